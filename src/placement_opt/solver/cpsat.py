"""The CP-SAT model of one placement problem: data, variables, constraints, objective, solve, read.

Torch-free. :class:`PlacementModel` reads a :class:`~placement_opt.solver.problem.PlacementProblem`
(plain integers) in the order of the OR-Tools samples; :func:`~placement_opt.solver.search.solve_problem`
decides what to build (coarsening, the hint, the memory objective's two solves) and what to report.
The memory rows are stated in :mod:`._memory_rows`, the latency rows in :mod:`._latency_rows` (mixins
of the model), and the rows the counting relaxations share in :mod:`.rows`.

Variables (``u`` a unit, ``o`` one of its options, ``d`` a device, ``e`` an edge, ``ph`` a phase):

* ``x[u, o]`` is 1 if unit ``u`` uses option ``o`` (exactly one per unit).
* ``n[g, o]`` is the number of units of group ``g`` (identical option menus) that use option ``o``.
* ``z[d, j]`` is 1 if some unit's option puts a transient of at least level ``j`` on ``d``
  (:meth:`~.problem.PlacementOption.peaks`: ``peak_bytes`` on its execution device, and a phased
  option's ``prefill_peak_bytes`` on its prefill device); ``peak[d]`` is the sum of the level steps
  switched on.
* With copy groups, on a device some option copies a group to (:func:`~.problem.device_transients`), per phase
  ``ph`` (a phased option copies and holds its prefill peak in the prefill only): ``copies[ph, r, d]`` is copy
  run ``r``'s group copies to ``d``; ``any[ph, r, d]`` is 1 if they are not 0 (two linear rows on them);
  ``first[ph, r, d] >= copies[ph, r, d]``, and ``>= first[ph, r', d]`` of the next run ``r'`` that may copy
  where ``any`` is 0 (the decode round the cycle; past a prefill's last, the decode's ``first`` of its first
  run): the copies of the first run from ``r`` on that copies, at the least; ``own[r, d]`` the largest own
  peak (:func:`~.problem.phase_peaks`) of a unit of ``r``; ``peak[d] >= own + copies + first`` of the run
  after ``r``, and ``>= own + 2 copies``, instead of the levels.
* ``start[u, d]`` is 1 if ``u`` opens the range of units stored on ``d`` (``contiguous`` only).
* ``used[d, u]`` is 1 once some unit up to ``u`` stores or computes (in either phase) on ``d``
  (interchangeable devices only: their first uses are ordered).
* ``xfer[ph, e]`` is the transfer time of edge ``e`` in phase ``ph`` (0 when both ends
  compute on one device in ``ph``); linearized: ``xfer >= c(p, q) * (on[src, p] + on[dst, q] - 1)``,
  ``on`` the device computing the unit in ``ph`` (:meth:`~.problem.PlacementOption.device_in`).
* ``end[ph, u]`` is the time unit ``u`` finishes in phase ``ph`` (DAGs only, and only where two or
  more edges enter ``u``; elsewhere the finish time is a linear expression, and a chain's longest
  path is the plain sum of durations and transfers).
* ``wait[ph, u]`` is streamed unit ``u``'s stall (:func:`~.problem.stalls`) and ``beside[ph, u]`` the
  time since the previous streamed unit started, through ``u``, capped at the largest copy (which
  leaves every stall as it is): ``beside[u] <= duration[u] + beside[u - 1]``, and
  ``<= duration[u]`` when ``u`` streams (a big-M row on its copy options);
  ``wait[u] >= copy[u] - beside[u - 1]``; cyclic in the decode. Exact: the objective pushes each
  ``beside`` to its largest value, the recurrence's. Only problems with copy options have them.
  With copy runs (``copy_groups``), the same rows per run: durations and copies summed over the run,
  ``streams[ph, r]`` a flag implied by each copying option of the run, the wait on the run's head.
* ``lat[ph]`` is the latency of phase ``ph``: ``>= longest path`` (stalls included), ``>= every
  device's load`` and ``>=`` each of ``SHARED``'s time (copies, host memory, disk) in ``ph``, exactly
  :meth:`PlacementProblem.score`'s maximum.
* ``stage`` is the slowest device's total work, each phase's on the device computing it
  (``throughput`` objective only).

A problem without phased options builds the same variables and rows as before they existed: a
unit's per-phase ``on`` flags are its ``execution`` flags unless one of its options is phased.

Integer time: every ``*_ns`` price is divided by ``scale_ns`` and rounded to the nearest integer
(:meth:`PlacementModel.rounding_slack` bounds the error). Every variable gets the hint's value.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from ortools.sat.python import cp_model

from ._latency_rows import _LatencyRows
from ._memory_rows import _MemoryRows
from .problem import PHASES, PlacementOption, PlacementProblem
from .rows import computes_on, new_solver, own_work, rounding_slack

__all__ = ["PlacementModel", "OutOfTime"]

_PHASES = PHASES


class OutOfTime(Exception):
    """The model's deadline passed while it was being built (a graph too large for the time limit)."""


