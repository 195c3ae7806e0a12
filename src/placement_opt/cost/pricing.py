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

Time of one forward of a unit on E is a roofline plus the host's time for it::

    t = max(FLOPs / (peak FLOP/s x compute efficiency), bytes / (bandwidth x bandwidth efficiency))
        + overhead(E)

where ``overhead(E)`` is the unit's traced op count x the host's seconds per op on E (a profile's
``op_overhead_s``, else :data:`OP_OVERHEAD_S`), or :data:`UNIT_OVERHEAD_S` for a unit whose ops were not
counted. On a GPU, whose kernels run while the host queues the next, a block takes the longer of the ops'
time and its kernels' instead of their sum (:meth:`PricingContext.host_s`).

Efficiencies are the :data:`COMPUTE_EFFICIENCY` / :data:`BANDWIDTH_EFFICIENCY` tables for
datasheet figures and 1.0 for figures measured by :func:`placement_opt.profile` (which are
achieved rates already). Bytes touched are the weights (MoE: only the experts the batch hits),
the activations in and out, and the KV cache read (decode) or written (prefill).

* Prefill: ``batch x prompt`` tokens, causal attention (query ``i`` sees ``i + 1`` tokens).
* Decode: step ``t`` (0-based) has ``batch`` tokens and a context of ``prompt + t + 1``; FLOPs and
  bytes grow linearly in ``t``, so the sum over all steps of a max of linear functions has a
  closed form (:func:`_sum_max_lines`), never a loop over steps. On a CPU whose profile measured the
  cost of fresh pages, the cache's keys and values, allocated anew each step, add their page faults
  from the size at which glibc maps them anew (:func:`_fresh_pages_s`).
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
  prompt's KV cache of the unit copied to the CPU once; each decode step computes on the CPU where the
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

Memory per option: see :mod:`.memory`.

Every float becomes an integer in one place, :func:`_ns` (called by :func:`to_option` and
:func:`edge_ns`), with :data:`NS_PER_S`.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

from ..hardware.devices import FRESH_PAGE_MIN_BYTES
from ..model.expert_groups import group_counts, whole_experts
from ..solver.problem import PlacementOption
from .calibrated import Calibration, UnitTimes
from .memory import stream_buffers, workspace_bytes
from .workload import Workload, unit_training_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware.devices import Device, Machine
    from ..model.graph import LayerGraph, UnitInfo

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

#: Fraction of datasheet peak FLOP/s that large matmuls reach (measured figures use 1.0).
COMPUTE_EFFICIENCY = {"gpu": 0.6, "cpu": 0.5, "disk": 1.0}
#: Fraction of datasheet memory bandwidth that weight reads reach (measured figures use 1.0).
BANDWIDTH_EFFICIENCY = {"gpu": 0.8, "cpu": 0.6, "disk": 0.9}
#: Fixed cost of running one unit once (Python hooks, kernel launches, small ops), for units whose ops the trace
#: did not count (graphs saved before the count, static fallback graphs, hand-made units).
UNIT_OVERHEAD_S = {"gpu": 60e-6, "cpu": 150e-6, "disk": 0.0}
#: Host seconds per torch op of a forward (the dispatch and the Python around it) on a device whose profile did
#: not measure it. CPU: measured on this project's 2-core VM (torch 2.13, transformers 5.24), a decoder layer's
#: decode step at hidden 64 took 3.4-6.2 us per dispatched op (Llama, Mixtral, Qwen2-MoE, GPT-2; eager and
#: sdpa). GPU: the same host work plus a kernel launch, a rule of thumb not yet measured here.
OP_OVERHEAD_S = {"gpu": 8e-6, "cpu": 5e-6, "disk": 0.0}
#: accelerate copies pageable (unpinned) CPU tensors: this fraction of the pinned link rate.
PAGEABLE_LINK_FACTOR = 0.6
#: accelerate reads each disk tensor through its own ``np.memmap`` and copies it out: this fraction
#: of the disk's read rate (a profiled disk's whole-file memory-map rate, a datasheet disk's
#: sequential rate). Measured: 1.07 GB/s for accelerate against 1.88 GB/s for placement_opt's
#: zero-copy maps on one disk (0.57; benchmarks/cost_accuracy, 2026-11-21).
MAPPED_READ_FACTOR = 0.6
#: Passes over its KV cache a decode step makes, in cache sizes: transformers' ``DynamicCache`` grows by
#: ``torch.cat``, which reads the old keys and values and writes them anew, and attention then reads them.
#: Measured on this project's 2-core CPU (a Llama layer, 4 KV heads of 64, fp32, batch 8 x 4096 cached tokens):
#: the two cats took 61 % of the step, attention 21 % (benchmarks/cost_accuracy/KV_CACHE.md).
CACHE_PASSES_PER_STEP = 3
#: Tensors of a layer's cache ``torch.cat`` allocates anew at each step: its keys and its values.
_CACHE_TENSORS = 2
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


