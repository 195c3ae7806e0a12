"""The CP-SAT model of one placement problem: data, variables, constraints, objective, solve, read.

Torch-free. :class:`PlacementModel` reads a :class:`~placement_opt.solver.problem.PlacementProblem`
(plain integers) in the order of the OR-Tools samples; :func:`~placement_opt.solver.search.solve_problem`
decides what to build (coarsening, the hint, the memory objective's two solves) and what to report.

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

import bisect
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

from ortools.sat.python import cp_model

from .problem import (
    PHASES,
    DeviceSpec,
    PlacementOption,
    PlacementProblem,
    Transient,
    device_transients,
    next_copies,
    phase_copies,
    phase_peaks,
    stalls,
)

__all__ = ["PlacementModel", "DETERMINISTIC_TIME_PER_S", "OutOfTime", "new_solver", "rounding_slack", "add_capacity_row", "add_level_caps", "peak_levels",
           "computes_on", "stage_work", "own_work", "peak_flags"]

#: CP-SAT deterministic time per second of time limit. The search stops at whichever limit comes
#: first; this one comes first on this project's 2-core VMs (about 0.35-0.4 units accrue per second
#: with one worker), and a one-worker search stopped by it returns the same plan on every run.
DETERMINISTIC_TIME_PER_S = 0.3
#: add_level_caps states its rows for the units at least as large as each of this many largest sizes.
LEVEL_CAP_SIZES = 2
_PHASES = PHASES


class OutOfTime(Exception):
    """The model's deadline passed while it was being built (a graph too large for the time limit)."""


