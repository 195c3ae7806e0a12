"""The Plan: a frozen answer to "where does every unit live and compute, and what does it cost".

Stage 5 of the data flow. A plan is a value: it round-trips through JSON with a schema
version, and carries the solver's status, objective, bound, gap and wall time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .cost import Cost
from .devices import Machine
from .workload import Workload

__all__ = ["Plan", "UnitPlacement", "BaselineResult", "PLAN_SCHEMA_VERSION"]

PLAN_SCHEMA_VERSION = 1


def _accelerate_value(device: str) -> int | str:
    """``"cuda:1"`` -> ``1`` (accelerate's spelling); ``"cpu"`` and ``"disk"`` unchanged."""
    return int(device.split(":")[1]) if device.startswith("cuda:") else device


@dataclass(frozen=True, kw_only=True)
class UnitPlacement:
    """Where one unit's weights live (``storage``) and where it computes (``execution``)."""

    unit: str
    storage: str
    execution: str
    mode: str
    """``resident``, ``stream`` or ``stream_sync`` (see :data:`placement_opt.problem.MODES`)."""


@dataclass(frozen=True, kw_only=True)
class BaselineResult:
    """How one baseline strategy scored on the same cost model."""

    strategy: str
    total_s: float
    fits: bool
    short_bytes: int = 0
    """Bytes over capacity summed over devices (0 when it fits)."""
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Storage and execution device of every unit, with its cost and the solver's report."""

    model_name: str
    dtype: str
    objective: str
    """``"latency"``, ``"throughput"`` or ``"memory"``."""
    strategy: str
    """``"cpsat"``, ``"sequential"``, ``"balanced"``, ``"balanced_low_0"`` or ``"accelerate"``."""
    placements: tuple[UnitPlacement, ...]
    """One per unit, in execution order."""
    machine: Machine
    workload: Workload
    cost: Cost
    status: str
    """``"OPTIMAL"``, ``"FEASIBLE"`` (CP-SAT) or ``"GREEDY"`` (a baseline)."""
    objective_value: float
    """The objective in seconds (latency, slowest stage) or bytes (memory)."""
    best_bound: float
    """Proven lower bound of the objective, same unit."""
    gap: float
    """``(objective - bound) / objective``: 0.0 means proven optimal."""
    solve_time_s: float
    baselines: tuple[BaselineResult, ...] = ()
    notes: tuple[str, ...] = ()
    """Things the user should know (coarsening, pins, training offload, distributed context)."""
    schema_version: int = PLAN_SCHEMA_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    # -- maps in accelerate's vocabulary --------------------------------------------------
    @property
    def device_map(self) -> dict[str, int | str]:
        """Storage device per unit, valid as ``from_pretrained(device_map=...)``/``dispatch_model``."""
        return {p.unit: _accelerate_value(p.storage) for p in self.placements}

    @property
    def execution_map(self) -> dict[str, str]:
        """Execution device per unit (``"cuda:0"``, ``"cpu"``)."""
        return {p.unit: p.execution for p in self.placements}

    @property
    def max_memory(self) -> dict[int | str, int]:
        """The capacities the plan was solved for, as an accelerate ``max_memory`` dict."""
        return self.machine.max_memory

    @property
    def streams_weights(self) -> bool:
        """True when some unit computes away from its storage: needs placement_opt's dispatcher."""
        return any(p.storage != p.execution for p in self.placements)

    def placement(self, unit: str) -> UnitPlacement:
        for p in self.placements:
            if p.unit == unit:
                return p
        raise KeyError(f"unit {unit!r} is not in this plan")

    # -- serialising --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model_name": self.model_name,
            "dtype": self.dtype,
            "objective": self.objective,
            "strategy": self.strategy,
            "placements": [vars(p).copy() for p in self.placements],
            "machine": self.machine.to_dict(),
            "workload": self.workload.to_dict(),
            "cost": self.cost.to_dict(),
            "status": self.status,
            "objective_value": self.objective_value,
            "best_bound": self.best_bound,
            "gap": self.gap,
            "solve_time_s": self.solve_time_s,
            "baselines": [vars(b).copy() for b in self.baselines],
            "notes": list(self.notes),
            "extra": dict(self.extra),
        }

    def to_json(self, path: str | None = None) -> str:
        """The plan as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        return text

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        version = data.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise ValueError(
                f"plan schema version {version!r} is not supported (this placement_opt reads "
                f"version {PLAN_SCHEMA_VERSION}): solve the plan again with this version"
            )
        return cls(
            model_name=data["model_name"],
            dtype=data["dtype"],
            objective=data["objective"],
            strategy=data["strategy"],
            placements=tuple(UnitPlacement(**p) for p in data["placements"]),
            machine=Machine.from_dict(data["machine"]),
            workload=Workload.from_dict(dict(data["workload"])),
            cost=Cost.from_dict(data["cost"]),
            status=data["status"],
            objective_value=float(data["objective_value"]),
            best_bound=float(data["best_bound"]),
            gap=float(data["gap"]),
            solve_time_s=float(data["solve_time_s"]),
            baselines=tuple(BaselineResult(**b) for b in data.get("baselines", [])),
            notes=tuple(data.get("notes", [])),
            extra=dict(data.get("extra", {})),
        )

    @classmethod
    def from_json(cls, text_or_path: str) -> Plan:
        """Read a plan from JSON text or from a file path."""
        text = text_or_path
        if not text_or_path.lstrip().startswith("{"):
            with open(text_or_path, encoding="utf-8") as fh:
                text = fh.read()
        return cls.from_dict(json.loads(text))
