"""``solve_problem()``: what to ask CP-SAT, from which start, and what to report back.

Torch-free. :mod:`.cpsat` holds the model itself; this module decides around it:

* the start: the caller's hint, else :func:`~.greedy.best_greedy_choice`; the returned solution is
  never worse than a valid hint;
* the ``memory`` objective's two solves: the best latency first, then the fewest GPU bytes whose
  latency stays within ``memory_slack`` of it;
* exact reductions, which keep the score of every assignment (so the bound stays the real
  problem's): covered edges are dropped (:func:`~.edges.prune_edges`), and interchangeable devices
  are used in a fixed order (:mod:`.symmetry`, a symmetry that maps every assignment onto an
  equally good one in that order);
* integer time: every ``*_ns`` price is divided by ``scale_ns`` (:func:`~._run.time_scale`: the hint's
  objective, or ten times a simple lower bound when that is smaller, divided into ``max(TIME_RESOLUTION,
  SLACK_STEPS x (units + edges))`` steps). The objective read back is always ``problem.objective_value`` of
  the chosen assignment (exact); the proven bound is lowered by the largest possible rounding error
  (``(units + edges) x scale_ns`` per solve, 0 when ``scale_ns == 1``), so the gap is honest;
* the path floor (latency): the graph's longest path with each unit at its least time
  (:func:`~._run.path_lower_bound`), a bound of every assignment computed in one pass; it stands when no
  relaxation proves more in time, and a start it proves within ``gap_limit`` (everything resident) skips the
  relaxations;
* relaxations (:mod:`._relaxing`), which give bounds and plans (the reported bound is the largest proven one,
  each a bound of the real problem): runs of identical consecutive units as counts per option
  (:mod:`.aggregate`, the decoder layers; up to ``AGGREGATE_SHARE`` of the time left), and above
  ``GROUP_ABOVE`` units (``GROUP_WITHOUT_RUNS_ABOVE`` when there is no such run: sublayer and module graphs)
  groups of like units anywhere as counts with one path kept (:mod:`.relax`; up to ``GROUP_SHARE``). A
  relaxation's plan (the cheapest of its last solutions read back, :func:`~._relaxing.best_read`), priced
  exactly, starts the full solve when it is better; when the bound already proves the start within
  ``gap_limit``, the full solve is skipped; a relaxation without a solution proves INFEASIBLE; when its share
  would leave the full model less than twice what it takes to build and load (:data:`FULL_S_PER_TERM` per
  unit and edge), the last relaxation gets all the time, and the full model is not built with less than
  that once left;
* a ``contiguous`` problem (each device stores one range) first solves itself without contiguity, like any
  problem (from its own greedy start), for :data:`FREE_SHARE` of the time (:func:`_free_start`): a
  relaxation whose bound is reported with the others', and whose plan, its runs of like units reordered by
  storage and its other units moved next to their device's range (:func:`~.ranged.contiguous_start`),
  starts the rest when valid and better. Its own relaxations follow: the counted runs state its storage
  ranges over whole runs (:mod:`.aggregate`);
* under overlap (some option copies beside the compute, the latency objective, units free to move), the
  full solve's start is first polished (:func:`~.polish.polish`: swaps of like units and moves to options
  their likes use, from the start and from the start re-ordered per phase, priced exactly, for up to
  :data:`POLISH_SHARE` of the time left): the order of the same
  counts sets the stalls, and neither the relaxations' reads nor the full model's big-M stall rows find it
  fast; a polished start proven within ``gap_limit`` skips the full solve;
* the time limit: the full model's build checks the deadline, and CP-SAT is given what is left less
  :data:`LOAD_SHARE` x the build time (it loads and presolves past its own limit);
* a problem with expert groups (``part_groups``) first solves itself with each layer's groups merged back (for
  :data:`PARTS_SHARE` of the time; that solve takes the layer-granular start below), another restriction whose
  expanded plan joins the starts as the layer-granular one does;
* a sublayer problem's layer-granular start, another restriction: its copy groups (a decoder layer's
  parts) as super-units, solved for :data:`BLOCK_SHARE` of the time; the expanded plan joins the starts
  after the relaxations (the better start goes on, the other is polished too), so a sublayer plan is never
  worse than the best layer-granular one found;
* coarsening, a *restriction*: problems with more than :data:`COARSEN_ABOVE` units are first solved
  on super-units (:func:`~.reductions.coarsen`, runs of chain units merged by the hint's options) for
  :data:`COARSE_SHARE` of the time; the expanded plan starts the solve of the full problem, whose
  bound is the one reported. A restriction never gives the bound;
* residency on ties (:func:`~.reductions.prefer_resident`), on the returned plan.

What :class:`Solution` reports: ``best_bound`` is a proven lower bound of the objective over every
assignment of the real problem that meets its constraints (for ``memory``: every assignment within
the latency cap of the first solve, which is at least the best latency times ``1 + memory_slack``);
``status`` is ``OPTIMAL`` only when the returned value equals that bound (gap 0, rounding included),
``FEASIBLE`` for any other plan, ``INFEASIBLE`` when CP-SAT proved that no assignment fits, and
``UNKNOWN`` when neither a plan nor a proof was found in time. The bound is never clamped to the
value: ``gap`` is computed from both as they are.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

from ortools.sat.python import cp_model

from ..errors import SolverInputError
from ._relaxing import BOUND_FROM, relaxations_for, run_relaxations
from ._run import (
    MIN_SOLVE_S,
    Found,
    Run,
    path_lower_bound,
    proven,
    real_bound,
    time_scale,
    within_cap,
)
from .cpsat import OutOfTime, PlacementModel
from .edges import prune_edges
from .greedy import best_greedy_choice
from .polish import polish
from .problem import OBJECTIVES, PlacementProblem
from .ranged import contiguous_start
from .reductions import block_groups, coarsen, coarsen_groups, part_groups, prefer_resident
from .starts import fits
from .symmetry import identical_devices, relabel

__all__ = ["Solution", "solve_problem", "GAP_LIMIT", "COARSEN_ABOVE", "COARSE_SHARE", "SEARCH_NOTES"]

#: How each of :attr:`Solution.notes` begins: what the search started from, and where its bound came from. They are
#: for whoever tunes the solver; the CLI prints them with ``--verbose`` only (``placement_opt.planner.SOLVER_NOTES``).
STARTED_FROM = "started from "
SEARCH_NOTES = (STARTED_FROM, BOUND_FROM)

#: Default proven gap at which the search stops: the cost model itself is only accurate to some %.
GAP_LIMIT = 0.001
#: Problems with more units than this are first solved coarsened into about this many super-units.
COARSEN_ABOVE = 1000
#: Most of the time limit the search for covered edges may take (0.1 s for 14,164 edges of 724 units).
PRUNE_SHARE = 0.25
#: Share of the time left that the coarse solve gets; the full problem gets the rest.
COARSE_SHARE = 0.4
#: Share of the time left that the layer-granular start of a sublayer problem gets (:func:`~.reductions.block_groups`:
#: each layer's parts on one option). Without it, the sublayer solves of benchmarks/phases under
#: overlap at 2 s ended 3-5 % above the layer plan lifted onto the same graph (Llama-3-8B at 10 GiB,
#: Mixtral-8x7B at 24 GiB, on the H100 host's profile): the full model did not find what the
#: layer-granular one finds in a fraction of the time.
BLOCK_SHARE = 0.25
#: BLOCK_SHARE for ``contiguous`` problems, whose plan without contiguity, solved next, rarely reorders into a start at
#: sublayer granularity (attention and MLP parts never form runs of like units): the layer-granular plan is the start.
#: Sublayer Llama-3-70B on RTX 4090 + 3090, 1 x 512 + 128, 1 s: 1521.9 s (two runs) with 0.25, 764.1-795.6 s with 0.5;
#: none of the eight other sublayer cells of Llama-3-8B, Mixtral-8x7B and Llama-3-70B on three machines priced higher.
CONTIGUOUS_BLOCK_SHARE = 0.5
#: Share of the time left that a problem with expert groups gives the same problem with each layer's groups merged
#: (:func:`~.reductions.part_groups`: the problem before the cut, solved like any, its own layer-granular start
#: included), whose plan expanded joins the starts as the layer-granular one does: the grouped plan is then never
#: worse than the best plan found without groups.
PARTS_SHARE = 0.3
#: Most of the time left that :func:`~.polish.polish` may take on the full solve's start, where orders
#: matter (:func:`_orders_matter`); it mostly stops sooner, at a plan no single step improves. All of it
#: when the rest would leave the full model less than twice its build (:data:`FULL_S_PER_TERM`).
POLISH_SHARE = 0.3
#: CP-SAT's load and presolve past its own limit, as a share of the time the model took to build.
LOAD_SHARE = 0.75
#: Seconds per unit and edge that building and loading the full CP-SAT model takes on this 2-core machine
#: (about 0.9 s for a module-level 70B's 724 units and 963 edges). With less than twice that left, the
#: full model would not search at all: the relaxations get the time instead.
FULL_S_PER_TERM = 0.0005
#: Share of the time left that a ``contiguous`` problem gives the same problem without contiguity (:func:`_free_start`):
#: its bound bounds the contiguous one, and its plan, reordered, starts the contiguous model.
FREE_SHARE = 0.5
#: Most units for which :func:`_free_start` starts the free solve from the free problem's own greedy start. On
#: sublayer graphs (Llama-3-70B's 324 units) it took the time the free solve needed to prove its bound (8.5 % gaps
#: became 84 % on 4x T4 in two of three 1 s solves); they start from their layer-granular plan instead.
FREE_GREEDY_MOST_UNITS = 150


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
    """Proven lower bound of the real problem, same unit (never clamped to ``objective_value``)."""
    gap: float
    """``(objective_value - best_bound) / objective_value``; 0.0 is proven optimal."""
    wall_time_s: float
    scale_ns: int
    """Nanoseconds per solver time unit."""
    units: int
    coarse_units: int
    """Super-units of the coarse solve that gave the start (== ``units`` when not coarsened); the
    bound always comes from the full problem."""
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
    problem = prune_edges(problem, t0 + PRUNE_SHARE * time_limit_s)  # exact: every assignment keeps its score
    run = Run(seed=seed, workers=workers, gap_limit=gap_limit, t0=t0)
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
    # `not x > 0` rather than `x <= 0`: NaN fails every comparison and would pass the latter
    if (not time_limit_s > 0 or isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
            or not 0 <= memory_slack < math.inf):
        raise SolverInputError(f"time_limit_s ({time_limit_s}) must be > 0, workers ({workers}) a whole number "
                               f">= 1 and memory_slack ({memory_slack}) finite and >= 0")
    if hint is not None:
        bad = [i for i, (u, c) in enumerate(zip(problem.units, hint, strict=False))
               if isinstance(c, bool) or not isinstance(c, Integral) or not 0 <= c < len(u.options)]
        if len(hint) != len(problem.units) or bad:
            raise SolverInputError(f"hint has {len(hint)} entries for {len(problem.units)} units, out-of-range "
                                   f"at positions {bad[:5]}: give one option index per unit")


def _solve(problem: PlacementProblem, objective: str, time_limit_s: float, run: Run,
           hint: list[int], latency_cap_ns: int | None) -> Solution:
    """One objective's solve: a coarse start when large, then the full problem, which gives the bound."""
    deadline = run.t0 + time_limit_s
    hint_ok = problem.satisfies(hint)
    n = len(problem.units)
    notes: list[str] = []
    # layered: a sublayer problem's layer-granular plan: joins the starts after the relaxations
    (hint, hint_ok), coarse_units, layered = _restricted_start(problem, objective, run, (hint, hint_ok),
                                                               latency_cap_ns, deadline, notes)
    free, (hint, hint_ok) = _free_start(problem, objective, run, (hint, hint_ok), latency_cap_ns, deadline, notes)
    classes = identical_devices(problem)  # ~0.1 s on a module-level 70B: found once per solve
    relaxations = relaxations_for(problem, classes)
    floor = path_lower_bound(problem) if objective == "latency" else 0
    if hint_ok and proven(problem, objective, hint, floor, run.gap_limit):
        relaxations = []  # the start is as good as the longest path allows already (everything resident)
    full_s = FULL_S_PER_TERM * (n + len(problem.edges))
    relaxed, (hint, hint_ok) = run_relaxations(problem, objective, relaxations, run, (hint, hint_ok),
                                                latency_cap_ns, (deadline, full_s), notes)
    if floor > max(free.bound, relaxed.bound):
        notes.append(f"{BOUND_FROM}the longest path, each unit at its least time")
    relaxed = Found([], "INFEASIBLE" if "INFEASIBLE" in (free.status, relaxed.status) else relaxed.status,
                    max(free.bound, relaxed.bound, floor))
    hint, hint_ok = _full_start(problem, objective, run, (hint, hint_ok), layered, relaxed, (deadline, full_s))
    found = _full_solve(problem, objective, run, (hint, hint_ok), latency_cap_ns, relaxed, classes, (deadline, full_s))
    if not found.choice and not hint_ok:
        return Solution(choice=(), status=found.status, objective=objective, objective_value=0,
                        best_bound=found.bound, gap=1.0, wall_time_s=time.perf_counter() - run.t0, scale_ns=0,
                        units=n, coarse_units=coarse_units, notes=tuple(notes))
    if not found.choice:  # out of time: the start stands
        found = Found(hint, "FEASIBLE", found.bound)
    return _report(problem, objective, run, found, (hint, hint_ok), latency_cap_ns, coarse_units=coarse_units,
                   notes=notes)


