"""The placement problem's vocabulary in plain integers: a unit's options, units, edges and devices.

Torch-free. A :class:`PlacementOption` is one way to place one unit (where its weights live, where it
computes, in which mode) with its price in nanoseconds and bytes; :class:`UnitSpec`, :class:`EdgeSpec` and
:class:`DeviceSpec` are what :class:`~.problem.PlacementProblem` is made of, and what its docstring's
formulation reads. :mod:`.problem` exports them too, as the problem's own names.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from ._validate import check_option

__all__ = ["MODES", "SHARED", "GROUP_BUFFERS", "PlacementOption", "UnitSpec", "EdgeSpec", "DeviceSpec"]

#: ``resident``: weights live where the unit computes. ``stream``: weights are copied from
#: ``storage`` to ``execution`` for every forward, the next unit's copy overlapped with this
#: unit's compute (placement_opt's dispatcher). ``stream_sync``: the same copy done
#: synchronously, tensor by tensor (accelerate's hooks); used to score accelerate's maps.
#: ``phased``: the prefill streams the weights from ``storage`` to ``prefill_execution`` (a GPU) and
#: computes there; the decode computes on ``execution`` (the device holding the weights: the CPU,
#: from RAM or a memory-mapped disk file) with the KV cache there, moved once after the prefill.
MODES = ("resident", "stream", "stream_sync", "phased")
#: What one thread or device does for every unit beside the compute, each bounding a phase's latency by its
#: sum over the units (``copy_*``, ``host_*`` and ``disk_*`` of :class:`PlacementOption`): the prefetch
#: thread's copies, host memory's traffic, the disk's reads.
SHARED = ("copy", "host", "disk")
#: Copies of its weights a streamed option's peak holds (its own, and the next one's in flight, of its size).
GROUP_BUFFERS = 2


@dataclass(frozen=True, kw_only=True)
class PlacementOption:
    """One way to place one unit: where its weights live, where it computes, and the price."""

    storage: str
    """Device that holds the weights between forwards (the ``device_map`` value)."""
    execution: str
    """Device that computes the unit (in the decode, for a ``phased`` option)."""
    mode: str
    """One of :data:`MODES`."""
    prefill_ns: int
    """Time of this unit in the prefill, weight copies included."""
    decode_ns: int
    """Time of this unit summed over every decode step."""
    stored_bytes: int
    """Bytes held on ``storage`` for the whole run (parameters and buffers)."""
    resident_bytes: int
    """Bytes held on ``execution`` for the whole run (KV cache; training states)."""
    peak_bytes: int
    """Transient bytes on ``execution`` while the unit runs (activation workspace, stream buffer)."""
    prefill_execution: str | None = None
    """``phased`` only: the device that computes the unit in the prefill (None: ``execution``)."""
    prefill_peak_bytes: int = 0
    """``phased`` only: transient bytes on ``prefill_execution`` while the unit runs in the prefill
    (its streamed weights, workspace and the prompt's KV cache before it moves to ``execution``)."""
    copy_prefill_ns: int = 0
    """The prefetch thread's copy of the weights in the prefill (``stream`` to a GPU; ``phased``), beside
    ``prefill_ns`` (the compute): other units' compute hides it (:mod:`.problem`'s docstring, Overlap)."""
    copy_decode_ns: int = 0
    """The prefetch thread's copies over every decode step (``stream`` to a GPU)."""
    host_prefill_ns: int = 0
    """Time host memory spends serving this unit in the prefill (the CPU's weight reads, a copy's reads)
    at the host's whole bandwidth: the host row, ``lat >= sum``, shares it between copies and compute."""
    host_decode_ns: int = 0
    """As ``host_prefill_ns``, over every decode step."""
    disk_prefill_ns: int = 0
    """Time the disk spends reading this option's weights in the prefill (stored on disk): the disk row,
    ``lat >= sum``, shares one disk between the prefetch thread's reads and the CPU's mapped reads."""
    disk_decode_ns: int = 0
    """As ``disk_prefill_ns``, over every decode step."""
    group_copy_bytes: int = 0
    """A part of a copy group copied ahead (a ``stream``, or a ``phased`` option's prefill): the bytes it adds
    to its group's copy on :attr:`group_device`. Its peak (``peak_bytes``, a phased option's
    ``prefill_peak_bytes``) holds them :data:`GROUP_BUFFERS` times, as a unit alone's buffer: the least they
    add to the device. The device's memory counts them per copy run instead (:mod:`.problem`'s docstring)."""

    def __post_init__(self) -> None:
        check_option(self, MODES, GROUP_BUFFERS)

    @property
    def kind(self) -> tuple[str, str, str, str | None]:
        """What the placement is apart from its prices: storage, execution, mode and prefill device. Units of one
        kind of layer offer the same kinds at different prices (the first layer's edges differ)."""
        return self.storage, self.execution, self.mode, self.prefill_execution

    @property
    def group_device(self) -> str:
        """Where the option's ``group_copy_bytes`` land: a phased option's prefill GPU, else its execution."""
        return self.prefill_execution if self.prefill_execution is not None else self.execution

    def device_in(self, phase: str) -> str:
        """The device that computes the unit in ``phase`` (one of :data:`~.schedule.PHASES`)."""
        if phase == "prefill_ns" and self.prefill_execution is not None:
            return self.prefill_execution
        return self.execution

    def copy_in(self, phase: str) -> int:
        """The prefetch thread's copy time in ``phase`` (one of :data:`~.schedule.PHASES`)."""
        return self.copy_prefill_ns if phase == "prefill_ns" else self.copy_decode_ns

    def shared_in(self, resource: str, phase: str) -> int:
        """The time one of :data:`SHARED` (``"copy"``, ``"host"``, ``"disk"``) spends on this option in ``phase``."""
        return getattr(self, f"{resource}_{phase}")

    def work_in(self, phase: str) -> int:
        """The option's time in ``phase`` when nothing else hides its copy: ``max(compute, copy)``, what a
        plain prefetch of equal units gives each. Its device's stage (throughput) and what the baselines
        rank options by; a lower bound of the phase's latency of any plan using it."""
        own = self.prefill_ns if phase == "prefill_ns" else self.decode_ns
        copy = self.copy_in(phase)
        return own if copy <= own else copy

    @functools.cached_property  # best_greedy_choice reads it ~150,000 times on a 324-unit problem
    def work_ns(self) -> int:
        """:meth:`work_in` of both phases: what the baselines rank options by."""
        return self.work_in("prefill_ns") + self.work_in("decode_ns")

    def peaks(self) -> tuple[tuple[str, int], ...]:
        """(device, transient bytes) this option adds to each device's peak: its execution device's,
        and a phased option's prefill device's too."""
        if self.prefill_execution is None:
            return ((self.execution, self.peak_bytes),)
        return ((self.execution, self.peak_bytes), (self.prefill_execution, self.prefill_peak_bytes))

    def peaks_apart(self) -> tuple[tuple[str, int], ...]:
        """:meth:`peaks` less the group copies (``group_copy_bytes``), which the device counts per copy run
        (:func:`~.schedule.device_transients`): each unit's own peak there."""
        if not self.group_copy_bytes:
            return self.peaks()
        apart = self.group_copy_bytes * GROUP_BUFFERS
        if self.prefill_execution is None:
            return ((self.execution, self.peak_bytes - apart),)
        return ((self.execution, self.peak_bytes), (self.prefill_execution, self.prefill_peak_bytes - apart))


@dataclass(frozen=True, kw_only=True)
class UnitSpec:
    name: str
    options: tuple[PlacementOption, ...]
    """Every allowed option; at least one."""


@dataclass(frozen=True, kw_only=True)
class EdgeSpec:
    src: str
    dst: str
    prefill_ns: Mapping[tuple[str, str], int]
    """Transfer time in the prefill for each ``(execution of src, execution of dst)`` pair of
    different devices; a missing pair costs 0."""
    decode_ns: Mapping[tuple[str, str], int]
    """Transfer time summed over every decode step, per pair as above."""


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    name: str
    kind: str
    """``"gpu"``, ``"cpu"`` or ``"disk"``."""
    capacity_bytes: int
    """Bytes the plan may use: memory less the reserve."""
