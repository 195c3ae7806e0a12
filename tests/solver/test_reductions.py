"""Coarsening and residency on ties: every coarse assignment costs what it expands to (the exact
reductions, covered edges and interchangeable devices, are checked in test_bound.py)."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
from _brute import reference_valid, reference_value
from _problems import problems
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from placement_opt.errors import SolverInputError
from placement_opt.solver import search
from placement_opt.solver.problem import (
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
)
from placement_opt.solver.reductions import (
    block_groups,
    coarsen,
    coarsen_groups,
    copies_apart,
    copies_first,
    make_room,
    part_groups,
    prefer_resident,
)

DEVICES = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=40), DeviceSpec(name="cpu", kind="cpu", capacity_bytes=1000))
XFER = {("cuda:0", "cpu"): 7, ("cpu", "cuda:0"): 7}


def _unit(name: str, size: int) -> UnitSpec:
    # GPU resident, CPU resident (10x slower), CPU -> GPU stream (copy of `size` ns, peak = size)
    return UnitSpec(name=name, options=(
        PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=size, decode_ns=10 * size,
                        stored_bytes=size, resident_bytes=1, peak_bytes=0),
        PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=10 * size, decode_ns=100 * size,
                        stored_bytes=size, resident_bytes=1, peak_bytes=0),
        PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=2 * size, decode_ns=20 * size,
                        stored_bytes=size, resident_bytes=1, peak_bytes=size)))


def _chain(sizes: list[int]) -> PlacementProblem:
    units = tuple(_unit(f"u{i}", s) for i, s in enumerate(sizes))
    edges = tuple(EdgeSpec(src=a.name, dst=b.name, prefill_ns=XFER, decode_ns=XFER) for a, b in itertools.pairwise(units))
    return PlacementProblem(units=units, edges=edges, devices=DEVICES)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3]), min_size=2, max_size=24), st.data())
def test_coarse_assignments_cost_what_they_expand_to(sizes, data):
    problem = _chain(sizes)
    hint = data.draw(st.lists(st.integers(0, 2), min_size=len(sizes), max_size=len(sizes)))
    target = data.draw(st.integers(1, len(sizes)))
    groups = coarsen_groups(problem, hint, target)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    assert all(len({hint[i] for i in g}) == 1 for g in groups)  # the hint stays representable
    coarse = coarsen(problem, groups)
    choice = data.draw(st.lists(st.integers(0, 2), min_size=len(groups), max_size=len(groups)))
    expanded = [c for g, c in zip(groups, choice, strict=True) for _ in g]
    fine, small = problem.score(expanded), coarse.score(choice)
    assert (small.prefill_ns, small.decode_ns, small.used_bytes) == (fine.prefill_ns, fine.decode_ns, fine.used_bytes)


@st.composite
def _layered(draw):
    """A sublayer graph's shape: units chained by free links (the residual stream stays home, round trips are in
    the options), cut into copy groups (the layers), one of them of 2+ units."""
    problem = draw(problems(copying=True))
    n = len(problem.units)
    assume(n >= 2)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 2)))
    bounds = [0, *cuts, n]
    groups = tuple(tuple(u.name for u in problem.units[a:b]) for a, b in itertools.pairwise(bounds))
    chain = tuple(EdgeSpec(src=a.name, dst=b.name, prefill_ns={}, decode_ns={})
                  for a, b in itertools.pairwise(problem.units))
    return dataclasses.replace(problem, edges=chain, copy_groups=groups, tied_groups=(), pins={})


@settings(max_examples=150, deadline=None)
@given(_layered(), st.data())
def test_a_layer_granular_assignment_costs_what_it_expands_to(problem, data):
    # block_groups: every unit once, in order; a multi-unit group is one whole copy group (a layer's parts)
    groups = block_groups(problem)
    assert groups is not None
    assert [i for g in groups for i in g] == list(range(len(problem.units)))
    layers = {tuple(g) for g in problem.copy_groups}
    names = [tuple(problem.units[i].name for i in g) for g in groups if len(g) > 1]
    assert names and all(g in layers for g in names)
    coarse = coarsen(problem, groups)
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in coarse.units]
    expanded = [c for g, c in zip(groups, choice, strict=True) for _ in g]
    fine, small = problem.score(expanded), coarse.score(choice)
    assert (small.prefill_ns, small.decode_ns) == (fine.prefill_ns, fine.decode_ns)
    assert small.used_bytes == fine.used_bytes


def test_a_copy_group_whose_parts_offer_different_options_stays_apart():
    menu = _unit("x", 1).options
    units = (UnitSpec(name="a0", options=menu), UnitSpec(name="m0", options=menu),
             UnitSpec(name="a1", options=menu), UnitSpec(name="m1", options=menu[:2]))
    problem = PlacementProblem(units=units, edges=(), devices=DEVICES, copy_groups=(("a0", "m0"), ("a1", "m1")))
    assert block_groups(problem) == [[0, 1], [2], [3]]
    assert block_groups(dataclasses.replace(problem, pins={"m0": "cpu"})) is None
    assert block_groups(dataclasses.replace(problem, copy_groups=())) is None


@settings(max_examples=40, deadline=None)
@given(_layered())
def test_a_solve_is_never_worse_than_the_best_plan_moving_each_layers_parts_together(problem):
    check_never_worse_than_merged(problem, block_groups(problem))


def check_never_worse_than_merged(problem: PlacementProblem, groups: list[list[int]]) -> None:
    """The search's plan is at least as good as the best plan with each of ``groups`` on one option (brute force
    over the merged problem), which the search solves for a start."""
    coarse = coarsen(problem, groups)
    merged = [[c for g, c in zip(groups, pick, strict=True) for _ in g]
              for pick in itertools.product(*(range(len(u.options)) for u in coarse.units))]
    values = [reference_value(problem, c, "latency") for c in merged if reference_valid(problem, c)]
    assume(values)
    sol = search.solve_problem(problem, "latency", time_limit_s=2.0, workers=1)
    assert sol.feasible and sol.objective_value <= min(values)


@st.composite
def _with_parts(draw):
    """A layered problem whose units also come in part groups (a layer's expert groups): runs inside the layers."""
    problem = draw(_layered())
    parts = []
    for layer in problem.copy_groups:
        if len(layer) >= 2 and draw(st.booleans()):
            start = draw(st.integers(0, len(layer) - 2))
            end = draw(st.integers(start + 2, len(layer)))
            parts.append(tuple(layer[start:end]))
    assume(parts)
    return dataclasses.replace(problem, part_groups=tuple(parts))


@settings(max_examples=100, deadline=None)
@given(_with_parts(), st.data())
def test_merged_part_groups_cost_what_they_expand_to(problem, data):
    groups = part_groups(problem)
    assert [i for g in groups for i in g] == list(range(len(problem.units)))
    merged = {tuple(problem.units[i].name for i in g) for g in groups if len(g) > 1}
    assert merged == set(problem.part_groups)  # one menu throughout: every run merges, nothing else does
    coarse = coarsen(problem, groups)
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in coarse.units]
    expanded = [c for g, c in zip(groups, choice, strict=True) for _ in g]
    fine, small = problem.score(expanded), coarse.score(choice)
    assert (small.prefill_ns, small.decode_ns, small.used_bytes) == (fine.prefill_ns, fine.decode_ns, fine.used_bytes)


