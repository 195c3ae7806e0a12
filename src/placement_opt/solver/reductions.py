"""Exact reductions around the CP-SAT model: coarsening, symmetric segments, residency on ties.

Torch-free, like :mod:`placement_opt.solver.search`, which calls them: each one changes the problem or an
assignment without changing the cost of any assignment the solver could return.

* :func:`coarsen_groups` / :func:`coarsen`: runs of chain units with the same option menu and the
  same hinted option become one super-unit (durations and stored/resident bytes summed, peak the
  max): exact for every cost, and the hint stays representable.
* :func:`symmetric_segments` / :func:`canonical_hint`: inside a run of identical units joined by
  identical edges, any order of the chosen options costs the same, so the model may ask for one
  block per execution device (sorted), and the hint is regrouped to match.
* :func:`prefer_resident`: a streamed unit that would be no slower stored where it computes is
  stored there when it fits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .problem import EdgeSpec, PlacementOption, PlacementProblem, UnitSpec

__all__ = ["coarsen_groups", "coarsen", "symmetric_segments", "canonical_hint", "prefer_resident"]


# -- coarsening: merge runs of chain units with the same menu and the same hinted option --------
def _menu_key(u: UnitSpec) -> tuple[tuple[str, str, str], ...]:
    return tuple((o.storage, o.execution, o.mode) for o in u.options)


def coarsen_groups(problem: PlacementProblem, hint: Sequence[int], target: int) -> list[list[int]]:
    """Runs of unit indices to merge, each of at most ``ceil(n / target)`` units."""
    n = len(problem.units)
    size = -(-n // target)
    index = problem.index()
    outs = [0] * n
    ins = [0] * n
    linked = [False] * n  # linked[i]: the only edge out of i goes to i + 1 and is the only one into it
    for e in problem.edges:
        outs[index[e.src]] += 1
        ins[index[e.dst]] += 1
    for e in problem.edges:
        i, j = index[e.src], index[e.dst]
        if j == i + 1:
            linked[i] = True
    special = {n_ for g in problem.tied_groups for n_ in g} | set(problem.pins)
    groups: list[list[int]] = []
    for i, u in enumerate(problem.units):
        prev = groups[-1][-1] if groups else None
        if (prev is not None and prev == i - 1 and len(groups[-1]) < size and linked[prev]
                and outs[prev] == 1 and ins[i] == 1 and u.name not in special
                and problem.units[prev].name not in special
                and _menu_key(u) == _menu_key(problem.units[prev]) and hint[i] == hint[prev]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _merge_options(units: Sequence[UnitSpec]) -> tuple[PlacementOption, ...]:
    merged = []
    for opts in zip(*(u.options for u in units), strict=True):
        first = opts[0]
        merged.append(PlacementOption(
            storage=first.storage, execution=first.execution, mode=first.mode,
            prefill_ns=sum(o.prefill_ns for o in opts), decode_ns=sum(o.decode_ns for o in opts),
            stored_bytes=sum(o.stored_bytes for o in opts), resident_bytes=sum(o.resident_bytes for o in opts),
            peak_bytes=max(o.peak_bytes for o in opts)))
    return tuple(merged)


def coarsen(problem: PlacementProblem, groups: list[list[int]]) -> PlacementProblem:
    units = tuple(UnitSpec(name=problem.units[g[0]].name,
                           options=_merge_options([problem.units[i] for i in g]) if len(g) > 1
                           else problem.units[g[0]].options) for g in groups)
    heads = {u.name for u in units}
    head_of = {problem.units[i].name: problem.units[g[0]].name for g in groups for i in g}
    edges = tuple(EdgeSpec(src=head_of[e.src], dst=e.dst, prefill_ns=e.prefill_ns, decode_ns=e.decode_ns)
                  for e in problem.edges if e.dst in heads and head_of[e.src] != e.dst)
    return PlacementProblem(units=units, edges=edges, devices=problem.devices, tied_groups=problem.tied_groups,
                            pins=problem.pins, contiguous=problem.contiguous)


# -- symmetry: runs of identical units (decoder layers) differ only in the order of their options
def _chain_links(problem: PlacementProblem) -> dict[int, EdgeSpec]:
    """i -> the edge i -> i + 1, for units whose only out-edge and whose successor's only in-edge it is."""
    index = problem.index()
    outs: dict[int, list[EdgeSpec]] = {}
    ins: dict[int, int] = {}
    for e in problem.edges:
        outs.setdefault(index[e.src], []).append(e)
        ins[index[e.dst]] = ins.get(index[e.dst], 0) + 1
    return {i: es[0] for i, es in outs.items()
            if len(es) == 1 and index[es[0].dst] == i + 1 and ins.get(i + 1) == 1}