def _restricted_start(problem: PlacementProblem, objective: str, run: Run, start: tuple[list[int], bool],
                      latency_cap_ns: int | None, deadline: float,
                      notes: list[str]) -> tuple[tuple[list[int], bool], int, list[int] | None]:
    """(the start, the super-units of the coarse solve, a sublayer problem's layer-granular plan or None) after
    the restriction that fits ``problem``: the coarse solve above :data:`COARSEN_ABOVE` units (its plan replaces
    the start), else the expert groups merged, else the layer-granular problem (their plan is kept aside: it joins
    the starts after the relaxations). Appends what it started from to ``notes``."""
    hint, hint_ok = start
    n = len(problem.units)
    coarse_units = n
    layered = None
    if n > COARSEN_ABOVE:
        groups = coarsen_groups(problem, hint, COARSEN_ABOVE)
        if len(groups) < n:
            coarse_units = len(groups)
            until = time.perf_counter() + COARSE_SHARE * (deadline - time.perf_counter())
            coarse = _coarse_start(problem, objective, groups, run, (hint, hint_ok), latency_cap_ns, until)
            if coarse is not None:
                hint, hint_ok = coarse, True
            notes.append(f"{STARTED_FROM}a plan of {n} units coarsened into {len(groups)} super-units (runs of "
                         f"chain units with the same options); the bound is the full problem's")
    elif (parts := part_groups(problem)) is not None:  # its own solve starts from the layer-granular plan
        span = PARTS_SHARE * (deadline - time.perf_counter())
        layered = _block_start(problem, objective, parts, run, (hint, hint_ok), latency_cap_ns, span)
        if layered is not None:
            notes.append(f"{STARTED_FROM}the best plan that keeps each layer's expert groups together ({len(parts)} "
                         f"super-units) as well; the bound is the full problem's")
    elif (blocks := block_groups(problem)) is not None:
        span = (CONTIGUOUS_BLOCK_SHARE if problem.contiguous else BLOCK_SHARE) * (deadline - time.perf_counter())
        layered = _block_start(problem, objective, blocks, run, (hint, hint_ok), latency_cap_ns, span)
        if layered is not None:
            notes.append(f"{STARTED_FROM}the best plan that moves each layer's parts together ({len(blocks)} "
                         f"super-units) as well; the bound is the full problem's")
    return (hint, hint_ok), coarse_units, layered


