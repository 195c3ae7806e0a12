"""Does the cost model predict measured times and memory on this machine, before and after calibration?

For each model shape (a small one, hidden 512 x 8 layers, where per-op overheads dominate; a mid-size
one, hidden 2048 x 16 layers, about 0.85B parameters; a Mixtral-shaped one, hidden 512 x 8 layers of 8
experts, top 2; on request, ``--models dbrx,jetmoe``: MoE families whose experts are not transformers' experts
interface, the same sizes), random fp32 weights are written with
``save_pretrained`` to a temporary folder, and every placement kind this machine offers is run and timed:

* ``resident``: every unit in CPU RAM, computed on the CPU (the compute device of a GPU-less machine);
* ``stream (1/3 on disk)`` and ``disk (all layers)``: decoder layers stored on disk, read per forward;
* ``sublayer: MLPs of 1/3 layers on disk`` and ``sublayer: every MLP on disk``: a sublayer graph's
  units (``trace(granularity="sublayer")``), attention resident and the MLPs (an MoE layer's experts)
  read from disk; for the MoE model also each layer's second expert group on disk
  (``expert_groups=2``; placement_opt only: accelerate has no such units).

Two runners per placement: ``placement_opt`` (``dispatch(model, plan)``: disk units computed from
memory-mapped safetensors files, the next one read ahead) and ``accelerate`` (``dispatch_model`` with
the plan's ``device_map``: each disk tensor copied out of its own ``np.memmap``, priced as
``stream_sync``; not for DBRX and JetMoE, whose weights accelerate's offload does not load). Two phases: prefill (batch 1 x ``--prompt`` tokens, logits of the last position,
as ``generate`` asks) and decode, timed **per step** over ``--steps`` tokens with the KV cache.

Predictions side by side, in one run: ``before`` from ``placement_opt.profile`` (isolated kernels,
the roofline) and ``after`` from ``placement_opt.calibrate`` on the same model, each through
``placement_opt.evaluate``. Measured figures: the median of the repeats (prefill) or steps (decode),
the fastest beside them (calibration keeps each unit's median as well); offloaded files are evicted from the page cache before every timed forward, so
disk reads are cold, as a machine whose RAM cannot hold them reads them. Memory: the process's RSS
growth during the first prefill forward, untimed (sampled every 2 ms) against the predicted peak of the CPU
beyond its weights (KV cache + workspace + stream buffers, ``predicted_memory`` where the cost model
has it). Rankings: the placements ordered by predicted and by measured time, per runner and phase.

A GPU part runs when CUDA is present (skipped, and said so, otherwise): accelerate ``device_map="auto"``
against ``placement_opt.load`` with the same ``max_memory``, batch 1 and 16 (at each of ``--gpu-prompts``), with
and without ``torch.cuda.set_per_process_memory_fraction`` as a hard cap (an over-budget plan then fails with OOM).
``--gpu-only`` runs that part alone (a GPU machine lent for minutes should not spend them on the CPU rows).

Usage::

    python benchmarks/cost_accuracy/run.py            # writes benchmarks/cost_accuracy/RESULTS.md
    python benchmarks/cost_accuracy/run.py --quick    # fewer layers and steps (a smoke run, about 2 min)
    python benchmarks/cost_accuracy/run.py --gpu-only --gpu-prompts 512,4096 --out GPU.md   # the GPU rows alone
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import gc
import glob
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from placement_opt.runtime.timing import cache_argument, cache_of

HERE = Path(__file__).resolve().parent
GOAL = 0.25
VOCAB = 32000
SHAPES = {  # name -> (hidden, intermediate, layers, heads, kv heads); --quick cuts the layers
    "small": (512, 1376, 8, 8, 8),
    "mid": (2048, 5632, 16, 16, 4),
    "moe": (512, 1024, 8, 8, 8),  # Mixtral-shaped: MOE_EXPERTS experts of this intermediate size, top 2
    "dbrx": (512, 1024, 8, 8, 8),  # DBRX: its experts stacked in 2-D tensors, looped over one at a time
    "jetmoe": (512, 1024, 8, 8, 4),  # JetMoE: MLP and attention experts told their rows; 4 KV heads x 2 picked
}
#: Shapes accelerate's disk offload cannot run: it loads a module's weights when that module's forward is called,
#: and these read theirs through other calls (calibrate() warns so).
NO_ACCELERATE = {"dbrx", "jetmoe"}
MOE_EXPERTS = 8
#: Expert groups of the grouped placement (issue 15's "each expert, or groups"): one resident, one on disk.
MOE_GROUPS = 2


@dataclass
class Row:
    model: str
    runner: str
    placement: str
    phase: str
    before_s: float
    after_s: float
    best_s: float
    median_s: float
    rss_growth: int | None = None
    predicted_rss: int | None = None
    notes: list[str] = field(default_factory=list)


# -- models and placements -----------------------------------------------------------------------
def config_of(shape: str, layers: int | None) -> Any:
    from transformers import DbrxConfig, JetMoeConfig, LlamaConfig, MixtralConfig

    hidden, inter, n, heads, kv = SHAPES[shape]
    if shape == "dbrx":
        config = DbrxConfig(d_model=hidden, n_heads=heads, n_layers=layers or n, max_seq_len=4096, vocab_size=VOCAB,
                            attn_config={"kv_n_heads": kv, "clip_qkv": 8.0, "rope_theta": 500000.0},
                            ffn_config={"ffn_hidden_size": inter, "moe_num_experts": MOE_EXPERTS, "moe_top_k": 2},
                            tie_word_embeddings=False)
    elif shape == "jetmoe":
        config = JetMoeConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers or n,
                              num_key_value_heads=kv, kv_channels=hidden // heads, num_local_experts=MOE_EXPERTS,
                              num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=4096,
                              tie_word_embeddings=False)
    if shape in ("dbrx", "jetmoe"):
        config.dtype = "float32"
        return config
    common = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers or n,
                  num_attention_heads=heads, num_key_value_heads=kv, vocab_size=VOCAB, tie_word_embeddings=False,
                  max_position_embeddings=4096)
    config = (MixtralConfig(**common, num_local_experts=MOE_EXPERTS, num_experts_per_tok=2) if shape == "moe"
              else LlamaConfig(**common))
    config.dtype = "float32"
    return config


def build(config: Any, folder: Path) -> torch.nn.Module:
    """Random weights (seeded), written with save_pretrained; the model stays in RAM for the runs."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return model


