"""Phased options (prefill on a GPU, decode on the CPU) through every solver component, against brute force.

A ``phased`` option computes its unit on ``prefill_execution`` in the prefill and on ``execution`` in
the decode, and puts ``prefill_peak_bytes`` on the prefill device. The generator below mixes such
options (stored on the CPU or the disk, decoded on the CPU, prefilled on each GPU) with the usual
ones, and drops whole kinds of options from a menu, so that a unit's prefill devices often differ
from its decode devices (the case a component reading ``execution`` alone gets wrong). Everything is
checked against ``_brute.py``, which reads the phase devices off the option's fields itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from _brute import (
    check_against_brute_force,
    every_reduction_on,
    reference_optimum,
    reference_valid,
    reference_value,
    reported_bound,
)
from _problems import copy_groups
from hypothesis import given, settings
from hypothesis import strategies as st

from placement_opt.solver import aggregate, rows, search
from placement_opt.solver.aggregate import AggregateModel, identical_runs
from placement_opt.solver.cpsat import PlacementModel
from placement_opt.solver.edges import covered_edges, prune_edges
from placement_opt.solver.greedy import (
    GREEDY_RESERVES,
    best_greedy_choice,
    choice_from_storage,
    greedy_choice,
)
from placement_opt.solver.paths import critical_path
from placement_opt.solver.problem import (
    OBJECTIVES,
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
)
from placement_opt.solver.reductions import coarsen, coarsen_groups, prefer_resident
from placement_opt.solver.relax import GroupModel, groups_of
from placement_opt.solver.starts import executor_starts, fits, improve
from placement_opt.solver.symmetry import first_use, identical_devices, relabel

_MAX_ASSIGNMENTS = 2500  # brute force stays around 0.1 s a case
#: Option kinds of a menu: resident on each GPU, streamed from the CPU to each GPU, resident on the CPU,
#: phased (stored on the CPU or the disk, decoded on the CPU, prefilled on each GPU), streamed disk -> CPU.
_KINDS = ("gpu", "stream", "cpu", "phased", "disk")


def _prices(draw, devices, twins):
    """Transfer prices per ordered pair of computing devices; ``twins``: one price per kind pair."""
    if twins:
        kinds = {(a, b): draw(st.integers(0, 9)) for a in ("gpu", "cpu") for b in ("gpu", "cpu")}
        return {(p, q): kinds["gpu" if p != "cpu" else "cpu", "gpu" if q != "cpu" else "cpu"]
                for p in devices for q in devices if p != q}
    return {(p, q): draw(st.integers(0, 9)) for p in devices for q in devices if p != q}


def _menu(draw, gpus, twins, has_disk, most, allowed=_KINDS, copying=False):
    """A menu of at most ``most`` options from a random set of ``allowed`` kinds (phased most often);
    ``copying``: streamed and phased options may copy with their group (``group_copy_bytes``)."""
    kinds = [k for k in allowed if (has_disk or k != "disk") and draw(st.integers(0, 3 if k == "phased" else 1))]
    per_kind = {k: len(gpus) if k in ("gpu", "stream", "phased") else 1 for k in _KINDS}
    while sum(per_kind[k] for k in kinds) > most:  # keep the later kinds (phased before disk)
        kinds.pop(0)
    kinds = kinds or ["phased"]
    stored = draw(st.integers(0, 6))
    store = draw(st.sampled_from(["cpu", "disk"])) if has_disk else "cpu"  # the phased options' store

    def numbers():
        return dict(prefill_ns=draw(st.integers(0, 30)), decode_ns=draw(st.integers(0, 60)),
                    resident_bytes=draw(st.integers(0, 2)), peak_bytes=draw(st.integers(0, 4)))

    shared = {k: numbers() for k in kinds}
    prefill_peak = draw(st.integers(0, 6))
    options = []
    for kind in kinds:
        for g in gpus if kind in ("gpu", "stream", "phased") else [None]:
            n = shared[kind] if twins or g is None else numbers()
            if kind == "gpu":
                options.append(PlacementOption(storage=g, execution=g, mode="resident", stored_bytes=stored, **n))
            elif kind == "stream":
                share = draw(st.integers(0, 2)) if copying else 0  # its group copy, twice in its peak
                options.append(PlacementOption(storage="cpu", execution=g, mode="stream", stored_bytes=stored,
                                               **(n | dict(peak_bytes=n["peak_bytes"] + 2 * share,
                                                           group_copy_bytes=share))))
            elif kind == "cpu":
                options.append(PlacementOption(storage="cpu", execution="cpu", mode="resident", stored_bytes=stored,
                                               **n))
            elif kind == "disk":
                options.append(PlacementOption(storage="disk", execution="cpu", mode="stream", stored_bytes=stored,
                                               **n))
            else:
                peak = prefill_peak if twins else draw(st.integers(0, 6))
                share = draw(st.integers(0, 2)) if copying else 0  # its prefill's group copy, twice there
                options.append(PlacementOption(storage=store, execution="cpu", mode="phased", prefill_execution=g,
                                               prefill_peak_bytes=peak + 2 * share, group_copy_bytes=share,
                                               stored_bytes=stored, **n))
    return tuple(options)


@st.composite
def phased_problems(draw, run=False):
    """Chains and small DAGs on 1-2 GPUs (interchangeable or not), a CPU and maybe a disk, capacities tight,
    with phased options; pins, ties and contiguity now and then. One problem in four computes only on the
    CPU but for phased prefills: its GPUs are prefill devices alone (no option executes there).

    ``run``: units 1 to n - 1 (n >= 5) are identical and joined by one price (a run the solver counts).
    """
    n_gpus = draw(st.integers(1, 2))
    gpus = [f"cuda:{i}" for i in range(n_gpus)]
    twins = n_gpus > 1 and draw(st.booleans())
    has_disk = draw(st.booleans())
    compute = [*gpus, "cpu"]
    allowed = ("cpu", "phased", "disk") if draw(st.integers(0, 3)) == 0 else _KINDS
    copying = draw(st.integers(0, 2)) == 0  # one problem in three copies with groups
    first = _menu(draw, gpus, twins, has_disk, 8, allowed, copying)
    if run:
        body = _menu(draw, gpus, twins, has_disk, 4, allowed, copying)
        n = max(5, min(7, int(math.log(_MAX_ASSIGNMENTS / len(first)) / math.log(max(2, len(body))))))
        menus = [first] + [body] * (n - 1)
    else:
        menus, target = [first], draw(st.integers(2, 6))
        while len(menus) < target:
            menu = menus[-1] if draw(st.integers(0, 2)) == 0 else _menu(draw, gpus, twins, has_disk, 8, allowed,
                                                                        copying)
            if math.prod(len(m) for m in menus) * len(menu) > _MAX_ASSIGNMENTS:
                break
            menus.append(menu)
        n = len(menus)
    units = tuple(UnitSpec(name=f"u{i}", options=m) for i, m in enumerate(menus))
    pairs = [(i, i + 1) for i in range(n - 1)]
    if run and n >= 6 and draw(st.booleans()):
        pairs.append((0, n - 1))
    elif not run and draw(st.booleans()):  # a DAG: skip edges, some chain edges dropped
        pairs = [p for p in pairs if draw(st.integers(0, 3))] + \
            [(i, j) for i in range(n) for j in range(i + 2, n) if draw(st.booleans())]
    shared = (_prices(draw, compute, twins), _prices(draw, compute, twins))
    edges = []
    for i, j in pairs:
        pre, dec = shared if run or draw(st.integers(0, 2)) else (_prices(draw, compute, twins),
                                                                  _prices(draw, compute, twins))
        edges.append(EdgeSpec(src=f"u{i}", dst=f"u{j}", prefill_ns=pre, decode_ns=dec))
    gpu_cap = draw(st.integers(0, 16))
    specs = [DeviceSpec(name=g, kind="gpu", capacity_bytes=gpu_cap if twins else draw(st.integers(0, 16)))
             for g in gpus] + [DeviceSpec(name="cpu", kind="cpu", capacity_bytes=draw(st.integers(4, 50)))]
    specs += [DeviceSpec(name="disk", kind="disk", capacity_bytes=draw(st.integers(0, 40)))] if has_disk else []
    tied = (("u0", f"u{n - 1}"),) if n >= 2 and not run and draw(st.integers(0, 4)) == 0 else ()
    pins = {}
    if draw(st.integers(0, 4)) == 0:
        unit = units[0 if run else draw(st.integers(0, n - 1))]
        pins = {unit.name: draw(st.sampled_from(sorted({o.storage for o in unit.options})))}
    return PlacementProblem(units=units, edges=tuple(edges), devices=tuple(specs), tied_groups=tied, pins=pins,
                            contiguous=not run and draw(st.integers(0, 5)) == 0, copy_groups=copy_groups(draw, n))


def _assignments(problem):
    return itertools.product(*(range(len(u.options)) for u in problem.units))


def _hint(problem, data):
    return [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]


# -- the reference itself ---------------------------------------------------------------------------
@settings(max_examples=100)
@given(phased_problems(), st.data())
def test_the_brute_force_reference_agrees_with_score(problem, data):
    # _brute.py restates the phased definitions; score() must say the same (else neither can be trusted).
    choice = _hint(problem, data)
    for objective in OBJECTIVES:
        assert reference_value(problem, choice, objective) == problem.objective_value(choice, objective)
    assert reference_valid(problem, choice) == problem.satisfies(choice)


# -- solve_problem, every reduction forced on ---------------------------------------------------------
@settings(max_examples=150)
@given(phased_problems(), st.sampled_from(OBJECTIVES), st.data())
def test_solve_problem_against_brute_force_with_phased_options(problem, objective, data):
    check_against_brute_force(problem, objective, data)


@settings(max_examples=100)
@given(phased_problems(run=True), st.sampled_from(OBJECTIVES), st.data())
def test_counted_runs_with_phased_options_against_brute_force(problem, objective, data):
    with every_reduction_on():
        assert identical_runs(problem)  # the counted relaxation is built
    check_against_brute_force(problem, objective, data)


@settings(max_examples=100)
@given(phased_problems(), st.sampled_from(OBJECTIVES), st.data())
def test_solve_problem_with_its_own_start_and_defaults(problem, objective, data):
    # No thresholds lowered: the greedy start, the full model and its rounding as users get them.
    best = reference_optimum(problem, objective)
    sol = search.solve_problem(problem, objective, time_limit_s=5, workers=1, gap_limit=0.0)
    if best is None:
        assert not sol.feasible
        return
    assert sol.feasible and reference_valid(problem, sol.choice)
    assert sol.objective_value == reference_value(problem, sol.choice, objective)
    assert sol.best_bound <= best
    if sol.status == "OPTIMAL":
        assert sol.objective_value == best if objective != "memory" else sol.objective_value <= best


# -- each model on its own, in exact integer time (scale 1: no rounding slack) -----------------------
def _cap(problem):
    """The memory objective's latency cap as reference_optimum sets it."""
    valid = [c for c in _assignments(problem) if reference_valid(problem, c)]
    return int(min(reference_value(problem, c, "latency") for c in valid) * 1.05) if valid else 0


