"""``LayerGraph`` + ``Machine`` + ``Workload`` -> :class:`~placement_opt.solver.problem.PlacementProblem`.

Every option of every unit is priced by :mod:`.pricing` and converted to the solver's integers
there (:func:`~.pricing.to_option`); this module lays out the option menu, the edges and the devices.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from ..errors import DeviceSpecError, SolverInputError, WorkloadError
from ..hardware.devices import Machine
from ..hardware.resolve import as_machine
from ..model.expert_groups import whole_experts
from ..solver.problem import MODES, DeviceSpec, EdgeSpec, PlacementProblem, UnitSpec
from .calibrated import calibration_for
from .pins import resolve_pins
from .pricing import (
    NS_PER_S,
    OptionPrice,
    PricingContext,
    edge_ns,
    price_option,
    to_option,
    unit_io_bytes,
)
from .workload import Workload

if TYPE_CHECKING:  # pragma: no cover
    from ..model.graph import LayerGraph, UnitInfo

__all__ = ["build_problem", "price_problem", "run_as_glue", "MAX_SOLVER_INT"]

#: The largest total the solver's integers may reach: the nanoseconds of the slowest placement of
#: every unit and edge, or the bytes of the largest option of every unit. CP-SAT works in signed
#: 64-bit integers (2**63); sums and products of its model must stay well below that.
MAX_SOLVER_INT = 2**60


#: One option of the menu: (storage, execution, mode, prefill_execution or None).
_Entry = tuple[str, str, str, "str | None"]


def _menu(machine: Machine, modes: Iterable[str], workload: Workload) -> list[_Entry]:
    """(storage, execution, mode, prefill execution) of every option, in a fixed order.

    ``phased`` options (CPU-stored or disk-stored weights, prefill on each GPU, decode on the CPU) come
    last, and only for generation: a workload without decode steps, or a training step, has no phases.
    """
    gpus = [d.name for d in machine.gpus]
    cpu = machine.cpu.name if machine.cpu else None
    disk = machine.disk.name if machine.disk else None
    streamed = [m for m in ("stream", "stream_sync") if m in modes]
    menu: list[_Entry] = [(g, g, "resident", None) for g in gpus]
    if cpu:
        menu.append((cpu, cpu, "resident", None))
        menu += [(cpu, g, m, None) for m in streamed for g in gpus]
    if disk:
        targets = ([cpu] if cpu else []) + gpus
        menu += [(disk, e, m, None) for m in streamed for e in targets]
    if "phased" in modes and cpu and workload.decode_steps > 0 and not workload.training:
        menu += [(s, cpu, "phased", g) for s in ([cpu] + ([disk] if disk else [])) for g in gpus]
    return menu


def _check_modes(modes: Iterable[str]) -> tuple[str, ...]:
    modes = tuple(modes)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SolverInputError(f"modes {unknown} are unknown: accepted are {', '.join(MODES)}")
    return modes


def price_problem(graph: LayerGraph, machine: Machine, workload: Workload, modes: Iterable[str],
            pins: Mapping[str, str] | None, contiguous: bool) -> tuple[PlacementProblem, list[list[OptionPrice]]]:
    """The problem and, beside it, every option's price in seconds and bytes (what ``evaluate`` reports).

    ``pins`` are accelerate-style (:func:`~.pins.resolve_pins`).
    """
    modes = _check_modes(modes)
    ctx = PricingContext(graph, machine, workload, calibration_for(graph, machine))
    menu = _menu(machine, modes, workload)
    if not menu:
        raise DeviceSpecError(f"machine {machine.names} has no device that can compute: add 'cpu' or a GPU")
    units = graph.units()
    priced: dict[tuple[Any, ...], list[OptionPrice]] = {}  # identical units (decoder layers) priced once
    parts = []
    logits = graph.meta.extra.get("logits_unit")
    spans = {span: tuple(_price_key(m, logits) for m in members)  # a part's host time is its span's share
             for span, members in ctx.span_members.items()}
    for u in units:
        # a part of a span shares the span's overhead (a final norm is priced apart from a layer's norms)
        key = (*_price_key(u, logits), *ctx.overhead_share(u), spans.get(u.host_span, ()))
        if ctx.home is not None:  # a sublayer graph: the round trips read the unit's bytes in too
            key += (unit_io_bytes(graph, u)[0],)
        if key not in priced:
            phased = _two_phases(u, ctx)
            priced[key] = [price_option(ctx, u, s, e, m, p) for s, e, m, p in menu if phased or m != "phased"]
        parts.append(priced[key])
    _check_limits(parts, workload)  # before the options, which refuse a price past the solver's integers alone
    options = {id(row): tuple(to_option(p) for p in row) for row in priced.values()}  # once per distinct row
    specs = tuple(UnitSpec(name=u.name, options=options[id(row)]) for u, row in zip(units, parts, strict=True))
    problem = PlacementProblem(
        units=specs, edges=_edges(ctx), devices=_devices(machine), tied_groups=graph.meta.tied_unit_groups,
        pins=_with_glue(resolve_pins(pins or {}, graph, machine), graph, ctx.home), contiguous=contiguous,
        copy_groups=copy_groups(units),
        part_groups=part_groups(units))
    return problem, parts


def run_as_glue(graph: LayerGraph) -> list[str]:
    """The units of a sublayer graph whose own forward the traced model never called, though they hold weights:
    their parent computes with those weights through other methods (JetMoE's attention experts, run by
    ``map()`` and ``reduce()``; Gemma-3n's ``altup``). That is glue, which runs on the home device, and the
    dispatcher copies a unit's weights when its forward is called, which for these never happens: so the
    problem pins them to the home device (:func:`_with_glue`). Told by the trace's op count: none for such a
    unit, a count for every unit that ran (a graph with no counts, saved before they were kept, has none)."""
    if graph.meta.granularity != "sublayer" or not graph.meta.traced:
        return []
    units = graph.units()
    if not any(u.ops_per_forward for u in units):
        return []
    return [u.name for u in units if u.param_bytes > 0 and not u.ops_per_forward]


def _with_glue(pins: Mapping[str, str], graph: LayerGraph, home: str | None) -> dict[str, str]:
    """``pins`` and every unit run as glue (:func:`run_as_glue`) stored on ``home``, a pin covering one of them
    (a whole layer's) included: there its one runnable option is to stay resident (a unit stored on a GPU
    computes there; home is the CPU only on a machine without a GPU). The plan's notes say so."""
    glue = run_as_glue(graph) if home is not None else []
    return {**pins, **dict.fromkeys(glue, home)}


def copy_groups(units: Sequence[UnitInfo]) -> tuple[tuple[str, ...], ...]:
    """Runs of consecutive units (in execution order) cut from one block (``UnitInfo.block``): the parts the
    dispatcher copies together, one prefetch per block. A block whose parts do not run consecutively is cut
    into its consecutive runs."""
    return tuple(tuple(u.name for u in run) for block, run in itertools.groupby(units, key=attrgetter("block"))
                 if block is not None)


def part_groups(units: Sequence[UnitInfo]) -> tuple[tuple[str, ...], ...]:
    """Runs of consecutive units cut from one experts module (:mod:`placement_opt.model.expert_groups`)."""
    def whole(unit: UnitInfo) -> str | None:
        parsed = whole_experts(unit.name)
        return parsed[0] if parsed else None

    return tuple(tuple(u.name for u in run) for experts, run in itertools.groupby(units, key=whole)
                 if experts is not None)


def _two_phases(unit: UnitInfo, ctx: PricingContext) -> bool:
    """Whether ``unit`` may be phased: it runs in the decode, and its prefill is a many-token call. The
    dispatcher tells a prefill by its tokens per sequence (``runtime._phases.call_is_prefill``), so a one-token
    prompt, and the logits unit of a ``logits="last"`` workload (one position per sequence in the prefill too),
    would run both phases on the CPU where the plan priced the prefill on the GPU."""
    last_only = ctx.workload.logits_kept == "last" and unit.name == ctx.graph.meta.extra.get("logits_unit")
    return unit.in_decode and ctx.workload.prompt_len > 1 and not last_only


def _check_limits(rows: Iterable[Sequence[OptionPrice]], workload: Workload) -> None:
    """Refuse a problem whose worst totals would overflow the solver's integers, before CP-SAT sees it."""
    rows = list(rows)
    worst_ns = sum(max(p.prefill_s + p.decode_s for p in row) for row in rows) * NS_PER_S
    worst_bytes = sum(max(_option_bytes(p) for p in row) for row in rows)
    if worst_ns > MAX_SOLVER_INT or worst_bytes > MAX_SOLVER_INT:
        what = (f"{worst_ns / NS_PER_S:.3g} s" if worst_ns > MAX_SOLVER_INT else f"{worst_bytes:.3g} bytes")
        raise WorkloadError(
            f"the workload (batch {workload.batch_size}, prompt {workload.prompt_len}, {workload.new_tokens} new "
            f"tokens) costs up to {what} on this machine, beyond the solver's range (totals up to 2**60 ns, "
            f"about 36 years, and 2**60 bytes): reduce the batch or the context, or check the device speeds")


def _option_bytes(p: OptionPrice) -> int:
    """What :func:`~.pricing.to_option` makes the option's stored, resident and peak bytes together."""
    return (p.weights_bytes + p.stored_other_bytes + p.kv_cache_bytes + p.resident_other_bytes + p.workspace_bytes
            + p.stream_buffer_bytes)


def _price_key(unit: UnitInfo, logits_unit: str | None) -> tuple[Any, ...]:
    """Everything :func:`price_option` reads of a unit (its name and position do not change its price,
    except that the logits unit's workspace follows ``Workload.logits``)."""
    return (unit.param_bytes, unit.buffer_bytes, unit.flops_per_token, unit.attn_flops_per_token_per_ctx,
            unit.out_bytes_per_token, unit.kv_bytes_per_token, unit.moe_num_experts, unit.moe_experts_per_token,
            unit.moe_expert_bytes, len(unit.param_names), unit.in_decode, unit.module_class,
            unit.workspace_bytes_per_token, unit.workspace_bytes_per_token_ctx, unit.scores_workspace_bytes_per_token,
            unit.scores_workspace_bytes_per_token_ctx, unit.kv_window_tokens, unit.latent_expand_flops_per_ctx,
            unit.latent_expand_bytes_per_ctx, unit.latent_expand_cpu_bytes_per_ctx, unit.cpu_attention_bytes_per_token,
            unit.cpu_attention_bytes_per_token_ctx, unit.decode_workspace_bytes, unit.decode_workspace_bytes_per_ctx,
            unit.ops_per_forward, unit.tied_param_bytes, unit.largest_module_bytes, unit.largest_load_bytes,
            unit.name == logits_unit)


def _edges(ctx: PricingContext) -> tuple[EdgeSpec, ...]:
    """Every edge priced per pair of devices. A sublayer graph's units are chained in execution order
    instead, each link free: its data goes through the home device, which the units' round trips price
    (see :mod:`.pricing`), and its forward runs them one after another. A parallel branch (a shared
    expert beside the routed experts) does not overlap the other in a real forward: the module calls
    them in turn, and moving the router's output to a CPU-computed unit waits for the GPU's queue."""
    if ctx.home is not None:
        return _in_turn(ctx.graph.names(), ())
    wl = ctx.workload
    compute = [d.name for d in ctx.machine.compute_devices]
    pairs = [(a, b) for a in compute for b in compute if a != b]
    times = 2 if wl.training else 1
    specs = []
    priced: dict[tuple[int, bool, int], tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]] = {}
    decodes = {u.name: u.in_decode for u in ctx.graph.units()}  # graph.unit() builds a UnitInfo per call
    # generate() hands the logits unit the last position of each sequence only: its input crosses for those rows
    last_logits = ctx.graph.meta.extra.get("logits_unit") if wl.logits_kept == "last" else None
    for src, dst, bpt in ctx.graph.edges():
        in_decode = decodes[src] and decodes[dst]
        rows = wl.batch_size if dst == last_logits else wl.batch_size * wl.prompt_len
        if (bpt, in_decode, rows) not in priced:  # edges of equal size cost the same: price each size once
            steps = wl.decode_steps if in_decode else 0
            priced[bpt, in_decode, rows] = ({p: edge_ns(ctx, *p, bpt, rows, times) for p in pairs},
                                            {p: edge_ns(ctx, *p, bpt, wl.batch_size, steps) for p in pairs})
        prefill, decode = priced[bpt, in_decode, rows]
        specs.append(EdgeSpec(src=src, dst=dst, prefill_ns=prefill, decode_ns=decode))
    return tuple(specs) + _in_turn(ctx.graph.names(), specs)


