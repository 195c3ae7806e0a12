"""Latent attention's decode step on this machine's CPU: predicted against measured, per layer, before and after
the re-expansion of the cached latents was priced (``latent_expand_*``), in one run.

A DeepSeek-V2-Lite-shaped model (its published sizes; random bf16 weights) cut to two layers, one dense and one
MoE, runs decode steps at fixed contexts (the cache cropped back after each step); each layer's step is timed
with forward hooks (median of ``--steps``). The predictions price the same layer computed on the CPU at that
context with this machine's profile (``placement_opt.profile(quick=True)``, run first), from the graph as traced
(after) and with the latent figures removed (before). Prints a Markdown table.

    python benchmarks/cost_accuracy/latent.py --contexts 256 1024 4096 --steps 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import transformers as T

LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
            num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
            qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1)


def step_times(model: torch.nn.Module, layers: list[str], context: int, steps: int) -> dict[str, float]:
    """Median seconds each layer takes in a decode step at ``context`` cached tokens (batch 1)."""
    from placement_opt.runtime.timing import cache_argument, cache_of

    started: dict[str, float] = {}
    taken: dict[str, list[float]] = {name: [] for name in layers}
    hooks = []
    for name in layers:
        module = model.get_submodule(name)
        hooks.append(module.register_forward_pre_hook(lambda _m, _a, n=name: started.__setitem__(n, time.perf_counter())))
        hooks.append(module.register_forward_hook(
            lambda _m, _a, _o, n=name: taken[n].append(time.perf_counter() - started[n])))
    try:
        with torch.no_grad():
            cache = cache_of(model(input_ids=torch.randint(0, 1000, (1, context)), use_cache=True))
            for name in layers:
                taken[name].clear()  # the prompt's forward
            for _ in range(steps + 1):
                model(input_ids=torch.randint(0, 1000, (1, 1)), **cache_argument(model, cache), use_cache=True)
                cache.crop(-1)  # back to the context: every step is timed at it
    finally:
        for hook in hooks:
            hook.remove()
    return {name: statistics.median(times[1:]) for name, times in taken.items()}  # the first step warms up


def predicted_step(graph: Any, machine: Any, name: str, context: int) -> float:
    """The cost model's decode step of unit ``name`` computed on the CPU from RAM at ``context`` cached tokens."""
    from placement_opt.cost.build import price_problem
    from placement_opt.cost.workload import Workload

    workload = Workload(batch_size=1, prompt_len=context, new_tokens=1)
    _, prices = price_problem(graph, machine, workload, ("resident",), None, False)
    index = graph.names().index(name)
    return next(p for p in prices[index] if p.storage == p.execution == "cpu").decode_s


def without_latent(graph: Any) -> Any:
    from placement_opt.model.graph import LATENT_NODE_ATTRIBUTES, LayerGraph

    stripped = graph.nx.copy()
    for _, data in stripped.nodes(data=True):
        for key in LATENT_NODE_ATTRIBUTES:
            data.pop(key, None)
    return LayerGraph(stripped, graph.meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    import placement_opt
    from placement_opt.model.tracer import trace

    machine = placement_opt.profile(["cpu"], quick=True, dtype="bfloat16", progress=False)
    torch.manual_seed(0)
    config = T.DeepseekV2Config(num_hidden_layers=2, **LITE)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16).eval()
    graph = trace(model, dtype="bfloat16")
    before = without_latent(graph)
    layers = ["model.layers.0", "model.layers.1"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; DeepSeek-V2-Lite shape, 2 layers, bf16, "
          f"batch 1, median of {args.steps} steps\n")
    print("| layer | context | measured ms | predicted before ms | ratio | predicted after ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        measured = step_times(model, layers, context, args.steps)
        for name in layers:
            old, new = (predicted_step(g, machine, name, context) for g in (before, graph))
            print(f"| {name} | {context} | {measured[name] * 1e3:.2f} | {old * 1e3:.2f} | {old / measured[name]:.2f} "
                  f"| {new * 1e3:.2f} | {new / measured[name]:.2f} |")


if __name__ == "__main__":
    main()
