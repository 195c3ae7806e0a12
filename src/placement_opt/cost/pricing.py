"""The cost model: what every placement option of every unit costs in time and memory.

Stage 3 of the data flow: ``LayerGraph`` + ``Machine`` + ``Workload`` -> :func:`build_problem`
-> ``PlacementProblem`` (plain integers for the solvers), and :func:`evaluate` -> :class:`Cost`
for any plan or accelerate ``device_map``, scored by the same ``PlacementProblem.score``.

Options of a unit (storage S, execution E, mode): resident on every GPU; resident in CPU RAM and
executed on the CPU; stored in CPU RAM and streamed to every GPU; stored on disk and read to the
CPU or streamed to every GPU. ``stream`` overlaps the copy with compute (placement_opt's
dispatcher prefetches the next unit), ``stream_sync`` adds it (accelerate's hooks copy tensor by
tensor, from pageable memory).

Time of one forward of a unit on E is a roofline plus a fixed per-unit overhead::

    t = max(FLOPs / (peak FLOP/s x compute efficiency), bytes / (bandwidth x bandwidth efficiency))
        + overhead(E)

Efficiencies are the :data:`COMPUTE_EFFICIENCY` / :data:`BANDWIDTH_EFFICIENCY` tables for
datasheet figures and 1.0 for figures measured by :func:`placement_opt.profile` (which are
achieved rates already). Bytes touched are the weights (MoE: only the experts the batch hits),
the activations in and out, and the KV cache read (decode) or written (prefill).

* Prefill: ``batch x prompt`` tokens, causal attention (query ``i`` sees ``i + 1`` tokens).
* Decode: step ``t`` (0-based) has ``batch`` tokens and a context of ``prompt + t + 1``; FLOPs and
  bytes grow linearly in ``t``, so the sum over all steps of a max of linear functions has a
  closed form (:func:`_sum_max_lines`), never a loop over steps.
* Streamed weights add ``bytes / link + latency`` per forward: ``max(compute, copy)`` for
  ``stream`` to a GPU (its copy engines work while it computes), ``compute + copy`` for
  ``stream_sync`` (one latency per tensor, pageable copies; disk reads through a memory map at
  :data:`MAPPED_READ_FACTOR` of the disk's rate: a profiled disk's memory-map read rate, a
  datasheet disk's sequential rate) and for any stream executed on the
  CPU: the same cores fault the weights in and compute, and measured runs on a CPU show no
  overlap (benchmarks/cost_accuracy).
* Edges: ``bytes_per_token x tokens / link + latency`` when the two ends execute on different
  devices, per prefill and per decode step.
* Training (``Workload.training``): one step = forward + backward (x3 compute, x4 with activation
  checkpointing), weights streamed twice, activations and gradients cross edges twice.

Memory per option: ``stored_bytes`` on S (parameters and buffers; training: gradients and
optimizer states, which stay where the weights live), ``resident_bytes`` on E (KV cache for
``batch x (prompt + new)`` tokens; training: saved activations), ``peak_bytes`` on E (prefill
activation workspace plus the stream buffer: x2 for ``stream``, whose next unit is prefetched).

Every float becomes an integer in one place, :func:`_ns`, with :data:`NS_PER_S`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from ._units import format_bytes
from .devices import Device, Machine, as_machine, normalize_device_name
from .graph import covering_key, keys_below
from .problem import MODES, DeviceSpec, EdgeSpec, PlacementOption, PlacementProblem, UnitSpec
from .workload import Workload, unit_training_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .graph import LayerGraph, UnitInfo

__all__ = [
    "UnitCost",
    "DeviceMemory",
    "Violation",
    "Cost",
    "build_problem",
    "evaluate",
    "evaluator",
    "expected_experts",
    "NS_PER_S",
    "COMPUTE_EFFICIENCY",
    "BANDWIDTH_EFFICIENCY",
    "UNIT_OVERHEAD_S",
    "PAGEABLE_LINK_FACTOR",
    "MAPPED_READ_FACTOR",
    "WORKSPACE_FACTOR",
]

#: Solver time unit: every ``*_ns`` integer is seconds x NS_PER_S, rounded up.
NS_PER_S = 10**9

#: Fraction of datasheet peak FLOP/s that large matmuls reach (measured figures use 1.0).
COMPUTE_EFFICIENCY = {"gpu": 0.6, "cpu": 0.5, "disk": 1.0}
#: Fraction of datasheet memory bandwidth that weight reads reach (measured figures use 1.0).
BANDWIDTH_EFFICIENCY = {"gpu": 0.8, "cpu": 0.6, "disk": 0.9}
#: Fixed cost of running one unit once (Python hooks, kernel launches, small ops).
UNIT_OVERHEAD_S = {"gpu": 60e-6, "cpu": 150e-6, "disk": 0.0}
#: accelerate copies pageable (unpinned) CPU tensors: this fraction of the pinned link rate.
PAGEABLE_LINK_FACTOR = 0.6
#: accelerate reads each disk tensor through its own ``np.memmap`` and copies it out: this fraction
#: of the disk's read rate (a profiled disk's whole-file memory-map rate, a datasheet disk's
#: sequential rate). Measured: 1.07 GB/s for accelerate against 1.88 GB/s for placement_opt's
#: zero-copy maps on one disk (0.57; benchmarks/cost_accuracy, 2026-11-21).
MAPPED_READ_FACTOR = 0.6
#: Prefill activation workspace of a unit, in multiples of its output for all prefill tokens
#: (q/k/v, MLP intermediates and their upcasts live at the same time).
WORKSPACE_FACTOR = 6
#: Compute of a training step in forwards: forward + backward (2x), + 1 recomputation.
_TRAIN_COMPUTE_FORWARDS = {False: 3, True: 4}
_STREAM_BUFFERS = {"resident": 0, "stream": 2, "stream_sync": 1}


# ---------------------------------------------------------------------------------------------
# Public result types
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class UnitCost:
    """Where one unit sits and what it costs there."""

    name: str
    storage: str
    execution: str
    mode: str
    prefill_s: float
    """Time in the prefill, weight copies included."""
    decode_s: float
    """Time summed over every decode step."""
    stored_bytes: int
    resident_bytes: int
    peak_bytes: int


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """Memory of one device under a placement, by what it holds."""

    device: str
    capacity_bytes: int
    """Bytes the plan may use: memory less the reserve."""
    reserve_bytes: int
    """Kept free for the CUDA context and allocator slack (not part of ``capacity_bytes``)."""
    weights_bytes: int
    """Parameters and buffers stored here."""
    kv_cache_bytes: int
    """KV cache of the attention units executed here, for batch x (prompt + new tokens)."""
    workspace_bytes: int
    """Peak activation workspace of the units executed here (the largest one, in the prefill)."""
    stream_buffer_bytes: int
    """Buffer that streamed weights pass through (prefetch included), at its peak."""
    other_bytes: int = 0
    """Anything else the memory model charges here (training states)."""

    @property
    def used_bytes(self) -> int:
        return (self.weights_bytes + self.kv_cache_bytes + self.workspace_bytes
                + self.stream_buffer_bytes + self.other_bytes)

    @property
    def free_bytes(self) -> int:
        """Negative when the device is over capacity."""
        return self.capacity_bytes - self.used_bytes


@dataclass(frozen=True, kw_only=True)
class Violation:
    """One device over capacity."""

    device: str
    needed_bytes: int
    capacity_bytes: int
    message: str
    """Says what is short, by how much, what takes the space, and what to do."""

    @property
    def short_bytes(self) -> int:
        return self.needed_bytes - self.capacity_bytes


@dataclass(frozen=True, kw_only=True)
class Cost:
    """The price of a placement: time per phase, memory per device, every capacity violation."""

    workload: Workload
    prefill_s: float
    decode_s: float
    transfer_s: float
    """Activation transfers between devices, included in the phase times."""
    stage_s: Mapping[str, float]
    """Total work per execution device: the pipeline stage times."""
    units: tuple[UnitCost, ...]
    memory: tuple[DeviceMemory, ...]
    violations: tuple[Violation, ...] = ()

    @property
    def total_s(self) -> float:
        """Latency of the whole workload: prefill plus every decode step."""
        return self.prefill_s + self.decode_s

    @property
    def fits(self) -> bool:
        return not self.violations

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second over the decode phase (all sequences of the batch)."""
        tokens = self.workload.batch_size * self.workload.new_tokens
        return tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second, prefill included (what a user waits for)."""
        tokens = self.workload.batch_size * max(self.workload.new_tokens, 1)
        return tokens / self.total_s if self.total_s > 0 else 0.0

    def device_memory(self, device: str) -> DeviceMemory:
        return next(m for m in self.memory if m.device == device)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stage_s"] = dict(self.stage_s)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cost:
        return cls(
            workload=Workload.from_dict(dict(data["workload"])),
            prefill_s=float(data["prefill_s"]),
            decode_s=float(data["decode_s"]),
            transfer_s=float(data["transfer_s"]),
            stage_s=dict(data["stage_s"]),
            units=tuple(UnitCost(**u) for u in data["units"]),
            memory=tuple(DeviceMemory(**m) for m in data["memory"]),
            violations=tuple(Violation(**v) for v in data["violations"]),
        )


# ---------------------------------------------------------------------------------------------
# Pricing one option (floats; converted once in _to_option)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _Parts:
    """One option priced in seconds and bytes, with the memory split that evaluate reports."""

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


@dataclass(frozen=True)
class _Context:
    graph: LayerGraph
    machine: Machine
    workload: Workload


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


def _copy_s(ctx: _Context, storage: str, execution: str, nbytes: float, mode: str, n_tensors: int) -> float:
    """Time to copy ``nbytes`` of weights from storage to execution once."""
    if mode == "resident" or nbytes <= 0:
        return 0.0
    bandwidth = ctx.machine.bandwidth(storage, execution)
    latency = ctx.machine.latency_s(storage, execution)
    if mode == "stream_sync":
        kind = ctx.machine[storage].kind
        bandwidth *= {"cpu": PAGEABLE_LINK_FACTOR, "disk": MAPPED_READ_FACTOR}.get(kind, 1.0)
        latency *= max(1, n_tensors)
    return nbytes / bandwidth + latency


def _prefill_s(ctx: _Context, unit: UnitInfo, device: Device) -> float:
    """Compute time of the unit over the whole prompt on ``device`` (training: a whole step)."""
    wl = ctx.workload
    tokens = wl.batch_size * wl.prompt_len
    flops_s, bytes_s = _achieved(device, tokens)
    base = _base_flops_per_token(unit, ctx.graph.meta.seq_len)
    causal_pairs = wl.prompt_len * (wl.prompt_len + 1) / 2
    flops = wl.batch_size * (wl.prompt_len * base + unit.attn_flops_per_token_per_ctx * causal_pairs)
    touched = (_touched_weight_bytes(unit, tokens) + 2 * tokens * unit.out_bytes_per_token
               + tokens * unit.kv_bytes_per_token)
    seconds = max(flops / flops_s, touched / bytes_s) + UNIT_OVERHEAD_S[device.kind]
    if wl.training:
        seconds *= _TRAIN_COMPUTE_FORWARDS[wl.activation_checkpointing]
    return seconds


def _decode_lines(ctx: _Context, unit: UnitInfo, device: Device) -> list[tuple[float, float]]:
    """Compute time of decode step t as ``max`` of lines ``a + b t`` (FLOPs line, bytes line)."""
    wl = ctx.workload
    flops_s, bytes_s = _achieved(device, wl.batch_size)
    batch, ctx0 = wl.batch_size, wl.prompt_len + 1
    attn = unit.attn_flops_per_token_per_ctx
    base = _base_flops_per_token(unit, ctx.graph.meta.seq_len)
    overhead = UNIT_OVERHEAD_S[device.kind]
    flops = (batch * (base + attn * ctx0), batch * attn)
    kv = batch * unit.kv_bytes_per_token
    touched = (_touched_weight_bytes(unit, batch) + 2 * batch * unit.out_bytes_per_token + kv * ctx0, kv)
    return [(flops[0] / flops_s + overhead, flops[1] / flops_s),
            (touched[0] / bytes_s + overhead, touched[1] / bytes_s)]


def _price(ctx: _Context, unit: UnitInfo, storage: str, execution: str, mode: str) -> _Parts:
    """Time and memory of one option of one unit."""
    wl = ctx.workload
    device = ctx.machine[execution]
    n_tensors = len(unit.param_names)
    copy = _copy_s(ctx, storage, execution, unit.weight_bytes, mode, n_tensors)
    compute = _prefill_s(ctx, unit, device)
    forwards = 2 if wl.training else 1
    overlapped = mode == "stream" and device.is_gpu
    prefill = max(compute, forwards * copy) if overlapped else compute + forwards * copy
    decode = 0.0
    if unit.in_decode and wl.decode_steps > 0:
        lines = _decode_lines(ctx, unit, device)
        if overlapped:
            lines.append((copy, 0.0))
        else:
            lines = [(a + copy, b) for a, b in lines]
        decode = _sum_max_lines(lines, wl.decode_steps)
    train = unit_training_bytes(unit, wl, ctx.graph.meta.dtype)
    prefill_tokens = wl.batch_size * wl.prompt_len
    kv = 0 if wl.training else unit.kv_bytes_per_token * wl.batch_size * wl.context_len
    return _Parts(
        storage=storage, execution=execution, mode=mode, prefill_s=prefill, decode_s=decode,
        weights_bytes=unit.weight_bytes,
        stored_other_bytes=train.gradient_bytes + train.optimizer_bytes,
        kv_cache_bytes=kv, resident_other_bytes=train.activation_bytes,
        workspace_bytes=prefill_tokens * unit.out_bytes_per_token * WORKSPACE_FACTOR,
        stream_buffer_bytes=unit.weight_bytes * _STREAM_BUFFERS[mode],
    )


def _ns(seconds: float) -> int:
    """Seconds -> integer nanoseconds, rounded up (after dropping float noise below 1e-3 ns)."""
    return math.ceil(round(seconds * NS_PER_S, 3))


def _to_option(parts: _Parts) -> PlacementOption:
    """The one place where an option's seconds become integer nanoseconds (see :func:`_ns`)."""
    return PlacementOption(
        storage=parts.storage, execution=parts.execution, mode=parts.mode,
        prefill_ns=_ns(parts.prefill_s),
        decode_ns=_ns(parts.decode_s),
        stored_bytes=parts.weights_bytes + parts.stored_other_bytes,
        resident_bytes=parts.kv_cache_bytes + parts.resident_other_bytes,
        peak_bytes=parts.workspace_bytes + parts.stream_buffer_bytes,
    )


