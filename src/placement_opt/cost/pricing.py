"""Pricing: what every placement option of one unit costs in time (and the bytes it holds).

Stage 3 of the data flow is the ``cost`` package: ``LayerGraph`` + ``Machine`` + ``Workload`` ->
:func:`~.build.build_problem` -> ``PlacementProblem`` (plain integers for the solvers), and
:func:`~.evaluate.evaluate` -> :class:`~.evaluate.Cost` for any plan or accelerate ``device_map``,
scored by the same ``PlacementProblem.score``. This module prices one option.

Options of a unit (storage S, execution E, mode): resident on every GPU; resident in CPU RAM and
executed on the CPU; stored in CPU RAM and streamed to every GPU; stored on disk and read to the
CPU or streamed to every GPU. ``stream`` overlaps the copy with compute (placement_opt's
dispatcher prefetches the next unit), ``stream_sync`` adds it (accelerate's hooks copy tensor by
tensor, from pageable memory).

Time of one forward of a unit on E is its kernels' time (:mod:`.kernels`: a roofline, or the unit's
calibrated times) plus the host's time around them (:mod:`.context`: traced ops x seconds per op; on a GPU,
which queues ahead, only the part its kernels do not hide). Those two modules hold the prefill and decode
rules (causal attention, the closed-form sum over decode steps, sliding windows, fresh pages on a CPU).

* Streamed weights add ``bytes / link + latency`` per forward: ``max(compute, copy)`` for ``stream``
  to a GPU (its copy runs while the unit before it computes); with ``Workload.overlap`` the copy is
  the prefetch thread's (``copy_*_s``, apart from the compute in ``prefill_s``/``decode_s``), and the
  problem's score runs it beside the compute of every unit since the previous streamed one
  (``solver.problem``'s Overlap: behind CPU-executed units it hides; between equal streamed units it
  costs ``max(compute, copy)`` each); ``compute + copy`` for
  ``stream_sync`` (one latency per tensor, pageable copies; disk reads through a memory map at
  :data:`MAPPED_READ_FACTOR` of the disk's rate: a profiled disk's memory-map read rate, a
  datasheet disk's sequential rate) and for any stream executed on the
  CPU: the same cores fault the weights in and compute, and measured runs on a CPU show no
  overlap (benchmarks/cost_accuracy).
* ``phased`` (a unit stored in CPU RAM or on disk): the prefill is the ``stream`` to a GPU plus the
  prompt's KV cache of the unit copied to the CPU once (at the GPU's measured rate back to the host, where a
  profile has one: ``Device.to_host_bytes_per_s``); each decode step computes on the CPU where the
  weights are (llama.cpp's split: GPU for prompt processing, CPU for generation, chosen per unit here).
* Host memory (``host_*_s``): the bytes an option moves through host RAM (a CPU-executed unit's weights
  and KV cache read, a streamed unit's weights copied out) over :func:`host_memory_bytes_per_s`; the
  problem bounds each phase by their sum, so copies and CPU compute share the host's bandwidth. The disk
  (``disk_*_s``): the weights an option reads off it at the disk's rate, summed likewise, so the
  prefetch thread's reads and the CPU's mapped reads share one disk.
* Edges: ``bytes_per_token x tokens / link + latency`` when the two ends execute on different
  devices, per prefill and per decode step.
* ``"sublayer"`` graphs (``graph.meta.granularity``; norms, attention, MLP or router and experts as
  units) run around a *home* device (:func:`home_device`: the first GPU, else the CPU): the model's
  inputs, the residual stream and all glue stay there, and each unit moves its inputs to its device
  and returns its outputs home. So a unit computing on ``d != home`` in a phase pays, in that phase,
  one round trip per forward (:func:`round_trip_s`, the one place of the rule)::

      in_bytes x tokens / link(home -> d) + latency(home -> d)
      + out_bytes x tokens / link(d -> home) + latency(d -> home)

  with ``in_bytes`` the unit's ``in_bytes_per_token`` (the sum of its incoming edges' bytes where the
  trace did not measure it) and ``out_bytes`` its ``out_bytes_per_token``; tokens are those of an edge
  (prefill: ``batch x prompt``, the logits unit ``batch`` when only the last logits are kept, twice in
  a training step; decode: ``batch`` per step, summed over the steps). A unit on home pays none; a
  ``phased`` unit pays it in the phase whose device is not home (its CPU decode, when home is a GPU).
  The round trip follows the unit's compute and weight copy (it is added, never overlapped). A sublayer
  graph's units are chained in execution order with free links (everything crosses through home,
  which the round trips price): a phase's latency is the sum of its units' times, as the forward calls
  them one after another (a shared expert beside the routed experts included: see ``build._edges``).
* Training (``Workload.training``): one step = forward + backward (x3 compute, x4 with activation
  checkpointing), weights streamed twice, activations and gradients cross edges twice.

Memory per option: see :mod:`.memory`. Copies, round trips and host-memory and disk reads: :mod:`.traffic`.

Every float becomes an integer in one place, :func:`_ns` (called by :func:`to_option` and
:func:`edge_ns`), with :data:`NS_PER_S`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..solver.problem import PlacementOption
from .context import OP_OVERHEAD_S, UNIT_OVERHEAD_S, PricingContext, home_device, op_overhead_s
from .kernels import (
    BANDWIDTH_EFFICIENCY,
    CACHE_PASSES_PER_STEP,
    COMPUTE_EFFICIENCY,
    contexts_at_least,
    decode_roofline_lines,
    expected_experts,
    fresh_pages_s,
    growing_steps,
    measured_decode_line,
    measured_prefill_s,
    prefill_roofline_s,
    prefill_rows,
    sum_capped_lines,
)
from .memory import accelerate_held_bytes, stream_buffers, workspace_bytes
from .traffic import (
    MAPPED_READ_FACTOR,
    PAGEABLE_LINK_FACTOR,
    copy_s,
    disk_reads_s,
    host_memory_bytes_per_s,
    host_traffic_s,
    lookup_mapped_bytes,
    lookup_read_s,
    round_trip_s,
    round_trips,
    routed_read_s,
    unit_io_bytes,
)
from .workload import unit_training_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware.devices import Device
    from ..model.graph import UnitInfo

__all__ = [
    "OptionPrice",
    "PricingContext",
    "home_device",
    "host_memory_bytes_per_s",
    "round_trip_s",
    "unit_io_bytes",
    "price_option",
    "to_option",
    "edge_ns",
    "expected_experts",
    "NS_PER_S",
    "COMPUTE_EFFICIENCY",
    "BANDWIDTH_EFFICIENCY",
    "UNIT_OVERHEAD_S",
    "OP_OVERHEAD_S",
    "op_overhead_s",
    "PAGEABLE_LINK_FACTOR",
    "MAPPED_READ_FACTOR",
    "CACHE_PASSES_PER_STEP",
    "contexts_at_least",
]

#: Solver time unit: every ``*_ns`` integer is seconds x NS_PER_S, rounded up.
NS_PER_S = 10**9

#: Compute of a training step in forwards: forward + backward (2x), + 1 recomputation.
_TRAIN_COMPUTE_FORWARDS = {False: 3, True: 4}


# ---------------------------------------------------------------------------------------------
# Pricing one option (floats; converted once in to_option)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class OptionPrice:
    """One option priced in seconds and bytes, with the memory split that ``evaluate`` reports.

    :func:`to_option` turns it into the solver's integer :class:`PlacementOption`.
    """

    storage: str
    execution: str
    mode: str
    prefill_s: float
    decode_s: float
    weights_bytes: int
    stored_other_bytes: int
    kv_cache_bytes: int
    resident_other_bytes: int
    workspace_bytes: int
    stream_buffer_bytes: int
    prefill_execution: str | None = None
    """``phased`` only: the GPU that computes the prefill (``execution`` computes the decode)."""
    prefill_workspace_bytes: int = 0
    """``phased`` only: the prefill's workspace on ``prefill_execution``."""
    prefill_stream_buffer_bytes: int = 0
    """``phased`` only: the prefill's stream buffer on ``prefill_execution``."""
    prefill_kv_bytes: int = 0
    """``phased`` only: the prompt's KV cache of this unit, held on ``prefill_execution`` until it moves."""
    group_copy_bytes: int = 0
    """A unit the prefetch thread copies ahead (``stream`` to a GPU; ``phased``: its prefill): its weights, its
    share of its copy group's buffer on that GPU (a sublayer graph's parts of one layer are a group; any other unit
    is a group alone; :attr:`~..solver.problem.PlacementOption.group_copy_bytes`). The device then counts the
    next streaming group's copies in flight beside every unit, resident ones included, as the dispatcher holds
    them."""
    round_trip_s: float = 0.0
    """Of ``prefill_s + decode_s``: the sublayer round trips to home and back (:func:`round_trip_s`);
    ``evaluate`` counts them with the transfers."""
    copy_prefill_s: float = 0.0
    """``stream`` to a GPU, ``phased``: the prefetch thread's weight copies in the prefill (not in ``prefill_s``)."""
    copy_decode_s: float = 0.0
    """``stream`` to a GPU: the prefetch thread's weight copies over every decode step (not in ``decode_s``)."""
    host_prefill_s: float = 0.0
    """Host memory's time for this option's traffic in the prefill (module docstring)."""
    host_decode_s: float = 0.0
    """Host memory's time for this option's traffic over every decode step."""
    disk_prefill_s: float = 0.0
    """The disk's time reading this option's weights in the prefill (stored on disk)."""
    disk_decode_s: float = 0.0
    """The disk's time reading this option's weights over every decode step."""


