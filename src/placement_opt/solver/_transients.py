"""Running accounts of each device's bytes as a start is built: the greedy's, one unit at a time in execution
order, and the fill's, one move at a time.

Torch-free. With copy groups a device's transient is :func:`~.problem.device_transients` over the copy runs;
recounting it for every unit the greedy places or every move the fill tries would cost a pass over the runs
each time (1,500 moves on a module-level 70B), so both keep it per phase and run, and agree with it
(tests/solver/test_transients.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .problem import PHASES, PlacementOption, PlacementProblem, phase_copies, phase_peaks

__all__ = ["MoveMemory", "RunPeaks", "RunTransients", "NONE"]

NONE = -(1 << 62)  # "no run there" (the fill's and the greedy's accounts): below any sum of bytes


class MoveMemory:
    """Bytes per device under the problem's memory model (transients from peaks(); with copy groups, per copy
    run as :func:`~.problem.device_transients` counts them), updated one move at a time."""

    def __init__(self, problem: PlacementProblem, chosen: Sequence[PlacementOption]) -> None:
        self.capacity = {d.name: d.capacity_bytes for d in problem.devices}
        self.held = dict.fromkeys(self.capacity, 0)
        self.peaks: dict[str, Counter[int]] = {d: Counter() for d in self.capacity}
        self.top = dict.fromkeys(self.capacity, 0)
        """The largest transient per device (kept up to date by _apply)."""
        self.runs = RunPeaks(problem) if problem.group_copies else None
        for i, o in enumerate(chosen):
            self._apply(i, o, 1)

    def _apply(self, i: int, o: PlacementOption, sign: int) -> None:
        self.held[o.storage] += sign * o.stored_bytes
        self.held[o.execution] += sign * o.resident_bytes
        if self.runs is not None:
            self.runs.apply(i, o, sign)
            return
        self._transient(o.execution, o.peak_bytes, sign)  # peaks(), the common case without a call
        if o.prefill_execution is not None:
            self._transient(o.prefill_execution, o.prefill_peak_bytes, sign)

    def _transient(self, device: str, nbytes: int, sign: int) -> None:
        peaks = self.peaks[device]
        peaks[nbytes] += sign
        if sign > 0:
            self.top[device] = max(self.top[device], nbytes)
        elif peaks[nbytes] == 0:
            del peaks[nbytes]
            if nbytes == self.top[device]:
                self.top[device] = max(peaks, default=0)

    def _fits(self, device: str) -> bool:
        top = self.top[device] if self.runs is None else self.runs.peak(device)
        return self.held[device] + top <= self.capacity[device]

    def move(self, i: int, old: PlacementOption, new: PlacementOption) -> bool:
        """Replace unit ``i``'s ``old`` by ``new`` if every device still fits; False (and nothing changed)
        otherwise."""
        self._apply(i, old, -1)
        self._apply(i, new, 1)
        # only new's devices can have grown (everything fitted before the move)
        if all(self._fits(d) for d in (new.storage, new.execution, new.prefill_execution) if d is not None):
            return True
        self._apply(i, new, -1)
        self._apply(i, old, 1)
        return False


class RunPeaks:
    """Each device's transient peak with copy groups (:func:`~.problem.device_transients`), kept per phase and
    copy run; a device's peak is counted anew (one pass over the runs) when a move touched it."""

    def __init__(self, problem: PlacementProblem) -> None:
        self.run_of = problem.run_of
        self.n_runs = len(problem.runs)
        self.own: dict[tuple[str, str, int], Counter[int]] = {}  # (phase, device, run) -> own peaks of its units
        self.tops: dict[tuple[str, str], list[int]] = {}  # (phase, device) -> each run's largest own peak, or NONE
        self.copies: dict[tuple[str, str], list[int]] = {}  # (phase, device) -> each run's group copies there
        self.peaks: dict[str, int] = {}  # device -> its transient, while no move touched it

    def apply(self, i: int, o: PlacementOption, sign: int) -> None:
        run = self.run_of[i]
        for phase in PHASES:
            for d, nbytes in phase_peaks(o, phase):
                own = self.own.setdefault((phase, d, run), Counter())
                own[nbytes] += sign
                if not own[nbytes]:
                    del own[nbytes]
                self.tops.setdefault((phase, d), [NONE] * self.n_runs)[run] = max(own, default=NONE)
                self.peaks.pop(d, None)
            made = phase_copies(o, phase)
            if made:
                self.copies.setdefault((phase, o.group_device), [0] * self.n_runs)[run] += sign * made
                self.peaks.pop(o.group_device, None)

    def peak(self, device: str) -> int:
        if device not in self.peaks:
            decode = self.copies.get(("decode_ns", device), ())
            wrap = next((c for c in decode if c), 0)  # the decode's first copies: what a prefill's last starts
            self.peaks[device] = max(self._phase(device, phase, wrap) for phase in PHASES)
        return self.peaks[device]

    def _phase(self, device: str, phase: str, decode_first: int) -> int:
        """:func:`~.problem.device_transients` of one phase on ``device``, in one backward pass (the fill counts
        a touched device for every move it tries: 1,500 times on a module-level 70B)."""
        tops = self.tops.get((phase, device))
        copies = self.copies.get((phase, device))
        if copies is None or not any(copies):
            return max(0, max(tops, default=0)) if tops else 0
        tops = tops or [NONE] * self.n_runs
        following = next((c for c in copies if c), 0) if phase == "decode_ns" else decode_first
        best = 0
        for r in range(self.n_runs - 1, -1, -1):
            top, made = tops[r], copies[r]
            if made:  # a copying run: its own peak (0 if none there), its copies, the next (at least its own)
                value = (top if top > 0 else 0) + made + (made if made > following else following)
                following = made
            else:  # NONE where no unit of the run computes there: below any total
                value = top + following
            if value > best:
                best = value
        return best


