"""The forward wrappers :func:`~.dispatcher.dispatch` installs: inputs to each unit's device, weights streamed in.

A unit's forward is wrapped only when the plan executes units on more than one device (its
inputs may need moving) or when its weights move per forward; the model's own forward is wrapped
once to move the caller's inputs to the first unit's device and return outputs on the caller's.
A ``phased`` unit's wrapper picks the phase of each call (:mod:`._phases`): a prefill streams the
weights to the prefill device like a ``stream`` unit and moves the prompt's KV cache to the decode
device afterwards; a decode computes where the weights are stored. With phased units in the plan
the model's forward also notes whether its call is a prefill, for the streamed units' prefetching.

The head of a copy group with streamed units (:func:`~._prefetch_links.link_groups`) is wrapped whatever
its kind, even a resident unit that needs nothing else: it starts its group's copies and the next
group's first thing, in the phase of the call; the group's other units only take their own weights.
What to start in each phase is fixed at dispatch, so a call only reads a tuple.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..hardware.host_copy import to_host
from . import _streamer
from ._phases import (
    CallPhase,
    call_extent,
    call_is_prefill,
    call_starts_sequence,
    call_tokens,
    move_cache_layers,
    past_plan,
    unit_is_prefill,
)
from ._prefetch_links import read_ahead
from ._streamer import DispatchUnit, Streamer

__all__ = ["install_hooks", "restore_forwards"]


def _move(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it (through tuples, lists, dicts) on ``device``; same object if none moved."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        if device.type == "cpu" and obj.is_cuda:
            return to_host(obj)  # staged through pinned memory: a pageable copy of a large output crawls
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


def install_hooks(model: nn.Module, units: list[DispatchUnit], streamer: Streamer,
                   move_inputs: bool | None, hooked: dict[nn.Module, tuple[bool, Any]],
                   home: str | None = None, planned: tuple[int, int, int] | None = None,
                   told: tuple[int, int, int] | None = None) -> None:
    """Wrap the forwards that need it; ``move_inputs=None``: when units execute on several devices.

    ``home`` (sublayer plans): the model's inputs go there, and a unit computing elsewhere hands its
    outputs back to its caller's device, so the glue between units (residual adds, routing) always
    runs on ``home``. ``planned``: the (batch, prompt, context) the plan's memory was counted for; a call
    past them is warned of, once (:func:`_watching`), unless it stays within ``told``, the workload load() warned of
    before reading.

    Each wrapped module is entered in ``hooked`` (module -> had its own forward, that forward) before
    its forward is replaced, so :func:`restore_forwards` undoes a partial installation too.
    """
    home_device = _streamer.torch_device(home) if home is not None else None
    if move_inputs is None:
        move_inputs = len({u.execution for u in units} | {u.prefill for u in units if u.prefill}
                          | ({home_device} if home_device is not None else set())) > 1
    phase = CallPhase()
    # units whose forwards swap their weights in and out, or share the streamer's copies and page releases, hold
    # state between the model's forward and theirs: calls from several threads run one at a time
    lock = threading.RLock() if any(u.kind in ("stream", "phased") or u.disk for u in units) else None
    for unit in units:
        wrapper = _unit_forward(unit, unit.module.forward, streamer, move_inputs, phase)
        if home is not None and _off_home(unit, home):
            wrapper = _returning(wrapper or unit.module.forward)
        if wrapper is not None:
            _wrap(unit.module, wrapper, hooked)
    main = home_device if home_device is not None else units[0].execution if units else torch.device("cpu")
    if model not in hooked:
        entry = _entry_forward(model.forward, main)
        if any(u.kind == "phased" for u in units):  # only then: plans without phased units keep their entry as it was
            entry = _noting_phase(entry, phase)
        if any(u.disk for u in units):  # pages of memory-mapped weights let go in the background
            entry = _settling(entry, streamer)
        if any(u.kind in ("stream", "phased") for u in units):  # copies that outlive a call
            entry = _renewing(entry, streamer)
        if planned is not None:
            entry = _watching(entry, *planned, told=told)
        _wrap(model, _one_at_a_time(entry, lock), hooked)
    encoder = _separately_called_encoder(model, units)
    if encoder is not None and encoder not in hooked:
        entry = _entry_forward(encoder.forward, _first_execution(encoder, model, units, main))
        _wrap(encoder, _one_at_a_time(entry, lock), hooked)


def restore_forwards(hooked: dict[nn.Module, tuple[bool, Any]]) -> None:
    """Put back the forwards :func:`install_hooks` replaced (last wrapped first)."""
    for module, (had_own, previous) in reversed(list(hooked.items())):
        if had_own:
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)
    hooked.clear()


def _wrap(module: nn.Module, wrapper: Callable[..., Any], hooked: dict[nn.Module, tuple[bool, Any]]) -> None:
    had_own = "forward" in module.__dict__
    hooked[module] = (had_own, module.__dict__.get("forward"))
    module.forward = wrapper


def _separately_called_encoder(model: nn.Module, units: list[DispatchUnit]) -> nn.Module | None:
    """``generate()`` of encoder-decoder models calls ``model.get_encoder()`` directly."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    get_encoder = getattr(model, "get_encoder", None)
    encoder = get_encoder() if callable(get_encoder) else None
    return encoder if isinstance(encoder, nn.Module) and encoder is not model else None


