"""The cost model: what every placement option of every unit costs in time and memory.

Stage 3 of the data flow: ``LayerGraph`` + ``Machine`` + ``Workload`` -> ``PlacementProblem``
(plain integers for the solvers), and ``evaluate`` -> ``Cost`` for any plan or device_map.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .workload import Workload

__all__ = ["UnitCost", "DeviceMemory", "Violation", "Cost"]


@dataclass(frozen=True, kw_only=True)
class UnitCost:
    """Where one unit sits and what it costs there."""

    name: str
    storage: str
    execution: str
    mode: str
    prefill_s: float
    """Time in the prefill, weight copies included."""
    decode_s: float
    """Time summed over every decode step."""
    stored_bytes: int
    resident_bytes: int
    peak_bytes: int


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


@dataclass(frozen=True, kw_only=True)
class Cost:
    """The price of a placement: time per phase, memory per device, every capacity violation."""

    workload: Workload
    prefill_s: float
    decode_s: float
    transfer_s: float
    """Activation transfers between devices, included in the phase times."""
    stage_s: Mapping[str, float]
    """Total work per execution device: the pipeline stage times."""
    units: tuple[UnitCost, ...]
    memory: tuple[DeviceMemory, ...]
    violations: tuple[Violation, ...] = ()

    @property
    def total_s(self) -> float:
        """Latency of the whole workload: prefill plus every decode step."""
        return self.prefill_s + self.decode_s

    @property
    def fits(self) -> bool:
        return not self.violations

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second over the decode phase (all sequences of the batch)."""
        tokens = self.workload.batch_size * self.workload.new_tokens
        return tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second, prefill included (what a user waits for)."""
        tokens = self.workload.batch_size * max(self.workload.new_tokens, 1)
        return tokens / self.total_s if self.total_s > 0 else 0.0

    def device_memory(self, device: str) -> DeviceMemory:
        return next(m for m in self.memory if m.device == device)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stage_s"] = dict(self.stage_s)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cost:
        return cls(
            workload=Workload.from_dict(dict(data["workload"])),
            prefill_s=float(data["prefill_s"]),
            decode_s=float(data["decode_s"]),
            transfer_s=float(data["transfer_s"]),
            stage_s=dict(data["stage_s"]),
            units=tuple(UnitCost(**u) for u in data["units"]),
            memory=tuple(DeviceMemory(**m) for m in data["memory"]),
            violations=tuple(Violation(**v) for v in data["violations"]),
        )
