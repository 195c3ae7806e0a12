"""A relaxation's earlier solutions: kept, read like the solver's last one, and the best plan among them wins; which
relaxations a problem gets."""

from __future__ import annotations

import dataclasses
import itertools
import time

from _brute import reported_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from placement_opt.solver import _counted, _relaxing, _run, aggregate, relax, search
from placement_opt.solver.problem import (
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
)


def _unit(name: str, works: tuple[int, ...]) -> UnitSpec:
    return UnitSpec(name=name, options=tuple(
        PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=w, decode_ns=0, stored_bytes=1,
                        resident_bytes=0, peak_bytes=0) for w in works))


def _problem(n: int = 3) -> PlacementProblem:
    # option k of every unit costs 10 * (k + 1): a plan's latency is the sum of its options' prices
    return PlacementProblem(units=tuple(_unit(f"u{i}", (10, 20, 30)) for i in range(n)), edges=(),
                            devices=(DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100),))


class _Reads:
    """A stand-in relaxation whose k-th solution reads into ``plans[k]``."""

    def __init__(self, plans: list[list[int]]) -> None:
        self.plans = plans
        self.read_count = 0

    def read(self, solution: int) -> list[int]:
        self.read_count += 1
        return list(self.plans[solution])


def test_a_snapshot_reads_values_and_literals_as_the_solver_does():
    model = cp_model.CpModel()
    x = model.new_int_var(0, 7, "x")
    b = model.new_bool_var("b")
    model.add(x + 3 * b <= 8)
    model.maximize(2 * x + b)
    solver = cp_model.CpSolver()
    assert solver.solve(model) == cp_model.OPTIMAL
    snap = _counted.Snapshot(list(solver.response_proto.solution))
    assert snap.value(x) == solver.value(x) == 7
    assert snap.boolean_value(b) is solver.boolean_value(b) is False
    assert snap.boolean_value(~b) is solver.boolean_value(~b) is True


def test_the_best_read_is_the_lowest_priced_plan_not_the_last_solutions():
    problem = _problem()
    reads = _Reads([[2, 2, 1], [0, 0, 1], [0, 1, 1]])  # 80, 40, 50: the second one wins
    best = _relaxing.best_read(problem, "latency", reads, [0, 1, 2], None, time.perf_counter() + 5)
    assert best == [0, 0, 1]
    assert reads.read_count == 3


def test_the_best_read_comes_back_even_when_it_prices_above_the_start():
    problem = _problem()
    reads = _Reads([[2, 2, 1], [1, 1, 1]])  # 80, 60: the caller compares them with its start
    assert _relaxing.best_read(problem, "latency", reads, [0, 1], None, time.perf_counter() + 5) == [1, 1, 1]


def test_polish_goes_on_from_a_plan_worse_than_the_start_when_that_one_descends_lower():
    # Polish moves a unit only to an option some unit of its menu (one options tuple) uses: from [1, 1, 1]
    # (60) no step improves, while [2, 2, 0] (70) descends to [0, 0, 0] (30).
    menu = _unit("u", (10, 20, 30)).options
    problem = dataclasses.replace(_problem(), units=tuple(UnitSpec(name=f"u{i}", options=menu) for i in range(3)))
    assert search.polish(problem, [1, 1, 1], time.perf_counter() + 5) == [1, 1, 1]
    assert search._polished(problem, [[1, 1, 1], [2, 2, 0]], time.perf_counter() + 5) == [0, 0, 0]
    assert search._polished(problem, [[1, 1, 1], [1, 1, 1]], time.perf_counter() + 5) == [1, 1, 1]


def test_past_its_deadline_only_the_last_solution_is_read():
    problem = _problem()
    reads = _Reads([[1, 1, 1], [0, 0, 0]])
    best = _relaxing.best_read(problem, "latency", reads, [0, 1], None, time.perf_counter() - 1)
    assert best == [1, 1, 1] and reads.read_count == 1


class _Optima:
    """A stand-in relaxation that proves ``bound`` at once (``status``) and whose optimum under seed ``s`` reads
    into ``plans[s]``: which of its optima CP-SAT returns depends on the seed."""

    def __init__(self, plans: list[list[int]], bound: int, status: int = cp_model.OPTIMAL) -> None:
        self.plans, self.bound, self.status = plans, bound, status
        self.seeds: list[int] = []
        self.solutions: list[int] = []

    def minimize(self, *_: object) -> None:
        pass

    def solve(self, time_limit_s: float, seed: int, workers: int, gap_limit: float) -> tuple[int, int]:
        self.seeds.append(seed)
        return seed, self.status

    def proven_bound(self, solver: int) -> int:
        return self.bound

    def read(self, solution: int) -> list[int]:
        return list(self.plans[solution])


