"""Expert groups: a layer's experts cut into groups of consecutive experts, each group a placement unit of its own.

transformers 5 fuses an MoE layer's experts into one weight per projection (``gate_up_proj``:
``[experts, 2 x intermediate, hidden]``), so a placement that keeps some experts of a layer on the GPU and
computes the rest on the CPU (Fiddler, kTransformers, llama.cpp's ``--n-cpu-moe`` per layer) has no module to
place. ``trace(..., granularity="sublayer", expert_groups=N)`` cuts each layer's experts unit into ``N`` units
(:func:`split_expert_units`), and the runtime cuts the module the same way before it places the weights
(:mod:`placement_opt.runtime._expert_groups`): group ``i`` of ``model.layers.3.mlp.experts`` is the module
``model.layers.3.mlp.experts.groups.i``, whose weights are rows of the whole ones (``...groups.i.gate_up_proj``).
The groups run one after another, each adding its experts' share to the running sum it is handed: a chain, as
the cost model prices it.

This module imports no torch (the planner reads plans' unit names with it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .graph import LOAD_NODE_ATTRIBUTES, LayerGraph, UnitInfo

__all__ = ["expert_groups_refusal", "group_ranges", "group_unit", "whole_experts", "group_counts", "split_expert_units"]

_GROUP = re.compile(r"^(?P<experts>.+)\.groups\.(?P<index>\d+)$")


def expert_groups_refusal(expert_groups: Any, granularity: str | None, accepted: Sequence[str]) -> str | None:
    """Why ``expert_groups`` cannot be taken with ``granularity`` (one of ``accepted`` cuts sublayer units), or None:
    the one check of the argument, which each stage raises as its own error."""
    if isinstance(expert_groups, bool) or not isinstance(expert_groups, int) or expert_groups < 1:
        return f"expert_groups={expert_groups!r}: give a whole number >= 1 (1: a layer's experts are one unit)"
    if expert_groups > 1 and granularity not in accepted:
        return (f"expert_groups={expert_groups} cuts the experts units of sublayer graphs: pass "
                f"{' or '.join(f'granularity={a!r}' for a in accepted)} with it (granularity={granularity!r} keeps "
                f"each MoE layer's experts inside a bigger unit)")
    return None


def group_ranges(num_experts: int, groups: int) -> list[tuple[int, int]]:
    """``[start, end)`` expert rows of each of ``groups`` consecutive groups, sizes differing by at most one
    (the first ``num_experts % groups`` one larger)."""
    if not 1 <= groups <= num_experts:
        raise ValueError(f"{groups} group(s) of {num_experts} experts: 1 to {num_experts} groups are possible")
    size, extra = divmod(num_experts, groups)
    bounds = [0]
    for i in range(groups):
        bounds.append(bounds[-1] + size + (i < extra))
    return list(zip(bounds, bounds[1:], strict=False))


def group_unit(experts: str, index: int) -> str:
    """The unit name of group ``index`` of the experts module ``experts``."""
    return f"{experts}.groups.{index}"


def whole_experts(unit: str) -> tuple[str, int] | None:
    """``(experts module, group index)`` of a group unit's name, None for any other name."""
    found = _GROUP.match(unit)
    return (found["experts"], int(found["index"])) if found else None


def group_counts(units: Iterable[str]) -> dict[str, int]:
    """Experts module -> how many groups a plan's (or graph's) unit names cut it into."""
    counts: dict[str, int] = {}
    for unit in units:
        parsed = whole_experts(unit)
        if parsed is not None:
            counts[parsed[0]] = max(counts.get(parsed[0], 0), parsed[1] + 1)
    return counts


