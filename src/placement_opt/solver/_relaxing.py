"""The relaxations of one solve: which are worth building, each one's proven bound and best plan read back,
run in turn.

Torch-free. Each relaxation (:class:`~.aggregate.AggregateModel`: runs of identical consecutive units as
counts; :class:`~.relax.GroupModel`: like units anywhere as counts, one path kept) bounds the real
problem from below; its solutions are read back into plans of the real problem and priced exactly
(:func:`best_read`), and the best becomes the start of what :func:`~.search.solve_problem` does next.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ortools.sat.python import cp_model

from ._run import MIN_SOLVE_S, Found, Run, proven, real_bound, time_scale, within_cap
from .aggregate import AggregateModel, identical_runs
from .paths import MORE_PATHS, covering_paths, critical_path, sibling_paths
from .problem import PlacementProblem
from .reductions import make_room
from .relax import GroupModel, groups_of
from .rows import rounding_slack

__all__ = ["BOUND_FROM", "run_relaxations", "relaxations_for", "solve_relaxation", "best_read", "AGGREGATE_SHARE", "GROUP_ABOVE",
           "GROUP_WITHOUT_RUNS_ABOVE", "GROUP_REPEATS_SHARE", "GROUP_SHARE", "READ_SHARE", "RELAX_RETRIES", "RETRY_READ_GAP"]

#: How a note on where the bound came from begins (:data:`.search.SEARCH_NOTES`).
BOUND_FROM = "bound also from "
#: Most of the time left that the aggregated relaxation (runs of identical units as counts) may take.
AGGREGATE_SHARE = 0.8
#: Problems with more units than this also get the grouped relaxation (identical units anywhere as
#: counts, one path kept: module-level graphs), with at most this share of the time left. Its bound
#: and its best read plan beat what the full model of 292-724 units finds in the rest: Mistral-7B per
#: module on a 6 GiB RTX 3060 at 2 s, 0.68-0.75 % (4 runs) against 1.03-1.05 % with 0.3; Llama-3-70B
#: on RTX 4090 + 3090 at 5 s, 5.1 % against 14 %.
GROUP_ABOVE = 150
#: Graphs with no run of identical consecutive units (sublayer and module graphs: their like units
#: alternate, so the aggregated relaxation has nothing to count) get the grouped relaxation from this
#: many units; ``contiguous`` problems, which never count runs, keep GROUP_ABOVE. At 1 s on the
#: solve_time machines, sublayer Llama-3-8B and Mistral-7B (132 units) on 8x L4 went from a 99.8 % gap
#: to 0.05 %, Mistral-7B on an RTX 3060 from 18.44 s at 12 % to 16.91 s at 0.06 %; module-level 8- and
#: 15-layer Llamas (76 and 139 units) from no bound on 6 of 16 cells to 0.06 % at most, most of these
#: solves in about half the wall time; block Llama-3-70B on 4x T4 with every other layer pinned (pins
#: break the runs) from 4.7 % to 0.05 %.
GROUP_WITHOUT_RUNS_ABOVE = 64
#: Smaller graphs with no run get it when their like units repeat: at most this share as many groups
#: (:func:`~.relax.groups_of`) as units. Gemma-2 past its 4k window alternates sliding and global layers
#: (46-50 units in 6 groups, no run): on RTX 4090 + 3090 at 8064 + 128 tokens, CP-SAT alone proved 54.5 s
#: against a plan of 211.9 s in 1 s (55 %); the grouped relaxation proves it within 0.01 % in 0.06 s.
GROUP_REPEATS_SHARE = 0.5
GROUP_SHARE = 0.9
#: Share of the time the grouped relaxation leaves that its whole-run variant gets (sublayer graphs under overlap:
#: :meth:`~.relax.GroupModel._whole_run_stalls`), run after it only when it stops early short of the gap limit. The
#: rows take the relaxation several times longer to solve: in its place they left the 1 s solves of
#: benchmarks/solve_time's sublayer overlap grid with no better bounds. After it, on the H200 profile's sublayer
#: Llama-3.1-8B at 10 GiB (1 x 512 + 16, overlap, 1 s, seeds 0-2) the bound rose from 0.855 s to 0.875-0.877 s
#: (gaps 10.6-14.8 % -> 8.7-9.1 %), at 4 GiB from 1.648 s to 1.666 s; the grid (two runs each) kept its gaps
#: (mean 3.9-4.6 % before and after) and the H100 host's sublayer plans (benchmarks/phases) stayed within the
#: 1-4 % two runs of one code differ by.
WHOLE_RUNS_SHARE = 0.5
#: Share of a relaxation's time for reading and pricing its earlier solutions (:func:`best_read`; 7-8 ms
#: each on a module-level 70B): kept from its CP-SAT run when it takes all the time left, else taken
#: from the stage after it.
READ_SHARE = 0.1
#: Further solves of a relaxation that proved its optimum early, with other seeds, while its best read plan
#: prices more than :data:`RETRY_READ_GAP` above the bound: the relaxation's optima are many (counts it
#: prices alike), and they read into plans far apart. Llama-3-70B on A100-80GB + T4, chat, overlap: the
#: aggregated relaxation proves 43.14 s in 0.06-0.09 s whatever the seed, and its optimum reads into a plan
#: of 43.8-44.2 s on 5 seeds of 8 and 50.2 s on 3, which neither polish nor the full model left at 1 s.
RELAX_RETRIES = 3
RETRY_READ_GAP = 0.01


def run_relaxations(problem: PlacementProblem, objective: str, relaxations: list[tuple[str, float, Any]],
                     run: Run, start: tuple[list[int], bool], latency_cap_ns: int | None,
                     limits: tuple[float, float], notes: list[str]) -> tuple[Found, tuple[list[int], bool]]:
    """What the relaxations proved (no choice: INFEASIBLE when one found no solution, and the largest bound), and
    the start they leave (a relaxation's plan when no worse). They run in turn until one proves the start within
    the gap or the problem infeasible. ``limits``: the deadline, and the full model's build time
    (:data:`.search.FULL_S_PER_TERM`). Appends where the bound came from to ``notes``."""
    hint, hint_ok = start
    deadline, full_s = limits
    relaxed = Found([], "UNKNOWN", 0)
    for k, (name, share, make) in enumerate(relaxations):
        if deadline - time.perf_counter() < MIN_SOLVE_S:
            break  # building one takes 0.1-0.3 s on 1,500 units, with no clock to stop it: past the time limit
        if k == len(relaxations) - 1 and (1 - share) * (deadline - time.perf_counter()) < max(MIN_SOLVE_S, 2 * full_s):
            share = 1.0  # the full model would not get to search: the last relaxation takes all the time
        now = time.perf_counter()
        span = share * (deadline - now)
        # Its earlier solutions are read after CP-SAT stops: in time taken from what comes next, or,
        # when nothing does, from its own (READ_SHARE).
        until = (now + span * (1 - READ_SHARE), deadline) if share == 1.0 else (now + span, now + span * (1 + READ_SHARE))
        found = solve_relaxation(problem, objective, make, run, (hint, hint_ok), latency_cap_ns, until)
        if found.choice and (not hint_ok or problem.objective_value(found.choice, objective)
                             <= problem.objective_value(hint, objective)):
            hint, hint_ok = found.choice, True
        relaxed = Found([], found.status if found.status == "INFEASIBLE" else relaxed.status,
                         max(relaxed.bound, found.bound))
        notes.append(f"{BOUND_FROM}{name}")
        if relaxed.status == "INFEASIBLE" or (hint_ok and proven(problem, objective, hint, relaxed.bound,
                                                                   run.gap_limit)):
            break
    return relaxed, (hint, hint_ok)


def relaxations_for(problem: PlacementProblem, classes: list[list[str]]) -> list[tuple[str, float, Any]]:
    """(what it counts, share of the time left, model factory) of the relaxations worth building."""
    out: list[tuple[str, float, Any]] = []
    runs = identical_runs(problem)
    if runs:
        out.append((f"{sum(b - a + 1 for a, b in runs)} identical consecutive units counted per option",
                    AGGREGATE_SHARE, lambda scale, hint, work: AggregateModel(problem, scale, hint, runs, work,
                                                                              classes)))
    runless = not runs and not problem.contiguous
    if len(problem.units) > (GROUP_WITHOUT_RUNS_ABOVE if runless else GROUP_ABOVE) or (
            runless and len(groups_of(problem)) <= GROUP_REPEATS_SHARE * len(problem.units)):
        out.append((f"{len(problem.units)} units counted per option in groups of like units", GROUP_SHARE,
                    lambda scale, hint, work: _grouped(problem, scale, hint, work, classes)))
        if problem.copy_runs is not None and problem.copies_beside:
            out.append(("the same with whole copy runs in the stall rows", WHOLE_RUNS_SHARE,
                        lambda scale, hint, work: _grouped(problem, scale, hint, work, classes, whole_runs=True)))
    return out


def _grouped(problem: PlacementProblem, scale: int, hint: list[int], work: int | None,
             classes: list[list[str]], whole_runs: bool = False) -> GroupModel:
    path, *others = sibling_paths(problem, critical_path(problem, hint))
    others += covering_paths(problem, path, MORE_PATHS - len(others)) if len(others) < MORE_PATHS else []
    return GroupModel(problem, scale, hint, groups_of(problem, path, others), path, work, classes,
                      others, whole_runs)


def solve_relaxation(problem: PlacementProblem, objective: str, make: Any, run: Run, start: tuple[list[int], bool],
           latency_cap_ns: int | None, until: tuple[float, float]) -> Found:
    """A relaxation's proven bound, and its best plan read back when valid (better than the start or not). ``until``: when
    CP-SAT stops, and when reading its earlier solutions stops (:func:`best_read`)."""
    hint, hint_ok = start
    scale = time_scale(problem, hint, objective)
    slack = rounding_slack(problem, objective)
    unit_scale = 1 if objective == "memory" else scale
    max_work = problem.objective_value(hint, objective) if hint_ok and objective != "memory" else latency_cap_ns
    m = make(scale, hint, max_work)
    m.minimize(objective, latency_cap_ns, rounding_slack(problem, "latency"))  # the cap's slack: latency's
    rounding = slack * unit_scale / max(1, problem.objective_value(hint, objective)) if unit_scale > 1 else 0.0
    gap_limit = max(0.0, run.gap_limit - rounding)
    began = time.perf_counter()
    solver, status = m.solve(until[0] - began, run.seed, run.workers, gap_limit)
    if status == cp_model.INFEASIBLE:
        return Found([], "INFEASIBLE", 0)
    bound = real_bound(m.proven_bound(solver), unit_scale, slack) if status != cp_model.MODEL_INVALID else 0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Found([], "UNKNOWN", bound)
    best = best_read(problem, objective, m, [solver, *m.solutions], latency_cap_ns, until[1])
    if status == cp_model.OPTIMAL and not (best and proven(problem, objective, best, bound, RETRY_READ_GAP)):
        best, bound = _other_optima(problem, objective, m, run, (best, bound), time.perf_counter() - began,
                                    lambda raw: real_bound(raw, unit_scale, slack), (gap_limit, latency_cap_ns), until)
    return Found(best, "FEASIBLE", bound)


def _other_optima(problem: PlacementProblem, objective: str, m: Any, run: Run, found: tuple[list[int], int],
                  took: float, rescale: Any, limits: tuple[float, int | None],
                  until: tuple[float, float]) -> tuple[list[int], int]:
    """The best read and the largest bound over a relaxation solved again with the next seeds (up to
    :data:`RELAX_RETRIES`), while its time allows a solve as long as the longest so far and the best read
    prices more than :data:`RETRY_READ_GAP` above the bound: which optimum CP-SAT returns, and so the plan it
    reads into, depends on the seed. ``found``: the first solve's (read, bound); ``took``: its seconds."""
    best, bound = found
    gap_limit, latency_cap_ns = limits
    for retry in range(1, RELAX_RETRIES + 1):
        if time.perf_counter() + took > until[0]:
            break
        began = time.perf_counter()
        solver, status = m.solve(until[0] - began, run.seed + retry, run.workers, gap_limit)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        bound = max(bound, rescale(m.proven_bound(solver)))
        read = best_read(problem, objective, m, [solver, *m.solutions], latency_cap_ns, until[1])
        if read and (not best or problem.objective_value(read, objective) < problem.objective_value(best, objective)):
            best = read
        took = max(took, time.perf_counter() - began)
        if status != cp_model.OPTIMAL or (best and proven(problem, objective, best, bound, RETRY_READ_GAP)):
            break
    return best, bound


def best_read(problem: PlacementProblem, objective: str, m: Any, solutions: Sequence[Any],
               latency_cap_ns: int | None, until: float) -> list[int]:
    """The lowest-priced valid plan read from a relaxation's solutions (its last one, then earlier ones,
    newest first, while time is left before ``until``), or ``[]``; the caller compares it with the start.

    Counts that relax better do not read into plans that price better (:data:`._counted.KEEP_SOLUTIONS`)."""
    best: list[int] = []
    best_value = None
    seen: set[tuple[int, ...]] = set()
    for k, solution in enumerate(solutions):
        if k and time.perf_counter() > until:
            break
        choice = m.read(solution)
        if tuple(choice) in seen:
            continue
        seen.add(tuple(choice))
        if not problem.satisfies(choice):
            choice = make_room(problem, choice, until=until)
        if not (problem.satisfies(choice) and within_cap(problem, choice, latency_cap_ns)):
            continue
        value = problem.objective_value(choice, objective)
        if best_value is None or value < best_value:
            best, best_value = choice, value
    return best