def _prefill_s(ctx: PricingContext, unit: UnitInfo, device: Device) -> float:
    """Compute time of the unit over the whole prompt on ``device`` (training: a whole step)."""
    measured = measured_prefill_s(ctx, unit, device)
    if measured is not None:
        return measured
    seconds = prefill_roofline_s(ctx, unit, device) + ctx.host_s(unit, device, "prefill")
    if ctx.workload.training:
        seconds *= _TRAIN_COMPUTE_FORWARDS[ctx.workload.activation_checkpointing]
    return seconds


def _decode_lines(ctx: PricingContext, unit: UnitInfo, device: Device) -> list[tuple[float, float]]:
    """Compute time of decode step t as ``max`` of lines ``a + b t`` (FLOPs line, bytes line).

    A calibrated unit has one line: its measured step at the first context, growing with the context.
    """
    measured = measured_decode_line(ctx, unit, device)
    if measured is not None:
        return [measured]
    host = ctx.host_s(unit, device, "decode")
    return [(a + host, b) for a, b in decode_roofline_lines(ctx, unit, device)]


def price_option(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str, mode: str,
                 prefill_execution: str | None = None) -> OptionPrice:
    """Time and memory of one option of one unit (``phased``: ``prefill_execution`` computes the prefill)."""
    if mode == "phased":
        if prefill_execution is None:
            raise ValueError("a phased option needs its prefill_execution")
        return _price_phased(ctx, unit, storage, execution, prefill_execution)
    wl = ctx.workload
    device = ctx.machine[execution]
    overlapped = mode == "stream" and device.is_gpu
    prefill, decode, copy_prefill, copy_decode = _compute_and_copies(ctx, unit, storage, execution, mode)
    host_prefill, host_decode = host_traffic_s(ctx, unit, storage, execution)
    disk_prefill, disk_decode = disk_reads_s(ctx, unit, storage, execution)
    trip_prefill, trip_decode = round_trips(ctx, unit, execution, execution)
    prefill += trip_prefill
    decode += trip_decode
    train = unit_training_bytes(unit, wl, ctx.graph.meta.dtype)
    kv = 0 if wl.training else unit.kv_bytes_per_token * wl.batch_size * unit.kv_tokens_held(wl.prompt_len,
                                                                                              wl.context_len)
    return OptionPrice(
        storage=storage, execution=execution, mode=mode, prefill_s=prefill, decode_s=decode,
        weights_bytes=unit.weight_bytes,
        stored_other_bytes=train.gradient_bytes + train.optimizer_bytes,
        kv_cache_bytes=kv, resident_other_bytes=train.activation_bytes,
        workspace_bytes=workspace_bytes(unit, wl, ctx.graph.meta, on_gpu=device.is_gpu),
        stream_buffer_bytes=_stream_buffer_bytes(ctx, unit, storage, execution, mode),
        round_trip_s=trip_prefill + trip_decode,
        group_copy_bytes=unit.read_bytes if overlapped else 0,
        copy_prefill_s=copy_prefill, copy_decode_s=copy_decode,
        host_prefill_s=host_prefill, host_decode_s=host_decode, disk_prefill_s=disk_prefill, disk_decode_s=disk_decode,
    )


