"""How :func:`~.calibrate.calibrate` times cold disk reads: forwards from evicted files, both ways they are read.

``stream``: placement_opt's dispatch computes a disk unit from its memory-mapped file (pages fault in as the
kernels touch them, the next disk unit read ahead), one chain of units of a shape on disk at a time
(:func:`_disk_chains`), as a plan that offloads that part in every layer reads it. ``stream_sync``:
accelerate's ``dispatch_model`` copies each tensor out of its ``np.memmap`` when the unit is called, each
unit's files evicted just then. A unit's figure is the cold forward's time less the same forward resident.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..cost.calibrated import shape_key
from ..cost.workload import Workload
from ..model.expert_groups import group_counts
from ..model.graph import LayerGraph
from ..plan import Plan
from ._calibrate_clock import logits_argument, routed_units, typical, unit_modules
from ._safetensors_file import drop_page_cache
from ._stamps import Stamps
from .timing import cache_argument, cache_of

__all__ = ["time_disk_reads", "DISK_STEPS", "DISK_BUDGET_S", "MAX_DISK_STEPS", "MAX_DISK_PREFILLS", "CHAIN_MIN_BYTES"]


def time_disk_reads(model: nn.Module, graph: LayerGraph, copy_graph: LayerGraph, representatives: Mapping[str, str],
                     workload: Workload, resident: Mapping[str, Mapping[str, float]], folder: Path
                     ) -> dict[str, dict[str, Any]]:
    """Seconds a CPU-executed unit adds per forward when its weights come from a cold disk, both ways
    they are read, at prefill and at a decode step.

    ``stream``: placement_opt's dispatch computes from the memory-mapped file (pages fault in as the
    kernels touch them, the next unit read ahead), the units of one shape on disk at a time
    (:func:`_disk_chains`); ``stream_sync``: accelerate's hooks copy each tensor
    out of its ``np.memmap``. Each is a forward with files evicted from the page cache first, less the
    same forward resident (``resident``: phase -> unit -> seconds): the median over the forwards, but for MoE
    units the mean (a step's picks decide its read; a group of experts idles in some steps), kept with the
    batch that picked them (``"decode_batch"``: pricing scales the read by the experts a batch hits);
    ``copy_graph``: the copy's graph, cut as ``graph`` is. accelerate's path is not timed for expert groups (accelerate has no such modules). A
    prefill hides more of the read-ahead behind compute than a decode step does, so the two phases are kept
    apart, the prefill's read capped at the decode's where both read every weight (:func:`_reads_every_weight`),
    and always for ``stream_sync``: accelerate copies every tensor before the module computes, the same bytes in
    both phases, and the decode's figure is the median of more forwards (up to 16 against 9). In
    benchmarks/cost_accuracy the measured prefill's read per layer was at most the decode step's in 5 of 6 runs
    (hidden 512: 11.2-16.6 ms against 13.0-15.8), while a calibrated prefill of 19.0 ms against a decode of
    17.8 priced the small all-disk prefill at 1.32x measured, and 65.6 against 50.1 the MoE one at 1.29x.
    The prefill is ``workload``'s prompt (the caller passes the longest prompt it timed, which a large model keeps
    short).
    """
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
                alike = [n for n in shapes.get(key, [name]) if n in cold["decode"]]
                if not alike:
                    continue  # never called through its forward: its reads land in the unit that uses it
                extra = {phase: statistics.fmean(max(0.0, cold[phase].get(n, 0.0) - resident[phase].get(n, 0.0))
                                                 for n in alike) for phase in ("prefill", "decode")}
                if mode == "stream_sync" or _reads_every_weight(graph.unit(name)):
                    extra["prefill"] = min(extra["prefill"], extra["decode"])
                if mode == "stream" and graph.unit(name).is_moe:  # its step read the experts this batch hit
                    extra["decode_batch"] = workload.batch_size
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
        found = _run_chain(model, graph, plan, workload, folder / str(index), _with_tied(chain, copy_graph))
        for phase, times in found.items():
            cold[phase].update({name: seconds for name, seconds in times.items() if name in chain})
    return cold


def _with_tied(chain: set[str], graph: LayerGraph) -> set[str]:
    """``chain`` and the units that share weights with one of its units (a tied LM head with its embeddings):
    tied weights are stored on one device, so they go to disk with it (their own figures are not taken)."""
    stored = set(chain)
    for group in graph.meta.tied_unit_groups:
        if stored & set(group):
            stored |= set(group)
    return stored


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
    units = {name: "disk" if graph.unit(name).weight_bytes > 0 else "cpu" for name in unit_modules(clone, graph)}
    dispatch_model(clone, device_map=units, offload_dir=str(folder))
    files = _accelerate_files(folder, [name for name, where in units.items() if where == "disk"])
    try:
        return _cold_forwards(clone, graph, workload, lambda: None, evicted_when_called=files)
    except (RuntimeError, NotImplementedError) as error:
        # accelerate loads a module's weights when that module's forward is called: a model that reads a
        # parameter of a module it never calls (JetMoE's attention experts, called through map() and reduce())
        # meets it still on the meta device
        warnings.warn(f"calibrate(): accelerate's offload did not run {type(model).__name__} from disk "
                      f"({type(error).__name__}: {str(error)[:200]}); its disk reads (stream_sync) stay priced from "
                      f"the profile", UserWarning, stacklevel=2)
        return None


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
    :data:`MAX_DISK_STEPS` decode steps, each after the files left the page cache: all of them before the forward
    (``evict``), or each unit's as it is called (``evicted_when_called``)."""
    vocab = int(getattr(model.config, "vocab_size", 32000) or 32000)
    modules = unit_modules(model, graph)
    stamps = Stamps(modules, torch.device("cpu"), routed=routed_units(graph, modules))
    keep = logits_argument(model, workload.logits_kept)
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
    return {"prefill": typical(prefills), "decode": typical(runs, stamps.routed)}


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
