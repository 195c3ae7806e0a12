"""The prefetch thread's schedule: each streamed unit's wait for its weights, and each device's transient peak.

Torch-free. :meth:`~.problem.PlacementProblem.score` reads these (the Overlap and Memory paragraphs of
:mod:`.problem` state the rules); the CP-SAT model, the relaxations and the greedy fill state them again in
their own terms and are tested against them. Units and runs are positions in execution order; an option is a
:class:`~.problem.PlacementOption`, read through its ``peaks_apart()``, ``group_copy_bytes`` and devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .specs import PlacementOption

__all__ = ["PHASES", "stalls", "Transient", "device_transients", "next_copies", "phase_next_copies", "phase_peaks",
           "phase_copies"]

#: The phases every price comes in: the keys of :class:`~.problem.PlacementOption`'s times.
PHASES = ("prefill_ns", "decode_ns")


def stalls(durations: Sequence[int], copies: Sequence[int], cyclic: bool,
           runs: Sequence[tuple[int, int]] | None = None) -> list[int]:
    """Each unit's wait for its weights under the prefetch thread (module docstring, Overlap).

    ``copies[i] > 0`` marks a streamed unit. Its copy started when the previous streamed unit started, and
    ran beside that unit and every unit after it; ``cyclic`` (the decode): the previous one of the first is
    the last, a step earlier; else the first copy runs from the start.

    ``runs`` (:attr:`PlacementProblem.copy_runs`): ``(first, end)`` ranges covering the units in order, each
    copied as one: a run streams when one of its units does, its copy is its units' copies together, and
    the run's first unit (its *head*, whatever it computes) waits for all of it; the next run's copy starts
    when this head starts. The same rule on runs' summed durations and copies.
    """
    if runs is not None:
        per_run = stalls([sum(durations[a:b]) for a, b in runs], [sum(copies[a:b]) for a, b in runs], cyclic)
        waits = [0] * len(durations)
        for (head, _), wait in zip(runs, per_run, strict=True):
            waits[head] = wait
        return waits
    waits = [0] * len(durations)
    last = next((i for i in range(len(copies) - 1, -1, -1) if copies[i] > 0), None)
    if last is None:
        return waits
    beside = sum(durations[last:]) if cyclic else 0  # time since the previous streamed unit started
    for i, (duration, copy) in enumerate(zip(durations, copies, strict=True)):
        if copy > 0:
            if copy > beside:
                waits[i] = copy - beside
            beside = duration
        else:
            beside += duration
    return waits


@dataclass(frozen=True)
class Transient:
    """A device's transient peak with copy groups (:func:`device_transients`): the copy run that sets it."""

    unit: int | None
    """The unit of that run whose own peak (:meth:`PlacementOption.peaks_apart`) counts; None: no unit of the run
    computes on the device."""
    own_bytes: int
    run_copies_bytes: int
    """The run's group copies to the device."""
    next_copies_bytes: int
    """The group copies to the device of the next run that copies there, in flight while this run computes
    (:func:`next_copies`), and at least this run's."""

    @property
    def total_bytes(self) -> int:
        return self.own_bytes + self.run_copies_bytes + self.next_copies_bytes


def next_copies(copies: Sequence[int], wrap: int | None = None) -> list[int]:
    """For each run, the ``copies`` of the first run after it with any: what the prefetch thread holds ahead
    while the run computes. Past the last, ``wrap`` (None: round the cycle, a run alone its own next; 0 when
    none copies)."""
    out = [0] * len(copies)
    # past the last copying run comes the wrap: round the cycle, the first copying run (one backward pass; the
    # fill counts this for every move it tries)
    following = next((c for c in copies if c > 0), 0) if wrap is None else wrap
    for r in range(len(copies) - 1, -1, -1):
        out[r] = following
        if copies[r] > 0:
            following = copies[r]
    return out


