"""Pipeline plans: contiguous stages of a model over the ranks of a :class:`~..hardware.cluster.Cluster`.

:func:`plan_pipeline` prices every unit on every rank's device with the cost model
(:func:`placement_opt.cost.pricing.price_option`, the unit resident where it computes), adds the
activation transfer over the link to the next rank (the network between hosts, NVLink/PCIe or
shared memory within one) and the memory of the schedule's micro-batches in flight, and cuts the
chain with the exact dynamic program of :mod:`placement_opt.solver.stages`: stage ``k`` on rank
``k``, the slowest stage as small as it can be. The bound equals the value (gap 0): the program is
exact for this cost model.

What a stage holds, per micro-batch of ``workload.batch_size x workload.prompt_len`` tokens:

* weights; training adds gradients, optimizer states (:func:`~..cost.workload.unit_training_bytes`)
  and the activations saved for the backward times the micro-batches in flight: all
  ``n_microbatches`` under GPipe, ``min(n_stages - k, n_microbatches)`` on stage ``k`` under 1F1B;
* the activations crossing its cuts, which ``torch.distributed.pipelining`` keeps for every micro-batch whatever the
  schedule: a receive buffer each; training, a gradient receive buffer each and the outputs awaiting their backward
  (the count in flight); forward only, every output, kept until the next step;
* the largest unit's workspace;
* on the last stage, the outputs (logits) of all ``n_microbatches``, which ``step()`` keeps and returns merged
  (``torch.cat``: twice their size).

Stage time per micro-batch: the units' forward (training: forward + backward, x3) plus the send
of the crossing activations (training: the gradients back too). Units without parameters (rotary
tables) are recomputed by every stage that needs them, so their outputs never cross a cut.
Generation is not pipelined here (``torch.distributed.pipelining`` has no KV cache): decode steps
of the workload are not priced.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any

from .._files import loads_json
from ..cost.pricing import PricingContext, price_option
from ..cost.workload import Workload
from ..errors import DeviceSpecError, InfeasiblePlacementError, PlanFormatError, SolverInputError
from ..hardware.cluster import Cluster, Rank
from ..hardware.devices import Machine
from ..hardware.resolve import reserve_note
from ..model.graph import LayerGraph
from ..solver.stages import (
    StageProblem,
    StageSolution,
    solve_stages,
    stage_memory_bytes,
    stage_time_ns,
)
from ..units import format_bytes, format_seconds

__all__ = ["PipelinePlan", "StagePlan", "plan_pipeline", "SCHEDULES", "layer_count_cuts", "PIPELINE_PLAN_VERSION",
           "stage_problem", "crossing_bytes_per_token", "MAX_MICROBATCHES"]

#: Schedules a plan can be made for: ``torch.distributed.pipelining``'s ScheduleGPipe and Schedule1F1B.
SCHEDULES = ("gpipe", "1f1b")
PIPELINE_PLAN_VERSION = 1
#: Micro-batches a step may have: more are no step anyone runs (10**400 overflowed the byte counts' floats).
MAX_MICROBATCHES = 65536
_NS = 1e9
_LOCAL_DEVICE_RE = re.compile(r"^(cpu|cuda:\d+)( .*)?$")


@dataclass(frozen=True)
class StagePlan:
    """One stage: its units, where it runs, and what the cost model predicts for it."""

    stage: int
    rank: int
    host: int
    local_rank: int
    device: str
    """The rank's device on its host (``cuda:N`` or ``cpu``) and its class, e.g. ``cuda:3 (h100-sxm)``."""
    units: tuple[str, ...]
    compute_s: float
    """Per micro-batch: the units' forward (training: forward and backward)."""
    send_s: float
    """Per micro-batch: activations to the next stage (training: and gradients back)."""
    memory_bytes: int
    capacity_bytes: int

    @property
    def predicted_s(self) -> float:
        return self.compute_s + self.send_s

    @property
    def local_device(self) -> str:
        """``cuda:<local GPU>`` or ``cpu``: the device to run the stage on, on its host."""
        return self.device.split(" ")[0]


