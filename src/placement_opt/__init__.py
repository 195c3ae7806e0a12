"""placement_opt: decide where every layer of a large model lives and computes, then run it there.

The data flows one way::

    model ──trace──▶ LayerGraph ──cost model──▶ PlacementProblem ──CP-SAT──▶ Plan ──dispatch──▶ model
             (meta forward,        (Machine of Devices,    (warm-started by      (frozen: storage and
              no weights)           Workload)               greedy baselines)     execution per unit)

Public entry points: :func:`trace`, :func:`solve`, :func:`evaluate`, :func:`dispatch`,
:func:`load`, :func:`profile`, and the ``placement-opt`` command.

Names are imported lazily, so ``import placement_opt`` stays cheap and the solver side never
imports torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "trace": "trace",
    "LayerGraph": "graph",
    "UnitInfo": "graph",
    "Device": "devices",
    "Machine": "devices",
    "Workload": "workload",
    "evaluate": "cost",
    "Cost": "cost",
    "profile": "profile",
    "solve": "solve",
    "Plan": "plan",
    "dispatch": "dispatch",
    "load": "dispatch",
    "DispatchedModel": "dispatch",
    "BaselineResult": "plan",
    "UnitPlacement": "plan",
    "detect_context": "runtime",
    "RuntimeContext": "runtime",
    "should_place_on_device": "runtime",
    "Decision": "runtime",
    "resolve_device_map": "runtime",
    "list_models": "models",
    "model_config": "models",
    "PlacementError": "errors",
    "InfeasiblePlacementError": "errors",
    "TraceError": "errors",
    "DispatchError": "errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

# Stage modules reachable as attributes (``placement_opt.runtime.detect_context()``) without an import.
_SUBMODULES = ("baselines", "checkpoint", "cli", "cost", "cpsat", "devices", "graph", "models", "offload",
               "plan", "problem", "runtime", "viz", "workload")


class _Package(types.ModuleType):
    """Keeps ``placement_opt.trace`` (and solve, dispatch, profile) the *function*.

    Those stages live in modules of the same name. Importing such a module makes Python set
    the package attribute to the module, which would shadow the function; we drop that one
    assignment (the module stays in ``sys.modules``, so ``import placement_opt.trace`` works).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


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

