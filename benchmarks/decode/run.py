"""Do units that a plan computes on the CPU run as fast as in a plain CPU-only model?

One run, side by side, on this machine; writes RESULTS.md beside this script (issue 14).

For a Llama-, a Mixtral- and a Qwen2-MoE-shaped model (random weights written by
``save_pretrained``, sizes that fit a small machine), each variant is loaded once and then timed
in interleaved rounds:

- ``plain``: ``from_pretrained(path, device_map="cpu")``, the reference;
- ``placement_opt``: ``placement_opt.load(path, {"cpu": ...})``, every unit on the CPU;
- MoE models only, ``plain, batched_mm``: the plain model with the experts kernel that
  ``generate()`` used to force on CPU-executed experts of a plan whose first unit is on a GPU
  (what the fix of issue 14 saves, measured on this machine's CPU);
- with CUDA only, ``mixed``: ``placement_opt.load(path, {0: budget, "cpu": ...})``, where the
  budget leaves about half the layers to the CPU.

Decode is timed two ways, never as the difference of two ``generate()`` calls:

- *per token under generate()*: a logits processor stamps the clock at every step; the
  median gap between consecutive steps (prefill excluded) is the time per token;
- *per step in a hand-written loop*: one token forward with a ``DynamicCache``, timed each.

For the mixed plan a last pass times every unit with forward hooks (synchronising CUDA), and
compares the mixed step with "its CPU-executed units timed in the plain CPU model + its GPU
units timed in the mixed model".

Usage::

    python benchmarks/decode/run.py            # full: ~6 minutes on 2 cores
    python benchmarks/decode/run.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as T

import placement_opt as po
from placement_opt.runtime.timing import cache_argument

T.utils.logging.disable_progress_bar()

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from run_all import machine_description  # noqa: E402

VOCAB = 32000


def config_for(family: str, quick: bool) -> tuple[type, T.PretrainedConfig]:
    """The three shapes; hidden sizes chosen so one token reads ~0.3-1 GB of weights (fp32)."""
    layers = 2 if quick else 8
    if family == "llama":
        return T.LlamaForCausalLM, T.LlamaConfig(
            vocab_size=VOCAB, hidden_size=1536, intermediate_size=4096, num_hidden_layers=layers,
            num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)
    if family == "mixtral":  # 8 experts, top 2 (Mixtral-8x7B's routing)
        return T.MixtralForCausalLM, T.MixtralConfig(
            vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
            num_attention_heads=16, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=2048)
    # Qwen1.5-MoE's routing: many small experts (here 16), top 4, plus a shared expert
    return T.Qwen2MoeForCausalLM, T.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704,
        shared_expert_intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=4, num_experts=16, num_experts_per_tok=4, max_position_embeddings=2048)


class _Stamps(T.LogitsProcessor):
    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def per_token_generate(model: Callable, prompt: torch.Tensor, tokens: int) -> list[float]:
    """Seconds per decode step under generate(): gaps between consecutive logits-processor calls."""
    stamps = _Stamps()
    model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                   logits_processor=[stamps], pad_token_id=0)
    return [b - a for a, b in zip(stamps.times[1:], stamps.times[2:], strict=False)]


def per_step_loop(model: Callable, prompt: torch.Tensor, tokens: int) -> list[float]:
    """Seconds per one-token forward with a DynamicCache, after a prefill of ``prompt``."""
    cache = T.DynamicCache()
    out = model(prompt, **cache_argument(model, cache), use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(tokens):
        start = time.perf_counter()
        out = model(token, **cache_argument(model, cache), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        if token.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def unit_times(handle: po.DispatchedModel, model: torch.nn.Module, prompt: torch.Tensor,
               tokens: int) -> dict[str, float]:
    """Median seconds per unit and decode step, measured with forward hooks on ``model``'s modules."""
    modules = dict(model.named_modules())
    spent: dict[str, list[float]] = {}
    hooks = []
    for placement in handle.plan.placements:
        module = modules[placement.unit]
        sync = placement.execution.startswith("cuda")

        def pre(_m, _a, sync=sync, unit=placement.unit):
            if sync:
                torch.cuda.synchronize()
            spent.setdefault(unit, []).append(-time.perf_counter())

        def post(_m, _a, _o, sync=sync, unit=placement.unit):
            if sync:
                torch.cuda.synchronize()
            spent[unit][-1] += time.perf_counter()

        hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.no_grad():
            per_step_loop(model, prompt, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    # the first call of each unit is the prefill
    return {unit: statistics.median(values[1:]) for unit, values in spent.items() if len(values) > 1}


def _load_variants(path: Path, mixed_budget: str | None) -> dict[str, Callable]:
    variants: dict[str, Callable] = {}
    plain = T.AutoModelForCausalLM.from_pretrained(path, device_map="cpu").eval()
    variants["plain"] = plain
    variants["placement_opt"] = po.load(path, {"cpu": "20GiB"})
    if any(hasattr(m, "_is_expert_parallel") for m in plain.modules()):
        variants["plain, batched_mm"] = T.AutoModelForCausalLM.from_pretrained(
            path, device_map="cpu", experts_implementation="batched_mm").eval()
    if mixed_budget is not None:
        variants["mixed"] = po.load(path, {0: mixed_budget, "cpu": "20GiB"})
    return variants


def _mixed_budget(path: Path) -> str | None:
    """A GPU budget that holds about half the weights, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return f"{max(size // 2, 1) / 2**30:.3f}GiB"


def bench_family(family: str, work: Path, quick: bool, rounds: int, tokens: int) -> list[dict]:
    cls, config = config_for(family, quick)
    path = work / family
    torch.manual_seed(0)
    cls(config).to(torch.float32).save_pretrained(path)
    variants = _load_variants(path, _mixed_budget(path))
    prompt = torch.randint(0, VOCAB, (1, 32))
    with torch.no_grad():
        reference = variants["plain"](prompt).logits
        for name, model in variants.items():
            if name != "plain":
                diff = (model(prompt).logits.to(reference.device) - reference).abs().max().item()
                if diff > 1e-3:
                    raise SystemExit(f"{family}/{name}: logits differ from the plain model by {diff}")
    gen: dict[str, list[float]] = {name: [] for name in variants}
    loop: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):  # alternate to cancel drift
            with torch.no_grad():
                gen[name] += per_token_generate(variants[name], prompt, tokens)
                loop[name] += per_step_loop(variants[name], prompt, tokens)
    rows = []
    for name in variants:
        rows.append({"family": family, "variant": name, "generate_ms": 1e3 * statistics.median(gen[name]),
                     "loop_ms": 1e3 * statistics.median(loop[name]), "samples": len(gen[name])})
    if "mixed" in variants:
        rows.append(_mixed_breakdown(variants, prompt, tokens, family))
    for model in variants.values():
        if isinstance(model, po.DispatchedModel):
            model.remove()
    return rows


def _mixed_breakdown(variants: dict[str, Callable], prompt: torch.Tensor, tokens: int, family: str) -> dict:
    mixed = variants["mixed"]
    on_gpu = {p.unit for p in mixed.plan.placements if p.execution.startswith("cuda")}
    in_mixed = unit_times(mixed, mixed.model, prompt, tokens)
    in_plain = unit_times(mixed, variants["plain"], prompt, tokens)
    expected = (sum(t for u, t in in_plain.items() if u not in on_gpu)
                + sum(t for u, t in in_mixed.items() if u in on_gpu))
    return {"family": family, "variant": "mixed: CPU units in plain + GPU units", "generate_ms": float("nan"),
            "loop_ms": 1e3 * expected, "samples": tokens,
            "note": f"{len(on_gpu)} of {len(mixed.plan.placements)} units on the GPU"}


def render(rows: list[dict], args: argparse.Namespace, seconds: float) -> str:
    lines = [
        "# Decode speed of CPU-executed units: placement_opt against the plain model",
        "",
        f"Machine: {machine_description()}; torch {torch.__version__}, transformers {T.__version__}; "
        f"{'CUDA: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device'}.",
        f"Run {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {seconds:.0f} s: "
        f"`python benchmarks/decode/run.py{' --quick' if args.quick else ''}`. "
        f"fp32 random weights, batch 1, prompt 32, {args.tokens} new tokens, {args.rounds} interleaved rounds; "
        "medians over every decode step (prefill excluded).",
        "",
        "| model | variant | per token, generate() | per step, decode loop | vs plain (generate / loop) |",
        "|---|---|---:|---:|---:|",
    ]
    plain = {r["family"]: r for r in rows if r["variant"] == "plain"}
    for r in rows:
        base = plain[r["family"]]
        gen = "-" if r["generate_ms"] != r["generate_ms"] else f"{r['generate_ms']:.1f} ms"
        ratio_gen = "-" if gen == "-" else f"{r['generate_ms'] / base['generate_ms']:.3f}x"
        lines.append(f"| {r['family']} | {r['variant']}{' (' + r['note'] + ')' if 'note' in r else ''} | {gen} | "
                     f"{r['loop_ms']:.1f} ms | {ratio_gen} / {r['loop_ms'] / base['loop_ms']:.3f}x |")
    lines += ["", "Goal (issue 14): CPU-executed units within 10 % of the plain CPU-only model per token; on a GPU "
              "machine the mixed plan faster than all-CPU and within 15 % of its CPU units' plain time plus its GPU "
              "part.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 1 round: a smoke run")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--families", default="llama,mixtral,qwen2_moe")
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 4)
    args.tokens = args.tokens or (8 if args.quick else 32)
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="po-decode-") as work:
        for family in args.families.split(","):
            rows += bench_family(family, Path(work), args.quick, args.rounds, args.tokens)
            print(f"{family}: done", flush=True)
    text = render(rows, args, time.perf_counter() - start)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
