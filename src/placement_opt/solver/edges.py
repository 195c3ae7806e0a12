"""Redundant edges: an edge whose every transfer is covered by another path between its ends.

Torch-free. Traced graphs carry many edges no longest path can ever need: a module-level Llama
has an edge from every ``o_proj`` and ``down_proj`` to every later norm (the residual stream), and
a block-level one an edge from ``rotary_emb`` to every layer. 724 units carry 13,922 edges, and
each edge costs the CP-SAT model a transfer variable and a precedence row per phase.

An edge ``a -> b`` is *covered* when another path ``a -> v1 -> ... -> b`` is, in each phase and for
every choice of the devices computing its units in that phase, at least as long as the edge: the
path's transfers plus the cheapest durations of its inner units ``>= c_ab(dev a, dev b)``. Each
phase is its own schedule, priced on the devices computing in it (a ``phased`` option computes its
prefill elsewhere than its decode), so each is checked on its own devices. Then ``finish[b]`` never
depends on the edge, and dropping it leaves the longest path of every assignment unchanged (the
device loads do not read edges). Covered edges are dropped shortest span first and a witness path uses only
shorter edges, so a dropped edge in a witness is itself covered by kept ones (induction on the
span): :func:`prune_edges` is exact for every objective.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
import weakref
from collections.abc import Mapping

from .problem import PHASES, EdgeSpec, PlacementProblem

__all__ = ["prune_edges", "covered_edges"]

_PHASES = PHASES
_INF = float("inf")


def prune_edges(problem: PlacementProblem, deadline: float | None = None) -> PlacementProblem:
    """``problem`` without its covered edges: every assignment keeps its exact score.

    ``deadline`` (a ``time.perf_counter()`` value) stops the search for covered edges early; the
    edges found by then are dropped, which stays exact. A problem this function returned from a
    search without a deadline is returned as it is (solve() prunes before its baselines, and the
    search would otherwise spend 0.1 s of a module-level 70B's budget finding nothing more).
    """
    if _PRUNED.get(id(problem)) is problem:
        return problem
    drop = covered_edges(problem, deadline)
    if drop:
        problem = dataclasses.replace(problem, edges=tuple(e for k, e in enumerate(problem.edges) if k not in drop))
    if deadline is None:
        _PRUNED[id(problem)] = problem
    return problem


#: id -> problem returned by a complete prune_edges (weak: an id is only trusted while its problem lives).
_PRUNED: weakref.WeakValueDictionary[int, PlacementProblem] = weakref.WeakValueDictionary()


def covered_edges(problem: PlacementProblem, deadline: float | None = None) -> set[int]:
    """Indices of the edges that a path of other edges always outlasts (see the module docstring)."""
    pairs, out = _edge_index(problem)
    reaches = _descendants(out, len(problem.units))
    succ = [sorted(o) for o in out]
    execs = _phase_devices(problem)
    fastest = _fastest(problem)
    # Traced graphs repeat one layer's pattern: the same witness shape (edge prices and devices)
    # recurs once per layer. Each shape is checked once with the inner durations taken as 0 (a
    # sufficient test, durations are >= 0); only the shapes that fail it are checked path by path.
    edge_key = _edge_keys(problem.edges)
    unit_key = _interned(execs)
    tails = _Tails(out, succ, reaches, edge_key, unit_key)
    seen: dict[tuple, bool] = {}
    timed: dict[tuple, bool] = {}  # shapes that fail without durations, with their inner units' menus
    drop: set[int] = set()
    for step, k in enumerate(sorted(range(len(pairs)), key=lambda k: pairs[k][1] - pairs[k][0])):
        if deadline is not None and step % 256 == 0 and time.perf_counter() > deadline:
            break  # what is dropped so far is covered by kept edges (shorter spans come first)
        a, b = pairs[k]
        if out[a].get(b) != k:  # a parallel duplicate: the first edge of the pair is kept
            if _dominates(problem.edges[out[a][b]], problem.edges[k], execs[a], execs[b]):
                drop.add(k)
            continue
        v = _furthest(succ[a], reaches, b)  # the witness's first hop: never the edge itself
        tail = tails.of(v, b) if v >= 0 else None
        if tail is None:
            continue
        shape = (edge_key[k], unit_key[a], unit_key[b], edge_key[out[a][v]], unit_key[v], tail)
        covered = seen.get(shape)
        if covered is None or not covered:
            path = [a, *tails.path(v, b)]
            hops = [out[x][y] for x, y in zip(path, path[1:], strict=False)]
            if covered is None:
                covered = seen[shape] = _covers(problem, hops, path, k, execs, None)
            if not covered:
                covered = _timed_covers(problem, hops, path, k, execs, fastest, timed, shape)
        if covered:
            drop.add(k)
    return drop


def _edge_index(problem: PlacementProblem) -> tuple[list[tuple[int, int]], list[dict[int, int]]]:
    """(source, destination) unit indices per edge, and per unit ``a`` its out-edges ``{b: edge index}`` (the
    first edge of parallel duplicates): :func:`covered_edges`' view of the graph."""
    index = problem.index()
    n = len(problem.units)
    pairs = [(index[e.src], index[e.dst]) for e in problem.edges]
    out: list[dict[int, int]] = [{} for _ in range(n)]  # a -> {b: edge index}
    for k, (a, b) in enumerate(pairs):
        out[a].setdefault(b, k)
    return pairs, out


def _phase_devices(problem: PlacementProblem) -> list[tuple[tuple[str, ...], ...]]:
    """Per unit and phase (in _PHASES order), the devices its options compute on in that phase: where each end of
    an edge may be."""
    return [(tuple(sorted({o.prefill_execution or o.execution for o in u.options})),
             tuple(sorted({o.execution for o in u.options}))) for u in problem.units]


def _timed_covers(problem: PlacementProblem, hops: list[int], path: list[int], k: int,
                  execs: list[tuple[tuple[str, ...], ...]], fastest: list[dict[str, dict[str, int]]],
                  timed: dict[tuple, bool], shape: tuple) -> bool:
    """:func:`_covers` with the inner units' durations, for a witness whose ``shape`` fails without them: found once
    per shape and inner units' menus (``timed``), as the durations of one menu are the same."""
    # _fastest shares one dict per distinct menu: its id stands for the durations
    timed_key = (shape, *(id(fastest[v]) for v in path[1:-1]))
    if timed_key not in timed:
        timed[timed_key] = _covers(problem, hops, path, k, execs, fastest)
    return timed[timed_key]


class _Tails:
    """The witness path's tail from ``v`` to ``b``, each hop the direct edge to ``b`` when there is one,
    else to ``v``'s furthest successor that still reaches ``b``: its next hop and a shape id per
    ``(v, b)``, found once. Witnesses of a fan of edges share their tails (every residual edge into
    one norm goes through the norm before it), so each edge costs one hop and a few lookups. Only the
    next hop is kept (a path is walked back from them when checked): a hand-built chain with many
    long edges would otherwise keep a path per unit and target."""

    def __init__(self, out: list[dict[int, int]], succ: list[list[int]], reaches: list[int],
                 edge_key: list[int], unit_key: list[int]) -> None:
        self.out, self.succ, self.reaches = out, succ, reaches
        self.edge_key, self.unit_key = edge_key, unit_key
        self.memo: dict[tuple[int, int], tuple[int, int] | None] = {}  # (v, b) -> (next hop, shape id)
        self.ids: dict[tuple[int, ...], int] = {}

    def of(self, v: int, b: int) -> int | None:
        """An id equal for tails ``v`` .. ``b`` (``v < b``) of equal edge prices and devices; None: no witness."""
        walk = []  # iterative: a hand-built chain can be longer than the recursion limit
        while v != b and (v, b) not in self.memo:
            walk.append(v)
            v = b if b in self.out[v] else _furthest(self.succ[v], self.reaches, b)
            if v < 0:
                break
        known = self.memo.get((v, b)) if 0 <= v != b else None
        tail = -1 if v == b else None if known is None else known[1]
        for u in reversed(walk):  # fill the memo back from where the walk stopped
            if tail is not None:
                tail = self.ids.setdefault((self.edge_key[self.out[u][v]], self.unit_key[v], tail), len(self.ids))
            self.memo[(u, b)] = None if tail is None else (v, tail)
            v = u
        return tail

    def path(self, v: int, b: int) -> list[int]:
        """The tail ``v`` .. ``b`` itself (``of(v, b)`` found it)."""
        out = [v]
        while v != b:
            v = self.memo[(v, b)][0]  # type: ignore[index]
            out.append(v)
        return out


def _furthest(after: list[int], reaches: list[int], b: int) -> int:
    """The furthest of the sorted successors ``after`` below ``b`` that reaches ``b``; -1 if none."""
    k = bisect.bisect_left(after, b) - 1
    while k >= 0 and not (reaches[after[k]] >> b) & 1:
        k -= 1
    return after[k] if k >= 0 else -1


def _fastest(problem: PlacementProblem) -> list[dict[str, dict[str, int]]]:
    """Per unit and phase, the least duration on each device computing it in that phase (each distinct menu once)."""
    by_menu: dict[tuple, dict[str, dict[str, int]]] = {}
    out = []
    for u in problem.units:
        key = tuple((o.prefill_execution or o.execution, o.prefill_ns, o.execution, o.decode_ns)
                    for o in u.options)  # device_in(ph), inline: 11,000 options on a module-level 70B
        if key not in by_menu:
            least: dict[str, dict[str, int]] = {ph: {} for ph in _PHASES}
            for x_pre, t_pre, x_dec, t_dec in key:
                for ph, x, t in (("prefill_ns", x_pre, t_pre), ("decode_ns", x_dec, t_dec)):
                    least[ph][x] = min(t, least[ph].get(x, t))
            by_menu[key] = least
        out.append(by_menu[key])
    return out


def _edge_keys(edges: tuple[EdgeSpec, ...]) -> list[int]:
    """A small int per distinct pair of price tables. build_problem gives edges of one size the same
    dict objects, so each object pair is turned into items once (13,922 edges of a module-level 70B
    share a handful), not once per edge (0.1 s)."""
    items: dict[tuple[int, int], tuple] = {}
    keys = []
    for e in edges:
        ids = (id(e.prefill_ns), id(e.decode_ns))  # the edges hold their dicts: ids stay unique meanwhile
        if ids not in items:
            items[ids] = (tuple(e.prefill_ns.items()), tuple(e.decode_ns.items()))
        keys.append(items[ids])
    return _interned(keys)


def _interned(keys: list) -> list[int]:
    """A small int per distinct key."""
    ids: dict = {}
    return [ids.setdefault(key, len(ids)) for key in keys]


def _descendants(out: list[dict[int, int]], n: int) -> list[int]:
    """Bitset per unit of the units reachable from it (edges point forward in the order)."""
    reach = [0] * n
    for v in range(n - 1, -1, -1):
        bits = 0
        for w in out[v]:
            bits |= reach[w] | (1 << w)
        reach[v] = bits
    return reach


def _cost(costs: Mapping[tuple[str, str], int], p: str, q: str) -> int:
    return 0 if p == q else costs.get((p, q), 0)


def _dominates(kept: EdgeSpec, other: EdgeSpec, src: tuple[tuple[str, ...], ...], dst: tuple[tuple[str, ...], ...]) -> bool:
    """A parallel edge costing at least as much on every device pair of each phase covers ``other``."""
    return all(_cost(getattr(kept, ph), p, q) >= _cost(getattr(other, ph), p, q)
               for k, ph in enumerate(_PHASES) for p in src[k] for q in dst[k])


def _covers(problem: PlacementProblem, hops: list[int], path: list[int], k: int,
            execs: list[tuple[tuple[str, ...], ...]], fastest: list[dict[str, dict[str, int]]] | None) -> bool:
    """True when, in each phase, the path's least length from each device of its source to each of its
    sink (the devices computing them in that phase) is >= edge k.

    ``fastest`` (per unit, phase and device, the least duration) adds the inner units' durations to
    the path; ``None`` counts them as 0.
    """
    edge = problem.edges[k]
    a, b = path[0], path[-1]
    for i, ph in enumerate(_PHASES):
        direct = getattr(edge, ph)
        for p in execs[a][i]:
            reach = {p: 0.0}  # least path length so far, per device computing the current unit in ph
            for h, v in zip(hops, path[1:], strict=True):
                costs = getattr(problem.edges[h], ph)
                inner = v != b and fastest is not None
                reach = {x: min((r + _cost(costs, y, x) for y, r in reach.items()), default=_INF)
                         + (fastest[v][ph][x] if inner else 0) for x in execs[v][i]}  # type: ignore[index]
            if any(reach[q] < _cost(direct, p, q) for q in execs[b][i]):
                return False
    return True
