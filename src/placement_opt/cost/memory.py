"""Memory: what each option holds where, per device under a placement, and what to say when it is short.

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
    from .pricing import _Parts

__all__ = ["DeviceMemory", "Violation", "WORKSPACE_FACTOR"]

#: Prefill activation workspace of a unit, in multiples of its output for all prefill tokens
#: (q/k/v, MLP intermediates and their upcasts live at the same time).
WORKSPACE_FACTOR = 6


_STREAM_BUFFERS = {"resident": 0, "stream": 2, "stream_sync": 1}


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


def _device_memory(device: Device, chosen: Sequence[_Parts]) -> DeviceMemory:
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


def _violation(memory: DeviceMemory, workload: Workload) -> Violation:
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
