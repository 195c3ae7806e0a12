"""The bound is a bound: every reduction forced on, checked against brute force over all assignments.

``solve_problem`` is run with its thresholds lowered so that small problems go through every path
large ones take: the coarse start (``COARSEN_ABOVE``), integer time with a rounding slack
(``TIME_RESOLUTION`` / ``SLACK_STEPS``), the counted runs (``aggregate.MIN_INTERIOR``) and the
grouped relaxation (``GROUP_ABOVE``), covered edges dropped, interchangeable devices ordered.
Each exact reduction is then checked on its own: it keeps the score of every assignment (edges),
or the optimum over the assignments it keeps equals the optimum over all (device order).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from _brute import (
    check_against_brute_force,
    every_reduction_on,
    reference_optimum,
    reference_value,
    reported_bound,
)
from _problems import _matrix, _menu, problems
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from placement_opt.solver import _counted, _run, aggregate, paths, relax, rows, search
from placement_opt.solver._counted import hiding
from placement_opt.solver.edges import covered_edges, prune_edges
from placement_opt.solver.problem import (
    OBJECTIVES,
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
    spine,
)
from placement_opt.solver.reductions import make_room
from placement_opt.solver.symmetry import first_use, identical_devices, relabel


def _assignments(problem):
    return itertools.product(*(range(len(u.options)) for u in problem.units))


@settings(max_examples=300)
@given(problems(), st.sampled_from(OBJECTIVES), st.data())
def test_bound_status_and_plan_against_brute_force_with_every_reduction_on(problem, objective, data):
    check_against_brute_force(problem, objective, data)


@settings(max_examples=60)
@given(problems(), st.sampled_from(OBJECTIVES), st.data())
def test_two_workers_bound_status_and_plan_against_brute_force(problem, objective, data):
    # The default of two workers takes other paths: the grouped relaxation runs objective_lb_search and
    # default_lp as full workers in one run (one worker: a bound pass, then the default search).
    check_against_brute_force(problem, objective, data, workers=2)


@given(problems())
def test_the_path_floor_is_under_every_assignments_latency_and_reached_by_the_fastest_chain(problem):
    """The floor that stands when no relaxation proves a bound in time (a 100 % gap before it, on sublayer graphs
    of 8 GPUs under overlap): every assignment, feasible or not, prices at least that much."""
    floor = _run.path_lower_bound(problem)
    least = min(reference_value(problem, choice, "latency") for choice in _assignments(problem))
    assert floor <= least
    fastest = [min(range(len(u.options)), key=lambda k, u=u: u.options[k].prefill_ns + u.options[k].decode_ns)
               for u in problem.units]
    free = all(not o.copy_prefill_ns and not o.copy_decode_ns for u in problem.units for o in u.options)
    on_one = len({problem.units[u].options[k].execution for u, k in enumerate(fastest)}) == 1
    chain = all(problem.index()[e.dst] == problem.index()[e.src] + 1 for e in problem.edges) and (
        len(problem.edges) == len(problem.units) - 1)
    if free and on_one and chain and not any(o.prefill_execution for u in problem.units for o in u.options):
        assert floor == reference_value(problem, fastest, "latency")  # nothing but the units' own times


@settings(max_examples=200)
@given(problems(run=True), st.sampled_from(OBJECTIVES), st.data())
def test_counted_runs_against_brute_force(problem, objective, data):
    with every_reduction_on():
        assert aggregate.identical_runs(problem)  # the relaxation is built, contiguous or not
    check_against_brute_force(problem, objective, data)


@settings(max_examples=150)  # 19 s at 300 on a 2-core VM: the suite keeps under 10 minutes
@given(problems(run=True), st.sampled_from(["latency", "throughput"]), st.data())
def test_counted_runs_of_a_contiguous_problem_never_bound_above_brute_force(problem, objective, data):
    """The counted relaxation of a contiguous problem (its storage ranges over items, an interior wholly on a
    device that items on both sides store on): its own bound, solved to the end, is at most brute force's
    optimum, and it finds no plan only where there is none."""
    problem = dataclasses.replace(problem, contiguous=True)
    runs = aggregate.identical_runs(problem, 2)
    assume(runs)
    hint = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    model = aggregate.AggregateModel(problem, 1, hint, runs, None)
    model.minimize(objective, None, 0)
    solver, status = model.solve(5, 0, 1, 0.0)
    best = reference_optimum(problem, objective)
    if best is None:
        return  # a relaxation may find room where the problem has none
    assert status != cp_model.INFEASIBLE
    assert reported_bound(model, solver) <= best


def test_counted_runs_of_a_contiguous_problem_bound_above_the_plan_without_contiguity():
    # The embedding and the head on the CPU, every layer on the GPU: the best plan without contiguity, which
    # a contiguous one cannot be (the CPU would store two ranges). The counted relaxation's bound, with its
    # contiguity rows, is above that plan's price and at most brute force's contiguous optimum.
    gpu = PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=10, decode_ns=10,
                          stored_bytes=1, resident_bytes=0, peak_bytes=0)
    cpu = dataclasses.replace(gpu, storage="cpu", execution="cpu", prefill_ns=50, decode_ns=50)
    ends = (dataclasses.replace(gpu, stored_bytes=2), dataclasses.replace(cpu, prefill_ns=1, decode_ns=1))
    units = (UnitSpec(name="embed", options=ends), *(UnitSpec(name=f"layer{i}", options=(gpu, cpu)) for i in range(6)),
             UnitSpec(name="head", options=ends))
    edges = tuple(EdgeSpec(src=a.name, dst=b.name, prefill_ns={}, decode_ns={}) for a, b in itertools.pairwise(units))
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=6), DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100))
    free = PlacementProblem(units=units, edges=edges, devices=devices)
    contiguous = dataclasses.replace(free, contiguous=True)
    bounds = []
    for problem in (free, contiguous):
        runs = aggregate.identical_runs(problem, 2)
        model = aggregate.AggregateModel(problem, 1, [1] + [0] * 6 + [1], runs, None)
        model.minimize("latency", None, 0)
        solver, _ = model.solve(5, 0, 1, 0.0)
        bounds.append(reported_bound(model, solver))
    assert bounds[0] == reference_optimum(free, "latency") < bounds[1] <= reference_optimum(contiguous, "latency")


@settings(max_examples=300)
@given(problems())
def test_dropping_covered_edges_keeps_every_assignments_score(problem):
    pruned = prune_edges(problem)
    if pruned.edges == problem.edges:
        return  # nothing dropped: the same problem (the loop below took 10 s of the suite for nothing)
    for choice in _assignments(problem):
        assert pruned.score(choice) == problem.score(choice)


def test_covered_edges_are_found_on_a_residual_pattern():
    # a -> b -> c with a skip a -> c whose price is at most a path's: dropped; a dearer skip is kept.
    def unit(name):
        return UnitSpec(name=name, options=tuple(PlacementOption(storage=d, execution=d, mode="resident", prefill_ns=1,
                                                                 decode_ns=1, stored_bytes=0, resident_bytes=0,
                                                                 peak_bytes=0) for d in ("cuda:0", "cuda:1")))
    hop = {("cuda:0", "cuda:1"): 5, ("cuda:1", "cuda:0"): 5}
    cheap = {("cuda:0", "cuda:1"): 4, ("cuda:1", "cuda:0"): 5}
    dear = {("cuda:0", "cuda:1"): 6, ("cuda:1", "cuda:0"): 5}
    devices = tuple(DeviceSpec(name=d, kind="gpu", capacity_bytes=1) for d in ("cuda:0", "cuda:1"))

    def problem(skip):
        edges = tuple(EdgeSpec(src=s, dst=t, prefill_ns=c, decode_ns=c) for s, t, c in
                      [("a", "b", hop), ("b", "c", hop), ("a", "c", skip)])
        return PlacementProblem(units=(unit("a"), unit("b"), unit("c")), edges=edges, devices=devices)

    # Either way round, the path a -> b -> c costs one hop (5) and b's 1 ns: 6 between different GPUs.
    assert covered_edges(problem(cheap)) == {2}
    assert covered_edges(problem(dear)) == {2}
    dearer = {("cuda:0", "cuda:1"): 7, ("cuda:1", "cuda:0"): 5}
    assert covered_edges(problem(dearer)) == set()


@settings(max_examples=150)  # every assignment priced 2-3 times: 500,000 scores at 300 (30 s)
@given(problems())
def test_interchangeable_devices_are_relabelled_at_no_cost_and_ordered_optimum_is_the_optimum(problem):
    classes = identical_devices(problem)
    best_all = best_ordered = None
    for k, choice in enumerate(_assignments(problem)):
        if k % 7 == 0:  # relabelling checked on a seventh of the assignments: the slow part
            moved = relabel(problem, choice, classes)
            _same_cost(problem, choice, moved)
            assert problem.satisfies(moved) == problem.satisfies(choice)
            assert _in_order(problem, moved, classes)
        score = problem.score(choice)  # once: satisfies() and objective_value() would each price it again
        if score.feasible and problem.satisfies(choice):
            value = score.latency_ns
            best_all = value if best_all is None else min(best_all, value)
            if _in_order(problem, choice, classes):
                best_ordered = value if best_ordered is None else min(best_ordered, value)
    assert best_ordered == best_all


def _same_cost(problem, choice, moved):
    """``moved`` is ``choice`` with devices renamed: the same times, the same loads and bytes per device, renamed."""
    a, b = problem.score(choice), problem.score(moved)
    assert (a.prefill_ns, a.decode_ns) == (b.prefill_ns, b.decode_ns)
    assert sorted(a.used_bytes.values()) == sorted(b.used_bytes.values())
    assert sorted(a.stage_ns.values()) == sorted(b.stage_ns.values())
    for objective in OBJECTIVES:
        assert problem.objective_value(choice, objective) == problem.objective_value(moved, objective)


def _in_order(problem, choice, classes):
    first = first_use(problem, choice)
    never = len(problem.units)
    return all(first.get(a, never) <= first.get(b, never) for c in classes for a, b in itertools.pairwise(c))


def test_twin_gpus_form_a_class_and_one_price_apart_do_not():
    def menu(extra):
        return tuple(PlacementOption(storage=d, execution=d, mode="resident", prefill_ns=10 + (extra if d == "cuda:1"
                                                                                              else 0),
                                     decode_ns=5, stored_bytes=1, resident_bytes=0, peak_bytes=0)
                     for d in ("cuda:0", "cuda:1", "cpu"))
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=4), DeviceSpec(name="cuda:1", kind="gpu",
                                                                                   capacity_bytes=4),
               DeviceSpec(name="cpu", kind="cpu", capacity_bytes=4))
    same = PlacementProblem(units=(UnitSpec(name="a", options=menu(0)),), edges=(), devices=devices)
    apart = PlacementProblem(units=(UnitSpec(name="a", options=menu(1)),), edges=(), devices=devices)
    pinned = PlacementProblem(units=(UnitSpec(name="a", options=menu(0)),), edges=(), devices=devices,
                              pins={"a": "cuda:1"})
    assert identical_devices(same) == [["cuda:0", "cuda:1"]]
    assert identical_devices(apart) == [] == identical_devices(pinned)


def test_grouped_relaxation_counts_only_groups_wholly_on_its_path():
    # a -> (b1, b2) -> c, b1 and b2 identical (one group) and best on two GPUs side by side: the path
    # holds one of them, so the bound may count one b, not both (a + 2b would exceed the optimum).
    def unit(name, work):
        return UnitSpec(name=name, options=tuple(PlacementOption(storage=d, execution=d, mode="resident",
                                                                 prefill_ns=work, decode_ns=0, stored_bytes=1,
                                                                 resident_bytes=0, peak_bytes=0)
                                                 for d in ("cuda:0", "cuda:1")))
    edges = tuple(EdgeSpec(src=s, dst=t, prefill_ns={}, decode_ns={}) for s, t in
                  [("a", "b1"), ("a", "b2"), ("b1", "c"), ("b2", "c")])
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=2), DeviceSpec(name="cuda:1", kind="gpu",
                                                                                   capacity_bytes=2))
    problem = PlacementProblem(units=(unit("a", 1), unit("b1", 10), unit("b2", 10), unit("c", 1)), edges=edges,
                               devices=devices)
    best = reference_optimum(problem, "latency")
    assert best == 12  # a, b1 on one GPU; b2, c on the other
    with every_reduction_on():
        sol = search.solve_problem(problem, time_limit_s=5, workers=1, gap_limit=0.0)
    assert sol.best_bound <= best and sol.objective_value == best
    model = relax.GroupModel(problem, 1, [0, 0, 1, 1], relax.groups_of(problem, [0, 1, 3]), [0, 1, 3], None)
    model.minimize("latency", None, 0)
    solver, _ = model.solve(5, 0, 1, 0.0)
    assert reported_bound(model, solver) <= best


def test_covering_and_sibling_paths_put_parallel_siblings_on_paths_of_their_own():
    # a -> (q, k, v) -> o -> (gate, up) -> down, a layer's pattern: the critical path holds one sibling of
    # each fan-out, covering_paths the others, so the grouped relaxation cannot make them slow for free.
    names = ["a", "q", "k", "v", "o", "gate", "up", "down"]
    pairs = [("a", "q"), ("a", "k"), ("a", "v"), ("q", "o"), ("k", "o"), ("v", "o"), ("o", "gate"), ("o", "up"),
             ("gate", "down"), ("up", "down")]
    option = PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=1, decode_ns=1,
                             stored_bytes=1, resident_bytes=0, peak_bytes=0)
    problem = PlacementProblem(units=tuple(UnitSpec(name=n, options=(option,)) for n in names),
                               edges=tuple(EdgeSpec(src=s, dst=t, prefill_ns={}, decode_ns={}) for s, t in pairs),
                               devices=(DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100),))
    path = paths.critical_path(problem, [0] * len(names))
    others = paths.covering_paths(problem, path)
    assert len(others) == 2 and set().union(path, *others) == set(range(len(names)))
    index = problem.index()
    siblings = [{index[n] for n in ("q", "k", "v")}, {index[n] for n in ("gate", "up")}]
    assert all(len(set(p_) & s_) == 1 for p_ in (path, *others) for s_ in siblings)  # real paths: one of each
    groups = relax.groups_of(problem, path, others)
    assert not any({index["q"], index["k"]} <= set(g) for g in groups)  # siblings on different paths: apart
    # sibling_paths: every combination of roles (3 x 2), each a real path (k and v share a menu: roles by index)
    combos = paths.sibling_paths(problem, path)
    edges = {(index[s], index[t]) for s, t in pairs}
    assert len(combos) == 6 and len({tuple(c) for c in combos}) == 6
    assert all((a, b) in edges for c in combos for a, b in itertools.pairwise(c))
    assert {frozenset(set(c) & (siblings[0] | siblings[1])) for c in combos} == {
        frozenset({x, y}) for x in siblings[0] for y in siblings[1]}


@given(stored=st.integers(0, 9), resident=st.integers(0, 9), peak=st.integers(0, 20), cap=st.integers(0, 40),
       same=st.booleans(), units=st.integers(1, 12))
def test_most_beside_peak_is_the_largest_count_that_fits(stored, resident, peak, cap, same, units):
    """n units on one option fit their execution device (with its peak) exactly when n <= most_beside_peak."""
    opt = PlacementOption(storage="cuda:0" if same else "cpu", execution="cuda:0", mode="resident" if same else "stream",
                          prefill_ns=1, decode_ns=1, stored_bytes=stored, resident_bytes=resident, peak_bytes=peak)
    problem = PlacementProblem(units=tuple(UnitSpec(name=f"u{i}", options=(opt,)) for i in range(units)), edges=(),
                               devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=cap),
                                        DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10**6)))
    most = aggregate.most_beside_peak(problem, opt)
    for n in range(1, units + 1):
        chosen = [opt] * n
        fits = problem.used_bytes(chosen)["cuda:0"] <= cap
        assert fits == (n <= most), (n, most)


def test_counted_runs_do_not_charge_a_device_change_the_plan_does_not_make(monkeypatch) -> None:
    # Regression: the counted model keyed its "computes on d" flags as (-1, d) beside the option flags
    # (o, ""), and -1 indexed the menu's last option, so a run computed on cuda:0 alone was also charged
    # as computing on the CPU (the last option's device): one transfer too many, and a bound 5.3 ms
    # above a Mistral-7B plan's value on RTX 4090 + RTX 3090 (benchmarks/solve_time, batch 16).
    monkeypatch.setattr(aggregate, "MIN_INTERIOR", 2)
    devices = ("cuda:0", "cuda:1", "cpu")
    prices = {(p, q): 100 for p in devices for q in devices if p != q}

    def option(device: str, ns: int) -> PlacementOption:
        return PlacementOption(storage=device, execution=device, mode="resident", prefill_ns=ns, decode_ns=ns,
                               stored_bytes=1, resident_bytes=0, peak_bytes=0)

    menu = (option("cuda:0", 10), option("cuda:1", 20), option("cpu", 50))
    units = tuple(UnitSpec(name=f"u{i}", options=menu) for i in range(6))
    edges = tuple(EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns=prices, decode_ns=prices) for i in range(5))
    problem = PlacementProblem(units=units, edges=edges, devices=tuple(
        DeviceSpec(name=d, kind="cpu" if d == "cpu" else "gpu", capacity_bytes=100) for d in devices))
    assert aggregate.identical_runs(problem)  # the counted model is built
    best = reference_optimum(problem, "latency")
    sol = search.solve_problem(problem, "latency", time_limit_s=5.0, gap_limit=0.0)
    assert sol.best_bound <= best, (sol.best_bound, best, sol.notes)


@settings(max_examples=100)
@given(cap=st.integers(0, 40), extra_peak=st.integers(0, 30), data=st.data())
def test_level_caps_cut_no_assignment_that_fits(cap, extra_peak, data):
    """Every count vector that fits its device (the exact memory model) meets add_level_caps' rows.

    ``extra_peak``: a transient another unit puts there with no bytes of its own (a phased prefill).
    """
    k = data.draw(st.integers(1, 4))
    opts = [PlacementOption(storage="cuda:0" if data.draw(st.booleans()) else "cpu", execution="cuda:0",
                            mode="resident", prefill_ns=1, decode_ns=1, stored_bytes=data.draw(st.integers(0, 9)),
                            resident_bytes=data.draw(st.integers(0, 3)), peak_bytes=data.draw(st.integers(0, 20)))
            for _ in range(k)]
    opts = [dataclasses.replace(o, mode="stream") if o.storage == "cpu" else o for o in opts]
    counts = [data.draw(st.integers(0, 4)) for _ in opts]
    device = DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=cap)
    chosen = [o for o, n in zip(opts, counts, strict=True) for _ in range(n)]
    peak = max([o.peak_bytes for o in chosen] + [extra_peak])
    used = sum(o.stored_bytes * (o.storage == "cuda:0") + o.resident_bytes for o in chosen) + peak
    assume(used <= cap)
    model = cp_model.CpModel()
    levels = sorted({o.peak_bytes for o in opts if o.peak_bytes > 0} | ({extra_peak} - {0}))
    z = [model.new_constant(int(peak >= level)) for level in levels]
    n = [model.new_constant(c) for c in counts]
    rows.add_level_caps(model, device, levels, z, [(o, v, 4) for o, v in zip(opts, n, strict=True)])
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    assert solver.solve(model) == cp_model.OPTIMAL


def test_level_caps_keep_a_prefill_gpu_from_also_holding_layers():
    # 405B on 8 x L4 in small: a layer (6 bytes, workspace 7) fits twice beside its own peak (6 + 6 + 7 <= 21),
    # never beside a phased prefill's 19; the capacity row alone lets a 1/8 prefill flag cost 1.5 bytes.
    layer = PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=1, decode_ns=1,
                            stored_bytes=6, resident_bytes=0, peak_bytes=7)
    model = cp_model.CpModel()
    n = model.new_int_var(0, 4, "n")
    z = [model.new_bool_var("z7"), model.new_bool_var("z19")]
    rows.add_level_caps(model, DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=21), [7, 19], z,
                         [(layer, n, 4)])
    model.add(z[1] == 1)
    model.maximize(n)
    solver = cp_model.CpSolver()
    assert solver.solve(model) == cp_model.OPTIMAL and solver.value(n) == 0


@settings(max_examples=50)
@given(problems(), st.data())
def test_make_room_returns_a_plan_that_fits_or_the_one_it_got(problem, data):
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    out = make_room(problem, choice)
    assert out == choice or not problem.score(out).over_bytes
    assert all(problem.allows(u, u.options[c]) or c == choice[i] for i, (u, c) in enumerate(zip(problem.units, out,
                                                                                                   strict=True)))


@settings(max_examples=25)
@given(st.data())
def test_sibling_paths_bound_a_layer_pattern_against_brute_force(data):
    """A decoder layer per module (q, k, v and gate, up side by side), priced at random on a GPU and the
    CPU: the grouped relaxation with its six sibling paths never bounds above the brute-force optimum.
    (The random DAGs of the whole-solver check above rarely have siblings.)"""
    names = ["a", "q", "k", "v", "o", "gate", "up", "down"]
    pairs = [("a", "q"), ("a", "k"), ("a", "v"), ("q", "o"), ("k", "o"), ("v", "o"), ("o", "gate"), ("o", "up"),
             ("gate", "down"), ("up", "down")]
    menus = {n: _menu(data.draw, ["cuda:0"], False)[::2] for n in names}  # resident on the GPU or the CPU: 2^8 plans
    if data.draw(st.booleans()):
        menus["v"], menus["up"] = menus["k"], menus["gate"]  # identical siblings, as in a traced graph
    price = _matrix(data.draw, ["cuda:0", "cpu"], False)
    problem = PlacementProblem(
        units=tuple(UnitSpec(name=n, options=menus[n]) for n in names),
        edges=tuple(EdgeSpec(src=s, dst=t, prefill_ns=price, decode_ns=price) for s, t in pairs),
        devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=data.draw(st.integers(0, 16))),
                 DeviceSpec(name="cpu", kind="cpu", capacity_bytes=data.draw(st.integers(20, 60)))))
    best = reference_optimum(problem, "latency")
    hint = [data.draw(st.integers(0, 1)) for _ in names]
    index = problem.index()
    through = [data.draw(st.sampled_from(["q", "k", "v"])), data.draw(st.sampled_from(["gate", "up"]))]
    path, *others = paths.sibling_paths(problem, [index[n] for n in ("a", through[0], "o", through[1], "down")])
    assert len(others) == 5  # 3 x 2 roles
    model = relax.GroupModel(problem, 1, hint, relax.groups_of(problem, path, others), path, None, (), others)
    model.minimize("latency", None, 0)
    solver, status = model.solve(5, 0, 1, 0.0)
    if best is None:
        return  # a relaxation may find room where the problem has none
    assert reported_bound(model, solver) <= best


@given(gap=st.integers(1, 120), sizes=st.lists(st.integers(1, 70), min_size=1, max_size=3), data=st.data())
def test_the_stall_rows_never_exceed_a_windows_real_stall(gap, sizes, data):
    # _counted._stalls: per window, delta (j0 + 1) - sum of worths <= max(0, gap - what the window computes),
    # for every mix of whole units (each count 0..4) and any unit size B
    size = data.draw(st.sampled_from(sizes) | st.integers(1, 70))
    j0, delta = divmod(gap, size)
    if delta == 0:
        return  # no row is stated then
    for counts in itertools.product(range(5), repeat=len(sizes)):
        row = delta * (j0 + 1) - sum(hiding(b, size, j0, delta) * k for b, k in zip(sizes, counts, strict=True))
        assert row <= max(0, gap - sum(b * k for b, k in zip(sizes, counts, strict=True)))


@settings(max_examples=300)
@example(gap=9, sizes=[5, 3])  # a lifted row the check drops: 4 - 3 x 1 > 0 with three units of 3
@given(gap=st.integers(1, 150), sizes=st.lists(st.integers(1, 90), min_size=1, max_size=4, unique=True))
def test_every_window_row_holds_at_every_mix_of_whole_units(gap, sizes):
    # _counted._window_rows, the single-size rows and the lifted two-size ones: per window,
    # each - sum of worths <= max(0, gap - what the window computes), for every mix (each count 0..ceil(gap / b))
    kinds = dict(enumerate(sizes))
    rows = _counted._window_rows(gap, kinds)
    ranges = [range(-(-gap // b) + 1) for b in sizes]
    for counts in itertools.product(*ranges):
        stall = max(0, gap - sum(b * n for b, n in zip(sizes, counts, strict=True)))
        for each, worth in rows:
            assert each - sum(worth[k] * n for k, n in enumerate(counts)) <= stall


def test_a_window_row_mixing_two_sizes_states_what_single_sizes_miss():
    # Llama-2-13B on an RTX 3060 (chat, overlap), in ms over its 128 decode steps: 12 windows of gap 2951 (copy
    # less the streamed layer's own compute), 13 CPU-decoded layers (2460), 15 resident (298). Best split: one
    # window of two CPU layers, four of one CPU and two resident, seven of one and one, each 193 short: 1351.
    sizes = {"cpu": 2460, "gpu": 298}
    best = _least_stall(2951, (2460, 298), 12, (13, 15))
    assert best == 7 * 193
    rows = _counted._window_rows(2951, sizes)
    bound = max(12 * each - 13 * worth["cpu"] - 15 * worth["gpu"] for each, worth in rows)
    assert bound == best  # the single-size rows alone: 931
    single = [r for r in rows if r not in _counted._lifted_rows(2951, sizes)]
    assert max(12 * each - 13 * worth["cpu"] - 15 * worth["gpu"] for each, worth in single) < best


def _least_stall(gap, sizes, windows, units):
    """The least total stall of ``windows`` windows of ``gap``, at most ``units`` whole units of each of the two
    ``sizes`` shared among them (any number in a window): exact, by dynamic programming over windows."""
    (b1, b2), (most1, most2) = sizes, units
    least = {(0, 0): 0}  # units of each size used so far -> least stall of the windows so far
    for _ in range(windows):
        after = {}
        for (used1, used2), stall in least.items():
            for n1 in range(most1 - used1 + 1):
                for n2 in range(most2 - used2 + 1):
                    key, value = (used1 + n1, used2 + n2), stall + max(0, gap - b1 * n1 - b2 * n2)
                    if value < after.get(key, value + 1):
                        after[key] = value
        least = after
    return min(least.values())


def test_the_spine_is_every_unit_on_all_paths():
    def unit(name):
        return UnitSpec(name=name, options=(PlacementOption(storage="cpu", execution="cpu", mode="resident",
                                                             prefill_ns=1, decode_ns=1, stored_bytes=0,
                                                             resident_bytes=0, peak_bytes=0),))
    names = ["embed", "rotary", "l0", "l1", "l2", "head"]
    edges = [("embed", "l0"), ("rotary", "l0"), ("l0", "l1"), ("l0", "l2"), ("l1", "l2"), ("l2", "head")]
    problem = PlacementProblem(units=tuple(unit(n) for n in names),
                               edges=tuple(EdgeSpec(src=a, dst=b, prefill_ns={}, decode_ns={}) for a, b in edges),
                               devices=(DeviceSpec(name="cpu", kind="cpu", capacity_bytes=1),))
    # two sources (embed, rotary); l0 -> l2 jumps over l1
    assert spine(problem) == {2, 4, 5}


_MOST_SLOT_COMBOS = relax.MOST_SLOT_COMBOS


def _two_layers(times, gpu_bytes):
    """a0 -> (q0, k0, v0) -> o0 -> (q1, k1, v1) -> o1, one byte each, on a GPU of ``gpu_bytes`` or the CPU;
    ``times[role] = (on the GPU, on the CPU)`` (decode only), 1 for a0, o0 and o1 anywhere."""
    def unit(name, gpu, cpu):
        return UnitSpec(name=name, options=tuple(
            PlacementOption(storage=d, execution=d, mode="resident", prefill_ns=0, decode_ns=t, stored_bytes=1,
                            resident_bytes=0, peak_bytes=0) for d, t in (("cuda:0", gpu), ("cpu", cpu))))
    units, pairs, before = [unit("a0", 1, 1)], [], "a0"
    for layer in range(2):
        for role in "qkv":
            units.append(unit(f"{role}{layer}", *times[role]))
            pairs += [(before, f"{role}{layer}"), (f"{role}{layer}", f"o{layer}")]
        units.append(unit(f"o{layer}", 1, 1))
        before = f"o{layer}"
    return PlacementProblem(units=tuple(units), edges=tuple(EdgeSpec(src=s, dst=t, prefill_ns={}, decode_ns={})
                                                            for s, t in pairs),
                            devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=gpu_bytes),
                                     DeviceSpec(name="cpu", kind="cpu", capacity_bytes=20)))


def _grouped_bound(problem, combos, monkeypatch):
    monkeypatch.setattr(relax, "MOST_SLOT_COMBOS", _MOST_SLOT_COMBOS if combos else 0)
    hint = [1] * len(problem.units)
    path, *others = paths.sibling_paths(problem, paths.critical_path(problem, hint))
    model = relax.GroupModel(problem, 1, hint, relax.groups_of(problem, path, others), path, None, (), others)
    model.minimize("latency", None, 0)
    solver, status = model.solve(5, 0, 1, 0.0)
    assert status == cp_model.OPTIMAL
    return reported_bound(model, solver)


def test_sibling_combinations_bound_what_sibling_paths_cannot(monkeypatch):
    # Five GPU slots for nine units. The sibling paths let the relaxation take a fast k in one layer and a
    # fast v in the other on paths of their own (18); counted by combination, each layer's slowest
    # sibling is on the path, as in every real plan (19, brute force's optimum).
    problem = _two_layers({"q": (2, 24), "k": (1, 14), "v": (1, 21)}, 5)
    assert reference_optimum(problem, "latency") == 19
    assert _grouped_bound(problem, False, monkeypatch) == 18
    assert _grouped_bound(problem, True, monkeypatch) == 19


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_sibling_combinations_never_bound_above_brute_force(data):
    times = {r: (data.draw(st.integers(0, 6)), data.draw(st.integers(0, 30))) for r in "qkv"}
    if data.draw(st.booleans()):
        times["v"] = times["k"]  # identical siblings share a menu (one kind, roles by index)
    problem = _two_layers(times, data.draw(st.integers(0, 9)))
    best = reference_optimum(problem, "latency")
    with pytest.MonkeyPatch.context() as mp:
        with_combos = _grouped_bound(problem, True, mp)
        without = _grouped_bound(problem, False, mp)
    assert without <= with_combos <= best


def _layers_of_two_parts(attention, mlp, layers, gpu_bytes, cpu_bytes):
    """``layers`` decoder layers, each an attention and an MLP unit copied as one run (``copy_groups``), on
    one GPU and the CPU: the menus of :func:`_problems._menu` with group copies."""
    runs = [((f"a{i}", attention), (f"m{i}", mlp)) for i in range(layers)]
    return _runs_on_one_gpu(runs, gpu_bytes, cpu_bytes)


def _runs_on_one_gpu(runs, gpu_bytes, cpu_bytes):
    """A chain of copy runs, each a tuple of (unit name, menu), on one GPU and the CPU."""
    units = [UnitSpec(name=name, options=menu) for run in runs for name, menu in run]
    names = [u.name for u in units]
    return PlacementProblem(
        units=tuple(units), edges=tuple(EdgeSpec(src=a, dst=b, prefill_ns={}, decode_ns={})
                                        for a, b in itertools.pairwise(names)),
        devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=gpu_bytes),
                 DeviceSpec(name="cpu", kind="cpu", capacity_bytes=cpu_bytes)),
        copy_groups=tuple(tuple(name for name, _ in run) for run in runs))


def _grouped_latency_bound(problem, hint, whole_runs=False):
    path = paths.critical_path(problem, hint)  # the whole chain
    model = relax.GroupModel(problem, 1, hint, relax.groups_of(problem, path), path, None, whole_runs=whole_runs)
    model.minimize("latency", None, 0)
    solver, status = model.solve(5, 0, 1, 0.0)
    return None if status == cp_model.INFEASIBLE else reported_bound(model, solver)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(2, 3), gpu=st.integers(0, 24), cpu=st.integers(0, 30), data=st.data())
def test_runs_shared_by_two_groups_never_bound_above_brute_force(layers, gpu, cpu, data):
    """The grouped relaxation's peak of two groups meeting in one copy run (``_shared_run_peaks``): its bound is
    at most brute force's optimum, and it proves no plan only where there is none."""
    attention, mlp = (_menu(data.draw, ["cuda:0"], False, copying=True) for _ in range(2))
    problem = _layers_of_two_parts(attention, mlp, layers, gpu, cpu)
    best = reference_optimum(problem, "latency")
    bound = _grouped_latency_bound(problem, [data.draw(st.integers(0, 2)) for _ in problem.units])
    if best is None:
        return  # a relaxation may find room where the problem has none
    assert bound is not None and bound <= best


