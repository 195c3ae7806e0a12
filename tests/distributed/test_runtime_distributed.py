"""A real 2-process run on CPU: torch.distributed with gloo on localhost, bounded time.

Each rank detects its context, resolves ``device_map="auto"``, and solves a small chain graph for
its own devices: the rank's own GPU (a simulated 2-GPU host: the GPUs are described by presets, so
no GPU is needed) plus half of the host's CPU RAM and disk; and, with the real context of this
machine (no GPU), for its detected CPU share. Every plan must be local and valid, and the two
ranks must agree, through ``all_gather_object``, on the model's total size.

Two launches: as torchrun does it (rank variables in the environment) and as ``mp.spawn`` does it
(no variables; ranks given to ``init_process_group``, so the context comes from torch.distributed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 60

# Six 512 MiB fp16 units = 3 GiB; each rank has 1 GiB usable on its GPU and 3 GiB of the host's
# 6 GiB of RAM, so a valid local plan needs both, and nothing fits without the CPU share.
WORKER = r'''
import json, sys
from datetime import timedelta

import torch.distributed as dist

launch, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if launch == "torchrun":
    dist.init_process_group("gloo", timeout=timedelta(seconds=45))
else:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=45))

import placement_opt
from placement_opt.hardware import detect
from placement_opt.cost.evaluate import evaluate
from placement_opt.errors import PlacementError
from placement_opt.model.graph import chain_graph
from placement_opt.distributed.context import detect_context
from placement_opt.distributed.rules import resolve_device_map

MIB = 2**20
graph = chain_graph([{"name": f"layers.{i}", "param_bytes": 512 * MIB, "flops_per_token": 2**30,
                      "out_bytes_per_token": 8192} for i in range(6)])

def check(plan):
    names = [p.unit for p in plan.placements]
    assert sorted(names) == sorted(graph.names()), names
    used = {d for p in plan.placements for d in (p.storage, p.execution)}
    assert used <= set(plan.machine.names), (used, plan.machine.names)
    cost = evaluate(plan, graph, plan.machine)             # re-priced independently of the solver
    assert cost.fits, [v.message for v in cost.violations]
    return sorted(used), sum(m.weights_bytes for m in cost.memory)

# 1. This machine as it is (no GPU): every call detects the context itself.
real = detect_context()
result = {"rank": rank, "kind": real.kind, "world_size": real.world_size, "local_device": real.local_device,
          "auto": resolve_device_map("auto")}
cpu_plan = placement_opt.solve(graph, None, time_limit_s=10)   # detects this rank's RAM and disk share
result["cpu_plan_devices"], cpu_weights = check(cpu_plan)
result["cpu_notes"] = list(cpu_plan.notes)

# 2. A 2-GPU host, simulated: torch would report two GPUs; the GPUs are described by presets.
detect.cuda_device_count = lambda: 2
result["auto_gpu"] = resolve_device_map("auto")
try:
    placement_opt.solve(graph, "cuda:0=t4/2GiB,cuda:1=t4/2GiB,cpu=6GiB,disk=100GB", time_limit_s=10)
except PlacementError as err:
    result["cross_rank_error"] = str(err)
plan = placement_opt.solve(graph, f"cuda:{rank}=t4/2GiB,cpu=6GiB,disk=100GB", time_limit_s=10)
result["gpu_plan_devices"], weights = check(plan)
result["gpu_machine"] = {d.name: d.memory_bytes for d in plan.machine.devices}
result["gpu_notes"] = list(plan.notes)
again = placement_opt.solve(graph, plan.machine, time_limit_s=10)  # a local machine is not divided twice
result["again_machine"] = {d.name: d.memory_bytes for d in again.machine.devices}

sizes = [None, None]
dist.all_gather_object(sizes, (graph.total_param_bytes, weights, cpu_weights))
result["sizes"] = sizes
dist.barrier()
dist.destroy_process_group()
print("RESULT " + json.dumps(result))
'''


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(launch: str) -> list[dict]:
    port = _free_port()
    base = {k: v for k, v in os.environ.items()
            if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_FSDP",
                         "ACCELERATE_USE_DEEPSPEED", "CUDA_VISIBLE_DEVICES")}
    base.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = []
    for rank in range(2):
        env = dict(base)
        if launch == "torchrun":
            env.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, launch, str(rank), str(port)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.communicate()
        pytest.fail(f"the 2-process run did not finish in {TIMEOUT_S} s")
    results = []
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"rank failed (exit {proc.returncode}):\n{err[-4000:]}"
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    return results


@pytest.mark.parametrize("launch", ["torchrun", "spawn"])
def test_two_ranks_plan_locally_and_agree(launch: str) -> None:
    results = _launch(launch)
    gib = 2**30
    for rank, res in enumerate(results):
        assert res["rank"] == rank
        assert (res["kind"], res["world_size"], res["local_device"]) == ("ddp", 2, "cpu")
        # TRL's rule, DDP flavour: one full replica per rank, on the rank's own device.
        assert res["auto"] == {"": "cpu"}
        assert res["auto_gpu"] == {"": f"cuda:{rank}"}
        # solve() itself honours the context: a plan for the rank's share of this host...
        assert set(res["cpu_plan_devices"]) <= {"cpu", "disk"}
        assert res["cpu_notes"][0].startswith(f"planned for rank {rank} of 2 (DDP) only: no GPU, cpu ")
        # ...an error when asked to split over both ranks' GPUs...
        assert res["cross_rank_error"].startswith(
            f"rank {rank} of 2 (DDP) owns cuda:{rank} but the machine lists cuda:0, cuda:1: in a "
            f"distributed run each rank plans for its own device")
        # ...and, given the rank's own GPU, half of the host's 6 GiB and 100 GB, never more.
        assert res["gpu_machine"] == {f"cuda:{rank}": 2 * gib, "cpu": 3 * gib, "disk": 50 * 10**9}
        assert res["again_machine"] == res["gpu_machine"]
        assert set(res["gpu_plan_devices"]) <= {f"cuda:{rank}", "cpu", "disk"}
        assert {f"cuda:{rank}", "cpu"} <= set(res["gpu_plan_devices"])  # 3 GiB needs both
        assert res["gpu_notes"][0].startswith(f"planned for rank {rank} of 2 (DDP) only: cuda:{rank}, "
                                              f"cpu 3.00 GiB")
    # Both ranks gathered the same sizes, and every plan stores the whole model: 6 x 512 MiB.
    assert results[0]["sizes"] == results[1]["sizes"]
    for total, gpu_weights, cpu_weights in results[0]["sizes"]:
        assert total == gpu_weights == cpu_weights == 3 * gib
