"""The baselines :func:`~placement_opt.planner.solve` prices beside its plan, and the Plan of a device_map.

Each of accelerate's ``device_map`` strategies (``sequential``, ``balanced``, ``balanced_low_0``: placement_opt's
re-implementation, :mod:`placement_opt.solver.greedy`), and the installed library itself when a model is given,
is scored by the cost model with accelerate's run-time semantics (cpu/disk units copied synchronously to the
first GPU): what ``Plan.baselines`` reports, and a warm start for the search where one maps onto the solver's
options. :func:`baseline_plan` turns such a map's cost into a :class:`~placement_opt.plan.Plan` (for
``solve(strategy=...)``, :func:`~placement_opt.compare.compare_strategies` and a given device_map at run time).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .cost.device_map import accelerate_device_map
from .cost.evaluate import Cost
from .cost.workload import Workload
from .errors import SolverInputError
from .hardware.devices import Machine, normalize_device_name
from .model.graph import covering_key
from .plan import NOT_RUN, BaselineResult, Plan, UnitPlacement
from .solver.greedy import STRATEGIES as BASELINE_STRATEGIES
from .solver.greedy import baseline_storage, choice_from_storage
from .solver.problem import PlacementProblem
from .units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .model.graph import LayerGraph

__all__ = ["ScoredBaseline", "score_baselines", "baseline_plan"]


@dataclass(frozen=True)
class ScoredBaseline:
    """One strategy's device_map, its cost under accelerate's run-time semantics, and the solver start it maps to."""

    strategy: str
    device_map: dict[str, Any] | None
    cost: Cost | None
    result: BaselineResult
    hint: list[int] | None


def score_baselines(graph: LayerGraph, machine: Machine, score: Callable[[Any], Cost], problem: PlacementProblem,
               model: Any) -> list[ScoredBaseline]:
    """Each of accelerate's strategies re-implemented, and the installed library's own ``"auto"`` map when ``model``
    is a model (not a graph), scored by ``score``; a map the library cannot make is reported as not run."""
    from .model.graph import LayerGraph

    found = [_score_map(s, baseline_storage(graph, machine, s), graph, machine, score, problem)
             for s in BASELINE_STRATEGIES]
    if not isinstance(model, LayerGraph):
        try:
            device_map = accelerate_device_map(model, machine.max_memory, "auto", dtype=graph.meta.dtype)
        except (ValueError, ImportError, RuntimeError, TypeError) as exc:
            found.append(ScoredBaseline("accelerate", None, None, BaselineResult(
                strategy="accelerate", total_s=float("inf"), fits=False, note=f"{NOT_RUN} {exc}"), None))
        else:
            found.append(_score_map("accelerate", device_map, graph, machine, score, problem))
    return found


def _score_map(strategy: str, device_map: Mapping[str, Any], graph: LayerGraph, machine: Machine,
               score: Callable[[Any], Cost], problem: PlacementProblem) -> ScoredBaseline:
    """Price a storage map as accelerate runs it (cpu/disk units copied synchronously to GPU 0)."""
    named = {k: normalize_device_name(v) for k, v in device_map.items()}
    owner = {u.name: covering_key(u.name, named) for u in graph.units()}
    missing = sorted({d for d in named.values() if d not in machine})
    if missing:
        short = sum(u.weight_bytes for u in graph.units()
                    if owner[u.name] is not None and named[owner[u.name]] in missing)
        note = f"offloads {format_bytes(short)} to {', '.join(missing)}, which the machine lacks"
        return ScoredBaseline(strategy, dict(device_map), None, BaselineResult(
            strategy=strategy, total_s=float("inf"), fits=False, short_bytes=short, note=note), None)
    cost = score(dict(device_map))
    short = sum(v.short_bytes for v in cost.violations)
    note = "; ".join(v.message for v in cost.violations)
    per_unit = {name: named[key] for name, key in owner.items() if key is not None}
    try:
        hint = choice_from_storage(problem, per_unit)
    except SolverInputError:  # a storage none of the unit's options offers: no hint from this map
        hint = None
    return ScoredBaseline(strategy, dict(device_map), cost, BaselineResult(
        strategy=strategy, total_s=cost.total_s, fits=cost.fits, short_bytes=short, note=note), hint)


def baseline_plan(graph: LayerGraph, machine: Machine, workload: Workload, objective: str, strategy: str,
                  cost: Cost, device_map: Mapping[str, Any], *, notes: Sequence[str] = (),
                  baselines: Sequence[BaselineResult] = (), solve_time_s: float = 0.0) -> Plan:
    """The Plan of a device_map run as accelerate runs it (``cost`` from ``evaluate``): status GREEDY, no bound.

    ``objective_value`` is the plan's value under the solver's definition of ``objective``; each
    capacity violation is added to ``notes`` ("does not fit: ...").
    """
    placements = tuple(UnitPlacement(unit=u.name, storage=u.storage, execution=u.execution, mode=u.mode,
                                     copy_group=graph.unit(u.name).block)
                       for u in cost.units)
    value = cost.objective_value(objective, [d.name for d in machine.gpus])
    notes = [*notes, *(f"does not fit: {v.message}" for v in cost.violations)]
    return Plan(model_name=graph.meta.model_name, dtype=graph.meta.dtype, objective=objective, strategy=strategy,
                placements=placements, machine=machine, workload=workload, cost=cost, status="GREEDY",
                objective_value=value, best_bound=0.0, gap=1.0 if value > 0 else 0.0, solve_time_s=solve_time_s,
                baselines=tuple(baselines), notes=tuple(notes), extra={"device_map": dict(device_map)})