@dataclass(frozen=True)
class PricingContext:
    """What every price reads: the graph (dtype, traced length), the machine and the workload.

    ``calibration``: unit times measured on this model (:mod:`.calibrated`); they replace the
    roofline and :data:`UNIT_OVERHEAD_S` wherever they exist.
    """

    graph: LayerGraph
    machine: Machine
    workload: Workload
    calibration: Calibration | None = None

    def overhead_s(self, unit: UnitInfo, device: Device) -> float:
        """Seconds the host spends running one forward of ``unit`` on ``device`` beside its kernels.

        A unit whose ops the trace counted (``ops_per_forward``) costs them at the device's
        ``op_overhead_s`` (measured by a profile; else :data:`OP_OVERHEAD_S` of its kind): its own share of
        its block, and each expert group its own run of the experts' code. Otherwise, :data:`UNIT_OVERHEAD_S`
        of ``device``'s kind, shared equally among the parts of a block
        (``UnitInfo.block``): a layer launches the same kernels whether it runs as one unit or as its
        attention and MLP, so cutting it does not multiply its overhead. Expert groups do multiply it: each
        group runs the experts' routing and kernels again, so a layer's ``G`` groups share the experts part's
        share and add ``G - 1`` overheads (about what one more group cost per call on this project's CPU:
        a tiny Mixtral decoded at 1054 tokens/s with its experts whole and 551 with 4 groups a layer)."""
        if unit.ops_per_forward is not None and device.kind != "disk":
            return unit.ops_per_forward * self._seconds_per_op(device)
        whole = UNIT_OVERHEAD_S[device.kind]
        parts, groups = self.overhead_share(unit)
        return (whole / parts + whole * (groups - 1)) / groups

    def _seconds_per_op(self, device: Device) -> float:
        """:func:`op_overhead_s` of ``device``; a CPU beside GPUs pays at least a GPU's. A unit the host computes
        between GPU units first waits for the GPU's queue (its inputs come back from it), and so gives up the lead
        that lets a GPU's kernels run under the host's ops; that wait is not modelled, and without it the cheaper
        CPU op would draw tiny units (rotary tables, norms) off an idle GPU for a saving that the wait undoes."""
        rate = op_overhead_s(device)
        if device.kind == "cpu" and self.machine.gpus:
            rate = max(rate, *(op_overhead_s(gpu) for gpu in self.machine.gpus))
        return rate

    def host_s(self, unit: UnitInfo, device: Device, phase: str) -> float:
        """What the host's time for ``unit`` adds to its kernels' per forward (``"prefill"``) or decode step: all
        of :meth:`overhead_s`, or on a GPU that queues ahead (:meth:`launches_ahead`) the part :meth:`exposed_s`."""
        if self.launches_ahead(unit, device):
            return self.exposed_s(unit, device, phase)
        return self.overhead_s(unit, device)

    def exposed_s(self, unit: UnitInfo, device: Device, phase: str) -> float:
        """The host's time for ``unit`` on a GPU that its kernels do not hide, per forward (``"prefill"``) or decode
        step (``"decode"``, at the middle step's context).

        A GPU's kernels run while the host queues the next ops, so a run of units takes the longer of the host's
        time and the kernels'. Taken unit by unit, that max would price a layer cut into parts (an attention the host
        bounds, an MLP the kernels bound) above the same layer whole. It is taken over the unit's block instead
        (``UnitInfo.block``; a unit outside every block is its own), as if all its parts ran on ``device``, and
        shared among the parts by their ops: the parts of a block on one GPU then cost what the block costs whole.
        """
        key = (unit.block or unit.name, device.name, phase)
        cache = self._exposed
        if key not in cache:
            members = self._block_members.get(unit.block, [unit]) if unit.block is not None else [unit]
            host = sum(self.overhead_s(m, device) for m in members)
            kernels = sum(self._kernel_s(m, device, phase) for m in members)
            ops = sum(m.ops_per_forward or 0 for m in members)
            cache[key] = (max(0.0, host - kernels), ops)
        exposed, ops = cache[key]
        return exposed * (unit.ops_per_forward or 0) / ops if ops else 0.0

    def _kernel_s(self, unit: UnitInfo, device: Device, phase: str) -> float:
        """One forward (prefill) or middle decode step of ``unit`` on ``device`` without host time, or as measured."""
        if phase == "prefill":
            measured = _measured_prefill_s(self, unit, device)
            return measured if measured is not None else _prefill_roofline_s(self, unit, device)
        line = _measured_decode_line(self, unit, device)
        lines = [line] if line is not None else _decode_roofline_lines(self, unit, device)
        middle = self.workload.decode_steps // 2
        return max(a + b * middle for a, b in lines)

    @functools.cached_property
    def _exposed(self) -> dict[tuple[str, str, str], tuple[float, int]]:
        return {}

    @functools.cached_property
    def _block_members(self) -> dict[str, list[UnitInfo]]:
        members: dict[str, list[UnitInfo]] = collections.defaultdict(list)
        for u in self.graph.units():
            if u.block is not None:
                members[u.block].append(u)
        return members

    @staticmethod
    def launches_ahead(unit: UnitInfo, device: Device) -> bool:
        """Whether the host's time for ``unit`` overlaps its kernels rather than adding to them: a GPU runs what
        the host queued while the host queues the next ops, so a forward takes the longer of the two. (A CPU
        does both itself, in turn.) Only for units whose ops were counted: the fixed :data:`UNIT_OVERHEAD_S`
        stands for hooks and syncs, which add."""
        return device.is_gpu and unit.ops_per_forward is not None

    def overhead_share(self, unit: UnitInfo) -> tuple[int, int]:
        """(parts of its block, expert groups of its experts module): what :meth:`overhead_s` reads beside the
        device, so what two units priced alike must share."""
        return self.block_parts(unit), self._groups.get(unit.name, 1)

    def block_parts(self, unit: UnitInfo) -> int:
        """How many units were cut from ``unit``'s block (1 for a unit that is not a part), a layer's expert
        groups counted as one."""
        return self._block_parts[unit.block] if unit.block is not None else 1

    @functools.cached_property
    def _block_parts(self) -> collections.Counter[str]:
        return collections.Counter(u.block for u in self.graph.units()
                                   if u.block is not None and (whole_experts(u.name) or ("", 0))[1] == 0)

    @functools.cached_property
    def _groups(self) -> dict[str, int]:
        """Expert group unit -> how many groups its experts module is cut into."""
        counts = group_counts(self.graph.names())
        return {u: counts[parsed[0]] for u in self.graph.names() if (parsed := whole_experts(u)) is not None}

    @property
    def home(self) -> str | None:
        """The device a ``"sublayer"`` graph's residual stream stays on; None for other graphs (no round trips)."""
        return home_device(self.machine) if self.graph.meta.granularity == "sublayer" else None


