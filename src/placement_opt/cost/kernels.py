"""Kernels: how long one unit's own kernels take on one device, for the prompt and for every decode step.

A roofline, or what :func:`placement_opt.calibrate` measured on the model itself (:mod:`.calibrated`), which
replaces it wherever it exists. The host's time around the kernels is :mod:`.context`'s; copies, round trips
and the options built from all of them are :mod:`.pricing`'s.

Time of one forward of a unit on a device::

    t = max(FLOPs / (peak FLOP/s x compute efficiency), bytes / (bandwidth x bandwidth efficiency))

Efficiencies are the :data:`COMPUTE_EFFICIENCY` / :data:`BANDWIDTH_EFFICIENCY` tables for
datasheet figures and 1.0 for figures measured by :func:`placement_opt.profile` (which are
achieved rates already). Bytes touched are the weights (MoE: only the experts the batch hits),
the activations in and out, and the KV cache read (decode) or written (prefill).

* Prefill: ``batch x prompt`` tokens; attention computes the query x context pairs its kernel computes
  (:func:`prompt_attention_pairs`: causal ``i + 1`` for query ``i`` where sdpa runs unmasked, every pair where
  it is given a mask); the logits unit computes ``batch`` rows only when ``generate()`` keeps the last
  position's logits.
* Decode: step ``t`` (0-based) has ``batch`` tokens and a context of ``prompt + t + 1``; FLOPs and
  bytes grow linearly in ``t``, so the sum over all steps of a max of linear functions has a
  closed form (:func:`_sum_max_lines`), never a loop over steps. A sliding layer stops growing at its
  window (:func:`sum_capped_lines`). On a CPU whose profile measured the cost of fresh pages, the
  cache's keys and values, allocated anew each step, add their page faults from the size at which
  glibc maps them anew (:func:`fresh_pages_s`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING

from ..hardware.devices import FRESH_PAGE_MIN_BYTES
from .memory import SCORE_FREE_ATTENTION

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware.devices import Device
    from ..model.graph import UnitInfo
    from .calibrated import UnitTimes
    from .context import PricingContext
    from .workload import Workload

__all__ = [
    "COMPUTE_EFFICIENCY",
    "BANDWIDTH_EFFICIENCY",
    "CACHE_PASSES_PER_STEP",
    "expected_experts",
    "contexts_at_least",
    "prompt_attention_pairs",
]

#: Fraction of datasheet peak FLOP/s that large matmuls reach (measured figures use 1.0).
COMPUTE_EFFICIENCY = {"gpu": 0.6, "cpu": 0.5, "disk": 1.0}
#: Fraction of datasheet memory bandwidth that weight reads reach (measured figures use 1.0).
BANDWIDTH_EFFICIENCY = {"gpu": 0.8, "cpu": 0.6, "disk": 0.9}
#: Passes over its KV cache a decode step makes, in cache sizes: transformers' ``DynamicCache`` grows by
#: ``torch.cat``, which reads the old keys and values and writes them anew, and attention then reads them.
#: Measured on this project's 2-core CPU (a Llama layer, 4 KV heads of 64, fp32, batch 8 x 4096 cached tokens):
#: the two cats took 61 % of the step, attention 21 % (benchmarks/cost_accuracy/KV_CACHE.md).
CACHE_PASSES_PER_STEP = 3
#: Tensors of a layer's cache ``torch.cat`` allocates anew at each step: its keys and its values.
_CACHE_TENSORS = 2


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts that ``tokens`` tokens hit, each routed to ``top_k``.

    Each token picks ``top_k`` of ``num_experts`` experts; one expert is missed by one token
    with probability ``1 - top_k / num_experts``, so ``E[distinct] = E x (1 - (1 - k/E)^T)``.
    Example: 8 experts, top-2, 1 token -> 2.0; 4 tokens -> 8 x (1 - 0.75^4) = 5.47.
    """
    if num_experts <= 0 or top_k <= 0 or tokens <= 0:
        return 0.0
    top_k = min(top_k, num_experts)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def touched_weight_bytes(unit: UnitInfo, tokens: int) -> float:
    """Weight bytes one forward over ``tokens`` tokens reads (MoE: only the experts hit).

    A unit with weights but no FLOPs is a lookup table (an embedding): it reads one row per token. Tied weights
    another unit stores are read as the unit's own (a tied LM head reads the whole embedding matrix).
    """
    if is_lookup(unit):
        return float(min(unit.read_bytes, tokens * unit.out_bytes_per_token + unit.buffer_bytes))
    if not unit.is_moe:
        return float(unit.read_bytes)
    hit = expected_experts(unit.moe_num_experts, unit.moe_experts_per_token, tokens)
    return unit.read_bytes - unit.moe_expert_bytes + unit.moe_expert_bytes * hit / unit.moe_num_experts


