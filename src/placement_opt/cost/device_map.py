"""accelerate ``device_map``s: placements with accelerate's run-time semantics, and the installed library's own map.

Keys may be coarser (prefixes) or finer (submodules) than units; :func:`placements_of` also reads a
placement_opt ``Plan``. :func:`accelerate_device_map` asks the installed transformers/accelerate.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..errors import ModelSpecError, PlanFormatError, SolverInputError
from ..hardware.devices import Machine, normalize_device_name
from ..model.graph import covering_key, keys_below
from ..solver.greedy import STRATEGIES

if TYPE_CHECKING:  # pragma: no cover
    from ..model.graph import LayerGraph

__all__ = ["accelerate_device_map", "placements_of"]


def _few(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _resolve_keys(entries: Mapping[str, Any], graph: LayerGraph) -> dict[str, Any]:
    """Value per unit from keys that may be coarser (prefixes) or finer (submodules) than units.

    A coarser key covers every unit under it (the longest key wins). A unit split by finer keys
    gets the value that holds most of its parameters (each parameter follows its longest matching
    key; ties go to the earliest key in the map): a plan scores whole units. A unit with no
    parameters (buffers only, such as ``rotary_emb``) may be left out, as accelerate allows: it
    goes with the unit before it in execution order (the first such unit with the one after it).
    """
    order = {k: i for i, k in enumerate(entries)}
    below = keys_below(entries)
    resolved: dict[str, Any] = {}
    missing, unplaced = [], []
    for unit in graph.units():
        finer = below.get(unit.name)
        if finer:
            resolved[unit.name] = _vote(entries, order, unit.param_names, finer[0])
            continue
        covering = covering_key(unit.name, entries)
        if covering is not None:
            resolved[unit.name] = entries[covering]
        elif unit.param_bytes == 0 and not unit.param_names:
            unplaced.append(unit.name)
        else:
            missing.append(unit.name)
    if not missing and unplaced:
        resolved = _with_neighbours(graph, resolved, set(unplaced))
    if missing or (unplaced and not resolved):
        raise PlanFormatError(f"the device map places no entry for units {_few(missing or unplaced)}: add them or a "
                         f"covering prefix (e.g. '' for the whole model); map keys: {_few(list(entries))}")
    return resolved


def _with_neighbours(graph: LayerGraph, resolved: Mapping[str, Any], unplaced: set[str]) -> dict[str, Any]:
    """Each parameter-free unit the map leaves out gets the value of the unit before it (else after it)."""
    names = [u.name for u in graph.units()]
    out = dict(resolved)
    previous = None
    pending: list[str] = []
    for name in names:
        if name in unplaced:
            if previous is None:
                pending.append(name)
            else:
                out[name] = previous
            continue
        previous = out[name]
        for early in pending:
            out[early] = previous
        pending = []
    return {name: out[name] for name in names if name in out}


def _vote(entries: Mapping[str, Any], order: Mapping[str, int], param_names: Sequence[str], fallback: str) -> Any:
    """The value holding most of a unit's parameters (ties: the earliest key in the map)."""
    votes: Counter[str] = Counter()
    for param in param_names:
        key = covering_key(param, entries)
        if key is not None:
            votes[key] += 1
    if not votes:
        votes[fallback] = 1
    by_value: Counter[Any] = Counter()
    first: dict[Any, int] = {}
    for key, count in votes.items():
        by_value[entries[key]] += count
        first[entries[key]] = min(first.get(entries[key], len(order)), order[key])
    return max(by_value, key=lambda v: (by_value[v], -first[v]))


def _device_of(value: Any, machine: Machine, key: str) -> str:
    name = normalize_device_name(str(value) if not isinstance(value, int) else value)
    if name not in machine:
        raise PlanFormatError(f"device map entry {key!r} -> {value!r}: {name} is not in the machine "
                         f"({', '.join(machine.names)}); add it to the machine or change the map")
    return name


def _prefill_device(placement: Any) -> str | None:
    prefill = getattr(placement, "prefill_execution", None)
    return normalize_device_name(prefill) if prefill is not None else None


def _placements_from_device_map(device_map: Mapping[str, Any], graph: LayerGraph,
                                machine: Machine) -> dict[str, tuple[str, str, str, str | None]]:
    """accelerate's run-time semantics: cpu/disk entries run on the main GPU with synchronous copies.

    The main device is the first GPU among the map's values (accelerate's ``dispatch_model``);
    with no GPU in the map, ``cpu`` entries compute on the CPU and ``disk`` entries are read to it.
    """
    storage = {k: _device_of(v, machine, k) for k, v in device_map.items()}
    main = next((d for d in storage.values() if d.startswith("cuda:")), None)
    per_unit = _resolve_keys(storage, graph)
    placements = {}
    for unit, device in per_unit.items():
        if device.startswith("cuda:"):
            placements[unit] = (device, device, "resident", None)
        elif main is not None:
            placements[unit] = (device, main, "stream_sync", None)
        elif device == "cpu":
            placements[unit] = (device, device, "resident", None)
        else:
            placements[unit] = (device, "cpu", "stream_sync", None)
    return placements


