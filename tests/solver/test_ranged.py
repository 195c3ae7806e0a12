"""Contiguous problems: storage ranges over the units that store bytes, and the start made from a plan without
contiguity (solver/ranged.py), checked against the brute-force reference of validity."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

from _brute import reference_optimum, reference_valid
from _problems import problems
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from placement_opt.solver import ranged as ranged_module
from placement_opt.solver import search
from placement_opt.solver.problem import (
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
)
from placement_opt.solver.ranged import contiguous_start, ranged, segments


def _key(option):
    return option.storage, option.execution, option.mode, option.prefill_execution


def _option(device, stored, work=10):
    return PlacementOption(storage=device, execution=device, mode="resident", prefill_ns=work, decode_ns=work,
                           stored_bytes=stored, resident_bytes=0, peak_bytes=0)


def _chain(menus, capacities, **fields):
    units = tuple(UnitSpec(name=name, options=menu) for name, menu in menus)
    edges = tuple(EdgeSpec(src=a.name, dst=b.name, prefill_ns={}, decode_ns={}) for a, b in itertools.pairwise(units))
    devices = tuple(DeviceSpec(name=d, kind="cpu" if d == "cpu" else "gpu", capacity_bytes=c)
                    for d, c in capacities.items())
    return PlacementProblem(units=units, edges=edges, devices=devices, contiguous=True, **fields)


def _storage(problem, choice):
    return [u.options[c].storage for u, c in zip(problem.units, choice, strict=True)]


def _layers(n, devices, stored=2):
    menu = tuple(_option(d, stored) for d in devices)
    return [(f"layer{i}", menu) for i in range(n)]


def test_a_unit_that_stores_nothing_does_not_break_a_range():
    # A tied output head stores no bytes of its own (its embedding holds them): on the embedding's device at the
    # end of the model it breaks no range, or a tied model could only be stored whole on one device.
    devices = ("cuda:0", "cuda:1")
    head = ("head", tuple(_option(d, 0) for d in devices))
    problem = _chain([("embed", tuple(_option(d, 1) for d in devices)), *_layers(4, devices), head],
                     {"cuda:0": 10, "cuda:1": 10}, tied_groups=(("embed", "head"),))
    choice = [0, 0, 0, 1, 1, 0]  # embed, two layers on cuda:0, two on cuda:1, the head computed on cuda:0
    assert problem.satisfies(choice) and reference_valid(problem, choice)
    broken = [0, 0, 1, 0, 1, 0]  # a layer on cuda:0 between two on cuda:1 still breaks it
    assert not problem.satisfies(broken) and not reference_valid(problem, broken)


def test_fixed_units_move_next_to_their_range_and_a_layer_makes_room():
    # The free plan keeps the embedding and the head on the CPU and the CPU's layers mid-model. Reordered, the
    # CPU's layers follow the embedding; the head, slow on the CPU, cannot join the full cuda:1 alone, so one
    # cuda:1 layer moves to the CPU to make room for it. (The embedding is slow on a GPU, or it could join
    # cuda:0 with the CPU's layers last and the head on the CPU, at the free plan's price.)
    devices = ("cuda:0", "cuda:1", "cpu")
    embed = tuple(_option(d, 1, 10 if d == "cpu" else 500) for d in devices)
    head = tuple(_option(d, 1, 500 if d == "cpu" else 10) for d in devices)
    problem = _chain([("embed", embed), *_layers(6, devices), ("head", head)], {"cuda:0": 4, "cuda:1": 4, "cpu": 100})
    free = [2, 0, 2, 1, 2, 0, 1, 2]
    assert dataclasses.replace(problem, contiguous=False).satisfies(free) and not problem.satisfies(free)
    start = contiguous_start(problem, free, "latency")
    assert start is not None and reference_valid(problem, start)
    assert _storage(problem, start) == ["cpu"] * 4 + ["cuda:0"] * 2 + ["cuda:1"] * 2


def test_a_device_the_reorder_leaves_over_its_capacity_gets_room_made():
    # A reorder changes streamed layers' copy buffers, which depend on their neighbours: the reordered plan can
    # be over a device the free plan fitted (by 4.6 MB on cuda:0 for Llama-3-70B at batch 16 on an RTX 4090 +
    # 3090). Here the CPU is over by one byte from the start. Moving the head next to the last layer, on cuda:1,
    # does not mend it; room made on the CPU does: one of its layers goes to cuda:0, the device the head left.
    devices = ("cuda:0", "cuda:1", "cpu", "disk")
    ends = tuple(_option(d, 1) for d in devices)
    problem = _chain([("embed", ends), ("rotary", ends), *_layers(5, devices), ("head", ends)],
                     {"cuda:0": 10, "cuda:1": 3, "cpu": 3, "disk": 100})
    over = [0, 0, 2, 2, 3, 3, 1, 0]
    assert not dataclasses.replace(problem, contiguous=False).satisfies(over)
    start = contiguous_start(problem, over, "latency")
    assert start is not None and reference_valid(problem, start)
    assert _storage(problem, start) == ["cuda:0"] * 3 + ["cpu"] + ["disk"] * 2 + ["cuda:1"] * 2


def test_an_end_unit_may_move_to_any_device_from_the_first_plan(monkeypatch):
    # Reordered, the free plan's layers run cuda:1, cuda:0, disk, and the head on cuda:1 breaks cuda:1's range.
    # Its neighbour is the disk, where it is slow. Moved to cuda:0 instead (no neighbour of it), the cuda:0
    # layers reorder to come last, next to it, and so do cuda:1's with the embedding moved to cuda:0: either is
    # valid at the free plan's price.
    devices = ("cuda:0", "cuda:1", "disk")
    embed = tuple(_option(d, 1) for d in devices)
    head = tuple(_option(d, 1, 500 if d == "disk" else 10) for d in devices)
    layers = [(f"layer{i}", tuple(_option(d, 2, 100 if d == "disk" else 10) for d in devices)) for i in range(6)]
    problem = _chain([("embed", embed), *layers, ("head", head)], {"cuda:0": 5, "cuda:1": 6, "disk": 100})
    free = [1, 0, 0, 1, 1, 2, 2, 1]
    start = contiguous_start(problem, free, "latency")
    assert start is not None and reference_valid(problem, start)
    assert problem.objective_value(start, "latency") == problem.objective_value(free, "latency")
    moves = ranged_module._moves
    monkeypatch.setattr(ranged_module, "_moves", lambda *args, **kwargs: moves(*args, **{**kwargs, "wide": False}))
    narrow = contiguous_start(problem, free, "latency")  # the head's only moves: the disk, or none
    assert problem.objective_value(narrow, "latency") > problem.objective_value(start, "latency")


def test_the_search_stops_at_a_valid_plan_as_cheap_as_the_plan_it_was_given(monkeypatch):
    # Nothing contiguous prices much below a free plan the solver proved: a valid plan within CLOSE of the plan
    # given ends the search. Here every valid plan is "close" (CLOSE = 100) or none is (CLOSE = -1).
    devices = ("cuda:0", "cuda:1", "cpu")
    ends = tuple(_option(d, 1) for d in devices)
    problem = _chain([("embed", ends), *_layers(6, devices), ("head", ends)], {"cuda:0": 4, "cuda:1": 4, "cpu": 100})
    free = [2, 0, 2, 1, 2, 0, 1, 2]
    tried = collections.Counter()
    moves = ranged_module._moves

    def counted(*args, **kwargs):
        for moved in moves(*args, **kwargs):
            tried[ranged_module.CLOSE] += 1
            yield moved

    monkeypatch.setattr(ranged_module, "_moves", counted)
    for close in (-1.0, 100.0):
        monkeypatch.setattr(ranged_module, "CLOSE", close)
        start = contiguous_start(problem, free, "latency")
        assert start is not None and reference_valid(problem, start)
    assert 0 < tried[100.0] < tried[-1.0]


@settings(max_examples=200)
@given(problems(run=True), st.data())
def test_ranged_trades_placements_within_segments_only(problem, data):
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    out = ranged(problem, choice)
    inside = {i for a, b in segments(problem) for i in range(a, b)}
    assert [out[i] for i in range(len(out)) if i not in inside] == [choice[i] for i in range(len(out)) if i not in inside]
    for a, b in segments(problem):
        before = collections.Counter(_key(problem.units[i].options[choice[i]]) for i in range(a, b))
        after = collections.Counter(_key(problem.units[i].options[out[i]]) for i in range(a, b))
        assert before == after  # the same placements, reordered
        stored = [device for device, _ in itertools.groupby(problem.units[i].options[out[i]].storage
                                                            for i in range(a, b))]
        assert len(stored) == len(set(stored))  # each device's placements side by side


@settings(max_examples=200)
@given(problems(run=True), st.data())
def test_the_start_is_valid_for_the_contiguous_problem(problem, data):
    contiguous = dataclasses.replace(problem, contiguous=True)
    free = dataclasses.replace(problem, contiguous=False)
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    assume(free.satisfies(choice))
    start = contiguous_start(contiguous, choice, "latency")
    if start is not None:
        assert reference_valid(contiguous, start)


def test_the_start_gives_up_when_its_time_is_up():
    devices = ("cuda:0", "cuda:1", "cpu")
    ends = tuple(_option(d, 1) for d in devices)
    problem = _chain([("embed", ends), *_layers(6, devices), ("head", ends)], {"cuda:0": 4, "cuda:1": 4, "cpu": 100})
    free = [2, 0, 2, 1, 2, 0, 1, 2]  # needs moves (above)
    assert contiguous_start(problem, free, "latency", until=time.perf_counter() - 1) is None


def test_a_contiguous_solve_is_proven_by_the_plan_without_contiguity():
    # Contiguity costs nothing here: the free optimum, reordered, is the contiguous optimum, and the free solve's
    # bound proves it (the contiguous model alone has no relaxation below 150 units).
    devices = ("cuda:0", "cuda:1", "cpu")
    menu = tuple(_option(d, 2, work) for d, work in zip(devices, (10, 12, 200), strict=True))
    ends = tuple(_option(d, 1) for d in devices)
    problem = _chain([("embed", ends), *[(f"layer{i}", menu) for i in range(6)], ("head", ends)],
                     {"cuda:0": 5, "cuda:1": 5, "cpu": 100})
    sol = search.solve_problem(problem, "latency", time_limit_s=5.0, workers=1)
    best = reference_optimum(problem, "latency")
    assert sol.objective_value == best and sol.best_bound <= best
    assert sol.gap <= search.GAP_LIMIT
    assert any(note.endswith("without contiguity") for note in sol.notes)
