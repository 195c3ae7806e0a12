"""What ``solve()`` accepts: its arguments checked at the boundary, before anything is traced or priced.

Each check raises :class:`~placement_opt.errors.SolverInputError` (or :class:`~placement_opt.errors.TraceError`
for a model with nothing to place) naming the value, what is accepted and an example; the checks that
collect several problems report them all in one message. :data:`STRATEGIES` and :data:`SOLVER_MODES`, the
values they accept, are re-exported by :mod:`placement_opt.planner`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from .cost.workload import Workload
from .errors import SolverInputError, TraceError
from .model.expert_groups import expert_groups_refusal
from .plan import STRATEGIES
from .solver.problem import OBJECTIVES

__all__ = ["STRATEGIES", "SOLVER_MODES", "check_arguments", "check_modes", "check_types", "check_granularity",
           "holds_no_tensors", "nothing_to_place"]

#: Strategies ``solve`` accepts.
#: The modes the solver chooses from (build_problem's default); ``stream_sync`` only scores baselines.
SOLVER_MODES = ("resident", "stream", "phased")


def check_granularity(model: Any, granularity: str | None, expert_groups: int = 1) -> None:
    """A known granularity, and for a traced graph its own (a LayerGraph cannot be cut again); expert groups
    only where sublayer units are traced."""
    from .model.graph import GRANULARITIES, LayerGraph

    if expert_groups != 1 and isinstance(model, LayerGraph):
        raise SolverInputError(f"expert_groups={expert_groups!r} needs the model itself, but a LayerGraph was given: "
                               f"pass the model (or its config), or trace(model, granularity='sublayer', "
                               f"expert_groups=...) first and leave expert_groups out")
    refusal = expert_groups_refusal(expert_groups, granularity, ("sublayer", "auto"))
    if refusal is not None:
        raise SolverInputError(refusal)

    accepted = (*GRANULARITIES, "auto")
    if granularity is not None and granularity not in accepted:
        raise SolverInputError(f"granularity {granularity!r} is not one of {', '.join(accepted)} (or None)")
    if isinstance(model, LayerGraph) and granularity not in (None, model.meta.granularity):
        raise SolverInputError(
            f"granularity={granularity!r} needs the model itself, but a LayerGraph traced at "
            f"{model.meta.granularity!r} was given: pass the model (or its config), or "
            f"trace(model, granularity=...) first and leave granularity out")


def holds_no_tensors(model: Any) -> bool:
    """An ``nn.Module`` (duck-typed: the planner imports no torch) without any parameter or buffer."""
    parameters, buffers = getattr(model, "parameters", None), getattr(model, "buffers", None)
    if not (callable(parameters) and callable(buffers)):
        return False
    return next(iter(parameters()), None) is None and next(iter(buffers()), None) is None


def nothing_to_place(name: str) -> TraceError:
    return TraceError(f"the model {name!r} has no placement units: it holds no parameters or buffers, so "
                      f"there is nothing to place; pass a model with weights (or its config)")


def check_arguments(objective: str, strategy: str, time_limit_s: float, seed: int, gap_limit: float,
                     workers: int) -> None:
    problems = []
    if objective not in OBJECTIVES:
        problems.append(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    if strategy not in STRATEGIES:
        problems.append(f"strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    # True ran as 1 s; infinity with gap_limit 0 could search for ever
    if not _seconds(time_limit_s):
        problems.append(f"time_limit_s must be a positive, finite number of seconds, got {time_limit_s!r}: "
                        f"e.g. 1.0 (default) or 10")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        problems.append(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        problems.append(f"workers must be a positive int, got {workers!r}: 1 for reproducible plans, 2 (default)")
    if not isinstance(gap_limit, (int, float)) or not 0 <= gap_limit < 1:
        problems.append(f"gap_limit must be a fraction in [0, 1), got {gap_limit!r}: e.g. 0.01 for 1 %")
    if problems:
        raise SolverInputError("; ".join(problems))


def _seconds(value: Any) -> bool:
    """A positive, finite number of seconds (an int too large for a float, 10**400, raised OverflowError)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:
        return False


def check_modes(modes: Any) -> tuple[str, ...]:
    chosen = (modes,) if isinstance(modes, str) else tuple(modes) if isinstance(modes, Iterable) else None
    if chosen is None or "resident" not in chosen or any(m not in SOLVER_MODES for m in chosen):
        raise SolverInputError(f"modes must name some of {', '.join(SOLVER_MODES)}, 'resident' included, got "
                               f"{modes!r}: e.g. modes=('resident', 'stream') for plans without phased units")
    return tuple(dict.fromkeys(chosen))  # a mode named twice is one choice, not two options of every unit


def check_types(workload: Any, pins: Any, contiguous: Any, strategy: str) -> None:
    problems = []
    if workload is not None and not isinstance(workload, Workload):
        problems.append(f"workload must be a placement_opt.Workload, got {type(workload).__name__}: "
                        f"e.g. Workload(batch_size=4, prompt_len=512, new_tokens=128)")
    if pins is not None and not isinstance(pins, Mapping):
        problems.append(f"pins must be a dict like {{'lm_head': 'cuda:1'}}, got {type(pins).__name__}")
    elif pins and (keys := [k for k in pins if not isinstance(k, str)]):
        problems.append(f"pins are keyed by module names (or patterns) like 'lm_head', not {keys[0]!r} "
                        f"({type(keys[0]).__name__}): e.g. {{'lm_head': 'cuda:1'}}")
    elif pins and strategy != "cpsat":  # the greedy fills know no pins: a plan that ignored them would say it kept them
        problems.append(f"pins apply to strategy 'cpsat' only: {strategy!r} fills devices as accelerate's "
                        f"device_map strings do, whatever is pinned; drop the pins, or use strategy='cpsat'")
    if not isinstance(contiguous, bool):
        problems.append(f"contiguous must be True or False, got {contiguous!r}")
    if problems:
        raise SolverInputError("; ".join(problems))
