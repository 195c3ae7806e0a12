"""``calibrate()``: time one unit of each distinct shape of a model on this machine, as it runs here.

A profile of isolated kernels (:func:`placement_opt.profile`) misses what a unit does around its
matmuls: attention, norms, Python hooks, a slow path of CPU-executed experts, per-op overheads that
dominate small models. :func:`calibrate` measures the model itself:

1. the model is traced; its units are grouped by shape (:func:`~placement_opt.cost.calibrated.shape_key`);
2. a copy of the model cut to the fewest layers that hold one unit of every shape (a Hugging Face
   config with ``num_hidden_layers`` lowered) is built on each compute device, its initialisers skipped
   and its weights filled from one small random block (:func:`_fill`: the values do not change a
   kernel's time, and drawing a 7B layer's weights took longer than timing it), and dispatched there
   with :func:`~.dispatcher.dispatch` (the project's hooks on every unit);
3. each unit is timed from its call to the next unit's call (the glue between units counted with the
   unit before it, so the units add up to the whole forward): prefills at prompts growing 4x from a
   short one (:data:`PROBE_TOKENS`) up to the workload's prompt while the next one should take at most
   :data:`PREFILL_BUDGET_S` (pricing extends the line beyond the last), and decode steps with a
   real KV cache near the first context (``prompt + 1``) and near the last (``prompt + new_tokens``);
4. the copy of each unit's weights is timed both ways they are streamed: with a GPU, the project's
   pinned prefetch on a side stream (``stream``) and accelerate's pageable per-tensor copies
   (``stream_sync``); with a disk, decode steps computed from cold memory-mapped files through
   ``dispatch`` (``stream``) and through accelerate's ``dispatch_model`` (``stream_sync``), less
   the resident step;
5. the figures are saved in the profile of this machine, per shape key, with the host's name.

Pricing uses them whenever ``solve()`` / ``evaluate()`` plan for this machine's measured devices,
whatever form ``devices`` takes. A device the profile has not measured yet is profiled first
(``profile(quick=True)``), since only measured devices take calibrated times.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import hashlib
import json
import os
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..cost.calibrated import UnitTimes, shape_key
from ..cost.workload import Workload
from ..errors import PlacementError, ProfileError
from ..hardware.profile_store import profile_path, save_calibration, saved_device
from ..hardware.resolve import device_names
from ..model.expert_groups import expert_groups_refusal, group_counts
from ..model.graph import LayerGraph
from ..plan import Plan
from ..progress import bar
from ._safetensors_file import drop_page_cache
from .timing import cache_argument, cache_of, last_logits_argument

__all__ = ["calibrate", "CalibrationResult"]

#: Decode steps timed at each context at least (the median counts, per unit) ...
DECODE_STEPS = 8
#: ... unless they add up to :data:`DECODE_BUDGET_S` first (a large model's steps vary little beside their
#: length), and then at least this many ...
MIN_DECODE_STEPS = 3
DECODE_BUDGET_S = 0.5
#: ... and at most, while they add up to under half :data:`MIN_TIMED_S`.
MAX_DECODE_STEPS = 32
#: Timed forwards of one shape go on until they add up to this (the median counts, per unit).
MIN_TIMED_S = 0.5
#: At most this many timed forwards of one shape.
MAX_RUNS = 20
#: The next, 4x longer prefill is timed when it should take at most this (estimated from the last one).
PREFILL_BUDGET_S = 2.0
#: The shortest prefill timed: the workload's prompt divided by 4 until one more division would go below this.
PROBE_TOKENS = 8
#: A warm-up faster than this is followed by two more (first calls of small shapes run slow).
FAST_FORWARD_S = 0.2
#: A warm-up slower than this is followed by one timed call only, the figure alone: a 7B layer's 32-token
#: prefill takes ~1 s on 2 cores, and repeating it would cost seconds per prompt length ...
SLOW_FORWARD_S = 0.5
#: ... unless that call ran this many times faster than the warm-up: then the warm-up was a first-call stall,
#: not a slow forward, and the call is the warm-up in its place (see :func:`_repeated`).
STALL_RATIO = 2.0
#: Prefill prompts grow by this factor from one timed length to the next.
SMALL_PROMPT_FRACTION = 4
#: Elements of the random block every weight is filled from (:func:`_fill`): 4 MiB in float32.
FILL_BLOCK_ELEMENTS = 2**20 + 7


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
    """shape key -> ``"cpu->cuda:N"`` / ``"disk->cpu"`` -> mode -> seconds, or ``{"prefill": s, "decode": s}``."""
    layers_built: int
    """Decoder layers of the cut copy that was run (1 for a model whose layers are all alike; one more
    when disk reads are timed, so that a layer's read is timed beside the next one's read-ahead)."""
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
        return " / ".join(f"{phase} {value * 1e3:.2f} ms" for phase, value in seconds.items())
    return f"{seconds * 1e3:.2f} ms"


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
            steps at contexts ``prompt + 1`` and ``prompt + new_tokens``.
        dtype: the dtype to run in (default: the model's).
        granularity: the units timed, as :func:`placement_opt.solve` cuts them: ``"block"`` (default:
            decoder layers whole), ``"sublayer"`` (attention, MLP, router, experts: the parts a
            ``granularity="sublayer"`` plan places) or ``"auto"`` (both, one after the other on the same
            copy: what ``solve(granularity="auto")`` compares). Each is dispatched and timed as it runs.
        expert_groups: with ``"sublayer"`` or ``"auto"``, each MoE layer's experts cut into this many
            groups (``solve(..., expert_groups=)``), each group timed as the dispatcher runs it.
        path: the profile file (default ``$PLACEMENT_OPT_PROFILE`` or ``~/.cache/placement_opt/profile.json``).
        offload_dir: where disk reads are timed when ``devices`` has a disk (default the current
            directory; scratch files are removed).
        repeats: timed prefill forwards per shape at least, after one warm-up (the median counts); one
            where the warm-up took over ``SLOW_FORWARD_S`` and the next call was not much faster.
        progress: a progress bar on stderr (see :func:`placement_opt.profile`).

    Returns:
        A :class:`CalibrationResult` (``summary()`` prints it).

    Raises:
        PlacementError: a ``LayerGraph``, a model without a transformers config, no compute device here,
            an unknown ``granularity``, ``expert_groups`` without sublayer units.
        ProfileError: the profile file is unreadable.
    """
    from ..model.tracer import trace

    started = time.perf_counter()
    workload = workload if workload is not None else Workload()
    if isinstance(model, LayerGraph):
        raise PlacementError("calibrate() runs the model's units, and a LayerGraph has no modules: pass the "
                             "model, its config, a preset name or a checkpoint directory")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise PlacementError(f"repeats must be an int >= 1, got {repeats!r}")
    cuts = _granularities(granularity, expert_groups)
    passes = _passes([trace(model, dtype=dtype, **how) for how in cuts], cuts)
    graph = passes[0].graph
    config = _config_of(model)
    names = _compute_devices(devices)
    disk_folder = _disk_folder(devices, offload_dir)
    _profile_missing([*names, *(["disk"] if disk_folder else [])], graph.meta.dtype, path, disk_folder)
    timed = [one.graph.unit(name).block or name for one in passes for name in one.representatives]
    cut = _cut_config(config, timed, chain=disk_folder is not None)
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
    """Where cold disk reads are timed: ``offload_dir`` (default the current directory) when the
    machine has a disk; None without one."""
    from ..hardware.detect import local_device_names

    listed = device_names(local_device_names() if devices is None else devices)
    return Path(offload_dir or ".") if "disk" in listed else None


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