def placements_of(plan_or_map: Any, graph: LayerGraph,
                  machine: Machine) -> dict[str, tuple[str, str, str, str | None]]:
    """(storage, execution, mode, prefill execution or None) per unit of a Plan (as placed) or a
    device_map (as accelerate runs it)."""
    placements = getattr(plan_or_map, "placements", None)
    if placements is not None:
        entries = {p.unit: (normalize_device_name(p.storage), normalize_device_name(p.execution), p.mode,
                            _prefill_device(p))
                   for p in placements}
        return _resolve_keys(entries, graph)
    if isinstance(plan_or_map, Mapping):
        return _placements_from_device_map(plan_or_map, graph, machine)
    raise PlanFormatError(f"cannot evaluate {type(plan_or_map).__name__}: pass a placement_opt Plan or an "
                     f"accelerate device_map dict like {{'model.embed_tokens': 0, 'model.layers': 'cpu'}}")


def accelerate_device_map(model_or_config: Any, max_memory: Mapping[Any, Any], strategy: str = "auto", *,
                          dtype: str | None = None) -> dict:
    """The device_map the installed transformers/accelerate compute (``from_pretrained``'s path), on meta.

    Example::

        accelerate_device_map(LlamaConfig(...), {0: "20GiB", "cpu": "64GiB"}, "balanced_low_0")

    Args:
        model_or_config: a ``PreTrainedModel`` (any device, meta included) or a ``PretrainedConfig``
            (built on meta with the class the trace builds: causal LM, seq2seq, or an encoder's bare model).
        max_memory: accelerate's ``max_memory`` dict.
        strategy: ``"auto"``, ``"balanced"``, ``"balanced_low_0"`` or ``"sequential"``.
        dtype: the weights' dtype (``"float32"``), as ``from_pretrained(dtype=...)`` builds the model before it
            maps it; default the model's own (a config's ``dtype``).

    Raises:
        SolverInputError: an unknown strategy.
        ModelSpecError: a bare LayerGraph or anything else that is not a transformers model or config.
    """
    accepted = ("auto", *STRATEGIES)
    if strategy not in accepted:
        raise SolverInputError(f"strategy {strategy!r} is not one of {', '.join(accepted)}")
    model = _meta_model(model_or_config, dtype)
    from transformers.integrations.accelerate import _get_device_map  # lazy: imports torch

    with _absent_gpus_unreported():
        return dict(_get_device_map(model, strategy, dict(max_memory), None))


class _AbsentGpuFilter:
    """Drops accelerate's "Device 0 is not available" warning: preset GPUs are meant to be absent."""

    def filter(self, record: Any) -> bool:
        return "is not available, available devices are" not in record.getMessage()


@contextmanager
def _absent_gpus_unreported() -> Iterator[None]:
    """accelerate's ``get_max_memory`` warns for every GPU of ``max_memory`` not on this machine.

    Planning for GPUs described by preset is the point, so that one warning is filtered on its
    logger (``accelerate.utils.modeling``) while the map is computed; every other message passes.
    """
    import logging

    logger = logging.getLogger("accelerate.utils.modeling")
    quiet = _AbsentGpuFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _meta_model(model_or_config: Any, dtype: str | None = None) -> Any:
    """A transformers model on the meta device from a model or a config, of ``dtype`` (None: its own), built with
    the class the trace builds (an encoder's bare model: its names are the graph's units)."""
    try:
        from transformers import PretrainedConfig, PreTrainedModel
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise ModelSpecError("strategy='accelerate' needs transformers installed: pip install transformers") from exc
    from ..model.dtypes import as_torch_dtype, config_dtype, module_dtype

    if isinstance(model_or_config, PreTrainedModel):
        if dtype is None or module_dtype(model_or_config) == as_torch_dtype(dtype):
            return model_or_config
        model_or_config = model_or_config.config  # another dtype: the same model, built anew on meta
    if isinstance(model_or_config, (str, os.PathLike)):  # a preset, a model directory or id: its config
        from ..model._source import config_of

        model_or_config = config_of(model_or_config)
    if not isinstance(model_or_config, PretrainedConfig):
        raise ModelSpecError(
            f"strategy='accelerate' runs the installed library on the model itself, so it needs a "
            f"transformers model or config, not a {type(model_or_config).__name__}: pass the model "
            f"(or its config) to solve(), or use strategy='balanced' on a LayerGraph")
    from ..model._source import _build_on_meta

    return _build_on_meta(model_or_config, as_torch_dtype(dtype) if dtype else config_dtype(model_or_config))
