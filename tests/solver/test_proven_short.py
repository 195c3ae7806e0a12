"""``proven_short`` claims a problem infeasible from arithmetic alone: brute force must agree every time."""

from __future__ import annotations

import dataclasses
import itertools

from _brute import reference_valid
from _problems import problems
from hypothesis import given, settings
from hypothesis import strategies as st

from placement_opt.cost.shortage import proven_short


def _shrunk(problem, data):
    """The problem with device capacities cut to a drawn fraction: tight enough that many are infeasible."""
    fraction = data.draw(st.sampled_from([0.02, 0.1, 0.3, 0.6, 1.0]), label="capacity fraction")
    devices = tuple(dataclasses.replace(d, capacity_bytes=int(d.capacity_bytes * fraction)) for d in problem.devices)
    return dataclasses.replace(problem, devices=devices)


@settings(max_examples=150)
@given(problem=problems(), data=st.data())
def test_a_problem_proven_short_has_no_valid_assignment(problem, data) -> None:
    problem = _shrunk(problem, data)
    if not proven_short(problem):
        return
    every = itertools.product(*(range(len(u.options)) for u in problem.units))
    assert not any(reference_valid(problem, list(choice)) for choice in every)
