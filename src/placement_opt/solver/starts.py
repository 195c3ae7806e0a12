"""Constructive feasible starts: a placement that fits whenever a simple one does, then filled greedily.

The device_map baselines and :func:`~.greedy.greedy_choice` place units one by one and can paint
themselves into a corner (the first GPU full of weights, no room left for the KV cache of the last
layers). The starts here are built the other way round, from every memory term of the problem
(``stored_bytes`` on the storage device, ``resident_bytes`` and the largest ``peak_bytes`` on the
execution device; capacities already exclude the reserve):

1. **One executor** (:func:`executor_starts`): every unit computes on one device ``E`` (the CPU,
   or one GPU of each kind) in both phases (``phased`` options, which prefill elsewhere, are left to the fill). For each cap ``p`` on ``E``'s largest transient (workspace, stream
   buffer), the units kept resident on ``E`` are a knapsack (weights: the bytes ``E`` gains when the
   unit is resident instead of streamed; values: the bytes the stores are spared), and the others
   are streamed from the stores in order (``cpu`` then ``disk``), each store packed as full as it
   goes. The knapsack is exact on small problems, so "everything computed on the CPU, stored on the
   CPU or the disk" is found whenever one such assignment fits (tied groups and pins included).
   With ``contiguous`` the split is a prefix or suffix of the execution order instead.
2. **Fill** (:func:`improve`): from a feasible start, move units to faster options (phased ones
   included) in order of time saved per byte added (the fastest devices fill first) while every
   capacity, pin and tie still holds; the result is kept only when the objective improves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._transients import MoveMemory
from .problem import PlacementOption, PlacementProblem

__all__ = ["executor_starts", "improve", "fits"]


#: Pareto states the knapsack keeps; beyond this it thins them (no longer exact, still valid).
_MAX_STATES = 1024
#: Items up to which the knapsack is solved exactly; above, by value density (LLM graphs: many
#: identical layers, each small against the capacities, where density is within one layer of best).
_EXACT_ITEMS = 24
#: Caps on the executor's largest transient tried per executor (the distinct peaks, thinned).
_MAX_PEAK_CAPS = 6
_MODE_RANK = {"resident": 0, "stream": 1, "stream_sync": 2, "phased": 3}


def _pack(items: Sequence[tuple[int, int]], budget: int) -> list[int]:
    """Indices of ``(weight, value)`` items of total weight <= ``budget`` with the largest value found.

    Everything when it all fits; exact on up to ``_EXACT_ITEMS`` items; else by value per byte.
    """
    if sum(w for w, _ in items) <= budget:
        return list(range(len(items)))
    if len(items) > _EXACT_ITEMS:
        return _pack_by_density(items, budget)
    return _pack_exact(items, budget)


def _pack_by_density(items: Sequence[tuple[int, int]], budget: int) -> list[int]:
    order = sorted(range(len(items)), key=lambda i: (-items[i][1] / max(1, items[i][0]), -items[i][0]))
    chosen = []
    for i in order:
        if items[i][0] <= budget:
            chosen.append(i)
            budget -= items[i][0]
    return chosen


def _pack_exact(items: Sequence[tuple[int, int]], budget: int) -> list[int]:
    """A Pareto frontier of (weight, value) over subsets: exact while it stays under ``_MAX_STATES``."""
    nodes: list[tuple[int, int, int, int]] = [(0, 0, -1, -1)]  # weight, value, parent node, item
    frontier = [0]
    for i, (w, v) in enumerate(items):
        grown = [len(nodes) + k for k in range(len(frontier))]
        nodes += [(nodes[n][0] + w, nodes[n][1] + v, n, i) for n in frontier]
        merged = sorted((n for n in frontier + grown if nodes[n][0] <= budget),
                        key=lambda n: (nodes[n][0], -nodes[n][1]))
        frontier = []
        for n in merged:  # keep a state only if it is worth more than every lighter one
            if not frontier or nodes[n][1] > nodes[frontier[-1]][1]:
                frontier.append(n)
        if len(frontier) > _MAX_STATES:
            step = len(frontier) / _MAX_STATES
            frontier = sorted({frontier[int(k * step)] for k in range(_MAX_STATES)} | {frontier[-1]})
    if not frontier:  # a negative budget: nothing fits
        return []
    chosen, n = [], frontier[-1]
    while nodes[n][3] >= 0:
        chosen.append(nodes[n][3])
        n = nodes[n][2]
    return chosen


@dataclass
class _Item:
    """A unit, or a tied group that must share its storage device."""

    units: list[int]
    resident: list[tuple[int, PlacementOption]] | None
    """Per unit: its option resident on the executor (None: not allowed under this peak cap)."""
    streamed: dict[str, list[tuple[int, PlacementOption]]]
    """Store -> per unit its option streamed from that store to the executor."""

    def bytes_on_executor(self, resident: bool) -> int:
        if resident:
            return sum(o.stored_bytes + o.resident_bytes for _, o in self.resident or [])
        return min(sum(o.resident_bytes for _, o in opts) for opts in self.streamed.values())

    def stored(self, store: str) -> int:
        return sum(o.stored_bytes for _, o in self.streamed[store])


def _groups(problem: PlacementProblem) -> list[list[int]]:
    """Unit indices by tie: each tied group is one list, every other unit its own."""
    index = problem.index()
    tied = [sorted(index[n] for n in g) for g in problem.tied_groups]
    seen = {i for g in tied for i in g}
    return tied + [[i] for i in range(len(problem.units)) if i not in seen]


def _menus(problem: PlacementProblem, executor: str) -> list[list[tuple[int, PlacementOption]]]:
    """Per unit, its allowed options computed on ``executor`` alone (in both phases: not phased), preferred
    first: overlapped streams before synchronous ones, then the fastest."""
    return [sorted(((k, o) for k, o in enumerate(u.options)
                    if o.execution == executor and o.mode != "phased" and problem.allows(u, o)),
                   key=lambda ko: (_MODE_RANK[ko[1].mode], ko[1].work_ns, ko[0])) for u in problem.units]


def _items(menus: list[list[tuple[int, PlacementOption]]], groups: list[list[int]], executor: str,
           stores: Sequence[str], peak_cap: int, most_peak: Callable[[PlacementOption], int]) -> list[_Item] | None:
    """Each group's options on ``executor`` whose transient (``most_peak``: a copy group's whole buffer where it
    has one) stays within ``peak_cap`` (None: one has none)."""
    items = []
    for g in groups:
        resident: list | None = []
        streamed: dict[str, list] = {s: [] for s in stores}
        for i in g:
            first: dict[str, tuple[int, PlacementOption]] = {}  # storage -> preferred option within the cap
            for k, o in menus[i]:
                if most_peak(o) <= peak_cap and o.storage not in first:
                    first[o.storage] = (k, o)
            res = first.get(executor)
            resident = None if resident is None or res is None else [*resident, res]
            for s in list(streamed):
                if s in first:
                    streamed[s].append(first[s])
                else:
                    del streamed[s]
        if resident is None and not streamed:
            return None
        items.append(_Item(g, resident, streamed))
    return items


def _fill_stores(items: list[_Item], stores: Sequence[str], free: dict[str, int]) -> dict[int, str] | None:
    """Store of every streamed item: single-store items first, then each store packed full in order."""
    where: dict[int, str] = {}
    for k, item in enumerate(items):
        if len(item.streamed) == 1:
            (store,) = item.streamed
            where[k] = store
            free[store] -= item.stored(store)
    for store in stores:
        left = [k for k, item in enumerate(items) if k not in where and store in item.streamed]
        if store == stores[-1]:
            chosen = left
        else:
            sizes = [items[k].stored(store) for k in left]
            chosen = [left[j] for j in _pack(list(zip(sizes, sizes, strict=True)), free[store])]
        for k in chosen:
            where[k] = store
            free[store] -= items[k].stored(store)
    if len(where) < len(items) or any(v < 0 for v in free.values()):
        return None
    return where


def _choice(problem: PlacementProblem, items: list[_Item], resident: set[int], where: dict[int, str]) -> list[int]:
    choice = [0] * len(problem.units)
    for k, item in enumerate(items):
        picks = item.resident if k in resident else item.streamed[where[k]]
        for i, (option, _) in zip(item.units, picks or [], strict=True):
            choice[i] = option
    return choice


def _split(problem: PlacementProblem, items: list[_Item], executor: str, stores: Sequence[str],
           budget: int) -> tuple[set[int], dict[int, str]] | None:
    """Which items stay resident on the executor, and the store of every other one."""
    forced = {k for k, it in enumerate(items) if not it.streamed}
    free_items = [k for k, it in enumerate(items) if it.resident is not None and it.streamed]
    budget -= sum(it.bytes_on_executor(k in forced) for k, it in enumerate(items))  # free ones: streamed
    if budget < 0:
        return None
    gains = [(items[k].bytes_on_executor(True) - items[k].bytes_on_executor(False),
              max(items[k].stored(s) for s in items[k].streamed)) for k in free_items]
    resident = forced | {free_items[j] for j in _pack(gains, budget)}
    streamed = [it for k, it in enumerate(items) if k not in resident]
    free = {s: problem.device(s).capacity_bytes for s in stores}
    placed = _fill_stores(streamed, stores, free)
    if placed is None:
        return None
    index = [k for k in range(len(items)) if k not in resident]
    return resident, {index[j]: s for j, s in placed.items()}


def _contiguous_split(problem: PlacementProblem, items: list[_Item], stores: Sequence[str], budget: int,
                      reverse: bool) -> tuple[set[int], dict[int, str]] | None:
    """The longest prefix (or suffix) of the execution order resident on the executor that fits, the
    rest streamed from one store; ties never cut. Every cut is tried (running sums: linear)."""
    item_of = {i: k for k, it in enumerate(items) for i in it.units}
    order = sorted(item_of, reverse=reverse)
    position = {i: j for j, i in enumerate(order)}
    cuts_inside = set()  # cuts that would split a tied group
    for it in items:
        first, last = min(position[i] for i in it.units), max(position[i] for i in it.units)
        cuts_inside.update(range(first + 1, last + 1))
    for store in stores or [None]:  # no store: every unit resident on the executor
        cut = _best_cut(problem, items, item_of, order, store, budget, cuts_inside)
        if cut is not None:
            resident = {item_of[i] for i in order[:cut]}
            return resident, {item_of[i]: store for i in order[cut:]}
    return None


def _best_cut(problem: PlacementProblem, items: list[_Item], item_of: dict[int, int], order: list[int], store: str | None,
              budget: int, cuts_inside: set[int]) -> int | None:
    """The largest cut k (order[:k] resident) that fits the executor's budget and the store."""
    def picks(i: int, resident: bool) -> PlacementOption | None:
        it = items[item_of[i]]
        chosen = it.resident if resident else it.streamed.get(store)
        return None if chosen is None else chosen[it.units.index(i)][1]

    res = [picks(i, True) for i in order]
    stream = [picks(i, False) for i in order]
    # executor bytes and store bytes when the cut is at k, starting from k = 0 (all streamed)
    on_executor = sum(o.resident_bytes for o in stream if o is not None)
    on_store = sum(o.stored_bytes for o in stream if o is not None)
    store_cap = problem.device(store).capacity_bytes if store else 0
    # the suffix order[k:] is streamable from this store only past its last unit that is not
    last_unstreamable = max((j for j, o in enumerate(stream) if o is None), default=-1)
    best = None
    for k in range(len(order) + 1):
        if k > 0:  # order[k - 1] moves from streamed to resident
            r, t = res[k - 1], stream[k - 1]
            if r is None:
                break
            on_executor += r.stored_bytes + r.resident_bytes - (t.resident_bytes if t else 0)
            on_store -= t.stored_bytes if t else 0
        if k > last_unstreamable and k not in cuts_inside and on_executor <= budget and on_store <= store_cap:
            best = k
    return best


