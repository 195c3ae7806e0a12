"""What a decode step holds per cached token: meta decode steps after meta prompts, counted as the trace counts.

A prefill trace cannot tell tensors that scale with the queries from tensors that scale with the keys: its
queries are its keys. A decode step has one query per sequence and the whole cache as keys, and what it holds
per cached token is often more than the cache: eager attention repeats grouped keys and values to every head
(``repeat_kv``: 2x the layer's cache on Llama-3), latent attention expands its latents (70x on DeepSeek-V3), the
cache grows by concatenation (the old and the new tensor of one layer at once). So the step is run: a meta
prompt of ``c`` tokens builds a cache, then one meta step, with :class:`~._memory.LiveBytes` fed every op and
the cache's own tensors counted as alive before it (their release is seen when the step replaces them). Each
unit's most bytes alive above that cache, at three contexts, give a line per sequence: bytes at no context and
bytes per cached token (:func:`decode_lines`). The most alive is the larger of a few moments, each linear in
the context (the MLP's, the attention's), so it is convex in the context: the line takes the slope of the two
longest contexts and the lowest intercept that keeps it above all three, which keeps it above the step at every
context from the shortest on, as long as the moment that is largest at the longest two stays so beyond them.

Identical blocks (decoder layers of one class, attributes and shapes) hold the same: only the first two of each
kind run (:data:`RUN_EACH`), the others hand their input on (their cache stays empty) and take the second's
figures, so a 126-layer model costs a few layers' forwards.

Scaled-dot-product attention is counted as fused, as in the prefill trace (:class:`~._memory.FusedAttention`).
A model whose cached forward cannot run on meta (no cache, custom inputs, an encoder-decoder) gets no lines,
and the cost model keeps its estimate from the prefill trace.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ._memory import FusedAttention, LiveBytes
from ._meta_experts import stand_in_experts
from ._recorder import guessed_scalar
from ._replay import static_signature

__all__ = ["probe_contexts", "decode_lines", "fit_line"]


def probe_contexts(window: int | None) -> tuple[int, int, int]:
    """Cached tokens per sequence before the three probed steps (meta: the length costs nothing): up to 1024, and
    inside the smallest sliding window (``window``), past which a sliding layer's step stops growing."""
    top = min(1024, window - 1) if window else 1024
    top = max(top, 6)
    return (2, top // 2, top)


def decode_lines(module: nn.Module, units: dict[str, nn.Module], *, state: dict[str, torch.Tensor] | None,
                 experts_per_token: Callable[[nn.Module], int], blocks: dict[str, nn.Module] | None = None,
                 contexts: tuple[int, int, int] = probe_contexts(None)) -> dict[str, tuple[int, int]]:
    """Unit -> (bytes, bytes per cached token) a decode step holds while the unit runs, per sequence, above the
    cache; only units that ran. ``state``: meta stand-ins of the module's tensors (None: it is on meta itself);
    ``blocks``: the no-split blocks (decoder layers), of which identical ones run once; ``contexts``: of the
    three probed steps, increasing.

    Raises:
        Exception: whatever the model's forward raises on meta (the caller goes without lines).
    """
    restore = stand_in_experts(module, experts_per_token)
    skip = _Skipped(blocks or {})
    was_training = module.training
    try:
        module.eval()
        peaks = _steps(module, units, state, contexts)
    finally:
        module.train(was_training)
        skip.restore()
        restore()
    lines = {n: fit_line(contexts, [p[n] for p in peaks]) for n in set.intersection(*(set(p) for p in peaks))}
    for name in units:  # a skipped block's units ran nothing: they take those of one that ran
        source = skip.source_of(name)
        if source is not None:
            lines.pop(name, None)
            if source in lines:
                lines[name] = lines[source]
    return lines


def fit_line(contexts: tuple[int, int, int], held: list[int]) -> tuple[int, int]:
    """(bytes, bytes per cached token): the slope of the two longest contexts (rounded up), and the lowest intercept
    that keeps the line at or above what was ``held`` at all three."""
    per_token = max(0, -(-(held[2] - held[1]) // (contexts[2] - contexts[1])))
    return max(0, *(b - per_token * c for b, c in zip(held, contexts, strict=True))), per_token


def _steps(module: nn.Module, units: dict[str, nn.Module], state: dict[str, torch.Tensor] | None,
           contexts: tuple[int, ...]) -> list[dict[str, int]]:
    """:func:`_step_peaks` at each of ``contexts``: one meta prompt of the longest, its cache cut back to the shorter
    ones (a fresh prompt for a cache that cannot be cut: a sliding layer's)."""
    by_context: dict[int, dict[str, int]] = {}
    cache = None
    for context in sorted(contexts, reverse=True):
        if cache is not None:
            try:
                cache = _cut(cache, context)
            except Exception:  # noqa: BLE001 - a cache that cannot be cut: a prompt of its own
                cache = None
        if cache is None:
            with torch.no_grad(), _Guessing():
                cache = _forward(module, state, torch.zeros((1, context), dtype=torch.long, device="meta"), None)
            if cache is None:  # a model without a transformers cache (a recurrent state of its own): no lines
                return [{} for _ in contexts]
        by_context[context] = _step_peaks(module, units, state, cache)
    return [by_context[c] for c in contexts]


def _cut(cache: Any, context: int) -> Any:
    """``cache`` cut back to ``context`` tokens, each tensor a copy of its own (a view would keep the longer storage
    alive and its release would count the longer size)."""
    cache.crop(context - cache.get_seq_length())
    for layer in getattr(cache, "layers", ()):
        for key, value in list(vars(layer).items()):
            if isinstance(value, torch.Tensor):
                setattr(layer, key, value.clone())
    if cache.get_seq_length() != context:
        raise ValueError(f"the cache holds {cache.get_seq_length()} tokens, not {context}")
    return cache


def _step_peaks(module: nn.Module, units: dict[str, nn.Module], state: dict[str, torch.Tensor] | None,
                cache: Any) -> dict[str, int]:
    """Each unit's most bytes alive above ``cache`` in a one-token meta step that extends it.

    Each layer's cache grows by the step's token as the layer runs, so a later layer would start with more alive
    than an earlier one (one token of every earlier layer's cache, which the cost model counts in the cache): a
    unit's figure is what it adds above its own start, plus what was alive when the first unit started (the
    residual stream, the mask, the rotary tables), the same for identical layers."""
    with torch.no_grad():
        memory = LiveBytes(seq_len=0)  # no tensor is taken for scores: every byte is one of the line's
        memory.hold(_cache_tensors(cache))  # no reference kept: a tensor the step replaces is freed, and seen so
        baseline = memory.linear_bytes
        step = _Step(memory)
        handles = [m.register_forward_pre_hook(step.entering(n)) for n, m in units.items()]
        handles += [m.register_forward_hook(step.leaving) for m in units.values()]
        try:
            with FusedAttention(memory, step.running), step:
                _forward(module, state, torch.zeros((1, 1), dtype=torch.long, device="meta"), cache)
        finally:
            for handle in handles:
                handle.remove()
    if step.first is None:
        return {}
    start = memory.peaks[step.first].entry[0] - baseline
    return {name: peak.linear_peak[0] - peak.entry[0] + start for name, peak in memory.peaks.items() if name in units}


def _forward(module: nn.Module, state: dict[str, torch.Tensor] | None, ids: torch.Tensor, cache: Any) -> Any:
    kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True}
    if cache is not None:  # transformers names it ``cache`` from 5.24 on, ``past_key_values`` before
        kwargs["cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"] = cache
    if state is None:
        out = module(**kwargs)
    else:
        out = torch.func.functional_call(module, state, (), kwargs, tie_weights=False, strict=False)
    return next((c for k in ("cache", "past_key_values") if (c := getattr(out, k, None)) is not None), None)


def _cache_tensors(cache: Any) -> Iterator[torch.Tensor]:
    """The tensors a transformers cache holds (each layer's keys, values and any other state)."""
    for layer in getattr(cache, "layers", ()):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                yield value


#: Blocks of each kind that run in the probe. Not one: the first decoder layer's units can hold less than the
#: later ones' (at module granularity Mixtral-8x7B's first attention output projection 49 KB per sequence, the
#: others 259-267 KB; a decoder layer whole, the same), and the later ones are the many.
RUN_EACH = 2


def _handed_on(hidden: Any, out: Any) -> int | None:
    """How a block's output ``out`` hands on a tensor shaped as its input ``hidden``: -1 as itself (transformers 5's
    decoder layers), k >= 0 as the first item of a tuple whose k others are None (Falcon's ``(hidden, None)``, its
    attention weights not asked for); None otherwise (the block's other outputs are its own: it must run)."""
    if not isinstance(hidden, torch.Tensor):
        return None
    if isinstance(out, torch.Tensor):
        return -1 if out.shape == hidden.shape else None
    if (type(out) is tuple and out and isinstance(out[0], torch.Tensor) and out[0].shape == hidden.shape
            and all(item is None for item in out[1:])):
        return len(out) - 1
    return None


class _Skipped:
    """Blocks identical to ones before them, patched to hand their input on: the first :data:`RUN_EACH` of each
    kind run, and the others take the figures of the last of those."""

    def __init__(self, blocks: dict[str, nn.Module]) -> None:
        self.source: dict[str, str] = {}  # a skipped block -> the block of its kind whose figures it takes
        self.kind: dict[str, Any] = {}
        self.patched: list[nn.Module] = []
        # kind -> how its blocks that ran handed their input on (:func:`_handed_on`); absent: they did not
        self.passes: dict[Any, int] = {}
        ran: dict[Any, list[str]] = {}
        for name, block in blocks.items():
            if "forward" in block.__dict__:  # a stand-in's or another patch's: leave it alone
                continue
            key = self.kind[name] = static_signature(block)
            runs = ran.setdefault(key, [])
            if len(runs) < RUN_EACH:
                runs.append(name)
            else:
                self.source[name] = runs[-1]
            self._patch(block, key, runs=name in runs)

    def _patch(self, block: nn.Module, key: Any, runs: bool) -> None:
        original = block.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not runs and (nones := self.passes.get(key)) is not None:
                return hidden if nones < 0 else (hidden, *(None,) * nones)  # shaped as those that ran returned
            out = original(*args, **kwargs)
            if runs and (nones := _handed_on(hidden, out)) is not None:
                self.passes[key] = nones
            return out

        block.forward = forward
        self.patched.append(block)

    def source_of(self, unit: str) -> str | None:
        """The unit of the identical block that ran whose figures ``unit`` (inside a skipped block) takes; None for
        a unit outside every skipped block (a block whose kind did not pass its input on ran)."""
        for block, source in self.source.items():
            if (unit == block or unit.startswith(block + ".")) and self.kind[block] in self.passes:
                return source + unit[len(block):]
        return None

    def restore(self) -> None:
        for block in self.patched:
            del block.forward


class _Guessing(TorchDispatchMode):
    """Answers the data-dependent reads meta tensors cannot (a mask's ``.all()``) with the dense, unpadded case, as
    the prefill trace does."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return guessed_scalar(args[0])
        return func(*args, **(kwargs or {}))


class _Step(_Guessing):
    """Feeds every op of the step to ``memory`` under the unit running it (None between units)."""

    def __init__(self, memory: LiveBytes) -> None:
        super().__init__()
        self.memory = memory
        self.unit: str | None = None
        self.first: str | None = None

    def running(self) -> str | None:
        return self.unit

    def entering(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            self.unit = name
            self.first = self.first or name
            self.memory.enter(name)
        return hook

    def leaving(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        self.unit = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.memory.record(self.unit, func, inputs, [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
        return out
