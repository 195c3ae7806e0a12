"""What the two counting relaxations share: integer time, the three goals, and the CP-SAT run.

Torch-free. :class:`~.aggregate.AggregateModel` (runs of identical units) and
:class:`~.relax.GroupModel` (like units anywhere) differ in what they count and in the path term of
a phase's latency; once each states :meth:`CountedRelaxation._phase` and
:meth:`CountedRelaxation._terms`, the goals and the solve are the same, and live here once.
"""

from __future__ import annotations

from typing import Any

from ortools.sat.python import cp_model

from .cpsat import new_solver, stage_work
from .problem import PlacementOption, PlacementProblem

__all__ = ["CountedRelaxation"]


class CountedRelaxation:
    """Base of the counting relaxations; a subclass sets ``p``, ``scale``, ``model`` and ``peak``."""

    p: PlacementProblem
    scale: int
    """Nanoseconds per solver time unit."""
    model: cp_model.CpModel
    peak: dict[str, Any]
    """Device name -> its transient peak bytes (a linear expression)."""
    goal: Any = 0

    def _terms(self, device: str | None = None, phase: str | None = None) -> list[tuple[PlacementOption, Any]]:
        """(option, count of units on it), for the options computing on ``device`` in ``phase`` (in either
        phase when None; every option when ``device`` is None)."""
        raise NotImplementedError

    def _phase(self, ph: str) -> Any:
        """A lower bound of phase ``ph``'s latency, in solver units."""
        raise NotImplementedError

    def _t(self, ns: int) -> int:
        return (ns + self.scale // 2) // self.scale if self.scale > 1 else ns

    def minimize(self, objective: str, latency_cap_ns: int | None, slack: int) -> None:
        """The goals of :meth:`.cpsat.PlacementModel.minimize`; ``slack`` is the latency's rounding slack
        in solver units, added to the memory objective's latency cap."""
        if objective == "throughput":
            stage = self.model.new_int_var(0, sum(self._t(o.prefill_ns) + self._t(o.decode_ns)
                                                  for u in self.p.units for o in u.options), "stage")
            for dev in (d.name for d in self.p.devices):  # each phase's work on the device computing it
                work = [stage_work(o, dev, self._t) * n for o, n in self._terms(dev)]
                if work:
                    self.model.add(stage >= sum(work))
            self.goal = stage
            return
        latency = self._phase("prefill_ns") + self._phase("decode_ns")
        if objective == "latency":
            self.goal = latency
            return
        assert latency_cap_ns is not None, "the memory objective needs a latency cap"
        self.model.add(latency <= latency_cap_ns // self.scale + (slack if self.scale > 1 else 0))
        gpus = set(self.p.gpu_names())
        terms: list[Any] = [self.peak[g] for g in sorted(gpus)]
        for opt, n in self._terms():
            size = (opt.stored_bytes if opt.storage in gpus else 0) + (opt.resident_bytes if opt.execution in gpus else 0)
            if size:
                terms.append(size * n)
        self.goal = sum(terms)

    def solve(self, time_limit_s: float, seed: int, workers: int, gap_limit: float) -> tuple[cp_model.CpSolver, Any]:
        self.model.minimize(self.goal)
        solver = new_solver(time_limit_s, seed, workers, gap_limit)
        return solver, solver.solve(self.model)
