"""Checkpoint layouts transformers converts at load time, converted one weight at a time.

transformers 5 fuses some weights at load: a Mixtral checkpoint stores each expert's ``w1``, ``w2`` and
``w3`` apart (``block_sparse_moe.experts.3.w1.weight``), the model holds one ``mlp.experts.gate_up_proj``
per layer; the router is renamed (``block_sparse_moe.gate`` -> ``mlp.gate``). ``from_pretrained`` reads
such a checkpoint whole into RAM before anything can be offloaded.

:func:`conversions` asks transformers for the model's own conversion mapping (the renamings and the
converters ``from_pretrained`` applies: :func:`transformers.conversion_mapping.get_model_conversion_mapping`)
and matches every checkpoint key against it, as ``from_pretrained`` does. A key only renamed becomes a
plain source under its new name (still a zero-copy view of the file); a converted weight becomes a
:class:`Converted`, which reads its source tensors and runs transformers' own operations on them when
:func:`~.checkpoint.materialize` reaches that weight. So at most one fused weight (and its sources, views
of the mapped shards) is in RAM at once, and a disk-stored one is written to the offload store with the rest
of its unit.

The mapping's classes live in ``transformers.core_model_loading``, which is not public API: any change
there that this module does not understand makes :func:`conversions` return ``None``, and ``load()`` then
falls back to ``from_pretrained`` (the whole model in RAM) rather than guessing.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._expert_groups import source_rows
from .offload import SafetensorsFile

__all__ = ["Converted", "conversions"]

Source = tuple[SafetensorsFile, str]


@dataclass(eq=False)
class Converted:
    """One model weight built from several checkpoint tensors by a transformers converter."""

    name: str
    """The model's name of the weight (``model.layers.0.mlp.experts.gate_up_proj``)."""
    sources: list[Source]
    """Its checkpoint tensors (file, key), in the order the converter collected them."""
    converter: Any
    """A private copy of the transformers ``WeightConverter``, its tensors added (not yet read)."""

    @property
    def nbytes(self) -> int:
        return sum(file.spans[key].nbytes for file, key in self.sources)

    def build(self, model: nn.Module) -> torch.Tensor:
        """The weight on the CPU in the checkpoint's dtype: the sources read and converted now."""
        out = self.converter.convert(self.name, model=model, config=getattr(model, "config", None))
        if len(out) != 1:
            raise ValueError(f"the converter of {self.name} made {sorted(out)}, not one tensor")
        return next(iter(out.values()))


def conversions(model: nn.Module, sources: Mapping[str, Source]) -> tuple[dict[str, Source], dict[str, Converted]] | None:
    """The checkpoint as the model names it: ``(renamed, converted)``, or ``None`` when transformers' mapping
    cannot be read here.

    ``renamed`` maps a model name to the checkpoint tensor it is (a renaming only); ``converted`` maps a
    model name to the :class:`Converted` that builds it. Keys the model already has are left out of both.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        mapping = get_model_conversion_mapping(model)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    # what rename_source_key looks names up in; an expert group's weights are rows of their whole weight
    wanted = {(rows[0] if (rows := source_rows(model, name)) else name): True for name in model.state_dict()}
    prefix = getattr(model, "base_model_prefix", None)
    renamed: dict[str, Source] = {}
    converted: dict[str, Converted] = {}
    try:
        for key in sorted(sources, key=dot_natural_key):  # the order from_pretrained collects experts in
            if key in wanted:
                continue
            name, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
            if name not in wanted:
                continue  # not the model's (an unused buffer, a head this class does not have)
            if pattern is None:
                renamed[name] = sources[key]
                continue
            entry = converted.get(name)
            if entry is None:
                entry = converted[name] = Converted(name, [], copy.deepcopy(by_pattern[pattern]))
            file, file_key = sources[key]
            entry.sources.append((file, file_key))
            entry.converter.add_tensor(name, key, pattern, _reader(file, file_key))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return renamed, converted


def _reader(file: SafetensorsFile, key: str) -> Any:
    """What transformers' "sync loading" collects: a callable giving the tensor (here a view of the mapped file)."""
    return lambda: file.tensor(key)
