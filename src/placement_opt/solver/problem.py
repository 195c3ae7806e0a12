"""The placement problem in plain integers: what the cost model hands to the solvers.

No torch and no networkx here: a :class:`PlacementProblem` is units (in execution order),
each with a menu of :class:`PlacementOption`s priced in nanoseconds and bytes, data-flow
edges with a transfer price per pair of execution devices, and device capacities.

:meth:`PlacementProblem.score` is the single definition of what an assignment costs. The
CP-SAT model, the baselines and ``evaluate`` all agree with it.

Its parts (:class:`PlacementOption`, :class:`UnitSpec`, :class:`EdgeSpec`, :class:`DeviceSpec`) are defined in
:mod:`.specs`, the stalls and transients it reads in :mod:`.schedule`; both are exported here too.

The latency of one phase (prefill, or all decode steps together) is

    max( longest path through the DAG,  busiest device's total work,
         the prefetch thread's copies,  host memory's traffic,  the disk's reads )

where a unit weighs its option's duration plus its *stall* and an edge weighs its transfer time
when its two ends execute on different devices in that phase (a ``phased`` option computes on
``prefill_execution`` in the prefill and on ``execution`` in the decode). For a chain (every
decoder-only LLM) the longest path is the plain sum. For DAGs it is the critical path; the
device-load term keeps two parallel branches on one device from being counted as if they
overlapped. It is the classic lower bound of the precedence-constrained scheduling problem (a
list schedule is within 2x of it).

Overlap. A ``stream`` option to a GPU has a ``copy_*_ns`` the dispatcher's one prefetch thread
spends copying its weights; its duration is its compute alone. The thread starts the copy of the
next streamed unit when the previous streamed unit starts computing, so the copy runs beside
every unit in between, CPU-executed ones included (and, in the decode, wraps to the next step's
first streamed unit). A streamed unit waits for what is left of its copy: with ``C`` the time the
units from the previous streamed unit (included) up to this one (excluded) take,

    stall = max(0, copy - C)

(:func:`stalls`; the decode is cyclic, steady state; in the prefill the first copy runs from the
call's start). Consecutive streamed units of equal size cost ``max(compute, copy)`` each, as a
plain prefetch does; a streamed unit behind CPU-executed ones hides its copy behind their compute.
``copy_groups`` (a sublayer graph's parts of one decoder layer) are copied as one: the rule above on
groups, a group's duration and copy the sums of its units', its stall charged to its first unit.
The copies share one thread (``lat >= sum of copies``), host memory serves the copies and the
CPU's weight reads together (``lat >= sum of host_*_ns``), and one disk serves every read of the
weights stored on it (``lat >= sum of disk_*_ns``). Edge transfers are not counted as time
that hides a copy (a pessimistic simplification), and the decode's recurrence runs on the sums
over its steps (optimistic by at most the variation of a step's compute across the context).

Memory on a device is

    sum(stored_bytes of units stored there) + sum(resident_bytes of units executed there)
    + max(peak_bytes of units executed there, prefill_peak_bytes of phased units prefilled there)

and must not exceed the device's ``capacity_bytes`` (its memory less the reserve). With copy groups, the
parts of a group streamed ahead (``group_copy_bytes``) hold one buffer together, not one each: such an
option's peak counts less its own :data:`GROUP_BUFFERS` copies, and the last term becomes

    max over copy runs R of ( max(peaks of R's units there) + R's group copies to the device
                              + max(R's group copies, those of the next run after R that copies there) )

(:func:`device_transients`): while a unit of R runs, the dispatcher holds R's copies and those of the next
streaming group, in flight, which R's head started; a unit outside the layers is a run alone. It is taken
in each phase, the larger counting: the prefill copies a phased unit's group and holds its prefill peak, the
decode does neither; the decode's runs go round a cycle (the last run's next is the first copying run of
the next step), and a prefill's last copying run starts the decode's first. The next copies count at least
as R's own: a streamed option's peak (its own copies twice, as a unit alone holds them) then stays what the
device holds at the least, which the relaxations and cuts read one option at a time; it over-counts where a
run copies more than the next.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from ..errors import SolverInputError
from ._validate import check_problem
from .schedule import (
    PHASES,
    Transient,
    device_transients,
    next_copies,
    phase_copies,
    phase_next_copies,
    phase_peaks,
    stalls,
)
from .specs import GROUP_BUFFERS, MODES, SHARED, DeviceSpec, EdgeSpec, PlacementOption, UnitSpec

__all__ = [
    "MODES",
    "PHASES",
    "SHARED",
    "OBJECTIVES",
    "objective_value",
    "PlacementOption",
    "UnitSpec",
    "EdgeSpec",
    "DeviceSpec",
    "PlacementProblem",
    "Score",
    "stalls",
    "spine",
    "GROUP_BUFFERS",
    "Transient",
    "device_transients",
    "next_copies",
    "phase_next_copies",
    "phase_peaks",
    "phase_copies",
]

#: What a plan can minimise: ``latency`` (prefill + decode), ``throughput`` (the slowest device's
#: total work) or ``memory`` (bytes used on the GPUs).
OBJECTIVES = ("latency", "throughput", "memory")
#: Scores a problem remembers (by assignment) before it forgets them all: a search prices a handful.
SCORES_KEPT = 64


def objective_value(objective: str, *, latency: float, stage: Mapping[str, float],
                    used_bytes: Mapping[str, float], gpus: Iterable[str]) -> float:
    """The single definition of each objective, in whatever unit the caller prices in.

    ``latency``: prefill + decode; ``throughput``: the slowest device's total work (0 with no work);
    ``memory``: bytes used on the GPUs, summed (0 on a machine without a GPU: the CPU and disk
    bytes are not what this objective saves).
    """
    if objective == "latency":
        return latency
    if objective == "throughput":
        return max(stage.values(), default=0)
    if objective == "memory":
        return sum(used_bytes[g] for g in gpus)
    raise SolverInputError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")


@dataclass(frozen=True, kw_only=True)
class Score:
    """What one assignment costs under :meth:`PlacementProblem.score`."""

    prefill_ns: int
    decode_ns: int
    stage_ns: Mapping[str, int]
    """Total work (prefill + decode) per execution device, each phase's on the device that computes it:
    the pipeline stage times."""
    used_bytes: Mapping[str, int]
    """Memory used per device under the memory model."""
    over_bytes: Mapping[str, int]
    """Bytes over capacity per device (only devices that are over)."""

    @property
    def latency_ns(self) -> int:
        return self.prefill_ns + self.decode_ns

    @property
    def throughput_ns(self) -> int:
        """The slowest stage: what bounds throughput when many batches are in flight."""
        return max(self.stage_ns.values(), default=0)

    @property
    def feasible(self) -> bool:
        return not self.over_bytes


@dataclass(frozen=True, kw_only=True)
class PlacementProblem:
    """Units in execution order, edges, devices and the constraints a solution must meet."""

    units: tuple[UnitSpec, ...]
    edges: tuple[EdgeSpec, ...]
    devices: tuple[DeviceSpec, ...]
    tied_groups: tuple[tuple[str, ...], ...] = ()
    """Unit names whose weights are shared: every unit of a group has the same storage device."""
    pins: Mapping[str, str] = field(default_factory=dict)
    """Unit name -> required storage device."""
    contiguous: bool = False
    """Each device stores one contiguous range of the units that store bytes of their own (:attr:`stored_units`, in
    execution order). A tied group's later members store none (their group's first member holds the weights):
    they may compute anywhere, as the last stage of a pipeline computes a tied output head."""
    copy_groups: tuple[tuple[str, ...], ...] = ()
    """Runs of consecutive units (in execution order) whose streamed weights the prefetch thread copies as
    one (a sublayer graph's parts of one decoder layer): :func:`stalls` with ``runs``. Units in no group
    are groups of their own."""
    part_groups: tuple[tuple[str, ...], ...] = ()
    """Runs of consecutive units cut from one coarser unit (a layer's expert groups): no constraint, a hint to
    the search, which solves the problem with each run merged back first for a start
    (:func:`~placement_opt.solver.reductions.part_groups`)."""

    def __post_init__(self) -> None:
        check_problem(self)

    @functools.cached_property
    def menu_units(self) -> tuple[UnitSpec, ...]:
        """The first unit of each distinct options tuple (by identity), in execution order. Pricing
        gives identical units one shared tuple (22 for a module-level 70B's 724 units): what reads
        every option reads each menu once through these."""
        first: dict[int, UnitSpec] = {}
        return tuple(first.setdefault(id(u.options), u) for u in self.units if id(u.options) not in first)

    def index(self) -> dict[str, int]:
        """Unit name -> position in execution order."""
        return {u.name: i for i, u in enumerate(self.units)}

    def device(self, name: str) -> DeviceSpec:
        return next(d for d in self.devices if d.name == name)

    def options(self, choice: Sequence[int]) -> list[PlacementOption]:
        """The chosen option of every unit, checked for range."""
        if len(choice) != len(self.units):
            raise SolverInputError(f"assignment has {len(choice)} entries for {len(self.units)} units: "
                                   f"give one option index per unit")
        return [u.options[c] for u, c in zip(self.units, choice, strict=True)]

    def score(self, choice: Sequence[int]) -> Score:
        """Price an assignment (one option index per unit, in execution order)."""
        # the search prices its start and each plan found several times (scale, caps, proofs, the report):
        # a module-level 70B's score takes ~15 ms, and a search under a 0.2 s budget can spend 0.2 s on repeats
        key = tuple(choice)
        known = self._scores.get(key)
        if known is None:
            if len(self._scores) >= SCORES_KEPT:
                self._scores.clear()
            known = self._scores[key] = self._score(choice)
        return known

    @functools.cached_property
    def _scores(self) -> dict[tuple[int, ...], Score]:
        return {}

    def _score(self, choice: Sequence[int]) -> Score:
        chosen = self.options(choice)
        prefill = self._phase_latency(chosen, "prefill_ns")
        decode = self._phase_latency(chosen, "decode_ns")
        stage: dict[str, int] = {}
        for opt in chosen:
            for phase in PHASES:
                device = opt.device_in(phase)
                stage[device] = stage.get(device, 0) + opt.work_in(phase)
        used = self.used_bytes(chosen)
        over = {d.name: used[d.name] - d.capacity_bytes for d in self.devices
                if used[d.name] > d.capacity_bytes}
        return Score(prefill_ns=prefill, decode_ns=decode, stage_ns=stage, used_bytes=used,
                     over_bytes=over)

    def used_bytes(self, chosen: Sequence[PlacementOption]) -> dict[str, int]:
        used = {d.name: 0 for d in self.devices}
        peak = {d.name: 0 for d in self.devices}
        for opt in chosen:
            used[opt.storage] += opt.stored_bytes
            used[opt.execution] += opt.resident_bytes
        if self.group_copies:
            for device, transient in device_transients(chosen, self.runs).items():
                peak[device] = transient.total_bytes
        else:
            for opt in chosen:
                for device, nbytes in opt.peaks():
                    if nbytes > peak[device]:
                        peak[device] = nbytes
        return {name: used[name] + peak[name] for name in used}

    def most_peak(self, opt: PlacementOption) -> int:
        """``opt``'s transient on its execution device with its copy run's and the next run's copies at the most
        any copy run puts there (the executor starts' conservative price; :meth:`used_bytes` is the exact one).
        A peak of another unit of its run may still exceed its own."""
        if not opt.group_copy_bytes or opt.prefill_execution is not None:
            return opt.peak_bytes
        return opt.peak_bytes + GROUP_BUFFERS * (self._group_most[opt.execution] - opt.group_copy_bytes)

    @functools.cached_property
    def _group_most(self) -> dict[str, int]:
        """Device -> the most group copies one copy run can put there (each unit on its largest option there)."""
        most: dict[str, int] = {}
        for a, b in self.runs:
            run: dict[str, int] = {}
            for unit in self.units[a:b]:
                largest: dict[str, int] = {}
                for o in unit.options:
                    if o.group_copy_bytes > largest.get(o.group_device, 0):
                        largest[o.group_device] = o.group_copy_bytes
                for d, nbytes in largest.items():
                    run[d] = run.get(d, 0) + nbytes
            for d, nbytes in run.items():
                most[d] = max(most.get(d, 0), nbytes)
        return most

    @functools.cached_property
    def group_copies(self) -> bool:
        """Whether some option is copied with its group (``group_copy_bytes``): then devices count transients per
        copy run (:func:`device_transients`)."""
        return any(o.group_copy_bytes for u in self.menu_units for o in u.options)

    def objective_value(self, choice: Sequence[int], objective: str) -> int:
        """The exact value of ``objective`` for ``choice``: ns for latency/throughput, GPU bytes for memory."""
        score = self.score(choice)
        return int(objective_value(objective, latency=score.latency_ns, stage=score.stage_ns,
                                   used_bytes=score.used_bytes, gpus=self.gpu_names()))

    def gpu_names(self) -> list[str]:
        return [d.name for d in self.devices if d.kind == "gpu"]

    def allows(self, unit: UnitSpec, option: PlacementOption) -> bool:
        """False when a pin fixes ``unit``'s storage elsewhere."""
        pin = self.pins.get(unit.name)
        return pin is None or option.storage == pin

    def satisfies(self, choice: Sequence[int]) -> bool:
        """Every constraint a solution must meet: capacities, pins, tied storage and contiguity."""
        chosen = self.options(choice)
        if not self.score(choice).feasible:
            return False
        if any(not self.allows(u, o) for u, o in zip(self.units, chosen, strict=True)):
            return False
        index = self.index()
        if any(len({chosen[index[n]].storage for n in group}) > 1 for group in self.tied_groups):
            return False
        return not self.contiguous or not self.extra_ranges(chosen)

    def extra_ranges(self, chosen: Sequence[PlacementOption]) -> int:
        """Ranges of :attr:`stored_units` beyond one per storage device: 0 when ``chosen`` meets ``contiguous``."""
        devices = [d for d, _ in itertools.groupby(chosen[i].storage for i in self.stored_units)]
        return len(devices) - len(set(devices))

    @functools.cached_property
    def stored_units(self) -> tuple[int, ...]:
        """Indices of the units that some option stores bytes for, in execution order: those ``contiguous``
        keeps in one range per device. A tied group's later members store nothing of their own, and a
        tied embedding's output head would otherwise force the whole model onto the embedding's device."""
        return tuple(i for i, u in enumerate(self.units) if any(o.stored_bytes for o in u.options))

    def schedule(self, chosen: Sequence[PlacementOption], key: str,
                 rounded: Callable[[int], int] | None = None) -> tuple[list[int], dict[str, int]]:
        """Finish time of every unit (its stall included) and total work per execution device in one phase
        (``key``).

        ``rounded`` maps every price (durations, copies and transfers) first: the solver's scaled integers.
        """
        n = len(chosen)
        finish = [0] * n
        load: dict[str, int] = {}
        durations = list(map(attrgetter(key), chosen))
        if rounded:
            durations = list(map(rounded, durations))
        waits = self.waits(chosen, key, rounded) or [0] * n
        devices = [o.device_in(key) for o in chosen]
        incoming = self._incoming_prices[key]
        # Edges point forward in execution order, so one pass in that order is a topological pass.
        for i in range(n):
            ready = 0
            device = devices[i]
            for j, prices in incoming[i]:
                src = devices[j]
                cost = prices.get((src, device), 0) if src != device else 0
                arrival = finish[j] + (rounded(cost) if rounded else cost)
                if arrival > ready:
                    ready = arrival
            finish[i] = ready + durations[i] + waits[i]
            load[device] = load.get(device, 0) + durations[i]
        return finish, load

    def waits(self, chosen: Sequence[PlacementOption], key: str,
              rounded: Callable[[int], int] | None = None) -> list[int]:
        """Every unit's stall in phase ``key`` (:func:`stalls`; the decode is cyclic); ``[]`` when none copies."""
        copies = list(map(attrgetter("copy_" + key), chosen))
        if not any(copies):
            return []  # the common case (no copy apart from compute), at once: score() runs often
        durations = list(map(attrgetter(key), chosen))
        if rounded:
            durations, copies = list(map(rounded, durations)), list(map(rounded, copies))
        return stalls(durations, copies, cyclic=key == "decode_ns", runs=self.copy_runs)

    @functools.cached_property
    def copy_runs(self) -> tuple[tuple[int, int], ...] | None:
        """``copy_groups`` as ``(first, end)`` index ranges covering every unit in order (a unit in no group
        alone), or None when no group has two units: then every unit is its own group, as before groups."""
        if all(len(g) < 2 for g in self.copy_groups):
            return None
        index = self.index()
        starts = {index[g[0]]: index[g[0]] + len(g) for g in self.copy_groups}
        runs, u = [], 0
        while u < len(self.units):
            end = starts.get(u, u + 1)
            runs.append((u, end))
            u = end
        return tuple(runs)

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """:attr:`copy_runs`, or every unit alone when there are none: the ranges stalls and memory go by."""
        return self.copy_runs or tuple((u, u + 1) for u in range(len(self.units)))

    @functools.cached_property
    def run_of(self) -> tuple[int, ...]:
        """Each unit's index in :attr:`runs`."""
        return tuple(k for k, (a, b) in enumerate(self.runs) for _ in range(a, b))

    def shared_rows(self, chosen: Sequence[PlacementOption], key: str,
                    rounded: Callable[[int], int] | None = None) -> tuple[int, ...]:
        """Each of :data:`SHARED`'s total time in phase ``key``: each bounds its latency."""
        rows = (map(attrgetter(f"{res}_{key}"), chosen) for res in SHARED)
        return tuple(sum(map(rounded, row)) if rounded else sum(row) for row in rows)

    def shared_used(self, phase: str) -> tuple[str, ...]:
        """The resources of :data:`SHARED` that some option uses in ``phase``: the rows worth stating."""
        return self._shared_used[phase]

    @property
    def copies_beside(self) -> bool:
        """Whether some option copies beside the compute in some phase (``Workload(overlap=True)``): then
        streamed units stall, and the order of the same options sets the price."""
        return any("copy" in self._shared_used[ph] for ph in PHASES)

    def shared_most(self, phase: str) -> tuple[int, ...]:
        """Per unit, the most any of its options asks of the shared rows used in ``phase`` together (ns):
        what a latency horizon must allow them."""
        return self._shared_most[phase]

    @functools.cached_property
    def _shared_most(self) -> dict[str, tuple[int, ...]]:
        most = {}
        for ph in PHASES:
            rows = [attrgetter(f"{res}_{ph}") for res in self.shared_used(ph)]
            most[ph] = tuple(max(sum(row(o) for row in rows) for o in u.options) if rows else 0 for u in self.units)
        return most

    @functools.cached_property
    def _shared_used(self) -> dict[str, tuple[str, ...]]:
        options = [o for u in self.units for o in u.options]
        return {ph: tuple(res for res in SHARED if any(map(attrgetter(f"{res}_{ph}"), options))) for ph in PHASES}

    @functools.cached_property
    def _incoming_prices(self) -> dict[str, list[list[tuple[int, Mapping[tuple[str, str], int]]]]]:
        """Per phase, per unit in execution order: (src, the edge's prices in that phase) of each in-edge,
        built once per problem (score() runs often on 724 units)."""
        index = self.index()
        incoming: dict[str, list[list[tuple[int, Mapping[tuple[str, str], int]]]]] = {
            ph: [[] for _ in self.units] for ph in PHASES}
        for edge in self.edges:
            for ph in PHASES:
                incoming[ph][index[edge.dst]].append((index[edge.src], getattr(edge, ph)))
        return incoming

    def _phase_latency(self, chosen: Sequence[PlacementOption], key: str) -> int:
        finish, load = self.schedule(chosen, key)
        return max(max(finish, default=0), max(load.values(), default=0), *self.shared_rows(chosen, key))


def spine(problem: PlacementProblem) -> set[int]:
    """Indices of the units on every path from a source to a sink (every unit of a chain): no edge jumps
    over one, no source comes after it and no sink before it. Each longest path holds their durations and
    stalls, whatever the assignment."""
    n = len(problem.units)
    index = problem.index()
    has_in, has_out = [False] * n, [False] * n
    over = [0] * (n + 1)  # edges jumping over each position, by a difference array
    for e in problem.edges:
        a, b = index[e.src], index[e.dst]
        has_out[a] = has_in[b] = True
        if b > a + 1:
            over[a + 1] += 1
            over[b] -= 1
    last_source = max((u for u in range(n) if not has_in[u]), default=-1)
    first_sink = min((u for u in range(n) if not has_out[u]), default=n)
    out, jumped = set(), 0
    for u in range(n):
        jumped += over[u]
        if not jumped and last_source <= u <= first_sink:
            out.add(u)
    return out
