"""The greedy strategies users know from ``device_map="sequential" | "balanced" | "balanced_low_0"``.

Torch-free re-implementations of what transformers 5 / accelerate do with those strings, working on
a :class:`~placement_opt.model.graph.LayerGraph` (unit names give the module tree, ``param_bytes +
buffer_bytes`` the sizes, ``module_index`` the registration order) and a :class:`Machine` (its usable
capacities are the ``max_memory``). They are the baselines every plan is compared with, and the
warm starts of the CP-SAT model.

The semantics, in three small steps:

1. **Budgets** (:func:`accelerate_budgets`): ``sequential`` uses the capacities as they are.
   ``balanced`` gives every GPU but the last ``total // n_gpus + int(1.25 x largest layer)`` (the
   largest no-split block or leaf); ``balanced_low_0`` divides by ``n_gpus - 1`` and gives GPU 0 only
   what the other GPUs cannot hold. Devices are ordered GPUs (by index), ``cpu``, ``disk``.
2. **Fill** (:func:`fill_device_map`): walk the module tree in registration order, a queue of the
   top-level children. The head of the queue goes on the current device if it fits, together with
   the modules holding parameters tied to it; on the first GPU and on the CPU (the "main" devices)
   room for the largest remaining layer is kept free (weights offloaded later are loaded there). A
   container that does not fit is replaced by its children; a unit (a no-split block or a leaf)
   that does not fit moves the fill to the next device. ``disk`` takes everything left.
3. **Options** (:func:`choice_from_storage`): a GPU stores and computes its units; ``cpu``/``disk``
   units are streamed to the first GPU (or run on the CPU when there is none).

Known differences from the library: units are never split below the placement unit (accelerate may
split a container module that the tracer kept whole), and the largest "leaf" is taken as the largest
unit that is not a no-split block. :func:`placement_opt.cost.device_map.accelerate_device_map` calls the installed library itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import SolverInputError
from ._transients import RunTransients
from .problem import PlacementOption, PlacementProblem
from .starts import executor_starts, fits, improve

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware.devices import Machine
    from ..model.graph import LayerGraph

__all__ = [
    "STRATEGIES",
    "accelerate_budgets",
    "fill_device_map",
    "baseline_storage",
    "choice_from_storage",
    "GREEDY_RESERVES",
    "ONE_GPU_RESERVES",
    "greedy_choice",
    "greedy_starts",
    "best_greedy_choice",
]

#: The device_map strings re-implemented here.
STRATEGIES = ("sequential", "balanced", "balanced_low_0")
_BUFFER_FACTOR = 1.25  # get_balanced_memory: per-GPU budget grows by 1.25 x the largest layer


@dataclass
class _Node:
    """A module of the tree: a placement unit (never split) or a container of units."""

    name: str
    size: int = 0
    unit: bool = False
    children: list[_Node] = field(default_factory=list)
    members: list[str] = field(default_factory=list)
    """An atomic node's units: itself, or the parts of a no-split block (a decoder layer) cut finer."""

    def units(self) -> list[str]:
        return list(self.members) if self.unit else [u for c in self.children for u in c.units()]

    def contains(self, unit: str) -> bool:
        return self.name == "" or unit == self.name or unit.startswith(self.name + ".")


def _tree(graph: LayerGraph) -> _Node:
    """The module tree of the units, children in registration order, sizes summed upwards. The parts of a no-split
    block (a ``"sublayer"`` or ``"module"`` graph's decoder layer) are one atomic node, as accelerate never splits
    a module of ``_no_split_modules``: opened, the baselines split layers and priced accelerate ~11 % too fast."""
    root = _Node("")
    nodes = {"": root}
    for u in sorted(graph.units(), key=lambda u: u.module_index):
        parts = u.name.split(".")
        block = _block(u.name, u.host_span)
        parent = root
        for depth in range(1, (len(block.split(".")) if block else len(parts)) + 1):
            name = ".".join(parts[:depth])
            if name not in nodes:
                nodes[name] = _Node(name)
                parent.children.append(nodes[name])
            parent = nodes[name]
            parent.size += u.weight_bytes
        parent.unit = True
        parent.members.append(u.name)
        root.size += u.weight_bytes
    return root


def _block(unit: str, span: str | None) -> str | None:
    """The no-split block ``unit`` was cut from (its ``host_span``), where that is a module above it."""
    return span if span and unit.startswith(span + ".") else None