def _max_work(problem, hint, objective):
    """What search passes: a valid start's value bounds every option's own work (time objectives)."""
    if objective == "memory" or not reference_valid(problem, hint):
        return None
    return reference_value(problem, hint, objective)


@settings(max_examples=150)
@given(phased_problems(), st.sampled_from(OBJECTIVES), st.data())
def test_full_model_optimum_is_the_brute_force_optimum(problem, objective, data):
    best = reference_optimum(problem, objective)
    hint = _hint(problem, data)
    classes = identical_devices(problem)
    model = PlacementModel(problem, 1, relabel(problem, hint, classes), _max_work(problem, hint, objective), classes)
    model.minimize(objective, _cap(problem))
    solver, status = model.solve(10, 0, 1)
    if best is None:
        assert solver.status_name(status) == "INFEASIBLE"
        return
    assert solver.status_name(status) == "OPTIMAL"
    choice = model.read(solver)
    assert reference_valid(problem, choice)
    # exact: the model's value of its plan is the plan's score, and no plan scores below it
    assert round(solver.objective_value) == reference_value(problem, choice, objective) == best


@settings(max_examples=150)
@given(st.one_of(phased_problems(), phased_problems(run=True)), st.sampled_from(OBJECTIVES), st.data())
def test_counting_relaxations_bound_the_brute_force_optimum(problem, objective, data):
    best = reference_optimum(problem, objective)
    hint = _hint(problem, data)
    classes = identical_devices(problem)
    work = _max_work(problem, hint, objective)
    path = critical_path(problem, hint)
    models = [GroupModel(problem, 1, hint, groups_of(problem, path), path, work, classes)]
    runs = identical_runs(problem, 2)
    if runs:
        models.append(AggregateModel(problem, 1, hint, runs, work, classes))
    for model in models:
        model.minimize(objective, _cap(problem), 0)
        solver, status = model.solve(10, 0, 1, 0.0)
        name = solver.status_name(status)
        if best is None:
            continue  # a relaxation may still find counts that fit
        assert name == "OPTIMAL", f"{type(model).__name__}: {name} where brute force finds {best}"
        bound = reported_bound(model, solver)  # CP-SAT reports 39.00000000000001 for a proven 39 at times
        assert bound <= best, f"{type(model).__name__}: {bound} > {best}"
        plan = model.read(solver)
        assert len(plan) == len(problem.units)