def _free_start(problem: PlacementProblem, objective: str, run: Run, start: tuple[list[int], bool],
                latency_cap_ns: int | None, deadline: float, notes: list[str]) -> tuple[Found, tuple[list[int], bool]]:
    """A ``contiguous`` problem's relaxation without contiguity, solved like any problem for :data:`FREE_SHARE` of
    the time, from the cheaper of ``start`` and its own greedy start: (its status and proven bound, a bound of
    ``problem`` too; the start, replaced by the free plan made contiguous (:func:`~.ranged.contiguous_start`)
    when that is valid and no worse). Other problems: nothing.

    The free solve does not get far from its start in its share: Llama-3.1-405B on 8x L4, 8064-token context,
    1 s: free plans of 3808-4148 s from the contiguous start (5281 s), 2902 s (its optimum, proven) from its own
    greedy start."""
    hint, hint_ok = start
    if not problem.contiguous:
        return Found([], "UNKNOWN", 0), start
    free = dataclasses.replace(problem, contiguous=False)
    free_hint = hint
    if len(problem.units) <= FREE_GREEDY_MOST_UNITS:  # the free problem's own start: the caller's is contiguous
        greedy = best_greedy_choice(free, objective)
        cheaper = not hint_ok or free.objective_value(greedy, objective) < free.objective_value(hint, objective)
        free_hint = greedy if cheaper and fits(free, greedy) and within_cap(free, greedy, latency_cap_ns) else hint
    span = FREE_SHARE * (deadline - time.perf_counter())
    found = _solve(free, objective, span, dataclasses.replace(run, t0=time.perf_counter()), free_hint, latency_cap_ns)
    notes.append(f"{BOUND_FROM}the same problem without contiguity")
    if found.feasible:
        choice = contiguous_start(problem, found.choice, objective, deadline)
        if choice is not None and problem.satisfies(choice) and within_cap(problem, choice, latency_cap_ns) and (
                not hint_ok or problem.objective_value(choice, objective) < problem.objective_value(hint, objective)):
            hint, hint_ok = choice, True
            notes.append(f"{STARTED_FROM}the plan without contiguity, each run of like units reordered by storage"
                         " and fixed units moved next to their device's range")
    return Found([], found.status if found.status == "INFEASIBLE" else "UNKNOWN", found.best_bound), (hint, hint_ok)


