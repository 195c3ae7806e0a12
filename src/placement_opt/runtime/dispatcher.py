"""Run a Plan for real: put every unit's weights where the plan stores them and compute where it says.

Stage 6 of the data flow: ``Plan`` -> :func:`dispatch` -> a running model (and
:func:`~.loader.load`, which builds the model on the meta device, solves, reads each weight
straight to its device, then dispatches). The per-unit forward wrappers live in :mod:`._hooks`,
the copies and prefetching of streamed weights in :mod:`._streamer` (which unit starts which copies in
:mod:`._prefetch_links`), the phase of a phased unit's call and its KV cache's move in :mod:`._phases`,
what is checked before anything changes in :mod:`._preflight`, the warnings about what a run holds beyond
the plan in :mod:`._dispatch_warnings`, the undo log in :mod:`._undo`.

What each unit gets, from its ``storage`` S and ``execution`` E (a unit of mode ``phased``,
whose ``prefill_execution`` P computes its prefill: the last row, whatever S and E):

==========================  ==================================================================
S == E (GPU or CPU)         weights moved once; no per-forward work
S = disk, E = cpu           weights are views of a memory-mapped safetensors file (the model's
                            checkpoint shard or a file written once into ``offload_dir``): the
                            CPU computes from the page cache, nothing is copied. ``stream`` mode
                            asks the kernel to read the next disk unit ahead. Once the unit has
                            run, its pages leave the process in the background (the page cache
                            keeps them; a tensor written to keeps its private pages), so the RSS
                            holds the unit running, not every unit read before.
S != E otherwise            streamed: weights copied to E for the forward, released after.
                            ``stream`` prefetches one copy group ahead (below) while this one
                            computes (a CUDA side stream from pinned memory; disk reads in a
                            background thread); ``stream_sync`` copies when the unit is called.
mode phased: S = cpu or     the prefill computes on P, weights streamed S -> P as ``stream``
disk, E = cpu, P = the      units' are (pinned copies, side stream, prefetched a group ahead);
prefill_execution (a GPU)   right after that forward the unit's KV cache layers
                            move P -> E. The decode computes on E from the weights where they
                            are stored (RAM, or the memory map: no copy), its cache there. A call
                            is a prefill when it has more than one token per sequence and the
                            unit's cache layers hold no tokens yet (:mod:`._phases`).
==========================  ==================================================================

Prefetching goes by copy groups (``UnitPlacement.copy_group``: the decoder layer a sublayer unit was
cut from; a unit without one is a group alone): runs of consecutive units with one group, whose
streamed units (in a prefill, phased ones too) are copied together. When a group's first unit (its
head, whatever it computes: often a norm resident on the GPU) starts, it starts its group's copies
and the next streaming group's, in order, on the one prefetch thread. Prefetching one *unit* ahead
would hide an MLP's copy behind its own layer's attention only; a group ahead, it runs beside a
whole layer, and first in first out keeps the next group's copies behind this one's: the device
holds two groups' streamed weights at most. The cost model charges a group's wait at its head and
starts the next group's copy there (:func:`placement_opt.solver.problem.stalls`); the dispatcher is
never later than that. A unit alone starts the next group's after taking its own weights, so a plan
without copy groups prefetches one streamed unit ahead, as before groups existed.

Streamed units are for inference: their weights leave the device after the forward, so a
backward pass through them is not supported (resident and memory-mapped units train normally).

Dispatch is all or nothing: every change it makes (a tensor moved, mapped or pinned, a forward
wrapped, an experts config replaced, ``hf_device_map``, the handle attribute) is entered in an
:class:`~._undo.UndoLog` before it is made. When anything fails, the log is unwound before the error leaves,
and the model is bitwise, device-wise and attribute-wise what it was; on success the log goes to the
:class:`DispatchedModel`, whose :meth:`~DispatchedModel.remove` unwinds it.

Hooks are the fewest that do the job: a unit's forward is wrapped only when the plan executes
units on more than one device (its inputs may need moving) or when its weights move per
forward; when inputs are already on the unit's device the wrapper does nothing but compare
devices. The model's own forward is wrapped once to move the caller's inputs to the first
unit's device and to return the outputs on the caller's device. KV caches stay where each
attention unit computes (the cache creates each layer's tensors on the device of its keys); a
phased unit's are created on its GPU in the prefill and moved to the CPU once, where it decodes, through
pinned staging (:mod:`placement_opt.hardware.host_copy`). A plan with GPU units also gets a pre- and a
post-hook on the model that run its decode calls with cuDNN's attention off (:mod:`._decode_attention`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import DispatchError, PlacementError
from ..model.expert_groups import group_counts
from ..plan import Plan
from . import _streamer
from ._decode_attention import decode_without_cudnn_attention
from ._disk_full import disk_bytes, disk_full_error, is_disk_full
from ._dispatch_warnings import (
    warn_copy_headroom,
    warn_cpu_heap,
    warn_gpu_segments,
    warn_mapped_phased,
)
from ._expert_groups import split_experts
from ._experts import pin_experts_to_devices
from ._hooks import install_hooks, restore_forwards
from ._prefetch_links import link_prefetch
from ._preflight import assign_slots, build_units, check_devices, check_model, check_phased
from ._routed_reads import read_looked_up_rows, read_routed_experts
from ._safetensors_file import drop_page_cache
from ._streamer import DispatchUnit, Streamer
from ._undo import UndoLog, Weights, attribute_restorer
from .checkpoint import Slot, collect_slots
from .offload import OffloadStore, SafetensorsFile

__all__ = ["dispatch", "DispatchedModel"]


# ---------------------------------------------------------------------------------------------
# The handle
# ---------------------------------------------------------------------------------------------
class DispatchedModel:
    """A model running in a plan's placement. Call it and use it like the model itself.

    Attribute access, ``generate()``, ``config`` and the rest go to the wrapped model, which is
    also available as :attr:`model` (it carries the hooks and ``hf_device_map``, so passing
    ``handle.model`` to a ``Trainer`` or a pipeline works too).

    Example::

        handle = dispatch(model, plan, offload_dir="offload/")
        logits = handle(input_ids).logits          # on input_ids' device
        tokens = handle.generate(input_ids, max_new_tokens=20)
        handle.remove()                            # forwards, devices and weights as before
    """

    def __init__(self, model: nn.Module, plan: Plan, units: list[DispatchUnit], hooked: dict[nn.Module, Any],
                 hf_hooked: set[int], undo: UndoLog, streamer: Streamer) -> None:
        self.model = model
        self.plan = plan
        self._units = units
        self._streamer = streamer
        self._hooked = hooked
        self._hf_hooked = hf_hooked
        self._undo = undo
        self._removed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        if model is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(model, name)

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for unit in self._units:
            kinds[unit.kind] = kinds.get(unit.kind, 0) + 1
        summary = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
        return f"DispatchedModel({type(self.model).__name__}, units: {summary}, removed={self._removed})"

    @property
    def hooked_modules(self) -> list[nn.Module]:
        """Modules whose forward is wrapped (the model itself included)."""
        return list(self._hooked)

    def unit_kinds(self) -> dict[str, str]:
        """``unit -> "resident" | "mmap" | "stream" | "phased"``: how each unit's weights are handled."""
        return {unit.name: unit.kind for unit in self._units}

    def refresh(self) -> None:
        """Make the next call read every weight as it is now, in the middle of a sequence too.

        A decode step starts copying the next step's first streamed units and returns while they are under
        way, so a weight changed between two decode steps of one sequence (a write into ``.data``,
        ``load_state_dict``) would reach the next step as that copy read it. A call that starts a sequence
        (no cache, or an empty one) copies again by itself; a loop that changes weights between the steps of
        one sequence calls this after each change. The copies under way are waited for and made again.
        """
        if not self._removed:
            self._streamer.renew()

    def drop_disk_cache(self) -> None:
        """Let the disk units' files leave the page cache (their pages in this process first), so that the next
        call reads them from the disk, as it would on a machine whose RAM cannot hold them: for cold timings
        (``placement-opt run --cold``). A tensor written to in place keeps its pages (``SafetensorsFile.release``);
        a copy the last call started for the next one keeps what it read, as the plan's pricing assumes."""
        files: dict[int, tuple[SafetensorsFile, list[str]]] = {}
        for unit in self._units:
            for file, key in unit.disk:
                files.setdefault(id(file), (file, []))[1].append(key)
        for file, keys in files.values():
            file.release(keys)
        drop_page_cache(file.path for file, _ in files.values())

    def remove(self) -> nn.Module:
        """Undo :func:`dispatch`: original forwards, devices and weights; returns the model.

        Weights read from memory maps or pinned copies are copied back into ordinary memory on
        their original device, so ``state_dict()`` is bitwise what it was before dispatch.
        (A model made by :func:`load` keeps its weights where they are: it had no placement before.)
        """
        if self._removed:
            return self.model
        self._remove_foreign_hooks()  # first: they wrap our forwards and put them back when removed
        failures = self._undo.unwind()
        self._removed = True
        self._let_go_of_files()
        if failures:
            raise DispatchError(f"remove() could not undo {len(failures)} change(s) of dispatch: {'; '.join(failures)}")
        return self.model

    def _let_go_of_files(self) -> None:
        """The disk units' descriptors closed, and the units' views of their maps dropped: a handle kept after
        remove() held every offload file open and mapped until it was collected. A map goes once no tensor views
        it (a model from load() keeps its weights there)."""
        for unit in self._units:
            for file, _ in unit.disk:
                file.let_go()
            unit.disk.clear()
            unit.slots.clear()
            unit.uses.clear()

    def _remove_foreign_hooks(self) -> None:
        """Drop accelerate hooks that transformers added while we ran (generate() on encoders)."""
        for module in self.model.modules():
            if hasattr(module, "_hf_hook") and id(module) not in self._hf_hooked:
                from accelerate.hooks import remove_hook_from_module

                remove_hook_from_module(module)


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------
def dispatch(model: nn.Module, plan: Plan | Mapping[str, Any], *, offload_dir: str | os.PathLike[str] | None = None,
             disk_reads: str = "mmap", _disk_sources: Mapping[str, tuple[SafetensorsFile, str]] | None = None,
             _restore: bool = True, _hook_every_unit: bool = False,
             _told: tuple[int, int, int] | None = None) -> DispatchedModel:
    """Apply ``plan`` to ``model``: weights where the plan stores them, compute where it executes.

    Example::

        plan = placement_opt.solve(model, ["cuda:0", "cpu", "disk"])
        handle = placement_opt.dispatch(model, plan, offload_dir="/scratch/offload")
        out = handle(**inputs)          # outputs on the inputs' device
        handle.remove()

        # or any device_map accelerate accepts, run as accelerate runs it
        handle = placement_opt.dispatch(model, {"model.embed_tokens": "cpu", "model.layers": 0,
                                                "model.norm": 0, "lm_head": "disk"}, offload_dir="offload/")

    Args:
        model: an ``nn.Module`` with real weights (anywhere); unit names in the plan are its
            qualified module names.
        plan: the placement; every unit of the plan must name a module of ``model``. Or an
            accelerate ``device_map`` (``{module name: device}``), turned into a plan with
            accelerate's run-time semantics (:mod:`._device_map`): keys are module prefixes
            (``"model.layers"``; ``""`` is the whole model), units or finer submodules (a map that
            splits decoder layers runs on sublayer units, as a sublayer plan's map says; a unit split
            finer still goes where most of its parameters are, with a warning); modules with buffers only (``rotary_emb``)
            may be left out. Values are GPU indices, ``"cuda:N"``, ``"cpu"`` or ``"disk"``. In a
            map with a GPU, ``"cpu"`` and ``"disk"`` entries are stored there and execute on the
            map's first GPU, copied in at each forward; a map of ``"cpu"``/``"disk"`` only
            computes on the CPU (disk entries from a memory map). The plan is ``handle.plan``.
        offload_dir: directory for the safetensors files of disk-stored units, written once
            per version of their weights and reused after a check of their bytes; threads and
            processes may share it (:class:`~placement_opt.runtime.offload.OffloadStore`). Not needed
            when the disk units' weights already come from checkpoint files (:func:`load`).
        disk_reads: ``"mmap"`` (default): disk units executed on the CPU compute from the memory
            map, zero copy. ``"copy"``: they are streamed, copied into RAM for each forward and
            prefetched by a background thread (for file systems where mapped reads are slow); that
            holds a copy of the next unit too, one more than the plan's memory charges (a warning
            gives the figures when the plan's free RAM is smaller than that copy).
            ``phased`` disk units decode from the memory map either way (a warning names them).

    Returns:
        A :class:`DispatchedModel`; ``model`` itself is modified in place (hooks, devices,
        ``model.hf_device_map`` = the plan's storage map) and is ``handle.model``. A call holding more
        tokens in the KV cache (sequences x context) or computing more at once (sequences x new tokens)
        than the plan's workload counted memory for is warned of (a ``UserWarning``, once): its KV
        cache and activations may not fit.

    Raises:
        DispatchError: a device_map with a key that names no module, a value that is no device
            or a unit with weights it leaves out; units missing from the model, tied weights stored on different devices,
            a CUDA device that is not present, disk units without ``offload_dir``, a model
            that accelerate has dispatched already, or (in a DDP/DeepSpeed/FSDP run) a plan that
            uses another rank's GPU. Any other failure on the way (a tensor the offload store
            cannot write) is a DispatchError naming the step and chaining the
            cause. Whatever fails, every change dispatch had made is undone before the error leaves.
        MemoryError, torch.OutOfMemoryError: memory ran out; raised as they are (after the undo),
            with a note naming the step, so code that catches them keeps working.
    """
    if disk_reads not in ("mmap", "copy"):
        raise DispatchError(f"disk_reads={disk_reads!r}: accepted are 'mmap' and 'copy'")
    if isinstance(plan, Mapping):
        from ._device_map import plan_from_device_map

        plan = plan_from_device_map(model, plan)
    elif not isinstance(plan, Plan):
        raise DispatchError(f"dispatch() takes a Plan or a device_map dict, not {type(plan).__name__}")
    log = UndoLog()
    try:
        return _dispatch(model, plan, log, offload_dir, disk_reads, _disk_sources, _restore, _hook_every_unit,
                         _told)
    except BaseException as exc:
        failures = log.unwind()
        if failures:
            exc.add_note(f"placement_opt.dispatch could not undo {len(failures)} change(s): {'; '.join(failures)}")
        if isinstance(exc, MemoryError | torch.OutOfMemoryError):
            # callers catch running out of memory by its own type (to retry smaller): keep it
            exc.add_note(f"placement_opt.dispatch ran out of memory while {log.doing}; "
                         f"{'every change it made was undone' if not failures else 'see the notes above'}")
        elif isinstance(exc, Exception) and not isinstance(exc, PlacementError):
            text = (str(exc).strip().splitlines() or [""])[0][:300]
            raise DispatchError(
                f"dispatch of {type(model).__name__} failed while {log.doing} ({type(exc).__name__}: {text}); "
                f"{'every change it made was undone, the model is as it was' if not failures else 'see the notes'}: "
                f"fix the cause and dispatch again") from exc
        raise


