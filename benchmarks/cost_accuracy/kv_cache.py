"""A decode step's growth with its KV cache on this machine's CPU: predicted against measured, with the cache
priced as read once, as transformers' DynamicCache moves it (three passes), and with the page faults of its
keys and values allocated anew at every step once they pass glibc's mmap threshold, in one run.

A Llama layer (hidden 1024, 16 heads, 4 KV heads of 64, fp32, random weights) runs decode steps at fixed contexts
(the cache cropped back after each step), timed with forward hooks (median of ``--steps``); the predictions use
this machine's profile (``placement_opt.profile(quick=True)``, run first) and differ only in
``CACHE_PASSES_PER_STEP`` and in whether the CPU carries the profile's ``fresh_page_bytes_per_s``. Prints a
Markdown table.

    python benchmarks/cost_accuracy/kv_cache.py --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import transformers as T


def measured_step(model: torch.nn.Module, batch: int, context: int, steps: int) -> float:
    """Median seconds of the first layer in a decode step at ``context`` cached tokens per sequence."""
    layer, start, taken = model.model.layers[0], {}, []
    hooks = [layer.register_forward_pre_hook(lambda *_: start.__setitem__("t", time.perf_counter())),
             layer.register_forward_hook(lambda *_: taken.append(time.perf_counter() - start["t"]))]
    try:
        with torch.no_grad():
            cache = model(input_ids=torch.randint(0, 1000, (batch, context)), use_cache=True).cache
            taken.clear()
            for _ in range(steps + 1):
                model(input_ids=torch.randint(0, 1000, (batch, 1)), cache=cache, use_cache=True)
                cache.crop(-1)  # back to the context: every step is timed at it
    finally:
        for hook in hooks:
            hook.remove()
    return statistics.median(taken[1:])  # the first step warms up


def predicted_step(graph: Any, machine: Any, batch: int, context: int, passes: int) -> float:
    import placement_opt.cost.kernels as kernels
    import placement_opt.cost.pricing as pricing
    from placement_opt.cost.build import price_problem
    from placement_opt.cost.workload import Workload

    kept = kernels.CACHE_PASSES_PER_STEP  # the kernels' step and the host traffic both read it
    kernels.CACHE_PASSES_PER_STEP = pricing.CACHE_PASSES_PER_STEP = passes
    try:
        _, prices = price_problem(graph, machine, Workload(batch_size=batch, prompt_len=context, new_tokens=1),
                                  ("resident",), None, False)
    finally:
        kernels.CACHE_PASSES_PER_STEP = pricing.CACHE_PASSES_PER_STEP = kept
    index = graph.names().index("model.layers.0")
    return next(p for p in prices[index] if p.storage == p.execution == "cpu").decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    import placement_opt
    from placement_opt.hardware.devices import Machine, replace_device
    from placement_opt.model.tracer import trace

    machine = placement_opt.profile(["cpu"], quick=True, dtype="float32", progress=False)
    unpaged = Machine([replace_device(machine.cpu, fresh_page_bytes_per_s=None)])
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=16,
                           num_key_value_heads=4, vocab_size=1000)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    graph = trace(model, dtype="float32")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; Llama layer, fp32, median of {args.steps} "
          f"steps; CPU profile: {machine.cpu.bandwidth_bytes_per_s / 1e9:.1f} GB/s, fresh pages "
          f"{(machine.cpu.fresh_page_bytes_per_s or 0) / 1e9:.1f} GB/s\n")
    print("| batch | context | measured ms | 1 pass ms | ratio | 3 passes ms | ratio | 3 passes + pages ms | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, context in [(1, 1024), (1, 4096), (8, 1024), (8, 4096), (16, 4096)]:
        measured = measured_step(model, batch, context, args.steps)
        predicted = [predicted_step(graph, unpaged, batch, context, 1), predicted_step(graph, unpaged, batch, context, 3),
                     predicted_step(graph, machine, batch, context, 3)]
        print(f"| {batch} | {context} | {measured * 1e3:.2f} | "
              + " | ".join(f"{p * 1e3:.2f} | {p / measured:.2f}" for p in predicted) + " |")


if __name__ == "__main__":
    main()