@dataclass(frozen=True)
class PipelinePlan:
    """Stages of a model over a cluster, with the predicted time of each and of the whole step."""

    model_name: str
    schedule: str
    n_microbatches: int
    workload: Workload
    """One micro-batch: ``batch_size`` sequences of ``prompt_len`` tokens; ``training`` for steps."""
    stages: tuple[StagePlan, ...]
    bound_s: float
    """Lower bound on the slowest stage; equal to it, since the stage program is exact."""
    layer_count_s: float | None
    """The slowest stage of the layer-count split (equal decoder layers per rank), None when it does not fit."""
    cluster_spec: str = ""
    status: str = "OPTIMAL"

    @property
    def objective_s(self) -> float:
        """The slowest stage: one micro-batch leaves the pipeline this often in steady state."""
        return max(s.predicted_s for s in self.stages)

    @property
    def gap(self) -> float:
        return 0.0 if self.objective_s <= 0 else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)

    @property
    def step_s(self) -> float:
        """One step of ``n_microbatches``: fill and drain the pipeline, ``(M + S - 1)`` slowest stages."""
        return (self.n_microbatches + len(self.stages) - 1) * self.objective_s

    @property
    def unit_ranges(self) -> list[tuple[str, ...]]:
        return [s.units for s in self.stages]

    def stage_of_rank(self, rank: int) -> StagePlan:
        for stage in self.stages:
            if stage.rank == rank:
                return stage
        raise SolverInputError(f"rank {rank} has no stage in this plan (ranks 0 to {len(self.stages) - 1}): "
                               f"launch as many processes as the plan has stages")

    def summary(self) -> str:
        """Stages per host and rank, as ``placement-opt plan --cluster`` prints them."""
        kind = "training step" if self.workload.training else "forward"
        lines = [f"pipeline of {self.model_name}: {_count(len(self.stages), 'stage')}, {self.schedule}, "
                 f"{_count(self.n_microbatches, 'micro-batch', 'micro-batches')} of {self.workload.batch_size} x "
                 f"{self.workload.prompt_len} "
                 f"tokens ({kind})",
                 f"slowest stage {format_seconds(self.objective_s)} per micro-batch (bound "
                 f"{format_seconds(self.bound_s)}, gap {self.gap:.1%}, {self.status}); step "
                 f"{format_seconds(self.step_s)}, {1 / self.step_s if self.step_s else math.inf:.3g} steps/s"]
        if self.layer_count_s is not None:
            # a plan read back may say 0 s for every stage: it divided by zero
            ratio = f" ({self.layer_count_s / self.objective_s:.2f}x this plan's)" if self.objective_s > 0 else ""
            lines.append(f"layer-count split: slowest stage {format_seconds(self.layer_count_s)}{ratio}")
        else:
            lines.append("layer-count split: does not fit the ranks' memory")
        for s in self.stages:
            first, last = s.units[0], s.units[-1]
            span = first if first == last else f"{first} .. {last} ({len(s.units)} units)"
            lines.append(f"  host {s.host} rank {s.rank} ({s.device}): {span}; {format_seconds(s.compute_s)} "
                         f"+ send {format_seconds(s.send_s)}; {format_bytes(s.memory_bytes)} of "
                         f"{format_bytes(s.capacity_bytes)}")
        return "\n".join(lines)

    # -- JSON -----------------------------------------------------------------------------
    def to_json(self) -> str:
        data = asdict(self)
        data["version"] = PIPELINE_PLAN_VERSION
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        try:
            data = loads_json(text)
            if data.pop("version") != PIPELINE_PLAN_VERSION:
                raise ValueError(f"version is not {PIPELINE_PLAN_VERSION}")
            stages = tuple(StagePlan(**{**s, "units": _units(s["units"])}) for s in data.pop("stages"))
            plan = cls(**{**data, "workload": Workload.from_dict(data["workload"]), "stages": stages})
            _check_read(plan)
            return plan
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise PlanFormatError(f"not a pipeline plan ({err}): write it with PipelinePlan.to_json() of this "
                                  f"version ({PIPELINE_PLAN_VERSION})") from None


