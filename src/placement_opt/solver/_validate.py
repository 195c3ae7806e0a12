"""What makes a placement problem well formed: the checks its options and the problem run when built.

Torch-free. :class:`~.specs.PlacementOption` and :class:`~.problem.PlacementProblem` call these from
their ``__post_init__``; each raises :class:`~placement_opt.errors.SolverInputError` saying what is wrong.
The option's constants (:data:`~.specs.MODES`, :data:`~.specs.GROUP_BUFFERS`) come in as arguments:
:mod:`.specs` and :mod:`.problem` import this module, not the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ..errors import SolverInputError

if TYPE_CHECKING:  # pragma: no cover
    from .problem import PlacementProblem
    from .specs import PlacementOption

__all__ = ["check_option", "check_problem"]

#: The kinds of device a problem may hold (:class:`~.specs.DeviceSpec`).
DEVICE_KINDS = ("gpu", "cpu", "disk")

#: The largest price or size one option, edge or device may carry: CP-SAT's integers are 64-bit, and the model
#: sums and multiplies them (``cost.build`` refuses workloads whose totals would pass it, in its own words).
MAX_VALUE = 2**60


def check_option(option: PlacementOption, modes: Sequence[str], group_buffers: int) -> None:
    """Raise unless ``option`` is well formed: a mode of ``modes``, a prefill device and background copies only
    where its mode has them, its group copy held ``group_buffers`` times by its peak, no price below 0."""
    if option.mode not in modes:
        raise SolverInputError(f"option mode {option.mode!r} is not one of {modes}")
    phased = option.prefill_execution is not None and option.prefill_execution != option.execution
    if phased != (option.mode == "phased") or (option.prefill_peak_bytes and not phased):
        raise SolverInputError(
            f"option {option.storage}->{option.execution} ({option.mode}): a phased option, and only a phased "
            f"one, names a prefill_execution other than its execution (got {option.prefill_execution!r}) "
            f"and may carry prefill_peak_bytes")
    if (option.copy_prefill_ns or option.copy_decode_ns) and option.mode not in ("stream", "phased"):
        raise SolverInputError(f"option {option.storage}->{option.execution} ({option.mode}): only a stream or "
                               f"phased option copies in the background (copy_*_ns must be 0)")
    if option.group_copy_bytes:
        _check_group_copy(option, group_buffers)
    values = _figures(option)
    if min(values) >= 0 and max(values) <= MAX_VALUE:
        return  # the common case, checked at once (pricing a module-level 70B builds 16,000 options)
    for key in _FIGURES:
        if not 0 <= getattr(option, key) <= MAX_VALUE:
            raise SolverInputError(f"option {option.storage}->{option.execution}: {key} is "
                                   f"{getattr(option, key)}, must be between 0 and 2**60 (the solver's integers "
                                   f"are 64-bit): check the prices' units")


#: An option's prices (ns) and sizes (bytes), each at most :data:`MAX_VALUE`.
_FIGURES = ("prefill_ns", "decode_ns", "stored_bytes", "resident_bytes", "peak_bytes", "prefill_peak_bytes",
            "copy_prefill_ns", "copy_decode_ns", "host_prefill_ns", "host_decode_ns", "disk_prefill_ns",
            "disk_decode_ns")


def _figures(option: PlacementOption) -> tuple[int, ...]:
    return (option.prefill_ns, option.decode_ns, option.stored_bytes, option.resident_bytes, option.peak_bytes,
            option.prefill_peak_bytes, option.copy_prefill_ns, option.copy_decode_ns, option.host_prefill_ns,
            option.host_decode_ns, option.disk_prefill_ns, option.disk_decode_ns)


def _check_group_copy(option: PlacementOption, group_buffers: int) -> None:
    own = option.prefill_peak_bytes if option.mode == "phased" else option.peak_bytes
    if option.mode not in ("stream", "phased") or not 0 < option.group_copy_bytes * group_buffers <= own:
        raise SolverInputError(
            f"option {option.storage}->{option.execution} ({option.mode}): group_copy_bytes "
            f"{option.group_copy_bytes} needs a stream or phased option whose peak holds it "
            f"{group_buffers} times (peak {own})")


def check_problem(problem: PlacementProblem) -> None:
    """Raise unless ``problem`` is well formed, listing every fault: units with options on known devices,
    edges, tied groups, pins, copy and part groups naming known units, edges forward, unit names unique."""
    names = [u.name for u in problem.units]
    known = set(names)
    devices = {d.name for d in problem.devices}
    problems = [] if names else ["the problem has no unit"]
    problems += _device_problems(problem)
    edge_problems, edge_total = _edge_prices(problem)
    problems += _total_problems(problem, edge_total)
    problems += [f"unit {u.name} has no option" for u in problem.units if not u.options]
    problems += [f"edge {e.src}->{e.dst} names an unknown unit" for e in problem.edges
                 if e.src not in known or e.dst not in known]
    problems += [f"option of {u.name} uses unknown device {o.storage}/{o.execution}/{o.prefill_execution}"
                 for u in problem.menu_units for o in u.options
                 if o.storage not in devices or o.execution not in devices
                 or (o.prefill_execution or o.execution) not in devices]
    problems += edge_problems
    problems += [f"tied group names unknown unit {n}" for g in problem.tied_groups for n in g
                 if n not in known]
    problems += ["a tied group is empty" for g in problem.tied_groups if not g]
    problems += [f"pin names unknown unit {n}" for n in problem.pins if n not in known]
    problems += [f"pin of {n} names unknown device {d}" for n, d in problem.pins.items() if d not in devices]
    order = {n: i for i, n in enumerate(names)}
    problems += _copy_group_problems(problem.copy_groups, order)
    problems += _copy_group_problems(problem.part_groups, order, "part group")
    problems += [f"edge {e.src}->{e.dst} points backwards in execution order" for e in problem.edges
                 if e.src in order and e.dst in order and order[e.src] >= order[e.dst]]
    if len(known) != len(names):
        problems.append("unit names are not unique")
    if problems:
        raise SolverInputError("malformed placement problem:\n  " + "\n  ".join(problems))


def _device_problems(problem: PlacementProblem) -> list[str]:
    """Devices named twice, of an unknown kind, or with a capacity below 0."""
    names = [d.name for d in problem.devices]
    problems = [f"device {n} is named {names.count(n)} times" for n in sorted(set(names)) if names.count(n) > 1]
    problems += [f"device {d.name} is of kind {d.kind!r}, not one of {', '.join(DEVICE_KINDS)}"
                 for d in problem.devices if d.kind not in DEVICE_KINDS]
    problems += [f"device {d.name} has capacity_bytes {d.capacity_bytes}, below 0 or above 2**60 (the solver's "
                 f"integers are 64-bit): give at most what its units could use" for d in problem.devices
                 if not 0 <= d.capacity_bytes <= MAX_VALUE]
    return problems


def _edge_prices(problem: PlacementProblem) -> tuple[list[str], int]:
    """Edges with a price below 0 or above :data:`MAX_VALUE`, and the sum of every edge's largest price."""
    problems, total = [], 0
    for e in problem.edges:
        prices = (*e.prefill_ns.values(), *e.decode_ns.values())
        if not prices:
            continue
        largest = max(prices)
        if min(prices) < 0 or largest > MAX_VALUE:
            bad = [v for v in prices if not 0 <= v <= MAX_VALUE]
            problems.append(f"edge {e.src}->{e.dst} has a transfer price below 0 or above 2**60 ({bad})")
        total += largest
    return problems, total