def _dispatch(model: nn.Module, plan: Plan, log: UndoLog, offload_dir: Any, disk_reads: str,
              disk_sources: Mapping[str, tuple[SafetensorsFile, str]] | None, restore: bool,
              hook_every_unit: bool, told: tuple[int, int, int] | None = None) -> DispatchedModel:
    """The steps of :func:`dispatch`; each change is entered in ``log`` before it is made. ``told``: the (batch,
    prompt, context) of a workload load() warned of already (its calls are not warned of again)."""
    check_model(model, plan)  # first: a dispatched model's experts are cut already, for its own plan
    log.doing = "cutting the experts into groups"
    log.push("expert groups", split_experts(model, group_counts(p.unit for p in plan.placements)))
    check_phased(plan)
    units = build_units(model, plan)
    from ..plan_check import check_plan  # coverage and sizes against the plan's fingerprint

    check_plan(model, plan)
    slots = collect_slots(model)
    assign_slots(units, slots, plan)
    check_devices(units)
    weights = Weights(slots, restore)
    log.push("weights", weights.undo)
    streamer = Streamer()
    log.push("prefetch thread", streamer.close)
    home = getattr(plan, "home", None)  # sublayer plans: the glue between units stays on one device
    home_device = _streamer.torch_device(home) if home else None
    main = home_device or (units[0].execution if units else torch.device("cpu"))
    _place(model, units, slots, offload_dir, disk_reads, disk_sources, weights, log, main)
    warn_copy_headroom(units, plan)
    warn_cpu_heap(units, plan)
    warn_gpu_segments(plan)
    log.doing = "linking the units that prefetch"
    link_prefetch(units)
    log.doing = "hooking the reads of routed experts and looked-up rows"
    log.push("routed expert reads", read_routed_experts(model, units))
    log.push("looked-up row reads", read_looked_up_rows(units, plan.machine))
    hooked_modules, hf_hooked = _wrap_forwards(model, units, streamer, hook_every_unit, log, home, _planned(plan),
                                               told)
    # Experts kernels follow each unit's execution device, not model.device (issue 14).
    log.doing = "pinning the experts kernels"
    log.push("experts configs", pin_experts_to_devices(model, {u.name: u.execution for u in units}, main))
    if any(u.execution.type == "cuda" for u in units):
        log.doing = "turning cuDNN attention off in decode steps"
        log.push("decode attention hooks", decode_without_cudnn_attention(model))
    handle = _attach(model, plan, units, (hooked_modules, hf_hooked), streamer, log)
    weights.commit()
    return handle