def _peak_caps(problem: PlacementProblem, executor: str, capacity: int) -> list[int]:
    """Caps on the executor's largest transient worth trying, smallest first: from the least any unit
    can run with up to the capacity; all of them on small problems (exact), else a spread."""
    per_unit = [[problem.most_peak(o) for o in u.options if o.execution == executor and o.mode != "phased"]
                for u in problem.units]  # the options of _menus
    if not all(per_unit):  # a unit that cannot compute here
        return []
    low = max(min(p) for p in per_unit)
    peaks = sorted({x for p in per_unit for x in p if low <= x <= capacity})
    if len(peaks) <= _MAX_PEAK_CAPS or len(problem.units) <= _EXACT_ITEMS:
        return peaks
    step = (len(peaks) - 1) / (_MAX_PEAK_CAPS - 1)
    return sorted({peaks[round(k * step)] for k in range(_MAX_PEAK_CAPS)})


def _executor_start(problem: PlacementProblem, executor: str, stores: Sequence[str]) -> list[int] | None:
    """A valid start with every unit computed on ``executor``: the first peak cap that gives one."""
    groups, menus = _groups(problem), _menus(problem, executor)
    capacity = problem.device(executor).capacity_bytes
    for cap in _peak_caps(problem, executor, capacity):
        items = _items(menus, groups, executor, stores, cap, problem.most_peak)
        if items is None:
            continue
        splits = ([_contiguous_split(problem, items, stores, capacity - cap, r) for r in (False, True)]
                  if problem.contiguous else [_split(problem, items, executor, stores, capacity - cap)])
        for split in splits:
            choice = None if split is None else _choice(problem, items, *split)
            if choice is not None and fits(problem, choice):
                return choice
    return None