@dataclass
class _Chain:
    """One phase's copies on one device over the runs placed so far (:func:`~.problem.next_copies`): runs
    before the first copying run have its copies next (``head``); runs between two copying runs the later
    one's (``closed``, counted); runs from the last copying run on wait for the next, or the ``wrap``."""

    first: int = 0
    head: int = NONE
    closed: int = NONE
    tail: int = NONE

    def total(self, value: int, copies: int, wrap: int | None) -> int:
        """The device's transient in the phase were the run now placed (``value``: its own peak + copies,
        ``copies``: its copies) the last to copy; ``wrap``: what follows the last copying run (None: the
        first, round the cycle)."""
        if copies and not self.first:
            return max(self.head + copies, value + (copies if wrap is None else wrap))
        if copies:
            return max(self.closed, self.head + self.first, self.tail + copies,
                       value + (self.first if wrap is None else wrap))
        if not self.first:
            return max(self.head, value)
        after = self.first if wrap is None else wrap
        return max(self.closed, self.head + self.first, max(self.tail, value) + after)

    def close(self, value: int, copies: int) -> None:
        """The run now placed is done."""
        if copies and not self.first:
            self.first, self.tail = copies, value
        elif copies:
            self.closed, self.tail = max(self.closed, self.tail + copies), value
        elif not self.first:
            self.head = max(self.head, value)
        else:
            self.tail = max(self.tail, value)


