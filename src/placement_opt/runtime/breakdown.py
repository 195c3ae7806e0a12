"""Where a dispatched model's time goes, unit by unit, beside what the plan predicted for each unit.

A run that misses its prediction says by how much, not where: a streamed layer waiting for its copy, a CPU
layer slower than its calibration, a move of activations the plan did not count. :func:`time_units` runs one
more greedy generation with a mark at every unit's call (:class:`~._stamps.Stamps`) and sets each unit's
prefill and median decode step beside the plan's figure for it. ``placement-opt run --breakdown`` prints it.

A unit's measured time runs from its call to the next unit's call, so what it waits for before it computes
(its weights' copy, its inputs' move from another device) counts with it, as the plan's wait does; the
model's own work before the first unit (masks, rotary tables) counts with the first. On a GPU the marks are
CUDA events on the first GPU's compute stream, so a GPU unit's time is the GPU's and a CPU unit's the host's
(it waits for its inputs first). The marks cost microseconds per unit: this generation is not the one whose
step time ``placement-opt run`` reports.

Example::

    handle = placement_opt.load("ckpt/", {0: "10GiB", "cpu": "64GiB"}, workload=workload)
    breakdown = time_units(handle, handle.plan.cost, input_ids, new_tokens=16)
    for kind in breakdown.kinds():
        print(kind.kind, kind.predicted_decode_step_s, kind.measured_decode_step_s)
"""

from __future__ import annotations

import functools
import inspect
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._stamps import Stamps
from .timing import _masked, cache_of, last_logits_argument, next_step_inputs

if TYPE_CHECKING:  # pragma: no cover
    from ..cost.evaluate import Cost, UnitCost

__all__ = ["UnitTime", "Breakdown", "time_units", "kind_of"]


@dataclass(frozen=True)
class UnitTime:
    """One unit's (or one kind's: :meth:`Breakdown.kinds`) seconds, predicted by the plan and measured."""

    name: str
    """The unit, or for a kind how many units it has (``"12 units"``)."""
    kind: str
    """How the unit runs (:func:`kind_of`): ``"resident cuda:0"``, ``"stream cpu -> cuda:0"``, ..."""
    predicted_prefill_s: float
    """The plan's prefill seconds of the unit: its compute and its wait for copies."""
    predicted_decode_step_s: float
    """The same for one decode step: the plan's decode seconds of the unit over its steps."""
    measured_prefill_s: float | None
    """None where the run did not call a module of the unit's name."""
    measured_decode_step_s: float | None
    """The median over the decode steps."""

    @property
    def decode_miss_s(self) -> float:
        """Measured less predicted seconds per decode step (0 where not measured)."""
        if self.measured_decode_step_s is None:
            return 0.0
        return self.measured_decode_step_s - self.predicted_decode_step_s


@dataclass(frozen=True)
class Breakdown:
    """Every unit of a plan, its predicted and measured seconds, and the whole forwards' for scale."""

    units: tuple[UnitTime, ...]
    prefill_s: float
    """The measured prefill, all units and the glue between them."""
    decode_step_s: float
    """The measured median decode step."""
    predicted_prefill_s: float
    """The plan's prefill: its units, and what no unit carries (activations moved between devices; the
    phase's floor where host memory, shared by copies and the CPU's reads, is the bottleneck)."""
    predicted_decode_step_s: float
    predicted_transfer_s: float
    """Of the plan's prefill and decode: the activation moves between devices, in no unit's figure."""

    def kinds(self) -> list[UnitTime]:
        """The units summed per kind (units not measured are left out of both sums), in plan order of first
        appearance."""
        by_kind: dict[str, list[UnitTime]] = {}
        for unit in self.units:
            by_kind.setdefault(unit.kind, []).append(unit)
        return [_summed(kind, units) for kind, units in by_kind.items()]

    def misses(self, count: int = 5) -> list[UnitTime]:
        """The ``count`` measured units whose decode step is furthest from its prediction, worst first."""
        measured = [u for u in self.units if u.measured_decode_step_s is not None]
        return sorted(measured, key=lambda u: -abs(u.decode_miss_s))[:count]

    @property
    def untimed(self) -> tuple[str, ...]:
        """Units of the plan the run did not call by name (a unit the model never calls, or one that is no module)."""
        return tuple(u.name for u in self.units if u.measured_prefill_s is None and u.measured_decode_step_s is None)

    def to_dict(self) -> dict[str, Any]:
        fields = ("name", "kind", "predicted_prefill_s", "predicted_decode_step_s", "measured_prefill_s",
                  "measured_decode_step_s")
        return {"prefill_s": self.prefill_s, "decode_step_s": self.decode_step_s,
                "predicted_prefill_s": self.predicted_prefill_s,
                "predicted_decode_step_s": self.predicted_decode_step_s,
                "predicted_transfer_s": self.predicted_transfer_s,
                "kinds": [{f: getattr(k, f) for f in fields} for k in self.kinds()],
                "units": [{f: getattr(u, f) for f in fields} for u in self.units]}


