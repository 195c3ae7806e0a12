"""Placement units of a module: which modules are units, the tensors each owns, ties, experts."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ._context import TraceContext, experts_per_token, is_block, is_container
from ._meta_experts import expert_count, is_fused_experts, is_stacked_experts
from .dtypes import dtype_bytes

__all__ = ["no_split_names", "find_units", "block_parts", "is_moe_block", "unit_tensors", "tensor_bytes", "tie_key", "tied_groups", "owner_of",
           "moe_facts", "groupable"]


def no_split_names(module: nn.Module, no_split: Iterable[str] | None, granularity: str) -> set[str]:
    if no_split is not None:
        return {str(n) for n in no_split}
    if granularity == "module":
        return set()
    return {str(n) for n in (getattr(module, "_no_split_modules", None) or ())}


def find_units(module: nn.Module, no_split: set[str],
               granularity: str = "block") -> tuple[dict[str, nn.Module], frozenset[str]]:
    """Unit name -> module, in registration order: no-split instances (``"sublayer"``: their parts, see
    :func:`block_parts`), then any module owning tensors; and the names of the units that own every
    tensor below them (the others own only their direct tensors)."""
    units: dict[str, nn.Module] = {}
    whole: set[str] = set()
    block: str | None = None
    for name, sub in module.named_modules():
        if block is not None and name.startswith(block + "."):
            continue
        block = None
        if name and type(sub).__name__ in no_split:
            parts = block_parts(name, sub) if granularity == "sublayer" else {name: sub}
            units.update(parts)
            whole.update(n for n in parts if not any(m.startswith(n + ".") for m in parts))
            block = name
        elif _has_direct_tensors(sub):
            units[name] = sub
    if not units:
        units[""] = module
    return units, frozenset(whole)


def block_parts(name: str, block: nn.Module) -> dict[str, nn.Module]:
    """The ``"sublayer"`` units of one no-split block: its direct children that hold tensors.

    An MoE block (a child with an ``experts`` child: Mixtral's, Qwen2-MoE's) is split one level further
    (router, experts, shared expert), since the experts are the part worth computing elsewhere; module
    lists are looked through (they have no forward of their own), except a list of experts, one unit. The block, or an MoE block, that owns
    tensors directly keeps them in a unit of its own name (before its parts, as registration has it).
    """
    parts: dict[str, nn.Module] = {name: block} if _has_direct_tensors(block) else {}
    for child_name, child in block.named_children():
        qualified = f"{name}.{child_name}"
        if not _holds_tensors(child):
            continue  # parameter-free children (activations, dropout) are glue: the next unit pays
        listed = isinstance(child, (nn.ModuleList, nn.ModuleDict)) and child_name != "experts"  # experts: one unit
        if listed or is_moe_block(child):
            parts.update(block_parts(qualified, child))
        else:
            parts[qualified] = child
    return parts


def is_moe_block(module: nn.Module) -> bool:
    """A mixture-of-experts block: a module with an ``experts`` child (its router and shared experts beside)."""
    return "experts" in module._modules and module._modules["experts"] is not None


def _holds_tensors(module: nn.Module) -> bool:
    return any(_has_direct_tensors(m) for m in module.modules())


def _has_direct_tensors(module: nn.Module) -> bool:
    return bool(module._parameters.keys() - {k for k, v in module._parameters.items() if v is None}) or any(
        v is not None for v in module._buffers.values())


def unit_tensors(name: str, module: nn.Module, whole: bool) -> list[tuple[str, torch.Tensor, bool]]:
    """(qualified name, tensor, is_param) of the tensors a unit owns: all below it, or only its own."""
    prefix = f"{name}." if name else ""
    params = module.named_parameters(recurse=whole, remove_duplicate=False)
    buffers = module.named_buffers(recurse=whole, remove_duplicate=False)
    return ([(prefix + n, t, True) for n, t in params] + [(prefix + n, t, False) for n, t in buffers])


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes once loaded: own dtype, or ``dtype`` for floating tensors (never upcast: accelerate's rule)."""
    size = tensor.element_size()
    if dtype is not None and tensor.is_floating_point():
        size = min(size, dtype_bytes(dtype))
    return tensor.numel() * size


def tie_key(pname: str, tied: list[tuple[str, ...]]) -> str:
    return next((g[0] for g in tied if pname in g), pname)


def tied_groups(ctx: TraceContext) -> tuple[list[tuple[str, ...]], dict[str, list[str]]]:
    """Tied parameter groups and each unit's parameter names.

    Ties come from object identity (a loaded or ``tie_weights()``-ed model) and from what transformers
    declares: ``all_tied_weights_keys`` / a ``_tied_weights_keys`` dict (transformers 5, whose models
    built on meta are not tied yet) or a ``_tied_weights_keys`` list tied to the input embeddings (v4).
    """
    owners = {name: [q for q, _, p in unit_tensors(name, module, is_block(ctx, name)) if p]
              for name, module in ctx.units.items()}
    named = list(ctx.module.named_parameters(remove_duplicate=False))
    by_object: dict[int, list[str]] = defaultdict(list)
    for qname, param in named:
        by_object[id(param)].append(qname)
    links: list[set[str]] = [set(g) for g in by_object.values() if len(g) > 1]
    links += _declared_ties(ctx, named)
    present = {q for q, _ in named}
    return [tuple(sorted(g & present)) for g in _merge(links) if len(g & present) > 1], owners