def _ordered(max_memory: Mapping[Any, int]) -> dict[Any, int]:
    """accelerate's device order: GPU indices sorted, then ``cpu``, then ``disk``."""
    gpus = sorted(k for k in max_memory if isinstance(k, int))
    return {k: int(max_memory[k]) for k in gpus + [k for k in ("cpu", "disk") if k in max_memory]}


def _largest_layer_bytes(graph: LayerGraph) -> int:
    """max(largest no-split block, largest leaf): the largest unit, or block of units cut finer."""
    sizes: dict[str, int] = {}
    for u in graph.units():
        key = _block(u.name, u.host_span) or u.name
        sizes[key] = sizes.get(key, 0) + u.weight_bytes
    return max(sizes.values(), default=0)


def accelerate_budgets(graph: LayerGraph, max_memory: Mapping[Any, int], strategy: str) -> dict[Any, int]:
    """Per-device byte budgets the fill uses (``get_balanced_memory`` semantics for balanced ones).

    Example::

        accelerate_budgets(graph, {0: 10_000, 1: 10_000, "cpu": 10**6}, "balanced")
        # {0: total // 2 + int(1.25 * largest unit), 1: 10_000, "cpu": 1_000_000}

    Args:
        graph: the layer graph (sizes and the largest unit).
        max_memory: accelerate keys (``0``, ``"cpu"``, ``"disk"``) to usable bytes.
        strategy: one of :data:`STRATEGIES`.

    Returns:
        The budgets in accelerate's device order.
    """
    budgets = _ordered(max_memory)
    if strategy == "sequential":
        return budgets
    gpus = [k for k, v in budgets.items() if isinstance(k, int) and v > 0]
    low_zero = strategy == "balanced_low_0" and len(gpus) > 1
    if not gpus:
        return budgets
    total = sum(u.weight_bytes for u in graph.units())
    per_gpu = total // (len(gpus) - 1 if low_zero else len(gpus))
    per_gpu += int(_BUFFER_FACTOR * _largest_layer_bytes(graph))
    for g in gpus[:-1]:  # the last GPU keeps its whole capacity, in case the buffer is not enough
        budgets[g] = min(budgets[0] if low_zero and g == 0 else per_gpu, budgets[g])
    if low_zero:
        others = sum(budgets.get(i, 0) for i in range(1, len(gpus)))
        budgets[0] = min(max(0, total - others), budgets[0])
    return budgets


def _largest_remaining(queue: Sequence[_Node]) -> tuple[int, list[str]]:
    """Size and names of the largest unit still queued (the layer the main devices keep room for)."""
    best, names = 0, []
    stack = list(queue)
    while stack:
        node = stack.pop(0)
        if not node.unit:
            stack = node.children + stack
        elif node.size > best:
            best, names = node.size, [node.name]
        elif node.size == best:
            names.append(node.name)
    return best, names


def _tied_partners(node: _Node, queue: Sequence[_Node], tied: Sequence[Sequence[str]]) -> list[_Node]:
    """Queued modules holding units tied to ``node`` from outside it (they must go with it)."""
    outside = [u for group in tied if any(node.contains(u) for u in group)
               for u in group if not node.contains(u)]
    partners: list[_Node] = []
    for unit in outside:
        holder = next((q for q in queue if q.contains(unit)), None)
        if holder is not None and holder not in partners:
            partners.append(holder)
    return partners


