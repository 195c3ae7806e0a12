"""How fast does solve() find a plan, and how close to the bound, on published models and real machines?

The hard benchmark of issue 12: published configurations (Mistral-7B, Llama-2-13B, Gemma-2-27B,
Falcon-40B, Mixtral-8x7B, Llama-3-70B, Qwen2-72B, Llama-3.1-405B; catalog presets traced on the meta
device at block granularity, once each) on seven machines of 1, 2, 4 and 8 GPUs, mixed kinds and
identical ones, each with a CPU and usually an NVMe disk, for three workloads (chat, batch 16 x 1024,
an 8192-token context): 8 x 7 x 3 = 168 cells. Each cell is one ``placement_opt.solve()`` with its
defaults (latency, time limit 1 s); cells left above a 1 % gap (or without a plan) are solved again
with ``time_limit_s=5``. Reported: cells with a plan, cells proven infeasible, cells within 1 % of the
bound at 1 s and at 5 s, median and worst solve() wall time (tracing excluded), a per-cell table, and
(with ``--compare``) the cells whose plan is worse than a recorded run's.

Only public calls that the code before issue 12 also has are used (``solve``, ``trace``, ``Machine``,
``Device.preset``, ``Workload``), so the same script measures an older checkout::

    PYTHONPATH=/work/wt-before/src python benchmarks/solve_time/run.py --out /tmp/before.md --json /tmp/before.json

Usage::

    python benchmarks/solve_time/run.py                 # 168 cells -> benchmarks/solve_time/RESULTS.md
    python benchmarks/solve_time/run.py --quick         # 12 hard cells, a minute or two
    python benchmarks/solve_time/run.py --only "4x T4"  # cells whose "model | machine | workload" holds it
    python benchmarks/solve_time/run.py --module        # module-granularity 7B and 70B graphs, limit 2 s
    python benchmarks/solve_time/run.py --sublayer      # sublayer graphs of 8B, Mixtral, 70B and 72B, limit 1 s
    python benchmarks/solve_time/run.py --expert-groups --out benchmarks/solve_time/GROUPS.md  # Mixtral, 2 and 4 groups
    python benchmarks/solve_time/run.py --overlap --out benchmarks/solve_time/OVERLAP.md   # Workload(overlap=True)
    python benchmarks/solve_time/run.py --contiguous --out benchmarks/solve_time/CONTIGUOUS.md  # solve(contiguous=True)
    python benchmarks/solve_time/run.py --host --overlap --out benchmarks/solve_time/HOST.md  # the profiled H100 host
    python benchmarks/solve_time/run.py --compare benchmarks/solve_time/before.json   # the default when present
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import placement_opt
from placement_opt import trace
from placement_opt.cost.workload import Workload
from placement_opt.errors import InfeasiblePlacementError, PlacementError
from placement_opt.hardware.devices import Device, Machine
from placement_opt.planner import solve

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # machine_info, for the results' machine line
from machine_info import cpu_model  # noqa: E402

BEFORE = HERE / "before.json"
WITHIN = 0.01
"""The gap the acceptance asks for (1 %)."""
RESOLVE_S = 5.0
"""Time limit of the second solve for cells left above 1 % (or without a plan) at the default 1 s."""
REL_TOL = 1e-6
"""Objectives closer than this (relative) count as equal when comparing with a recorded run."""
NOISE = 0.001
"""solve() stops once within its default gap limit (0.1 %), so two runs may differ by this much."""

MODELS = ["mistral-7b", "llama-2-13b", "gemma-2-27b", "falcon-40b", "mixtral-8x7b", "llama-3-70b", "qwen2-72b",
          "llama-3.1-405b"]

# Qwen2-72B as published (transformers' Qwen2Config); only for checkouts whose catalog lacks the preset.
_QWEN2_72B = {"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 131072,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": False,
              "tie_word_embeddings": False}


def _gpus(key: str, n: int, start: int = 0) -> list[Device]:
    return [Device.preset(key, name=f"cuda:{start + i}") for i in range(n)]


def _host(cpu: str, memory: str | None = None, disk: bool = True) -> list[Device]:
    devices = [Device.preset(cpu, name="cpu", memory=memory)]
    return devices + ([Device.preset("nvme-gen4", name="disk")] if disk else [])


MACHINES: dict[str, Callable[[], Machine]] = {
    "1x RTX 3060 12GB + 32 GiB + NVMe": lambda: Machine(_gpus("rtx-3060", 1) + _host("cpu-desktop", "32GiB")),
    "RTX 4090 + RTX 3090 + 64 GiB + NVMe": lambda: Machine(_gpus("rtx-4090", 1) + _gpus("rtx-3090", 1, 1)
                                                           + _host("cpu-desktop")),
    "A100-80GB + T4 + 256 GiB + NVMe": lambda: Machine(_gpus("a100-80gb", 1) + _gpus("t4", 1, 1)
                                                       + _host("cpu-server", "256GiB")),
    "2x H100 SXM + 512 GiB + NVMe": lambda: Machine(_gpus("h100-sxm", 2) + _host("cpu-server")),
    "4x T4 + 128 GiB + NVMe": lambda: Machine(_gpus("t4", 4) + _host("cpu-desktop", "128GiB")),
    "4x A100-40GB + 512 GiB, no disk": lambda: Machine(_gpus("a100-40gb", 4) + _host("cpu-server", disk=False)),
    "8x L4 + 512 GiB + NVMe": lambda: Machine(_gpus("l4", 8) + _host("cpu-server")),
}

WORKLOADS = {
    "chat 1x512+128": Workload(batch_size=1, prompt_len=512, new_tokens=128),
    "batch 16x1024+128": Workload(batch_size=16, prompt_len=1024, new_tokens=128),
    "context 8064+128": Workload(batch_size=1, prompt_len=8064, new_tokens=128),
}

#: --quick: a dozen cells that were hard for the solver before issue 12 (large gaps, no plan, 405B).
QUICK = [
    ("llama-3-70b", "RTX 4090 + RTX 3090 + 64 GiB + NVMe", "batch 16x1024+128"),
    ("llama-3-70b", "A100-80GB + T4 + 256 GiB + NVMe", "batch 16x1024+128"),
    ("llama-3-70b", "4x T4 + 128 GiB + NVMe", "batch 16x1024+128"),
    ("qwen2-72b", "4x T4 + 128 GiB + NVMe", "batch 16x1024+128"),
    ("gemma-2-27b", "4x T4 + 128 GiB + NVMe", "context 8064+128"),
    ("llama-3.1-405b", "2x H100 SXM + 512 GiB + NVMe", "chat 1x512+128"),
    ("llama-3.1-405b", "8x L4 + 512 GiB + NVMe", "batch 16x1024+128"),
    ("mixtral-8x7b", "RTX 4090 + RTX 3090 + 64 GiB + NVMe", "context 8064+128"),
    ("falcon-40b", "4x A100-40GB + 512 GiB, no disk", "batch 16x1024+128"),
    ("qwen2-72b", "8x L4 + 512 GiB + NVMe", "context 8064+128"),
    ("llama-2-13b", "1x RTX 3060 12GB + 32 GiB + NVMe", "batch 16x1024+128"),
    ("mistral-7b", "1x RTX 3060 12GB + 32 GiB + NVMe", "context 8064+128"),
]


#: --module: the issue's module-granularity graphs (292 units for Mistral-7B, 724 for Llama-3-70B),
#: acceptance "within 1 % in 2 s"; model names carry a "/module" suffix.
MODULE_TIME_LIMIT_S = 2.0
MODULE_MACHINES: dict[str, Callable[[], Machine]] = {
    "RTX 3060 at 6 GiB + 32 GiB + NVMe": lambda: Machine([Device.preset("rtx-3060", name="cuda:0", memory="6GiB")]
                                                         + _host("cpu-desktop", "32GiB")),
    "RTX 4090 + RTX 3090 + 64 GiB + NVMe": MACHINES["RTX 4090 + RTX 3090 + 64 GiB + NVMe"],
    "2x H100 SXM + 512 GiB + NVMe": MACHINES["2x H100 SXM + 512 GiB + NVMe"],
    "4x T4 + 128 GiB + NVMe": MACHINES["4x T4 + 128 GiB + NVMe"],
}
MODULE = [(f"{m}/module", h, "chat 1x512+128") for m in ("mistral-7b", "llama-3-70b") for h in MODULE_MACHINES]

#: --sublayer: issue 15's sublayer graphs (norms, attention, MLP or experts as units): Llama-3-8B (132 units,
#: the grouped relaxation from GROUP_WITHOUT_RUNS_ABOVE), Mixtral-8x7B (164) and the 72B-class ones (324), at
#: the default 1 s: the solve time that issue asks to keep within issue 12's figures. Model names carry
#: "/sublayer".
SUBLAYER = [(f"{m}/sublayer", h, w) for m in ("llama-3-8b", "mixtral-8x7b", "llama-3-70b", "qwen2-72b")
            for h in ("RTX 4090 + RTX 3090 + 64 GiB + NVMe", "4x T4 + 128 GiB + NVMe", "1x RTX 3060 12GB + 32 GiB + NVMe",
                      "8x L4 + 512 GiB + NVMe")
            for w in ("chat 1x512+128", "batch 16x1024+128")]
#: --expert-groups' one machine outside the grid: the one-GPU desktop issue 15's expert groups are for.
GROUP_MACHINES: dict[str, Callable[[], Machine]] = {
    "1x RTX 4090 + 64 GiB + NVMe": lambda: Machine(_gpus("rtx-4090", 1) + _host("cpu-desktop")),
}
#: --expert-groups: Mixtral-8x7B's sublayer graph with each layer's experts cut into 2 and 4 units (196 and 260
#: units, ``trace(..., expert_groups=N)``), on the sublayer grid's machines, at the default 1 s. Model names carry
#: "/sublayer/N".
EXPERT_GROUPS = [(f"mixtral-8x7b/sublayer/{n}", h, w) for n in (2, 4)
                 for h in ("RTX 4090 + RTX 3090 + 64 GiB + NVMe", "4x T4 + 128 GiB + NVMe",
                           "1x RTX 3060 12GB + 32 GiB + NVMe", "1x RTX 4090 + 64 GiB + NVMe")
                 for w in ("chat 1x512+128", "batch 16x1024+128")]


@dataclass
class Run:
    """One solve() of one cell: its outcome, gap, wall time and objective (None without a plan)."""

    status: str
    """The plan's status (OPTIMAL / FEASIBLE / ...), ``INFEASIBLE`` (proven), ``NO PLAN`` or ``ERROR``."""
    gap: float | None
    wall_s: float
    objective: float | None
    bound: float | None
    message: str = ""
    runs: list | None = None
    """The plan as runs of units: ``[first unit, count, storage, execution, mode]`` (to re-price it later)."""


