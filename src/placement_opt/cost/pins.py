"""Pins: accelerate-style ``{module prefix: device}`` -> the storage device every covered unit must use.

The one place pins are checked (``solve()`` and ``build_problem`` both come here).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import SolverInputError
from ..hardware.devices import Machine, normalize_device_name
from ..model.graph import covering_key, keys_below

if TYPE_CHECKING:  # pragma: no cover
    from ..model.graph import LayerGraph

__all__ = ["resolve_pins"]


def resolve_pins(pins: Mapping[str, Any], graph: LayerGraph, machine: Machine) -> dict[str, str]:
    """Accelerate-style pins -> storage device name per unit (the longest covering key wins).

    Example::

        resolve_pins({"model.layers": 0, "lm_head": "cpu"}, graph, machine)
        # {"model.layers.0": "cuda:0", ..., "lm_head": "cpu"}

    Raises:
        SolverInputError: every bad pin at once: a key that covers no unit (close unit names are
            listed), a key inside a unit (units are the smallest placeable pieces), or a device
            the machine lacks.
    """
    names = graph.names()
    name_set, inside = set(names), keys_below(names)
    problems = []
    devices: dict[str, str] = {}
    for key, value in pins.items():
        try:
            device = normalize_device_name(value)
        except ValueError as exc:
            problems.append(f"pin {key!r}: {exc}")
            continue
        if device not in machine:
            problems.append(f"pin {key!r} -> {value!r}: {device} is not in the machine ({', '.join(machine.names)})")
        elif key not in inside and key not in name_set:
            problems.append(_unknown_pin(key, names))
        devices[key] = device
    if problems:
        raise SolverInputError("bad pins:\n  " + "\n  ".join(problems))
    resolved = {}
    for name in names:
        key = covering_key(name, devices)
        if key is not None:
            resolved[name] = devices[key]
    return resolved


def _unknown_pin(key: str, names: Sequence[str]) -> str:
    owner = next((n for n in names if key.startswith(n + ".")), None)
    if owner is not None:
        return (f"pin {key!r} is inside unit {owner!r}; units are the smallest pieces a plan places: "
                f"pin {owner!r} instead")
    prefixes = sorted({".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)})
    close = difflib.get_close_matches(key, prefixes, n=5, cutoff=0.5)
    hint = f"close names: {', '.join(close)}" if close else f"units are e.g. {', '.join(names[:5])}"
    return f"pin {key!r} names no module of the model; {hint}"
