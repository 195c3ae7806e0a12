"""The fingerprint of a model's units: what a plan records at solve time to recognise its model later.

Per unit: how many parameters it owns, their bytes (tied ones counted once) and a digest of their names.
:func:`graph_fingerprint` reads a traced graph (torch-free); ``placement_opt.plan_check`` computes the same of
a model it is given, and :func:`fingerprint_differences` says what differs between two.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .graph import LayerGraph

__all__ = ["graph_fingerprint", "fingerprint_differences", "names_digest", "finish"]


def names_digest(names: Iterable[str]) -> str:
    return hashlib.blake2b("\n".join(sorted(names)).encode(), digest_size=8).hexdigest()


def finish(dtype: str, units: dict[str, dict[str, Any]]) -> dict[str, Any]:
    text = "\n".join(f"{u}:{e['tensors']}:{e['param_bytes']}:{e['names']}" for u, e in sorted(units.items()))
    return {"dtype": dtype, "units": units, "digest": hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}


def graph_fingerprint(graph: LayerGraph) -> dict[str, Any]:
    """Per unit of ``graph``: parameters owned, their bytes (tied ones counted once) and a digest of their names."""
    units = {u.name: {"tensors": len(u.param_names), "param_bytes": int(u.param_bytes),
                      "names": names_digest(u.param_names)} for u in graph.units()}
    return finish(graph.meta.dtype, units)


def fingerprint_differences(expected: Mapping[str, Any], actual: Mapping[str, Any],
                            tied: Iterable[set[str]] = ()) -> list[str]:
    """What differs between the plan's fingerprint and the model's, one phrase per difference.

    Units in one ``tied`` group are compared by the sum of their bytes.
    """
    want, got = dict(expected["units"]), dict(actual["units"])
    for group in _merged(tied):
        members = sorted(u for u in group if u in want and u in got)
        if len(members) < 2:
            continue
        label = " + ".join(members)
        for side in (want, got):
            merged = [side.pop(u) for u in members]
            side[label] = {"tensors": sum(e["tensors"] for e in merged),
                           "param_bytes": sum(e["param_bytes"] for e in merged),
                           "names": names_digest(e["names"] for e in merged)}
    out = []
    for unit, e in want.items():
        a = got.get(unit)
        if a is None:
            continue
        if e["tensors"] != a["tensors"] or e["names"] != a["names"]:
            out.append(f"{unit or '(root)'}: {e['tensors']} parameters in the plan, {a['tensors']} in the model "
                       f"{'(other names)' if e['tensors'] == a['tensors'] else ''}".rstrip())
        elif e["param_bytes"] != a["param_bytes"]:
            out.append(f"{unit or '(root)'}: {format_bytes(e['param_bytes'])} of weights in the plan, "
                       f"{format_bytes(a['param_bytes'])} in the model")
    return out


def _merged(groups: Iterable[set[str]]) -> list[set[str]]:
    """Overlapping groups joined (a tensor tied across three units, two tensors tied across one pair)."""
    out: list[set[str]] = []
    for group in groups:
        group = set(group)
        for other in [o for o in out if o & group]:
            out.remove(other)
            group |= other
        out.append(group)
    return out
