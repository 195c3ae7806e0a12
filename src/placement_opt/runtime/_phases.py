"""Phased units: which phase a call is in, and the prompt's KV cache moved to where the decode runs.

A ``phased`` unit computes the prefill on a GPU from weights streamed there and the decode on the
CPU where the weights are stored (:mod:`._hooks` runs it). The phase is read from each call:

* a unit with attention (its modules carry transformers' ``layer_idx``) is in a prefill when the
  call has more than one token per sequence and the KV cache holds no tokens yet for its layers;
* a unit without attention (an MLP, ``lm_head``) when its input has more than one token per
  sequence; when the input does not say (tokens flattened across sequences, as an experts module
  gets them) the phase of the model's call is taken.

Anything else runs where the unit decodes: decode steps, a 1-token prompt, and a multi-token call
on a cache already filled (chunked prefill, speculative verification), whose cache is there.
Right after a unit's prefill its layers' cache tensors move to the decode device, so the GPU holds
one unit's prompt KV at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import DispatchError
from ..hardware.host_copy import to_host

__all__ = ["CallPhase", "attention_layers", "call_extent", "past_plan", "workload_past_plan", "call_tokens", "call_is_prefill", "call_starts_sequence", "unit_is_prefill", "move_cache_layers"]

# The names transformers gives the KV cache argument (5.24 on: cache; 5.x before: past_key_values; older
# layers: the others).
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
# The names of the argument that says how many tokens a call has, most telling first.
_TOKEN_ARGUMENTS = ("hidden_states", "input_ids", "inputs_embeds", "decoder_input_ids", "decoder_inputs_embeds")


class CallPhase:
    """Whether the model's current call is a prefill, as last seen: streamed units read it to pick
    which unit to prefetch (phased units stream in the prefill only)."""

    __slots__ = ("prefill",)

    def __init__(self) -> None:
        self.prefill = False


def attention_layers(module: nn.Module) -> tuple[int, ...]:
    """The KV cache layers a unit's attention modules write: their ``layer_idx``, in order.

    Only attention modules count: other modules may carry a ``layer_idx`` too (routers, MLPs of some
    families), and reading the cache for them would see the tokens their own layer's attention
    wrote before them in the same call.
    """
    found = []
    for sub in module.modules():
        idx = getattr(sub, "layer_idx", None)
        if isinstance(idx, int) and "attention" in type(sub).__name__.lower() and idx not in found:
            found.append(idx)
    return tuple(found)


def _main_input(args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The call's main input: the first of the token arguments it has, else its first tensor."""
    tensor = next((kwargs[k] for k in _TOKEN_ARGUMENTS if isinstance(kwargs.get(k), torch.Tensor)), None)
    if tensor is None:
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return tensor