# -- exact reductions ---------------------------------------------------------------------------------
@settings(max_examples=200)
@given(phased_problems())
def test_dropping_covered_edges_keeps_every_assignments_score(problem):
    pruned = prune_edges(problem)
    for choice in _assignments(problem):
        assert pruned.score(choice) == problem.score(choice)


def _option(storage, execution, pre, dec, prefill=None, **kw):
    mode = "phased" if prefill else "resident" if storage == execution else "stream"
    return PlacementOption(storage=storage, execution=execution, mode=mode, prefill_ns=pre, decode_ns=dec,
                           stored_bytes=kw.get("stored", 0), resident_bytes=kw.get("resident", 0),
                           peak_bytes=kw.get("peak", 0), prefill_execution=prefill,
                           prefill_peak_bytes=kw.get("prefill_peak", 0))


def test_an_edge_only_the_prefill_crosses_is_not_covered():
    # a -> b -> c and a skip a -> c. Every unit decodes on the CPU (so in the decode nothing ever
    # crosses), but each may prefill on cuda:0 (phased). With a and b prefilled on the GPU and c on
    # the CPU, the skip costs 100 and the path a -> b -> c only 1 + b's 0 ns: the skip decides c's start.
    menu = (_option("cpu", "cpu", 50, 50), _option("cpu", "cpu", 0, 50, prefill="cuda:0"))
    hop = {("cuda:0", "cpu"): 1, ("cpu", "cuda:0"): 1}
    skip = {("cuda:0", "cpu"): 100, ("cpu", "cuda:0"): 100}
    edges = tuple(EdgeSpec(src=s, dst=t, prefill_ns=c, decode_ns={}) for s, t, c in
                  [("a", "b", hop), ("b", "c", hop), ("a", "c", skip)])
    problem = PlacementProblem(units=tuple(UnitSpec(name=n, options=menu) for n in "abc"), edges=edges,
                               devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=10),
                                        DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10)))
    assert covered_edges(problem) == set()
    assert problem.score([1, 1, 0]).prefill_ns == 100 + 50