class PlacementModel:
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

    def _transients(self, options: Any) -> dict[str, list[tuple[int, Any]]]:
        """Device -> (transient bytes, x or 1) of each of ``options`` ((x, option) pairs) putting one there
        (peaks(): the execution device's, and a phased option's prefill device's), in order; one pass."""
        out: dict[str, list[tuple[int, Any]]] = {d: [] for d in self.devices}
        for var, opt in options:
            for d, nbytes in opt.peaks_apart():
                out[d].append((nbytes, var))
        return out

    def _peak(self, dev: str, flagged: list[tuple[int, Any]], hinted: int) -> Any:
        # peak[d] from level flags (see peak_levels); x[u, o] switches on the level of each transient its
        # option puts on d; ``hinted``: the hint's peak there.
        peak, levels, z = peak_levels(self.model, dev, flagged)
        for level, zj in zip(levels, z, strict=True):
            self._hinted(zj, int(hinted >= level))
        return peak

    def _run_peak(self, dev: str, hinted: Transient | None) -> Any:
        # device_transients as rows, per phase: copies[ph, r, d] = run r's group copies to d in ph; the next
        # copying run's (_next_chain; a prefill's last wraps to the decode's first); peak[d] >= own[r] (the
        # largest own peak in ph of a unit of r, phase_peaks) + copies + the larger of the next and the copies,
        # as two rows.
        top = max((n for u in range(len(self.p.units)) for _, opt in self._opts(u) for d, n in opt.peaks_apart()
                   if d == dev), default=0)
        most = max((opt.group_copy_bytes for u in range(len(self.p.units)) for _, opt in self._opts(u)
                    if opt.group_copy_bytes and opt.group_device == dev), default=0)
        most *= max(b - a for a, b in self.p.runs)
        peak = self._hinted(self.model.new_int_var(0, top + 2 * most, f"peak[{dev}]"),
                            hinted.total_bytes if hinted else 0)
        wrap: Any = 0
        own = {phase: [self._run_own(dev, phase, a, b) for a, b in self.p.runs] for phase in ("decode_ns", "prefill_ns")}
        for phase in ("decode_ns", "prefill_ns"):
            rows, chain = [], []
            for r, (a, b) in enumerate(self.p.runs):
                copying = [(u, o, opt) for u in range(a, b) for o, opt in self._opts(u)
                           if phase_copies(opt, phase) and opt.group_device == dev]
                run = None
                if copying:
                    run, bound = self._copies(f"copies[{phase},{a},{dev}]", copying, a, b)
                    chain.append((r, run, bound, copying))
                if own[phase][r] is not None or run is not None:
                    rows.append((r, own[phase][r], run))
            if not chain:
                for _, mine, _ in rows:
                    self.model.add(peak >= mine)
                continue
            head, first = self._next_chain(dev, phase, chain, wrap if phase == "prefill_ns" else None)
            wrap = first
            for r, mine, run in rows:
                base = (mine if mine is not None else 0) + (run if run is not None else 0)
                self.model.add(peak >= base + head(r))
                if run is not None:  # the next copies count at least as the run's own
                    self.model.add(peak >= base + run)
        return peak

    def _run_own(self, dev: str, phase: str, a: int, b: int) -> Any:
        # The largest own peak on dev (phase_peaks) of the run's units a..b-1 in phase: an expression, or None
        # when no option of theirs computes there. The phases share one variable where their peaks agree.
        terms = [(n, self.x[u, o]) for u in range(a, b) for o, opt in self._opts(u)
                 for d, n in phase_peaks(opt, phase) if d == dev and n > 0]
        if not terms:
            return None
        if len(terms) == 1:
            return terms[0][0] * terms[0][1]
        key = tuple(sorted((n, x.index) for n, x in terms))
        if key not in self._own_vars:
            hint = max((n for n, x in terms if self._hint_of(x)), default=0)
            var = self._hinted(self.model.new_int_var(0, max(n for n, _ in terms), f"own[{a},{dev}]"), hint)
            for n, x in terms:
                self.model.add(var >= n * x)
            self._own_vars[key] = var
        return self._own_vars[key]

    def _copies(self, name: str, copying: list[tuple[int, int, PlacementOption]], a: int, b: int) -> tuple[Any, int]:
        # A run's group copies to a device in a phase, as a variable (sum of its copying options' bytes x), and
        # its bound.
        most = sum(max((opt.group_copy_bytes for v, _, opt in copying if v == u), default=0) for u in range(a, b))
        hint = sum(opt.group_copy_bytes for u, o, opt in copying if self.hint[u] == o)
        var = self._hinted(self.model.new_int_var(0, most, name), hint)
        self.model.add(var == sum(opt.group_copy_bytes * self.x[u, o] for u, o, opt in copying))
        return var, most

    def _next_chain(self, dev: str, phase: str, chain: list[tuple[int, Any, int, list[tuple[int, int, PlacementOption]]]],
                    wrap: Any) -> tuple[Callable[[int], Any], Any]:
        # first[j] >= copies[j] and, where run j copies nothing (any[j] = 0, which copies[j] > 0 rules out),
        # >= first[j + 1], round the cycle (wrap None) or, past the last, >= ``wrap``: at the least, the copies of
        # the first copying run from j on. Returns (run r -> the next copies after r, first[0]).
        values = [self._hint_of(copies) for _, copies, _, _ in chain]
        after = next_copies(values, None if wrap is None else self._hint_of(wrap))
        most = max(m for _, _, m, _ in chain)
        first = [self._hinted(self.model.new_int_var(0, most, f"first[{phase},{r},{dev}]"), values[j] or after[j])
                 for j, (r, *_) in enumerate(chain)]
        for j, (r, copies, bound, copying) in enumerate(chain):
            any_ = self._hinted(self.model.new_bool_var(f"any[{phase},{r},{dev}]"), int(values[j] > 0))
            least = min(opt.group_copy_bytes for _, _, opt in copying)
            self.model.add(copies <= bound * any_)  # copying sets it ...
            self.model.add(copies >= least * any_)  # ... and only copying
            self.model.add(first[j] >= copies)
            following = first[(j + 1) % len(chain)] if wrap is None or j + 1 < len(chain) else wrap
            if not isinstance(following, int):  # a wrap of 0: no decode copies to start
                self.model.add(first[j] >= following).only_enforce_if(any_.Not())
        positions = [r for r, *_ in chain]

        def head(r: int) -> Any:
            j = bisect.bisect_right(positions, r)
            return first[j % len(chain)] if wrap is None or j < len(chain) else wrap
        return head, first[0]

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

    def _transfer(self, ph: str, k: int) -> Any:
        # xfer[ph, e] >= c(p, q) whenever src executes on p and dst on q (p != q), one row per p:
        # xfer >= sum_q c(p, q) exec[dst, q] - max_q c(p, q) (1 - exec[src, p]).
        if k % 64 == 0:
            self._in_time()
        e = self.p.edges[k]
        a, b = self.index[e.src], self.index[e.dst]
        costs = {pq: self._t(c) for pq, c in getattr(e, ph).items() if pq[0] != pq[1] and self._t(c) > 0}
        if not costs:
            return 0
        pair = (self.chosen[a].device_in(ph), self.chosen[b].device_in(ph))
        var = self._hinted(self.model.new_int_var(0, max(costs.values()), f"xfer[{ph},{e.src}->{e.dst}]"),
                           costs.get(pair, 0))
        for p in sorted({pq[0] for pq in costs}):
            row = {q: c for (s, q), c in costs.items() if s == p}
            on_p = self._on(a, p, ph)
            if isinstance(on_p, int):
                continue  # src never computes on p in this phase
            top = max(row.values())
            self.model.add(var >= sum(c * self._on(b, q, ph) for q, c in row.items()) - top * (1 - on_p))
        devices = self._exec_devices[ph]
        if len(set(costs.values())) > 1 or len(costs) < len(devices) * (len(devices) - 1):
            self._leaving_costs_at_least(ph, var, costs, a, b)  # with one price for every pair the rows above say it
        return var

    def _leaving_costs_at_least(self, ph: str, var: Any, costs: dict[tuple[str, str], int], a: int, b: int) -> None:
        # Tighter for the LP: leaving p costs at least the cheapest pair out of p (into p likewise).
        for p in {pq[0] for pq in costs} | {pq[1] for pq in costs}:
            others = [q for q in self._exec_devices[ph] if q != p]
            out_p = min(costs.get((p, q), 0) for q in others) if others else 0
            in_p = min(costs.get((q, p), 0) for q in others) if others else 0
            on_a, on_b = self._on(a, p, ph), self._on(b, p, ph)
            if out_p:
                self.model.add(var >= out_p * (on_a - on_b))
            if in_p:
                self.model.add(var >= in_p * (on_b - on_a))

    # -- constraints --------------------------------------------------------------------------
    def _one_option_per_unit(self) -> None:
        # Every unit takes exactly one allowed option (a pin only allows options storing on its device).
        for u, spec in enumerate(self.p.units):
            self.model.add_exactly_one([self.x[u, o] for o, _ in self._opts(u)])
            if spec.name in self.p.pins:
                for o, opt in self._opts(u):
                    if opt.storage != self.p.pins[spec.name]:
                        self.model.add(self.x[u, o] == 0)

    def _capacity_rows(self) -> None:
        # Stored + resident + peak bytes on every device stay within its capacity.
        terms = self._terms()
        flagged = self._transients((self.x[u, o], opt) for u in range(len(self.p.units)) for o, opt in self._opts(u))
        hinted = self._transients((1, opt) for opt in self.chosen)
        copied = {o.group_device for u in self.p.menu_units for o in u.options if o.group_copy_bytes}
        transients = device_transients(self.chosen, self.p.runs) if copied else {}
        for dev in self.p.devices:
            if dev.name in copied:  # copy groups: peak rows per copy run
                self.peak[dev.name] = self._run_peak(dev.name, transients.get(dev.name))
            else:
                top = max((nbytes for nbytes, _ in hinted[dev.name]), default=0)
                self.peak[dev.name] = self._peak(dev.name, flagged[dev.name], top)
            add_capacity_row(self.model, dev, self.peak[dev.name], terms)

    def _tied_groups_share_storage(self) -> None:
        # Units holding tied parameters store them on one device.
        for group in self.p.tied_groups:
            first = self.index[group[0]]
            for name in group[1:]:
                for dev in self.devices:
                    self.model.add(self._on(first, dev, "storage") == self._on(self.index[name], dev, "storage"))

    def _contiguous_storage(self) -> None:
        # Each device stores one contiguous range of units: at most one range opens on it.
        if not self.p.contiguous:
            return
        for dev in self.devices:
            self.model.add(sum(self._range_starts(range(len(self.p.units)), dev, "storage", "start")) <= 1)

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

    def _phase_latency(self, ph: str) -> Any:
        # lat[ph] >= the longest path (transfers included) and >= every device's total work.
        n = len(self.p.units)
        finish, load = self.p.schedule(self.chosen, ph, self._t)
        hinted = max(max(finish, default=0), max(load.values(), default=0), *self.p.shared_rows(self.chosen, ph, self._t))
        shared = self.p.shared_used(ph)
        horizon = sum(max(self._t(getattr(opt, ph)) + sum(self._t(opt.shared_in(res, ph)) for res in shared)
                          for _, opt in self._opts(u)) for u in range(n))
        horizon += sum(max([self._t(c) for c in getattr(e, ph).values()], default=0) for e in self.p.edges)
        lat = self._hinted(self.model.new_int_var(0, max(horizon, hinted), f"lat[{ph}]"), hinted)
        for res in shared:  # the prefetch thread, host memory, the disk: those some option uses
            row = [self._t(opt.shared_in(res, ph)) * v for opt, v in self._terms() if self._t(opt.shared_in(res, ph))]
            if row:
                self.model.add(lat >= sum(row))
        xfer = [self._transfer(ph, k) for k in range(len(self.p.edges))]
        wait = self._waits(ph)
        if self.chain:
            self.model.add(lat >= sum(self._t(getattr(opt, ph)) * v for opt, v in self._terms()) + sum(xfer) + sum(wait))
            return lat
        self._longest_path_rows(ph, lat, max(horizon, hinted), finish, xfer, wait)
        for dev in self.devices:
            work = [self._t(getattr(opt, ph)) * v for opt, v in self._terms(dev, ph)]
            if work:
                self.model.add(lat >= sum(work))
        return lat

    def _longest_path_rows(self, ph: str, lat: Any, top: int, finish: Sequence[int], xfer: list[Any],
                           wait: list[Any]) -> None:
        """A DAG's rows ``lat[ph] >=`` the end of each sink (:meth:`_phase_latency`'s longest path): ``top`` bounds
        the ``end`` variables, ``finish`` (each unit's end under the hint) their hints, ``xfer`` and ``wait`` are
        the phase's transfers and stalls."""
        # end[ph, u]: a variable only where paths merge (two or more in-edges); a unit with one
        # in-edge ends at its source's end + transfer + duration, a linear expression, so chain
        # stretches of a DAG keep the chain's tight LP. Only sinks bound lat (ends grow along edges).
        incoming: dict[int, list[int]] = {}
        for k, e in enumerate(self.p.edges):
            incoming.setdefault(self.index[e.dst], []).append(k)
        has_out = {self.index[e.src] for e in self.p.edges}
        end: list[Any] = []
        for u in range(len(self.p.units)):
            ins = incoming.get(u, [])
            arrivals = [end[self.index[self.p.edges[k].src]] + xfer[k] for k in ins]
            if len(ins) <= 1:
                end.append((arrivals[0] if arrivals else 0) + self._duration(u, ph) + wait[u])
            else:
                var = self._hinted(self.model.new_int_var(0, top, f"end[{ph},{u}]"), finish[u])
                duration = self._duration(u, ph) + wait[u]
                for arrival in arrivals:
                    self.model.add(var >= arrival + duration)
                end.append(var)
            if u not in has_out:
                self.model.add(lat >= end[u])

    def _waits(self, ph: str) -> list[Any]:
        """wait[ph, u] of every unit (0 where no option of u's copy run copies in ph): the module docstring's
        rows, on the problem's copy runs (:attr:`~.problem.PlacementProblem.copy_runs`; each unit its own run
        when None), a run's stall charged to its head."""
        n = len(self.p.units)
        if "copy" not in self.p.shared_used(ph):
            return [0] * n
        runs = self.p.runs
        copies = [[(u, o, self._t(opt.copy_in(ph))) for u in range(a, b) for o, opt in self._opts(u)
                   if self._t(opt.copy_in(ph)) > 0] for a, b in runs]
        if not any(copies):
            return [0] * n
        unit_most: dict[int, int] = {}  # each unit's largest copy; a run's largest is their sum
        for u, _, c in itertools.chain.from_iterable(copies):
            unit_most[u] = max(c, unit_most.get(u, 0))
        most = max(sum(unit_most.get(u, 0) for u in range(a, b)) for a, b in runs)
        cyclic = ph == "decode_ns"
        durations = [sum(self._t(getattr(o, ph)) for o in self.chosen[a:b]) for a, b in runs]
        hinted_copy = [sum(self._t(o.copy_in(ph)) for o in self.chosen[a:b]) for a, b in runs]
        hinted_wait = stalls(durations, hinted_copy, cyclic)
        beside: list[Any] = []
        k = len(runs)
        running = sum(durations[max((i for i, c in enumerate(hinted_copy) if c), default=k):]) if cyclic else 0
        for r in range(k):
            running = durations[r] if hinted_copy[r] else running + durations[r]
            beside.append(self._hinted(self.model.new_int_var(0, most, f"beside[{ph},{r}]"), min(most, running)))
        wait: list[Any] = [0] * n
        for r, (a, b) in enumerate(runs):
            before = beside[r - 1] if r > 0 else (beside[k - 1] if cyclic else 0)
            duration = sum(self._duration(u, ph) for u in range(a, b))
            self.model.add(beside[r] <= duration + before)
            if not copies[r]:
                continue
            self.model.add(beside[r] <= duration + most * (1 - self._streams(r, a, b, copies[r], ph)))
            w = self._hinted(self.model.new_int_var(0, most, f"wait[{ph},{r}]"), hinted_wait[r])
            self.model.add(w >= sum(c * self.x[u, o] for u, o, c in copies[r]) - before)
            wait[a] = w
        return wait

    def _streams(self, r: int, a: int, b: int, copies: list[tuple[int, int, int]], ph: str) -> Any:
        """1 when some unit of run ``r`` (units ``a`` to ``b``) copies in ``ph``: the sum of the copying
        options of a one-unit run; for a longer run a flag at least each of them (the objective keeps it at 0
        otherwise: it only lowers ``beside``)."""
        if b - a == 1:
            return sum(self.x[u, o] for u, o, _ in copies)
        hinted = int(any(self._t(self.chosen[u].copy_in(ph)) > 0 for u in range(a, b)))
        flag = self._hinted(self.model.new_bool_var(f"streams[{ph},{r}]"), hinted)
        for u, o, _ in copies:
            self.model.add_implication(self.x[u, o], flag)
        return flag

    def _slowest_stage(self) -> Any:
        # stage >= every device's total work (prefill + decode, each phase on the device computing it).
        n = len(self.p.units)
        stages = {d: sum(stage_work(o, d, self._t) for o in self.chosen) for d in self.devices}
        top = sum(max(stage_work(o, o.execution, self._t) + stage_work(o, o.device_in("prefill_ns"), self._t)
                      for _, o in self._opts(u)) for u in range(n))
        z = self._hinted(self.model.new_int_var(0, max(top, max(stages.values())), "stage"), max(stages.values()))
        for dev in self.devices:
            work = [stage_work(o, dev, self._t) * v for o, v in self._terms(dev)]
            if work:
                self.model.add(z >= sum(work))
        return z

    def _gpu_bytes(self) -> Any:
        # Stored + resident + peak bytes summed over the GPUs (the memory objective).
        gpus = set(self.p.gpu_names())
        terms: list[Any] = [self.peak[g] for g in sorted(gpus)]
        for opt, var in self._terms():
            size = (opt.stored_bytes if opt.storage in gpus else 0) + \
                   (opt.resident_bytes if opt.execution in gpus else 0)
            if size:
                terms.append(size * var)
        return sum(terms)

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