class PlacementModel(_MemoryRows, _LatencyRows):
    """The CP-SAT model of one problem for one objective, with a hint value for every variable.

    Example::

        m = PlacementModel(problem, scale_ns=1, hint=[0] * len(problem.units))
        m.minimize("latency")
        solver, status = m.solve(time_limit_s=1.0, seed=0, workers=1)
        choice = m.read(solver)
    """

    # -- data ---------------------------------------------------------------------------------
    def __init__(self, problem: PlacementProblem, scale_ns: int, hint: Sequence[int],
                 max_work_ns: int | None = None, device_classes: Sequence[Sequence[str]] = (),
                 deadline: float | None = None) -> None:
        """``max_work_ns`` drops options whose own work exceeds it; ``device_classes`` are classes of
        interchangeable devices (:func:`~.symmetry.identical_devices`), used in their order. Past
        ``deadline`` (a ``time.perf_counter()`` value) building raises :class:`OutOfTime`."""
        self.deadline = deadline
        self.p = problem
        self.scale = scale_ns
        self.hint = list(hint)
        self.chosen = problem.options(self.hint)
        self.index = problem.index()
        self.devices = [d.name for d in problem.devices]
        self.chain = self._is_chain()
        # per phase, every device some option computes on in it: where "elsewhere" is, for transfers
        self._exec_devices = {ph: sorted({o.device_in(ph) for u in problem.units for o in u.options})
                              for ph in _PHASES}
        self.model = cp_model.CpModel()
        self.hints: list[tuple[Any, int]] = []
        self._hint_values: dict[int, int] = {}
        self._own_vars: dict[tuple[tuple[int, int], ...], Any] = {}
        self.peak: dict[str, Any] = {}
        self.goal: Any = 0
        self._on_cache: dict[tuple[int, str, str], Any] = {}
        self._opts_cache: dict[int, list[tuple[int, PlacementOption]]] = {}
        self._phased_cache: dict[int, bool] = {}
        # -- variables --
        self.x = self._option_vars(max_work_ns)
        self.counts = self._count_vars()
        # -- constraints every objective needs --
        self._one_option_per_unit()
        self._capacity_rows()
        self._tied_groups_share_storage()
        self._contiguous_storage()
        self._identical_devices_in_order(device_classes)

    def _t(self, ns: int) -> int:
        """ns -> solver time units, rounded to the nearest."""
        return (ns + self.scale // 2) // self.scale if self.scale > 1 else ns

    def _is_chain(self) -> bool:
        n = len(self.p.units)
        pairs = {(self.index[e.src], self.index[e.dst]) for e in self.p.edges}
        return pairs == {(i, i + 1) for i in range(n - 1)} and len(self.p.edges) == n - 1

    def _hinted(self, var: Any, value: int) -> Any:
        self.hints.append((var, value))
        self._hint_values[var.index] = value
        return var

    def _terms(self, device: str | None = None, phase: str | None = None) -> list[tuple[PlacementOption, Any]]:
        """(option, 0/1 or count expression) over every unit; with ``device``, only the options computing
        there in ``phase`` (in either phase when None)."""
        return [(self.p.units[units[0]].options[o], var) for units, counts in self.counts
                for o, var in counts.items()
                if device is None or computes_on(self.p.units[units[0]].options[o], device, phase)]

    def _opts(self, u: int) -> list[tuple[int, PlacementOption]]:
        """(index, option) of the options unit u may take (cached once x exists)."""
        if u not in self._opts_cache:
            self._opts_cache[u] = [(o, opt) for o, opt in enumerate(self.p.units[u].options) if (u, o) in self.x]
        return self._opts_cache[u]

    def _on(self, u: int, device: str, where: str) -> Any:
        """1 if unit u's storage (``where="storage"``), execution (``"execution"``) or device computing it
        in a phase (``where`` one of PHASES) is ``device``: 0, one x, or a 0/1 variable equal to the sum
        of its options there (cached). One variable keeps the many transfer rows short: rows of
        sums took most of the building time of a 724-unit module graph."""
        key = (u, device, where)
        if key in self._on_cache:
            return self._on_cache[key]
        if where == "decode_ns" or (where == "prefill_ns" and not self._phased(u)):
            flag = self._on(u, device, "execution")  # the decode always, the prefill of a unit never phased
        else:
            terms = [self.x[u, o] for o, opt in self._opts(u) if _place(opt, where) == device]
            flag = terms[0] if len(terms) == 1 else 0
            if len(terms) > 1:
                hinted = int(_place(self.chosen[u], where) == device)
                flag = self._hinted(self.model.new_bool_var(f"on[{u},{device},{where}]"), hinted)
                self.model.add(flag == sum(terms))
        self._on_cache[key] = flag
        return flag

    def _phased(self, u: int) -> bool:
        """Some option unit u may take is phased (its prefill computes elsewhere than its decode)."""
        if u not in self._phased_cache:
            self._phased_cache[u] = any(opt.mode == "phased" for _, opt in self._opts(u))
        return self._phased_cache[u]

    def _duration(self, u: int, ph: str) -> Any:
        return sum(self._t(getattr(opt, ph)) * self.x[u, o] for o, opt in self._opts(u))

    # -- variables ----------------------------------------------------------------------------
    def _option_vars(self, max_work_ns: int | None) -> dict[tuple[int, int], Any]:
        # x[u, o] is 1 if unit u uses option o; pinned-away options and options whose own work
        # (own_work: the most it puts on one device) exceeds max_work_ns (a bound no better solution
        # can exceed) are left out.
        x = {}
        for u, spec in enumerate(self.p.units):
            if u % 256 == 0:
                self._in_time()
            for o, opt in enumerate(spec.options):
                keep = self.p.allows(spec, opt) or self.hint[u] == o
                if max_work_ns is not None and self.hint[u] != o:
                    keep = keep and own_work(opt) <= max_work_ns
                if keep:
                    x[u, o] = self._hinted(self.model.new_bool_var(f"x[{spec.name},{o}]"), int(self.hint[u] == o))
        return x

    def _count_vars(self) -> list[tuple[list[int], dict[int, Any]]]:
        # n[g, o] is the number of units of group g (units with identical option menus and prices,
        # e.g. the decoder layers) that use option o; the capacity rows and work sums read these
        # integer counts, which gives the LP knapsack-style cuts. Exact: n[g, o] = sum of x[u, o].
        by_menu: dict[tuple[PlacementOption, ...], list[int]] = {}
        for u, spec in enumerate(self.p.units):
            by_menu.setdefault(spec.options, []).append(u)
        groups = []
        for k, members in enumerate(by_menu.values()):
            if len(members) == 1:
                u = members[0]
                groups.append(([u], {o: self.x[u, o] for o, _ in self._opts(u)}))
                continue
            counts = {}
            for o, _ in enumerate(self.p.units[members[0]].options):
                terms = [self.x[u, o] for u in members if (u, o) in self.x]
                if terms:
                    n = self._hinted(self.model.new_int_var(0, len(members), f"n[{k},{o}]"),
                                     sum(self.hint[u] == o for u in members))
                    self.model.add(n == sum(terms))
                    counts[o] = n
            groups.append((members, counts))
        return groups

    def _hint_of(self, var: Any) -> int:
        """The value hinted for ``var`` (set with :meth:`_hinted`); a plain number is its own."""
        return var if isinstance(var, int) else self._hint_values[var.index]

    def _range_starts(self, units: Sequence[int], dev: str, where: str, name: str) -> list[Any]:
        # s[u, d] >= on(u, d) - on(previous u, d): 1 where a range of units on d opens.
        starts = []
        for k, u in enumerate(units):
            here = getattr(self.chosen[u], where) == dev
            before = k > 0 and getattr(self.chosen[units[k - 1]], where) == dev
            s = self._hinted(self.model.new_bool_var(f"{name}[{u},{dev}]"), int(here and not before))
            prev = self._on(units[k - 1], dev, where) if k > 0 else 0
            self.model.add(s >= self._on(u, dev, where) - prev)
            starts.append(s)
        return starts

    def _in_time(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise OutOfTime(f"building the model of {len(self.p.units)} units and {len(self.p.edges)} edges")

    # -- constraints --------------------------------------------------------------------------
    def _one_option_per_unit(self) -> None:
        # Every unit takes exactly one allowed option (a pin only allows options storing on its device).
        for u, spec in enumerate(self.p.units):
            self.model.add_exactly_one([self.x[u, o] for o, _ in self._opts(u)])
            if spec.name in self.p.pins:
                for o, opt in self._opts(u):
                    if opt.storage != self.p.pins[spec.name]:
                        self.model.add(self.x[u, o] == 0)

    def _tied_groups_share_storage(self) -> None:
        # Units holding tied parameters store them on one device.
        for group in self.p.tied_groups:
            first = self.index[group[0]]
            for name in group[1:]:
                for dev in self.devices:
                    self.model.add(self._on(first, dev, "storage") == self._on(self.index[name], dev, "storage"))

    def _contiguous_storage(self) -> None:
        # Each device stores one contiguous range of the units with bytes of their own
        # (PlacementProblem.stored_units): at most one range opens on it.
        if not self.p.contiguous:
            return
        for dev in self.devices:
            self.model.add(sum(self._range_starts(self.p.stored_units, dev, "storage", "start")) <= 1)

    def _identical_devices_in_order(self, classes: Sequence[Sequence[str]]) -> None:
        # Symmetry breaking (see symmetry.py): used[d, i] is 1 once some unit <= i stores or computes
        # (in either phase) on d; within a class of interchangeable devices, a later device is never
        # used before an earlier one: used[d_k+1, i] <= used[d_k, i].
        for members in classes:
            used = {d: self._first_use_flags(d) for d in members}
            for a, b in itertools.pairwise(members):
                for fa, fb in zip(used[a], used[b], strict=True):
                    self.model.add(fb <= fa)

    def _first_use_flags(self, dev: str) -> list[Any]:
        flags: list[Any] = []
        seen = False
        for u in range(len(self.p.units)):
            use = sum(self.x[u, o] for o, opt in self._opts(u) if _uses(opt, dev))
            seen = seen or _uses(self.chosen[u], dev)
            f = self._hinted(self.model.new_bool_var(f"used[{dev},{u}]"), int(seen))
            prev = flags[-1] if flags else 0
            self.model.add(f >= prev)
            self.model.add(f >= use)
            self.model.add(f <= prev + use)
            flags.append(f)
        return flags

    # -- objective ----------------------------------------------------------------------------
    def minimize(self, objective: str, latency_cap_ns: int | None = None) -> None:
        """Build what ``objective`` needs and make it the goal.

        ``latency``: lat[prefill] + lat[decode]. ``throughput``: the slowest stage (the lat rows are
        stated too, see below). ``memory``: GPU bytes, with lat[prefill] + lat[decode] <=
        ``latency_cap_ns`` (plus the rounding slack).
        """
        lat = {ph: self._phase_latency(ph) for ph in _PHASES}
        if objective == "throughput":
            # The latency rows do not constrain the slowest stage (lat is free up to its horizon), but
            # they steer CP-SAT's search: without them 13 of the 20 recorded throughput plans change
            # (tests/fixtures/recorded_plans.py; 3 better, 1 worse). Kept until the fixture is re-recorded.
            self.goal = self._slowest_stage()
            return
        latency = lat["prefill_ns"] + lat["decode_ns"]
        if objective == "latency":
            self.goal = latency
            return
        assert latency_cap_ns is not None, "the memory objective needs a latency cap"
        slack = self.rounding_slack("latency") if self.scale > 1 else 0
        self.model.add(latency <= latency_cap_ns // self.scale + slack)
        self.goal = self._gpu_bytes()

    def rounding_slack(self, objective: str) -> int:
        """The most the rounded objective can differ from the exact one, in solver units."""
        return rounding_slack(self.p, objective)

    def unit_scale(self, objective: str) -> int:
        """Objective units per solver unit: ``scale_ns`` for times, 1 for bytes."""
        return 1 if objective == "memory" else self.scale

    # -- solve --------------------------------------------------------------------------------
    def solve(self, time_limit_s: float, seed: int, workers: int,
              gap_limit: float = 0.0) -> tuple[cp_model.CpSolver, Any]:
        """Run CP-SAT on the goal from the hint; returns the solver and its status."""
        self.model.minimize(self.goal)
        for var, value in self.hints:
            self.model.add_hint(var, value)
        solver = new_solver(time_limit_s, seed, workers, gap_limit)
        if len(self.counts) > len(self.p.units) // 2:
            # Mostly distinct units (random or module-level graphs): no count variables tighten the
            # LP, and the full linearization (max_lp) proves gaps that default_lp does not reach in
            # a second; repeated layers do better with default_lp. It takes the full-problem slot
            # (the only one with 1 or 2 workers; LNS shares the second worker). Measured with one
            # worker on benchmarks/solve_time: 23/26 runs <= 1 % gap against 21/26 without it.
            solver.parameters.subsolvers.append("max_lp")
        return solver, solver.solve(self.model)

    # -- read the solution --------------------------------------------------------------------
    def read(self, solver: cp_model.CpSolver) -> list[int]:
        """The option index of every unit in the solver's best solution."""
        return [next(o for o, _ in self._opts(u) if solver.boolean_value(self.x[u, o]))
                for u in range(len(self.p.units))]


def _place(opt: PlacementOption, where: str) -> str:
    """``opt``'s device for ``where``: ``"storage"``, ``"execution"`` or a phase (the device computing it there)."""
    return opt.device_in(where) if where in _PHASES else getattr(opt, where)


def _uses(opt: PlacementOption, device: str) -> bool:
    """``opt`` stores or computes (in either phase) on ``device``: symmetry.first_use's notion of use."""
    return device in (opt.storage, opt.execution, opt.prefill_execution)
