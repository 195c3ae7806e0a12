"""Paths of a placement DAG that the grouped relaxation (:mod:`.relax`) keeps: the hint's critical path, paths
covering the other units, and the critical path with each set of parallel siblings taking one role.

Torch-free. A path's length bounds the latency from below whatever the rest of the graph does, so the
relaxation states a few of them; these functions choose which (units are indices into
``problem.units``, a path runs in execution order).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from .problem import PlacementProblem

__all__ = ["critical_path", "covering_paths", "sibling_paths", "sibling_slots", "MORE_PATHS", "MOST_SIBLING_PATHS"]

#: Paths beside the critical one that :func:`covering_paths` adds (a layer's widest fan-out is 3: q, k, v).
MORE_PATHS = 3
#: Most paths :func:`sibling_paths` states (one per combination of sibling roles: 3 x 2 in a decoder layer).
MOST_SIBLING_PATHS = 12


def critical_path(problem: PlacementProblem, choice: Sequence[int]) -> list[int]:
    """The units of a longest prefill + decode path under ``choice`` (a real path of the graph)."""
    chosen = problem.options(choice)
    index = problem.index()
    length = [0] * len(chosen)
    before: list[int | None] = [None] * len(chosen)
    incoming: dict[int, list[int]] = {}
    for e in problem.edges:
        incoming.setdefault(index[e.dst], []).append(index[e.src])
    for u, o in enumerate(chosen):
        best = max(incoming.get(u, []), key=lambda a: length[a], default=None)
        before[u] = best
        length[u] = (length[best] if best is not None else 0) + o.prefill_ns + o.decode_ns
    end: int | None = max(range(len(chosen)), key=lambda u: length[u], default=None)
    path = []
    while end is not None:
        path.append(end)
        end = before[end]
    return path[::-1]


def covering_paths(problem: PlacementProblem, path: Sequence[int], most: int = MORE_PATHS) -> list[list[int]]:
    """Up to ``most`` more paths of the graph, each through as many units on no earlier path as any path
    goes (then the longest such), until every unit lies on a path."""
    covered = set(path)
    incoming: dict[int, list[int]] = {}
    index = problem.index()
    for e in problem.edges:
        incoming.setdefault(index[e.dst], []).append(index[e.src])
    out: list[list[int]] = []
    weight = len(problem.units) + 1  # a new unit outweighs any number of covered ones
    while len(out) < most and len(covered) < len(problem.units):
        new = [0] * len(problem.units)
        before: list[int | None] = [None] * len(problem.units)
        for u in range(len(problem.units)):
            best = max(incoming.get(u, []), key=lambda a: new[a], default=None)
            before[u] = best
            new[u] = (new[best] if best is not None else 0) + (u not in covered) * weight + 1  # then the longest
        end: int | None = max(range(len(new)), key=lambda u: new[u])
        found = []
        while end is not None:
            found.append(end)
            end = before[end]
        out.append(found[::-1])
        covered.update(found)
    return out


def sibling_paths(problem: PlacementProblem, path: Sequence[int],
                  most: int = MOST_SIBLING_PATHS) -> list[list[int]]:
    """``path`` with its siblings swapped in, one path per combination of sibling roles (``[path]`` when
    it has no siblings or more than ``most`` combinations).

    A unit ``p`` of ``path`` between ``a`` and ``b`` has siblings when other units ``u`` also have the
    edges ``a -> u -> b`` (``q``, ``k``, ``v`` between a layer's norm and ``o_proj``). Siblings are
    ordered by menu; a *role* is a position in that order among sibling sets of the same menus. Each
    returned path takes the same role in every such set, so the longest of them is at least
    ``sum(unshared units) + sum over kinds of sets of max over roles (their work summed)``: the sum of
    the per-layer maxima that the paths through one role each (:func:`covering_paths`) do not bound.
    """
    slots = sibling_slots(problem, path)
    kinds = sorted({kind for _, kind, _ in slots}, key=repr)
    combos = list(itertools.product(*(range(len(kind)) for kind in kinds)))
    if not slots or len(combos) > most:
        return [list(path)]
    out = []
    for roles in combos:
        role = dict(zip(kinds, roles, strict=True))
        p = list(path)
        for i, kind, alt in slots:
            p[i] = alt[role[kind]]
        out.append(p)
    return out


def sibling_slots(problem: PlacementProblem, path: Sequence[int]) -> list[tuple[int, tuple[Any, ...], list[int]]]:
    """(position on ``path``, kind, siblings by role) of every unit of ``path`` with parallel siblings:
    other units ``u`` with the same edges ``a -> u -> b`` to its neighbours on the path. The kind is
    the siblings' menus in order; a role is a position in that order (:func:`sibling_paths`)."""
    index = problem.index()
    succ: dict[int, set[int]] = {}
    for e in problem.edges:
        succ.setdefault(index[e.src], set()).add(index[e.dst])
    slots = []
    for i in range(1, len(path) - 1):
        a, b = path[i - 1], path[i + 1]
        alt = sorted((u for u in succ.get(a, ()) if b in succ.get(u, ())), key=lambda u: (_menu(problem, u), u))
        if len(alt) > 1:
            slots.append((i, tuple(_menu(problem, u) for u in alt), alt))
    return slots


def _menu(problem: PlacementProblem, u: int) -> tuple[Any, ...]:
    return tuple((o.storage, o.execution, o.mode, o.stored_bytes, o.resident_bytes) for o in problem.units[u].options)
