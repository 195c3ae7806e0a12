"""Local search on the exact price: like units swapped, or moved to options their likes use (any option,
for a unit alone in its menu).

Each step is kept while it lowers the plan's latency. Torch-free; :func:`~.search.solve_problem` runs it
on the start of the full CP-SAT solve when some option copies beside the compute
(``Workload(overlap=True)``). There a streamed unit's stall depends on what computes before it
(:func:`~.problem.stalls`), so the *order* of the same counts decides the price; the counting
relaxations read their counts into an order by rule (:mod:`.aggregate`, :mod:`.relax`), and the full
model's stall rows (big-M) leave CP-SAT's search slow to reorder. Mixtral-8x7B on RTX 4090 + 3090
(chat, overlap): a relaxation proved 46.97 s and its counts read into a plan priced 53.81 s, which the
full model took to 52.41 s in the 0.75 s it had; swaps of units at most two apart and option moves take
that start to 47.28 s in 0.2 s.

A step changes one window at a time, and the relaxations' counts often read into orders that only many
steps together would repair. So when a descent ends with prices left, the search descends again from the
start's options dealt out anew among like units by a rule that knows what each copy needs hidden
(:func:`sequenced`, once per phase), and keeps the best plan of the descents. Mistral-7B on an RTX 3060
(batch 16 x 1024 + 128, overlap): from a 53.28 s start, one descent stops at 51.24 s; the start dealt out
for the decode prices 54.86 s and descends to 49.01 s (the relaxation's bound: 47.33 s).

Every step keeps the plan valid (:meth:`~.problem.PlacementProblem.satisfies`), so the result is a plan
of the real problem; it says nothing about the bound.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .problem import PHASES, PlacementOption, PlacementProblem

__all__ = ["polish", "sequenced", "arranged", "balanced", "SWAP_RADIUS", "MOST_PRICES"]

#: Farthest apart, in execution order, two units may be to swap places: a stall depends on the units since
#: the previous streamed one, so near swaps are the ones that change it, and each sweep prices about
#: ``SWAP_RADIUS`` x units plans.
SWAP_RADIUS = 2
#: Most plans one polish prices. Bounds its time where the deadline does not come first, so that a
#: one-worker solve stays reproducible (the deadline, a wall clock, would end it at a different step each
#: run); about 1.2 s of pricing for 36 units on this project's 2-core machine (0.3 ms a step).
MOST_PRICES = 4000


def polish(problem: PlacementProblem, choice: Sequence[int], deadline: float,
           most: int = MOST_PRICES) -> list[int]:
    """``choice`` improved by first-improvement local search on its exact latency, until no step improves
    it, ``most`` plans were priced, or ``time.perf_counter()`` passes ``deadline``.

    Steps: swap two units with the same option menu (the same tuple) and different options, at most
    :data:`SWAP_RADIUS` apart; move one unit to an option another unit of its menu uses, or to any option of
    its menu when no other unit has that menu (an embedding, lm_head). The search descends
    from ``choice``, then, with what is left, from ``choice`` :func:`sequenced` for each phase, and keeps
    the best plan it saw. An invalid ``choice`` is returned as it is.

    Example::

        better = polish(problem, hint, time.perf_counter() + 0.2)
        assert problem.objective_value(better, "latency") <= problem.objective_value(hint, "latency")
    """
    start = list(choice)
    if not problem.satisfies(start):
        return start
    budget = _Budget(most, deadline)
    best, value = _descend(problem, start, problem.objective_value(start, "latency"), budget)
    seen = {tuple(start)}
    for phase in PHASES:  # each later start gets what the descents before it left
        trial = sequenced(problem, start, phase)
        if tuple(trial) in seen or not budget.take() or not problem.satisfies(trial):
            continue
        seen.add(tuple(trial))
        found, found_value = _descend(problem, trial, problem.objective_value(trial, "latency"), budget)
        if found_value < value:
            best, value = found, found_value
    return best


def _descend(problem: PlacementProblem, start: list[int], value: int, budget: _Budget) -> tuple[list[int], int]:
    """First-improvement descent from the valid ``start`` (latency ``value``): where it stopped, and its latency."""
    best = list(start)
    improved = True
    while improved and budget.left():
        improved = False
        for trial in _steps(problem, best):
            if not budget.take():
                break
            if problem.satisfies(trial) and (v := problem.objective_value(trial, "latency")) < value:
                best[:], value, improved = trial, v, True
    return best, value


def sequenced(problem: PlacementProblem, choice: Sequence[int], phase: str) -> list[int]:
    """``choice``'s options dealt out again, unit by unit in execution order, each unit taking one of the
    options its like units (the same menu) use, so that the copies of ``phase`` (one of :data:`PHASES`)
    wait little: a streamed option whose copy the compute since the previous streamed unit already hides
    comes first (the largest such copy); else the option that hides what the smallest copy left needs
    (the smallest enough, or the largest there is); a streamed one only when nothing else is left.

    Every menu keeps its counts, so bytes and work per device do not change; the order, and with it the
    stalls and the transfers between devices, does. With copy groups the bytes may change too (a group's
    buffer holds those of its units that stream), so the result can overfill a device. A rule, not a
    search: :func:`polish` checks and prices it.
    """
    units = problem.units
    chosen = problem.options(choice)
    left: dict[int, Counter[int]] = {}
    for u, c in zip(units, choice, strict=True):
        left.setdefault(id(u.options), Counter())[c] += 1
    streamed = [i for i, o in enumerate(chosen) if o.copy_in(phase) > 0]
    if not streamed:
        return list(choice)
    # the decode is cyclic: the first unit runs after the last streamed one of the step before
    beside = sum(getattr(o, phase) for o in chosen[streamed[-1]:]) if phase == "decode_ns" else 0
    copies = Counter(chosen[i].copy_in(phase) for i in streamed)
    out = []
    for u, original in zip(units, choice, strict=True):
        counts = left[id(u.options)]
        pick = _pick(u.options, counts, beside, phase, original, min(copies, default=0))
        _take_one(counts, pick)
        option = u.options[pick]
        out.append(pick)
        if option.copy_in(phase) > 0:
            _take_one(copies, option.copy_in(phase))
            beside = getattr(option, phase)
        else:
            beside += getattr(option, phase)
    return out


def arranged(problem: PlacementProblem, choice: Sequence[int], phase: str) -> list[int]:
    """``choice`` with the options of each run of consecutive like units (one menu; no pinned or tied unit)
    dealt out anew as windows, so that the copies of ``phase`` wait little: each streamed unit of the run
    after its share of the run's other units, dealt largest first to the window whose copy the compute
    before it covers least. The run's first window counts what computes outside the run since the streamed
    unit before it (in the decode round the cycle, back to the run's own last streamed unit when no other
    unit streams; in the prefill from the call's start when none streams before it), so a streamed unit
    placed first behind a CPU-computed lm_head needs nothing of the run. When a streamed unit outside the
    run follows it (a streamed lm_head), the run's tail, after its last streamed unit, is one more window:
    that unit's copy less what computes between the run and it.

    Where :func:`sequenced` deals unit by unit without looking ahead, this balances the windows of a run
    whole. The counted relaxations' plain reads keep a run's interior in one block per device and their
    spreading ignores what lies outside the interior: on the H100 host's Llama-3-8B at 4 GiB (batch 16 x 512
    + 32, overlap) the aggregated relaxation's optimum read into 4.727 s, and, arranged for the decode,
    4.509 s (its bound 4.459 s), where the 1 s solve had stopped at 4.649 s. Without the tail, Mistral-7B
    on an RTX 3060 (8064 + 128 tokens, overlap) read into 24.12 s, where the streamed lm_head's copy waited, a
    start the polish could not leave (23.53 s from the spread read); with it, 23.55 s. A rule, not a search:
    callers price it. Problems with copy runs (sublayer graphs) are returned as they are.
    """
    out = list(choice)
    if problem.copy_runs is not None:
        return out
    for lo, hi in _like_runs(problem):
        around = _around(problem.options(out), lo, hi, phase)
        out[lo:hi + 1] = _dealt(out[lo:hi + 1], problem.units[lo].options, phase, around)
    return out


def balanced(units: list[int], opts: Sequence[PlacementOption], phase: str) -> list[int]:
    """``units`` (option indices of like units, in a cycle of their own) as windows, each a streamed unit (copied in
    ``phase``) after its share of the rest: the rest dealt out largest first, each to the window whose copy is least
    covered by the compute before it (the streamed unit ahead of the window included), each window's units in the
    order ``units`` had them. :func:`arranged`'s dealing with nothing around the units."""
    return _dealt(units, opts, phase, _Around(0, True, None))


