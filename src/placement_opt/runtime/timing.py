"""A dispatched model's own prefill and decode steps, timed: what ``placement-opt run`` sets beside the plan's
prediction.

:func:`time_generation` runs greedy generation by hand (one prefill with the cache on, then one forward per new
token), so each decode step is timed on its own: the difference of two ``generate()`` calls would be mostly the
prompt's noise. CUDA devices are synchronised around every timed call; the first decode step, which allocates
the cache's growth and warms kernels, is kept but the median rules.

Example::

    timing = time_generation(handle, input_ids, new_tokens=32)
    print(timing.prefill_s, timing.decode_tokens_per_s)
"""

from __future__ import annotations

import gc
import inspect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._rss import peak_bytes, reset_peak
from .allocator import trim_heap

__all__ = ["Timing", "time_generation", "next_step_inputs", "cache_argument", "cache_of", "last_logits_argument"]


@dataclass(frozen=True)
class Timing:
    """Measured seconds of one greedy generation."""

    batch_size: int
    prefill_s: float
    """The prompt's forward (cache on, logits of the last position only): the median of :attr:`prefill_runs_s`."""
    decode_step_s: tuple[float, ...]
    """Each decode step's forward, in order."""
    tokens: tuple[tuple[int, ...], ...]
    """Per sequence of the batch: the greedy tokens after the prompt (the prefill's first)."""
    peak_gpu_bytes: dict[str, int]
    """``torch.cuda.max_memory_allocated`` of every CUDA device over the generation (empty without CUDA)."""
    prefill_runs_s: tuple[float, ...] = ()
    """Each timed prefill, in order (one unless ``prefill_repeats`` asked for more)."""
    peak_cpu_growth_bytes: int | None = None
    """The process's peak resident set over the warm-up and the generation, less the resident set just before:
    what the forwards added to RAM at their peak (activations, KV cache, buffers, pages of memory-mapped disk
    weights), the figure the plan's CPU KV cache, workspace and stream buffer predict. None where ``/proc`` does
    not give it (not Linux)."""
    prefill_peak_gpu_bytes: dict[str, int] = field(default_factory=dict)
    """Of :attr:`peak_gpu_bytes`, the prefills' part: each CUDA device's peak up to the end of the prefills; the
    decode steps' is :attr:`decode_peak_gpu_bytes` (which phase a plan's memory misses in, when it does)."""
    decode_peak_gpu_bytes: dict[str, int] = field(default_factory=dict)
    """Each CUDA device's peak over the decode steps alone (from what the prefill left allocated)."""

    @property
    def decode_step_median_s(self) -> float:
        return statistics.median(self.decode_step_s) if self.decode_step_s else 0.0

    @property
    def decode_step_mean_s(self) -> float:
        """The mean step: unlike the median, it carries what some steps pay once (a GPU's set-up per new context
        length, when a process meets it first)."""
        return statistics.fmean(self.decode_step_s) if self.decode_step_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second while decoding, all sequences of the batch: batch / the median step."""
        step = self.decode_step_median_s
        return self.batch_size / step if step > 0 else 0.0


def time_generation(model: Any, input_ids: torch.Tensor, new_tokens: int, *, warmup: bool = True,
                    before_each: Callable[[], None] | None = None, prefill_repeats: int = 1,
                    attention_mask: torch.Tensor | None = None) -> Timing:
    """Greedy generation of ``new_tokens`` tokens after ``input_ids`` (batch x prompt) by ``model`` (a causal
    LM, dispatched or not), every forward timed. ``warmup``: one untimed forward of the prompt first (the first
    call's one-off costs, kernel selection and allocator growth, would otherwise land in the prefill). The peak
    GPU memory counts from after the warm-up. The CPU's (resident set) counts from before it, since RAM the
    warm-up took and freed stays with the process and serves the timed forwards; and from after a short
    forward (:data:`LIBRARY_WARMUP_TOKENS`: the libraries' one-off state) and the heap's free pages going back
    to the system (:func:`~.allocator.trim_heap`), so that RAM earlier work freed does not hide the growth.
    ``before_each`` runs before every timed forward, untimed (e.g. ``handle.drop_disk_cache`` for cold disk
    reads).
    ``prefill_repeats``: the prompt is timed that many times, each on a new cache, and the median is the prefill
    (one forward is one sample: on a busy machine the same run's prefill ratios moved 0.7-22x); decode steps are
    many already, their median rules.
    ``attention_mask``: the prompt's (0 where a sequence is padded), extended by a column of ones per decode
    step, as ``generate()`` does; the model builds the masks padded prompts take (``Workload.padded``)."""
    _check_arguments(input_ids, new_tokens, prefill_repeats, attention_mask)
    gpus = range(torch.cuda.device_count()) if torch.cuda.is_available() else range(0)
    steps: list[float] = []
    positioned = attention_mask is not None and "position_ids" in inspect.signature(model.forward).parameters
    with torch.inference_mode():
        last = last_logits_argument(model)
        if warmup:  # the libraries' one-off state (oneDNN's kernels, thread pools: ~11 MiB) is not the plan's
            model(input_ids=_library_warmup(model, input_ids), use_cache=False, **last)
        gc.collect()  # what earlier work left unreachable goes before the resident set is read ...
        trim_heap()  # ... and the heap's free pages (a load's, a calibration's): the growth is the run's own
        rss_before = reset_peak()
        if warmup:
            _timed(gpus, model, input_ids=input_ids, use_cache=False, **last, **_masked(attention_mask, positioned))
        for index in gpus:
            torch.cuda.reset_peak_memory_stats(index)
        out, prefills = _prefills(gpus, model, input_ids, prefill_repeats, before_each, last,
                                  attention_mask, positioned)
        cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
        prefill_peaks = _peaks(gpus, reset=True)
        tokens = [token[:, 0].tolist()]
        for _ in range(new_tokens - 1):
            if before_each is not None:
                before_each()
            inputs, attention_mask = next_step_inputs(model, token, cache, attention_mask, positioned)
            out, took = _timed(gpus, model, **inputs)
            steps.append(took)
            cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
            tokens.append(token[:, 0].tolist())
    by_sequence = tuple(tuple(step[b] for step in tokens) for b in range(input_ids.shape[0]))
    decode_peaks = _peaks(gpus)
    peaks = {name: max(prefill_peaks[name], decode_peaks[name]) for name in prefill_peaks}
    rss_peak = peak_bytes() if rss_before is not None else None
    return Timing(batch_size=input_ids.shape[0], prefill_s=statistics.median(prefills), decode_step_s=tuple(steps),
                  tokens=by_sequence, peak_gpu_bytes=peaks, prefill_runs_s=tuple(prefills),
                  peak_cpu_growth_bytes=None if rss_peak is None else max(0, rss_peak - rss_before),
                  prefill_peak_gpu_bytes=prefill_peaks, decode_peak_gpu_bytes=decode_peaks)


def next_step_inputs(model: Any, token: torch.Tensor, cache: Any, attention_mask: torch.Tensor | None,
                     positioned: bool) -> tuple[dict[str, Any], torch.Tensor | None]:
    """(the keyword arguments of the greedy decode step that feeds ``token`` with ``cache``, the mask it takes):
    the mask grows by a column of ones per step, as ``generate()`` grows it, with the newest token's position where
    the model takes positions (``positioned``)."""
    if attention_mask is not None:
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], 1)
    inputs = {"input_ids": token, "use_cache": True, **cache_argument(model, cache),
              **_masked(attention_mask, positioned, last_only=True)}
    return inputs, attention_mask


def _peaks(gpus: range, reset: bool = False) -> dict[str, int]:
    """``max_memory_allocated`` of each CUDA device since its last reset; ``reset``: start the next count from
    what is allocated now."""
    peaks = {f"cuda:{i}": torch.cuda.max_memory_allocated(i) for i in gpus}
    if reset:
        for index in gpus:
            torch.cuda.reset_peak_memory_stats(index)
    return peaks


def _check_arguments(input_ids: torch.Tensor, new_tokens: int, prefill_repeats: int,
                     attention_mask: torch.Tensor | None) -> None:
    """None, or :func:`time_generation`'s ValueError: a mask not of the prompt's shape, or a prompt, token count
    or repeat count it cannot time, refused before any forward runs."""
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}: it must be the prompt's, "
                         f"{tuple(input_ids.shape)}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0 or new_tokens < 1 or prefill_repeats < 1:
        raise ValueError(f"input_ids must be batch x prompt tokens (got shape {tuple(input_ids.shape)}), "
                         f"new_tokens >= 1 (got {new_tokens}) and prefill_repeats >= 1 (got {prefill_repeats})")


def _prefills(gpus: range, model: Any, input_ids: torch.Tensor, repeats: int,
              before_each: Callable[[], None] | None, last: dict[str, int],
              attention_mask: torch.Tensor | None, positioned: bool) -> tuple[Any, list[float]]:
    """``(the last prefill's output, each prefill's seconds)``: the prompt timed ``repeats`` times, each on a new
    cache, for :func:`time_generation`, whose decode starts from that last output's cache and logits."""
    prefills = []
    for _ in range(repeats):
        out = None  # the last run's cache goes before the next is built
        if before_each is not None:
            before_each()
        out, took = _timed(gpus, model, input_ids=input_ids, use_cache=True, **last,
                           **_masked(attention_mask, positioned))
        prefills.append(took)
    return out, prefills


#: Tokens of the forward that sets up the libraries' state before the CPU's memory is measured: with one token,
#: about 0.4 MiB of the scratch of a first forward of many tokens was left in the figure.
LIBRARY_WARMUP_TOKENS = 8


def _masked(attention_mask: torch.Tensor | None, positioned: bool, last_only: bool = False) -> dict[str, torch.Tensor]:
    """The mask, and where the model takes them (``positioned``) the positions ``generate()`` derives from it:
    each sequence's tokens counted from its first unpadded one (``last_only``: the newest token's)."""
    if attention_mask is None:
        return {}
    if not positioned:
        return {"attention_mask": attention_mask}
    if last_only:  # the newest token's position: the sequence's unpadded tokens before it
        return {"attention_mask": attention_mask, "position_ids": attention_mask.long().sum(-1, keepdim=True) - 1}
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return {"attention_mask": attention_mask, "position_ids": positions}


def _library_warmup(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """The first sequence's first tokens, within a dispatched model's plan (a call past the workload it was
    solved for draws a warning, once, which the run's own calls should be the ones to draw)."""
    tokens = min(LIBRARY_WARMUP_TOKENS, input_ids.shape[1])
    workload = getattr(getattr(model, "plan", None), "workload", None)
    if workload is not None:
        tokens = max(1, min(tokens, workload.batch_size * workload.prompt_len))
    return input_ids[:1, :tokens]


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """``cache`` as the keyword ``model.forward`` takes it by: ``cache`` from transformers 5.24, ``past_key_values``
    before (5.24 still takes the old name with a FutureWarning, until 5.40)."""
    takes = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {takes: cache}


def last_logits_argument(model: Any) -> dict[str, int]:
    """``logits_to_keep=1`` where the model takes it: generation keeps the prompt's last position only."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def cache_of(out: Any) -> Any:
    """The KV cache a forward returned: ``out.cache`` from transformers 5.24, ``out.past_key_values`` before."""
    return out["cache"] if "cache" in out else out.past_key_values


def _timed(gpus: range, model: Any, **inputs: Any) -> tuple[Any, float]:
    """``model(**inputs)`` and its seconds, every CUDA device synchronised before and after."""
    for index in gpus:
        torch.cuda.synchronize(index)
    started = time.perf_counter()
    out = model(**inputs)
    for index in gpus:
        torch.cuda.synchronize(index)
    return out, time.perf_counter() - started