def executor_starts(problem: PlacementProblem) -> list[list[int]]:
    """Valid starts with one execution device: the CPU (stores: disk), then one GPU of each size
    (stores: cpu, then disk). Empty when none of them fits."""
    kinds = {d.name: d.kind for d in problem.devices}
    cpu = [n for n, k in kinds.items() if k == "cpu"]
    disk = [n for n, k in kinds.items() if k == "disk"]
    starts = [_executor_start(problem, e, disk) for e in cpu]
    seen_sizes: set[int] = set()
    for d in problem.devices:
        if d.kind == "gpu" and d.capacity_bytes not in seen_sizes:  # identical GPUs give identical starts
            seen_sizes.add(d.capacity_bytes)
            starts.append(_executor_start(problem, d.name, cpu + disk))
    return [c for c in starts if c is not None]


def fits(problem: PlacementProblem, choice: Sequence[int]) -> bool:
    """:meth:`PlacementProblem.satisfies` without pricing the schedule (linear, no time model):
    capacities, pins, tied storage and contiguity."""
    chosen = problem.options(choice)
    used = problem.used_bytes(chosen)
    if any(used[d.name] > d.capacity_bytes for d in problem.devices):
        return False
    if not all(problem.allows(u, o) for u, o in zip(problem.units, chosen, strict=True)):
        return False
    index = problem.index()
    if any(len({chosen[index[n]].storage for n in g}) > 1 for g in problem.tied_groups):
        return False
    return not problem.contiguous or not problem.extra_ranges(chosen)