def _relax_with(m: _Optima, until_s: float = 5.0) -> _run.Found:
    now = time.perf_counter()
    run = _run.Run(seed=0, workers=1, gap_limit=0.001, t0=now)
    return _relaxing.solve_relaxation(_problem(), "latency", lambda *_: m, run, ([2, 2, 2], True), None,
                         (now + until_s, now + until_s + 1))


def test_an_optimum_proven_early_that_reads_far_from_its_bound_is_solved_again_with_other_seeds():
    # bound 30; seed 0 reads into 80, seed 1 into 50, seed 2 into the optimum, 30: the search stops there
    m = _Optima([[2, 2, 1], [0, 1, 1], [0, 0, 0], [0, 0, 0]], bound=30)
    found = _relax_with(m)
    assert found.choice == [0, 0, 0] and found.bound == 30
    assert m.seeds == [0, 1, 2]


def test_retries_keep_the_best_read_and_stop_after_the_last_retry():
    m = _Optima([[0, 1, 1], [2, 2, 1], [1, 1, 1], [2, 2, 2], [0, 0, 0]], bound=30)  # 50, 80, 60, 90, (30)
    found = _relax_with(m)
    assert found.choice == [0, 1, 1]
    assert m.seeds == list(range(_relaxing.RELAX_RETRIES + 1))


def test_no_retry_for_a_close_read_an_unproven_optimum_or_no_time():
    close = _Optima([[0, 0, 0], [1, 1, 1]], bound=30)
    assert _relax_with(close).choice == [0, 0, 0] and close.seeds == [0]
    unproven = _Optima([[2, 2, 1], [0, 0, 0]], bound=30, status=cp_model.FEASIBLE)
    assert _relax_with(unproven).choice == [2, 2, 1] and unproven.seeds == [0]
    late = _Optima([[2, 2, 1], [0, 0, 0]], bound=30)
    assert _relax_with(late, until_s=-1.0).choice == [2, 2, 1] and late.seeds == [0]


def _sized_problem(works: list[list[int]], capacity: int) -> PlacementProblem:
    """Units on one CPU of ``capacity`` bytes, option k of unit i taking ``works[i][k]`` and storing k + 1 bytes."""
    units = tuple(UnitSpec(name=f"u{i}", options=tuple(
        PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=w, decode_ns=0,
                        stored_bytes=k + 1, resident_bytes=0, peak_bytes=0) for k, w in enumerate(row)))
        for i, row in enumerate(works))
    return PlacementProblem(units=units, edges=(), devices=(DeviceSpec(name="cpu", kind="cpu", capacity_bytes=capacity),))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=3, max_size=3), min_size=4, max_size=7),
       st.integers(1, 60))
def test_kept_solutions_read_into_valid_plans_priced_at_or_above_the_bound(works, capacity):
    # Units on one CPU of limited capacity, option k storing k + 1 bytes: every solution the grouped
    # relaxation kept reads into a plan that fits, and no plan prices below the relaxation's bound.
    problem = _sized_problem(works, capacity)
    units = problem.units
    model = relax.GroupModel(problem, 1, [2] * len(units), relax.groups_of(problem), [], None)
    model.minimize("latency", None, 0)
    solver, status = model.solve(5, 0, 1, 0.0)
    if status == cp_model.INFEASIBLE:
        assert len(units) > capacity  # every option stores a byte at least
        return
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    assert len(model.solutions) <= _counted.KEEP_SOLUTIONS
    for plan in [model.read(solver), *map(model.read, model.solutions)]:
        assert problem.satisfies(plan)
        assert problem.objective_value(plan, "latency") >= reported_bound(model, solver)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(2, 20))