def _layers_of_experts(attention, experts, layers, gpu_bytes, cpu_bytes, groups=2, other=None):
    """``layers`` MoE layers, each an attention unit and ``groups`` expert units with one menu (like units: one
    group of the grouped relaxation, ``groups`` of them a run), copied as one run, on one GPU and the CPU;
    with ``other``, every second expert unit of a layer has that menu instead (two groups, each in every run)."""
    runs = [((f"a{i}", attention), *((f"e{i}.{j}", other if other and j % 2 else experts) for j in range(groups)))
            for i in range(layers)]
    return _runs_on_one_gpu(runs, gpu_bytes, cpu_bytes)


@settings(max_examples=30, deadline=None)  # ~1 s an example: brute force over 2-3 layers of groups
@given(layers=st.integers(2, 3), gpu=st.integers(0, 30), cpu=st.integers(0, 40), data=st.data())
def test_runs_holding_several_like_units_never_bound_above_brute_force(layers, gpu, cpu, data):
    """Expert groups: like units two (or three) a run, or two groups of them in every run, which the pigeonhole
    rows (``_crowded_rows``, per group and per pool of groups copying as much) and the pair rows with such a
    group (``_met_rows``) count: the bound is at most brute force's optimum."""
    groups = data.draw(st.integers(2, 3)) if layers == 2 else 2
    attention, experts, other = (_menu(data.draw, ["cuda:0"], False, copying=True) for _ in range(3))
    problem = _layers_of_experts(attention, experts, layers, gpu, cpu, groups, other if data.draw(st.booleans()) else None)
    best = reference_optimum(problem, "latency")
    bound = _grouped_latency_bound(problem, [data.draw(st.integers(0, 2)) for _ in problem.units])
    if best is None:
        return
    assert bound is not None and bound <= best


