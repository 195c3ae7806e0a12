"""How fast does placement_opt's dispatcher run a plan, compared with accelerate's hooks?

One run, side by side, on this machine; writes RESULTS.md beside this script.

1. Forward time of an 8-layer, hidden-1024 Llama in fp32 (vocab 32000, MLP 2816; 0.67 GB),
   one token, no KV cache: the plain model; everything on the CPU (placement_opt vs accelerate
   ``dispatch_model`` with hooks on every unit); half the layers on disk; the whole model on
   disk (accelerate ``disk_offload``). Every variant is its own model object sharing the same
   weights; rounds visit the variants in a shuffled order (interleaved, to cancel drift), and
   the table gives medians over every forward.
2. Loading a 20-layer checkpoint of the same width (1.3 GB safetensors): ``placement_opt.load``
   vs ``from_pretrained(device_map=...)``, all on the CPU and with half the layers on disk;
   each load in a fresh interpreter, alternating, reporting wall time and peak RSS.

Usage::

    python benchmarks/dispatch/run.py            # full: ~5 minutes on 2 cores
    python benchmarks/dispatch/run.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as T

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from placement_opt.cost.evaluate import Cost  # noqa: E402
from placement_opt.cost.workload import Workload  # noqa: E402
from placement_opt.hardware.resolve import as_machine  # noqa: E402
from placement_opt.plan import Plan, UnitPlacement  # noqa: E402
from run_all import machine_description  # noqa: E402

HIDDEN, MLP, VOCAB, HEADS = 1024, 2816, 32000, 16


def llama_config(layers: int) -> T.LlamaConfig:
    return T.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=512,
                         tie_word_embeddings=False)


def units(layers: int) -> list[str]:
    return (["model.embed_tokens"] + [f"model.layers.{i}" for i in range(layers)]
            + ["model.norm", "model.rotary_emb", "lm_head"])


def plan_for(layers: int, on_disk: set[str]) -> Plan:
    """A hand-made plan: units in ``on_disk`` stored on disk, everything executed on the CPU."""
    workload = Workload(batch_size=1, prompt_len=1, new_tokens=0)
    rows = tuple(UnitPlacement(unit=u, storage="disk" if u in on_disk else "cpu", execution="cpu",
                               mode="stream" if u in on_disk else "resident") for u in units(layers))
    cost = Cost(workload=workload, prefill_s=0.0, decode_s=0.0, transfer_s=0.0, stage_s={}, units=(), memory=())
    return Plan(model_name=f"llama-{layers}x{HIDDEN}", dtype="float32", objective="latency", strategy="sequential",
                placements=rows, machine=as_machine({"cpu": "16GiB", "disk": "100GiB"}), workload=workload,
                cost=cost, status="GREEDY", objective_value=0.0, best_bound=0.0, gap=0.0, solve_time_s=0.0)


def half_disk(layers: int) -> set[str]:
    return {f"model.layers.{i}" for i in range(layers // 2, layers)}


def accelerate_map(layers: int, on_disk: set[str]) -> dict[str, str]:
    return {u: "disk" if u in on_disk else "cpu" for u in units(layers)}


# ---------------------------------------------------------------------------------------------
# 1. Forward time
# ---------------------------------------------------------------------------------------------
def sibling(model: torch.nn.Module) -> torch.nn.Module:
    """Another model object whose parameters share the reference's memory."""
    with torch.device("meta"):
        twin = T.LlamaForCausalLM(model.config)
    twin.load_state_dict(model.state_dict(), assign=True)
    for name, buffer in model.named_buffers():
        owner, _, attr = name.rpartition(".")
        twin.get_submodule(owner)._buffers[attr] = buffer
    return twin.eval()


