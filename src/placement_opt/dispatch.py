"""Run a Plan for real: put every unit's weights where the plan stores them and compute where it says.

Stage 6 of the data flow: ``Plan`` -> :func:`dispatch` -> a running model (and :func:`load`, which
builds the model on the meta device, solves, reads each weight straight to its device, then
dispatches).

What each unit gets, from its ``storage`` S and ``execution`` E:

==========================  ==================================================================
S == E (GPU or CPU)         weights moved once; no per-forward work
S = disk, E = cpu           weights are views of a memory-mapped safetensors file (the model's
                            checkpoint shard or a file written once into ``offload_dir``): the
                            CPU computes from the page cache, nothing is copied. ``stream`` mode
                            asks the kernel to read the next disk unit ahead.
S != E otherwise            streamed: weights copied to E for the forward, released after.
                            ``stream`` prefetches the next streamed unit while this one computes
                            (a CUDA side stream from pinned memory; disk reads in a background
                            thread); ``stream_sync`` copies when the unit is called.
==========================  ==================================================================

Streamed units are for inference: their weights leave the device after the forward, so a
backward pass through them is not supported (resident and memory-mapped units train normally).

Hooks are the fewest that do the job: a unit's forward is wrapped only when the plan executes
units on more than one device (its inputs may need moving) or when its weights move per
forward; when inputs are already on the unit's device the wrapper does nothing but compare
devices. The model's own forward is wrapped once to move the caller's inputs to the first
unit's device and to return the outputs on the caller's device. KV caches stay where each
attention unit computes (the cache creates each layer's tensors on the device of its keys).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._experts import pin_experts_to_devices
from .checkpoint import (
    Slot,
    checkpoint_files,
    checkpoint_index,
    collect_slots,
    materialize,
    meta_model,
    needs_conversion,
    unit_of,
)
from .errors import DispatchError, PlacementError
from .offload import OffloadStore, SafetensorsFile
from .plan import Plan, UnitPlacement

__all__ = ["dispatch", "load", "DispatchedModel", "unit_of"]


# ---------------------------------------------------------------------------------------------
# Moving inputs and outputs
# ---------------------------------------------------------------------------------------------
def _move(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (through tuples, lists, dicts) on ``device``; same object if none moved."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        return obj.to(device, non_blocking=device.type == "cuda")
    kind = type(obj)
    if kind is tuple or kind is list:
        moved = [_move(item, device) for item in obj]
        return obj if all(a is b for a, b in zip(moved, obj, strict=True)) else kind(moved)
    if kind is dict:
        moved_items = {key: _move(value, device) for key, value in obj.items()}
        return obj if all(moved_items[k] is v for k, v in obj.items()) else moved_items
    return obj  # caches and other objects pass through: each layer keeps its part on its device


def _move_output(obj: Any, device: torch.device) -> Any:
    """Like :func:`_move`, also through ``ModelOutput`` (a mapping whose items are attributes too)."""
    if isinstance(obj, Mapping) and type(obj) is not dict:
        for key, value in list(obj.items()):
            moved = _move(value, device)
            if moved is not value:
                obj[key] = moved
        return obj
    return _move(obj, device)


def _first_device(args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


# ---------------------------------------------------------------------------------------------
# Bookkeeping of weights
# ---------------------------------------------------------------------------------------------
def _torch_device(name: str) -> torch.device:
    return torch.device(name)


@dataclass(eq=False)
class _Unit:
    placement: UnitPlacement
    module: nn.Module
    execution: torch.device
    slots: list[Slot] = field(default_factory=list)
    """Tensors this unit owns (their first name is under it): placed on its storage."""
    uses: list[Slot] = field(default_factory=list)
    """Tensors its modules reference (owned or tied to another unit's): swapped when streamed."""
    kind: str = "resident"
    """``resident``, ``mmap`` (disk, CPU-executed, zero-copy) or ``stream``."""
    disk: list[tuple[SafetensorsFile, str]] = field(default_factory=list)
    next_unit: _Unit | None = None
    """The unit to prefetch when this one starts (``stream`` mode)."""

    @property
    def name(self) -> str:
        return self.placement.unit



# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------
class _Streamer:
    """Copies streamed units' weights to their execution device; prefetches the next one."""

    def __init__(self) -> None:
        self.pool: ThreadPoolExecutor | None = None
        self.side_streams: dict[torch.device, Any] = {}
        self.inflight: dict[int, Future[tuple[list[torch.Tensor], Any]]] = {}

    def _pool(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="placement_opt-prefetch")
        return self.pool

    def _side(self, device: torch.device) -> Any:
        if device not in self.side_streams:
            self.side_streams[device] = torch.cuda.Stream(device)
        return self.side_streams[device]

    def _copy(self, unit: _Unit, side: bool) -> tuple[list[torch.Tensor], Any]:
        """Copy every stored tensor of ``unit`` to its execution device (on a side stream if asked)."""
        device = unit.execution
        if device.type != "cuda":
            return [slot.stored.to(device, copy=True) for slot in unit.uses], None
        sources = []
        for slot in unit.uses:
            src = slot.stored
            if not src.is_pinned() and src.device.type == "cpu":
                # disk (memory map) or pageable memory: stage through pinned memory, read in this thread
                src = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
            sources.append(src)
        if not side:
            return [src.to(device, non_blocking=False) for src in sources], None
        stream = self._side(device)
        with torch.cuda.stream(stream):
            out = [src.to(device, non_blocking=True) for src in sources]
            event = torch.cuda.Event()
            event.record(stream)
        return out, event

    def start(self, unit: _Unit) -> None:
        """Begin fetching ``unit``'s weights in the background unless that is under way.

        Disk reads and GPU copies run in the prefetch thread (GPU copies on a side stream);
        a CPU-to-CPU copy gains nothing from running early and is made when taken.
        """
        if id(unit) not in self.inflight and (unit.disk or unit.execution.type == "cuda"):
            self.inflight[id(unit)] = self._pool().submit(self._copy, unit, unit.execution.type == "cuda")

    def take(self, unit: _Unit) -> list[torch.Tensor]:
        """The unit's weights on its device: the prefetched ones, or copied now."""
        future = self.inflight.pop(id(unit), None)
        tensors, event = future.result() if future is not None else self._copy(unit, side=False)
        if unit.execution.type == "cuda":
            stream = torch.cuda.current_stream(unit.execution)
            if event is not None:
                stream.wait_event(event)
            for tensor in tensors:
                tensor.record_stream(stream)
        return tensors

    def close(self) -> None:
        for future in self.inflight.values():
            future.result()
        self.inflight.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


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

    def __init__(self, model: nn.Module, plan: Plan, units: list[_Unit], slots: list[Slot],
                 streamer: _Streamer, hooked: dict[nn.Module, tuple[bool, Any]],
                 previous_map: Any, had_map: bool, hf_hooked: set[int], restore: bool,
                 unpin_experts: Callable[[], None] = lambda: None) -> None:
        self.model = model
        self.plan = plan
        self._units = units
        self._slots = slots
        self._streamer = streamer
        self._hooked = hooked
        self._previous_map = (had_map, previous_map)
        self._hf_hooked = hf_hooked
        self._restore = restore
        self._unpin_experts = unpin_experts
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
        """``unit -> "resident" | "mmap" | "stream"``: how each unit's weights are handled."""
        return {unit.name: unit.kind for unit in self._units}

    def remove(self) -> nn.Module:
        """Undo :func:`dispatch`: original forwards, devices and weights; returns the model.

        Weights read from memory maps or pinned copies are copied back into ordinary memory on
        their original device, so ``state_dict()`` is bitwise what it was before dispatch.
        (A model made by :func:`load` keeps its weights where they are: it had no placement before.)
        """
        if self._removed:
            return self.model
        self._streamer.close()
        self._remove_foreign_hooks()  # first: they wrap our forwards and put them back when removed
        self._unpin_experts()
        for module, (had_own, previous) in self._hooked.items():
            if had_own:
                module.forward = previous
            else:
                del module.forward
        if self._restore:
            for slot in self._slots:
                _restore_slot(slot)
        had_map, previous_map = self._previous_map
        if had_map:
            self.model.hf_device_map = previous_map
        elif hasattr(self.model, "hf_device_map"):
            del self.model.hf_device_map
        if getattr(self.model, "_placement_opt_dispatch", None) is self:
            del self.model._placement_opt_dispatch
        self._removed = True
        return self.model

    def _remove_foreign_hooks(self) -> None:
        """Drop accelerate hooks that transformers added while we ran (generate() on encoders)."""
        for module in self.model.modules():
            if hasattr(module, "_hf_hook") and id(module) not in self._hf_hooked:
                from accelerate.hooks import remove_hook_from_module

                remove_hook_from_module(module)


def _restore_slot(slot: Slot) -> None:
    current = slot.tensor.data
    if slot.original_device.type == "meta":
        return
    if slot.foreign or current.device != slot.original_device:
        slot.tensor.data = current.to(slot.original_device, copy=True)


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------
def dispatch(model: nn.Module, plan: Plan, *, offload_dir: str | os.PathLike[str] | None = None,
             disk_reads: str = "mmap", _disk_sources: Mapping[str, tuple[SafetensorsFile, str]] | None = None,
             _restore: bool = True, _hook_every_unit: bool = False) -> DispatchedModel:
    """Apply ``plan`` to ``model``: weights where the plan stores them, compute where it executes.

    Example::

        plan = placement_opt.solve(model, ["cuda:0", "cpu", "disk"])
        handle = placement_opt.dispatch(model, plan, offload_dir="/scratch/offload")
        out = handle(**inputs)          # outputs on the inputs' device
        handle.remove()

    Args:
        model: an ``nn.Module`` with real weights (anywhere); unit names in the plan are its
            qualified module names.
        plan: the placement; every unit of the plan must name a module of ``model``.
        offload_dir: directory for the safetensors files of disk-stored units, written once
            per version of their weights and reused after a check of their bytes; threads and
            processes may share it (:class:`~placement_opt.offload.OffloadStore`). Not needed
            when the disk units' weights already come from checkpoint files (:func:`load`).
        disk_reads: ``"mmap"`` (default): disk units executed on the CPU compute from the memory
            map, zero copy. ``"copy"``: they are streamed, copied into RAM for each forward and
            prefetched by a background thread (for file systems where mapped reads are slow).

    Returns:
        A :class:`DispatchedModel`; ``model`` itself is modified in place (hooks, devices,
        ``model.hf_device_map`` = the plan's storage map) and is ``handle.model``.

    Raises:
        DispatchError: units missing from the model, tied weights stored on different devices,
            a CUDA device that is not present, disk units without ``offload_dir``, a model
            that accelerate has dispatched already, or (in a DDP/DeepSpeed/FSDP run) a plan that
            uses another rank's GPU.
    """
    if disk_reads not in ("mmap", "copy"):
        raise DispatchError(f"disk_reads={disk_reads!r}: accepted are 'mmap' and 'copy'")
    _check_rank(plan)
    existing = getattr(model, "_placement_opt_dispatch", None)
    if existing is not None and not existing._removed:
        raise DispatchError("this model is already dispatched: call .remove() on its handle first")
    hooked_by_accelerate = [name or type(model).__name__ for name, m in model.named_modules() if hasattr(m, "_hf_hook")]
    if hooked_by_accelerate:
        raise DispatchError(
            f"{len(hooked_by_accelerate)} module(s) carry accelerate hooks ({', '.join(hooked_by_accelerate[:3])}): "
            f"the model was dispatched by accelerate (from_pretrained(device_map=...) on several devices). "
            f"Load it with placement_opt.load(), or call accelerate.hooks.remove_hook_from_submodules(model) first"
        )
    units = _build_units(model, plan)
    slots = collect_slots(model)
    _assign_slots(units, slots, plan)
    _check_devices(units)
    _place(model, units, slots, offload_dir, disk_reads, _disk_sources)
    streamer = _Streamer()
    _link_prefetch(units)
    hf_hooked = {id(m) for m in model.modules() if hasattr(m, "_hf_hook")}
    hooked = _install_hooks(model, units, streamer, move_inputs=_hook_every_unit or None)
    # Experts kernels follow each unit's execution device, not model.device (issue 14).
    unpin = pin_experts_to_devices(model, {u.name: u.execution for u in units},
                                   units[0].execution if units else torch.device("cpu"))
    had_map = "hf_device_map" in model.__dict__
    previous = model.__dict__.get("hf_device_map")
    model.hf_device_map = plan.device_map
    handle = DispatchedModel(model, plan, units, slots, streamer, hooked, previous, had_map, hf_hooked, _restore,
                             unpin)
    model._placement_opt_dispatch = handle
    return handle


def _check_rank(plan: Plan) -> None:
    """In a distributed run, a plan may use this rank's GPU only (the framework owns the others)."""
    from .runtime import check_no_cross_rank_split, detect_context

    try:
        check_no_cross_rank_split(plan, detect_context())
    except PlacementError as exc:
        raise DispatchError(str(exc)) from exc


def _build_units(model: nn.Module, plan: Plan) -> list[_Unit]:
    modules = dict(model.named_modules())
    missing = [p.unit for p in plan.placements if p.unit not in modules]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise DispatchError(
            f"{len(missing)} unit(s) of the plan are not modules of {type(model).__name__}: {shown}. "
            f"Solve the plan for this model (placement_opt.solve(model, ...))"
        )
    return [_Unit(placement=p, module=modules[p.unit], execution=_torch_device(p.execution))
            for p in plan.placements]


def _assign_slots(units: list[_Unit], slots: list[Slot], plan: Plan) -> None:
    """Give each tensor to the unit owning its first name; tied tensors must share one storage."""
    by_name = {unit.name: unit for unit in units}
    names = list(by_name)
    conflicts = []
    for slot in slots:
        owners = {unit_of(n, names) for n in slot.names} - {None}
        storages = {by_name[o].placement.storage for o in owners}
        if len(storages) > 1:
            conflicts.append(f"{'/'.join(slot.names)} stored on {sorted(storages)}")
        owner = unit_of(slot.names[0], names)
        if owner is not None:
            by_name[owner].slots.append(slot)
        for user in sorted(owners):
            by_name[user].uses.append(slot)
    if conflicts:
        raise DispatchError(
            f"tied weights must be stored on one device ({len(conflicts)} conflict(s)): {'; '.join(conflicts)}. "
            f"Give the units that share them the same storage"
        )


def _check_devices(units: list[_Unit]) -> None:
    wanted = sorted({d for u in units for d in (u.placement.storage, u.placement.execution)
                     if d.startswith("cuda")})
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    absent = [d for d in wanted if count == 0 or (torch.device(d).index or 0) >= count]
    if absent:
        raise DispatchError(f"the plan uses {', '.join(absent)} but this machine has {count} CUDA device(s): "
                            f"solve the plan for this machine")
    bad = [u.name for u in units if u.placement.execution == "disk"]
    if bad:
        raise DispatchError(f"units {bad} execute on 'disk', which cannot compute: execute them on cpu or a GPU")


def _place(model: nn.Module, units: list[_Unit], slots: list[Slot], offload_dir: Any,
           disk_reads: str, disk_sources: Mapping[str, tuple[SafetensorsFile, str]] | None) -> None:
    """Move or map every tensor to its storage; decide each unit's kind."""
    store = None
    for unit in units:
        storage, execution = unit.placement.storage, unit.placement.execution
        if storage == "disk":
            if disk_sources is None or any(s.names[0] not in disk_sources for s in unit.slots):
                if offload_dir is None:
                    raise DispatchError(
                        f"unit {unit.name!r} is stored on disk but dispatch() has no offload_dir: pass "
                        f"offload_dir='some/empty/dir' (its weights are written there once), or use "
                        f"placement_opt.load(), which reads them from the checkpoint"
                    )
                store = store or OffloadStore(offload_dir)
                _map_from_store(unit, store)
            else:
                _map_from_sources(unit, disk_sources)
            unit.kind = "mmap" if execution == "cpu" and disk_reads == "mmap" else "stream"
        elif storage == execution:
            for slot in unit.slots:
                _set(slot, slot.tensor.data.to(execution), foreign=False)
        else:
            pin = execution.startswith("cuda") and storage == "cpu"
            for slot in unit.slots:
                data = slot.tensor.data.to(storage)
                if pin:
                    data = data.pin_memory()
                _set(slot, data, foreign=pin)
            unit.kind = "stream"
    main = units[0].execution if units else torch.device("cpu")
    owned = {id(s) for u in units for s in u.slots}
    for slot in slots:  # tensors no unit owns (e.g. a rotary table): live on the first unit's device
        if id(slot) not in owned:
            _set(slot, slot.tensor.data.to(main), foreign=False)


def _set(slot: Slot, data: torch.Tensor, *, foreign: bool) -> None:
    slot.tensor.data = data
    slot.stored = data
    slot.foreign = slot.foreign or foreign


def _map_from_store(unit: _Unit, store: OffloadStore) -> None:
    path = store.write(unit.name, {slot.names[0]: slot.tensor.data for slot in unit.slots})
    file = SafetensorsFile(path)
    for slot in unit.slots:
        _set(slot, file.tensor(slot.names[0]), foreign=True)
        unit.disk.append((file, slot.names[0]))


def _map_from_sources(unit: _Unit, sources: Mapping[str, tuple[SafetensorsFile, str]]) -> None:
    for slot in unit.slots:
        file, key = sources[slot.names[0]]
        _set(slot, file.tensor(key), foreign=True)
        unit.disk.append((file, key))


def _link_prefetch(units: list[_Unit]) -> None:
    """Each ``stream``-mode unit prefetches the next unit of its kind, wrapping to the first."""
    for kind in ("stream", "mmap"):
        chain = [u for u in units if u.kind == kind]
        for unit, following in zip(chain, chain[1:] + chain[:1], strict=True):
            if unit.placement.mode == "stream" and following is not unit:
                unit.next_unit = following


# ---------------------------------------------------------------------------------------------
# Hooks
# ---------------------------------------------------------------------------------------------
def _install_hooks(model: nn.Module, units: list[_Unit], streamer: _Streamer,
                   move_inputs: bool | None) -> dict[nn.Module, tuple[bool, Any]]:
    """Wrap the forwards that need it; ``move_inputs=None``: when units execute on several devices."""
    hooked: dict[nn.Module, tuple[bool, Any]] = {}
    if move_inputs is None:
        move_inputs = len({u.execution for u in units}) > 1
    for unit in units:
        wrapper = _unit_forward(unit, unit.module.forward, streamer, move_inputs=move_inputs)
        if wrapper is not None:
            _wrap(unit.module, wrapper, hooked)
    main = units[0].execution if units else torch.device("cpu")
    if model not in hooked:
        _wrap(model, _entry_forward(model.forward, main), hooked)
    encoder = _separately_called_encoder(model, units)
    if encoder is not None and encoder not in hooked:
        _wrap(encoder, _entry_forward(encoder.forward, _first_execution(encoder, model, units, main)), hooked)
    return hooked


def _wrap(module: nn.Module, wrapper: Callable[..., Any], hooked: dict[nn.Module, tuple[bool, Any]]) -> None:
    had_own = "forward" in module.__dict__
    hooked[module] = (had_own, module.__dict__.get("forward"))
    module.forward = wrapper


def _separately_called_encoder(model: nn.Module, units: list[_Unit]) -> nn.Module | None:
    """``generate()`` of encoder-decoder models calls ``model.get_encoder()`` directly."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    get_encoder = getattr(model, "get_encoder", None)
    encoder = get_encoder() if callable(get_encoder) else None
    return encoder if isinstance(encoder, nn.Module) and encoder is not model else None


def _first_execution(sub: nn.Module, model: nn.Module, units: list[_Unit], default: torch.device) -> torch.device:
    prefix = next((name for name, m in model.named_modules() if m is sub), None)
    for unit in units:
        if prefix is not None and (unit.name == prefix or unit.name.startswith(prefix + ".")):
            return unit.execution
    return default


def _entry_forward(forward: Callable[..., Any], main: torch.device) -> Callable[..., Any]:
    """The model's forward: inputs to the first unit's device, outputs back to the caller's."""

    def entry(*args: Any, **kwargs: Any) -> Any:
        caller = _first_device(args, kwargs)
        if caller is None or caller == main:
            return forward(*[_move(a, main) for a in args], **{k: _move(v, main) for k, v in kwargs.items()})
        out = forward(*[_move(a, main) for a in args], **{k: _move(v, main) for k, v in kwargs.items()})
        return _move_output(out, caller)

    return functools.wraps(forward)(entry)


def _unit_forward(unit: _Unit, forward: Callable[..., Any], streamer: _Streamer,
                  move_inputs: bool) -> Callable[..., Any] | None:
    """The wrapped forward of one unit, or None when the unit needs no per-call work."""
    device = unit.execution
    following = unit.next_unit
    if unit.kind == "stream":
        slots = unit.uses

        def streamed(*args: Any, **kwargs: Any) -> Any:
            weights = streamer.take(unit)
            if following is not None:
                streamer.start(following)
            for slot, data in zip(slots, weights, strict=True):
                slot.tensor.data = data
            try:
                if move_inputs:
                    args = tuple(_move(a, device) for a in args)
                    kwargs = {k: _move(v, device) for k, v in kwargs.items()}
                return forward(*args, **kwargs)
            finally:
                for slot in slots:
                    slot.tensor.data = slot.stored

        return functools.wraps(forward)(streamed)
    if unit.kind == "mmap" and following is not None:
        ahead = [(file, key) for file, key in following.disk]

        def mapped(*args: Any, **kwargs: Any) -> Any:
            for file, key in ahead:
                file.prefetch((key,))
            if move_inputs:
                args = tuple(_move(a, device) for a in args)
                kwargs = {k: _move(v, device) for k, v in kwargs.items()}
            return forward(*args, **kwargs)

        return functools.wraps(forward)(mapped)
    if not move_inputs:
        return None

    def moved(*args: Any, **kwargs: Any) -> Any:
        return forward(*[_move(a, device) for a in args], **{k: _move(v, device) for k, v in kwargs.items()})

    return functools.wraps(forward)(moved)


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
def load(model_id_or_path: str | os.PathLike[str], devices: Any, *, objective: str = "latency",
         workload: Any = None, dtype: torch.dtype | str | None = None,
         offload_dir: str | os.PathLike[str] | None = None, plan: Plan | None = None) -> DispatchedModel:
    """Build a model on the meta device, solve its placement, read every weight straight to its place.

    Each tensor goes from the checkpoint's safetensors files straight to its storage device:
    GPU tensors are read one by one through pinned memory; CPU- and disk-stored tensors in the
    checkpoint's dtype are views of the memory-mapped shards (zero copy, copy-on-write; CPU ones
    are read ahead at once, disk ones when first used); other dtypes are read and cast one
    tensor at a time. The whole model is never in RAM twice, and disk units never enter it.

    Example::

        handle = placement_opt.load("out/my-llama", ["cuda:0", "cpu", "disk"], dtype="float16")
        tokens = handle.generate(input_ids, max_new_tokens=32)

    Args:
        model_id_or_path: a local directory written by ``save_pretrained`` (``config.json`` and
            ``model.safetensors`` or a ``model.safetensors.index.json`` with shards).
        devices: anything :func:`placement_opt.solve` accepts (``["cuda:0", "cpu", "disk"]``,
            a ``Machine``, a ``max_memory`` dict); ignored when ``plan`` is given.
        objective: ``"latency"``, ``"throughput"`` or ``"memory"``, passed to the solver.
        workload: the :class:`~placement_opt.workload.Workload` to optimise for.
        dtype: weights' dtype; default: the checkpoint's. Disk-stored units whose checkpoint
            dtype differs are converted once into ``offload_dir``.
        offload_dir: where converted disk weights go (only needed in that case).
        plan: a plan to use instead of solving.

    Returns:
        A :class:`DispatchedModel` in eval mode.

    Raises:
        DispatchError: no safetensors checkpoint in the directory, or a weight the model needs
            is missing from it.
    """
    root = Path(model_id_or_path)
    files = checkpoint_files(root)
    model = meta_model(root, dtype)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # before reading, so tied names share one tensor and are read once
    if plan is None:
        from .solve import solve  # written by the solver stage

        plan = solve(model, devices, objective=objective, workload=workload)
    sources = checkpoint_index(files)
    if needs_conversion(model, sources):
        return _load_converted(root, model, plan, offload_dir)
    disk_sources = materialize(model, plan, sources, offload_dir)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    model.eval()
    return dispatch(model, plan, offload_dir=offload_dir, _disk_sources=disk_sources, _restore=False)


def _load_converted(root: Path, skeleton: nn.Module, plan: Plan, offload_dir: Any) -> DispatchedModel:
    """Checkpoints in an older layout (MoE experts one tensor each, fused by transformers at load):
    transformers reads and converts them into RAM, then the plan is applied (disk units are
    written once to ``offload_dir``)."""
    if offload_dir is None and any(p.storage == "disk" for p in plan.placements):
        raise DispatchError(
            f"{root} stores weights in a layout transformers converts at load time ({type(skeleton).__name__}), "
            f"so they cannot be mapped from the checkpoint: pass offload_dir='some/dir' for the disk units"
        )
    dtype = next(iter(skeleton.parameters())).dtype
    model = type(skeleton).from_pretrained(root, dtype=dtype).eval()
    return dispatch(model, plan, offload_dir=offload_dir, _restore=False)

