"""Streamed weights: each unit's bookkeeping, copies to the device it streams to, prefetching one group ahead.

Disk reads and GPU copies run in one background thread (GPU copies on a CUDA side stream, from
pinned memory); :class:`Streamer` hands the copied weights to the unit's forward (:mod:`._hooks`).
A ``stream`` unit streams to its execution device; a ``phased`` unit to its prefill device, in the
prefill only.

Copies are started a copy group ahead (a decoder layer cut into sublayer units is one group; a unit
without ``copy_group`` is a group alone): the thread runs them first in, first out, so the next
group's copies queue behind what is left of the current group's, and the streamed weights of at most
two groups are on the device at once.

"At once" on the GPU, not only in Python: a streamed unit's forward returns when its kernels are queued, and its
weights, used on the compute stream (``record_stream``), stay allocated until those kernels have run. Without a
bound the host runs ahead of the GPU and the next copies are allocated beside weights still in use: on an H200,
a Mixtral sublayer plan with six phased expert blocks of 2.6 GiB in a row peaked at 8.04 GiB against 5.94 GiB
predicted (benchmarks/phases/GPU.md), three blocks where the cost model counts two. So each streamed forward on a
GPU records an event when it ends (:meth:`Streamer.finished`), and a copy started later waits, in the prefetch
thread, for the events recorded before it was started: the group before the one that starts it has left the
device, as the cost model's schedule has it (:func:`placement_opt.solver.problem.stalls`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..plan import UnitPlacement
from .checkpoint import Slot
from .offload import SafetensorsFile

__all__ = ["DispatchUnit", "Streamer", "torch_device", "MAX_ENDED"]

#: Ended forwards' events kept for the next copy to wait for, at most (:meth:`Streamer.finished`).
MAX_ENDED = 64


def torch_device(name: str) -> torch.device:
    """A plan's device name (``"cuda:1"``, ``"cpu"``) as a ``torch.device``."""
    return torch.device(name)


@dataclass(eq=False)
class DispatchUnit:
    """One unit of a dispatched model: its placement, module, tensors and how it runs."""

    placement: UnitPlacement
    module: nn.Module
    execution: torch.device
    """Where the unit computes (in the decode, for a ``phased`` unit)."""
    prefill: torch.device | None = None
    """``phased`` only: where the unit computes in the prefill, its weights streamed there."""
    slots: list[Slot] = field(default_factory=list)
    """Tensors this unit owns (their first name is under it): placed on its storage."""
    uses: list[Slot] = field(default_factory=list)
    """Tensors its modules reference (owned or tied to another unit's): swapped when streamed."""
    kind: str = "resident"
    """``resident``, ``mmap`` (disk, CPU-executed, zero-copy), ``stream`` or ``phased``."""
    disk: list[tuple[SafetensorsFile, str]] = field(default_factory=list)
    next_unit: DispatchUnit | None = None
    """The memory-mapped unit to read ahead (kernel read-ahead, no copy) when this one starts: ``mmap``
    units, and ``phased`` disk units when they decode from the memory map."""
    ahead: tuple[DispatchUnit, ...] = ()
    """The units whose copies this one starts when it begins, in a decode (:func:`~._prefetch_links.link_groups`):
    a streamed unit alone in its copy group starts the next group's after taking its own weights; the head
    of a group of several units (:attr:`heads_group`) its own group's and the next group's, first thing."""
    ahead_prefill: tuple[DispatchUnit, ...] = ()
    """The same in a prefill, where ``phased`` units stream too."""
    heads_group: bool = False
    """First unit of a copy group of several units with copies to start: it starts :attr:`ahead` before
    anything else of its own forward, whatever its kind (its group's other units start none)."""
    again: tuple[DispatchUnit, ...] = ()
    """``(self,)`` for a unit of the only group streaming in a decode: its copy, started again once it has
    taken its weights, for the next decode step (no other group's head would start it)."""
    layer_ids: tuple[int, ...] = ()
    """``phased`` only: the KV cache layers of its attention modules (their ``layer_idx``)."""
    streams_to: torch.device = field(init=False)
    """Where :class:`Streamer` copies the weights: the prefill device of a phased unit, else the execution device."""

    def __post_init__(self) -> None:
        self.streams_to = self.prefill or self.execution

    @property
    def name(self) -> str:
        return self.placement.unit


