"""Reads on demand from a disk map, asked for as soon as what they read is known: the routed experts of a unit the
CPU computes from it, once the router has picked them, and the rows a lookup table (an embedding) looks up, once
its forward has its token ids.

A decode step's tokens use a few of a layer's experts (top-2 of 8 at batch 1), so the read-ahead of the next
mapped unit leaves the experts out (:class:`._prefetch_links.ReadAhead`). Left to fault in on demand, the picked
experts came in at about a quarter of the disk's mapped read rate on this project's machine: each fault reads a
128 KiB window and waits for it. A forward pre-hook on the experts module asks the kernel for the picked
experts' rows of every fused expert tensor at once (``posix_fadvise``, returns at once), after the router has
chosen them and before they are computed: one large read of what the step uses (DBRX stacks its experts along the
rows of 2-D tensors: a pick's block of rows). JetMoE's experts (its MLP's and its attention's) are told how many rows
each expert gets instead: the experts with some are asked for.

Expert groups (:mod:`._expert_groups`) are asked for by the module that holds a layer's groups, before its
first group computes: a disk group's picked rows come in while the groups before it compute.

A call of as many tokens as the layer has experts or more (a prompt) skips it: the read-ahead asked for every
expert.

A lookup table is never read ahead (:func:`._prefetch_links.link_prefetch`). Left to fault in on demand, each row
it looks up brought the kernel's read-around window with it: 8 MiB (``read_ahead_kb``) on this project's virtual
disk, 6 ms for a decode step's one row of a 128k-row table. Its pre-hook asks for its tokens' rows instead, or
for the whole table where the plan's machine reads that faster (:func:`~placement_opt.cost.traffic.asks_whole_table`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..cost.traffic import asks_whole_table
from ..hardware.devices import Machine
from ..model._meta_experts import (
    PICKS_ARGUMENT,
    expert_count,
    is_fused_experts,
    is_stacked_experts,
    routing_argument,
)
from ..model.graph import covering_key
from ._expert_groups import ExpertGroups
from ._prefetch_links import expert_rows, takes_picks
from ._streamer import DispatchUnit

__all__ = ["read_routed_experts", "read_looked_up_rows"]

# Where the experts module's forward takes the router's picks, or its rows per expert, by position (by name:
# PICKS_ARGUMENT, COUNTS_ARGUMENT).
_INDEX_POSITION = 1

# (the expert tensors of one mapped module, as (file, key), the layer's expert id of its first expert, and how many
# experts it holds)
_Rows = tuple[Sequence[tuple[Any, str]], int, int]


def read_routed_experts(model: nn.Module, units: Iterable[DispatchUnit]) -> Callable[[], None]:
    """Hook every experts module of a unit computed from a disk map (``mmap`` units, ``phased`` disk units, which
    decode from it) whose expert weights are fused tensors there, and every module holding expert groups of which
    some are; returns the undo function."""
    mapped = {u.name: u for u in units if u.disk and u.kind in ("mmap", "phased")}
    handles: list[Any] = []
    with _all_or_none(handles):
        for name, module in _routed_modules(model):
            if isinstance(module, ExpertGroups):
                reads = [(fused, group.first_expert, group.num_experts) for i, group in enumerate(module.groups)
                         if (fused := _fused(f"{name}.groups.{i}", mapped, group.num_experts))]
                experts = module.num_experts
            else:
                experts = expert_count(module)
                reads = [(fused, 0, experts)] if (fused := _fused(name, mapped, experts)) else []
            if reads:
                hook = _reader(reads, experts, routing_argument(module) or PICKS_ARGUMENT)
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return functools.partial(_remove_all, handles)


@contextlib.contextmanager
def _all_or_none(handles: list[Any]) -> Iterator[None]:
    """Hooks registered into ``handles`` inside: all removed again when the block raises (dispatch is all or
    nothing: the hooks put on modules before a later module's error stayed on the model)."""
    try:
        yield
    except BaseException:
        _remove_all(handles)
        raise


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def read_looked_up_rows(units: Iterable[DispatchUnit], machine: Machine) -> Callable[[], None]:
    """Hook every lookup table (``nn.Embedding``) unit computed from a disk map to ask for its tokens' rows before
    it looks them up, or for the whole table where ``machine`` (the plan's) reads that faster; returns the undo
    function."""
    handles: list[Any] = []
    with _all_or_none(handles):
        for unit in units:
            if unit.disk and unit.kind in ("mmap", "phased") and isinstance(unit.module, nn.Embedding):
                tables = [(f, k) for f, k in unit.disk if len(f.spans[k].shape) == 2
                          and f.spans[k].shape[0] == unit.module.num_embeddings]
                if tables:
                    handles.append(unit.module.register_forward_pre_hook(_row_asker(tables, machine)))
    return functools.partial(_remove_all, handles)


def _row_asker(tables: Sequence[tuple[Any, str]], machine: Machine) -> Callable[..., None]:
    file, key = tables[0]
    table_rows, table_bytes = file.spans[key].shape[0], file.spans[key].nbytes
    row_bytes = table_bytes // max(1, table_rows)

    def ask(_module: nn.Module, args: tuple[Any, ...]) -> None:
        ids = args[0] if args else None
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.numel() == 0:
            return
        rows = [r for r in torch.unique(ids).tolist() if 0 <= r < table_rows]
        if asks_whole_table(machine, len(rows), row_bytes, table_bytes):
            for file, key in tables:
                file.prefetch([key])
            return
        for start, end in _runs(rows):
            for file, key in tables:
                file.prefetch_rows(key, start, end)

    return ask


def _routed_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Fused experts modules that compute the router's picks only (transformers' experts interface, the families
    that write the loop themselves: LongCat-Flash, Step-3.7; JetMoE's, told the rows of each expert), DBRX's
    stacked ones, and the holders of expert groups (a group is asked for by its holder)."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, ExpertGroups) or ((is_fused_experts(m) or is_stacked_experts(m)) and takes_picks(m))]


def _fused(name: str, mapped: Mapping[str, DispatchUnit], experts: int) -> list[tuple[Any, str]]:
    """The expert tensors of module ``name`` (of ``experts`` experts) in the memory map of the mapped unit covering
    it: those whose rows are its experts' (:func:`._prefetch_links.expert_rows`)."""
    owner = covering_key(name, mapped)
    if owner is None:
        return []
    return [(f, k) for f, k in mapped[owner].disk if k.startswith(f"{name}.") and expert_rows(f, k, experts)]


def _reader(reads: Sequence[_Rows], experts: int, argument: str = PICKS_ARGUMENT) -> Callable[..., None]:
    # each module's experts: [first, first + held) of the layer's, each the same rows of every tensor (one in a fused
    # tensor, the expert's width in DBRX's stacked ones), counted once here, not at every call
    spans = [([(f, k, f.spans[k].shape[0] // held) for f, k in fused], first, held) for fused, first, held in reads]
    picks = _picks if argument == PICKS_ARGUMENT else _counted

    def read(_module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        routing = kwargs.get(argument, args[_INDEX_POSITION] if len(args) > _INDEX_POSITION else None)
        picked = picks(routing, experts)
        if not picked:
            return
        for tensors, first, held in spans:
            for start, end in _runs([i - first for i in picked if 0 <= i - first < held]):
                for file, key, rows in tensors:
                    file.prefetch_rows(key, start * rows, end * rows)

    return read


def _picks(index: Any, experts: int) -> list[int]:
    """The experts a call's picks (a tensor of expert ids per token) name; none for a call of as many tokens as
    ``experts`` or more, whose read-ahead asked for every expert."""
    if not isinstance(index, torch.Tensor) or index.dim() == 0 or index.shape[0] >= experts:
        return []
    return torch.unique(index).tolist()


def _counted(counts: Any, experts: int) -> list[int]:
    """The experts a call's rows per expert (in expert order) give any row, every one of them: the rows do not say
    how many tokens the call has, so a call whose rows reach every expert may be a few tokens' (4 of top-2 over 8
    experts), for which the read-ahead asked for none; where it asked for all (a prompt), asking again costs one
    ``posix_fadvise`` a tensor."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    if not isinstance(counts, (list, tuple)):
        return []
    return [i for i, rows in enumerate(counts[:experts]) if isinstance(rows, int) and rows > 0]


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted expert ids as ``[start, end)`` runs of consecutive ones: ``[1, 2, 5]`` -> ``[(1, 3), (5, 6)]``."""
    runs: list[tuple[int, int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
