"""What :func:`~.calibrate.calibrate` times on one device: prefills, decode steps, and a GPU's weight copies.

Prefills run at prompts growing 4x from a short one (:data:`PROBE_TOKENS`) toward the workload's while the next
one should take at most :data:`PREFILL_BUDGET_S`; decode steps run with a real KV cache near the first context
and, after the cache is filled up (grown by repeating what it holds where it can be), near the last. Each decode
context is run twice and timed the second time (:func:`_steps`). With a GPU, each unit's weights are copied from
CPU RAM both ways they are streamed.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._calibrate_clock import MIN_TIMED_S, logits_argument, repeated, typical
from ._decode_attention import cudnn_attention_off
from .timing import cache_argument, cache_of

if TYPE_CHECKING:  # pragma: no cover
    from ..cost.workload import Workload
    from ._stamps import Stamps

__all__ = ["time_forwards", "time_copies", "DECODE_STEPS", "MIN_DECODE_STEPS", "DECODE_BUDGET_S", "MAX_DECODE_STEPS",
           "PREFILL_BUDGET_S", "PROBE_TOKENS", "SMALL_PROMPT_FRACTION", "FIRST_VISIT_RATIO", "FIRST_VISIT_MIN_S"]

#: Decode steps timed at each context at least (the median counts, per unit) ...
DECODE_STEPS = 8
#: ... unless they add up to :data:`DECODE_BUDGET_S` first (a large model's steps vary little beside their
#: length), and then at least this many ...
MIN_DECODE_STEPS = 3
DECODE_BUDGET_S = 0.5
#: ... and at most, while they add up to under half :data:`MIN_TIMED_S`.
MAX_DECODE_STEPS = 32
#: The next, 4x longer prefill is timed when it should take at most this (estimated from the last one).
PREFILL_BUDGET_S = 2.0
#: The shortest prefill timed: the workload's prompt divided by 4 until one more division would go below this.
PROBE_TOKENS = 8
#: Prefill prompts grow by this factor from one timed length to the next.
SMALL_PROMPT_FRACTION = 4


def time_forwards(model: nn.Module, stamps: Stamps, workload: Workload, repeats: int, device: torch.device
                  ) -> tuple[dict[tuple[int, int], dict[str, float]], dict[tuple[int, int], dict[str, float]]]:
    """Per-unit seconds of prefills ``(batch, prompt)`` and of decode steps ``(batch, context)``.

    Prompts grow 4x from :func:`_first_length` to the workload's while the next one should take at
    most :data:`PREFILL_BUDGET_S` (estimated from the last, in proportion); when only one fits, a 4x
    shorter one is timed too, so that pricing has a line to extend (a prefill is linear in tokens but
    for attention's small quadratic part). The decode steps run on the longest prompt's KV cache
    grown to the workload's prompt.
    """
    batch, prompt = workload.batch_size, workload.prompt_len
    vocab = int(getattr(model.config, "vocab_size", 32000) or 32000)
    keep = logits_argument(model, workload.logits_kept)
    prefill: dict[tuple[int, int], dict[str, float]] = {}

    def timed(length: int) -> Any:
        ids = torch.randint(0, vocab, (batch, length), device=device)
        runs, out = repeated(lambda: model(input_ids=ids, use_cache=True, **keep), stamps, repeats)
        prefill[batch, length] = typical(runs)
        return cache_of(out)

    length = _first_length(prompt)
    cache = timed(length)
    while length < prompt:
        longer = min(prompt, length * SMALL_PROMPT_FRACTION)
        if sum(prefill[batch, length].values()) * longer / length > PREFILL_BUDGET_S:
            if len(prefill) == 1 and length > 1:
                timed(max(1, length // SMALL_PROMPT_FRACTION))
            break
        cache, length = timed(longer), longer
    if _cached_length(cache) < prompt and not _grown(cache, prompt):  # untimed: a cache of the prompt's length
        ids = torch.randint(0, vocab, (batch, prompt), device=device)
        cache = cache_of(model(input_ids=ids, use_cache=True, **logits_argument(model, "last")))
    with cudnn_attention_off():  # as dispatched models run their decode steps (:mod:`._decode_attention`)
        return prefill, _time_decode(model, stamps, cache, workload, vocab, device)


def _first_length(prompt: int) -> int:
    """The shortest prefill timed: the prompt divided by 4, and again while that stays >= :data:`PROBE_TOKENS`."""
    length = max(1, prompt // SMALL_PROMPT_FRACTION)
    while length // SMALL_PROMPT_FRACTION >= PROBE_TOKENS:
        length //= SMALL_PROMPT_FRACTION
    return length


def _cached_length(cache: Any) -> int:
    length = getattr(cache, "get_seq_length", None)
    return int(length()) if callable(length) else 0


def _grown(cache: Any, length: int) -> bool:
    """Grow a plain dynamic KV cache to ``length`` tokens by repeating what it holds (the values do
    not change a step's time); False for other cache kinds (sliding windows, quantized, ...)."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" or not getattr(layer, "is_initialized", False)
                         or getattr(layer, "keys", None) is None or layer.keys.numel() == 0 for layer in layers):
        return False
    for layer in layers:
        have = layer.keys.shape[-2]
        if have < length:
            copies = -(-length // have)
            layer.keys = torch.cat([layer.keys] * copies, dim=-2)[:, :, :length]
            layer.values = torch.cat([layer.values] * copies, dim=-2)[:, :, :length]
    return True


def _time_decode(model: nn.Module, stamps: Stamps, cache: Any, workload: Workload, vocab: int,
                 device: torch.device) -> dict[tuple[int, int], dict[str, float]]:
    """Decode steps at the first context and, after the cache is filled up, at the last."""
    batch, prompt = workload.batch_size, workload.prompt_len
    decode: dict[tuple[int, int], dict[str, float]] = {}
    if workload.new_tokens == 0 or cache is None:
        return decode
    most = min(MAX_DECODE_STEPS, workload.new_tokens)
    seconds, steps = _steps(model, stamps, cache, batch, most, vocab, device)
    decode[batch, prompt + 1 + (steps - 1) // 2] = seconds  # the middle context of the steps timed
    last = prompt + workload.new_tokens
    if last - (prompt + steps + 1) > most:  # fill the cache up to the last context in one forward, untimed
        filled = prompt + steps + 1
        if not _grown(cache, last - most):
            ids = torch.randint(0, vocab, (batch, last - filled - most), device=device)
            cache = cache_of(model(input_ids=ids, use_cache=True, **cache_argument(model, cache),
                                   **logits_argument(model, "last")))
        seconds, steps = _steps(model, stamps, cache, batch, most, vocab, device)
        decode[batch, last - most + (steps - 1) // 2] = seconds
    return decode


def _steps(model: nn.Module, stamps: Stamps, cache: Any, batch: int, most: int, vocab: int,
           device: torch.device) -> tuple[dict[str, float], int]:
    """The typical per-unit seconds of decode steps and how many were timed (at least
    :data:`DECODE_STEPS`, or :data:`MIN_DECODE_STEPS` once they add up to :data:`DECODE_BUDGET_S`; more
    while they add up to under half :data:`MIN_TIMED_S`, at most ``most``).

    Each context is timed on its second visit: the steps run once, then again from a copy of the cache taken before
    them (a cache that cannot be copied keeps the first visit's figures). A step at a context length the
    process has not run before may pay a one-time set-up of its shapes, which a plan pays once per length, not
    once per step and unit: under torch 2.11 on an H200, SDPA's cuDNN attention (the default on Hopper) took
    about 68 ms per first-visited decode step of a Llama-3.1-8B layer at batch 16, where a whole 16 x 512 prefill
    of it took 6.4 ms; block plans priced with such figures computed every layer on the CPU (benchmarks/phases/GPU.md).
    Decode steps now run with cuDNN's attention off, here as in dispatched models (:mod:`._decode_attention`), which
    removed that set-up in a probe; the second visit stays for any other set-up per shape.
    """
    kept = _copy_of(cache)  # the caller's cache goes on growing in the first visits
    first, _ = _first_visits(model, stamps, cache, batch, most, vocab, device)
    if not first or kept is None:
        return typical(first, stamps.routed), len(first)
    again: list[dict[str, float]] = []
    for step in range(len(first) + 1):  # the same contexts: the untimed first one, then those timed before
        seconds, kept = _step(model, stamps, kept, batch, vocab, device)
        if step > 0:
            again.append(seconds)
    _warn_of_first_visits(first, again, device)
    return typical(again, stamps.routed), len(again)


def _copy_of(cache: Any) -> Any:
    """A copy of ``cache`` (any kind: sliding windows, static) to run the same steps again from; None for one that
    cannot be copied."""
    try:
        return copy.deepcopy(cache)
    except (TypeError, RuntimeError, copy.Error):
        return None


def _first_visits(model: nn.Module, stamps: Stamps, cache: Any, batch: int, most: int, vocab: int,
                  device: torch.device) -> tuple[list[dict[str, float]], Any]:
    """Decode steps from ``cache``, as many as :func:`_steps` says; the per-unit seconds of each but the first
    (it warms up the decode shapes, untimed), and the cache they leave."""
    runs: list[dict[str, float]] = []
    spent = 0.0
    step = 0
    while (step <= min(DECODE_STEPS, most) and not (spent >= DECODE_BUDGET_S and len(runs) >= MIN_DECODE_STEPS)
           or (spent < MIN_TIMED_S / 2 and step <= most)):
        start = time.perf_counter()
        seconds, cache = _step(model, stamps, cache, batch, vocab, device)
        if step > 0:
            runs.append(seconds)
            spent += time.perf_counter() - start
        step += 1
    return runs, cache


def _step(model: nn.Module, stamps: Stamps, cache: Any, batch: int, vocab: int,
          device: torch.device) -> tuple[dict[str, float], Any]:
    ids = torch.randint(0, vocab, (batch, 1), device=device)
    seconds, out = stamps.run(lambda: model(input_ids=ids, use_cache=True, **cache_argument(model, cache)))
    return seconds, cache_of(out)


#: First visits of decode contexts this much slower than second visits (and by :data:`FIRST_VISIT_MIN_S` or more
#: per step) are said: a cost the first generate() of a process pays, which the figures leave out.
FIRST_VISIT_RATIO = 2.0
FIRST_VISIT_MIN_S = 0.005


def _warn_of_first_visits(first: list[dict[str, float]], again: list[dict[str, float]], device: torch.device) -> None:
    once = statistics.median(sum(run.values()) for run in first)
    steady = statistics.median(sum(run.values()) for run in again)
    if once > FIRST_VISIT_RATIO * steady and once - steady >= FIRST_VISIT_MIN_S:
        warnings.warn(
            f"calibrate(): on {device}, a decode step took {once * 1e3:.1f} ms at a context length this process had "
            f"not run before and {steady * 1e3:.1f} ms at one it had: a set-up per new shape. Plans are priced at the second figure; a process's first "
            f"generate() pays the difference once per new length (cuDNN's attention, off in these steps and in "
            f"dispatched models' decode steps, is not the cause)", UserWarning, stacklevel=2)


def time_copies(modules: Mapping[str, nn.Module], representatives: Mapping[str, str],
                device: torch.device) -> dict[str, dict[str, dict[str, float]]]:  # pragma: no cover - needs a GPU
    """Seconds to bring each unit's weights from CPU RAM: pinned prefetch (``stream``), per tensor (``stream_sync``)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    side = torch.cuda.Stream(device)
    for name, module in modules.items():
        tensors = [t.detach() for t in (*module.parameters(), *module.buffers())]
        if not tensors:
            continue
        pageable = [t.to("cpu") for t in tensors]
        pinned = [t.pin_memory() for t in pageable]

        def prefetch(pinned: list[torch.Tensor] = pinned) -> None:
            with torch.cuda.stream(side):  # what the Streamer does: a side stream from pinned memory
                [t.to(device, non_blocking=True) for t in pinned]
            side.synchronize()

        def per_tensor(pageable: list[torch.Tensor] = pageable) -> None:
            for t in pageable:  # what accelerate's hooks do: one synchronous pageable copy per tensor
                t.to(device)
            torch.cuda.synchronize(device)

        out[representatives[name]] = {f"cpu->{device}": {"stream": _best(prefetch), "stream_sync": _best(per_tensor)}}
    return out


def _best(call: Callable[[], None], repeats: int = 3) -> float:  # pragma: no cover - needs a GPU
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)
