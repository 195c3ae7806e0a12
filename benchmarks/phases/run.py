"""Layer-granular plans against phased plans (issue 15), estimated by the cost model.

For each machine, model, GPU budget and workload, these plans are solved side by side in one run:

* ``layer, no overlap``: the layer plan solved with the default pricing (each streamed unit
  ``max(compute, copy)``, its copy hidden behind its own unit only), then priced with
  ``Workload(overlap=True)`` (the dispatcher's prefetch beside every unit since the previous streamed one):
  what it would run at by that model;
* ``layer``: the solver's choices before phased execution: each unit resident on the GPU, resident in CPU
  RAM and computed by the CPU, or streamed to the GPU at every forward (``modes=("resident", "stream")``),
  solved with ``overlap=True`` (streamed copies beside the compute of the units before them, CPU-computed
  ones included), as are the phased and sublayer plans;
* ``phased``: the same, plus phased units (streamed to the GPU for the prompt, computed by the CPU at every
  decode step where the weights are, KV cache on the CPU);
* ``sublayer``: every mode, on the model traced at ``granularity="sublayer"`` (attention, MLP, router and
  experts as units around a home GPU: kTransformers' split when the solver finds it pays).

accelerate ``auto`` with the same ``max_memory`` is priced beside them (its synchronous streams). All three
are estimates: nothing runs here (``gpu.py`` beside this script runs them on a CUDA machine). The machines:

* ``h100-host``: the H100 80GB host's measured profile (``shared/measurements/h100-host-profile.json``:
  ``../shared`` beside the repository: the GPU's bf16 matmul curve and pinned host-to-device rate, the 16-core CPU's bf16 curve and matrix-vector
  read rate), GPU capped at the budget as ``max_memory`` does;
* ``this-cpu+h100``: this machine's CPU as ``placement_opt.profile`` measures it now (bf16), beside a
  datasheet H100 at the budget: a what-if (this machine has no GPU), showing how the choice moves with a
  slower CPU.

Usage::

    python benchmarks/phases/run.py            # writes RESULTS.md here (about 2 minutes on 2 cores)
    python benchmarks/phases/run.py --quick    # quick CPU profile, fewer workloads
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # machine_info, for the results' machine line
from machine_info import cpu_model  # noqa: E402

#: The H100 host's profile, in the team's shared folder beside the repository (``--h100-profile`` elsewhere).
H100_PROFILE = HERE.parents[2] / "shared" / "measurements" / "h100-host-profile.json"
CPU_MEMORY = "100GiB"
#: (model, GPU budgets): the issue's 8B at 10 and 4 GiB, the MoE shapes at 24 GiB (Qwen-MoE at 8 GiB: it
#: is 14 B parameters, 28 GiB in bf16, so 24 GiB would hold nearly all of it).
CASES = (("llama-3-8b", ("10GiB", "4GiB")), ("mixtral-8x7b", ("24GiB",)), ("qwen1.5-moe-a2.7b", ("8GiB",)))
#: (batch, prompt, new tokens): the issue's workload, a long generation, a long prompt, a batch.
WORKLOADS = ((1, 512, 32), (1, 128, 256), (1, 4096, 32), (16, 512, 32))


def _qwen_moe_config():
    """Qwen1.5-MoE-A2.7B's published shape: 24 layers, 60 routed experts (top 4) + a shared expert."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                          num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
                          moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                          max_position_embeddings=8192, torch_dtype="bfloat16")


def _graphs(name: str):
    """(block graph, sublayer graph, config) of a model, traced on the meta device."""
    from placement_opt import trace
    from placement_opt.model import catalog

    config = _qwen_moe_config() if name.startswith("qwen1.5-moe") else catalog.model_config(name)
    return trace(config, dtype="bfloat16"), trace(config, dtype="bfloat16", granularity="sublayer"), config


def _h100_host(budget: str):
    from placement_opt.hardware.devices import Machine
    from placement_opt.hardware.profile_store import device_from_measurement

    data = json.loads(H100_PROFILE.read_text())
    gpu = device_from_measurement("cuda:0", data["measurements"]["cuda:0"], "bfloat16", data["created"])
    cpu = device_from_measurement("cpu", data["measurements"]["cpu"], "bfloat16", data["created"])
    return Machine([gpu.with_memory(budget), cpu.with_memory(CPU_MEMORY)])


def _this_cpu_with_h100(budget: str, profile: Path):
    from placement_opt.hardware.devices import Device, Machine
    from placement_opt.hardware.profile_store import saved_device

    cpu = saved_device("cpu", dtype="bfloat16", path=profile)
    return Machine([Device.preset("h100-sxm", name="cuda:0").with_memory(budget), cpu.with_memory(CPU_MEMORY)])


