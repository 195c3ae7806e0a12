"""Turn a model into a :class:`~placement_opt.model.graph.LayerGraph`: ``trace(model) -> LayerGraph``.

The model is never run on real data and its weights are never read or copied: models built from a
config are built on the meta device, and a module given with real weights is copied without its weights
(:func:`placement_opt.model._source.meta_skeleton`: same classes, attributes and shapes, every tensor on
meta) and the copy runs one forward (see :mod:`placement_opt.model._recorder`, which records execution
order, FLOPs and data flow per unit). The module given is never changed, not even for a moment: it may
serve requests in another thread while ``trace`` or ``solve`` runs.

Placement units are the instances of the model's no-split classes (``model._no_split_modules``, e.g.
``LlamaDecoderLayer``, or the user's ``no_split``) plus every module outside them that owns parameters
or buffers itself (embeddings, final norm, ``lm_head``, a rotary embedding's ``inv_freq``). A module
that owns tensors and also has units below it owns only its direct tensors and is charged for the ops
that read them.
With ``granularity="sublayer"`` the no-split instances are replaced by their parts (see :func:`trace`).

Conventions the cost model relies on:

* bytes: parameters and buffers at their own dtype (the config's dtype for a config; with ``dtype=``
  given for a module, floating tensors at that size, never upcast: accelerate's
  ``compute_module_sizes`` rule). Tied parameters are counted once, on the first unit to run.
* ``flops_per_token``: FLOPs of the traced forward / (batch x seq_len), counted by
  ``torch.utils.flop_counter`` formulas (matmuls, convolutions, attention kernels). Attention is traced
  with the implementation the model runs with (a config: sdpa where its class has it); on meta, sdpa
  runs as its math path, so QK^T and AV are visible matmuls either way.
* ``kv_bytes_per_token``: ``2 x kv_heads x head_dim x dtype bytes`` (``kv_heads``: the heads transformers caches,
  every query head for Falcon's new decoder architecture) per self-attention module of units
  (keys and values of their own sizes where the module has ``v_head_dim``; a latent-attention module,
  DeepSeek's, the ``kv_lora_rank + qk_rope_head_dim`` values transformers caches) that run at decode
  time in generating models (decoder-only and the decoder of encoder-decoders);
  encoder-only models and encoders keep no cache. Cross-attention KV of T5-like decoders is reported in
  ``meta.extra["cross_attn_kv_bytes_per_token"]``. A unit whose layers' caches slide (transformers'
  ``DynamicCache`` for the config keeps a window) carries ``kv_window_tokens``. A latent-attention unit
  carries what each decode step spends per cached token re-expanding its latents into keys and values
  (``latent_expand_*``): invisible to a prefill trace, whose context is its own prompt, and at long
  contexts the larger part of the step (DeepSeek-V3: 33.6 MFLOP and 112 KiB per cached token and layer).
* ``decode_workspace_bytes`` (+ ``..._per_ctx``): for units with a KV cache of generating models, what a decode
  step holds while the unit runs, per sequence, measured by meta decode steps after meta prompts of three
  lengths (``_decode_probe.py``; identical layers run once). Absent where the cached forward fails on meta.
* ``ops_per_forward``: the torch ops the traced forward dispatched for the unit (a fused attention call as one; the
  glue ops since the unit before it charged to it, as glue FLOPs are). On a tiny Llama, Mixtral and GPT-2 (eager
  and sdpa) a decoder layer's count is 0-4 under what a real CPU forward dispatches (up to 8 %).
* MoE: fused expert modules (transformers 5 ``MixtralExperts``) are run through ``top_k`` experts' weights
  densely, so their FLOPs are ``top_k / num_experts`` of all experts' dense FLOPs. An experts module given no
  routing (Llama-4's, which transformers runs on every token) counts every expert, and says so in
  ``moe_experts_per_token``.
* Dummy inputs: ``input_ids`` (plus ``decoder_input_ids`` for encoder-decoders), no ``attention_mask``
  (an all-ones mask is the same computation, and masks trigger data-dependent checks on meta).

When the meta forward fails (custom ops, data-dependent control flow), :func:`trace` warns and returns a
static graph of the module tree in registration order (``meta.traced`` is False). When it succeeds but a
module decided a branch on tensor values (``if x.sum() > 0:``), whose values meta tensors do not have,
the branch taken follows a guess and :func:`trace` warns with the unit and the line (transformers' own
mask checks, which the dummy inputs answer correctly, are not reported).

Where the parts live: :mod:`._source` turns the argument into a module, :mod:`._units` finds the
units and their tensors, :mod:`._recorder` runs the meta forward, :mod:`._attention` reads attention
facts, :mod:`._node_attributes` writes each unit's node; this module runs them in order and assembles the
graph.
"""

