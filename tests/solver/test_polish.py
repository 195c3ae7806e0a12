"""polish(): a valid start comes back valid and no worse, at a plan no single step improves; which problems
the search polishes."""

from __future__ import annotations

import itertools
import time

from _brute import reference_optimum
from _problems import problems
from hypothesis import given, settings
from hypothesis import strategies as st

from placement_opt.solver import aggregate, search
from placement_opt.solver import polish as polish_module
from placement_opt.solver.polish import SWAP_RADIUS, arranged, balanced, polish, sequenced
from placement_opt.solver.problem import (
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
)

_LATER = 1e18  # a deadline that never comes


def _latency(problem, choice):
    return problem.objective_value(choice, "latency")


def _neighbours(problem, choice):
    """Every plan one step from ``choice``, written out here on its own: swaps of like units with different
    options at most SWAP_RADIUS apart, and a unit moved to an option a like unit uses (any option of its
    menu, for a unit alone in it)."""
    n = len(choice)
    for i, j in itertools.combinations(range(n), 2):
        if j - i <= SWAP_RADIUS and choice[i] != choice[j] and problem.units[i].options is problem.units[j].options:
            out = list(choice)
            out[i], out[j] = out[j], out[i]
            yield out
    for i in range(n):
        likes = [c for u, c in zip(problem.units, choice, strict=True) if u.options is problem.units[i].options]
        used = set(likes) if len(likes) > 1 else set(range(len(problem.units[i].options)))  # alone: any option
        for o in used - {choice[i]}:
            out = list(choice)
            out[i] = o
            yield out


@settings(max_examples=150)
@given(problems(), st.data())
def test_a_valid_start_comes_back_valid_no_worse_and_at_a_local_optimum(problem, data):
    start = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    out = polish(problem, start, _LATER, most=10**9)
    if not problem.satisfies(start):
        assert out == start
        return
    assert problem.satisfies(out)
    assert _latency(problem, out) <= _latency(problem, start)
    better = [c for c in _neighbours(problem, out) if problem.satisfies(c) and _latency(problem, c) < _latency(problem, out)]
    assert not better, f"{out} ({_latency(problem, out)}) has a better neighbour {better[0]}"


def _stream_or_compute() -> tuple[PlacementOption, ...]:
    """Computed by the CPU (10 ns a step), or streamed to the GPU (1 ns, after a 10 ns copy)."""
    return (PlacementOption(storage="cpu", execution="cpu", mode="resident", stored_bytes=1, resident_bytes=0,
                            peak_bytes=0, prefill_ns=10, decode_ns=10),
            PlacementOption(storage="cpu", execution="cuda:0", mode="stream", stored_bytes=1, resident_bytes=1,
                            peak_bytes=0, prefill_ns=1, decode_ns=1, copy_prefill_ns=10, copy_decode_ns=10))


def _spread_problem(n: int) -> PlacementProblem:
    menu = _stream_or_compute()
    free = {("cpu", "cuda:0"): 0, ("cuda:0", "cpu"): 0}
    return PlacementProblem(
        units=tuple(UnitSpec(name=f"u{i}", options=menu) for i in range(n)),
        edges=tuple(EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns=free, decode_ns=free) for i in range(n - 1)),
        devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=100),
                 DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100)))


def test_bunched_streamed_units_are_spread_behind_the_cpus_compute():
    # three streamed units in a row wait for their copies; one behind each CPU-computed unit hides its copy in
    # the decode (cyclic), and every order of these counts but one leaves the prefill's first copy in view
    problem = _spread_problem(6)
    start = [1, 1, 1, 0, 0, 0]
    prices = {p: _latency(problem, list(p)) for p in set(itertools.permutations(start))}
    # the steps alone: [1, 0, 1, 0, 1, 0] is as far as single swaps go from here; the best order is one more
    # swap of every pair away
    descended, _ = polish_module._descend(problem, start, _latency(problem, start), polish_module._Budget(10**9, _LATER))
    assert _latency(problem, descended) == prices[(1, 0, 1, 0, 1, 0)] > min(prices.values()) == prices[(0, 1, 0, 1, 0, 1)]
    # dealt out for the prefill, the start reads as the best order
    assert sequenced(problem, start, "prefill_ns") == [0, 1, 0, 1, 0, 1]
    assert polish(problem, start, _LATER, most=10**9) == [0, 1, 0, 1, 0, 1]