def _full_start(problem: PlacementProblem, objective: str, run: Run, start: tuple[list[int], bool],
                layered: list[int] | None, relaxed: Found, limits: tuple[float, float]) -> tuple[list[int], bool]:
    """The full solve's start: the better of ``start`` and the layer-granular plan, polished (from both) where
    orders matter and the relaxations neither proved it within the gap nor the problem infeasible.
    ``limits``: the deadline, and the full model's build time."""
    hint, hint_ok = start
    deadline, full_s = limits
    others: list[list[int]] = []  # the layer-granular plan or the start it beat: polished too
    if layered is not None:  # not before: the relaxations' solutions follow their hint, and read worse from it
        better = not hint_ok or problem.objective_value(layered, objective) < problem.objective_value(hint, objective)
        others.append(hint if better and hint_ok else layered)
        hint, hint_ok = (layered, True) if better else (hint, hint_ok)
    if (relaxed.status != "INFEASIBLE" and hint_ok and _orders_matter(problem, objective)
            and not proven(problem, objective, hint, relaxed.bound, run.gap_limit)):
        left = deadline - time.perf_counter()  # all of it when the full model would not get to search after
        share = POLISH_SHARE if (1 - POLISH_SHARE) * left >= max(MIN_SOLVE_S, 2 * full_s) else 1.0
        hint = _polished(problem, [hint, *others], time.perf_counter() + share * left)
    return hint, hint_ok


