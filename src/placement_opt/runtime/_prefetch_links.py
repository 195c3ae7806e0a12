"""Which copies each dispatched unit starts: one prefetch per copy group, and the memory-mapped read-ahead chain.

Set once at dispatch on each :class:`~._streamer.DispatchUnit` (``ahead``, ``ahead_prefill``, ``heads_group``,
``again``, ``next_unit``), read by :mod:`._hooks` and :mod:`._streamer` at every forward. The order follows the
cost model's (:func:`placement_opt.solver.problem.stalls`): a group's wait at its head, the next group's copy
started there.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..model._meta_experts import expert_count, is_stacked_experts, routing_argument
from ._streamer import DispatchUnit

__all__ = ["link_prefetch", "link_groups", "ReadAhead", "read_ahead", "expert_rows", "takes_picks"]


@dataclass(frozen=True)
class ReadAhead:
    """What a mapped unit asks the kernel to read ahead of the next mapped unit (``next_unit``): every tensor of
    it, or, for a call of fewer tokens than that unit has routed experts, every tensor but its fused expert
    tensors. A decode step's few tokens use a few experts (top-2 of 8: a quarter of the expert bytes at batch 1):
    :mod:`._routed_reads` asks for those once the router has picked them, and reading every expert ahead would read
    the rest for nothing. A call of as many tokens as experts or more (a prompt) uses nearly all of them: all are
    read ahead. An expert group counts its layer's experts: its tokens are routed among all of them."""

    every: tuple[tuple[Any, str], ...] = ()
    unrouted: tuple[tuple[Any, str], ...] = ()
    experts: int = 0
    """How many routed experts the next unit has (0: none, read everything ahead)."""

    def keys(self, tokens: int | None) -> tuple[tuple[Any, str], ...]:
        """The (file, key) pairs to read ahead for a call of ``tokens`` tokens (None: not known, all of them)."""
        if not self.experts or tokens is None or tokens >= self.experts:
            return self.every
        return self.unrouted


def read_ahead(unit: DispatchUnit | None) -> ReadAhead:
    """The :class:`ReadAhead` of ``unit``'s memory-mapped tensors (none for None)."""
    if unit is None:
        return ReadAhead()
    every = tuple(unit.disk)
    routed, counts = [], []
    for file, key in every:
        experts = _routed_experts(unit, key)
        if experts and expert_rows(file, key, experts):
            routed.append((file, key))
            counts.append(experts)
    # an expert group holds some rows of its layer's experts: the tokens are routed among the layer's
    experts = getattr(unit.module, "layer_experts", max(counts)) if routed else 0
    return ReadAhead(every, tuple(x for x in every if x not in routed), experts)


def expert_rows(file: Any, key: str, experts: int) -> int:
    """Rows per expert of tensor ``key`` of ``file`` held by an experts module of ``experts`` experts, in expert
    order along its first dimension: one for a fused 3-D tensor (transformers 5's ``mlp.experts.gate_up_proj``,
    JetMoE's ``mlp.input_linear.weight``) or a per-expert bias, the expert's width for DBRX's stacked 2-D tensors
    (``[experts x ffn, hidden]``); 0 where its rows are not the experts'."""
    shape = file.spans[key].shape
    if experts <= 0 or len(shape) < 2 or shape[0] % experts:
        return 0
    return shape[0] // experts


def takes_picks(module: nn.Module) -> bool:
    """Whether ``module``'s forward is told which experts it computes
    (:func:`~placement_opt.model._meta_experts.routing_argument`), and so reads only their weights."""
    return routing_argument(module) is not None


def _routed_experts(unit: DispatchUnit, key: str) -> int:
    """The experts of the module of ``unit`` that holds tensor ``key`` and computes only the experts it is told
    of: its owner (fused tensors, an expert group), or the owner's parent for DBRX's stacked tensors, which its
    experts module's child holds; 0 for any other tensor (a key that names no module of the unit: not known)."""
    owner = key.rpartition(".")[0]
    if unit.name and owner != unit.name and not owner.startswith(f"{unit.name}."):
        return 0
    path = owner[len(unit.name):].lstrip(".")
    try:
        module = unit.module.get_submodule(path)
        parent = unit.module.get_submodule(path.rpartition(".")[0]) if path else None
    except AttributeError:
        return 0
    if takes_picks(module) and (experts := expert_count(module)):
        return experts
    return parent.num_experts if parent is not None and is_stacked_experts(parent) else 0


