"""The argument of :func:`~placement_opt.model.tracer.trace` -> a module (built on meta), its name, config, dtype.

A module given with real weights is never traced itself: :func:`meta_skeleton` copies its tree with
every parameter and buffer replaced by a meta tensor of the same shape and dtype (no weight is read or
copied), and the forward runs on the copy. Hooks, eval mode, stand-ins and swapped tensors then touch
only the copy, so a model may serve requests in another thread while it is traced.
"""

from __future__ import annotations

import copy
import difflib
import os
import socket
import urllib.parse
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelSpecError, TraceError, first_line
from ._ties import untie_stored_apart
from .dtypes import as_torch_dtype, config_dtype, module_dtype

__all__ = ["resolve_source", "config_of", "meta_skeleton"]


_ENCODER_ONLY_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
                       "deberta-v2", "camembert", "mpnet", "modernbert", "ernie", "bert-generation"}


def _is_encoder(config: Any) -> bool:
    """An encoder-only config: BERT's family, by name or by having a masked-LM class, unless it says ``is_decoder``.

    Their causal-LM classes (``XLMRobertaXLForCausalLM``, ``RoFormerForCausalLM``) run bidirectionally without a
    cache unless ``is_decoder`` is set: built as one, an encoder got an LM head and a KV cache it never keeps
    (``ReformerModelWithLMHead`` refuses to be built at all).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_decoder", False) is True:
        return False
    return model_type in _ENCODER_ONLY_TYPES or model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def resolve_source(model: Any, dtype: str | torch.dtype | None
             ) -> tuple[nn.Module, str, Any, torch.dtype, torch.dtype | None]:
    """(module, name, config or None, graph dtype, dtype to count floating tensors in or None for their own)."""
    if isinstance(model, nn.Module):
        model = _compiled_original(model)
        config = getattr(model, "config", None)
        name = getattr(config, "name_or_path", "") or type(model).__name__
        if dtype is None:
            return meta_skeleton(model), name, config, module_dtype(model), None
        return meta_skeleton(model), name, config, as_torch_dtype(dtype), as_torch_dtype(dtype)
    config = _as_config(model)
    torch_dtype = as_torch_dtype(dtype) if dtype is not None else config_dtype(config)
    name = getattr(config, "name_or_path", "") or type(config).__name__
    return _build_on_meta(config, torch_dtype), name, config, torch_dtype, None


def _compiled_original(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (its ``_orig_mod``), which the compiled one runs: the wrapper's forward is an
    instance attribute the meta copy drops, so it fell back to a static graph with every unit named ``_orig_mod.``...,
    names no checkpoint or ``from_pretrained`` device map has."""
    while type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def config_of(name: str | os.PathLike[str]) -> Any:
    """The transformers config a preset name, a local config.json or model directory, or a cached model id names.

    Raises:
        ModelSpecError: it names none of these (the message lists what is accepted).
    """
    return _as_config(name)


#: Config fields that count layers, under the names transformers' configs give them.
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def check_layer_counts(config: Any, where: str) -> Any:
    """``config``, refused when it counts a negative number of layers (``where`` names it in the message); a
    transformers config takes any int there and builds a model without layers."""
    for name in LAYER_COUNTS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ModelSpecError(f"{where} has {name}={value}: a model has 0 or more layers; fix the value there")
    return config