def _full_solve(problem: PlacementProblem, objective: str, run: Run, start: tuple[list[int], bool],
                latency_cap_ns: int | None, relaxed: Found, classes: list[list[str]],
                limits: tuple[float, float]) -> Found:
    """The full model's answer with the relaxations' bound, unless the relaxations settled it (INFEASIBLE, or the
    start proven within the gap) or too little time is left to build it (then no choice: the start stands).
    ``limits``: the deadline, and the full model's build time."""
    hint, hint_ok = start
    deadline, full_s = limits
    if relaxed.status == "INFEASIBLE":  # a relaxation without a solution: neither has the real problem
        return relaxed
    if hint_ok and proven(problem, objective, hint, relaxed.bound, run.gap_limit):
        return Found(hint, "FEASIBLE", relaxed.bound)
    if deadline - time.perf_counter() < max(MIN_SOLVE_S, full_s):  # no time to build it: the start stands
        return Found([], relaxed.status, relaxed.bound)
    found = _solve_once(problem, objective, deadline, run, hint, hint_ok, latency_cap_ns, classes)
    return Found(found.choice, found.status, max(found.bound, relaxed.bound))


def _polished(problem: PlacementProblem, starts: Sequence[list[int]], deadline: float) -> list[int]:
    """The lowest-latency plan :func:`~.polish.polish` reaches from any of ``starts`` (the first one valid),
    the time left shared equally among the starts not yet polished.

    A start that prices higher may still descend lower: a sublayer problem polishes its layer-granular plan
    and the relaxations' plan both. On the 16 sublayer cells of benchmarks/phases (H100 host, overlap,
    2 s, three solves each) that gained up to 4 % on three cells and lost up to 1.2 % on three against
    polishing the better one alone; on layer graphs, polishing the relaxations' worse plans too lost up to
    1 % (Mistral-7B on an RTX 3060), so they get one start."""
    distinct = list({tuple(start): start for start in starts}.values())
    best: list[int] = []
    value = 0
    for k, start in enumerate(distinct):
        found = polish(problem, start, time.perf_counter() + (deadline - time.perf_counter()) / (len(distinct) - k))
        if not best or (problem.satisfies(found) and problem.objective_value(found, "latency") < value):
            best, value = found, problem.objective_value(found, "latency")
    return best


