"""Turn a model into a :class:`~placement_opt.graph.LayerGraph` with one forward pass on meta tensors.

The model is never run on real data and its weights are never read or copied: every parameter and
buffer is replaced by a meta tensor of the same shape for the duration of one forward
(``torch.func.functional_call``), and models built from a config are built on the meta device to
begin with. A ``TorchDispatchMode`` watches every aten op of that forward to

* count FLOPs with ``torch.utils.flop_counter``'s formulas, charged to the placement unit running the op;
* follow tensor provenance: each tensor remembers which unit produced it (glue code between units
  passes provenance through), so an op inside unit B reading a tensor made by unit A is an edge A -> B,
  however the tensor travelled (positional or keyword argument, tuple, rotary ``(cos, sin)``,
  encoder hidden states, a bias computed by the first T5 block and reused by the others).

Module hooks on the units record the execution order and the bytes each unit returns.
When the meta forward fails (custom ops, data-dependent control flow), :func:`trace` warns and falls
back to a static graph of the module tree in registration order.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.flop_counter import flop_registry

from .errors import TraceError
from .graph import NODE_ATTRIBUTES, GraphMeta, LayerGraph

__all__ = ["trace", "GRANULARITIES"]

#: ``"block"``: no-split blocks are kept whole (default); ``"module"``: every module with its own
#: parameters or buffers is a unit, no-split classes are ignored (finest; a coarser graph is obtained
#: by naming container classes in ``no_split``).
GRANULARITIES = ("block", "module")

_ENCODER_ONLY_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
                       "deberta-v2", "camembert", "mpnet", "modernbert", "ernie"}
_META_OPS = {torch.ops.aten.sym_size.default, torch.ops.aten.sym_stride.default, torch.ops.aten.size.default,
             torch.ops.aten.stride.default, torch.ops.aten.dim.default, torch.ops.aten.numel.default,
             torch.ops.aten.is_contiguous.default, torch.ops.aten.sym_numel.default,
             torch.ops.aten.storage_offset.default, torch.ops.prim.layout.default}


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
            name of :mod:`placement_opt.models`, a path to a ``config.json`` or to a directory holding one,
            or a Hugging Face model id (only its config is fetched).
        batch_size: batch of the traced forward.
        seq_len: tokens per sequence of the traced forward; ``flops_per_token`` is measured at this length.
        dtype: weight dtype the byte counts assume (``"float16"``, ``torch.bfloat16``). Default: the
            config's ``dtype``/``torch_dtype`` for configs (float16 when absent), the parameters' own dtype
            for modules. Floating tensors are counted at this size, integer buffers at their own.
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
                   batch_size=batch_size,
                   seq_len=seq_len, units=units, no_split=tuple(sorted(split)))
    try:
        record = _meta_forward(ctx, example_inputs)
    except Exception as exc:  # noqa: BLE001 - any failure of a foreign forward means: fall back
        warnings.warn(
            f"placement_opt.trace: the meta forward of {name} failed ({type(exc).__name__}: "
            f"{_first_line(exc)}); using a static graph of the module tree in registration order "
            f"(chain edges, FLOPs estimated as 2 x parameters per token). Pass example_inputs or a "
            f"no_split set that hides the failing module to get a traced graph.",
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
            f"of placement_opt.models, a config.json path or a model id")
    text = os.fspath(model)
    from . import models

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

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


@dataclass
class _Record:
    """What the meta forward observed."""

    order: list[str] = field(default_factory=list)
    flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    out_bytes: dict[str, int] = field(default_factory=dict)
    edges: dict[tuple[str, str], dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    guessed_scalars: int = 0
    glue_flops: int = 0
    replayed_blocks: int = 0


class _Recorder(TorchDispatchMode):
    """Counts FLOPs per unit and follows which unit produced every tensor."""

    def __init__(self, record: _Record, param_owner: dict[int, str]) -> None:
        super().__init__()
        self.record = record
        self.param_owner = param_owner
        """id of a direct tensor of a container unit (a unit with units below it) -> that unit."""
        self.stack: list[str] = []
        self.producers: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        self.pending_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _META_OPS:
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._guess_scalar(args[0])
        if func._overloadpacket not in flop_registry and func is not torch.ops.prim.device.default:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        current = self._current(inputs, out)
        packet = func._overloadpacket
        if packet in flop_registry:
            self._charge(current, int(flop_registry[packet](*args, **kwargs, out_val=out)))
        self._follow(current, inputs, out)
        return out

    def _current(self, inputs: list[torch.Tensor], out: Any) -> str | None:
        """The unit running this op: the innermost hooked unit, else a container whose own tensor it reads."""
        if self.stack:
            return self.stack[-1]
        owner = next((self.param_owner[id(t)] for t in inputs if id(t) in self.param_owner), None)
        if owner is not None:
            self._start(owner)
            self.record.out_bytes[owner] = sum(_nbytes(t) for t in _tensors(out))
        return owner

    def _guess_scalar(self, tensor: torch.Tensor) -> Any:
        # data-dependent checks (`mask.all()`, `x.max().item()`): assume the common, dense case
        self.record.guessed_scalars += 1
        if tensor.dtype == torch.bool:
            return True
        return 1 if not tensor.is_floating_point() else 0.0

    def _charge(self, current: str | None, flops: int) -> None:
        if current is not None:
            self.record.flops[current] += flops
        else:
            self.pending_flops += flops

    def _follow(self, current: str | None, inputs: list[torch.Tensor], out: Any) -> None:
        sources: set[str] = set()
        for tensor in inputs:
            entry = self.producers.get(id(tensor))
            if entry is None or entry[0] is not tensor:
                continue
            for unit in entry[1]:
                if current is not None and unit != current:
                    self.record.edges[(unit, current)][id(tensor)] = _nbytes(tensor)
                sources.add(unit)
        made = frozenset({current}) if current is not None else frozenset(sources)
        if made:
            for tensor in _tensors(out):
                self.producers[id(tensor)] = (tensor, made)

    def _start(self, name: str) -> None:
        """First time ``name`` runs: give it the next execution index and the glue FLOPs before it."""
        if name not in self.record.flops:
            self.record.flops[name] = 0
            self.record.order.append(name)
        if self.pending_flops:
            self.record.flops[name] += self.pending_flops
            self.record.glue_flops += self.pending_flops
            self.pending_flops = 0

    # -- module hooks --
    def enter(self, name: str) -> None:
        self._start(name)
        self.stack.append(name)

    def leave(self, name: str, output: Any) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        if name not in self.record.out_bytes:
            seen: dict[int, int] = {id(t): _nbytes(t) for t in _tensors(output)}
            self.record.out_bytes[name] = sum(seen.values())
        made = frozenset({name})
        for tensor in _tensors(output):
            if id(tensor) not in self.producers:
                self.producers[id(tensor)] = (tensor, made)


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    out: list[torch.Tensor] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif hasattr(leaf, "to_tuple"):  # transformers ModelOutput
            out.extend(_tensors(leaf.to_tuple()))
    return out


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _meta_forward(ctx: _Context, example_inputs: Any) -> _Record:
    record = _Record()
    args, kwargs = _inputs(ctx, example_inputs)
    state = _meta_state(ctx.module, ctx.override)
    containers = {n for n in ctx.units if _is_container(ctx, n)}
    param_owner = {id(state[q]): n for n in containers
                   for q, _, _ in _unit_tensors(n, ctx.units[n], False) if q in state}
    recorder = _Recorder(record, param_owner)
    handles = []
    for name, sub in ctx.units.items():
        if name in containers:
            continue
        handles.append(sub.register_forward_pre_hook(lambda _m, _a, n=name: recorder.enter(n)))
        handles.append(sub.register_forward_hook(lambda _m, _a, out, n=name: recorder.leave(n, out)))
    restore = _stand_in_experts(ctx)
    replay = _BlockReplay(recorder)
    if REPLAY_REPEATED_BLOCKS:
        for name, sub in ctx.units.items():
            if _is_block(ctx, name) and name:
                replay.patch(name, sub)
    was_training = ctx.module.training
    try:
        ctx.module.eval()
        with torch.no_grad(), recorder:
            torch.func.functional_call(ctx.module, state, args, kwargs, tie_weights=False, strict=False)
        if recorder.pending_flops and record.order:
            record.flops[record.order[-1]] += recorder.pending_flops
            record.glue_flops += recorder.pending_flops
    finally:
        ctx.module.train(was_training)
        for handle in handles:
            handle.remove()
        replay.restore()
        restore()
    record.replayed_blocks = replay.replayed
    return record


#: Run only the first block of each signature for real; later identical blocks replay its record.
REPLAY_REPEATED_BLOCKS = True

_PRIMITIVES = (int, float, bool, str, type(None))


@dataclass
class _Learned:
    """What one real run of a block did, enough to replay it for an identical block."""

    flops: int
    consumed: list[int]
    """Positions of the input tensors its ops read (the edges a replay must draw)."""
    outputs: list[int | tuple[tuple[int, ...], torch.dtype]]
    """Per output tensor: the position of the input it passes through, or (shape, dtype) of a new one."""
    spec: Any


class _BlockReplay:
    """Replays identical blocks: same class, attributes, parameter and input shapes -> same FLOPs and outputs.

    A 126-layer model then costs two real block forwards on meta instead of 126; the edges are still drawn
    per block from the producers of the tensors each block actually receives.
    """

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder
        self.cache: dict[Any, _Learned | None] = {}
        self.patched: list[nn.Module] = []
        self.replayed = 0

    def patch(self, name: str, module: nn.Module) -> None:
        static = _static_signature(module)
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            key = (static, _input_signature(args, kwargs))
            learned = self.cache.get(key)
            if learned is not None:
                self.replayed += 1
                return self._replay(name, learned, args, kwargs)
            before = self.recorder.record.flops.get(name, 0)
            out = original(*args, **kwargs)
            if key not in self.cache:
                self.cache[key] = self._learn(name, args, kwargs, out, self.recorder.record.flops[name] - before)
            return out

        module.forward = forward
        self.patched.append(module)

    def restore(self) -> None:
        for module in self.patched:
            del module.forward

    def _learn(self, name: str, args: Any, kwargs: Any, out: Any, flops: int) -> _Learned | None:
        inputs = _tensors((args, kwargs))
        leaves, spec = tree_flatten(out)
        if any(not isinstance(leaf, (torch.Tensor, *_PRIMITIVES)) for leaf in leaves):
            return None  # caches or other objects with side effects: always run for real
        read = {tid for (_src, dst), tensors in self.recorder.record.edges.items() if dst == name for tid in tensors}
        consumed = [i for i, t in enumerate(inputs) if id(t) in read]
        outputs: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                same = next((i for i, t in enumerate(inputs) if t is leaf), None)
                outputs.append(same if same is not None else (tuple(leaf.shape), leaf.dtype))
            else:
                outputs.append(("value", leaf))
        return _Learned(flops=flops, consumed=consumed, outputs=outputs, spec=spec)

    def _replay(self, name: str, learned: _Learned, args: Any, kwargs: Any) -> Any:
        recorder = self.recorder
        inputs = _tensors((args, kwargs))
        recorder.record.flops[name] += learned.flops
        for i in learned.consumed:
            tensor = inputs[i]
            entry = recorder.producers.get(id(tensor))
            if entry is not None and entry[0] is tensor:
                for unit in entry[1] - {name}:
                    recorder.record.edges[(unit, name)][id(tensor)] = _nbytes(tensor)
        leaves: list[Any] = []
        for item in learned.outputs:
            if isinstance(item, int):
                leaves.append(inputs[item])
            elif item[0] == "value":
                leaves.append(item[1])
            else:
                tensor = torch.empty(item[0], dtype=item[1], device="meta")
                recorder.producers[id(tensor)] = (tensor, frozenset({name}))
                leaves.append(tensor)
        return tree_unflatten(leaves, learned.spec)


def _static_signature(module: nn.Module) -> tuple[Any, ...]:
    """Class, plain attributes (except indices) and tensor shapes of every submodule."""
    parts = []
    for sub_name, sub in module.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items()
                             if isinstance(v, _PRIMITIVES) and not k.startswith("_") and "idx" not in k
                             and "index" not in k))
        tensors = tuple((k, tuple(t.shape), t.dtype) for k, t in (*sub._parameters.items(), *sub._buffers.items())
                        if t is not None)
        parts.append((sub_name, type(sub).__name__, attrs, tensors))
    return tuple(parts)


def _input_signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    leaves, spec = tree_flatten((args, kwargs))
    items = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor)
                  else (type(x).__name__, x if isinstance(x, _PRIMITIVES) else id(x)) for x in leaves)
    return (str(spec), items)


def _meta_state(module: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """A meta stand-in for every parameter and buffer (floating ones in ``dtype`` if given); no data is read."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in list(module.named_parameters(remove_duplicate=False)) + list(
            module.named_buffers(remove_duplicate=False)):
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        state[name] = torch.empty(tensor.shape, dtype=target, device="meta")
    return state


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


