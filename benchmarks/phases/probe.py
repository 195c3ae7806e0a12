"""Two questions the first GPU run left (benchmarks/phases/GPU.md, cost_accuracy/GPU.md), each answered in seconds.

1. **Does a decode step cost more at a context length the process has not run before, and is cuDNN attention why?**
   A one-layer Llama-3.1-8B-shaped model (random bf16 weights) prefills 512 tokens, then decodes ``--steps`` steps
   (first visits), then the same steps run again from a copy of the prompt's KV cache (second visits); each
   step synchronised and timed. Once with torch's default SDPA backends and once with cuDNN attention switched off
   (``torch.backends.cuda.enable_cudnn_sdp(False)``, restored after), at batch 1 and 16.
2. **How fast does a layer's KV cache leave the GPU?** The prompt's cache of one layer at batch x 512 tokens copied
   to the CPU as the dispatcher moves a phased unit's (``.to("cpu")``: blocking, into new pageable memory), and
   into pinned memory with a non-blocking copy (a pinned buffer taken first, its allocation timed apart).

Usage::

    python benchmarks/phases/probe.py --out probe.md     # on a CUDA machine (about 20 s)
    python benchmarks/phases/probe.py --smoke            # any machine: a tiny Llama on the CPU, checks the script
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

LLAMA_8B_LAYER = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=1024)
PROMPT = 512


def build(smoke: bool) -> tuple[Any, torch.device]:
    import transformers as T

    from placement_opt.runtime._calibrate_build import build as build_copy

    device = torch.device("cpu" if smoke else "cuda:0")
    config = T.LlamaConfig(**(TINY if smoke else LLAMA_8B_LAYER), tie_word_embeddings=False)
    return build_copy(config, "float32" if smoke else "bfloat16", device), device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def sdpa(cudnn: bool) -> Iterator[None]:
    """cuDNN attention on or off for the block (the default on Hopper under torch 2.11 is on), restored after."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def step_times(model: Any, device: torch.device, batch: int, steps: int) -> tuple[list[float], list[float]]:
    """Each decode step's seconds after a 512-token prefill: first visits, then the same contexts again."""
    from placement_opt.runtime.timing import cache_argument, cache_of

    ids = torch.randint(0, model.config.vocab_size, (batch, PROMPT), device=device)
    prompt = cache_of(model(input_ids=ids, use_cache=True))
    visits: list[list[float]] = []
    for _ in range(2):
        cache, seconds = copy.deepcopy(prompt), []  # each visit from the prompt's cache
        for _ in range(steps):
            token = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
            sync(device)
            start = time.perf_counter()
            cache = cache_of(model(input_ids=token, use_cache=True, **cache_argument(model, cache)))
            sync(device)
            seconds.append(time.perf_counter() - start)
        visits.append(seconds)
    return visits[0], visits[1]


def kv_move(model: Any, device: torch.device, batch: int, repeats: int = 5) -> dict[str, float]:
    """Bytes/s of one layer's prompt KV cache (keys and values) leaving ``device``: as the dispatcher moves it, and
    into pinned memory; with the pinned buffers' allocation on its own."""
    config = model.config
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    kv = [torch.randn(batch, heads, PROMPT, dim, dtype=model.dtype, device=device) for _ in range(2)]
    size = sum(t.numel() * t.element_size() for t in kv)

    def best(call: Any) -> float:
        times = []
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            call()
            sync(device)
            times.append(time.perf_counter() - start)
        return min(times)

    pin = device.type == "cuda"
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in kv]
    return {"bytes": size,
            "to_cpu": size / best(lambda: [t.to("cpu") for t in kv]),
            "pinned_alloc": size / best(lambda: [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in kv]),
            "into_pinned": size / best(lambda: [b.copy_(t, non_blocking=pin) for b, t in zip(buffers, kv, strict=True)])}


def run(smoke: bool, steps: int) -> list[str]:
    model, device = build(smoke)
    name = "CPU (--smoke)" if smoke else torch.cuda.get_device_name(device)
    lines = [f"Device: {name}; torch {torch.__version__}; one Llama-3.1-8B-shaped layer{' (tiny)' if smoke else ''}, "
             f"random weights, prompt {PROMPT}, {steps} decode steps per visit; seconds per step, median (max).", "",
             "| SDPA | batch | first visit | second visit | first / second |", "|---|---:|---:|---:|---:|"]
    with torch.inference_mode():
        for cudnn in (True, False):
            for batch in (1, 16):
                with sdpa(cudnn):
                    first, second = step_times(model, device, batch, steps)
                label = "default" if cudnn else "cuDNN off"
                lines.append(f"| {label} | {batch} | {statistics.median(first) * 1e3:.2f} ms ({max(first) * 1e3:.1f}) | "
                             f"{statistics.median(second) * 1e3:.2f} ms ({max(second) * 1e3:.1f}) | "
                             f"{statistics.median(first) / statistics.median(second):.1f}x |")
                print(lines[-1], flush=True)
        lines += ["", "| one layer's prompt KV cache | batch | bytes | .to('cpu') | pinned allocation | copy into pinned |",
                  "|---|---:|---:|---:|---:|---:|"]
        for batch in (1, 16):
            rates = kv_move(model, device, batch)
            lines.append(f"| leaving {device} | {batch} | {rates['bytes']} | {rates['to_cpu'] / 1e9:.2f} GB/s | "
                         f"{rates['pinned_alloc'] / 1e9:.2f} GB/s | {rates['into_pinned'] / 1e9:.2f} GB/s |")
            print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU: checks the script anywhere")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per visit (default 24)")
    parser.add_argument("--out", type=Path, default=None, help="a Markdown file for the tables (default: printed)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    lines = run(args.smoke, args.steps if not args.smoke else min(args.steps, 4))
    text = "\n".join(["# First visits of decode contexts, and a KV cache leaving the GPU", "",
                      f"Command: `python benchmarks/phases/probe.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
                      "", *lines, ""])
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
