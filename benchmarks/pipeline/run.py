"""Planned pipeline stages against the layer-count split, on torch.distributed.pipelining (issue 16).

Part 1, measured on this machine: two ranks (two processes, gloo, one thread each) of unequal
speed. This machine has 2 cores and no GPU, so "unequal devices" is made by hand: rank 1 is a
``--slow-factor`` (3) times slower device, made so by sleeping, after every unit's forward
(embedding, each decoder layer, norm, head), ``factor - 1`` times that forward's own time. Each rank first times its own decoder layer (fastest of 15, one rank at a time, the slow-down
included on rank 1), turns that into a measured FLOP/s for the cost model, and rank 0 plans with :func:`plan_pipeline` over a two-"host" cluster whose ranks are those
two measured devices (link: 1 GB/s, 50 us, about gloo over loopback). Then, in the same processes,
both splits run ``--steps`` forward steps of ``ScheduleGPipe``: the plan's and the layer-count
split that hand-written pipelines use (equal decoder layers per rank, embedding on the first,
norm and head on the last). Per stage: predicted and measured time per micro-batch (forward hooks
on the stage module); per split: micro-batches/s (median step).

Part 2, estimates only: plans for published models (catalog presets, traced on meta) over 2-8
hosts of mixed GPUs, the planned slowest stage against the layer-count split's.

Usage::

    python benchmarks/pipeline/run.py             # both parts (3 measured launches), writes RESULTS.md here
    python benchmarks/pipeline/run.py --quick     # fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HIDDEN, LAYERS, SEQ, MICRO_BATCH, N_MICRO, VOCAB = 256, 8, 128, 2, 8, 1024


def _model():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=688, num_hidden_layers=LAYERS,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=VOCAB,
                                      max_position_embeddings=SEQ, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _min_s(fn, repeats: int) -> float:
    """The fastest of ``repeats`` runs: the least disturbed by other jobs on a shared machine."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _measured_device(graph, unit_times: dict[str, float]):
    """A CPU device whose measured FLOP/s makes the cost model give this rank's decoder-layer time."""
    from placement_opt.cost.pricing import UNIT_OVERHEAD_S, PricingContext, price_option
    from placement_opt.cost.workload import Workload
    from placement_opt.hardware.devices import Device, Machine

    probe = Device("cpu", "16GiB", flops=1.0, bandwidth=1e18, source="measured")
    ctx = PricingContext(graph, Machine([probe]), Workload(batch_size=MICRO_BATCH, prompt_len=SEQ, new_tokens=0))
    layer = graph.unit("model.layers.0")
    flops = price_option(ctx, layer, "cpu", "cpu", "resident").prefill_s - UNIT_OVERHEAD_S["cpu"]
    achieved = flops / max(unit_times["layer"] - UNIT_OVERHEAD_S["cpu"], 1e-6)
    return Device("cpu", "16GiB", flops=achieved, bandwidth=20e9, source="measured")


def _slow_down(model, factor: float) -> None:
    """Make every unit ``factor`` times slower: after its forward, sleep ``factor - 1`` times its own time."""
    units = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
    for unit in units:
        started: list[float] = []
        unit.register_forward_pre_hook(lambda m, a, started=started: started.append(time.perf_counter()))
        unit.register_forward_hook(
            lambda m, a, o, started=started: time.sleep((factor - 1) * (time.perf_counter() - started.pop())))