def home_device(machine: Machine) -> str | None:
    """Where the residual stream and the glue of a sublayer plan stay: the first GPU, else the CPU
    (None for a machine that computes nowhere, which no plan can use)."""
    computing = machine.gpus or machine.compute_devices
    return computing[0].name if computing else None


def op_overhead_s(device: Device) -> float:
    """Host seconds per torch op on ``device``: its profile's figure, else :data:`OP_OVERHEAD_S` of its kind."""
    return device.op_overhead_s if device.op_overhead_s is not None else OP_OVERHEAD_S[device.kind]


def host_memory_bytes_per_s(machine: Machine) -> float | None:
    """What host RAM serves all its readers together (the cores and the GPUs' copies): the CPU's
    ``shared_bandwidth_bytes_per_s``; None without a CPU (no host row)."""
    cpu = machine.cpu
    return cpu.shared_bandwidth_bytes_per_s if cpu is not None else None


def _host_s(ctx: PricingContext, nbytes: float) -> float:
    rate = host_memory_bytes_per_s(ctx.machine)
    return nbytes / rate if rate else 0.0


def _host_traffic_s(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str) -> tuple[float, float]:
    """(prefill, decode) host-memory time of one non-phased option: a CPU-executed unit reads its weights
    (the experts hit) and KV cache from RAM; a GPU-executed unit stored off the GPU is copied out of RAM."""
    wl = ctx.workload
    forwards = 2 if wl.training else 1
    steps = wl.decode_steps if unit.in_decode else 0
    device = ctx.machine[execution]
    if device.kind == "cpu":
        rows = _prefill_rows(ctx, unit)
        kv = unit.kv_bytes_per_token * wl.batch_size
        # latent attention's expanded keys and values and the math path's copies: written, then read
        expanded = 2 * ((unit.latent_expand_bytes_per_ctx or 0) + (unit.latent_expand_cpu_bytes_per_ctx or 0)) * wl.batch_size
        kv_read = (CACHE_PASSES_PER_STEP * kv + expanded) * _kv_positions_read(unit, wl.prompt_len + 1, steps)
        return (_host_s(ctx, forwards * _touched_weight_bytes(unit, rows) + kv * wl.prompt_len),
                _host_s(ctx, steps * _touched_weight_bytes(unit, wl.batch_size) + kv_read))
    if storage == execution:
        return 0.0, 0.0
    return _host_s(ctx, forwards * unit.weight_bytes), _host_s(ctx, steps * unit.weight_bytes)


