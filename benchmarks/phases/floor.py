"""How fast could any placement decode? A floor under issue 15's 2x goal, from a GPU host's measured profile.

The goal asks the new modes for twice the layer plan's decode tokens/s. This script asks whether any placement of the
same model, with the same GPU budget, on the same host, could reach it. It reads the profile a lent GPU machine wrote
(``h200-host-profile-3.json`` beside this script: the H200 host's devices and links, and the calibrated figures of
the Llama-3.1-8B and Mixtral shapes' units, which ``gpu.py`` measured in the same run), prices every option of every
unit of the block graph (a decoder layer whole) and of the sublayer graph (attention, MLP and norms apart) as
``solve()`` does, and solves a linear program over them:

* each decoder layer is taken whole, in its parts, or any mix of the two (a calibrated layer can cost less than its
  parts, each timed with its own call overhead), and each unit's options take fractions that sum to its share (a unit
  may be split any way at all, finer than any granularity the tracer offers);
* the weights stored on the GPU, and the KV cache of the units the GPU computes in the decode, fit the budget
  (workspace and stream buffers are left out: they only make a placement slower);
* a decode step lasts at least the compute of its units one after another (a batch-1 step is a chain: the CPU and the
  GPU never compute at once), at least the prefetch thread's copies, and at least host memory's traffic (the copies'
  reads and the CPU's weight reads together). Stalls and transfers between devices are left out: both are >= 0.

Every placement ``solve()`` can return costs at least this floor by the same cost model, so a goal above it is beyond
any placement of these units on that host, in the cost model's terms (its third run, ``GPU.md``: the Llama layer
plan's decode predicted 2 % over the measured at 10 GiB and 10 % over at 4 GiB; the Mixtral layer plan's 29 % under,
its CPU layers measured faster than calibrated). The measured figures beside it are read from ``GPU.json`` (that run's rows).
Nothing runs on a GPU here.

Usage::

    python benchmarks/phases/floor.py            # writes FLOOR.md here (about a minute on 2 cores)
    python benchmarks/phases/floor.py --case mixtral --profile PROFILE   # gpu.py's Mixtral case, from a profile
                                                  # that calibrated it (the moe step's, DEVICE.md)
    python benchmarks/phases/floor.py --smoke --case all   # gpu.py's tiny models, roofline prices: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu  # noqa: E402  (the cases gpu.py measured, their shapes and workloads)

PROFILE = HERE / "h200-host-profile-3.json"
CPU_MEMORY = "100GiB"
#: gpu.py's workload in the runs GPU.json holds: batch 1, a 512-token prompt, 16 decode steps.
WORKLOAD = (1, 512, 16)
#: A floor above a plan by more than this share of the plan's time is a fault of this script, not a finding.
TOLERANCE = 1e-6


@dataclass(frozen=True)
class Floor:
    """The linear program's optimum: one decode step at the least, and where its bytes go."""

    step_s: float
    binding: tuple[str, ...]
    """Which of ``compute chain``, ``copies``, ``host memory`` reach ``step_s`` (within 0.1 %)."""
    gpu_weights_bytes: float
    streamed_bytes: float
    cpu_bytes: float
    """Weights the CPU computes in the decode (CPU-resident and phased options): the embedding's count whole, though
    a lookup reads one row a token."""


def _machine(budget: str | None):
    from placement_opt.hardware.resolve import as_machine

    return as_machine({0: budget or "140GiB", "cpu": CPU_MEMORY})