@settings(max_examples=150)
@given(phased_problems())
def test_interchangeable_devices_with_phased_options(problem):
    classes = identical_devices(problem)
    best_all = best_ordered = None
    for k, choice in enumerate(_assignments(problem)):
        if k % 5 == 0:
            moved = relabel(problem, choice, classes)
            for objective in OBJECTIVES:
                assert problem.objective_value(moved, objective) == problem.objective_value(choice, objective)
            assert problem.satisfies(moved) == problem.satisfies(choice)
            first = first_use(problem, moved)
            assert all(first.get(a, 99) <= first.get(b, 99) for c in classes for a, b in itertools.pairwise(c))
        if problem.satisfies(choice):
            value = problem.objective_value(choice, "latency")
            best_all = value if best_all is None else min(best_all, value)
            first = first_use(problem, choice)
            if all(first.get(a, 99) <= first.get(b, 99) for c in classes for a, b in itertools.pairwise(c)):
                best_ordered = value if best_ordered is None else min(best_ordered, value)
    assert best_ordered == best_all


def test_gpus_apart_only_in_their_phased_prices_are_not_interchangeable():
    def menu(extra, more_bytes=0):
        return (_option("cpu", "cpu", 50, 50), _option("cpu", "cpu", 10, 50, prefill="cuda:0", prefill_peak=2),
                _option("cpu", "cpu", 10 + extra, 50, prefill="cuda:1", prefill_peak=2 + more_bytes))
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=4),
               DeviceSpec(name="cuda:1", kind="gpu", capacity_bytes=4), DeviceSpec(name="cpu", kind="cpu",
                                                                                   capacity_bytes=4))
    same = PlacementProblem(units=(UnitSpec(name="a", options=menu(0)),), edges=(), devices=devices)
    apart = PlacementProblem(units=(UnitSpec(name="a", options=menu(1)),), edges=(), devices=devices)
    larger = PlacementProblem(units=(UnitSpec(name="a", options=menu(0, 1)),), edges=(), devices=devices)
    assert identical_devices(same) == [["cuda:0", "cuda:1"]]
    assert identical_devices(apart) == [] == identical_devices(larger)
    assert relabel(same, [2], [["cuda:0", "cuda:1"]]) == [1]  # a prefill device is a use


# -- hand-checked: the phased terms of the model -------------------------------------------------------
def _one_gpu(units, gpu_cap, cpu_cap=100, edges=()):
    return PlacementProblem(units=tuple(units), edges=tuple(edges),
                            devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=gpu_cap),
                                     DeviceSpec(name="cpu", kind="cpu", capacity_bytes=cpu_cap)))


def test_throughput_keeps_a_phased_option_whose_two_phases_beat_the_start_apart():
    # Resident on the GPU: one stage of 50 + 50 = 100. Phased: 60 on the GPU, 60 on the CPU, the slowest
    # stage 60 although prefill + decode = 120 exceeds the start's 100 (pruning must not drop it).
    u = UnitSpec(name="u", options=(_option("cuda:0", "cuda:0", 50, 50, stored=1),
                                    _option("cpu", "cpu", 60, 60, prefill="cuda:0", stored=1)))
    problem = _one_gpu([u], 10)
    assert problem.objective_value([1], "throughput") == 60
    sol = search.solve_problem(problem, "throughput", time_limit_s=5, workers=1, gap_limit=0.0, hint=[0])
    assert sol.objective_value == 60 and sol.best_bound <= 60 and sol.status == "OPTIMAL"
    assert rows.own_work(u.options[1]) == 60


