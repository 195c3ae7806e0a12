"""What every step of :func:`~placement_opt.model.tracer.trace` reads: the module, its units, its config."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["TraceContext", "is_block", "is_container", "experts_per_token", "first_int", "hidden_size", "MEDIA_ENCODERS",
           "in_media_encoder"]

#: Submodules of multimodal models that encode an image or a sound once, in the prompt: no decode step runs them
#: (Phi-4-multimodal's are ``image_embed`` and ``audio_embed``).
MEDIA_ENCODERS = frozenset({"vision_tower", "vision_model", "visual", "vision_encoder", "image_encoder",
                            "audio_tower", "multi_modal_projector", "image_embed", "audio_embed"})


@dataclass
class TraceContext:
    module: nn.Module
    name: str
    config: Any
    dtype: torch.dtype
    override: torch.dtype | None
    """Count (and run) floating tensors in this dtype instead of their own (user's dtype for a module)."""
    batch_size: int
    seq_len: int
    units: dict[str, nn.Module]
    no_split: tuple[str, ...]
    granularity: str = "block"
    whole: frozenset[str] = frozenset()
    """Units that own every tensor below them (no-split blocks, or their parts at ``"sublayer"``); the
    others own only their direct tensors."""
    attn_implementation: str | None = None
    """The attention the model runs with at run time (``"sdpa"``, ``"eager"``; None: not a transformers model)."""
    traced_attention: str | None = None
    """The attention the meta forward ran: the module's own (None: not a transformers model)."""

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @functools.cached_property
    def with_units_below(self) -> frozenset[str]:
        """Every name some unit sits below (its dotted prefixes; "" when any unit has a name). The units are fixed
        at construction; a scan of every unit per question took a module-level Qwen2-72B's trace 1.5 s."""
        below = {n.rsplit(".", k)[0] for n in self.units for k in range(1, n.count(".") + 1)}
        return frozenset(below | ({""} if any(self.units) else set()))

    @property
    def layer_classes(self) -> tuple[str, ...]:
        """The model's own no-split classes (``_no_split_modules``: its decoder layers), whatever ``no_split`` cut."""
        return tuple(str(n) for n in (getattr(self.module, "_no_split_modules", None) or ()))


def is_container(ctx: TraceContext, name: str) -> bool:
    """A unit owning only its direct tensors while other units sit below it (its forward is mostly glue)."""
    return not is_block(ctx, name) and name in ctx.with_units_below


def is_block(ctx: TraceContext, name: str) -> bool:
    """A unit kept whole (owns every tensor below it), as opposed to one owning only its direct tensors."""
    return name in ctx.whole or len(ctx.units) == 1


def experts_per_token(ctx: TraceContext, experts: nn.Module) -> int:
    # DBRX keeps its MoE settings in a nested ffn_config (moe_top_k)
    for source in (ctx.config, getattr(ctx.config, "ffn_config", None), experts):
        for key in ("num_experts_per_tok", "top_k", "moe_topk", "num_experts_per_token", "moe_top_k"):
            value = getattr(source, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return 1


def first_int(obj: Any, keys: tuple[str, ...]) -> int:
    for key in keys:
        try:
            value = getattr(obj, key, None) if obj is not None else None
        except Exception:  # noqa: BLE001 - a config whose layers differ refuses a global value (Gemma-4): none
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def hidden_size(ctx: TraceContext) -> int:
    value = first_int(ctx.config, ("hidden_size", "d_model", "n_embd"))
    if value:
        return value
    linear = next((m for m in ctx.module.modules() if isinstance(m, nn.Linear)), None)
    return linear.out_features if linear is not None else 1


def in_media_encoder(name: str) -> bool:
    """Whether the module or unit ``name`` lies in a multimodal model's media encoder (:data:`MEDIA_ENCODERS`)."""
    return bool(MEDIA_ENCODERS & set(name.split(".")))