def _declared_ties(ctx: TraceContext, named: list[tuple[str, nn.Parameter]]) -> list[set[str]]:
    module = ctx.module
    if not getattr(ctx.config, "tie_word_embeddings", True) and not getattr(module, "all_tied_weights_keys", None):
        return []
    declared = getattr(module, "all_tied_weights_keys", None) or getattr(module, "_tied_weights_keys", None)
    if isinstance(declared, Mapping):
        return [{str(k), str(v)} for k, v in declared.items()]
    embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    source = next((q for q, p in named if p is weight), None) if weight is not None else None
    if isinstance(declared, (list, tuple)) and source is not None:
        return [{str(k), source} for k in declared]
    return []


def _merge(sets: list[set[str]]) -> list[set[str]]:
    merged: list[set[str]] = []
    for group in sets:
        overlapping = [m for m in merged if m & group]
        for m in overlapping:
            merged.remove(m)
            group = group | m
        merged.append(group)
    return merged


def owner_of(pname: str, owners: Mapping[str, list[str]]) -> str | None:
    return next((u for u, names in owners.items() if pname in names), None)


def moe_facts(ctx: TraceContext, module: nn.Module, name: str) -> tuple[int, int, int]:
    """(experts, experts per token, bytes of expert weights) of a unit; zeros when it is not MoE, or owns only
    its direct tensors (the experts below it are another unit's)."""
    if is_container(ctx, name):
        return 0, 0, 0
    experts = [m for m in module.modules() if is_fused_experts(m) or is_stacked_experts(m)]
    if not experts and (owner := _stacked_owner(ctx, name, module)) is not None:
        # DBRX's stacked experts cut per module: this unit holds every expert's rows, its parent routes each token
        nbytes = sum(tensor_bytes(p, ctx.override) for p in module.parameters())
        return int(owner.num_experts), experts_per_token(ctx, owner), int(nbytes)
    if not experts:
        # full names: the unit may be the expert list itself (a "sublayer" experts unit)
        lists = [m for n, m in module.named_modules(prefix=name) if n.endswith("experts")
                 and isinstance(m, nn.ModuleList)]
        if not lists:
            return 0, 0, 0
        count = sum(len(m) for m in lists)
        nbytes = sum(tensor_bytes(p, ctx.override) for m in lists for p in m.parameters())
        return count, experts_per_token(ctx, lists[0]), nbytes
    count = max(expert_count(m) for m in experts)
    nbytes = sum(tensor_bytes(p, ctx.override) for m in experts for p in m.parameters())
    per_token = count if _runs_every_expert(experts[0]) else experts_per_token(ctx, experts[0])
    return int(count), int(per_token), int(nbytes)


def _stacked_owner(ctx: TraceContext, name: str, module: nn.Module) -> nn.Module | None:
    """The stacked experts module (:func:`is_stacked_experts`) whose ``mlp`` child ``module`` is, or None: at
    ``granularity="module"`` that child is the unit holding the experts' weights, and its parent, which routes the
    tokens and slices the rows each expert reads, holds none. Without it a DBRX-132B layer's decode was priced
    reading all 16 experts' 5.9 GiB a token, not its top 4's."""
    parent_name, _, child = name.rpartition(".")
    if child != "mlp" or not parent_name:
        return None
    try:
        parent = ctx.module.get_submodule(parent_name)
    except AttributeError:
        return None
    return parent if is_stacked_experts(parent) and parent.mlp is module else None


def _runs_every_expert(experts: nn.Module) -> bool:
    """An experts module whose forward takes the hidden states alone gets no routing: it runs every expert on every
    token (Llama-4's in transformers: the router scales a copy of each token per expert, and all of them run), so
    each token reads every expert's weights, not its top-k's."""
    import inspect

    try:
        params = [p for p in inspect.signature(experts.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def groupable(module: nn.Module) -> bool:
    """A fused experts module :func:`split_experts` can cut: transformers' experts interface (whose kernels
    skip the expert-parallel sentinel), every weight with one row per expert, no submodule holding tensors."""
    if not hasattr(module, "_is_expert_parallel") or not hasattr(module, "num_experts"):
        return False
    tensors = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
    rows = module.num_experts
    return (bool(tensors) and all(t.dim() >= 2 and t.shape[0] == rows for t in tensors)
            and not any(True for m in module.children() for _ in m.parameters()))
