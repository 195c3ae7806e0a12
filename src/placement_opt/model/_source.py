"""The argument of :func:`~placement_opt.model.tracer.trace` -> a module (built on meta), its name, config, dtype."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import TraceError
from .dtypes import as_torch_dtype, config_dtype, module_dtype

__all__ = ["resolve_source", "first_line"]


_ENCODER_ONLY_TYPES = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
                       "deberta-v2", "camembert", "mpnet", "modernbert", "ernie"}


def resolve_source(model: Any, dtype: str | torch.dtype | None
             ) -> tuple[nn.Module, str, Any, torch.dtype, torch.dtype | None]:
    """(module, name, config or None, graph dtype, dtype to count floating tensors in or None for their own)."""
    if isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        name = getattr(config, "name_or_path", "") or type(model).__name__
        if dtype is None:
            return model, name, config, module_dtype(model), None
        return model, name, config, as_torch_dtype(dtype), as_torch_dtype(dtype)
    config = _as_config(model)
    torch_dtype = as_torch_dtype(dtype) if dtype is not None else config_dtype(config)
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
            raise TraceError(f"cannot read a transformers config from {text!r}: {first_line(exc)}") from None
    try:
        return AutoConfig.from_pretrained(text, local_files_only=True)  # the hub cache first
    except Exception:  # noqa: BLE001 - not cached: ask the hub below
        pass
    try:
        return AutoConfig.from_pretrained(text)
    except Exception as exc:
        raise TraceError(
            f"{text!r} is not a preset ({', '.join(models.list_models())}), not a local path, and fetching its "
            f"config.json from the Hugging Face hub failed ({first_line(exc)}): pass a local config.json, a "
            f"directory holding one, or a transformers config object") from None


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
            f"cannot build {type(config).__name__} on the meta device ({first_line(exc)}): build the model "
            f"yourself (e.g. under `with torch.device('meta')`) and pass the nn.Module") from None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
