"""The CP-SAT placement model: one option per unit, every capacity, the cost model's objective.

Stage 4 of the data flow, torch-free: it reads a :class:`~placement_opt.solver.problem.PlacementProblem`
(plain integers) and returns a :class:`Solution` (one option index per unit). The model reads
like the OR-Tools samples: data, variables, constraints, objective, solve, read the solution.

Variables (``u`` a unit, ``o`` one of its options, ``d`` a device, ``e`` an edge, ``ph`` a phase):

* ``x[u, o]`` is 1 if unit ``u`` uses option ``o`` (exactly one per unit).
* ``peak[d]`` is the largest ``peak_bytes`` of the options executed on ``d``.
* ``xfer[ph, e]`` is the transfer time of edge ``e`` in phase ``ph`` (0 when both ends
  execute on one device); linearized: ``xfer >= c(p, q) * (exec[src, p] + exec[dst, q] - 1)``.
* ``end[ph, u]`` is the time unit ``u`` finishes in phase ``ph`` (DAGs only; a chain's longest
  path is the plain sum of durations and transfers).
* ``lat[ph]`` is the latency of phase ``ph``: ``>= longest path`` and ``>= every device's load``,
  exactly :meth:`PlacementProblem.score`'s ``max(longest path, busiest device)``.
* ``start[u, d]`` is 1 if ``u`` opens the range of units stored on ``d`` (``contiguous`` only).

Integer time: every ``*_ns`` price is divided by ``scale_ns`` and rounded to the nearest integer,
with ``scale_ns = max(1, hint objective // TIME_RESOLUTION)``; coefficients stay around 10^5
whatever the model size. The objective read back is always ``problem.score`` of the chosen
assignment (exact); the proven bound is lowered by the largest possible rounding error
(``(units + edges) x scale_ns`` per solve, 0 when ``scale_ns == 1``), so the gap is honest.

Coarsening: problems with more than :data:`COARSEN_ABOVE` units are solved on super-units: runs of
consecutive chain units (linked only to each other, not pinned, not tied) with the same option
menu and the same hinted option are merged (durations and stored/resident bytes summed, peak the
max), which is exact for every cost, and expanded afterwards. The hint stays representable, so
the coarse solve is never worse than the hint; its bound is a bound of the coarse problem only.
The reductions (coarsening, symmetric segments, residency on ties) live in ``_reductions.py``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from .problem import PlacementOption, PlacementProblem, UnitSpec
from .reductions import canonical_hint, coarsen, coarsen_groups, prefer_resident, symmetric_segments

__all__ = [
    "Solution",
    "solve_problem",
    "greedy_choice",
    "best_greedy_choice",
    "satisfies",
    "objective_of",
    "OBJECTIVES",
    "TIME_RESOLUTION",
    "GAP_LIMIT",
    "DETERMINISTIC_TIME_PER_S",
    "COARSEN_ABOVE",
    "GREEDY_RESERVES",
]

#: Objectives the solver accepts.
OBJECTIVES = ("latency", "throughput", "memory")
#: Integer steps the hint's objective is divided into: sets ``scale_ns``.
TIME_RESOLUTION = 200_000
#: Default proven gap at which the search stops: the cost model itself is only accurate to some %.
GAP_LIMIT = 0.001
#: CP-SAT deterministic time per second of time limit. The search stops at whichever limit comes
#: first; this one comes first on this project's 2-core VMs (about 0.35-0.4 units accrue per second
#: with one worker), and a one-worker search stopped by it returns the same plan on every run.
DETERMINISTIC_TIME_PER_S = 0.3
#: Problems with more units than this are coarsened into at most about this many super-units.
COARSEN_ABOVE = 160
_PHASES = ("prefill_ns", "decode_ns")


@dataclass(frozen=True, kw_only=True)
class Solution:
    """What :func:`solve_problem` found."""

    choice: tuple[int, ...]
    """Option index per unit, in execution order (empty when infeasible)."""
    status: str
    """``"OPTIMAL"``, ``"FEASIBLE"``, ``"INFEASIBLE"`` or ``"UNKNOWN"`` (no feasible solution found)."""
    objective: str
    objective_value: int
    """``problem.score(choice)``: latency or slowest stage in ns, or GPU bytes for ``memory``."""
    best_bound: int
    """Proven lower bound, same unit (of the coarse problem when ``coarse_units < units``)."""
    gap: float
    """``(objective_value - best_bound) / objective_value``; 0.0 is proven optimal."""
    wall_time_s: float
    scale_ns: int
    """Nanoseconds per solver time unit."""
    units: int
    coarse_units: int
    """Units the solver saw after coarsening (== ``units`` when not coarsened)."""
    notes: tuple[str, ...] = ()

    @property
    def feasible(self) -> bool:
        return self.status in ("OPTIMAL", "FEASIBLE")


# ---------------------------------------------------------------------------------------------
# Objective values under problem.score (the one definition)
# ---------------------------------------------------------------------------------------------
def objective_of(problem: PlacementProblem, choice: Sequence[int], objective: str) -> int:
    """The exact value of ``objective`` for ``choice``: ns for latency/throughput, GPU bytes for memory."""
    score = problem.score(choice)
    if objective == "latency":
        return score.latency_ns
    if objective == "throughput":
        return score.throughput_ns
    gpus = [d.name for d in problem.devices if d.kind == "gpu"]
    return sum(score.used_bytes[g] for g in gpus)


def _allowed(problem: PlacementProblem, u: UnitSpec, o: PlacementOption) -> bool:
    pin = problem.pins.get(u.name)
    return pin is None or o.storage == pin


def greedy_choice(problem: PlacementProblem, reserve_fraction: float | None = None) -> list[int]:
    """A simple feasible-if-possible assignment: each unit takes the fastest allowed option that fits.

    Units are placed in execution order against the remaining capacity; tied units follow the
    storage of the first of their group. With ``reserve_fraction``, weights resident on a GPU leave
    free the largest stream buffer of that GPU plus this fraction of its capacity, so later units can
    still be streamed there (KV cache and buffers) instead of falling back to the CPU.
    """
    free = {d.name: d.capacity_bytes for d in problem.devices}
    peak = {d.name: 0 for d in problem.devices}
    reserve = dict.fromkeys(free, 0)
    if reserve_fraction is not None:
        for d in problem.devices:
            if d.kind == "gpu":
                streams = [o.peak_bytes for u in problem.units for o in u.options
                           if o.execution == d.name and o.storage != d.name]
                reserve[d.name] = max(streams, default=0) + int(reserve_fraction * d.capacity_bytes)
    tied_to = {n: g[0] for g in problem.tied_groups for n in g[1:]}
    storage: dict[str, str] = {}
    choice = []
    for u in problem.units:
        def fits(o: PlacementOption) -> bool:
            extra_peak = max(0, o.peak_bytes - peak[o.execution])
            if o.storage == o.execution:
                return o.stored_bytes + o.resident_bytes + extra_peak + reserve[o.storage] <= free[o.storage]
            return o.stored_bytes <= free[o.storage] and o.resident_bytes + extra_peak <= free[o.execution]

        lead = tied_to.get(u.name)
        ranked = sorted(range(len(u.options)),
                        key=lambda i: (not _allowed(problem, u, u.options[i]),
                                       lead in storage and u.options[i].storage != storage[lead],
                                       not fits(u.options[i]),
                                       u.options[i].prefill_ns + u.options[i].decode_ns, i))
        best = ranked[0]
        o = u.options[best]
        free[o.storage] -= o.stored_bytes
        free[o.execution] -= o.resident_bytes + max(0, o.peak_bytes - peak[o.execution])
        peak[o.execution] = max(peak[o.execution], o.peak_bytes)
        storage[u.name] = o.storage
        choice.append(best)
    return choice


#: Reserve fractions tried by :func:`best_greedy_choice` (None: no reserve).
GREEDY_RESERVES = (None, 0.0, 0.1, 0.25, 0.5)


def best_greedy_choice(problem: PlacementProblem, objective: str = "latency") -> list[int]:
    """The best valid :func:`greedy_choice` over :data:`GREEDY_RESERVES` (the first one if none is valid)."""
    key = "latency" if objective == "memory" else objective
    variants = [greedy_choice(problem, r) for r in GREEDY_RESERVES]
    valid = [(objective_of(problem, c, key), i) for i, c in enumerate(variants) if satisfies(problem, c)]
    return variants[min(valid)[1]] if valid else variants[0]


def _contiguous_ok(problem: PlacementProblem, choice: Sequence[int]) -> bool:
    seen: list[str] = []
    for o in problem.options(choice):
        if not seen or seen[-1] != o.storage:
            if o.storage in seen:
                return False
            seen.append(o.storage)
    return True


def satisfies(problem: PlacementProblem, choice: Sequence[int]) -> bool:
    """Every constraint the CP-SAT model states, checked directly (capacity, pins, ties, contiguity)."""
    chosen = problem.options(choice)
    if not problem.score(choice).feasible:
        return False
    if any(not _allowed(problem, u, o) for u, o in zip(problem.units, chosen, strict=True)):
        return False
    index = problem.index()
    for group in problem.tied_groups:
        if len({chosen[index[n]].storage for n in group}) > 1:
            return False
    return not problem.contiguous or _contiguous_ok(problem, choice)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
class _Model:
    """The CP-SAT model of one problem, with a hint value for every variable."""

    def __init__(self, problem: PlacementProblem, scale_ns: int, hint: Sequence[int],
                 max_work_ns: int | None, segments: Sequence[list[int]] = ()) -> None:
        # -- data --
        self.p = problem
        self.scale = scale_ns
        self.hint = list(hint)
        self.index = problem.index()
        self.devices = [d.name for d in problem.devices]
        self.model = cp_model.CpModel()
        self.hints: list[tuple[Any, int]] = []
        self.peak: dict[str, Any] = {}
        self.levels: list[Any] = []
        self._on_cache: dict[tuple[int, str, str], Any] = {}
        self._opts_cache: dict[int, list[tuple[int, PlacementOption]]] = {}
        self.chain = self._is_chain()
        self._exec_devices = sorted({o.execution for u in problem.units for o in u.options})
        self.chosen = problem.options(self.hint)
        # -- variables --
        self.x = self._option_vars(max_work_ns)
        self.counts = self._count_vars()
        # -- constraints --
        self._one_option_per_unit()
        self._capacity_rows()
        self._tied_groups_share_storage()
        self._contiguous_storage()
        self._identical_units_in_blocks(segments)
        self.lat = {ph: self._phase_latency(ph) for ph in _PHASES}

    def _t(self, ns: int) -> int:
        return (ns + self.scale // 2) // self.scale if self.scale > 1 else ns

    def _is_chain(self) -> bool:
        n = len(self.p.units)
        pairs = {(self.index[e.src], self.index[e.dst]) for e in self.p.edges}
        return pairs == {(i, i + 1) for i in range(n - 1)} and len(self.p.edges) == n - 1

    def _hinted(self, var: Any, value: int) -> Any:
        self.hints.append((var, value))
        return var

    def _option_vars(self, max_work_ns: int | None) -> dict[tuple[int, int], Any]:
        # x[u, o] is 1 if unit u uses option o; pinned-away options and options whose own work
        # (prefill + decode) exceeds max_work_ns (a bound no better solution can exceed) are left out.
        x = {}
        for u, spec in enumerate(self.p.units):
            for o, opt in enumerate(spec.options):
                keep = _allowed(self.p, spec, opt) or self.hint[u] == o
                if max_work_ns is not None and self.hint[u] != o:
                    keep = keep and opt.prefill_ns + opt.decode_ns <= max_work_ns
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

    def _terms(self, execution: str | None = None) -> list[tuple[PlacementOption, Any]]:
        """(option, 0/1 or count expression) over every unit, optionally only options executed on a device."""
        return [(self.p.units[units[0]].options[o], var) for units, counts in self.counts
                for o, var in counts.items()
                if execution is None or self.p.units[units[0]].options[o].execution == execution]

    def _opts(self, u: int) -> list[tuple[int, PlacementOption]]:
        """(index, option) of the options unit u may take (cached once x exists)."""
        if u not in self._opts_cache:
            self._opts_cache[u] = [(o, opt) for o, opt in enumerate(self.p.units[u].options) if (u, o) in self.x]
        return self._opts_cache[u]

    def _on(self, u: int, device: str, where: str) -> Any:
        """1 if unit u's storage (or execution) is on device, as a linear expression (cached)."""
        key = (u, device, where)
        if key not in self._on_cache:
            self._on_cache[key] = sum(self.x[u, o] for o, opt in self._opts(u) if getattr(opt, where) == device)
        return self._on_cache[key]

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
        for dev in self.p.devices:
            peak = self._peak(dev.name)
            self.peak[dev.name] = peak
            terms = [peak]
            for opt, var in self._terms():
                size = (opt.stored_bytes if opt.storage == dev.name else 0) + \
                       (opt.resident_bytes if opt.execution == dev.name else 0)
                if size:
                    terms.append(size * var)
            self.model.add(sum(terms) <= dev.capacity_bytes)

    def _peak(self, dev: str) -> Any:
        # z[d, j] is 1 if some unit executed on d has peak_bytes >= level j (levels: the distinct
        # peaks on d, ascending); peak[d] = sum of the level steps switched on. x[u, o] <= z[d, j(o)].
        chosen = self.p.options(self.hint)
        levels = sorted({opt.peak_bytes for u in range(len(self.p.units)) for _, opt in self._opts(u)
                         if opt.execution == dev and opt.peak_bytes > 0})
        hinted = max((o.peak_bytes for o in chosen if o.execution == dev), default=0)
        z = [self._hinted(self.model.new_bool_var(f"z[{dev},{j}]"), int(hinted >= level))
             for j, level in enumerate(levels)]
        self.levels.extend(z)
        for a, b in itertools.pairwise(z):
            self.model.add_implication(b, a)
        where = {level: j for j, level in enumerate(levels)}
        for u in range(len(self.p.units)):
            for o, opt in self._opts(u):
                if opt.execution == dev and opt.peak_bytes > 0:
                    self.model.add_implication(self.x[u, o], z[where[opt.peak_bytes]])
        steps = [b - a for a, b in zip([0, *levels], levels, strict=False)]
        return sum(step * zj for step, zj in zip(steps, z, strict=True)) if z else 0

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
        chosen = self.p.options(self.hint)
        for dev in self.devices:
            starts = []
            for u in range(len(self.p.units)):
                here = chosen[u].storage == dev
                before = u > 0 and chosen[u - 1].storage == dev
                s = self._hinted(self.model.new_bool_var(f"start[{u},{dev}]"), int(here and not before))
                prev = self._on(u - 1, dev, "storage") if u > 0 else 0
                self.model.add(s >= self._on(u, dev, "storage") - prev)
                starts.append(s)
            self.model.add(sum(starts) <= 1)

    def _identical_units_in_blocks(self, segments: Sequence[list[int]]) -> None:
        # Symmetry breaking: in a segment of identical units, one block per execution device,
        # option indices non-decreasing inside a block (see _reductions.symmetric_segments).
        chosen = self.p.options(self.hint)
        for seg in segments:
            for dev in self.devices:
                starts = []
                for k, u in enumerate(seg):
                    here = chosen[u].execution == dev
                    before = k > 0 and chosen[seg[k - 1]].execution == dev
                    s = self._hinted(self.model.new_bool_var(f"block[{u},{dev}]"), int(here and not before))
                    prev = self._on(seg[k - 1], dev, "execution") if k > 0 else 0
                    self.model.add(s >= self._on(u, dev, "execution") - prev)
                    starts.append(s)
                self.model.add(sum(starts) <= 1)
            for a, b in itertools.pairwise(seg):
                for o, opt in self._opts(b):
                    later = [self.x[a, o2] for o2, opt2 in self._opts(a) if o2 > o and opt2.execution == opt.execution]
                    if later:
                        self.model.add(self.x[b, o] + sum(later) <= 1)

    def duration(self, u: int, ph: str) -> Any:
        return sum(self._t(getattr(opt, ph)) * self.x[u, o] for o, opt in self._opts(u))

    def _transfer(self, ph: str, k: int) -> Any:
        # xfer[ph, e] >= c(p, q) whenever src executes on p and dst on q (p != q), one row per p:
        # xfer >= sum_q c(p, q) exec[dst, q] - max_q c(p, q) (1 - exec[src, p]).
        e = self.p.edges[k]
        a, b = self.index[e.src], self.index[e.dst]
        costs = {pq: self._t(c) for pq, c in getattr(e, ph).items() if pq[0] != pq[1] and self._t(c) > 0}
        if not costs:
            return 0
        pair = (self.chosen[a].execution, self.chosen[b].execution)
        var = self._hinted(self.model.new_int_var(0, max(costs.values()), f"xfer[{ph},{e.src}->{e.dst}]"),
                           costs.get(pair, 0))
        for p in sorted({pq[0] for pq in costs}):
            row = {q: c for (s, q), c in costs.items() if s == p}
            on_p = self._on(a, p, "execution")
            if isinstance(on_p, int):
                continue  # src can never execute on p
            top = max(row.values())
            self.model.add(var >= sum(c * self._on(b, q, "execution") for q, c in row.items()) - top * (1 - on_p))
        # Tighter for the LP: leaving p costs at least the cheapest pair out of p (into p likewise).
        for p in {pq[0] for pq in costs} | {pq[1] for pq in costs}:
            others = [q for q in self._exec_devices if q != p]
            out_p = min(costs.get((p, q), 0) for q in others) if others else 0
            in_p = min(costs.get((q, p), 0) for q in others) if others else 0
            on_a, on_b = self._on(a, p, "execution"), self._on(b, p, "execution")
            if out_p:
                self.model.add(var >= out_p * (on_a - on_b))
            if in_p:
                self.model.add(var >= in_p * (on_b - on_a))
        return var

    def _hint_value(self, ph: str) -> tuple[list[int], dict[str, int], int]:
        """Scaled end times, device loads and latency of the hint in phase ph."""
        chosen = self.p.options(self.hint)
        finish = [0] * len(chosen)
        incoming: dict[int, list[Any]] = {}
        for e in self.p.edges:
            incoming.setdefault(self.index[e.dst], []).append(e)
        load = {d: 0 for d in self.devices}
        for i, opt in enumerate(chosen):
            ready = 0
            for e in incoming.get(i, ()):
                j = self.index[e.src]
                pq = (chosen[j].execution, opt.execution)
                c = self._t(getattr(e, ph).get(pq, 0)) if pq[0] != pq[1] else 0
                ready = max(ready, finish[j] + c)
            finish[i] = ready + self._t(getattr(opt, ph))
            load[opt.execution] += self._t(getattr(opt, ph))
        return finish, load, max(max(finish, default=0), max(load.values(), default=0))

    def _phase_latency(self, ph: str) -> Any:
        # lat[ph] >= the longest path (transfers included) and >= every device's total work.
        n = len(self.p.units)
        finish, _, hinted = self._hint_value(ph)
        horizon = sum(max(self._t(getattr(opt, ph)) for _, opt in self._opts(u)) for u in range(n))
        horizon += sum(max([self._t(c) for c in getattr(e, ph).values()], default=0) for e in self.p.edges)
        lat = self._hinted(self.model.new_int_var(0, max(horizon, hinted), f"lat[{ph}]"), hinted)
        xfer = [self._transfer(ph, k) for k in range(len(self.p.edges))]
        if self.chain:
            self.model.add(lat >= sum(self._t(getattr(opt, ph)) * v for opt, v in self._terms()) + sum(xfer))
        else:
            end = [self._hinted(self.model.new_int_var(0, max(horizon, hinted), f"end[{ph},{u}]"), finish[u])
                   for u in range(n)]
            for u in range(n):
                self.model.add(end[u] >= self.duration(u, ph))
                self.model.add(lat >= end[u])
            for k, e in enumerate(self.p.edges):
                a, b = self.index[e.src], self.index[e.dst]
                self.model.add(end[b] >= end[a] + xfer[k] + self.duration(b, ph))
            for dev in self.devices:
                load = [self._t(getattr(opt, ph)) * v for opt, v in self._terms(dev)]
                if load:
                    self.model.add(lat >= sum(load))
        return lat

    def stage_time(self) -> Any:
        """Slowest device's total work (prefill + decode), as a hinted int var."""
        n = len(self.p.units)
        chosen = self.p.options(self.hint)
        stages = {d: sum(self._t(o.prefill_ns) + self._t(o.decode_ns) for o in chosen if o.execution == d)
                  for d in self.devices}
        top = sum(max(self._t(o.prefill_ns) + self._t(o.decode_ns) for _, o in self._opts(u)) for u in range(n))
        z = self._hinted(self.model.new_int_var(0, max(top, max(stages.values())), "stage"), max(stages.values()))
        for dev in self.devices:
            work = [(self._t(o.prefill_ns) + self._t(o.decode_ns)) * v for o, v in self._terms(dev)]
            if work:
                self.model.add(z >= sum(work))
        return z

    def gpu_bytes(self) -> Any:
        """Stored + resident + peak bytes summed over the GPUs (the memory objective)."""
        gpus = {d.name for d in self.p.devices if d.kind == "gpu"}
        terms: list[Any] = [self.peak[g] for g in sorted(gpus)]
        for opt, var in self._terms():
            size = (opt.stored_bytes if opt.storage in gpus else 0) + \
                   (opt.resident_bytes if opt.execution in gpus else 0)
            if size:
                terms.append(size * var)
        return sum(terms)

    def read(self, solver: cp_model.CpSolver) -> list[int]:
        return [next(o for o, _ in self._opts(u) if solver.boolean_value(self.x[u, o]))
                for u in range(len(self.p.units))]

    def solve(self, objective: Any, time_limit_s: float, seed: int, workers: int,
              gap_limit: float = 0.0) -> tuple[cp_model.CpSolver, Any]:
        self.model.minimize(objective)
        for var, value in self.hints:
            self.model.add_hint(var, value)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
        if workers == 1:  # reproducible: the deterministic budget, not the clock, ends the search
            solver.parameters.max_deterministic_time = max(0.01, time_limit_s) * DETERMINISTIC_TIME_PER_S
        solver.parameters.random_seed = seed
        solver.parameters.num_workers = workers
        solver.parameters.relative_gap_limit = gap_limit
        if len(self.counts) > len(self.p.units) // 2:
            # Mostly distinct units (random or module-level graphs): no count variables tighten the
            # LP, and the full linearization (max_lp) proves gaps that default_lp does not reach in
            # a second; repeated layers do better with default_lp. It takes the full-problem slot
            # (the only one with 1 or 2 workers; LNS shares the second worker). Measured with one
            # worker on benchmarks/solve_time: 23/26 runs <= 1 % gap against 21/26 without it.
            solver.parameters.subsolvers.append("max_lp")
        solver.parameters.cp_model_probing_level = 0  # probing and repeated presolve passes can eat
        solver.parameters.max_presolve_iterations = 1  # most of a 1 s budget before the hint is loaded
        return solver, solver.solve(self.model)