def _like_runs(problem: PlacementProblem) -> list[tuple[int, int]]:
    """``(first, last)`` of each run of two or more consecutive units sharing one menu, none pinned or tied."""
    special = {n for g in problem.tied_groups for n in g} | set(problem.pins)
    runs: list[tuple[int, int]] = []
    start = 0
    units = problem.units
    for i in range(1, len(units) + 1):
        if i == len(units) or units[i].options is not units[start].options or units[i].name in special:
            if i - start > 1 and units[start].name not in special:
                runs.append((start, i - 1))
            start = i
    return runs


@dataclass(frozen=True)
class _Around:
    """What lies around a run of like units, in one phase (:func:`arranged`)."""

    ahead_ns: int
    """What computes before the run since the streamed unit before it (included), outside the run."""
    wraps: bool
    """The decode's cycle with no streamed unit outside the run: the run's own last streamed unit is the one before
    its first window (its compute counts there too), and no window follows the run."""
    after_ns: int | None
    """What the copy of the first streamed unit after the run leaves for the run's tail (what follows the run's
    last streamed unit) to hide: its copy less the compute between the run and it; None when no streamed unit
    outside the run follows it (in the prefill, none after it; in the decode, none at all)."""


def _around(chosen: Sequence[PlacementOption], lo: int, hi: int, phase: str) -> _Around:
    outside = [i for i, o in enumerate(chosen) if o.copy_in(phase) > 0 and not lo <= i <= hi]
    compute = [getattr(o, phase) for o in chosen]
    before = [i for i in outside if i < lo]
    after = [i for i in outside if i > hi]
    cyclic = phase == "decode_ns"
    if before:
        ahead = sum(compute[before[-1]:lo])
    elif not cyclic:  # the prefill's first copy runs from the call's start
        ahead = sum(compute[:lo])
    elif after:  # round the cycle to the last streamed unit after the run
        ahead = sum(compute[after[-1]:]) + sum(compute[:lo])
    else:
        ahead = sum(compute[hi + 1:]) + sum(compute[:lo])
    nxt = after[0] if after else (before[0] if before and cyclic else None)
    if nxt is None:
        return _Around(ahead, cyclic and not outside, None)
    between = sum(compute[hi + 1:nxt]) if nxt > hi else sum(compute[hi + 1:]) + sum(compute[:nxt])
    return _Around(ahead, False, chosen[nxt].copy_in(phase) - between)