_LAYER_INDEX = re.compile(r"\.(\d+)$")


def _cut_config(config: Any, timed: Iterable[str], *, chain: bool = False) -> Any:
    """The config with the fewest layers that still hold every unit ``timed`` (a block unit, or the block
    a sublayer unit lies in; layer i kept: i + 1), and with ``chain`` one more where the model has it.

    ``chain`` is for timing disk reads: a plan's disk units read side by side, each one's pages faulted
    in while the next one's are read ahead, and a unit read with nothing after it reads faster. One
    layer alone read its cold weights in 20.8 ms per decode step (Mixtral-shaped, hidden 512) and
    83 ms (Llama, hidden 2048), where the layers of an all-disk plan took 25-31 ms and 100-105 ms;
    a copy of two layers read them in 25.0 ms and 93.6 ms (:func:`_shapes` takes the mean of both)."""
    indices = [int(m.group(1)) for name in timed if (m := _LAYER_INDEX.search(name))]
    cut = copy.deepcopy(config)
    layers = getattr(cut, "num_hidden_layers", None)
    if not isinstance(layers, int) or not indices:
        return cut
    keep = min(layers, max(indices) + 1 + int(chain))
    cut.num_hidden_layers = keep
    if isinstance(getattr(cut, "layer_types", None), list):  # per-layer attention kinds (sliding windows)
        cut.layer_types = cut.layer_types[:keep]
    return cut


def _layers(config: Any) -> int:
    return int(getattr(config, "num_hidden_layers", 0) or 0)


def _build(config: Any, dtype: str, device: torch.device) -> nn.Module:
    """The model of ``config`` on ``device`` with random weights, built without running its initialisers."""
    import transformers

    auto = (transformers.AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False)
            else transformers.AutoModelForCausalLM)
    with torch.device(device), _no_init():
        try:
            model = auto.from_config(config, dtype=getattr(torch, dtype))
        except ValueError:
            model = transformers.AutoModel.from_config(config, dtype=getattr(torch, dtype))
    _fill(model)
    return model.eval()


