"""What ``fix_mmap_threshold()`` costs a CPU forward: prefill and decode steps under glibc's dynamic mmap
threshold and under fixed ones, one fresh process per measurement.

Each child builds a random Llama (fp32, 1 intra-op thread, 8192-token vocabulary; hidden 512 with 2
layers, or hidden 2048 with 4), fixes the threshold first when asked, warms up at 8 tokens, then times 4
prefills (the median of the last 3) and 12 decode steps on the KV cache the last prefill made (the median
of the last 10). The parent runs every (shape, threshold) once per round, for ``--rounds`` rounds, and
reports medians over the rounds with their ratio to glibc's default in the same shape.

Usage::

    python benchmarks/cost_accuracy/allocator.py          # writes benchmarks/cost_accuracy/ALLOCATOR.md
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = [(512, 16, 512), (2048, 1, 128)]  # hidden, batch, prompt
THRESHOLDS = [0, 64 * 2**10, 2**20]  # 0: glibc's default (dynamic)
LAYERS = {512: 2, 2048: 4}
INTERMEDIATE = {512: 1376, 2048: 5632}


def child(threshold: int, hidden: int, batch: int, prompt: int) -> tuple[float, float]:
    if threshold:
        from placement_opt.runtime.allocator import fix_mmap_threshold

        if not fix_mmap_threshold(threshold):
            raise RuntimeError("fix_mmap_threshold() did not take: no glibc?")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from placement_opt.runtime.timing import cache_argument, cache_of

    torch.set_num_threads(1)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=INTERMEDIATE[hidden], num_hidden_layers=LAYERS[hidden],
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256 if hidden > 512 else hidden // 64,
                         vocab_size=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(0, 8192, (batch, prompt))
    prefill, decode = [], []
    with torch.inference_mode():
        model(input_ids=ids[:, :8])
        for _ in range(4):
            start = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            prefill.append(time.perf_counter() - start)
        cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
        for _ in range(12):
            start = time.perf_counter()
            out = model(input_ids=token, **cache_argument(model, cache), use_cache=True)
            decode.append(time.perf_counter() - start)
            cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
    return statistics.median(prefill[1:]), statistics.median(decode[2:])


def run(threshold: int, shape: tuple[int, int, int]) -> tuple[float, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", str(threshold), *map(str, shape)], env=env,
                         capture_output=True, text=True, check=True)
    prefill, decode = out.stdout.split()[-2:]
    return float(prefill), float(decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "ALLOCATOR.md"))
    parser.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(*child(*args.child))
        return
    started, load = time.perf_counter(), os.getloadavg()[0]
    results: dict[tuple[tuple[int, int, int], int], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):  # every setting once per round: a slow minute of the machine hits all alike
        for shape, threshold in itertools.product(SHAPES, THRESHOLDS):
            results.setdefault((shape, threshold), []).append(run(threshold, shape))
    lines = ["# What `fix_mmap_threshold()` costs a CPU forward", "",
             f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; wall time {time.perf_counter() - started:.0f} s; "
             f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; 1-minute load "
             f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
             f"- Command: `python benchmarks/cost_accuracy/allocator.py --rounds {args.rounds}` (see its docstring).",
             "- Medians over the rounds of each process's median prefill and median decode step; ratios against "
             "glibc's default threshold in the same shape.", "",
             "| hidden, layers, batch x prompt | threshold | prefill (ms) | x default | decode step (ms) | x default |",
             "|---|---|---:|---:|---:|---:|"]
    for shape, threshold in itertools.product(SHAPES, THRESHOLDS):
        base = results[shape, 0]
        pre, dec = (statistics.median(r[k] for r in results[shape, threshold]) for k in (0, 1))
        pre0, dec0 = (statistics.median(r[k] for r in base) for k in (0, 1))
        name = "glibc default" if not threshold else f"fixed {threshold // 1024} KiB"
        lines.append(f"| {shape[0]}, {LAYERS[shape[0]]}, {shape[1]} x {shape[2]} | {name} | {pre * 1e3:.1f} | "
                     f"{pre / pre0:.2f} | {dec * 1e3:.2f} | {dec / dec0:.2f} |")
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