@dataclass
class Cell:
    model: str
    machine: str
    workload: str
    units: int
    first: Run
    """solve() with its defaults (time limit 1 s)."""
    again: Run | None = None
    """solve(time_limit_s=5) when the first left a gap above 1 % or no plan."""
    limit_s: float = 1.0
    """The first solve's time limit (the default 1 s; 2 s for module-granularity cells)."""
    recorded_now: float | None = None
    """The recorded run's 1 s plan priced by today's cost model (None: no recorded plan, or it no
    longer maps onto today's options or capacities; ``recorded_note`` says which)."""
    recorded_note: str = ""

    @property
    def key(self) -> str:
        return f"{self.model} | {self.machine} | {self.workload}"


def _config(name: str):
    from placement_opt.errors import ModelSpecError
    from placement_opt.model import catalog

    try:
        return catalog.model_config(name)
    except ModelSpecError:
        if name != "qwen2-72b":
            raise
        import transformers

        config = transformers.Qwen2Config(**_QWEN2_72B)
        config.dtype = "bfloat16"
        config.name_or_path = name
        return config


def _solve(graph, machine: Machine, workload: Workload, time_limit_s: float | None, seed: int = 0,
           contiguous: bool = False) -> Run:
    kwargs = {} if time_limit_s is None else {"time_limit_s": time_limit_s}
    if seed:
        kwargs["seed"] = seed
    if contiguous:
        kwargs["contiguous"] = True
    t0 = time.perf_counter()
    try:
        plan = solve(graph, machine, workload=workload, **kwargs)
    except InfeasiblePlacementError as exc:
        return Run("INFEASIBLE", None, time.perf_counter() - t0, None, None, str(exc)[:160])
    except PlacementError as exc:
        return Run("NO PLAN", None, time.perf_counter() - t0, None, None, str(exc)[:160])
    except Exception as exc:  # a bug must not stop the grid: it is reported as its own row
        return Run("ERROR", None, time.perf_counter() - t0, None, None, f"{type(exc).__name__}: {exc}"[:160])
    runs = [[units[0], len(units), storage, execution, mode] for units, storage, execution, mode in plan.runs()]
    return Run(plan.status, plan.gap, time.perf_counter() - t0, plan.objective_value, plan.best_bound, runs=runs)


