"""The grouped relaxation's bound (:mod:`placement_opt.solver.relax`): like units grouped apart where their times
part (``TIME_STEP``), and the transfers counts alone prove on each path (``GroupModel._crossings``), each checked
against brute force."""

from __future__ import annotations

import pytest
from _brute import reference_optimum, reported_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from placement_opt.solver import paths, relax
from placement_opt.solver.problem import (
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
)

GPUS = ("cuda:0", "cuda:1")


def _layers(times: dict[str, dict[str, int]], layers: int,
            transfer: dict[tuple[str, str], int] | list[dict[tuple[str, str], int]],
            capacity: dict[str, int]) -> PlacementProblem:
    """``layers`` layers of two modules ``a`` then ``m`` in one chain, each module resident on any device of
    ``times[role]`` (its decode time there; ``a`` stores one byte, ``m`` two: two groups of like units), every
    edge priced ``transfer`` between devices (or each edge its own, a list)."""
    def unit(name: str, role: str) -> UnitSpec:
        return UnitSpec(name=name, options=tuple(
            PlacementOption(storage=d, execution=d, mode="resident", prefill_ns=0, decode_ns=t,
                            stored_bytes=1 if role == "a" else 2,
                            resident_bytes=0, peak_bytes=0) for d, t in times[role].items()))
    names = [f"{role}{i}" for i in range(layers) for role in "am"]
    units = tuple(unit(n, n[0]) for n in names)
    prices = transfer if isinstance(transfer, list) else [transfer] * (len(names) - 1)
    edges = tuple(EdgeSpec(src=a, dst=b, prefill_ns={}, decode_ns=price)
                  for a, b, price in zip(names[:-1], names[1:], prices, strict=True))
    devices = tuple(DeviceSpec(name=d, kind="cpu" if d == "cpu" else "gpu", capacity_bytes=capacity[d])
                    for d in capacity)
    return PlacementProblem(units=units, edges=edges, devices=devices)


def _bound(problem: PlacementProblem, hint: list[int], crossings: bool = True) -> int:
    """The grouped relaxation's proven bound on the whole chain, with or without its transfer rows."""
    with pytest.MonkeyPatch.context() as mp:
        if not crossings:
            mp.setattr(relax.GroupModel, "_crossings", lambda self, path, ph: [])
        path = paths.critical_path(problem, hint)  # the whole chain
        model = relax.GroupModel(problem, 1, hint, relax.groups_of(problem, path), path, None)
        model.minimize("latency", None, 0)
        solver, status = model.solve(5, 0, 1, 0.0)
    assert status == cp_model.OPTIMAL
    return reported_bound(model, solver)


def test_modules_split_over_two_gpus_pay_for_the_edges_between_them():
    # a is faster on cuda:1, m on cuda:0: alternating them saves 1 per layer (54 against 57) but sends 5 edges
    # across, 5 each. Counted without transfers the relaxation takes the split (54); with them it proves 57,
    # everything on one GPU, as brute force finds.
    problem = _layers({"a": {"cuda:0": 10, "cuda:1": 9}, "m": {"cuda:0": 9, "cuda:1": 10}}, 3,
                      {("cuda:0", "cuda:1"): 5, ("cuda:1", "cuda:0"): 5}, {"cuda:0": 9, "cuda:1": 9})
    assert reference_optimum(problem, "latency") == 57
    hint = [0] * len(problem.units)
    assert _bound(problem, hint, crossings=False) == 54
    assert _bound(problem, hint) == 57


def test_a_free_pair_of_devices_proves_no_transfer():
    # the same layers with one pair of devices priced 0: an edge may cross for free, so no crossing is charged
    problem = _layers({"a": {"cuda:0": 10, "cuda:1": 9}, "m": {"cuda:0": 9, "cuda:1": 10}}, 3,
                      {("cuda:0", "cuda:1"): 5, ("cuda:1", "cuda:0"): 0}, {"cuda:0": 9, "cuda:1": 9})
    assert _bound(problem, [0] * len(problem.units)) == 54


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(2, 4), data=st.data())
def test_crossings_never_bound_above_brute_force(layers, data):
    """Layers of two modules on two GPUs and the CPU, at random times, transfer prices (per edge) and capacities (some
    modules without every device, so groups differ in size at times): the bound stays at or below the
    optimum, and the relaxation proves no plan only where there is none."""
    devices = (*GPUS, "cpu")
    times = {role: {d: data.draw(st.integers(0, 20)) for d in devices
                    if d == "cpu" or data.draw(st.integers(0, 4))} for role in "am"}
    transfer = [{(p, q): data.draw(st.integers(0, 9)) for p in devices for q in devices if p != q}
                for _ in range(2 * layers - 1)]
    capacity = {d: data.draw(st.integers(0, 3 * layers)) for d in devices}
    problem = _layers(times, layers, transfer, capacity)
    best = reference_optimum(problem, "latency")
    hint = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    path = paths.critical_path(problem, hint)
    if len(path) > 1 and data.draw(st.booleans()):  # a path through part of the chain only: groups partly matched
        path = path[data.draw(st.integers(0, len(path) - 2)):]
    model = relax.GroupModel(problem, 1, hint, relax.groups_of(problem, path), path, None)
    model.minimize("latency", None, 0)
    solver, status = model.solve(5, 0, 1, 0.0)
    if best is None:
        return  # a relaxation may find room where the problem has none
    assert status == cp_model.OPTIMAL
    assert reported_bound(model, solver) <= best