def _three_kinds() -> tuple[PlacementOption, ...]:
    """Resident on the GPU (1 ns a step), computed by the CPU (10 ns) or streamed to the GPU (1 ns, a 6 ns copy)."""
    common = dict(stored_bytes=1, resident_bytes=0, peak_bytes=0, prefill_ns=1)
    return (PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", decode_ns=1, **common),
            PlacementOption(storage="cpu", execution="cpu", mode="resident", decode_ns=10, **common),
            PlacementOption(storage="cpu", execution="cuda:0", mode="stream", decode_ns=1, copy_decode_ns=6, **common))


def test_sequencing_hides_every_copy_the_counts_can_hide():
    # two CPU units hide one copy each; the third needs six units of 1 ns since the streamed unit before it:
    # the rule streams the first unit behind the step before's tail (cyclic), spends a CPU unit before each
    # next copy, and leaves the GPU units at the end, where they hide the next step's first copy
    menu = _three_kinds()
    free = {("cpu", "cuda:0"): 0, ("cuda:0", "cpu"): 0}
    n = 10
    problem = PlacementProblem(
        units=tuple(UnitSpec(name=f"u{i}", options=menu) for i in range(n)),
        edges=tuple(EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns=free, decode_ns=free) for i in range(n - 1)),
        devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=100),
                 DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100)))
    start = [2, 2, 2, 1, 1, 0, 0, 0, 0, 0]
    out = sequenced(problem, start, "decode_ns")
    assert out == [2, 1, 2, 1, 2, 0, 0, 0, 0, 0]
    assert not any(problem.waits(problem.options(out), "decode_ns"))
    assert any(problem.waits(problem.options(start), "decode_ns"))


@settings(max_examples=150)
@given(problems(), st.sampled_from(["prefill_ns", "decode_ns"]), st.data())
def test_sequencing_keeps_each_menus_options_and_a_valid_plans_fit(problem, phase, data):
    start = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    out = sequenced(problem, start, phase)
    assert len(out) == len(start)
    menus = {}
    for u, a, b in zip(problem.units, start, out, strict=True):
        menus.setdefault(id(u.options), ([], []))
        menus[id(u.options)][0].append(a)
        menus[id(u.options)][1].append(b)
    assert all(sorted(a) == sorted(b) for a, b in menus.values())
    if (problem.satisfies(start) and not problem.contiguous and not problem.tied_groups and not problem.pins
            and not problem.copy_groups):
        # like units hold the same bytes: only the order, never the capacities, can make the plan invalid (copy
        # groups excepted: a group's buffer holds the units of it that stream, test below)
        assert problem.score(out).feasible


def test_sequencing_may_overfill_a_copy_groups_buffer_which_polish_never_returns():
    # u0..u2 copy as one group, u3 alone; u0, u1 and u3 share a menu (u2 has its own). The start streams u3 alone;
    # dealt in order, u1 takes the streamed option (a copy, nothing hides it yet), so the group u0..u2 streams
    # and its buffer sits beside u0 and u2's resident bytes: one byte over the GPU. polish() checks every
    # trial, so it never returns that order.
    resident = PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=1, decode_ns=0,
                               stored_bytes=1, resident_bytes=2, peak_bytes=1)
    streamed = PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=0, decode_ns=0,
                               stored_bytes=1, resident_bytes=0, peak_bytes=4, copy_prefill_ns=1, group_copy_bytes=2)
    on_cpu = PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=0, decode_ns=0,
                             stored_bytes=1, resident_bytes=0, peak_bytes=0)
    menu = (resident, streamed, on_cpu)
    free = {("cpu", "cuda:0"): 0, ("cuda:0", "cpu"): 0}
    problem = PlacementProblem(
        units=(UnitSpec(name="u0", options=menu), UnitSpec(name="u1", options=menu),
               UnitSpec(name="u2", options=(resident, streamed, on_cpu)), UnitSpec(name="u3", options=menu)),
        edges=tuple(EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns=free, decode_ns=free) for i in range(3)),
        devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=13),
                 DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10)),
        copy_groups=(("u0", "u1", "u2"), ("u3",)))
    start = [0, 0, 0, 1]
    assert problem.satisfies(start)
    out = sequenced(problem, start, "prefill_ns")
    assert out == [0, 1, 0, 0] and not problem.score(out).feasible
    assert problem.satisfies(polish(problem, start, time.perf_counter() + 1))