def is_lookup(unit: UnitInfo) -> bool:
    """A unit with parameters (its own or tied) and no FLOPs: a lookup table, such as an embedding."""
    return unit.flops_per_token == 0 and unit.param_bytes + unit.tied_param_bytes > 0


def _achieved(device: Device, tokens: int) -> tuple[float, float]:
    """Achieved (FLOP/s, bytes/s) of a device running ``tokens`` tokens per forward.

    Measured figures are used as they are (a measured FLOP/s-by-tokens curve, interpolated in
    log(tokens), wins over the single figure); datasheet figures are derated by the efficiency tables.
    """
    if device.source.startswith("measured"):
        flops = _interpolate(device.flops_by_tokens, tokens) if device.flops_by_tokens else device.flops_per_s
        return flops, device.bandwidth_bytes_per_s
    return (device.flops_per_s * COMPUTE_EFFICIENCY[device.kind],
            device.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY[device.kind])


def _interpolate(curve: Sequence[tuple[int, float]], tokens: int) -> float:
    """The FLOP/s of a forward of ``tokens`` tokens on a measured curve: its time per FLOP of one token (tokens /
    FLOP/s) piecewise linear in tokens between the points, flat rates beyond both ends.

    Interpolated in the rate (linear in log(tokens)), a forward's time dipped between points whose rate grows
    more than (1 + ln(t1/t0))-fold: on the profiler's 1, 4, 16, ... points, any memory-bound layer's (its time
    flat from 1 to 4 tokens), and a batch of 2 was priced 11 % faster than a batch of 1. The times are also made
    non-decreasing over the points (a running maximum): a measured 4-token forward faster than a 1-token one is
    noise, and a plan would otherwise buy speed by batching more."""
    times = list(accumulate((t / f for t, f in curve), max))
    if tokens <= curve[0][0]:
        return curve[0][1]
    for ((t0, _), (t1, _)), (s0, s1) in zip(pairwise(curve), pairwise(times), strict=True):
        if tokens <= t1:
            return tokens / (s0 + (tokens - t0) / (t1 - t0) * (s1 - s0))
    (t_last, f_last), s_last = curve[-1], times[-1]
    return f_last if s_last == t_last / f_last else t_last / s_last  # the rate as measured, not a round trip of it


def _base_flops_per_token(unit: UnitInfo, traced_seq_len: int) -> int:
    """FLOPs per token without the attention term (graph.py: flops - attn x traced seq_len)."""
    return max(0, unit.flops_per_token - unit.attn_flops_per_token_per_ctx * traced_seq_len)


def _sum_max_lines(lines: Sequence[tuple[float, float]], steps: int) -> float:
    """``sum_{t=0}^{steps-1} max_i(a_i + b_i t)`` in closed form.

    The upper envelope of lines is convex and piecewise linear; cutting ``[0, steps)`` at the
    integer ceilings of every pairwise intersection leaves segments where one line dominates,
    and each segment is an arithmetic series.
    """
    if steps <= 0:
        return 0.0
    cuts = {0, steps}
    for i, (a1, b1) in enumerate(lines):
        for a2, b2 in lines[i + 1:]:
            if b1 != b2:
                x = (a2 - a1) / (b1 - b2)
                if 0 < x < steps:
                    cuts.add(math.ceil(x))
    total = 0.0
    points = sorted(cuts)
    for start, end in pairwise(points):
        if end <= start:
            continue
        mid = (start + end - 1) / 2
        a, b = max(lines, key=lambda line: line[0] + line[1] * mid)
        count = end - start
        total += a * count + b * (start + end - 1) * count / 2
    return total


def measured_prefill_s(ctx: PricingContext, unit: UnitInfo, device: Device) -> float | None:
    """The unit's calibrated prefill on ``device`` (its host time included), or None. :func:`placement_opt.calibrate`
    times equal prompts: a padded workload's mask adds the pairs sdpa then computes too (:func:`_padding_s`)."""
    wl = ctx.workload
    measured = _calibrated(ctx, unit, device)
    seconds = None if measured is None else measured.prefill_s(wl.batch_size, wl.prompt_len, wl.logits_kept)
    return None if seconds is None else seconds + _padding_s(ctx, unit, device)


def _padding_s(ctx: PricingContext, unit: UnitInfo, device: Device) -> float:
    """The attention work a padded prompt's mask adds to a forward timed on equal prompts (the query x key pairs
    :func:`prompt_attention_pairs` counts with the mask, less those without), at the device's FLOP rate."""
    wl = ctx.workload
    if not wl.padded or not unit.attn_flops_per_token_per_ctx:
        return 0.0
    equal = dataclasses.replace(ctx, workload=dataclasses.replace(wl, padded=False))
    extra = prompt_attention_pairs(ctx, unit) - prompt_attention_pairs(equal, unit)
    flops_s, _ = _achieved(device, prefill_rows(ctx, unit))
    return wl.batch_size * unit.attn_flops_per_token_per_ctx * extra / flops_s


