"""A plan's JSON form: what a :class:`~placement_opt.plan.Plan` writes, and how it is read back.

The plan's fields as JSON (infinite baseline times written as ``null``), the file written whole or not at
all, and the way back: the schema versions this placement_opt reads, the schema check, the message for a file
that is not a plan, and the note on a plan whose placements were edited after it was priced.
:class:`~placement_opt.plan.Plan`'s methods call these.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from ._files import OWN_JSON, foreign_file, loads_json, refusal, write_text_atomic
from .cost.evaluate import Cost
from .cost.workload import DTYPE_NAMES, Workload
from .errors import PlanFormatError
from .hardware.devices import Machine
from .plan import STATUSES, STRATEGIES, BaselineResult, Plan, UnitPlacement
from .schema import PlanSchema, json_kind, json_safe, validated
from .solver.problem import MODES, OBJECTIVES
from .units import few, format_bytes

__all__ = ["EDITED_NOTE", "EDITED_WORKLOAD_NOTE", "EDITED_MACHINE_NOTE", "plan_dict", "plan_json", "read_plan", "plan_from_json"]

_READABLE_VERSIONS = (1, 2)
_FIX = "write it with Plan.to_json() or `placement-opt plan --json`, or solve the plan again"


def plan_dict(plan: Plan) -> dict[str, Any]:
    """What :meth:`Plan.to_dict <placement_opt.plan.Plan.to_dict>` returns."""
    return {
        "schema_version": plan.schema_version,
        "model_name": plan.model_name,
        "dtype": plan.dtype,
        "objective": plan.objective,
        "strategy": plan.strategy,
        "placements": [p.to_dict() for p in plan.placements],
        "machine": plan.machine.to_dict(),
        "workload": plan.workload.to_dict(),
        "cost": plan.cost.to_dict(),
        "status": plan.status,
        "objective_value": plan.objective_value,
        "best_bound": plan.best_bound,
        "gap": plan.gap,
        "solve_time_s": plan.solve_time_s,
        "baselines": [_baseline_dict(b) for b in plan.baselines],
        "notes": list(plan.notes),
        "extra": dict(plan.extra),
        "fingerprint": None if plan.fingerprint is None else dict(plan.fingerprint),
        # only where set: plans of other granularities (and files written before) read and write as before
        **({"home": plan.home} if plan.home is not None else {}),
    }


def plan_json(plan: Plan, path: str | os.PathLike[str] | None = None) -> str:
    """What :meth:`Plan.to_json <placement_opt.plan.Plan.to_json>` returns, and writes to ``path`` when given."""
    text = json.dumps(json_safe(plan.to_dict()), indent=1, allow_nan=False)
    if path is not None:
        if (why := foreign_file(path, "plan")) is not None:  # a user's file there (a config.json) is never lost
            raise PlanFormatError(refusal(path, "plan", why))
        write_text_atomic(path, text)  # an old plan at ``path`` stays whole until this one is
    return text


def read_plan(cls: type[Plan], data: Any, where: str) -> Plan:
    """A plan of class ``cls`` from ``data``, what :meth:`Plan.to_dict <placement_opt.plan.Plan.to_dict>` wrote;
    ``where`` names it in the messages of :class:`~placement_opt.errors.PlanFormatError`."""
    if not isinstance(data, Mapping):
        raise PlanFormatError(f"{where} is a JSON {json_kind(data)}, not an object: pass what "
                              f"Plan.to_dict() or Plan.to_json() wrote")
    version = data.get("schema_version")
    if version is None and OWN_JSON["pipeline plan"](data):
        raise PlanFormatError(f"{where} is a pipeline plan over several machines (placement-opt plan --cluster "
                              f"wrote it), not a one-machine plan: its summary is what plan --cluster printed "
                              f"(PipelinePlan.from_json reads it); explain and run take a plan of plan --devices")
    if version is None and "placements" not in data:
        raise PlanFormatError(f"{where} is not a plan (no schema_version, no placements): pass a file that "
                              f"placement-opt plan --json or Plan.to_json() wrote")
    if isinstance(version, bool) or version not in _READABLE_VERSIONS:  # true == 1 in Python, not in a plan
        raise PlanFormatError(
            f"{where} has schema version {version!r}, which is not supported (this placement_opt reads "
            f"versions {', '.join(map(str, _READABLE_VERSIONS))}): solve the plan again with this version"
        )
    checked = validated(PlanSchema, data, what=where, fix=_FIX, context={
        "modes": MODES, "objectives": OBJECTIVES, "strategies": STRATEGIES, "statuses": STATUSES,
        "dtypes": DTYPE_NAMES})
    try:
        return _from_fields(cls, data, checked)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        if isinstance(err, PlanFormatError):
            raise
        raise PlanFormatError(f"{where} has a malformed entry ({type(err).__name__}: {err}): {_FIX}") from err


def _from_fields(cls: type[Plan], data: Mapping[str, Any], checked: PlanSchema) -> Plan:
    placements = tuple(_placement(p.model_dump()) for p in checked.placements)
    workload = Workload.from_dict(checked.workload.model_dump())
    cost = Cost.from_dict(checked.cost.model_dump(exclude_unset=True))  # as checked: "1e3", "Infinity" as numbers
    machine = Machine.from_dict(data["machine"])
    edited = _edited_note(placements, cost, workload) + _edited_machine_note(machine, cost)
    return cls(
        model_name=checked.model_name,
        dtype=checked.dtype,
        objective=checked.objective,
        strategy=checked.strategy,
        placements=placements,
        machine=machine,
        workload=workload,
        cost=cost,
        status=checked.status,
        objective_value=checked.objective_value,
        best_bound=checked.best_bound,
        gap=checked.gap,
        solve_time_s=checked.solve_time_s,
        baselines=tuple(BaselineResult(**{**b.model_dump(), "total_s": _time(b.total_s)})
                        for b in checked.baselines),
        notes=tuple(checked.notes) + tuple(n for n in edited if n not in checked.notes),
        extra=dict(data.get("extra") or {}),
        fingerprint=None if checked.fingerprint is None else checked.fingerprint.model_dump(),
        home=checked.home,
    )


def _placement(fields: dict[str, Any]) -> UnitPlacement:
    """A placement as read; a ``prefill_execution`` the schema lets a non-phased one name (its own execution) is
    dropped: kept, it showed as "phased" and counted as a streamed unit."""
    if fields["mode"] != "phased":
        fields = {**fields, "prefill_execution": None}
    return UnitPlacement(**fields)


def plan_from_json(cls: type[Plan], text_or_path: str | os.PathLike[str]) -> Plan:
    """What :meth:`Plan.from_json <placement_opt.plan.Plan.from_json>` returns: a plan of class ``cls`` from JSON
    text or from a file path; :class:`~placement_opt.errors.PlanFormatError` names the file and the problem."""
    if not isinstance(text_or_path, str | os.PathLike):
        raise PlanFormatError(f"a plan is read from JSON text or a file path, not a {type(text_or_path).__name__}: "
                              f"give the path of a file written by Plan.to_json() (a dict: Plan.from_dict)")
    text, where = os.fspath(text_or_path), "the plan text"
    if not text.strip():
        raise PlanFormatError("the plan path is empty: give the path of a file written by Plan.to_json() "
                              "or `placement-opt plan --json`, or the JSON text itself")
    if not text.lstrip().startswith(("{", "[")):
        where = f"the plan file {text!r}"
        try:
            with open(text, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as err:
            raise PlanFormatError(f"cannot read {where}: {err.strerror or err}; give the path "
                                  f"of a file written by Plan.to_json() or `placement-opt plan --json`") from err
        except UnicodeDecodeError:
            raise PlanFormatError(f"{where} is not text (not UTF-8): give a file written by Plan.to_json() or "
                                  f"`placement-opt plan --json`") from None
    if not text.strip():  # a file that holds nothing was not cut off JSON: it was never written, or emptied
        raise PlanFormatError(f"{where} is empty: give a file written by Plan.to_json() or `placement-opt plan "
                              f"--json`")
    try:
        data = loads_json(text)
    except json.JSONDecodeError as err:
        # a string still open at the end reports where it started, a number cut after its point ("0.")
        # where the point is: the text ends early all the same
        ends_early = (err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")
                      or re.fullmatch(r"[\w.+-]+", text[err.pos:].strip()) is not None)
        truncated = " (the text ends early: was the file cut off?)" if ends_early else ""
        raise PlanFormatError(f"{where} is not JSON ({err.msg}: line {err.lineno}, column {err.colno})"
                              f"{truncated}: give a file written by Plan.to_json()") from err
    return read_plan(cls, data, where)


def _baseline_dict(b: BaselineResult) -> dict[str, Any]:
    data = vars(b).copy()
    if data["total_s"] == float("inf"):
        data["total_s"] = None  # standard JSON has no Infinity; read back as inf
    return data


#: How the note on a plan whose placements were edited after its figures were computed begins.
EDITED_NOTE = "placements edited after the plan was priced:"


#: How the note on a plan whose workload was edited after its figures were computed begins.
EDITED_WORKLOAD_NOTE = "workload edited after the plan was priced:"

#: How the note on a machine whose memory differs from the one its plan was priced for begins.
EDITED_MACHINE_NOTE = "machine edited after the plan was priced:"


def _edited_note(placements: tuple[UnitPlacement, ...], cost: Cost, workload: Workload) -> tuple[str, ...]:
    """Notes where the file's placements or workload differ from the ones its cost was computed for (a hand edit):
    its times and memory are the plan's before the edit. No placement note for a hand-made plan, which carries no
    per-unit cost."""
    def where(p: Any) -> tuple[str, str, str, str | None]:  # a UnitPlacement's or a UnitCost's
        return p.storage, p.execution, p.mode, p.prefill_execution

    priced = {u.name: where(u) for u in cost.units}
    edited = [p.unit for p in placements if p.unit in priced and priced[p.unit] != where(p)]
    notes = []
    if edited:
        notes.append(f"{EDITED_NOTE} the times and memory shown are of another placement of {few(edited)}; "
                     f"placement-opt run reprices the plan on its checkpoint, and placement_opt.evaluate(plan, model, "
                     f"machine) on its model")
    if workload != cost.workload:  # the summary's workload line is the plan's, its figures the cost's
        solved, shown = asdict(cost.workload), asdict(workload)
        was = ", ".join(f"{k} {solved[k]}" for k in solved if solved[k] != shown[k])
        notes.append(f"{EDITED_WORKLOAD_NOTE} the times and memory shown are of the workload it was solved for "
                     f"({was}), not of the one shown; solve the plan again for this one")
    return tuple(notes)


def _edited_machine_note(machine: Machine, cost: Cost) -> tuple[str, ...]:
    """A note where a device's usable memory differs from the capacity its memory row was counted against (a hand
    edit of the machine): whether the plan fits, and its free memory, are then of the machine before the edit."""
    usable = {d.name: d.usable_bytes for d in machine.devices}
    changed = [f"{m.device} ({format_bytes(usable[m.device])} usable, counted against "
               f"{format_bytes(m.capacity_bytes)})" for m in cost.memory
               if m.device in usable and usable[m.device] != m.capacity_bytes]
    if not changed:
        return ()
    return (f"{EDITED_MACHINE_NOTE} its memory and fit were counted for other capacities of {', '.join(changed)}; "
            f"placement_opt.evaluate(plan, model, plan.machine) counts them again, and solving again plans for it",)


def _time(value: float | None) -> float:
    return float("inf") if value is None else value
