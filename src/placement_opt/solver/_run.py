"""What the stages of one :func:`~.search.solve_problem` call share: its settings, a stage's answer, and
the integer time scale a bound is read back through.

Torch-free. Every CP-SAT model of a solve (the full one and the relaxations) prices time in
``scale_ns`` steps (:func:`time_scale`); :func:`real_bound` turns a bound in those steps back into a
bound of the real problem, rounding slack taken off, and :func:`proven` says when a plan is within the
gap limit of one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .problem import PlacementProblem

__all__ = ["Run", "Found", "proven", "within_cap", "time_scale", "work_lower_bound", "path_lower_bound", "real_bound",
           "TIME_RESOLUTION", "SLACK_STEPS", "MIN_SOLVE_S"]

#: Least number of integer steps the hint's objective is divided into: sets ``scale_ns``.
TIME_RESOLUTION = 200_000
#: Steps per rounded term (units + edges): the rounding slack stays below 1/2000 of the objective's
#: scale base (0.05 %) however many units the graph has (724 units at module granularity).
SLACK_STEPS = 2000
#: Least time left after building the full model for CP-SAT to run it at all: loading a 724-unit model
#: into CP-SAT takes about this long before its clock starts.
MIN_SOLVE_S = 0.05


@dataclass(frozen=True)
class Run:
    """Search settings shared by the solves of one call."""

    seed: int
    workers: int
    gap_limit: float
    t0: float
    """perf_counter() when the call began: every solve's budget ends at t0 + time_limit_s."""


@dataclass(frozen=True)
class Found:
    """One CP-SAT run's answer: a choice (empty if none), its status and the proven bound."""

    choice: list[int]
    status: str
    bound: int


def proven(problem: PlacementProblem, objective: str, choice: Sequence[int], bound: int, gap_limit: float) -> bool:
    value = problem.objective_value(choice, objective)
    return value <= 0 or (value - bound) / value <= gap_limit


def within_cap(problem: PlacementProblem, choice: Sequence[int], latency_cap_ns: int | None) -> bool:
    return latency_cap_ns is None or problem.objective_value(choice, "latency") <= latency_cap_ns


def time_scale(problem: PlacementProblem, hint: Sequence[int], objective: str) -> int:
    """ns per solver time unit: the hint's time objective (at most 10x a simple lower bound) in steps.

    A poor hint (10x the optimum) would otherwise make the steps, and the rounding slack, 10x coarser.
    """
    key = "throughput" if objective == "throughput" else "latency"
    base = min(problem.objective_value(hint, key), 10 * work_lower_bound(problem))
    steps = max(TIME_RESOLUTION, SLACK_STEPS * (len(problem.units) + len(problem.edges)))
    return max(1, base // steps)


def work_lower_bound(problem: PlacementProblem) -> int:
    """Every unit's least prefill + decode, shared evenly by the devices that compute (in either phase):
    <= either time objective."""
    least = _least_times(problem)
    total = sum(least[id(u.options)] for u in problem.units)
    computing = {d for m in problem.menu_units for o in m.options for d in (o.execution, o.device_in("prefill_ns"))}
    return total // max(1, len(computing))


def path_lower_bound(problem: PlacementProblem) -> int:
    """The graph's longest path with each unit at its least prefill + decode: <= the latency of every assignment.

    Each phase's finish holds the durations of every unit along any path (a unit starts once its inputs have
    arrived; transfers and stalls only add), and both phases run the same graph, so one path bounds their sum. On
    a chain (every graph: units run in turn) it is every unit's least time. The bound that stands when no
    relaxation proves one in time: a 164-unit sublayer Mixtral-8x7B on 8x L4 under overlap, at 1 s, proved
    nothing (a 100 % gap) on some runs.
    """
    least = _least_times(problem)
    index = problem.index()
    incoming: dict[int, list[int]] = {}
    for e in problem.edges:
        incoming.setdefault(index[e.dst], []).append(index[e.src])
    length = [0] * len(problem.units)
    for u, unit in enumerate(problem.units):  # edges point forward in execution order
        length[u] = max((length[a] for a in incoming.get(u, ())), default=0) + least[id(unit.options)]
    return max(length, default=0)


def _least_times(problem: PlacementProblem) -> dict[int, int]:
    """Each menu's (``id`` of its options) least prefill + decode over its options."""
    return {id(m.options): min(o.prefill_ns + o.decode_ns for o in m.options) for m in problem.menu_units}


def real_bound(objective_bound: float, scale: int, slack_units: int) -> int:
    """A CP-SAT objective bound (solver units) as a bound of the real problem: scaled, less the rounding slack.

    CP-SAT gives the bound as a double, which past 2**53 is the integer bound rounded to the nearest double, up as
    often as down: there, one unit in the last place less (a bound of 2**54+3 read as 2**54+4 was above the
    optimum)."""
    whole = math.floor(objective_bound)
    if abs(objective_bound) >= 2**53:
        whole -= int(math.ulp(objective_bound))
    return max(0, whole * scale - (slack_units * scale if scale > 1 else 0))