def _wrap_forwards(model: nn.Module, units: list[DispatchUnit], streamer: Streamer, hook_every_unit: bool,
                   log: UndoLog, home: str | None = None, planned: tuple[int, int, int] | None = None,
                   told: tuple[int, int, int] | None = None) -> tuple[dict[nn.Module, Any], set[int]]:
    """Install the forward wrappers; (the modules wrapped, ids of modules that carried accelerate hooks)."""
    log.doing = "wrapping the forwards"
    hf_hooked = {id(m) for m in model.modules() if hasattr(m, "_hf_hook")}
    hooked: dict[nn.Module, tuple[bool, Any]] = {}
    log.push("forwards", lambda: restore_forwards(hooked))
    install_hooks(model, units, streamer, hook_every_unit or None, hooked, home, planned, told)
    return dict(hooked), hf_hooked


def _planned(plan: Plan) -> tuple[int, int, int] | None:
    """(batch, prompt, context) a priced plan counted memory for; None for a device_map's or an unpriced plan
    (no workload of the caller's to hold calls to)."""
    if plan.strategy == "device_map" or not plan.cost.memory:
        return None
    return plan.workload.batch_size, plan.workload.prompt_len, plan.workload.context_len


def _attach(model: nn.Module, plan: Plan, units: list[DispatchUnit], hooks: tuple[dict[nn.Module, Any], set[int]],
            streamer: Streamer, log: UndoLog) -> DispatchedModel:
    """Set ``model.hf_device_map`` and attach the handle to the model; returns the handle."""
    log.doing = "setting model.hf_device_map"
    log.push("hf_device_map", attribute_restorer(model, "hf_device_map"))
    model.hf_device_map = plan.device_map
    log.doing = "creating the handle"
    handle = DispatchedModel(model, plan, units, *hooks, log, streamer)
    log.push("handle attribute", lambda: _drop_handle(model, handle))
    model._placement_opt_dispatch = handle
    return handle


