"""A plan without contiguity made into one with it: a start, and through its free solve a bound, for
``contiguous`` problems.

Torch-free. A ``contiguous`` problem (each device stores one range of units) is the same problem as
without contiguity plus one constraint, so the free problem's proven bound bounds it too, and the free
problem is the easy one: without the order to keep, its plans come quickly. (The counted relaxation of
:mod:`.aggregate` bounds both, the contiguous one with its ranges over whole runs.) What the free plan lacks
is the order: :func:`ranged` reorders it.

Units next to each other with the same placements on offer and the same weights (a run of decoder
layers, not tied or pinned) may trade placements: any order of the same placements stores the same bytes
on every device, and computes about the same work (the first layer's prices may differ a little from the
others'); the transfers between them and the order of the copies change. The caller prices the result
exactly. So within each such segment the placements are sorted by storage device: the devices of the
units before the segment first (the nearest last), the devices of the units after it last (the nearest
first), the others in between in the order the plan first stores on them.

The units outside the segments (embedding, rotary tables, final norm, output head) cannot trade, and often
break the ranges on their own: an embedding kept on the CPU while the CPU's layers sit mid-model.
:func:`contiguous_start` then moves such a unit, or a run of them next to each other (with the units tied to
them), onto the storage device of the stored unit before or after it, or onto a device that stores nothing yet
(from the first plan, a run at either end of the model onto any device: the segment next to it reorders to suit,
as when an embedding joins the GPU whose layers then come first), each to its cheapest option there (the same
execution device where it has one); where the move does not fit, it makes it once more with room: segment units
on the target device moved to the device the run's largest unit left (else to the first device with room that
takes them: a full CPU leaves the disk), one after another until it fits (the room a 1 GB output head needs on a
full GPU: one layer's). A reordered plan can be over a device the free plan fitted (streamed layers' copy buffers
depend on their neighbours): it is not valid, but moves start from it, and room is made the same way on any
device a move leaves over its capacity. It goes best first, from the plan tried with the fewest extra ranges and
the lowest price, to plans with at most one range more (a move that makes room often breaks a range the next move
mends) and never back to a plan already seen, and returns the cheapest valid plan met within :data:`MOST_TRIED`
moves.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Iterator, Mapping, Sequence

from .problem import PlacementOption, PlacementProblem
from .starts import fits

__all__ = ["contiguous_start", "ranged", "segments", "MOST_TRIED", "MOST_FIXED", "MOST_MADE_ROOM", "CLOSE"]

#: Moves :func:`contiguous_start` tries (each one move of fixed units from a plan tried before): all of them unless
#: time runs out, as the first valid plan met is seldom the cheapest. On the block graphs of the solve_time grid
#: they take 1-130 ms (300 took twice that for the same plans); the grid went from 146 to 150 of 165 cells within
#: 1 % at 1 s against stopping at the first valid plan (Llama-3-70B on 8x L4, batch 16: a start of 117.2 s against
#: 154.4 s, where the plan without contiguity prices 115.7 s).
MOST_TRIED = 150
#: Most fixed units :func:`contiguous_start` moves among. A sublayer or module graph has a fixed unit wherever
#: neighbours differ (attention, then MLP): hundreds of moves per plan, tried for 0.07-0.23 s of a 1 s solve on
#: the sublayer graphs of Llama-3-8B, Mixtral-8x7B and Llama-3-70B, none of them to a valid plan.
MOST_FIXED = 16
#: Most segment units :func:`_made_room` moves off a device to make room for one fixed unit: Qwen2-72B's 2.5 GB
#: embedding takes two of its layers' room on an A100-40GB holding batch 16's KV cache.
MOST_MADE_ROOM = 4
#: :func:`contiguous_start` stops at a valid plan within this share of the plan it was given (which prices what
#: contiguity would cost nothing): the search to a cheaper one took 0.1-0.3 s of a 1 s solve on Llama-3.1-405B's
#: block graph on 8x L4 for none.
CLOSE = 0.001


def contiguous_start(problem: PlacementProblem, choice: Sequence[int], objective: str,
                     until: float | None = None) -> list[int] | None:
    """``choice`` (a plan without contiguity) made valid for the ``contiguous`` problem: :func:`ranged`, then moves
    of fixed units (module docstring); the cheapest valid plan met (by ``objective``), or None when none was met
    within :data:`MOST_TRIED` moves and the time until ``until`` (``time.perf_counter()``), or when the reordered
    plan is not valid and more than :data:`MOST_FIXED` units are fixed. Checked for memory, pins, ties and
    contiguity (:func:`~.starts.fits`); the caller compares its price."""
    free = dataclasses.replace(problem, contiguous=False)
    segs = segments(problem)
    fixed = sorted(set(problem.stored_units).difference(*(range(a, b) for a, b in segs)))
    first = ranged(problem, choice, segs)
    first_extra = problem.extra_ranges(problem.options(first))
    if not first_extra and fits(free, first):
        return first
    if len(fixed) > MOST_FIXED:
        return None
    # the first plan is not valid (extra ranges, or a device its reorder overran by copy buffers): moves start from it
    tried, pushed = itertools.count(), itertools.count()  # moves tried; order of equal plans in the heap
    frontier = [(first_extra, 0, next(pushed), first)]
    seen = {tuple(first)}
    valid: list[tuple[int, list[int]]] = []  # (price, plan) of the valid plans met
    close = problem.objective_value(choice, objective) * (1 + CLOSE)  # no start need be cheaper than this
    out_of_moves = False
    while frontier and not out_of_moves:
        extra, value, _, current = heapq.heappop(frontier)
        if not extra and current is not first:
            valid.append((value, current))
            continue
        for moved in _moves(problem, free, current, fixed, segs, wide=current is first):
            if out_of_moves := next(tried) > MOST_TRIED or (until is not None and time.perf_counter() > until):
                break
            moved = ranged(problem, moved, segs)
            if tuple(moved) not in seen and (fewer := problem.extra_ranges(problem.options(moved))) <= extra + 1 and fits(free, moved):
                heapq.heappush(frontier, (fewer, price := problem.objective_value(moved, objective), next(pushed), moved))
                if out_of_moves := not fewer and price <= close:
                    break
            seen.add(tuple(moved))
    valid += [(value, plan) for extra, value, _, plan in frontier if not extra]  # met, not yet popped (first is popped)
    return min(valid, key=lambda found: found[0])[1] if valid else None


def segments(problem: PlacementProblem) -> list[tuple[int, int]]:
    """``(first, end)`` ranges of two or more consecutive units that may trade placements: the same placements
    on offer (:attr:`~.specs.PlacementOption.kind`), the same largest stored bytes, none tied or pinned."""
    special = {n for g in problem.tied_groups for n in g} | set(problem.pins)
    kinds = [None if u.name in special else (frozenset(o.kind for o in u.options), max(o.stored_bytes for o in u.options))
             for u in problem.units]
    out: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] is None or kinds[i] != kinds[first]:
            if i - first > 1 and kinds[first] is not None:
                out.append((first, i))
            first = i
    return out


def ranged(problem: PlacementProblem, choice: Sequence[int],
           segs: Sequence[tuple[int, int]] | None = None) -> list[int]:
    """``choice`` with each segment's placements sorted by storage device, so that every device stores one
    range where the segments alone break them (module docstring). Not checked: the caller does. ``segs``:
    :func:`segments` of ``problem`` when the caller has them."""
    out = list(choice)
    stored = set(problem.stored_units)
    for first, end in segments(problem) if segs is None else segs:
        units = problem.units[first:end]
        keys = [u.options[c].kind for u, c in zip(units, out[first:end], strict=True)]
        seen = list(dict.fromkeys(k[0] for k in keys))
        rank = {d: j for j, d in enumerate(seen)}
        # devices stored after the segment go last, the nearest first; those before it first, the nearest last
        after = _stored_on(problem, out, stored, range(end, len(problem.units)))
        before = _stored_on(problem, out, stored, range(first - 1, -1, -1))
        rank.update({d: len(seen) + j for j, d in enumerate(after) if d in seen})
        rank.update({d: -1 - j for j, d in enumerate(before) if d in seen})
        keys.sort(key=lambda k: rank[k[0]])  # stable: each device's placements keep their order
        out[first:end] = [next(j for j, o in enumerate(u.options) if o.kind == k) for u, k in zip(units, keys, strict=True)]
    return out


def _stored_on(problem: PlacementProblem, choice: Sequence[int], stored: set[int], around: range) -> list[str]:
    """The storage devices of the units in ``around`` that store bytes, each once, in the order first met."""
    return list(dict.fromkeys(problem.units[i].options[choice[i]].storage for i in around if i in stored))


def _storage(problem: PlacementProblem, choice: Sequence[int]) -> list[tuple[int, str]]:
    return [(i, problem.units[i].options[choice[i]].storage) for i in problem.stored_units]


def _moves(problem: PlacementProblem, free: PlacementProblem, choice: Sequence[int], fixed: Sequence[int],
           segs: Sequence[tuple[int, int]], wide: bool = False) -> Iterator[list[int]]:
    """``choice`` with one fixed unit, or a run of fixed units next to each other, moved onto the storage device of
    the stored unit before or after it, or onto a device that stores nothing yet (a disk: a range of its own), or
    with ``wide`` (the first plan), for a run at either end of the model, onto any device; where that does not
    fit, also with room made for it (:func:`_rooms`)."""
    storage = dict(_storage(problem, choice))
    order = list(storage)
    where = {i: k for k, i in enumerate(order)}
    unused = [d.name for d in problem.devices if d.name not in storage.values()]
    runs = [[i] for i in fixed] + [r for r in _fixed_runs(order, set(fixed)) if len(r) > 1]
    for run in runs:
        first, last = where[run[0]], where[run[-1]]
        nearby = [storage[order[j]] for j in (first - 1, last + 1) if 0 <= j < len(order)]
        # the device the run's largest unit leaves: where the room made for it goes
        left = storage[max(run, key=lambda i: max(o.stored_bytes for o in problem.units[i].options))]
        # from the first plan, a run at either end of the model may also go to any device: its segment neighbours
        # reorder to suit (an embedding moved to the GPU whose layers come first)
        ends = [d.name for d in problem.devices] if wide and (first == 0 or last == len(order) - 1) else []
        for device in dict.fromkeys(nearby + unused + ends):
            if any(storage[i] != device for i in run) and (moved := _moved(problem, choice, run, device)) is not None:
                yield moved
                if not fits(free, moved):
                    yield from _rooms(problem, free, moved, device, left, segs)


def _rooms(problem: PlacementProblem, free: PlacementProblem, choice: list[int], device: str, left: str,
           segs: Sequence[tuple[int, int]]) -> Iterator[list[int]]:
    """``choice`` with room made (:func:`_made_room`) on ``device``, where a run was just moved, and on each other
    device over its capacity (a reorder changes streamed layers' copy buffers, which depend on their neighbours):
    for ``left``, the device the run left, else for the first device in the problem's order that takes the units
    (a full CPU leaves the disk); one plan per device made room on."""
    used = problem.used_bytes(problem.options(choice))
    spare = {d.name: d.capacity_bytes - used[d.name] for d in problem.devices}
    for full in [device, *(d for d, free_bytes in spare.items() if free_bytes < 0 and d != device)]:
        for other in dict.fromkeys([left, *spare]):
            if other != full and spare[other] > 0 and (room := _made_room(problem, free, choice, full, other, segs, spare)):
                yield room
                break


def _fixed_runs(order: Sequence[int], fixed: set[int]) -> list[list[int]]:
    """The runs of fixed units next to each other in ``order`` (the stored units)."""
    return [list(group) for is_fixed, group in itertools.groupby(order, key=fixed.__contains__) if is_fixed]


def _made_room(problem: PlacementProblem, free: PlacementProblem, choice: list[int], device: str, other: str,
               segs: Sequence[tuple[int, int]], spare: Mapping[str, int]) -> list[int] | None:
    """``choice`` with as few segment units stored on ``device`` as it takes (up to :data:`MOST_MADE_ROOM`) moved
    to ``other`` (room on ``device`` for the fixed unit just moved there), each to the placement a segment unit
    stored there has, else to its cheapest option there; None when that does not fit either. ``spare``: each
    device's bytes free in ``choice`` (negative: over), by which plans that cannot fit go unpriced."""
    for first, end in segs:
        units = problem.units[first:end]
        here = [first + k for k, (u, c) in enumerate(zip(units, choice[first:end], strict=True))
                if u.options[c].storage == device]
        there = [u.options[c].kind for u, c in zip(units, choice[first:end], strict=True) if u.options[c].storage == other]
        out = list(choice)
        over, room = -spare[device], spare[other]
        for i in reversed(here[-MOST_MADE_ROOM:]):
            options = problem.units[i].options
            on_other = [j for j, o in enumerate(options) if (o.kind == there[0] if there else o.storage == other)]
            if not on_other:
                break
            out[i] = min(on_other, key=lambda j: _work(options[j]))
            over -= options[choice[i]].stored_bytes
            room -= options[out[i]].stored_bytes
            if room < 0:
                break
            if over <= 0 and fits(free, out):
                return out
    return None


def _moved(problem: PlacementProblem, choice: Sequence[int], units: Sequence[int], device: str) -> list[int] | None:
    """``units`` (and the units tied to them) stored on ``device``, or None when one has no option there."""
    index = problem.index()
    names = {problem.units[i].name for i in units}
    names.update(*(g for g in problem.tied_groups if names.intersection(g)))
    out = list(choice)
    for name in names:
        i = index[name]
        spec, now = problem.units[i], problem.units[i].options[choice[i]]
        there = [k for k, o in enumerate(spec.options) if o.storage == device and problem.allows(spec, o)]
        if not there:
            return None
        out[i] = min(there, key=lambda k: (spec.options[k].execution != now.execution, _work(spec.options[k])))
    return out


def _work(option: PlacementOption) -> int:
    return option.prefill_ns + option.decode_ns