def _compute_and_copies(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str,
                        mode: str) -> tuple[float, float, float, float]:
    """(prefill, every decode step, the prefetch thread's prefill copies, its decode copies) of a non-phased
    option: the unit's compute with its weight copies added, overlapped (``stream`` to a GPU: the longer of the
    two), or apart (``stream`` to a GPU with ``Workload.overlap``: the last two, which the problem schedules)."""
    wl = ctx.workload
    device = ctx.machine[execution]
    copy = _weights_in_s(ctx, unit, storage, execution, mode, "decode")
    copy_prefill = _weights_in_s(ctx, unit, storage, execution, mode, "prefill")
    compute = _prefill_s(ctx, unit, device)
    forwards = 2 if wl.training else 1
    # stream to a GPU: the prefetch thread copies beside the compute: of the units before it (copy_*, with
    # Workload.overlap), or of this unit alone (max); otherwise the copy adds
    overlapped = mode == "stream" and device.is_gpu
    apart = overlapped and wl.overlap
    if apart:
        prefill = compute
    else:
        prefill = max(compute, forwards * copy_prefill) if overlapped else compute + forwards * copy_prefill
    decode = copy_decode = 0.0
    if unit.in_decode and wl.decode_steps > 0:
        lines = _decode_lines(ctx, unit, device)
        if apart:
            copy_decode = wl.decode_steps * copy
        elif overlapped:
            lines.append((copy, 0.0))
        else:
            lines = [(a + copy, b) for a, b in lines]
        decode = sum_capped_lines(lines, wl.decode_steps, growing_steps(unit, wl)) + fresh_pages_s(ctx, unit, device)
    return prefill, decode, forwards * copy_prefill if apart else 0.0, copy_decode