def test_crossings_are_left_out_above_their_size(monkeypatch):
    problem = _layers({"a": {"cuda:0": 10, "cuda:1": 9}, "m": {"cuda:0": 9, "cuda:1": 10}}, 3,
                      {("cuda:0", "cuda:1"): 5, ("cuda:1", "cuda:0"): 5}, {"cuda:0": 9, "cuda:1": 9})
    monkeypatch.setattr(relax, "CROSSINGS_UP_TO", len(problem.units) - 1)
    assert _bound(problem, [0] * len(problem.units)) == 54


def _norms(decode_ns: list[int]) -> PlacementProblem:
    """A chain of like units (same bytes and devices) on a GPU, with the decode times given."""
    units = tuple(UnitSpec(name=f"n{i}", options=(PlacementOption(
        storage="cuda:0", execution="cuda:0", mode="resident", prefill_ns=0, decode_ns=t, stored_bytes=1,
        resident_bytes=0, peak_bytes=0),)) for i, t in enumerate(decode_ns))
    edges = tuple(EdgeSpec(src=f"n{i}", dst=f"n{i + 1}", prefill_ns={}, decode_ns={}) for i in range(len(units) - 1))
    return PlacementProblem(units=units, edges=edges, devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=99),))


def test_a_unit_whose_time_parts_from_its_likes_is_grouped_apart_and_priced_as_it_is(monkeypatch):
    # module-level Mistral-7B's first post-attention norm: 9.2 ms of decode against 0.77-0.89 ms for the others.
    # One group priced all four at the least time (4 x 77); apart, the bound is the chain's real time.
    problem = _norms([920, 77, 89, 89])
    assert relax.groups_of(problem) == [[0], [1], [2, 3]]
    assert _bound(problem, [0] * 4) == 920 + 77 + 89 + 89
    monkeypatch.setattr(relax, "TIME_STEP", 1e9)  # one bucket: times ignored, as before TIME_STEP
    assert relax.groups_of(problem) == [[0, 1, 2, 3]]
    assert _bound(problem, [0] * 4) == 4 * 77


@given(st.lists(st.integers(1, 10**6), min_size=2, max_size=12))
def test_like_units_share_a_group_only_within_the_time_step(times):
    for group in relax.groups_of(_norms(times)):
        spread = [times[u] for u in group]
        assert max(spread) <= min(spread) * relax.TIME_STEP  # one bucket: [step^k, step^(k+1))


def test_units_that_copy_different_bytes_for_their_copy_group_are_grouped_apart():
    """The group took its first unit's copy-group bytes for every unit: a first unit that copies 10 bytes for its
    run made every other count them too, and the relaxation proved 440 where the optimum is 261 (or the problem
    infeasible, with the CPU one unit wide)."""
    def menu(group_copy: int, peak: int) -> tuple[PlacementOption, ...]:
        return (PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=10, decode_ns=10,
                                stored_bytes=5, resident_bytes=0, peak_bytes=peak, group_copy_bytes=group_copy,
                                copy_prefill_ns=1, copy_decode_ns=1),
                PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=100, decode_ns=100,
                                stored_bytes=5, resident_bytes=0, peak_bytes=0))
    units = tuple(UnitSpec(name=f"u{i}", options=menu(10, 21) if i == 0 else menu(0, 20)) for i in range(4))
    edges = tuple(EdgeSpec(src=f"u{i}", dst=f"u{i + 1}", prefill_ns={}, decode_ns={}) for i in range(3))
    problem = PlacementProblem(units=units, edges=edges, copy_groups=(("u0", "u1"), ("u2", "u3")),
                               devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=20),
                                        DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100)))
    assert relax.groups_of(problem) == [[0], [1, 2, 3]]
    optimum = reference_optimum(problem, "latency")
    assert optimum == 261
    assert _bound(problem, [1, 0, 0, 0]) <= optimum