def _kv_positions_read(unit: UnitInfo, ctx0: int, steps: int) -> int:
    """Cached positions per sequence the decode steps read in all: step t reads ``ctx0 + t``, a sliding layer
    at most its window."""
    return contexts_at_least(ctx0, steps, unit.kv_window_tokens, 0)


def _disk_reads_s(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str) -> tuple[float, float]:
    """(prefill, decode) time the disk spends reading a non-phased option's weights: every forward reads
    what it computes with (a CPU-executed unit from its memory map: the experts hit), at the disk's rate."""
    if ctx.machine[storage].kind != "disk":
        return 0.0, 0.0
    wl = ctx.workload
    rate = ctx.machine[storage].bandwidth_bytes_per_s
    forwards = 2 if wl.training else 1
    steps = wl.decode_steps if unit.in_decode else 0
    if ctx.machine[execution].kind == "cpu":
        read_prefill, read_decode = _touched_weight_bytes(unit, _prefill_rows(ctx, unit)), _touched_weight_bytes(unit, wl.batch_size)
    else:
        read_prefill = read_decode = unit.weight_bytes
    return forwards * read_prefill / rate, steps * read_decode / rate


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


def _round_trips(ctx: PricingContext, unit: UnitInfo, prefill_device: str, decode_device: str) -> tuple[float, float]:
    """The unit's round trips over a whole workload: (prefill, every decode step)."""
    wl = ctx.workload
    forwards = 2 if wl.training else 1
    prefill = forwards * round_trip_s(ctx, unit, prefill_device, _prefill_rows(ctx, unit))
    decode = wl.decode_steps * round_trip_s(ctx, unit, decode_device, wl.batch_size) if unit.in_decode else 0.0
    return prefill, decode


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts that ``tokens`` tokens hit, each routed to ``top_k``.

    Each token picks ``top_k`` of ``num_experts`` experts; one expert is missed by one token
    with probability ``1 - top_k / num_experts``, so ``E[distinct] = E x (1 - (1 - k/E)^T)``.
    Example: 8 experts, top-2, 1 token -> 2.0; 4 tokens -> 8 x (1 - 0.75^4) = 5.47.
    """
    if num_experts <= 0 or top_k <= 0 or tokens <= 0:
        return 0.0
    top_k = min(top_k, num_experts)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _touched_weight_bytes(unit: UnitInfo, tokens: int) -> float:
    """Weight bytes one forward over ``tokens`` tokens reads (MoE: only the experts hit).

    A unit with weights but no FLOPs is a lookup table (an embedding): it reads one row per token.
    """
    if unit.flops_per_token == 0 and unit.param_bytes > 0:
        return float(min(unit.weight_bytes, tokens * unit.out_bytes_per_token + unit.buffer_bytes))
    if not unit.is_moe:
        return float(unit.weight_bytes)
    hit = expected_experts(unit.moe_num_experts, unit.moe_experts_per_token, tokens)
    return unit.weight_bytes - unit.moe_expert_bytes + unit.moe_expert_bytes * hit / unit.moe_num_experts


def _achieved(device: Device, tokens: int) -> tuple[float, float]:
    """Achieved (FLOP/s, bytes/s) of a device running ``tokens`` tokens per forward.

    Measured figures are used as they are (a measured FLOP/s-by-tokens curve, interpolated in
    log(tokens), wins over the single figure); datasheet figures are derated by the efficiency tables.
    """
    if device.source.startswith("measured"):
        flops = _interpolate(device.flops_by_tokens, tokens) if device.flops_by_tokens else device.flops_per_s
        return flops, device.bandwidth_bytes_per_s
    return (device.flops_per_s * COMPUTE_EFFICIENCY[device.kind],
            device.bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY[device.kind])


def _interpolate(curve: Sequence[tuple[int, float]], tokens: int) -> float:
    """Piecewise-linear in log(tokens) through the measured points, flat beyond both ends."""
    if tokens <= curve[0][0]:
        return curve[0][1]
    for (t0, f0), (t1, f1) in pairwise(curve):
        if tokens <= t1:
            w = math.log(tokens / t0) / math.log(t1 / t0)
            return f0 + w * (f1 - f0)
    return curve[-1][1]


def _base_flops_per_token(unit: UnitInfo, traced_seq_len: int) -> int:
    """FLOPs per token without the attention term (graph.py: flops - attn x traced seq_len)."""
    return max(0, unit.flops_per_token - unit.attn_flops_per_token_per_ctx * traced_seq_len)


def _sum_max_lines(lines: Sequence[tuple[float, float]], steps: int) -> float:
    """``sum_{t=0}^{steps-1} max_i(a_i + b_i t)`` in closed form.

    The upper envelope of lines is convex and piecewise linear; cutting ``[0, steps)`` at the
    integer ceilings of every pairwise intersection leaves segments where one line dominates,
    and each segment is an arithmetic series.
    """
    if steps <= 0:
        return 0.0
    cuts = {0, steps}
    for i, (a1, b1) in enumerate(lines):
        for a2, b2 in lines[i + 1:]:
            if b1 != b2:
                x = (a2 - a1) / (b1 - b2)
                if 0 < x < steps:
                    cuts.add(math.ceil(x))
    total = 0.0
    points = sorted(cuts)
    for start, end in pairwise(points):
        if end <= start:
            continue
        mid = (start + end - 1) / 2
        a, b = max(lines, key=lambda line: line[0] + line[1] * mid)
        count = end - start
        total += a * count + b * (start + end - 1) * count / 2
    return total


def _copy_s(ctx: PricingContext, storage: str, execution: str, nbytes: float, mode: str, n_tensors: int,
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


def _prefill_s(ctx: PricingContext, unit: UnitInfo, device: Device) -> float:
    """Compute time of the unit over the whole prompt on ``device`` (training: a whole step)."""
    measured = _measured_prefill_s(ctx, unit, device)
    if measured is not None:
        return measured
    seconds = _prefill_roofline_s(ctx, unit, device) + ctx.host_s(unit, device, "prefill")
    if ctx.workload.training:
        seconds *= _TRAIN_COMPUTE_FORWARDS[ctx.workload.activation_checkpointing]
    return seconds


def _measured_prefill_s(ctx: PricingContext, unit: UnitInfo, device: Device) -> float | None:
    """The unit's calibrated prefill on ``device`` (its host time included), or None."""
    wl = ctx.workload
    measured = _calibrated(ctx, unit, device)
    return None if measured is None else measured.prefill_s(wl.batch_size, wl.prompt_len, wl.logits_kept)


