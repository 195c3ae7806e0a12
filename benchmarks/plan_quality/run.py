"""How much better than the baselines are the plans?

Published configs (placement_opt.model.catalog: a 70B dense Llama, Mixtral 8x7B, Mistral 7B, Gemma 2 27B),
traced on meta at block level, on machine presets with one to four GPUs (mixed kinds included), CPU
RAM and disk, for three workloads (chat, batch 16, long context). For each case:

* ``cpsat``: ``placement_opt.solve`` (latency objective, 1 s, seed 0);
* ``sequential`` / ``balanced`` / ``balanced_low_0``: placement_opt's re-implementation of those
  device_map strings (``Plan.baselines``);
* ``hf auto``: the installed transformers' own ``device_map="auto"`` on a meta model of the config.

Every placement is scored by ``placement_opt.evaluate`` on the same cost model; device maps with
accelerate's run-time semantics (cpu/disk entries copied synchronously to the first GPU at every
forward), cpsat plans with placement_opt's dispatcher (copies overlapped with compute). Reported: how
often each strategy runs out of memory (its KV cache, workspace or weights exceed a device), and the
median and worst ratio of its estimated time to cpsat's where both fit.

Usage::

    python benchmarks/plan_quality/run.py            # writes benchmarks/plan_quality/RESULTS.md
    python benchmarks/plan_quality/run.py --quick    # one model, two machines
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from placement_opt import trace
from placement_opt.cost.device_map import accelerate_device_map
from placement_opt.cost.evaluate import evaluate
from placement_opt.cost.workload import Workload
from placement_opt.errors import PlacementError
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model import catalog as models
from placement_opt.planner import solve

HERE = Path(__file__).resolve().parent
MODELS = ["llama-3-70b", "mixtral-8x7b", "mistral-7b", "gemma-2-27b"]
WORKLOADS = {
    "chat": Workload(batch_size=1, prompt_len=512, new_tokens=128),
    "batch-16": Workload(batch_size=16, prompt_len=1024, new_tokens=256),
    "long-context": Workload(batch_size=1, prompt_len=32768, new_tokens=256),
}


def _dev(preset: str, name: str, memory: str | None = None) -> Device:
    d = Device.preset(preset, name=name)
    return d.with_memory(memory) if memory else d


MACHINES = {
    "1x4090+64G+disk": lambda: Machine([_dev("rtx-4090", "cuda:0"), _dev("cpu-desktop", "cpu", "64GiB"),
                                        _dev("nvme-gen4", "disk")]),
    "1xH100+256G": lambda: Machine([_dev("h100-pcie", "cuda:0"), _dev("cpu-server", "cpu", "256GiB")]),
    "2xA100-40+128G+disk": lambda: Machine([_dev("a100-40gb", "cuda:0"), _dev("a100-40gb", "cuda:1"),
                                            _dev("cpu-desktop", "cpu", "128GiB"), _dev("nvme-gen4", "disk")]),
    "A100-80+A100-40+L40S+4090+512G+disk": lambda: Machine([
        _dev("a100-80gb", "cuda:0"), _dev("a100-40gb", "cuda:1"), _dev("l40s", "cuda:2"), _dev("rtx-4090", "cuda:3"),
        _dev("cpu-server", "cpu"), _dev("nvme-gen4", "disk")]),
}
STRATEGIES = ["cpsat", "sequential", "balanced", "balanced_low_0", "hf auto"]


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds:.2f}"


def _run_case(graph, config, machine, workload, hf_map):
    """Estimated time (None when it does not fit) per strategy."""
    out: dict[str, float | None] = {}
    try:
        plan = solve(graph, machine, workload=workload, time_limit_s=1.0)
        out["cpsat"] = plan.cost.total_s if plan.cost.fits else None
        gap = plan.gap
        baselines = {b.strategy: b for b in plan.baselines}
    except PlacementError:
        out["cpsat"], gap, baselines = None, float("nan"), {}
    for s in ("sequential", "balanced", "balanced_low_0"):
        b = baselines.get(s)
        out[s] = b.total_s if b is not None and b.fits else None
    if hf_map is None:
        out["hf auto"] = None
    else:
        try:
            cost = evaluate(hf_map, graph, machine, workload)
            out["hf auto"] = cost.total_s if cost.fits else None
        except ValueError:  # e.g. a disk entry on a machine without disk
            out["hf auto"] = None
    return out, gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    model_names = MODELS[1:2] if args.quick else MODELS
    machines = dict(list(MACHINES.items())[:2]) if args.quick else MACHINES
    rows, results = [], []
    t_start = time.perf_counter()
    for name in model_names:
        config = models.model_config(name)
        graph = trace(config)
        for mname, make in machines.items():
            machine = make()
            try:
                hf_map = accelerate_device_map(config, machine.max_memory, "auto")
            except (ValueError, RuntimeError) as exc:
                print(f"hf auto failed for {name} on {mname}: {exc}", flush=True)
                hf_map = None
            for wname, workload in WORKLOADS.items():
                out, gap = _run_case(graph, config, machine, workload, hf_map)
                results.append(out)
                cp = out["cpsat"]
                cells = [_fmt(out[s]) if out[s] is not None else "OOM" for s in STRATEGIES]
                ratios = [f"{out[s] / cp:.2f}x" if out[s] is not None and cp else "-" for s in STRATEGIES[1:]]
                rows.append(f"| {name} | {mname} | {wname} | " + " | ".join(cells) + (f" | {gap:.1%} | " if gap == gap else " | - | ")
                            + " | ".join(ratios) + " |")
                print(rows[-1], flush=True)
    summary = ["| strategy | cases | out of memory | fits where cpsat fits | median time / cpsat | worst time / cpsat |",
               "|---|---|---|---|---|---|"]
    for s in STRATEGIES:
        oom = sum(r[s] is None for r in results)
        both = [r[s] / r["cpsat"] for r in results if r[s] is not None and r["cpsat"]]
        fits_cp = sum(r[s] is not None for r in results if r["cpsat"] is not None)
        cp_cases = sum(r["cpsat"] is not None for r in results)
        med = f"{statistics.median(both):.2f}x" if both else "-"
        worst = f"{max(both):.2f}x" if both else "-"
        summary.append(f"| {s} | {len(results)} | {oom} ({oom / len(results):.0%}) | {fits_cp}/{cp_cases} | {med} | {worst} |")
    text = "\n".join([
        "# Plan quality: cpsat vs the device_map baselines", "",
        f"Machine: {platform.processor() or platform.machine()}, {platform.system()}, Python {sys.version.split()[0]}; "
        f"estimated times from the cost model (no GPU was used); CP-SAT's 1 s solves ran with a "
        f"1-minute load average of {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores. "
        f"Total run time {time.perf_counter() - t_start:.0f} s.",
        f"Command: `python benchmarks/plan_quality/run.py{' --quick' if args.quick else ''}`  ",
        f"Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC.", "",
        "Workloads: chat = batch 1, prompt 512, 128 new; batch-16 = batch 16, prompt 1024, 256 new; "
        "long-context = batch 1, prompt 32768, 256 new. Times are seconds for the whole workload "
        "(prefill + every decode step); OOM = the placement needs more memory than some device has "
        "(weights, KV cache, workspace, stream buffers).", "",
        *summary, "",
        "| model | machine | workload | " + " | ".join(STRATEGIES) + " | cpsat gap | "
        + " | ".join(f"{s}/cpsat" for s in STRATEGIES[1:]) + " |",
        "|" + "---|" * (4 + len(STRATEGIES) + len(STRATEGIES) - 1),
        *rows, ""])
    (HERE / "RESULTS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
