"""How :func:`~.calibrate.calibrate` clocks a forward: per-unit stamps, and how many calls make a figure.

A unit's time runs from its call to the next unit's call (:class:`~._stamps.Stamps`), so the glue between units
counts with the unit before it and the units add up to the whole forward. :func:`repeated` decides how many calls
are timed (a warm-up first, more for fast forwards, one for slow ones, a first-call stall never the figure);
:func:`typical` takes each unit's median over them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from torch import nn

from ..model.graph import LayerGraph
from ._stamps import Stamps
from .timing import last_logits_argument

__all__ = ["repeated", "typical", "routed_units", "unit_modules", "logits_argument", "MIN_TIMED_S", "MAX_RUNS",
           "FAST_FORWARD_S", "SLOW_FORWARD_S", "STALL_RATIO"]

#: Timed forwards of one shape go on until they add up to this (the median counts, per unit).
MIN_TIMED_S = 0.5
#: At most this many timed forwards of one shape.
MAX_RUNS = 20
#: A warm-up faster than this is followed by two more (first calls of small shapes run slow).
FAST_FORWARD_S = 0.2
#: A warm-up slower than this is followed by one timed call only, the figure alone: a 7B layer's 32-token
#: prefill takes ~1 s on 2 cores, and repeating it would cost seconds per prompt length ...
SLOW_FORWARD_S = 0.5
#: ... unless that call ran this many times faster than the warm-up: then the warm-up was a first-call stall,
#: not a slow forward, and the call is the warm-up in its place (see :func:`repeated`).
STALL_RATIO = 2.0


def typical(runs: Iterable[Mapping[str, float]], mean_of: Collection[str] = ()) -> dict[str, float]:
    """The median seconds of each unit over the runs: on a machine other jobs share, the fastest run
    is luck and the slowest a busy moment, while a plan runs through the usual ones. The units in
    ``mean_of`` get the mean: experts whose work depends on where the router sends each step's tokens
    (a group of a layer's experts runs in some decode steps and idles in the others), whose cost per step
    is the average, not the usual step (the median of a group busy in fewer than half the steps is its idle
    time)."""
    by_unit: dict[str, list[float]] = {}
    for run in runs:
        for name, seconds in run.items():
            by_unit.setdefault(name, []).append(seconds)
    return {name: (statistics.fmean if name in mean_of else statistics.median)(values)
            for name, values in by_unit.items()}


def routed_units(graph: LayerGraph, names: Iterable[str]) -> list[str]:
    """The MoE units among ``names``: their decode figures are means over the steps (:func:`typical`'s ``mean_of``)."""
    return [name for name in names if graph.unit(name).is_moe]


def unit_modules(model: nn.Module, graph: LayerGraph) -> dict[str, nn.Module]:
    """The modules of ``graph``'s units that the cut copy has (the layers beyond the cut are gone)."""
    present = dict(model.named_modules())
    return {name: present[name] for name in graph.names() if name in present}


def repeated(call: Callable[[], Any], stamps: Stamps, repeats: int) -> tuple[list[dict[str, float]], Any]:
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


def _clocked(call: Callable[[], Any], stamps: Stamps) -> tuple[float, tuple[dict[str, float], Any]]:
    """The wall-clock seconds of one stamped call, and what :meth:`Stamps.run` returned."""
    start = time.perf_counter()
    ran = stamps.run(call)
    return time.perf_counter() - start, ran


def logits_argument(model: nn.Module, kept: str) -> dict[str, int]:
    """``logits_to_keep=1`` where the model takes it and generation keeps the last position only."""
    return last_logits_argument(model) if kept == "last" else {}