def _edge_ns(ctx: _Context, src: str, dst: str, bytes_per_token: int, tokens: int, times: int) -> int:
    """Integer nanoseconds of ``times`` activation transfers of ``tokens`` tokens each."""
    one = tokens * bytes_per_token / ctx.machine.bandwidth(src, dst) + ctx.machine.latency_s(src, dst)
    return _ns(times * one)


# ---------------------------------------------------------------------------------------------
# build_problem
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# evaluate
# ---------------------------------------------------------------------------------------------
def _as_graph(model_or_graph: Any) -> LayerGraph:
    from .graph import LayerGraph

    if isinstance(model_or_graph, LayerGraph):
        return model_or_graph
    from .trace import trace  # lazy: tracing imports torch

    return trace(model_or_graph)


def _resolve_keys(entries: Mapping[str, Any], graph: LayerGraph) -> dict[str, Any]:
    """Value per unit from keys that may be coarser (prefixes) or finer (submodules) than units.

    A coarser key covers every unit under it (the longest key wins). A unit split by finer keys
    gets the value that holds most of its parameters (each parameter follows its longest matching
    key; ties go to the earliest key in the map): a plan scores whole units.
    """
    order = {k: i for i, k in enumerate(entries)}
    below = keys_below(entries)
    resolved: dict[str, Any] = {}
    missing = []
    for unit in graph.units():
        finer = below.get(unit.name)
        if finer:
            resolved[unit.name] = _vote(entries, order, unit.param_names, finer[0])
            continue
        covering = covering_key(unit.name, entries)
        if covering is None:
            missing.append(unit.name)
        else:
            resolved[unit.name] = entries[covering]
    if missing:
        raise ValueError(f"the device map places no entry for units {_few(missing)}: add them or a "
                         f"covering prefix (e.g. '' for the whole model); map keys: {_few(list(entries))}")
    return resolved


