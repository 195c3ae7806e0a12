"""Issue 15 measured on a GPU: accelerate ``auto`` against the layer, phased and sublayer plans, in one run.

``run.py`` beside this script prices these plans; this one runs them. For each case (the Llama-3.1-8B shape at
10 and 4 GiB of ``cuda:0``; a Mixtral-8x7B shape cut to ``--mixtral-layers`` layers at the issue's 24 GiB scaled to
those layers, :func:`mixtral_budget`), a checkpoint with
random bf16 weights is written with ``save_pretrained``, and each runner loads it with the same ``max_memory``:

* ``accelerate auto``: ``from_pretrained(path, device_map="auto", max_memory=M)``, the reference tokens;
* ``layer``: ``placement_opt.load(path, M, plan=...)`` with the block plan of ``modes=("resident", "stream")``;
* ``phased``: the block plan with phased units too (prompt streamed to the GPU, decode on the CPU);
* ``sublayer``: every mode, on ``trace(path, granularity="sublayer")`` (attention, MLP, experts apart);
* ``expert groups`` (MoE cases): the same with each layer's experts in :data:`EXPERT_GROUPS` groups
  (``expert_groups=``), so part of a layer's experts can stay on the GPU.

Every plan is solved with ``Workload(overlap=True)`` after ``placement_opt.profile`` and
``placement_opt.calibrate`` on this machine (block and sublayer units, and the expert groups of MoE cases; into a
profile file of this run, never the user's), and each row puts
the plan's prediction beside the measurement: the prefill (one forward of the prompt, the last position's logits)
and the decode (one token per step in a hand-written loop over the KV cache, the median step; never the difference
of two ``generate()`` calls; after one untimed warm-up forward), the GPU's ``max_memory_allocated`` over the
generation against the predicted ``cuda:0`` peak, and how many
greedy tokens equal accelerate's (bf16 on the CPU rounds differently from the GPU, so a few may not).
``--cap`` adds ``torch.cuda.set_per_process_memory_fraction(budget)``: an over-budget plan then fails with OOM.

Without CUDA, ``--smoke`` runs the same code on the CPU with a tiny Llama and a tiny Mixtral (devices ``{"cpu": ...}``, where every
runner computes on the CPU): a check of the script, not a measurement of issue 15.

Usage::

    python benchmarks/phases/gpu.py             # on a CUDA machine: writes GPU.md beside this script
    python benchmarks/phases/gpu.py --cap       # the same with the hard cap
    python benchmarks/phases/gpu.py --case llama --budget 4GiB   # one case and budget: rows merged into GPU.json
    python benchmarks/phases/gpu.py --smoke     # any machine: a tiny Llama and a tiny Mixtral on the CPU (minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from run import _modes, _split  # noqa: E402  (this folder's pricing benchmark: the same unit summaries)

from gpu_common import freeze_imports, profile_once, random_checkpoint, remove_unshared, use_profile  # noqa: E402

EVERY = ("resident", "stream", "phased")
RUNNERS = ("accelerate auto", "layer", "phased", "sublayer")
#: Tokens the prompt of the unvisited-contexts generation is longer by: past every context the workload's
#: calibration and first generation ran (its prompt + steps + 1).
UNVISITED_OFFSET = 64
#: Decode steps of that generation.
UNVISITED_STEPS = 8
#: Groups a Mixtral layer's 8 experts are cut into for the ``expert groups`` runner (MoE cases only).
EXPERT_GROUPS = 4
#: Llama-3.1-8B's published shape (the issue's checkpoint) and Mixtral-8x7B's, its layer count set per run.
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
MIXTRAL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
               num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=8192)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=256)
#: --smoke's Mixtral: its checkpoint stores experts one tensor each, as Mixtral's do (load() fuses them).
TINY_MOE = dict(TINY, num_local_experts=4, num_experts_per_tok=2)


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    shape: dict[str, Any]
    budgets: tuple[str, ...]
    workload: tuple[int, int, int]
    """batch, prompt tokens, decode steps."""


@dataclass(frozen=True)
class Row:
    case: str
    budget: str
    runner: str
    units: str
    predicted_prefill_s: float | None
    measured_prefill_s: float | None
    predicted_decode_tps: float | None
    measured_decode_tps: float | None
    predicted_peak_gib: float | None
    measured_peak_gib: float | None
    tokens_equal: str
    note: str = ""
    measured_mean_decode_tps: float | None = None
    """batch / the mean step: unlike the median, it carries a step's one-time costs (a new context length's
    attention set-up on a GPU), which a fresh process's first generate() pays. Rows before 2026-11-30 lack it."""
    unvisited_decode_tps: float | None = None
    """batch / the mean step of a second generation whose prompt is :data:`UNVISITED_OFFSET` tokens longer, so that
    no context it decodes at was run before in the process (the calibration and the first generation ran the
    workload's): what a user's first generate() meets. Rows before 2026-11-30 lack it."""
    kinds: list[dict[str, Any]] | None = None
    """A third generation with every unit's call marked (``placement_opt.runtime.breakdown.time_units``): each kind
    of unit's predicted and measured prefill and decode step seconds, where a miss is. Our plans' rows only;
    rows before 2026-11-30 lack it."""