def _triangle(edge: EdgeSpec) -> bool:
    """c(a, b) <= c(a, p) + c(p, b) for every phase and device triple: merging blocks never costs more."""
    for costs in (edge.prefill_ns, edge.decode_ns):
        devs = {d for pair in costs for d in pair}
        def c(a: str, b: str, costs: Mapping[tuple[str, str], int] = costs) -> int:
            return 0 if a == b else costs.get((a, b), 0)
        if any(c(a, b) > c(a, p) + c(p, b) for a in devs for b in devs for p in devs):
            return False
    return True


def symmetric_segments(problem: PlacementProblem) -> list[list[int]]:
    """Interiors of maximal runs of identical chain units joined by identical edges (>= 2 units each).

    Inside such a segment any reordering of the chosen options keeps memory and compute, and (under
    the triangle inequality) grouping the units by execution device never adds transfer time, so the
    model may ask for one block per execution device with options sorted inside each block.
    """
    if problem.contiguous:
        return []
    links = _chain_links(problem)
    special = {n for g in problem.tied_groups for n in g} | set(problem.pins)
    runs: list[list[int]] = []
    for i, u in enumerate(problem.units):
        prev = i - 1
        same = (runs and runs[-1][-1] == prev and prev in links and u.name not in special
                and problem.units[prev].name not in special and u.options == problem.units[prev].options
                and _triangle(links[prev])
                and (len(runs[-1]) < 2 or _same_costs(links[prev], links[prev - 1])))
        if same:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [r[1:-1] for r in runs if len(r) >= 4]


def _same_costs(a: EdgeSpec, b: EdgeSpec) -> bool:
    return dict(a.prefill_ns) == dict(b.prefill_ns) and dict(a.decode_ns) == dict(b.decode_ns)


def canonical_hint(problem: PlacementProblem, hint: Sequence[int], segments: Sequence[list[int]]) -> list[int]:
    """The hint with each segment regrouped: one block per execution device (first-seen order), sorted."""
    out = list(hint)
    for seg in segments:
        chosen = [hint[i] for i in seg]
        options = problem.units[seg[0]].options
        order: list[str] = []
        for c in chosen:
            if options[c].execution not in order:
                order.append(options[c].execution)
        regrouped = sorted(chosen, key=lambda c: (order.index(options[c].execution), c))
        for i, c in zip(seg, regrouped, strict=True):
            out[i] = c
    return out


def prefer_resident(problem: PlacementProblem, choice: Sequence[int]) -> list[int]:
    """Store streamed units on their execution device where that costs nothing and fits.

    The time model often ties (a norm of a few KiB streams as fast as it sits on the GPU), and the
    solver then picks either. A resident unit is simpler to run (plain ``from_pretrained`` maps) and
    never slower: its execution device and every transfer stay the same and its copy disappears.
    Only units outside tied groups and pins move, and only while the device keeps room for them.
    """
    if problem.contiguous:
        return list(choice)
    out = list(choice)
    score = problem.score(out)
    free = {d.name: d.capacity_bytes - score.used_bytes[d.name] for d in problem.devices}
    fixed = {n for g in problem.tied_groups for n in g} | set(problem.pins)
    for i, u in enumerate(problem.units):
        o = u.options[out[i]]
        if o.storage == o.execution or u.name in fixed:
            continue
        target = next((k for k, c in enumerate(u.options) if c.storage == c.execution == o.execution
                       and c.mode == "resident"), None)
        if target is None:
            continue
        c = u.options[target]
        grow = c.stored_bytes + c.resident_bytes - o.resident_bytes
        if (c.prefill_ns <= o.prefill_ns and c.decode_ns <= o.decode_ns and grow <= free[o.execution]
                and c.peak_bytes <= o.peak_bytes):
            out[i] = target
            free[o.execution] -= grow
            free[o.storage] += o.stored_bytes
    return out