def _in_turn(names: list[str], edges: Iterable[EdgeSpec]) -> tuple[EdgeSpec, ...]:
    """A free link from each unit to the next in execution order where no data edge joins them.

    The dispatcher runs a forward's units one after another, in that order, on one Python thread: a
    unit computed on the CPU blocks it, and a GPU runs its own units one at a time. Without these
    links, a module-level graph's parallel siblings (``q/k/v_proj``, ``gate/up_proj``) overlapped
    in the longest path even on one device: a module-level Mistral-7B on an RTX 4090 + 3090 was
    priced at 3.3 s split over both GPUs against 4.6 s on either alone, for a forward that runs the
    same modules in turn either way. With them, the longest path holds every unit's duration."""
    linked = {(e.src, e.dst) for e in edges}
    return tuple(EdgeSpec(src=a, dst=b, prefill_ns={}, decode_ns={})
                 for a, b in pairwise(names) if (a, b) not in linked)


def _devices(machine: Machine) -> tuple[DeviceSpec, ...]:
    return tuple(DeviceSpec(name=d.name, kind=d.kind, capacity_bytes=d.usable_bytes) for d in machine.devices)


def build_problem(
    graph: LayerGraph,
    machine: Any,
    workload: Workload,
    *,
    modes: Iterable[str] = ("resident", "stream", "phased"),
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
        modes: which modes to offer (default: what ``solve()`` chooses from): ``"resident"`` always;
            ``"stream"`` (overlapped copies) and ``"stream_sync"`` (accelerate's synchronous copies) for
            weights kept in CPU RAM or on disk; ``"phased"`` (prefill streamed to a GPU, decode on the CPU)
            for those weights when generating.
        pins: module name or prefix -> required storage device of every unit it covers
            (accelerate vocabulary, :func:`~.pins.resolve_pins`).
        contiguous: ask the solver for one contiguous range of units per device.

    Returns:
        A :class:`PlacementProblem`: options in the order GPUs resident, CPU resident, CPU -> GPU
        streams, disk -> CPU/GPU streams, phased; integer ns and bytes.

    Raises:
        SolverInputError: an unknown mode, or a pin naming an unknown module or device.
        DeviceSpecError: a machine without a compute device.
    """
    machine = as_machine(machine, dtype=graph.meta.dtype)
    return price_problem(graph, machine, workload, modes, pins, contiguous)[0]
