"""What to say when memory is short: a device over capacity, or no placement that fits at all.

:func:`violation` says it of one device over capacity, :func:`shortage_message` of a problem no placement
fits, and :func:`proven_short` tells whether arithmetic alone proves that no placement fits; each message
says how much is short, what takes the space (weights, KV cache, workspace, buffers) and what to do. The
figures are :mod:`.memory`'s.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..units import format_bytes
from .memory import Violation

if TYPE_CHECKING:  # pragma: no cover
    from ..model.graph import LayerGraph
    from ..solver.problem import DeviceSpec, PlacementOption, PlacementProblem
    from .memory import DeviceMemory
    from .workload import Workload

__all__ = ["violation", "shortage_message", "proven_short"]


_ADVICE = {
    "gpu": "raise max_memory, add {more} to the devices, or reduce the batch or context",
    "cpu": "raise the CPU's max_memory, add {more} to the devices, or reduce the batch or context",
    "disk": "free disk space or point the offload folder at a larger disk",
}
#: The devices each kind's advice may ask to add, where the machine lacks them.
_ADDABLE = {"gpu": ("cpu", "disk"), "cpu": ("disk",)}


def _advice(kind: str, present: Collection[str]) -> str:
    """What to do about a ``kind`` device over capacity; a device the machine has is not asked for again."""
    missing = [d for d in _ADDABLE.get(kind, ()) if d not in present]
    advice = _ADVICE[kind]
    if not missing:  # every device it could add is there: more memory or a smaller workload
        return advice.replace(", add {more} to the devices", "")
    return advice.format(more="/".join(f"'{d}'" for d in missing))


def violation(memory: DeviceMemory, workload: Workload, present: Collection[str] = ()) -> Violation:
    """The message for a device over capacity: how much is short, what takes the space, what to do (``present``:
    the machine's device names, whose kinds it does not ask to add)."""
    need, has = memory.used_bytes, memory.capacity_bytes
    parts = [("weights", memory.weights_bytes),
             (f"KV cache for batch {workload.batch_size} x {workload.context_len} tokens", memory.kv_cache_bytes),
             (f"activation workspace{f' of {memory.peak_unit}' if memory.peak_unit else ''} for "
              f"{workload.batch_size} x {workload.prompt_len} prompt tokens", memory.workspace_bytes),
             ("stream buffer", memory.stream_buffer_bytes),
             ("gradients, optimizer states and saved activations" if workload.training else "other",
              memory.other_bytes)]
    split = ", ".join(f"{label} {format_bytes(n)}" for label, n in parts if n > 0)
    kind = "gpu" if memory.device.startswith("cuda:") else memory.device
    message = (f"{memory.device} needs {format_bytes(need)}, has {format_bytes(has)} "
               f"({format_bytes(need - has)} short): {split}: {_advice(kind, present)}")
    return Violation(device=memory.device, needed_bytes=need, capacity_bytes=has, message=message)


@dataclass(frozen=True)
class _Totals:
    """Lower bounds of what any placement needs, against what the devices have: all of them (weights, KV
    cache, one unit's workspace) and the compute devices (KV cache and that workspace)."""

    least: list[int]
    resident: list[int]
    compute: list[DeviceSpec]
    need_all: int
    have_all: int
    need_compute: int
    have_compute: int


def _totals(problem: PlacementProblem) -> _Totals:
    least = [min(o.stored_bytes + o.resident_bytes for o in u.options) for u in problem.units]
    resident = [min(o.resident_bytes for o in u.options) for u in problem.units]
    peak = max((min(o.peak_bytes for o in u.options) for u in problem.units), default=0)
    compute = [d for d in problem.devices if d.kind != "disk"]
    return _Totals(least, resident, compute, sum(least) + peak, sum(d.capacity_bytes for d in problem.devices),
                   sum(resident) + peak, sum(d.capacity_bytes for d in compute))


def proven_short(problem: PlacementProblem) -> bool:
    """Whether the totals, or a unit that fits on no device even alone, prove that no placement fits
    (:func:`shortage_message` says how): then the solver need not search, and could run out of time before
    it proved as much (a 32k-token prompt whose eager scores no device holds)."""
    totals = _totals(problem)
    return (totals.need_all > totals.have_all or totals.need_compute > totals.have_compute
            or bool(_homeless(problem)))


def _homeless(problem: PlacementProblem) -> list[tuple[str, str, int, int]]:
    """Units none of whose options fits its devices even with nothing else on them: (name, and for the
    option that comes closest, the device it overfills, what it needs there, what that device has)."""
    cap = {d.name: d.capacity_bytes for d in problem.devices}

    def needs(o: PlacementOption) -> dict[str, int]:
        on = {o.storage: o.stored_bytes}
        on[o.execution] = on.get(o.execution, 0) + o.resident_bytes + o.peak_bytes
        if o.prefill_execution:
            on[o.prefill_execution] = max(on.get(o.prefill_execution, 0), o.prefill_peak_bytes)
        return on

    found = []
    for unit in problem.units:
        over = [max((need - cap[d], d, need) for d, need in needs(o).items()) for o in unit.options]
        if over and min(over)[0] > 0:
            _, device, need = min(over)
            found.append((unit.name, device, need, cap[device]))
    return found


def shortage_message(problem: PlacementProblem, graph: LayerGraph, workload: Workload) -> str:
    """Which capacity is short, by how much, and what takes the space."""
    lines = []
    totals = _totals(problem)
    least, resident, compute = totals.least, totals.resident, totals.compute
    need_all, have_all = totals.need_all, totals.have_all
    why = _what_takes_space(least, resident, graph, workload)
    if need_all > have_all:
        # a bare 'disk' is this machine's free space, however large the machine described beside it: say its size
        has = ", ".join(f"{d.name} {format_bytes(d.capacity_bytes)}" for d in problem.devices)
        more = ("a larger disk (disk=SIZE, or disk=nvme-gen4 for a described one: a bare 'disk' is the free space "
                "where the offload folder goes)" if any(d.kind == "disk" for d in problem.devices)
                else "a disk device")
        lines.append(f"needs at least {format_bytes(need_all - have_all)} more across {', '.join(d.name for d in problem.devices)} "
                     f"(usable: {has}); {why}; add {more} or more memory, or reduce the batch or context")
    elif totals.need_compute > totals.have_compute:
        lines.append(f"needs at least {format_bytes(totals.need_compute - totals.have_compute)} more on the compute devices "
                     f"({', '.join(d.name for d in compute)}), which must hold the KV cache and workspace; {why}; "
                     f"reduce the batch or context, or add GPU/CPU memory")
    top = max(problem.devices, key=lambda d: d.capacity_bytes)
    big = [(u.name, m) for u, m in zip(problem.units, least, strict=True) if m > top.capacity_bytes]
    if big:
        name, m = max(big, key=lambda t: t[1])
        lines.append(f"unit {name} alone needs {format_bytes(m)}, more than the largest device ({top.name}, "
                     f"{format_bytes(top.capacity_bytes)}): give that device more memory")
    elif not lines and (homeless := _homeless(problem)):
        name, device, need, has = max(homeless, key=lambda t: t[2] - t[3])
        more = f" (and {len(homeless) - 1} more unit(s))" if len(homeless) > 1 else ""
        lines.append(f"unit {name}{more} fits on no device even alone: its least demanding option needs "
                     f"{format_bytes(need)} on {device}, which has {format_bytes(has)} (weights, KV cache, workspace "
                     f"and buffers); reduce the batch or context, or add GPU/CPU memory")
    if not lines:
        from .build import run_as_glue  # build prices the problem; this module reads it after

        lines.append(_split_shortage(problem, need_all, have_all,
                                     [n for n in run_as_glue(graph) if n in problem.pins]))
    return "no placement fits: " + "; ".join(lines)


def _what_takes_space(least: list[int], resident: list[int], graph: LayerGraph, workload: Workload) -> str:
    """The weights' and the KV cache's totals, the bigger one first: the reason :func:`shortage_message` gives
    for a capacity short in total."""
    # a training step keeps no KV cache, and its weights come with their gradients and optimizer states
    kv = 0 if workload.training else sum(u.kv_bytes_per_token * u.kv_tokens_held(workload.prompt_len,
                                                                                 workload.context_len)
                                         for u in graph.units()) * workload.batch_size
    weights = sum(least) - sum(resident)
    kv_why = f"the KV cache for batch {workload.batch_size} x {workload.context_len} tokens alone is {format_bytes(kv)}"
    states = " with their gradients and optimizer states" if workload.training else ""
    weights_why = f"the weights{states} alone are {format_bytes(weights)}"
    kv_part = f"the KV cache for batch {workload.batch_size} x {workload.context_len} tokens {format_bytes(kv)}"
    return kv_why if kv >= weights else weights_why + (f" ({kv_part})" if kv else "")  # the bigger one first


def _split_shortage(problem: PlacementProblem, need_all: int, have_all: int, glue: Sequence[str] = ()) -> str:
    """:func:`shortage_message`'s line where the totals suffice and no unit is too big, yet nothing fits: the
    constraints in the way, and memory that is enough where a start shows it."""
    blamed = _constraints_in_the_way(problem, glue)
    enough = _enough(problem)
    more = ", ".join(f"{format_bytes(n)} more on {name}" for name, n in enough.items()) if enough else ""
    return (f"the total memory suffices ({format_bytes(need_all)} needed at least, {format_bytes(have_all)} "
            f"available) but no assignment fits every device"
            + (f" under {'; and '.join(blamed)}" if blamed else
               ": the per-device split of weights, KV cache and workspace does not work out; add memory")
            + (f" ({more} is enough: a plan fits with it)" if more else ""))


def _least_memory(problem: PlacementProblem) -> list[int]:
    """Each unit's option that takes least of the memories that compute (the disk's space aside), the fastest of
    those: the start that asks least of the GPUs and the CPU, whatever it costs in time."""
    def key(option: PlacementOption) -> tuple[int, int, int]:
        # what it holds for the whole run first (summed over units), its peak second (a device holds one at a time)
        held = (0 if option.storage == "disk" else option.stored_bytes) + option.resident_bytes
        return held, option.peak_bytes, option.prefill_ns + option.decode_ns

    return [min(range(len(unit.options)), key=lambda i, u=unit: key(u.options[i])) for unit in problem.units]


def _enough(problem: PlacementProblem) -> dict[str, int] | None:
    """Memory that is enough, per device: what the start closest to fitting (each unit's least demanding option, the
    greedy fills, the constructive starts) uses beyond each device, kept where that start does fit on the devices
    grown by as much (pins, ties and order included). Sufficient, not least: a search could need less. None when no
    start fits that way."""
    import dataclasses

    from ..solver.greedy import greedy_starts
    from ..solver.starts import executor_starts, fits

    def grown(extra: dict[str, int]) -> PlacementProblem:
        return dataclasses.replace(problem, devices=tuple(
            dataclasses.replace(d, capacity_bytes=d.capacity_bytes + extra.get(d.name, 0)) for d in problem.devices))

    best: dict[str, int] | None = None
    starts = [_least_memory(problem), *(c for c, _ in greedy_starts(problem)), *(list(c) for c in executor_starts(problem))]
    for choice in starts:
        used = problem.used_bytes(problem.options(choice))
        over = {d.name: used[d.name] - d.capacity_bytes for d in problem.devices if used[d.name] > d.capacity_bytes}
        if over and (best is None or sum(over.values()) < sum(best.values())) and fits(grown(over), choice):
            best = over
    return best


def _constraints_in_the_way(problem: PlacementProblem, glue: Sequence[str] = ()) -> list[str]:
    """The constraints beyond capacity that a plan must meet, each with what the user can do about it. ``glue``:
    the units pinned to the home device because their parent uses their weights outside their forward
    (:func:`~.build.run_as_glue`), which no user pin moves."""
    out = []
    given = {name: device for name, device in problem.pins.items() if name not in glue}
    if given:
        pinned = ", ".join(f"{name} -> {device}" for name, device in list(given.items())[:4])
        out.append(f"the pins ({pinned}{', ...' if len(given) > 4 else ''}): move or drop them")
    if glue:
        home = problem.pins[glue[0]]
        out.append(f"the {len(glue)} unit(s) kept on the home device {home} ({', '.join(glue[:3])}"
                   f"{', ...' if len(glue) > 3 else ''}: their parent uses their weights outside their forward): "
                   f"give {home} room for them, or plan with granularity='block'")
    if problem.tied_groups:
        index = problem.index()
        groups = []
        for group in problem.tied_groups[:3]:
            units = [problem.units[index[name]] for name in group]
            nbytes = max(min(o.stored_bytes for o in u.options) for u in units)  # the shared weight, at least
            groups.append(f"{' + '.join(group)} (at least {format_bytes(nbytes)} together)")
        out.append(f"tied weights, stored on one device: {', '.join(groups)}: give one device room for them beside "
                   f"what it must hold (more memory), or untie them if the model allows (tie_word_embeddings=False)")
    if problem.contiguous:
        out.append("contiguous ranges per device: solve with contiguous=False")
    return out