def _first_execution(sub: nn.Module, model: nn.Module, units: list[DispatchUnit], default: torch.device) -> torch.device:
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


def _off_home(unit: DispatchUnit, home: str) -> bool:
    """Whether the plan computes ``unit`` away from ``home`` in some phase (by the plan's device names)."""
    placement = unit.placement
    return placement.execution != home or placement.device_in("prefill") != home


def _returning(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A unit's forward whose outputs go back to the device its inputs came from (a sublayer plan's home)."""

    def returning(*args: Any, **kwargs: Any) -> Any:
        caller = _first_device(args, kwargs)
        out = forward(*args, **kwargs)
        return out if caller is None else _move_output(out, caller)

    return functools.wraps(forward)(returning)


def _settling(entry: Callable[..., Any], streamer: Streamer) -> Callable[..., Any]:
    """The model's forward returning once the pages its mapped units let go in the background are gone."""

    def settling(*args: Any, **kwargs: Any) -> Any:
        try:
            return entry(*args, **kwargs)
        finally:
            streamer.settle()

    return functools.wraps(entry)(settling)


def _one_at_a_time(entry: Callable[..., Any], lock: threading.RLock | None) -> Callable[..., Any]:
    """The model's forward run by one thread at a time (``lock`` None: as it is). A streamed unit's forward sets
    its weights' ``.data`` to their copy and back: a second thread's forward in the same unit would compute from
    the host memory (a device mismatch on a GPU), and the phase, the copies in flight and the releases of mapped
    pages are the whole model's. A thread's nested calls (an encoder called inside ``generate()``) go through."""
    if lock is None:
        return entry

    def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return entry(*args, **kwargs)

    return functools.wraps(entry)(one_at_a_time)


def _renewing(entry: Callable[..., Any], streamer: Streamer) -> Callable[..., Any]:
    """The model's forward copying again, when the call starts a sequence, the weights a decode step
    began copying before it returned (:meth:`Streamer.renew`): decode steps keep them."""

    def renewing(*args: Any, **kwargs: Any) -> Any:
        if streamer.inflight and call_starts_sequence(args, kwargs):
            streamer.renew()
        return entry(*args, **kwargs)

    return functools.wraps(entry)(renewing)


