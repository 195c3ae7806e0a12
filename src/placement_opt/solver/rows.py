"""The rows and option predicates every CP-SAT model here shares: the full model and both counting relaxations.

Torch-free. :class:`~.cpsat.PlacementModel` states them on one 0/1 variable per unit and option; the
counting relaxations (:mod:`.aggregate`, :mod:`.relax`) on counts of identical units. Each states
capacity and the transient peak the same way, and reads an option's devices and work through the same
predicates, so a bound from a relaxation is a bound of the full model.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ortools.sat.python import cp_model

from .problem import PHASES, DeviceSpec, PlacementOption, PlacementProblem

__all__ = ["DETERMINISTIC_TIME_PER_S", "LEVEL_CAP_SIZES", "new_solver", "rounding_slack", "add_capacity_row",
           "add_level_caps", "peak_levels", "computes_on", "stage_work", "own_work", "peak_flags"]

#: CP-SAT deterministic time per second of time limit. The search stops at whichever limit comes
#: first; this one comes first on this project's 2-core VMs (about 0.35-0.4 units accrue per second
#: with one worker), and a one-worker search stopped by it returns the same plan on every run.
DETERMINISTIC_TIME_PER_S = 0.3
#: add_level_caps states its rows for the units at least as large as each of this many largest sizes.
LEVEL_CAP_SIZES = 2


def rounding_slack(problem: PlacementProblem, objective: str) -> int:
    """The most ``objective`` rounded to solver units can differ from the exact one, in solver units: half a
    unit per rounded term (units, and edges for latency), doubled, and for latency as much again when some
    option copies (a stall's error is at most half a unit per unit its window spans). Memory is exact."""
    if objective == "memory":
        return 0
    n = len(problem.units)
    if objective != "latency":
        return n
    return n + len(problem.edges) + (n if problem.copies_beside else 0)


def new_solver(time_limit_s: float, seed: int, workers: int, gap_limit: float) -> cp_model.CpSolver:
    """A CP-SAT solver with the settings every model here runs under (the full one and the relaxations)."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    if workers == 1:  # reproducible: the deterministic budget, not the clock, ends the search
        solver.parameters.max_deterministic_time = max(0.01, time_limit_s) * DETERMINISTIC_TIME_PER_S
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    solver.parameters.relative_gap_limit = gap_limit
    solver.parameters.cp_model_probing_level = 0  # probing and repeated presolve passes can eat
    solver.parameters.max_presolve_iterations = 1  # most of a 1 s budget before the hint is loaded
    return solver


def add_capacity_row(model: cp_model.CpModel, device: DeviceSpec, peak: Any,
                     terms: Sequence[tuple[PlacementOption, Any]]) -> None:
    """Stored + resident + peak bytes on ``device`` stay within its capacity.

    ``terms``: (option, how many units use it) pairs, a 0/1 variable in the full model and a count in
    the relaxations; ``peak``: the device's transient peak bytes (every option's :func:`peak_flags`,
    a phased option's prefill transient included). Resident bytes stay on ``execution``, phased or not.
    """
    row = [peak]
    for opt, n in terms:
        size = (opt.stored_bytes if opt.storage == device.name else 0) + \
               (opt.resident_bytes if opt.execution == device.name else 0)
        if size:
            row.append(size * n)
    model.add(sum(row) <= device.capacity_bytes)


def add_level_caps(model: cp_model.CpModel, device: DeviceSpec, levels: Sequence[int], z: Sequence[Any],
                   terms: Sequence[tuple[PlacementOption, Any, int]]) -> None:
    """How many units of each option fit on ``device`` beside each level of its peak: a valid cut.

    ``terms``: (option, count of units on it, the count's upper bound); ``levels``/``z`` from
    :func:`peak_levels`. When ``z[j]`` is 1 the device's peak is at least ``levels[j]``, so ``n`` units
    putting ``b`` bytes each there fit only if ``n <= (capacity - levels[j]) // b``; stated as
    ``n <= top - (top - cap_j) z[j]`` (``top``: the most beside the option's own peak). Every
    assignment meets it, so it cuts no solution; the LP loses its cheapest trick: a large transient
    (a stream buffer, a phased prefill) spread as a small fraction over every GPU of a class, each
    then still holding its full share of resident layers (Llama-3.1-405B on 8 x L4).
    """
    sized = []  # (bytes on device, own transient there, count, its bound)
    for opt, n, most in terms:
        size = ((opt.stored_bytes if opt.storage == device.name else 0)
                + (opt.resident_bytes if opt.execution == device.name else 0))
        if size > 0:
            sized.append((size, max(peak_flags(opt, device.name), default=0), n, most))
    for b in sorted({size for size, *_ in sized}, reverse=True)[:LEVEL_CAP_SIZES]:
        group = [(own, n, most) for size, own, n, most in sized if size >= b]
        top = min(sum(most for *_, most in group), max(0, (device.capacity_bytes - min(own for own, *_ in group)) // b))
        for level, zj in zip(levels, z, strict=True):
            cap = min(top, max(0, (device.capacity_bytes - level) // b))
            if cap < top:
                model.add(sum(n for _, n, _ in group) <= top - (top - cap) * zj)


def peak_levels(model: cp_model.CpModel, device: str,
                flagged: Sequence[tuple[int, Any]]) -> tuple[Any, list[int], list[Any]]:
    """The transient peak of ``device`` as level flags: ``(peak expression, levels, z)``.

    ``flagged``: (transient bytes, a 0/1 that is 1 when some unit runs with that transient on ``device``;
    see :func:`peak_flags`).
    ``z[j]`` is 1 if some unit computed there has a peak of at least ``levels[j]`` (the distinct
    peaks, ascending); the peak is the sum of the level steps switched on. The full model and both
    relaxations state it this way.
    """
    levels = sorted({peak for peak, _ in flagged if peak > 0})
    z = [model.new_bool_var(f"z[{device},{j}]") for j in range(len(levels))]
    for a, b in itertools.pairwise(z):
        model.add_implication(b, a)
    where = {level: j for j, level in enumerate(levels)}
    for peak, flag in flagged:
        if peak > 0:
            model.add_implication(flag, z[where[peak]])
    steps = [b - a for a, b in zip([0, *levels], levels, strict=False)]
    return (sum(step * zj for step, zj in zip(steps, z, strict=True)) if z else 0), levels, z


def computes_on(opt: PlacementOption, device: str, phase: str | None = None) -> bool:
    """True when ``opt`` computes on ``device`` in ``phase`` (in either phase when None)."""
    if opt.prefill_execution is None:  # the common case first: both phases on its execution device
        return opt.execution == device
    if phase is not None:
        return opt.device_in(phase) == device
    return device in (opt.execution, opt.prefill_execution)


def stage_work(opt: PlacementOption, device: str, t: Any) -> int:
    """What ``opt`` adds to ``device``'s stage (throughput) in solver time (``t``: ns -> solver units):
    each phase on the device computing it, as :meth:`~.problem.PlacementProblem.score` adds it."""
    return sum(t(opt.work_in(ph)) for ph in PHASES if opt.device_in(ph) == device)


def own_work(opt: PlacementOption) -> int:
    """The most work (ns) ``opt`` puts on one device: prefill + decode, or for a phased option the larger
    of the two (they land on two devices). At most both the latency (a phase's longest path holds the
    unit) and the slowest stage of any assignment using ``opt``, so options above a known objective
    value can be left out."""
    if opt.device_in("prefill_ns") == opt.execution:
        return opt.work_ns
    return max(opt.work_in("prefill_ns"), opt.work_in("decode_ns"))


def peak_flags(opt: PlacementOption, device: str) -> list[int]:
    """The transient bytes ``opt`` puts on ``device`` (:meth:`~.problem.PlacementOption.peaks`)."""
    return [nbytes for d, nbytes in opt.peaks() if d == device]