class RunTransients:
    """Each device's transient with copy groups (:func:`~.problem.device_transients`) as units are placed in
    execution order: per phase the current copy run's own peaks and copies, and the runs before it
    (:class:`_Chain`), a run's own copies its least next. Exact for the units placed so far, later runs taken
    to copy nothing."""

    def __init__(self, problem: PlacementProblem) -> None:
        self.run_of = problem.run_of
        self.run = -1
        self.own: dict[tuple[str, str], int] = {}  # (phase, device) -> the current run's largest own peak
        self.copies: dict[tuple[str, str], int] = {}  # (phase, device) -> the current run's copies
        self.chains: dict[tuple[str, str], _Chain] = {}
        self.twice: dict[tuple[str, str], int] = {}  # the largest done run's value + its copies (its least next)
        self.now: dict[str, int] = {}  # device -> its transient as placed so far (_total), until the next enter/add
        # grows() per transient shape (_shape), until the next enter/add: a unit's options that differ in storage
        # only grow alike (its streams from the CPU and from the disk to one GPU)
        self.grown: dict[tuple[str, int, str | None, int, int], dict[str, int]] = {}

    def enter(self, unit: int) -> None:
        if self.run_of[unit] == self.run:
            return
        for key in self.own.keys() | self.copies.keys():
            value, copies = self._value(key, self.own, self.copies)
            self._chain(key).close(value, copies)
            self.twice[key] = max(self.twice.get(key, NONE), value + copies)
        self.run, self.own, self.copies = self.run_of[unit], {}, {}
        self.now, self.grown = {}, {}

    def _chain(self, key: tuple[str, str]) -> _Chain:
        if key not in self.chains:
            self.chains[key] = _Chain()
        return self.chains[key]

    @staticmethod
    def _value(key: tuple[str, str], own: dict[tuple[str, str], int],
               copies: dict[tuple[str, str], int]) -> tuple[int, int]:
        made = copies.get(key, 0)
        return (own.get(key, 0) + made if key in own or made else NONE), made

    def _total(self, d: str, own: dict[tuple[str, str], int], copies: dict[tuple[str, str], int]) -> int:
        # the decode's first copies there: what a prefill's last copying run starts (the next call's)
        decode = ("decode_ns", d)
        wrap = self._chain(decode).first or copies.get(decode, 0)
        out = 0
        for phase in PHASES:
            key = (phase, d)
            value, made = self._value(key, own, copies)
            out = max(out, self.twice.get(key, NONE), value + made,
                      self._chain(key).total(value, made, wrap if phase == "prefill_ns" else None))
        return out

    def _after(self, o: PlacementOption) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        """The current run's own peaks and copies once ``o`` joins it (the keys it touches only)."""
        own, copies = {}, {}
        for phase in PHASES:
            for d, nbytes in phase_peaks(o, phase):
                own[phase, d] = max(self.own.get((phase, d), 0), nbytes)
            made = phase_copies(o, phase)
            if made:
                copies[phase, o.group_device] = self.copies.get((phase, o.group_device), 0) + made
        return own, copies

    def grows(self, o: PlacementOption) -> dict[str, int]:
        """What each device's transient grows by when ``o`` joins the current run (less than 0: shrinks, as
        earlier runs' next copies are this run's instead of the first run's). The caller must not change it."""
        shape = _shape(o)
        known = self.grown.get(shape)
        if known is None:
            own, copies = self._after(o)
            devices = {d for _, d in own.keys() | copies.keys()}
            merged_own, merged_copies = {**self.own, **own}, {**self.copies, **copies}
            known = self.grown[shape] = {d: self._total(d, merged_own, merged_copies) - self._now(d)
                                         for d in devices}
        return known

    def _now(self, d: str) -> int:
        # the greedy asks every option of a unit what it grows: the state before them is the same for all
        if d not in self.now:
            self.now[d] = self._total(d, self.own, self.copies)
        return self.now[d]

    def add(self, o: PlacementOption) -> None:
        own, copies = self._after(o)
        self.own.update(own)
        self.copies.update(copies)
        self.now, self.grown = {}, {}


def _shape(o: PlacementOption) -> tuple[str, int, str | None, int, int]:
    """What :meth:`RunTransients.grows` reads of ``o``: the fields its own peaks and group copy come from."""
    return o.execution, o.peak_bytes, o.prefill_execution, o.prefill_peak_bytes, o.group_copy_bytes
