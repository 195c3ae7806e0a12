"""Pins: accelerate-style ``{module prefix: device}`` (or shell-style patterns) -> the storage device every
covered unit must use.

The one place pins are checked (``solve()`` and ``build_problem`` both come here).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import SolverInputError
from ..hardware.devices import Machine, normalize_device_name
from ..model.graph import covering_key, keys_below

if TYPE_CHECKING:  # pragma: no cover
    from ..model.graph import LayerGraph

__all__ = ["resolve_pins"]


def resolve_pins(pins: Mapping[str, Any], graph: LayerGraph, machine: Machine) -> dict[str, str]:
    """Accelerate-style pins -> storage device name per unit.

    A plain key covers every unit it names or prefixes (the longest covering key wins). A key with ``*``, ``?``
    or ``[`` is a shell-style pattern (:func:`fnmatch.fnmatchcase`) over unit names and their dotted prefixes:
    ``"model.layers.*.mlp.experts"`` pins every layer's experts (sublayer units), as llama.cpp's
    ``--override-tensor`` does by hand. A unit a plain key covers keeps that key's device; two patterns that
    give one unit different devices are an error.

    Example::

        resolve_pins({"model.layers": 0, "lm_head": "cpu"}, graph, machine)
        # {"model.layers.0": "cuda:0", ..., "lm_head": "cpu"}

    Raises:
        SolverInputError: every bad pin at once: a key or pattern that covers no unit (close unit names are
            listed), a key inside a unit (units are the smallest placeable pieces), a device the machine
            lacks, or a unit two patterns pin to different devices.
    """
    names = graph.names()
    name_set, inside = set(names), keys_below(names)
    problems = []
    devices: dict[str, str] = {}
    patterns: dict[str, str] = {}
    for key, value in pins.items():
        try:
            device = normalize_device_name(value)
        except ValueError as exc:
            problems.append(f"pin {key!r}: {exc}")
            continue
        is_pattern = any(c in key for c in _PATTERN_CHARS)
        if device not in machine:
            problems.append(f"pin {key!r} -> {value!r}: {device} is not in the machine ({', '.join(machine.names)}): "
                            f"pin to one of those, or add {device} to the devices")
        elif is_pattern and not any(_matches(key, n) for n in names):
            problems.append(f"pin pattern {key!r} matches no unit nor a module holding units (units are e.g. "
                            f"{', '.join(names[:4])}); parts of a unit (a decoder layer's mlp at block "
                            f"granularity) are placed with it: pin the unit, or plan at granularity 'sublayer'")
        elif not is_pattern and key not in inside and key not in name_set:
            problems.append(_unknown_pin(key, names))
        (patterns if is_pattern else devices)[key] = device
    resolved = {}
    for name in names:
        key = covering_key(name, devices)
        if key is not None:
            resolved[name] = devices[key]
            continue
        matched = {p: d for p, d in patterns.items() if _matches(p, name)}
        if len(set(matched.values())) > 1:
            problems.append(f"unit {name!r} is pinned to different devices by patterns "
                            f"{', '.join(f'{p!r} -> {d}' for p, d in matched.items())}: make them disjoint, or pin "
                            f"{name!r} by name (a plain key wins over patterns)")
        elif matched:
            resolved[name] = next(iter(matched.values()))
    if problems:
        raise SolverInputError("bad pins:\n  " + "\n  ".join(problems))
    return resolved


_PATTERN_CHARS = "*?["


def _matches(pattern: str, name: str) -> bool:
    """Whether ``pattern`` matches unit ``name`` or one of its dotted prefixes (the module it is inside)."""
    while name:
        if fnmatch.fnmatchcase(name, pattern):
            return True
        cut = name.rfind(".")
        name = name[:cut] if cut >= 0 else ""
    return False


def _unknown_pin(key: str, names: Sequence[str]) -> str:
    owner = next((n for n in names if key.startswith(n + ".")), None)
    if owner is not None:
        return (f"pin {key!r} is inside unit {owner!r}; units are the smallest pieces a plan places: "
                f"pin {owner!r} instead")
    prefixes = sorted({".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)})
    close = difflib.get_close_matches(key, prefixes, n=5, cutoff=0.5)
    hint = f"close names: {', '.join(close)}" if close else f"units are e.g. {', '.join(names[:5])}"
    return f"pin {key!r} names no module of the model; {hint}"