def _total_problems(problem: PlacementProblem, edge_total: int) -> list[str]:
    """A sum the model makes that could pass :data:`MAX_VALUE`: a device's bytes and a path's time add a figure of
    every unit (and edge), so their largest, added up, must stay within it (CP-SAT refused larger models as
    invalid, and the solve reported a status outside its documented ones)."""
    largest: dict[int, int] = {}  # per menu: units of one shape share their options
    total = edge_total
    for unit in problem.units:
        if id(unit.options) not in largest:
            largest[id(unit.options)] = max((max(_figures(o)) for o in unit.options), default=0)
        total += largest[id(unit.options)]
    if total <= MAX_VALUE:
        return []
    return [f"the largest price or size of every unit and edge adds up to {total}, above 2**60 (the solver's "
            f"integers are 64-bit and it sums them): check the prices' units"]


def _copy_group_problems(groups: Sequence[Sequence[str]], order: Mapping[str, int],
                         what: str = "copy group") -> list[str]:
    """What is wrong with ``copy_groups`` (or ``part_groups``): unknown units, a unit in two groups, a group not
    consecutive."""
    problems, seen = [], set()
    for group in groups:
        if not group or any(n not in order for n in group):
            problems.append(f"{what} {list(group)} is empty or names an unknown unit")
            continue
        if seen & set(group) or len(set(group)) < len(group):
            problems.append(f"{what} {list(group)} repeats a unit of another group or of itself")
        seen.update(group)
        positions = [order[n] for n in group]
        if positions != list(range(positions[0], positions[0] + len(group))):
            problems.append(f"{what} {list(group)} is not a run of consecutive units in execution order")
    return problems
