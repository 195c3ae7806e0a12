"""``evaluate()``: the price of any placement (a Plan or an accelerate ``device_map``) as a :class:`Cost`.

Totals come from the same ``PlacementProblem.score`` the solvers minimise; the per-unit and
per-device breakdowns and the violations come from :mod:`.pricing` and :mod:`.memory`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ..errors import PlanFormatError, PlanMismatchError, WorkloadError
from ..hardware.devices import Machine
from ..hardware.resolve import as_machine
from ..solver.edges import prune_edges
from ..solver.problem import (
    MODES,
    PHASES,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    device_transients,
    objective_value,
)
from ..units import few
from .build import price_problem
from .device_map import placements_of
from .memory import DeviceMemory, Violation, device_memory
from .pricing import NS_PER_S, OptionPrice
from .shortage import violation
from .workload import Workload

if TYPE_CHECKING:  # pragma: no cover
    from ..model.graph import LayerGraph

__all__ = ["UnitCost", "Cost", "evaluate", "evaluator", "as_graph", "predicted_memory"]


@dataclass(frozen=True, kw_only=True)
class UnitCost:
    """Where one unit sits and what it costs there."""

    name: str
    storage: str
    execution: str
    mode: str
    prefill_s: float
    """Time in the prefill: compute, and weight copies unless the prefetch thread makes them (``copy_s``)."""
    prefill_execution: str | None = None
    """``phased`` only: where the unit computes in the prefill (``execution``: in the decode)."""
    prefill_peak_bytes: int = 0
    """``phased`` only: transient bytes on ``prefill_execution`` during the prefill."""
    decode_s: float
    """Time summed over every decode step."""
    stored_bytes: int
    resident_bytes: int
    peak_bytes: int
    copy_prefill_s: float = 0.0
    """The prefetch thread's copy of the weights in the prefill (``stream`` to a GPU; a ``phased`` unit):
    beside the compute of the units before it, not in ``prefill_s``."""
    copy_decode_s: float = 0.0
    """The prefetch thread's copies over every decode step (``stream`` to a GPU), not in ``decode_s``."""
    wait_prefill_s: float = 0.0
    """How long the unit waits for its copy in the prefill: what compute before it did not hide
    (``solver.problem``'s Overlap); part of the phase's latency, beside ``prefill_s``."""
    wait_decode_s: float = 0.0
    """As ``wait_prefill_s``, over every decode step."""
    host_prefill_s: float = 0.0
    """Host memory's time for the unit's traffic in the prefill (its CPU reads, its copy out of RAM): the
    phase lasts at least the sum over units, as the cores and the copies share host memory."""
    host_decode_s: float = 0.0
    """As ``host_prefill_s``, over every decode step."""
    disk_prefill_s: float = 0.0
    """The disk's time reading the unit's weights in the prefill (stored on disk): the phase lasts at least
    the sum over units, as every read shares the one disk."""
    disk_decode_s: float = 0.0
    """As ``disk_prefill_s``, over every decode step."""

    @property
    def copy_s(self) -> float:
        return self.copy_prefill_s + self.copy_decode_s

    @property
    def wait_s(self) -> float:
        return self.wait_prefill_s + self.wait_decode_s


@dataclass(frozen=True, kw_only=True)
class Cost:
    """The price of a placement: time per phase, memory per device, every capacity violation."""

    workload: Workload
    prefill_s: float
    decode_s: float
    transfer_s: float
    """Activation transfers between devices, included in the phase times: the edges' (those no other
    path between their ends always outlasts, :func:`~..solver.edges.prune_edges`), and in a sublayer
    graph each off-home unit's round trip (its inputs from home and its outputs back). Leaving out the
    covered edges keeps a module graph's residual stream (an edge from every earlier projection to
    each norm) from counting once per reader; it also leaves out the copies of a small tensor passed
    to many units (rotary's cos and sin, a few KiB per token), which hooks do make once per unit."""
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
    def copy_s(self) -> float:
        """The prefetch thread's weight copies over the workload (beside the compute)."""
        return sum(u.copy_s for u in self.units)

    @property
    def wait_s(self) -> float:
        """Of the phase times: the waits for weight copies that compute did not hide."""
        return sum(u.wait_s for u in self.units)

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens per second over the decode phase (all sequences of the batch)."""
        tokens = self.workload.batch_size * self.workload.new_tokens
        return tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second, prefill included (what a user waits for); for a training workload, which
        generates nothing, the tokens a step trains on (batch x prompt)."""
        wl = self.workload
        tokens = wl.batch_size * (wl.prompt_len if wl.training else max(wl.new_tokens, 1))
        return tokens / self.total_s if self.total_s > 0 else 0.0

    def objective_value(self, objective: str, gpus: Iterable[str]) -> float:
        """``objective``'s value by the solver's one definition: seconds, or bytes on ``gpus`` for memory."""
        return float(objective_value(objective, latency=self.total_s, stage=self.stage_s,
                                     used_bytes={m.device: m.used_bytes for m in self.memory}, gpus=gpus))

    def device_memory(self, device: str) -> DeviceMemory:
        return next(m for m in self.memory if m.device == device)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stage_s"] = dict(self.stage_s)
        for unit in data["units"]:  # written only where set: plans without phased units read as before
            if unit["prefill_execution"] is None:
                del unit["prefill_execution"], unit["prefill_peak_bytes"]
            for key in ("copy_prefill_s", "copy_decode_s", "wait_prefill_s", "wait_decode_s", "host_prefill_s",
                        "host_decode_s", "disk_prefill_s", "disk_decode_s"):
                if not unit[key]:
                    del unit[key]
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