def _vote(entries: Mapping[str, Any], order: Mapping[str, int], param_names: Sequence[str], fallback: str) -> Any:
    """The value holding most of a unit's parameters (ties: the earliest key in the map)."""
    votes: Counter[str] = Counter()
    for param in param_names:
        key = covering_key(param, entries)
        if key is not None:
            votes[key] += 1
    if not votes:
        votes[fallback] = 1
    by_value: Counter[Any] = Counter()
    first: dict[Any, int] = {}
    for key, count in votes.items():
        by_value[entries[key]] += count
        first[entries[key]] = min(first.get(entries[key], len(order)), order[key])
    return max(by_value, key=lambda v: (by_value[v], -first[v]))


def _device_of(value: Any, machine: Machine, key: str) -> str:
    name = normalize_device_name(str(value) if not isinstance(value, int) else value)
    if name not in machine:
        raise ValueError(f"device map entry {key!r} -> {value!r}: {name} is not in the machine "
                         f"({', '.join(machine.names)}); add it to the machine or change the map")
    return name


def _placements_from_device_map(device_map: Mapping[str, Any], graph: LayerGraph,
                                machine: Machine) -> dict[str, tuple[str, str, str]]:
    """accelerate's run-time semantics: cpu/disk entries run on the main GPU with synchronous copies.

    The main device is the first GPU among the map's values (accelerate's ``dispatch_model``);
    with no GPU in the map, ``cpu`` entries compute on the CPU and ``disk`` entries are read to it.
    """
    storage = {k: _device_of(v, machine, k) for k, v in device_map.items()}
    main = next((d for d in storage.values() if d.startswith("cuda:")), None)
    per_unit = _resolve_keys(storage, graph)
    placements = {}
    for unit, device in per_unit.items():
        if device.startswith("cuda:"):
            placements[unit] = (device, device, "resident")
        elif main is not None:
            placements[unit] = (device, main, "stream_sync")
        elif device == "cpu":
            placements[unit] = (device, device, "resident")
        else:
            placements[unit] = (device, "cpu", "stream_sync")
    return placements