def test_experts_copied_two_a_layer_hold_both_copies_twice(monkeypatch):
    """Three expert groups streamed over two layers (copy 3 each, own peak 1) put two in one run: 1 + 2 x (3 + 3)
    = 13 bytes. On a 12-byte GPU the per-option peaks (1 + 2 x 3) let all four stream (bound 4 + 4 x 1); counted
    by run, each layer streams one and computes the other on the CPU (5 ns), as in brute force's optimum."""
    attention = (PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=0, decode_ns=0,
                                 stored_bytes=1, resident_bytes=0, peak_bytes=0),)
    problem = _layers_of_experts(attention, _two_options(3, 1, 5), 2, 12, 10)
    best = reference_optimum(problem, "latency")
    assert best == 2 * (1 + 5)
    with_runs = _grouped_latency_bound(problem, [0, 1, 1] * 2)
    monkeypatch.setattr(relax.GroupModel, "_crowded_rows", lambda self, *args: [])
    assert _grouped_latency_bound(problem, [0, 1, 1] * 2) == 4 < with_runs == best


def test_expert_groups_of_two_kinds_copied_three_a_layer_hold_three_copies_twice(monkeypatch):
    """A layer's expert units of two kinds (grouped apart: they store different bytes), one and two a layer, all
    copying 3 bytes: five of six streamed over two layers put three in one run, 1 + 2 x 9 = 19 bytes, more than
    the 18-byte GPU, where two a run (13) fit. Each group's own rows and the pair's counting runs touched allow all
    six (bound 6); the pool of both groups' rows stream two a layer, as in brute force's optimum, and so do the
    pair's rows counting the runs that hold two of a group (``_touching``)."""
    attention = (PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=0, decode_ns=0,
                                 stored_bytes=1, resident_bytes=0, peak_bytes=0),)
    heavier = tuple(dataclasses.replace(o, stored_bytes=2) for o in _two_options(3, 1, 5))
    problem = _layers_of_experts(attention, _two_options(3, 1, 5), 2, 18, 20, groups=3, other=heavier)
    assert len(relax.groups_of(problem, paths.critical_path(problem, [0] * 8))) == 3
    best = reference_optimum(problem, "latency")
    assert best == 2 * (1 + 1 + 5)
    with_pools = _grouped_latency_bound(problem, [0, 1, 1, 1] * 2)
    kept = relax.GroupModel._crowded_rows

    def singles_only(self, dev, copying, per_run, alone):
        return [row for k, *rest in copying for row in kept(self, dev, [(k, *rest)], per_run, alone)]

    monkeypatch.setattr(relax.GroupModel, "_crowded_rows", singles_only)
    assert _grouped_latency_bound(problem, [0, 1, 1, 1] * 2) == best  # the pair rows' runs of e alone see it too
    touching = relax.GroupModel._touching
    monkeypatch.setattr(relax.GroupModel, "_touching", lambda self, *args: touching(self, *args)[:1])
    assert _grouped_latency_bound(problem, [0, 1, 1, 1] * 2) == 6 < with_pools == best


