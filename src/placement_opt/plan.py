"""The Plan: a frozen answer to "where does every unit live and compute, and what does it cost".

Stage 5 of the data flow. A plan is a value: it round-trips through JSON with a schema
version, and carries the solver's status, objective, bound, gap and wall time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .cost.evaluate import Cost
from .cost.workload import Workload
from .hardware.devices import Machine
from .model.expert_groups import whole_experts
from .solver.greedy import STRATEGIES as BASELINE_STRATEGIES
from .units import format_bytes, format_seconds, ratio_or_dash, seconds_or_dash

__all__ = ["Plan", "UnitPlacement", "BaselineResult", "PLAN_SCHEMA_VERSION", "STRATEGIES", "STATUSES"]

#: What made a plan: the solver, a greedy device_map baseline, or the installed accelerate's own map.
STRATEGIES = ("cpsat", *BASELINE_STRATEGIES, "accelerate")
#: A plan's status: CP-SAT's (``OPTIMAL`` only at gap 0), or ``GREEDY`` for a baseline.
STATUSES = ("OPTIMAL", "FEASIBLE", "GREEDY")

PLAN_SCHEMA_VERSION = 2
"""2 adds ``fingerprint`` (the model's units, for :func:`~placement_opt.plan_check.check_plan`) and
writes infinite baseline times as ``null``; version 1 files are still read."""


#: How far from the GPUs a storage device is (GPUs 0): an experts module whose groups differ takes the farthest.
_TIER = {"cpu": 1, "disk": 2}


def _accelerate_value(device: str) -> int | str:
    """``"cuda:1"`` -> ``1`` (accelerate's spelling); ``"cpu"`` and ``"disk"`` unchanged."""
    return int(device.split(":")[1]) if device.startswith("cuda:") else device


@dataclass(frozen=True, kw_only=True)
class UnitPlacement:
    """Where one unit's weights live (``storage``) and where it computes (``execution``)."""

    unit: str
    storage: str
    execution: str
    mode: str
    """``resident``, ``stream``, ``stream_sync`` or ``phased`` (see :data:`placement_opt.solver.problem.MODES`)."""
    prefill_execution: str | None = None
    """``phased`` only: where the unit computes in the prefill (its weights streamed there from
    ``storage``); ``execution`` is where it computes in the decode."""
    copy_group: str | None = None
    """The decoder layer a sublayer unit belongs to (the no-split block it was cut from), or None: its own
    group. The dispatcher copies a group's streamed units together, one prefetch per group, and the cost
    model prices them so (:func:`placement_opt.solver.problem.stalls`)."""

    def device_in(self, phase: str) -> str:
        """Where the unit computes in ``phase``: ``"prefill"`` or ``"decode"``."""
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase {phase!r} is not 'prefill' or 'decode'")
        return self.prefill_execution if phase == "prefill" and self.prefill_execution else self.execution

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; ``prefill_execution`` and ``copy_group`` only where set (older plans read as before)."""
        out: dict[str, Any] = {"unit": self.unit, "storage": self.storage, "execution": self.execution,
                               "mode": self.mode}
        if self.prefill_execution is not None:
            out["prefill_execution"] = self.prefill_execution
        if self.copy_group is not None:
            out["copy_group"] = self.copy_group
        return out


#: How a :class:`BaselineResult`'s note starts when the strategy could not be run at all.
NOT_RUN = "not run:"


@dataclass(frozen=True, kw_only=True)
class BaselineResult:
    """How one baseline strategy scored on the same cost model."""

    strategy: str
    total_s: float
    fits: bool
    short_bytes: int = 0
    """Bytes over capacity summed over devices (0 when it fits)."""
    note: str = ""
    """Why it does not fit; for a baseline that could not be run at all, ``"not run: "`` and why."""

    @property
    def ran(self) -> bool:
        """False where the strategy could not be run at all (e.g. ``accelerate`` on a preset name).

        Its ``total_s`` is then infinite and ``fits`` False for want of a figure, and ``note`` says why.
        """
        return not self.note.startswith(NOT_RUN)

    @property
    def why_not_run(self) -> str:
        """The reason a baseline was not run (``note`` without its ``"not run: "``); empty where it ran."""
        return "" if self.ran else self.note.removeprefix(NOT_RUN).strip()


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Storage and execution device of every unit, with its cost and the solver's report.

    A frozen value made by :func:`placement_opt.solve`; read it, print it, save it, apply it.

    Example::

        plan = placement_opt.solve("llama-2-7b", {0: "24GiB", "cpu": "64GiB"})
        print(plan.summary())            # unit runs, memory per device, time per phase, solver
        print(plan.explain())            # why the surprising units sit where they are
        plan.device_map                  # {'model.embed_tokens': 0, ..., 'model.layers.31': 'cpu'}
        plan.to_json("plan.json")        # versioned JSON; Plan.from_json("plan.json") reads it back
        handle = placement_opt.dispatch(model, plan)   # or from_pretrained(device_map=plan.device_map)
    """

    model_name: str
    dtype: str
    objective: str
    """``"latency"``, ``"throughput"`` or ``"memory"``."""
    strategy: str
    """``"cpsat"``, ``"sequential"``, ``"balanced"``, ``"balanced_low_0"`` or ``"accelerate"``."""
    placements: tuple[UnitPlacement, ...]
    """One per unit, in execution order."""
    machine: Machine
    workload: Workload
    cost: Cost
    status: str
    """``"OPTIMAL"``, ``"FEASIBLE"`` (CP-SAT) or ``"GREEDY"`` (a baseline)."""
    objective_value: float
    """The objective in seconds (latency, slowest stage) or bytes (memory)."""
    best_bound: float
    """Proven lower bound of the objective, same unit."""
    gap: float
    """``(objective - bound) / objective``: 0.0 means proven optimal."""
    solve_time_s: float
    baselines: tuple[BaselineResult, ...] = ()
    notes: tuple[str, ...] = ()
    """Things the user should know (coarsening, pins, training offload, distributed context)."""
    schema_version: int = PLAN_SCHEMA_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: Mapping[str, Any] | None = None
    """The units of the model the plan was solved for: per unit, how many parameters it owns, their
    bytes and a digest of their names (:func:`placement_opt.plan_check.graph_fingerprint`); ``None``
    when unknown. :func:`placement_opt.dispatch` compares it with the model it is given."""
    home: str | None = None
    """The device the residual stream stays on; set for sublayer plans (``trace(granularity="sublayer")``):
    the model's inputs and the glue between units stay there, and a unit computed elsewhere receives its
    inputs from it and returns its outputs to it (:func:`placement_opt.cost.pricing.home_device`)."""

    # -- maps in accelerate's vocabulary --------------------------------------------------
    @property
    def device_map(self) -> dict[str, int | str]:
        """Storage device per unit, valid as ``from_pretrained(device_map=...)``/``dispatch_model``.

        Expert groups (``...experts.groups.N``, modules only :func:`~placement_opt.dispatch` makes) are one entry,
        their experts module, on the farthest of their devices from the GPUs (disk, then the CPU): accelerate
        places a module whole, and this way no GPU holds more than the plan gives it (the plan's notes say which).
        """
        out: dict[str, int | str] = {}
        for p in self.placements:
            parsed = whole_experts(p.unit)
            key, value = (parsed[0] if parsed else p.unit), _accelerate_value(p.storage)
            if key not in out or _TIER.get(str(value), 0) > _TIER.get(str(out[key]), 0):
                out[key] = value
        return out

    @property
    def execution_map(self) -> dict[str, str]:
        """Execution device per unit (``"cuda:0"``, ``"cpu"``)."""
        return {p.unit: p.execution for p in self.placements}

    @property
    def max_memory(self) -> dict[int | str, int]:
        """The capacities the plan was solved for, as an accelerate ``max_memory`` dict."""
        return self.machine.max_memory

    @property
    def streams_weights(self) -> bool:
        """True when some unit computes away from its storage (in either phase): needs placement_opt's dispatcher."""
        return any(p.storage != p.execution or p.prefill_execution for p in self.placements)

    def placement(self, unit: str) -> UnitPlacement:
        for p in self.placements:
            if p.unit == unit:
                return p
        raise KeyError(f"unit {unit!r} is not in this plan")

    # -- reading ------------------------------------------------------------------------
    def runs(self) -> list[tuple[list[str], str, str, str]]:
        """Consecutive units sharing (storage, execution, mode): ``(units, storage, execution, mode)``.

        A phased run's mode names its prefill device, ``"phased (prefill on cuda:0)"``; its execution is
        the decode's device.
        """
        out: list[tuple[list[str], str, str, str]] = []
        for p in self.placements:
            mode = f"phased (prefill on {p.prefill_execution})" if p.prefill_execution else p.mode
            key = (p.storage, p.execution, mode)
            if out and out[-1][1:] == key:
                out[-1][0].append(p.unit)
            else:
                out.append(([p.unit], *key))
        return out

    def summary(self) -> str:
        """The plan's tables as text: facts, unit runs, memory per device, baselines, notes.

        The same rows and labels as ``placement-opt plan`` and the HTML report
        (:mod:`placement_opt.report` builds them once); tokens/s are given end to end (prefill
        included) and while decoding.

        Example::

            print(placement_opt.solve(graph, {0: "24GiB", "cpu": "64GiB"}).summary())
        """
        from .report import plan_report, report_text

        return report_text(plan_report(self))

    def _repr_html_(self) -> str:
        """The plan's tables as HTML: how a notebook (Jupyter, VS Code) shows a plan."""
        from .report import plan_report, report_html

        return report_html(plan_report(self))

    def explain(self) -> str:
        """Why the expensive or surprising units sit where they are, and how each baseline compares."""
        c = self.cost
        from .report import gap_advice

        lines = [f"{self.strategy} plan for {self.model_name}: {format_seconds(c.total_s)} for the workload, "
                 f"{'fits' if c.fits else 'does NOT fit'} ({self.status}, gap {self.gap:.1%})."]
        advice = gap_advice(self)
        if advice:
            lines.append(f"- the gap: {advice}")
        lines += self._run_lines()
        if c.copy_s:
            hidden = 1 - c.wait_s / c.copy_s
            grouped = any(p.copy_group for p in self.placements)
            when = ("a layer's streamed sublayer units are copied together, starting when the layer before them "
                    "that streams starts, and the wait is charged to the layer's first unit" if grouped else
                    "each starts when the streamed unit before it does")
            lines.append(f"- streamed weights: {format_seconds(c.copy_s)} of copies run on the prefetch thread beside "
                         f"the compute ({when}; in the decode the last one fetches the next step's first); "
                         f"{hidden:.0%} of it is hidden, {format_seconds(c.wait_s)} is spent waiting for weights.")
        slow = sorted(c.units, key=lambda u: u.prefill_s + u.decode_s + u.wait_s, reverse=True)[:3]
        for u in slow:
            lines.append(f"- {u.name} is among the most expensive units ({format_seconds(u.prefill_s + u.decode_s)}: "
                         f"prefill {format_seconds(u.prefill_s)}, decode {format_seconds(u.decode_s)}) on "
                         f"{u.execution} ({u.mode}, stored on {u.storage}).")
        lines += self._baseline_lines()
        lines += [f"- note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _run_lines(self) -> list[str]:
        """:meth:`explain`'s line for each run of units whose place needs saying (phased, streamed, or computed on
        the CPU beside GPUs): why they sit there, from what each device has free."""
        c = self.cost
        lines = []
        free = {m.device: m.free_bytes for m in c.memory}
        resident = {u.name: u.resident_bytes for u in c.units}
        for units, storage, execution, mode in self.runs():
            span = units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]} ({len(units)} units)"
            if mode.startswith("phased"):
                gpu = mode.removeprefix("phased (prefill on ").rstrip(")")
                # experts and MLPs cache nothing: a KV move said of them sent readers looking for one
                cache = (f"; their KV cache moves to {execution} once, after the prompt"
                         if any(resident.get(u, 0) for u in units) else "")
                lines.append(f"- {span}: weights stay on {storage}; the prompt streams them to {gpu}, which "
                             f"computes many tokens at once far faster, and each decode step computes them on "
                             f"{execution}, which reads them in place faster than {gpu} could receive them "
                             f"({_full(gpu, free)}){cache}.")
            elif storage != execution:
                how = "streamed synchronously" if mode == "stream_sync" else "streamed"
                lines.append(f"- {span}: weights stay on {storage} and are {how} to {execution} at every forward, "
                             f"because {_full(execution, free)}{_faster(execution, storage)}.")
            elif execution == "cpu" and any(m.device.startswith("cuda:") for m in c.memory):
                lines.append(f"- {span}: computed on the CPU: {_full('the GPUs', free)}, and streaming these "
                             f"weights at every step would cost more than computing them on the CPU.")
        return lines

    def _baseline_lines(self) -> list[str]:
        """:meth:`explain`'s line for each baseline: not run and why, or its time and fit against this plan's."""
        lines = []
        for b in self.baselines:
            if not b.ran:
                lines.append(f"- baseline {b.strategy}: not run ({b.why_not_run.rstrip('.')}).")
                continue
            ratio = ratio_or_dash(b.total_s, self.cost.total_s)
            if b.fits:
                lines.append(f"- baseline {b.strategy}: {seconds_or_dash(b.total_s)}, fits, {ratio} this plan's time.")
                continue
            # its time is what it would take had it the memory: a ratio under 1x is no faster plan, it cannot run
            why = b.note.split(": ")[0] if b.note else f"{format_bytes(b.short_bytes)} short"
            lines.append(f"- baseline {b.strategy}: does not fit ({why}), so it would run out of memory; priced as if "
                         f"it fit, {seconds_or_dash(b.total_s)} ({ratio} this plan's time).")
        return lines

    # -- serialising --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        from ._plan_json import plan_dict

        return plan_dict(self)

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """The plan as standard JSON text (no bare ``Infinity``); also written to ``path`` when given (a file
        already there is replaced only once the whole plan is written)."""
        from ._plan_json import plan_json

        return plan_json(self, path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict`'s output.

        Raises:
            PlanFormatError: another schema version, a missing field or a malformed entry; the
                message names it.
        """
        from ._plan_json import read_plan

        return read_plan(cls, data, "the plan")

    @classmethod
    def from_json(cls, text_or_path: str | os.PathLike[str]) -> Plan:
        """Read a plan from JSON text or from a file path.

        Example::

            plan = Plan.from_json("plan.json")      # what plan.to_json("plan.json") wrote

        Raises:
            PlanFormatError: the file cannot be read, is not JSON, or is not a plan of this
                schema version; the message names the file and the problem.
        """
        from ._plan_json import plan_from_json

        return plan_from_json(cls, text_or_path)


def _full(device: str, free: Mapping[str, int]) -> str:
    if device.startswith("cuda:") and device in free:
        return f"{device} has only {format_bytes(max(0, free[device]))} free with the resident units and KV cache"
    owner = f"{device}'" if device.endswith("s") else device  # "the GPUs' memory", "cpu memory"
    return f"{owner} memory is taken by the units that are resident there"


def _faster(execution: str, storage: str) -> str:
    """Why a streamed unit computes on ``execution``, not where it is stored: a disk computes nothing, so a unit
    stored there is weighed against the CPU reading it in place (and said nothing of when the CPU computes it)."""
    if storage.split(":")[0] != "disk":
        return f"; {execution} still computes them faster than {storage} would"
    return "" if execution == "cpu" else f"; {execution} still computes them faster than the CPU would"
