"""The undo log of :func:`~.dispatcher.dispatch`: every change it makes, undone last-first.

Dispatch enters each change in an :class:`UndoLog` before making it: when anything fails, the log
is unwound before the error leaves and the model is bitwise, device-wise and attribute-wise what it
was; on success the log goes to the :class:`~.dispatcher.DispatchedModel`, whose ``remove()``
unwinds it. :class:`Weights` keeps the tensors dispatch re-pointed (put back as they were after a
failure, copied home by ``remove()``); :func:`attribute_restorer` puts an attribute back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .checkpoint import Slot

__all__ = ["UndoLog", "Weights", "attribute_restorer", "restore_slot"]


class UndoLog:
    """What dispatch changed, as steps undone last-first; :attr:`doing` names the step in progress."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], None]]] = []
        self.doing = "checking the plan"

    def push(self, what: str, undo: Callable[[], None]) -> None:
        """Enter ``undo`` before making the change it undoes (so a change half made is undone too)."""
        self._steps.append((what, undo))

    def unwind(self) -> list[str]:
        """Run every undo step, last first, even when one fails; returns what failed."""
        failures = []
        while self._steps:
            what, undo = self._steps.pop()
            try:
                undo()
            except Exception as exc:  # noqa: BLE001 - the other steps must still run
                failures.append(f"{what}: {type(exc).__name__}: {exc}")
        return failures


class Weights:
    """The tensors dispatch re-pointed; put back as they were (failure) or copied home (``remove()``)."""

    def __init__(self, slots: list[Slot], restore: bool) -> None:
        self.slots = slots
        self.restore = restore
        self.originals: dict[int, tuple[Slot, torch.Tensor]] = {}

    def record(self, slot: Slot) -> None:
        """Keep the tensor's own data before its first change (the same memory, nothing is copied)."""
        if id(slot) not in self.originals:
            self.originals[id(slot)] = (slot, slot.tensor.data)

    def commit(self) -> None:
        """Dispatch succeeded: let the original memory go; ``remove()`` copies the weights back instead."""
        self.originals.clear()

    def undo(self) -> None:
        if self.originals:  # dispatch failed: the original tensors themselves, bitwise and device-wise
            for slot, data in reversed(list(self.originals.values())):
                slot.tensor.data = data
            self.originals.clear()
        elif self.restore:
            for slot in self.slots:
                restore_slot(slot)


def attribute_restorer(module: nn.Module, name: str) -> Callable[[], None]:
    """An undo step putting ``module.<name>`` back as it is now (absent stays absent)."""
    had = name in module.__dict__
    previous = module.__dict__.get(name)

    def restore() -> None:
        if had:
            module.__dict__[name] = previous
        else:
            module.__dict__.pop(name, None)

    return restore


def restore_slot(slot: Slot) -> None:
    """Copy ``slot``'s tensor back into ordinary memory on its original device (meta stays as it is)."""
    current = slot.tensor.data
    if slot.original_device.type == "meta":
        return
    if slot.foreign or current.device != slot.original_device:
        slot.tensor.data = _copied(current, slot)


def _copied(data: torch.Tensor, slot: Slot) -> torch.Tensor:
    """``data`` copied to ``slot``'s original device, in its original layout where it had one of its own (the
    offload files hold contiguous tensors): a transposed buffer comes back transposed, and the reductions over it
    run in the order they ran before dispatch."""
    layout = slot.original_layout
    if layout is None or layout[0] != data.shape:
        return data.to(slot.original_device, copy=True)
    shape, stride = layout
    return torch.empty_strided(shape, stride, dtype=data.dtype, device=slot.original_device).copy_(data)