def test_kept_solutions_hold_the_last_and_span_a_long_run(found, most):
    keep = _counted._Keep(most)
    for k in range(found):  # the k-th solution's values: [k]
        keep.add([k])
    kept = [v[0] for v in keep.kept]
    assert kept == sorted(set(kept)) and kept[-1] == found - 1  # in order, the last always kept
    assert len(kept) == found if found <= most else len(kept) <= most
    if found > most:  # thinned from the front: the oldest half of the run still has a solution
        assert kept[0] < found / 2


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=3, max_size=3), min_size=3, max_size=6),
       st.integers(3, 30), st.sampled_from([(1, True), (2, True), (2, False)]))
def test_a_bound_pass_bounds_the_brute_force_optimum_and_its_solutions_read_into_plans(works, capacity, run):
    # The grouped relaxation's runs: with two workers, objective_lb_search and default_lp as full
    # workers in one run (its default), or a bound pass (max_lp and objective_lb_search; max_lp's
    # linearization with one worker) before the default search: the bound it reports stays at or below
    # the real problem's optimum, and every solution kept from either run reads into a plan that fits.
    workers, full = run
    problem = _sized_problem(works, capacity)
    units = problem.units
    plans = [list(c) for c in itertools.product(range(3), repeat=len(units)) if problem.satisfies(c)]
    model = relax.GroupModel(problem, 1, [0] * len(units), relax.groups_of(problem), [], None)
    model.bound_share = 0.5
    if not full:
        model.full_subsolvers = ()
    model.minimize("latency", None, 0)
    solver, status = model.solve(1.0, 0, workers, 0.0)
    if not plans:
        return  # counts may still fit where no plan does (each group priced at its least)
    best = min(problem.objective_value(c, "latency") for c in plans)
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    assert reported_bound(model, solver) <= best
    for plan in [model.read(solver), *map(model.read, model.solutions)]:
        assert problem.satisfies(plan)


def _chain(menus: list[tuple[int, ...]]) -> PlacementProblem:
    """A chain of units on one CPU, unit i with ``menus[i]``'s prices, each edge the only one in and out."""
    units = tuple(_unit(f"u{i}", works) for i, works in enumerate(menus))
    edges = tuple(EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns={}, decode_ns={}) for i in range(len(units) - 1))
    return PlacementProblem(units=units, edges=edges, devices=(DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10**6),))


def _relaxation_kinds(problem: PlacementProblem) -> list[str]:
    names = [name for name, _, _ in _relaxing.relaxations_for(problem, [["cpu"]])]
    return ["grouped" if "groups of like units" in n else "runs" if "consecutive" in n else n for n in names]


def test_alternating_units_get_the_grouped_relaxation_from_fewer_units_than_runs_do():
    # two menus in turn, as a sublayer graph's attention and MLP: no run of identical consecutive units
    alternating = [(10, 20), (30, 40)]
    above, at = _relaxing.GROUP_WITHOUT_RUNS_ABOVE + 1, _relaxing.GROUP_WITHOUT_RUNS_ABOVE
    assert _relaxation_kinds(_chain([alternating[i % 2] for i in range(above)])) == ["grouped"]
    # fewer units: grouped where like units repeat (Gemma-2's sliding and global layers), not where each is alone
    assert _relaxation_kinds(_chain([alternating[i % 2] for i in range(at)])) == ["grouped"]
    assert _relaxation_kinds(_chain([alternating[i % 2] for i in range(4)])) == ["grouped"]
    distinct = [(10 * 2**i, 20 * 2**i) for i in range(12)]  # work apart by more than relax.TIME_STEP: 12 groups
    assert _relaxation_kinds(_chain(distinct)) == []
    assert _relaxing.GROUP_REPEATS_SHARE == 0.5  # 12 units: grouped in 6 groups, not in 7
    assert _relaxation_kinds(_chain(distinct[:6] * 2)) == ["grouped"]
    assert _relaxation_kinds(_chain(distinct[:7] + distinct[:5])) == []
    # the same size with a run of identical layers: counted as a run, grouped only above GROUP_ABOVE
    assert above <= _relaxing.GROUP_ABOVE
    assert _relaxation_kinds(_chain([(10, 20)] * above)) == ["runs"]
    assert _relaxation_kinds(_chain([(10, 20)] * (_relaxing.GROUP_ABOVE + 1))) == ["runs", "grouped"]
    # contiguous storage counts no runs at all: the grouped relaxation waits for GROUP_ABOVE there, as before
    contiguous = dataclasses.replace(_chain([alternating[i % 2] for i in range(above)]), contiguous=True)
    assert _relaxation_kinds(contiguous) == []