def test_experts_one_a_layer_leave_no_run_for_a_streamed_attention(monkeypatch):
    """Two layers, each an attention and two expert units. Streaming one expert of each layer holds 1 + 2 x 3 = 7
    bytes; streaming an attention beside them puts it in a run with an expert (1 + 2 x (3 + 2) = 11), or two experts
    in one run (13), more than the 10-byte GPU. Counted as touching ``n / 2`` runs (two a run at most), the expert
    group left a run free for the attention (bound 17); with its flag of two in one run unset it touches ``n``
    (``_touching``), and the bound is brute force's optimum (20), which streams the experts alone."""
    problem = _layers_of_experts(_two_options(2, 1, 4), _two_options(3, 1, 5), 2, 10, 10)
    best = reference_optimum(problem, "latency")
    assert best == 2 * (4 + 1 + 5)
    with_terms = _grouped_latency_bound(problem, [1, 0, 1] * 2)
    kept = relax.GroupModel._touching
    monkeypatch.setattr(relax.GroupModel, "_touching", lambda self, *args: kept(self, *args)[:1])
    assert _grouped_latency_bound(problem, [1, 0, 1] * 2) == 17 < with_terms == best


def test_three_experts_a_layer_leave_no_run_for_a_streamed_attention(monkeypatch):
    """Two layers of an attention and four expert units, copies 2 and 3. Three streamed experts in each layer hold
    1 + 2 x 9 = 19 bytes, an attention beside them 23, four experts 25: on a 20-byte GPU the attentions cannot
    stream (brute force: 24). Runs of ``e`` experts (the flag of ``e + 1`` in one run unset) number at least
    ``n - (e - 1) R``: six experts over two runs put three in both, and no run is left for an attention. With
    one expert a run counted at most, both attentions streamed (bound 18)."""
    problem = _layers_of_experts(_two_options(2, 1, 4), _two_options(3, 1, 5), 2, 20, 20, groups=4)
    best = reference_optimum(problem, "latency")
    assert best == 2 * (4 + 3 * 1 + 5)
    with_terms = _grouped_latency_bound(problem, [1, 0, 0, 0, 1] * 2)
    kept = relax.GroupModel._touching
    monkeypatch.setattr(relax.GroupModel, "_touching", lambda self, *args: [
        t for t in kept(self, *args) if t[3] == 1])
    assert _grouped_latency_bound(problem, [1, 0, 0, 0, 1] * 2) == 18 < with_terms == best