def _stage_hooks(module, sink: list[float]):
    start: list[float] = []
    module.register_forward_pre_hook(lambda m, a: start.append(time.perf_counter()))
    module.register_forward_hook(lambda m, a, o: sink.append(time.perf_counter() - start.pop()))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from placement_opt.cost.workload import Workload
    from placement_opt.distributed.pipeline_plan import (
        PipelinePlan,
        layer_count_cuts,
        plan_pipeline,
        stage_problem,
    )
    from placement_opt.hardware.cluster import Cluster, Host, Link
    from placement_opt.hardware.devices import Machine
    from placement_opt.model.tracer import trace
    from placement_opt.runtime.pipelining import DecoderStage
    from placement_opt.solver.stages import stage_time_ns

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _model()
    if rank == 1:
        _slow_down(model, args.slow_factor)
    graph = trace(model)
    x = torch.randn(MICRO_BATCH, SEQ, HIDDEN)
    probe = DecoderStage(model, ("model.layers.0",))
    layer_s = 0.0
    for turn in range(2):  # one rank at a time: the two would share this machine's cores otherwise
        dist.barrier()
        if turn == rank:
            with torch.no_grad():
                probe(x)
                layer_s = _min_s(lambda: probe(x), 15)
    devices = [None, None]
    dist.all_gather_object(devices, _measured_device(graph, {"layer": layer_s}).to_dict())
    from placement_opt.hardware.devices import Device

    cluster = Cluster(tuple(Host(Machine([Device.from_dict(d)]), cpu_ranks=1) for d in devices), Link(1e9, 50e-6))
    workload = Workload(batch_size=MICRO_BATCH, prompt_len=SEQ, new_tokens=0)
    plan = plan_pipeline(graph, cluster, workload, schedule="gpipe", n_microbatches=N_MICRO)
    problem = stage_problem(graph, cluster, workload, "gpipe", N_MICRO)
    names = graph.names()
    even = layer_count_cuts(graph, 2)
    splits = {"planned": [s.units for s in plan.stages],
              "layer-count": [tuple(names[a:b]) for a, b in zip(even[:-1], even[1:], strict=True)]}
    cut_of = {"planned": [names.index(u[0]) for u in splits["planned"]] + [len(names)], "layer-count": even}
    ids = torch.randint(0, VOCAB, (MICRO_BATCH * N_MICRO, SEQ))
    result = {"rank": rank, "layer_s": layer_s, "device_flops": devices[rank]["flops_per_s"], "splits": {}}
    for name, units in splits.items():
        module = DecoderStage(model, units[rank])
        times: list[float] = []
        _stage_hooks(module, times)
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=N_MICRO)
        steps = []
        for step in range(args.steps + 1):
            dist.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                schedule.step(ids) if rank == 0 else schedule.step()
            dist.barrier()
            if step:  # the first step infers shapes and warms up
                steps.append(time.perf_counter() - start)
        cuts = cut_of[name]
        predicted = stage_time_ns(problem, rank, cuts[rank], cuts[rank + 1]) / 1e9
        result["splits"][name] = {"units": list(units[rank]), "predicted_s": predicted,
                                  "measured_s": statistics.median(times[N_MICRO:]) if len(times) > N_MICRO else None,
                                  "step_s": statistics.median(steps)}
    gathered = [None, None]
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"results": gathered, "plan": json.loads(plan.to_json())}, indent=1))
    dist.destroy_process_group()
    del PipelinePlan  # imported for the reader: the plan's type


def launch(args: argparse.Namespace) -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = HERE / "_measured.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
                               "--slow-factor", str(args.slow_factor)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    try:
        for proc in procs:
            if proc.wait(timeout=900) != 0:
                raise SystemExit(f"a rank failed (exit {proc.returncode})")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    data = json.loads(out.read_text())
    out.unlink()
    return data


def published(quick: bool) -> list[dict]:
    from placement_opt.cost.workload import Workload
    from placement_opt.distributed.pipeline_plan import plan_pipeline
    from placement_opt.errors import InfeasiblePlacementError
    from placement_opt.hardware.cluster import Cluster
    from placement_opt.model.tracer import trace

    clusters = ["(h100-sxm*4,cpu-server)+(a100-40gb*4,cpu-server)@ib-200g",
                "2x(a100-80gb*4,cpu-server)+2x(a10*4,cpu-server)@ib-100g",
                "(h100-sxm*8,cpu-server)+3x(l40s*4,cpu-server)@eth-100g",
                "4x(l4*2,cpu-server)+4x(t4*2,cpu-server)@eth-25g"]
    models = ["llama-2-7b", "llama-2-70b"] if quick else ["llama-2-7b", "llama-2-13b", "llama-2-70b", "qwen2-72b"]
    rows = []
    for model in models:
        graph = trace(model)
        for spec in clusters:
            for training in (False, True):
                workload = Workload(batch_size=1, prompt_len=4096, new_tokens=0, training=training,
                                    activation_checkpointing=training)
                micro = max(16, Cluster.from_spec(spec).world_size)  # 1F1B: at least one per stage
                try:
                    plan = plan_pipeline(graph, spec, workload, schedule="1f1b", n_microbatches=micro)
                except InfeasiblePlacementError as err:  # an infeasible cell is a result too
                    reason = str(err).split(";")[0]
                    rows.append({"model": model, "cluster": spec, "training": training, "error": reason})
                    continue
                start = time.perf_counter()
                plan_pipeline(graph, spec, workload, schedule="1f1b", n_microbatches=micro)
                rows.append({"model": model, "cluster": spec, "training": training, "stages": len(plan.stages),
                             "planned_s": plan.objective_s, "layer_count_s": plan.layer_count_s,
                             "plan_s": time.perf_counter() - start,
                             "per_stage": [len([u for u in s.units if "layers." in u]) for s in plan.stages]})
    return rows


def _ratio(measured: dict) -> float:
    r0 = measured["results"][0]["splits"]
    return r0["layer-count"]["step_s"] / r0["planned"]["step_s"]


def _predicted_ratio(measured: dict) -> float:
    slowest = {name: max(r["splits"][name]["predicted_s"] for r in measured["results"])
               for name in ("planned", "layer-count")}
    return slowest["layer-count"] / slowest["planned"]