# ---------------------------------------------------------------------------------------------
# solve_problem
# ---------------------------------------------------------------------------------------------
def _check(problem: PlacementProblem, objective: str, hint: Sequence[int] | None, time_limit_s: float,
           workers: int, memory_slack: float, gap_limit: float) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not one of {', '.join(OBJECTIVES)}")
    if not 0 <= gap_limit < 1:
        raise ValueError(f"gap_limit must be a fraction in [0, 1), got {gap_limit!r}: e.g. 0.001 for 0.1 %")
    if time_limit_s <= 0 or workers < 1 or memory_slack < 0:
        raise ValueError(f"time_limit_s ({time_limit_s}) must be > 0, workers ({workers}) >= 1 and "
                         f"memory_slack ({memory_slack}) >= 0")
    if hint is not None:
        bad = [i for i, (u, c) in enumerate(zip(problem.units, hint, strict=False)) if not 0 <= c < len(u.options)]
        if len(hint) != len(problem.units) or bad:
            raise ValueError(f"hint has {len(hint)} entries for {len(problem.units)} units, out-of-range "
                             f"at positions {bad[:5]}: give one option index per unit")


def _bound(solver: cp_model.CpSolver, scale: int, slack_units: int) -> int:
    return max(0, int(solver.best_objective_bound) * scale - (slack_units * scale if scale > 1 else 0))