def decode_floor(graphs: dict[str, Any], budget: str | None, workload: Any, gpu_free: bool = False) -> Floor:
    """The least decode step of any fractional placement (module docstring) in which each decoder layer is one
    unit of the block graph or its parts in the sublayer graph, or any mix of the two: a calibrated layer can cost
    less than its parts, each timed with its own call overhead. ``budget`` None: the GPU's whole memory is the budget
    (every weight fits there). ``gpu_free``: the GPU's compute costs nothing (what the bytes kept off the GPU cost
    alone, whatever a faster GPU runtime would save)."""
    from ortools.linear_solver import pywraplp

    from placement_opt.cost.build import price_problem
    from placement_opt.cost.calibrated import calibration_for

    machine = _machine(budget)
    gpu = machine.gpus[0].name
    modes = ("resident", "stream", "phased")
    problem, parts = price_problem(graphs["sublayer"], machine, workload, modes, None, False)
    blocks, block_parts = price_problem(graphs["layer"], machine, workload, modes, None, False)
    capacity = next(d.capacity_bytes for d in problem.devices if d.name == gpu)
    lp = pywraplp.Solver.CreateSolver("GLOP")
    step = lp.NumVar(0.0, lp.infinity(), "step")
    # a block unit cut into parts in the sublayer graph: its share taken whole (the rest goes to its parts)
    whole = {u.name: lp.NumVar(0.0, 1.0, "") for u in blocks.units
             if any(_inside(v.name, u.name) for v in problem.units)}
    calibration = calibration_for(graphs["layer"], machine)
    for name in whole:
        # a profile that kept another batch's points alone prices the unit from them (h200-host-profile-3.json's
        # Llama layers hold batch-16 x 4100 steps, 7x a batch-1 CPU step): no floor, rather than a wrong one
        if not measured_at(calibration, name, workload.batch_size):
            raise NoFloor(f"{graphs['case']}: the profile's calibration of {name} has no decode step at batch "
                          f"{workload.batch_size}, so its options would be priced from another batch's; calibrate "
                          "the workload into the profile (gpu.py's decode step does) and run this again")
    shares = []
    for unit, row in zip(blocks.units, block_parts, strict=True):
        if unit.name in whole:
            xs = [lp.NumVar(0.0, 1.0, "") for _ in row]
            lp.Add(lp.Sum(xs) == whole[unit.name])
            shares.append(list(zip(xs, row, strict=True)))
    for unit, row in zip(problem.units, parts, strict=True):
        xs = [lp.NumVar(0.0, 1.0, "") for _ in row]
        owner = next((name for name in whole if _inside(unit.name, name)), None)
        lp.Add(lp.Sum(xs) == (1 - whole[owner] if owner else 1))
        shares.append(list(zip(xs, row, strict=True)))

    def total(term) -> Any:
        return lp.Sum([x * term(o) for unit in shares for x, o in unit if term(o)])

    steps = workload.decode_steps
    def compute(o) -> float:
        return 0.0 if gpu_free and o.execution == gpu else o.decode_s / steps

    sums = {"compute chain": total(compute), "copies": total(lambda o: o.copy_decode_s / steps),
            "host memory": total(lambda o: o.host_decode_s / steps)}
    for expression in sums.values():
        lp.Add(step >= expression)
    lp.Add(total(lambda o: (o.weights_bytes if o.storage == gpu else 0)
                 + (o.kv_cache_bytes if o.execution == gpu else 0)) <= capacity)
    lp.Minimize(step)
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        raise SystemExit(f"the floor's linear program has no optimum at {budget}: is the budget below the KV cache?")
    best = step.solution_value()
    binding = tuple(name for name, e in sums.items() if e.solution_value() >= best * 0.999)

    def weights(keep) -> float:
        return sum(x.solution_value() * o.weights_bytes for unit in shares for x, o in unit if keep(o))

    return Floor(best, binding, weights(lambda o: o.storage == gpu), weights(lambda o: o.mode == "stream"),
                 weights(lambda o: o.execution != gpu and o.mode != "stream"))


class NoFloor(Exception):
    """A case whose floor this profile cannot give (the message says why and what to run)."""


def measured_at(calibration: Any, unit: str, batch: int) -> bool:
    """Whether ``unit``'s calibrated decode steps (``calibration_for``'s, None: none) include ``batch`` on every
    device they were measured on (True for a unit without calibrated figures: the profile's devices price it)."""
    devices = calibration.compute.get(unit, {}) if calibration is not None else {}
    return all(any(b == batch for b, _, _ in times.decode) for times in devices.values())


def _inside(name: str, block: str) -> bool:
    """Whether unit ``name`` of the sublayer graph is a part of block unit ``block`` (not the same unit)."""
    return name.startswith(block + ".")


def _cases(family: str, smoke: bool, mixtral_layers: int) -> list[Any]:
    """gpu.py's cases, with its workloads (``smoke``: its tiny models), those of ``family`` ("all": every one)."""
    chosen = gpu.cases(argparse.Namespace(smoke=smoke, case=None if family == "all" else family, budget=None,
                                          steps=WORKLOAD[2], mixtral_layers=mixtral_layers))
    # smoke: a budget the tiny models do not fit, so that the memory row binds
    return [dataclasses.replace(c, budgets=("1MiB",)) for c in chosen] if smoke else chosen


def _config(case: Any) -> Path:
    """A folder holding ``case``'s config (gpu.py's, in bf16 with its own lm_head): traced, never built."""
    folder = Path(tempfile.mkdtemp(prefix="floor-"))
    gpu.case_config(case).save_pretrained(folder)
    return folder


def _measured(case: str, budget: str) -> dict[str, float]:
    """GPU.json's measured decode tokens/s per runner of ``case`` at ``budget`` (the latest run's rows come first)."""
    rows = json.loads((HERE / "GPU.json").read_text())
    found: dict[str, float] = {}
    for r in rows:
        if r["case"] == case and r["budget"] == budget and r.get("measured_decode_tps"):
            found.setdefault(r["runner"], r["measured_decode_tps"])
    return found


def _row(graphs: dict[str, Any], budget: str | None, workload: Any, limit_s: float) -> dict[str, Any]:
    from placement_opt import solve

    floor = decode_floor(graphs, budget, workload)
    row: dict[str, Any] = {"case": graphs["case"], "budget": budget or "whole GPU", "floor": floor,
                           "gpu_free": decode_floor(graphs, budget, workload, gpu_free=True)}
    for name, modes in (("layer", ("resident", "stream")), ("sublayer", ("resident", "stream", "phased"))):
        plan = solve(graphs[name], _machine(budget), workload=workload, modes=modes, time_limit_s=limit_s)
        step_s = plan.cost.decode_s / workload.decode_steps
        if floor.step_s > step_s * (1 + TOLERANCE):
            raise SystemExit(f"the floor ({floor.step_s * 1e3:.3f} ms) is above the {name} plan's step "
                             f"({step_s * 1e3:.3f} ms) at {row['budget']}: the linear program is not a relaxation")
        row[name] = step_s
    return row