def report(measured: dict | None, rows: list[dict], args: argparse.Namespace) -> str:
    lines = ["# Pipeline stages: planned split vs layer-count split (issue 16)", "",
             f"Written by `python benchmarks/pipeline/run.py{' --quick' if args.quick else ''}`. This machine: 2 cores, "
             f"no GPU, shared with other jobs while measured (timings are under contention).", ""]
    if measured:
        r0, r1 = measured["results"]
        lines += ["## Measured: 2 CPU ranks of unequal speed, torch.distributed.pipelining ScheduleGPipe", "",
                  f"Llama-shaped, hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}, random weights; {N_MICRO} micro-batches of "
                  f"{MICRO_BATCH} x {SEQ} tokens per step, forward only; gloo, 1 thread per rank. Rank 1 stands in for a "
                  f"{args.slow_factor:g}x slower device: after every unit's forward it sleeps {args.slow_factor - 1:g}x that "
                  f"forward's own time. Decoder layer "
                  f"measured: rank 0 {r0['layer_s'] * 1e3:.2f} ms, rank 1 {r1['layer_s'] * 1e3:.2f} ms per micro-batch. "
                  f"Median of {args.steps} steps after one warm-up.", "",
                  "| split | rank | units | predicted per micro-batch | measured per micro-batch | step | micro-batches/s |",
                  "|---|---|---|---|---|---|---|"]
        for name in ("planned", "layer-count"):
            for r in (r0, r1):
                s = r["splits"][name]
                layers = [u for u in s["units"] if "layers." in u]
                measured_ms = f"{s['measured_s'] * 1e3:.2f} ms" if s["measured_s"] is not None else "-"
                lines.append(f"| {name} | {r['rank']} | {len(s['units'])} ({len(layers)} layers) | "
                             f"{s['predicted_s'] * 1e3:.2f} ms | {measured_ms} | {s['step_s'] * 1e3:.1f} ms | "
                             f"{N_MICRO / s['step_s']:.2f} |")
        ratios = ", ".join(f"{r:.2f}x" for r in measured.get("ratios", [_ratio(measured)]))
        lines += ["", f"Planned split against the layer-count split, micro-batches/s (rank 0's median step), in each of "
                      f"{len(measured.get('ratios', [1]))} launches: {ratios}; the table is the launch with the median "
                      f"ratio, whose predicted ratio (slowest stage against slowest stage) is {_predicted_ratio(measured):.2f}x. "
                      f"Predictions come from each rank's decoder layer timed alone; during the run both ranks "
                      f"and other jobs share the 2 cores, so measured stage times run above the predictions and "
                      f"vary from launch to launch.", ""]
    lines += ["## Estimates: published models on 2-8 hosts of mixed GPUs", "",
              "Cost-model estimates (datasheet figures), micro-batch 1 x 4096 tokens, 16 micro-batches (or one per stage where there are more stages), Schedule1F1B; training: Adam, fp16 weights with fp32 master copies and moments, activation checkpointing (each unit's input kept per micro-batch in flight, the forward recomputed). "
              "`layer-count` is the slowest stage when every rank gets an equal number of decoder layers "
              "(embedding first, head last); `-` where it does not fit memory. Decoder layers per stage in the last "
              "column.", "",
              "| model | cluster | step | stages | planned slowest stage | layer-count | ratio | plan time | layers per stage |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        kind = "train" if row["training"] else "forward"
        if "error" in row:
            lines.append(f"| {row['model']} | `{row['cluster']}` | {kind} | - | infeasible: {row['error']} | | | | |")
            continue
        even, planned = row["layer_count_s"], row["planned_s"]
        even_text = "-" if even is None else f"{even * 1e3:.1f} ms"
        ratio = "-" if even is None else f"{even / planned:.2f}x"
        lines.append(f"| {row['model']} | `{row['cluster']}` | {kind} | {row['stages']} | {planned * 1e3:.1f} ms | "
                     f"{even_text} | {ratio} | {row['plan_s']:.2f} s | "
                     f"{','.join(map(str, row['per_stage']))} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(HERE / "_measured.json"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--skip-measured", action="store_true", help="estimates only")
    parser.add_argument("--launches", type=int, default=3, help="measured launches (the median is tabled)")
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.quick else 10)
    if args.worker:
        worker(args)
        return
    measured = None
    if not args.skip_measured:
        runs = [launch(args) for _ in range(args.launches)]
        ratios = [_ratio(run) for run in runs]
        measured = sorted(runs, key=_ratio)[len(runs) // 2]  # the launch with the median ratio
        measured["ratios"] = ratios
    rows = published(args.quick)
    (HERE / "RESULTS.md").write_text(report(measured, rows, args), encoding="utf-8")
    print((HERE / "RESULTS.md").read_text())


if __name__ == "__main__":
    main()
