"""placement_opt: decide where every layer of a large model lives and computes, then run it there.

The data flows one way::

    model ──trace──▶ LayerGraph ──cost model──▶ PlacementProblem ──CP-SAT──▶ Plan ──dispatch──▶ model
             (meta forward,        (Machine of Devices,    (warm-started by      (frozen: storage and
              no weights)           Workload)               greedy baselines)     execution per unit)

Public entry points: :func:`trace`, :func:`solve`, :func:`evaluate`, :func:`dispatch`,
:func:`load`, :func:`profile`, and the ``placement-opt`` command.

Names are imported lazily (PEP 562 ``__getattr__``), so ``import placement_opt`` stays cheap and
``import placement_opt.solver`` never imports torch. The stages are folders: ``model/``,
``hardware/``, ``cost/``, ``solver/`` (torch-free), ``runtime/``, ``distributed/``, with
``planner.py`` (``solve()``), ``plan.py`` and ``compare.py`` on top and ``cli/`` the command.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "trace": "model.tracer",
    "LayerGraph": "model.graph",
    "UnitInfo": "model.graph",
    "Device": "hardware.devices",
    "Machine": "hardware.devices",
    "Workload": "cost.workload",
    "evaluate": "cost.evaluate",
    "Cost": "cost.evaluate",
    "profile": "hardware.profiler",
    "solve": "planner",
    "Plan": "plan",
    "dispatch": "runtime.dispatcher",
    "load": "runtime.loader",
    "DispatchedModel": "runtime.dispatcher",
    "BaselineResult": "plan",
    "UnitPlacement": "plan",
    "detect_context": "distributed.context",
    "RuntimeContext": "distributed.context",
    "should_place_on_device": "distributed.rules",
    "Decision": "distributed.rules",
    "resolve_device_map": "distributed.rules",
    "list_models": "model.catalog",
    "model_config": "model.catalog",
    "PlacementError": "errors",
    "InfeasiblePlacementError": "errors",
    "TraceError": "errors",
    "DispatchError": "errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

# Stage packages and modules reachable as attributes (``placement_opt.solver``) without an import.
# No module is named like a function it exports, so importing one never shadows a public name.
_SUBMODULES = ("cli", "compare", "cost", "distributed", "errors", "hardware", "model", "plan", "planner",
               "runtime", "solver", "units")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'placement_opt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