from __future__ import annotations

import difflib
import itertools
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import networkx as nx
import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import TraceError, first_line
from . import _recorder
from ._attention import AttentionFacts, graph_extra
from ._context import TraceContext, experts_per_token, in_media_encoder, is_block, is_container
from ._decode_probe import decode_lines, probe_contexts
from ._node_attributes import node_attributes
from ._source import resolve_source
from ._units import find_units, groupable, no_split_names, owner_of, tie_key, tied_groups
from .dtypes import dtype_name
from .expert_groups import expert_groups_refusal, split_expert_units
from .graph import GRANULARITIES, GraphMeta, LayerGraph, covering_key

__all__ = ["trace", "GRANULARITIES"]


def _check_whole_experts(module: Any) -> None:
    """Refuse a model whose experts are cut into groups (a model load() built in groups keeps them after remove()):
    it traces as a dense unit that reads every expert on every token, and its plans cannot run on it. Checked by the
    groups' class marker (``runtime._expert_groups``), so that model/ needs nothing from runtime/."""
    cut = sorted({n.rpartition(".groups.")[0] for n, m in module.named_modules()
                  if getattr(type(m), "_expert_group", False)})
    if cut:
        raise TraceError(f"{cut[0]} is cut into expert groups ({len(cut)} such module(s)): a model load() or "
                         f"dispatch() built in groups traces as dense units. Trace its checkpoint (the folder "
                         f"load() read) or the model before it was loaded in groups, with expert_groups=N")


