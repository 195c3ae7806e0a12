"""Brute force over every assignment, from the definitions in problem.py's docstring written anew.

Shared by the solver's property tests: nothing here calls ``PlacementProblem.score`` or ``satisfies``
(nor ``PlacementOption.device_in`` or ``peaks``: a phased option's prefill device is read off its fields).
"""

from __future__ import annotations

import contextlib
import itertools

from hypothesis import strategies as st

from _overlap import simulated_waits
from placement_opt.solver import _relaxing, _run, aggregate, search


def computes(o, key):
    """The device computing option ``o`` in phase ``key``: a phased option prefills on its prefill_execution."""
    return o.prefill_execution if key == "prefill_ns" and o.prefill_execution is not None else o.execution


def reference_value(problem, choice, objective, runs=None):
    """``objective`` of ``choice`` from the definitions in problem.py's docstring, written anew here (``runs``: the
    problem's :func:`reference_runs`, computed once by a caller scoring many choices)."""
    runs = reference_runs(problem) if runs is None else runs
    chosen = dict(zip([u.name for u in problem.units], (u.options[c] for u, c in zip(problem.units, choice, strict=True)), strict=True))
    devices = [d.name for d in problem.devices]
    incoming = {name: [] for name in chosen}
    for e in problem.edges:
        incoming[e.dst].append(e)

    def phase(key):
        options = list(chosen.values())
        waits = dict(zip(chosen, simulated_waits([getattr(o, key) for o in options],
                                                 [copy_of(o, key) for o in options], cyclic=key == "decode_ns",
                                                 runs=runs),
                         strict=True))
        finish = {}
        for name, o in chosen.items():  # units are in execution order and edges point forward
            here = computes(o, key)
            arrivals = [finish[e.src] + (getattr(e, key).get((computes(chosen[e.src], key), here), 0)
                                         if computes(chosen[e.src], key) != here else 0)
                        for e in incoming[name]]
            finish[name] = max(arrivals, default=0) + waits[name] + getattr(o, key)
        busiest = max(sum(getattr(o, key) for o in options if computes(o, key) == d) for d in devices)
        copies = sum(copy_of(o, key) for o in options)
        host = sum(o.host_prefill_ns if key == "prefill_ns" else o.host_decode_ns for o in options)
        disk = sum(o.disk_prefill_ns if key == "prefill_ns" else o.disk_decode_ns for o in options)
        return max(max(finish.values()), busiest, copies, host, disk)

    if objective == "latency":
        return phase("prefill_ns") + phase("decode_ns")
    if objective == "throughput":  # a streamed unit's stage work: the longer of its compute and its copy
        return max(sum(max(getattr(o, key), copy_of(o, key)) for o in chosen.values()
                       for key in ("prefill_ns", "decode_ns") if computes(o, key) == d) for d in devices)
    return sum(reference_bytes(list(chosen.values()), d.name, runs)
               for d in problem.devices if d.kind == "gpu")


def reference_runs(problem):
    """``copy_groups`` as ranges covering every unit (None without a group of two units or more)."""
    if all(len(g) < 2 for g in problem.copy_groups):
        return None
    position = {u.name: i for i, u in enumerate(problem.units)}
    heads = {position[g[0]]: len(g) for g in problem.copy_groups}
    runs, u = [], 0
    while u < len(problem.units):
        runs.append((u, u + heads.get(u, 1)))
        u = runs[-1][1]
    return runs


def copy_of(o, key):
    return o.copy_prefill_ns if key == "prefill_ns" else o.copy_decode_ns


def reference_bytes(chosen, device, runs=None):
    """Stored + resident + the transient: without group copies the largest peak there; with them, in each
    phase, over the copy runs with a unit computing or copying there then, the largest of (the run's largest
    peak there in the phase, each less twice its group copy on the device it copies to, + the run's group
    copies there in the phase + the larger of those and the next copying run's). The prefill copies and holds
    a phased option's prefill side, the decode neither; the decode's next goes round the cycle, a prefill's
    last copying run is followed by the decode's first."""
    stored = sum(o.stored_bytes for o in chosen if o.storage == device)
    resident = sum(o.resident_bytes for o in chosen if o.execution == device)
    if not any(o.group_copy_bytes for o in chosen):
        peaks = [o.peak_bytes for o in chosen if o.execution == device]
        peaks += [o.prefill_peak_bytes for o in chosen if o.prefill_execution == device]
        return stored + resident + max(peaks, default=0)

    # where a group copy lands: a phased option's prefill GPU; a unit's peak there is less twice its copy
    lands = [bool(o.group_copy_bytes) and (o.prefill_execution or o.execution) == device for o in chosen]

    def own(i, prefill):
        o = chosen[i]
        cut = 2 * o.group_copy_bytes if lands[i] else 0
        peaks = [o.peak_bytes - cut] if o.execution == device else []
        if prefill and o.prefill_execution == device:
            peaks.append(o.prefill_peak_bytes - cut)
        return peaks

    runs = runs or [(u, u + 1) for u in range(len(chosen))]
    made = {True: [sum(chosen[i].group_copy_bytes for i in range(a, b) if lands[i]) for a, b in runs],
            False: [sum(chosen[i].group_copy_bytes for i in range(a, b) if lands[i] and chosen[i].mode == "stream")
                    for a, b in runs]}

    def following(prefill, r):  # the next run after r that copies (the decode: r itself last)
        copies = made[prefill]
        for step in range(1, len(runs) + (0 if prefill else 1)):
            if r + step >= len(runs) and prefill:
                break
            if copies[(r + step) % len(runs)]:
                return copies[(r + step) % len(runs)]
        return next((c for c in made[False] if c), 0) if prefill else 0

    values = []
    for prefill in (True, False):
        for r, (a, b) in enumerate(runs):
            peaks = [p for i in range(a, b) for p in own(i, prefill)]
            if peaks or made[prefill][r]:
                values.append(max(peaks, default=0) + made[prefill][r]
                              + max(made[prefill][r], following(prefill, r)))
    return stored + resident + max(values, default=0)