def _watching(entry: Callable[..., Any], batch: int, prompt: int, context: int,
              told: tuple[int, int, int] | None = None) -> Callable[..., Any]:
    """The model's forward warning once of a call past what the plan counted memory for: more tokens in the KV
    cache than ``batch x context`` (it grows with both), or more computed at once than ``batch x prompt`` (the
    activations). The plan's fit says nothing of such a call: one for 1 x 24 tokens run at 2 x 300 is an OOM the
    plan did not predict."""
    said = False

    def watching(*args: Any, **kwargs: Any) -> Any:
        nonlocal said
        extent = None if said else call_extent(args, kwargs)
        if extent is not None:
            past = past_plan(extent, (batch, prompt, context))
            if past and (told is None or past_plan(extent, told)):  # not said again of the workload load() named
                said = True
                warnings.warn(
                    f"this call {' and '.join(past)}: its KV cache and activations take more memory than the plan "
                    f"counted, and may not fit; solve the plan for this workload (workload=Workload(batch_size=..., "
                    f"prompt_len=..., new_tokens=...))", UserWarning, stacklevel=_caller_level())
        return entry(*args, **kwargs)

    return functools.wraps(entry)(watching)


def _caller_level() -> int:
    """The ``stacklevel`` that names the caller's own line: the first frame outside torch, transformers and this
    package (a warning raised inside a forward would else point at torch's ``Module._call_impl``)."""
    packages = [sys.modules.get(name) for name in ("torch", "transformers", __name__.split(".")[0])]
    libraries = tuple(os.path.dirname(p.__file__) + os.sep for p in packages if p is not None and p.__file__)
    frame, level = sys._getframe(2), 2  # the caller of the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(libraries):
        frame, level = frame.f_back, level + 1
    return level


def _noting_phase(entry: Callable[..., Any], phase: CallPhase) -> Callable[..., Any]:
    """The model's forward noting whether its call is a prefill before any unit runs."""

    def noting(*args: Any, **kwargs: Any) -> Any:
        phase.prefill = call_is_prefill(args, kwargs)
        return entry(*args, **kwargs)

    return functools.wraps(entry)(noting)


def _unit_forward(unit: DispatchUnit, forward: Callable[..., Any], streamer: Streamer,
                  move_inputs: bool, phase: CallPhase) -> Callable[..., Any] | None:
    """The wrapped forward of one unit, or None when the unit needs no per-call work."""
    if unit.kind == "phased":
        return _phased_forward(unit, forward, streamer, phase)  # starts its group's copies once it knows its phase
    wrapper = _own_forward(unit, forward, streamer, move_inputs, phase)
    if unit.heads_group:
        return _heading(unit, wrapper or forward, streamer, phase)
    return wrapper


def _own_forward(unit: DispatchUnit, forward: Callable[..., Any], streamer: Streamer,
                 move_inputs: bool, phase: CallPhase) -> Callable[..., Any] | None:
    """What a unit other than phased does for itself each call (its weights, its inputs), or None."""
    device = unit.execution
    if unit.kind == "stream":
        return _streamed_forward(unit, forward, streamer, move_inputs, phase)
    if unit.kind == "mmap":
        ahead = read_ahead(unit.next_unit)

        def mapped(*args: Any, **kwargs: Any) -> Any:
            streamer.settle()  # the unit before has let its pages go: the process maps this unit's alone
            streamer.read_ahead(ahead.keys(call_tokens(args, kwargs)))
            if move_inputs:
                args = tuple(_move(a, device) for a in args)
                kwargs = {k: _move(v, device) for k, v in kwargs.items()}
            try:
                return forward(*args, **kwargs)
            finally:  # its pages leave the process (the page cache keeps them): the RSS holds about one unit's
                streamer.release(unit)

        return functools.wraps(forward)(mapped)
    if not move_inputs:
        return None

    def moved(*args: Any, **kwargs: Any) -> Any:
        return forward(*[_move(a, device) for a in args], **{k: _move(v, device) for k, v in kwargs.items()})

    return functools.wraps(forward)(moved)