def _stand_in_experts(ctx: _Context):  # noqa: ANN202
    """Replace fused MoE expert modules by a shape-correct dense stand-in for the meta forward.

    Fused experts (transformers 5 ``MixtralExperts``: 3D weights ``[num_experts, out, in]``) route tokens
    with data-dependent ops (``nonzero``) that cannot run on meta tensors. The stand-in sends every
    token through ``top_k`` experts' weights, so the FLOPs counted are exactly ``top_k / num_experts`` of
    all experts' dense FLOPs: what a routed forward computes on average.
    """
    patched: list[nn.Module] = []
    for sub in ctx.module.modules():
        if _is_fused_experts(sub):
            top_k = _experts_per_token(ctx, sub)
            sub.forward = _dense_experts(sub, top_k)  # instance attribute, removed again below
            patched.append(sub)

    def restore() -> None:
        for sub in patched:
            del sub.forward
    return restore


def _is_fused_experts(module: nn.Module) -> bool:
    params = [p for p in module._parameters.values() if p is not None]
    return type(module).__name__.endswith("Experts") and any(p.dim() == 3 for p in params)


def _experts_per_token(ctx: _Context, experts: nn.Module) -> int:
    for key in ("num_experts_per_tok", "top_k", "moe_topk", "num_experts_per_token"):
        value = getattr(ctx.config, key, None) or getattr(experts, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1


def _dense_experts(module: nn.Module, top_k: int):  # noqa: ANN202
    act = getattr(module, "act_fn", torch.nn.functional.silu)

    def forward(hidden_states: torch.Tensor, *_args: Any, **_kwargs: Any) -> torch.Tensor:
        # read the parameters at call time: functional_call has swapped in their meta stand-ins
        weights = [p for p in module._parameters.values() if p is not None and p.dim() == 3]
        total = torch.zeros_like(hidden_states)
        for k in range(top_k):
            h = hidden_states
            for i, w in enumerate(weights):
                h = _apply_expert_weight(h, w[k % w.shape[0]], act, last=i == len(weights) - 1)
            if h.shape == total.shape:
                total = total + h
        return total
    return forward


def _apply_expert_weight(h: torch.Tensor, w: torch.Tensor, act: Any, *, last: bool) -> torch.Tensor:
    if w.shape[-1] != h.shape[-1] and w.shape[0] == h.shape[-1]:
        w = w.t()
    elif w.shape[-1] != h.shape[-1] and w.shape[-1] * 2 == h.shape[-1]:
        gate, up = h.chunk(2, dim=-1)
        h = act(gate) * up
    elif w.shape[-1] != h.shape[-1] and w.shape[0] * 2 == h.shape[-1]:
        gate, up = h.chunk(2, dim=-1)
        h, w = act(gate) * up, w.t()
    return torch.nn.functional.linear(h, w)


# -- building the graph --------------------------------------------------------------------------------


def _build_graph(ctx: _Context, record: _Record | None) -> LayerGraph:
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


def _node(ctx: _Context, record: _Record | None, name: str, module_index: int, exec_index: int,
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


def _leaving_bytes(record: _Record, name: str) -> int:
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
    """Tied parameter groups (shared objects plus transformers' declared ties) and each unit's params."""
    owners: dict[str, list[str]] = {}
    by_object: dict[int, list[str]] = defaultdict(list)
    for name, module in ctx.units.items():
        owners[name] = [q for q, _, p in _unit_tensors(name, module, _is_block(ctx, name)) if p]
    for qname, param in ctx.module.named_parameters(remove_duplicate=False):
        by_object[id(param)].append(qname)
    links: list[set[str]] = [set(g) for g in by_object.values() if len(g) > 1]
    declared = getattr(ctx.module, "all_tied_weights_keys", None) or getattr(ctx.module, "_tied_weights_keys", None)
    if isinstance(declared, Mapping) and (getattr(ctx.config, "tie_word_embeddings", True) or
                                          getattr(ctx.module, "all_tied_weights_keys", None)):
        links += [{str(k), str(v)} for k, v in declared.items()]
    known = {q for names in owners.values() for q in names} | {q for g in links for q in g}
    groups = _merge(links)
    all_names = set(dict(ctx.module.named_parameters(remove_duplicate=False)))
    result = [tuple(sorted(g & all_names)) for g in groups if len(g & all_names & known) > 1]
    return result, owners


def _merge(sets: list[set[str]]) -> list[set[str]]:
    merged: list[set[str]] = []
    for group in sets:
        overlapping = [m for m in merged if m & group]
        for m in overlapping:
            merged.remove(m)
            group = group | m
        merged.append(group)
    return merged


def _add_edges(digraph: nx.DiGraph, ctx: _Context, record: _Record | None, order: list[str],
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
    experts = [m for m in module.modules() if _is_fused_experts(m)]
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
        self.causal = bool(getattr(ctx.config, "is_encoder_decoder", False) or
                           (callable(can_generate) and can_generate()))
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


def _extra(ctx: _Context, record: _Record | None, attention: _AttentionFacts, dropped: int) -> dict[str, Any]:
    config = ctx.config
    extra: dict[str, Any] = {"module_class": type(ctx.module).__name__, "num_units": len(ctx.units)}
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
                          "sliding_window": ("sliding_window",)}.items():
            value = _first_int(config, keys)
            if value:
                extra[key] = value
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