@settings(max_examples=30, deadline=None)
@given(_with_parts())
def test_a_solve_is_never_worse_than_the_best_plan_keeping_each_part_group_together(problem):
    check_never_worse_than_merged(problem, part_groups(problem))


def test_part_groups_stay_apart_when_pinned_tied_or_of_other_menus():
    menu = _unit("x", 1).options
    units = (UnitSpec(name="g0", options=menu), UnitSpec(name="g1", options=menu), UnitSpec(name="h0", options=menu),
             UnitSpec(name="h1", options=menu[:2]))
    problem = PlacementProblem(units=units, edges=(), devices=DEVICES, part_groups=(("g0", "g1"), ("h0", "h1")))
    assert part_groups(problem) == [[0, 1], [2], [3]]
    assert part_groups(dataclasses.replace(problem, pins={"g1": "cpu"})) is None
    assert part_groups(dataclasses.replace(problem, part_groups=())) is None
    with pytest.raises(SolverInputError, match="part group"):
        dataclasses.replace(problem, part_groups=(("g0", "h0"),))  # not consecutive


def test_a_sublayer_solve_starts_from_its_layer_granular_plan_when_that_beats_the_start():
    # Two layers of two parts; the GPU holds one layer. The hint computes all on the CPU (valid, slow):
    # the layer-granular start puts one layer's parts on the GPU, and the note says so.
    menu = _unit("x", 4).options
    units = tuple(UnitSpec(name=f"{p}{i}", options=menu) for i in range(2) for p in ("a", "m"))
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=9), DEVICES[1])
    problem = PlacementProblem(units=units, edges=(), devices=devices, copy_groups=(("a0", "m0"), ("a1", "m1")))
    sol = search.solve_problem(problem, "latency", time_limit_s=1.0, workers=1, hint=[1, 1, 1, 1])
    assert sol.objective_value < problem.objective_value([1, 1, 1, 1], "latency")
    assert any("each layer's parts together" in note for note in sol.notes)
    assert all(note.startswith(search.SEARCH_NOTES) for note in sol.notes)  # what plan --verbose alone prints