def _reprice(graph, machine: Machine, workload: Workload, runs: list) -> tuple[float | None, str]:
    """The latency (s) of a recorded plan under today's cost model, or None and why not.

    Plans recorded before a cost-model change are compared on today's prices: the same placement
    (storage, execution, mode per unit) is priced again, so "at least as good" means the same model.
    """
    from placement_opt.cost.build import build_problem

    problem = build_problem(graph, machine, workload)
    choice: list[int] = []
    for first, count, storage, execution, mode in runs:
        units = problem.units[len(choice):len(choice) + count]
        if not units or units[0].name != first:
            return None, f"the recorded plan's units no longer match the graph at {first}"
        # Plan.runs() names a phased run's prefill device in its mode: "phased (prefill on cuda:0)"
        plain, _, prefill = mode.partition(" (prefill on ")
        key = (storage, execution, plain, prefill.rstrip(")") or None)
        for u in units:
            index = next((k for k, o in enumerate(u.options)
                          if (o.storage, o.execution, o.mode, o.prefill_execution) == key), None)
            if index is None:
                return None, f"{u.name} has no {storage}->{execution} {mode} option today"
            choice.append(index)
    if len(choice) != len(problem.units):
        return None, "the recorded plan covers a different number of units"
    if not problem.satisfies(choice):
        return None, "the recorded plan does not fit today's memory model"
    return problem.objective_value(choice, "latency") / 1e9, ""