def build_variants(model: torch.nn.Module, layers: int, work: Path) -> dict[str, torch.nn.Module]:
    import accelerate

    from placement_opt import dispatch

    half, everything = half_disk(layers), set(units(layers))
    variants = {"plain": model}
    variants["placement_opt, all CPU"] = dispatch(sibling(model), plan_for(layers, set())).model
    variants["placement_opt, all CPU, every unit hooked"] = dispatch(
        sibling(model), plan_for(layers, set()), _hook_every_unit=True).model
    variants["accelerate dispatch_model, all CPU"] = accelerate.dispatch_model(
        sibling(model), accelerate_map(layers, set()), main_device="cpu", force_hooks=True)
    variants["placement_opt, half layers on disk"] = dispatch(
        sibling(model), plan_for(layers, half), offload_dir=work / "po-half").model
    variants["accelerate dispatch_model, half layers on disk"] = accelerate.dispatch_model(
        sibling(model), accelerate_map(layers, half), main_device="cpu", offload_dir=str(work / "acc-half"))
    variants["placement_opt, whole model on disk"] = dispatch(
        sibling(model), plan_for(layers, everything), offload_dir=work / "po-disk").model
    variants["accelerate disk_offload, whole model"] = accelerate.disk_offload(
        sibling(model), str(work / "acc-disk"), execution_device="cpu")
    return variants


def time_forwards(variants: dict[str, torch.nn.Module], rounds: int,
                  per_round: int) -> dict[str, list[list[float]]]:
    """Seconds per forward, per variant and round."""
    ids = torch.tensor([[42]])
    times: dict[str, list[list[float]]] = {name: [] for name in variants}
    order = list(variants)
    rng = random.Random(0)
    with torch.inference_mode():
        for model in variants.values():  # warm-up: page cache, allocator, lazy init
            for _ in range(2):
                model(ids, use_cache=False)
        for _ in range(rounds):
            rng.shuffle(order)
            for name in order:
                model, this_round = variants[name], []
                for _ in range(per_round):
                    start = time.perf_counter()
                    model(ids, use_cache=False)
                    this_round.append(time.perf_counter() - start)
                times[name].append(this_round)
    return times


def check_equal(variants: dict[str, torch.nn.Module]) -> dict[str, float]:
    ids = torch.tensor([[1, 42, 7, 99]])
    with torch.inference_mode():
        reference = variants["plain"](ids, use_cache=False).logits
        return {name: float((m(ids, use_cache=False).logits - reference).abs().max()) for name, m in variants.items()}