def _row(machine_name, model, budget, wl, graphs, config, machine):
    from placement_opt import Workload, solve
    from placement_opt.cost.evaluate import evaluate

    graph, sublayer_graph = graphs
    workload = Workload(batch_size=wl[0], prompt_len=wl[1], new_tokens=wl[2], overlap=True)
    plain = solve(graph, machine, workload=Workload(batch_size=wl[0], prompt_len=wl[1], new_tokens=wl[2]),
                  modes=("resident", "stream"), time_limit_s=2.0)
    before = evaluate(plain, graph, machine, workload)
    plans = {}
    every = ("resident", "stream", "phased")
    for label, g, modes in (("layer", graph, ("resident", "stream")), ("phased", graph, every),
                            ("sublayer", sublayer_graph, every)):
        started = time.perf_counter()
        plan = solve(g, machine, workload=workload, modes=modes, time_limit_s=2.0)
        plans[label] = (plan, time.perf_counter() - started)
    accelerate = _accelerate_cost(config, machine, graph, workload, evaluate)
    layer, phased, sublayer = plans["layer"][0], plans["phased"][0], plans["sublayer"][0]
    modes = {}
    for p in phased.placements:
        modes[p.mode] = modes.get(p.mode, 0) + 1
    return {
        "machine": machine_name, "model": model, "budget": budget, "batch": wl[0], "prompt": wl[1], "new": wl[2],
        "accelerate_decode_tps": accelerate.decode_tokens_per_s if accelerate else None,
        "accelerate_fits": accelerate.fits if accelerate else None,
        "before_decode_tps": before.decode_tokens_per_s, "before_total_s": before.total_s,
        "before_split": _modes(plain), "layer_split": _modes(layer),
        "layer_decode_tps": layer.cost.decode_tokens_per_s, "phased_decode_tps": phased.cost.decode_tokens_per_s,
        "sublayer_decode_tps": sublayer.cost.decode_tokens_per_s,
        "layer_prefill_s": layer.cost.prefill_s, "phased_prefill_s": phased.cost.prefill_s,
        "sublayer_prefill_s": sublayer.cost.prefill_s,
        "layer_total_s": layer.cost.total_s, "phased_total_s": phased.cost.total_s,
        "sublayer_total_s": sublayer.cost.total_s,
        "phased_modes": modes, "sublayer_split": _split(sublayer), "gaps": (layer.gap, phased.gap, sublayer.gap),
        "solve_s": (plans["layer"][1], plans["phased"][1], plans["sublayer"][1]),
    }


def _modes(plan) -> str:
    """'12 cpu, 20 resident, 4 stream': where a plan's units compute (cpu) or how they reach the GPU."""
    modes: dict[str, int] = {}
    for p in plan.placements:
        key = "cpu" if p.execution == "cpu" else p.mode
        modes[key] = modes.get(key, 0) + 1
    return ", ".join(f"{n} {m}" for m, n in sorted(modes.items()))


def _split(plan) -> str:
    """Where a sublayer plan computes attention and MLP/experts in the decode: 'attn gpu 32, experts cpu 24 ...'."""
    counts: dict[str, int] = {}
    for p in plan.placements:
        part = next((k for k in ("self_attn", "experts", "mlp") if p.unit.endswith(k)), None)
        if part is not None:
            where = "gpu" if p.execution.startswith("cuda") else ("phased" if p.prefill_execution else "cpu")
            counts[f"{part} {where}"] = counts.get(f"{part} {where}", 0) + 1
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))


def _accelerate_cost(config, machine, graph, workload, evaluate):
    from placement_opt.cost.device_map import accelerate_device_map

    max_memory = {0 if d.is_gpu else d.name: d.usable_bytes for d in machine.devices}
    try:
        device_map = accelerate_device_map(config, max_memory, "auto")
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported as such
        print(f"accelerate auto not priced: {exc}")
        return None
    return evaluate(device_map, graph, machine, workload)