def _placements(plan_or_map: Any, graph: LayerGraph, machine: Machine) -> dict[str, tuple[str, str, str]]:
    placements = getattr(plan_or_map, "placements", None)
    if placements is not None:
        entries = {p.unit: (normalize_device_name(p.storage), normalize_device_name(p.execution), p.mode)
                   for p in placements}
        return _resolve_keys(entries, graph)
    if isinstance(plan_or_map, Mapping):
        return _placements_from_device_map(plan_or_map, graph, machine)
    raise ValueError(f"cannot evaluate {type(plan_or_map).__name__}: pass a placement_opt Plan or an "
                     f"accelerate device_map dict like {{'model.embed_tokens': 0, 'model.layers': 'cpu'}}")


def _choice(problem: PlacementProblem, placements: Mapping[str, tuple[str, str, str]]) -> list[int]:
    choice = []
    for unit in problem.units:
        wanted = placements[unit.name]
        keys = [(o.storage, o.execution, o.mode) for o in unit.options]
        if wanted not in keys:
            raise ValueError(f"unit {unit.name} is placed as storage={wanted[0]}, execution={wanted[1]}, "
                             f"mode={wanted[2]}, which the cost model does not offer on this machine; "
                             f"offered: {', '.join('/'.join(k) for k in keys)}")
        choice.append(keys.index(wanted))
    return choice


