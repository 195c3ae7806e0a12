"""A dtype as users write it (``"float16"``, ``"torch.bfloat16"``, ``torch.float32``) -> ``torch.dtype``.

The one place that parses dtypes for ``trace()`` and ``load()``, and reads a module's or a config's.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from ..errors import ModelSpecError

__all__ = ["as_torch_dtype", "dtype_name", "module_dtype", "config_dtype", "dtype_bytes"]


def as_torch_dtype(value: str | torch.dtype) -> torch.dtype:
    """``torch.float16``, ``"float16"``, ``"torch.float16"`` or ``"half"`` -> ``torch.float16``.

    Raises:
        ModelSpecError: ``value`` names no torch dtype; the message gives examples.
    """
    if isinstance(value, torch.dtype):
        return value
    candidate = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(candidate, torch.dtype):
        raise ModelSpecError(
            f"dtype {value!r} is not a torch dtype: use e.g. 'float16', 'bfloat16', 'float32' "
            f"or torch.bfloat16"
        )
    return candidate


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``, the form a graph's ``meta.dtype`` and a Device use."""
    return str(dtype).removeprefix("torch.")


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype most of ``module``'s floating parameters have (float32 when it has none)."""
    counts: dict[torch.dtype, int] = defaultdict(int)
    for tensor in module.parameters():
        if tensor.is_floating_point():
            counts[tensor.dtype] += tensor.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def config_dtype(config: Any) -> torch.dtype:
    """A transformers config's ``dtype`` (or older ``torch_dtype``); float16 when absent or ``"auto"``."""
    for key in ("dtype",) if hasattr(type(config), "dtype") or "dtype" in vars(config) else ("torch_dtype",):
        value = getattr(config, key, None)
        if value is not None and value != "auto":
            return as_torch_dtype(value)
    return torch.float16


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype, device="meta").element_size()
