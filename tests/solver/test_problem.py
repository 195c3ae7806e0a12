"""PlacementProblem.score: the one definition of what an assignment costs, checked by hand."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _overlap import dispatcher_step_time, simulated_waits
from placement_opt.errors import SolverInputError
from placement_opt.solver.problem import (
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
    device_transients,
    stalls,
)


def _opt(storage, execution, pre, dec, stored=0, resident=0, peak=0):
    mode = "resident" if storage == execution else "stream"
    return PlacementOption(storage=storage, execution=execution, mode=mode, prefill_ns=pre, decode_ns=dec,
                           stored_bytes=stored, resident_bytes=resident, peak_bytes=peak)


def _diamond() -> PlacementProblem:
    # a -> b, a -> c, b -> d, c -> d; every unit may run on cuda:0 or cuda:1 (or stream from cpu).
    menu = lambda pre: (_opt("cuda:0", "cuda:0", pre, 2 * pre, stored=10, resident=1, peak=3),  # noqa: E731
                        _opt("cuda:1", "cuda:1", pre, 2 * pre, stored=10, resident=1, peak=4),
                        _opt("cpu", "cuda:0", pre + 5, 2 * pre + 5, stored=10, resident=1, peak=20))
    xfer = {("cuda:0", "cuda:1"): 7, ("cuda:1", "cuda:0"): 7}
    edges = tuple(EdgeSpec(src=s, dst=d, prefill_ns=xfer, decode_ns={}) for s, d in
                  [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    return PlacementProblem(units=tuple(UnitSpec(name=n, options=menu(t)) for n, t in zip("abcd", (1, 50, 30, 1),
                                                                                      strict=True)),
                            edges=edges, devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=40),
                                                  DeviceSpec(name="cuda:1", kind="gpu", capacity_bytes=25),
                                                  DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100)))


def test_one_device_pays_the_load_not_the_critical_path():
    s = _diamond().score([0, 0, 0, 0])
    # critical path 1 + 50 + 1 = 52, but cuda:0 does all 82 ns of prefill work
    assert s.prefill_ns == 82 and s.decode_ns == 164
    assert s.stage_ns == {"cuda:0": 246}
    # memory: 4 x 10 stored + 4 x 1 resident + max peak 3 = 47 > 40
    assert s.used_bytes["cuda:0"] == 47 and s.over_bytes == {"cuda:0": 7} and not s.feasible


def test_two_devices_pay_the_critical_path_with_transfers():
    s = _diamond().score([0, 0, 1, 0])  # c on cuda:1: a->c and c->d cross (7 ns each in the prefill)
    # path a(1) -> b(50) -> d(1) = 52; path a(1) + 7 + c(30) + 7 -> d = 46; loads 52 and 30
    assert s.prefill_ns == 52 and s.decode_ns == max(2 + 100 + 2, 60)  # decode edges are free here
    assert s.used_bytes == {"cuda:0": 33 + 3, "cuda:1": 11 + 4, "cpu": 0} and s.feasible
    assert s.latency_ns == 52 + 104 and s.throughput_ns == 52 + 104


def test_streamed_unit_stores_on_cpu_and_uses_the_gpu():
    s = _diamond().score([2, 0, 0, 0])
    assert s.used_bytes["cpu"] == 10 and s.used_bytes["cuda:0"] == 30 + 4 + 20


def test_malformed_problems_list_every_problem():
    opt = _opt("cpu", "cpu", 1, 1)
    with pytest.raises(ValueError, match="points backwards") as err:
        PlacementProblem(units=(UnitSpec(name="a", options=(opt,)), UnitSpec(name="b", options=(opt,))),
                         edges=(EdgeSpec(src="b", dst="a", prefill_ns={}, decode_ns={}),),
                         devices=(DeviceSpec(name="cpu", kind="cpu", capacity_bytes=1),), pins={"z": "cpu"})
    assert "pin names unknown unit z" in str(err.value)
    with pytest.raises(ValueError, match="3 entries for 4 units"):
        _diamond().score([0, 0, 0])


def test_problems_the_solver_would_misread_are_refused_whole():
    """Each of these was accepted: a negative transfer price proved a bound above the plan (140 against 120), an
    empty tied group raised IndexError, no unit a bare ValueError, and the devices named twice, of an unknown kind
    or below 0 bytes, or a pin to an absent device, solved to a wrong answer or to INFEASIBLE without a reason."""
    opt = _opt("cpu", "cpu", 1, 1)
    units = (UnitSpec(name="a", options=(opt,)), UnitSpec(name="b", options=(opt,)))
    cpu = DeviceSpec(name="cpu", kind="cpu", capacity_bytes=1)
    with pytest.raises(SolverInputError) as err:
        PlacementProblem(units=units, edges=(EdgeSpec(src="a", dst="b", prefill_ns={("cpu", "x"): -5},
                                                      decode_ns={}),),
                         devices=(cpu, cpu, DeviceSpec(name="t", kind="tpu", capacity_bytes=-1)),
                         tied_groups=((),), pins={"a": "cuda:7"})
    for said in ("transfer price below 0 or above 2**60 ([-5])", "a tied group is empty", "device cpu is named 2 times",
                 "device t is of kind 'tpu'", "device t has capacity_bytes -1, below 0",
                 "pin of a names unknown device cuda:7"):
        assert said in str(err.value), said
    with pytest.raises(SolverInputError, match="the problem has no unit"):
        PlacementProblem(units=(), edges=(), devices=(cpu,))


def test_a_price_past_the_solvers_integers_is_refused_when_built():
    """A price of 2**63 ns reached CP-SAT and failed there with an OR-Tools TypeError."""
    with pytest.raises(SolverInputError, match=r"decode_ns is 9223372036854775808, must be between 0 and 2\*\*60"):
        _opt("cpu", "cpu", 1, 2**63)
    opt = _opt("cpu", "cpu", 1, 1)
    with pytest.raises(SolverInputError, match=r"transfer price below 0 or above 2\*\*60 \(\[4611686018427387904\]\)"):
        PlacementProblem(units=(UnitSpec(name="a", options=(opt,)), UnitSpec(name="b", options=(opt,))),
                         edges=(EdgeSpec(src="a", dst="b", prefill_ns={}, decode_ns={("cpu", "x"): 2**62}),),
                         devices=(DeviceSpec(name="cpu", kind="cpu", capacity_bytes=1),))
    assert _opt("cpu", "cpu", 1, 2**60).decode_ns == 2**60  # the largest accepted


def test_a_capacity_or_totals_past_the_solvers_integers_are_refused_when_built():
    """A capacity of 2**63 failed in OR-Tools with a TypeError; three units of 2**60 each passed every check and
    CP-SAT called the model invalid, a status outside the solve's documented ones."""
    big = _opt("gpu", "gpu", 1, 1, stored=2**60)
    units = tuple(UnitSpec(name=f"u{i}", options=(big,)) for i in range(3))
    edges = tuple(EdgeSpec(src=a.name, dst=b.name, prefill_ns={}, decode_ns={}) for a, b in itertools.pairwise(units))
    with pytest.raises(SolverInputError, match=r"capacity_bytes 9223372036854775808, below 0 or above 2\*\*60"):
        PlacementProblem(units=units[:1], edges=(), devices=(DeviceSpec(name="gpu", kind="gpu", capacity_bytes=2**63),))
    with pytest.raises(SolverInputError, match=r"adds up to 3458764513820540928, above 2\*\*60"):
        PlacementProblem(units=units, edges=edges, devices=(DeviceSpec(name="gpu", kind="gpu", capacity_bytes=2**60),))
    # the largest accepted: one such unit, or units whose figures add up to 2**60
    half = _opt("gpu", "gpu", 1, 1, stored=2**59)
    PlacementProblem(units=(UnitSpec(name="a", options=(half,)), UnitSpec(name="b", options=(half,))),
                     edges=(EdgeSpec(src="a", dst="b", prefill_ns={}, decode_ns={}),),
                     devices=(DeviceSpec(name="gpu", kind="gpu", capacity_bytes=2**60),))


