"""``LayerGraph`` + ``Machine`` + ``Workload`` -> :class:`~placement_opt.solver.problem.PlacementProblem`.

Every option of every unit is priced by :mod:`.pricing` and converted to the solver's integers
there (:func:`~.pricing._to_option`); this module lays out the option menu, the edges and the devices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..hardware.devices import Machine, normalize_device_name
from ..hardware.resolve import as_machine
from ..solver.problem import MODES, DeviceSpec, EdgeSpec, PlacementProblem, UnitSpec
from .pricing import _Context, _edge_ns, _Parts, _price, _to_option
from .workload import Workload

if TYPE_CHECKING:  # pragma: no cover
    from ..model.graph import LayerGraph, UnitInfo

__all__ = ["build_problem"]


def _menu(machine: Machine, modes: Iterable[str]) -> list[tuple[str, str, str]]:
    """(storage, execution, mode) of every option, in a fixed order."""
    gpus = [d.name for d in machine.gpus]
    cpu = machine.cpu.name if machine.cpu else None
    disk = machine.disk.name if machine.disk else None
    streamed = [m for m in ("stream", "stream_sync") if m in modes]
    menu = [(g, g, "resident") for g in gpus]
    if cpu:
        menu.append((cpu, cpu, "resident"))
        menu += [(cpu, g, m) for m in streamed for g in gpus]
    if disk:
        targets = ([cpu] if cpu else []) + gpus
        menu += [(disk, e, m) for m in streamed for e in targets]
    return menu


def _check_modes(modes: Iterable[str]) -> tuple[str, ...]:
    modes = tuple(modes)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"modes {unknown} are unknown: accepted are {', '.join(MODES)}")
    return modes


def _priced(graph: LayerGraph, machine: Machine, workload: Workload, modes: Iterable[str],
            pins: Mapping[str, str] | None, contiguous: bool) -> tuple[PlacementProblem, list[list[_Parts]]]:
    """The problem and, beside it, the float/byte split of every option (for evaluate)."""
    modes = _check_modes(modes)
    ctx = _Context(graph, machine, workload)
    menu = _menu(machine, modes)
    if not menu:
        raise ValueError(f"machine {machine.names} has no device that can compute: add 'cpu' or a GPU")
    units = graph.units()
    priced: dict[tuple[Any, ...], list[_Parts]] = {}  # identical units (decoder layers) priced once
    parts = []
    for u in units:
        key = _price_key(u)
        if key not in priced:
            priced[key] = [_price(ctx, u, s, e, m) for s, e, m in menu]
        parts.append(priced[key])
    specs = tuple(UnitSpec(name=u.name, options=tuple(_to_option(p) for p in row))
                  for u, row in zip(units, parts, strict=True))
    problem = PlacementProblem(
        units=specs, edges=_edges(ctx), devices=_devices(machine), tied_groups=graph.meta.tied_unit_groups,
        pins=_check_pins(pins or {}, graph, machine), contiguous=contiguous)
    return problem, parts


def _price_key(unit: UnitInfo) -> tuple[Any, ...]:
    """Everything :func:`_price` reads of a unit (its name and position do not change its price)."""
    return (unit.param_bytes, unit.buffer_bytes, unit.flops_per_token, unit.attn_flops_per_token_per_ctx,
            unit.out_bytes_per_token, unit.kv_bytes_per_token, unit.moe_num_experts, unit.moe_experts_per_token,
            unit.moe_expert_bytes, len(unit.param_names), unit.in_decode, unit.module_class)


def _edges(ctx: _Context) -> tuple[EdgeSpec, ...]:
    wl = ctx.workload
    compute = [d.name for d in ctx.machine.compute_devices]
    pairs = [(a, b) for a in compute for b in compute if a != b]
    times = 2 if wl.training else 1
    specs = []
    priced: dict[tuple[int, bool], tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]] = {}
    for src, dst, bpt in ctx.graph.edges():
        in_decode = ctx.graph.unit(src).in_decode and ctx.graph.unit(dst).in_decode
        if (bpt, in_decode) not in priced:  # edges of equal size cost the same: price each size once
            steps = wl.decode_steps if in_decode else 0
            priced[bpt, in_decode] = ({p: _edge_ns(ctx, *p, bpt, wl.batch_size * wl.prompt_len, times) for p in pairs},
                                      {p: _edge_ns(ctx, *p, bpt, wl.batch_size, steps) for p in pairs})
        prefill, decode = priced[bpt, in_decode]
        specs.append(EdgeSpec(src=src, dst=dst, prefill_ns=prefill, decode_ns=decode))
    return tuple(specs)


def _devices(machine: Machine) -> tuple[DeviceSpec, ...]:
    return tuple(DeviceSpec(name=d.name, kind=d.kind, capacity_bytes=d.usable_bytes) for d in machine.devices)


def _check_pins(pins: Mapping[str, Any], graph: LayerGraph, machine: Machine) -> dict[str, str]:
    checked = {}
    for unit, device in pins.items():
        name = normalize_device_name(device)
        if name not in machine:
            raise ValueError(f"pin {unit!r} -> {device!r}: {name} is not in the machine ({', '.join(machine.names)})")
        if unit not in graph:
            raise ValueError(f"pin names unit {unit!r}, which is not in the graph (units: {_few(graph.names())})")
        checked[unit] = name
    return checked


def _few(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def build_problem(
    graph: LayerGraph,
    machine: Any,
    workload: Workload,
    *,
    modes: Iterable[str] = ("resident", "stream"),
    pins: Mapping[str, str] | None = None,
    contiguous: bool = False,
) -> PlacementProblem:
    """Price every placement option of every unit: the integer problem the solvers read.

    Example::

        graph = chain_graph([{"name": "a", "param_bytes": 2**30, "flops_per_token": 2**31}])
        problem = build_problem(graph, ["cpu"], Workload(prompt_len=128, new_tokens=16))
        problem.score([0]).latency_ns

    Args:
        graph: the layer graph (units in execution order, edges with bytes per token).
        machine: a :class:`Machine` or anything :func:`as_machine` accepts.
        workload: batch, prompt and new tokens (or a training step).
        modes: which modes to offer: ``"resident"`` always; ``"stream"`` (overlapped copies) and
            ``"stream_sync"`` (accelerate's synchronous copies) for weights kept in CPU RAM or on disk.
        pins: unit name -> required storage device.
        contiguous: ask the solver for one contiguous range of units per device.

    Returns:
        A :class:`PlacementProblem`: options in the order GPUs resident, CPU resident, CPU -> GPU
        streams, disk -> CPU/GPU streams; integer ns and bytes.

    Raises:
        ValueError: an unknown mode, a pin naming an unknown unit or device, a machine without a
            compute device.
    """
    machine = as_machine(machine, dtype=graph.meta.dtype)
    return _priced(graph, machine, workload, modes, pins, contiguous)[0]