def test_no_price_or_time_left_returns_the_start():
    problem = _spread_problem(6)
    start = [1, 1, 1, 0, 0, 0]
    assert polish(problem, start, _LATER, most=0) == start
    assert polish(problem, start, time.perf_counter() - 1) == start


def test_a_polish_prices_at_most_its_budget(monkeypatch):
    problem = _spread_problem(8)
    priced = []
    real = PlacementProblem.objective_value
    monkeypatch.setattr(PlacementProblem, "objective_value", lambda self, c, o: priced.append(1) or real(self, c, o))
    polish(problem, [1, 1, 1, 1, 0, 0, 0, 0], _LATER, most=5)
    assert len(priced) <= 5 + 1  # the start, then at most five steps


def test_only_latency_with_copies_and_free_order_is_polished():
    problem = _spread_problem(4)
    assert search._orders_matter(problem, "latency")
    assert not search._orders_matter(problem, "throughput")
    assert not search._orders_matter(problem, "memory")
    no_copies = _spread_problem(4)
    menu = tuple(o for o in no_copies.units[0].options if not o.copy_decode_ns)
    no_copies = PlacementProblem(units=tuple(UnitSpec(name=u.name, options=menu) for u in no_copies.units),
                                 edges=no_copies.edges, devices=no_copies.devices)
    assert not search._orders_matter(no_copies, "latency")
    contiguous = PlacementProblem(units=problem.units, edges=problem.edges, devices=problem.devices, contiguous=True)
    assert not search._orders_matter(contiguous, "latency")


def test_the_search_polishes_its_start_where_orders_matter(monkeypatch):
    seen = []
    real = polish_module.polish
    monkeypatch.setattr(search, "polish", lambda p, c, d: seen.append(list(c)) or real(p, c, d))
    # the relaxation's read without its arranged orders, which reach this problem's optimum: a start left unproven
    monkeypatch.setattr(aggregate, "arranged", lambda problem, choice, phase: list(choice))
    problem = _spread_problem(6)
    sol = search.solve_problem(problem, "latency", time_limit_s=2, hint=[1, 1, 1, 0, 0, 0], workers=1)
    assert len(seen) == 1 and problem.satisfies(seen[0])  # the start the relaxation's read gave, polished once
    assert sol.objective_value <= _latency(problem, polish(problem, seen[0], _LATER))


def _run_behind_a_cpu_head(n: int) -> PlacementProblem:
    """``n`` like layers (:func:`_stream_or_compute`) and, after them, a unit alone in its menu that the CPU
    computes for 30 ns a step (an lm_head kept in RAM)."""
    layer = _stream_or_compute()
    head = (PlacementOption(storage="cpu", execution="cpu", mode="resident", stored_bytes=1, resident_bytes=0,
                            peak_bytes=0, prefill_ns=30, decode_ns=30),)
    names = [f"u{i}" for i in range(n)] + ["head"]
    free = {("cpu", "cuda:0"): 0, ("cuda:0", "cpu"): 0}
    return PlacementProblem(
        units=(*(UnitSpec(name=f"u{i}", options=layer) for i in range(n)), UnitSpec(name="head", options=head)),
        edges=tuple(EdgeSpec(src=a, dst=b, prefill_ns=free, decode_ns=free) for a, b in itertools.pairwise(names)),
        devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=100),
                 DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100)))