@pytest.mark.parametrize("kwargs", [{"time_limit_s": float("nan")}, {"memory_slack": float("inf")},
                                    {"workers": 1.5}, {"workers": True}, {"hint": [0, 0, 0, 0.5]},
                                    {"hint": [0, 0, 0, True]}])
def test_solve_problem_refuses_limits_and_hints_that_are_no_numbers_it_can_use(kwargs):
    from placement_opt.solver.search import solve_problem

    with pytest.raises(SolverInputError):
        solve_problem(_diamond(), "memory", **kwargs)


# -- overlap: the prefetch thread's copies beside the compute (problem.py's Overlap) ----------------
def _chain(*options_per_unit: PlacementOption) -> PlacementProblem:
    names = [f"u{i}" for i in range(len(options_per_unit))]
    return PlacementProblem(
        units=tuple(UnitSpec(name=n, options=(o,)) for n, o in zip(names, options_per_unit, strict=True)),
        edges=tuple(EdgeSpec(src=a, dst=b, prefill_ns={}, decode_ns={}) for a, b in itertools.pairwise(names)),
        devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=100),
                 DeviceSpec(name="cpu", kind="cpu", capacity_bytes=100)))


def _streamed(compute, copy):
    return PlacementOption(storage="cpu", execution="cuda:0", mode="stream", prefill_ns=compute, decode_ns=compute,
                           copy_prefill_ns=copy, copy_decode_ns=copy, stored_bytes=0, resident_bytes=0, peak_bytes=0)


