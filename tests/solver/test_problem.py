"""PlacementProblem.score: the one definition of what an assignment costs, checked by hand."""

from __future__ import annotations

import pytest

from placement_opt.solver.problem import (
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
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