def _needs_again(run: Run) -> bool:
    return run.status in ("NO PLAN", "ERROR") or (run.gap is not None and run.gap > WITHIN)


#: --host: the machine issue 15 measured (one H100 80GB at the budgets its acceptance names, beside the
#: profiled 16-core host: shared/measurements/h100-host-profile.json), for that issue's workloads; with
#: --overlap, the pricing under which phased and streamed layers share the host (benchmarks/phases).
HOST_PROFILE = HERE.parents[2] / "shared" / "measurements" / "h100-host-profile.json"
HOST_WORKLOADS = {
    "1x512+32": Workload(batch_size=1, prompt_len=512, new_tokens=32),
    "1x128+256": Workload(batch_size=1, prompt_len=128, new_tokens=256),
    "1x4096+32": Workload(batch_size=1, prompt_len=4096, new_tokens=32),
    "16x512+32": Workload(batch_size=16, prompt_len=512, new_tokens=32),
}


def _h100_host(budget: str) -> Machine:
    """The profiled H100 host: its GPU at ``budget``, its CPU with 100 GiB (bf16 figures), no disk."""
    from placement_opt.hardware.profile_store import device_from_measurement

    if not HOST_PROFILE.exists():
        raise SystemExit(f"--host needs {HOST_PROFILE} (the H100 host's profile), which is not there")
    data = json.loads(HOST_PROFILE.read_text())
    gpu, cpu = (device_from_measurement(name, data["measurements"][name], "bfloat16", data["created"])
                for name in ("cuda:0", "cpu"))
    return Machine([gpu.with_memory(budget), cpu.with_memory("100GiB")])