def solve_problem(problem: PlacementProblem, objective: str = "latency", *, time_limit_s: float = 1.0,
                  seed: int = 0, workers: int = 2, hint: Sequence[int] | None = None,
                  memory_slack: float = 0.05, gap_limit: float = GAP_LIMIT) -> Solution:
    """Find the best assignment of ``problem`` for ``objective`` with OR-Tools CP-SAT.

    Example::

        sol = solve_problem(problem, "latency", time_limit_s=1.0, hint=[0] * len(problem.units))
        assert sol.objective_value == problem.score(sol.choice).latency_ns

    Args:
        problem: the integer problem (units, options, edges, devices, ties, pins, contiguity).
        objective: ``"latency"`` (prefill + decode, each the max of the critical path and the busiest
            device), ``"throughput"`` (the slowest device's total work) or ``"memory"`` (least GPU
            bytes whose latency stays within ``memory_slack`` of the best latency: two solves, each
            with half of ``time_limit_s``).
        time_limit_s: wall-clock limit of the whole call.
        seed: CP-SAT's random seed.
        workers: CP-SAT search workers; with ``1`` the search ends on its deterministic-time budget
            and is reproducible (the same plan every run) unless the wall-clock limit comes first.
        hint: an option index per unit (the best feasible baseline); default :func:`best_greedy_choice`.
            The returned solution is never worse than a valid hint.
        memory_slack: allowed relative latency increase for ``"memory"``.
        gap_limit: stop as soon as the returned objective is proven within this fraction of the
            optimum (rounding of the integer time model included); ``0`` searches until the limit.

    Returns:
        A :class:`Solution`; ``objective_value`` is exactly ``problem.score(choice)``'s value.

    Raises:
        ValueError: an unknown objective, a malformed hint or a non-positive limit.
    """
    _check(problem, objective, hint, time_limit_s, workers, memory_slack, gap_limit)
    t0 = time.perf_counter()
    hint = list(hint) if hint is not None else best_greedy_choice(problem, objective)
    run = _Run(seed=seed, workers=workers, gap_limit=gap_limit, t0=t0)
    if objective == "memory":
        first = _solve(problem, "latency", time_limit_s / 2, run, hint, None)
        if not first.feasible:
            return first
        cap = int(first.objective_value * (1 + memory_slack))
        return _solve(problem, "memory", time_limit_s, run, list(first.choice), cap)
    return _solve(problem, objective, time_limit_s, run, hint, None)


