"""Memory: what each option holds where, per device under a placement, and what to say when it is short
(one device over capacity: :func:`violation`; no placement fits at all: :func:`shortage_message`).

Memory per option (priced in :mod:`.pricing`): ``stored_bytes`` on S (parameters and buffers;
training: gradients and optimizer states, which stay where the weights live), ``resident_bytes``
on E (KV cache for ``batch x (prompt + new)`` tokens; training: saved activations), ``peak_bytes``
on E (prefill activation workspace plus the stream buffer: x2 for ``stream``, whose next unit is
prefetched).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..units import format_bytes
from .workload import Workload

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware.devices import Device
    from ..model.graph import LayerGraph
    from ..solver.problem import PlacementProblem
    from .pricing import OptionPrice

__all__ = ["DeviceMemory", "Violation", "WORKSPACE_FACTOR", "STREAM_BUFFERS", "device_memory", "violation",
           "shortage_message"]

#: Prefill activation workspace of a unit, in multiples of its output for all prefill tokens
#: (q/k/v, MLP intermediates and their upcasts live at the same time).
WORKSPACE_FACTOR = 6


#: Copies of a unit's weights its stream buffer holds, by mode (``stream`` prefetches the next unit).
STREAM_BUFFERS = {"resident": 0, "stream": 2, "stream_sync": 1}


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """Memory of one device under a placement, by what it holds."""

    device: str
    capacity_bytes: int
    """Bytes the plan may use: memory less the reserve."""
    reserve_bytes: int
    """Kept free for the CUDA context and allocator slack (not part of ``capacity_bytes``)."""
    weights_bytes: int
    """Parameters and buffers stored here."""
    kv_cache_bytes: int
    """KV cache of the attention units executed here, for batch x (prompt + new tokens)."""
    workspace_bytes: int
    """Peak activation workspace of the units executed here (the largest one, in the prefill)."""
    stream_buffer_bytes: int
    """Buffer that streamed weights pass through (prefetch included), at its peak."""
    other_bytes: int = 0
    """Anything else the memory model charges here (training states)."""

    @property
    def used_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + self.workspace_bytes
                + self.stream_buffer_bytes + self.other_bytes)

    @property
    def free_bytes(self) -> int:
        """Negative when the device is over capacity."""
        return self.capacity_bytes - self.used_bytes


@dataclass(frozen=True, kw_only=True)
class Violation:
    """One device over capacity."""

    device: str
    needed_bytes: int
    capacity_bytes: int
    message: str
    """Says what is short, by how much, what takes the space, and what to do."""

    @property
    def short_bytes(self) -> int:
        return self.needed_bytes - self.capacity_bytes


def device_memory(device: Device, chosen: Sequence[OptionPrice]) -> DeviceMemory:
    """What ``device`` holds when the units take the ``chosen`` options, split by kind."""
    stored = [p for p in chosen if p.storage == device.name]
    executed = [p for p in chosen if p.execution == device.name]
    peak = max(executed, key=lambda p: p.workspace_bytes + p.stream_buffer_bytes, default=None)
    return DeviceMemory(
        device=device.name, capacity_bytes=device.usable_bytes, reserve_bytes=device.reserve_bytes,
        weights_bytes=sum(p.weights_bytes for p in stored),
        kv_cache_bytes=sum(p.kv_cache_bytes for p in executed),
        workspace_bytes=peak.workspace_bytes if peak else 0,
        stream_buffer_bytes=peak.stream_buffer_bytes if peak else 0,
        other_bytes=sum(p.stored_other_bytes for p in stored) + sum(p.resident_other_bytes for p in executed),
    )


_ADVICE = {
    "gpu": "raise max_memory, add 'cpu'/'disk' to the devices, or reduce the batch or context",
    "cpu": "raise the CPU's max_memory, add 'disk' to the devices, or reduce the batch or context",
    "disk": "free disk space or point the offload folder at a larger disk",
}


def violation(memory: DeviceMemory, workload: Workload) -> Violation:
    """The message for a device over capacity: how much is short, what takes the space, what to do."""
    need, has = memory.used_bytes, memory.capacity_bytes
    parts = [("weights", memory.weights_bytes),
             (f"KV cache for batch {workload.batch_size} x {workload.context_len} tokens", memory.kv_cache_bytes),
             (f"activation workspace for {workload.batch_size} x {workload.prompt_len} prompt tokens",
              memory.workspace_bytes),
             ("stream buffer", memory.stream_buffer_bytes),
             ("gradients, optimizer states and saved activations" if workload.training else "other",
              memory.other_bytes)]
    split = ", ".join(f"{label} {format_bytes(n)}" for label, n in parts if n > 0)
    kind = "gpu" if memory.device.startswith("cuda:") else memory.device
    message = (f"{memory.device} needs {format_bytes(need)}, has {format_bytes(has)} "
               f"({format_bytes(need - has)} short): {split}: {_ADVICE[kind]}")
    return Violation(device=memory.device, needed_bytes=need, capacity_bytes=has, message=message)


def shortage_message(problem: PlacementProblem, graph: LayerGraph, workload: Workload) -> str:
    """Which capacity is short, by how much, and what takes the space."""
    lines = []
    compute = [d for d in problem.devices if d.kind != "disk"]
    least = [min(o.stored_bytes + o.resident_bytes for o in u.options) for u in problem.units]
    resident = [min(o.resident_bytes for o in u.options) for u in problem.units]
    peak = max((min(o.peak_bytes for o in u.options) for u in problem.units), default=0)
    need_all = sum(least) + peak
    have_all = sum(d.capacity_bytes for d in problem.devices)
    need_compute, have_compute = sum(resident) + peak, sum(d.capacity_bytes for d in compute)
    kv = sum(u.kv_bytes_per_token for u in graph.units()) * workload.batch_size * workload.context_len
    weights = sum(least) - sum(resident)
    kv_why = f"the KV cache for batch {workload.batch_size} x {workload.context_len} tokens alone is {format_bytes(kv)}"
    weights_why = f"the weights alone are {format_bytes(weights)}"
    kv_part = f"the KV cache for batch {workload.batch_size} x {workload.context_len} tokens {format_bytes(kv)}"
    why = kv_why if kv >= weights else weights_why + (f" ({kv_part})" if kv else "")  # the bigger one first
    if need_all > have_all:
        lines.append(f"needs {format_bytes(need_all - have_all)} more across {', '.join(d.name for d in problem.devices)}; "
                     f"{why}; add a disk device or more memory, or reduce the batch or context")
    elif need_compute > have_compute:
        lines.append(f"needs {format_bytes(need_compute - have_compute)} more on the compute devices "
                     f"({', '.join(d.name for d in compute)}), which must hold the KV cache and workspace; {why}; "
                     f"reduce the batch or context, or add GPU/CPU memory")
    top = max(problem.devices, key=lambda d: d.capacity_bytes)
    big = [(u.name, m) for u, m in zip(problem.units, least, strict=True) if m > top.capacity_bytes]
    if big:
        name, m = max(big, key=lambda t: t[1])
        lines.append(f"unit {name} alone needs {format_bytes(m)}, more than the largest device ({top.name}, "
                     f"{format_bytes(top.capacity_bytes)}): give that device more memory")
    if not lines:
        extra = [("pins", bool(problem.pins)), ("tied groups", bool(problem.tied_groups)),
                 ("contiguous ranges", problem.contiguous)]
        blamed = [name for name, on in extra if on]
        lines.append(f"the total memory suffices ({format_bytes(need_all)} needed at least, {format_bytes(have_all)} "
                     f"available) but no assignment fits every device"
                     + (f" under the {', '.join(blamed)}: relax them" if blamed else
                        ": the per-device split of weights, KV cache and workspace does not work out; add memory"))
    return "no placement fits: " + "; ".join(lines)