def test_a_phased_prefill_peak_counts_on_the_gpu():
    # a -> b. a: resident on the GPU (4 bytes) or on the CPU (slow). b: phased, its prefill holding 7
    # bytes on the GPU (streamed weights), or on the CPU alone (slow). On a 10-byte GPU, a resident (4)
    # and b's prefill peak (7) do not fit together (both would take 10 + 10 + 10 + 40 = 70).
    a = UnitSpec(name="a", options=(_option("cuda:0", "cuda:0", 10, 10, stored=4),
                                    _option("cpu", "cpu", 30, 30, stored=4)))
    b = UnitSpec(name="b", options=(_option("cpu", "cpu", 10, 40, prefill="cuda:0", stored=4, prefill_peak=7),
                                    _option("cpu", "cpu", 40, 40, stored=4)))
    problem = _one_gpu([a, b], 10, edges=[EdgeSpec(src="a", dst="b", prefill_ns={}, decode_ns={})])
    assert problem.score([0, 0]).used_bytes["cuda:0"] == 11 and not problem.satisfies([0, 0])
    assert reference_optimum(problem, "latency") == reference_value(problem, [0, 1], "latency") == 50 + 50
    assert reference_value(problem, [1, 0], "latency") == 30 + 10 + 70
    for objective in OBJECTIVES:
        sol = search.solve_problem(problem, objective, time_limit_s=5, workers=1, gap_limit=0.0, hint=[1, 1])
        assert problem.satisfies(sol.choice) and sol.best_bound <= reference_optimum(problem, objective)
    assert search.solve_problem(problem, time_limit_s=5, workers=1, gap_limit=0.0).choice == (0, 1)
    assert greedy_choice(problem) == [0, 1]


# -- greedy and constructive starts ----------------------------------------------------------------------
@settings(max_examples=150)
@given(phased_problems())
def test_best_greedy_choice_is_valid_whenever_all_on_the_cpu_fits(problem):
    cpu_only = [[k for k, o in enumerate(u.options) if o.execution == "cpu" and o.mode != "phased"]
                for u in problem.units]
    if all(cpu_only) and any(reference_valid(problem, c) for c in itertools.product(*cpu_only)):
        assert reference_valid(problem, best_greedy_choice(problem))


@settings(max_examples=150)
@given(phased_problems(), st.sampled_from(["latency", "throughput"]), st.data())
def test_starts_and_fills_are_valid_and_never_worse(problem, objective, data):
    for start in executor_starts(problem):
        assert reference_valid(problem, start)
        chosen = [u.options[c] for u, c in zip(problem.units, start, strict=True)]
        assert len({o.execution for o in chosen} | {o.prefill_execution or o.execution for o in chosen}) == 1
        filled = improve(problem, start, objective)
        assert reference_valid(problem, filled)
        assert reference_value(problem, filled, objective) <= reference_value(problem, start, objective)
    old = [c for c in (greedy_choice(problem, r) for r in GREEDY_RESERVES) if reference_valid(problem, c)]
    choice = best_greedy_choice(problem, objective)
    if old:
        assert reference_valid(problem, choice)
        assert reference_value(problem, choice, objective) <= min(reference_value(problem, c, objective) for c in old)
    choice = _hint(problem, data)
    assert fits(problem, choice) == reference_valid(problem, choice)


def test_greedy_takes_a_phased_option_only_where_its_prefill_fits():
    # One unit; phased is the fastest option, but its prefill needs 12 bytes on a 10-byte GPU.
    u = UnitSpec(name="u", options=(_option("cpu", "cpu", 5, 10, prefill="cuda:0", stored=1, prefill_peak=12),
                                    _option("cpu", "cpu", 50, 50, stored=1)))
    for cap, want in ((10, 1), (12, 0)):
        problem = _one_gpu([u], cap)
        assert all(greedy_choice(problem, r) == [want] for r in GREEDY_RESERVES)
        assert best_greedy_choice(problem) == [want]


def test_fill_moves_to_a_phased_option_only_where_its_prefill_fits():
    # From everything on the CPU: a's prefill (6 bytes) fits the 10-byte GPU, b's (12) does not. The
    # fill must take a's move and refuse b's (taking both, it would have to drop the whole fill).
    def unit(name, prefill_peak):
        return UnitSpec(name=name, options=(_option("cpu", "cpu", 100, 100, stored=1),
                                            _option("cpu", "cpu", 10, 100, prefill="cuda:0", stored=1,
                                                    prefill_peak=prefill_peak)))
    problem = _one_gpu([unit("a", 6), unit("b", 12)], 10, edges=[EdgeSpec(src="a", dst="b", prefill_ns={},
                                                                          decode_ns={})])
    assert improve(problem, [0, 0]) == [1, 0]