def as_graph(model_or_graph: Any, granularity: str | None = None, expert_groups: int = 1) -> LayerGraph:
    """A LayerGraph as it is; anything else :func:`placement_opt.trace` accepts is traced (imports torch),
    at ``granularity`` (default ``"block"``), its experts in ``expert_groups``."""
    from ..model.graph import LayerGraph

    if isinstance(model_or_graph, LayerGraph):
        return model_or_graph
    from ..model.tracer import trace  # lazy: tracing imports torch

    return trace(model_or_graph, granularity=granularity or "block", expert_groups=expert_groups)


def _choice(problem: PlacementProblem, placements: Mapping[str, tuple[str, str, str, str | None]]) -> list[int]:
    choice = []
    for unit in problem.units:
        wanted = placements[unit.name]
        keys = [(o.storage, o.execution, o.mode, o.prefill_execution) for o in unit.options]
        if wanted not in keys:
            prefill = f", prefill_execution={wanted[3]}" if wanted[3] else ""
            raise PlanFormatError(f"unit {unit.name} is placed as storage={wanted[0]}, execution={wanted[1]}, "
                             f"mode={wanted[2]}{prefill}, which the cost model does not offer on this machine "
                             f"and workload; offered: {', '.join('/'.join(filter(None, k)) for k in keys)}")
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
        PlanFormatError: a unit without an entry, a device the machine lacks, or a placement the cost
            model does not offer; the message lists what is accepted.
        PlanMismatchError: a plan whose units differ in size from ``model_or_graph``'s (solved for another model).
    """
    if workload is not None and not isinstance(workload, Workload):
        raise WorkloadError(f"workload must be a placement_opt.Workload, got {type(workload).__name__}: "
                            f"e.g. Workload(batch_size=4, prompt_len=512, new_tokens=128)")
    graph = as_graph(model_or_graph)
    _check_fingerprint(plan_or_device_map, graph)
    if workload is None:
        workload = getattr(plan_or_device_map, "workload", None) or Workload()
    return evaluator(graph, machine, workload)(plan_or_device_map)


def _check_fingerprint(plan: Any, graph: LayerGraph) -> None:
    """A plan solved for another model (units of the same names, other sizes) priced on ``graph`` gave that model's
    figures under this plan's name: refused, as dispatch() refuses it."""
    from ..model.fingerprint import fingerprint_differences, graph_fingerprint

    expected = getattr(plan, "fingerprint", None)
    if expected is None:  # a device_map, or a plan written before fingerprints
        return
    differ = fingerprint_differences(expected, graph_fingerprint(graph), [set(g) for g in graph.meta.tied_unit_groups])
    if differ:
        raise PlanMismatchError(f"plan for {plan.model_name!r} was solved for another model than this graph's "
                                f"({graph.meta.model_name!r}): {len(differ)} unit(s) differ ({few(differ)}); price it on "
                                f"the graph of the model it was solved for, or solve a plan for this one")


def predicted_memory(plan_or_device_map: Any, model_or_graph: Any, machine: Any,
                     workload: Workload | None = None) -> dict[str, DeviceMemory]:
    """The predicted peak memory of every device under a placement, split by term: device name ->
    :class:`~.memory.DeviceMemory` (weights, KV cache, workspace, stream buffer, other; ``used_bytes`` is
    the peak, ``peak_unit`` the unit whose workspace sets it). Arguments as for :func:`evaluate`.

    Example::

        cpu = predicted_memory(plan, graph, machine)["cpu"]
        activations = cpu.used_bytes - cpu.weights_bytes   # what a forward adds once weights are loaded
    """
    return {m.device: m for m in evaluate(plan_or_device_map, model_or_graph, machine, workload).memory}