def evaluate(plan_or_device_map: Any, model_or_graph: Any, machine: Any,
             workload: Workload | None = None) -> Cost:
    """Price any placement: a placement_opt ``Plan`` or a plain accelerate/transformers ``device_map``.

    Example::

        cost = evaluate({"model.embed_tokens": 0, "model.layers": "cpu", "lm_head": 0},
                        graph, {0: "24GiB", "cpu": "64GiB"}, Workload(batch_size=4))
        print(cost.total_s, [v.message for v in cost.violations])

    Args:
        plan_or_device_map: a ``Plan`` (its placements are used as they are) or a ``device_map``
            whose keys are module prefixes coarser or finer than units and whose values are
            ints, ``"cuda:N"``, ``"cpu"`` or ``"disk"``. A map is scored with accelerate's run-time
            semantics: ``cpu``/``disk`` entries execute on the first GPU of the map with
            synchronous copies, or on the CPU when the map has no GPU.
        model_or_graph: a ``LayerGraph`` or anything :func:`placement_opt.trace` accepts.
        machine: a ``Machine`` or anything :func:`as_machine` accepts.
        workload: the workload; default the plan's own, else ``Workload()``.

    Returns:
        A :class:`Cost` whose totals equal ``build_problem(...).score(...)`` of the same assignment,
        with per-unit and per-device breakdowns and every capacity violation.

    Raises:
        ValueError: a unit without an entry, a device the machine lacks, or a placement the cost
            model does not offer; the message lists what is accepted.
    """
    graph = _as_graph(model_or_graph)
    if workload is None:
        workload = getattr(plan_or_device_map, "workload", None) or Workload()
    return evaluator(graph, machine, workload)(plan_or_device_map)


