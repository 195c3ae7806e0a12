"""``calibrate()``: time one unit of each distinct shape of a model on this machine, as it runs here.

A profile of isolated kernels (:func:`placement_opt.profile`) misses what a unit does around its
matmuls: attention, norms, Python hooks, a slow path of CPU-executed experts, per-op overheads that
dominate small models. :func:`calibrate` measures the model itself:

1. the model is traced; its units are grouped by shape (:func:`~placement_opt.cost.calibrated.shape_key`);
2. a copy of the model cut to the fewest layers that hold one unit of every shape (a Hugging Face
   config with ``num_hidden_layers`` lowered) is built on each compute device, its initialisers skipped
   and its weights filled from one small random block (:func:`._calibrate_build.fill`: the values do not
   change a kernel's time, and drawing a 7B layer's weights took longer than timing it), and dispatched there
   with :func:`~.dispatcher.dispatch` (the project's hooks on every unit);
3. each unit is timed from its call to the next unit's call (the glue between units counted with the
   unit before it, so the units add up to the whole forward): prefills at prompts growing 4x from a
   short one (:data:`._calibrate_timing.PROBE_TOKENS`) up to the workload's prompt while the next one should
   take at most :data:`._calibrate_timing.PREFILL_BUDGET_S` (pricing extends the line beyond the last), and
   decode steps with a real KV cache near the first context (``prompt + 1``) and near the last
   (``prompt + new_tokens``), each context timed on its second visit (a GPU's first step at a new context
   length can set up kernels for it: :func:`._calibrate_timing._steps`);
4. the copy of each unit's weights is timed both ways they are streamed: with a GPU, the project's
   pinned prefetch on a side stream (``stream``) and accelerate's pageable per-tensor copies
   (``stream_sync``); with a disk, decode steps computed from cold memory-mapped files through
   ``dispatch`` (``stream``) and through accelerate's ``dispatch_model`` (``stream_sync``), less
   the resident step (an MoE unit's with the batch whose picks it read: pricing takes each expert's read
   from it);
5. the figures are saved in the profile of this machine, per shape key, with the host's name.

The cut copy is built by :mod:`._calibrate_build`; its forwards and copies are timed by :mod:`._calibrate_timing`.
How a forward is clocked (stamps, repeats, stalls) is :mod:`._calibrate_clock`'s; how cold reads are timed,
:mod:`._calibrate_disk`'s.

Pricing uses them whenever ``solve()`` / ``evaluate()`` plan for this machine's measured devices,
whatever form ``devices`` takes. A device the profile has not measured yet is profiled first
(``profile(quick=True)``), since only measured devices take calibrated times.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..cost.calibrated import UnitTimes, shape_key
from ..cost.workload import Workload
from ..errors import PlacementError, ProfileError, WorkloadError
from ..hardware.devices import Machine
from ..hardware.profile_store import (
    check_profile_target,
    measured_elsewhere,
    profile_path,
    save_calibration,
    saved_calibration,
    saved_device,
)
from ..hardware.resolve import device_names, is_auto
from ..model.expert_groups import expert_groups_refusal
from ..model.graph import LayerGraph
from ..progress import bar
from ._calibrate_build import build, cut_config
from ._calibrate_clock import routed_units, unit_modules
from ._calibrate_disk import time_disk_reads
from ._calibrate_timing import time_copies, time_forwards
from ._stamps import Stamps

__all__ = ["calibrate", "CalibrationResult"]


@dataclass(frozen=True)
class CalibrationResult:
    """What :func:`calibrate` measured and where it saved it."""

    path: Path
    """The profile file that now holds the figures."""
    took_s: float
    model_name: str
    devices: tuple[str, ...]
    units: Mapping[str, str]
    """The unit timed for each shape: unit name -> shape key."""
    times: Mapping[str, Mapping[str, UnitTimes]]
    """shape key -> device -> measured times."""
    copies: Mapping[str, Mapping[str, Mapping[str, Any]]]
    """shape key -> ``"cpu->cuda:N"`` / ``"disk->cpu"`` -> mode -> seconds, or ``{"prefill": s, "decode": s}``
    (an MoE unit's cold read from disk also ``"decode_batch"``: the batch whose picks the step read)."""
    layers_built: int
    """Decoder layers of the cut copy that was run (1 for a model whose layers are all alike; two more
    when disk reads are timed, so that a layer's read is timed beside the next ones' read-ahead)."""
    granularities: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    """``"block"`` / ``"sublayer"`` -> the units timed cut that way (unit name -> shape key). A unit whose
    shape the block pass timed is not timed again (``units`` keeps the first pass's key of a name)."""

    def summary(self) -> str:
        lines = [f"calibrated {self.model_name} on {', '.join(self.devices)} in {self.took_s:.1f} s "
                 f"({len(self.times)} unit shape(s), {self.layers_built} layer(s) built); saved to {self.path}"]
        many = len(self.granularities) > 1
        for cut, timed in (self.granularities or {"": self.units}).items():
            for name, key in timed.items():
                lines += self._unit_lines(f"{name} ({cut})" if many else name, key)
        return "\n".join(lines)

    def _unit_lines(self, name: str, key: str) -> list[str]:
        lines = []
        for device, times in self.times[key].items():
            prefill = max(times.prefill, key=lambda p: p[0] * p[1])
            decode = min(times.decode, key=lambda d: d[1])
            lines.append(f"  {name} on {device}: prefill {prefill[0]}x{prefill[1]} {prefill[2] * 1e3:.2f} ms, "
                         f"decode step (batch {decode[0]}, context {decode[1]}) {decode[2] * 1e3:.3f} ms")
        for link, modes in self.copies.get(key, {}).items():
            read = ", ".join(f"{mode} {_ms(seconds)}" for mode, seconds in modes.items())
            lines.append(f"  {name} weights {link}: {read}")
        return lines


def _ms(seconds: Any) -> str:
    if isinstance(seconds, Mapping):
        batch = f" (batch {seconds['decode_batch']})" if "decode_batch" in seconds else ""
        return f"prefill {seconds['prefill'] * 1e3:.2f} ms / decode {seconds['decode'] * 1e3:.2f} ms{batch}"
    return f"{seconds * 1e3:.2f} ms"


def _profile_of(devices: Any, path: str | os.PathLike[str] | None) -> str | os.PathLike[str] | None:
    """Where the calibration goes: ``path``, else the profile a :class:`Machine` was read from (``solve()`` prices
    that machine from that file), which must be this host's: another host's file keeps that host's times.

    Raises:
        ProfileError: ``devices`` was read from a profile another host measured, and no ``path`` is given.
    """
    if path is not None or not isinstance(devices, Machine) or devices.profile_path is None:
        return path
    if (host := measured_elsewhere(devices.profile_path)) is not None:
        raise ProfileError(f"the machine was read from the profile {devices.profile_path!r}, which host {host!r} "
                           f"measured: calibrate on that host, where its devices are; or pass path= to save this "
                           f"host's times in another profile (that file keeps {host!r}'s)")
    return devices.profile_path


def calibrate(model: Any, devices: Any = None, *, workload: Workload | None = None, dtype: str | None = None,
              granularity: str = "block", expert_groups: int = 1, path: str | os.PathLike[str] | None = None,
              offload_dir: str | os.PathLike[str] | None = None, repeats: int = 2,
              progress: bool | None = None) -> CalibrationResult:
    """Time one unit of each distinct shape of ``model`` on this machine's compute devices and save it.

    Example::

        placement_opt.calibrate("out/llama-8b", ["cpu"], workload=Workload(batch_size=1, prompt_len=512,
                                                                             new_tokens=32))
        plan = placement_opt.solve("out/llama-8b", {"cpu": "20GiB", "disk": "1TB"}, workload=...)
        # the plan's times now come from the model's own units

    Args:
        model: what :func:`placement_opt.solve` accepts except a ``LayerGraph`` (it has no modules
            to run): an ``nn.Module``, a transformers config, a preset name, a checkpoint directory.
        devices: what ``solve()`` accepts; its compute devices that are on this machine are timed
            (default: every visible GPU and the CPU).
        workload: the shapes to time (default ``Workload()``): prefill at ``batch x prompt``, decode
            steps at contexts ``prompt + 1`` and ``prompt + new_tokens``. Calibrating another workload adds
            its shapes to the ones saved (pricing interpolates between them); the same shape is replaced.
        dtype: the dtype to run in (default: the model's).
        granularity: the units timed, as :func:`placement_opt.solve` cuts them: ``"block"`` (default:
            decoder layers whole), ``"sublayer"`` (attention, MLP, router, experts: the parts a
            ``granularity="sublayer"`` plan places) or ``"auto"`` (both, one after the other on the same
            copy: what ``solve(granularity="auto")`` compares). Each is dispatched and timed as it runs.
        expert_groups: with ``"sublayer"`` or ``"auto"``, each MoE layer's experts cut into this many
            groups (``solve(..., expert_groups=)``), each group timed as the dispatcher runs it.
        path: the profile file (default: the one ``devices`` was read from, a :class:`Machine` that carries its
            ``profile_path``, as ``profile(path=...)`` returns; else ``$PLACEMENT_OPT_PROFILE`` or
            ``~/.cache/placement_opt/profile.json``), where ``solve()`` reads it for that machine.
        offload_dir: where disk reads are timed when ``devices`` has a disk (default the current
            directory; made if missing; scratch files are removed).
        repeats: timed prefill forwards per shape at least, after one warm-up (the median counts); one
            where the warm-up took over ``SLOW_FORWARD_S`` and the next call was not much faster.
        progress: a progress bar on stderr (see :func:`placement_opt.profile`).

    Returns:
        A :class:`CalibrationResult` (``summary()`` prints it).

    Raises:
        PlacementError: a ``LayerGraph``, a model without a transformers config, no compute device here,
            an unknown ``granularity``, ``expert_groups`` without sublayer units, an ``offload_dir`` that
            cannot be made or written.
        ProfileError: the profile file is unreadable, its calibration malformed, or ``path`` is a directory.
        PlanFormatError: a file at ``path`` is not a profile (checked first; never written over).
        WorkloadError: ``workload`` is not a :class:`Workload`.
    """
    from ..model.tracer import trace

    started = time.perf_counter()
    workload = workload if workload is not None else Workload()
    if not isinstance(workload, Workload):
        raise WorkloadError(f"workload is a {type(workload).__name__}: pass a placement_opt.Workload "
                            f"(Workload(batch_size=..., prompt_len=..., new_tokens=...))")
    path = _profile_of(devices, path)
    check_profile_target(path)  # before minutes of timing: a directory or a user's file there is refused
    saved_calibration(path)  # and a malformed calibration there, which the new one would be merged into
    if isinstance(model, LayerGraph):
        raise PlacementError("calibrate() runs the model's units, and a LayerGraph has no modules: pass the "
                             "model, its config, a preset name or a checkpoint directory")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise PlacementError(f"repeats must be an int >= 1, got {repeats!r}")
    if is_auto(devices):  # this machine, as solve() and --devices read the word
        devices = None
    cuts = _granularities(granularity, expert_groups)
    disk_folder = _disk_folder(devices, offload_dir)
    passes = _passes([trace(model, dtype=dtype, **how) for how in cuts], cuts)
    graph = passes[0].graph
    config = _config_of(model)
    names = _compute_devices(devices)
    _profile_missing([*names, *(["disk"] if disk_folder else [])], graph.meta.dtype, path, disk_folder)
    timed = [one.graph.unit(name).block or name for one in passes for name in one.representatives]
    cut = cut_config(config, timed, chain=disk_folder is not None)
    times: dict[str, dict[str, UnitTimes]] = {key: {} for one in passes for key in one.representatives.values()}
    copies: dict[str, dict[str, dict[str, Any]]] = {}
    with bar("Calibrating", len(names), progress=progress) as counted:
        for name in names:
            counted.describe(f"{name}: building {graph.meta.model_name} cut to {_layers(cut)} layer(s)")
            measured, linked = _calibrate_on(cut, passes, torch.device(name), workload, repeats,
                                             many_devices=len(names) > 1, disk_folder=disk_folder)
            for key, unit_times in measured.items():
                times[key][name] = unit_times
            for key, links in linked.items():
                copies.setdefault(key, {}).update(links)
            counted.advance(1)
    for one in passes:
        where = _save(one.graph, one.representatives, times, copies, workload, path)
    by_pass = {one.graph.meta.granularity: dict(one.representatives) for one in passes}
    units: dict[str, str] = {}
    for one in passes:  # a name both passes time (its traced facts differ between the cuts) keeps the first key
        for name, key in one.representatives.items():
            units.setdefault(name, key)
    return CalibrationResult(path=where, took_s=time.perf_counter() - started, model_name=graph.meta.model_name,
                             devices=tuple(names), units=units, times=times, copies=copies,
                             layers_built=_layers(cut), granularities=by_pass)


# ---------------------------------------------------------------------------------------------
# What to build
# ---------------------------------------------------------------------------------------------
def _config_of(model: Any) -> Any:
    from ..model._source import resolve_source

    config = getattr(model, "config", None) if isinstance(model, nn.Module) else resolve_source(model, None)[2]
    if config is None or not hasattr(config, "to_dict"):
        raise PlacementError(f"calibrate() builds a copy of the model from its transformers config, and "
                             f"{type(model).__name__} has none: pass a transformers model, config, preset or "
                             f"checkpoint directory")
    return config


def _compute_devices(devices: Any) -> list[str]:
    from ..hardware.detect import local_device_names

    listed = device_names(local_device_names() if devices is None else devices)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = [n for n in listed if n == "cpu" or (n.startswith("cuda:") and int(n.split(":")[1]) < visible)]
    if not local:
        raise PlacementError(f"calibrate() times units on this machine's compute devices, and {listed} has none "
                             f"here ({visible} GPU(s) visible): add 'cpu' or a visible GPU")
    return list(dict.fromkeys(local))


def _profile_missing(names: Iterable[str], dtype: str, path: str | os.PathLike[str] | None,
                     disk_folder: Path | None) -> None:
    """Profile (quick) the devices the saved profile lacks: calibrated times apply to measured devices only."""
    from ..hardware.profiler import profile

    missing = [n for n in names if saved_device(n, dtype=dtype, path=path) is None]
    if missing:
        profile(missing, path=path, quick=True, dtype=dtype if dtype in ("float32", "bfloat16", "float16")
                else "float32", offload_folder=disk_folder, progress=False)


def _disk_folder(devices: Any, offload_dir: str | os.PathLike[str] | None) -> Path | None:
    """Where cold disk reads are timed: ``offload_dir`` (default the current directory), made if missing, as
    ``dispatch`` makes it, when the machine has a disk; None without one. Checked before anything is traced."""
    from ..hardware.detect import local_device_names

    listed = device_names(local_device_names() if devices is None else devices)
    if "disk" not in listed:
        return None
    folder = Path(offload_dir or ".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file of that name, or no right to write there
        raise PlacementError(f"offload_dir {str(folder)!r} cannot hold calibration's scratch files ({exc.strerror}): "
                             f"pass a directory you can write to (it is made if missing)") from None
    return folder


#: ``granularity`` -> the trace arguments of each pass, in the order they are timed.
GRANULARITIES: dict[str, tuple[str, ...]] = {"block": ("block",), "sublayer": ("sublayer",),
                                             "auto": ("block", "sublayer")}


@dataclass(frozen=True)
class _Pass:
    """One way of cutting the model, timed as one dispatch of the copy."""

    graph: LayerGraph
    """The whole model's graph, cut this way."""
    representatives: Mapping[str, str]
    """The units this pass times: the first of each shape no earlier pass timed (name -> shape key)."""
    trace_args: Mapping[str, Any]
    """How the copy is traced for its plan (``granularity``, ``expert_groups``)."""


def _granularities(granularity: Any, expert_groups: Any) -> list[dict[str, Any]]:
    """The trace arguments of each pass, or a PlacementError for arguments solve() would refuse too."""
    if granularity not in GRANULARITIES:
        raise PlacementError(f"granularity={granularity!r}: accepted are {', '.join(map(repr, GRANULARITIES))} "
                             f"(the units solve() will place)")
    refusal = expert_groups_refusal(expert_groups, granularity, ("sublayer", "auto"))
    if refusal:
        raise PlacementError(refusal)
    return [{"granularity": cut, **({"expert_groups": expert_groups} if cut == "sublayer" else {})}
            for cut in GRANULARITIES[granularity]]


def _passes(graphs: Iterable[LayerGraph], cuts: Iterable[Mapping[str, Any]]) -> list[_Pass]:
    """Each graph's units of a shape not timed by an earlier pass (the embedding, final norm and head of a
    block and a sublayer graph are the same units: timed once)."""
    seen: set[str] = set()
    passes = []
    for graph, how in zip(graphs, cuts, strict=True):
        found = _representatives(graph, seen)
        seen.update(found.values())
        passes.append(_Pass(graph, found, how))
    return [one for one in passes if one.representatives] or passes[:1]


def _representatives(graph: LayerGraph, seen: Iterable[str] = ()) -> dict[str, str]:
    """The first unit of each shape not in ``seen``: unit name -> shape key, in execution order."""
    found: dict[str, str] = {}
    known = set(seen)
    for unit in graph.units():
        key = shape_key(unit, graph.meta.dtype, graph.meta.seq_len)
        if key not in known:
            found[unit.name] = key
            known.add(key)
    return found


def _layers(config: Any) -> int:
    return int(getattr(config, "num_hidden_layers", 0) or 0)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def _calibrate_on(config: Any, passes: Iterable[_Pass], device: torch.device, workload: Workload, repeats: int,
                  many_devices: bool, disk_folder: Path | None
                  ) -> tuple[dict[str, UnitTimes], dict[str, dict[str, dict[str, Any]]]]:
    """Every pass's units timed on ``device``, on one copy of the model built once."""
    passes = list(passes)
    model = build(config, passes[0].graph.meta.dtype, device)
    times: dict[str, UnitTimes] = {}
    copies: dict[str, dict[str, dict[str, Any]]] = {}
    for one in passes:
        measured, linked = _time_pass(model, one, device, workload, repeats, many_devices, disk_folder)
        times.update(measured)
        for key, links in linked.items():
            copies.setdefault(key, {}).update(links)
    del model
    return times, copies


def _time_pass(model: nn.Module, one: _Pass, device: torch.device, workload: Workload, repeats: int,
               many_devices: bool, disk_folder: Path | None
               ) -> tuple[dict[str, UnitTimes], dict[str, dict[str, dict[str, Any]]]]:
    """The pass's units timed: the copy dispatched whole on ``device``, cut as the pass cuts it (its
    experts split into groups for the time of the pass), then put back."""
    from ..model.tracer import trace
    from ._device_map import plan_from_device_map
    from .dispatcher import dispatch

    graph, representatives = one.graph, one.representatives
    copy_graph = trace(model, **one.trace_args)  # the copy's own units (fewer layers): what its plan places
    plan = plan_from_device_map(model, {"": str(device)}, graph=copy_graph)
    handle = dispatch(model, plan, _hook_every_unit=many_devices)
    try:
        modules = unit_modules(model, graph)  # every unit marked: glue goes to the unit before it
        stamps = Stamps(modules, device, routed=routed_units(graph, modules))
        try:
            with torch.inference_mode():
                prefill, decode = time_forwards(model, stamps, workload, repeats, device)
        finally:
            stamps.close()
        timed = {name: modules[name] for name in representatives}
        copies = time_copies(timed, representatives, device) if device.type == "cuda" else {}
    finally:
        handle.remove()
    if device.type == "cpu" and disk_folder is not None and decode:
        longest = max(prefill, key=lambda k: k[1])  # the cold prefill runs at it: the workload's prompt may be slow
        resident = {"prefill": prefill[longest], "decode": decode[min(decode, key=lambda k: k[1])]}
        cold_workload = dataclasses.replace(workload, prompt_len=longest[1])
        for key, links in time_disk_reads(model, graph, copy_graph, representatives, cold_workload, resident,
                                           disk_folder).items():
            copies.setdefault(key, {}).update(links)
    kept = workload.logits_kept
    out = {}
    for name, key in representatives.items():
        if not any(name in run for run in (*prefill.values(), *decode.values())):
            continue  # never called through its forward (JetMoE's attention experts: map() and reduce()): not timed
        unit = graph.unit(name)
        alike = _alike(graph, key, modules) if unit.is_moe else [name]
        out[key] = UnitTimes(prefill=tuple((b, p, run[name], kept) for (b, p), run in prefill.items() if name in run),
                             decode=tuple((b, c, statistics.fmean(run[n] for n in alike if n in run))
                                          for (b, c), run in decode.items() if name in run),
                             attention=unit.attn_flops_per_token_per_ctx > 0 or unit.kv_bytes_per_token > 0)
    return out, copies


def _alike(graph: LayerGraph, key: str, timed: Iterable[str]) -> list[str]:
    """The timed units of shape ``key``: a routed unit's decode figure is their mean, as the router sends more of
    a step's tokens to some experts than to others (a group of experts may idle in most steps, its neighbour run in
    most), and a plan pays their average over the layers."""
    return [n for n in timed if shape_key(graph.unit(n), graph.meta.dtype, graph.meta.seq_len) == key]


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------
def _save(graph: LayerGraph, representatives: Mapping[str, str], times: Mapping[str, Mapping[str, UnitTimes]],
          copies: Mapping[str, Mapping[str, Mapping[str, float]]], workload: Workload,
          path: str | os.PathLike[str] | None) -> Path:
    from ..plan_check import graph_fingerprint

    fingerprint = hashlib.sha1(json.dumps(graph_fingerprint(graph), sort_keys=True).encode()).hexdigest()[:16]
    units = {}
    for name, key in representatives.items():
        unit = graph.unit(name)
        units[key] = {"module_class": unit.module_class, "unit": name,
                      "attention": any(t.attention for t in times[key].values()),
                      "devices": {d: {"prefill": [list(p) for p in t.prefill], "decode": [list(p) for p in t.decode]}
                                  for d, t in times[key].items()},
                      "links": {link: dict(modes) for link, modes in copies.get(key, {}).items()}}
    model = {"fingerprint": fingerprint, "name": graph.meta.model_name, "dtype": graph.meta.dtype,
             "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
             "workload": workload.to_dict(), "units": dict(representatives)}
    try:
        return save_calibration(units, model, path=path)
    except OSError as exc:
        raise ProfileError(f"cannot write the calibration to {str(profile_path(path))!r} ({exc}): pass "
                           f"path= a writable file, or set $PLACEMENT_OPT_PROFILE") from None