# ---------------------------------------------------------------------------------------------
# Greedy fill
# ---------------------------------------------------------------------------------------------


def _moves(problem: PlacementProblem, choice: Sequence[int], movable: Sequence[bool]) -> list[tuple[int, int, int]]:
    """(unit, option, bytes it adds) moves that save time, by time saved per byte added."""
    ranked = []
    for i, (u, c) in enumerate(zip(problem.units, choice, strict=True)):
        cur = u.options[c]
        for k, o in enumerate(u.options):
            saved = cur.work_ns - o.work_ns
            if saved <= 0 or not problem.allows(u, o) or (not movable[i] and o.storage != cur.storage):
                continue
            added = o.stored_bytes + o.resident_bytes + o.peak_bytes + o.prefill_peak_bytes
            ranked.append((-saved / max(1, added), i, k, added))
    return [(i, k, added) for _, i, k, added in sorted(ranked)]


def _fill(problem: PlacementProblem, current: list[int], passes: int) -> None:
    """Apply the moves of :func:`_moves` that keep every device within capacity (in place)."""
    tied = {n for g in problem.tied_groups for n in g}
    movable = [u.name not in tied for u in problem.units]
    memory = MoveMemory(problem, problem.options(current))
    for _ in range(passes):
        moved, refused = False, {}  # devices a move touches -> fewest bytes a move there failed with
        for i, k, added in _moves(problem, current, movable):
            old, new = problem.units[i].options[current[i]], problem.units[i].options[k]
            pair = (new.storage, new.execution, new.prefill_execution)
            if new.work_ns >= old.work_ns or added >= refused.get(pair, added + 1) or not memory.move(i, old, new):
                refused[pair] = min(added, refused.get(pair, added))
                continue
            current[i], before = k, current[i]
            if problem.contiguous and problem.extra_ranges(problem.options(current)):
                memory.move(i, new, old)
                current[i] = before
                continue
            moved = True
        if not moved:
            break


def improve(problem: PlacementProblem, choice: Sequence[int], objective: str = "latency", passes: int = 2,
            value: int | None = None) -> list[int]:
    """``choice`` with units moved to faster options while everything fits; never worse for ``objective``.

    Units go in order of time saved per byte added, so the fastest devices fill with the units that
    gain most from them. Units of a tied group keep their storage (they may change where they
    compute); pins hold. ``value``: the objective of ``choice`` when the caller knows it.
    """
    if not fits(problem, choice):
        return list(choice)
    current = list(choice)
    _fill(problem, current, passes)
    if current == list(choice) or not fits(problem, current):
        return list(choice)
    key = "latency" if objective == "memory" else objective
    value = problem.objective_value(choice, key) if value is None else value
    return current if problem.objective_value(current, key) < value else list(choice)