class Streamer:
    """Copies streamed units' weights to their execution device, in one thread, in the order started."""

    def __init__(self) -> None:
        self.pool: ThreadPoolExecutor | None = None
        self.side_streams: dict[torch.device, Any] = {}
        self.inflight: dict[int, tuple[DispatchUnit, Future[tuple[list[torch.Tensor], Any]]]] = {}
        self.release_pool: ThreadPoolExecutor | None = None
        self.releasing: list[Future[None]] = []
        self.asking: list[Future[None]] = []
        """Read-aheads asked for in the background (:meth:`read_ahead`), waited for by :meth:`settle`."""
        self.ended: dict[torch.device, list[Any]] = {}
        """Per GPU, CUDA events of streamed forwards that ended there since the last copy to it started
        (:meth:`finished`): a copy waits for its own GPU's forwards only, which free the memory it takes."""
        self.ended_lock = threading.Lock()

    def _pool(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="placement_opt-prefetch")
        return self.pool

    def _side(self, device: torch.device) -> Any:
        if device not in self.side_streams:
            self.side_streams[device] = torch.cuda.Stream(device)
        return self.side_streams[device]

    def finished(self, device: torch.device) -> None:
        """A streamed unit's forward on ``device`` has been queued whole: mark its end on the compute stream, which
        the copies started from now on wait for before they allocate (the module's docstring)."""
        if device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        with self.ended_lock:
            # events on one stream end in order, so the latest ones stand for those dropped before them (one list
            # per GPU: another GPU's events, interleaved, dropped this one's and made its copies wait for them)
            self.ended[device] = [*self.ended.get(device, [])[-(MAX_ENDED - 1):], event]

    def _ended_so_far(self, device: torch.device) -> list[Any]:
        with self.ended_lock:
            return self.ended.pop(device, [])

    def _copy(self, unit: DispatchUnit, side: bool, after: Sequence[Any] = ()) -> tuple[list[torch.Tensor], Any]:
        """Copy every stored tensor of ``unit`` to the device it streams to (on a side stream if asked), once the
        forwards whose ``after`` events mark their end have run on the GPU (their weights are free then)."""
        device = unit.streams_to
        if device.type != "cuda":
            return [slot.stored.to(device, copy=True) for slot in unit.uses], None
        sources = []
        for slot in unit.uses:
            src = slot.stored
            if not src.is_pinned() and src.device.type == "cpu":
                # disk (memory map) or pageable memory: stage through pinned memory, read in this thread
                src = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src)
            sources.append(src)
        for event in after:  # the host's reads above take no GPU memory: only the device copies wait
            event.synchronize()
        if not side:
            return [src.to(device, non_blocking=False) for src in sources], None
        stream = self._side(device)
        with torch.cuda.stream(stream):
            out = [src.to(device, non_blocking=True) for src in sources]
            event = torch.cuda.Event()
            event.record(stream)
        return out, event

    def start(self, unit: DispatchUnit) -> None:
        """Begin fetching ``unit``'s weights in the background unless that is under way.

        Disk reads and GPU copies run in the prefetch thread (GPU copies on a side stream);
        a CPU-to-CPU copy gains nothing from running early and is made when taken.
        """
        if id(unit) not in self.inflight and (unit.disk or unit.streams_to.type == "cuda"):
            cuda = unit.streams_to.type == "cuda"
            after = self._ended_so_far(unit.streams_to) if cuda else []  # the group before the one starting this copy
            self.inflight[id(unit)] = (unit, self._pool().submit(self._copy, unit, cuda, after))

    def take(self, unit: DispatchUnit) -> list[torch.Tensor]:
        """The unit's weights on its device: the prefetched ones, or copied now."""
        _, future = self.inflight.pop(id(unit), (unit, None))
        tensors, event = future.result() if future is not None else self._copy(unit, side=False)
        if unit.disk:  # copied out of the memory map: its pages leave the process (during this forward)
            self.release(unit)
        if unit.streams_to.type == "cuda":
            stream = torch.cuda.current_stream(unit.streams_to)
            if event is not None:
                stream.wait_event(event)
            for tensor in tensors:
                tensor.record_stream(stream)
        return tensors

    def drop(self, unit: DispatchUnit) -> None:
        """Let go of a prefetch ``unit`` will not take (a phased unit that decodes where it is stored).

        Waits for the copy to finish, so its memory is free when this returns; a failed copy is
        forgotten with it (nothing needs those weights).
        """
        _, future = self.inflight.pop(id(unit), (unit, None))
        if future is not None:
            future.exception()
            if unit.disk:
                self.release(unit)

    def renew(self) -> None:
        """Copy again every unit whose copy is in flight: a call that starts a sequence reads its weights as
        they are now.

        A decode step starts the next step's first copies (the decode is cyclic), and they run on after the
        step returns: a weight the caller changes between calls (``load_state_dict``, a LoRA merge, a write
        into ``.data``) would reach the next call as the copy read it before. The copies in flight are waited
        for and dropped (their memory is free before the new ones are made), then started again, in order.
        """
        units = [unit for unit, _ in self.inflight.values()]
        for unit in units:
            self.drop(unit)
        for unit in units:
            self.start(unit)

    def adopt(self, slots: Sequence[Slot]) -> None:
        """Make what the caller assigned to streamed weights through ``.data = ...`` since they last computed
        (PEFT's safe LoRA merge, ``Module._apply``) their stored weights: the copies are made from it, and
        ``remove()`` leaves it in place. A streamed forward puts the stored weights back when it returns, so
        without this the assignment would be dropped there, unseen. It stays where the weights were stored (pinned
        where they were, for their copies to the GPU); copies in flight, made from the weights before, are made
        again (:meth:`renew`)."""
        for slot in slots:
            data = slot.tensor.data
            if data.data_ptr() == slot.stored.data_ptr():
                continue
            stored = data.to(slot.stored.device)
            if slot.stored.is_pinned() and not stored.is_pinned():
                stored = stored.pin_memory()
            slot.stored, slot.foreign = stored, stored.data_ptr() != data.data_ptr()
        self.renew()

    def release(self, unit: DispatchUnit) -> None:
        """Let ``unit``'s mapped pages leave the process in the background, once it has computed from them.

        Off the forward's path: checking and unmapping them costs ~2 ms per GB (:meth:`settle` waits).
        One release at a time: the one before, done while this unit computed, is waited for first; a mapped
        unit also waits for it before it starts (:mod:`._hooks`), so while a unit computes the process maps its
        pages alone (the memory model's one stream buffer of a unit streamed to the CPU).
        """
        self.settle()
        self.releasing.append(self._releaser().submit(_release_pages, unit))

    def read_ahead(self, tensors: Sequence[tuple[SafetensorsFile, str]]) -> None:
        """Ask the kernel to read these mapped tensors ahead, from the release thread.

        ``posix_fadvise`` allocates the page cache's pages and queues their reads before it returns: 18 ms of a
        73 ms cold decode step of a hidden-512, 8-layer model with every layer on disk (10 units asked for, on
        the 2-core machine of benchmarks/cost_accuracy). The unit computes meanwhile; :meth:`settle` (at the
        next mapped unit's call, and as the unit lets its pages go) waits for the asking to be done.
        """
        if tensors:
            self.asking.append(self._releaser().submit(_ask_kernel, tuple(tensors)))

    def _releaser(self) -> ThreadPoolExecutor:
        if self.release_pool is None:
            self.release_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="placement_opt-release")
        return self.release_pool

    def settle(self) -> None:
        """Wait for the pages let go in the background, so that the caller's next write to a weight is seen
        (a tensor written to is never let go) and cannot race a release; and for the read-aheads asked for."""
        releasing, self.releasing = self.asking + self.releasing, []
        self.asking = []
        for future in releasing:
            future.result()

    def close(self) -> None:
        """Wait for the copies in flight and forget them, then stop the threads. A copy in flight is the next call's,
        which will not come: its failure (a GPU out of memory after the last step) is nobody's, as :meth:`drop`
        forgets one; it raised here, in remove(), and left both threads running."""
        try:
            for _, future in self.inflight.values():
                future.exception()
            self.inflight.clear()
            self.settle()
        finally:
            for pool in (self.pool, self.release_pool):
                if pool is not None:
                    pool.shutdown(wait=True)
            self.pool = self.release_pool = None


def _ask_kernel(tensors: Sequence[tuple[SafetensorsFile, str]]) -> None:
    for file, key in tensors:
        file.prefetch((key,))


def _release_pages(unit: DispatchUnit) -> None:
    """Let go of the pages of ``unit``'s memory-mapped weights (:meth:`SafetensorsFile.release`)."""
    by_file: dict[SafetensorsFile, list[str]] = {}
    for file, key in unit.disk:
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        file.release(keys)
