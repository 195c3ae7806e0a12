"""Weights a config ties but its checkpoint stores apart, with different values.

``from_pretrained`` ties ``lm_head.weight`` to the input embeddings when the config says
``tie_word_embeddings``, except where the checkpoint holds both tensors and they differ: it then warns and
keeps them apart (the config is wrong, the checkpoint is the truth). A model built from that config on the
meta device would tie them, count the head's bytes once, and run the embeddings in its place. This module
reads the checkpoint's headers (and, for a pair both present, the two tensors in chunks) and gives back the
config with ``tie_word_embeddings=False`` in that case, so tracing, planning and loading build the model
transformers runs.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

from .._files import offload_store_files
from ..errors import ModelSpecError

__all__ = ["untie_stored_apart", "checkpoint_safetensors"]

#: Rows compared at a time: a 128k-vocabulary head in bf16 is 1 GiB, never read whole into RAM.
_CHUNK_BYTES = 64 * 2**20


def untie_stored_apart(config: Any, root: Path) -> Any:
    """``config``, or a copy with ``tie_word_embeddings=False`` where the checkpoint in ``root`` stores every
    tied weight apart from its source with other values (what ``from_pretrained`` does, with its warning).

    Raises:
        ModelSpecError: some of the class's ties are stored apart with other values and some are not:
            transformers unties them one by one, which a config cannot say.
    """
    if not getattr(config, "tie_word_embeddings", False):
        return config
    ties = _tied_names(config)
    try:
        files = checkpoint_safetensors(root)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a broken index: load() says so itself
        return config
    if not ties or not files:
        return config
    where = _locations(files)
    apart = [(target, source) for target, source in ties.items()
             if target in where and source in where and not _equal(where, target, source)]
    if not apart:
        return config
    if len(apart) < len(ties):
        raise ModelSpecError(
            f"the checkpoint in {root} stores {', '.join(t for t, _ in apart)} apart from the weights the config ties "
            f"them to, with other values, but not its other tied weights: placement_opt builds models from the "
            f"config and cannot untie some ties only; set the right tie_word_embeddings in config.json, or load "
            f"this model with from_pretrained")
    pairs = ", ".join(f"{t} and {s}" for t, s in apart)
    warnings.warn(f"placement_opt: {root}'s config ties {pairs}, but the checkpoint holds both with different "
                  f"values: they are kept apart, as from_pretrained does (set tie_word_embeddings=false in its "
                  f"config.json to silence this)", UserWarning, stacklevel=3)
    untied = copy.deepcopy(config)
    untied.tie_word_embeddings = False
    return untied


def _tied_names(config: Any) -> dict[str, str]:
    """``{target: source}`` of the config's model class, where they are plain names (the common case)."""
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        try:
            cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
        except (KeyError, ValueError):
            return {}
    ties = getattr(cls, "_tied_weights_keys", None)
    if not isinstance(ties, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in ties.items()):
        return {}
    return dict(ties)


def checkpoint_safetensors(root: Path) -> list[Path]:
    """The safetensors files of the checkpoint in ``root``: its index's shards, else ``model.safetensors``, else every
    ``*.safetensors`` there but an offload store's (:func:`~placement_opt._files.offload_store_files`); none where it
    has none.

    Raises:
        ValueError, KeyError: the index is not JSON, or has no ``weight_map``.
    """
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    single = root / "model.safetensors"
    if single.exists():
        return [single]
    stored = offload_store_files(root)
    return sorted(path for path in root.glob("*.safetensors") if path.name not in stored)


def _locations(files: list[Path]) -> dict[str, Path]:
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                where.update((key, path) for key in f.keys())
        except Exception:  # noqa: BLE001 - unreadable here: load() reports the file with its own error
            continue
    return where


def _equal(where: dict[str, Path], first: str, second: str) -> bool:
    """Whether two checkpoint tensors hold the same values, read a chunk of rows at a time."""
    import torch
    from safetensors import safe_open

    with safe_open(where[first], framework="pt") as a, safe_open(where[second], framework="pt") as b:
        left, right = a.get_slice(first), b.get_slice(second)
        shape = left.get_shape()
        if shape != right.get_shape() or left.get_dtype() != right.get_dtype():
            return False
        if not shape:
            return bool(torch.equal(a.get_tensor(first), b.get_tensor(second)))
        row_bytes = 8  # the widest element: chunks stay within the budget whatever the dtype
        for dim in shape[1:]:
            row_bytes *= dim
        step = max(1, _CHUNK_BYTES // max(1, row_bytes))
        for start in range(0, shape[0], step):
            if not torch.equal(left[start:start + step], right[start:start + step]):
                return False
    return True
