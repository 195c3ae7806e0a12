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

How a forward is clocked (stamps, repeats, stalls) is :mod:`._calibrate_clock`'s; how cold reads are timed,
:mod:`._calibrate_disk`'s.

Pricing uses them whenever ``solve()`` / ``evaluate()`` plan for this machine's measured devices,
whatever form ``devices`` takes. A device the profile has not measured yet is profiled first
(``profile(quick=True)``), since only measured devices take calibrated times.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
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
from ..model.expert_groups import expert_groups_refusal
from ..model.graph import LayerGraph
from ..progress import bar
from ._calibrate_clock import (
    MIN_TIMED_S,
    Stamps,
    logits_argument,
    repeated,
    typical,
    unit_modules,
)
from ._calibrate_disk import time_disk_reads
from .timing import cache_argument, cache_of

__all__ = ["calibrate", "CalibrationResult"]

#: Decode steps timed at each context at least (the median counts, per unit) ...
DECODE_STEPS = 8
#: ... unless they add up to :data:`DECODE_BUDGET_S` first (a large model's steps vary little beside their
#: length), and then at least this many ...
MIN_DECODE_STEPS = 3
DECODE_BUDGET_S = 0.5
#: ... and at most, while they add up to under half :data:`MIN_TIMED_S`.
MAX_DECODE_STEPS = 32
#: The next, 4x longer prefill is timed when it should take at most this (estimated from the last one).
PREFILL_BUDGET_S = 2.0
#: The shortest prefill timed: the workload's prompt divided by 4 until one more division would go below this.
PROBE_TOKENS = 8
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
    a sublayer unit lies in; layer i kept: i + 1), and with ``chain`` two more where the model has them.

    ``chain`` is for timing disk reads: a plan's disk units read side by side, each one's pages faulted
    in while the next one's are read ahead, and a unit read with nothing after it reads faster. One
    layer alone read its cold weights in 20.8 ms per decode step (Mixtral-shaped, hidden 512) and
    83 ms (Llama, hidden 2048), where the layers of an all-disk plan took 25-31 ms and 100-105 ms;
    a copy of two layers read them in 25.0 ms and 93.6 ms. A chain's reads add up to about its bytes over
    the disk's rate plus a start (the first unit waits for its own pages and the next one's), and the mean
    over the copy's units (:func:`._calibrate_disk._shapes`) spreads that start over as many units as the
    copy chains: hidden 512, 8 layers all on disk, a cold decode step took 22 ms in its first layer and
    7.7 ms in each later one (1.2 ms resident); a copy of two layers priced it at 1.19-1.26x measured,
    one of three at 0.94-1.01x (their MLPs alone on disk: 1.14-1.60x, and 0.91-1.04x)."""
    indices = [int(m.group(1)) for name in timed if (m := _LAYER_INDEX.search(name))]
    cut = copy.deepcopy(config)
    layers = getattr(cut, "num_hidden_layers", None)
    if not isinstance(layers, int) or not indices:
        return cut
    keep = min(layers, max(indices) + 1 + 2 * int(chain))
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
    if hasattr(model, "tie_weights"):  # skipped with the initialisers: an untied head was not the model planned
        model.tie_weights()
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
        modules = unit_modules(model, graph)  # every unit marked: glue goes to the unit before it
        stamps = Stamps(modules, device)
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
        for key, links in time_disk_reads(model, graph, copy_graph, representatives, cold_workload, resident,
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


def _time_forwards(model: nn.Module, stamps: Stamps, workload: Workload, repeats: int, device: torch.device
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
    keep = logits_argument(model, workload.logits_kept)
    prefill: dict[tuple[int, int], dict[str, float]] = {}

    def timed(length: int) -> Any:
        ids = torch.randint(0, vocab, (batch, length), device=device)
        runs, out = repeated(lambda: model(input_ids=ids, use_cache=True, **keep), stamps, repeats)
        prefill[batch, length] = typical(runs)
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
        cache = cache_of(model(input_ids=ids, use_cache=True, **logits_argument(model, "last")))
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


def _time_decode(model: nn.Module, stamps: Stamps, cache: Any, workload: Workload, vocab: int,
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
                                   **logits_argument(model, "last")))
        seconds, steps = _steps(model, stamps, cache, batch, most, vocab, device)
        decode[batch, last - most + (steps - 1) // 2] = seconds
    return decode


def _steps(model: nn.Module, stamps: Stamps, cache: Any, batch: int, most: int, vocab: int,
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
    return typical(runs), len(runs)


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
