"""Turn a model into a :class:`~placement_opt.model.graph.LayerGraph`: ``trace(model) -> LayerGraph``.

The model is never run on real data and its weights are never read or copied: models built from a
config are built on the meta device, and a module given with real weights runs its one forward with
every parameter and buffer swapped for a meta tensor (see :mod:`placement_opt.model._recorder`, which records
execution order, FLOPs and data flow per unit).

Placement units are the instances of the model's no-split classes (``model._no_split_modules``, e.g.
``LlamaDecoderLayer``, or the user's ``no_split``) plus every module outside them that owns parameters
or buffers itself (embeddings, final norm, ``lm_head``, a rotary embedding's ``inv_freq``). A module
that owns tensors and also has units below it owns only its direct tensors and is charged for the ops
that read them.

Conventions the cost model relies on:

* bytes: parameters and buffers at their own dtype (the config's dtype for a config; with ``dtype=``
  given for a module, floating tensors at that size, never upcast: accelerate's
  ``compute_module_sizes`` rule). Tied parameters are counted once, on the first unit to run.
* ``flops_per_token``: FLOPs of the traced forward / (batch x seq_len), counted by
  ``torch.utils.flop_counter`` formulas (matmuls, convolutions, attention kernels). Attention is traced
  with the eager implementation so QK^T and AV are visible matmuls.
* ``kv_bytes_per_token``: ``2 x kv_heads x head_dim x dtype bytes`` per self-attention module of units
  that run at decode time in generating models (decoder-only and the decoder of encoder-decoders);
  encoder-only models and encoders keep no cache. Cross-attention KV of T5-like decoders is reported in
  ``meta.extra["cross_attn_kv_bytes_per_token"]``.
* MoE: fused expert modules (transformers 5 ``MixtralExperts``) are run through ``top_k`` experts' weights
  densely, so their FLOPs are ``top_k / num_experts`` of all experts' dense FLOPs.
* Dummy inputs: ``input_ids`` (plus ``decoder_input_ids`` for encoder-decoders), no ``attention_mask``
  (an all-ones mask is the same computation, and masks trigger data-dependent checks on meta).

When the meta forward fails (custom ops, data-dependent control flow), :func:`trace` warns and returns a
static graph of the module tree in registration order (``meta.traced`` is False).
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import TraceError
from . import _recorder
from .graph import NODE_ATTRIBUTES, GraphMeta, LayerGraph

__all__ = ["trace", "GRANULARITIES"]

#: ``"block"``: no-split blocks are kept whole (default); ``"module"``: every module with its own
#: parameters or buffers is a unit, no-split classes are ignored (finest; a coarser graph is obtained
#: by naming container classes in ``no_split``).
GRANULARITIES = ("block", "module")

_ENCODER_ONLY_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
                       "deberta-v2", "camembert", "mpnet", "modernbert", "ernie"}


def trace(
    model: Any,
    *,
    batch_size: int = 1,
    seq_len: int = 64,
    dtype: str | torch.dtype | None = None,
    no_split: Iterable[str] | None = None,
    granularity: str = "block",
    example_inputs: tuple[Any, ...] | Mapping[str, Any] | None = None,
) -> LayerGraph:
    """Trace ``model`` into a layer graph of placement units, without touching any weight data.

    Example::

        >>> from placement_opt import trace, models
        >>> graph = trace(models.model_config("llama-3-70b"))     # built on meta, nothing allocated
        >>> graph.names()[:3]
        ['model.embed_tokens', 'model.rotary_emb', 'model.layers.0']
        >>> graph.unit("model.layers.0").kv_bytes_per_token      # 2 x 8 KV heads x 128 x 2 bytes
        4096

    Args:
        model: an ``nn.Module`` (weights on meta, CPU or any device), a ``transformers`` config, a preset
            name of :mod:`placement_opt.model.catalog`, a path to a ``config.json`` or to a directory holding one,
            or a Hugging Face model id (only its config is fetched).
        batch_size: batch of the traced forward.
        seq_len: tokens per sequence of the traced forward; ``flops_per_token`` is measured at this length.
        dtype: weight dtype the byte counts assume (``"float16"``, ``torch.bfloat16``). Default: the
            config's ``dtype``/``torch_dtype`` for configs (float16 when absent), the parameters' own dtype
            for modules. Floating tensors are counted at this size (for a module: never above their
            own, accelerate's rule), integer buffers at their own.
        no_split: module class names kept whole (default: ``model._no_split_modules``).
        granularity: ``"block"`` keeps no-split blocks whole (default); ``"module"`` ignores them and
            makes every module with its own parameters or buffers a unit. Anything coarser is asked
            for by naming bigger container classes in ``no_split``.
        example_inputs: inputs of the forward for plain modules (a tuple of positional arguments or a
            dict of keyword arguments); only shapes and dtypes are used. Default: token ids for
            ``transformers`` models, a ``(batch, seq_len, in_features)`` tensor for modules whose first
            layer is a ``Linear``.

    Returns:
        The :class:`LayerGraph`; ``graph.meta.traced`` is False when the static fallback was used.

    Raises:
        TraceError: the argument is none of the accepted kinds, a config cannot be read, or the model
            cannot be built from its config.
        ValueError: a bad ``batch_size``, ``seq_len`` or ``granularity``.
    """
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size ({batch_size}) and seq_len ({seq_len}) must both be >= 1")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity {granularity!r} is not one of {', '.join(GRANULARITIES)}")
    module, name, config, torch_dtype, override = _resolve(model, dtype)
    split = _no_split_names(module, no_split, granularity)
    units = _find_units(module, split)
    ctx = _Context(module=module, name=name, config=config, dtype=torch_dtype, override=override,
                   batch_size=batch_size, seq_len=seq_len, units=units, no_split=tuple(sorted(split)),
                   granularity=granularity)
    try:
        record = _meta_forward(ctx, example_inputs)
    except Exception as exc:  # noqa: BLE001 - any failure of a foreign forward means: fall back
        warnings.warn(
            f"placement_opt.trace: the meta forward of {name} failed ({type(exc).__name__}: "
            f"{_first_line(exc)}); using a static graph of the module tree in registration order "
            f"(chain edges, FLOPs estimated as 2 x matrix parameters per token). If the forward needs other "
            f"inputs, pass example_inputs (shapes and dtypes are enough) to get a traced graph.",
            RuntimeWarning, stacklevel=2)
        record = None
    return _build_graph(ctx, record)


# -- resolving the argument into a module ------------------------------------------------------------


def _resolve(model: Any, dtype: str | torch.dtype | None
             ) -> tuple[nn.Module, str, Any, torch.dtype, torch.dtype | None]:
    """(module, name, config or None, graph dtype, dtype to count floating tensors in or None for their own)."""
    if isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        name = getattr(config, "name_or_path", "") or type(model).__name__
        if dtype is None:
            return model, name, config, _module_dtype(model), None
        return model, name, config, _as_dtype(dtype), _as_dtype(dtype)
    config = _as_config(model)
    torch_dtype = _as_dtype(dtype) if dtype is not None else _config_dtype(config)
    name = getattr(config, "name_or_path", "") or type(config).__name__
    return _build_on_meta(config, torch_dtype), name, config, torch_dtype, None


def _as_config(model: Any) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise TraceError(
            f"cannot trace a {type(model).__name__}: pass an nn.Module, a transformers config, a preset name "
            f"of placement_opt.model.catalog, a config.json path or a model id")
    text = os.fspath(model)
    from . import catalog as models

    if text.strip().lower() in models.list_models():
        return models.model_config(text)
    path = Path(text)
    if path.exists():
        try:
            return AutoConfig.from_pretrained(path.parent if path.is_file() and path.name == "config.json"
                                              else path)
        except Exception as exc:
            raise TraceError(f"cannot read a transformers config from {text!r}: {_first_line(exc)}") from None
    try:
        return AutoConfig.from_pretrained(text, local_files_only=True)  # the hub cache first
    except Exception:  # noqa: BLE001 - not cached: ask the hub below
        pass
    try:
        return AutoConfig.from_pretrained(text)
    except Exception as exc:
        raise TraceError(
            f"{text!r} is not a preset ({', '.join(models.list_models())}), not a local path, and fetching its "
            f"config.json from the Hugging Face hub failed ({_first_line(exc)}): pass a local config.json, a "
            f"directory holding one, or a transformers config object") from None


def _config_dtype(config: Any) -> torch.dtype:
    for key in ("dtype",) if hasattr(type(config), "dtype") or "dtype" in vars(config) else ("torch_dtype",):
        value = getattr(config, key, None)
        if value is not None and value != "auto":
            return _as_dtype(value)
    return torch.float16


def _as_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    candidate = getattr(torch, name, None)
    if not isinstance(candidate, torch.dtype):
        raise ValueError(f"dtype {value!r} is not a torch dtype: use e.g. 'float16', 'bfloat16' or 'float32'")
    return candidate


def _module_dtype(module: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = defaultdict(int)
    for tensor in module.parameters():
        if tensor.is_floating_point():
            counts[tensor.dtype] += tensor.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def _build_on_meta(config: Any, torch_dtype: torch.dtype) -> nn.Module:
    """Instantiate the right Auto class on the meta device: no weight is allocated."""
    import transformers

    config = copy.deepcopy(config)  # from_config writes its dtype into the config
    if getattr(config, "is_encoder_decoder", False):
        auto = transformers.AutoModelForSeq2SeqLM
    elif getattr(config, "model_type", "") in _ENCODER_ONLY_TYPES:
        auto = transformers.AutoModel
    else:
        auto = transformers.AutoModelForCausalLM
    try:
        with torch.device("meta"):
            try:
                return auto.from_config(config, dtype=torch_dtype, attn_implementation="eager")
            except ValueError:
                return transformers.AutoModel.from_config(config, dtype=torch_dtype,
                                                          attn_implementation="eager")
    except Exception as exc:
        raise TraceError(
            f"cannot build {type(config).__name__} on the meta device ({_first_line(exc)}): build the model "
            f"yourself (e.g. under `with torch.device('meta')`) and pass the nn.Module") from None


# -- placement units -----------------------------------------------------------------------------------


def _no_split_names(module: nn.Module, no_split: Iterable[str] | None, granularity: str) -> set[str]:
    if no_split is not None:
        return {str(n) for n in no_split}
    if granularity == "module":
        return set()
    return {str(n) for n in (getattr(module, "_no_split_modules", None) or ())}


def _find_units(module: nn.Module, no_split: set[str]) -> dict[str, nn.Module]:
    """Unit name -> module, in registration order: no-split instances, then any module owning tensors."""
    units: dict[str, nn.Module] = {}
    block: str | None = None
    for name, sub in module.named_modules():
        if block is not None and name.startswith(block + "."):
            continue
        block = None
        if name and type(sub).__name__ in no_split:
            units[name] = sub
            block = name
        elif _has_direct_tensors(sub):
            units[name] = sub
    if not units:
        units[""] = module
    return units


def _has_direct_tensors(module: nn.Module) -> bool:
    return bool(module._parameters.keys() - {k for k, v in module._parameters.items() if v is None}) or any(
        v is not None for v in module._buffers.values())


def _unit_tensors(name: str, module: nn.Module, whole: bool) -> list[tuple[str, torch.Tensor, bool]]:
    """(qualified name, tensor, is_param) of the tensors a unit owns: all below it, or only its own."""
    prefix = f"{name}." if name else ""
    params = module.named_parameters(recurse=whole, remove_duplicate=False)
    buffers = module.named_buffers(recurse=whole, remove_duplicate=False)
    return ([(prefix + n, t, True) for n, t in params] + [(prefix + n, t, False) for n, t in buffers])


# -- the meta forward --------------------------------------------------------------------------------


@dataclass
class _Context:
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

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


def _meta_forward(ctx: _Context, example_inputs: Any) -> _recorder.Record:
    """Run the model once on meta tensors and record order, FLOPs and data flow per unit."""
    args, kwargs = _inputs(ctx, example_inputs)
    return _recorder.run(
        ctx.module, ctx.units, args=args, kwargs=kwargs, dtype=ctx.override,
        containers={n for n in ctx.units if _is_container(ctx, n)},
        blocks={n for n in ctx.units if n and _is_block(ctx, n)},
        experts_per_token=lambda experts: _experts_per_token(ctx, experts))


def _inputs(ctx: _Context, example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Meta inputs of the forward: the user's (shapes only) or token ids for transformers models."""
    shape = (ctx.batch_size, ctx.seq_len)
    if example_inputs is not None:
        meta = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                        if isinstance(t, torch.Tensor) else t, example_inputs)
        return ((), dict(meta)) if isinstance(meta, Mapping) else (tuple(meta) if isinstance(meta, (tuple, list))
                                                                  else (meta,), {})
    if ctx.config is not None and hasattr(ctx.module, "main_input_name"):
        ids = torch.zeros(shape, dtype=torch.long, device="meta")
        kwargs: dict[str, Any] = {"input_ids": ids}
        if getattr(ctx.config, "is_encoder_decoder", False):
            kwargs["decoder_input_ids"] = torch.zeros(shape, dtype=torch.long, device="meta")
        if getattr(ctx.config, "use_cache", False) or getattr(ctx.config, "is_encoder_decoder", False):
            kwargs["use_cache"] = False
        return (), kwargs
    first = next((m for m in ctx.module.modules() if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv1d))), None)
    if isinstance(first, nn.Embedding):
        return (torch.zeros(shape, dtype=torch.long, device="meta"),), {}
    if isinstance(first, nn.Linear):
        return (torch.empty((*shape, first.in_features), dtype=ctx.dtype, device="meta"),), {}
    raise TraceError(f"cannot guess the inputs of {type(ctx.module).__name__}: pass example_inputs")