def test_a_read_hands_copied_units_to_the_runs_copying_least():
    """Four layers of two expert units, one of each layer streamed by the counts (7 bytes a run on a 10-byte GPU,
    two in one run would hold 13). Handed out in unit order the four streamed units fill the last two layers,
    over memory; the read also deals them out apart (``reductions.copies_apart``: each to the run copying least so
    far), and the plan fits at brute force's optimum."""
    attention = (PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=0, decode_ns=0,
                                 stored_bytes=1, resident_bytes=0, peak_bytes=0),)
    problem = _layers_of_experts(attention, _two_options(3, 1, 5), 4, 10, 20)
    best = reference_optimum(problem, "latency")
    assert best == 4 * (1 + 5)
    path = paths.critical_path(problem, [0] * len(problem.units))
    model = relax.GroupModel(problem, 1, [0] * len(problem.units), relax.groups_of(problem, path), path, None)
    model.minimize("latency", None, 0)
    solver, status = model.solve(5, 0, 1, 0.0)
    assert status == cp_model.OPTIMAL
    handed = model._handed(solver)
    assert not problem.satisfies(handed)  # the order this test is about
    read = model.read(solver)
    assert problem.satisfies(read) and problem.objective_value(read, "latency") == best


def _two_options(copy, gpu_ns, cpu_ns):
    """Streamed to the GPU (own peak 1, ``group_copy_bytes`` ``copy``) or resident on the CPU, 1 byte stored there."""
    return (PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=gpu_ns, decode_ns=0,
                            stored_bytes=1, resident_bytes=0, peak_bytes=1 + 2 * copy, group_copy_bytes=copy),
            PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=cpu_ns, decode_ns=0,
                            stored_bytes=1, resident_bytes=0, peak_bytes=0))