def phase_next_copies(copies: Sequence[int], phase: str, decode: Sequence[int]) -> list[int]:
    """:func:`next_copies` in ``phase`` (``copies``: each run's there): the decode goes round the cycle, and a
    prefill's last copying run is followed by the decode's first (``decode``: each run's copies in the decode),
    as the dispatcher starts them."""
    if phase == "decode_ns":
        return next_copies(copies)
    return next_copies(copies, next((c for c in decode if c), 0))


def phase_peaks(opt: PlacementOption, phase: str) -> tuple[tuple[str, int], ...]:
    """:meth:`PlacementOption.peaks_apart` while ``phase`` runs: a phased option's prefill device's in the
    prefill only (it decodes where it is stored)."""
    apart = opt.peaks_apart()
    return apart if phase == "prefill_ns" or opt.prefill_execution is None else apart[:1]


def phase_copies(opt: PlacementOption, phase: str) -> int:
    """``opt``'s group copy in ``phase``: a phased option copies in the prefill only."""
    return opt.group_copy_bytes if phase == "prefill_ns" or opt.prefill_execution is None else 0


def device_transients(chosen: Sequence[PlacementOption],
                      runs: Sequence[tuple[int, int]] | None) -> dict[str, Transient]:
    """Device -> its transient peak with copy groups (module docstring): over both phases and the copy runs
    (``runs``: :attr:`PlacementProblem.copy_runs`, None: each unit alone) with a unit computing or copying there
    in the phase, the largest of the run's largest own peak there, plus its group copies there, plus the next
    copying run's (at least as many as its own). The decode's runs go round a cycle; a prefill's last copying
    run is followed by the decode's first (the next call). Devices without a transient are left out."""
    runs = runs if runs is not None else [(u, u + 1) for u in range(len(chosen))]
    own = {"prefill_ns": [], "decode_ns": []}  # per phase, per run: device -> (largest own peak, its unit)
    copies: dict[str, dict[str, list[int]]] = {"prefill_ns": {}, "decode_ns": {}}  # phase -> device -> per run
    for r, (a, b) in enumerate(runs):  # one pass for both phases: scores call this thousands of times
        prefill: dict[str, tuple[int, int]] = {}
        decode: dict[str, tuple[int, int]] = {}
        for u in range(a, b):
            opt = chosen[u]
            for k, (device, nbytes) in enumerate(opt.peaks_apart()):  # k = 1: a phased option's prefill side
                for here in (prefill,) if k else (prefill, decode):
                    if device not in here or nbytes > here[device][0]:
                        here[device] = (nbytes, u)
            if opt.group_copy_bytes:
                for phase in PHASES if opt.prefill_execution is None else ("prefill_ns",):
                    copies[phase].setdefault(opt.group_device, [0] * len(runs))[r] += opt.group_copy_bytes
        own["prefill_ns"].append(prefill)
        own["decode_ns"].append(decode)
    best: dict[str, tuple[int, str, int]] = {}  # device -> (total, phase, run)
    nexts: dict[tuple[str, str], list[int]] = {}
    for phase in PHASES:
        for device in {d for here in own[phase] for d in here} | copies[phase].keys():
            made = copies[phase].get(device)
            if made is None:  # nothing copied there in the phase: the largest own peak
                total, r = max((here[device][0], -r) for r, here in enumerate(own[phase]) if device in here)
            else:
                ahead = nexts[phase, device] = phase_next_copies(made, phase, copies["decode_ns"].get(device, ()))
                total, r = max((here.get(device, (0,))[0] + c + (c if c > n else n), -r)
                               for r, (here, c, n) in enumerate(zip(own[phase], made, ahead, strict=True))
                               if c or device in here)
            if device not in best or total > best[device][0]:
                best[device] = (total, phase, -r)  # on a tie the first run, which the report names
    out = {}
    for device, (_, phase, r) in best.items():
        nbytes, unit = own[phase][r].get(device, (0, None))
        made = copies[phase].get(device, [0] * len(runs))[r]
        ahead = nexts.get((phase, device), [0] * len(runs))[r]
        out[device] = Transient(unit=unit, own_bytes=nbytes, run_copies_bytes=made,
                                next_copies_bytes=max(made, ahead))
    return out