def _prefill_roofline_s(ctx: PricingContext, unit: UnitInfo, device: Device) -> float:
    """The roofline of one forward of the unit over the prompt on ``device``: its kernels, no host time."""
    wl = ctx.workload
    tokens = wl.batch_size * wl.prompt_len
    rows = _prefill_rows(ctx, unit)
    flops_s, bytes_s = _achieved(device, rows)
    base = _base_flops_per_token(unit, ctx.graph.meta.seq_len)
    causal_pairs = wl.prompt_len * (wl.prompt_len + 1) / 2
    flops = rows * base + wl.batch_size * unit.attn_flops_per_token_per_ctx * causal_pairs
    touched = (_touched_weight_bytes(unit, rows) + 2 * rows * unit.out_bytes_per_token
               + tokens * unit.kv_bytes_per_token)
    return max(flops / flops_s, touched / bytes_s)


def _prefill_rows(ctx: PricingContext, unit: UnitInfo) -> int:
    """Tokens the unit computes in the prefill: batch x prompt, but generate() asks the logits unit for the
    last position only (batch rows)."""
    wl = ctx.workload
    return wl.batch_size if _last_logits_only(ctx, unit) else wl.batch_size * wl.prompt_len


def _last_logits_only(ctx: PricingContext, unit: UnitInfo) -> bool:
    """Whether the prefill computes ``unit`` (the logits unit) at the last position of each sequence only."""
    return ctx.workload.logits_kept == "last" and unit.name == ctx.graph.meta.extra.get("logits_unit")