def test_two_streamed_parts_of_a_layer_hold_both_copies_twice(monkeypatch):
    """A layer streaming both parts holds a run copying both, and at least as much in flight: 1 + 2 x (2 + 3)
    bytes on the GPU. With 10 there, the per-option peaks (1 + 2 x 3) let every part stream (bound 4); counted
    by run, no layer streams both, and both attentions run on the CPU, as in brute force's optimum."""
    problem = _layers_of_two_parts(_two_options(2, 1, 5), _two_options(3, 1, 9), 2, 10, 10)
    best = reference_optimum(problem, "latency")
    assert best == 5 + 1 + 5 + 1  # with one attention on the CPU, the other layer's run holds 1 + 5 + 5 bytes
    with_runs = _grouped_latency_bound(problem, [1] * 4)
    monkeypatch.setattr(relax.GroupModel, "_shared_run_peaks", lambda self: None)
    assert _grouped_latency_bound(problem, [1] * 4) == 4 < with_runs == best


def test_a_shared_run_peak_between_two_levels_is_not_rounded_up():
    """The pair's 1 + 2 x (2 + 3) = 11 bytes lie between the menus' peak levels (5, 7, 12: a GPU-resident
    option's workspace): on an 11-byte GPU every part streams. Stated on the level expression, the peak
    would have had to take 12 and the bound rose above the optimum (sublayer Mixtral-8x7B, 3060, batch 16)."""
    resident = PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=1, decode_ns=0,
                               stored_bytes=0, resident_bytes=0, peak_bytes=12)
    attention, mlp = ((*_two_options(c, 1, 9), resident) for c in (2, 3))
    problem = _layers_of_two_parts(attention, mlp, 2, 11, 10)
    assert reference_optimum(problem, "latency") == 4 == _grouped_latency_bound(problem, [1] * 4)