def _dealt(units: list[int], opts: Sequence[PlacementOption], phase: str, around: _Around) -> list[int]:
    """``units`` (option indices) as windows, each a streamed unit after the others dealt to it (:func:`arranged`),
    and a tail after the last streamed unit when a streamed unit outside follows the run; the others keep their
    order within a window, and the streamed units theirs."""
    streamed = [o for o in units if opts[o].copy_in(phase)]
    if not streamed or len(streamed) == len(units):
        return units
    # window k precedes streamed[k]; the streamed unit before it computes in it too, and the first window has
    # what comes before the run (with the run's last streamed unit when the decode's cycle wraps to it); the
    # tail, the last window, is the next streamed unit's outside the run, which the run's last one begins
    before = [getattr(opts[o], phase) for o in streamed]
    short = [opts[o].copy_in(phase) - before[k - 1] for k, o in enumerate(streamed)]
    short[0] = opts[streamed[0]].copy_in(phase) - around.ahead_ns - (before[-1] if around.wraps else 0)
    if around.after_ns is not None:
        short.append(around.after_ns - before[-1])
    rank = {o: k for k, o in enumerate(dict.fromkeys(units))}
    windows: list[list[int]] = [[] for _ in short]
    for o in sorted((o for o in units if not opts[o].copy_in(phase)), key=lambda o: -getattr(opts[o], phase)):
        k = max(range(len(windows)), key=short.__getitem__)
        windows[k].append(o)
        short[k] -= getattr(opts[o], phase)
    out: list[int] = []
    for k, window in enumerate(windows):
        out += sorted(window, key=rank.__getitem__) + streamed[k:k + 1]
    return out


