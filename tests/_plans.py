"""A hand-made plan with costs, for the tests of reports, tables and pictures (no solver, no torch).

Test modules import from here, never from each other.
"""

from __future__ import annotations

from placement_opt.cost.evaluate import Cost, UnitCost
from placement_opt.cost.memory import DeviceMemory, Violation
from placement_opt.cost.workload import Workload
from placement_opt.hardware.resolve import parse_device_spec
from placement_opt.plan import Plan, UnitPlacement
from placement_opt.units import GIB, MIB

__all__ = ["MACHINE", "WORKLOAD", "report_plan"]

MACHINE = parse_device_spec("cuda:0=a100-40gb,cpu=64GiB,disk=nvme-gen4")
WORKLOAD = Workload(batch_size=1, prompt_len=512, new_tokens=16)


def report_plan(*, strategy: str = "cpsat", total_s: float = 2.0, over_bytes: int = 0,
              n_layers: int = 8) -> Plan:
    """A hand-made plan: embed + n layers + head; the last 3 layers are streamed from the CPU.

    Sizes: 1 GiB per layer; cuda:0 holds embed (0.5 GiB) + 5 layers + head (0.5 GiB) = 6 GiB.
    """
    names = ["embed"] + [f"layers.{i}" for i in range(n_layers)] + ["head"]
    placements, units = [], []
    for i, name in enumerate(names):
        streamed = name.startswith("layers.") and i > n_layers - 3
        storage, mode = ("cpu", "stream") if streamed else ("cuda:0", "resident")
        placements.append(UnitPlacement(unit=name, storage=storage, execution="cuda:0", mode=mode))
        units.append(UnitCost(name=name, storage=storage, execution="cuda:0", mode=mode,
                              prefill_s=total_s / len(names) / 2, decode_s=total_s / len(names) / 2,
                              stored_bytes=GIB, resident_bytes=0, peak_bytes=0))
    capacity = 39 * GIB
    gpu_used = capacity + over_bytes
    memory = (
        DeviceMemory(device="cuda:0", capacity_bytes=capacity, reserve_bytes=GIB,
                     weights_bytes=gpu_used - 3 * GIB - 512 * MIB, kv_cache_bytes=2 * GIB,
                     workspace_bytes=GIB, stream_buffer_bytes=512 * MIB),
        DeviceMemory(device="cpu", capacity_bytes=64 * GIB, reserve_bytes=0, weights_bytes=3 * GIB,
                     kv_cache_bytes=0, workspace_bytes=0, stream_buffer_bytes=0),
        DeviceMemory(device="disk", capacity_bytes=2 * 10**12, reserve_bytes=0, weights_bytes=0,
                     kv_cache_bytes=0, workspace_bytes=0, stream_buffer_bytes=0),
    )
    violations = ()
    if over_bytes:
        violations = (Violation(device="cuda:0", needed_bytes=gpu_used, capacity_bytes=capacity,
                                message=f"cuda:0 needs {over_bytes} more bytes"),)
    cost = Cost(workload=WORKLOAD, prefill_s=total_s / 2, decode_s=total_s / 2, transfer_s=0.0,
                stage_s={"cuda:0": total_s}, units=tuple(units), memory=memory, violations=violations)
    return Plan(model_name="tiny-test", dtype="float16", objective="latency", strategy=strategy,
                placements=tuple(placements), machine=MACHINE, workload=WORKLOAD, cost=cost,
                status="OPTIMAL" if strategy == "cpsat" else "GREEDY", objective_value=total_s,
                best_bound=total_s, gap=0.0, solve_time_s=0.1)