def placements(graph: Any, parts: Any, groups: Any | None = None) -> dict[str, tuple[Any, dict[str, str]]]:
    """Placement name -> (the graph it places, unit -> storage): decoder layers whole (``graph``), and
    their MLPs (an MoE layer's experts) apart from attention (``parts``, the sublayer graph: what issue
    15's finer units offer); for an MoE model, also each layer's last expert group on disk (``groups``)."""
    names = graph.names()
    layers = [u.name for u in graph.units() if u.module_class.endswith(("DecoderLayer", "Block"))]
    third = max(1, len(layers) // 3)
    last = set(layers[-third:])
    mlps = [u.name for u in parts.units() if u.name.endswith((".mlp", ".mlp.experts", ".ffn.experts"))]
    what = "experts" if any(parts.unit(m).is_moe for m in mlps) else "MLPs"
    found = {"resident": (graph, {n: "cpu" for n in names}),
             f"stream ({third}/{len(layers)} layers on disk)": (graph, {n: "disk" if n in last else "cpu"
                                                                         for n in names}),
             "disk (all layers)": (graph, {n: "disk" if n in layers else "cpu" for n in names}),
             f"sublayer: {what} of {third}/{len(layers)} layers on disk": (
                 parts, {u.name: "disk" if u.name in mlps and u.block in last else "cpu" for u in parts.units()}),
             f"sublayer: every layer's {what} on disk": (parts, {n: "disk" if n in mlps else "cpu"
                                                                for n in parts.names()})}
    if groups is not None:
        tail = f".groups.{MOE_GROUPS - 1}"
        found[f"groups: {MOE_GROUPS - 1}/{MOE_GROUPS} of every layer's experts on disk"] = (
            groups, {n: "disk" if n.endswith(tail) else "cpu" for n in groups.names()})
    return found


def make_plan(device_map: dict[str, str], graph: Any, machine: Any, workload: Any) -> Any:
    from placement_opt.cost.evaluate import evaluate
    from placement_opt.plan import Plan, UnitPlacement
    from placement_opt.plan_check import graph_fingerprint

    placed = tuple(UnitPlacement(unit=n, storage=d, execution="cpu", mode="resident" if d == "cpu" else "stream")
                   for n, d in device_map.items())
    cost = evaluate(type("P", (), {"placements": placed})(), graph, machine, workload)
    return Plan(model_name=graph.meta.model_name, dtype="float32", objective="latency", strategy="manual",
                placements=placed, machine=machine, workload=workload, cost=cost, status="GREEDY",
                objective_value=cost.total_s, best_bound=0.0, gap=1.0, solve_time_s=0.0,
                fingerprint=graph_fingerprint(graph), home="cpu" if graph.meta.granularity == "sublayer" else None)


def predict(target: Any, graph: Any, machine: Any, workload: Any) -> tuple[float, float, int | None]:
    """(prefill s, mean decode step s, predicted CPU bytes beyond the weights)."""
    from placement_opt.cost.evaluate import evaluate

    cost = evaluate(target, graph, machine, workload)
    extra = predicted_cpu_extra(target, graph, machine, workload)
    return cost.prefill_s, cost.decode_s / max(1, workload.new_tokens), extra


def predicted_cpu_extra(target: Any, graph: Any, machine: Any, workload: Any) -> int:
    """KV cache + workspace + stream buffers the CPU holds beyond its weights (the memory model's figure)."""
    from placement_opt.cost.evaluate import predicted_memory

    cpu = predicted_memory(target, graph, machine, workload)["cpu"]
    return int(cpu.used_bytes - cpu.weights_bytes)


# -- page cache ----------------------------------------------------------------------------------
def evict(folder: Path) -> None:
    """Drop the offloaded files from the page cache (mapped pages first: ``fadvise`` skips them)."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    if not files:  # nothing offloaded (a resident placement)
        return
    _unmap_safetensors_pages()
    fadvise_dontneed(files)


def fadvise_dontneed(files: list[Path]) -> None:
    from placement_opt.runtime._safetensors_file import drop_page_cache

    drop_page_cache(files)


def _unmap_safetensors_pages() -> None:
    from placement_opt.runtime.offload import SafetensorsFile

    for obj in gc.get_objects():
        if isinstance(obj, SafetensorsFile) and getattr(obj, "_array", None) is not None:
            mapped = obj._array.base
            while mapped is not None and not isinstance(mapped, mmap.mmap):
                mapped = getattr(mapped, "obj", None) or getattr(mapped, "base", None)
            if isinstance(mapped, mmap.mmap):
                mapped.madvise(mmap.MADV_DONTNEED)


# -- measuring -----------------------------------------------------------------------------------
class PeakRss:
    """The highest RSS of this process while the block runs, sampled every 2 ms."""

    def __enter__(self) -> PeakRss:
        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc: Any) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start


def measure(model: torch.nn.Module, evict_all: Callable[[], None], prompt: int, steps: int, repeats: int
            ) -> tuple[list[float], list[float], int]:
    """Prefill seconds of ``repeats`` forwards, seconds of each of ``steps`` decode steps, peak RSS growth.

    ``evict_all`` runs before each forward (a runner whose units evict their own files as they are
    called passes a no-op).

    The RSS is sampled in the first forward, untimed (a sampling thread would slow the timed ones):
    later forwards reuse the memory the allocator kept from it, and their RSS would not grow at all.
    """
    ids = torch.randint(0, VOCAB, (1, prompt))
    prefill = []
    with torch.inference_mode():
        evict_all()
        gc.collect()
        with PeakRss() as rss:  # the first forward: what it adds is what a forward needs
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
        for _ in range(repeats):
            out = None
            evict_all()
            start = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            prefill.append(time.perf_counter() - start)
        decode = []
        cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            evict_all()
            start = time.perf_counter()
            out = model(input_ids=token, **cache_argument(model, cache), use_cache=True)
            decode.append(time.perf_counter() - start)
            cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
    return prefill, decode, rss.growth


def run_placement_opt(model: torch.nn.Module, plan: Any, folder: Path
                      ) -> tuple[torch.nn.Module, Callable[[], Any], Callable[[], None]]:
    """``dispatch(model, plan)``; every offloaded file evicted before each forward (the next unit's
    read-ahead starts while the one before computes, so a unit's files cannot be evicted as it is called)."""
    from placement_opt.runtime.dispatcher import dispatch

    handle = dispatch(model, plan, offload_dir=str(folder))
    return handle.model, handle.remove, lambda: evict(folder)


def run_accelerate(model: torch.nn.Module, device_map: dict[str, str], folder: Path
                   ) -> tuple[torch.nn.Module, Callable[[], Any], Callable[[], None]]:
    """``dispatch_model`` with the plan's ``device_map``; each disk unit's files evicted as it is called.

    accelerate reads a unit's files when the unit is called, and evicting them just then is what a
    machine whose RAM cannot hold them does (its least recently used pages make room). Evicting every
    file before the forward frees all that memory at once, and on this virtual machine memory free for
    ~2 s goes back to the host, so the last units of a long forward read at half the rate
    (``placement_opt.calibrate`` times the same path the same way).
    """
    from accelerate import dispatch_model

    clone = copy.deepcopy(model)  # accelerate leaves offloaded parameters on meta: run a copy
    dispatch_model(clone, device_map=device_map, offload_dir=str(folder))
    modules = dict(clone.named_modules())
    handles = []
    for unit, where in device_map.items():
        if where != "disk":
            continue
        files = sorted(folder.glob(f"{glob.escape(unit)}.*.dat"))  # accelerate's file per tensor

        def evict_unit(_module: Any, _args: Any, files: list[Path] = files) -> None:
            fadvise_dontneed(files)

        handles.append(modules[unit].register_forward_pre_hook(evict_unit))
    return clone, lambda: [h.remove() for h in handles], lambda: None


def timed(run: Callable[..., tuple[torch.nn.Module, Callable[[], Any], Callable[[], None]]], model: torch.nn.Module,
          target: Any, offload: Path, args: argparse.Namespace) -> tuple[list[float], list[float], int]:
    """``measure`` of ``model`` run by ``run`` (a runner above) in ``target``, its files in ``offload``
    (made, then removed), the model put back afterwards."""
    offload.mkdir(parents=True)
    running, undo, evict_all = run(model, target, offload)
    try:
        return measure(running, evict_all, args.prompt, args.steps, args.repeats)
    finally:
        undo()
        del running
        gc.collect()
        shutil.rmtree(offload, ignore_errors=True)


# -- one model -----------------------------------------------------------------------------------
def bench_model(shape: str, args: argparse.Namespace, work: Path) -> tuple[list[Row], dict[str, Any]]:
    import placement_opt
    from placement_opt.cost.calibrated import calibration_for
    from placement_opt.cost.workload import Workload
    from placement_opt.hardware.resolve import as_machine
    from placement_opt.model.tracer import trace

    layers = 4 if args.quick and shape == "mid" else None
    config = config_of(shape, layers)
    folder = work / shape
    model = build(config, folder)
    graph = trace(model, dtype="float32")
    parts = trace(model, dtype="float32", granularity="sublayer")
    groups = trace(model, dtype="float32", granularity="sublayer", expert_groups=MOE_GROUPS) if shape == "moe" else None
    machine = as_machine(["cpu", "disk"], dtype="float32")  # this machine, as the profile measured it
    workload = Workload(batch_size=1, prompt_len=args.prompt, new_tokens=args.steps)
    plans = {name: (g, make_plan(m, g, machine, workload))
             for name, (g, m) in placements(graph, parts, groups).items()}
    targets = {(runner, name): (g, plan if runner == "placement_opt" else plan.device_map)
               for name, (g, plan) in plans.items() for runner in args.runners
               if runner == "placement_opt" or (g is not groups and shape not in NO_ACCELERATE)}
    before = {key: predict(t, g, machine, workload) for key, (g, t) in targets.items()}
    started = time.perf_counter()
    result = placement_opt.calibrate(folder, ["cpu", "disk"], workload=workload, dtype="float32",
                                     granularity="auto", offload_dir=work)
    summaries = [result.summary()]
    if groups is not None:  # the groups' own shapes: a second sublayer pass, its experts cut into groups
        summaries.append(placement_opt.calibrate(folder, ["cpu", "disk"], workload=workload, dtype="float32",
                                                 granularity="sublayer", expert_groups=MOE_GROUPS,
                                                 offload_dir=work).summary())
    graphs = {"block": graph, "sublayer": parts, **({f"{MOE_GROUPS} expert groups": groups} if groups else {})}
    info = {"calibrate_s": time.perf_counter() - started, "layers": config.num_hidden_layers,
            "params": sum(p.numel() for p in model.parameters()), "summary": "\n".join(summaries),
            "covered": {cut: (len(calibration_for(g, machine).compute), len(g)) for cut, g in graphs.items()}}
    after = {key: predict(t, g, machine, workload) for key, (g, t) in targets.items()}
    rows = []
    for (runner, name), (_, target) in targets.items():
        run = run_placement_opt if runner == "placement_opt" else run_accelerate
        prefill, decode, growth = timed(run, model, target, work / "offload" / f"{shape}-{runner}-{len(rows)}", args)
        (b_pre, b_dec, _), (a_pre, a_dec, extra) = before[runner, name], after[runner, name]
        rows.append(Row(shape, runner, name, "prefill", b_pre, a_pre, min(prefill), statistics.median(prefill),
                        growth, extra))
        rows.append(Row(shape, runner, name, "decode step", b_dec, a_dec, min(decode), statistics.median(decode)))
        for row in rows[-2:]:
            print(f"{shape:6s} {runner:14s} {name:28s} {row.phase:12s} before {row.before_s:8.4f} "
                  f"after {row.after_s:8.4f} measured median {row.median_s:8.4f} (fastest {row.best_s:.4f})", flush=True)
    return rows, info


# -- GPU part ------------------------------------------------------------------------------------
GPU_SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)  # Llama-3.1-8B's shape, the run
#: --gpu-smoke's model: the GPU part's code run on the CPU, to check the script before a GPU session runs it.
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=256)


