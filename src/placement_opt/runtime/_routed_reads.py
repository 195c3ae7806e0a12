"""The routed experts of a unit the CPU computes from a disk map, read as soon as the router has picked them.

A decode step's tokens use a few of a layer's experts (top-2 of 8 at batch 1), so the read-ahead of the next
mapped unit leaves the experts out (:class:`._prefetch_links.ReadAhead`). Left to fault in on demand, the picked
experts came in at about a quarter of the disk's mapped read rate on this project's machine: each fault reads a
128 KiB window and waits for it. A forward pre-hook on the experts module asks the kernel for the picked
experts' rows of every fused expert tensor at once (``posix_fadvise``, returns at once), after the router has
chosen them and before they are computed: one large read of what the step uses.

A call of as many tokens as experts or more (a prompt) skips it: the read-ahead asked for every expert.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..model.graph import covering_key
from ._expert_groups import is_expert_group
from ._experts import experts_modules
from ._prefetch_links import fused_experts
from ._streamer import DispatchUnit

__all__ = ["read_routed_experts"]

# The experts module's argument that holds each token's experts (transformers 5's experts interface).
_INDEX_ARGUMENT, _INDEX_POSITION = "top_k_index", 1


def read_routed_experts(model: nn.Module, units: Iterable[DispatchUnit]) -> Callable[[], None]:
    """Hook every experts module of a unit computed from a disk map (``mmap`` units, ``phased`` disk units, which
    decode from it) whose expert weights are fused tensors there; returns the undo function."""
    mapped = {u.name: u for u in units if u.disk and u.kind in ("mmap", "phased")}
    handles = []
    for name, module in experts_modules(model):
        if is_expert_group(module):
            continue  # a group's rows are read ahead whole (_prefetch_links.read_ahead)
        owner = covering_key(name, mapped)
        unit = mapped[owner] if owner is not None else None
        fused = [(f, k) for f, k in unit.disk if k.startswith(f"{name}.") and fused_experts(f, k)] if unit else []
        if fused:
            experts = max(f.spans[k].shape[0] for f, k in fused)
            handles.append(module.register_forward_pre_hook(_reader(fused, experts), with_kwargs=True))

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo


def _reader(fused: Sequence[tuple[Any, str]], experts: int) -> Callable[..., None]:
    def read(_module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        index = kwargs.get(_INDEX_ARGUMENT, args[_INDEX_POSITION] if len(args) > _INDEX_POSITION else None)
        if not isinstance(index, torch.Tensor) or index.dim() == 0 or index.shape[0] >= experts:
            return
        for start, end in _runs([i for i in torch.unique(index).tolist() if 0 <= i < experts]):
            for file, key in fused:
                file.prefetch_rows(key, start, end)

    return read


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted expert ids as ``[start, end)`` runs of consecutive ones: ``[1, 2, 5]`` -> ``[(1, 3), (5, 6)]``."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
