"""Every strategy priced side by side: placement_opt's plan, the greedy baselines, and the installed accelerate.

:func:`compare_strategies` solves one problem with each strategy and returns a
:class:`StrategyOutcome` per strategy (its plan, or why it produced none); the ``placement-opt
compare`` command only renders them (:mod:`placement_opt.cli.tables`, :mod:`placement_opt.cli.pictures`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .cost.workload import Workload
    from .hardware.devices import Machine
    from .plan import Plan

__all__ = ["STRATEGIES", "StrategyOutcome", "compare_strategies", "solve_strategy", "objective_value", "one_line"]

#: Every strategy ``compare`` runs, in display order.
STRATEGIES = ("cpsat", "sequential", "balanced", "balanced_low_0", "accelerate")


def solve_strategy(graph: Any, machine: Machine, *, objective: str, workload: Workload, strategy: str,
                   time_limit_s: float | None, source: Any = None, modes: Sequence[str] | None = None,
                   granularity: str | None = None, pins: Mapping[str, Any] | None = None,
                   expert_groups: int = 1, contiguous: bool = False, sublayer: Any = None) -> Plan:
    """One strategy's plan for the traced graph (what ``placement-opt plan`` renders).

    ``solve`` on the graph (``modes``: the solver's choices, default solve's); ``accelerate`` asks the
    installed library with ``source`` (the model or config the graph was traced from);
    ``granularity="auto"`` traces ``source`` at sublayer granularity too (``graph`` is its block graph,
    at the same dtype; ``sublayer``: that graph when the caller has it) and keeps the better plan;
    ``contiguous``: each device stores one range of units.
    """
    if strategy == "accelerate":
        return _accelerate_plan(source, graph, machine, objective=objective, workload=workload)
    from .planner import solve

    kwargs: dict[str, Any] = {"workload": workload, "strategy": strategy}
    if time_limit_s is not None:
        kwargs["time_limit_s"] = time_limit_s
    if modes is not None:
        kwargs["modes"] = modes
    if pins:
        kwargs["pins"] = pins
    if contiguous:
        kwargs["contiguous"] = True
    if granularity == "auto":
        from .planner import solve_best_granularity

        if sublayer is None:  # imports torch: not when the caller has the graph (the CLI's cache)
            from .model.tracer import trace

            sublayer = trace(source, dtype=graph.meta.dtype, granularity="sublayer", expert_groups=expert_groups)
        return solve_best_granularity(graph, sublayer, machine, objective, **kwargs)
    return solve(graph, machine, objective, **kwargs)


def _accelerate_plan(source: Any, graph: Any, machine: Machine, *, objective: str,
                     workload: Workload) -> Plan:
    """The installed transformers' ``device_map="auto"``, scored with accelerate's run-time semantics.

    Same as ``solve(source, strategy="accelerate")`` but reuses the traced graph instead of
    tracing the model again (seconds for a 70B model).
    """
    from .baselines import baseline_plan
    from .cost.device_map import accelerate_device_map
    from .cost.evaluate import evaluate
    from .errors import SolverInputError

    if source is None:
        raise SolverInputError("strategy 'accelerate' needs the model's config, not only its graph: pass source=")
    started = time.perf_counter()
    device_map = accelerate_device_map(source, machine.max_memory, "auto", dtype=graph.meta.dtype)
    cost = evaluate(device_map, graph, machine, workload)
    note = ("device_map='auto' of the installed transformers/accelerate, run as accelerate runs it "
            "(cpu/disk units copied to the first GPU synchronously at every forward)")
    return baseline_plan(graph, machine, workload, objective, "accelerate", cost, device_map, notes=[note],
                         solve_time_s=time.perf_counter() - started)


def compare_strategies(
    graph: Any,
    machine: Any,
    *,
    objective: str = "latency",
    workload: Workload | None = None,
    strategies: Sequence[str] = STRATEGIES,
    time_limit_s: float | None = None,
    source: Any = None,
) -> list[StrategyOutcome]:
    """Solve the same problem with every strategy and return one outcome per strategy.

    A strategy that raises gets an outcome with ``error`` set instead of a plan, so one failure never
    hides the others: ``ran`` True where it found no placement that fits, False where it could not be
    run at all (bad input, or the installed library refuses).

    Example::

        config = models.model_config("llama-2-7b")
        graph = placement_opt.trace(config)
        for o in compare_strategies(graph, "cuda:0=t4,cpu=64GiB,disk", source=config):
            print(o.strategy, o.fits, o.total_s)

    Args:
        graph: the traced :class:`~placement_opt.model.graph.LayerGraph`.
        machine: a ``Machine`` or anything :func:`~placement_opt.hardware.resolve.as_machine` accepts.
        objective: ``"latency"``, ``"throughput"`` or ``"memory"``.
        workload: default ``Workload()``.
        strategies: which strategies, in display order (default :data:`STRATEGIES`).
        time_limit_s: CP-SAT's time limit (default: ``solve``'s).
        source: the transformers config or model the graph was traced from; needed by the
            ``accelerate`` strategy (the installed library computes its map from the model).

    Returns:
        One :class:`StrategyOutcome` per strategy, in order.
    """
    from .cost.workload import Workload
    from .errors import InfeasiblePlacementError, PlacementError
    from .hardware.resolve import as_machine

    machine = as_machine(machine, dtype=graph.meta.dtype)
    workload = workload or Workload()
    outcomes = []
    for strategy in strategies:
        try:
            plan = solve_strategy(graph, machine, objective=objective, workload=workload, strategy=strategy,
                          time_limit_s=time_limit_s, source=source)
        except (PlacementError, ValueError, ImportError, RuntimeError) as exc:
            outcomes.append(StrategyOutcome(strategy=strategy, error=one_line(exc),
                                            ran=isinstance(exc, InfeasiblePlacementError)))
        else:
            outcomes.append(StrategyOutcome(strategy=strategy, plan=plan))
    return outcomes


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (its class name when it has none)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


@dataclass(frozen=True, kw_only=True)
class StrategyOutcome:
    """One strategy's result in a comparison: its plan, or why it produced none."""

    strategy: str
    plan: Plan | None = None
    """The plan (also for a baseline that runs out of memory: its cost lists the violations)."""
    error: str = ""
    """Why there is no plan (e.g. the solver proved the problem infeasible)."""
    ran: bool = True
    """False where the strategy could not be run at all (its input or the installed library refused; ``error``
    says why), as opposed to one that ran and found no placement that fits."""

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.cost.fits

    @property
    def total_s(self) -> float | None:
        return None if self.plan is None else self.plan.cost.total_s


def objective_value(plan: Plan, objective: str) -> float:
    """The number ``objective`` minimises, read off a plan's cost (lower is better).

    The solver's one definition (:func:`placement_opt.solver.problem.objective_value`): ``latency``:
    prefill + decode seconds; ``throughput``: the slowest device's total work (seconds); ``memory``:
    bytes used on the GPUs (0 on a machine without one).
    """
    return plan.cost.objective_value(objective, [d.name for d in plan.machine.gpus])