def trace(
    model: Any,
    *,
    batch_size: int = 1,
    seq_len: int = 64,
    dtype: str | torch.dtype | None = None,
    no_split: Iterable[str] | None = None,
    granularity: str = "block",
    example_inputs: tuple[Any, ...] | Mapping[str, Any] | None = None,
    expert_groups: int = 1,
) -> LayerGraph:
    """Trace ``model`` into a layer graph of placement units, without touching any weight data.

    Example::

        >>> from placement_opt import trace
        >>> graph = trace("llama-3-70b")     # a catalog preset, built on meta, nothing allocated
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
            makes every module with its own parameters or buffers a unit. ``"sublayer"`` splits each
            no-split block into its direct children that hold tensors (``input_layernorm``, ``self_attn``,
            ``post_attention_layernorm``, ``mlp``), and an MoE block (a child with an ``experts`` child)
            into its children (router ``gate``, ``experts``, ``shared_expert``...); tensors a block owns
            directly stay in a unit of the block's name. Such units can run on different devices because
            the glue between them (residual adds, routing math) stays on one home device: the attention
            unit holds the KV cache, the experts unit the MoE facts, each unit records the bytes it
            reads (``in_bytes_per_token``) and returns (``out_bytes_per_token``), and edges order the units
            (nothing crosses them but through home; a residual stream comes from its latest producers
            only, not from every earlier unit). Anything coarser is asked for by naming bigger
            container classes in ``no_split``.
        example_inputs: inputs of the forward for plain modules (a tuple of positional arguments or a
            dict of keyword arguments); only shapes and dtypes are used. Default: token ids for
            ``transformers`` models, a ``(batch, seq_len, in_features)`` tensor for modules whose first
            layer is a ``Linear``.
        expert_groups: with ``granularity="sublayer"``, cut each layer's fused experts (transformers 5 MoE
            models) into this many groups of consecutive experts, each a unit of its own
            (``model.layers.3.mlp.experts.groups.0``), so a plan can keep some of a layer's experts on the GPU
            and compute the rest on the CPU (:mod:`placement_opt.model.expert_groups`). Default 1: a layer's
            experts are one unit. More groups than a layer has experts gives one expert per group.

    Returns:
        The :class:`LayerGraph`; ``graph.meta.traced`` is False when the static fallback was used.

    Raises:
        TraceError: the argument is none of the accepted kinds, or the model cannot be built from its
            config. Also a bad ``batch_size``, ``seq_len``, ``granularity`` or ``expert_groups``, or a
            ``no_split`` naming no class the model has.
        ModelSpecError: a name that is no preset, local path or reachable model id, a config that cannot
            be read, or a ``dtype`` (or the config's) that names no torch dtype.
    """
    counts = (batch_size, seq_len)
    if any(not isinstance(n, int) or isinstance(n, bool) for n in counts) or min(counts) < 1:
        raise TraceError(f"batch_size ({batch_size!r}) and seq_len ({seq_len!r}) must both be ints >= 1: they size "
                         f"the dummy inputs of the meta forward; the defaults (1, 64) are enough")
    if isinstance(no_split, str):  # one class name, not its letters
        no_split = [no_split]
    if no_split is not None:
        names = list(no_split) if isinstance(no_split, Iterable) else None
        if names is None or not all(isinstance(n, str) for n in names):
            raise TraceError(f"no_split is {no_split!r}: give module class names to keep whole, e.g. "
                             f"['LlamaDecoderLayer'] (the model's own _no_split_modules when None)")
        no_split = names
    if granularity not in GRANULARITIES:
        raise TraceError(f"granularity {granularity!r} is not one of {', '.join(GRANULARITIES)}")
    _check_expert_groups(expert_groups, granularity)
    module, name, config, torch_dtype, override = resolve_source(model, dtype)
    _check_whole_experts(module)
    _check_no_split_found(module, no_split)
    split = no_split_names(module, no_split, granularity)
    units, whole = find_units(module, split, granularity)
    ctx = TraceContext(module=module, name=name, config=config, dtype=torch_dtype, override=override,
                       batch_size=batch_size, seq_len=seq_len, units=units, no_split=tuple(sorted(split)),
                       granularity=granularity, whole=whole,
                       attn_implementation=_runtime_attention(model, module, config),
                       traced_attention=_own_attention(config, module))
    try:
        record = _meta_forward(ctx, example_inputs)
    except Exception as exc:  # noqa: BLE001 - any failure of a foreign forward means: fall back
        ours = _raised_in_placement_opt(exc)
        advice = (f"The error was raised in placement_opt itself ({ours}): a bug to report, with the model's config"
                  if ours else "If the forward needs other inputs, pass example_inputs (shapes and dtypes are enough) "
                               "to get a traced graph")
        warnings.warn(
            f"placement_opt.trace: the meta forward of {name} failed ({type(exc).__name__}: "
            f"{first_line(exc)}); using a static graph of the module tree in registration order "
            f"(chain edges, FLOPs estimated as 2 x matrix parameters per token). {advice}.",
            RuntimeWarning, stacklevel=2)
        record = None
    if record is not None and record.branches:
        warnings.warn(_branch_message(name, record.branches), UserWarning, stacklevel=2)
    attention = AttentionFacts(ctx)
    encoder = _encoder_units(ctx)
    lines = _decode_lines(ctx, attention, encoder) if record is not None and example_inputs is None else None
    graph = _build_graph(ctx, record, attention, encoder, lines)
    cut = [n for n, m in ctx.units.items() if groupable(m)]
    if expert_groups > 1 and not cut:
        warnings.warn(f"placement_opt.trace: expert_groups={expert_groups} has nothing to cut: {name} has no fused "
                      f"experts module of transformers' experts interface (transformers 5 MoE models have one per "
                      f"layer), so its units are as with expert_groups=1", UserWarning, stacklevel=2)
    return split_expert_units(graph, expert_groups, cut)