def _orders_matter(problem: PlacementProblem, objective: str) -> bool:
    """Whether :func:`~.polish.polish` may lower the start: the latency objective, some option copying beside
    the compute (where the order of the same counts sets the stalls), units free to move (not contiguous)."""
    return objective == "latency" and not problem.contiguous and problem.copies_beside


def _coarse_start(problem: PlacementProblem, objective: str, groups: list[list[int]], run: Run,
                  start: tuple[list[int], bool], latency_cap_ns: int | None, until: float) -> list[int] | None:
    """The coarse problem's plan, expanded, when it is valid and better than the start; else None."""
    hint, hint_ok = start
    coarse = coarsen(problem, groups)
    found = _solve_once(coarse, objective, until, run, [hint[g[0]] for g in groups], hint_ok, latency_cap_ns)
    return _expanded(problem, objective, groups, found.choice, start, latency_cap_ns)


def _block_start(problem: PlacementProblem, objective: str, groups: list[list[int]], run: Run,
                 start: tuple[list[int], bool], latency_cap_ns: int | None, span_s: float) -> list[int] | None:
    """The layer-granular problem's plan (``groups`` from :func:`~.reductions.block_groups`), expanded, when it
    is valid and better than the start; else None.

    Solved like any problem (relaxations, polish, the full model), as its runs of identical layers are what
    the aggregated relaxation counts best."""
    hint, _ = start
    found = _solve(coarsen(problem, groups), objective, span_s, dataclasses.replace(run, t0=time.perf_counter()),
                   [hint[g[0]] for g in groups], latency_cap_ns)
    return _expanded(problem, objective, groups, list(found.choice), start, latency_cap_ns)


def _expanded(problem: PlacementProblem, objective: str, groups: list[list[int]], coarse_choice: Sequence[int],
              start: tuple[list[int], bool], latency_cap_ns: int | None) -> list[int] | None:
    """A coarse choice as a choice of ``problem`` (every unit of a group on its group's option) when it fits,
    keeps the cap and is no worse than a valid start; else None."""
    if not coarse_choice:
        return None
    hint, hint_ok = start
    choice = [0] * len(problem.units)
    for g, c in zip(groups, coarse_choice, strict=True):
        for i in g:
            choice[i] = c
    if not problem.satisfies(choice) or not within_cap(problem, choice, latency_cap_ns):
        return None
    if hint_ok and problem.objective_value(choice, objective) > problem.objective_value(hint, objective):
        return None
    return choice


