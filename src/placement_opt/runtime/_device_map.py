"""An accelerate ``device_map`` -> the :class:`~placement_opt.plan.Plan` that runs it as accelerate does.

:func:`placement_opt.dispatch` accepts a plain map (``{"model.embed_tokens": 0, "model.layers": "cpu",
...}``) wherever it accepts a plan. The map is read by the same code that prices it in
:func:`placement_opt.evaluate` (:mod:`placement_opt.cost.device_map`), so a map runs exactly as it is
scored: keys may be prefixes ("" for the whole model), single units or finer submodules (a map that
splits decoder layers is run on the model's sublayer units, attention, MLP and experts apart, as
``solve(granularity="sublayer")`` writes them; a unit still split by finer keys goes where most of
its parameters are, with a warning), and modules with buffers only (such as
``model.rotary_emb``) may be left out (they go with their neighbour). Values are GPU indices,
``"cuda:N"``, ``torch.device``s, ``"cpu"`` or ``"disk"``; run-time semantics are accelerate's:

* a map with a GPU: GPU entries are resident there; ``"cpu"`` and ``"disk"`` entries are stored
  there and execute on the map's first GPU, their weights copied in at each forward (streamed);
* a map of ``"cpu"``/``"disk"`` only: everything computes on the CPU (disk entries from a memory map).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from ..errors import DispatchError, PlacementError
from ..hardware.detect import cuda_device_count
from ..hardware.devices import normalize_device_name
from ..model.graph import LayerGraph, covering_key
from ..plan import Plan
from ..units import few

__all__ = ["plan_from_device_map"]


def plan_from_device_map(model: nn.Module, device_map: Mapping[Any, Any], *, graph: LayerGraph | None = None) -> Plan:
    """The Plan of ``device_map`` on ``model`` with accelerate's run-time semantics (strategy ``"device_map"``).

    ``graph``: the units to place (default ``trace(model)``, decoder layers whole); a sublayer graph of
    ``model`` (``trace(model, granularity="sublayer", expert_groups=...)``) gives a plan of its parts.

    Raises:
        DispatchError: an empty map, a key that names no module or tensor of ``model``, a value that
            is not a device, a GPU this machine lacks, or a unit with weights the map leaves out.
    """
    if not device_map:
        raise DispatchError("the device_map is empty: map '' (the whole model) or its modules to devices, "
                            "e.g. {'': 'cpu'} or {'model.embed_tokens': 0, 'model.layers': 'cpu', 'lm_head': 0}")
    entries = {_key(model, key): value for key, value in device_map.items()}
    _check_keys(model, entries)
    devices = {key: _device(key, value) for key, value in entries.items()}
    _check_gpus(devices)
    try:
        return _plan(model, devices, graph)
    except DispatchError:
        raise
    except PlacementError as exc:
        raise DispatchError(f"cannot dispatch this device_map: {exc}") from exc


def _key(model: nn.Module, key: Any) -> str:
    if not isinstance(key, str):
        raise DispatchError(f"device_map key {key!r} is not a module name: keys are qualified module names of "
                            f"{type(model).__name__} such as 'model.layers.0', or '' for the whole model")
    return key


def _check_keys(model: nn.Module, entries: Mapping[str, Any]) -> None:
    """Every key must be '' or a module, parameter or buffer name of the model."""
    known = {name for name, _ in model.named_modules()}
    known.update(name for name, _ in model.named_parameters(remove_duplicate=False))
    known.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    unknown = [key for key in entries if key and key not in known]
    if unknown:
        tops = sorted({name.split(".")[0] for name in known if name})
        raise DispatchError(f"device_map keys {', '.join(repr(k) for k in unknown[:5])} name no module of "
                            f"{type(model).__name__}: keys are qualified module names (its top-level modules: "
                            f"{', '.join(tops)}), or '' for the whole model")


def _device(key: str, value: Any) -> str:
    try:
        return normalize_device_name(value if isinstance(value, int) else str(value))
    except (PlacementError, ValueError, TypeError) as exc:
        raise DispatchError(f"device_map entry {key!r} -> {value!r} is not a device: values are GPU indices, "
                            f"'cuda:N', 'cpu' or 'disk' ({exc})") from exc


def _check_gpus(devices: Mapping[str, str]) -> None:
    gpus = sorted({d for d in devices.values() if d.startswith("cuda:")})
    count = cuda_device_count()
    absent = [d for d in gpus if int(d.split(":")[1]) >= count]
    if absent:
        raise DispatchError(f"the device_map uses {', '.join(absent)} but this machine has {count} CUDA device(s): "
                            f"map those modules to a GPU it has, or to 'cpu'")


def _plan(model: nn.Module, devices: Mapping[str, str], graph: LayerGraph | None) -> Plan:
    """Trace the model (unless ``graph`` is given), price the map as accelerate runs it, make that a Plan with
    the graph's fingerprint (and, for a sublayer graph, its home device)."""
    import dataclasses

    from ..baselines import baseline_plan
    from ..cost.evaluate import evaluator
    from ..cost.pricing import home_device
    from ..cost.workload import Workload
    from ..hardware.resolve import as_machine
    from ..plan_check import graph_fingerprint

    graph, split = _graph_for(model, devices) if graph is None else (graph, _split_units(graph, devices))
    _warn_split(split)
    names = list(dict.fromkeys([*sorted(d for d in devices.values() if d.startswith("cuda:")), "cpu",
                                *(["disk"] if "disk" in devices.values() else [])]))
    machine = as_machine(names, dtype=graph.meta.dtype)
    workload = Workload()
    cost = evaluator(graph, machine, workload)(dict(devices))
    plan = baseline_plan(graph, machine, workload, "latency", "device_map", cost, dict(devices),
                         notes=["device_map: accelerate's run-time semantics (cpu/disk entries copied to the "
                                "first GPU at every forward; a map without GPU computes on the CPU)"])
    home = home_device(machine) if graph.meta.granularity == "sublayer" else None
    return dataclasses.replace(plan, fingerprint=graph_fingerprint(graph), home=home)


def _split_units(graph: LayerGraph, devices: Mapping[str, str]) -> list[str]:
    """Units whose parameters the map sends to more than one device."""
    split = []
    for unit in graph.units():
        places = {devices[key] for name in unit.param_names if (key := covering_key(name, devices)) is not None}
        if len(places) > 1:
            split.append(unit.name)
    return split


def _graph_for(model: nn.Module, devices: Mapping[str, str]) -> tuple[LayerGraph, list[str]]:
    """The block graph, or the sublayer one where the map splits decoder layers and that splits no more units (a
    sublayer plan's map, experts on disk and attention on a GPU, then runs as it says, not by a vote per layer);
    with the units the map still splits."""
    from ..model.tracer import trace

    block = trace(model)
    split = _split_units(block, devices)
    if not split:
        return block, split
    try:
        fine = trace(model, granularity="sublayer")
    except PlacementError:  # no sublayer units in this model: the block graph and its vote
        return block, split
    fine_split = _split_units(fine, devices)
    return (fine, fine_split) if len(fine_split) <= len(split) else (block, split)  # finer: the vote moves less


def _warn_split(split: list[str]) -> None:
    if split:
        warnings.warn(f"the device_map sends parts of {len(split)} unit(s) ({few(split, 4)}) to different devices: "
                      f"each runs whole where most of its parameters are; map whole modules (a plan's device_map "
                      f"does) to keep them apart", UserWarning, stacklevel=4)