HOST_MACHINES: dict[str, Callable[[], Machine]] = {
    f"H100 host profile, GPU at {budget}": (lambda budget=budget: _h100_host(budget)) for budget in ("10GiB", "4GiB", "24GiB")}
HOST = [(m, f"H100 host profile, GPU at {b}", w) for m, b in (("llama-3-8b", "10GiB"), ("llama-3-8b", "4GiB"),
                                                              ("mixtral-8x7b", "24GiB")) for w in HOST_WORKLOADS]


def _cells(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    cells = (QUICK if args.quick else MODULE if args.module else SUBLAYER if args.sublayer else
             EXPERT_GROUPS if args.expert_groups else HOST if args.host else None) or [
        (m, h, w) for m in MODELS for h in MACHINES for w in WORKLOADS]
    return [c for c in cells if all(o in " | ".join(c) for o in args.only)]


def _graph(model: str):
    """The traced graph of a cell's model ("name" at block granularity, "name/module" per module,
    "name/sublayer" per sublayer, "name/sublayer/N" with each MoE layer's experts in N units)."""
    name, _, rest = model.partition("/")
    granularity, _, groups = rest.partition("/")
    if groups:
        return trace(_config(name), granularity=granularity, expert_groups=int(groups))
    return trace(_config(name), granularity=granularity or "block")


def run_grid(args: argparse.Namespace, before: dict | None = None) -> list[Cell]:
    graphs, out = {}, []
    for model, machine, workload in _cells(args):
        if model not in graphs:
            t0 = time.perf_counter()
            graphs[model] = _graph(model)
            print(f"# traced {model}: {len(graphs[model])} units in {time.perf_counter() - t0:.1f} s", flush=True)
        graph, make = graphs[model], {**MACHINES, **MODULE_MACHINES, **GROUP_MACHINES, **HOST_MACHINES}[machine]
        wl = {**WORKLOADS, **HOST_WORKLOADS}[workload]
        if args.overlap:  # the opt-in pricing of copies beside every unit before them (not in older checkouts)
            wl = dataclasses.replace(wl, overlap=True)
        limit = MODULE_TIME_LIMIT_S if model.endswith("/module") else None
        cell = Cell(model, machine, workload, len(graph), _solve(graph, make(), wl, limit, args.seed, args.contiguous),
                    limit_s=limit or 1.0)
        if not args.no_resolve and _needs_again(cell.first):
            cell.again = _solve(graph, make(), wl, RESOLVE_S, args.seed, args.contiguous)
        recorded = (before or {}).get(cell.key)
        if recorded and recorded["first"].get("runs"):
            cell.recorded_now, cell.recorded_note = _reprice(graph, make(), wl, recorded["first"]["runs"])
        out.append(cell)
        print(_row(cell, None), flush=True)
    return out


# -- reporting ----------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _run_text(run: Run | None) -> str:
    if run is None:
        return ""
    if run.objective is None:
        return f"{run.status} ({run.wall_s:.2f} s): {run.message}"
    return f"{run.status} {_pct(run.gap)} ({run.wall_s:.2f} s)"


def _row(cell: Cell, before: dict | None) -> str:
    r = cell.first
    obj = "-" if r.objective is None else f"{r.objective:.4g}"
    status = r.status if r.objective is not None else f"{r.status}: {r.message}"
    extra = ""
    if before is not None:
        b = before.get(cell.key)
        extra = " | " + ("not run" if b is None else _before_text(b, cell))
    return (f"| {cell.model} ({cell.units}) | {cell.machine} | {cell.workload} | {status} | {_pct(r.gap)} | "
            f"{r.wall_s:.2f} | {obj} | {_run_text(cell.again)}{extra} |")


def _best(run: Run | None, other: Run | None) -> float | None:
    values = [r.objective for r in (run, other) if r is not None and r.objective is not None]
    return min(values) if values else None


def _recorded(b: dict, cell: Cell) -> float | None:
    """The recorded 1 s plan's objective to compare with: re-priced today when it could be."""
    return cell.recorded_now if cell.recorded_now is not None else b["first"]["objective"]


def _before_text(b: dict, cell: Cell) -> str:
    old = b["first"]
    if old["objective"] is None:
        return f"{old['status']}"
    text = f"{old['objective']:.4g} {_pct(old['gap'])}"
    if cell.recorded_now is not None and abs(cell.recorded_now / old["objective"] - 1) > REL_TOL:
        text += f", {cell.recorded_now:.4g} today"
    elif cell.recorded_note:
        return text + f" ({cell.recorded_note})"
    now, ref = cell.first.objective, _recorded(b, cell)
    if now is not None and ref:
        text += f" ({now / ref - 1:+.2%})"
    return text


def compare(cells: list[Cell], before: dict) -> tuple[list[str], list[str], list[str]]:
    """Cells whose 1 s plan is worse than the recorded run's by more than ``NOISE``, by less, and
    cells that lost their plan."""
    worse, slightly, lost = [], [], []
    for cell in cells:
        b = before.get(cell.key)
        if b is None or b["first"]["objective"] is None or (cell.recorded_note and cell.recorded_now is None):
            continue  # nothing recorded, or the recorded plan has no price today (its note says why)
        old, now = _recorded(b, cell), cell.first.objective
        if now is None:
            lost.append(f"{cell.key}: before {old:.4g}, now {cell.first.status} ({cell.first.message})")
        elif now > old * (1 + REL_TOL):
            (worse if now > old * (1 + NOISE) else slightly).append(
                f"{cell.key}: {now:.4g} against {old:.4g} before ({now / old - 1:+.3%})")
    return worse, slightly, lost


def summary(cells: list[Cell]) -> dict:
    """The counts and times the acceptance of issue 12 asks for."""
    firsts = [c.first for c in cells]
    infeasible = [c for c in cells if c.first.status == "INFEASIBLE"]
    feasible = [c for c in cells if c.first.status != "INFEASIBLE"]
    planned = [c for c in cells if c.first.objective is not None]
    within = [c for c in planned if c.first.gap is not None and c.first.gap <= WITHIN]
    rest = [c for c in feasible if c not in within]
    rest_ok = [c for c in rest if c.again is not None and c.again.gap is not None and c.again.gap <= WITHIN]
    walls = [r.wall_s for r in firsts]
    return {
        "cells": len(cells), "with_plan": len(planned), "proven_infeasible": len(infeasible),
        "no_plan": len(feasible) - len(planned), "errors": sum(r.status == "ERROR" for r in firsts),
        "feasible": len(feasible), "within_1pct_at_1s": len(within),
        "rest": len(rest), "rest_within_1pct_at_5s": len(rest_ok),
        "median_wall_s": statistics.median(walls) if walls else 0.0, "worst_wall_s": max(walls, default=0.0),
        "over_limit": sum(c.first.wall_s > c.limit_s + 0.5 for c in cells),
        "worst_gap_at_1s": max((c.first.gap for c in planned if c.first.gap is not None), default=0.0),
        # A bound above its own plan's value is a wrong bound (it is never clamped): must stay 0.
        "bound_above_value": sum(r.gap is not None and r.gap < -1e-9 for c in cells for r in (c.first, c.again)
                                 if r is not None),
    }


def _summary_lines(s: dict, label: str) -> list[str]:
    feasible = max(s["feasible"], 1)
    return [
        f"| {label} | {s['cells']} | {s['with_plan']} | {s['proven_infeasible']} | {s['no_plan']} "
        f"| {s['within_1pct_at_1s']}/{s['feasible']} ({s['within_1pct_at_1s'] / feasible:.1%}) "
        f"| {s['rest_within_1pct_at_5s']}/{s['rest']} | {s['median_wall_s']:.2f} | {s['worst_wall_s']:.2f} "
        f"| {s['over_limit']} | {s['worst_gap_at_1s']:.1%} | {s.get('bound_above_value', '-')} |"]


def _code() -> str:
    """Where placement_opt was imported from, and its git commit when that is a checkout."""
    src = Path(placement_opt.__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(src)
    return f"{src} at {rev}{' (modified)' if dirty else ''}"


def markdown(cells: list[Cell], meta: dict, before: dict | None, before_meta: dict | None) -> str:
    head = ["| run | cells | with a plan | proven infeasible | no plan | within 1 % at the limit (of feasible) "
            "| rest within 1 % at 5 s | median wall s | worst wall s | walls > limit + 0.5 s | worst gap at the limit "
            "| bounds above their plan's value (wrong bounds) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    head += _summary_lines(meta["summary"], "this run")
    if before_meta is not None:
        keys = {c.key for c in cells}
        old = [_cell_from_json(c) for c in before_meta["cells"] if _key(c) in keys]
        head += _summary_lines(summary(old), f"recorded ({before_meta['meta']['code']})")
    lines = [
        "# Solve time and gap on published models and real machines (issue 12's hard benchmark)", "",
        f"Date: {meta['date']}. Command: `{meta['command']}`  ",
        f"Code: {meta['code']}  ",
        f"Machine: {meta['machine']}; 1-minute load average {meta['load_start']:.1f} at the start and "
        f"{meta['load_end']:.1f} at the end (other work shares these cores: wall times are upper bounds).  ",
        "Each cell: `solve(graph, machine, workload=...)` with the defaults (latency, time limit 1 s, gap limit "
        f"0.1 %, 2 workers, seed {meta.get('seed', 0)}); wall = build + baselines + CP-SAT + scoring (tracing excluded); "
        f"`/module` cells: module granularity and `time_limit_s={MODULE_TIME_LIMIT_S:g}`; `/sublayer` cells: sublayer "
        "granularity, the default limit (`/sublayer/N`: each MoE layer's experts in N units). Cells left "
        f"above 1 % or without a plan are solved again with `time_limit_s={RESOLVE_S:g}`.", "",
        *head, "",
    ]
    if before is not None:
        worse, slightly, lost = compare(cells, before)
        lines += [f"Against the recorded run: {len(worse)} cell(s) with a plan worse by more than {NOISE:.1%} at 1 s, "
                  f"{len(slightly)} worse by less (within the gap limit, where the search may stop anywhere), "
                  f"{len(lost)} cell(s) that lost their plan.", ""]
        repriced = sum(c.recorded_now is not None for c in cells)
        unpriced = [c for c in cells if c.recorded_note]
        lines += [f"Recorded plans priced again with today's cost model: {repriced} (compared at that price); "
                  f"{len(unpriced)} recorded plan(s) with no price today (left out of the comparison).", ""]
        listed = [f"- worse: {w}" for w in worse] + [f"- lost: {x}" for x in lost]
        listed += [f"- recorded plan not comparable: {c.key}: {c.recorded_note}" for c in unpriced]
        listed += [f"- worse by less than {NOISE:.1%}: {w}" for w in slightly]
        lines += listed + ([""] if listed else [])
    cols = "| model (units) | machine | workload | status at 1 s | gap | wall s | objective (s) | at 5 s |"
    rule = "|---|---|---|---|---|---|---|---|"
    if before is not None:
        cols, rule = cols + " recorded objective, gap (its price today; change) |", rule + "---|"
    lines += [cols, rule, *(_row(c, before) for c in cells), ""]
    return "\n".join(lines)


def dump(record: dict) -> str:
    """A --json record: the meta indented, one line per cell (small files, one diff line per cell)."""
    cells = ",\n".join(json.dumps(c, separators=(",", ":")) for c in record["cells"])
    return f'{{"meta": {json.dumps(record["meta"], indent=1)},\n"cells": [\n{cells}\n]}}\n'


def _key(c: dict) -> str:
    return f"{c['model']} | {c['machine']} | {c['workload']}"


def _cell_from_json(c: dict) -> Cell:
    return Cell(c["model"], c["machine"], c["workload"], c["units"], Run(**c["first"]),
                Run(**c["again"]) if c.get("again") else None, c.get("limit_s", 1.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 12 hard cells of QUICK only")
    parser.add_argument("--module", action="store_true",
                        help=f"module-granularity Mistral-7B and Llama-3-70B instead, time limit {MODULE_TIME_LIMIT_S:g} s")
    parser.add_argument("--sublayer", action="store_true",
                        help="sublayer graphs of Llama-3-8B, Mixtral-8x7B, Llama-3-70B and Qwen2-72B instead (32 cells, 1 s)")
    parser.add_argument("--expert-groups", action="store_true",
                        help="sublayer Mixtral-8x7B with 2 and 4 expert groups a layer instead (16 cells, 1 s)")
    parser.add_argument("--host", action="store_true",
                        help="the profiled H100 host at 10/4 GiB (Llama-3-8B) and 24 GiB (Mixtral-8x7B), issue 15's "
                             "workloads, instead (12 cells, 1 s; with --overlap, benchmarks/phases' pricing)")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="cells whose 'model | machine | workload' contains TEXT (repeatable: all must match)")
    parser.add_argument("--no-resolve", action="store_true", help="skip the 5 s second solves")
    parser.add_argument("--seed", type=int, default=0,
                        help="CP-SAT's random seed for every solve (default 0, solve()'s own): a sweep over seeds "
                             "shows how much a cell's gap at the limit owes to the search's luck")
    parser.add_argument("--overlap", action="store_true",
                        help="every workload with overlap=True (streamed copies beside the units before them)")
    parser.add_argument("--contiguous", action="store_true",
                        help="every solve with contiguous=True (each device stores one range of units)")
    parser.add_argument("--out", type=Path, default=None,
                        help="Markdown report (default: RESULTS.md beside this script for the full grid without "
                             "--overlap or --contiguous, none else)")
    parser.add_argument("--json", type=Path, default=None, help="every cell as JSON (the format of before.json)")
    parser.add_argument("--compare", type=lambda s: Path(s) if s else None, default=argparse.SUPPRESS,
                        help="a recorded --json run: report cells whose plan is worse (default: before.json, the plain "
                             "grid's, when present and without --contiguous, whose plans it does not record; '' for none)")
    args = parser.parse_args(argv)
    if "compare" not in args:  # not given
        args.compare = BEFORE if BEFORE.exists() and not args.contiguous else None
    load_start = os.getloadavg()[0]
    recorded = json.loads(args.compare.read_text()) if args.compare else None
    before = {_key(c): c for c in recorded["cells"]} if recorded else None
    cells = run_grid(args, before)
    meta = {"date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "command": " ".join(["python", "benchmarks/solve_time/run.py", *(argv if argv is not None else sys.argv[1:])]),
            "code": _code(), "machine": f"{cpu_model()}, {os.cpu_count()} cores, Python "
                                        f"{sys.version.split()[0]}",
            "load_start": load_start, "load_end": os.getloadavg()[0], "summary": summary(cells), "seed": args.seed}
    text = markdown(cells, meta, before, recorded)
    variant = args.quick or args.only or args.module or args.sublayer or args.expert_groups or args.host or args.overlap or args.contiguous
    out = args.out or (None if variant else HERE / "RESULTS.md")  # RESULTS.md records the plain grid only
    if out:
        out.write_text(text)
    if args.json:
        args.json.write_text(dump({"meta": meta, "cells": [
            {"model": c.model, "machine": c.machine, "workload": c.workload, "units": c.units, "limit_s": c.limit_s,
             "first": asdict(c.first), "again": asdict(c.again) if c.again else None} for c in cells]}))
    print(text)
    if before is not None:
        worse, _, lost = compare(cells, before)
        return 1 if worse or lost else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