def _decode_lines(ctx: PricingContext, unit: UnitInfo, device: Device) -> list[tuple[float, float]]:
    """Compute time of decode step t as ``max`` of lines ``a + b t`` (FLOPs line, bytes line).

    A calibrated unit has one line: its measured step at the first context, growing with the context.
    """
    measured = _measured_decode_line(ctx, unit, device)
    if measured is not None:
        return [measured]
    host = ctx.host_s(unit, device, "decode")
    return [(a + host, b) for a, b in _decode_roofline_lines(ctx, unit, device)]


def _measured_decode_line(ctx: PricingContext, unit: UnitInfo, device: Device) -> tuple[float, float] | None:
    """The unit's calibrated decode step on ``device`` at the first step's context, and its growth per step."""
    wl = ctx.workload
    measured = _calibrated(ctx, unit, device)
    return None if measured is None else measured.decode_line(wl.batch_size, unit.kv_tokens(wl.prompt_len + 1))


def _decode_roofline_lines(ctx: PricingContext, unit: UnitInfo, device: Device) -> list[tuple[float, float]]:
    """:func:`_decode_lines` without the host's time: the FLOPs line and the bytes line of the kernels."""
    wl = ctx.workload
    ctx0 = unit.kv_tokens(wl.prompt_len + 1)  # a sliding layer past its window starts (and stays) there
    flops_s, bytes_s = _achieved(device, wl.batch_size)
    batch = wl.batch_size
    attn = unit.attn_flops_per_token_per_ctx
    base = _base_flops_per_token(unit, ctx.graph.meta.seq_len)
    grows = _expand_s_per_cached(unit, device, batch, ctx0)
    overhead = grows * ctx0
    flops = (batch * (base + attn * ctx0), batch * attn)
    # latent attention's expanded keys and values (on a CPU, the math path's copies too): written, then read
    expanded = (unit.latent_expand_bytes_per_ctx or 0) + (
        unit.latent_expand_cpu_bytes_per_ctx or 0 if device.kind == "cpu" else 0)
    kv = batch * (CACHE_PASSES_PER_STEP * unit.kv_bytes_per_token + 2 * expanded)
    touched = (_touched_weight_bytes(unit, batch) + 2 * batch * unit.out_bytes_per_token + kv * ctx0, kv)
    return [(flops[0] / flops_s + overhead, flops[1] / flops_s + grows),
            (touched[0] / bytes_s + overhead, touched[1] / bytes_s + grows)]


