"""Is the predicted CPU peak at least the measured one, and at most 15 % above it? One fresh process per row.

A row is a Llama shape (hidden 512 or 1024, 2 decoder layers, an 8192-token vocabulary to keep the
logits' compute short on 2 cores), a dtype, batch x prompt, a placement kind that executes on the CPU
(``resident``: every unit in RAM; ``stream``: the decoder layers on disk, read through
``placement_opt.dispatch`` from memory-mapped safetensors) and a call: ``forward`` (``model(ids)``, the
logits of every position, ``Workload(new_tokens=0)``, ``logits="all"``) or ``generate`` (greedy,
``--new`` tokens, the last position's logits, ``logits="last"``).

Each row runs in a fresh subprocess (the parent only starts them, one after the other): random weights,
``dispatch`` of the plan, then one warm-up call at a tiny shape (batch 1 x 8 tokens, the same call) so
that library state (oneDNN primitives, glibc's first arenas, Python's lazy imports) is not counted; then
``gc.collect()``, the offloaded files dropped from the page cache, and the peak RSS reset
(``echo 5 > /proc/self/clear_refs`` resets ``VmHWM`` to the current RSS). Measured: ``VmHWM`` after the
call less the RSS before it; beside it, the peak of ``RssAnon`` (sampled every 1 ms by a thread), which
leaves out pages of memory-mapped files. Predicted: ``predicted_memory(plan, graph, machine, workload)["cpu"]``
less its weights (KV cache + workspace + stream buffer: what the call allocates; the resident weights
are in RAM before it). The rule: ``1.00 <= predicted / measured <= 1.15``.

Usage::

    python benchmarks/cost_accuracy/memory.py                 # the grid; writes benchmarks/cost_accuracy/MEMORY.md
    python benchmarks/cost_accuracy/memory.py --rows 512-float32-16x512-resident-forward
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VOCAB = 8192
LAYERS = 2
SHAPES = {512: (1376, 8, 8), 1024: (2816, 16, 8),  # hidden -> (intermediate, heads, kv heads)
          4096: (14336, 32, 8)}  # Llama-3-8B's layer (not in GRID: 1.7 GB of fp32 weights per row; --rows)
GRID = [  # hidden-dtype-batchxprompt-placement-call; bf16 matmuls are slow on this CPU (no AVX-512): fewer
    *(f"512-float32-{s}-{p}-{c}" for s in ("1x512", "1x1024", "16x512", "16x1024")
      for p in ("resident", "stream") for c in ("forward", "generate")),
    *(f"1024-float32-{s}-resident-{c}" for s in ("1x512", "1x1024", "16x512") for c in ("forward", "generate")),
    "1024-float32-16x512-stream-generate",
    *(f"512-bfloat16-{s}-resident-{c}" for s in ("1x512", "16x512") for c in ("forward", "generate")),
    "512-bfloat16-16x512-stream-forward",
]


def parse_row(name: str) -> dict[str, Any]:
    hidden, dtype, shape, placement, call = name.split("-")
    batch, prompt = (int(x) for x in shape.split("x"))
    return {"name": name, "hidden": int(hidden), "dtype": dtype, "batch": batch, "prompt": prompt,
            "placement": placement, "call": call}


# -- the child: one row ----------------------------------------------------------------------------
def _status_kib(*keys: str) -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+)", text, re.M).group(1)) * 1024 for k in keys}  # type: ignore[union-attr]


class AnonPeak:
    """Peak ``RssAnon`` while the block runs, read every 1 ms by a thread (torch ops release the GIL)."""

    def __enter__(self) -> AnonPeak:
        self.start = self.peak = _status_kib("RssAnon")["RssAnon"]
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, _status_kib("RssAnon")["RssAnon"])
            time.sleep(0.001)

    def __exit__(self, *exc: Any) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, _status_kib("RssAnon")["RssAnon"])


def build_model(row: dict[str, Any]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    inter, heads, kv = SHAPES[row["hidden"]]
    config = LlamaConfig(hidden_size=row["hidden"], intermediate_size=inter, num_hidden_layers=LAYERS,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=VOCAB,
                         tie_word_embeddings=False, max_position_embeddings=4096)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, row["dtype"])).eval()


def make_plan(model: Any, row: dict[str, Any], workload: Any) -> tuple[Any, Any, Any]:
    from placement_opt.cost.evaluate import evaluate
    from placement_opt.hardware.resolve import as_machine
    from placement_opt.model.tracer import trace
    from placement_opt.plan import Plan, UnitPlacement
    from placement_opt.plan_check import graph_fingerprint

    graph = trace(model, dtype=row["dtype"])
    machine = as_machine(["cpu", "disk"], dtype=row["dtype"])
    on_disk = row["placement"] == "stream"
    placed = tuple(UnitPlacement(unit=n, storage="disk" if on_disk and ".layers." in n else "cpu",
                                 execution="cpu", mode="stream" if on_disk and ".layers." in n else "resident")
                   for n in graph.names())
    cost = evaluate(type("P", (), {"placements": placed})(), graph, machine, workload)
    plan = Plan(model_name=graph.meta.model_name, dtype=row["dtype"], objective="latency", strategy="manual",
                placements=placed, machine=machine, workload=workload, cost=cost, status="GREEDY",
                objective_value=cost.total_s, best_bound=0.0, gap=1.0, solve_time_s=0.0,
                fingerprint=graph_fingerprint(graph))
    return plan, graph, machine


def call(model: Any, row: dict[str, Any], batch: int, prompt: int, new: int) -> None:
    import torch

    ids = torch.randint(0, VOCAB, (batch, prompt))
    if row["call"] == "forward":
        model(input_ids=ids, use_cache=True)
    else:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)


def child(row: dict[str, Any], new: int) -> dict[str, Any]:
    import torch

    from placement_opt.cost.evaluate import predicted_memory
    from placement_opt.cost.workload import Workload
    from placement_opt.runtime.dispatcher import dispatch

    torch.set_num_threads(1)
    if os.environ.get("COST_ACCURACY_FIX_MMAP"):
        from placement_opt.runtime.allocator import fix_mmap_threshold

        if not fix_mmap_threshold():
            raise RuntimeError("fix_mmap_threshold() did not take: no glibc?")
    workload = Workload(batch_size=row["batch"], prompt_len=row["prompt"],
                        new_tokens=0 if row["call"] == "forward" else new)
    model = build_model(row)
    plan, graph, machine = make_plan(model, row, workload)
    cpu = predicted_memory(plan, graph, machine, workload)["cpu"]
    offload = Path(tempfile.mkdtemp(prefix="memrow_"))
    handle = dispatch(model, plan, offload_dir=str(offload))
    with torch.inference_mode():
        call(handle.model, row, 1, 8, 2)  # warm-up at a tiny shape: library state, not the row's tensors
        gc.collect()
        evict(offload)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _status_kib("VmRSS")["VmRSS"]
        with AnonPeak() as anon:
            call(handle.model, row, row["batch"], row["prompt"], new)
        hwm = _status_kib("VmHWM")["VmHWM"]
    return {"name": row["name"], "predicted": cpu.used_bytes - cpu.weights_bytes, "kv": cpu.kv_cache_bytes,
            "workspace": cpu.workspace_bytes, "stream": cpu.stream_buffer_bytes, "peak_unit": cpu.peak_unit,
            "measured": hwm - before, "anon": anon.peak - anon.start, "logits": workload.logits_kept}


def evict(folder: Path) -> None:
    """Drop the offloaded files from the page cache, so that the measured call reads them as a cold one does."""
    sys.path.insert(0, str(HERE))
    from run import (
        evict as run_evict,  # run.py's: unmaps mapped pages first, then fadvise(DONTNEED)
    )

    run_evict(folder)


# -- the parent: the grid --------------------------------------------------------------------------
MALLOC = {"glibc": {}, "mmap64k": {"COST_ACCURACY_FIX_MMAP": "1"}}
"""Allocator settings a row runs under: glibc's defaults (a dynamic mmap threshold, which rises to the size of
the largest block freed, up to 32 MiB: blocks below it come from the heap, whose freed middle is not given
back), and a fixed 64 KiB threshold set in the child by ``placement_opt.runtime.allocator.fix_mmap_threshold()``
before the model is built (every block of 64 KiB or more is its own mapping, unmapped when freed)."""


def run_row(name: str, new: int, malloc: str) -> dict[str, Any]:
    env = {**os.environ, "PLACEMENT_OPT_PROFILE": str(Path(tempfile.gettempdir()) / "memrow-profile.json"),
           "OMP_NUM_THREADS": "1", **MALLOC[malloc]}
    out = subprocess.run([sys.executable, __file__, "--child", name, "--new", str(new)], env=env,
                         capture_output=True, text=True, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode or not lines:
        return {"name": name, "error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def verdict(ratio: float) -> str:
    return "yes" if 1.0 <= ratio <= 1.15 else ("UNDER" if ratio < 1 else "over")


def table(results: list[dict[str, dict[str, Any]]]) -> list[str]:
    lines = ["| row (hidden-dtype-batch x prompt-placement-call) | logits | predicted (MiB) | kv / workspace / stream "
             "(MiB) | peak unit | glibc: VmHWM growth (MiB) | pred / meas | rule | mmap64k: VmHWM growth (MiB) | "
             "pred / meas | rule | mmap64k: RssAnon growth (MiB) | (kv + workspace) / RssAnon |",
             "|---|---|---:|---|---|---:|---:|:---:|---:|---:|:---:|---:|---:|"]
    for by in results:
        r = next((x for x in by.values() if "error" not in x), None)
        if r is None:
            first = next(iter(by.values()))
            lines.append(f"| {first['name']} | error: {first['error'][:80]} |" + " |" * 11)
            continue
        cells = [f"| {r['name']} | {r['logits']} | {mib(r['predicted'])} | {mib(r['kv'])} / {mib(r['workspace'])} / "
                 f"{mib(r['stream'])} | {r['peak_unit']} |"]
        for mode in MALLOC:
            m = by[mode]
            if "error" in m:
                cells.append(f" error: {m['error'][:60]} | | |")
                continue
            ratio = m["predicted"] / max(1, m["measured"])
            cells.append(f" {mib(m['measured'])} | {ratio:.2f} | {verdict(ratio)} |")
        anon = by["mmap64k"].get("anon", 0)
        cells.append(f" {mib(anon)} | {(r['kv'] + r['workspace']) / max(1, anon):.2f} |")
        lines.append("".join(cells))
    return lines


def write(out: Path, results: list[dict[str, dict[str, Any]]], args: argparse.Namespace, wall_s: float,
          load: tuple[float, float]) -> None:
    import platform

    import torch

    rows = [by for by in results if all("error" not in m for m in by.values())]
    ok = {mode: sum(1.0 <= by[mode]["predicted"] / max(1, by[mode]["measured"]) <= 1.15 for by in rows)
          for mode in MALLOC}
    head = [
        "# Predicted CPU peak against the measured RSS growth, one fresh process per row",
        "",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; wall time {wall_s:.0f} s; "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 intra-op thread per row; "
        f"1-minute load {load[0]:.1f} at the start, {load[1]:.1f} at the end (other jobs share the machine).",
        f"- Command: `python benchmarks/cost_accuracy/memory.py --new {args.new}` (see its docstring for the rows, "
        "the warm-up and how the peak is read).",
        f"- Rule `1.00 <= predicted / measured <= 1.15`: glibc defaults {ok['glibc']} of {len(rows)} rows; "
        f"`fix_mmap_threshold()` (64 KiB, `mmap64k` columns) {ok['mmap64k']} of {len(rows)}.",
        "",
    ]
    out.write_text("\n".join(head + table(results)) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(GRID), help="comma-separated row names (see GRID)")
    parser.add_argument("--new", type=int, default=4, help="tokens generate() makes (decode steps + 1)")
    parser.add_argument("--out", default=str(HERE / "MEMORY.md"), help="where the table goes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(parse_row(args.child), args.new)), flush=True)
        return
    results, begun, load = [], time.perf_counter(), os.getloadavg()[0]
    for name in args.rows.split(","):
        results.append({})
        for mode in MALLOC:
            started = time.perf_counter()
            results[-1][mode] = run_row(name, args.new, mode)
            print(f"{name} {mode}: {results[-1][mode]} ({time.perf_counter() - started:.0f} s)", flush=True)
    print("\n".join(table(results)))
    write(Path(args.out), results, args, time.perf_counter() - begun, (load, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