def test_baseline_maps_skip_phased_options():
    # accelerate never prefills elsewhere: a CPU-stored unit streams to GPU 0 (or runs on the CPU).
    u = UnitSpec(name="u", options=(_option("cpu", "cpu", 5, 10, prefill="cuda:0"), _option("cpu", "cpu", 50, 50),
                                    _option("cpu", "cuda:0", 20, 20)))
    gpu_less = UnitSpec(name="u", options=(_option("cpu", "cpu", 5, 10, prefill="cuda:0"),
                                           _option("cpu", "cpu", 50, 50)))
    assert choice_from_storage(_one_gpu([u], 10), {"u": "cpu"}) == [2]
    assert choice_from_storage(_one_gpu([gpu_less], 10), {"u": "cpu"}) == [1]


# -- coarsening and residency ------------------------------------------------------------------------------
@settings(max_examples=100)
@given(phased_problems(run=True), st.data())
def test_coarse_phased_assignments_cost_what_they_expand_to(problem, data):
    def varied(o):  # the run's units keep their menu's devices and modes, not its numbers (nor group copies)
        held = 2 * o.group_copy_bytes
        return dataclasses.replace(
            o, prefill_ns=data.draw(st.integers(0, 30)),
            peak_bytes=data.draw(st.integers(0, 4)) + (held if o.mode == "stream" else 0),
            prefill_peak_bytes=data.draw(st.integers(0, 6)) + held if o.mode == "phased" else 0)
    problem = dataclasses.replace(problem, units=problem.units[:1] + tuple(
        dataclasses.replace(u, options=tuple(varied(o) for o in u.options)) for u in problem.units[1:]))
    hint = _hint(problem, data)
    hint[1:] = [hint[1]] * (len(hint) - 1)  # one option along the run: the coarsening merges it
    groups = coarsen_groups(problem, hint, 2)
    coarse = coarsen(problem, groups)
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in coarse.units]
    expanded = [c for g, c in zip(groups, choice, strict=True) for _ in g]
    fine, small = problem.score(expanded), coarse.score(choice)
    assert (small.prefill_ns, small.decode_ns, small.stage_ns, small.used_bytes) == \
        (fine.prefill_ns, fine.decode_ns, fine.stage_ns, fine.used_bytes)


@settings(max_examples=100)
@given(phased_problems(), st.data())
def test_prefer_resident_never_costs_time_with_phased_options(problem, data):
    choice = _hint(problem, data)
    if not reference_valid(problem, choice):
        return
    moved = prefer_resident(problem, choice)
    assert reference_valid(problem, moved)
    for objective in ("latency", "throughput"):
        assert reference_value(problem, moved, objective) <= reference_value(problem, choice, objective)


def test_residency_leaves_a_phased_unit_where_it_prefills():
    # a -> b -> c. a and c on the GPU; b phased (disk -> CPU, prefilled on the GPU) or resident on the CPU
    # at the same prices. Residency would move b's prefill to the CPU: two crossings of 7 ns.
    gpu = _option("cuda:0", "cuda:0", 10, 10)
    b = UnitSpec(name="b", options=(_option("disk", "cpu", 10, 50, prefill="cuda:0"), _option("cpu", "cpu", 10, 50)))
    hop = {("cuda:0", "cpu"): 7, ("cpu", "cuda:0"): 7}
    edges = [EdgeSpec(src=s, dst=t, prefill_ns=hop, decode_ns={}) for s, t in (("a", "b"), ("b", "c"))]
    problem = PlacementProblem(units=(UnitSpec(name="a", options=(gpu,)), b, UnitSpec(name="c", options=(gpu,))),
                               edges=tuple(edges), devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=10),
                                                            DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10),
                                                            DeviceSpec(name="disk", kind="disk", capacity_bytes=10)))
    assert prefer_resident(problem, [0, 0, 0]) == [0, 0, 0]
    assert problem.score([0, 1, 0]).prefill_ns == problem.score([0, 0, 0]).prefill_ns + 14


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_phased_runs_are_counted_and_bounded(monkeypatch, objective):
    # Eight identical layers that fit on the GPU only in part: phased (GPU prefill, CPU decode) for the
    # rest is the best use of the GPU, and the counted relaxation must bound it from below.
    monkeypatch.setattr(aggregate, "MIN_INTERIOR", 2)
    menu = (_option("cuda:0", "cuda:0", 2, 10, stored=3, resident=1),
            _option("cpu", "cpu", 2, 40, prefill="cuda:0", stored=3, resident=1, prefill_peak=4),
            _option("cpu", "cpu", 20, 40, stored=3, resident=1))
    units = [UnitSpec(name=f"u{i}", options=menu) for i in range(8)]
    hop = {("cuda:0", "cpu"): 3, ("cpu", "cuda:0"): 3}
    edges = [EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns=hop, decode_ns=hop) for i in range(7)]
    problem = _one_gpu(units, 16, cpu_cap=100, edges=edges)
    assert identical_runs(problem)
    best = reference_optimum(problem, objective)
    sol = search.solve_problem(problem, objective, time_limit_s=5, workers=1, gap_limit=0.0)
    assert sol.best_bound <= best and reference_valid(problem, sol.choice)
    assert sol.objective_value == best if objective != "memory" else sol.objective_value <= best