def forward_section(quick: bool) -> str:
    layers = 8
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(llama_config(layers)).eval()
    size_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    with tempfile.TemporaryDirectory(prefix="dispatch-bench-") as tmp:
        variants = build_variants(model, layers, Path(tmp))
        errors = check_equal(variants)
        rounds, per_round = (3, 2) if quick else (25, 3)
        times = time_forwards(variants, rounds, per_round)
    med = {name: statistics.median(t for r in rs for t in r) * 1e3 for name, rs in times.items()}
    plain = med["plain"]

    def paired(name: str, other: str) -> float:
        """Median over rounds of the ratio of round medians: drift between rounds cancels."""
        return statistics.median(statistics.median(a) / statistics.median(b)
                                 for a, b in zip(times[name], times[other], strict=True))

    pairs = {
        "placement_opt, all CPU": "accelerate dispatch_model, all CPU",
        "placement_opt, all CPU, every unit hooked": "accelerate dispatch_model, all CPU",
        "placement_opt, half layers on disk": "accelerate dispatch_model, half layers on disk",
        "placement_opt, whole model on disk": "accelerate disk_offload, whole model",
    }
    lines = [
        f"Llama, {layers} layers, hidden {HIDDEN}, MLP {MLP}, vocab {VOCAB}, fp32 ({size_gb:.2f} GB of weights); "
        f"one-token forward, no KV cache, `torch.inference_mode()`, {torch.get_num_threads()} threads. "
        f"{rounds} rounds x {per_round} forwards per variant, variants shuffled each round; median per forward.",
        "",
        "| variant | median ms | vs plain | vs plain, paired by round | vs accelerate (same split) "
        "| vs accelerate, paired | max abs logit diff vs plain |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in variants:
        partner = pairs.get(name)
        vs_acc = f"{med[name] / med[partner]:.2f}x" if partner else ""
        vs_acc_paired = f"{paired(name, partner):.2f}x" if partner else ""
        lines.append(f"| {name} | {med[name]:.1f} | {med[name] / plain:.3f}x | {paired(name, 'plain'):.3f}x | "
                     f"{vs_acc} | {vs_acc_paired} | {errors[name]:.1e} |")
    lines.append("")
    over = {name: 100 * (paired(name, "plain") - 1) for name in variants}
    lines.append(f"Hook overhead, all CPU (paired by round): placement_opt {over['placement_opt, all CPU']:+.1f}% "
                 f"over plain (only the model's forward is wrapped: no unit needs work), "
                 f"{over['placement_opt, all CPU, every unit hooked']:+.1f}% with every unit's forward wrapped "
                 f"(what a multi-device plan pays), accelerate {over['accelerate dispatch_model, all CPU']:+.1f}%.")
    return "\n".join(lines), med


# ---------------------------------------------------------------------------------------------
# 2. Loading a checkpoint
# ---------------------------------------------------------------------------------------------
_LOADERS = {
    "placement_opt.load, all CPU": "po-cpu",
    "from_pretrained(device_map='cpu')": "hf-cpu",
    "placement_opt.load, half layers on disk": "po-half",
    "from_pretrained(device_map=..., half layers on disk)": "hf-half",
}


def _memory_mb() -> dict[str, float]:
    """VmHWM (peak resident set; ru_maxrss would carry the parent's across exec), RssAnon, RssFile."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(line.split()[1]) / 1024
    return fields


def _child(kind: str, path: str, layers: int, work: str) -> None:
    """Runs in a fresh interpreter: load once, print wall time and memory as JSON."""
    from placement_opt import load  # imports are not part of the timed load

    _ = T.LlamaForCausalLM, T.LlamaConfig, T.AutoConfig  # resolve transformers' lazy imports now
    start = time.perf_counter()
    if kind.startswith("po"):
        on_disk = half_disk(layers) if kind == "po-half" else set()
        model = load(path, None, plan=plan_for(layers, on_disk), offload_dir=work).model
    else:
        on_disk = half_disk(layers) if kind == "hf-half" else set()
        device_map = accelerate_map(layers, on_disk) if on_disk else "cpu"
        model = T.LlamaForCausalLM.from_pretrained(path, device_map=device_map, offload_folder=work,
                                                   dtype=torch.float32)
    seconds = time.perf_counter() - start
    loaded = _memory_mb()
    with torch.inference_mode():
        logit = float(model(torch.tensor([[42]]), use_cache=False).logits[0, -1, :4].sum())
    after = _memory_mb()
    print(json.dumps({"seconds": seconds, "load_peak_mb": loaded["VmHWM"], "peak_mb": after["VmHWM"],
                      "anon_mb": after["RssAnon"], "file_mb": after["RssFile"], "logit": logit}))


def load_section(quick: bool) -> str:
    layers = 4 if quick else 20
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="dispatch-load-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(llama_config(layers))
        model.save_pretrained(ckpt)
        size_gb = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 1e9
        del model
        results: dict[str, list[dict[str, float]]] = {name: [] for name in _LOADERS}
        for r in range(repeats):
            for name, kind in _LOADERS.items():
                work = Path(tmp) / f"offload-{kind}-{r}"
                out = subprocess.run([sys.executable, __file__, "--child", kind, str(ckpt), str(layers), str(work)],
                                     check=True, capture_output=True, text=True)
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    logits = {round(x["logit"], 4) for rs in results.values() for x in rs}
    lines = [
        f"Llama, {layers} layers, hidden {HIDDEN}, fp32: {size_gb:.2f} GB safetensors checkpoint (save_pretrained). "
        f"Each load in a fresh interpreter (imports done before the clock starts), {repeats} alternating "
        f"repetitions, medians. Memory from /proc/self/status: peak RSS when the load returns, then after one "
        f"forward the peak, the anonymous memory (RssAnon: owned by the process) and the file-backed pages "
        f"(RssFile: mapped checkpoint or offload files, page cache the kernel can drop and re-read). "
        f"Same first logits in every run: {'yes' if len(logits) == 1 else 'NO: ' + str(sorted(logits))}.",
        "",
        "| loader | load s | peak RSS at load MB | peak RSS after forward MB | RssAnon MB | RssFile MB "
        "| time vs from_pretrained | peak vs from_pretrained |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = ("seconds", "load_peak_mb", "peak_mb", "anon_mb", "file_mb")
    med = {n: {k: statistics.median(x[k] for x in rs) for k in keys} for n, rs in results.items()}
    partner = {"placement_opt.load, all CPU": "from_pretrained(device_map='cpu')",
               "placement_opt.load, half layers on disk": "from_pretrained(device_map=..., half layers on disk)"}
    for name, m in med.items():
        other = partner.get(name)
        ratio_t = f"{m['seconds'] / med[other]['seconds']:.2f}x" if other else ""
        ratio_m = f"{m['peak_mb'] / med[other]['peak_mb']:.2f}x" if other else ""
        lines.append(f"| {name} | {m['seconds']:.2f} | {m['load_peak_mb']:.0f} | {m['peak_mb']:.0f} | "
                     f"{m['anon_mb']:.0f} | {m['file_mb']:.0f} | {ratio_t} | {ratio_m} |")
    return "\n".join(lines)


_NOTES = """## Reading the figures

- The 2-core machine is a shared VM: the load average above says how busy it was; ratios taken side
  by side in one run are steadier than the absolute times. For an all-CPU plan placement_opt wraps only the model's forward; a per-unit wrapper (what a
  multi-device plan adds) measured 11 us per call (microbenchmark, taken under load): 12 wrapped
  units cost ~0.13 ms, under 0.5 % of this forward.