def _no_init() -> Any:
    """transformers' context that skips torch's and its own weight initialisers (a 7B layer's draws took
    ~5 s of a 16 s calibration on 2 cores); a no-op where this transformers has none."""
    import contextlib

    for where in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            module = __import__(where, fromlist=["no_init_weights"])
        except ImportError:  # pragma: no cover - depends on the transformers version
            continue
        if hasattr(module, "no_init_weights"):
            return module.no_init_weights()
    return contextlib.nullcontext()  # pragma: no cover - an old transformers: initialisers run, only slower


def _fill(model: nn.Module) -> None:
    """Every floating weight tiled from one seeded random block (N(0, 0.02), as transformers initialises):
    a copy runs at memory speed where drawing runs at a few hundred MB/s. The values matter only for
    being finite and not denormal, as a kernel's time depends on nothing else."""
    block = torch.randn(FILL_BLOCK_ELEMENTS, generator=torch.Generator().manual_seed(0)) * 0.02
    converted: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    with torch.no_grad():
        for tensor in model.parameters():
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            if not tensor.is_contiguous():  # pragma: no cover - no transformers weight is strided
                tensor.normal_(0.0, 0.02)
                continue
            source = converted.setdefault((tensor.device, tensor.dtype), block.to(tensor.device, tensor.dtype))
            flat = tensor.view(-1)
            for start in range(0, flat.numel(), source.numel()):
                piece = flat[start:start + source.numel()]
                piece.copy_(source[:piece.numel()])


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
class _Stamps:
    """Per-unit seconds of one forward: from a unit's call to the next unit's call (or the end)."""

    def __init__(self, modules: Mapping[str, nn.Module], device: torch.device) -> None:
        self.device = device
        self.marks: list[tuple[str, Any]] = []
        self.handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in modules.items()]

    def _now(self) -> Any:
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _hook(self, name: str) -> Callable[..., None]:
        def mark(_module: nn.Module, _args: Any) -> None:
            self.marks.append((name, self._now()))
        return mark

    def run(self, call: Callable[[], Any]) -> tuple[dict[str, float], Any]:
        self.marks = []
        begin = self._now()
        out = call()
        end = self._now()
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)
        seconds: dict[str, float] = {}
        stamps = [begin, *(t for _, t in self.marks[1:]), end]
        for (name, _), start, stop in zip(self.marks, stamps, stamps[1:], strict=False):
            seconds[name] = seconds.get(name, 0.0) + self._elapsed(start, stop)
        return seconds, out

    def _elapsed(self, start: Any, stop: Any) -> float:
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            return start.elapsed_time(stop) / 1e3
        return stop - start

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _typical(runs: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The median seconds of each unit over the runs: on a machine other jobs share, the fastest run
    is luck and the slowest a busy moment, while a plan runs through the usual ones."""
    by_unit: dict[str, list[float]] = {}
    for run in runs:
        for name, seconds in run.items():
            by_unit.setdefault(name, []).append(seconds)
    return {name: statistics.median(values) for name, values in by_unit.items()}


def _calibrate_on(config: Any, passes: Iterable[_Pass], device: torch.device, workload: Workload, repeats: int,
                  many_devices: bool, disk_folder: Path | None
                  ) -> tuple[dict[str, UnitTimes], dict[str, dict[str, dict[str, Any]]]]:
    """Every pass's units timed on ``device``, on one copy of the model built once."""
    passes = list(passes)
    model = _build(config, passes[0].graph.meta.dtype, device)
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
        modules = _unit_modules(model, graph)  # every unit marked: glue goes to the unit before it
        stamps = _Stamps(modules, device)
        try:
            with torch.inference_mode():
                prefill, decode = _time_forwards(model, stamps, workload, repeats, device)
        finally:
            stamps.close()
        timed = {name: modules[name] for name in representatives}
        copies = _time_copies(timed, representatives, device) if device.type == "cuda" else {}
    finally:
        handle.remove()
    if device.type == "cpu" and disk_folder is not None and decode:
        longest = max(prefill, key=lambda k: k[1])  # the cold prefill runs at it: the workload's prompt may be slow
        resident = {"prefill": prefill[longest], "decode": decode[min(decode, key=lambda k: k[1])]}
        cold_workload = dataclasses.replace(workload, prompt_len=longest[1])
        for key, links in _time_disk_reads(model, graph, copy_graph, representatives, cold_workload, resident,
                                           disk_folder).items():
            copies.setdefault(key, {}).update(links)
    kept = workload.logits_kept
    out = {}
    for name, key in representatives.items():
        unit = graph.unit(name)
        out[key] = UnitTimes(prefill=tuple((b, p, run[name], kept) for (b, p), run in prefill.items() if name in run),
                             decode=tuple((b, c, run[name]) for (b, c), run in decode.items() if name in run),
                             attention=unit.attn_flops_per_token_per_ctx > 0 or unit.kv_bytes_per_token > 0)
    return out, copies


def _unit_modules(model: nn.Module, graph: LayerGraph) -> dict[str, nn.Module]:
    """The modules of ``graph``'s units that the cut copy has (the layers beyond the cut are gone)."""
    present = dict(model.named_modules())
    return {name: present[name] for name in graph.names() if name in present}


def _time_forwards(model: nn.Module, stamps: _Stamps, workload: Workload, repeats: int, device: torch.device
                   ) -> tuple[dict[tuple[int, int], dict[str, float]], dict[tuple[int, int], dict[str, float]]]:
    """Per-unit seconds of prefills ``(batch, prompt)`` and of decode steps ``(batch, context)``.

    Prompts grow 4x from :func:`_first_length` to the workload's while the next one should take at
    most :data:`PREFILL_BUDGET_S` (estimated from the last, in proportion); when only one fits, a 4x
    shorter one is timed too, so that pricing has a line to extend (a prefill is linear in tokens but
    for attention's small quadratic part). The decode steps run on the longest prompt's KV cache
    grown to the workload's prompt.
    """
    batch, prompt = workload.batch_size, workload.prompt_len
    vocab = int(getattr(model.config, "vocab_size", 32000) or 32000)
    keep = _logits_argument(model, workload.logits_kept)
    prefill: dict[tuple[int, int], dict[str, float]] = {}

    def timed(length: int) -> Any:
        ids = torch.randint(0, vocab, (batch, length), device=device)
        runs, out = _repeated(lambda: model(input_ids=ids, use_cache=True, **keep), stamps, repeats)
        prefill[batch, length] = _typical(runs)
        return cache_of(out)

    length = _first_length(prompt)
    cache = timed(length)
    while length < prompt:
        longer = min(prompt, length * SMALL_PROMPT_FRACTION)
        if sum(prefill[batch, length].values()) * longer / length > PREFILL_BUDGET_S:
            if len(prefill) == 1 and length > 1:
                timed(max(1, length // SMALL_PROMPT_FRACTION))
            break
        cache, length = timed(longer), longer
    if _cached_length(cache) < prompt and not _grown(cache, prompt):  # untimed: a cache of the prompt's length
        ids = torch.randint(0, vocab, (batch, prompt), device=device)
        cache = cache_of(model(input_ids=ids, use_cache=True, **_logits_argument(model, "last")))
    return prefill, _time_decode(model, stamps, cache, workload, vocab, device)


def _first_length(prompt: int) -> int:
    """The shortest prefill timed: the prompt divided by 4, and again while that stays >= :data:`PROBE_TOKENS`."""
    length = max(1, prompt // SMALL_PROMPT_FRACTION)
    while length // SMALL_PROMPT_FRACTION >= PROBE_TOKENS:
        length //= SMALL_PROMPT_FRACTION
    return length


def _cached_length(cache: Any) -> int:
    length = getattr(cache, "get_seq_length", None)
    return int(length()) if callable(length) else 0


def _grown(cache: Any, length: int) -> bool:
    """Grow a plain dynamic KV cache to ``length`` tokens by repeating what it holds (the values do
    not change a step's time); False for other cache kinds (sliding windows, quantized, ...)."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" or not getattr(layer, "is_initialized", False)
                         or getattr(layer, "keys", None) is None or layer.keys.numel() == 0 for layer in layers):
        return False
    for layer in layers:
        have = layer.keys.shape[-2]
        if have < length:
            copies = -(-length // have)
            layer.keys = torch.cat([layer.keys] * copies, dim=-2)[:, :, :length]
            layer.values = torch.cat([layer.values] * copies, dim=-2)[:, :, :length]
    return True


def _repeated(call: Callable[[], Any], stamps: _Stamps, repeats: int) -> tuple[list[dict[str, float]], Any]:
    """One warm-up, then timed calls: at least ``repeats``, more while they add up to under
    :data:`MIN_TIMED_S` (fast forwards vary most: first calls of a shape, a busy moment).

    A warm-up over :data:`SLOW_FORWARD_S` is followed by one timed call, the figure alone (a slow forward
    is not repeated: two calls in all), unless that call ran :data:`STALL_RATIO` times faster: then the
    warm-up was a first-call stall and the call is the warm-up in its place, the rule applied again from
    it. The warm-up is never the figure.

    Returns the per-unit seconds of every timed call and the last call's output.
    """
    runs: list[dict[str, float]] = []
    took, (seconds, out) = _clocked(call, stamps)
    # A slow first call is not taken for the forward's time: it may be a stall (allocator pages, lazy
    # init, kernel selection, a busy moment on a shared machine). Taking the warm-up alone as the figure
    # recorded a tiny random Mixtral's model.layers.0 prefill (4 experts, 4 layers, 16-token prompt, a
    # whole forward ~2 ms) at 231-239 ms in three calibrations and 0.37-0.41 ms in four: the first
    # forwards of a fresh process took 180-860 ms on a shared 2-core machine. A slow forward costs one
    # more call (a 3 s forward is timed at 3 s in 6 s, not repeated further); a stall, a few more while
    # each call runs much faster than the one before it (halving each time: bounded).
    while took > SLOW_FORWARD_S:
        out = None  # the previous output (a KV cache) is freed before the next call
        again, (seconds, out) = _clocked(call, stamps)
        if again * STALL_RATIO > took:
            return [seconds], out  # not much faster: a slow forward, and this call is its figure
        took = again  # much faster: the call before was a stall, and this one is the warm-up
    if took < FAST_FORWARD_S:  # the first calls of a small shape are slow for a while (allocator, kernels)
        for _ in range(2):
            stamps.run(call)
    spent, out = 0.0, None
    while len(runs) < repeats or (spent < MIN_TIMED_S and len(runs) < MAX_RUNS):
        start = time.perf_counter()
        out = None  # the previous output (a KV cache) is freed before the next call
        seconds, out = stamps.run(call)
        runs.append(seconds)
        spent += time.perf_counter() - start
    return runs, out


def _clocked(call: Callable[[], Any], stamps: _Stamps) -> tuple[float, tuple[dict[str, float], Any]]:
    """The wall-clock seconds of one stamped call, and what :meth:`_Stamps.run` returned."""
    start = time.perf_counter()
    ran = stamps.run(call)
    return time.perf_counter() - start, ran


def _time_decode(model: nn.Module, stamps: _Stamps, cache: Any, workload: Workload, vocab: int,
                 device: torch.device) -> dict[tuple[int, int], dict[str, float]]:
    """Decode steps at the first context and, after the cache is filled up, at the last."""
    batch, prompt = workload.batch_size, workload.prompt_len
    decode: dict[tuple[int, int], dict[str, float]] = {}
    if workload.new_tokens == 0 or cache is None:
        return decode
    most = min(MAX_DECODE_STEPS, workload.new_tokens)
    seconds, steps = _steps(model, stamps, cache, batch, most, vocab, device)
    decode[batch, prompt + 1 + (steps - 1) // 2] = seconds  # the middle context of the steps timed
    last = prompt + workload.new_tokens
    if last - (prompt + steps + 1) > most:  # fill the cache up to the last context in one forward, untimed
        filled = prompt + steps + 1
        if not _grown(cache, last - most):
            ids = torch.randint(0, vocab, (batch, last - filled - most), device=device)
            cache = cache_of(model(input_ids=ids, use_cache=True, **cache_argument(model, cache),
                                   **_logits_argument(model, "last")))
        seconds, steps = _steps(model, stamps, cache, batch, most, vocab, device)
        decode[batch, last - most + (steps - 1) // 2] = seconds
    return decode


def _steps(model: nn.Module, stamps: _Stamps, cache: Any, batch: int, most: int, vocab: int,
           device: torch.device) -> tuple[dict[str, float], int]:
    """The typical per-unit seconds of decode steps and how many were timed (at least
    :data:`DECODE_STEPS`, or :data:`MIN_DECODE_STEPS` once they add up to :data:`DECODE_BUDGET_S`; more
    while they add up to under half :data:`MIN_TIMED_S`, at most ``most``)."""
    runs: list[dict[str, float]] = []
    spent = 0.0
    step = 0
    while (step <= min(DECODE_STEPS, most) and not (spent >= DECODE_BUDGET_S and len(runs) >= MIN_DECODE_STEPS)
           or (spent < MIN_TIMED_S / 2 and step <= most)):
        ids = torch.randint(0, vocab, (batch, 1), device=device)
        start = time.perf_counter()
        seconds, out = stamps.run(lambda ids=ids, cache=cache: model(input_ids=ids, use_cache=True,
                                                                     **cache_argument(model, cache)))
        if step > 0:  # the first step warms up the decode shapes, untimed
            runs.append(seconds)
            spent += time.perf_counter() - start
        cache = cache_of(out)
        step += 1
    return _typical(runs), len(runs)


def _time_disk_reads(model: nn.Module, graph: LayerGraph, copy_graph: LayerGraph, representatives: Mapping[str, str],
                     workload: Workload, resident: Mapping[str, Mapping[str, float]], folder: Path
                     ) -> dict[str, dict[str, Any]]:
    """Seconds a CPU-executed unit adds per forward when its weights come from a cold disk, both ways
    they are read, at prefill and at a decode step.

    ``stream``: placement_opt's dispatch computes from the memory-mapped file (pages fault in as the
    kernels touch them, the next unit read ahead), the units of one shape on disk at a time
    (:func:`_disk_chains`); ``stream_sync``: accelerate's hooks copy each tensor
    out of its ``np.memmap``. Each is a forward with files evicted from the page cache first, less the
    same forward resident (``resident``: phase -> unit -> seconds); ``copy_graph``: the copy's graph, cut as
    ``graph`` is. accelerate's path is not timed for expert groups (accelerate has no such modules). A
    prefill hides more of the read-ahead behind compute than a decode step does, so the two phases are kept apart, the prefill's
    read capped at the decode's where both read every weight (:func:`_reads_every_weight`). The prefill is
    ``workload``'s prompt (the caller passes the longest prompt it timed, which a large model keeps short).
    """
    import tempfile

    reads: dict[str, dict[str, Any]] = {}
    shapes = _shapes(graph)
    runners = [("stream", _run_mapped)]
    if not group_counts(copy_graph.names()):
        runners.append(("stream_sync", _run_accelerate))
    with tempfile.TemporaryDirectory(prefix="placement_opt_calibrate_", dir=folder) as scratch:
        for mode, runner in runners:
            cold = runner(model, graph, copy_graph, workload, Path(scratch) / mode)
            if cold is None:
                continue
            for name, key in representatives.items():
                if graph.unit(name).weight_bytes == 0:
                    continue
                alike = [n for n in shapes.get(key, ()) if n in cold["decode"]] or [name]
                extra = {phase: statistics.fmean(max(0.0, cold[phase].get(n, 0.0) - resident[phase].get(n, 0.0))
                                                 for n in alike) for phase in ("prefill", "decode")}
                if mode == "stream" and _reads_every_weight(graph.unit(name)):
                    extra["prefill"] = min(extra["prefill"], extra["decode"])
                reads.setdefault(key, {}).setdefault("disk->cpu", {})[mode] = extra
    return reads


def _shapes(graph: LayerGraph) -> dict[str, list[str]]:
    """Shape key -> the units of that shape. A shape's cold read is the mean over those the copy has.

    The read-ahead chain asks for the next unit's pages as one is called, so consecutive units of one
    shape read side by side, and the first waits for its own pages while the next one's compete with
    them: in a cold decode step of a Mixtral-shaped layer (`benchmarks/cost_accuracy`'s, 2 expert groups),
    the first group took 20.4 ms and the second 7.5 ms (0.9 ms each resident). Each group was charged the
    first's read, and the benchmark's plan with the second group of every layer on disk was priced slower
    than all of each layer's experts on disk, where it ran 1.5x faster."""
    found: dict[str, list[str]] = {}
    for unit in graph.units():
        found.setdefault(shape_key(unit, graph.meta.dtype, graph.meta.seq_len), []).append(unit.name)
    return found


def _reads_every_weight(unit: Any) -> bool:
    """Whether a forward reads all of the unit's weights whatever its tokens (not a lookup table, not experts).

    Such a unit's prefill reads the bytes a decode step reads, with more compute before it to hide the
    read-ahead behind, so its added prefill time is at most the decode step's; and the decode's figure is
    the median of up to :data:`MAX_DISK_STEPS` cold steps where a large model gets one cold prefill
    (hidden 2048: 124 ms in one prefill against 71 ms, the median of 16 steps, and about 76 ms per layer
    measured in cost_accuracy's all-disk prefill)."""
    return unit.flops_per_token > 0 and not unit.is_moe


#: Cold decode steps timed per disk path at least (the median counts, per unit) ...
DISK_STEPS = 3
#: ... and more while they add up to under this, at most :data:`MAX_DISK_STEPS`: a small unit's cold read
#: varies by 1.7x between medians of 3 steps on a loaded 2-core machine, and by 1.2x between medians of 12
#: (hidden 512, 6 calibrations each); a large model's 3 steps already take longer than this. The cold
#: prefills share the rule: one, then more while they add up to under it, at most :data:`MAX_DISK_PREFILLS`.
DISK_BUDGET_S = 2.0
MAX_DISK_STEPS = 16
#: A single cold prefill of a hidden-2048 layer read at 61 ms in one calibration and 125 ms in the next,
#: which left the streamed prefills of the cost_accuracy benchmark at 0.66-0.74x of measured in the first
#: run; a median of three keeps one such sample from being the figure. Three were not enough where they
#: are short: a hidden-512 layer's cold prefill read 19.4 ms (median of 3) in one calibration and 2.2-5.5 ms
#: in the next four, and the small all-disk prefill of cost_accuracy was then priced at 1.88x measured.
#: Nine such prefills take about 1 s.
MAX_DISK_PREFILLS = 9


#: A unit with fewer weight bytes reads in a few page faults wherever it lies in a read-ahead chain: such units
#: are timed on disk together (:func:`_disk_chains`).
CHAIN_MIN_BYTES = 1 << 20


def _disk_chains(graph: LayerGraph, copy_graph: LayerGraph) -> list[set[str]]:
    """The sets of the copy's units put on disk together to time their memory-mapped reads.

    Each shape the copy holds more than once (one per layer) with units of at least :data:`CHAIN_MIN_BYTES`
    is a chain of its own: a plan that puts a layer's MLP on disk puts it there in many layers, and each is
    read while the next one's pages are read ahead. With every unit on disk instead, a sublayer copy reads
    an MLP ahead of the next layer's norm (a few KiB): a Mixtral-shaped layer's experts read in 20.3 ms per
    decode step that way, where the experts of an all-experts-on-disk plan took 24-30 ms each. The other
    units with weights make one more chain."""
    keys = {name: key for key, names in _shapes(graph).items() for name in names}
    shapes: dict[str, list[str]] = {}
    for unit in copy_graph.units():
        if unit.weight_bytes > 0 and unit.name in keys:
            shapes.setdefault(keys[unit.name], []).append(unit.name)
    chains, rest = [], set()
    for names in shapes.values():
        if len(names) > 1 and min(copy_graph.unit(n).weight_bytes for n in names) >= CHAIN_MIN_BYTES:
            chains.append(set(names))
        else:
            rest.update(names)
    return chains + ([rest] if rest else [])


def _run_mapped(model: nn.Module, graph: LayerGraph, copy_graph: LayerGraph, workload: Workload, folder: Path
                ) -> dict[str, dict[str, float]]:
    """Cold reads through placement_opt's dispatch, one chain of units on disk at a time (:func:`_disk_chains`):
    each unit's figure comes from the forwards where it and the rest of its chain were on disk."""
    from ._device_map import plan_from_device_map

    plan = plan_from_device_map(model, {"": "disk"}, graph=copy_graph)  # every unit on disk: each chain cuts from it
    cold: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}
    for index, chain in enumerate(_disk_chains(graph, copy_graph)):
        found = _run_chain(model, graph, plan, workload, folder / str(index), chain)
        for phase, times in found.items():
            cold[phase].update({name: seconds for name, seconds in times.items() if name in chain})
    return cold


def _run_chain(model: nn.Module, graph: LayerGraph, plan: Plan, workload: Workload, folder: Path,
               chain: set[str]) -> dict[str, dict[str, float]]:
    from .dispatcher import dispatch

    # the chain's units computed on the CPU from their mapped files, each reading the next one ahead; the rest resident
    placed = tuple(dataclasses.replace(p, mode="stream") if p.unit in chain
                   else dataclasses.replace(p, storage="cpu", mode="resident") for p in plan.placements)
    handle = dispatch(model, dataclasses.replace(plan, placements=placed), offload_dir=folder)
    try:
        files = [file for unit in handle._units for file, _ in unit.disk]
        return _cold_forwards(model, graph, workload, lambda: _evict(folder, files))
    finally:
        handle.remove()


def _run_accelerate(model: nn.Module, graph: LayerGraph, _copy_graph: LayerGraph, workload: Workload, folder: Path
                    ) -> dict[str, dict[str, float]] | None:
    """Cold reads through accelerate's ``dispatch_model``: no read-ahead, each unit's files read when it
    is called, and evicted just then (:func:`_evict_when_called`).

    That is how a machine whose RAM cannot hold the files runs it: the least recently used pages, the
    unit's own from the last forward, make room just before the read. Evicting every file before the
    forward instead frees all their memory at once, and on a virtual machine whose guest hands memory
    free for ~2 s back to its host (free page reporting), a forward longer than that reads its last units
    into memory the host must first give back: measured on a 16-layer all-disk decode step (2.9 GB,
    ~4 s), the last 3-4 layers read at half the rate of the first, which a one-layer copy (a ~1 s step)
    never sees.
    """
    try:
        from accelerate import dispatch_model
    except ImportError:  # pragma: no cover - accelerate is a dependency
        return None
    clone = copy.deepcopy(model)  # accelerate leaves offloaded parameters on the meta device
    units = {name: "disk" if graph.unit(name).weight_bytes > 0 else "cpu" for name in _unit_modules(clone, graph)}
    dispatch_model(clone, device_map=units, offload_dir=str(folder))
    files = _accelerate_files(folder, [name for name, where in units.items() if where == "disk"])
    return _cold_forwards(clone, graph, workload, lambda: None, evicted_when_called=files)


def _accelerate_files(folder: Path, units: Iterable[str]) -> dict[str, list[Path]]:
    """The files ``dispatch_model`` offloaded each unit's tensors to (``<tensor name>.dat``)."""
    return {unit: sorted(folder.glob(f"{glob.escape(unit)}.*.dat")) for unit in units}


def _evict_when_called(modules: Mapping[str, nn.Module], files: Mapping[str, Iterable[Path]]
                       ) -> list[torch.utils.hooks.RemovableHandle]:
    """Forward pre-hooks that drop each unit's files from the page cache as the unit is called."""
    handles = []
    for name, paths in files.items():
        listed = list(paths)

        def evict(_module: nn.Module, _args: Any, listed: list[Path] = listed) -> None:
            drop_page_cache(listed)

        handles.append(modules[name].register_forward_pre_hook(evict))
    return handles


def _cold_forwards(model: nn.Module, graph: LayerGraph, workload: Workload, evict: Callable[[], None],
                   evicted_when_called: Mapping[str, Iterable[Path]] | None = None) -> dict[str, dict[str, float]]:
    """Per-unit seconds (medians) of 1 to :data:`MAX_DISK_PREFILLS` prefills and of :data:`DISK_STEPS` to
    :data:`MAX_DISK_STEPS` decode steps, each after the files left the page cache: all of them before the forward (``evict``), or each
    unit's as it is called (``evicted_when_called``)."""
    vocab = int(getattr(model.config, "vocab_size", 32000) or 32000)
    modules = _unit_modules(model, graph)
    stamps = _Stamps(modules, torch.device("cpu"))
    keep = _logits_argument(model, workload.logits_kept)
    runs = []
    evicting = _evict_when_called(modules, evicted_when_called or {})  # after the stamps: counted in the unit
    try:
        with torch.inference_mode():
            ids = torch.randint(0, vocab, (workload.batch_size, workload.prompt_len))
            model(input_ids=ids, use_cache=True, **keep)  # warm-up: first calls of the shapes
            prefills, spent = [], 0.0
            while not prefills or (spent < DISK_BUDGET_S and len(prefills) < MAX_DISK_PREFILLS):
                evict()
                start = time.perf_counter()
                seconds, out = stamps.run(lambda: model(input_ids=ids, use_cache=True, **keep))
                spent += time.perf_counter() - start
                prefills.append(seconds)
            cache = cache_of(out)  # the last prefill's: the decode steps go on from it
            spent = 0.0
            while len(runs) < DISK_STEPS or (spent < DISK_BUDGET_S and len(runs) < MAX_DISK_STEPS):
                evict()
                ids = torch.randint(0, vocab, (workload.batch_size, 1))
                start = time.perf_counter()
                seconds, out = stamps.run(lambda ids=ids, cache=cache: model(input_ids=ids, use_cache=True,
                                                                             **cache_argument(model, cache)))
                spent += time.perf_counter() - start
                runs.append(seconds)
                cache = cache_of(out)
    finally:
        stamps.close()
        for handle in evicting:
            handle.remove()
    return {"prefill": _typical(prefills), "decode": _typical(runs)}


def _evict(folder: Path, files: Iterable[Any]) -> None:
    """Drop ``folder``'s files from the page cache; mapped pages first (``fadvise`` skips mapped pages)."""
    _unmap(files)
    drop_page_cache(path for path in folder.rglob("*") if path.is_file())


def _unmap(files: Iterable[Any]) -> None:
    """Let go of the mapped pages of these files (``MADV_DONTNEED``), so that the page cache can drop them."""
    import mmap

    for file in files:
        mapped = getattr(file, "_map", None)  # a SafetensorsFile's map, once it is mapped
        if mapped is not None:
            mapped.madvise(mmap.MADV_DONTNEED)


def _logits_argument(model: nn.Module, kept: str) -> dict[str, int]:
    """``logits_to_keep=1`` where the model takes it and generation keeps the last position only."""
    return last_logits_argument(model) if kept == "last" else {}


def _time_copies(modules: Mapping[str, nn.Module], representatives: Mapping[str, str],
                 device: torch.device) -> dict[str, dict[str, dict[str, float]]]:  # pragma: no cover - needs a GPU
    """Seconds to bring each unit's weights from CPU RAM: pinned prefetch (``stream``), per tensor (``stream_sync``)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    side = torch.cuda.Stream(device)
    for name, module in modules.items():
        tensors = [t.detach() for t in (*module.parameters(), *module.buffers())]
        if not tensors:
            continue
        pageable = [t.to("cpu") for t in tensors]
        pinned = [t.pin_memory() for t in pageable]

        def prefetch(pinned: list[torch.Tensor] = pinned) -> None:
            with torch.cuda.stream(side):  # what the Streamer does: a side stream from pinned memory
                [t.to(device, non_blocking=True) for t in pinned]
            side.synchronize()

        def per_tensor(pageable: list[torch.Tensor] = pageable) -> None:
            for t in pageable:  # what accelerate's hooks do: one synchronous pageable copy per tensor
                t.to(device)
            torch.cuda.synchronize(device)

        out[representatives[name]] = {f"cpu->{device}": {"stream": _best(prefetch), "stream_sync": _best(per_tensor)}}
    return out


def _best(call: Callable[[], None], repeats: int = 3) -> float:  # pragma: no cover - needs a GPU
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


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