def cases(args: argparse.Namespace) -> list[Case]:
    """The cases to run: every one, or those ``--case`` names, at ``--budget`` when given."""
    if args.smoke:
        return [c for c in (Case("tiny-llama (smoke)", "llama", TINY, ("1GiB",), (1, 32, 8)),
                            Case("tiny-mixtral (smoke)", "mixtral", TINY_MOE, ("1GiB",), (1, 32, 8)))
                if args.case in (None, c.family)]
    every = [Case("llama-3.1-8b shape", "llama", LLAMA_8B, ("10GiB", "4GiB"), (1, 512, args.steps)),
             Case(f"mixtral-8x7b shape, {args.mixtral_layers} layers", "mixtral",
                  {**MIXTRAL, "num_hidden_layers": args.mixtral_layers}, (mixtral_budget(args.mixtral_layers),),
                  (1, 512, args.steps))]
    chosen = [c for c in every if args.case in (None, c.family)]
    if args.budget:
        chosen = [dataclasses.replace(c, budgets=(args.budget,)) for c in chosen]
    return chosen


def mixtral_budget(layers: int) -> str:
    """The issue's 24 GiB for the whole 32-layer Mixtral, scaled to ``layers``: the same share of the model fits
    on the GPU (12 layers, about 18 GB in bf16, would fit whole in 24 GiB, and no plan would differ)."""
    return f"{max(1, round(24 * layers / 32))}GiB"


def case_config(case: Case) -> Any:
    """The transformers config of ``case``'s shape, in bf16, with its own lm_head (as the issue's checkpoints)."""
    import transformers as T

    config_class = T.MixtralConfig if case.family == "mixtral" else T.LlamaConfig
    config = config_class(**case.shape, tie_word_embeddings=False)
    config.dtype = "bfloat16"
    return config


def max_memory(budget: str, smoke: bool) -> dict[Any, str]:
    return {"cpu": "4GiB"} if smoke else {0: budget, "cpu": "100GiB"}


def compute_devices(smoke: bool) -> list[str]:
    return ["cpu"] if smoke else ["cuda:0", "cpu"]


def runners(case: Case) -> tuple[str, ...]:
    return (*RUNNERS, "expert groups") if case.family == "mixtral" else RUNNERS