def _table(rows) -> list[str]:
    lines = ["| machine | model | GPU budget | batch x prompt + new | accelerate auto decode tok/s | layer plan, "
             "no overlap decode tok/s | layer plan decode tok/s | phased plan decode tok/s | sublayer plan decode "
             "tok/s | best / layer no overlap (decode) | prefill layer -> phased -> sublayer | total layer no "
             "overlap -> layer -> phased -> sublayer | layer plans' units (no overlap; overlap) | phased plan's units | "
             "sublayer plan's attention / MLP / experts (decode device) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = ("-" if r["accelerate_decode_tps"] is None else
               f"{r['accelerate_decode_tps']:.2f}" + ("" if r["accelerate_fits"] else " (OOM)"))
        units = ", ".join(f"{n} {m}" for m, n in sorted(r["phased_modes"].items()))
        best = max(r["layer_decode_tps"], r["phased_decode_tps"], r["sublayer_decode_tps"])
        lines.append(
            f"| {r['machine']} | {r['model']} | {r['budget']} | {r['batch']} x {r['prompt']} + {r['new']} | {acc} | "
            f"{r['before_decode_tps']:.2f} | {r['layer_decode_tps']:.2f} | {r['phased_decode_tps']:.2f} | "
            f"{r['sublayer_decode_tps']:.2f} | {best / r['before_decode_tps']:.2f}x | "
            f"{r['layer_prefill_s'] * 1e3:.0f} -> {r['phased_prefill_s'] * 1e3:.0f} -> "
            f"{r['sublayer_prefill_s'] * 1e3:.0f} ms | {r['before_total_s']:.2f} -> "
            f"{r['layer_total_s']:.2f} -> {r['phased_total_s']:.2f} -> {r['sublayer_total_s']:.2f} s | "
            f"{r['before_split']}; {r['layer_split']} | {units} | {r['sublayer_split']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="quick CPU profile, two workloads")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args()
    import placement_opt

    workloads = WORKLOADS[:2] if args.quick else WORKLOADS
    with tempfile.TemporaryDirectory() as tmp:
        profile = Path(tmp) / "profile.json"
        os.environ["PLACEMENT_OPT_PROFILE"] = str(profile)  # never the user's own profile
        started = time.perf_counter()
        placement_opt.profile(["cpu"], dtype="bfloat16", quick=args.quick, path=profile)
        profile_s = time.perf_counter() - started
        this_cpu = _this_cpu_with_h100("1GiB", profile)["cpu"]
        rows = []
        for model, budgets in CASES:
            graph, sublayer_graph, config = _graphs(model)
            for budget in budgets:
                for name, machine in (("h100-host", _h100_host(budget)),
                                      ("this-cpu+h100", _this_cpu_with_h100(budget, profile))):
                    for wl in workloads:
                        rows.append(_row(name, model, budget, wl, (graph, sublayer_graph), config, machine))
                        print(_table(rows[-1:])[-1], flush=True)
    _write(args.out, rows, this_cpu, profile_s)


def _write(out: str, rows, this_cpu, profile_s: float) -> None:
    import torch

    h100 = json.loads(H100_PROFILE.read_text())["measurements"]
    text = [
        "# Layer-granular plans against phased, sublayer and overlapped plans (estimates)",
        "",
        f"`python benchmarks/phases/run.py`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on "
        f"{cpu_model()} ({os.cpu_count()} cores), torch {torch.__version__}. "
        "Every figure is the cost model's prediction: nothing runs here. Plans are solved with a 2 s limit.",
        "",
        f"- h100-host: the measured H100 host profile: GPU bf16 curve, pinned host-to-device "
        f"{h100['cuda:0']['pinned_h2d_bytes_per_s'] / 1e9:.1f} GB/s; CPU "
        f"{h100['cpu']['threads']} threads, bf16 matrix-vector "
        f"{h100['cpu']['matvec_bytes_per_s']['bfloat16'] / 1e9:.1f} GB/s.",
        f"- this-cpu+h100: this machine's CPU profiled now ({profile_s:.0f} s; {this_cpu}) beside a datasheet "
        "H100: a what-if, since this machine has no GPU.",
        "",
        "Every figure is priced with `Workload(overlap=True)`: a streamed unit's copy runs on the prefetch thread "
        "beside every unit since the previous streamed one. 'layer plan, no overlap' is the plan the default pricing "
        "(each copy hidden behind its own unit only) chooses, priced that way: the plan before overlap was priced.",
        "",
        "decode tok/s: generated tokens per second over the decode steps (batch included). The layer plan chooses "
        "among resident, CPU-computed and streamed decoder layers; the phased plan may also stream a layer for the "
        "prompt and compute it on the CPU for every decode step; the sublayer plan makes those choices for "
        "attention, MLP, router and experts separately (home cuda:0; a layer's streamed parts copied together, one "
        "prefetch per layer). Every plan minimises the whole workload's "
        "latency (prefill + decode), so a plan may give up some decode speed for a much faster prompt: the "
        "decode ratio can fall below 1 where the total still drops (compare the total column).",
        "",
        *_table(rows),
        "",
    ]
    Path(out).write_text("\n".join(text))
    (Path(out).with_suffix(".json")).write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