def _on_cpu(compute, host=0):
    return PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=compute, decode_ns=compute,
                           host_prefill_ns=host, host_decode_ns=host, stored_bytes=0, resident_bytes=0, peak_bytes=0)


def test_a_copy_behind_cpu_compute_costs_the_longer_of_the_two_not_their_sum():
    # decode, cyclic: CPU 40, streamed (compute 2, copy 30): the copy runs while the CPU computes
    s = _chain(_on_cpu(40), _streamed(2, 30)).score([0, 0])
    assert s.decode_ns == 42
    # the prefill's first copy starts with the call: the CPU's 40 hide it as well
    assert s.prefill_ns == 42
    # a copy longer than the compute beside it shows what is left: in the decode the copy for the next step
    # starts as the streamed unit does, so the step takes the copy's 60; the prefill's waits 60 - 40
    longer = _chain(_on_cpu(40), _streamed(2, 60)).score([0, 0])
    assert (longer.decode_ns, longer.prefill_ns) == (60, 40 + 20 + 2)


def test_back_to_back_streamed_units_cost_the_longer_of_compute_and_copy_each():
    s = _chain(_streamed(2, 30), _streamed(2, 30), _streamed(2, 30)).score([0, 0, 0])
    assert s.decode_ns == 90  # every copy waits on the one before: 3 x max(2, 30)
    # the prefill's first copy has nothing before it to hide behind: it waits 30, then 28 each
    assert s.prefill_ns == 30 + 2 + 28 + 2 + 28 + 2


def test_interleaving_streamed_units_with_cpu_ones_hides_their_copies():
    blocks = _chain(_on_cpu(30), _on_cpu(30), _streamed(2, 30), _streamed(2, 30))
    spread = _chain(_on_cpu(30), _streamed(2, 30), _on_cpu(30), _streamed(2, 30))
    assert blocks.score([0] * 4).decode_ns == 30 + 30 + 2 + 28 + 2  # the second copy waits behind 2
    assert spread.score([0] * 4).decode_ns == 64  # every copy hidden


def test_the_prefetch_thread_and_host_memory_bound_a_phase():
    # a DAG cannot hide a copy behind parallel branches beyond the thread's own time: lat >= sum of copies
    s = _chain(_streamed(1, 10), _streamed(1, 10)).score([0, 0])
    assert s.decode_ns >= 20
    # host memory serves the CPU's reads and the copies: 50 + 50 of host time, longer than anything else
    shared = _chain(_on_cpu(30, host=50), PlacementOption(
        storage="cpu", execution="cuda:0", mode="stream", prefill_ns=2, decode_ns=2, copy_prefill_ns=30,
        copy_decode_ns=30, host_prefill_ns=50, host_decode_ns=50, stored_bytes=0, resident_bytes=0, peak_bytes=0))
    assert shared.score([0, 0]).decode_ns == 100