def evaluator(graph: LayerGraph, machine: Any, workload: Workload) -> Callable[[Any], Cost]:
    """:func:`evaluate` for one graph, machine and workload, pricing the options once for many plans.

    Example::

        score = evaluator(graph, machine, Workload())
        costs = [score(device_map) for device_map in candidate_maps]
    """
    machine = as_machine(machine, dtype=graph.meta.dtype)
    problem, parts = price_problem(graph, machine, workload, MODES, None, False)
    return priced_evaluator(graph, machine, workload, problem, parts)


def priced_evaluator(graph: LayerGraph, machine: Machine, workload: Workload, problem: PlacementProblem,
                     parts: list[list[OptionPrice]], kept_edges: tuple[EdgeSpec, ...] | None = None
                     ) -> Callable[[Any], Cost]:
    """:func:`evaluator` on options already priced by :func:`~.build.price_problem` with every mode
    (:data:`MODES`): solve() prices once for both the solver and the scores.

    ``kept_edges``: ``problem``'s edges less the covered ones (:func:`~..solver.edges.prune_edges` of
    ``problem``), which ``Cost.transfer_s`` sums; found here when not given.
    """
    kept = prune_edges(problem).edges if kept_edges is None else kept_edges

    def score(plan_or_device_map: Any) -> Cost:
        placements = placements_of(plan_or_device_map, graph, machine)
        return _cost(problem, parts, _choice(problem, placements), machine, workload, kept)

    return score


def _cost(problem: PlacementProblem, parts: list[list[OptionPrice]], choice: list[int], machine: Machine,
          workload: Workload, kept_edges: tuple[EdgeSpec, ...]) -> Cost:
    score = problem.score(choice)
    chosen = problem.options(choice)
    chosen_parts = [row[c] for row, c in zip(parts, choice, strict=True)]
    waits = zip(*(problem.waits(chosen, ph) or [0] * len(chosen) for ph in PHASES), strict=True)
    units = tuple(
        UnitCost(name=u.name, storage=o.storage, execution=o.execution, mode=o.mode,
                 prefill_execution=o.prefill_execution, prefill_peak_bytes=o.prefill_peak_bytes,
                 prefill_s=o.prefill_ns / NS_PER_S, decode_s=o.decode_ns / NS_PER_S,
                 stored_bytes=o.stored_bytes, resident_bytes=o.resident_bytes, peak_bytes=o.peak_bytes,
                 copy_prefill_s=o.copy_prefill_ns / NS_PER_S, copy_decode_s=o.copy_decode_ns / NS_PER_S,
                 wait_prefill_s=wait_prefill / NS_PER_S, wait_decode_s=wait_decode / NS_PER_S,
                 host_prefill_s=o.host_prefill_ns / NS_PER_S, host_decode_s=o.host_decode_ns / NS_PER_S,
                 disk_prefill_s=o.disk_prefill_ns / NS_PER_S, disk_decode_s=o.disk_decode_ns / NS_PER_S)
        for u, o, (wait_prefill, wait_decode) in zip(problem.units, chosen, waits, strict=True))
    names = [u.name for u in problem.units]
    peaks = device_transients(chosen, problem.runs) if problem.group_copies else {}
    memory = tuple(device_memory(d, chosen_parts, names, peaks.get(d.name)) for d in machine.devices)
    for m in memory:  # the split must add up to the one memory model
        assert m.used_bytes == score.used_bytes[m.device], (m, score.used_bytes)
    violations = tuple(violation(m, workload, machine.names) for m in memory if m.free_bytes < 0)
    return Cost(
        workload=workload, prefill_s=score.prefill_ns / NS_PER_S, decode_s=score.decode_ns / NS_PER_S,
        transfer_s=_transfer_ns(problem, chosen, kept_edges) / NS_PER_S + sum(p.round_trip_s for p in chosen_parts),
        stage_s={k: v / NS_PER_S for k, v in score.stage_ns.items()},
        units=units, memory=memory, violations=violations)


def _transfer_ns(problem: PlacementProblem, chosen: Sequence[PlacementOption], edges: Sequence[EdgeSpec]) -> int:
    """What ``edges`` (the kept ones, :attr:`Cost.transfer_s` says why) move between devices."""
    index = problem.index()
    total = 0
    for edge in edges:
        src, dst = chosen[index[edge.src]], chosen[index[edge.dst]]
        for phase in PHASES:
            pair = (src.device_in(phase), dst.device_in(phase))
            if pair[0] != pair[1]:
                total += getattr(edge, phase).get(pair, 0)
    return total