def kind_of(unit: UnitCost) -> str:
    """How a unit runs, in words short enough for a table: its mode, and where its weights go from and to."""
    if unit.mode == "phased":
        return f"phased {unit.storage} -> {unit.prefill_execution} / {unit.execution}"
    if unit.storage == unit.execution:
        return f"{unit.mode} {unit.execution}"
    return f"{unit.mode} {unit.storage} -> {unit.execution}"


def time_units(model: Any, cost: Cost, input_ids: torch.Tensor, new_tokens: int,
               attention_mask: torch.Tensor | None = None, before_each: Callable[[], None] | None = None) -> Breakdown:
    """Greedy generation of ``new_tokens`` tokens after ``input_ids`` by ``model`` (a dispatched model: a
    :class:`~.dispatcher.DispatchedModel` or the model it wraps), every unit of ``cost`` (the plan's, or one
    priced again for this run) marked, and each unit's seconds set beside the plan's.

    ``attention_mask`` and ``before_each`` (run before every forward, unmarked: ``handle.drop_disk_cache`` for
    cold disk reads) as :func:`~.timing.time_generation` takes them.
    Raises ValueError for a prompt or token count it cannot time (before any forward runs).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0 or new_tokens < 2:
        raise ValueError(f"input_ids must be batch x prompt tokens (got shape {tuple(input_ids.shape)}) and "
                         f"new_tokens at least 2, so that a decode step is timed (got {new_tokens})")
    network = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model
    present = dict(network.named_modules())
    modules = {u.name: present[u.name] for u in cost.units if u.name in present}
    stamps = Stamps(modules, _marking_device(cost.units))
    try:
        prefill, steps = _generate(model, stamps, input_ids, new_tokens, attention_mask, before_each)
    finally:
        stamps.close()
    return _set_beside(cost, prefill, steps)


def _marking_device(units: Iterable[UnitCost]) -> torch.device:
    """The first GPU any unit computes on (in either phase), else the CPU: where the marks are taken."""
    for unit in units:
        for device in (unit.execution, unit.prefill_execution):
            if device is not None and device.startswith("cuda") and torch.cuda.is_available():
                return torch.device(device)
    return torch.device("cpu")


def _generate(model: Any, stamps: Stamps, input_ids: torch.Tensor, new_tokens: int, attention_mask: torch.Tensor | None,
              before_each: Callable[[], None] | None) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(per-unit seconds of the prefill, of each decode step), as :func:`~.timing.time_generation` generates."""
    positioned = attention_mask is not None and "position_ids" in inspect.signature(model.forward).parameters
    before_each = before_each or (lambda: None)
    steps = []
    with torch.inference_mode():
        before_each()
        prefill, out = stamps.run(functools.partial(model, input_ids=input_ids, use_cache=True,
                                                    **last_logits_argument(model),
                                                    **_masked(attention_mask, positioned)))
        for _ in range(new_tokens - 1):
            inputs, attention_mask = next_step_inputs(model, out.logits[:, -1:].argmax(-1), cache_of(out),
                                                      attention_mask, positioned)
            call = functools.partial(model, **inputs)
            out = None  # the step's output is not held while the next runs
            before_each()
            step, out = stamps.run(call)
            steps.append(step)
    return prefill, steps


def _set_beside(cost: Cost, prefill: Mapping[str, float], steps: list[dict[str, float]]) -> Breakdown:
    per_step = max(1, cost.workload.new_tokens)
    units = [UnitTime(name=unit.name, kind=kind_of(unit),
                      predicted_prefill_s=unit.prefill_s + unit.wait_prefill_s,
                      predicted_decode_step_s=(unit.decode_s + unit.wait_decode_s) / per_step,
                      measured_prefill_s=prefill.get(unit.name),
                      measured_decode_step_s=_per_step(unit.name, steps))
             for unit in cost.units]
    totals = [sum(step.values()) for step in steps]
    return Breakdown(units=tuple(units), prefill_s=sum(prefill.values()),
                     decode_step_s=statistics.median(totals) if totals else 0.0,
                     predicted_prefill_s=cost.prefill_s, predicted_decode_step_s=cost.decode_s / per_step,
                     predicted_transfer_s=cost.transfer_s)


def _per_step(name: str, steps: list[dict[str, float]]) -> float | None:
    """A unit's seconds per decode step: the median where every step called it; where only some did (a group
    of experts the router sent no token to), the mean with the others at 0, as the plan prices it."""
    called = [step[name] for step in steps if name in step]
    if not called:
        return None
    if len(called) == len(steps):
        return statistics.median(called)
    return sum(called) / len(steps)


def _summed(kind: str, units: list[UnitTime]) -> UnitTime:
    """One row for a kind: the sums of its units' figures, each sum over the units measured in that phase."""
    prefill = [u for u in units if u.measured_prefill_s is not None]
    decode = [u for u in units if u.measured_decode_step_s is not None]
    return UnitTime(
        name=f"{len(units)} unit{'s' if len(units) != 1 else ''}", kind=kind,
        predicted_prefill_s=sum(u.predicted_prefill_s for u in prefill or units),
        predicted_decode_step_s=sum(u.predicted_decode_step_s for u in decode or units),
        measured_prefill_s=sum(u.measured_prefill_s or 0.0 for u in prefill) if prefill else None,
        measured_decode_step_s=sum(u.measured_decode_step_s or 0.0 for u in decode) if decode else None)