def gpu_part(args: argparse.Namespace, work: Path,
             emit: Callable[[list[str]], None] = lambda lines: None) -> list[str]:
    """accelerate ``auto`` against placement_opt with the same max_memory, batch 1 and 16, capped and not.

    The machine is profiled (cuda:0 and the CPU) and the model calibrated on both before any plan,
    so placement_opt's plan and the price of accelerate's map use the same measured figures. Shorter prompts
    first, and ``emit`` gets the lines so far after every row: a run stopped by its time limit keeps its rows.
    ``args.gpu_smoke``: the same steps on the CPU alone with a tiny Llama (no cap), which checks the script.
    """
    smoke = args.gpu_smoke
    if not smoke and not torch.cuda.is_available():
        return ["No CUDA device on this machine: the GPU part was skipped. `benchmarks/cost_accuracy/GPU.md` holds the GPU runs "
                "(NVIDIA H200, the latest first)."]
    from transformers import LlamaConfig

    import placement_opt
    from placement_opt.cost.workload import Workload
    from placement_opt.model.tracer import trace
    from placement_opt.runtime.cuda_allocator import allocator_settings

    sys.path.insert(0, str(HERE.parent))
    from gpu_common import freeze_imports, profile_once, random_checkpoint, use_profile

    freeze_imports()

    device, devices = ("cpu", ["cpu"]) if smoke else ("cuda:0", ["cuda:0", "cpu"])
    shape = SMOKE_SHAPE if smoke else GPU_SHAPE
    config = LlamaConfig(**shape, tie_word_embeddings=False, max_position_embeddings=8192)
    config.dtype = "bfloat16"
    use_profile(work)  # within one device_check.sh call, the steps share the checkpoint and the profile
    path = random_checkpoint(config, work)
    graph = trace(str(path))
    profile_once(devices, "bfloat16", quick=args.quick or smoke)
    max_memory = {"cpu": "1GiB"} if smoke else {0: args.gpu_budget, "cpu": "100GiB"}
    name = "none: --gpu-smoke runs the steps on the CPU" if smoke else torch.cuda.get_device_name(0)
    memory = ("cpu: the predicted KV cache, workspace and stream buffer against the resident set's growth"
              if smoke else "cuda:0")
    lines = [f"GPU: {name}; Llama-3.1-8B shape{' (tiny for the smoke)' if smoke else ''}, random bf16 weights; "
             f"max_memory {max_memory}; {args.steps} decode steps; cap = set_per_process_memory_fraction(budget); "
             f"CUDA allocator settings: {allocator_settings() or 'default'}",
             "",
             f"| runner | batch x prompt | cap | predicted prefill (s) | measured prefill (s) | predicted step (s) | "
             f"measured step (s) | measured mean step (s) | predicted peak ({memory}) | measured max_memory_allocated "
             f"(the load's or the generation's, the larger) | measured max_memory_reserved (the decode's: the timing "
             f"resets the peaks after the prefill; an OOM row's, to the failure) |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    emit(lines)
    for prompt in args.gpu_prompts:
        for batch in (1, 16):
            workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=args.steps)
            placement_opt.calibrate(path, devices, workload=workload)
            for cap in args.gpu_caps if not smoke else [False]:
                for runner in ("accelerate", "placement_opt"):
                    lines.append(gpu_row(runner, batch, cap, (path, graph, shape["vocab_size"]), max_memory,
                                         workload, args.steps, device))
                    print(lines[-1], flush=True)
                    emit(lines)
    return lines