def _drop_handle(model: nn.Module, handle: DispatchedModel) -> None:
    if model.__dict__.get("_placement_opt_dispatch") is handle:
        del model.__dict__["_placement_opt_dispatch"]


def _place(model: nn.Module, units: list[DispatchUnit], slots: list[Slot], offload_dir: Any,
           disk_reads: str, disk_sources: Mapping[str, tuple[SafetensorsFile, str]] | None,
           weights: Weights, log: UndoLog, main: torch.device) -> None:
    """Move or map every tensor to its storage (tensors no unit owns: to ``main``); decide each unit's kind."""
    store = None
    for unit in units:
        storage, execution = unit.placement.storage, unit.placement.execution
        log.doing = f"placing unit {unit.name!r} ({storage} storage, {execution} execution)"
        for slot in unit.slots:
            weights.record(slot)
        if storage == "disk":
            if disk_sources is None or not _sourced(unit, disk_sources):
                if offload_dir is None:
                    raise DispatchError(
                        f"unit {unit.name!r} is stored on disk but dispatch() has no offload_dir: pass "
                        f"offload_dir='some/empty/dir' (its weights are written there once), or use "
                        f"placement_opt.load(), which reads them from the checkpoint"
                    )
                store = store or OffloadStore(offload_dir)
                _stored(unit, store, units, model)
            else:
                _map_from_sources(unit, disk_sources)
            unit.kind = "mmap" if execution == "cpu" and disk_reads == "mmap" else "stream"
        elif storage == execution and unit.prefill is None:
            for slot in unit.slots:
                _set(slot, slot.tensor.data.to(unit.execution), foreign=False)
        else:
            # pinned, so the copies to the GPU run asynchronously (a phased unit decodes from it too)
            pin = unit.streams_to.type == "cuda" and storage == "cpu"
            for slot in unit.slots:
                data = slot.tensor.data.to(storage)
                if pin:
                    data = data.pin_memory()
                _set(slot, data, foreign=pin)
            unit.kind = "stream"
        if unit.prefill is not None:
            unit.kind = "phased"  # decodes from RAM or the memory map (disk_reads aside), streams the prefill
    warn_mapped_phased(units, disk_reads)
    _place_unowned(units, slots, weights, log, main)