def fill_device_map(graph: LayerGraph, budgets: Mapping[Any, int]) -> dict[str, Any]:
    """Storage device (accelerate key) of every unit: ``infer_auto_device_map``'s greedy fill.

    Args:
        graph: the layer graph; ``meta.tied_unit_groups`` are kept together.
        budgets: bytes per device in fill order (:func:`accelerate_budgets`).

    Returns:
        Unit name -> ``0``/``1``/... for GPUs, ``"cpu"`` or ``"disk"``.
    """
    devices = list(budgets) + ([] if "disk" in budgets else ["disk"])
    gpus = [d for d in devices if isinstance(d, int)]
    main = {gpus[0], "cpu"} if gpus else {"cpu"}
    used = dict.fromkeys(devices, 0)
    queue = list(_tree(graph).children)
    reserve, reserve_names = _largest_remaining(queue)
    placed: dict[str, Any] = {}
    current = 0
    while queue:
        node = queue.pop(0)
        reserve_names = [n for n in reserve_names if not node.contains(n)]
        if not reserve_names:
            reserve, reserve_names = _largest_remaining(queue)
        device = devices[current]
        kept = reserve if device in main else 0
        limit = None if device == "disk" else budgets[device] - kept
        partners = _tied_partners(node, queue, graph.meta.tied_unit_groups)
        size = node.size + sum(p.size for p in partners)
        if limit is None or used[device] + size <= limit:  # fits, with its tied partners
            used[device] += size
            for n in [node, *partners]:
                placed.update(dict.fromkeys(n.units(), device))
            queue = [q for q in queue if q not in partners]
            continue
        split = next((p for p in partners if not p.unit), None) if used[device] + node.size <= limit else None
        if split is not None:  # a tied partner is a container: open it and try again
            at = queue.index(split)
            queue = [node, *queue[:at], *split.children, *queue[at + 1:]]
        elif not node.unit:  # a container that does not fit: treat its children one by one
            queue = node.children + queue
        else:  # a unit that does not fit: keep the reserve here and move on to the next device
            used[device] += kept
            current += 1
            queue.insert(0, node)
            continue
        reserve, reserve_names = _largest_remaining(queue)
    return placed


