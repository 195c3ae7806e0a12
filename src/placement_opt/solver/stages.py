"""Pipeline stages: a chain of units cut into contiguous ranges, one per stage, slowest stage least.

Stage ``k`` runs on its own device (rank ``k``), so every number is per stage and per unit. A
stage that holds units ``a .. b-1`` costs::

    time(k, a, b)   = sum(time_ns[k][a:b]) + send_ns[k][b]
    memory(k, a, b) = sum(stored_bytes[k][a:b]) + max(peak_bytes[k][a:b])
                      + in_bytes[k][a] + out_bytes[k][b]

less what ``stored_bytes`` counts twice of a tensor tied across units of the range (``shared_bytes``).

``send_ns[k][b]`` is the transfer of the activations that cross cut ``b`` to stage ``k + 1``
(0 for the last stage); ``in_bytes``/``out_bytes`` are the receive and send buffers of the
micro-batches in flight. The pipeline's step time is set by its slowest stage, so the objective
is ``max_k time(k, a_k, a_{k+1})`` subject to ``memory(k, ...) <= capacity_bytes[k]``.

:func:`solve_stages` is the classic chain-partition dynamic program, exact: ``best[k][b]`` is
the least possible slowest stage among the first ``k + 1`` stages holding units ``0 .. b-1``,
``best[k][b] = min_a max(best[k-1][a], time(k, a, b))`` over feasible ``a``. It is
``O(stages x units^2)`` at worst and stops scanning ``a`` once the stage alone is slower than the
best found, so a 700-unit, 8-stage problem takes well under a second. Every stage holds at least
one unit (``torch.distributed.pipelining`` has no empty stage). Torch-free.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InfeasiblePlacementError, SolverInputError
from ..units import format_bytes

__all__ = ["StageProblem", "StageSolution", "solve_stages", "stage_time_ns", "stage_memory_bytes"]


@dataclass(frozen=True)
class StageProblem:
    """Integer inputs of the stage partition; outer index = stage, inner = unit (or cut, ``n + 1``)."""

    time_ns: tuple[tuple[int, ...], ...]
    stored_bytes: tuple[tuple[int, ...], ...]
    peak_bytes: tuple[tuple[int, ...], ...]
    send_ns: tuple[tuple[int, ...], ...]
    in_bytes: tuple[tuple[int, ...], ...]
    out_bytes: tuple[tuple[int, ...], ...]
    capacity_bytes: tuple[int, ...]
    shared_bytes: tuple[tuple[tuple[int, ...], int], ...] = ()
    """Units that each count one same tensor in ``stored_bytes`` (their indices, its bytes): weights tied across
    units. A stage holding several of them loads the tensor once, so :func:`stage_memory_bytes` counts it once."""

    def __post_init__(self) -> None:
        stages = len(self.capacity_bytes)
        units = len(self.time_ns[0]) if self.time_ns else 0
        if stages < 1 or units < stages:
            raise SolverInputError(f"{stages} stage(s) over {units} unit(s): a pipeline needs at least one stage "
                                   f"and at least one unit per stage; use fewer ranks")
        for name, width in (("time_ns", units), ("stored_bytes", units), ("peak_bytes", units),
                            ("send_ns", units + 1), ("in_bytes", units + 1), ("out_bytes", units + 1)):
            rows = getattr(self, name)
            if len(rows) != stages or any(len(r) != width for r in rows):
                raise SolverInputError(f"StageProblem.{name} must be {stages} rows of {width} integers")
            if any(v < 0 for r in rows for v in r):
                raise SolverInputError(f"StageProblem.{name} has a negative entry: times and bytes are >= 0")
        for members, nbytes in self.shared_bytes:
            if nbytes < 0 or len(set(members)) != len(members) or any(not 0 <= i < units for i in members):
                raise SolverInputError(f"StageProblem.shared_bytes has ({members}, {nbytes}): give distinct unit "
                                       f"indices below {units} and bytes >= 0")

    @functools.cached_property
    def _sharing(self) -> dict[int, tuple[int, ...]]:
        """Unit index -> the :attr:`shared_bytes` entries (indices) it counts: read by every range the program scans."""
        out: dict[int, tuple[int, ...]] = {}
        for g, (members, _) in enumerate(self.shared_bytes):
            for i in members:
                out[i] = (*out.get(i, ()), g)
        return out

    @property
    def n_stages(self) -> int:
        return len(self.capacity_bytes)

    @property
    def n_units(self) -> int:
        return len(self.time_ns[0])


@dataclass(frozen=True)
class StageSolution:
    """The cuts (``cuts[k]`` is the first unit of stage ``k``; ``cuts[-1] == n_units``) and their times."""

    cuts: tuple[int, ...]
    stage_ns: tuple[int, ...]
    stage_bytes: tuple[int, ...]

    @property
    def objective_ns(self) -> int:
        return max(self.stage_ns)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self.cuts[:-1], self.cuts[1:], strict=True))


def stage_time_ns(problem: StageProblem, k: int, a: int, b: int) -> int:
    """Time of stage ``k`` holding units ``a .. b-1``, its send included."""
    return sum(problem.time_ns[k][a:b]) + problem.send_ns[k][b]


def stage_memory_bytes(problem: StageProblem, k: int, a: int, b: int) -> int:
    """Memory of stage ``k`` holding units ``a .. b-1``."""
    return (sum(problem.stored_bytes[k][a:b]) - _shared_twice(problem, a, b) + max(problem.peak_bytes[k][a:b])
            + problem.in_bytes[k][a] + problem.out_bytes[k][b])


def _shared_twice(problem: StageProblem, a: int, b: int) -> int:
    """Bytes ``stored_bytes`` counts more than once in units ``a .. b-1``: each shared tensor past its first unit."""
    return sum(nbytes * max(0, sum(a <= i < b for i in members) - 1) for members, nbytes in problem.shared_bytes)


def _prefix(row: Sequence[int]) -> list[int]:
    out = [0]
    for v in row:
        out.append(out[-1] + v)
    return out


def solve_stages(problem: StageProblem) -> StageSolution:
    """An exact least slowest stage (one optimal partition among equals), by dynamic programming.

    Raises:
        InfeasiblePlacementError: no partition fits every stage's capacity; says which stage is
            short by how much at best.
    """
    n, stages = problem.n_units, problem.n_stages
    inf = float("inf")
    best: list[list[float]] = [[inf] * (n + 1) for _ in range(stages)]
    choice: list[list[int]] = [[-1] * (n + 1) for _ in range(stages)]
    times = [_prefix(r) for r in problem.time_ns]
    stored = [_prefix(r) for r in problem.stored_bytes]
    for k in range(stages):
        # Stage k's last unit is at least k (stages before it hold one each), and at most
        # n - (stages - k) so that later stages get one each.
        for b in range(k + 1, n - (stages - k - 1) + 1):
            _best_start(problem, k, b, times[k], stored[k], best, choice)
    if best[-1][n] == inf:
        raise InfeasiblePlacementError(_shortage(problem))
    cuts = [n]
    for k in range(stages - 1, -1, -1):
        cuts.append(choice[k][cuts[-1]])
    cuts.reverse()
    ranges = list(zip(cuts[:-1], cuts[1:], strict=True))
    return StageSolution(cuts=tuple(cuts),
                         stage_ns=tuple(stage_time_ns(problem, k, a, b) for k, (a, b) in enumerate(ranges)),
                         stage_bytes=tuple(stage_memory_bytes(problem, k, a, b) for k, (a, b) in enumerate(ranges)))


def _best_start(problem: StageProblem, k: int, b: int, times: list[int], stored: list[int],
                best: list[list[float]], choice: list[list[int]]) -> None:
    """Fill ``best[k][b]``: scan the stage's first unit ``a`` from ``b - 1`` down."""
    cap, peak_row = problem.capacity_bytes[k], problem.peak_bytes[k]
    send, out_bytes = problem.send_ns[k][b], problem.out_bytes[k][b]
    peak = 0
    lowest = 0 if k == 0 else k
    sharing = problem._sharing
    held = [0] * len(problem.shared_bytes)  # units of each shared tensor in the range so far
    twice = 0  # _shared_twice of the range, kept as a walks down
    for a in range(b - 1, lowest - 1, -1):
        peak = max(peak, peak_row[a])
        for g in sharing.get(a, ()):
            twice += problem.shared_bytes[g][1] if held[g] else 0
            held[g] += 1
        own = times[b] - times[a] + send
        if own >= best[k][b]:
            break  # times only grow as the stage takes more units: no a below does better
        if k == 0 and a != 0:
            continue  # the first stage starts at unit 0
        before = 0 if k == 0 else best[k - 1][a]
        value = max(before, own)
        if value >= best[k][b]:
            continue
        memory = stored[b] - stored[a] - twice + peak + problem.in_bytes[k][a] + out_bytes
        if memory <= cap:
            best[k][b], choice[k][b] = value, a