def _experts_per_token(ctx: _Context, experts: nn.Module) -> int:
    for key in ("num_experts_per_tok", "top_k", "moe_topk", "num_experts_per_token"):
        value = getattr(ctx.config, key, None) or getattr(experts, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1


# -- building the graph --------------------------------------------------------------------------------


def _build_graph(ctx: _Context, record: _recorder.Record | None) -> LayerGraph:
    names = list(ctx.units)
    order = [n for n in (record.order if record else []) if n in ctx.units]
    order += [n for n in names if n not in order]
    exec_index = {n: i for i, n in enumerate(order)}
    tied_params, owners = _tied_groups(ctx)
    first_owner = {}
    for name in order:
        for pname in owners[name]:
            first_owner.setdefault(_tie_key(pname, tied_params), name)
    attention = _AttentionFacts(ctx)
    encoder = _encoder_units(ctx)
    digraph = nx.DiGraph()
    for module_index, name in enumerate(names):
        digraph.add_node(name, **_node(ctx, record, name, module_index, exec_index[name], tied_params,
                                       first_owner, attention, encoder))
    dropped = _add_edges(digraph, ctx, record, order, exec_index)
    tied_units = tuple(
        tuple(sorted({_owner_of(p, owners) for p in group} - {None}, key=exec_index.__getitem__))
        for group in tied_params)
    meta = GraphMeta(
        model_name=ctx.name, dtype=str(ctx.dtype).removeprefix("torch."), batch_size=ctx.batch_size,
        seq_len=ctx.seq_len, traced=record is not None,
        is_encoder_decoder=bool(getattr(ctx.config, "is_encoder_decoder", False)),
        tied_param_groups=tuple(tuple(g) for g in tied_params),
        tied_unit_groups=tuple(g for g in tied_units if len(g) > 1), no_split=ctx.no_split,
        extra={**_extra(ctx, record, attention, dropped),
               "total_param_bytes": sum(int(d["param_bytes"]) for _, d in digraph.nodes(data=True)),
               "total_buffer_bytes": sum(int(d["buffer_bytes"]) for _, d in digraph.nodes(data=True))})
    graph = LayerGraph(digraph, meta)
    graph.validate()
    return graph


def _node(ctx: _Context, record: _recorder.Record | None, name: str, module_index: int, exec_index: int,
          tied: list[tuple[str, ...]], first_owner: dict[str, str], attention: _AttentionFacts,
          encoder: set[str]) -> dict[str, Any]:
    module = ctx.units[name]
    tensors = _unit_tensors(name, module, _is_block(ctx, name))
    param_bytes = buffer_bytes = 0
    for qname, tensor, is_param in tensors:
        size = _tensor_bytes(tensor, ctx.override)
        if is_param:
            if first_owner.get(_tie_key(qname, tied)) == name:
                param_bytes += size
        else:
            buffer_bytes += size
    tokens = ctx.tokens
    if record is not None:
        flops = round(record.flops.get(name, 0) / tokens)
        out_bytes = math.ceil(_leaving_bytes(record, name) / tokens)
    else:
        flops = 2 * sum(t.numel() for q, t, p in tensors if p and t.dim() > 1 and not _in_embedding(ctx, q))
        out_bytes = _hidden_size(ctx) * _dtype_bytes(ctx.dtype)
    heads, kv_heads, head_dim, n_self = attention.of(name)
    in_decode = name not in encoder
    has_cache = in_decode and attention.causal
    moe = _moe(ctx, module, name)
    attrs = {
        "module_class": type(module).__name__, "exec_index": exec_index, "module_index": module_index,
        "param_bytes": int(param_bytes), "buffer_bytes": int(buffer_bytes), "flops_per_token": int(flops),
        "attn_flops_per_token_per_ctx": int(n_self * 4 * heads * head_dim),
        "out_bytes_per_token": int(out_bytes),
        "kv_bytes_per_token": int(n_self * 2 * kv_heads * head_dim * _dtype_bytes(ctx.dtype)) if has_cache else 0,
        "moe_num_experts": moe[0], "moe_experts_per_token": moe[1], "moe_expert_bytes": moe[2],
        "param_names": tuple(q for q, _, p in tensors if p), "in_decode": in_decode,
    }
    assert set(attrs) == set(NODE_ATTRIBUTES)
    return attrs


def _leaving_bytes(record: _recorder.Record, name: str) -> int:
    """Bytes of the distinct tensors other units read from ``name``; all its outputs when none are read
    (the last unit's logits). Returned tensors nobody reads (eager attention probabilities) do not count."""
    read: dict[int, int] = {}
    for (src, _dst), tensors in record.edges.items():
        if src == name:
            read.update(tensors)
    return sum(read.values()) if read else record.out_bytes.get(name, 0)


def _in_embedding(ctx: _Context, qname: str) -> bool:
    """An embedding table: looked up, not multiplied (0 FLOPs in the static estimate)."""
    owner = qname.rpartition(".")[0]
    try:
        return isinstance(ctx.module.get_submodule(owner), nn.Embedding)
    except AttributeError:
        return False


def _is_container(ctx: _Context, name: str) -> bool:
    """A unit owning only its direct tensors while other units sit below it (its forward is mostly glue)."""
    return not _is_block(ctx, name) and any(n.startswith(name + ".") or (not name and n) for n in ctx.units)


def _is_block(ctx: _Context, name: str) -> bool:
    """A unit kept whole (owns every tensor below it), as opposed to one owning only its direct tensors."""
    return bool(name) and type(ctx.units[name]).__name__ in ctx.no_split or len(ctx.units) == 1


def _owner_of(pname: str, owners: Mapping[str, list[str]]) -> str | None:
    return next((u for u, names in owners.items() if pname in names), None)


def _tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes once loaded: own dtype, or ``dtype`` for floating tensors (never upcast: accelerate's rule)."""
    size = tensor.element_size()
    if dtype is not None and tensor.is_floating_point():
        size = min(size, _dtype_bytes(dtype))
    return tensor.numel() * size


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _tie_key(pname: str, tied: list[tuple[str, ...]]) -> str:
    return next((g[0] for g in tied if pname in g), pname)


def _tied_groups(ctx: _Context) -> tuple[list[tuple[str, ...]], dict[str, list[str]]]:
    """Tied parameter groups and each unit's parameter names.

    Ties come from object identity (a loaded or ``tie_weights()``-ed model) and from what transformers
    declares: ``all_tied_weights_keys`` / a ``_tied_weights_keys`` dict (transformers 5, whose models
    built on meta are not tied yet) or a ``_tied_weights_keys`` list tied to the input embeddings (v4).
    """
    owners = {name: [q for q, _, p in _unit_tensors(name, module, _is_block(ctx, name)) if p]
              for name, module in ctx.units.items()}
    named = list(ctx.module.named_parameters(remove_duplicate=False))
    by_object: dict[int, list[str]] = defaultdict(list)
    for qname, param in named:
        by_object[id(param)].append(qname)
    links: list[set[str]] = [set(g) for g in by_object.values() if len(g) > 1]
    links += _declared_ties(ctx, named)
    present = {q for q, _ in named}
    return [tuple(sorted(g & present)) for g in _merge(links) if len(g & present) > 1], owners


def _declared_ties(ctx: _Context, named: list[tuple[str, nn.Parameter]]) -> list[set[str]]:
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


def _add_edges(digraph: nx.DiGraph, ctx: _Context, record: _recorder.Record | None, order: list[str],
               exec_index: Mapping[str, int]) -> int:
    """Data-flow edges (traced) or a chain in execution order (fallback); returns dropped back edges."""
    if record is None:
        for src, dst in zip(order, order[1:], strict=False):
            digraph.add_edge(src, dst, bytes_per_token=int(digraph.nodes[src]["out_bytes_per_token"]))
        return 0
    dropped = 0
    for (src, dst), tensors in record.edges.items():
        if exec_index[src] >= exec_index[dst]:
            dropped += 1  # a module run twice (shared embedding) reading a later unit: not a placement edge
            continue
        digraph.add_edge(src, dst, bytes_per_token=int(math.ceil(sum(tensors.values()) / ctx.tokens)))
    return dropped


def _encoder_units(ctx: _Context) -> set[str]:
    """Units that run only inside the encoder of an encoder-decoder model."""
    if not getattr(ctx.config, "is_encoder_decoder", False) or not hasattr(ctx.module, "get_encoder"):
        return set()
    encoder = ctx.module.get_encoder()
    inside = {id(m) for m in encoder.modules()}
    decoder = ctx.module.get_decoder() if hasattr(ctx.module, "get_decoder") else None
    shared = {id(m) for m in decoder.modules()} if decoder is not None else set()
    return {n for n, m in ctx.units.items() if id(m) in inside and id(m) not in shared}


def _moe(ctx: _Context, module: nn.Module, name: str) -> tuple[int, int, int]:
    """(experts, experts per token, bytes of expert weights) of a unit; zeros when it is not MoE."""
    experts = [m for m in module.modules() if _recorder.is_fused_experts(m)]
    if not experts:
        lists = [m for n, m in module.named_modules() if n.endswith("experts") and isinstance(m, nn.ModuleList)]
        if not lists:
            return 0, 0, 0
        count = sum(len(m) for m in lists)
        nbytes = sum(_tensor_bytes(p, ctx.override) for m in lists for p in m.parameters())
        return count, _experts_per_token(ctx, lists[0]), nbytes
    count = max(p.shape[0] for m in experts for p in m._parameters.values() if p is not None and p.dim() == 3)
    nbytes = sum(_tensor_bytes(p, ctx.override) for m in experts for p in m.parameters())
    return int(count), _experts_per_token(ctx, experts[0]), int(nbytes)


class _AttentionFacts:
    """Heads, KV heads and head size of the attention modules each unit owns.

    A unit owns the attention modules inside it; with ``granularity="module"`` (attention split into its
    projections) the last unit registered inside an attention module (its output projection, which also
    receives the glue FLOPs of QK^T and AV) owns it.
    """

    def __init__(self, ctx: _Context) -> None:
        self.ctx = ctx
        module = ctx.module
        can_generate = getattr(module, "can_generate", None)
        # a KV cache exists for generating models, encoder-decoders, and bare decoders (``LlamaModel``)
        self.causal = bool(getattr(ctx.config, "is_encoder_decoder", False) or
                           (callable(can_generate) and can_generate()) or
                           any(getattr(m, "is_causal", False) is True for m in module.modules()))
        self.cross_kv_bytes_per_token = 0
        self.owned: dict[str, list[tuple[str, nn.Module]]] = defaultdict(list)
        blocks = [n for n in ctx.units if _is_block(ctx, n) or not _is_container(ctx, n)]
        for name, attention in _outer_attention(module):
            owner = next((u for u in blocks if name == u or name.startswith(u + ".") or not u), None)
            if owner is None:
                owner = next((u for u in reversed(list(ctx.units)) if u.startswith(name + ".")), None)
            if owner is not None:
                self.owned[owner].append((name, attention))

    def of(self, unit_name: str) -> tuple[int, int, int, int]:
        """(heads, kv heads, head dim, number of self-attention modules) of the unit ``unit_name``."""
        outer = self.owned.get(unit_name, [])
        selfs = [(n, m) for n, m in outer if not _is_cross(n, m)]
        cross = [(n, m) for n, m in outer if _is_cross(n, m)]
        if not outer:
            return 0, 0, 0, 0
        heads, kv_heads, head_dim = self._shape(outer[0][1])
        if cross:
            self.cross_kv_bytes_per_token = 2 * kv_heads * head_dim * _dtype_bytes(self.ctx.dtype) * len(cross)
        return heads, kv_heads, head_dim, len(selfs)

    def _shape(self, attention: nn.Module) -> tuple[int, int, int]:
        config = self.ctx.config
        heads = kv = head_dim = 0
        for sub in attention.modules():
            heads = heads or _first_int(sub, ("num_heads", "n_heads", "num_attention_heads", "n_head"))
            kv = kv or _first_int(sub, ("num_key_value_heads", "num_kv_heads", "n_kv_heads"))
            head_dim = head_dim or _first_int(sub, ("head_dim", "key_value_proj_dim", "attention_head_size"))
            groups = _first_int(sub, ("num_key_value_groups",))
            sub_config = getattr(sub, "config", None)
            heads = heads or _first_int(sub_config, ("num_attention_heads", "num_heads", "n_head"))
            kv = kv or _first_int(sub_config, ("num_key_value_heads",))
            if heads and groups and not kv:
                kv = heads // groups
        heads = heads or _first_int(config, ("num_attention_heads", "num_heads", "n_head"))
        kv = kv or _first_int(config, ("num_key_value_heads", "num_kv_heads")) or heads
        hidden = _hidden_size(self.ctx)
        head_dim = head_dim or _first_int(config, ("head_dim", "d_kv")) or (hidden // heads if heads else 0)
        return heads, kv, head_dim


def _outer_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Outermost modules whose class names say attention (``LlamaAttention``, ``T5LayerCrossAttention``)."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in model.named_modules():
        cls = type(sub).__name__.lower()
        if name and ("attention" in cls or cls.endswith("attn")) and not (
                found and name.startswith(found[-1][0] + ".")):
            found.append((name, sub))
    return found


def _is_cross(name: str, module: nn.Module) -> bool:
    text = (name + type(module).__name__).lower()
    return bool(getattr(module, "is_cross_attention", False)) or "cross" in text or "encdec" in text


def _first_int(obj: Any, keys: tuple[str, ...]) -> int:
    for key in keys:
        value = getattr(obj, key, None) if obj is not None else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _hidden_size(ctx: _Context) -> int:
    value = _first_int(ctx.config, ("hidden_size", "d_model", "n_embd"))
    if value:
        return value
    linear = next((m for m in ctx.module.modules() if isinstance(m, nn.Linear)), None)
    return linear.out_features if linear is not None else 1


def _extra(ctx: _Context, record: _recorder.Record | None, attention: _AttentionFacts, dropped: int) -> dict[str, Any]:
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
            value = _first_int(config, keys)
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