def _free(floor: Floor, batch: int) -> str:
    if floor.step_s <= 0:  # every weight on the GPU, whose compute is free: nothing left to cost
        return "no limit"
    return f"{batch / floor.step_s:.2f} ({', '.join(floor.binding)})"


def _table(rows: list[dict[str, Any]], batch: int) -> list[str]:
    lines = ["| case | GPU budget | layer plan measured (GPU.json) | the 2x goal | layer plan predicted | sublayer plan "
             "predicted | floor of any placement | floor / layer plan measured | what binds at the floor | "
             "weights on the GPU / streamed / computed by the CPU at the floor (GB) | floor with the GPU's compute free |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f: Floor = r["floor"]
        measured = _measured(r["case"], r["budget"]).get("layer")
        lines.append("| " + " | ".join([
            r["case"], r["budget"], f"{measured:.2f}" if measured else "-", f"{2 * measured:.2f}" if measured else "-",
            f"{batch / r['layer']:.2f}", f"{batch / r['sublayer']:.2f}", f"**{batch / f.step_s:.2f}**",
            f"{batch / f.step_s / measured:.2f}x" if measured else "-", ", ".join(f.binding),
            f"{f.gpu_weights_bytes / 1e9:.2f} / {f.streamed_bytes / 1e9:.2f} / {f.cpu_bytes / 1e9:.2f}",
            _free(r["gpu_free"], batch)]) + " |")
    return lines


def _calibrated(calibration: Any) -> int:
    """Units with calibrated figures (``calibration_for`` returns None when none has)."""
    return len(calibration.compute) if calibration is not None else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="gpu.py's tiny models and budgets: checks the script")
    parser.add_argument("--case", choices=("all", "llama", "mixtral"), default="llama",
                        help="gpu.py's cases; mixtral needs a profile with that shape's calibration (the moe step's: "
                             "DEVICE.md), or its figures are the roofline's, which its GPU rows showed far off")
    parser.add_argument("--mixtral-layers", type=int, default=8, help="the Mixtral shape's layers (gpu.py's default 8)")
    parser.add_argument("--profile", default=str(PROFILE), help=f"the GPU host's profile (default {PROFILE.name})")
    parser.add_argument("--time-limit", type=float, default=2.0, help="solve() time limit per plan (default 2 s)")
    parser.add_argument("--out", default=None, help="Markdown report (default: FLOOR.md here; none with --smoke)")
    args = parser.parse_args(argv)
    os.environ["PLACEMENT_OPT_PROFILE"] = args.profile  # before placement_opt reads a profile
    from placement_opt import Workload, trace
    from placement_opt.cost.calibrated import calibration_for

    started = time.time()
    rows, covered, skipped = [], [], []
    for case in _cases(args.case, args.smoke, args.mixtral_layers):
        batch, prompt, steps = case.workload
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=steps, overlap=True)
        folder = _config(case)
        graphs = {"case": case.name, "layer": trace(str(folder)), "sublayer": trace(str(folder), granularity="sublayer")}
        try:
            rows += [_row(graphs, b, workload, args.time_limit) for b in (*case.budgets, None)]
        except NoFloor as exc:  # the other cases still get theirs
            skipped.append(str(exc))
            continue
        covered.append(f"{case.name}: " + ", ".join(
            f"{_calibrated(calibration_for(graphs[cut], _machine(None)))} of {len(graphs[cut])} {cut} units"
            for cut in ("layer", "sublayer")))
    lines = [
        "# The fastest decode any placement could reach: a floor under issue 15's 2x goal", "",
        f"`python benchmarks/phases/floor.py{' --smoke' if args.smoke else ''}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on {platform.machine()} ({os.cpu_count()} cores), "
        f"{time.time() - started:.0f} s. Profile: `{Path(args.profile).name}`; its calibrated figures cover "
        f"{'; '.join(covered)} (the rest priced by the profile's devices). gpu.py's shapes (bf16), batch {batch} x "
        f"{prompt} + {steps}, `Workload(overlap=True)`; decode tokens/s (batch / one step). Predicted columns: "
        f"`solve(time_limit_s={args.time_limit:g})` on the block graph (resident and streamed layers, CPU compute) "
        "and the sublayer graph (every mode), priced by the profile. The floor: the linear program of this script's "
        "docstring over both graphs' units (each layer whole, in parts, or a mix). 'whole GPU': the GPU's memory is "
        "no limit.", "",
        *_table(rows, batch), "", *(f"No floor for {line}" for line in skipped), *([""] if skipped else [])]
    text = "\n".join(lines)
    print(text)
    out = args.out or (None if args.smoke else str(HERE / "FLOOR.md"))
    if out:
        Path(out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