@given(durations=st.lists(st.integers(0, 50), min_size=1, max_size=12), data=st.data(), cyclic=st.booleans())
def test_stalls_match_the_prefetch_played_in_time(durations, data, cyclic):
    copies = [data.draw(st.integers(0, 60)) if data.draw(st.booleans()) else 0 for _ in durations]
    assert stalls(durations, copies, cyclic) == simulated_waits(durations, copies, cyclic)


def test_copies_belong_to_stream_and_phased_options_only():
    with pytest.raises(SolverInputError, match="only a stream or phased option"):
        PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=1, decode_ns=1, copy_decode_ns=3,
                        stored_bytes=0, resident_bytes=0, peak_bytes=0)


@st.composite
def _runs(draw, n):
    """``(first, end)`` ranges covering ``n`` units in order, some longer than one unit."""
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    bounds = [0, *cuts, n]
    return list(zip(bounds, bounds[1:], strict=False))


@settings(max_examples=200)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=10), st.data(), st.booleans())
def test_run_stalls_match_the_run_prefetch_played_in_time(durations, data, cyclic):
    copies = data.draw(st.lists(st.integers(0, 60), min_size=len(durations), max_size=len(durations)))
    runs = data.draw(_runs(len(durations)))
    assert stalls(durations, copies, cyclic, runs=runs) == simulated_waits(durations, copies, cyclic, runs=runs)


@settings(max_examples=300)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=10), st.data(), st.booleans())
def test_run_stalls_never_price_a_step_below_the_dispatchers_group_prefetch(durations, data, cyclic):
    """The charge (a run's head waits for its whole run) is never optimistic against the dispatcher, whose
    streamed units each wait for their own copy only."""
    copies = data.draw(st.lists(st.integers(0, 60), min_size=len(durations), max_size=len(durations)))
    runs = data.draw(_runs(len(durations)))
    charged = sum(durations) + sum(stalls(durations, copies, cyclic, runs=runs))
    assert charged >= dispatcher_step_time(durations, copies, cyclic, runs)


def test_a_layers_parts_copied_together_hide_behind_the_layer_before():
    # norm, attention, norm, MLP twice: the MLP's copy (10) behind its attention alone waits 8 a layer;
    # copied with its layer, the layer's copies (13) hide behind the whole layer before (12): 1 a layer
    durations, copies = [5, 1, 1, 5] * 2, [0, 3, 0, 10] * 2
    assert stalls(durations, copies, cyclic=True) == [0, 0, 0, 8] * 2
    assert stalls(durations, copies, cyclic=True, runs=[(0, 4), (4, 8)]) == [1, 0, 0, 0] * 2


def test_copy_groups_must_be_runs_of_known_consecutive_units():
    option = PlacementOption(storage="cpu", execution="cpu", mode="resident", prefill_ns=1, decode_ns=1,
                             stored_bytes=0, resident_bytes=0, peak_bytes=0)
    units = tuple(UnitSpec(name=f"u{i}", options=(option,)) for i in range(4))
    devices = (DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10),)
    with pytest.raises(SolverInputError) as err:
        PlacementProblem(units=units, edges=(), devices=devices,
                         copy_groups=(("u0", "u2"), ("u2", "u3"), ("u9",), ()))
    message = str(err.value)
    assert "['u0', 'u2'] is not a run of consecutive units" in message
    assert "['u2', 'u3'] repeats a unit" in message
    assert "['u9'] is empty or names an unknown unit" in message and "[] is empty" in message
    grouped = PlacementProblem(units=units, edges=(), devices=devices, copy_groups=(("u1", "u2"),))
    assert grouped.copy_runs == ((0, 1), (1, 3), (3, 4))
    assert PlacementProblem(units=units, edges=(), devices=devices, copy_groups=(("u1",),)).copy_runs is None