def _expand_s_per_cached(unit: UnitInfo, device: Device, batch: int, ctx0: int) -> float:
    """Seconds per cached token latent attention takes at a decode step to expand its cache: a matmul of
    ``batch x context`` rows, which runs at that many rows' rate (taken at the first step's ``ctx0``), not a
    step's (one row per sequence), and beside the rest of the step, not hidden under its weight reads."""
    flops = unit.latent_expand_flops_per_ctx or 0
    if not flops:
        return 0.0
    rate, _ = _achieved(device, batch * ctx0)  # the later, longer steps run at least as fast
    return batch * flops / rate


def _fresh_pages_s(ctx: PricingContext, unit: UnitInfo, device: Device) -> float:
    """Seconds a CPU's decode steps spend getting new pages for a unit's grown KV cache, beside its passes.

    Every step's ``torch.cat`` allocates the layer's keys and values anew, and from
    :data:`FRESH_PAGE_MIN_BYTES` on (per tensor) glibc maps them anew, so their pages fault in at the
    device's measured ``fresh_page_bytes_per_s``. Without that figure, or for a calibrated unit (whose
    measured step has it), nothing. Other allocations of the step that grow with the context (eager
    attention's repeated keys, latent attention's expansion) are not counted.
    """
    rate = device.fresh_page_bytes_per_s
    wl = ctx.workload
    if device.kind != "cpu" or not rate or not unit.kv_bytes_per_token or _calibrated(ctx, unit, device):
        return 0.0
    per_token = wl.batch_size * unit.kv_bytes_per_token / _CACHE_TENSORS
    floor = math.ceil(FRESH_PAGE_MIN_BYTES / per_token)
    cached = contexts_at_least(wl.prompt_len + 1, wl.decode_steps, unit.kv_window_tokens, floor)
    return _CACHE_TENSORS * per_token * cached / rate


def contexts_at_least(ctx0: int, steps: int, window: int | None, floor: int) -> int:
    """Sum over ``steps`` decode steps of the cached tokens ``c_t`` (``ctx0 + t``, at most ``window``) of the
    steps with ``c_t >= floor``, in closed form (``floor`` 0: every step's)."""
    growing = steps if window is None else max(0, min(steps, window - ctx0))
    low, high = max(ctx0, floor), ctx0 + growing - 1
    total = (low + high) * (high - low + 1) // 2 if high >= low else 0
    if window is not None and window >= floor:
        total += (steps - growing) * window
    return total


def _growing_steps(unit: UnitInfo, workload: Workload) -> int | None:
    """Decode steps before a sliding layer's cache reaches its window, from which on every step reads the
    window (:func:`_decode_lines` start at the first step's context); None: the cache grows to the end."""
    if unit.kv_window_tokens is None:
        return None
    return unit.kv_window_tokens - unit.kv_tokens(workload.prompt_len + 1)


def _sum_capped_lines(lines: Sequence[tuple[float, float]], steps: int, growing: int | None) -> float:
    """:func:`_sum_max_lines` where step ``t`` is priced at ``min(t, growing)`` (None: never capped)."""
    if growing is None or growing >= steps:
        return _sum_max_lines(lines, steps)
    flat = max(a + b * growing for a, b in lines)
    return _sum_max_lines(lines, growing) + (steps - growing) * flat


def _calibrated(ctx: PricingContext, unit: UnitInfo, device: Device) -> UnitTimes | None:
    """The unit's measured times on ``device`` (inference only), or None."""
    if ctx.calibration is None or ctx.workload.training:
        return None
    return ctx.calibration.times(unit.name, device.name)


