"""placement_opt: decide where every layer of a large model lives and computes, then run it there.

The data flows one way, one stage folder per arrow::

    model ──trace──▶ LayerGraph ──cost──▶ PlacementProblem ──solver──▶ Plan ──runtime──▶ running model
    model/            hardware/ + cost/     solver/ (torch-free)         plan.py  runtime/
                      (Machine, Workload)

The public surface is sixteen names:

==========================  =====================================================================
name                        what it is
==========================  =====================================================================
:func:`trace`               a model, config or preset name -> ``LayerGraph`` (meta device, no weights)
:func:`solve`               model + devices + workload -> :class:`Plan` (CP-SAT, greedy warm start)
:func:`evaluate`            the cost of any plan or accelerate ``device_map`` on the same model
:func:`dispatch`            apply a plan to a loaded model -> :class:`DispatchedModel`
:func:`load`                a checkpoint read straight to each unit's storage -> :class:`DispatchedModel`
:func:`profile`             measure this machine -> :class:`Machine`
:func:`calibrate`           time one unit of each shape of a model here; ``solve()`` then prices with it
:class:`Workload`           what the model is run for (generation, single forward, training)
:class:`Device`             one GPU, the CPU or a disk, with its capacity and speeds
:class:`Machine`            the devices a plan may use
:class:`Plan`               the frozen answer: storage, execution and mode per unit, cost, solver report
:class:`DispatchedModel`    a running model with hooks; ``remove()`` undoes the dispatch
:class:`PlacementError`     base of every error (a ``ValueError``); the others are in ``errors``
:class:`InfeasiblePlacementError`  no placement fits: says which device is short and by how much
:func:`pipeline`            this rank's ``torch.distributed.pipelining`` stage and schedule for a pipeline plan
:class:`Cluster`            hosts (each a :class:`Machine`) and the network: what pipeline stages are planned over
==========================  =====================================================================

Example::

    import placement_opt as po

    devices = {0: "24GiB", "cpu": "64GiB", "disk": "1TB"}
    plan = po.solve("llama-2-7b", devices,
                    workload=po.Workload(batch_size=1, prompt_len=512, new_tokens=128))
    print(plan.summary())                       # where each unit lives, what it costs, the gap

    handle = po.load("out/my-llama", devices, offload_dir="/scratch/offload")  # solve + read weights
    logits = handle(input_ids).logits
    handle.remove()

Everything else lives in its stage, reachable by folder name without an extra import:
``placement_opt.model.graph.LayerGraph``, ``placement_opt.cost.evaluate.Cost``,
``placement_opt.distributed.rules.should_place_on_device``, ``placement_opt.errors.TraceError``,
``placement_opt.model.catalog.list_models`` ... (see docs/architecture.md for the map).

Names are imported lazily (PEP 562 ``__getattr__``), so ``import placement_opt`` stays cheap and
``import placement_opt.solver`` never imports torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "trace": "model.tracer",
    "solve": "planner",
    "evaluate": "cost.evaluate",
    "dispatch": "runtime.dispatcher",
    "load": "runtime.loader",
    "profile": "hardware.profiler",
    "calibrate": "runtime.calibrate",
    "Workload": "cost.workload",
    "Device": "hardware.devices",
    "Machine": "hardware.devices",
    "Plan": "plan",
    "DispatchedModel": "runtime.dispatcher",
    "PlacementError": "errors",
    "InfeasiblePlacementError": "errors",
    "pipeline": "runtime.pipelining",
    "Cluster": "hardware.cluster",
}

# Names that were top-level before the stage layout (issue 11): still resolved, with a
# DeprecationWarning that names their home. Not in __all__; remove in a later release.
_MOVED = {
    "LayerGraph": "model.graph",
    "UnitInfo": "model.graph",
    "list_models": "model.catalog",
    "model_config": "model.catalog",
    "Cost": "cost.evaluate",
    "BaselineResult": "plan",
    "UnitPlacement": "plan",
    "detect_context": "distributed.context",
    "RuntimeContext": "distributed.context",
    "should_place_on_device": "distributed.rules",
    "Decision": "distributed.rules",
    "resolve_device_map": "distributed.rules",
    "TraceError": "errors",
    "DispatchError": "errors",
}

__all__ = [*_EXPORTS, "__version__"]

# Stage packages and modules reachable as attributes (``placement_opt.solver``) without an import.
# No module is named like a function it exports, so importing one never shadows a public name.
_SUBMODULES = ("cli", "compare", "cost", "distributed", "errors", "hardware", "model", "plan", "planner",
               "runtime", "solver", "units")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _MOVED:
        home = f"{__name__}.{_MOVED[name]}"
        warnings.warn(f"placement_opt.{name} moved to {home}.{name}: import it from there",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'placement_opt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*__all__, *_SUBMODULES]
