"""A device's transient with copy groups: the problem's model (device_transients), an independent restatement
(_brute.reference_bytes), and the two running accounts the baselines keep (the one-pass greedy's, the fill's),
on assignments whose runs copy unequal amounts (the next copying run is not the largest)."""

from __future__ import annotations

import dataclasses

from _brute import reference_bytes, reference_runs
from _problems import copy_groups
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from placement_opt.solver._transients import RunPeaks, RunTransients
from placement_opt.solver.cpsat import PlacementModel
from placement_opt.solver.problem import (
    DeviceSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
    device_transients,
    next_copies,
)
from placement_opt.solver.reductions import prefer_resident

GPUS = ("cuda:0", "cuda:1")


def _menu(draw):
    """Resident on a GPU, streamed to a GPU and phased (prefill on a GPU, decode on the CPU), each with its own
    workspace and group copy, and the CPU."""
    options = []
    for g in GPUS[:draw(st.integers(1, 2))]:
        options.append(PlacementOption(storage=g, execution=g, mode="resident", prefill_ns=1, decode_ns=1,
                                       stored_bytes=1, resident_bytes=0, peak_bytes=draw(st.integers(0, 9))))
        share = draw(st.integers(0, 6))
        options.append(PlacementOption(storage="cpu", execution=g, mode="stream", prefill_ns=1, decode_ns=1,
                                       stored_bytes=1, resident_bytes=0,
                                       peak_bytes=draw(st.integers(0, 9)) + 2 * share, group_copy_bytes=share))
        share = draw(st.integers(0, 6))
        options.append(PlacementOption(storage="cpu", execution="cpu", mode="phased", prefill_execution=g,
                                       prefill_ns=1, decode_ns=1, stored_bytes=1, resident_bytes=0,
                                       peak_bytes=draw(st.integers(0, 9)),
                                       prefill_peak_bytes=draw(st.integers(0, 9)) + 2 * share, group_copy_bytes=share))
    options.append(PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=1, decode_ns=1,
                                   stored_bytes=1, resident_bytes=0, peak_bytes=draw(st.integers(0, 9))))
    return tuple(options)


@st.composite
def assigned(draw):
    """(problem, choice): up to 9 units, each its own menu, copy groups now and then, a random option each."""
    n = draw(st.integers(1, 9))
    units = tuple(UnitSpec(name=f"u{i}", options=_menu(draw)) for i in range(n))
    devices = tuple(DeviceSpec(name=g, kind="gpu", capacity_bytes=1000) for g in GPUS) + \
        (DeviceSpec(name="cpu", kind="cpu", capacity_bytes=1000),)
    problem = PlacementProblem(units=units, edges=(), devices=devices, copy_groups=copy_groups(draw, n))
    return problem, [draw(st.integers(0, len(u.options) - 1)) for u in units]


def _transient(problem, chosen, device):
    """reference_bytes less its stored and resident bytes: the transient alone."""
    fixed = sum(o.stored_bytes for o in chosen if o.storage == device) + \
        sum(o.resident_bytes for o in chosen if o.execution == device)
    return reference_bytes(chosen, device, reference_runs(problem)) - fixed


def _model(problem, chosen):
    return {d: t.total_bytes for d, t in device_transients(chosen, problem.runs).items() if t.total_bytes}


@settings(max_examples=300)
@given(assigned())
def test_device_transients_agree_with_the_restated_definition(case):
    problem, choice = case
    chosen = problem.options(choice)
    if not any(o.group_copy_bytes for o in chosen):
        return  # the reference then takes the largest peak, without runs
    model = _model(problem, chosen)
    assert {d.name: model.get(d.name, 0) for d in problem.devices} == \
        {d.name: _transient(problem, chosen, d.name) for d in problem.devices}


@settings(max_examples=300)
@given(assigned())
def test_the_greedy_account_follows_the_model_unit_by_unit(case):
    """RunTransients, fed the units in order, ends at the model's transient of each device; after each unit it
    holds the model's transient of the units so far (later units taken to copy nothing)."""
    problem, choice = case
    chosen = problem.options(choice)
    account, grown = RunTransients(problem), {}
    for k, o in enumerate(chosen):
        account.enter(k)
        for d, n in account.grows(o).items():
            grown[d] = grown.get(d, 0) + n
        account.add(o)
        so_far = [*chosen[:k + 1], *(_idle(u) for u in problem.units[k + 1:])]
        assert {d: n for d, n in grown.items() if n} == _model(problem, so_far)


@settings(max_examples=300)
@given(assigned())
def test_a_unit_grows_no_device_less_than_zero_but_its_group_copys(case):
    """What greedy_choice's shortcut rests on: as a unit joins its run, the transient of every device but the one
    its group copy lands on grows or stays; and each option's growth, asked after the unit's other options (the
    account keeps them per shape), is what an account asked only that option says."""
    problem, choice = case
    chosen = problem.options(choice)
    account = RunTransients(problem)
    for k, o in enumerate(chosen):
        account.enter(k)
        for other in problem.units[k].options:
            grown = account.grows(other)
            shrinks = other.group_device if other.group_copy_bytes else None
            assert all(n >= 0 for d, n in grown.items() if d != shrinks)
            fresh = RunTransients(problem)
            for j, placed in enumerate(chosen[:k]):
                fresh.enter(j)
                fresh.add(placed)
            fresh.enter(k)
            assert fresh.grows(other) == grown
        account.add(o)


def _idle(unit):
    """An option that puts nothing on any device (what the greedy account assumes of the units not placed)."""
    return PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=0, decode_ns=0,
                           stored_bytes=0, resident_bytes=0, peak_bytes=0)