def _stream_buffer_bytes(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str, mode: str) -> int:
    """The unit's weights a stream holds on ``execution`` while it computes: the pages of the rows a lookup table
    computed from its memory map touches (:func:`~.traffic.lookup_mapped_bytes`), accelerate's one module at a time
    (:func:`~.memory.accelerate_held_bytes`), else whole copies."""
    mapped = lookup_mapped_bytes(ctx, unit, storage, execution) if mode == "stream" else None
    if mapped is not None:
        return mapped
    if mode == "stream_sync":
        return accelerate_held_bytes(unit, ctx.machine[storage].kind == "disk" and ctx.machine[execution].kind == "cpu")
    return unit.read_bytes * stream_buffers(mode, ctx.machine[execution].is_gpu)


def _weights_in_s(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str, mode: str, phase: str) -> float:
    """One forward's time getting the unit's weights to ``execution`` (:func:`~.traffic.copy_s`), but for a ``stream``
    unit the CPU computes from a disk map that reads part of them: a call's routed experts
    (:func:`~.traffic.routed_read_s`), a lookup table's rows (:func:`~.traffic.lookup_read_s`) unless calibrated (a
    measured copy rules). ``stream_sync`` (accelerate's) copies every tensor whole.

    A calibrated routed unit's figure is read per expert its steps' batch hit, so that another batch is priced by
    the experts it hits (:func:`~.traffic.routed_read_s`)."""
    rows = prefill_rows(ctx, unit) if phase == "prefill" else ctx.workload.batch_size
    routed = routed_read_s(ctx, unit, storage, execution, rows) if mode == "stream" else None
    if routed is not None:
        return routed
    calibrated = ctx.calibration is not None and ctx.calibration.copy_s(unit.name, storage, execution, mode,
                                                                        phase) is not None
    looked_up = lookup_read_s(ctx, unit, storage, execution, rows) if mode == "stream" and not calibrated else None
    if looked_up is not None:
        return looked_up
    return copy_s(ctx, storage, execution, unit.read_bytes, mode, len(unit.param_names), unit.name, phase)