def prefill_roofline_s(ctx: PricingContext, unit: UnitInfo, device: Device) -> float:
    """The roofline of one forward of the unit over the prompt on ``device``: its kernels, no host time."""
    wl = ctx.workload
    tokens = wl.batch_size * wl.prompt_len
    rows = prefill_rows(ctx, unit)
    flops_s, bytes_s = _achieved(device, rows)
    base = _base_flops_per_token(unit, ctx.graph.meta.seq_len)
    flops = rows * base + wl.batch_size * unit.attn_flops_per_token_per_ctx * prompt_attention_pairs(ctx, unit)
    touched = (touched_weight_bytes(unit, rows) + 2 * rows * unit.out_bytes_per_token
               + tokens * unit.kv_bytes_per_token)
    return max(flops / flops_s, touched / bytes_s)


#: Attention that skips the blocks its causal mask or sliding window leaves out (a block mask, varlen sequences):
#: it computes ``sum_i min(i, window)`` pairs over a prompt, padded or not.
BLOCK_SKIPPING_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3", "flex_attention", "flash_paged"})


def prompt_attention_pairs(ctx: PricingContext, unit: UnitInfo) -> float:
    """Query x context pairs per sequence ``unit``'s self-attention computes over the prompt ``P``.

    The kernel decides it, not the mask's ones. sdpa given no mask (transformers passes its causal flag) skips
    the blocks above the diagonal: ``P (P + 1) / 2``. Given a mask (padded prompts; a sliding layer once the
    prompt reaches its window, where transformers builds one) it computes every pair, ``P^2``, as eager
    attention always does and a bidirectional encoder's (BART's, ModernBERT's) does by its nature.
    flash-attention and flex-attention skip what the window leaves out: ``sum_i min(i, window)``. A graph that
    does not record its attention (built by hand) is priced as sdpa.

    Measured on this project's 2-core CPU (a 4-layer hidden-512 Llama body, 1 x 2048 and 1 x 4096): one padded
    position made the forward 1.42x and 1.49x slower, a Mistral of the same shape with a 512-token window 1.41x
    and 1.45x; the attention call alone, 16 heads of 64 at 2048 and 4096, 1.8x and 2.1x.
    """
    prompt, meta = ctx.workload.prompt_len, ctx.graph.meta
    window = unit.kv_window_tokens
    implementation = meta.extra.get("attn_implementation")
    causal = unit.kv_bytes_per_token > 0 or (unit.in_decode and meta.extra.get("kv_cache", True))
    if not causal:
        return float(prompt * prompt)
    if implementation in BLOCK_SKIPPING_ATTENTION:
        if window is None or window >= prompt:
            return prompt * (prompt + 1) / 2
        return window * (window + 1) / 2 + (prompt - window) * window
    masked = ctx.workload.padded or (window is not None and window <= prompt)
    eager = implementation is not None and implementation not in SCORE_FREE_ATTENTION  # None: not recorded
    return float(prompt * prompt) if eager or masked else prompt * (prompt + 1) / 2


def prefill_rows(ctx: PricingContext, unit: UnitInfo) -> int:
    """Tokens the unit computes in the prefill: batch x prompt, but generate() asks the logits unit for the
    last position only (batch rows)."""
    wl = ctx.workload
    return wl.batch_size if _last_logits_only(ctx, unit) else wl.batch_size * wl.prompt_len


def _last_logits_only(ctx: PricingContext, unit: UnitInfo) -> bool:
    """Whether the prefill computes ``unit`` (the logits unit) at the last position of each sequence only."""
    return ctx.workload.logits_kept == "last" and unit.name == ctx.graph.meta.extra.get("logits_unit")


def measured_decode_line(ctx: PricingContext, unit: UnitInfo, device: Device) -> tuple[float, float] | None:
    """The unit's calibrated decode step on ``device`` at the first step's context, and its growth per step."""
    wl = ctx.workload
    measured = _calibrated(ctx, unit, device)
    return None if measured is None else measured.decode_line(wl.batch_size, unit.kv_tokens(wl.prompt_len + 1))