# -- per assignment: the full model prices it exactly, the relaxations never above ---------------------
def _valid_choice(problem, data):
    valid = [c for c in _assignments(problem) if reference_valid(problem, c)]
    return list(data.draw(st.sampled_from(valid))) if valid else None


@settings(max_examples=150)
@given(phased_problems(), st.sampled_from(OBJECTIVES), st.data())
def test_full_model_prices_a_valid_assignment_exactly(problem, objective, data):
    # Every option fixed to a valid assignment (moved into the model's device order): the model must
    # accept it (no row cuts it off) and price it at its score (no term above or below).
    choice = _valid_choice(problem, data)
    if choice is not None:
        _check_priced_exactly(problem, choice, objective)


def _check_priced_exactly(problem, choice, objective):
    classes = identical_devices(problem)
    choice = relabel(problem, choice, classes)
    model = PlacementModel(problem, 1, choice, None, classes)
    model.minimize(objective, reference_value(problem, choice, "latency"))
    for (u, o), x in model.x.items():
        model.model.add(x == int(choice[u] == o))
    solver, status = model.solve(10, 0, 1)
    assert solver.status_name(status) == "OPTIMAL"
    assert round(solver.objective_value) == reference_value(problem, choice, objective)


def _phased_everywhere(prices, n=2):
    """A chain of n units, each phased (prefilled on cuda:0 or cuda:1, decoded on the CPU) or on the CPU alone."""
    menu = (_option("cpu", "cpu", 10, 10, prefill="cuda:0"), _option("cpu", "cpu", 10, 10, prefill="cuda:1"),
            _option("cpu", "cpu", 30, 10))
    edges = [EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns=prices, decode_ns={}) for i in range(n - 1)]
    return PlacementProblem(units=tuple(UnitSpec(name=f"u{i}", options=menu) for i in range(n)), edges=tuple(edges),
                            devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=10),
                                     DeviceSpec(name="cuda:1", kind="gpu", capacity_bytes=10),
                                     DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10)))


def test_a_crossing_between_prefill_gpus_is_priced_at_its_own_price():
    # No option executes on a GPU, yet the prefill crosses cuda:0 -> cuda:1 at 1 ns (to the CPU: 9 ns):
    # the model's cheapest way out of cuda:0 is the 1 ns hop, not the CPU's 9.
    prices = {(p, q): 1 if "cpu" not in (p, q) else 9 for p in ("cuda:0", "cuda:1", "cpu")
              for q in ("cuda:0", "cuda:1", "cpu") if p != q}
    problem = _phased_everywhere(prices)
    assert problem.score([0, 1]).prefill_ns == 10 + 1 + 10
    for objective in OBJECTIVES:
        _check_priced_exactly(problem, [0, 1], objective)


def test_a_gpu_used_only_for_a_prefill_counts_as_used_in_the_device_order():
    # Two interchangeable GPUs. u0 prefills on cuda:1, u1 is resident on cuda:0: moved into the device
    # order (cuda:0 first used by u0's prefill) the assignment must stay a solution of the model.
    problem = dataclasses.replace(_phased_everywhere({}), units=tuple(
        UnitSpec(name=f"u{i}", options=(_option("cpu", "cpu", 10, 10, prefill="cuda:0"),
                                        _option("cpu", "cpu", 10, 10, prefill="cuda:1"),
                                        _option("cuda:0", "cuda:0", 10, 10), _option("cuda:1", "cuda:1", 10, 10)))
        for i in range(2)))
    assert identical_devices(problem) == [["cuda:0", "cuda:1"]]
    for objective in OBJECTIVES:
        _check_priced_exactly(problem, [1, 2], objective)