def test_arranging_a_run_counts_the_compute_around_it():
    # four streamed layers and three CPU ones: three CPU windows hide three copies, and only the head's 30 ns,
    # the step before's tail, can hide the fourth: the run must begin with a streamed layer. Dealt without
    # what lies outside the run (aggregate's spreading of an interior), one window is left with its copy
    # in view; dealt with it, every order of these counts that hides each copy is reached
    problem = _run_behind_a_cpu_head(7)
    start = [1, 1, 1, 1, 0, 0, 0, 0]
    out = arranged(problem, start, "decode_ns")
    decode = {p: problem.score([*p, 0]).decode_ns for p in set(itertools.permutations(start[:7]))}
    assert problem.score(out).decode_ns == min(decode.values()) < problem.score(start).decode_ns
    assert out == [1, 0, 1, 0, 1, 0, 1, 0]
    assert not any(problem.waits(problem.options(out), "decode_ns"))
    inside = balanced(start[:7], problem.units[0].options, "decode_ns")
    assert any(problem.waits(problem.options([*inside, 0]), "decode_ns"))


def test_a_relaxations_counts_read_in_an_order_that_counts_the_head():
    """The aggregated relaxation, solved to its optimum, reads back into a plan at the brute-force optimum: its
    counts stream four layers, and only the order :func:`arranged` deals hides all four copies."""
    problem = _run_behind_a_cpu_head(7)
    runs = aggregate.identical_runs(problem, 2)
    assert runs == [(1, 5)]
    model = aggregate.AggregateModel(problem, 1, [0] * 8, runs, None)
    model.minimize("latency", None, 0)
    solver, _ = model.solve(5, 0, 1, 0.0)
    read = model.read(solver)
    assert problem.objective_value(read, "latency") == reference_optimum(problem, "latency")


@settings(max_examples=150)
@given(problems(), st.sampled_from(["prefill_ns", "decode_ns"]), st.data())
def test_arranging_moves_options_only_within_runs_of_free_like_units(problem, phase, data):
    start = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    out = arranged(problem, start, phase)
    special = {n for g in problem.tied_groups for n in g} | set(problem.pins)
    runs = polish_module._like_runs(problem)
    inside = {i for lo, hi in runs for i in range(lo, hi + 1)}
    assert all(a == b for i, (a, b) in enumerate(zip(start, out, strict=True)) if i not in inside)
    assert not any(problem.units[i].name in special for i in inside)
    for lo, hi in runs:
        assert all(problem.units[i].options is problem.units[lo].options for i in range(lo, hi + 1))
        assert sorted(start[lo:hi + 1]) == sorted(out[lo:hi + 1])
    if problem.satisfies(start) and not problem.contiguous and problem.copy_runs is None:
        assert problem.score(out).feasible  # like units hold the same bytes: the order cannot overfill


def test_arranging_leaves_the_run_a_tail_for_a_streamed_unit_after_it():
    # two streamed layers and four CPU ones before a streamed head whose 20 ns copy only what follows the run's
    # last streamed layer can hide: two CPU layers there, one before each streamed layer, and no copy waits
    layer = _stream_or_compute()
    head = (PlacementOption(storage="cpu", execution="cuda:0", mode="stream", stored_bytes=1, resident_bytes=1,
                            peak_bytes=0, prefill_ns=1, decode_ns=1, copy_prefill_ns=20, copy_decode_ns=20),)
    names = [f"u{i}" for i in range(6)] + ["head"]
    free = {("cpu", "cuda:0"): 0, ("cuda:0", "cpu"): 0}
    problem = PlacementProblem(
        units=(*(UnitSpec(name=f"u{i}", options=layer) for i in range(6)), UnitSpec(name="head", options=head)),
        edges=tuple(EdgeSpec(src=a, dst=b, prefill_ns=free, decode_ns=free) for a, b in itertools.pairwise(names)),
        devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=100),
                 DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100)))
    start = [1, 1, 0, 0, 0, 0, 0]
    out = arranged(problem, start, "decode_ns")
    decode = {p: problem.score([*p, 0]).decode_ns for p in set(itertools.permutations(start[:6]))}
    assert problem.score(out).decode_ns == min(decode.values())
    assert out == [0, 1, 0, 1, 0, 0, 0]
    assert not any(problem.waits(problem.options(out), "decode_ns"))