def decode_roofline_lines(ctx: PricingContext, unit: UnitInfo, device: Device) -> list[tuple[float, float]]:
    """:func:`_decode_lines` without the host's time: the FLOPs line and the bytes line of the kernels."""
    wl = ctx.workload
    ctx0 = unit.kv_tokens(wl.prompt_len + 1)  # a sliding layer past its window starts (and stays) there
    flops_s, bytes_s = _achieved(device, wl.batch_size)
    batch = wl.batch_size
    attn = unit.attn_flops_per_token_per_ctx
    base = _base_flops_per_token(unit, ctx.graph.meta.seq_len)
    grows = _expand_s_per_cached(unit, device, batch, ctx0)
    overhead = grows * ctx0
    flops = (batch * (base + attn * ctx0), batch * attn)
    # latent attention's expanded keys and values (on a CPU, the math path's copies too): written, then read
    expanded = (unit.latent_expand_bytes_per_ctx or 0) + (
        unit.latent_expand_cpu_bytes_per_ctx or 0 if device.kind == "cpu" else 0)
    kv = batch * (CACHE_PASSES_PER_STEP * unit.kv_bytes_per_token + 2 * expanded)
    touched = (touched_weight_bytes(unit, batch) + 2 * batch * unit.out_bytes_per_token + kv * ctx0, kv)
    return [(flops[0] / flops_s + overhead, flops[1] / flops_s + grows),
            (touched[0] / bytes_s + overhead, touched[1] / bytes_s + grows)]


def _expand_s_per_cached(unit: UnitInfo, device: Device, batch: int, ctx0: int) -> float:
    """Seconds per cached token latent attention takes at a decode step to expand its cache: a matmul of
    ``batch x context`` rows, which runs at that many rows' rate (taken at the first step's ``ctx0``), not a
    step's (one row per sequence), and beside the rest of the step, not hidden under its weight reads."""
    flops = unit.latent_expand_flops_per_ctx or 0
    if not flops:
        return 0.0
    rate, _ = _achieved(device, batch * ctx0)  # the later, longer steps run at least as fast
    return batch * flops / rate


def fresh_pages_s(ctx: PricingContext, unit: UnitInfo, device: Device) -> float:
    """Seconds a CPU's decode steps spend getting new pages for a unit's grown KV cache, beside its passes.

    Every step's ``torch.cat`` allocates the layer's keys and values anew, and from
    :data:`FRESH_PAGE_MIN_BYTES` on (per tensor) glibc maps them anew, so their pages fault in at the
    device's measured ``fresh_page_bytes_per_s``. Without that figure, or for a calibrated unit (whose
    measured step has it), nothing. Other allocations of the step that grow with the context (eager
    attention's repeated keys, latent attention's expansion) are not counted.
    """
    rate = device.fresh_page_bytes_per_s
    wl = ctx.workload
    if device.kind != "cpu" or not rate or not unit.kv_bytes_per_token or _calibrated(ctx, unit, device):
        return 0.0
    per_token = wl.batch_size * unit.kv_bytes_per_token / _CACHE_TENSORS
    floor = math.ceil(FRESH_PAGE_MIN_BYTES / per_token)
    cached = contexts_at_least(wl.prompt_len + 1, wl.decode_steps, unit.kv_window_tokens, floor)
    return _CACHE_TENSORS * per_token * cached / rate


def contexts_at_least(ctx0: int, steps: int, window: int | None, floor: int) -> int:
    """Sum over ``steps`` decode steps of the cached tokens ``c_t`` (``ctx0 + t``, at most ``window``) of the
    steps with ``c_t >= floor``, in closed form (``floor`` 0: every step's)."""
    growing = steps if window is None else max(0, min(steps, window - ctx0))
    low, high = max(ctx0, floor), ctx0 + growing - 1
    total = (low + high) * (high - low + 1) // 2 if high >= low else 0
    if window is not None and window >= floor:
        total += (steps - growing) * window
    return total


def kv_positions_read(unit: UnitInfo, ctx0: int, steps: int) -> int:
    """Cached positions per sequence the decode steps read in all: step t reads ``ctx0 + t``, a sliding layer
    at most its window."""
    return contexts_at_least(ctx0, steps, unit.kv_window_tokens, 0)


def growing_steps(unit: UnitInfo, workload: Workload) -> int | None:
    """Decode steps before a sliding layer's cache reaches its window, from which on every step reads the
    window (:func:`_decode_lines` start at the first step's context); None: the cache grows to the end."""
    if unit.kv_window_tokens is None:
        return None
    return unit.kv_window_tokens - unit.kv_tokens(workload.prompt_len + 1)


def sum_capped_lines(lines: Sequence[tuple[float, float]], steps: int, growing: int | None) -> float:
    """:func:`_sum_max_lines` where step ``t`` is priced at ``min(t, growing)`` (None: never capped)."""
    if growing is None or growing >= steps:
        return _sum_max_lines(lines, steps)
    flat = max(a + b * growing for a, b in lines)
    return _sum_max_lines(lines, growing) + (steps - growing) * flat


def _calibrated(ctx: PricingContext, unit: UnitInfo, device: Device) -> UnitTimes | None:
    """The unit's measured times on ``device`` (inference only), or None."""
    if ctx.calibration is None or ctx.workload.training:
        return None
    return ctx.calibration.times(unit.name, device.name)