def price_option(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str, mode: str,
                 prefill_execution: str | None = None) -> OptionPrice:
    """Time and memory of one option of one unit (``phased``: ``prefill_execution`` computes the prefill)."""
    if mode == "phased":
        if prefill_execution is None:
            raise ValueError("a phased option needs its prefill_execution")
        return _price_phased(ctx, unit, storage, execution, prefill_execution)
    wl = ctx.workload
    device = ctx.machine[execution]
    n_tensors = len(unit.param_names)
    copy = _copy_s(ctx, storage, execution, unit.weight_bytes, mode, n_tensors, unit.name)
    copy_prefill = _copy_s(ctx, storage, execution, unit.weight_bytes, mode, n_tensors, unit.name, "prefill")
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
        decode = _sum_capped_lines(lines, wl.decode_steps, _growing_steps(unit, wl)) + _fresh_pages_s(ctx, unit, device)
    host_prefill, host_decode = _host_traffic_s(ctx, unit, storage, execution)
    disk_prefill, disk_decode = _disk_reads_s(ctx, unit, storage, execution)
    trip_prefill, trip_decode = _round_trips(ctx, unit, execution, execution)
    prefill += trip_prefill
    decode += trip_decode
    train = unit_training_bytes(unit, wl, ctx.graph.meta.dtype)
    kv = 0 if wl.training else unit.kv_bytes_per_token * wl.batch_size * unit.kv_tokens(wl.context_len)
    return OptionPrice(
        storage=storage, execution=execution, mode=mode, prefill_s=prefill, decode_s=decode,
        weights_bytes=unit.weight_bytes,
        stored_other_bytes=train.gradient_bytes + train.optimizer_bytes,
        kv_cache_bytes=kv, resident_other_bytes=train.activation_bytes,
        workspace_bytes=workspace_bytes(unit, wl, ctx.graph.meta, on_gpu=device.is_gpu),
        stream_buffer_bytes=unit.weight_bytes * stream_buffers(mode, device.is_gpu), round_trip_s=trip_prefill + trip_decode,
        group_copy_bytes=unit.weight_bytes if overlapped else 0,
        copy_prefill_s=forwards * copy_prefill if apart else 0.0, copy_decode_s=copy_decode,
        host_prefill_s=host_prefill, host_decode_s=host_decode, disk_prefill_s=disk_prefill, disk_decode_s=disk_decode,
    )


def _price_phased(ctx: PricingContext, unit: UnitInfo, storage: str, execution: str, gpu: str) -> OptionPrice:
    """A ``phased`` option: the prefill of a ``stream`` to ``gpu`` plus the prompt's KV cache moved to
    ``execution`` once; the decode of the unit computed on ``execution`` from ``storage`` (resident in
    RAM, or memory-mapped from disk); the whole KV cache on ``execution``."""
    wl = ctx.workload
    prefill = price_option(ctx, unit, storage, gpu, "stream")
    decode = price_option(ctx, unit, storage, execution, "resident" if storage == execution else "stream")
    prompt_kv = unit.kv_bytes_per_token * wl.batch_size * unit.kv_tokens(wl.prompt_len)
    move_s = (prompt_kv / ctx.machine.bandwidth(gpu, execution) + ctx.machine.latency_s(gpu, execution)
              if prompt_kv else 0.0)
    return OptionPrice(
        storage=storage, execution=execution, mode="phased", prefill_s=prefill.prefill_s + move_s,
        decode_s=decode.decode_s, weights_bytes=unit.weight_bytes, stored_other_bytes=0,
        kv_cache_bytes=decode.kv_cache_bytes, resident_other_bytes=0,
        workspace_bytes=workspace_bytes(unit, wl, ctx.graph.meta, on_gpu=False, phase="decode"),
        stream_buffer_bytes=decode.stream_buffer_bytes, prefill_execution=gpu,
        prefill_workspace_bytes=workspace_bytes(unit, wl, ctx.graph.meta, on_gpu=True, phase="prefill"),
        prefill_stream_buffer_bytes=prefill.stream_buffer_bytes, prefill_kv_bytes=prompt_kv,
        group_copy_bytes=prefill.group_copy_bytes,
        round_trip_s=sum(_round_trips(ctx, unit, gpu, execution)),
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