def link_prefetch(units: list[DispatchUnit]) -> None:
    """Which copies each unit starts (:func:`link_groups`), and the memory-mapped read-ahead chain.

    ``mmap`` units, and phased disk units (they decode from the map), of mode ``stream``/``phased`` ask
    the kernel to read the next one of them ahead (``next_unit``), wrapping to the first. A lookup table
    (an embedding) reads ahead but is never read ahead: its forward reads one row per token from the map,
    and a read-ahead would read the whole table (a 128k-token vocabulary is 1 GiB in bf16) for a decode
    step's row; the unit before it reads ahead the one after it.
    """
    chain = [u for u in units if u.kind == "mmap" or (u.kind == "phased" and u.disk)]
    for i, unit in enumerate(chain):
        following = next((u for u in chain[i + 1:] + chain[:i + 1] if not _lookup(u)), None)
        if unit.placement.mode in ("stream", "phased") and following is not None and following is not unit:
            unit.next_unit = following
    link_groups(units)


def _lookup(unit: DispatchUnit) -> bool:
    """Whether the unit is a lookup table: an embedding, whose forward reads the rows of its tokens only."""
    return isinstance(unit.module, nn.Embedding)


def _copy_groups(units: list[DispatchUnit]) -> list[list[DispatchUnit]]:
    """Maximal runs of consecutive units with one ``copy_group``; a unit whose copy_group is None is alone."""
    groups: list[list[DispatchUnit]] = []
    for name, run in itertools.groupby(units, key=lambda u: u.placement.copy_group):
        members = list(run)
        groups += [members] if name is not None else [[u] for u in members]
    return groups


def _prefetched(unit: DispatchUnit, group: list[DispatchUnit]) -> bool:
    """Whether ``unit`` is copied ahead by the prefetch thread: a ``stream``-kind unit, but in a group of several
    only a ``stream`` to a GPU, the one option the cost model prices as copied beside the compute
    (``stream_sync``, and a disk read for the CPU, are priced as made when called: a group of those alone
    must not start the next group's copies later than the model says). A unit alone keeps the rule from
    before groups: the streamed unit before it prefetches it whatever its mode."""
    if unit.kind != "stream":
        return False
    return len(group) == 1 or (unit.placement.mode == "stream" and unit.placement.execution != "cpu")


def link_groups(units: list[DispatchUnit]) -> None:
    """One prefetch per copy group: each unit's ``ahead`` (decode) and ``ahead_prefill``.

    A group's *item* in a phase is its units streamed then: ``stream`` ones, in a prefill ``phased``
    ones too. A group with an item starts the next group's item (the next with one in that phase,
    wrapping to the first): a group of several units at its head, first thing (its own item too,
    those not started yet), as the cost model charges a group's wait at its head and starts the next
    group's copy there; a unit alone (every unit of a plan without copy groups) after taking its own
    weights, in mode ``stream`` or ``phased`` (not ``stream_sync``), as before groups. A prefill wraps
    to the first group with a *decode* item: the call after a prefill is a decode step, where phased
    units do not stream. When one group alone streams in a decode, each of its units starts its own copy
    again once it has its weights (``again``), for the next step.
    """
    groups = _copy_groups(units)
    decode = [tuple(u for u in g if _prefetched(u, g)) for g in groups]
    prefill = [tuple(u for u in g if u.kind == "phased" or _prefetched(u, g)) for g in groups]
    first = next((i for i, item in enumerate(decode) if item), None)
    for i, group in enumerate(groups):
        wrap = decode[first] if first is not None and first != i else ()
        next_decode = next((item for item in decode[i + 1:] if item), wrap)
        next_prefill = next((item for item in prefill[i + 1:] if item), wrap)
        head = group[0]
        if len(group) > 1:
            head.ahead = decode[i] + next_decode if decode[i] else ()
            head.ahead_prefill = prefill[i] + next_prefill if prefill[i] else ()
            head.heads_group = bool(head.ahead or head.ahead_prefill)
        elif head.placement.mode in ("stream", "phased") and prefill[i]:
            head.ahead = next_decode if decode[i] else ()  # a phased unit decodes where it is stored
            head.ahead_prefill = next_prefill
    streaming = [item for item in decode if item]
    if len(streaming) == 1:
        # it would be its own next group: each of its units, once it has its weights, copies them again for
        # the next step, as the cost model prices the decode (a copy beside the whole step before it)
        for unit in streaming[0]:
            unit.again = (unit,) if unit.placement.mode == "stream" else ()
