"""What every price reads (graph, machine, workload, calibration), and the host's time per unit.

The host runs each unit's forward beside its kernels: the unit's traced op count x the host's seconds per op
on that device (a profile's ``op_overhead_s``, else :data:`OP_OVERHEAD_S`), or :data:`UNIT_OVERHEAD_S` for a
unit whose ops were not counted. On a CPU that time adds to the kernels' (:mod:`.kernels`). On a GPU, whose
kernels run while the host queues the next, a decoder layer (a sublayer graph's block, a module graph's layer:
``UnitInfo.host_span``) takes the longer of the ops' time and its kernels' instead of their sum
(:meth:`PricingContext.host_s`), shared among the layer's parts by their ops.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model.expert_groups import group_counts, group_ranges, whole_experts
from .kernels import (
    decode_roofline_lines,
    growing_steps,
    measured_decode_line,
    measured_prefill_s,
    prefill_roofline_s,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware.devices import Device, Machine
    from ..model.graph import LayerGraph, UnitInfo
    from .calibrated import Calibration
    from .workload import Workload

__all__ = ["PricingContext", "home_device", "op_overhead_s", "UNIT_OVERHEAD_S", "OP_OVERHEAD_S"]

#: Fixed cost of running one unit once (Python hooks, kernel launches, small ops), for units whose ops the trace
#: did not count (graphs saved before the count, static fallback graphs, hand-made units).
UNIT_OVERHEAD_S = {"gpu": 60e-6, "cpu": 150e-6, "disk": 0.0}
#: Host seconds per torch op of a forward (the dispatch and the Python around it) on a device whose profile did
#: not measure it. CPU: measured on this project's 2-core VM (torch 2.13, transformers 5.24), a decoder layer's
#: decode step at hidden 64 took 3.4-6.2 us per dispatched op (Llama, Mixtral, Qwen2-MoE, GPT-2; eager and
#: sdpa). GPU: the same host work plus a kernel launch, a rule of thumb not yet measured here.
OP_OVERHEAD_S = {"gpu": 8e-6, "cpu": 5e-6, "disk": 0.0}


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
        bounds, an MLP the kernels bound) above the same layer whole. It is taken over the unit's span instead
        (``UnitInfo.host_span``: a sublayer graph's block, a module graph's layer; a unit outside every span is its
        own), as if all its parts ran on one GPU, and shared among the parts by their ops: the parts of a layer on
        one GPU then cost what the layer costs whole.

        A part's share is the largest any GPU of the machine leaves (the fastest one's, whose kernels hide the
        least): the host queues a part's ops whichever GPU runs them, and a share that shrank on a slower GPU
        would price a layer split across two GPUs below the same layer on the faster one. The solver took that
        discount: Mistral-7B's modules on an RTX 4090 + RTX 3090 had three modules of every layer sent to the 3090
        for 0.3 %, a plan that copies activations between the GPUs 64 times a token. A whole layer on a slower
        GPU is priced up to the difference of its kernels' times on the two above what it takes (6 % on the 3090).
        """
        span = unit.host_span
        gpus = self.machine.gpus if span is not None and len(self.machine.gpus) > 1 else (device,)
        exposed, ops = max(self._span_exposed(unit, gpu, phase) for gpu in gpus)
        return exposed * (unit.ops_per_forward or 0) / ops if ops else 0.0

    def _span_exposed(self, unit: UnitInfo, device: Device, phase: str) -> tuple[float, int]:
        """(the host's time over ``unit``'s span that its kernels on ``device`` leave exposed, the span's ops)."""
        span = unit.host_span
        key = (span or unit.name, device.name, phase)
        cache = self._exposed
        if key not in cache:
            members = self.span_members.get(span, [unit]) if span is not None else [unit]
            host = sum(self.overhead_s(m, device) for m in members)
            kernels = sum(self._kernel_s(m, device, phase) for m in members)
            ops = sum(m.ops_per_forward or 0 for m in members)
            cache[key] = (max(0.0, host - kernels), ops)
        return cache[key]

    def _kernel_s(self, unit: UnitInfo, device: Device, phase: str) -> float:
        """One forward (prefill) or middle decode step of ``unit`` on ``device`` without host time, or as measured."""
        if phase == "prefill":
            measured = measured_prefill_s(self, unit, device)
            return measured if measured is not None else prefill_roofline_s(self, unit, device)
        line = measured_decode_line(self, unit, device)
        lines = [line] if line is not None else decode_roofline_lines(self, unit, device)
        middle = _mean_step(self.workload.decode_steps, growing_steps(unit, self.workload))
        return max(a + b * middle for a, b in lines)

    @functools.cached_property
    def _exposed(self) -> dict[tuple[str, str, str], tuple[float, int]]:
        return {}

    @functools.cached_property
    def span_members(self) -> dict[str, list[UnitInfo]]:
        """Span (``UnitInfo.host_span``) -> its units in execution order: whose times :meth:`exposed_s` shares."""
        members: dict[str, list[UnitInfo]] = collections.defaultdict(list)
        for u in self.graph.units():
            if u.host_span is not None:
                members[u.host_span].append(u)
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

    def routed_experts(self, unit: UnitInfo) -> int:
        """How many of its layer's routed experts ``unit`` holds: an expert group its rows
        (:func:`~placement_opt.model.expert_groups.group_ranges`), any other unit all of ``moe_num_experts``."""
        parsed = whole_experts(unit.name)
        groups = self._groups.get(unit.name)
        if parsed is None or groups is None or not 0 < groups <= unit.moe_num_experts:
            return unit.moe_num_experts  # not a group, or a hand-made name no trace cuts: the whole layer's
        start, end = group_ranges(unit.moe_num_experts, groups)[parsed[1]]
        return end - start

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


def _mean_step(steps: int, growing: int | None) -> float:
    """The mean over a decode's steps ``t = 0 .. steps - 1`` of ``min(t, growing)`` (None: never capped): the
    step whose kernels stand for every step's when the host's time is set against them.

    The mean, not the middle step: the decode sums the steps' kernels (:func:`~.kernels.sum_capped_lines`), so
    where the host's time is longer, kernels plus exposed host time are the host's time whatever the kernels. The
    middle step ``steps // 2`` lay past the mean, and a bigger batch (steeper kernel growth) decoded cheaper. A
    sliding layer's steps stop growing at its window (``growing``)."""
    if steps <= 1:
        return 0.0
    cap = steps - 1 if growing is None else max(0, min(growing, steps - 1))
    return (cap * (cap + 1) / 2 + (steps - 1 - cap) * cap) / steps
