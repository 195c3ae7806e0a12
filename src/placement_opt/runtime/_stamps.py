"""Per-unit seconds of a forward: a mark at every unit's call, on the host's clock or a GPU's stream.

A unit's time runs from its call to the next unit's call (or the forward's end), so the glue between units
counts with the unit before it and the units add up to the whole forward. On a GPU each mark is a CUDA event on
the current stream: a unit's time is when the GPU reached its call and the next one, which for a unit the host
runs (on the CPU) is when the host did, as it waits for its inputs. :mod:`.calibrate` times units with it;
:mod:`.breakdown` times a dispatched model's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["Stamps"]


class Stamps:
    """Per-unit seconds of one forward: from a unit's call to the next unit's call (or the end)."""

    def __init__(self, modules: Mapping[str, nn.Module], device: torch.device, routed: Collection[str] = ()) -> None:
        self.device = device
        self.routed = frozenset(routed)
        """Units whose decode steps are averaged, not their median taken (:func:`typical`'s ``mean_of``)."""
        self.marks: list[tuple[str, Any]] = []
        # first among the module's pre-hooks: what the others do at the unit's call (a routed-read hook's asks for
        # the router's picks) counts with the unit, not with the unit before it
        self.handles = [module.register_forward_pre_hook(self._hook(name), prepend=True)
                        for name, module in modules.items()]

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