@dataclass(frozen=True)
class _Run:
    """Search settings shared by the solves of one call."""

    seed: int
    workers: int
    gap_limit: float
    t0: float
    """perf_counter() when the call began: every solve's budget ends at t0 + time_limit_s."""


def _solve(problem: PlacementProblem, objective: str, time_limit_s: float, run: _Run,
           hint: list[int], latency_cap_ns: int | None) -> Solution:
    """One CP-SAT solve (coarsened when large); falls back to the full problem if the coarse one fails."""
    hint_ok = satisfies(problem, hint)
    n = len(problem.units)
    groups = coarsen_groups(problem, hint, COARSEN_ABOVE) if n > COARSEN_ABOVE else [[i] for i in range(n)]
    coarse = len(groups) < n
    sub = coarsen(problem, groups) if coarse else problem
    sub_hint = [hint[g[0]] for g in groups]
    sol = _solve_once(sub, objective, time_limit_s, run, sub_hint, hint_ok, latency_cap_ns)
    if coarse and not sol[0]:  # the coarse problem found nothing: try the full one with what is left
        coarse, groups, sub = False, [[i] for i in range(n)], problem
        sol = _solve_once(problem, objective, time_limit_s, run, hint, hint_ok, latency_cap_ns)
    choice_sub, status, bound = sol
    notes = []
    if coarse:
        notes.append(f"coarsened {n} units into {len(groups)} super-units (runs of chain units with the "
                     f"same options); the bound is the coarse problem's")
    if not choice_sub:
        if hint_ok:  # the solver ran out of time before finding anything: the hint stands
            choice_sub, status = [hint[g[0]] for g in groups], "FEASIBLE"
        else:
            return Solution(choice=(), status=status, objective=objective, objective_value=0,
                            best_bound=bound, gap=1.0, wall_time_s=time.perf_counter() - run.t0, scale_ns=0,
                            units=n, coarse_units=len(groups), notes=tuple(notes))
    choice = [0] * n
    for g, c in zip(groups, choice_sub, strict=True):
        for i in g:
            choice[i] = c
    if objective != "memory":
        choice = prefer_resident(problem, choice)
    value = objective_of(problem, choice, objective)
    if hint_ok and objective_of(problem, hint, objective) < value and (
            latency_cap_ns is None or objective_of(problem, hint, "latency") <= latency_cap_ns):
        choice, value = hint, objective_of(problem, hint, objective)  # rounding: never worse than the hint
    bound = min(bound, value)
    gap = (value - bound) / value if value > 0 else 0.0
    if gap <= 0 and status == "FEASIBLE":
        status = "OPTIMAL"
    return Solution(choice=tuple(choice), status=status, objective=objective, objective_value=value,
                    best_bound=bound, gap=gap, wall_time_s=time.perf_counter() - run.t0,
                    scale_ns=_scale(problem, hint, objective), units=n, coarse_units=len(groups),
                    notes=tuple(notes))