def test_streamed_units_become_resident_only_while_they_fit():
    # GPU of 40 bytes; four 9-byte units streamed (9 x 4 = 36 stored on cpu, 4 resident + peak 9
    # on the GPU). Residency is no slower here only if its prices are not above streaming's:
    # _unit prices residency at half of streaming, so each move helps, and moves stop at capacity.
    problem = _chain([9, 9, 9, 9])
    moved = prefer_resident(problem, [2, 2, 2, 2])
    score = problem.score(moved)
    assert score.feasible and moved.count(0) == 3 and moved.count(2) == 1
    assert score.latency_ns <= problem.score([2, 2, 2, 2]).latency_ns


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.integers(1, 5), st.integers(0, 3), st.integers(0, 3))
def test_make_room_repairs_a_plan_over_on_two_gpus_at_once(n0, n1, over0, over1):
    """Units of 10 bytes resident on two GPUs, each GPU a few bytes short: moving units to the CPU fixes
    both. A move off the first GPU adds nothing to the second, so the second's overflow must not forbid it."""
    gpus = {"cuda:0": n0, "cuda:1": n1}
    devices = tuple(DeviceSpec(name=g, kind="gpu", capacity_bytes=10 * n - over) for (g, n), over
                    in zip(gpus.items(), (over0, over1), strict=True)) + (DeviceSpec(name="cpu", kind="cpu",
                                                                                      capacity_bytes=1000),)

    def unit(name: str) -> UnitSpec:
        return UnitSpec(name=name, options=tuple(
            PlacementOption(storage=d, execution=d, mode="resident", prefill_ns=1 if d != "cpu" else 10,
                            decode_ns=1 if d != "cpu" else 10, stored_bytes=10, resident_bytes=0, peak_bytes=0)
            for d in ("cuda:0", "cuda:1", "cpu")))

    units = tuple(unit(f"u{i}") for i in range(n0 + n1))
    problem = PlacementProblem(units=units, edges=(), devices=devices)
    choice = [0] * n0 + [1] * n1
    out = make_room(problem, choice)
    assert problem.satisfies(out)
    # each GPU over by 1-3 bytes gives up exactly one 10-byte unit, to the CPU (no room on the other GPU)
    moved = [i for i, (a, b) in enumerate(zip(choice, out, strict=True)) if a != b]
    assert len(moved) == (over0 > 0) + (over1 > 0) and all(out[i] == 2 for i in moved)