def rounding_slack(problem: PlacementProblem, objective: str) -> int:
    """The most ``objective`` rounded to solver units can differ from the exact one, in solver units: half a
    unit per rounded term (units, and edges for latency), doubled, and for latency as much again when some
    option copies (a stall's error is at most half a unit per unit its window spans). Memory is exact."""
    if objective == "memory":
        return 0
    n = len(problem.units)
    if objective != "latency":
        return n
    return n + len(problem.edges) + (n if problem.copies_beside else 0)


def new_solver(time_limit_s: float, seed: int, workers: int, gap_limit: float) -> cp_model.CpSolver:
    """A CP-SAT solver with the settings every model here runs under (the full one and the relaxations)."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    if workers == 1:  # reproducible: the deterministic budget, not the clock, ends the search
        solver.parameters.max_deterministic_time = max(0.01, time_limit_s) * DETERMINISTIC_TIME_PER_S
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = workers
    solver.parameters.relative_gap_limit = gap_limit
    solver.parameters.cp_model_probing_level = 0  # probing and repeated presolve passes can eat
    solver.parameters.max_presolve_iterations = 1  # most of a 1 s budget before the hint is loaded
    return solver


def add_capacity_row(model: cp_model.CpModel, device: DeviceSpec, peak: Any,
                     terms: Sequence[tuple[PlacementOption, Any]]) -> None:
    """Stored + resident + peak bytes on ``device`` stay within its capacity.

    ``terms``: (option, how many units use it) pairs, a 0/1 variable in the full model and a count in
    the relaxations; ``peak``: the device's transient peak bytes (every option's :func:`peak_flags`,
    a phased option's prefill transient included). Resident bytes stay on ``execution``, phased or not.
    """
    row = [peak]
    for opt, n in terms:
        size = (opt.stored_bytes if opt.storage == device.name else 0) + \
               (opt.resident_bytes if opt.execution == device.name else 0)
        if size:
            row.append(size * n)
    model.add(sum(row) <= device.capacity_bytes)


def add_level_caps(model: cp_model.CpModel, device: DeviceSpec, levels: Sequence[int], z: Sequence[Any],
                   terms: Sequence[tuple[PlacementOption, Any, int]]) -> None:
    """How many units of each option fit on ``device`` beside each level of its peak: a valid cut.

    ``terms``: (option, count of units on it, the count's upper bound); ``levels``/``z`` from
    :func:`peak_levels`. When ``z[j]`` is 1 the device's peak is at least ``levels[j]``, so ``n`` units
    putting ``b`` bytes each there fit only if ``n <= (capacity - levels[j]) // b``; stated as
    ``n <= top - (top - cap_j) z[j]`` (``top``: the most beside the option's own peak). Every
    assignment meets it, so it cuts no solution; the LP loses its cheapest trick: a large transient
    (a stream buffer, a phased prefill) spread as a small fraction over every GPU of a class, each
    then still holding its full share of resident layers (Llama-3.1-405B on 8 x L4).
    """
    sized = []  # (bytes on device, own transient there, count, its bound)
    for opt, n, most in terms:
        size = ((opt.stored_bytes if opt.storage == device.name else 0)
                + (opt.resident_bytes if opt.execution == device.name else 0))
        if size > 0:
            sized.append((size, max(peak_flags(opt, device.name), default=0), n, most))
    for b in sorted({size for size, *_ in sized}, reverse=True)[:LEVEL_CAP_SIZES]:
        group = [(own, n, most) for size, own, n, most in sized if size >= b]
        top = min(sum(most for *_, most in group), max(0, (device.capacity_bytes - min(own for own, *_ in group)) // b))
        for level, zj in zip(levels, z, strict=True):
            cap = min(top, max(0, (device.capacity_bytes - level) // b))
            if cap < top:
                model.add(sum(n for _, n, _ in group) <= top - (top - cap) * zj)


def peak_levels(model: cp_model.CpModel, device: str,
                flagged: Sequence[tuple[int, Any]]) -> tuple[Any, list[int], list[Any]]:
    """The transient peak of ``device`` as level flags: ``(peak expression, levels, z)``.

    ``flagged``: (transient bytes, a 0/1 that is 1 when some unit runs with that transient on ``device``;
    see :func:`peak_flags`).
    ``z[j]`` is 1 if some unit computed there has a peak of at least ``levels[j]`` (the distinct
    peaks, ascending); the peak is the sum of the level steps switched on. The full model and both
    relaxations state it this way.
    """
    levels = sorted({peak for peak, _ in flagged if peak > 0})
    z = [model.new_bool_var(f"z[{device},{j}]") for j in range(len(levels))]
    for a, b in itertools.pairwise(z):
        model.add_implication(b, a)
    where = {level: j for j, level in enumerate(levels)}
    for peak, flag in flagged:
        if peak > 0:
            model.add_implication(flag, z[where[peak]])
    steps = [b - a for a, b in zip([0, *levels], levels, strict=False)]
    return (sum(step * zj for step, zj in zip(steps, z, strict=True)) if z else 0), levels, z


def computes_on(opt: PlacementOption, device: str, phase: str | None = None) -> bool:
    """True when ``opt`` computes on ``device`` in ``phase`` (in either phase when None)."""
    if opt.prefill_execution is None:  # the common case first: both phases on its execution device
        return opt.execution == device
    if phase is not None:
        return opt.device_in(phase) == device
    return device in (opt.execution, opt.prefill_execution)


def stage_work(opt: PlacementOption, device: str, t: Any) -> int:
    """What ``opt`` adds to ``device``'s stage (throughput) in solver time (``t``: ns -> solver units):
    each phase on the device computing it, as :meth:`~.problem.PlacementProblem.score` adds it."""
    return sum(t(opt.work_in(ph)) for ph in _PHASES if opt.device_in(ph) == device)


def own_work(opt: PlacementOption) -> int:
    """The most work (ns) ``opt`` puts on one device: prefill + decode, or for a phased option the larger
    of the two (they land on two devices). At most both the latency (a phase's longest path holds the
    unit) and the slowest stage of any assignment using ``opt``, so options above a known objective
    value can be left out."""
    if opt.device_in("prefill_ns") == opt.execution:
        return opt.work_ns
    return max(opt.work_in("prefill_ns"), opt.work_in("decode_ns"))


def peak_flags(opt: PlacementOption, device: str) -> list[int]:
    """The transient bytes ``opt`` puts on ``device`` (:meth:`~.problem.PlacementOption.peaks`)."""
    return [nbytes for d, nbytes in opt.peaks() if d == device]


def _place(opt: PlacementOption, where: str) -> str:
    """``opt``'s device for ``where``: ``"storage"``, ``"execution"`` or a phase (the device computing it there)."""
    return opt.device_in(where) if where in _PHASES else getattr(opt, where)


def _uses(opt: PlacementOption, device: str) -> bool:
    """``opt`` stores or computes (in either phase) on ``device``: symmetry.first_use's notion of use."""
    return device in (opt.storage, opt.execution, opt.prefill_execution)