def _scale(problem: PlacementProblem, hint: Sequence[int], objective: str) -> int:
    """ns per solver time unit: the hint's time objective divided into TIME_RESOLUTION steps."""
    key = "throughput" if objective == "throughput" else "latency"
    return max(1, objective_of(problem, hint, key) // TIME_RESOLUTION)


def _solve_once(problem: PlacementProblem, objective: str, time_limit_s: float, run: _Run,
                hint: list[int], hint_ok: bool, latency_cap_ns: int | None) -> tuple[list[int], str, int]:
    """(choice or [], status, proven bound in the objective's unit) of one CP-SAT run."""
    scale = _scale(problem, hint, objective)
    max_work = None  # latency and the slowest stage are >= every unit's own prefill + decode
    if hint_ok and objective in ("latency", "throughput"):
        max_work = objective_of(problem, hint, objective)
    elif latency_cap_ns is not None:
        max_work = latency_cap_ns
    segments = symmetric_segments(problem)
    canonical = canonical_hint(problem, hint, segments)
    if satisfies(problem, canonical) >= hint_ok and \
            objective_of(problem, canonical, objective if objective != "memory" else "latency") <= \
            objective_of(problem, hint, objective if objective != "memory" else "latency"):
        hint = canonical
    else:
        segments = []
    m = _Model(problem, scale, hint, max_work, segments)
    slack = len(problem.units) + len(problem.edges)
    if objective == "latency":
        goal, unit_scale = m.lat["prefill_ns"] + m.lat["decode_ns"], scale
    elif objective == "throughput":
        goal, unit_scale, slack = m.stage_time(), scale, len(problem.units)
    else:
        cap = latency_cap_ns // scale + (slack if scale > 1 else 0)
        m.model.add(m.lat["prefill_ns"] + m.lat["decode_ns"] <= cap)
        goal, unit_scale, slack = m.gpu_bytes(), 1, 0
    # CP-SAT's gap is on the rounded model; the reported one adds the rounding slack, so ask for less.
    rounding = slack * unit_scale / max(1, objective_of(problem, hint, objective)) if unit_scale > 1 else 0.0
    budget = time_limit_s - (time.perf_counter() - run.t0)
    solver, status = m.solve(goal, budget, run.seed, run.workers, max(0.0, run.gap_limit - rounding))
    name = solver.status_name(status)
    if status == cp_model.OPTIMAL and solver.best_objective_bound < solver.objective_value:
        name = "FEASIBLE"  # stopped by the gap limit: within it, not proven optimal
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return m.read(solver), name, _bound(solver, unit_scale, slack)
    bound = _bound(solver, unit_scale, slack) if status == cp_model.UNKNOWN else 0
    return [], name, bound
