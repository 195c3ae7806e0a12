"""Node attributes: what :func:`~.tracer.trace` writes on each unit's node of the graph.

Sizes (its own parameter and buffer bytes, a tied parameter counted at its first owner), FLOPs and output
bytes per token, attention and KV cache facts, MoE facts, and what the meta forward measured beside them
(workspace, op count, a CPU's unfused attention, a sublayer unit's bytes in and out); without a record
(the static fallback), estimates from the unit's weights.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._context import TraceContext, hidden_size, is_block
from ._unit_info import (
    CPU_ATTENTION_NODE_ATTRIBUTES,
    DECODE_NODE_ATTRIBUTES,
    LATENT_NODE_ATTRIBUTES,
    LOAD_NODE_ATTRIBUTES,
    MEASURED_NODE_ATTRIBUTES,
    NODE_ATTRIBUTES,
)
from ._units import moe_facts, tensor_bytes, tie_key, unit_tensors
from .dtypes import dtype_bytes

if TYPE_CHECKING:  # pragma: no cover
    from . import _recorder
    from ._attention import AttentionFacts

__all__ = ["node_attributes"]


def node_attributes(ctx: TraceContext, record: _recorder.Record | None, name: str, module_index: int,
                    exec_index: int, tied: list[tuple[str, ...]], first_owner: dict[str, str],
                    attention: AttentionFacts, encoder: set[str], decode_line: tuple[int, int] | None = None
                    ) -> dict[str, Any]:
    module = ctx.units[name]
    tensors = unit_tensors(name, module, is_block(ctx, name))
    param_bytes, buffer_bytes, tied_bytes = _owned_bytes(ctx, name, tensors, tied, first_owner)
    flops, out_bytes = _per_token(ctx, record, name, tensors)
    attn_flops_per_ctx, kv_elements = attention.of(name)
    in_decode = name not in encoder
    has_cache = in_decode and attention.causal
    moe = moe_facts(ctx, module, name)
    attrs = {
        "module_class": type(module).__name__, "exec_index": exec_index, "module_index": module_index,
        "param_bytes": int(param_bytes), "buffer_bytes": int(buffer_bytes), "flops_per_token": int(flops),
        "attn_flops_per_token_per_ctx": int(attn_flops_per_ctx),
        "out_bytes_per_token": int(out_bytes),
        "kv_bytes_per_token": int(kv_elements * dtype_bytes(ctx.dtype)) if has_cache else 0,
        "moe_num_experts": moe[0], "moe_experts_per_token": moe[1], "moe_expert_bytes": moe[2],
        "param_names": tuple(q for q, _, p in tensors if p), "in_decode": in_decode,
    }
    assert set(attrs) == set(NODE_ATTRIBUTES)
    attrs.update(_load_attributes(ctx, tensors))
    if tied_bytes:
        attrs["tied_param_bytes"] = int(tied_bytes)
    if has_cache and attrs["kv_bytes_per_token"]:
        attrs.update(_cache_attributes(name, attention, decode_line))
    if has_cache and any(expansion := attention.expansion(name)):
        attrs.update(zip(LATENT_NODE_ATTRIBUTES, expansion, strict=True))
    if record is not None:
        attrs.update(_recorded_attributes(ctx, record, name))
    if ctx.granularity == "sublayer" and (block := _enclosing_block(ctx, name, ctx.no_split)) is not None:
        attrs["block"] = block
    if ctx.granularity == "module" and (layer := _enclosing_block(ctx, name, ctx.layer_classes)) not in (None, name):
        attrs["layer"] = layer
    return attrs


def _load_attributes(ctx: TraceContext, tensors: Iterable[tuple[str, torch.Tensor, bool]]) -> dict[str, int]:
    """:data:`LOAD_NODE_ATTRIBUTES` of a unit's tensors, its parameters in registration order, as accelerate loads
    an offloaded module's own ones (not its buffers, which it keeps on the execution device): the most one module
    holds, and the most held while one module is copied out of its files' maps (the copies so far, and the map
    and copy of the parameter being copied); none for a unit without parameters."""
    held: dict[str, int] = {}
    loading: dict[str, int] = {}
    for qname, tensor, is_param in tensors:
        if is_param:
            size = tensor_bytes(tensor, ctx.override)
            owner = qname.rpartition(".")[0]
            loading[owner] = max(loading.get(owner, 0), held.get(owner, 0) + 2 * size)
            held[owner] = held.get(owner, 0) + size
    if not held:
        return {}
    return dict(zip(LOAD_NODE_ATTRIBUTES, (max(held.values()), max(loading.values())), strict=True))


def _owned_bytes(ctx: TraceContext, name: str, tensors: Iterable[tuple[str, torch.Tensor, bool]],
                 tied: list[tuple[str, ...]], first_owner: dict[str, str]) -> tuple[int, int, int]:
    """(parameter bytes, buffer bytes) unit ``name`` stores, and the bytes of the tied parameters it uses that
    another unit stores: a tied parameter is stored once, at its first owner."""
    param_bytes = buffer_bytes = tied_bytes = 0
    for qname, tensor, is_param in tensors:
        size = tensor_bytes(tensor, ctx.override)
        if not is_param:
            buffer_bytes += size
        elif first_owner.get(tie_key(qname, tied)) == name:
            param_bytes += size
        else:
            tied_bytes += size
    return param_bytes, buffer_bytes, tied_bytes


def _per_token(ctx: TraceContext, record: _recorder.Record | None, name: str,
               tensors: Iterable[tuple[str, torch.Tensor, bool]]) -> tuple[int, int]:
    """(FLOPs, output bytes) per token of unit ``name``: as the meta forward recorded them, or without a record
    (the static fallback) two FLOPs per weight of its matrices and one hidden state out."""
    tokens = ctx.tokens
    if record is not None:
        return round(record.flops.get(name, 0) / tokens), math.ceil(_leaving_bytes(record, name) / tokens)
    flops = 2 * sum(t.numel() for q, t, p in tensors if p and t.dim() > 1 and not _in_embedding(ctx, q))
    return flops, hidden_size(ctx) * dtype_bytes(ctx.dtype)


def _cache_attributes(name: str, attention: AttentionFacts, decode_line: tuple[int, int] | None) -> dict[str, Any]:
    """A unit with a KV cache: its window (a sliding layer) and what a decode step holds (the decode probe's line)."""
    attrs: dict[str, Any] = {}
    if (window := attention.kv_window(name)) is not None:
        attrs["kv_window_tokens"] = window
    if decode_line is not None:
        attrs.update(zip(DECODE_NODE_ATTRIBUTES, decode_line, strict=True))
    return attrs


def _recorded_attributes(ctx: TraceContext, record: _recorder.Record, name: str) -> dict[str, Any]:
    """What the meta forward measured of unit ``name`` beside its sizes: workspace, op count, a CPU's unfused
    attention, and a sublayer unit's bytes in."""
    attrs: dict[str, Any] = {}
    if name in record.workspace:
        attrs.update(_workspace(ctx, record.workspace[name]))
    if name in record.ops:
        attrs["ops_per_forward"] = record.ops[name]
    if name in record.cpu_attention:
        linear, scores = record.cpu_attention[name]
        attrs.update(zip(CPU_ATTENTION_NODE_ATTRIBUTES, (math.ceil(linear / ctx.tokens),
                                                         math.ceil(scores / (ctx.tokens * ctx.seq_len))), strict=True))
    if ctx.granularity == "sublayer":
        attrs.update(_round_trip_bytes(ctx, record, name))
    return attrs


def _enclosing_block(ctx: TraceContext, name: str, classes: Collection[str]) -> str | None:
    """The module of one of ``classes`` that holds unit ``name`` (the longest such prefix of its name), or None:
    the no-split block a ``"sublayer"`` unit was cut from, the decoder layer a ``"module"`` unit lies in."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if type(ctx.module.get_submodule(prefix)).__name__ in classes:
            return prefix
    return None


def _round_trip_bytes(ctx: TraceContext, record: _recorder.Record, name: str) -> dict[str, int]:
    """What a sublayer unit computed away from the home device moves per token: the distinct tensors it
    reads from other units (home -> its device) and what its forward returns (back home; eager attention's
    probabilities apart, see :attr:`~._recorder.Record.returned_bytes`)."""
    read: dict[int, int] = {}
    for (_src, dst), tensors in record.edges.items():
        if dst == name:
            read.update(tensors)
    # a unit owning a block's own tensors is never called: what it makes leaves it
    returned = record.returned_bytes.get(name, _leaving_bytes(record, name))
    return {"in_bytes_per_token": math.ceil(sum(read.values()) / ctx.tokens),
            "out_bytes_per_token": math.ceil(returned / ctx.tokens)}


def _workspace(ctx: TraceContext, peaks: tuple[tuple[int, int], tuple[int, int]]) -> dict[str, int]:
    """A unit's two peak moments, (linear, score) bytes, as the graph's per-token figures (see :mod:`._memory`)."""
    (linear, scores), (linear_at_scores, most_scores) = peaks
    pairs = ctx.tokens * ctx.seq_len
    attrs = {"workspace_bytes_per_token": math.ceil(linear / ctx.tokens),
             "workspace_bytes_per_token_ctx": math.ceil(scores / pairs),
             "scores_workspace_bytes_per_token": math.ceil(linear_at_scores / ctx.tokens),
             "scores_workspace_bytes_per_token_ctx": math.ceil(most_scores / pairs)}
    assert set(attrs) == set(MEASURED_NODE_ATTRIBUTES)
    return attrs


def _leaving_bytes(record: _recorder.Record, name: str) -> int:
    """Bytes of the distinct tensors other units read from ``name``; all its outputs when none are read
    (the last unit's logits). Returned tensors nobody reads (eager attention probabilities) do not count.

    At most what its forward returned: glue outside units (a residual add between modules) derives new
    tensors from a unit's output, and later units read those, but what leaves the unit's device is its
    output. Counting them made a module-level Llama-3-70B's layer-1 ``o_proj`` send 158 hidden states
    per token instead of one."""
    read = record.read_from(name)
    if not read:
        return record.out_bytes.get(name, 0)
    returned = record.returned_bytes.get(name)
    return sum(read.values()) if returned is None else min(sum(read.values()), returned)


def _in_embedding(ctx: TraceContext, qname: str) -> bool:
    """An embedding table: looked up, not multiplied (0 FLOPs in the static estimate)."""
    owner = qname.rpartition(".")[0]
    try:
        return isinstance(ctx.module.get_submodule(owner), nn.Embedding)
    except AttributeError:
        return False
