"""The host's time per unit on this machine's CPU: a fixed overhead per unit (before) against the trace's op count x
the profile's seconds per op (after), predicted against measured, in one run, uncalibrated.

Models with random fp32 weights, every unit resident on the CPU: tiny Llama, Mixtral and GPT-2 (hidden 64, 2 layers,
where the host's time is nearly all of a step), and cost_accuracy's ``small``, ``moe`` and ``mid`` shapes
(``run.py``). Measured as ``run.py`` measures: the median of ``--repeats`` prefills (batch 1 x ``--prompt``, the
last position's logits) and of ``--steps`` decode steps. Both predictions use one CPU profile
(``placement_opt.profile(quick=True)``, run first) through ``placement_opt.evaluate``; "before" prices the same
graph with its op counts removed. Prints a Markdown table.

    python benchmarks/cost_accuracy/ops.py --steps 16 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import transformers as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import config_of, measure  # noqa: E402

#: Tiny models (hidden 64, 2 layers): their steps are nearly all the host's time.
_TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=32000)


def tiny_configs() -> dict[str, Any]:
    return {"tiny llama": T.LlamaConfig(**_TINY_SIZES),
            "tiny mixtral": T.MixtralConfig(**_TINY_SIZES, num_local_experts=4, num_experts_per_tok=2),
            "tiny gpt2": T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=32000, bos_token_id=0, eos_token_id=0)}


def uncounted(graph: Any) -> Any:
    """``graph`` without its op counts: every unit priced with the fixed ``UNIT_OVERHEAD_S``."""
    from placement_opt.model.graph import LayerGraph

    digraph = graph.nx.copy()
    for _, attrs in digraph.nodes(data=True):
        attrs.pop("ops_per_forward", None)
    return LayerGraph(digraph, graph.meta)


def predicted(graph: Any, machine: Any, workload: Any) -> tuple[float, float]:
    """(prefill s, mean decode step s) of every unit resident on the CPU."""
    from placement_opt.cost.evaluate import evaluate

    cost = evaluate({n: "cpu" for n in graph.names()}, graph, machine, workload)
    return cost.prefill_s, cost.decode_s / max(1, workload.new_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128)
    args = parser.parse_args()
    import placement_opt
    from placement_opt.cost.workload import Workload
    from placement_opt.model.tracer import trace

    machine = placement_opt.profile(["cpu"], quick=True, dtype="float32", progress=False)
    workload = Workload(batch_size=1, prompt_len=args.prompt, new_tokens=args.steps)
    print(f"torch {torch.__version__}, transformers {T.__version__}, {torch.get_num_threads()} threads; fp32, batch 1 "
          f"x {args.prompt}; medians of {args.repeats} prefills and {args.steps} decode steps; CPU profile: "
          f"{machine.cpu.op_overhead_s * 1e6:.2f} us per op\n")
    print("| model | ops per step | phase | measured ms | fixed overhead ms | ratio | ops x s/op ms | ratio |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    configs = {**tiny_configs(), **{k: config_of(k, None) for k in ("small", "moe", "mid")}}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        graph = trace(model, dtype="float32", granularity="block")
        prefill, decode, _ = measure(model, lambda: None, args.prompt, args.steps, args.repeats)
        measured = {"prefill": statistics.median(prefill), "decode step": statistics.median(decode)}
        before, after = (dict(zip(measured, predicted(g, machine, workload), strict=True))
                         for g in (uncounted(graph), graph))
        ops = sum(graph.unit(n).ops_per_forward or 0 for n in graph.names())
        for phase, seconds in measured.items():
            print(f"| {name} | {ops} | {phase} | {seconds * 1e3:.2f} | {before[phase] * 1e3:.2f} | "
                  f"{before[phase] / seconds:.2f} | {after[phase] * 1e3:.2f} | {after[phase] / seconds:.2f} |")
        del model


if __name__ == "__main__":
    main()
