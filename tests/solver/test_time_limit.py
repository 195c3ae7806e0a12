"""``solve_problem`` returns within its time limit plus 0.5 s, whatever the graph.

The large graphs are where the limit is at risk: building the CP-SAT model of a module-level 70B
graph (724 units, 13,922 edges as traced) takes longer than a second on a busy 2-core machine, and
the search for covered edges is itself bounded. Past the limit the start stands (bound 0).
"""

from __future__ import annotations

import itertools
import time

import pytest

from placement_opt.solver.problem import (
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
)
from placement_opt.solver.search import solve_problem

_OVER_S = 0.5


def _dense_dag(n: int) -> PlacementProblem:
    """n units on two GPUs and a CPU, every unit feeding the next 12: many edges, few of them covered."""
    devices = ("cuda:0", "cuda:1", "cpu")
    prices = {(p, q): 3 + 2 * i for i, (p, q) in enumerate(itertools.permutations(devices, 2))}
    units = tuple(UnitSpec(name=f"u{i}", options=tuple(
        PlacementOption(storage=d, execution=d, mode="resident", prefill_ns=1 + (i * 7 + k) % 5,
                        decode_ns=10 + (i * 3 + k) % 11, stored_bytes=1 + i % 3, resident_bytes=0, peak_bytes=i % 4)
        for k, d in enumerate(devices))) for i in range(n))
    edges = tuple(EdgeSpec(src=f"u{i}", dst=f"u{j}", prefill_ns=prices, decode_ns=prices)
                  for i in range(n) for j in range(i + 1, min(n, i + 13)))
    caps = (DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=n // 2), DeviceSpec(name="cuda:1", kind="gpu",
            capacity_bytes=n // 3), DeviceSpec(name="cpu", kind="cpu", capacity_bytes=10 * n))
    return PlacementProblem(units=units, edges=edges, devices=caps)


def _timed(solve, limit_s):
    """(wall seconds, solution) of ``solve()``, run a second time when the first overran ``limit_s`` +
    _OVER_S: a shared CI machine can stall one run by a second (load 2.5 doubled the overrun here), while a
    solver that does not keep its limit overruns both."""
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        sol = solve()
        runs.append((time.perf_counter() - t0, sol))
        if runs[-1][0] <= limit_s + _OVER_S:
            break
    return min(runs, key=lambda run: run[0])


@pytest.mark.slow
@pytest.mark.parametrize("limit_s", [0.5, 1.0])
def test_a_dense_dag_of_1500_units_keeps_the_time_limit(limit_s):
    problem = _dense_dag(1500)  # 17,922 edges
    start = [2] * len(problem.units)  # everything on the CPU: valid
    wall_s, sol = _timed(lambda: solve_problem(problem, time_limit_s=limit_s, hint=start), limit_s)
    assert wall_s <= limit_s + _OVER_S
    assert sol.feasible and problem.satisfies(sol.choice)
    assert sol.best_bound <= sol.objective_value


@pytest.mark.slow
def test_a_module_level_70b_graph_keeps_the_time_limit(module_level_70b):
    from placement_opt.cost.build import build_problem
    from placement_opt.cost.workload import Workload
    from placement_opt.hardware.devices import Device, Machine
    from placement_opt.solver.greedy import best_greedy_choice

    graph = module_level_70b
    machine = Machine([Device.preset("a100-80gb", name="cuda:0"), Device.preset("t4", name="cuda:1"),
                       Device.preset("cpu-desktop", name="cpu").with_memory("128GiB"),
                       Device.preset("nvme-gen4", name="disk")])
    problem = build_problem(graph, machine, Workload(batch_size=16, prompt_len=1024), pins={}, contiguous=False)
    start = best_greedy_choice(problem)
    for limit_s in (1.0, 2.0):
        wall_s, sol = _timed(lambda limit_s=limit_s: solve_problem(problem, time_limit_s=limit_s, hint=start), limit_s)
        assert wall_s <= limit_s + _OVER_S, f"{len(problem.units)} units, limit {limit_s} s"
        assert not problem.satisfies(start) or sol.feasible


def test_no_relaxation_is_built_once_the_time_is_spent():
    """A relaxation's model has no clock while it is built (0.1-0.3 s on 1,500 units): the memory objective's
    second solve, begun at its deadline, built two of them and ran 0.6 s past a 0.5 s limit."""
    from placement_opt.solver._relaxing import run_relaxations
    from placement_opt.solver._run import Run

    built = []
    problem = _dense_dag(4)
    relaxations = [("a relaxation", 0.5, lambda *args: built.append(args))]
    run = Run(seed=0, workers=1, gap_limit=0.0, t0=time.perf_counter())
    relaxed, (hint, hint_ok) = run_relaxations(problem, "latency", relaxations, run, ([0, 0, 0, 0], False), None,
                                               (time.perf_counter() - 0.01, 0.0), [])
    assert not built and relaxed.status == "UNKNOWN" and relaxed.bound == 0 and hint == [0, 0, 0, 0]
