"""load() of a checkpoint transformers converts at load time: one weight at a time against from_pretrained whole.

A Mixtral checkpoint stores every expert's ``w1``/``w2``/``w3`` apart; the model holds one fused
``gate_up_proj`` and ``down_proj`` per layer. ``load()`` fuses them with transformers' own conversion mapping,
one weight at a time, straight to each weight's storage (disk units into ``offload_dir``). Before, it let
``from_pretrained`` read the whole model into RAM first, then applied the plan; that path is still the
fallback when transformers' mapping cannot be read, and this script runs it by making the mapping unreadable.

Each mode runs in a fresh process, on the same checkpoint (a random fp32 Mixtral-shaped model written by
``save_pretrained``; the page cache warm: it was just written), with the same plan (every decoder layer on
disk, computed on the CPU; embeddings, norm and head in RAM). Per mode: load() wall time, the peak of the
process's anonymous memory during load() (``RssAnon``, sampled every 1 ms: file pages the kernel can drop
are not counted) above what it held before, and the logits of one forward, compared across modes.

Usage::

    python benchmarks/dispatch/convert.py                      # writes CONVERT.md here
    python benchmarks/dispatch/convert.py --layers 2 --out /tmp/c.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "cost_accuracy"))
import memory as cost_memory  # noqa: E402 - its AnonPeak: the RssAnon peak sampler
import run as cost_accuracy  # noqa: E402 - its make_plan: a plan of a given storage map, priced

MODES = ("converted", "from_pretrained")


def build(path: Path, layers: int, hidden: int, intermediate: int, experts: int) -> int:
    """Write the checkpoint; return its bytes."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=intermediate,
                                        num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                        num_key_value_heads=hidden // 256, num_local_experts=experts,
                                        num_experts_per_tok=2, max_position_embeddings=512)
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def child(mode: str, path: Path, offload: Path, out: Path) -> None:
    """One load() in this process; its figures and logits written to ``out``."""
    torch.set_num_threads(1)
    import placement_opt.runtime.loader as loader
    from placement_opt.cost.workload import Workload
    from placement_opt.hardware.resolve import as_machine
    from placement_opt.model.tracer import trace
    from placement_opt.runtime.checkpoint import meta_model

    if mode == "from_pretrained":
        loader.conversions = lambda *args: None  # the mapping unreadable: the fallback reads the model whole
    graph = trace(meta_model(path, None), dtype="float32")
    names = graph.names()
    plan = cost_accuracy.make_plan({n: "disk" if ".layers." in n else "cpu" for n in names}, graph,
                                   as_machine(["cpu", "disk"], dtype="float32"),
                                   Workload(batch_size=1, prompt_len=32, new_tokens=1))
    with cost_memory.AnonPeak() as peak:
        started = time.perf_counter()
        handle = loader.load(path, None, plan=plan, offload_dir=offload, progress=False)
        wall = time.perf_counter() - started
    ids = torch.randint(0, 4096, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = handle(input_ids=ids).logits
    torch.save(logits, out.with_suffix(".pt"))
    out.write_text(json.dumps({"mode": mode, "wall_s": wall, "anon_peak_bytes": peak.peak - peak.start}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="processes per mode, alternating (default 2)")
    parser.add_argument("--out", type=Path, default=HERE / "CONVERT.md")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "CKPT", "OFFLOAD", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, path, offload, out = args.child
        child(mode, Path(path), Path(offload), Path(out))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        total = build(work / "ckpt", args.layers, args.hidden, args.intermediate, args.experts)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        logits: dict[str, torch.Tensor] = {}
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                out = work / f"{mode}-{r}.json"
                offload = work / f"offload-{mode}-{r}"  # a fresh one: every run writes its disk units
                subprocess.run([sys.executable, __file__, "--child", mode, str(work / "ckpt"), str(offload), str(out)],
                               check=True)
                shutil.rmtree(offload)
                runs[mode].append(json.loads(out.read_text()))
                logits[mode] = torch.load(out.with_suffix(".pt"))
        diff = (logits["converted"] - logits["from_pretrained"]).abs().max().item()
        scale = logits["from_pretrained"].abs().max().item()
    _write(args, total, runs, diff, scale)


def _write(args: argparse.Namespace, total: int, runs: dict[str, list[dict]], diff: float, scale: float) -> None:
    mib = 2**20
    lines = [
        "# load() of a Mixtral-layout checkpoint: weights fused one at a time against from_pretrained whole",
        "",
        f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()}, torch {torch.__version__}, "
        f"Python {platform.python_version()}, 1 intra-op thread.",
        f"- Command: `python benchmarks/dispatch/convert.py --layers {args.layers} --hidden {args.hidden} "
        f"--intermediate {args.intermediate} --experts {args.experts} --repeats {args.repeats}`",
        f"- Checkpoint: random fp32 Mixtral-shaped model, {args.layers} layers x {args.experts} experts, hidden "
        f"{args.hidden}, {total / mib:.0f} MiB, written by `save_pretrained` (experts one tensor each). Plan: every "
        f"decoder layer on disk (into `offload_dir`), the rest in RAM. One fresh process per load, the modes "
        f"alternating, each into an empty `offload_dir`; the page cache warm.",
        "- Anonymous peak: the most `RssAnon` seen during `load()` above what the process held before it (sampled "
        "every 1 ms); memory-mapped file pages, which the kernel can drop, are not in it.",
        f"- Logits of one forward (batch 1 x 32), the two modes: largest difference {diff:.2g} (largest logit "
        f"{scale:.3g}; fp32 rounding: the model `from_pretrained` builds may run its experts through another kernel).",
        "",
        "| mode | load() wall, median (s) | runs (s) | anonymous peak, median (MiB) | runs (MiB) |",
        "|---|---:|---|---:|---|",
    ]
    for mode in MODES:
        walls = [r["wall_s"] for r in runs[mode]]
        peaks = [r["anon_peak_bytes"] / mib for r in runs[mode]]
        lines.append(f"| {mode} | {statistics.median(walls):.2f} | {', '.join(f'{w:.2f}' for w in walls)} | "
                     f"{statistics.median(peaks):.0f} | {', '.join(f'{p:.0f}' for p in peaks)} |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