def test_make_room_does_not_move_a_unit_onto_a_transient_the_other_gpu_has_no_room_for():
    """Off an overfull cuda:0, the faster move is a phased-like option whose prompt buffer lands on a full
    cuda:1; the slower plain CPU option adds nothing there and is the one that fits."""
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=19), DeviceSpec(name="cuda:1", kind="gpu",
                                                                                      capacity_bytes=10),
               DeviceSpec(name="cpu", kind="cpu", capacity_bytes=1000))

    def unit(name: str, home: str) -> UnitSpec:
        return UnitSpec(name=name, options=(
            PlacementOption(storage=home, execution=home, mode="resident", prefill_ns=1, decode_ns=1,
                            stored_bytes=10, resident_bytes=0, peak_bytes=0),
            PlacementOption(storage="cpu", execution="cpu", mode="phased", prefill_execution="cuda:1", prefill_ns=1,
                            decode_ns=2, stored_bytes=10, resident_bytes=0, peak_bytes=0, prefill_peak_bytes=5),
            PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=10, decode_ns=10,
                            stored_bytes=10, resident_bytes=0, peak_bytes=0)))

    problem = PlacementProblem(units=(unit("a", "cuda:0"), unit("b", "cuda:0"), unit("c", "cuda:1")), edges=(),
                               devices=devices)
    out = make_room(problem, [0, 0, 0])
    assert problem.satisfies(out) and sorted(out) == [0, 0, 2]


def test_make_room_streams_a_resident_unit_under_a_buffer_the_gpu_already_holds():
    """cuda:0 holds two 10-byte resident units and a 50-byte stream buffer (of ``big``), 3 bytes over; the
    CPU has no room. Streaming one resident unit from the disk puts a 10-byte transient on cuda:0, larger
    than its own (0) but under the 50 bytes already held: the peak stays, and 10 bytes leave."""
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=67), DeviceSpec(name="cpu", kind="cpu",
                                                                                      capacity_bytes=5),
               DeviceSpec(name="disk", kind="disk", capacity_bytes=1000))

    def unit(name: str, size: int) -> UnitSpec:
        return UnitSpec(name=name, options=(
            PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=1, decode_ns=1,
                            stored_bytes=size, resident_bytes=0, peak_bytes=0),
            PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=10, decode_ns=10,
                            stored_bytes=size, resident_bytes=0, peak_bytes=0),
            PlacementOption(storage="disk", execution="cuda:0", mode="stream", prefill_ns=5, decode_ns=5,
                            stored_bytes=size, resident_bytes=0, peak_bytes=size)))

    problem = PlacementProblem(units=(unit("a", 10), unit("big", 50), unit("b", 10)), edges=(), devices=devices)
    choice = [0, 2, 0]
    assert problem.score(choice).over_bytes == {"cuda:0": 3}
    out = make_room(problem, choice)
    assert problem.satisfies(out)
    assert sorted(out) == [0, 2, 2] and out[1] == 2  # one of a, b streamed; big as it was


def _layer(name: str, workspace: int) -> UnitSpec:
    """A layer of 10 bytes: resident on the GPU with ``workspace`` bytes of transient, or phased (stored on the
    CPU, its prefill streamed to the GPU: a 10-byte copy), or on the CPU (slow)."""
    return UnitSpec(name=name, options=(
        PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=1, decode_ns=1,
                        stored_bytes=10, resident_bytes=0, peak_bytes=workspace),
        PlacementOption(storage="cpu", execution="cpu", mode="phased", prefill_execution="cuda:0", prefill_ns=2,
                        decode_ns=3, stored_bytes=10, resident_bytes=0, peak_bytes=0, prefill_peak_bytes=20,
                        group_copy_bytes=10),
        PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=50, decode_ns=50,
                        stored_bytes=10, resident_bytes=0, peak_bytes=0)))