def solve_plans(path: Path, devices: dict[Any, str], workload: Any, time_limit_s: float,
                moe: bool = False) -> dict[str, Any]:
    """The plans, each solved with ``workload`` (overlap on) on this machine's profile; ``moe``: with expert groups."""
    import placement_opt

    block, sublayer = placement_opt.trace(str(path)), placement_opt.trace(str(path), granularity="sublayer")
    grouped = {}
    if moe:
        graph = placement_opt.trace(str(path), granularity="sublayer", expert_groups=EXPERT_GROUPS)
        grouped["expert groups"] = (placement_opt.solve(graph, devices, workload=workload, modes=EVERY,
                                                        time_limit_s=time_limit_s), graph)
    return {**grouped,
        "layer": (placement_opt.solve(block, devices, workload=workload, modes=("resident", "stream"),
                                      time_limit_s=time_limit_s), block),
        "phased": (placement_opt.solve(block, devices, workload=workload, modes=EVERY, time_limit_s=time_limit_s),
                   block),
        "sublayer": (placement_opt.solve(sublayer, devices, workload=workload, modes=EVERY,
                                         time_limit_s=time_limit_s), sublayer),
    }


def _groups(plan: Any) -> str:
    """Where a plan's expert groups compute in the decode: 'groups gpu 10, cpu 22'."""
    counts: dict[str, int] = {}
    for p in plan.placements:
        if ".experts.groups." in p.unit:
            where = "gpu" if p.execution.startswith("cuda") else "cpu"
            counts[where] = counts.get(where, 0) + 1
    return "groups " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))


def measure(model: Any, ids: torch.Tensor, steps: int) -> tuple[float, list[float], list[list[int]], int | None, str]:
    """Prefill seconds, each decode step's seconds, the greedy tokens per step (the prompt's next token first),
    cuda:0's peak bytes over the generation and its prefill's and decode's peaks apart, as words for a note
    ("" without CUDA): ``placement_opt.runtime.timing.time_generation``, as
    ``placement-opt run`` measures (one untimed warm-up forward first: a runner's first call would otherwise carry
    the process's CUDA and kernel set-up into its prefill)."""
    from placement_opt.runtime.timing import time_generation

    timing = time_generation(model, ids, steps + 1)
    tokens = [list(step) for step in zip(*timing.tokens, strict=True)]
    phases = (f"cuda:0 peak {timing.prefill_peak_gpu_bytes['cuda:0'] / 2**30:.2f} GiB in the prefill, "
              f"{timing.decode_peak_gpu_bytes['cuda:0'] / 2**30:.2f} in the decode"
              if "cuda:0" in timing.prefill_peak_gpu_bytes else "")
    return timing.prefill_s, list(timing.decode_step_s), tokens, timing.peak_gpu_bytes.get("cuda:0"), phases


# The first runner's greedy tokens (per step) and its prompt's last logits.
Reference = tuple[list, torch.Tensor]