def test_stall_rows_share_the_hiding_units_out_among_the_windows():
    """Two streamed units (a 6 ns copy, 1 ns of compute each) and one CPU unit of 9 ns between them, round the
    decode's cycle: the CPU unit hides the second copy, and the first waits 6 - 1 = 5 ns behind the second's
    compute alone: 11 + 5 = 16. The copy thread's row says 12; a hiding unit wider than the gap only hides the
    gap, in one window, so counted windows say 16 as well."""
    streamed = (PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=0, decode_ns=1,
                                copy_decode_ns=6, stored_bytes=1, resident_bytes=0, peak_bytes=0),)
    on_cpu = (PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=0, decode_ns=9,
                              stored_bytes=1, resident_bytes=0, peak_bytes=0),)
    names = ["s1", "h", "s2"]
    problem = PlacementProblem(
        units=(UnitSpec(name="s1", options=streamed), UnitSpec(name="h", options=on_cpu),
               UnitSpec(name="s2", options=streamed)),
        edges=tuple(EdgeSpec(src=a, dst=b, prefill_ns={}, decode_ns={}) for a, b in itertools.pairwise(names)),
        devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=10),
                 DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10)))
    model = aggregate.AggregateModel(problem, 1, [0, 0, 0], [], None)  # three single items
    model.minimize("latency", None, 0)
    solver, _ = model.solve(5, 0, 1, 0.0)
    assert reference_optimum(problem, "latency") == 16 == reported_bound(model, solver)


def test_stall_rows_count_the_previous_streamed_unit_as_it_computes():
    """Two streamed layers (a 10 ns copy, 1 ns of compute) round the decode's cycle, a 15 ns CPU unit in one
    window and three 1 ns units in the other: the first window hides its copy, the second waits 10 - 4 = 6 ns;
    the optimum is 20 ns of compute + 6 = 26. The last unit may also stream, computing 8 ns, which no
    optimum does. Crediting each window's first unit with the most any streamed option computes (8 ns) left
    each copy a gap of 2 ns and the bound at the copy thread's 20 ns; credited with what the most units'
    streamed option computes (1 ns), the 8 ns option's excess a unit of its window, the bound is the optimum."""
    layer = (PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=0, decode_ns=1,
                             copy_decode_ns=10, stored_bytes=1, resident_bytes=0, peak_bytes=0),)

    def on(execution, ns, copy=0):
        return PlacementOption(storage="cpu", execution=execution, mode="stream" if copy else "resident",
                               prefill_ns=0, decode_ns=ns, copy_decode_ns=copy, stored_bytes=1, resident_bytes=0,
                               peak_bytes=0)

    units = [("s1", layer), ("big", (on("cpu", 15),)), ("s2", layer), ("g1", (on("cpu", 1),)),
             ("g2", (on("cpu", 1),)), ("last", (on("cuda:0", 1), on("cuda:0", 8, copy=1)))]
    problem = PlacementProblem(
        units=tuple(UnitSpec(name=n, options=o) for n, o in units),
        edges=tuple(EdgeSpec(src=a, dst=b, prefill_ns={}, decode_ns={})
                    for (a, _), (b, _) in itertools.pairwise(units)),
        devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=10),
                 DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10)))
    model = aggregate.AggregateModel(problem, 1, [0] * len(units), [], None)  # single items
    model.minimize("latency", None, 0)
    solver, _ = model.solve(5, 0, 1, 0.0)
    assert reference_optimum(problem, "latency") == 26 == reported_bound(model, solver)


def _retimed(draw, menu):
    """``menu`` with every option's times drawn again (bytes, devices and modes kept): units that
    :func:`relax.groups_of` puts in one group while their times differ."""
    def again(option, field):
        if field.startswith("copy") and not getattr(option, field):
            return 0  # an option that copies nothing still does not
        return draw(st.integers(0, 60))

    fields = ("prefill_ns", "decode_ns", "copy_prefill_ns", "copy_decode_ns")
    return tuple(dataclasses.replace(o, **{f: again(o, f) for f in fields}) for o in menu)


@settings(max_examples=80, deadline=None)
@given(layers=st.integers(2, 3), runs=st.booleans(), data=st.data())
def test_grouped_stall_rows_never_bound_above_brute_force(layers, runs, data):
    """The grouped relaxation's stall rows (overlap: copies beside the compute), with copy runs (a layer's two
    parts copied as one) and without, over groups whose units' times differ (each group's option counts at
    the least time in the path rows, at the most in what it may hide): its bound is at most brute force's."""
    attention, mlp = (_menu(data.draw, ["cuda:0"], False, copying=runs) for _ in range(2))
    problem = _layers_of_two_parts(attention, mlp, layers, 24, 30)
    problem = dataclasses.replace(problem, units=tuple(
        dataclasses.replace(u, options=_retimed(data.draw, u.options)) for u in problem.units),
        copy_groups=problem.copy_groups if runs else ())
    best = reference_optimum(problem, "latency")
    assume(best is not None)
    assert _grouped_latency_bound(problem, [data.draw(st.integers(0, 2)) for _ in problem.units]) <= best


def _decode_option(storage, execution, mode, decode_ns, stored, copy_ns=0):
    """A decode-only option (the prefill costs nothing); a streamed one copies ``copy_ns`` and holds its buffer."""
    return PlacementOption(storage=storage, execution=execution, mode=mode, prefill_ns=0, decode_ns=decode_ns,
                           stored_bytes=stored, resident_bytes=0, peak_bytes=3 if copy_ns else 0,
                           copy_decode_ns=copy_ns, group_copy_bytes=1 if copy_ns else 0)