def baseline_storage(graph: LayerGraph, machine: Machine, strategy: str) -> dict[str, str]:
    """Storage device name (``"cuda:0"``, ``"cpu"``, ``"disk"``) per unit for ``strategy``.

    Example::

        baseline_storage(graph, Machine([...]), "balanced")  # {"model.embed_tokens": "cuda:0", ...}

    Raises:
        SolverInputError: an unknown strategy (the message lists :data:`STRATEGIES`).
    """
    if strategy not in STRATEGIES:
        raise SolverInputError(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    max_memory = machine.max_memory
    placed = fill_device_map(graph, accelerate_budgets(graph, max_memory, strategy))
    return {u: f"cuda:{d}" if isinstance(d, int) else d for u, d in placed.items()}


def choice_from_storage(problem: PlacementProblem, storage: Mapping[str, str]) -> list[int]:
    """Option index per unit for a storage map: GPUs compute their own units, cpu/disk stream to GPU 0.

    The execution device of ``cpu``/``disk`` units is the first GPU of the problem (the CPU when there
    is none); among options with that storage and execution, ``stream`` is preferred over
    ``stream_sync``, and a unit without such an option takes the fastest option with that storage.

    Raises:
        SolverInputError: a unit missing from ``storage``, or a storage device none of its options uses.
    """
    gpus = [d.name for d in problem.devices if d.kind == "gpu"]
    main = gpus[0] if gpus else "cpu"
    rank = {"resident": 0, "stream": 1, "stream_sync": 2, "phased": 3}  # phased: not an accelerate map
    choice = []
    for u in problem.units:
        if u.name not in storage:
            raise SolverInputError(f"unit {u.name} has no storage device in the baseline map: give every unit one")
        where = storage[u.name]
        execution = where if where in gpus else (main if main in gpus or where == "cpu" else "cpu")
        options = [i for i, o in enumerate(u.options) if o.storage == where]
        if not options:
            raise SolverInputError(f"unit {u.name} has no option stored on {where}: offered storages are "
                             f"{sorted({o.storage for o in u.options})}")
        exact = [i for i in options if u.options[i].execution == execution]
        pool = exact or options
        choice.append(min(pool, key=lambda i: (rank[u.options[i].mode],
                                               u.options[i].work_ns)))
    return choice


# ---------------------------------------------------------------------------------------------
# A constructive feasible start for CP-SAT
# ---------------------------------------------------------------------------------------------
#: Reserve fractions tried by :func:`best_greedy_choice` (None: no reserve).
GREEDY_RESERVES = (None, 0.0, 0.1, 0.25, 0.5)
#: Reserve fractions also tried with the reserve kept on one GPU only (:func:`greedy_choice`'s
#: ``one_gpu``). A prompt streams its phased and streamed units through one GPU, and the stream
#: buffer it needs there can be larger than a resident layer: kept on every GPU, it left seven of
#: eight L4s empty for Llama-3.1-405B at an 8064-token prompt (a start 1.8x the optimum).
ONE_GPU_RESERVES = (0.0,)
#: How many of the best valid starts :func:`best_greedy_choice` fills greedily beside the constructive
#: ones on problems above :data:`_FILL_ALL_UNITS` units (each fill is priced once: ~35 ms at 724 units).
_FILLED = 2
_FILL_ALL_UNITS = 200


def greedy_choice(problem: PlacementProblem, reserve_fraction: float | None = None, *,
                  one_gpu: bool = False) -> list[int]:
    """A simple feasible-if-possible assignment: each unit takes the fastest allowed option that fits.

    Units are placed in execution order against the remaining capacity; tied units follow the
    storage of the first of their group. With ``reserve_fraction``, weights resident on a GPU leave
    free the largest stream buffer of that GPU plus this fraction of its capacity, so later units can
    still be streamed there (KV cache and buffers) instead of falling back to the CPU; with ``one_gpu``,
    only on the GPU of largest capacity (the first of those), and the others fill with resident weights.
    """
    free = {d.name: d.capacity_bytes for d in problem.devices}
    peak = dict.fromkeys(free, 0)
    reserve = _gpu_reserves(problem, reserve_fraction, one_gpu)
    tied_to = {n: g[0] for g in problem.tied_groups for n in g[1:]}
    storage: dict[str, str] = {}
    choice = []
    by_work: dict[int, list[int]] = {}  # per menu (units share a few option tuples: 22 of 724 units' own)
    groups = RunTransients(problem) if problem.group_copies else None
    for k, u in enumerate(problem.units):
        if groups is not None:
            groups.enter(k)
        lead = tied_to.get(u.name)
        # the least (disallowed, off its tie, without room, work_ns, index): options in work order, the first
        # that is allowed, tied right and fits ends the scan (most units: the first or second option)
        best, least, best_adds = 0, None, None
        order = by_work.get(id(u.options))
        if order is None:
            order = by_work[id(u.options)] = sorted(range(len(u.options)), key=lambda i: (u.options[i].work_ns, i))
        for i in order:
            o = u.options[i]
            placed = (not problem.allows(u, o), lead in storage and o.storage != storage[lead])
            if least is not None and (*placed, False) >= least:
                continue  # no better than the best so far even with room: its bytes need no counting
            if groups is not None and _short_of_held(o, free, reserve):
                adds, flaws = None, (*placed, True)
            else:
                adds = _adds(o, peak, groups) if o.mode == "phased" or groups is not None else None
                flaws = (*placed, not _room_for(o, free, peak, reserve, adds))
            if least is None or flaws < least:
                best, least, best_adds = i, flaws, adds
                if not any(flaws):
                    break
        o = u.options[best]
        for d, added in (_adds(o, peak, groups) if best_adds is None else best_adds).items():
            free[d] -= added
        if groups is not None:
            groups.add(o)
        else:
            for d, nbytes in o.peaks():
                peak[d] = max(peak[d], nbytes)
        storage[u.name] = o.storage
        choice.append(best)
    return choice


def _room_for(o: PlacementOption, free: dict[str, int], peak: dict[str, int], reserve: dict[str, int],
              adds: dict[str, int] | None) -> bool:
    """Whether :func:`greedy_choice` has room for ``o``: its bytes fit in what is ``free`` beside the transient
    ``peak`` each device holds, resident weights leaving the GPU's ``reserve``. ``adds`` is :func:`_adds` where the
    caller needs it (transients on two devices, or counted per copy run), else None."""
    kept = reserve[o.storage] if o.storage == o.execution else 0  # resident weights leave the reserve
    if adds is not None:
        return all(added + (kept if d == o.storage else 0) <= free[d] for d, added in adds.items())
    extra_peak = max(0, o.peak_bytes - peak[o.execution])  # the common case, inline (5 x 11,000 calls)
    if o.storage == o.execution:
        return o.stored_bytes + o.resident_bytes + extra_peak + kept <= free[o.storage]
    return o.stored_bytes <= free[o.storage] and o.resident_bytes + extra_peak <= free[o.execution]


def _short_of_held(o: PlacementOption, free: dict[str, int], reserve: dict[str, int]) -> bool:
    """Whether ``o``'s stored and resident bytes alone overfill a device where its transient cannot shrink, so
    that :func:`_room_for` is False whatever :func:`_adds` counts (the greedy skips counting it: most of a start's
    time on eight GPUs, each full after a few layers). A transient grows or stays as a unit joins its copy run,
    except on the device its group copy lands on (:meth:`RunTransients.grows`), left out here."""
    held = {o.storage: o.stored_bytes + (reserve[o.storage] if o.storage == o.execution else 0)}
    held[o.execution] = held.get(o.execution, 0) + o.resident_bytes
    shrinks = o.group_device if o.group_copy_bytes else None
    return any(nbytes > free[d] for d, nbytes in held.items() if d != shrinks)


def _adds(o: PlacementOption, peak: dict[str, int], groups: RunTransients | None) -> dict[str, int]:
    """Bytes ``o`` adds per device beside the transient ``peak`` each already holds: stored bytes on its
    storage, resident ones on its execution device, and each transient (peaks()) above the peak there; with
    copy groups (``groups``), what the device's transient grows by instead."""
    added = {o.storage: o.stored_bytes}
    added[o.execution] = added.get(o.execution, 0) + o.resident_bytes
    if groups is not None:
        for d, grown in groups.grows(o).items():
            added[d] = added.get(d, 0) + grown
        return added
    top: dict[str, int] = {}
    for d, nbytes in o.peaks():
        top[d] = max(top.get(d, 0), nbytes)
    for d, nbytes in top.items():
        added[d] = added.get(d, 0) + max(0, nbytes - peak[d])
    return added


def _gpu_reserves(problem: PlacementProblem, reserve_fraction: float | None, one_gpu: bool = False) -> dict[str, int]:
    """Bytes resident weights leave free per device: the largest stream buffer + a fraction (GPUs only; with
    ``one_gpu``, the largest GPU only)."""
    reserve = {d.name: 0 for d in problem.devices}
    gpus = [d for d in problem.devices if d.kind == "gpu"]
    if reserve_fraction is None or not gpus:
        return reserve
    keeping = {max(gpus, key=lambda d: d.capacity_bytes).name} if one_gpu else {d.name for d in gpus}
    buffer = dict.fromkeys(reserve, 0)  # the largest stream buffer per computing device, in one pass
    for menu in problem.menu_units:  # each shared options tuple once
        for o in menu.options:
            if o.execution != o.storage:  # with copy groups, a group's whole buffer
                buffer[o.execution] = max(buffer[o.execution], problem.most_peak(o))
            if o.mode == "phased" and o.prefill_peak_bytes > buffer[o.device_in("prefill_ns")]:
                buffer[o.device_in("prefill_ns")] = o.prefill_peak_bytes  # weights streamed there for the prefill
    for d in gpus:
        if d.name in keeping:
            reserve[d.name] = buffer[d.name] + int(reserve_fraction * d.capacity_bytes)
    return reserve


def greedy_starts(problem: PlacementProblem) -> list[tuple[list[int], str]]:
    """(assignment, name) of :func:`greedy_choice` over :data:`GREEDY_RESERVES`, the first without a
    reserve, then over :data:`ONE_GPU_RESERVES` kept on one GPU (machines with two GPUs or more: with
    one, the same starts)."""
    starts = [(greedy_choice(problem, r), "greedy" if r is None else f"greedy (GPU reserve {r:.0%})")
              for r in GREEDY_RESERVES]
    if len(problem.gpu_names()) > 1:
        starts += [(greedy_choice(problem, r, one_gpu=True), f"greedy (GPU reserve {r:.0%} on the largest GPU only)")
                   for r in ONE_GPU_RESERVES]
    return starts


def best_greedy_choice(problem: PlacementProblem, objective: str = "latency") -> list[int]:
    """The best valid start: :func:`greedy_starts` and the constructive
    starts of :mod:`.starts` (every unit on one execution device), filled greedily: every
    constructive start and, on large problems, only the best :data:`_FILLED` others.

    Valid whenever one of those starts is, in particular whenever every unit can compute on the CPU
    with its weights on the CPU or the disk. With no valid start: ``greedy_choice(problem)``.
    """
    key = "latency" if objective == "memory" else objective
    variants = [choice for choice, _ in greedy_starts(problem)]
    constructive = {tuple(c) for c in executor_starts(problem)}
    unique = list(dict.fromkeys([*(tuple(c) for c in variants), *constructive]))
    valid = sorted((problem.objective_value(c, key), c) for c in unique if fits(problem, c))
    if not valid:
        return variants[0]
    others = len(valid) if len(problem.units) <= _FILL_ALL_UNITS else _FILLED
    to_fill = [(v, c) for rank, (v, c) in enumerate(valid) if rank < others or c in constructive]
    for value, start in to_fill:
        better = tuple(improve(problem, start, key, value=value))
        if better != start:  # improve() keeps only fills that lower the objective
            valid.append((problem.objective_value(better, key), better))
    return list(min(valid)[1])
