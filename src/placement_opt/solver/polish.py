"""Local search on the exact price: like units swapped, or moved to options their likes use.

Each step is kept while it lowers the plan's latency. Torch-free; :func:`~.search.solve_problem` runs it
on the start of the full CP-SAT solve when some option copies beside the compute
(``Workload(overlap=True)``). There a streamed unit's stall depends on what computes before it
(:func:`~.problem.stalls`), so the *order* of the same counts decides the price; the counting
relaxations read their counts into an order by rule (:mod:`.aggregate`, :mod:`.relax`), and the full
model's stall rows (big-M) leave CP-SAT's search slow to reorder. Mixtral-8x7B on RTX 4090 + 3090
(chat, overlap): a relaxation proved 46.97 s and its counts read into a plan priced 53.81 s, which the
full model took to 52.41 s in the 0.75 s it had; swaps of units at most two apart and option moves take
that start to 47.28 s in 0.2 s.

Every step keeps the plan valid (:meth:`~.problem.PlacementProblem.satisfies`), so the result is a plan
of the real problem; it says nothing about the bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from .problem import PlacementProblem

__all__ = ["polish", "SWAP_RADIUS", "MOST_PRICES"]

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
    :data:`SWAP_RADIUS` apart; move one unit to an option another unit of its menu uses. An invalid
    ``choice`` is returned as it is.

    Example::

        better = polish(problem, hint, time.perf_counter() + 0.2)
        assert problem.objective_value(better, "latency") <= problem.objective_value(hint, "latency")
    """
    best = list(choice)
    if not problem.satisfies(best):
        return best
    value = problem.objective_value(best, "latency")
    budget = _Budget(most, deadline)
    improved = True
    while improved and budget.left():
        improved = False
        for trial in _steps(problem, best):
            if not budget.take():
                break
            if problem.satisfies(trial) and (v := problem.objective_value(trial, "latency")) < value:
                best[:], value, improved = trial, v, True
    return best


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
    for i in range(n):
        for o in sorted(used[id(units[i].options)]):
            if o != current[i]:
                trial = list(current)
                trial[i] = o
                yield trial