def _raised_in_placement_opt(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``exc`` when it is placement_opt's own code (not the model's)."""
    import traceback
    from pathlib import Path

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    package = Path(__file__).resolve().parents[1]
    where = Path(frames[-1].filename).resolve()
    return f"{where.relative_to(package.parent)}:{frames[-1].lineno}" if package in where.parents else None


def _check_no_split_found(module: nn.Module, no_split: list[str] | None) -> None:
    """Refuse class names of which the model has no module: a misspelt layer class kept nothing whole, and the graph
    silently became one of every module with tensors (units that cannot run across devices)."""
    if not no_split:
        return
    present = {type(m).__name__ for m in module.modules()}
    if present & set(no_split):
        return
    own = list(getattr(module, "_no_split_modules", None) or ())
    close = sorted({c for n in no_split for c in difflib.get_close_matches(n, sorted(present), n=1)})
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise TraceError(f"no_split names {', '.join(no_split)}, but {type(module).__name__} has no module of "
                     f"{'that class' if len(no_split) == 1 else 'those classes'}: {hint}its own no-split classes "
                     f"are {own or 'none'}; pass class names of its modules, or no_split=None for its own")


def _check_expert_groups(expert_groups: Any, granularity: str) -> None:
    refusal = expert_groups_refusal(expert_groups, granularity, ("sublayer",))
    if refusal is not None:
        raise TraceError(refusal)


def _branch_message(name: str, branches: Mapping[tuple[str | None, str], Any]) -> str:
    """The warning for data-dependent control flow: which units, where, what was assumed, what to do."""
    shown = [f"unit {unit!r} at {where} (assumed {value!r})" if unit is not None
             else f"the model's own forward, outside every unit, at {where} (assumed {value!r})"
             for (unit, where), value in list(branches.items())[:3]]
    more = f" and {len(branches) - 3} more" if len(branches) > 3 else ""
    return (f"placement_opt.trace: the forward of {name} branches on tensor values in {len(branches)} place(s): "
            f"{'; '.join(shown)}{more}. The trace runs on meta tensors, which have no values, so it followed the "
            f"assumed value and the branch not taken costs nothing in the graph. Make the condition independent "
            f"of tensor values (torch.where, a Python flag, a shape test) so the traced path is the one that runs, "
            f"or check those units' flops_per_token in the graph before trusting the plan")


def _runtime_attention(given: Any, module: nn.Module, config: Any) -> str | None:
    """The attention implementation the model runs with, which decides whether scores are materialised.

    A module runs with its own; a model built here from a config runs with what transformers picks for that
    config: the config's choice, else ``sdpa`` where the class supports it (the trace runs the same, or sdpa
    for another fused kernel: :func:`~._source.resolve_source`).
    """
    if config is None:
        return None
    chosen = getattr(config, "_attn_implementation", None)
    if isinstance(given, nn.Module) or chosen:
        return str(chosen) if chosen else None
    return "sdpa" if getattr(type(module), "_supports_sdpa", False) else "eager"


def _own_attention(config: Any, module: nn.Module) -> str | None:
    """The attention the meta forward runs: the module's own (its config's, set when it was built)."""
    if config is None:
        return None
    chosen = getattr(getattr(module, "config", config), "_attn_implementation", None)
    return str(chosen) if chosen else None


def _logits_unit(ctx: TraceContext) -> str | None:
    """The unit whose output is the logits (the output embeddings' unit), None when the model has none."""
    get = getattr(ctx.module, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None
    if head is None:
        return None
    name = next((n for n, m in ctx.module.named_modules() if m is head), None)
    return covering_key(name, ctx.units) if name is not None else None


def _decode_lines(ctx: TraceContext, attention: AttentionFacts, encoder: set[str]) -> dict[str, tuple[int, int]] | None:
    """What a decode step holds per unit (:mod:`._decode_probe`), for a generating model with a cache; None where
    it has none, or its cached forward fails on meta (the cost model keeps its estimate from the prefill)."""
    config = ctx.config
    if config is None or getattr(config, "is_encoder_decoder", False) or not attention.causal:
        return None
    # the units with a cache of their own: the first of them to run starts the figures of all (_decode_probe)
    hooked = {n: m for n, m in ctx.units.items()
              if n and not is_container(ctx, n) and n not in encoder and attention.of(n)[1]}
    if not hooked:
        return None
    state = None if _all_meta(ctx) and ctx.override is None else _recorder.meta_state(ctx.module, ctx.override)
    windows = [attention.kv_window(n) for n in ctx.units]
    contexts = probe_contexts(min((w for w in windows if w), default=None))
    try:
        return decode_lines(ctx.module, hooked, state=state, contexts=contexts, blocks=_outer_blocks(ctx),
                            experts_per_token=lambda experts: experts_per_token(ctx, experts))
    except Exception as exc:  # noqa: BLE001 - a forward with a cache that fails on meta: no lines, the estimate stays
        if (ours := _raised_in_placement_opt(exc)) is not None:
            warnings.warn(f"placement_opt.trace: the meta decode steps of {ctx.name} failed in placement_opt itself "
                          f"({ours}: {type(exc).__name__}: {first_line(exc)}): a bug to report, with the model's "
                          f"config; decode memory is estimated from the prefill", RuntimeWarning, stacklevel=3)
        return None


def _outer_blocks(ctx: TraceContext) -> dict[str, nn.Module]:
    """The outermost modules of the no-split classes (decoder layers), in registration order; at module granularity,
    which keeps none whole, of the model's own (``layer_classes``): the decode probe runs two of each kind (a
    module-level Llama-3-8B trace spent 2.4 s of 3.1 probing all 32 layers at four contexts)."""
    classes = ctx.no_split or ctx.layer_classes
    blocks: dict[str, nn.Module] = {}
    for name, module in ctx.module.named_modules():
        if type(module).__name__ in classes and not any(name.startswith(b + ".") for b in blocks):
            blocks[name] = module
    return blocks


def _meta_forward(ctx: TraceContext, example_inputs: Any) -> _recorder.Record:
    """Run the model once on meta tensors and record order, FLOPs and data flow per unit."""
    args, kwargs = _inputs(ctx, example_inputs)
    return _recorder.run(
        ctx.module, ctx.units, args=args, kwargs=kwargs, dtype=ctx.override,
        containers={n for n in ctx.units if is_container(ctx, n)},
        blocks={n for n in ctx.units if n and is_block(ctx, n)},
        experts_per_token=lambda experts: experts_per_token(ctx, experts),
        # ours alone (a meta copy, or built from a config) and all on meta: no stand-ins needed
        private=_all_meta(ctx),
        seq_len=ctx.seq_len, frontier=ctx.granularity == "sublayer")


def _all_meta(ctx: TraceContext) -> bool:
    """Whether every parameter and buffer of the module is on meta (ours alone: a meta copy, or built from a config)."""
    return all(t.device.type == "meta" for t in itertools.chain(ctx.module.parameters(), ctx.module.buffers()))


def _inputs(ctx: TraceContext, example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
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


def _build_graph(ctx: TraceContext, record: _recorder.Record | None, attention: AttentionFacts, encoder: set[str],
                 lines: dict[str, tuple[int, int]] | None = None) -> LayerGraph:
    names = list(ctx.units)
    order = [n for n in (record.order if record else []) if n in ctx.units]
    order += [n for n in names if n not in order]
    exec_index = {n: i for i, n in enumerate(order)}
    tied_params, owners = tied_groups(ctx)
    first_owner = {}
    for name in order:
        for pname in owners[name]:
            first_owner.setdefault(tie_key(pname, tied_params), name)
    digraph = nx.DiGraph()
    for module_index, name in enumerate(names):
        digraph.add_node(name, **node_attributes(ctx, record, name, module_index, exec_index[name], tied_params,
                                                 first_owner, attention, encoder, (lines or {}).get(name)))
    dropped = _add_edges(digraph, ctx, record, order, exec_index)
    tied_units = tuple(
        tuple(sorted({owner_of(p, owners) for p in group} - {None}, key=exec_index.__getitem__))
        for group in tied_params)
    meta = GraphMeta(
        model_name=ctx.name, dtype=dtype_name(ctx.dtype), batch_size=ctx.batch_size,
        seq_len=ctx.seq_len, traced=record is not None,
        is_encoder_decoder=bool(getattr(ctx.config, "is_encoder_decoder", False)),
        tied_param_groups=tuple(tuple(g) for g in tied_params),
        tied_unit_groups=tuple(g for g in tied_units if len(g) > 1), no_split=ctx.no_split,
        extra={**graph_extra(ctx, record, attention, dropped), **_runtime_extra(ctx, record),
               "total_param_bytes": sum(int(d["param_bytes"]) for _, d in digraph.nodes(data=True)),
               "total_buffer_bytes": sum(int(d["buffer_bytes"]) for _, d in digraph.nodes(data=True))})
    graph = LayerGraph(digraph, meta)
    graph.validate()
    return graph


def _runtime_extra(ctx: TraceContext, record: _recorder.Record | None) -> dict[str, str | int]:
    """What the cost model must know of how the model runs: its attention, its logits unit and the activation
    bytes per token alive when that unit starts (they scale with the prompt when only the last logits are kept;
    what the unit and the glue after it add scales with the positions kept)."""
    extra: dict[str, str | int] = {}
    if ctx.attn_implementation is not None:
        extra["attn_implementation"] = ctx.attn_implementation
    if ctx.traced_attention is not None:
        extra["traced_attention"] = ctx.traced_attention
    logits = _logits_unit(ctx)
    if logits is not None:
        extra["logits_unit"] = logits
        if record is not None and logits in record.entry_bytes:
            extra["logits_entry_bytes_per_token"] = math.ceil(record.entry_bytes[logits] / ctx.tokens)
    return extra


def _add_edges(digraph: nx.DiGraph, ctx: TraceContext, record: _recorder.Record | None, order: list[str],
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


def _encoder_units(ctx: TraceContext) -> set[str]:
    """Units that run only inside the encoder of an encoder-decoder model, or a multimodal model's media encoder."""
    media = {n for n in ctx.units if in_media_encoder(n)}
    if not getattr(ctx.config, "is_encoder_decoder", False) or not hasattr(ctx.module, "get_encoder"):
        return media
    encoder = ctx.module.get_encoder()
    inside = {id(m) for m in encoder.modules()}
    decoder = ctx.module.get_decoder() if hasattr(ctx.module, "get_decoder") else None
    shared = {id(m) for m in decoder.modules()} if decoder is not None else set()
    return media | {n for n, m in ctx.units.items() if id(m) in inside and id(m) not in shared}