def test_copies_first_makes_a_relaxations_order_fit_where_moving_a_unit_off_was_slower():
    """Two resident layers of 30 bytes of workspace and two phased ones on a GPU of 52 bytes. Alternating, a
    resident layer runs in the prefill beside the next phased layer's copy: 20 stored + 30 + 10 = 60. Phased
    first, the resident layers run after the prefill's last copy, beside the decode's first (none here):
    20 + 30 = 50. A relaxation's per-option peaks (30, or a phased prefill's 20) cannot tell the two orders
    apart; moving a layer to the CPU would fit too, 50 ns slower."""
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=52), DeviceSpec(name="cpu", kind="cpu",
                                                                                      capacity_bytes=1000))
    problem = PlacementProblem(units=tuple(_layer(f"l{i}", 30) for i in range(4)), edges=(), devices=devices)
    resident_first = [0, 1, 0, 1]
    assert problem.score(resident_first).over_bytes == {"cuda:0": 8}
    assert copies_first(problem, resident_first) == [1, 1, 0, 0]
    out = make_room(problem, resident_first)
    assert out == [1, 1, 0, 0] and problem.satisfies(out)


def test_make_room_puts_a_small_copy_between_a_layer_and_a_large_next_copy():
    """A layer (own peak 5, a 2-byte copy) runs beside the head's 4-byte copy in flight: 5 + 2 + 4 = 11 on a
    10-byte GPU, where no unit stores a byte to move off. Streaming the norm between them (a 1-byte copy)
    puts it in flight beside the layer instead (5 + 2 + 2 = 9), and the head's beside the norm (0 + 1 + 4):
    it fits, and faster than the norm on the CPU. Resident on the GPU, the layer or the head do not fit."""
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=10),
               DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100))

    def unit(name: str, own: int, weights: int) -> UnitSpec:
        return UnitSpec(name=name, options=(
            PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=2, decode_ns=0,
                            stored_bytes=weights, resident_bytes=0, peak_bytes=own + 2 * weights,
                            group_copy_bytes=weights),
            PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=50, decode_ns=0,
                            stored_bytes=weights, resident_bytes=0, peak_bytes=0),
            PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=1, decode_ns=0,
                            stored_bytes=weights, resident_bytes=0, peak_bytes=own)))

    problem = PlacementProblem(units=(unit("layer", 5, 2), unit("norm", 0, 1), unit("head", 1, 4)), edges=(),
                               devices=devices)
    choice = [0, 1, 0]
    assert problem.score(choice).over_bytes == {"cuda:0": 1}
    out = make_room(problem, choice)
    assert out == [0, 0, 0] and problem.satisfies(out)


def test_copies_apart_streams_an_attention_where_its_layers_mlp_does_not():
    """Three layers of an attention (2-byte copy) and an MLP (3 bytes), each layer one copy run. Read in unit
    order, layer 0 streams both: 1 + 5 + 5 beside 7 bytes of resident parts, 4 over a 14-byte GPU. Dealt out
    apart, the streamed attention goes to layer 2, whose MLP is resident: 1 + 3 + 3 + 7 fits, at the same
    latency; moving parts to the CPU would fit 49 ns slower each."""
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=14),
               DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100))

    def part(name: str, weights: int) -> UnitSpec:
        return UnitSpec(name=name, options=(
            PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=1, decode_ns=0,
                            stored_bytes=weights, resident_bytes=0, peak_bytes=1 + 2 * weights,
                            group_copy_bytes=weights),
            PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=50, decode_ns=0,
                            stored_bytes=weights, resident_bytes=0, peak_bytes=0),
            PlacementOption(storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=1, decode_ns=0,
                            stored_bytes=weights, resident_bytes=0, peak_bytes=1)))

    attention, mlp = part("a", 2).options, part("m", 3).options
    units = tuple(UnitSpec(name=f"{kind}{i}", options=menu) for i in range(3)
                  for kind, menu in (("a", attention), ("m", mlp)))
    problem = PlacementProblem(units=units, edges=(), devices=devices,
                               copy_groups=tuple((f"a{i}", f"m{i}") for i in range(3)))
    choice = [0, 0, 2, 0, 2, 2]
    assert problem.score(choice).over_bytes == {"cuda:0": 4}
    apart = copies_apart(problem, choice)
    assert apart == [2, 0, 2, 0, 0, 2] and problem.satisfies(apart)
    assert make_room(problem, choice) == apart
    assert problem.score(apart).latency_ns == problem.score(choice).latency_ns