def last_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The prompt's last-position logits of one more forward, float32 on the CPU: where two runners' greedy tokens
    part, these say whether it is rounding (a gap within the reference's top-2 margin) or a fault (non-finite
    values, a gap far past it)."""
    with torch.no_grad():
        return model(input_ids=ids, logits_to_keep=1).logits[:, -1].float().cpu()


def logits_apart(logits: torch.Tensor, reference: torch.Tensor) -> str:
    """Words for a row whose tokens differ from the reference's: the first position's logits against it."""
    top = reference.topk(2, dim=-1).values
    margin = (top[:, 0] - top[:, 1]).min().item()
    finite = "all finite" if bool(torch.isfinite(logits).all()) else "NON-FINITE values"
    return (f"prompt's last logits: max |diff| {(logits - reference).abs().max().item():.3g} from the reference's, "
            f"whose top-2 margin is {margin:.3g}; {finite}, argmax {'equal' if torch.equal(logits.argmax(-1), reference.argmax(-1)) else 'apart'}")


def unvisited_step(model: Any, vocab: int, batch: int, prompt: int, device: str) -> float:
    """The mean decode step of a generation at contexts this process has not run (``prompt`` past them), no warm-up:
    a GPU's set-up per new key length (cuDNN attention's graphs) shows here, where the calibrated rows hide it."""
    from placement_opt.runtime.timing import time_generation

    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(2)).to(device)
    return time_generation(model, ids, UNVISITED_STEPS + 1, warmup=False).decode_step_mean_s


def breakdown_kinds(model: Any, cost: Any, ids: torch.Tensor, steps: int) -> list[dict[str, Any]]:
    """Each kind of unit's predicted and measured seconds (``time_units``: a generation with every unit's call
    marked), as ``placement-opt run --breakdown`` prints them."""
    from placement_opt.runtime.breakdown import time_units

    return time_units(model, cost, ids, steps + 1).to_dict()["kinds"]


def kinds_table(rows: list[Row]) -> list[str]:
    """Our plans' units per kind: decode step and prefill milliseconds, predicted / measured."""
    lines = ["| case | budget | runner | units | how they run | decode step ms, predicted / measured | "
             "prefill ms, predicted / measured |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for k in r.kinds or ():
            measured = [k[f"measured_{p}_s"] for p in ("decode_step", "prefill")]
            pred = [k[f"predicted_{p}_s"] for p in ("decode_step", "prefill")]
            cells = [f"{a * 1e3:.2f} / {b * 1e3:.2f}" if b is not None else f"{a * 1e3:.2f} / -"
                     for a, b in zip(pred, measured, strict=True)]
            lines.append(f"| {r.case} | {r.budget} | {r.runner} | {k['name']} | {k['kind']} | {cells[0]} | {cells[1]} |")
    return lines if len(lines) > 2 else []


def load_runner(runner: str, path: Path, devices: dict[Any, str], plans: dict[str, Any]) -> Any:
    import transformers as T

    import placement_opt

    if runner == "accelerate auto":
        return T.AutoModelForCausalLM.from_pretrained(path, device_map="auto", max_memory=devices,
                                                      dtype=torch.bfloat16)
    return placement_opt.load(path, devices, plan=plans[runner][0])


def run_row(case: Case, budget: str, runner: str, path: Path, plans: dict[str, Any], reference: Reference | None,
            args: argparse.Namespace, workload: Any) -> tuple[Row, Reference | None]:
    """One runner: loaded, measured, compared with its prediction; an OOM is a row of its own. ``reference``: the
    first runner's greedy tokens and last logits (:func:`last_logits`), which this one's are compared with."""
    from placement_opt.cost.evaluate import evaluate, predicted_memory
    from placement_opt.units import parse_size

    batch, prompt, steps = case.workload
    devices = max_memory(budget, args.smoke)
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        fraction = min(1.0, parse_size(budget) / total) if args.cap else 1.0
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    model = None
    try:
        model = load_runner(runner, path, devices, plans)
        # with the CPU alone, transformers loads the model whole and sets no map
        accelerate_map = getattr(model, "hf_device_map", None) or {"": "cpu"}
        # accelerate's map is priced on the block graph, the layer plan's
        target, graph = (accelerate_map, plans["layer"][1]) if runner == "accelerate auto" else plans[runner]
        cost = evaluate(target, graph, devices, workload)
        peak_predicted = predicted_memory(target, graph, devices, workload).get("cuda:0")
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, case.shape["vocab_size"], (batch, prompt), generator=generator)
        prefill, times, tokens, peak, phases = measure(model, ids.to("cuda:0" if cuda else "cpu"), steps)
        unvisited = None if args.cap else unvisited_step(  # a longer prompt than the cap was priced for
            model, case.shape["vocab_size"], batch, prompt + max(steps, UNVISITED_OFFSET), "cuda:0" if cuda else "cpu")
        kinds = None if runner == "accelerate auto" else breakdown_kinds(model, cost, ids.to("cuda:0" if cuda else "cpu"),
                                                                          steps)
        step = statistics.median(times)
        logits = last_logits(model, ids.to("cuda:0" if cuda else "cpu"))
        equal = "reference" if reference is None else f"{sum(a == b for a, b in zip(tokens, reference[0], strict=True))}/{len(tokens)}"
        differ = reference is not None and tokens != reference[0]
        units = (_modes(target) if runner in ("layer", "phased") else _split(target) if runner == "sublayer"
                 else _groups(target) if runner == "expert groups" else "")
        row = Row(case.name, budget, runner, units, cost.prefill_s, prefill, cost.decode_tokens_per_s, batch / step,
                  peak_predicted.used_bytes / 2**30 if peak_predicted else None,
                  peak / 2**30 if cuda and peak is not None else None, equal,
                  # a peak over its prediction: which phase it is in; tokens apart: how far the logits are
                  note="; ".join(n for n in (
                      phases if peak_predicted and peak and peak > 1.02 * peak_predicted.used_bytes else "",
                      logits_apart(logits, reference[1]) if differ else "") if n),
                  measured_mean_decode_tps=batch / statistics.mean(times),
                  unvisited_decode_tps=batch / unvisited if unvisited else None, kinds=kinds)
        return row, (tokens, logits) if reference is None else reference
    except torch.cuda.OutOfMemoryError as exc:
        return Row(case.name, budget, runner, "", None, None, None, None, None, None, "-",
                   f"OOM: {str(exc).splitlines()[0][:80]}"), reference
    except Exception as exc:  # noqa: BLE001 - the row says why; the other runners still run
        return Row(case.name, budget, runner, "", None, None, None, None, None, None, "-",
                   f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"), reference
    finally:
        model = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def run_case(case: Case, work: Path, args: argparse.Namespace, done: list[Row] | None = None,
             emit: Any = lambda rows: None) -> list[Row]:
    """The case's rows; ``emit`` gets every row so far (``done``'s, then this case's) after each one."""
    import placement_opt
    from placement_opt.cost.workload import Workload

    path = random_checkpoint(case_config(case), work)  # written once per device_check.sh call (BENCH_SHARED)
    batch, prompt, steps = case.workload
    workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=steps, overlap=True)
    # block and sublayer units both (each runner's plan priced from its own units' times), and the groups' shapes
    placement_opt.calibrate(path, compute_devices(args.smoke), workload=workload, granularity="auto")
    if "expert groups" in runners(case):
        placement_opt.calibrate(path, compute_devices(args.smoke), workload=workload, granularity="sublayer",
                                expert_groups=EXPERT_GROUPS)
    rows = []
    try:
        for budget in case.budgets:
            plans = solve_plans(path, max_memory(budget, args.smoke), workload, args.time_limit,
                                moe=case.family == "mixtral")
            reference = None
            for runner in runners(case):
                row, reference = run_row(case, budget, runner, path, plans, reference, args, workload)
                rows.append(row)
                print(table([row])[-1], flush=True)
                emit([*(done or []), *rows])
    finally:
        remove_unshared(path)  # the next case's checkpoint needs the disk
    return rows