def _price_phased(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str, gpu: str) -> OptionPrice:
    """A ``phased`` option: the prefill of a ``stream`` to ``gpu`` plus the prompt's KV cache moved to
    ``execution`` once; the decode of the unit computed on ``execution`` from ``storage`` (resident in
    RAM, or memory-mapped from disk); the whole KV cache on ``execution``."""
    wl = ctx.workload
    prefill = price_option(ctx, unit, storage, gpu, "stream")
    decode = price_option(ctx, unit, storage, execution, "resident" if storage == execution else "stream")
    # the GPU holds the prompt's cache whole (a window's view of it: UnitInfo.kv_tokens_held); the move copies
    # the window, which the decode device then keeps
    per_token = unit.kv_bytes_per_token * wl.batch_size
    prompt_kv, moved_kv = per_token * wl.prompt_len, per_token * unit.kv_tokens(wl.prompt_len)
    move_s = (moved_kv / ctx.machine.bandwidth(gpu, execution) + ctx.machine.latency_s(gpu, execution)
              if moved_kv else 0.0)
    return OptionPrice(
        storage=storage, execution=execution, mode="phased", prefill_s=prefill.prefill_s + move_s,
        decode_s=decode.decode_s, weights_bytes=unit.weight_bytes, stored_other_bytes=0,
        kv_cache_bytes=per_token * unit.kv_tokens(wl.context_len), resident_other_bytes=0,
        workspace_bytes=workspace_bytes(unit, wl, ctx.graph.meta, on_gpu=False, phase="decode"),
        stream_buffer_bytes=decode.stream_buffer_bytes, prefill_execution=gpu,
        prefill_workspace_bytes=workspace_bytes(unit, wl, ctx.graph.meta, on_gpu=True, phase="prefill"),
        prefill_stream_buffer_bytes=prefill.stream_buffer_bytes, prefill_kv_bytes=prompt_kv,
        group_copy_bytes=prefill.group_copy_bytes,
        round_trip_s=sum(round_trips(ctx, unit, gpu, execution)),
        copy_prefill_s=prefill.copy_prefill_s, host_prefill_s=prefill.host_prefill_s,
        host_decode_s=decode.host_decode_s, disk_prefill_s=prefill.disk_prefill_s, disk_decode_s=decode.disk_decode_s)


def _ns(seconds: float) -> int:
    """Seconds -> integer nanoseconds, rounded up (after dropping float noise below 1e-3 ns)."""
    return math.ceil(round(seconds * NS_PER_S, 3))


def to_option(parts: OptionPrice) -> PlacementOption:
    """The one place where an option's seconds become integer nanoseconds (see :func:`_ns`)."""
    return PlacementOption(
        storage=parts.storage, execution=parts.execution, mode=parts.mode,
        prefill_ns=_ns(parts.prefill_s),
        decode_ns=_ns(parts.decode_s),
        stored_bytes=parts.weights_bytes + parts.stored_other_bytes,
        resident_bytes=parts.kv_cache_bytes + parts.resident_other_bytes,
        peak_bytes=parts.workspace_bytes + parts.stream_buffer_bytes,
        prefill_execution=parts.prefill_execution,
        prefill_peak_bytes=(parts.prefill_workspace_bytes + parts.prefill_stream_buffer_bytes + parts.prefill_kv_bytes
                            if parts.prefill_execution else 0),
        copy_prefill_ns=_ns(parts.copy_prefill_s), copy_decode_ns=_ns(parts.copy_decode_s),
        host_prefill_ns=_ns(parts.host_prefill_s), host_decode_ns=_ns(parts.host_decode_s),
        disk_prefill_ns=_ns(parts.disk_prefill_s), disk_decode_ns=_ns(parts.disk_decode_s),
        group_copy_bytes=parts.group_copy_bytes,
    )


def edge_ns(ctx: PricingContext, src: str, dst: str, bytes_per_token: int, tokens: int, times: int) -> int:
    """Integer nanoseconds of ``times`` activation transfers of ``tokens`` tokens each."""
    one = tokens * bytes_per_token / ctx.machine.bandwidth(src, dst) + ctx.machine.latency_s(src, dst)
    return _ns(times * one)