@settings(max_examples=200)
@given(assigned(), st.data())
def test_the_fill_account_follows_the_model_move_by_move(case, data):
    problem, choice = case
    account = RunPeaks(problem)
    for i, o in enumerate(problem.options(choice)):
        account.apply(i, o, 1)
    for _ in range(6):
        i = data.draw(st.integers(0, len(problem.units) - 1))
        k = data.draw(st.integers(0, len(problem.units[i].options) - 1))
        account.apply(i, problem.units[i].options[choice[i]], -1)
        account.apply(i, problem.units[i].options[k], 1)
        choice[i] = k
        model = _model(problem, problem.options(choice))
        assert {d.name: account.peak(d.name) for d in problem.devices} == \
            {d.name: model.get(d.name, 0) for d in problem.devices}


def test_a_tied_transient_names_the_first_unit_that_reaches_it():
    """The report names the unit whose peak sets the device's (the OOM message's "activation workspace of ..."):
    of equal peaks the first in execution order, with and without copies on the device."""
    def option(mode, peak, copies=0):
        storage = "cpu" if mode == "stream" else "cuda:0"
        return PlacementOption(storage=storage, execution="cuda:0", mode=mode, prefill_ns=1, decode_ns=1,
                               stored_bytes=1, resident_bytes=0, peak_bytes=peak + 2 * copies,
                               group_copy_bytes=copies)
    equal = [option("resident", 5), option("resident", 5), option("resident", 5)]
    assert device_transients(equal, None)["cuda:0"].unit == 0
    streaming = [option("resident", 5), option("stream", 1, copies=2), option("resident", 5)]  # 5 + 2 twice
    assert device_transients(streaming, None)["cuda:0"].unit == 0


def test_next_copies_go_round_the_cycle():
    assert next_copies([]) == []
    assert next_copies([0, 0]) == [0, 0]
    assert next_copies([5]) == [5]  # alone: its own next copy, as a unit alone holds two
    assert next_copies([3, 0, 7, 0]) == [7, 7, 3, 3]


@settings(max_examples=100, deadline=None)
@given(assigned())
def test_the_cp_sat_rows_hold_each_peak_at_the_model_transient(case):
    """With every unit fixed to its option, the least peak the CP-SAT rows allow on each GPU is the model's
    transient there (the rows neither under- nor over-count it)."""
    problem, choice = case
    assume(problem.group_copies)  # else the peak is the level flags' (test_cpsat)
    model = PlacementModel(problem, 1, choice)
    for u, o in enumerate(choice):
        model.model.add(model.x[u, o] == 1)
    model.model.minimize(sum(model.peak[g] for g in GPUS))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    assert solver.solve(model.model) == cp_model.OPTIMAL
    transients = _model(problem, problem.options(choice))
    assert {g: solver.value(model.peak[g]) for g in GPUS} == {g: transients.get(g, 0) for g in GPUS}


@settings(max_examples=300)
@given(assigned())
def test_every_chosen_options_peak_is_held_on_its_device(case):
    """What the relaxations and cuts read one option at a time (peaks(): a streamed option's own copies twice)
    is at most its device's transient: their bounds rest on it. The next run may copy less than a run's own;
    the model then still counts the run's own copies as its next."""
    problem, choice = case
    chosen = problem.options(choice)
    model = _model(problem, chosen)
    for o in chosen:
        for d, nbytes in o.peaks():
            assert nbytes <= model.get(d, 0)


def test_a_unit_kept_streaming_where_its_residency_would_bring_a_bulkier_copy_forward():
    """prefer_resident stores a streamed unit on the GPU where that costs no time and its bytes fit. Here the
    middle unit's copy (1) is what the first unit waits beside; resident, the first unit would wait beside the
    bulky unit's copy (4) instead: 11 bytes on a 10-byte GPU."""
    def option(storage, t, stored=0, share=0, own=0):
        mode = "resident" if storage == "cuda:0" else "stream"
        return PlacementOption(storage=storage, execution="cuda:0", mode=mode, prefill_ns=t, decode_ns=t,
                               stored_bytes=stored, resident_bytes=0, peak_bytes=own + 2 * share,
                               group_copy_bytes=share)
    units = (UnitSpec(name="first", options=(option("cpu", 5, share=1, own=5),)),
             UnitSpec(name="middle", options=(option("cpu", 5, share=1), option("cuda:0", 5, stored=1))),
             UnitSpec(name="bulky", options=(option("cpu", 5, share=4),)))
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=10), DeviceSpec(name="cpu", kind="cpu",
                                                                                    capacity_bytes=100))
    problem = PlacementProblem(units=units, edges=(), devices=devices)
    assert problem.score((0, 0, 0)).used_bytes["cuda:0"] == 4 + 4  # bulky's own copies, twice at the least
    assert problem.score((0, 1, 0)).used_bytes["cuda:0"] == 1 + 5 + 1 + 4
    assert prefer_resident(problem, [0, 0, 0]) == [0, 0, 0]


@settings(max_examples=200)
@given(assigned(), st.data())
def test_prefer_resident_keeps_a_plan_that_fits_fitting(case, data):
    problem, choice = case
    used = problem.score(choice).used_bytes
    slack = data.draw(st.integers(0, 4))
    tight = dataclasses.replace(problem, devices=tuple(dataclasses.replace(d, capacity_bytes=used[d.name] + slack)
                                                       for d in problem.devices))
    assert tight.score(prefer_resident(tight, choice)).feasible