def call_tokens(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
    """Tokens of a call over all its sequences (its main input's positions: every dimension of token ids, all but
    the last of hidden states); None when it has no tensor."""
    tensor = _main_input(args, kwargs)
    if tensor is None or tensor.dim() == 0:
        return None
    return tensor.numel() // tensor.shape[-1] if tensor.is_floating_point() else tensor.numel()


def _tokens_per_sequence(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
    """Tokens per sequence of the call's main input; None when the input does not say."""
    return _tokens_of(_main_input(args, kwargs))


def _tokens_of(tensor: torch.Tensor | None) -> int | None:
    if tensor is None:
        return None
    if tensor.is_floating_point():
        # [batch, tokens, hidden] (or [batch, heads, tokens, dim]); [tokens, hidden] mixes the sequences
        return tensor.shape[-2] if tensor.dim() >= 3 else None
    return tensor.shape[-1] if tensor.dim() >= 2 else None  # token ids: [batch, tokens]


def _cache_argument(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    for name in _CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return next((a for a in args if hasattr(a, "get_seq_length")), None)


def call_extent(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """(sequences, tokens each holds in context after the call: cached + new, new tokens each) of a model call;
    None when its input does not say."""
    tensor = _main_input(args, kwargs)
    tokens = _tokens_of(tensor)
    if tensor is None or tokens is None:
        return None
    cache = _cache_argument(args, kwargs)
    cached = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
    return int(tensor.shape[0]), cached + int(tokens), int(tokens)


def past_plan(extent: tuple[int, int, int], planned: tuple[int, int, int], new: str = "tokens") -> list[str]:
    """What a call (or a workload) of ``extent`` (:func:`call_extent`'s sequences, context, new tokens each) holds
    past the memory a plan counted for ``planned`` (batch, prompt, context): more tokens in the KV cache than
    ``batch x context`` (it grows with both), more computed at once than ``batch x prompt`` (the activations);
    ``new`` names what the second computes."""
    sequences, held, fresh = extent
    batch, prompt, context = planned
    past = []
    if sequences * held > batch * context:
        past.append(f"holds {sequences} x {held} tokens in the KV cache, past the plan's {batch} x {context}")
    if sequences * fresh > batch * prompt:
        past.append(f"computes {sequences} x {fresh} {new} at once, past the plan's {batch} x {prompt}")
    return past


def workload_past_plan(workload: Any, planned: Any) -> list[str]:
    """:func:`past_plan` of a whole ``workload`` against the workload a plan was priced for (``planned``): its KV cache
    at the full context, its prompt computed at once."""
    return past_plan((workload.batch_size, workload.context_len, workload.prompt_len),
                     (planned.batch_size, planned.prompt_len, planned.context_len), "prompt tokens")


def call_is_prefill(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """The model's call is a prefill: more than one token per sequence and an empty (or no) cache."""
    tokens = _tokens_per_sequence(args, kwargs)
    return tokens is not None and tokens > 1 and call_starts_sequence(args, kwargs)


def call_starts_sequence(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """The model's call begins anew: no cache, or an empty one (a prefill, a plain forward, a 1-token prompt)."""
    cache = _cache_argument(args, kwargs)
    return cache is None or not hasattr(cache, "get_seq_length") or int(cache.get_seq_length()) == 0


def unit_is_prefill(unit: str, layer_ids: tuple[int, ...], args: Sequence[Any], kwargs: Mapping[str, Any],
                    call_prefill: bool) -> bool:
    """This call of a phased unit is its prefill (see the module's docstring); ``call_prefill``: the
    model call's phase, taken when the unit's input does not say how many tokens each sequence has."""
    tokens = _tokens_per_sequence(args, kwargs)
    if tokens is None:
        return call_prefill
    if tokens <= 1 or not layer_ids:
        return tokens > 1
    cache = _cache_argument(args, kwargs)
    if cache is None:
        return True  # no cache (use_cache=False): a whole sequence at once, nothing to keep
    return all(_cached_tokens(layer) == 0 for idx in layer_ids for layer in _cache_layers(unit, cache, idx))


def _cached_tokens(layer: Any) -> int:
    return int(layer.get_seq_length()) if hasattr(layer, "get_seq_length") else 0


def _cache_layers(unit: str, cache: Any, idx: int) -> list[Any]:
    """The per-layer objects of ``cache`` that layer ``idx`` writes (an encoder-decoder cache has two)."""
    parts = [getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
    caches = [c for c in parts if c is not None] or [cache]
    layers = []
    for part in caches:
        held = getattr(part, "layers", None)
        if not isinstance(held, Sequence):
            raise DispatchError(
                f"phased unit {unit!r} got a KV cache of type {type(part).__name__}, which keeps no per-layer "
                f"keys/values (no .layers): the prompt's cache cannot move from the prefill's GPU to where the "
                f"unit decodes. Use a transformers Cache (DynamicCache, StaticCache), or give {unit!r} mode "
                f"'resident' or 'stream'")
        if idx < len(held):
            layers.append(held[idx])
    return layers


def move_cache_layers(unit: str, layer_ids: tuple[int, ...], args: Sequence[Any], kwargs: Mapping[str, Any],
                      device: torch.device) -> None:
    """Move the cache tensors of ``layer_ids`` (from the call's cache argument) to ``device``."""
    cache = _cache_argument(args, kwargs)
    if cache is None:
        return
    for idx in layer_ids:
        for layer in _cache_layers(unit, cache, idx):
            _move_layer(unit, idx, layer, device)


def _move_layer(unit: str, idx: int, layer: Any, device: torch.device) -> None:
    """Every tensor a cache layer holds to ``device``, and its ``device`` attribute (which later
    allocations follow, e.g. a static layer's positions)."""
    state = getattr(layer, "__dict__", {})
    if "keys" not in state or "values" not in state:
        raise DispatchError(
            f"phased unit {unit!r}: cache layer {idx} is a {type(layer).__name__}, which holds no keys/values "
            f"(attributes: {', '.join(sorted(state)) or 'none'}), so its prompt state cannot move from the "
            f"prefill's GPU to {device}. Phased units need a key/value cache (DynamicCache, StaticCache): give "
            f"{unit!r} mode 'resident' or 'stream'")
    for name, value in list(state.items()):
        moved = _to(value, device)
        if moved is not value:
            setattr(layer, name, moved)
    if isinstance(state.get("device"), torch.device | str):
        layer.device = device


def _to(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors on ``device`` (through tuples, lists and dicts, as quantized layers keep them)."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        # a prompt's cache leaving the prefill's GPU: staged through pinned memory (pageable copies crawl)
        return to_host(value) if device.type == "cpu" and value.is_cuda else value.to(device)
    if type(value) in (tuple, list):
        moved = [_to(v, device) for v in value]
        return value if all(a is b for a, b in zip(moved, value, strict=True)) else type(value)(moved)
    if type(value) is dict:
        items = {k: _to(v, device) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    return value
