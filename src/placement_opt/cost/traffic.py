"""What moving bytes costs an option: weight copies, a sublayer unit's round trips from home, and the time host
memory and the disk spend on its reads.

The rules are :mod:`.pricing`'s (its module docstring states them); this module holds the ones that price bytes
crossing a link or read from RAM or disk, apart from the compute. Seconds here; :func:`.pricing.to_option`
turns them into the solver's integers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .context import PricingContext
from .kernels import (
    CACHE_PASSES_PER_STEP,
    expected_experts,
    is_lookup,
    kv_positions_read,
    prefill_rows,
    touched_weight_bytes,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware.devices import Machine
    from ..model.graph import LayerGraph, UnitInfo

__all__ = ["host_memory_bytes_per_s", "host_traffic_s", "disk_reads_s", "unit_io_bytes", "round_trip_s", "round_trips",
           "copy_s", "lookup_read_s", "lookup_mapped_bytes", "routed_read_s", "asks_whole_table", "PAGEABLE_LINK_FACTOR", "MAPPED_READ_FACTOR", "PAGE_BYTES"]

#: accelerate copies pageable (unpinned) CPU tensors: this fraction of the pinned link rate.
PAGEABLE_LINK_FACTOR = 0.6
#: accelerate reads each disk tensor through its own ``np.memmap`` and copies it out: this fraction
#: of the disk's read rate (a profiled disk's whole-file memory-map rate, a datasheet disk's
#: sequential rate). Measured: 1.07 GB/s for accelerate against 1.88 GB/s for placement_opt's
#: zero-copy maps on one disk (0.57; benchmarks/cost_accuracy, 2026-11-21).
MAPPED_READ_FACTOR = 0.6
#: The least a read asks the disk for: a page.
PAGE_BYTES = 4096


def host_memory_bytes_per_s(machine: Machine) -> float | None:
    """What host RAM serves all its readers together (the cores and the GPUs' copies): the CPU's
    ``shared_bandwidth_bytes_per_s``; None without a CPU (no host row)."""
    cpu = machine.cpu
    return cpu.shared_bandwidth_bytes_per_s if cpu is not None else None


def _host_s(ctx: PricingContext, nbytes: float) -> float:
    rate = host_memory_bytes_per_s(ctx.machine)
    return nbytes / rate if rate else 0.0


def host_traffic_s(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str) -> tuple[float, float]:
    """(prefill, decode) host-memory time of one non-phased option: a CPU-executed unit reads its weights
    (the experts hit) and KV cache from RAM; a GPU-executed unit stored off the GPU is copied out of RAM."""
    wl = ctx.workload
    forwards = 2 if wl.training else 1
    steps = wl.decode_steps if unit.in_decode else 0
    device = ctx.machine[execution]
    if device.kind == "cpu":
        rows = prefill_rows(ctx, unit)
        kv = unit.kv_bytes_per_token * wl.batch_size
        # latent attention's expanded keys and values and the math path's copies: written, then read
        expanded = 2 * ((unit.latent_expand_bytes_per_ctx or 0) + (unit.latent_expand_cpu_bytes_per_ctx or 0)) * wl.batch_size
        kv_read = (CACHE_PASSES_PER_STEP * kv + expanded) * kv_positions_read(unit, wl.prompt_len + 1, steps)
        return (_host_s(ctx, forwards * touched_weight_bytes(unit, rows) + kv * wl.prompt_len),
                _host_s(ctx, steps * touched_weight_bytes(unit, wl.batch_size) + kv_read))
    if storage == execution:
        return 0.0, 0.0
    return _host_s(ctx, forwards * unit.read_bytes), _host_s(ctx, steps * unit.read_bytes)


def disk_reads_s(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str) -> tuple[float, float]:
    """(prefill, decode) time the disk spends reading a non-phased option's weights: every forward reads
    what it computes with (a CPU-executed unit from its memory map: the experts hit), at the disk's rate."""
    if ctx.machine[storage].kind != "disk":
        return 0.0, 0.0
    wl = ctx.workload
    rate = ctx.machine[storage].bandwidth_bytes_per_s
    forwards = 2 if wl.training else 1
    steps = wl.decode_steps if unit.in_decode else 0
    if ctx.machine[execution].kind == "cpu":
        read_prefill, read_decode = touched_weight_bytes(unit, prefill_rows(ctx, unit)), touched_weight_bytes(unit, wl.batch_size)
    else:
        read_prefill = read_decode = unit.read_bytes
    return forwards * read_prefill / rate, steps * read_decode / rate


def asks_whole_table(machine: Machine, rows: int, row_bytes: int, table_bytes: int) -> bool:
    """Whether a lookup of ``rows`` distinct rows of ``row_bytes`` asks the disk for its whole table of
    ``table_bytes`` rather than for each row (a read of at least a page): whichever :meth:`~...Machine.random_read_s`
    says is faster. The runtime's rule (``runtime._routed_reads``), priced by :func:`lookup_read_s`."""
    return machine.random_read_s(1, table_bytes) <= machine.random_read_s(rows, rows * max(row_bytes, PAGE_BYTES))


def _table(unit: UnitInfo, rows: int) -> tuple[int, int]:
    """(distinct rows of ``rows`` tokens, bytes of a row) of a lookup table: a row is what it outputs per token;
    every token is taken as a distinct row (prompts repeat tokens: an upper bound)."""
    row = max(1, unit.out_bytes_per_token)
    return min(rows, max(1, unit.read_bytes // row)), row


def lookup_read_s(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str, rows: int) -> float | None:
    """One forward's disk time of a lookup table (an embedding) the CPU computes from its memory map, ``rows`` tokens
    looked up; None for any other option (its weights are read whole: :func:`copy_s`).

    The runtime asks the kernel for the rows of the forward's tokens before it looks them up
    (``runtime._routed_reads``): a random read each, at least a page (:meth:`~...Machine.random_read_s`); or for the
    table whole where that is faster (:func:`asks_whole_table`). A decode step's row costs a small read, not the
    table (a 128k vocabulary: 1 GiB in bf16).
    """
    if not is_lookup(unit) or ctx.machine[storage].kind != "disk" or ctx.machine[execution].kind != "cpu":
        return None
    rows, row = _table(unit, rows)
    if asks_whole_table(ctx.machine, rows, row, unit.read_bytes):
        return ctx.machine.random_read_s(1, unit.read_bytes)
    return ctx.machine.random_read_s(rows, rows * max(row, PAGE_BYTES))


def routed_read_s(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str, rows: int) -> float | None:
    """One forward's disk time of an MoE unit the CPU computes from its memory map, for a call of fewer tokens than
    it has experts (a decode step): its shared weights, read ahead in order at the disk's rate, and the experts the
    tokens are routed to, asked for once the router has picked them: a random read each
    (:meth:`~...Machine.random_read_s`); None for any other option or a call of more tokens (every expert read).

    The runtime reads the next mapped unit ahead but for its routed experts in such calls
    (``runtime._prefetch_links.ReadAhead``) and asks for the router's picks once it has made them: reading all of
    them would read the rest for nothing (top-2 of 8 at batch 1: a quarter of the expert bytes). An expert group
    (``trace(expert_groups=...)``) reads the picks among its rows: its share of the layer's experts hit.

    Where :func:`placement_opt.calibrate` timed the unit's cold decode steps through the dispatcher, an expert's
    read costs what it cost there (:func:`_calibrated_expert_s`), asks and all; else the profile's scattered reads.
    """
    if (not unit.is_moe or rows >= unit.moe_num_experts or ctx.machine[storage].kind != "disk"
            or ctx.machine[execution].kind != "cpu" or unit.moe_experts_per_token >= unit.moe_num_experts):
        return None  # every token runs every expert (Llama 4 in transformers): read ahead whole
    hit = _experts_hit(ctx, unit, rows)
    shared = unit.read_bytes - unit.moe_expert_bytes
    shared_s = shared / ctx.machine.bandwidth(storage, execution)
    per_expert = _calibrated_expert_s(ctx, unit, storage, execution, shared_s)
    if per_expert is not None:
        return shared_s + hit * per_expert
    return ctx.machine.random_read_s(hit, touched_weight_bytes(unit, rows) - shared) + shared_s


def _experts_hit(ctx: PricingContext, unit: UnitInfo, rows: int) -> float:
    """The unit's experts that ``rows`` tokens hit, expected: a group's share of its layer's."""
    share = ctx.routed_experts(unit) / unit.moe_num_experts
    return expected_experts(unit.moe_num_experts, unit.moe_experts_per_token, rows) * share


def _calibrated_expert_s(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str, shared_s: float
                         ) -> float | None:
    """Seconds one routed expert's read added to the calibrated cold decode steps of ``unit`` (their mean), less the
    shared weights' ``shared_s``, over the experts their batch hit; None without such a calibration.

    The profile's scattered reads are regions asked for eight at a time; the dispatcher asks for a layer's two or
    so picks, then computes, then asks for the next layer's. Priced from the profile, benchmarks/cost_accuracy's
    MoE disk decode steps measured 1.2x their prediction (block units, 2026-11-30); priced from this figure,
    0.98-1.08x in the same run.
    """
    calibration = ctx.calibration
    if calibration is None:
        return None
    batch = calibration.read_batch.get(unit.name)
    seconds = calibration.copy_s(unit.name, storage, execution, "stream", "decode")
    if batch is None or seconds is None or batch >= unit.moe_num_experts:
        return None  # a step of as many tokens as experts read them all ahead: no figure per expert
    hit = _experts_hit(ctx, unit, batch)
    return max(0.0, seconds - shared_s) / hit if hit > 0 else None


def lookup_mapped_bytes(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str) -> int | None:
    """What a lookup table the CPU computes from its memory map (:func:`lookup_read_s`) holds in RAM at most: the
    pages of the rows of the largest forward, or the whole table where it asks for it whole; None for any other
    option (its weights whole: :func:`~.memory.stream_buffers`)."""
    if lookup_read_s(ctx, unit, storage, execution, 1) is None:
        return None
    rows, row = _table(unit, max(prefill_rows(ctx, unit), ctx.workload.batch_size))
    if asks_whole_table(ctx.machine, rows, row, unit.read_bytes):
        return unit.read_bytes
    return min(unit.read_bytes, rows * max(row, PAGE_BYTES))


def unit_io_bytes(graph: LayerGraph, unit: UnitInfo) -> tuple[int, int]:
    """(bytes in, bytes out) per token of a unit run away from home: the traced ``in_bytes_per_token``, else
    the sum of its incoming edges (a hand-made or static graph), and ``out_bytes_per_token``."""
    inputs = unit.in_bytes_per_token
    if inputs is None:
        inputs = sum(int(d["bytes_per_token"]) for _, _, d in graph.nx.in_edges(unit.name, data=True))
    return inputs, unit.out_bytes_per_token


def round_trip_s(ctx: PricingContext, unit: UnitInfo, device: str, tokens: int) -> float:
    """One forward's inputs sent from home to ``device`` and outputs back (0 on home, or outside a sublayer
    graph): the rule of the module docstring, for ``tokens`` tokens."""
    home = ctx.home
    if home is None or device == home or tokens <= 0:
        return 0.0
    inputs, outputs = unit_io_bytes(ctx.graph, unit)
    machine = ctx.machine
    return (inputs * tokens / machine.bandwidth(home, device) + machine.latency_s(home, device)
            + outputs * tokens / machine.bandwidth(device, home) + machine.latency_s(device, home))


def round_trips(ctx: PricingContext, unit: UnitInfo, prefill_device: str, decode_device: str) -> tuple[float, float]:
    """The unit's round trips over a whole workload: (prefill, every decode step)."""
    wl = ctx.workload
    forwards = 2 if wl.training else 1
    prefill = forwards * round_trip_s(ctx, unit, prefill_device, prefill_rows(ctx, unit))
    decode = wl.decode_steps * round_trip_s(ctx, unit, decode_device, wl.batch_size) if unit.in_decode else 0.0
    return prefill, decode


def copy_s(ctx: PricingContext, storage: str, execution: str, nbytes: float, mode: str, n_tensors: int,
            unit: str = "", phase: str = "decode") -> float:
    """Time to copy ``nbytes`` of weights from storage to execution once (calibrated copies first: what
    the unit's weights added to a measured ``phase`` forward)."""
    if mode == "resident" or nbytes <= 0:
        return 0.0
    measured = ctx.calibration.copy_s(unit, storage, execution, mode, phase) if ctx.calibration else None
    if measured is not None:
        return measured
    bandwidth = ctx.machine.bandwidth(storage, execution)
    latency = ctx.machine.latency_s(storage, execution)
    if mode == "stream_sync":
        kind = ctx.machine[storage].kind
        bandwidth *= {"cpu": PAGEABLE_LINK_FACTOR, "disk": MAPPED_READ_FACTOR}.get(kind, 1.0)
        latency *= max(1, n_tensors)
    return nbytes / bandwidth + latency