def _as_config(model: Any) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return check_layer_counts(model, f"the {type(model).__name__} given")
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
        folder = path.parent if path.is_file() and path.name == "config.json" else path
        try:
            config = AutoConfig.from_pretrained(folder)
        except Exception as exc:
            raise ModelSpecError(f"cannot read a transformers config from {text!r}: {first_line(exc)}") from None
        # a checkpoint beside it may say the config's ties are wrong
        return check_layer_counts(untie_stored_apart(config, folder), repr(text))
    try:
        return AutoConfig.from_pretrained(text, local_files_only=True)  # the hub cache first
    except Exception:  # noqa: BLE001 - not cached: ask the hub below
        pass
    if not _hub_reachable():  # fail fast: the hub client would retry for about 25 s
        close = difflib.get_close_matches(text.strip().lower(), models.list_models(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelSpecError(
            f"{text!r} is not a preset, not a local path, and not in the Hugging Face cache, and the hub cannot "
            f"be reached (offline or HF_HUB_OFFLINE=1): {hint}accepted are a preset "
            f"({', '.join(models.list_models())}), a local config.json or a directory holding one, a cached "
            f"model id, or a transformers config object")
    try:
        return AutoConfig.from_pretrained(text)
    except Exception as exc:
        raise ModelSpecError(
            f"{text!r} is not a preset ({', '.join(models.list_models())}), not a local path, and fetching its "
            f"config.json from the Hugging Face hub failed ({first_line(exc)}): pass a local config.json, a "
            f"directory holding one, or a transformers config object") from None


def _hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connect within ``timeout_s`` (False when offline mode is set)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urllib.parse.urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _build_on_meta(config: Any, torch_dtype: torch.dtype) -> nn.Module:
    """Instantiate the right Auto class on the meta device: no weight is allocated. The attention is the one the
    model runs with, or sdpa for another fused kernel (flash attention needs its package, and both hold no
    scores): the trace then sees the masks that attention builds, and on meta sdpa runs as its math path, so
    its matmuls are counted as eager's are."""
    import transformers

    config = copy.deepcopy(config)  # from_config writes its dtype into the config
    if getattr(config, "is_encoder_decoder", False):
        auto = transformers.AutoModelForSeq2SeqLM
    elif _is_encoder(config):
        auto = transformers.AutoModel
    else:
        auto = transformers.AutoModelForCausalLM
    try:
        with torch.device("meta"):
            # a multimodal config (LLaVA, Qwen2-VL) has no causal-LM class: its image-text one has the LM head
            image_text = getattr(transformers, "AutoModelForImageTextToText", None)
            for attempt in (a for a in (auto, image_text) if a is not None):
                try:
                    return _from_config(attempt, config, torch_dtype)
                except ValueError:
                    continue
            return _from_config(transformers.AutoModel, config, torch_dtype)
    except Exception as exc:
        if negative := _negative_sizes(config, exc):  # a hand-edited config.json, not a model to build by hand
            raise ModelSpecError(f"{type(config).__name__} has negative sizes ({negative}), and a model cannot be "
                                 f"built with them ({first_line(exc)}): fix them in its config.json") from None
        raise TraceError(
            f"cannot build {type(config).__name__} on the meta device ({first_line(exc)}): build the model "
            f"yourself (e.g. under `with torch.device('meta')`) and pass the nn.Module") from None


def _negative_sizes(config: Any, exc: Exception) -> str:
    """``name=value`` of the config's negative integers, where building failed on a negative dimension; else ''."""
    if "negative dimension" not in str(exc):
        return ""
    fields = config.to_dict() if hasattr(config, "to_dict") else {}
    return ", ".join(f"{k}={v}" for k, v in fields.items() if type(v) is int and v < 0)


def _from_config(auto: Any, config: Any, torch_dtype: torch.dtype) -> nn.Module:
    """``auto.from_config`` with the attention the model runs with where it is eager, else sdpa where the
    class has it, else eager (what transformers picks for a class without sdpa)."""
    if getattr(config, "_attn_implementation", None) != "eager":
        try:
            return auto.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
        except ValueError as exc:
            if "scaled_dot_product_attention" not in str(exc):
                raise  # not the attention: the caller tries the next Auto class
    return auto.from_config(config, dtype=torch_dtype, attn_implementation="eager")


#: Per-instance state of ``nn.Module`` that the copy gets empty: hooks run the caller's code, not the model's.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
#: Instance attributes that wrap or point at the live model (dispatch wrappers, accelerate hooks): dropped,
#: so the copy runs its class's own forward on its own (meta) tensors.
_LIVE_ATTRIBUTES = ("forward", "_old_forward", "_hf_hook", "_placement_opt_dispatch")
#: What ``nn.Module.__init__`` puts in every instance's ``__dict__`` (never a reference to another module).
_MODULE_STATE = frozenset(nn.Module().__dict__)


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s tree whose parameters and buffers are meta tensors of the same shape and dtype.

    Every module is a new instance of its class sharing the original's plain attributes (config,
    sizes); ``_parameters``, ``_buffers``, ``_modules`` and the hook registries are its own, so
    whatever the trace does to the copy (hooks, ``eval()``, patched forwards) leaves the original as
    it was. Tied tensors stay tied (one meta tensor per original tensor); instance-level forwards
    and accelerate hooks are dropped. No weight memory is read or allocated.
    """
    copier = _MetaCopier()
    skeleton = copier.copy_tree(module)
    copier.repoint_references()
    return skeleton


class _MetaCopier:
    """The state of one :func:`meta_skeleton` copy: every original tensor and module is copied once,
    so tied tensors and modules reachable twice stay shared in the copy."""

    _META = torch.device("meta")

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.copies: dict[int, nn.Module] = {}
        #: (copied module, attribute) of every unregistered module reference, repointed at the end.
        self.references: list[tuple[nn.Module, str]] = []

    def meta(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """The meta tensor standing for ``tensor`` (a parameter stays a parameter)."""
        if tensor is None:
            return None
        out = self.tensors.get(id(tensor))
        if out is None:
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self._META)
            if isinstance(tensor, nn.Parameter):
                out = nn.Parameter(out, requires_grad=tensor.requires_grad)
            self.tensors[id(tensor)] = out
        return out

    def copy_tree(self, original: nn.Module) -> nn.Module:
        """The copy of ``original`` and, recursively, of its submodules."""
        done = self.copies.get(id(original))
        if done is not None:
            return done
        clone = type(original).__new__(type(original))
        self.copies[id(original)] = clone
        state = self._state_of(original)
        clone.__dict__.update(state)
        for key in state.keys() - _MODULE_STATE:
            if isinstance(state[key], nn.Module):
                self.references.append((clone, key))
        return clone

    def _state_of(self, original: nn.Module) -> dict[str, Any]:
        """``original.__dict__`` for its copy: live attributes dropped, hook registries empty, meta
        tensors, copied submodules."""
        state = original.__dict__.copy()
        for key in _LIVE_ATTRIBUTES:
            if key in state:
                del state[key]
        for key in _HOOK_DICTS:  # registries of its own, empty: hooks registered on the copy stay there
            if key in state:
                state[key] = type(state[key])()
        state["_parameters"] = {k: self.meta(v) for k, v in original._parameters.items()}
        state["_buffers"] = {k: self.meta(v) for k, v in original._buffers.items()}
        state["_non_persistent_buffers_set"] = set(original._non_persistent_buffers_set)
        state["_modules"] = {k: None if v is None else self.copy_tree(v) for k, v in original._modules.items()}
        return state

    def repoint_references(self) -> None:
        """Unregistered references to modules of the tree point into the copy."""
        for clone, key in self.references:
            target = self.copies.get(id(clone.__dict__[key]))
            if target is not None:
                clone.__dict__[key] = target