def _report(problem: PlacementProblem, objective: str, run: Run, found: Found, start: tuple[list[int], bool],
            latency_cap_ns: int | None, *, coarse_units: int, notes: list[str]) -> Solution:
    """The Solution of a found choice: residency on ties, never worse than a valid start, honest gap."""
    choice = found.choice
    hint, hint_ok = start
    if objective != "memory":
        resident = prefer_resident(problem, choice)
        # each move is no slower on its own, but on a DAG it can shift the next stream's copy window: checked whole
        if problem.objective_value(resident, objective) <= problem.objective_value(choice, objective):
            choice = resident
    elif hint_ok and not within_cap(problem, choice, latency_cap_ns):
        choice = hint  # the model's cap allows its rounding slack; the plan keeps the exact cap (the hint does)
    value = problem.objective_value(choice, objective)
    if hint_ok and problem.objective_value(hint, objective) < value and within_cap(problem, hint, latency_cap_ns):
        choice, value = hint, problem.objective_value(hint, objective)  # rounding: never worse than the start
    bound = found.bound  # a bound of the real problem: not clamped, so a wrong one shows (tests check it)
    gap = (value - bound) / value if value > 0 else 0.0
    status = "OPTIMAL" if value <= bound else "FEASIBLE"
    return Solution(choice=tuple(choice), status=status, objective=objective, objective_value=value,
                    best_bound=bound, gap=gap, wall_time_s=time.perf_counter() - run.t0,
                    scale_ns=time_scale(problem, hint, objective), units=len(problem.units),
                    coarse_units=coarse_units, notes=tuple(notes))


def _solve_once(problem: PlacementProblem, objective: str, deadline: float, run: Run,
                hint: list[int], hint_ok: bool, latency_cap_ns: int | None,
                classes: list[list[str]] | None = None) -> Found:
    """The choice (or []), status and proven bound (in the objective's unit) of one CP-SAT run.

    ``classes``: :func:`.symmetry.identical_devices` of ``problem`` when the caller has them."""
    scale = time_scale(problem, hint, objective)
    max_work = None  # latency and the slowest stage are >= every unit's own prefill + decode
    if hint_ok and objective in ("latency", "throughput"):
        max_work = problem.objective_value(hint, objective)
    elif latency_cap_ns is not None:
        max_work = latency_cap_ns
    classes = identical_devices(problem) if classes is None else classes
    hint = relabel(problem, hint, classes)  # the same cost, in the model's device order
    building = time.perf_counter()
    try:
        m = PlacementModel(problem, scale, hint, max_work, classes, deadline=deadline)
        m.minimize(objective, latency_cap_ns)
    except OutOfTime:  # the time limit holds whatever the graph: the start stands, bound unknown
        return Found([], "UNKNOWN", 0)
    # CP-SAT loads and presolves the model before its clock can stop it, and overran its limit by up to
    # about half the building time (0.25-0.45 s for a module-level 70B built in 0.6 s): that much is kept.
    built = time.perf_counter()
    left_s = deadline - built - LOAD_SHARE * (built - building)
    if left_s < MIN_SOLVE_S:  # too little time to load the model: the start stands
        return Found([], "UNKNOWN", 0)
    unit_scale, slack = m.unit_scale(objective), m.rounding_slack(objective)
    # CP-SAT's gap is on the rounded model; the reported one adds the rounding slack, so ask for less.
    rounding = slack * unit_scale / max(1, problem.objective_value(hint, objective)) if unit_scale > 1 else 0.0
    solver, status = m.solve(left_s, run.seed, run.workers, max(0.0, run.gap_limit - rounding))
    name = solver.status_name(status)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Found(m.read(solver), name, real_bound(solver.best_objective_bound, unit_scale, slack))
    return Found([], name, real_bound(solver.best_objective_bound, unit_scale, slack) if status == cp_model.UNKNOWN else 0)