@settings(max_examples=150, deadline=None)
@given(problems(), st.sampled_from([copies_first, copies_apart]), st.data())
def test_dealing_out_again_keeps_every_units_kind_of_option_per_class_and_the_pins_and_ties(problem, deal, data):
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    out = deal(problem, choice)

    def kinds(c):
        return Counter((tuple(sorted((o.storage, o.execution, o.mode, o.prefill_execution, o.stored_bytes)
                                     for o in u.options)),
                        (u.options[k].storage, u.options[k].execution, u.options[k].mode,
                         u.options[k].prefill_execution)) for u, k in zip(problem.units, c, strict=True))

    def used(c):
        return {(o.storage, o.execution): 0 for o in problem.options(c)}

    assert kinds(out) == kinds(choice)
    assert used(out).keys() == used(choice).keys()
    fixed = set(problem.pins) | {n for g in problem.tied_groups for n in g}
    assert all(a == b for u, a, b in zip(problem.units, choice, out, strict=True) if u.name in fixed)
    assert make_room(problem, choice) == list(choice) or problem.score(make_room(problem, choice)).feasible


def test_make_room_spills_to_a_full_cpu_that_the_disk_then_relieves():
    """cuda:0 is 3 bytes over and its units run only there or on the CPU, which is full; the CPU's own unit can
    live on the disk. No single move fits, so the GPU's unit spills onto the CPU and the CPU's goes to the disk
    next (the two moves a relaxation's plan 80 MB over a 3090 needed on sublayer Mixtral-8x7B)."""
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=17), DeviceSpec(name="cpu", kind="cpu",
                                                                                      capacity_bytes=10),
               DeviceSpec(name="disk", kind="disk", capacity_bytes=1000))

    def resident(d: str, ns: int) -> PlacementOption:
        return PlacementOption(storage=d, execution=d, mode="resident", prefill_ns=ns, decode_ns=ns,
                               stored_bytes=10, resident_bytes=0, peak_bytes=0)

    gpu_unit = UnitSpec(name="g", options=(resident("cuda:0", 1), resident("cpu", 10)))
    cpu_unit = UnitSpec(name="c", options=(resident("cpu", 10), PlacementOption(
        storage="disk", execution="cpu", mode="stream", prefill_ns=20, decode_ns=20, stored_bytes=10,
        resident_bytes=0, peak_bytes=0)))
    other = dataclasses.replace(gpu_unit, name="h")
    problem = PlacementProblem(units=(gpu_unit, other, cpu_unit), edges=(), devices=devices)
    choice = [0, 0, 0]
    assert problem.score(choice).over_bytes == {"cuda:0": 3}
    out = make_room(problem, choice)
    assert problem.satisfies(out) and sorted(out[:2]) == [0, 1] and out[2] == 1
    no_disk = PlacementProblem(units=(gpu_unit, other, dataclasses.replace(cpu_unit, options=cpu_unit.options[:1])),
                               edges=(), devices=devices[:2])
    assert make_room(no_disk, choice) == choice  # nowhere to spill: unchanged, the caller drops it