def _place_unowned(units: list[DispatchUnit], slots: list[Slot], weights: Weights, log: UndoLog,
                   main: torch.device) -> None:
    """Tensors no unit owns (e.g. a rotary table) live where the glue runs: the home device of a sublayer
    plan, else the first unit's execution device."""
    owned = {id(s) for u in units for s in u.slots}
    log.doing = f"moving the tensors outside every unit to {main}"
    for slot in slots:
        if id(slot) not in owned:
            weights.record(slot)
            _set(slot, slot.tensor.data.to(main), foreign=False)


def _set(slot: Slot, data: torch.Tensor, *, foreign: bool) -> None:
    slot.tensor.data = data
    slot.stored = data
    slot.foreign = slot.foreign or foreign


def _stored(unit: DispatchUnit, store: OffloadStore, units: list[DispatchUnit], model: nn.Module) -> None:
    """:func:`_map_from_store`, a full disk said with its figures (the undo log then puts the model back)."""
    try:
        _map_from_store(unit, store)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        needed = disk_bytes(s for u in units if u.placement.storage == "disk" for s in u.slots)
        raise disk_full_error(f"dispatch of {type(model).__name__}", f"unit {unit.name!r}", store.directory, needed,
                              "every change dispatch made is undone; the units written so far are kept and reused "
                              "by the next dispatch") from exc


def _map_from_store(unit: DispatchUnit, store: OffloadStore) -> None:
    path = store.write(unit.name, {slot.names[0]: slot.tensor.data for slot in unit.slots})
    file = SafetensorsFile(path)
    for slot in unit.slots:
        _set(slot, file.tensor(slot.names[0]), foreign=True)
        unit.disk.append((file, slot.names[0]))


def _sourced(unit: DispatchUnit, sources: Mapping[str, tuple[SafetensorsFile, str]]) -> bool:
    """Whether the checkpoint holds every weight of ``unit``. Buffers computed at init (Gemma's ``embed_scale``,
    rotary tables) are in no checkpoint: they stay in RAM as they are, a few bytes, and need no offload_dir."""
    return all(slot.names[0] in sources or not isinstance(slot.tensor, nn.Parameter) for slot in unit.slots)


def _map_from_sources(unit: DispatchUnit, sources: Mapping[str, tuple[SafetensorsFile, str]]) -> None:
    for slot in unit.slots:
        if slot.names[0] not in sources:  # a buffer computed at init (_sourced)
            _set(slot, slot.tensor.data, foreign=False)
            continue
        file, key = sources[slot.names[0]]
        _set(slot, file.tensor(key), foreign=True)
        unit.disk.append((file, key))