def evaluator(graph: LayerGraph, machine: Any, workload: Workload) -> Callable[[Any], Cost]:
    """:func:`evaluate` for one graph, machine and workload, pricing the options once for many plans.

    Example::

        score = evaluator(graph, machine, Workload())
        costs = [score(device_map) for device_map in candidate_maps]
    """
    machine = as_machine(machine, dtype=graph.meta.dtype)
    problem, parts = _priced(graph, machine, workload, MODES, None, False)

    def score(plan_or_device_map: Any) -> Cost:
        placements = _placements(plan_or_device_map, graph, machine)
        return _cost(problem, parts, _choice(problem, placements), machine, workload)

    return score


def _cost(problem: PlacementProblem, parts: list[list[_Parts]], choice: list[int], machine: Machine,
          workload: Workload) -> Cost:
    score = problem.score(choice)
    chosen = problem.options(choice)
    chosen_parts = [row[c] for row, c in zip(parts, choice, strict=True)]
    units = tuple(
        UnitCost(name=u.name, storage=o.storage, execution=o.execution, mode=o.mode,
                 prefill_s=o.prefill_ns / NS_PER_S, decode_s=o.decode_ns / NS_PER_S,
                 stored_bytes=o.stored_bytes, resident_bytes=o.resident_bytes, peak_bytes=o.peak_bytes)
        for u, o in zip(problem.units, chosen, strict=True))
    memory = tuple(_device_memory(d, chosen_parts) for d in machine.devices)
    for m in memory:  # the split must add up to the one memory model
        assert m.used_bytes == score.used_bytes[m.device], (m, score.used_bytes)
    violations = tuple(_violation(m, workload) for m in memory if m.free_bytes < 0)
    return Cost(
        workload=workload, prefill_s=score.prefill_ns / NS_PER_S, decode_s=score.decode_ns / NS_PER_S,
        transfer_s=_transfer_ns(problem, chosen) / NS_PER_S,
        stage_s={k: v / NS_PER_S for k, v in score.stage_ns.items()},
        units=units, memory=memory, violations=violations)


def _transfer_ns(problem: PlacementProblem, chosen: Sequence[PlacementOption]) -> int:
    index = problem.index()
    total = 0
    for edge in problem.edges:
        pair = (chosen[index[edge.src]].execution, chosen[index[edge.dst]].execution)
        if pair[0] != pair[1]:
            total += edge.prefill_ns.get(pair, 0) + edge.decode_ns.get(pair, 0)
    return total


def _device_memory(device: Device, chosen: Sequence[_Parts]) -> DeviceMemory:
    stored = [p for p in chosen if p.storage == device.name]
    executed = [p for p in chosen if p.execution == device.name]
    peak = max(executed, key=lambda p: p.workspace_bytes + p.stream_buffer_bytes, default=None)
    return DeviceMemory(
        device=device.name, capacity_bytes=device.usable_bytes, reserve_bytes=device.reserve_bytes,
        weights_bytes=sum(p.weights_bytes for p in stored),
        kv_cache_bytes=sum(p.kv_cache_bytes for p in executed),
        workspace_bytes=peak.workspace_bytes if peak else 0,
        stream_buffer_bytes=peak.stream_buffer_bytes if peak else 0,
        other_bytes=sum(p.stored_other_bytes for p in stored) + sum(p.resident_other_bytes for p in executed),
    )


_ADVICE = {
    "gpu": "raise max_memory, add 'cpu'/'disk' to the devices, or reduce the batch or context",
    "cpu": "raise the CPU's max_memory, add 'disk' to the devices, or reduce the batch or context",
    "disk": "free disk space or point the offload folder at a larger disk",
}


def _violation(memory: DeviceMemory, workload: Workload) -> Violation:
    need, has = memory.used_bytes, memory.capacity_bytes
    parts = [("weights", memory.weights_bytes),
             (f"KV cache for batch {workload.batch_size} x {workload.context_len} tokens", memory.kv_cache_bytes),
             (f"activation workspace for {workload.batch_size} x {workload.prompt_len} prompt tokens",
              memory.workspace_bytes),
             ("stream buffer", memory.stream_buffer_bytes),
             ("gradients, optimizer states and saved activations" if workload.training else "other",
              memory.other_bytes)]
    split = ", ".join(f"{label} {format_bytes(n)}" for label, n in parts if n > 0)
    kind = "gpu" if memory.device.startswith("cuda:") else memory.device
    message = (f"{memory.device} needs {format_bytes(need)}, has {format_bytes(has)} "
               f"({format_bytes(need - has)} short): {split}: {_ADVICE[kind]}")
    return Violation(device=memory.device, needed_bytes=need, capacity_bytes=has, message=message)