def test_a_window_of_copies_holds_whole_layers():
    """Three layers of an attention (4 ns on the GPU) and an MLP (7 ns) round the decode's cycle, with room on the
    GPU for one MLP: the others stream (a 16 ns copy) or compute on the CPU (40 ns). Streamed after a streamed
    layer, a copy waits 16 - 11 = 5 ns, since the window holds that layer whole; per unit, each window could take
    an attention or an MLP of the resident layer, and the bound was 33 against brute force's 38. Counted by whole
    run (``_whole_run_stalls``), it is the optimum."""
    attention = (_decode_option("cuda:0", "cuda:0", "resident", 4, 1), _decode_option("cpu", "cpu", "resident", 30, 1))
    mlp = (_decode_option("cuda:0", "cuda:0", "resident", 7, 4), _decode_option("cpu", "cuda:0", "stream", 7, 4, 16),
           _decode_option("cpu", "cpu", "resident", 40, 4))
    problem = _layers_of_two_parts(attention, mlp, 3, 10, 100)
    hint = [0, 0, 0, 1, 0, 1]
    assert reference_optimum(problem, "latency") == 3 * (4 + 7) + 5 == _grouped_latency_bound(problem, hint, True)
    assert _grouped_latency_bound(problem, hint) == 33


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_whole_run_stall_rows_never_bound_above_brute_force(data):
    """Runs of one to three units drawn from one to three menus (a menu twice in a run: a group twice there, as an
    MoE layer's expert groups; one menu in runs of two kinds, as layer 0's norm), copying with their run: the
    grouped relaxation with its whole-run stall rows bounds at most brute force's optimum."""
    menus = [_menu(data.draw, ["cuda:0"], False, copying=True) for _ in range(data.draw(st.integers(1, 3)))]
    shapes = data.draw(st.lists(st.lists(st.integers(0, len(menus) - 1), min_size=1, max_size=3), min_size=2,
                                max_size=3).filter(lambda runs: sum(map(len, runs)) <= 6))
    runs = [tuple((f"r{i}.{j}", menus[m]) for j, m in enumerate(shape)) for i, shape in enumerate(shapes)]
    problem = _runs_on_one_gpu(runs, data.draw(st.integers(0, 30)), data.draw(st.integers(0, 40)))
    best = reference_optimum(problem, "latency")
    bound = _grouped_latency_bound(problem, [data.draw(st.integers(0, 2)) for _ in problem.units], True)
    if best is None:
        return
    assert bound is not None and bound <= best


@settings(max_examples=200)
@given(st.lists(st.integers(1, 10**7), min_size=1, max_size=30))
def test_near_sums_take_their_buckets_extreme_within_the_step(values):
    up, down = relax._nearest(values, max), relax._nearest(values, min)
    for v in values:
        assert v <= up[v] <= v * relax.RUN_STEP and v / relax.RUN_STEP <= down[v] <= v
        assert up[v] in values and down[v] in values


def _chain_of_like_units(peaks, gpu_bytes, cpu_bytes, gpu_ns=1, cpu_ns=5):
    """One unit per peak, each resident on the GPU (that transient there) or on the CPU; 1 byte stored either way.
    Peaks within :data:`~.relax.PEAK_STEP` of each other make one group of the grouped relaxation."""
    units = tuple(UnitSpec(name=f"u{i}", options=(
        PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=gpu_ns, decode_ns=0,
                        stored_bytes=1, resident_bytes=0, peak_bytes=peak),
        PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=cpu_ns, decode_ns=0,
                        stored_bytes=1, resident_bytes=0, peak_bytes=0))) for i, peak in enumerate(peaks))
    return PlacementProblem(units=units, edges=tuple(EdgeSpec(src=a.name, dst=b.name, prefill_ns={}, decode_ns={})
                                                     for a, b in itertools.pairwise(units)),
                            devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=gpu_bytes),
                                     DeviceSpec(name="cpu", kind="cpu", capacity_bytes=cpu_bytes)))


def test_like_units_past_their_least_peak_hold_the_next_one(monkeypatch):
    """Three like units with peaks 100, 105 and 105 (one group: within PEAK_STEP) on a 106-byte GPU: one fits
    beside its own peak, two need 2 + 105 = 107. At the group's least peak (100) all three fit (3 + 100), and the
    bound is 3; past it (``_graded_peaks``: more than one unit holds 105) only one does, brute force's 11."""
    problem = _chain_of_like_units([100, 105, 105], 106, 10)
    assert len(relax.groups_of(problem, [0, 1, 2])) == 1
    best = reference_optimum(problem, "latency")
    assert best == 1 + 5 + 5
    graded = _grouped_latency_bound(problem, [1, 1, 1])
    monkeypatch.setattr(relax.GroupModel, "_graded_peaks", lambda self, dev: [])
    assert _grouped_latency_bound(problem, [1, 1, 1]) == 3 < graded == best


@settings(max_examples=60, deadline=None)
@given(peaks=st.lists(st.integers(90, 99), min_size=2, max_size=6), gpu=st.integers(90, 106),
       data=st.data())
def test_like_units_of_different_peaks_never_bound_above_brute_force(peaks, gpu, data):
    """Like units whose peaks differ (one group, each option at its least peak, the counts past it held to the
    members' larger peaks): the grouped bound is at most brute force's optimum."""
    problem = _chain_of_like_units(peaks, gpu, 10)
    best = reference_optimum(problem, "latency")
    bound = _grouped_latency_bound(problem, [data.draw(st.integers(0, 1)) for _ in peaks])
    if best is None:
        return
    assert bound is not None and bound <= best


def test_a_memory_bound_past_2_53_bytes_is_never_above_the_optimum():
    """CP-SAT gives its bound as a double: 2**54 + 3 bytes came back as 2**54 + 4, one byte above the only plan
    (all on the GPU: the CPU is 100x slower, past the latency slack)."""
    size = 2**54 + 3
    menu = (PlacementOption(storage="gpu", execution="gpu", mode="resident", prefill_ns=1, decode_ns=1,
                            stored_bytes=size, resident_bytes=0, peak_bytes=0),
            PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=100, decode_ns=100,
                            stored_bytes=1, resident_bytes=0, peak_bytes=0))
    problem = PlacementProblem(units=(UnitSpec(name="a", options=menu), UnitSpec(name="b", options=menu)),
                               edges=(EdgeSpec(src="a", dst="b", prefill_ns={}, decode_ns={}),),
                               devices=(DeviceSpec(name="gpu", kind="gpu", capacity_bytes=2**60),
                                        DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10)))
    solution = search.solve_problem(problem, "memory", time_limit_s=2, workers=1)
    assert solution.objective_value == reference_optimum(problem, "memory") == 2 * size
    assert solution.best_bound <= 2 * size


def test_residency_that_slows_a_dag_is_not_kept():
    """prefer_resident moves a streamed unit to resident where the unit itself is no slower. Here B's residency
    starts C's copy window earlier but without B's longer compute beside it: C stalls 10 more on a path (C -> D)
    that does not pass B. The search's optimum (100, B streamed) was returned as 110."""
    def option(storage, execution, mode, prefill_ns, copy=0):
        return PlacementOption(storage=storage, execution=execution, mode=mode, prefill_ns=prefill_ns, decode_ns=0,
                               copy_prefill_ns=copy, stored_bytes=0, resident_bytes=0, peak_bytes=0)
    b = UnitSpec(name="B", options=(option("cpu", "gpu", "stream", 10, copy=1), option("gpu", "gpu", "resident", 0)))
    c = UnitSpec(name="C", options=(option("cpu", "gpu", "stream", 0, copy=10),))
    d = UnitSpec(name="D", options=(option("cpu", "cpu", "resident", 100),
                                    dataclasses.replace(option("gpu", "gpu", "resident", 1), stored_bytes=1000)))
    problem = PlacementProblem(units=(b, c, d), edges=(EdgeSpec(src="C", dst="D", prefill_ns={}, decode_ns={}),),
                               devices=(DeviceSpec(name="gpu", kind="gpu", capacity_bytes=100),
                                        DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100)))
    assert reference_optimum(problem, "latency") == 100
    solution = search.solve_problem(problem, "latency", time_limit_s=2, workers=1, hint=[0, 0, 1])  # hint: no fit
    assert solution.objective_value == 100 and solution.best_bound <= 100