def _shortage(problem: StageProblem) -> str:
    """Say how far the tightest stage is from fitting even the smallest range it could hold."""
    worst = []
    for k in range(problem.n_stages):
        smallest = min(stage_memory_bytes(problem, k, a, a + 1) for a in range(problem.n_units))
        worst.append((smallest - problem.capacity_bytes[k], k, smallest))
    short, k, smallest = max(worst)
    if short > 0:
        return (f"stage {k} cannot hold even its smallest unit: {format_bytes(smallest)} with its buffers "
                f"against {format_bytes(problem.capacity_bytes[k])} ({format_bytes(short)} short); use a device with more memory for rank {k}, "
                f"fewer micro-batches in flight (Schedule1F1B, a smaller micro-batch) or more ranks")
    total = sum(sum(r) for r in problem.stored_bytes) // problem.n_stages**2  # rows hold the whole chain
    caps = problem.capacity_bytes
    # the activations a boundary holds in flight (every micro-batch under GPipe): what a huge count of them costs
    flight = max(max(max(problem.in_bytes[k]), max(problem.out_bytes[k])) for k in range(problem.n_stages))
    return (f"no split of {problem.n_units} units into {problem.n_stages} contiguous stages fits every rank's "
            f"memory (what the stages store, without buffers or workspace, averages {format_bytes(total)} per "
            f"stage, and a stage boundary holds up to {format_bytes(flight)} of activations in flight, against "
            f"capacities of {format_bytes(min(caps))} to {format_bytes(max(caps))}); add ranks, "
            f"use devices with more memory, or keep fewer activations (fewer micro-batches in flight, "
            f"activation checkpointing)")
