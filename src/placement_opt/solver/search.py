"""``solve_problem()``: what to ask CP-SAT, from which start, and what to report back.

Torch-free. :mod:`.cpsat` holds the model itself; this module decides around it:

* the start: the caller's hint, else :func:`~.greedy.best_greedy_choice`; the returned solution is
  never worse than a valid hint;
* the ``memory`` objective's two solves: the best latency first, then the fewest GPU bytes whose
  latency stays within ``memory_slack`` of it;
* integer time: every ``*_ns`` price is divided by ``scale_ns = max(1, hint objective //
  TIME_RESOLUTION)``, so coefficients stay around 10^5 whatever the model size. The objective
  read back is always ``problem.objective_value`` of the chosen assignment (exact); the proven
  bound is lowered by the largest possible rounding error (``(units + edges) x scale_ns`` per
  solve, 0 when ``scale_ns == 1``), so the gap is honest;
* coarsening: problems with more than :data:`COARSEN_ABOVE` units are solved on super-units
  (:func:`~.reductions.coarsen`), exact for every cost, and expanded afterwards; the hint stays
  representable, so the coarse solve is never worse than the hint; its bound is a bound of the
  coarse problem only;
* the other reductions of :mod:`.reductions`: symmetric segments with a canonical hint, and
  residency on ties.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from ..errors import SolverInputError
from .cpsat import PlacementModel
from .greedy import best_greedy_choice
from .problem import OBJECTIVES, PlacementProblem
from .reductions import canonical_hint, coarsen, coarsen_groups, prefer_resident, symmetric_segments

__all__ = ["Solution", "solve_problem", "TIME_RESOLUTION", "GAP_LIMIT", "COARSEN_ABOVE"]

#: Integer steps the hint's objective is divided into: sets ``scale_ns``.
TIME_RESOLUTION = 200_000
#: Default proven gap at which the search stops: the cost model itself is only accurate to some %.
GAP_LIMIT = 0.001
#: Problems with more units than this are coarsened into at most about this many super-units.
COARSEN_ABOVE = 160


@dataclass(frozen=True, kw_only=True)
class Solution:
    """What :func:`solve_problem` found."""

    choice: tuple[int, ...]
    """Option index per unit, in execution order (empty when infeasible)."""
    status: str
    """``"OPTIMAL"``, ``"FEASIBLE"``, ``"INFEASIBLE"`` or ``"UNKNOWN"`` (no feasible solution found)."""
    objective: str
    objective_value: int
    """``problem.objective_value(choice, objective)``: latency or slowest stage in ns, or GPU bytes."""
    best_bound: int
    """Proven lower bound, same unit (of the coarse problem when ``coarse_units < units``)."""
    gap: float
    """``(objective_value - best_bound) / objective_value``; 0.0 is proven optimal."""
    wall_time_s: float
    scale_ns: int
    """Nanoseconds per solver time unit."""
    units: int
    coarse_units: int
    """Units the solver saw after coarsening (== ``units`` when not coarsened)."""
    notes: tuple[str, ...] = ()

    @property
    def feasible(self) -> bool:
        return self.status in ("OPTIMAL", "FEASIBLE")


def solve_problem(problem: PlacementProblem, objective: str = "latency", *, time_limit_s: float = 1.0,
                  seed: int = 0, workers: int = 2, hint: Sequence[int] | None = None,
                  memory_slack: float = 0.05, gap_limit: float = GAP_LIMIT) -> Solution:
    """Find the best assignment of ``problem`` for ``objective`` with OR-Tools CP-SAT.

    Example::

        sol = solve_problem(problem, "latency", time_limit_s=1.0, hint=[0] * len(problem.units))
        assert sol.objective_value == problem.score(sol.choice).latency_ns

    Args:
        problem: the integer problem (units, options, edges, devices, ties, pins, contiguity).
        objective: ``"latency"`` (prefill + decode, each the max of the critical path and the busiest
            device), ``"throughput"`` (the slowest device's total work) or ``"memory"`` (least GPU
            bytes whose latency stays within ``memory_slack`` of the best latency: two solves, the
            first with half of ``time_limit_s``).
        time_limit_s: wall-clock limit of the whole call.
        seed: CP-SAT's random seed.
        workers: CP-SAT search workers; with ``1`` the search ends on its deterministic-time budget
            and is reproducible (the same plan every run) unless the wall-clock limit comes first.
        hint: an option index per unit (the best feasible baseline); default :func:`best_greedy_choice`.
            The returned solution is never worse than a valid hint.
        memory_slack: allowed relative latency increase for ``"memory"``.
        gap_limit: stop as soon as the returned objective is proven within this fraction of the
            optimum (rounding of the integer time model included); ``0`` searches until the limit.

    Returns:
        A :class:`Solution`; ``objective_value`` is exactly ``problem.objective_value(choice, objective)``.

    Raises:
        SolverInputError: an unknown objective, a malformed hint or a non-positive limit.
    """
    _check(problem, objective, hint, time_limit_s, workers, memory_slack, gap_limit)
    t0 = time.perf_counter()
    hint = list(hint) if hint is not None else best_greedy_choice(problem, objective)
    run = _Run(seed=seed, workers=workers, gap_limit=gap_limit, t0=t0)
    if objective == "memory":
        first = _solve(problem, "latency", time_limit_s / 2, run, hint, None)
        if not first.feasible:
            return first
        cap = int(first.objective_value * (1 + memory_slack))
        return _solve(problem, "memory", time_limit_s, run, list(first.choice), cap)
    return _solve(problem, objective, time_limit_s, run, hint, None)


def _check(problem: PlacementProblem, objective: str, hint: Sequence[int] | None, time_limit_s: float,
           workers: int, memory_slack: float, gap_limit: float) -> None:
    if objective not in OBJECTIVES:
        raise SolverInputError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    if not 0 <= gap_limit < 1:
        raise SolverInputError(f"gap_limit must be a fraction in [0, 1), got {gap_limit!r}: e.g. 0.001 for 0.1 %")
    if time_limit_s <= 0 or workers < 1 or memory_slack < 0:
        raise SolverInputError(f"time_limit_s ({time_limit_s}) must be > 0, workers ({workers}) >= 1 and "
                               f"memory_slack ({memory_slack}) >= 0")
    if hint is not None:
        bad = [i for i, (u, c) in enumerate(zip(problem.units, hint, strict=False)) if not 0 <= c < len(u.options)]
        if len(hint) != len(problem.units) or bad:
            raise SolverInputError(f"hint has {len(hint)} entries for {len(problem.units)} units, out-of-range "
                                   f"at positions {bad[:5]}: give one option index per unit")


@dataclass(frozen=True)
class _Run:
    """Search settings shared by the solves of one call."""

    seed: int
    workers: int
    gap_limit: float
    t0: float
    """perf_counter() when the call began: every solve's budget ends at t0 + time_limit_s."""