def _units(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, list):  # tuple("embed") is ('e', 'm', ...): five units no model has
        raise ValueError(f"a stage's units are a list of module names, not {type(value).__name__}")
    return tuple(value)


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _check_read(plan: PipelinePlan) -> None:
    """What a pipeline plan read back must hold, as plan_pipeline() writes it (a ValueError says which): a file
    edited by hand ran a schedule pipeline() does not have as 1F1B, or broke summary() with an IndexError."""
    if plan.schedule not in SCHEDULES:
        raise ValueError(f"schedule {plan.schedule!r} is none of {', '.join(SCHEDULES)}")
    micro = plan.n_microbatches
    if not _index(micro) or not 1 <= micro <= MAX_MICROBATCHES:
        raise ValueError(f"n_microbatches is {micro!r}, not an int from 1 to {MAX_MICROBATCHES}")
    if plan.workload.padded:  # plan_pipeline() refuses it: pipeline() builds a causal mask only
        raise ValueError("the workload is padded: a pipeline runs unpadded micro-batches (padded false)")
    if not plan.stages or any(not s.units for s in plan.stages):
        raise ValueError("a plan has one stage or more, each with one unit or more")
    if [s.stage for s in plan.stages] != list(range(len(plan.stages))) or not all(_index(s.stage) for s in plan.stages):
        raise ValueError(f"stages are numbered {[s.stage for s in plan.stages]}, not 0 to {len(plan.stages) - 1}")
    # pipeline() finds its stage by rank and torch sends stage k's output to rank k + 1: another rank was refused as
    # "rank 1 has no stage", a device that is no string raised an AttributeError
    for s in plan.stages:
        if s.rank != s.stage or not all(_index(v) for v in (s.rank, s.host, s.local_rank)):
            raise ValueError(f"stage {s.stage} runs on rank {s.rank!r}, host {s.host!r}, local rank {s.local_rank!r}: "
                             f"stage k runs on rank k, and each is an int >= 0")
        if not isinstance(s.device, str) or not _LOCAL_DEVICE_RE.match(s.device):
            raise ValueError(f"stage {s.stage}'s device is {s.device!r}, not 'cuda:N (preset)' or 'cpu (preset)'")
    units = [u for s in plan.stages for u in s.units]
    if len(set(units)) < len(units):
        raise ValueError(f"unit(s) {sorted({u for u in units if units.count(u) > 1})[:3]} are in more than one place")
    times = [t for s in plan.stages for t in (s.compute_s, s.send_s)]
    if not all(_seconds(t) for t in times) or not math.isfinite(plan.step_s):  # 1e308 x micro-batches: inf
        raise ValueError("a stage's compute_s and send_s are finite seconds >= 0, and so is a step of them")
    texts = {"model_name": plan.model_name, "status": plan.status, "cluster_spec": plan.cluster_spec}
    if not all(isinstance(v, str) for v in texts.values()):  # summary() printed a number or null as the name
        raise ValueError(f"{', '.join(k for k, v in texts.items() if not isinstance(v, str))} must be text")
    # summary() compared and divided these: text or null there raised a TypeError, not this error
    if not _seconds(plan.bound_s) or not (plan.layer_count_s is None or _seconds(plan.layer_count_s)):
        raise ValueError("bound_s is finite seconds >= 0, and layer_count_s too or null")
    sizes = [b for s in plan.stages for b in (s.memory_bytes, s.capacity_bytes)]
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in sizes):
        raise ValueError("a stage's memory_bytes and capacity_bytes are ints >= 0")
    if not all(isinstance(u, str) for u in units):  # a string of units was read as its letters, one unit each
        raise ValueError("a stage's units are a list of module names")


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _seconds(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------
def plan_pipeline(model: Any, cluster: Cluster | str, workload: Workload | None = None, *,
                  schedule: str = "1f1b", n_microbatches: int | None = None) -> PipelinePlan:
    """Cut ``model`` into one contiguous stage per rank of ``cluster``, the slowest stage least.

    Example::

        plan = plan_pipeline("llama-2-70b", "2x(h100-sxm*4,cpu-server)@ib-200g",
                             Workload(batch_size=1, prompt_len=4096, training=True), n_microbatches=16)
        print(plan.summary())

    Args:
        model: a ``LayerGraph`` or anything :func:`placement_opt.trace` accepts.
        cluster: a :class:`Cluster` or its spec string (read in the model's dtype, as ``plan --cluster`` does).
        workload: ONE micro-batch (``batch_size`` sequences of ``prompt_len`` tokens); ``training``
            prices forward + backward and the training states. Default ``Workload(new_tokens=0)``. Its
            ``new_tokens`` and ``logits`` are dropped: a pipeline runs whole sequences, logits at every position.
        schedule: ``"gpipe"`` (all micro-batches in flight) or ``"1f1b"`` (at most one per later stage).
        n_microbatches: micro-batches per step; default the number of stages.

    Raises:
        SolverInputError: unknown schedule, fewer units than ranks, ``n_microbatches`` not 1 to
            :data:`MAX_MICROBATCHES`, a padded workload.
        InfeasiblePlacementError: no split fits every rank's memory (says which and by how much).
        DeviceSpecError: a :class:`Cluster` read for another dtype than the model's (``Cluster.dtype``).
    """
    spec = cluster if isinstance(cluster, str) else None
    cluster = Cluster.from_spec(cluster) if spec is not None else cluster  # a bad spec is said before tracing
    if not isinstance(cluster, Cluster):
        raise SolverInputError(f"cluster is a {type(cluster).__name__}: pass a Cluster or its spec string, e.g. "
                               f"'2x(h100-sxm*8,cpu-server)@ib-200g' (one machine's devices go to solve())")
    if workload is not None and not isinstance(workload, Workload):  # dataclasses.replace raised a TypeError
        raise SolverInputError(f"workload must be a placement_opt.Workload, got {type(workload).__name__}: e.g. "
                               f"Workload(batch_size=1, prompt_len=2048), one micro-batch")
    if workload is not None and workload.padded:  # pipeline() builds a causal mask only: no padding rows
        raise SolverInputError("Workload(padded=True) is priced on one machine's plan: pipeline() runs unpadded "
                               "micro-batches (a causal mask only); plan with padded=False")
    graph = _graph(model)
    if spec is not None:  # read at float16, a float32 model was priced at its GPUs' half-precision rate (16x fast)
        cluster = Cluster.from_spec(spec, dtype=graph.meta.dtype)
    elif not cluster.priced_for(graph.meta.dtype):
        raise DeviceSpecError(
            f"the cluster's devices were read for {cluster.dtype} and the model is {graph.meta.dtype}: its GPUs "
            f"would be priced at {cluster.dtype}'s rates (tensor cores run float16 up to 16x faster than float32); "
            f"build it with Cluster.from_spec(spec, dtype={graph.meta.dtype!r}), or pass the spec string")
    ranks = cluster.ranks
    micro = n_microbatches if n_microbatches is not None else len(ranks)
    _check(schedule, micro, graph, len(ranks))
    # whole-sequence forwards: the last stage computes the logits of every position, whatever a generation
    # workload kept (logits="last" priced the head for one token a sequence: 1.8 GiB short on llama-3-8b)
    workload = replace(workload or Workload(), new_tokens=0, logits=None)
    problem = stage_problem(graph, cluster, workload, schedule, micro)
    try:
        _check_outputs_fit(problem, ranks[-1], micro)
        solution = solve_stages(problem)
    except InfeasiblePlacementError as exc:
        said = _reserve_said(cluster)
        if said is None:
            raise
        raise InfeasiblePlacementError(f"{exc}; {said}") from None
    names = graph.names()
    stages = tuple(_stage_plan(problem, solution, k, rank, names) for k, rank in enumerate(ranks))
    if workload.training:
        _check_tied_training(graph, stages)
    even = layer_count_cuts(graph, len(ranks))
    return PipelinePlan(model_name=graph.meta.model_name, schedule=schedule, n_microbatches=micro,
                        workload=workload, stages=stages, bound_s=solution.objective_ns / _NS,
                        layer_count_s=_cuts_time(problem, even), cluster_spec=_spec_or_blank(cluster))


def _reserve_said(cluster: Cluster) -> str | None:
    """Why a rank shows 0 B usable, when its GPU's reserve takes all of it ('(a10=0.5GiB)' under the default
    1 GiB): the hosts' reserve notes, one per distinct text."""
    said: dict[str, list[int]] = {}
    for h, host in enumerate(cluster.hosts):
        if (note := reserve_note(host.machine)) is not None:
            said.setdefault(note, []).append(h)
    if not said:
        return None
    return "; ".join(f"host{'s' if len(hs) > 1 else ''} {', '.join(map(str, hs))}: {note}" for note, hs in said.items())


def _check_tied_training(graph: LayerGraph, stages: tuple[StagePlan, ...]) -> None:
    """pipeline() refuses to train weights tied across stages (their gradients would not be summed across ranks):
    say so when planning, not when the run starts."""
    where = {u: s.stage for s in stages for u in s.units}
    split = [g for g in graph.meta.tied_unit_groups if len({where.get(u) for u in g}) > 1]
    if split:
        raise SolverInputError(f"{graph.meta.model_name} ties weights between stages ({' and '.join(split[0])}), "
                               f"and pipeline() cannot train those (their gradients would not be summed across "
                               f"ranks): untie them (tie_word_embeddings=False) to train, or plan the forward only")


def _graph(model: Any) -> LayerGraph:
    from ..cost.evaluate import as_graph

    return as_graph(model)


def _check(schedule: str, micro: int, graph: LayerGraph, n_ranks: int) -> None:
    if schedule not in SCHEDULES:
        raise SolverInputError(f"schedule {schedule!r} is unknown: accepted are {', '.join(SCHEDULES)}")
    if not isinstance(micro, int) or isinstance(micro, bool) or not 1 <= micro <= MAX_MICROBATCHES:
        raise SolverInputError(f"n_microbatches is {micro!r}: it must be an int from 1 to {MAX_MICROBATCHES} "
                               f"(default: one per stage)")
    if schedule == "1f1b" and micro < n_ranks:
        raise SolverInputError(f"Schedule1F1B needs at least one micro-batch per stage: n_microbatches is {micro} "
                               f"for {n_ranks} stages; use n_microbatches >= {n_ranks} or schedule='gpipe'")
    if len(graph) < n_ranks:
        raise SolverInputError(f"{graph.meta.model_name} has {len(graph)} units but the cluster has {n_ranks} ranks: "
                               f"every stage needs one unit; use at most {len(graph)} ranks")


def _in_flight(schedule: str, micro: int, n_stages: int, k: int) -> int:
    return micro if schedule == "gpipe" else min(n_stages - k, micro)


def crossing_bytes_per_token(graph: LayerGraph) -> list[int]:
    """Bytes per token that cross cut ``j`` (between units ``j - 1`` and ``j``), ``j = 0 .. n``.

    Outputs of units without parameters (rotary tables: buffers only) are recomputed by each stage. A tied unit
    counts no bytes of its own but has weights (t5-11b's decoder embedding, tied to the encoder's): its output
    crosses a cut like any other.
    """
    names = graph.names()
    index = {n: i for i, n in enumerate(names)}
    tied = {name for group in graph.meta.tied_unit_groups for name in group}
    free = {u.name for u in graph.units() if u.param_bytes == 0 and u.name not in tied}
    crossing = [0] * (len(names) + 1)
    for src, dst, nbytes in graph.edges():
        if src in free:
            continue
        for j in range(index[src] + 1, index[dst] + 1):
            crossing[j] += nbytes
    return crossing


def stage_problem(graph: LayerGraph, cluster: Cluster, workload: Workload, schedule: str,
                  micro: int) -> StageProblem:
    """The integer stage problem: every unit priced on every rank, links between consecutive ranks."""
    ranks = cluster.ranks
    tokens = workload.batch_size * workload.prompt_len
    crossing = crossing_bytes_per_token(graph)
    times = 2 if workload.training else 1  # activations forward, gradients back
    rows: dict[str, list[tuple[int, ...]]] = {k: [] for k in ("time", "stored", "peak", "send", "in", "out")}
    copies, shared = _tied_copies(graph) if len(ranks) > 1 else ({}, ())
    for k, rank in enumerate(ranks):
        flight = _in_flight(schedule, micro, len(ranks), k)
        prices = _prices(graph, rank, workload)
        rows["time"].append(tuple(_ns(p.prefill_s) for p in prices))
        rows["stored"].append(tuple(p.weights_bytes + p.stored_other_bytes + flight * p.resident_other_bytes
                                    + copies.get(i, 0) for i, p in enumerate(prices)))
        rows["peak"].append(tuple(p.workspace_bytes for p in prices))
        last = k == len(ranks) - 1
        link = None if last else cluster.link(rank, ranks[k + 1])
        rows["send"].append(tuple(0 if link is None else _ns(times * link.seconds(tokens * c)) for c in crossing))
        received, sent = _boundary_copies(micro, flight, workload.training)
        rows["in"].append(tuple(0 if k == 0 else received * tokens * c for c in crossing))
        rows["out"].append(tuple(sent * tokens * c for c in crossing) if not last
                           else (0,) * len(graph) + (_outputs_held(graph, micro, tokens),))
    return StageProblem(time_ns=tuple(rows["time"]), stored_bytes=tuple(rows["stored"]),
                        peak_bytes=tuple(rows["peak"]), send_ns=tuple(rows["send"]), in_bytes=tuple(rows["in"]),
                        out_bytes=tuple(rows["out"]),
                        capacity_bytes=tuple(r.device.usable_bytes for r in ranks), shared_bytes=shared)


def _boundary_copies(micro: int, flight: int, training: bool) -> tuple[int, int]:
    """Micro-batches of crossing activations a stage holds at its first cut and at its last, as
    ``torch.distributed.pipelining`` keeps them, whatever the schedule: a receive buffer for every micro-batch,
    allocated when the step starts; training, the outputs awaiting their backward (``flight``) and a gradient receive
    buffer for every micro-batch; forward only, every micro-batch's output, which the stage's ``fwd_cache`` keeps
    until the next step. Priced at ``flight`` each, a 2-stage 1F1B run of 8 micro-batches held 8 where 1 was counted."""
    return micro, flight + micro if training else micro


def _outputs_held(graph: LayerGraph, micro: int, tokens: int) -> int:
    """What the last stage holds of the model's outputs at the end of a step: ``torch.distributed.pipelining`` keeps
    every micro-batch's output (``step(return_outputs=True)``, the default: the logits of the whole batch) and merges
    them with ``torch.cat``, a second copy. Uncounted, llama-3-8b's 16 micro-batches of 8192 tokens (2 GiB of logits
    each) were planned at 10 GiB of an A100-40GB's last stage."""
    names = graph.names()
    output = graph.meta.extra.get("logits_unit")
    output = output if output in names else names[-1]
    return 2 * micro * tokens * graph.unit(output).out_bytes_per_token


def _check_outputs_fit(problem: StageProblem, rank: Rank, micro: int) -> None:
    """Say so when the outputs the last stage holds are what no split can fit (the stage program would blame
    "activations in flight" and suggest more ranks, which do not help)."""
    last, n = problem.n_stages - 1, problem.n_units
    held, capacity = problem.out_bytes[last][n], problem.capacity_bytes[last]
    smallest = stage_memory_bytes(problem, last, n - 1, n)
    if smallest > capacity >= smallest - held:
        raise InfeasiblePlacementError(
            f"the last stage (rank {rank.rank}, {rank.device.name}) holds the outputs of all {micro} micro-batches "
            f"until step() returns them merged: {format_bytes(held)} (kept, and their merged copy), "
            f"{format_bytes(smallest - capacity)} more than its {format_bytes(capacity)} can hold with its last unit; "
            f"use fewer or smaller micro-batches, a shorter prompt, or a last rank with more memory")


def _tied_copies(graph: LayerGraph) -> tuple[dict[int, int], tuple[tuple[tuple[int, ...], int], ...]]:
    """(unit index -> bytes of the tied tensor it holds a copy of on its own stage; each tied tensor's units that
    count it, for :attr:`~.stages.StageProblem.shared_bytes`). The tracer counts a tied tensor once, on its first
    owner (an embedding tied to the output head); a pipeline loads it again on every stage that holds another of
    its owners (pipeline() reads the head's copy on the last stage), which a stage of more than one rank never
    shares with the first: gemma-2-9b's last stage was 1.71 GiB short of what it holds. A stage holding two of
    them loads it once (t5-11b's decoder embedding and output head on its last stage), and the stage program
    counts it once there."""
    index = {u.name: i for i, u in enumerate(graph.units())}
    copies: dict[int, int] = {}
    shared: list[tuple[tuple[int, ...], int]] = []
    for group in graph.meta.tied_unit_groups:
        members = [graph.unit(name) for name in group if name in index]
        size = max((u.param_bytes for u in members), default=0)
        if size == 0:
            continue
        owner = next(u for u in members if u.param_bytes == size)
        for u in members:
            if u.param_bytes == 0:
                copies[index[u.name]] = size
        counting = tuple(sorted(index[u.name] for u in members if u is owner or u.param_bytes == 0))
        if len(counting) > 1:
            shared.append((counting, size))
    return copies, tuple(shared)


def _prices(graph: LayerGraph, rank: Rank, workload: Workload) -> list[Any]:
    name = rank.device.name
    ctx = PricingContext(graph, Machine([rank.device]), workload)
    return [price_option(ctx, unit, name, name, "resident") for unit in graph.units()]


def _ns(seconds: float) -> int:
    return math.ceil(round(seconds * _NS, 3))


def layer_count_cuts(graph: LayerGraph, n_stages: int) -> list[int]:
    """Cuts of the usual hand split: the repeated layers shared out evenly (earlier stages take the
    remainder), everything before the first layer on stage 0, everything after the last on the last stage.

    The layers are the units of the most common module class (``LlamaDecoderLayer``; of two as common, the first
    met), or in a graph of a layer's parts (sublayer) or modules (module granularity) the first unit of each (the
    most common class there was ``LlamaRMSNorm``, two a layer, or ``Linear``, and the split cut layers apart); a
    model with fewer layers than stages is cut unit by unit instead.
    """
    units = graph.units()
    if any(u.block or u.layer for u in units):
        first = {}
        for i, u in enumerate(units):
            if u.block or u.layer:
                first.setdefault(u.block or u.layer, i)
        layers = sorted(first.values())
    else:
        classes = [u.module_class for u in units]
        layer_class = Counter(classes).most_common(1)[0][0]  # ties in order met: a set's order changed per process
        layers = [i for i, c in enumerate(classes) if c == layer_class]
    if len(layers) < n_stages:
        per, extra = divmod(len(units), n_stages)
        sizes = [per + (1 if k < extra else 0) for k in range(n_stages)]
        return [sum(sizes[:k]) for k in range(n_stages)] + [len(units)]
    per, extra = divmod(len(layers), n_stages)
    starts = [layers[sum(per + (1 if j < extra else 0) for j in range(k))] for k in range(n_stages)]
    return [0] + starts[1:] + [len(units)]


def _cuts_time(problem: StageProblem, cuts: list[int]) -> float | None:
    ranges = list(zip(cuts[:-1], cuts[1:], strict=True))
    if any(stage_memory_bytes(problem, k, a, b) > problem.capacity_bytes[k] for k, (a, b) in enumerate(ranges)):
        return None
    return max(stage_time_ns(problem, k, a, b) for k, (a, b) in enumerate(ranges)) / _NS


def _stage_plan(problem: StageProblem, solution: StageSolution, k: int, rank: Rank, names: list[str]) -> StagePlan:
    a, b = solution.ranges()[k]
    send = problem.send_ns[k][b]
    preset = rank.device.source.split(":", 1)[-1]
    return StagePlan(stage=k, rank=rank.rank, host=rank.host, local_rank=rank.local_rank,
                     device=f"{rank.device.name} ({preset})", units=tuple(names[a:b]),
                     compute_s=(solution.stage_ns[k] - send) / _NS, send_s=send / _NS,
                     memory_bytes=solution.stage_bytes[k], capacity_bytes=problem.capacity_bytes[k])


def _spec_or_blank(cluster: Cluster) -> str:
    try:
        return cluster.to_spec()
    except DeviceSpecError:  # measured devices have no spec; the plan still names each rank's device
        return ""