def _overlap_problem(n: int) -> PlacementProblem:
    """``n`` like units, each computed on the CPU in 10 ns per decode or streamed to the GPU and computed there in
    1 ns, its copy taking the prefetch thread 10 ns: a CPU unit before a streamed one hides its copy."""
    cpu = PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=0, decode_ns=10,
                          stored_bytes=1, resident_bytes=0, peak_bytes=0)
    stream = PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=0, decode_ns=1,
                             stored_bytes=1, resident_bytes=0, peak_bytes=1, copy_decode_ns=10)
    units = tuple(UnitSpec(name=f"u{i}", options=(cpu, stream)) for i in range(n))
    edges = tuple(EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns={}, decode_ns={}) for i in range(n - 1))
    return PlacementProblem(units=units, edges=edges, devices=(
        DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=10), DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100)))


def _grouped_read(problem: PlacementProblem, hint: list[int], seed: int) -> list[int]:
    """The grouped relaxation of ``problem`` solved (one worker) and its solution read into a plan."""
    model = relax.GroupModel(problem, 1, hint, relax.groups_of(problem), [], None)
    model.minimize("latency", None, 0)
    solver, status = model.solve(2.0, seed, 1, 0.0)
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    return model.read(solver)


@settings(max_examples=10, deadline=None)
@given(st.integers(4, 9), st.integers(0, 3))
def test_the_grouped_read_spreads_streamed_units_among_the_others_under_overlap(n, seed):
    # Handed out in unit order, the streamed units of a group sit together and each but the first waits for
    # its copy; the read spreads them among the CPU units instead, so that it prices like the best order of
    # its own counts (every arrangement of them, brute force).
    problem = _overlap_problem(n)
    plan = _grouped_read(problem, [0] * n, seed)
    assert problem.satisfies(plan)
    streamed = sum(plan)
    orders = {tuple(1 if i in picked else 0 for i in range(n)) for picked in itertools.combinations(range(n), streamed)}
    best = min(problem.objective_value(list(c), "latency") for c in orders)
    assert problem.objective_value(plan, "latency") == best
    assert 0 < streamed < n  # both kinds used: the test is about their order


@settings(max_examples=10, deadline=None)
@given(st.integers(4, 9), st.integers(0, 3))
def test_the_grouped_read_keeps_contiguous_storage_in_one_range_per_device(n, seed):
    # Streamed units stored on the disk, CPU units in RAM: spread among each other they would interleave the
    # two devices' ranges, which contiguous storage forbids; the read keeps each device's units together.
    base = _overlap_problem(n)
    disk = dataclasses.replace(base.units[0].options[1], storage="disk")
    units = tuple(dataclasses.replace(u, options=(u.options[0], disk)) for u in base.units)
    problem = dataclasses.replace(base, units=units, contiguous=True,
                                  devices=(*base.devices, DeviceSpec(name="disk", kind="disk", capacity_bytes=100)))
    plan = _grouped_read(problem, [0] * n, seed)
    assert 0 < sum(plan) < n  # both devices store units: the order decides contiguity
    assert problem.satisfies(plan)


def _layers(copy_ns: int, groups: bool) -> PlacementProblem:
    """Eight layers of an attention and an MLP, each resident on the GPU or streamed there (a ``copy_ns`` copy beside
    the compute), copied as one run per layer when ``groups``."""
    def menu(ns: int) -> tuple[PlacementOption, ...]:
        return (PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=ns, decode_ns=ns,
                                stored_bytes=4, resident_bytes=0, peak_bytes=0),
                PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=ns, decode_ns=ns,
                                stored_bytes=4, resident_bytes=0, peak_bytes=2, copy_decode_ns=copy_ns,
                                group_copy_bytes=1))
    names = [f"{part}{i}" for i in range(8) for part in ("a", "m")]
    units = tuple(UnitSpec(name=n, options=menu(10 if n[0] == "a" else 20)) for n in names)
    edges = tuple(EdgeSpec(src=a, dst=b, prefill_ns={}, decode_ns={}) for a, b in itertools.pairwise(names))
    return PlacementProblem(units=units, edges=edges,
                            devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=40),
                                     DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10**6)),
                            copy_groups=tuple((f"a{i}", f"m{i}") for i in range(8)) if groups else ())


