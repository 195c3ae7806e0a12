"""``solve()``: the public front end from a model and a machine to a :class:`~placement_opt.plan.Plan`.

Stage 4 of the data flow, wiring the others together::

    graph = trace(model)  (or the LayerGraph given)
    problem = cost.build_problem(graph, machine, workload, pins=..., contiguous=...)
    baselines: sequential / balanced / balanced_low_0 (and the installed library when a model is given),
               each scored by cost.evaluate with accelerate's run-time semantics -> Plan.baselines
    solver.search.solve_problem(problem, objective, hint=best valid baseline) -> Plan

Torch is imported only when a model (not a LayerGraph) must be traced, or for ``strategy="accelerate"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._solve_inputs import (
    SOLVER_MODES,
    STRATEGIES,
    check_arguments,
    check_granularity,
    check_modes,
    check_types,
    holds_no_tensors,
    nothing_to_place,
)
from .baselines import ScoredBaseline, baseline_plan, score_baselines
from .cost.build import price_problem, run_as_glue
from .cost.calibrated import calibration_for
from .cost.device_map import accelerate_device_map
from .cost.evaluate import Cost, as_graph, priced_evaluator
from .cost.pricing import home_device
from .cost.shortage import proven_short, shortage_message
from .cost.workload import Workload
from .errors import InfeasiblePlacementError, PlacementError, SolverInputError
from .hardware.devices import Machine
from .plan import Plan, UnitPlacement
from .plan_check import graph_fingerprint
from .plan_notes import (
    beyond_preset_note,
    calibration_note,
    context_note,
    contiguous_note,
    cpu_beside_gpu_note,
    default_speeds_note,
    group_note,
    kept_groups_note,
    other_dtype_note,
    phased_note,
    reserve_note,
    split_experts_note,
    uncut_note,
    unitless_note,
)
from .report import EXTRA_SEARCH_S
from .solver.edges import prune_edges
from .solver.greedy import best_greedy_choice, greedy_starts
from .solver.problem import MODES, OBJECTIVES, PlacementProblem
from .solver.search import GAP_LIMIT, SEARCH_NOTES, solve_problem
from .units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .model.graph import LayerGraph

__all__ = ["solve", "solve_best_granularity", "searched_again", "STRATEGIES", "OBJECTIVES",
           "SOLVER_WORKERS", "SOLVER_NOTES"]

_NS_PER_S = 1e9
#: Least search time (s) CP-SAT gets however long pricing and baselines took: past the limit by then,
#: solve() overruns it by at most this and the final scoring (the acceptance allows 0.5 s).
MIN_SEARCH_S = 0.2
#: CP-SAT search workers by default: LNS beside the LP search. On hard problems it finds much better
#: plans than one worker in the same second (Llama-3-70B, batch 16, four mixed GPUs: 43.6 s against
#: 64.0 s); one worker (``workers=1``) gives the same plan on every run.
SOLVER_WORKERS = 2
#: How a cpsat plan's notes about the search itself begin: the greedy plan it was warm-started from, and the
#: search's own notes (what it started from, where its bound came from). The CLI prints them with --verbose only.
WARM_START = "warm start: "
SOLVER_NOTES = (WARM_START, *SEARCH_NOTES)


@dataclass(frozen=True)
class _Placements:
    """A plan-shaped value for ``cost.evaluate`` (it reads ``.placements``)."""

    placements: tuple[UnitPlacement, ...]


def solve(model: Any, devices: Any = None, objective: str = "latency", *, workload: Workload | None = None,
          strategy: str = "cpsat", pins: Mapping[str, Any] | None = None, time_limit_s: float = 1.0,
          seed: int = 0, contiguous: bool = False, gap_limit: float = GAP_LIMIT,
          workers: int = SOLVER_WORKERS, modes: Sequence[str] = SOLVER_MODES,
          granularity: str | None = None, expert_groups: int = 1) -> Plan:
    """Decide where every unit of ``model`` is stored and computed on ``devices``.

    Example::

        plan = placement_opt.solve(graph, {0: "24GiB", "cpu": "64GiB", "disk": "1TB"},
                                   workload=Workload(batch_size=16), pins={"lm_head": 0})
        print(plan.summary())
        model = AutoModelForCausalLM.from_pretrained(path, device_map=plan.device_map)

    Args:
        model: a :class:`LayerGraph`, or anything :func:`placement_opt.trace` accepts (a model, a
            config, a preset name).
        devices: a ``Machine``, a list of ``Device``s, names or spec items (``"cuda:0=h100-sxm"``), an
            accelerate ``max_memory`` dict or a spec string; ``None`` or ``"auto"`` detects this machine (in a
            distributed run: this rank's share).
        objective: ``"latency"`` (prefill + every decode step), ``"throughput"`` (slowest pipeline
            stage) or ``"memory"`` (least GPU memory within 5 % of the best latency).
        workload: batch, prompt and new tokens; default ``Workload()``.
        strategy: ``"cpsat"`` (the optimizer), ``"sequential"``, ``"balanced"``, ``"balanced_low_0"``
            (placement_opt's re-implementation of those device_map strings) or ``"accelerate"`` (the
            installed library itself; needs a model or config).
        pins: accelerate vocabulary, ``{"lm_head": "cuda:1", "model.embed_tokens": "cpu",
            "model.layers": 0}``: a key covers every unit it prefixes; the storage device is fixed. A key
            with ``*``, ``?`` or ``[`` is a shell-style pattern over unit names and their prefixes
            (``{"model.layers.*.mlp.experts": "cpu"}`` at ``granularity="sublayer"``); a plain key wins over
            patterns (:func:`~placement_opt.cost.pins.resolve_pins`).
        time_limit_s: wall-clock limit of everything after tracing: pricing, baselines and the CP-SAT
            search, which gets what is left (at least 0.2 s: a limit already spent on pricing is
            overrun by that much). Meanwhile Python's full cycle collections wait (the oldest
            generation's threshold is raised, and restored on return), so that scanning a large traced
            graph does not take the search's time.
        seed: CP-SAT's random seed.
        contiguous: each device stores one contiguous range of the units that store weights (pipeline stages; a
            tied output head may compute anywhere). The same problem without contiguity is solved first, for its
            bound and its plan reordered into a start; batch-16 solves on full GPUs may still need more than the
            default second (docs/limitations.md).
        gap_limit: CP-SAT stops once its plan is proven within this fraction of the optimum
            (default 0.1 %: the cost model is not more accurate than that); ``0`` uses the whole limit.
        workers: CP-SAT search workers. ``1`` is reproducible: the search ends on a deterministic-time
            budget, so the same inputs give the same plan on every run. The default ``2`` adds a
            large-neighbourhood search beside it, which finds better plans on hard problems but
            can return a different (equally bounded) plan from one run to the next.
        modes: what the solver may choose for weights kept off the GPUs: ``"resident"`` (always),
            ``"stream"`` (copied to a GPU at every forward, overlapped) and ``"phased"`` (streamed to a
            GPU for the prompt, computed on the CPU at every decode step; run by :func:`dispatch`
            and :func:`load` only: ``from_pretrained(device_map=plan.device_map)`` streams them).
        granularity: what a model is cut into (:func:`placement_opt.trace`): ``"block"`` (decoder
            layers whole; the default for a model), ``"module"``, ``"sublayer"`` (attention, MLP, experts
            apart), or ``"auto"``: block and sublayer both, each solved with half of ``time_limit_s``,
            the better plan kept (its notes give both values). ``None``: a ``LayerGraph`` as traced, a
            model at ``"block"``. A ``LayerGraph`` takes no other value than its own.
        expert_groups: with ``granularity="sublayer"`` (or ``"auto"``), each MoE layer's experts are cut into this
            many groups of consecutive experts, each placed on its own (:func:`placement_opt.trace`), so the GPU
            can hold part of a layer's experts; 1 (default): a layer's experts are one unit. More units make the
            search harder: see the plan's gap. A ``LayerGraph`` is traced with it (``trace(..., expert_groups=)``).

    Returns:
        A frozen :class:`Plan` with its cost, the solver's status, bound and gap, and every baseline;
        for a ``trace(granularity="sublayer")`` graph, ``plan.home`` names the device the residual
        stream stays on (the first GPU, else the CPU), which the round trips were priced around.

        Given a :class:`~placement_opt.hardware.cluster.Cluster` as ``devices`` (with
        ``objective="throughput"``), a ``PipelinePlan`` instead: one contiguous stage per rank, from
        :func:`placement_opt.distributed.pipeline_plan.plan_pipeline` (1F1B, one micro-batch per rank; call
        that function for other schedules).

    Raises:
        InfeasiblePlacementError: no placement fits; says which capacity is short, by how much and why.
        SolverInputError: a bad argument or pin (the message lists what is accepted).
        PlacementError: no solution in time, or another stage's error (a device spec, the model).
    """
    check_arguments(objective, strategy, time_limit_s, seed, gap_limit, workers)
    modes = check_modes(modes)
    if _is_cluster(devices):  # pipeline stages over several hosts (issue 16): a PipelinePlan
        _check_cluster_arguments(strategy=strategy != "cpsat", pins=bool(pins), contiguous=bool(contiguous),
                                 modes=set(modes) != set(SOLVER_MODES), granularity=granularity not in (None, "block"),
                                 expert_groups=expert_groups != 1, time_limit_s=time_limit_s != 1.0, seed=seed != 0,
                                 gap_limit=gap_limit != GAP_LIMIT, workers=workers != SOLVER_WORKERS)
        return _pipeline_plan(model, devices, objective, workload)
    check_types(workload, pins, contiguous, strategy)
    from .model.graph import LayerGraph

    check_granularity(model, granularity, expert_groups)
    if granularity == "auto":
        return _solve_either_granularity(model, devices, objective, expert_groups, workload=workload,
                                         strategy=strategy, pins=pins, time_limit_s=time_limit_s, seed=seed,
                                         contiguous=contiguous, gap_limit=gap_limit, workers=workers, modes=modes)

    if strategy == "accelerate" and isinstance(model, LayerGraph):
        raise SolverInputError("strategy='accelerate' runs the installed library on the model itself, so it "
                               "needs a transformers model or config, not a LayerGraph: pass the model (or its "
                               "config), or use strategy='balanced' on a LayerGraph")
    if holds_no_tensors(model):  # before tracing, which would warn about a forward it cannot guess
        raise nothing_to_place(type(model).__name__)
    graph = as_graph(model, granularity, expert_groups)
    with _full_collections_deferred():
        plan = _timed_solve(graph, model, devices, objective, workload, strategy, pins, contiguous, modes,
                            (time_limit_s, seed, gap_limit, workers))
    # a sublayer graph was priced around a home device (cost.pricing): the plan says which, for the runtime
    home = home_device(plan.machine) if graph.meta.granularity == "sublayer" else None
    return dataclasses.replace(plan, fingerprint=graph_fingerprint(graph), home=home,
                               notes=(*plan.notes, *uncut_note(graph, expert_groups)))


#: The oldest generation's threshold while a solve runs: no solve makes that many younger collections
_NO_FULL_COLLECTION = 1 << 30
_deferring = threading.Lock()
#: solves running now (threads may overlap), and the thresholds the first of them found
_deferral: dict[str, Any] = {"solves": 0, "thresholds": None}


@contextlib.contextmanager
def _full_collections_deferred() -> Iterator[None]:
    """No full (generation 2) cycle collection until the solve returns; the caller's thresholds restored then.

    A full collection scans every live object: after tracing a module-level Llama-3-70B, one came in a 2 s
    solve() and took 0.22 s of it on a 2-core machine (0.5 s when the machine was loaded). Younger
    collections go on: they scan only what the solve allocated. An earlier version froze the live objects
    (``gc.freeze``) unless the caller had frozen some; CPython 3.12 starts with objects frozen (375 on
    3.12.1), so that never deferred there. The caller's own freeze is not touched. Python 3.14's incremental
    collector ignores the threshold: it scans the old generation a part at a time instead."""
    with _deferring:
        if _deferral["solves"] == 0:
            young, middle, old = _deferral["thresholds"] = gc.get_threshold()
            gc.set_threshold(young, middle, max(old, _NO_FULL_COLLECTION))
        _deferral["solves"] += 1
    try:
        yield
    finally:
        with _deferring:
            _deferral["solves"] -= 1
            if _deferral["solves"] == 0:
                gc.set_threshold(*_deferral["thresholds"])


def _timed_solve(graph: LayerGraph, model: Any, devices: Any, objective: str, workload: Workload | None,
                 strategy: str, pins: Mapping[str, Any] | None, contiguous: bool, modes: Sequence[str],
                 search: tuple[float, int, float, int]) -> Plan:
    """Everything :func:`solve` does after tracing, which its time limit covers."""
    from .model.graph import LayerGraph

    time_limit_s, seed, gap_limit, workers = search
    started = time.perf_counter()
    if not graph.names() or (not isinstance(model, LayerGraph) and graph.total_param_bytes + graph.total_buffer_bytes == 0):
        raise nothing_to_place(graph.meta.model_name)
    machine, machine_note = _machine(devices, graph.meta.dtype)
    workload = workload if workload is not None else Workload()
    problem, score = _priced(graph, machine, workload, pins or {}, contiguous, modes)
    scored = time.perf_counter()
    baselines = score_baselines(graph, machine, score, problem, model)
    # The plan is scored once more after the search: about one baseline's share of that time.
    after_s = (time.perf_counter() - scored) / max(1, len(baselines))
    notes = [machine_note] if machine_note else []
    # what the prediction rests on: calibrated, assumed or another dtype's speeds; a context past the model's
    notes += [said for said in (calibration_note(graph, machine), default_speeds_note(machine),
                                beyond_preset_note(machine), reserve_note(machine), unitless_note(machine),
                                other_dtype_note(machine, graph.meta.dtype),
                                context_note(graph, workload)) if said]
    glue = run_as_glue(graph)
    if len(problem.pins) > len(glue):
        given = ", ".join(f"{key!r} -> {value}" for key, value in (pins or {}).items())
        notes.append(f"{len(problem.pins) - len(glue)} unit(s) stored where pinned ({given}); the solver placed the "
                     f"rest, and chose where every unit computes")
    if glue:
        kept = (f"kept on the home device {problem.pins[glue[0]]}, where that code runs (no pin moves them)"
                if strategy == "cpsat" else  # the fills know no pins: they place these as any other unit
                f"strategy {strategy!r} places them as any other unit, and where it stores one off the home device "
                f"{problem.pins[glue[0]]} the model cannot run as planned; strategy='cpsat' keeps them there")
        notes.append(f"{len(glue)} unit(s) hold weights their parent uses through other methods, never their own "
                     f"forward ({', '.join(glue[:3])}{', ...' if len(glue) > 3 else ''}): {kept}")
    if strategy == "cpsat":
        return _cpsat_plan(graph, machine, workload, problem, objective, baselines, score,
                           (time_limit_s, seed, gap_limit, workers, started - after_s), notes)
    return _baseline_plan(graph, machine, workload, objective, strategy, baselines, model, notes)


def _solve_either_granularity(model: Any, devices: Any, objective: str, expert_groups: int, **options: Any) -> Plan:
    """``granularity="auto"`` on a model: traced at both granularities, then :func:`solve_best_granularity`."""
    from .model.tracer import trace

    sublayer = trace(model, granularity="sublayer", expert_groups=expert_groups)
    plan = solve_best_granularity(trace(model, granularity="block"), sublayer, devices, objective, **options)
    return dataclasses.replace(plan, notes=(*plan.notes, *uncut_note(sublayer, expert_groups)))


def solve_best_granularity(block: LayerGraph, sublayer: LayerGraph, devices: Any, objective: str = "latency",
                           **options: Any) -> Plan:
    """The block plan and the sublayer plan of one model, each in half of ``time_limit_s``; the better one.

    What ``solve(model, granularity="auto")`` does once it has traced the model both ways; callers that
    hold the block graph already (the CLI) trace only the sublayer one. Both are priced by one cost model
    (the sublayer plan with its round trips to home), so their objective values compare. A model without
    sublayer parts (no decoder blocks to split) is solved once. ``options``: :func:`solve`'s keywords.
    """
    options.setdefault("time_limit_s", 1.0)
    if set(block.names()) == set(sublayer.names()):
        return solve(block, devices, objective, **options)
    half = {**options, "time_limit_s": options["time_limit_s"] / 2}
    plans: dict[str, Plan] = {}
    refusals: dict[str, PlacementError] = {}
    for name, graph in (("block", block), ("sublayer", sublayer)):
        try:
            plans[name] = solve(graph, devices, objective, **half)
        except InfeasiblePlacementError as exc:
            refusals[name] = exc
    if not plans:
        raise refusals["block"]
    best = min(plans, key=lambda name: (plans[name].objective_value, name != "block"))
    other = "sublayer" if best == "block" else "block"
    said = (f"{other} units: {_value(plans[other])}" if other in plans else f"{other} units: no placement fits")
    note = (f"granularity auto: {best} units chosen ({len(plans[best].placements)} units, objective "
            f"{_value(plans[best])}; {said}), each solved in {half['time_limit_s']:.2g} s")
    unlike = _unlike_calibration(block, sublayer, plans[best].machine)
    return dataclasses.replace(plans[best], notes=(*plans[best].notes, note, *([unlike] if unlike else [])))


def _unlike_calibration(block: LayerGraph, sublayer: LayerGraph, machine: Machine) -> str | None:
    """A note when the two graphs' prices rest on unlike figures: one's units timed on the model
    (:func:`placement_opt.calibrate`), the other's partly priced by the device speeds."""
    shares = {}
    for name, graph in (("block", block), ("sublayer", sublayer)):
        found = calibration_for(graph, machine)
        timed = sum(1 for u in graph.names() if found is not None and u in found.compute)
        shares[name] = (timed, len(graph))
    if len({timed == total for timed, total in shares.values()}) == 1:
        return None  # both fully calibrated, or both partly: alike
    said = ", ".join(f"{timed} of {total} {name} units" for name, (timed, total) in shares.items())
    return (f"granularity auto compared prices of unlike sources: {said} timed on this model, the rest priced by "
            f"the device speeds; placement-opt profile --model MODEL --granularity auto (or "
            f"placement_opt.calibrate(..., granularity='auto')) times both")


def _value(plan: Plan) -> str:
    """The objective with its unit: bytes for ``memory``, else seconds."""
    return format_bytes(int(plan.objective_value)) if plan.objective == "memory" else f"{plan.objective_value:.4g} s"


def _machine(devices: Any, dtype: str) -> tuple[Machine, str | None]:
    from .distributed.context import current_context
    from .distributed.ranks import plan_note
    from .hardware.resolve import resolve_machine

    context = current_context()
    machine = resolve_machine(devices, context, dtype=dtype)
    return machine, plan_note(machine, context)


def _priced(graph: LayerGraph, machine: Machine, workload: Workload, pins: Mapping[str, Any],
            contiguous: bool, modes: Sequence[str] = SOLVER_MODES) -> tuple[PlacementProblem, Callable[[Any], Cost]]:
    """The solver's problem and the scorer of maps and plans, from one pricing of every option.

    The scorer needs accelerate's ``stream_sync`` options too; the solver's problem is the same
    options without them (:func:`build_problem`'s default modes, in the same order). Covered edges
    are dropped (exact): 14,164 -> 965 on a module-level 70B on 4x T4, so that every baseline and start
    is priced on the small graph; they are found once, on every option (an edge covered there is
    covered with fewer options; a second search on the solver's options drops 80 more, to 885, in 20-30
    ms), and the scorer's transfers sum the same edges. One pricing instead of two saves 0.2 s there.
    """
    full, parts = price_problem(graph, machine, workload, MODES, pins, contiguous)
    kept = {id(u.options): tuple(o for o in u.options if o.mode in modes) for u in full.units}
    units = tuple(dataclasses.replace(u, options=kept[id(u.options)]) for u in full.units)
    pruned = prune_edges(full)
    # Scored on the kept edges too: the same finish times as with all of them (exact), at a 14th of
    # the edges to walk per score on a module-level 70B.
    score = priced_evaluator(graph, machine, workload, dataclasses.replace(pruned, pins={}, contiguous=False), parts,
                             kept_edges=pruned.edges)
    return prune_edges(dataclasses.replace(pruned, units=units)), score


# ---------------------------------------------------------------------------------------------
# Baselines (scored in baselines.py): the search's warm start
# ---------------------------------------------------------------------------------------------
def _best_hint(problem: PlacementProblem, objective: str, baselines: Sequence[ScoredBaseline]) -> tuple[list[int], str]:
    key = "latency" if objective == "memory" else objective
    candidates = [(b.hint, b.strategy) for b in baselines if b.hint is not None]
    plain = len(candidates)  # the first greedy start: the fallback when none is valid
    candidates += greedy_starts(problem)
    valid = [(problem.objective_value(c, key), i, c, s) for i, (c, s) in enumerate(candidates)
             if problem.satisfies(c)]
    if not valid:  # the constructive starts (every memory term counted) find one whenever the simple ones fit
        start = best_greedy_choice(problem, objective)
        if problem.satisfies(start):
            return start, "constructive start"
    if valid:
        _, _, choice, name = min(valid)
        return choice, name
    return candidates[plain][0], "greedy"


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------
def _cpsat_plan(graph: LayerGraph, machine: Machine, workload: Workload, problem: PlacementProblem,
                objective: str, baselines: Sequence[ScoredBaseline], score: Callable[[Any], Cost],
                search: tuple[float, int, float, int, float], notes: list[str]) -> Plan:
    time_limit_s, seed, gap_limit, workers, started = search
    def short() -> str:  # what is short, and a GPU its reserve leaves nothing of
        said = "; ".join(n for n in (reserve_note(machine), unitless_note(machine)) if n)
        return shortage_message(problem, graph, workload) + (f"; {said}" if said else "")

    if proven_short(problem):  # arithmetic proves it: no search (which may end before proving it)
        raise InfeasiblePlacementError(short())
    hint, hint_name = _best_hint(problem, objective, baselines)
    # The search gets what pricing, baselines and the final scoring (``started`` is moved back by its
    # estimate) leave of the limit, and never less than MIN_SEARCH_S (a module-level 70B's pricing
    # and baselines take 0.6-1.2 s of a busy 2-core machine).
    budget = max(min(MIN_SEARCH_S, time_limit_s), time_limit_s - (time.perf_counter() - started))
    sol = solve_problem(problem, objective, time_limit_s=budget, seed=seed, workers=workers, hint=hint,
                        gap_limit=gap_limit)
    if sol.status == "INFEASIBLE":
        raise InfeasiblePlacementError(short())
    if not sol.feasible:
        raise PlacementError(f"CP-SAT found no placement within {time_limit_s:g} s and no baseline fits: "
                             f"{short()}; or raise time_limit_s")
    chosen = problem.options(sol.choice)
    placements = tuple(UnitPlacement(unit=u.name, storage=o.storage, execution=o.execution, mode=o.mode,
                                       prefill_execution=o.prefill_execution, copy_group=graph.unit(u.name).block)
                       for u, o in zip(problem.units, chosen, strict=True))
    cost = score(_Placements(placements))
    scale = 1.0 if objective == "memory" else _NS_PER_S
    notes = [*notes, f"{WARM_START}{hint_name}", *sol.notes, *phased_note(placements), *group_note(placements),
             *cpu_beside_gpu_note(placements), *split_experts_note(placements), *kept_groups_note(placements),
             *contiguous_note(problem.contiguous)]
    return Plan(model_name=graph.meta.model_name, dtype=graph.meta.dtype, objective=objective, strategy="cpsat",
                placements=placements, machine=machine, workload=workload, cost=cost, status=sol.status,
                objective_value=sol.objective_value / scale, best_bound=sol.best_bound / scale, gap=sol.gap,
                solve_time_s=sol.wall_time_s, baselines=tuple(b.result for b in baselines), notes=tuple(notes),
                extra={"scale_ns": sol.scale_ns, "units": sol.units, "coarse_units": sol.coarse_units})


def _baseline_plan(graph: LayerGraph, machine: Machine, workload: Workload, objective: str, strategy: str,
                   baselines: Sequence[ScoredBaseline], model: Any, notes: list[str]) -> Plan:
    chosen = next((b for b in baselines if b.strategy == strategy), None)
    if chosen is None:  # strategy="accelerate" on a bare LayerGraph
        accelerate_device_map(model, machine.max_memory, "auto", dtype=graph.meta.dtype)  # raises the clear error
        raise SolverInputError("strategy='accelerate' needs a transformers model or config")  # pragma: no cover
    if chosen.cost is None:
        raise InfeasiblePlacementError(f"{strategy}: {chosen.result.note}: add a disk device or more memory")
    notes = [*notes, f"{strategy}: accelerate's device_map semantics (cpu/disk units copied to the first GPU "
                     f"synchronously at every forward)"]
    return baseline_plan(graph, machine, workload, objective, strategy, chosen.cost, chosen.device_map or {},
                         notes=notes, baselines=[b.result for b in baselines])


def _is_cluster(devices: Any) -> bool:
    from .hardware.cluster import Cluster

    # a spec string of hosts in parentheses ("2x(h100-sxm*8,cpu)@ib-200g") is a cluster, as plan_pipeline() reads it;
    # one machine's device specs never hold parentheses, a network after "@" ("2xa10@ib-200g"), hosts joined by "+"
    # ("a10+a10") or a host count ("2xa10", the default network): a saved profile's path may, so it stays a path
    if isinstance(devices, Cluster):
        return True
    if not isinstance(devices, str) or os.path.exists(devices):
        return False
    return "(" in devices or "@" in devices or "+" in devices or re.match(r"\s*\d+\s*x", devices) is not None


def _check_cluster_arguments(**given: bool) -> None:
    """solve()'s arguments of one machine's plan that a cluster's pipeline stages do not take: given, they were
    dropped without a word."""
    if dropped := [name for name, set_ in given.items() if set_]:
        raise SolverInputError(f"{', '.join(dropped)} shape{'s' if len(dropped) == 1 else ''} one machine's plan; a "
                               f"cluster is planned as contiguous pipeline stages, the slowest one least, which "
                               f"take{'s' if len(dropped) == 1 else ''} none of them: leave "
                               f"{'it' if len(dropped) == 1 else 'them'} out (or pass a Machine for one host)")


def _pipeline_plan(model: Any, cluster: Any, objective: str, workload: Workload | None) -> Any:
    """``solve(model, cluster, "throughput")``: the exact stage program of issue 16."""
    from .distributed.pipeline_plan import plan_pipeline

    if objective != "throughput":
        raise SolverInputError(f"a cluster is planned as pipeline stages, whose objective is the slowest stage: "
                               f"pass objective='throughput' (got {objective!r}), or a Machine for one host")
    return plan_pipeline(model, cluster, workload)


def searched_again(first: Plan, solve_again: Callable[[float], Plan], extra_s: float = EXTRA_SEARCH_S) -> Plan:
    """The better of ``first`` and ``solve_again(extra_s)`` (lower objective, then lower gap), with a note
    saying what was done: for callers that let the default search run and want more time only where it
    stopped far from its bound (:func:`~placement_opt.report.gap_advice` says when)."""
    again = solve_again(extra_s)
    better = again if (again.objective_value, again.gap) < (first.objective_value, first.gap) else first
    note = (f"the default search stopped at a {first.gap:.1%} gap: searched again for up to {extra_s:g} s "
            f"({again.status}, gap {again.gap:.1%}); this is the {'second' if better is again else 'first'} "
            f"search's plan")
    return dataclasses.replace(better, notes=(*better.notes, note))