- Disk-stored units executed on the CPU compute from the memory-mapped safetensors file in place:
  after the first forward they run from the page cache at RAM speed. accelerate copies every disk
  weight out of its memmap (or the checkpoint) on every forward.
- RssFile counts those mapped pages: page cache that the kernel reclaims under memory pressure
  (and reads again when the unit next runs), not memory the process owns; RssAnon is the same
  for both loaders. from_pretrained also maps CPU weights from the checkpoint without copying.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke sizes")
    parser.add_argument("--child", nargs=4, metavar=("KIND", "PATH", "LAYERS", "WORK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, path, layers, work = args.child
        _child(kind, path, int(layers), work)
        return
    started = time.perf_counter()
    forward_md, _ = forward_section(args.quick)
    load_md = load_section(args.quick)
    command = "python benchmarks/dispatch/run.py" + (" --quick" if args.quick else "")
    load_avg = os.getloadavg()
    text = "\n".join([
        "# Dispatcher: placement_opt vs accelerate",
        "",
        f"- Machine: {machine_description()}",
        f"- Software: torch {torch.__version__}, transformers {T.__version__}, "
        f"accelerate {__import__('accelerate').__version__}",
        f"- Command: `{command}`",
        f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; wall time {time.perf_counter() - started:.0f} s; "
        f"1-minute load average at the end {load_avg[0]:.1f} on {os.cpu_count()} cores",
        "",
        "## Forward time per plan",
        "",
        forward_md,
        "",
        "## Loading a checkpoint",
        "",
        load_md,
        "",
        _NOTES,
    ])
    (HERE / "RESULTS.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