def _take_one(counter: Counter[int], key: int) -> None:
    """One ``key`` fewer in ``counter``; a key at zero leaves it (``min`` and ``sorted`` read the keys)."""
    counter[key] -= 1
    if not counter[key]:
        del counter[key]


def _pick(options: Sequence[PlacementOption], counts: Counter[int], beside: int, phase: str, original: int,
          smallest_copy: int) -> int:
    """One of the option indices ``counts`` has left (:func:`sequenced`'s rule)."""
    left = sorted(counts)
    streamed = [k for k in left if options[k].copy_in(phase) > 0]
    hidden = [k for k in streamed if options[k].copy_in(phase) <= beside]
    if hidden:
        return max(hidden, key=lambda k: options[k].copy_in(phase))
    others = [k for k in left if options[k].copy_in(phase) == 0]
    if not others:
        return min(streamed, key=lambda k: options[k].copy_in(phase))
    if not smallest_copy:  # nothing left to hide: keep the unit's own option where it can
        return original if original in others else others[0]
    enough = [k for k in others if getattr(options[k], phase) >= smallest_copy - beside]
    if enough:
        return min(enough, key=lambda k: getattr(options[k], phase))
    return max(others, key=lambda k: getattr(options[k], phase))


class _Budget:
    """Prices left, and the deadline."""

    def __init__(self, most: int, deadline: float) -> None:
        self.prices, self.deadline = most, deadline

    def left(self) -> bool:
        return self.prices > 0 and time.perf_counter() < self.deadline

    def take(self) -> bool:
        if not self.left():
            return False
        self.prices -= 1
        return True


def _steps(problem: PlacementProblem, current: list[int]) -> Iterator[list[int]]:
    """Each step from ``current`` as a new plan; ``current`` is read as it is when each step is made, so
    an improvement the caller keeps (written into ``current``) is the base of the steps after it."""
    units = problem.units
    n = len(units)
    for i in range(n):
        for j in range(i + 1, min(n, i + 1 + SWAP_RADIUS)):
            if current[i] != current[j] and units[i].options is units[j].options:
                trial = list(current)
                trial[i], trial[j] = current[j], current[i]
                yield trial
    used: dict[int, set[int]] = {}
    for u, c in zip(units, current, strict=True):
        used.setdefault(id(u.options), set()).add(c)
    likes = Counter(id(u.options) for u in units)
    for i in range(n):
        menu = units[i].options
        # a unit alone in its menu has no like to take an option from: it may take any (few units, and
        # otherwise an embedding streamed just after lm_head's copy would never move)
        for o in (range(len(menu)) if likes[id(menu)] == 1 else sorted(used[id(menu)])):
            if o != current[i]:
                trial = list(current)
                trial[i] = o
                yield trial
