"""Does a plan fit the model it is applied to? The fingerprint of a model's units and the check.

At solve time :func:`graph_fingerprint` records, per unit, how many parameters it owns, their bytes
and a digest of their names; the plan carries it (``Plan.fingerprint``). At dispatch
:func:`check_plan` computes the same from the model it is given and says what differs: units
missing on either side, parameters no unit of the plan covers, units whose weights have another
size (another model of the same family), before anything is moved.

Example::

    check_plan(model, plan)     # DispatchError: "... model.layers.0: 1.00 MiB in the plan, 4.00 MiB in the model"
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .cost.workload import dtype_bytes
from .errors import PlanMismatchError
from .model.fingerprint import fingerprint_differences, finish, graph_fingerprint, names_digest
from .model.graph import covering_key
from .units import few, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan

__all__ = ["graph_fingerprint", "model_fingerprint", "check_plan", "fingerprint_differences", "MISMATCH_HINT"]

#: What a plan made for another model asks of a Python caller (the command line says it in its own terms).
MISMATCH_HINT = "solve a plan for this model (placement_opt.solve(model, ...))"


def model_fingerprint(model: Any, units: Iterable[str],
                      dtype: str) -> tuple[dict[str, Any], list[str], list[set[str]]]:
    """The fingerprint of ``model`` cut into ``units`` (module names), bytes counted in ``dtype``.

    Returns:
        The fingerprint, the parameters no unit covers, and the groups of units that share a tensor
        (tied weights: which of them counts the tensor is the tracer's choice, so sizes are
        compared per group).
    """
    keys = set(units)
    names: dict[str, list[str]] = {u: [] for u in keys}
    sizes: dict[str, int] = dict.fromkeys(keys, 0)
    uncovered: list[str] = []
    per_element = dtype_bytes(dtype)
    owners: dict[int, set[str]] = {}
    for qname, tensor in model.named_parameters(remove_duplicate=False):
        unit = covering_key(qname, keys)
        if unit is None:
            uncovered.append(qname)
            continue
        names[unit].append(qname)
        if id(tensor) not in owners:  # a tied tensor counts once, on its first owner
            owners[id(tensor)] = set()
            sizes[unit] += int(tensor.numel()) * per_element
        owners[id(tensor)].add(unit)
    entries = {u: {"tensors": len(names[u]), "param_bytes": sizes[u], "names": names_digest(names[u])}
               for u in keys}
    return finish(dtype, entries), uncovered, [g for g in owners.values() if len(g) > 1]


def check_plan(model: Any, plan: Plan) -> None:
    """Refuse ``plan`` for ``model`` when they disagree, with what differs and what to do.

    Always checked: every parameter of the model is covered by a unit of the plan. When the plan
    carries a fingerprint (plans from :func:`placement_opt.solve` of this version): every unit
    owns the same parameters, of the same size, as when the plan was solved.

    Raises:
        DispatchError: the differences (at most five of each kind shown).
    """
    dtype = (plan.fingerprint or {}).get("dtype") or plan.dtype
    try:
        dtype_bytes(dtype)
    except ValueError:
        dtype = "float32"
    actual, uncovered, tied = model_fingerprint(model, (p.unit for p in plan.placements), dtype)
    problems = []
    if uncovered:
        problems.append(f"{len(uncovered)} parameter(s) of the model are in no unit of the plan "
                        f"({few(uncovered)}): the plan misses units of this model")
    if plan.fingerprint is not None:
        differ = fingerprint_differences(plan.fingerprint, actual, tied)
        if differ:
            problems.append(f"{len(differ)} unit(s) differ from the model the plan was solved for ({few(differ)})")
    if (wider := _wider_weights(model, dtype)) is not None:
        problems.append(wider)
    if problems:
        raise PlanMismatchError(f"plan for {plan.model_name!r} does not match this model: {'; '.join(problems)}; "
                                f"{MISMATCH_HINT}")


def _wider_weights(model: Any, dtype: str) -> str | None:
    """Why the model's weights take more memory than the plan counts, or None: most of its floating-point weights
    (by count) are of a wider dtype than the plan's (a float32 model given a float16 plan holds twice the bytes the
    plan's budgets hold). A few wider tensors (norms or routers kept in float32) are not counted against it."""
    counts: dict[Any, int] = {}
    for tensor in {id(t): t for t in model.parameters()}.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + int(tensor.numel())
    if not counts:  # quantized weights only: sized by the checkpoint, not by a float dtype
        return None
    most = max(counts, key=counts.__getitem__)
    planned = dtype_bytes(dtype)
    if most.itemsize <= planned:
        return None
    name = str(most).removeprefix("torch.")
    held = sum(counts.values()) * most.itemsize
    return (f"its weights are {name} ({format_bytes(held)}), the plan counts them in {dtype} "
            f"({format_bytes(sum(counts.values()) * planned)}): convert the model to {dtype} first "
            f"(model.to(torch.{dtype}))")