def reference_valid(problem, choice):
    """Whether ``choice`` keeps the pins, ties, contiguity and every device's capacity."""
    return validator(problem)(choice)


def validator(problem):
    """:func:`reference_valid` of ``problem`` as a function of the choice, with what does not depend on the choice
    found once: a brute force calls it for every assignment. The cheap checks first; the capacities, which take
    most of a brute force's time, last."""
    runs = reference_runs(problem)
    names = [u.name for u in problem.units]
    # contiguity holds over the units that store bytes: a unit storing nothing may sit anywhere
    storing = [i for i, u in enumerate(problem.units) if any(x.stored_bytes for x in u.options)]

    def valid(choice):
        chosen = [u.options[c] for u, c in zip(problem.units, choice, strict=True)]
        storage = dict(zip(names, (o.storage for o in chosen), strict=True))
        if any(storage[n] != d for n, d in problem.pins.items()):
            return False
        if any(len({storage[n] for n in group}) > 1 for group in problem.tied_groups):
            return False
        blocks = [k for k, _ in itertools.groupby(chosen[i].storage for i in storing)]
        if problem.contiguous and len(blocks) != len(set(blocks)):
            return False
        return all(reference_bytes(chosen, d.name, runs) <= d.capacity_bytes for d in problem.devices)

    return valid


def reference_optimum(problem, objective, memory_slack=0.05):
    """The optimum over every assignment (None when none is valid); memory: within the latency slack."""
    runs, valid = reference_runs(problem), validator(problem)
    every = [c for c in itertools.product(*(range(len(u.options)) for u in problem.units)) if valid(c)]
    if not every:
        return None
    if objective != "memory":
        return min(reference_value(problem, c, objective, runs) for c in every)
    cap = int(min(reference_value(problem, c, "latency", runs) for c in every) * (1 + memory_slack))
    return min(reference_value(problem, c, "memory", runs) for c in every
               if reference_value(problem, c, "latency", runs) <= cap)


@contextlib.contextmanager
def every_reduction_on():
    """Lower the thresholds: a 2-unit problem is coarsened first, 4 identical units are counted, any problem
    gets the grouped relaxation, time is rounded."""
    # Each threshold where the search reads it: a name moved to another module fails here (getattr), not silently.
    where = {search: ("COARSEN_ABOVE",), _run: ("TIME_RESOLUTION", "SLACK_STEPS"),
             _relaxing: ("GROUP_ABOVE", "GROUP_WITHOUT_RUNS_ABOVE"), aggregate: ("MIN_INTERIOR",)}
    lowered = {"COARSEN_ABOVE": 1, "TIME_RESOLUTION": 7, "SLACK_STEPS": 1, "GROUP_ABOVE": 0,
               "GROUP_WITHOUT_RUNS_ABOVE": 0, "MIN_INTERIOR": 2}
    saved = [(module, k, getattr(module, k)) for module, names in where.items() for k in names]
    for module, k, _ in saved:
        setattr(module, k, lowered[k])
    try:
        yield
    finally:
        for module, k, v in saved:
            setattr(module, k, v)


def check_against_brute_force(problem, objective, data, workers=1):
    hint = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]  # often invalid
    best = reference_optimum(problem, objective)
    with every_reduction_on():
        sol = search.solve_problem(problem, objective, time_limit_s=5, workers=workers, gap_limit=0.0, hint=hint)
    if best is None:
        assert not sol.feasible and sol.choice == ()
        return
    assert sol.feasible, "brute force finds a plan; the solver must return one"
    assert reference_valid(problem, sol.choice)  # capacities, pins, ties, contiguity
    assert sol.objective_value == reference_value(problem, sol.choice, objective)
    # memory: the first solve's latency cap is >= the best latency's, so its optimum is <= brute force's.
    assert sol.best_bound <= best, f"bound {sol.best_bound} above the brute-force optimum {best}"
    if sol.status == "OPTIMAL":
        assert sol.objective_value == best if objective != "memory" else sol.objective_value <= best
    assert sol.gap >= 0.0


def reported_bound(model, solver):
    """A relaxation's proven bound as ``solve_problem`` reports it (floored to an integer: CP-SAT states an
    integer objective's bound as a float, 180.00000000000003 for 180 now and then)."""
    return _run.real_bound(model.proven_bound(solver), 1, 0)
