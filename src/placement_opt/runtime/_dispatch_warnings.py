"""The warnings :func:`~.dispatcher.dispatch` gives about a plan it runs: what the run holds that the plan does not
charge, and where a disk option does not reach.

Each says what, how much, and the way out; none changes what dispatch does.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..plan import Plan
from ..units import format_bytes
from ._streamer import DispatchUnit
from .allocator import glibc_heap, mmap_threshold_fixed
from .cuda_allocator import expandable_segments

__all__ = ["warn_mapped_phased", "warn_copy_headroom", "warn_cpu_heap", "warn_gpu_segments", "HEAP_WARN_MIN_BYTES"]


def warn_mapped_phased(units: list[DispatchUnit], disk_reads: str) -> None:
    """``disk_reads="copy"`` does not reach phased disk units: their decode reads the memory map."""
    mapped = [u.name for u in units if u.kind == "phased" and u.placement.storage == "disk"]
    if disk_reads == "copy" and mapped:
        shown = ", ".join(mapped[:3]) + (f" and {len(mapped) - 3} more" if len(mapped) > 3 else "")
        warnings.warn(
            f"disk_reads='copy' does not apply to phased units: {len(mapped)} disk-stored phased unit(s) "
            f"({shown}) decode from the memory map. To copy every disk read, plan without phased units: "
            f"solve(..., modes=('resident', 'stream'))", UserWarning, stacklevel=4)


def _cpu_memory(plan: Plan) -> Any:
    """The plan's memory row of the CPU (a :class:`~..cost.memory.DeviceMemory`), or None without one."""
    return next((m for m in plan.cost.memory if m.device == "cpu"), None)


def warn_copy_headroom(units: list[DispatchUnit], plan: Plan) -> None:
    """``disk_reads="copy"`` holds the next disk unit's copy beside the running one's, which the plan's memory
    does not charge (it prices memory-mapped reads: one copy): say so when the plan's free RAM cannot hold it."""
    copied = {u.name: sum(s.tensor.nbytes for s in u.slots) for u in units
              if u.kind == "stream" and u.placement.storage == "disk" and u.execution.type == "cpu"}
    cpu = _cpu_memory(plan)
    if not copied or cpu is None:
        return
    largest = max(copied, key=copied.__getitem__)
    extra, free = copied[largest], cpu.free_bytes
    if extra > free:
        warnings.warn(
            f"disk_reads='copy' holds up to {format_bytes(extra)} of RAM more than the plan charges (the next disk "
            f"unit's copy, {largest!r} the largest, beside the running one's), and the plan leaves "
            f"{format_bytes(max(free, 0))} of the cpu's {format_bytes(cpu.capacity_bytes)} free: use "
            f"disk_reads='mmap', or plan with {format_bytes(extra - free)} less cpu memory", UserWarning,
            stacklevel=4)


#: Activations and KV cache on the CPU below which a tight plan is not warned about glibc's heap: what the heap
#: can hold again is then within the few MiB of library scratch that decide such rows anyway
#: (benchmarks/cost_accuracy/MEMORY.md: rows under ~60 MiB sit at the measurement floor either way).
HEAP_WARN_MIN_BYTES = 64 * 2**20


def warn_cpu_heap(units: list[DispatchUnit], plan: Plan) -> None:
    """Where the plan leaves the cpu less free RAM than a forward's activations and KV cache there, glibc's
    default heap, which can hold about that much again (:mod:`.allocator`), may run it out: say how to fix it."""
    cpu = _cpu_memory(plan)
    if cpu is None or mmap_threshold_fixed() is not None or not glibc_heap():
        return
    if not any(u.execution.type == "cpu" for u in units):  # phased units too: they decode there
        return
    live, free = cpu.workspace_bytes + cpu.kv_cache_bytes, cpu.free_bytes
    if live > max(free, HEAP_WARN_MIN_BYTES):
        warnings.warn(
            f"the plan leaves {format_bytes(max(free, 0))} of the cpu's {format_bytes(cpu.capacity_bytes)} free, less than "
            f"the {format_bytes(live)} of activations and KV cache it computes there, and glibc's default heap can "
            f"hold up to about that much again during a forward: call "
            f"placement_opt.runtime.allocator.fix_mmap_threshold() once before the first forward (about 5-18 % slower "
            f"CPU forwards), or plan with a smaller cpu budget", UserWarning, stacklevel=4)


def warn_gpu_segments(plan: Plan) -> None:
    """Where the plan leaves a GPU less free memory than the activations and streamed weights it computes there
    allocate and free, PyTorch's default CUDA allocator, whose split segments can hold about that much again
    (:mod:`.cuda_allocator`), may run it out: say how to fix it."""
    if expandable_segments():
        return
    tight = [m for m in plan.cost.memory if m.device.startswith("cuda")
             and m.free_bytes < m.workspace_bytes + m.stream_buffer_bytes]
    if not tight:
        return
    shown = "; ".join(f"{m.device}: {format_bytes(max(m.free_bytes, 0))} of {format_bytes(m.capacity_bytes)} free, "
                      f"{format_bytes(m.workspace_bytes + m.stream_buffer_bytes)} allocated and freed" for m in tight)
    warnings.warn(
        f"the plan leaves a GPU less free memory than what it allocates and frees there ({shown}), and PyTorch's "
        f"default CUDA allocator can hold up to about that much again in split segments (measured: 2.81 GiB beside "
        f"6.35 GiB allocated under a 10 GiB cap): set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the "
        f"environment before the process first uses CUDA (the placement-opt command does), or plan with a smaller "
        f"GPU budget", UserWarning, stacklevel=4)
