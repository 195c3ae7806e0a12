"""Masked prompts on this machine: is a padded batch's prefill, and a sliding window's, priced at what it costs?

transformers hands sdpa its causal flag alone for equal prompts below a sliding window, and the kernel skips the
blocks above the diagonal; for a padded batch, or a sliding layer once the prompt reaches its window, it hands a
mask, and the kernel computes every query x key pair (``cost.kernels.prompt_attention_pairs``). This script
measures both on the CPU, side by side in one run, against the predictions:

* models: ``run.py``'s small Llama (hidden 512 x 8 layers, fp32, random weights written with ``save_pretrained``)
  and a Mistral of the same shape with a sliding window of :data:`WINDOW` tokens;
* inputs: batch 1 x each prompt of ``--prompts``, equal (no mask) and padded (the first position masked out,
  as a left-padded sequence of a batch is);
* measured: the median of ``--repeats`` prefill forwards of the whole model on the CPU (logits of the last
  position, as ``generate`` asks), after one untimed;
* predicted, for the same resident CPU placement through ``placement_opt.evaluate``: ``before`` from the
  profile (the roofline; ``profile(quick=True)`` first where the CPU has none), ``after`` from ``placement_opt.calibrate`` at that prompt (which times equal prompts:
  a padded workload adds the mask's pairs to it), and ``as equal`` the price of the equal prompt, which is what
  a padded workload was priced at before the pairs were counted.

Usage::

    python benchmarks/cost_accuracy/masked.py                   # writes benchmarks/cost_accuracy/MASKED.md
    python benchmarks/cost_accuracy/masked.py --prompts 512 --repeats 2 --out -   # a smoke run, printed
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import VOCAB, build, config_of, make_plan  # noqa: E402 - the CPU benchmark's models and plans

HERE = Path(__file__).resolve().parent
#: The sliding window of the Mistral-shaped model: below the default prompts, so its mask is built.
WINDOW = 512


def mistral_config() -> Any:
    """``run.py``'s small shape as a Mistral with a sliding window."""
    from transformers import MistralConfig

    small = config_of("small", None)
    config = MistralConfig(hidden_size=small.hidden_size, intermediate_size=small.intermediate_size,
                           num_hidden_layers=small.num_hidden_layers, num_attention_heads=small.num_attention_heads,
                           num_key_value_heads=small.num_key_value_heads, vocab_size=VOCAB, tie_word_embeddings=False,
                           max_position_embeddings=8192, sliding_window=WINDOW)
    config.dtype = "float32"
    return config


def measured_prefill(model: torch.nn.Module, prompt: int, padded: bool, repeats: int) -> float:
    """Median seconds of a batch-1 prefill forward (one untimed before)."""
    ids = torch.randint(0, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, prompt, dtype=torch.long)
    if padded:
        mask[0, 0] = 0
    seconds = []
    with torch.inference_mode():
        for k in range(repeats + 1):
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
            if k:
                seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def priced(graph: Any, machine: Any, prompt: int, padded: bool) -> float:
    """The prefill seconds ``evaluate`` prices every unit resident on the CPU at."""
    from placement_opt.cost.evaluate import evaluate
    from placement_opt.cost.workload import Workload

    workload = Workload(batch_size=1, prompt_len=prompt, new_tokens=1, padded=padded)
    plan = make_plan({n: "cpu" for n in graph.names()}, graph, machine, workload)
    return evaluate(plan, graph, machine, workload).prefill_s


def bench(name: str, config: Any, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    import placement_opt
    from placement_opt.cost.workload import Workload
    from placement_opt.hardware.resolve import as_machine
    from placement_opt.model.tracer import trace

    folder = work / name
    model = build(config, folder)
    graph = trace(model, dtype="float32")
    machine = as_machine(["cpu"], dtype="float32")
    if not machine["cpu"].source.startswith("measured"):  # "before" prices from the profile, as run.py's does
        machine = placement_opt.profile(["cpu"], dtype="float32", quick=True)
    rows = []
    for prompt in args.prompts:
        before = {padded: priced(graph, machine, prompt, padded) for padded in (False, True)}
        placement_opt.calibrate(folder, ["cpu"], workload=Workload(batch_size=1, prompt_len=prompt, new_tokens=1),
                                dtype="float32")
        after = {padded: priced(graph, machine, prompt, padded) for padded in (False, True)}
        for padded in (False, True):
            seconds = measured_prefill(model, prompt, padded, args.repeats)
            rows.append({"model": name, "prompt": prompt, "padded": padded, "before": before[padded],
                         "after": after[padded], "as_equal": after[False], "measured": seconds})
            print(f"{name:8s} {prompt:5d} {'padded' if padded else 'equal':6s} before {before[padded]:.4f} "
                  f"after {after[padded]:.4f} as equal {after[False]:.4f} measured {seconds:.4f}", flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | prompt | prompts | before (s) | after (s) | as equal (s) | measured median (s) | "
             "before / measured | after / measured | as equal / measured | after within +-25% |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        ratio = r["after"] / r["measured"]
        lines.append(f"| {r['model']} | {r['prompt']} | {'padded' if r['padded'] else 'equal'} | {r['before']:.4f} | "
                     f"{r['after']:.4f} | {r['as_equal']:.4f} | {r['measured']:.4f} | "
                     f"{r['before'] / r['measured']:.2f} | {ratio:.2f} | {r['as_equal'] / r['measured']:.2f} | "
                     f"{'yes' if abs(ratio - 1) <= 0.25 else 'no'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="1024,2048", help="prompt lengths, e.g. 1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefill forwards per row (after one untimed)")
    parser.add_argument("--out", default=str(HERE / "MASKED.md"), help="'-': print only")
    args = parser.parse_args()
    args.prompts = [int(p) for p in args.prompts.split(",")]
    started, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="masked-") as tmp:
        rows = bench("llama", config_of("small", None), args, Path(tmp))
        rows += bench("mistral", mistral_config(), args, Path(tmp))
    lines = ["# Masked prompts: predicted against measured prefill on this machine", "",
             f"- Date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; wall time {time.perf_counter() - started:.0f} s",
             f"- Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} with "
             f"{torch.get_num_threads()} threads, Python {platform.python_version()}; 1-minute load average {load:.1f} "
             f"at the start, {os.getloadavg()[0]:.1f} at the end.",
             f"- Command: `python benchmarks/cost_accuracy/masked.py --prompts {','.join(map(str, args.prompts))} "
             f"--repeats {args.repeats}`",
             f"- Models: run.py's small shape (hidden 512 x 8 layers, fp32) as a Llama, and as a Mistral with a "
             f"{WINDOW}-token sliding window; every unit resident on the CPU. `as equal`: the calibrated price of the "
             f"equal prompt, what a padded workload was priced at before a mask's pairs were counted.", "",
             *table(rows), ""]
    text = "\n".join(lines)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
