"""The stage program is exact: against every partition of small chains, and its bookkeeping."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement_opt.errors import InfeasiblePlacementError, SolverInputError
from placement_opt.solver.stages import (
    StageProblem,
    solve_stages,
    stage_memory_bytes,
    stage_time_ns,
)


def _brute(problem: StageProblem) -> int | None:
    """The least slowest stage over every split into non-empty contiguous stages, None if none fits."""
    n, s = problem.n_units, problem.n_stages
    best = None
    for inner in combinations(range(1, n), s - 1):
        cuts = (0, *inner, n)
        ranges = list(zip(cuts[:-1], cuts[1:], strict=True))
        if any(stage_memory_bytes(problem, k, a, b) > problem.capacity_bytes[k] for k, (a, b) in enumerate(ranges)):
            continue
        value = max(stage_time_ns(problem, k, a, b) for k, (a, b) in enumerate(ranges))
        best = value if best is None else min(best, value)
    return best


@st.composite
def problems(draw: st.DrawFn) -> StageProblem:
    n = draw(st.integers(1, 8))
    s = draw(st.integers(1, n))
    ints = st.integers(0, 50)

    def rows(width: int, values: st.SearchStrategy[int] = ints) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(draw(st.lists(values, min_size=width, max_size=width))) for _ in range(s))

    stored = rows(n)
    shared = []  # tied tensors: a few units count the same bytes, at most what each stores on every stage
    groups = st.lists(st.lists(st.integers(0, n - 1), min_size=2, max_size=3, unique=True), max_size=2)
    for members in draw(groups) if n > 1 else ():
        most = min(stored[k][i] for k in range(s) for i in members)
        shared.append((tuple(members), draw(st.integers(0, most))))
    return StageProblem(time_ns=rows(n), stored_bytes=stored, peak_bytes=rows(n), send_ns=rows(n + 1),
                        in_bytes=rows(n + 1), out_bytes=rows(n + 1),
                        capacity_bytes=tuple(draw(st.lists(st.integers(0, 300), min_size=s, max_size=s))),
                        shared_bytes=tuple(shared))


@settings(max_examples=400, deadline=None)
@given(problems())
def test_dp_equals_brute_force(problem: StageProblem) -> None:
    expected = _brute(problem)
    if expected is None:
        with pytest.raises(InfeasiblePlacementError):
            solve_stages(problem)
        return
    solution = solve_stages(problem)
    assert solution.objective_ns == expected
    # The reported split is a real one: contiguous, non-empty, in order, within every capacity,
    # and its reported times and bytes are the problem's.
    assert solution.cuts[0] == 0 and solution.cuts[-1] == problem.n_units
    for k, (a, b) in enumerate(solution.ranges()):
        assert a < b
        assert solution.stage_ns[k] == stage_time_ns(problem, k, a, b)
        assert solution.stage_bytes[k] == stage_memory_bytes(problem, k, a, b) <= problem.capacity_bytes[k]


def test_unequal_devices_get_unequal_ranges() -> None:
    # Six equal units; stage 1 is three times slower per unit: 5 + 1 (50, 30) beats 4 + 2 (40, 60)
    # and the layer-count 3 + 3 (30, 90).
    fast, slow = (10,) * 6, (30,) * 6
    zeros6, zeros7 = (0,) * 6, (0,) * 7
    problem = StageProblem(time_ns=(fast, slow), stored_bytes=(zeros6, zeros6), peak_bytes=(zeros6, zeros6),
                           send_ns=(zeros7, zeros7), in_bytes=(zeros7, zeros7), out_bytes=(zeros7, zeros7),
                           capacity_bytes=(1, 1))
    solution = solve_stages(problem)
    assert solution.cuts == (0, 5, 6) and solution.stage_ns == (50, 30)


def test_memory_forces_a_slower_split_and_shortage_is_reported() -> None:
    times, ones = (10,) * 4, (1,) * 4
    zeros4, zeros5 = (0,) * 4, (0,) * 5
    args = dict(time_ns=(times, times), peak_bytes=(zeros4, zeros4), send_ns=(zeros5, zeros5),
                in_bytes=(zeros5, zeros5), out_bytes=(zeros5, zeros5), stored_bytes=(ones, ones))
    assert solve_stages(StageProblem(**args, capacity_bytes=(1, 3))).cuts == (0, 1, 4)
    with pytest.raises(InfeasiblePlacementError, match="no split of 4 units into 2"):
        solve_stages(StageProblem(**args, capacity_bytes=(1, 2)))
    with pytest.raises(InfeasiblePlacementError, match="stage 0 cannot hold even its smallest unit"):
        solve_stages(StageProblem(**args, capacity_bytes=(0, 9)))
    # a billion GPipe micro-batches: the message quoted only the stored bytes, which fit, and not the activations
    # in flight at the boundary, which do not (a unit whose output is not the hidden state crosses nothing)
    flying = dict(args, out_bytes=((0, 0, 9, 9, 0), zeros5), in_bytes=(zeros5, (0, 0, 9, 9, 0)))
    with pytest.raises(InfeasiblePlacementError, match="a stage boundary holds up to 9 B of activations in flight"):
        solve_stages(StageProblem(**flying, capacity_bytes=(2, 2)))


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(SolverInputError, match="3 stage"):
        StageProblem(time_ns=((1, 1),) * 3, stored_bytes=((0, 0),) * 3, peak_bytes=((0, 0),) * 3,
                     send_ns=((0, 0, 0),) * 3, in_bytes=((0, 0, 0),) * 3, out_bytes=((0, 0, 0),) * 3,
                     capacity_bytes=(1, 1, 1))
    with pytest.raises(SolverInputError, match="negative"):
        StageProblem(time_ns=((-1,),), stored_bytes=((0,),), peak_bytes=((0,),), send_ns=((0, 0),),
                     in_bytes=((0, 0),), out_bytes=((0, 0),), capacity_bytes=(1,))