def gpu_row(runner: str, batch: int, cap: bool, model_of: tuple[Path, Any, int], max_memory: dict[Any, str],
            workload: Any, steps: int, device: str) -> str:
    """One runner at one workload: predicted and measured prefill, decode step and peak memory of ``device``;
    out of memory and other errors are rows of their own (every row has the table's eleven cells)."""
    from transformers import AutoModelForCausalLM

    import placement_opt
    from placement_opt.cost.evaluate import evaluate, predicted_memory
    from placement_opt.runtime.timing import time_generation
    from placement_opt.units import format_bytes, parse_size

    path, graph, vocab = model_of
    cuda = device.startswith("cuda")
    if cuda:  # pragma: no cover - needs a GPU
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(parse_size(max_memory[0]) / total if cap else 1.0, 0)
        torch.cuda.reset_peak_memory_stats(0)
    model = None
    predicted_peak = None
    head = f"| {runner} | {batch} x {workload.prompt_len} | {'yes' if cap else 'no'} |"
    try:
        if runner == "accelerate":
            model = AutoModelForCausalLM.from_pretrained(path, device_map="auto", max_memory=max_memory,
                                                         dtype=torch.bfloat16)
            target = getattr(model, "hf_device_map", None) or {"": "cpu"}  # the CPU alone: loaded whole, no map
        else:
            model = placement_opt.load(path, max_memory, workload=workload)
            target = model.plan
        cost = evaluate(target, graph, max_memory, workload)
        use = predicted_memory(target, graph, max_memory, workload)[device]
        predicted_peak = use.used_bytes if cuda else use.used_bytes - use.weights_bytes
        ids = torch.randint(0, vocab, (batch, workload.prompt_len), device=device)
        loading_peak = torch.cuda.max_memory_allocated(0) if cuda else 0  # the load's own transients count too
        # as placement-opt run times it: one untimed warm-up forward, then the prefill and each decode step
        timing = time_generation(model, ids, steps + 1)
        peak = max(loading_peak, timing.peak_gpu_bytes[device]) if cuda else timing.peak_cpu_growth_bytes
        # the cap bounds reserved bytes: an OOM with allocated under the budget is the allocator's slack
        reserved = format_bytes(torch.cuda.max_memory_reserved(0)) if cuda else "-"
        return (f"{head} {cost.prefill_s:.3f} | {timing.prefill_s:.3f} | {cost.decode_s / steps:.4f} | "
                f"{timing.decode_step_median_s:.4f} | {timing.decode_step_mean_s:.4f} | "
                f"{format_bytes(predicted_peak)} | "
                f"{format_bytes(peak) if peak is not None else '-'} | {reserved} |")
    except torch.cuda.OutOfMemoryError as exc:  # pragma: no cover - needs a GPU
        # the peaks up to the failed request: allocated far under the cap is the allocator's slack
        return (f"{head} OOM ({str(exc).splitlines()[0][:60]}) | | | | | "
                f"{format_bytes(predicted_peak) if predicted_peak is not None else ''} | "
                f"{format_bytes(torch.cuda.max_memory_allocated(0))} | "
                f"{format_bytes(torch.cuda.max_memory_reserved(0))} |")
    except Exception as exc:  # noqa: BLE001 - a row that failed says why; the other rows still run
        return f"{head} error ({type(exc).__name__}: {str(exc).splitlines()[0][:80]}) | | | | | | | |"
    finally:
        model = None
        gc.collect()
        if cuda:  # pragma: no cover - needs a GPU
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, 0)  # the next calibrate() runs without the cap


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A temporary folder for checkpoints and offloaded files, holding the profile this run saves (never the
    user's own), removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["PLACEMENT_OPT_PROFILE"] = str(work / "profile.json")
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def gpu_only(args: argparse.Namespace) -> None:
    """The GPU part alone, written to ``--out`` with the machine and command: no profile of the CPU and disk rows."""
    started = time.perf_counter()

    def write(gpu: list[str], done: bool = False) -> None:
        lines = ["# Cost-model accuracy on a GPU: accelerate `auto` against placement_opt, the same max_memory", "",
                 f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; wall time "
                 f"{time.perf_counter() - started:.0f} s{'' if done else ' so far (the run had not ended)'}",
                 f"- Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, Python "
                 f"{sys.version.split()[0]}",
                 f"- Command: `python benchmarks/cost_accuracy/run.py {' '.join(sys.argv[1:])}`", "", *gpu]
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
        elif done:
            print("\n".join(lines))

    with scratch("cost_accuracy_gpu_") as work:
        gpu = gpu_part(args, work, write)  # written after every row: a run stopped early keeps them
    write(gpu, done=True)
    if args.out:
        print(Path(args.out).read_text())


# -- report --------------------------------------------------------------------------------------
#: Two placements measured closer than this are a near tie: the same row measured in two runs of this benchmark
#: on this machine moved by up to ~7% (the MoE all-disk decode step: 0.2444, 0.2511 and 0.2611 s).
NEAR_TIE = 0.05


def ranking(rows: list[Row], model: str, runner: str, phase: str, key: str) -> str:
    """Whether the predicted order of the placements (``key``) is the measured one (medians), and if not, which
    pairs are swapped and how far apart they measured; swapped near ties are told apart from real swaps."""
    mine = [r for r in rows if (r.model, r.runner, r.phase) == (model, runner, phase)]
    measured = sorted(mine, key=lambda r: r.median_s)
    swapped = [(fast, slow) for i, fast in enumerate(measured) for slow in measured[i + 1:]
               if getattr(slow, key) < getattr(fast, key)]
    if not swapped:
        return "matches"
    pairs = [(fast, slow, slow.median_s / fast.median_s - 1) for fast, slow in swapped]
    told = "; ".join(f"{fast.placement} measured {gap:.0%} faster than {slow.placement}" for fast, slow, gap in pairs)
    if all(gap < NEAR_TIE for *_, gap in pairs):
        return f"matches but for near ties (under {NEAR_TIE:.0%} apart, swapped: {told})"
    return f"DIFFERS ({told})"


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def disk_figures() -> str:
    """The disk figures of this run's profile: what its disk rows are priced from before calibration (and its
    routed experts and lookups after it too)."""
    from placement_opt.hardware.profile_store import load_profile

    disk = ((load_profile() or {}).get("measurements") or {}).get("disk") or {}
    rate, scattered, latency = (disk.get(k) for k in ("mapped_read_bytes_per_s", "random_read_bytes_per_s",
                                                      "random_read_latency_s"))
    if not (rate and scattered and latency):
        return "- Disk: not profiled."
    return (f"- Disk, as this run's profile measured it: {rate / 1e9:.2f} GB/s mapped and read in order; "
            f"{scattered / 1e9:.2f} GB/s and {latency * 1e6:.0f} µs a read for regions at random places asked for "
            f"together (a router's picks, a lookup's rows).")


def write_results(out: Path, rows: list[Row], infos: dict[str, dict[str, Any]], gpu: list[str],
                  args: argparse.Namespace, load: tuple[float, float], wall_s: float) -> None:
    within = [r for r in rows if abs(r.after_s / r.median_s - 1) <= GOAL]
    lines = [
        "# Cost-model accuracy on this machine: before and after `placement_opt.calibrate`",
        "",
        f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; wall time {wall_s:.0f} s",
        f"- Machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, Python {sys.version.split()[0]}; 1-minute load average "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end (other jobs share the cores).",
        f"- Command: `python benchmarks/cost_accuracy/run.py{' --quick' if args.quick else ''}"
        f"{f' --threads {args.threads}' if args.threads else ''}"
        f"{f' --models {args.models}' if args.models != 'small,mid,moe' else ''}` (prompt "
        f"{args.prompt}, {args.steps} decode steps, {args.repeats} prefill repeats)",
        "- `before`: `placement_opt.profile(['cpu', 'disk'], dtype='float32')` and the roofline; `after`: the same "
        "profile plus `placement_opt.calibrate(path, ['cpu', 'disk'], workload=..., granularity='auto')` on the "
        "model. Both through "
        "`placement_opt.evaluate`. Measured: the median prefill of the repeats and the median decode step of the "
        "steps (calibration keeps each unit's median too; the fastest beside); ratios = prediction / median.",
        f"- Within +-{GOAL:.0%} after calibration: {len(within)} of {len(rows)} rows.",
        disk_figures(),
        "",
    ]
    for shape, info in infos.items():
        lines.append(f"- `{shape}`: {info['layers']} layers, {info['params'] / 1e9:.2f}B parameters (fp32); "
                     f"calibrate (granularity auto: block and sublayer units) took {info['calibrate_s']:.1f} s "
                     f"(CPU profiled first if it was not); calibrated figures cover "
                     + ", ".join(f"{n} of {total} {cut} units" for cut, (n, total) in info["covered"].items()) + ".")
    lines += ["", "| model | runner | placement | phase | before (s) | after (s) | measured median (s) | fastest (s) "
              "| before / median | after / median | after within +-25% | RSS growth (MiB) | predicted CPU extra (MiB) |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|:---:|---:|---:|"]
    for r in rows:
        ok = abs(r.after_s / r.median_s - 1) <= GOAL
        lines.append(f"| {r.model} | {r.runner} | {r.placement} | {r.phase} | {r.before_s:.4f} | {r.after_s:.4f} | "
                     f"{r.median_s:.4f} | {r.best_s:.4f} | {r.before_s / r.median_s:.2f} | "
                     f"{r.after_s / r.median_s:.2f} | "
                     f"{'yes' if ok else 'NO'} | {mib(r.rss_growth)} | {mib(r.predicted_rss)} |")
    lines += ["", "Predicted ranking of the placements against the measured one (fastest first):", ""]
    for shape in infos:
        for runner in args.runners:
            if not any((r.model, r.runner) == (shape, runner) for r in rows):
                continue  # not run for this model (accelerate's offload does not run DBRX or JetMoE)
            for phase in ("prefill", "decode step"):
                for key in ("before_s", "after_s"):
                    lines.append(f"- {shape}, {runner}, {phase}, {key[:-2]}: {ranking(rows, shape, runner, phase, key)}")
    lines += ["", "## GPU part", "", *gpu, "", "## Calibrations", ""]
    for shape, info in infos.items():
        lines += [f"`{shape}`:", "", "```", info["summary"], "```", ""]
    lines += ["How to read it:", "",
              "- A unit's calibrated time runs from its call to the next unit's call, so the glue between units "
              "(masks, rotary embeddings, the model's own Python) is counted once, with the unit before it.",
              "- Disk rows, after calibration: the calibrated compute plus each unit's calibrated cold read (a decode "
              "step from evicted files through `dispatch` for placement_opt, through accelerate's `dispatch_model` for "
              "accelerate, less the resident step); before: the profile's memory-mapped read rate (x "
              "`MAPPED_READ_FACTOR` for accelerate).",
              "- RSS growth is sampled in the first forward after each dispatch, in one process for every row: the "
              "allocator keeps what earlier rows freed, so resident rows read 0 and the column is NOT a validation "
              "of the predicted peak (that needs a fresh process per row: `benchmarks/cost_accuracy/memory.py`, "
              "table in MEMORY.md). It also includes the pages of memory-mapped disk weights faulted in, which the "
              "predicted CPU extra (KV cache + workspace + stream buffers, `predicted_memory(...)['cpu']` less its "
              "weights) does not count."]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 layers for the mid model, fewer steps")
    parser.add_argument("--models", default="small,mid,moe")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed (default 16, quick 6)")
    parser.add_argument("--repeats", type=int, default=None, help="prefill repeats (default 5, quick 3)")
    parser.add_argument("--runners", default="placement_opt,accelerate")
    parser.add_argument("--gpu-budget", default="10GiB", help="GPU part: max_memory of cuda:0 (the issue's 10GiB)")
    parser.add_argument("--gpu-prompts", default="512", help="GPU part: prompt lengths, e.g. 512,1024,4096")
    parser.add_argument("--gpu-caps", default="no,yes", help="GPU part: without the hard cap, with it, or both")
    parser.add_argument("--gpu-only", action="store_true", help="the GPU part alone (no CPU rows)")
    parser.add_argument("--gpu-smoke", action="store_true",
                        help="with --gpu-only: its steps on the CPU with a tiny Llama, to check the script anywhere")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for calibration and runs alike (default: torch's); 1 is steadier "
                             "on a machine other jobs share, whose cores the threads would wait for")
    parser.add_argument("--out", default=None, help="default: RESULTS.md here (--gpu-smoke: printed only)")
    args = parser.parse_args()
    from placement_opt.runtime.cuda_allocator import use_expandable_segments

    use_expandable_segments()  # as the placement-opt command runs (the same for accelerate's rows)
    if args.gpu_smoke:
        args.gpu_only = True
    args.out = args.out or (None if args.gpu_smoke else str(HERE / "RESULTS.md"))
    if args.threads:
        torch.set_num_threads(args.threads)
    args.steps = args.steps or (6 if args.quick else 16)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.runners = args.runners.split(",")
    args.gpu_prompts = [int(p) for p in args.gpu_prompts.split(",")]
    args.gpu_caps = [c == "yes" for c in args.gpu_caps.split(",")]
    if args.gpu_only:
        gpu_only(args)
        return
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with scratch("cost_accuracy_") as work:
        import placement_opt

        placement_opt.profile(["cpu", "disk"], quick=args.quick, dtype="float32", offload_folder=work)
        rows, infos = [], {}
        for shape in args.models.split(","):
            found, infos[shape] = bench_model(shape, args, work)
            rows += found
        gpu = gpu_part(args, work)
        write_results(Path(args.out), rows, infos, gpu, args, (load_before, os.getloadavg()[0]),
                      time.perf_counter() - started)


if __name__ == "__main__":
    main()