def table(rows: list[Row]) -> list[str]:
    def f(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    layer = {(r.case, r.budget): r.measured_decode_tps for r in rows if r.runner == "layer"}
    lines = ["| case | budget | runner | units | prefill predicted / measured (s) | decode tok/s predicted / measured | "
             "measured / layer plan | decode tok/s of the mean step | cuda:0 peak predicted / measured (GiB) | "
             "greedy tokens equal to the reference's (accelerate's; the first runner's that ran when it ran out of "
             "memory) | note | decode tok/s of the mean step at contexts not run before |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = layer.get((r.case, r.budget))
        ratio = f"{r.measured_decode_tps / base:.2f}x" if base and r.measured_decode_tps else "-"
        lines.append(f"| {r.case} | {r.budget} | {r.runner} | {r.units} | {f(r.predicted_prefill_s, 3)} / "
                     f"{f(r.measured_prefill_s, 3)} | {f(r.predicted_decode_tps, 2)} / {f(r.measured_decode_tps, 2)} | "
                     f"{ratio} | {f(r.measured_mean_decode_tps, 2)} | {f(r.predicted_peak_gib, 2)} / "
                     f"{f(r.measured_peak_gib, 2)} | {r.tokens_equal} | {r.note} | {f(r.unvisited_decode_tps, 2)} |")
    return lines


def merged(rows: list[Row], recorded: Path) -> list[Row]:
    """``rows`` over the rows of earlier runs kept in ``recorded`` (one per case, budget and runner), which a
    run of one case or budget (``--case``, ``--budget``: a GPU session's 10-minute commands) adds to."""
    kept = [Row(**r) for r in json.loads(recorded.read_text())] if recorded.exists() else []
    fresh = {(r.case, r.budget, r.runner) for r in rows}
    return [r for r in kept if (r.case, r.budget, r.runner) not in fresh] + rows


def write(out: Path, rows: list[Row], args: argparse.Namespace, seconds: float) -> None:
    import transformers

    from placement_opt.runtime.cuda_allocator import allocator_settings

    recorded = out.with_suffix(".json")
    rows = merged(rows, recorded)
    recorded.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.smoke else "CPU only (--smoke)"
    text = ["# Issue 15 measured: accelerate auto against the layer, phased and sublayer plans", "",
            f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC (the last run; `{recorded.name}` keeps "
            f"every run's rows, one per case, budget and runner); wall time of the last run {seconds:.0f} s",
            f"- Device: {device}; {os.cpu_count()} CPU cores; torch {torch.__version__}, transformers "
            f"{transformers.__version__}",
            f"- Command: `python benchmarks/phases/gpu.py {' '.join(sys.argv[1:])}`".rstrip(),
            f"- Plans solved with `time_limit_s={args.time_limit:g}` and `Workload(overlap=True)` after `profile` and "
            f"`calibrate` on this machine; hard cap: {'yes' if args.cap else 'no'}; CUDA allocator settings: "
            f"{allocator_settings() or 'default'}.", "",
            *table(rows), ""]
    kinds = kinds_table(rows)
    if kinds:
        text += ["Per kind of unit, from a generation with every unit's call marked (`time_units`; a unit's time runs "
                 "from its call to the next unit's, its waits included):", "", *kinds, ""]
    out.write_text("\n".join(text))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU: checks the script anywhere")
    parser.add_argument("--cap", action="store_true", help="set_per_process_memory_fraction(budget) on cuda:0")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed (default 32)")
    parser.add_argument("--mixtral-layers", type=int, default=12, help="layers of the Mixtral shape (default 12)")
    parser.add_argument("--time-limit", type=float, default=2.0, help="solve() time limit per plan (default 2 s)")
    parser.add_argument("--case", choices=("llama", "mixtral"), default=None, help="one case only (default: both)")
    parser.add_argument("--budget", default=None, help="one GPU budget only, e.g. 10GiB (default: each case's)")
    parser.add_argument("--out", type=Path, default=None, help="default: GPU.md here (smoke runs: no file)")
    args = parser.parse_args(argv)
    from placement_opt.runtime.cuda_allocator import use_expandable_segments

    use_expandable_segments()  # as the placement-opt command runs (the same for accelerate's rows)
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="phases_gpu_") as tmp:
        work = Path(tmp)
        use_profile(work)  # never the user's own profile
        profile_once(compute_devices(args.smoke), "bfloat16", quick=args.smoke)
        out = args.out or (None if args.smoke else HERE / "GPU.md")
        # written after every row: a run stopped by its time limit keeps what it measured
        emit = (lambda so_far: write(out, so_far, args, time.perf_counter() - started)) if out else (lambda so_far: None)
        rows: list[Row] = []
        for case in cases(args):
            rows += run_case(case, work, args, rows, emit)
    if out:
        write(out, rows, args, time.perf_counter() - started)
    else:
        print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    freeze_imports()
    sys.exit(main())