@dataclass(frozen=True)
class _Found:
    """One CP-SAT run's answer: a choice (empty if none), its status and the proven bound."""

    choice: list[int]
    status: str
    bound: int


def _solve(problem: PlacementProblem, objective: str, time_limit_s: float, run: _Run,
           hint: list[int], latency_cap_ns: int | None) -> Solution:
    """One CP-SAT solve (coarsened when large); falls back to the full problem if the coarse one fails."""
    hint_ok = problem.satisfies(hint)
    n = len(problem.units)
    groups = coarsen_groups(problem, hint, COARSEN_ABOVE) if n > COARSEN_ABOVE else [[i] for i in range(n)]
    sub = coarsen(problem, groups) if len(groups) < n else problem
    found = _solve_once(sub, objective, time_limit_s, run, [hint[g[0]] for g in groups], hint_ok, latency_cap_ns)
    if len(groups) < n and not found.choice:  # the coarse problem found nothing: try the full one
        groups = [[i] for i in range(n)]
        found = _solve_once(problem, objective, time_limit_s, run, hint, hint_ok, latency_cap_ns)
    notes = []
    if len(groups) < n:
        notes.append(f"coarsened {n} units into {len(groups)} super-units (runs of chain units with the "
                     f"same options); the bound is the coarse problem's")
    choice_sub, status = found.choice, found.status
    if not choice_sub:
        if not hint_ok:
            return Solution(choice=(), status=status, objective=objective, objective_value=0,
                            best_bound=found.bound, gap=1.0, wall_time_s=time.perf_counter() - run.t0, scale_ns=0,
                            units=n, coarse_units=len(groups), notes=tuple(notes))
        choice_sub, status = [hint[g[0]] for g in groups], "FEASIBLE"  # out of time: the hint stands
    choice = [0] * n
    for g, c in zip(groups, choice_sub, strict=True):
        for i in g:
            choice[i] = c
    return _report(problem, objective, run, _Found(choice, status, found.bound), (hint, hint_ok),
                   latency_cap_ns, coarse_units=len(groups), notes=notes)


