"""Expert groups (issue 15): each MoE layer's experts cut into N units, estimated by the cost model.

For Mixtral-8x7B at a 24 GiB GPU budget and Qwen1.5-MoE-A2.7B at 8 GiB, on the H100 host's measured profile
(``run.py``'s ``h100-host`` machine), the sublayer plan is solved with ``expert_groups`` 1 (a layer's experts one
unit, as before), 2 and 4, at two time limits, side by side in one run. A layer's groups placed together cost a
little more than its experts unit there (each group away from home pays its own round trip), and the search starts
from the problem with the groups merged back; the bound column says what is proven. Nothing runs here; the figures
are the cost model's.

Usage::

    python benchmarks/phases/groups.py     # writes GROUPS.md here (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from run import _h100_host, _qwen_moe_config

HERE = Path(__file__).resolve().parent
CASES = (("mixtral-8x7b", "24GiB"), ("qwen1.5-moe-a2.7b", "8GiB"))
WORKLOADS = ((1, 512, 32), (16, 512, 32))
GROUPS = (1, 2, 4)
LIMITS_S = (2.0, 10.0)


def _graph(name: str, groups: int):
    from placement_opt import trace
    from placement_opt.model import catalog

    config = _qwen_moe_config() if name.startswith("qwen1.5-moe") else catalog.model_config(name)
    return trace(config, dtype="bfloat16", granularity="sublayer", expert_groups=groups)


def _split_layers(plan) -> tuple[int, int]:
    """(layers whose experts compute on two devices in the decode, groups computed on the GPU in the decode)."""
    from placement_opt.model.expert_groups import whole_experts

    devices: dict[str, set[str]] = {}
    on_gpu = 0
    for p in plan.placements:
        if (parsed := whole_experts(p.unit)) is not None:
            devices.setdefault(parsed[0], set()).add(p.execution)
            on_gpu += p.execution.startswith("cuda")
    return sum(len(d) > 1 for d in devices.values()), on_gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE / "GROUPS.md"))
    args = parser.parse_args()
    from placement_opt import Workload, solve

    lines = ["| model | GPU budget | batch x prompt + new | expert groups | units | limit | total s | decode tok/s | "
             "bound s | gap | solve s | layers split | GPU groups |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, budget in CASES:
        machine = _h100_host(budget)
        for groups in GROUPS:
            graph = _graph(name, groups)
            for batch, prompt, new in WORKLOADS:
                workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new, overlap=True)
                for limit in LIMITS_S:
                    started = time.perf_counter()
                    plan = solve(graph, machine, workload=workload, time_limit_s=limit)
                    took = time.perf_counter() - started
                    split, on_gpu = _split_layers(plan)
                    row = (f"| {name} | {budget} | {batch} x {prompt} + {new} | {groups} | {len(graph)} | {limit:g} s | "
                           f"{plan.cost.total_s:.3f} | {plan.cost.decode_tokens_per_s:.2f} | {plan.best_bound:.3f} | "
                           f"{plan.gap:.1%} | {took:.1f} | {split if groups > 1 else '-'} | "
                           f"{on_gpu if groups > 1 else '-'} |")
                    print(row, flush=True)
                    lines.append(row)
    header = [f"# Expert groups, estimated ({platform.node()}, {time.strftime('%Y-%m-%d')})", "",
              "`python benchmarks/phases/groups.py`: the H100 host's profile (`h100-host` in run.py), overlap on, "
              "sublayer graphs; one solve per row, two CPU workers. `layers split`: layers whose experts compute on "
              "the GPU and the CPU in the decode; `GPU groups`: groups computed on the GPU in the decode.", ""]
    Path(args.out).write_text("\n".join(header + lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