def test_copy_runs_under_overlap_get_a_second_grouped_relaxation_counting_whole_runs():
    whole = "the same with whole copy runs in the stall rows"
    assert _relaxation_kinds(_layers(copy_ns=50, groups=True)) == ["grouped", whole]
    assert _relaxation_kinds(_layers(copy_ns=0, groups=True)) == ["grouped"]  # no copy beside the compute
    assert _relaxation_kinds(_layers(copy_ns=50, groups=False)) == ["grouped"]  # no runs to count whole


def _mixed_problem(n: int) -> PlacementProblem:
    """``n`` like units: on the GPU resident (1 ns a decode, room for a third of them), on the CPU (10 ns), or
    streamed to the GPU (1 ns, its copy 10 ns): a streamed unit's copy is hidden only by a CPU unit and a resident
    one since the streamed unit before it, so the best orders mix all three."""
    gpu = PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=0, decode_ns=1,
                          stored_bytes=3, resident_bytes=0, peak_bytes=0)
    cpu = PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=0, decode_ns=10,
                          stored_bytes=1, resident_bytes=0, peak_bytes=0)
    stream = PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=0, decode_ns=1,
                             stored_bytes=1, resident_bytes=0, peak_bytes=1, copy_decode_ns=11)
    units = tuple(UnitSpec(name=f"u{i}", options=(gpu, cpu, stream)) for i in range(n))
    edges = tuple(EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns={}, decode_ns={}) for i in range(n - 1))
    return PlacementProblem(units=units, edges=edges, devices=(
        DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=3 * (n // 3) + 1),
        DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100)))


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([6, 9]), st.integers(0, 2))
def test_the_grouped_read_deals_every_option_out_when_the_best_orders_mix_them(n, seed):
    # Streamed units spread among the others in blocks per device (a GPU block, then a CPU block) leave the
    # copies after the GPU block unhidden; every option spread evenly hides them all. The read prices like the
    # best order of its own counts (every arrangement of them, brute force).
    problem = _mixed_problem(n)
    plan = _grouped_read(problem, [1] * n, seed)
    assert problem.satisfies(plan)
    assert len(set(plan)) == 3  # all three kinds used: the test is about their order
    orders = set(itertools.permutations(plan))
    best = min(problem.objective_value(list(c), "latency") for c in orders if problem.satisfies(list(c)))
    assert problem.objective_value(plan, "latency") == best


def _four_options() -> list[PlacementOption]:
    return [PlacementOption(storage="cpu", execution="cuda:0" if k % 2 else "cpu", mode="stream" if k % 2 else "resident",
                            prefill_ns=k, decode_ns=k, stored_bytes=1, resident_bytes=0, peak_bytes=0,
                            copy_prefill_ns=k % 2, copy_decode_ns=k % 2) for k in range(4)]


def _worst_prefix_miss(units: list[int], out: list[int]) -> float:
    """The farthest any prefix of ``out`` strays from an option's share of it, in units."""
    n = len(units)
    return max(abs(out[:length].count(o) - length * units.count(o) / n) for o in set(units) for length in range(n + 1))


@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.sampled_from(["prefill_ns", "decode_ns"]))
def test_interleaving_keeps_the_options_and_spreads_each_evenly(units, phase):
    out = aggregate.interleaved(units, _four_options(), phase)
    assert sorted(out) == sorted(units)
    assert _worst_prefix_miss(units, out) <= 1  # every prefix holds its share of each option, within one unit


def test_interleaving_does_not_pile_options_up_where_their_places_tie():
    # Three single units and eight of a fourth: sorting the places puts the singles together at 5.5 of 11, after
    # four of the eight, and the fourth option falls 1.35 units behind its share there.
    units = [0, 1, 2] + [3] * 8
    out = aggregate.interleaved(units, _four_options(), "decode_ns")
    assert _worst_prefix_miss(units, out) <= 1
    assert out[0] == 3 and out[-1] == 3  # still spread: the singles among the eight, not at an end


def test_interleaving_spreads_within_one_unit_for_every_mix_of_four_options():
    opts = _four_options()
    for counts in itertools.product(range(6), repeat=4):
        units = [o for o, c in enumerate(counts) for _ in range(c)]
        if units:
            assert _worst_prefix_miss(units, aggregate.interleaved(units, opts, "prefill_ns")) <= 1, counts
