"""Do the solver's own plans run as predicted, and does the granularity it prefers run faster here?

``run.py`` prices placements written by hand. This script lets ``placement_opt.solve`` choose them, on this
machine's CPU and disk, with CPU RAM too small for the model, after ``calibrate(..., granularity="auto")``
(and ``expert_groups=2`` for the MoE model): one plan per granularity (``block``: decoder layers whole;
``sublayer``: attention, MLP or experts apart; ``groups``: the experts in 2 groups), each dispatched with
``placement_opt.dispatch`` and timed as ``run.py`` times its rows (the median of ``--repeats`` prefills and of
``--steps`` decode steps, every offloaded file evicted from the page cache before each forward). The question
is issue 15's: are the finer units worth what the cost model says on this machine, and does the predicted
order of the plans hold?

Usage::

    python benchmarks/cost_accuracy/solved.py            # writes benchmarks/cost_accuracy/SOLVED.md
    python benchmarks/cost_accuracy/solved.py --quick    # the MoE model only, fewer steps
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import MOE_GROUPS, build, config_of, run_placement_opt, scratch, timed  # noqa: E402

HERE = Path(__file__).resolve().parent
#: Model -> the share of its weights that CPU RAM may hold (the rest must go to disk).
RAM_SHARE = {"mid": 0.6, "moe": 0.5}


def plans_of(shape: str, folder: Path, budget: dict[str, str], workload: Any, limit_s: float) -> dict[str, Any]:
    """Granularity -> the plan ``solve`` makes for the calibrated model."""
    import placement_opt

    cuts = {"block": {"granularity": "block"}, "sublayer": {"granularity": "sublayer"}}
    if shape == "moe":
        cuts["groups"] = {"granularity": "sublayer", "expert_groups": MOE_GROUPS}
    return {name: placement_opt.solve(str(folder), budget, workload=workload, time_limit_s=limit_s, **how)
            for name, how in cuts.items()}


def where(plan: Any) -> str:
    """How many units of each kind are stored on disk, e.g. ``6 mlp, 2 self_attn of 36 on disk``."""
    kinds: dict[str, int] = {}
    for p in plan.placements:
        if p.storage == "disk":
            last = p.unit.rsplit(".", 1)[-1]
            kind = "expert group" if ".groups." in p.unit else "layer" if last.isdigit() else last
            kinds[kind] = kinds.get(kind, 0) + 1
    said = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "nothing"
    return f"{said} of {len(plan.placements)} units on disk"


def bench(shape: str, args: argparse.Namespace, work: Path) -> list[str]:
    import placement_opt
    from placement_opt.cost.workload import Workload
    from placement_opt.units import format_bytes

    config = config_of(shape, None)
    folder = work / shape
    model = build(config, folder)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = {"cpu": int(weights * RAM_SHARE[shape]), "disk": "100GiB"}
    workload = Workload(batch_size=1, prompt_len=args.prompt, new_tokens=args.steps)
    started = time.perf_counter()
    placement_opt.calibrate(folder, ["cpu", "disk"], workload=workload, dtype="float32", granularity="auto",
                            offload_dir=work)
    if shape == "moe":
        placement_opt.calibrate(folder, ["cpu", "disk"], workload=workload, dtype="float32",
                                granularity="sublayer", expert_groups=MOE_GROUPS, offload_dir=work)
    calibrated_s = time.perf_counter() - started
    plans = plans_of(shape, folder, budget, workload, args.time_limit)
    rows = []
    for name, plan in plans.items():
        prefill, decode, _ = timed(run_placement_opt, model, plan, work / "offload" / f"{shape}-{name}", args)
        rows.append((name, plan, statistics.median(prefill), statistics.median(decode)))
        print(f"{shape} {name}: predicted {plan.cost.prefill_s:.4f} / {plan.cost.decode_s / args.steps:.4f}, "
              f"measured {rows[-1][2]:.4f} / {rows[-1][3]:.4f}", flush=True)
    lines = [f"### `{shape}`: {format_bytes(weights)} of fp32 weights, CPU RAM {format_bytes(budget['cpu'])}, "
             "disk beside",
             "", f"Calibrated in {calibrated_s:.1f} s; each plan solved in up to {args.time_limit:g} s.", "",
             "| granularity | plan | gap | predicted prefill s | measured | ratio | predicted decode step s | measured "
             "| ratio | predicted total s | measured total s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, plan, pre, dec in rows:
        step = plan.cost.decode_s / args.steps
        lines.append(f"| {name} | {where(plan)} | {plan.gap:.1%} | {plan.cost.prefill_s:.4f} | {pre:.4f} | "
                     f"{plan.cost.prefill_s / pre:.2f} | {step:.4f} | {dec:.4f} | {step / dec:.2f} | "
                     f"{plan.cost.total_s:.3f} | {pre + dec * args.steps:.3f} |")
    predicted = [r[0] for r in sorted(rows, key=lambda r: r[1].cost.total_s)]
    measured = [r[0] for r in sorted(rows, key=lambda r: r[2] + r[3] * args.steps)]
    lines += ["", f"Fastest first, predicted: {', '.join(predicted)}; measured: {', '.join(measured)} "
                  f"({'same order' if predicted == measured else 'DIFFERENT order'}).", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the MoE model only, 6 steps, 3 repeats")
    parser.add_argument("--models", default=None, help="default mid,moe (quick: moe)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--time-limit", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)")
    parser.add_argument("--out", default=str(HERE / "SOLVED.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.steps = args.steps or (6 if args.quick else 16)
    args.repeats = args.repeats or (3 if args.quick else 5)
    models = (args.models or ("moe" if args.quick else "mid,moe")).split(",")
    load = os.getloadavg()[0]
    started = time.perf_counter()
    command = "python benchmarks/cost_accuracy/solved.py" + (" --quick" if args.quick else "")
    with scratch("cost_accuracy_solved_") as work:
        import placement_opt

        placement_opt.profile(["cpu", "disk"], quick=args.quick, dtype="float32", offload_folder=work)
        body = [line for shape in models for line in bench(shape, args, work)]
    lines = ["# The solver's own plans on this machine, predicted against measured", "",
             f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; wall time "
             f"{time.perf_counter() - started:.0f} s; command: `{command}`",
             f"- Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} with "
             f"{args.threads} thread(s); 1-minute load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} "
             f"at the end (other jobs share the cores).",
             f"- Workload: batch 1 x prompt {args.prompt} + {args.steps} new tokens; measured: medians of "
             f"{args.repeats} prefills and {args.steps} decode steps, offloaded files evicted before each forward "
             "(as run.py). Plans: `solve(checkpoint, {'cpu': RAM, 'disk': '100GiB'}, granularity=...)` after "
             "`calibrate(..., granularity='auto')` (and the expert groups).", "", *body]
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