def split_expert_units(graph: LayerGraph, groups: int, units: Iterable[str]) -> LayerGraph:
    """``graph`` with each experts unit in ``units`` replaced by a chain of ``groups`` group units.

    Group ``i`` of ``k`` experts (of the layer's ``E``) owns ``k / E`` of the unit's weights and FLOPs (routing
    is priced uniform); its MoE facts keep the layer's ``E`` and top-k, so the experts a batch touches in it are
    priced as a share of the layer's. Each group reads what the unit read, and every group after the first the
    running sum too (one output's bytes); the last hands the unit's output on. Its workspace is the unit's
    whole: transformers' grouped kernel gathers a row per routed token and expert for every group (rows of other
    groups' experts are skipped in the matmuls, not in the gather), so no group holds less than the unit did;
    every group after the first holds the running sum beside it (a Mixtral-shaped second group measured 3 %
    over the unit's workspace on a CPU forward).
    A graph with ``groups`` 1, or without such units, comes back as it is.
    """
    chosen = [n for n in units if n in graph and graph.unit(n).moe_num_experts > 1]
    if groups == 1 or not chosen:
        return graph
    digraph = graph.nx.copy()
    shift = {}  # every node's new (exec_index, module_index): later nodes move down by the groups added
    for name in chosen:
        info = graph.unit(name)
        cut = min(groups, info.moe_num_experts)
        made = _group_nodes(info, dict(graph.nx.nodes[name]), cut)
        preds = list(digraph.in_edges(name, data="bytes_per_token"))
        succs = list(digraph.out_edges(name, data="bytes_per_token"))
        digraph.remove_node(name)
        for i, (unit, attrs) in enumerate(made):
            digraph.add_node(unit, **attrs)
            shift[unit] = (info.exec_index, info.module_index, i)
            for src, _, nbytes in preds:
                digraph.add_edge(src, unit, bytes_per_token=int(nbytes))
            if i:
                digraph.add_edge(made[i - 1][0], unit, bytes_per_token=info.out_bytes_per_token)
        for _, dst, nbytes in succs:
            digraph.add_edge(made[-1][0], dst, bytes_per_token=int(nbytes))
    _renumber(digraph, shift)
    extra = {**graph.meta.extra, "expert_groups": groups}
    out = LayerGraph(digraph, dataclasses.replace(graph.meta, extra=extra))
    out.validate()
    return out


def _group_nodes(info: UnitInfo, attrs: dict[str, Any], groups: int) -> list[tuple[str, dict[str, Any]]]:
    """The node attributes (``attrs``: the unit's) of each group of its experts, sizes and FLOPs split by rows."""
    experts = info.moe_num_experts
    made = []
    for i, (start, end) in enumerate(group_ranges(experts, groups)):
        unit = group_unit(info.name, i)

        def share(value: int, start: int = start, end: int = end) -> int:  # telescoping: shares sum to value
            return round(value * end / experts) - round(value * start / experts)

        node = {**attrs, "module_class": f"{info.module_class}Group",
                "param_bytes": share(info.param_bytes), "buffer_bytes": share(info.buffer_bytes),
                "flops_per_token": share(info.flops_per_token), "moe_expert_bytes": share(info.moe_expert_bytes),
                "param_names": tuple(f"{unit}.{p.rpartition('.')[2]}" for p in info.param_names)}
        for key in LOAD_NODE_ATTRIBUTES:  # accelerate runs no groups: a group's stream_sync holds the group
            node.pop(key, None)
        if i and info.in_bytes_per_token is not None:
            node["in_bytes_per_token"] = info.in_bytes_per_token + info.out_bytes_per_token  # the running sum
        if i and info.out_bytes_per_token:
            for key in ("workspace_bytes_per_token", "scores_workspace_bytes_per_token"):
                if attrs.get(key) is not None:  # the running sum is alive while the group runs
                    node[key] = attrs[key] + info.out_bytes_per_token
        made.append((unit, node))
    return made


def _renumber(digraph: Any, placed: Mapping[str, tuple[int, int, int]]) -> None:
    """Give every node consecutive execution and registration indices, groups where their unit was."""
    for key in ("exec_index", "module_index"):
        slot = 0 if key == "exec_index" else 1

        def order(name: str, key: str = key, slot: int = slot) -> tuple[int, int]:
            if name in placed:
                return placed[name][slot], placed[name][2]
            return digraph.nodes[name][key], -1

        for index, name in enumerate(sorted(digraph.nodes, key=order)):
            digraph.nodes[name][key] = index