def test_relaxations_load_a_phased_prefill_on_its_gpu():
    # u0 -> run u1..u5 -> u7 beside u0 -> u6 -> u7. The run is phased (prefill on the GPU, 10 ns a unit),
    # u6 takes 40 ns of prefill on the CPU: the branches overlap (prefill 50, decode 50). Counting the
    # run's prefill on the CPU would bound the prefill by 90.
    run = UnitSpec(name="r", options=(_option("cpu", "cpu", 10, 10, prefill="cuda:0"),))
    units = [UnitSpec(name="u0", options=(_option("cpu", "cpu", 0, 0),)),
             *(dataclasses.replace(run, name=f"u{i}") for i in range(1, 6)),
             UnitSpec(name="u6", options=(_option("cpu", "cpu", 40, 0),)), UnitSpec(name="u7", options=(
                 _option("cpu", "cpu", 0, 0, stored=1),))]  # its bytes keep it out of u6's group (least prices)
    pairs = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 7), (0, 6), (6, 7)]
    edges = [EdgeSpec(src=f"u{i}", dst=f"u{j}", prefill_ns={}, decode_ns={}) for i, j in pairs]
    problem = _one_gpu(units, 10, edges=edges)
    assert identical_runs(problem, 2) == [(2, 4)]
    best = reference_optimum(problem, "latency")
    assert best == 50 + 50
    path = critical_path(problem, [0] * 8)
    for model in (AggregateModel(problem, 1, [0] * 8, [(2, 4)], None),
                  GroupModel(problem, 1, [0] * 8, groups_of(problem, path), path, None)):
        model.minimize("latency", None, 0)
        solver, _ = model.solve(10, 0, 1, 0.0)
        assert reported_bound(model, solver) <= best, type(model).__name__


@settings(max_examples=150)
@given(st.one_of(phased_problems(), phased_problems(run=True)), st.sampled_from(OBJECTIVES), st.data())
def test_relaxations_never_price_a_valid_assignment_above_its_score(problem, objective, data):
    # The counts of a valid assignment are a solution of each counting relaxation, worth at most its score.
    choice = _valid_choice(problem, data)
    if choice is None:
        return
    path = critical_path(problem, choice)
    group = GroupModel(problem, 1, choice, groups_of(problem, path), path, None)
    fixed = [(group, [(n, sum(choice[u] == o for u in g)) for g, counts in zip(group.groups, group.n, strict=True)
                      for o, (n, _) in counts.items()])]
    runs = identical_runs(problem, 2)
    if runs:
        agg = AggregateModel(problem, 1, choice, runs, None)
        fixed.append((agg, [(v, sum(choice[u] == o for u in range(a, b + 1)))
                            for (a, b), counts in zip(agg.items, agg.vars, strict=True) for o, v in counts.items()]))
    for model, counts in fixed:
        for var, count in counts:
            model.model.add(var == count)
        model.minimize(objective, reference_value(problem, choice, "latency"), 0)
        solver, status = model.solve(10, 0, 1, 0.0)
        assert solver.status_name(status) == "OPTIMAL", type(model).__name__
        assert solver.objective_value <= reference_value(problem, choice, objective), type(model).__name__


def test_relaxations_see_a_prefill_peak_that_fits_nowhere():
    # Six like units whose only option prefills with 12 bytes on a 10-byte GPU: nothing fits, and both
    # counting relaxations must say so (the prefill peak is a peak of the GPU).
    menu = (_option("cpu", "cpu", 5, 10, prefill="cuda:0", stored=1, prefill_peak=12),)
    hop = {("cuda:0", "cpu"): 3, ("cpu", "cuda:0"): 3}
    units = [UnitSpec(name=f"u{i}", options=menu) for i in range(6)]
    edges = [EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns=hop, decode_ns=hop) for i in range(5)]
    problem = _one_gpu(units, 10, edges=edges)
    path = list(range(6))
    for model in (AggregateModel(problem, 1, [0] * 6, identical_runs(problem, 2), None),
                  GroupModel(problem, 1, [0] * 6, groups_of(problem, path), path, None)):
        model.minimize("latency", None, 0)
        solver, status = model.solve(10, 0, 1, 0.0)
        assert solver.status_name(status) == "INFEASIBLE", type(model).__name__


def test_like_units_prefilled_on_different_gpus_are_not_grouped():
    # The same numbers, but a's first phased option prefills on cuda:0 and b's on cuda:1: one group
    # would price b's options on a's devices.
    def unit(name, gpus):
        return UnitSpec(name=name, options=(_option("cpu", "cpu", 50, 50),
                                            *(_option("cpu", "cpu", 5, 50, prefill=g) for g in gpus)))
    problem = PlacementProblem(units=(unit("a", ["cuda:0", "cuda:1"]), unit("b", ["cuda:1", "cuda:0"])),
                               edges=(), devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=4),
                                                  DeviceSpec(name="cuda:1", kind="gpu", capacity_bytes=4),
                                                  DeviceSpec(name="cpu", kind="cpu", capacity_bytes=4)))
    assert groups_of(problem) == [[0], [1]]
