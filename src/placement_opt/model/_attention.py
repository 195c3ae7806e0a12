"""Attention facts of the units (heads, KV heads, head size, cross-attention) and the graph's ``meta.extra``."""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

from torch import nn

from . import _recorder
from ._context import TraceContext, first_int, hidden_size, in_media_encoder, is_block, is_container
from .dtypes import dtype_bytes

__all__ = ["AttentionFacts", "graph_extra"]


class AttentionFacts:
    """Heads, KV heads and head size of the attention modules each unit owns.

    A unit owns the attention modules inside it; with ``granularity="module"`` (attention split into its
    projections) the last unit registered inside an attention module (its output projection, which also
    receives the glue FLOPs of QK^T and AV) owns it.
    """

    def __init__(self, ctx: TraceContext) -> None:
        self.ctx = ctx
        module = ctx.module
        can_generate = getattr(module, "can_generate", None)
        # a KV cache exists for generating models, encoder-decoders, and bare decoders (``LlamaModel``)
        self.causal = bool(getattr(ctx.config, "is_encoder_decoder", False) or
                           (callable(can_generate) and can_generate()) or
                           any(getattr(m, "is_causal", False) is True for m in module.modules()))
        self.cross_kv_bytes_per_token = 0
        self.owned: dict[str, list[tuple[str, nn.Module]]] = defaultdict(list)
        blocks = [n for n in ctx.units if is_block(ctx, n) or not is_container(ctx, n)]
        for name, attention in _outer_attention(module):
            owner = next((u for u in blocks if name == u or name.startswith(u + ".") or not u), None)
            if owner is None:
                owner = next((u for u in reversed(list(ctx.units)) if u.startswith(name + ".")), None)
            if owner is not None:
                self.owned[owner].append((name, attention))

    def kv_window(self, unit_name: str) -> int | None:
        """The most tokens the KV cache of ``unit_name``'s self-attention keeps, where every one of its layers
        slides (transformers' cache for the model's config keeps a window); None: the whole context."""
        indices = [_layer_index(m) for n, m in self.owned.get(unit_name, []) if not _is_cross(n, m)]
        windows = {self._windows.get(i) if isinstance(i, int) else None for i in indices}
        if len(windows) != 1:
            return None  # no attention, or layers of different kinds
        return windows.pop()

    @functools.cached_property
    def _cache_layers(self) -> tuple[Any, ...]:
        """The layers of transformers' ``DynamicCache`` for the model's config (none where it cannot build one)."""
        try:
            from transformers import DynamicCache

            return tuple(getattr(DynamicCache(config=self.ctx.config), "layers", ()))
        except Exception:  # noqa: BLE001 - no config, or one the cache cannot read
            return ()

    @functools.cached_property
    def _windows(self) -> dict[int, int]:
        """Layer index -> the tokens transformers' ``DynamicCache`` keeps for it, for its sliding layers."""
        return {i: int(window) for i, layer in enumerate(self._cache_layers)
                if isinstance(window := getattr(layer, "sliding_window", None), int) and window > 0}

    @functools.cached_property
    def _linear(self) -> frozenset[int]:
        """Layer indices whose cache is a linear attention's fixed-size state (MiniMax's lightning attention,
        Kimi's delta attention): no keys and values per token, no work per context token."""
        # a hybrid layer's cache (Falcon-H1's LinearAttentionAndFullAttentionLayer) keeps its attention's KV too
        return frozenset(i for i, layer in enumerate(self._cache_layers)
                         if type(layer).__name__.startswith("Linear") and "And" not in type(layer).__name__)

    def of(self, unit_name: str) -> tuple[int, int]:
        """(attention FLOPs per query token per context token, KV-cache elements per token) of the self-attention
        modules of the unit ``unit_name``."""
        cross = [m for n, m in self.owned.get(unit_name, []) if _is_cross(n, m)]
        if cross:
            self.cross_kv_bytes_per_token = sum(self._per_module(m)[1] for m in cross) * dtype_bytes(self.ctx.dtype)
        flops = sum(self._per_module(m)[0] for m in self._prompt_selves(unit_name))
        # a layer that reuses an earlier layer's keys and values (Gemma-3n's last ones) attends, caching nothing
        cached = sum(self._per_module(m)[1] for m in self._cached_selves(unit_name) if not _reuses_cache(m))
        return flops, cached

    def expansion(self, unit_name: str) -> tuple[int, int, int]:
        """What a decode step spends per cached token per sequence re-expanding a compressed cache, summed over
        the unit's cached self-attention modules: (FLOPs, bytes alive on any device, bytes a CPU adds)."""
        figures = [self._expansion(m) for m in self._cached_selves(unit_name)]
        return (sum(f[0] for f in figures), sum(f[1] for f in figures), sum(f[2] for f in figures))

    def _prompt_selves(self, unit_name: str) -> list[nn.Module]:
        """The unit's self-attention modules whose work grows with the prompt: causal or not (an encoder's attends
        to the whole prompt: BART's, ModernBERT's), but not a media encoder's (its context is the image) nor a linear
        attention (no work per context token)."""
        return [m for n, m in self.owned.get(unit_name, []) if not _is_cross(n, m) and not in_media_encoder(n)
                and _layer_index(m) not in self._linear]

    def _cached_selves(self, unit_name: str) -> list[nn.Module]:
        """The unit's self-attention modules that run over a cache: a vision tower's or an encoder's attention
        (is_causal False) keeps none; nor does a linear attention."""
        return [m for n, m in self.owned.get(unit_name, []) if not _is_cross(n, m)
                and getattr(m, "is_causal", True) is not False and _layer_index(m) not in self._linear]

    def _expansion(self, attention: nn.Module) -> tuple[int, int, int]:
        """Multi-head latent attention as transformers runs it (``expand_kv``): every step projects each cached
        latent up through ``kv_b_proj`` into keys without rotary part and values, then writes whole keys into a
        new tensor, so a step holds both for the whole context beside the latent cache. On a CPU, torch's fused
        kernel needs queries, keys and values of one head size; these differ (192 and 128 on DeepSeek-V3), so
        the math path runs: float32 copies of half-precision keys and values and a scaled copy of the keys, per
        cached token (its scores, per query x cached token, are the trace's ``cpu_attention_*`` figures).

        Measured on a CPU decode step of a tiny DeepSeek-V3 at context 501 (tests/model/test_workspace.py).
        """
        project = getattr(attention, "kv_b_proj", None)
        rank, rope, nope = (first_int(attention, (k,)) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim"))
        value_dim = first_int(attention, ("v_head_dim",))
        width = (first_int(project, ("in_features",)), first_int(project, ("out_features",)))
        if not (hasattr(attention, "expand_kv") and rank and rope and nope and value_dim and all(width)):
            return 0, 0, 0
        heads = self._shape(attention)[0]
        size = dtype_bytes(self.ctx.dtype)
        keys = heads * (nope + rope)
        alive = (width[1] + keys) * size
        exact = 4 if size < 4 else size  # the math path computes half precision in float32
        copies = heads * (nope + rope + value_dim) * exact if size < exact else 0
        cpu = copies + keys * exact
        return 2 * width[0] * width[1], alive, cpu

    def _per_module(self, attention: nn.Module) -> tuple[int, int]:
        """(FLOPs per query x context token pair, cache elements per token) of one attention module.

        Multi-head latent attention (DeepSeek-V2/V3) caches one compressed latent and its rotary key per token,
        ``kv_lora_rank + qk_rope_head_dim`` values, where transformers expands them at each call
        (``expand_kv``); queries and keys have ``qk_nope_head_dim + qk_rope_head_dim`` per head and values
        ``v_head_dim``. Other modules: keys of ``head_dim`` and values of ``v_head_dim`` where the module says it
        (MiMo), else ``head_dim``, for each KV head.
        """
        heads, kv, head_dim = self._shape(attention)
        rank, rope, nope = (first_int(attention, (k,)) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim"))
        value_dim = first_int(attention, ("v_head_dim",))
        if rank and rope and nope and value_dim:
            query_dim = nope + rope
            cached = rank + rope if hasattr(attention, "expand_kv") else heads * (query_dim + value_dim)
            return 2 * heads * (query_dim + value_dim), cached
        value_dim = value_dim or head_dim
        return 2 * heads * (head_dim + value_dim), kv * (head_dim + value_dim)

    def _shape(self, attention: nn.Module) -> tuple[int, int, int]:
        """(query heads, heads the KV cache holds per token, head size) of one attention module."""
        config = self.ctx.config
        heads = kv = head_dim = groups = listed_kv = 0
        for sub in attention.modules():
            heads = heads or first_int(sub, ("num_heads", "n_heads", "num_attention_heads", "n_head"))
            kv = kv or first_int(sub, ("num_key_value_heads", "num_kv_heads", "n_kv_heads"))
            head_dim = head_dim or first_int(sub, ("head_dim", "key_value_proj_dim", "attention_head_size"))
            groups = groups or first_int(sub, ("num_key_value_groups",))
            sub_config = getattr(sub, "config", None)
            heads = heads or first_int(sub_config, ("num_attention_heads", "num_heads", "n_head"))
            listed_kv = listed_kv or first_int(sub_config, ("num_key_value_heads",))
        heads = heads or first_int(config, ("num_attention_heads", "num_heads", "n_head"))
        # the module's own grouping before its config's figure: a layer may differ from the config (MiMo-V2-Flash's
        # sliding layers have twice its num_key_value_heads, and say so only in num_key_value_groups)
        kv = (kv or (heads // groups if heads and groups else 0) or listed_kv
              or first_int(config, ("num_key_value_heads", "num_kv_heads")) or heads)
        if _caches_every_head(attention):
            kv = heads
        hidden = hidden_size(self.ctx)
        head_dim = head_dim or first_int(config, ("head_dim", "d_kv")) or (hidden // heads if heads else 0)
        return heads, kv, head_dim


def _caches_every_head(attention: nn.Module) -> bool:
    """Whether the module writes its grouped keys and values to the cache already repeated for every query head.

    transformers' ``FalconAttention`` with ``new_decoder_architecture`` (Falcon-40B, Falcon-180B) broadcasts its
    ``num_kv_heads`` groups to all ``num_attention_heads`` before ``layer_past.update``: the cache holds a key and a
    value per query head (Falcon-40B: 128 heads, not 8, 16x the grouped figure), and the memory a plan must keep
    is that one.
    """
    return any(getattr(m, "new_decoder_architecture", False) is True and hasattr(m, "query_key_value")
               for m in attention.modules())


def _reuses_cache(attention: nn.Module) -> bool:
    """Whether an attention module reads another layer's cache instead of keeping its own (transformers'
    ``is_kv_shared_layer``: Gemma-3n, Gemma-4)."""
    return any(getattr(m, "is_kv_shared_layer", False) is True for m in attention.modules())


def _layer_index(attention: nn.Module) -> int | None:
    """The cache layer an attention module writes: its ``layer_idx``, or its first submodule's (a match on a decoder
    layer's class name, OLMo-Hybrid's ``...LinearAttentionDecoderLayer``, holds the attention that has it)."""
    for module in attention.modules():
        if isinstance(index := getattr(module, "layer_idx", None), int):
            return index
    return None


def _outer_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost modules whose class names say attention (``LlamaAttention``, ``T5LayerCrossAttention``)."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in model.named_modules():
        cls = type(sub).__name__.lower()
        if name and ("attention" in cls or cls.endswith(("attn", "mla"))) and not (
                found and name.startswith(found[-1][0] + ".")):
            found.append((name, sub))
    return found


def _is_cross(name: str, module: nn.Module) -> bool:
    text = (name + type(module).__name__).lower()
    # BART's family names its decoder's cross-attention ``encoder_attn`` (a plain BartAttention)
    return (bool(getattr(module, "is_cross_attention", False)) or "cross" in text or "encdec" in text
            or name.rsplit(".", 1)[-1] == "encoder_attn")


def graph_extra(ctx: TraceContext, record: _recorder.Record | None, attention: AttentionFacts, dropped: int) -> dict[str, Any]:
    config = ctx.config
    extra: dict[str, Any] = {"module_class": type(ctx.module).__name__, "num_units": len(ctx.units),
                             "granularity": ctx.granularity, "kv_cache": attention.causal}
    if config is not None:
        extra["config_class"] = type(config).__name__
        extra["model_type"] = str(getattr(config, "model_type", ""))
        for key, keys in {"num_layers": ("num_hidden_layers", "num_layers", "n_layer"),
                          "num_decoder_layers": ("num_decoder_layers",),
                          "hidden_size": ("hidden_size", "d_model", "n_embd"),
                          "intermediate_size": ("intermediate_size", "d_ff", "ffn_dim", "n_inner"),
                          "num_attention_heads": ("num_attention_heads", "num_heads", "n_head"),
                          "num_key_value_heads": ("num_key_value_heads", "num_kv_heads"),
                          "head_dim": ("head_dim", "d_kv"), "vocab_size": ("vocab_size",),
                          "max_position_embeddings": ("max_position_embeddings", "n_positions"),
                          "sliding_window": ("sliding_window",),
                          "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
                          "num_experts_per_tok": ("num_experts_per_tok", "moe_topk")}.items():
            value = first_int(config, keys)
            if value:
                extra[key] = value
        if "head_dim" not in extra and extra.get("num_attention_heads") and extra.get("hidden_size"):
            extra["head_dim"] = extra["hidden_size"] // extra["num_attention_heads"]
    if attention.cross_kv_bytes_per_token:
        extra["cross_attn_kv_bytes_per_token"] = attention.cross_kv_bytes_per_token
    if record is not None:
        extra["glue_flops"] = int(record.glue_flops)
        extra["guessed_scalars"] = int(record.guessed_scalars)
        extra["dropped_back_edges"] = int(dropped)
        extra["replayed_blocks"] = int(record.replayed_blocks)
    return extra