def _report(problem: PlacementProblem, objective: str, run: _Run, found: _Found, start: tuple[list[int], bool],
            latency_cap_ns: int | None, *, coarse_units: int, notes: list[str]) -> Solution:
    """The Solution of a found choice: residency on ties, never worse than a valid hint, honest gap."""
    choice, status = found.choice, found.status
    hint, hint_ok = start
    if objective != "memory":
        choice = prefer_resident(problem, choice)
    value = problem.objective_value(choice, objective)
    if hint_ok and problem.objective_value(hint, objective) < value and (
            latency_cap_ns is None or problem.objective_value(hint, "latency") <= latency_cap_ns):
        choice, value = hint, problem.objective_value(hint, objective)  # rounding: never worse than the hint
    bound = min(found.bound, value)
    gap = (value - bound) / value if value > 0 else 0.0
    if gap <= 0 and status == "FEASIBLE":
        status = "OPTIMAL"
    return Solution(choice=tuple(choice), status=status, objective=objective, objective_value=value,
                    best_bound=bound, gap=gap, wall_time_s=time.perf_counter() - run.t0,
                    scale_ns=_scale(problem, hint, objective), units=len(problem.units),
                    coarse_units=coarse_units, notes=tuple(notes))


def _scale(problem: PlacementProblem, hint: Sequence[int], objective: str) -> int:
    """ns per solver time unit: the hint's time objective divided into TIME_RESOLUTION steps."""
    key = "throughput" if objective == "throughput" else "latency"
    return max(1, problem.objective_value(hint, key) // TIME_RESOLUTION)


def _start(problem: PlacementProblem, objective: str, hint: list[int], hint_ok: bool) -> tuple[list[int], list]:
    """The hint and the symmetric segments to state: regrouped canonically when no worse, else none."""
    segments = symmetric_segments(problem)
    canonical = canonical_hint(problem, hint, segments)
    key = objective if objective != "memory" else "latency"
    if problem.satisfies(canonical) >= hint_ok and \
            problem.objective_value(canonical, key) <= problem.objective_value(hint, key):
        return canonical, segments
    return hint, []


def _solve_once(problem: PlacementProblem, objective: str, time_limit_s: float, run: _Run,
                hint: list[int], hint_ok: bool, latency_cap_ns: int | None) -> _Found:
    """The choice (or []), status and proven bound (in the objective's unit) of one CP-SAT run."""
    scale = _scale(problem, hint, objective)
    max_work = None  # latency and the slowest stage are >= every unit's own prefill + decode
    if hint_ok and objective in ("latency", "throughput"):
        max_work = problem.objective_value(hint, objective)
    elif latency_cap_ns is not None:
        max_work = latency_cap_ns
    hint, segments = _start(problem, objective, hint, hint_ok)
    m = PlacementModel(problem, scale, hint, max_work, segments)
    m.minimize(objective, latency_cap_ns)
    unit_scale, slack = m.unit_scale(objective), m.rounding_slack(objective)
    # CP-SAT's gap is on the rounded model; the reported one adds the rounding slack, so ask for less.
    rounding = slack * unit_scale / max(1, problem.objective_value(hint, objective)) if unit_scale > 1 else 0.0
    budget = time_limit_s - (time.perf_counter() - run.t0)
    solver, status = m.solve(budget, run.seed, run.workers, max(0.0, run.gap_limit - rounding))
    name = solver.status_name(status)
    if status == cp_model.OPTIMAL and solver.best_objective_bound < solver.objective_value:
        name = "FEASIBLE"  # stopped by the gap limit: within it, not proven optimal
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _Found(m.read(solver), name, _bound(solver, unit_scale, slack))
    return _Found([], name, _bound(solver, unit_scale, slack) if status == cp_model.UNKNOWN else 0)


def _bound(solver: cp_model.CpSolver, scale: int, slack_units: int) -> int:
    return max(0, int(solver.best_objective_bound) * scale - (slack_units * scale if scale > 1 else 0))