def _part(storage, peak, share=0):
    mode = "resident" if storage == "cuda:0" else "stream"
    return PlacementOption(storage=storage, execution="cuda:0", mode=mode, prefill_ns=1, decode_ns=1,
                           stored_bytes=10, resident_bytes=0, peak_bytes=peak, group_copy_bytes=share)


def test_a_gpu_holds_a_layers_copies_and_the_next_layers_beside_the_running_units_peak():
    # two layers of two parts each, then a head: workspaces 4, 6, 4, 6, 30; a streamed part copies 10 bytes
    # (peak 4 or 6, + 2 x 10 as a unit alone would hold)
    resident = (_part("cuda:0", 4), _part("cuda:0", 6))
    streamed = (_part("cpu", 4 + 20, share=10), _part("cpu", 6 + 20, share=10))
    units = tuple(UnitSpec(name=f"l{layer}.p{k}", options=(resident[k], streamed[k])) for layer in (0, 1) for k in (0, 1))
    units += (UnitSpec(name="head", options=(_part("cuda:0", 30),)),)
    devices = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=1000), DeviceSpec(name="cpu", kind="cpu",
                                                                                       capacity_bytes=1000))
    problem = PlacementProblem(units=units, edges=(), devices=devices,
                               copy_groups=(("l0.p0", "l0.p1"), ("l1.p0", "l1.p1")))
    on_gpu = {c: problem.score(c).used_bytes["cuda:0"] - 10 for c in ((0, 0, 0, 0, 0), (1, 0, 1, 0, 0),
                                                                       (1, 1, 0, 0, 0), (1, 1, 1, 1, 0))}
    assert on_gpu == {(0, 0, 0, 0, 0): 40 + 30,  # all resident: weights, the head's workspace
                      (1, 0, 1, 0, 0): 20 + 30 + 10,  # the head runs while a layer's part (10) may be in flight
                      (1, 1, 0, 0, 0): 20 + 30 + 20,  # ... a whole layer's (20)
                      (1, 1, 1, 1, 0): 0 + 30 + 20}  # not two layers' copies: only the next one's is held then
    # the next copying layer's, not the largest's: layer 0 copies 10, layer 1 20; the head waits with layer 0's
    # 10 in flight (the next step's), layer 0 with its 10 and layer 1's 20, layer 1 with its 20 and, at least
    # as many as its own, 20 (layer 0's 10 are next)
    assert problem.score((1, 0, 1, 1, 0)).used_bytes["cuda:0"] - 10 == 10 + max(30 + 10, 6 + 10 + 20, 6 + 20 + 20)
    # the head's workspace grown to 50 sets the peak: with layer 0's 10 in flight, not the largest layer's 20
    bigger = dataclasses.replace(problem, units=(*units[:4], UnitSpec(name="head", options=(_part("cuda:0", 50),))))
    assert bigger.score((1, 0, 1, 1, 0)).used_bytes["cuda:0"] - 10 == 10 + 50 + 10
    # the layers' peak itself: a layer's workspace (6) with its own copies (20) and the next layer's (20)
    assert device_transients(problem.options((1, 1, 1, 1, 0))[:4], problem.copy_runs[:2])["cuda:0"].total_bytes \
        == 6 + 20 + 20
    # without groups, each streamed unit is a run of its own: its own copy and the next one's, 10 each
    alone = PlacementProblem(units=units[:4], edges=(), devices=devices)
    assert alone.score((1, 1, 1, 1)).used_bytes["cuda:0"] == 6 + 10 + 10
    # the executor starts' conservative price of a part: its run's and the next run's copies at the most
    assert problem.most_peak(streamed[0]) == 4 + 2 * 20


def test_a_group_copy_must_be_a_streamed_option_holding_it_twice():
    with pytest.raises(SolverInputError, match="group_copy_bytes 10 needs a stream or phased option whose peak "
                                               "holds it 2 times"):
        _part("cpu", 19, share=10)
    with pytest.raises(SolverInputError, match="needs a stream or phased option"):
        _part("cuda:0", 40, share=10)