def _heading(unit: DispatchUnit, forward: Callable[..., Any], streamer: Streamer,
             phase: CallPhase) -> Callable[..., Any]:
    """A copy group's head: start its group's copies and the next group's (``unit.ahead``), then run.

    First thing, whatever the head computes: the copies then run beside the whole group, and the next
    group's queue behind this one's in the prefetch thread.
    """
    in_decode, in_prefill = unit.ahead, unit.ahead_prefill

    def heading(*args: Any, **kwargs: Any) -> Any:
        for other in in_prefill if phase.prefill else in_decode:
            streamer.start(other)
        return forward(*args, **kwargs)

    return functools.wraps(forward)(heading)


def _streamed_forward(unit: DispatchUnit, forward: Callable[..., Any], streamer: Streamer, move_inputs: bool,
                      phase: CallPhase) -> Callable[..., Any]:
    """A streamed unit's forward: take its copied weights, start the next group's copies, run, put back.

    Only a unit alone in its copy group starts copies here (``unit.ahead``, in a prefill ``ahead_prefill``,
    phased units included): a group's head started its group's first thing (:func:`_heading`). A unit of
    the only group streaming in a decode starts its own copy again, for the next step (``unit.again``).
    """
    device, slots = unit.streams_to, unit.uses
    in_decode, in_prefill = ((), ()) if unit.heads_group else (unit.ahead, unit.ahead_prefill)
    in_decode += unit.again  # the only group streaming in a decode: its copies for the next step

    def streamed(*args: Any, **kwargs: Any) -> Any:
        if any(slot.tensor.data_ptr() != slot.stored.data_ptr() for slot in slots):
            streamer.adopt(slots)  # the caller assigned `.data` since the last forward: copy that, not the old
        weights = streamer.take(unit)
        for other in in_prefill if phase.prefill else in_decode:
            streamer.start(other)
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
            streamer.finished(device)  # its weights are free once the GPU has run what it queued

    return functools.wraps(forward)(streamed)


def _phased_forward(unit: DispatchUnit, forward: Callable[..., Any], streamer: Streamer,
                    phase: CallPhase) -> Callable[..., Any]:
    """A phased unit's forward: the prefill streamed to its prefill device, the decode where it is stored."""
    name, layer_ids, decode_device = unit.name, unit.layer_ids, unit.execution
    prefill = _streamed_forward(unit, forward, streamer, True, phase)
    # a disk unit decodes from the memory map: read the next mapped unit ahead, as mmap units do
    ahead = read_ahead(unit.next_unit if unit.disk else None)
    # a copy group's head starts its group's copies and the next group's in the phase it finds
    in_decode, in_prefill = (unit.ahead, unit.ahead_prefill) if unit.heads_group else ((), ())

    def phased(*args: Any, **kwargs: Any) -> Any:
        if unit_is_prefill(name, layer_ids, args, kwargs, phase.prefill):
            phase.prefill = True
            for other in in_prefill:
                streamer.start(other)
            # a cache layer filled elsewhere before (a static cache, reset) is written where the prefill runs
            move_cache_layers(name, layer_ids, args, kwargs, unit.streams_to)
            out = prefill(*args, **kwargs)
            move_cache_layers(name, layer_ids, args, kwargs, decode_device)
            return out
        phase.prefill = False
        for other in in_decode:
            streamer.start(other)
        streamer.drop(unit)  # a prefetch started for a prefill this call is not
        streamer.settle()  # as an mmap unit: the pages let go before are gone before this one maps its own
        streamer.read_ahead(ahead.keys(call_tokens(args, kwargs)))
        try:
            return forward(*[_move(a, decode_device) for a in args],
                           **{k: _move(v, decode_device) for k, v in kwargs.items()})
        finally:
            if unit.disk:  # decoded from the map: its pages leave the process, as an mmap unit's do
                streamer.release(unit)

    return functools.wraps(forward)(phased)
