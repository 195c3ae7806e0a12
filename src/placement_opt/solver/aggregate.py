"""Identical units as integer counts: a small relaxation that bounds, and a plan rebuilt from it.

Torch-free. The 80 decoder layers of a 70B model are one *run*: consecutive units with the same
option menu (same prices), joined by edges that are each the only edge out of their source and
into their destination, all at the same prices, with no pin or tie. Inside a run (its *interior*,
every unit but the first and the last, whose other edges may leave the run) a placement is, up to
order, a count per option. :class:`AggregateModel` keeps those counts and drops the order:

* work, bytes and the transient peak of the interior are read from the counts (exact);
* ``first[ph][d]`` / ``last[ph][d]`` are the devices computing the interior's first and last units in
  phase ``ph`` (both phases on the execution device, and one set of flags, unless the run's options
  include ``phased`` ones); the edges into and out of the interior are priced from them (exact);
* the interior's own edges cost at least ``c_min x (devices used - 1)`` in each phase: an order that
  visits k devices in that phase changes device at least k - 1 times, each change costing at least
  the cheapest price between two of the devices its units may compute on in that phase. A lower
  bound, not the price. (A phased run's first and last devices are not tied across the phases to
  one option: a relaxation still.)

A ``contiguous`` problem's storage ranges are stated over the items that store (units, and interiors taken
whole, whose inner order stays free): each device opens at most one range of them, and an interior whose stored
neighbours both store on a device is wholly on it (:meth:`AggregateModel._contiguous_storage`).

Every assignment of the real problem maps to a solution of this model (counts, first and last device
of each interior) that costs at most as much, so the model's proven bound is a bound of the real
problem (less the rounding slack, as in :mod:`.cpsat`). Its solution is rebuilt into an order
(:meth:`AggregateModel.read`: one block per execution device, the first and last devices at the
ends; for a contiguous problem, each run's placements then sorted by storage device) and priced
exactly by the caller; that order is optimal when the prices between devices are all equal, as
traced graphs price them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ortools.sat.python import cp_model

from ._counted import SEARCH_SUBSOLVERS, CountedRelaxation
from .polish import arranged, balanced
from .problem import PHASES, EdgeSpec, PlacementOption, PlacementProblem, spine
from .ranged import ranged
from .rows import add_capacity_row, add_level_caps, computes_on, own_work, peak_flags, peak_levels

__all__ = ["identical_runs", "AggregateModel", "MIN_INTERIOR", "most_beside_peak", "interleaved", "spread_streamed",
           "OVERLAP_SUBSOLVERS"]

_PHASES = PHASES
#: An order of like units' options for one phase (:func:`spread_streamed`, :func:`interleaved`, ...): the options
#: (indices into the menu), the menu, the phase -> the same options in another order.
Deal = Callable[[list[int], Sequence[PlacementOption], str], list[int]]
#: Fewest interior units worth a count variable.
MIN_INTERIOR = 4
#: :attr:`~._counted.CountedRelaxation.full_subsolvers` under overlap (stall rows): two full workers, one
#: raising the bound by searching at it, in place of CP-SAT's default pair (one full worker beside
#: neighbourhood search), as the grouped relaxation runs. On benchmarks/solve_time's grid with
#: ``--overlap`` (165 feasible cells, 1 s, this 2-core machine, seeds 0-2) it took the cells within 1 %
#: from 147, 141 and 143 to 148, 147 and 147; on the 22 cells that missed, two seeds each, from 10 of 44
#: solves to 16. Mostly the bound: Llama-3-70B on RTX 4090 + 3090, batch 16, proved 595-784 s against an
#: optimum of 815 s before, 789-815 s after (0.7 s runs of the relaxation alone, seeds 0-2). Without overlap
#: the default pair proves these models' bounds in time (164 of 165 cells within 1 %): they keep it.
OVERLAP_SUBSOLVERS = SEARCH_SUBSOLVERS


def most_beside_peak(problem: PlacementProblem, opt: PlacementOption) -> int:
    """Most units on ``opt`` that its execution device can hold beside ``opt``'s own peak.

    A device that runs ``opt`` at all holds its transient peak (the device's peak is the largest of
    its units'), and every unit on ``opt`` adds its bytes there: ``n x bytes + peak <= capacity``.
    (A phased option's prefill transient sits on another device: the bound holds without it.)
    As ``n <= most x any`` it ties the count to its peak flag far tighter than ``n <= size x any``
    for the LP: three L4s streaming 38 layers of Llama-3.1-405B each hold a 19 GB buffer beside 38
    layers' KV cache, no more.
    """
    here = opt.resident_bytes + (opt.stored_bytes if opt.storage == opt.execution else 0)
    room = problem.device(opt.execution).capacity_bytes - opt.peak_bytes
    if room < 0:
        return 0
    return room // here if here > 0 else len(problem.units)


def _links(problem: PlacementProblem) -> dict[int, EdgeSpec]:
    """i -> the edge i -> i + 1 when it is i's only out-edge and i + 1's only in-edge."""
    index = problem.index()
    outs: dict[int, list[EdgeSpec]] = {}
    ins: dict[int, int] = {}
    for e in problem.edges:
        outs.setdefault(index[e.src], []).append(e)
        ins[index[e.dst]] = ins.get(index[e.dst], 0) + 1
    return {i: es[0] for i, es in outs.items() if len(es) == 1 and index[es[0].dst] == i + 1 and ins.get(i + 1) == 1}


def _prices(e: EdgeSpec) -> tuple:
    return tuple(sorted(e.prefill_ns.items())), tuple(sorted(e.decode_ns.items()))


def identical_runs(problem: PlacementProblem, min_interior: int | None = None) -> list[tuple[int, int]]:
    """Interiors ``(first, last)`` (inclusive unit indices) of the runs of identical units (module docstring),
    those of at least ``min_interior`` (default :data:`MIN_INTERIOR`) units."""
    min_interior = MIN_INTERIOR if min_interior is None else min_interior
    links = _links(problem)
    special = {n for g in problem.tied_groups for n in g} | set(problem.pins)
    runs: list[list[int]] = []
    for i, u in enumerate(problem.units):
        prev = i - 1
        joined = (runs and runs[-1][-1] == prev and prev in links and u.name not in special
                  and problem.units[prev].name not in special and u.options == problem.units[prev].options
                  and (len(runs[-1]) < 2 or _prices(links[prev]) == _prices(links[prev - 1])))
        if joined:
            runs[-1].append(i)
        else:
            runs.append([i])
    return [(r[1], r[-2]) for r in runs if len(r) - 2 >= min_interior]


class AggregateModel(CountedRelaxation):
    """The relaxation of one problem with each run interior as counts (see the module docstring)."""

    def __init__(self, problem: PlacementProblem, scale_ns: int, hint: Sequence[int],
                 runs: Sequence[tuple[int, int]], max_work_ns: int | None = None,
                 device_classes: Sequence[Sequence[str]] = ()) -> None:
        """``device_classes``: interchangeable devices (:func:`~.symmetry.identical_devices`); within a
        class, a later device holds or computes no more units than an earlier one (relabelling the
        devices by that count maps every assignment onto one as good that meets it)."""
        self.p, self.scale, self.hint = problem, scale_ns, list(hint)
        self.runs = list(runs)
        self.index = problem.index()
        n = len(problem.units)
        self.item_of = list(range(n))  # unit -> item (an item is a unit, or a run interior)
        self.items: list[tuple[int, int]] = []
        k = 0
        while k < n:
            run = next((r for r in self.runs if r[0] == k), (k, k))
            for u in range(run[0], run[1] + 1):
                self.item_of[u] = len(self.items)
            self.items.append(run)
            k = run[1] + 1
        self.model = cp_model.CpModel()
        self.spine = spine(problem)
        self.vars: list[dict[int, Any]] = [self._counts(t, max_work_ns) for t in range(len(self.items))]
        # first[t][ph][d] / last[t][ph][d]: the device computing item t's first / last unit in phase ph
        self.first = [self._ends(t, self.items[t][0]) for t in range(len(self.items))]
        self.last = [self._ends(t, self.items[t][1]) if self._is_run(t) else self.first[t]
                     for t in range(len(self.items))]
        self.any: list[dict[int, Any]] = []  # run t: any[t][o], 1 when some unit of the interior uses o
        self.computes: list[dict[str, dict[str, Any]]] = []  # run t: computes[t][ph][d], some unit on d in ph
        for t in range(len(self.items)):
            flags, computes = self._used(t)
            self.any.append(flags)
            self.computes.append(computes)
        self.twins = {d for members in device_classes for d in members}
        if problem.copies_beside:  # stall rows: the bound, not the plan, is what the 1 s solves lack
            self.full_subsolvers = OVERLAP_SUBSOLVERS
        self._constraints()
        for members in device_classes:
            usage = [self._usage(d) for d in members]
            for a, b in itertools.pairwise(usage):
                self.model.add(a >= b)
        self.goal: Any = 0

    # -- variables ------------------------------------------------------------------------------
    def _is_run(self, t: int) -> bool:
        return self.items[t][0] != self.items[t][1]

    def _size(self, t: int) -> int:
        return self.items[t][1] - self.items[t][0] + 1

    def _options(self, t: int) -> tuple[PlacementOption, ...]:
        return self.p.units[self.items[t][0]].options

    def _phases(self, t: int) -> tuple[str, ...]:
        """The phases whose device flags item t needs: the decode's (the execution device) alone unless
        an option of t is phased (then the prefill computes elsewhere and gets flags of its own)."""
        return _PHASES[::-1] if any(o.mode == "phased" for o in self._options(t)) else ("decode_ns",)

    def _counts(self, t: int, max_work_ns: int | None) -> dict[int, Any]:
        # n[t, o]: units of item t on option o (a 0/1 for a single unit). Options pinned away, or
        # whose own work exceeds max_work_ns (no better plan uses them), are left out.
        a, b = self.items[t]
        spec = self.p.units[a]
        size = b - a + 1
        hinted = [self.hint[u] for u in range(a, b + 1)]
        out = {}
        for o, opt in enumerate(spec.options):
            keep = self.p.allows(spec, opt) or o in hinted
            if max_work_ns is not None and o not in hinted:
                keep = keep and own_work(opt) <= max_work_ns
            if keep:
                out[o] = self._hinted(self.model.new_int_var(0, size, f"n[{t},{o}]"), hinted.count(o))
        self.model.add(sum(out.values()) == size)
        return out

    def _hinted(self, var: Any, value: int) -> Any:
        self.model.add_hint(var, value)
        return var

    def _ends(self, t: int, unit: int) -> dict[str, dict[str, Any]]:
        """Phase -> the device computing ``unit`` (the first or last of item t) in it, as 0/1 per device."""
        ends = {ph: self._end(t, unit, ph) for ph in self._phases(t)}
        return {ph: ends.get(ph, ends["decode_ns"]) for ph in _PHASES}

    def _end(self, t: int, unit: int, ph: str) -> dict[str, Any]:
        if not self._is_run(t):
            return {d: sum(v for o, v in self.vars[t].items() if self._options(t)[o].device_in(ph) == d)
                    for d in self._devices()}
        hinted = self.p.units[unit].options[self.hint[unit]].device_in(ph)
        tag = "" if ph == "decode_ns" else f"{ph},"
        flags = {d: self._hinted(self.model.new_bool_var(f"end[{tag}{t},{unit},{d}]"), int(d == hinted))
                 for d in self._devices()}
        self.model.add_exactly_one(list(flags.values()))
        return flags

    def _devices(self) -> list[str]:
        return [d.name for d in self.p.devices]

    def _used(self, t: int) -> tuple[dict[int, Any], dict[str, dict[str, Any]]]:
        """any[t, o] (item t uses option o at all) and, per phase and device, whether item t computes there."""
        if not self._is_run(t):
            return {}, {}
        size = self._size(t)
        hinted = [self.hint[u] for u in range(self.items[t][0], self.items[t][1] + 1)]
        flags: dict[int, Any] = {}
        for o, n in self.vars[t].items():
            f = self._hinted(self.model.new_bool_var(f"any[{t},{o}]"), int(o in hinted))
            self.model.add(n <= min(size, most_beside_peak(self.p, self._options(t)[o])) * f)
            self.model.add(n >= f)
            flags[o] = f
        computes = {ph: self._computes(t, ph, flags, hinted) for ph in self._phases(t)}
        return flags, {ph: computes.get(ph, computes["decode_ns"]) for ph in _PHASES}

    def _computes(self, t: int, ph: str, flags: dict[int, Any], hinted: list[int]) -> dict[str, Any]:
        # computes[t, d] = OR of any[t, o] over the options computing on d in phase ph; the interior's
        # first and last units compute only where some unit of it does.
        opts = self._options(t)
        execs = {opts[o].device_in(ph) for o in hinted}
        tag = "" if ph == "decode_ns" else f"{ph},"
        out = {}
        for d in self._devices():
            on = [f for o, f in flags.items() if opts[o].device_in(ph) == d]
            g = self._hinted(self.model.new_bool_var(f"computes[{tag}{t},{d}]"), int(d in execs))
            for f in on:
                self.model.add(g >= f)
            self.model.add(g <= sum(on))
            self.model.add(self.first[t][ph][d] <= g)
            self.model.add(self.last[t][ph][d] <= g)
            out[d] = g
        return out

    # -- constraints ----------------------------------------------------------------------------
    def _terms(self, device: str | None = None, phase: str | None = None) -> list[tuple[PlacementOption, Any]]:
        return [(self._options(t)[o], v) for t in range(len(self.items)) for o, v in self.vars[t].items()
                if device is None or computes_on(self._options(t)[o], device, phase)]

    def _constraints(self) -> None:
        self.levels: dict[str, tuple[list[int], list[Any]]] = {}
        self.peak = {d: self._peak(d) for d in self._devices()}
        terms = self._terms()
        bounded = [(self._options(t)[o], v, self._size(t)) for t in range(len(self.items)) for o, v in self.vars[t].items()]
        for dev in self.p.devices:
            add_capacity_row(self.model, dev, self.peak[dev.name], terms)
            if dev.name in self.twins:  # where the LP spreads a transient over interchangeable GPUs
                add_level_caps(self.model, dev, *self.levels[dev.name], bounded)
        for u, d in self.p.pins.items():  # pinned units are never in a run: their item is the unit
            t = self.item_of[self.index[u]]
            for o, v in self.vars[t].items():
                if self._options(t)[o].storage != d:
                    self.model.add(v == 0)
        for group in self.p.tied_groups:
            first = self.item_of[self.index[group[0]]]
            for name in group[1:]:
                t = self.item_of[self.index[name]]
                for d in self._devices():
                    self.model.add(self._stored(first, d) == self._stored(t, d))
        self._contiguous_storage()

    def _contiguous_storage(self) -> None:
        # A contiguous problem stores one range of PlacementProblem.stored_units per device. Over the items
        # that store (units, and interiors taken whole, whose order is free), a device's items form one range;
        # an interior between two items storing on the device is wholly on it. (The order inside an interior
        # is relaxed: a device's range may start or end there.)
        if not self.p.contiguous:
            return
        stored = set(self.p.stored_units)
        items = [t for t, (a, b) in enumerate(self.items) if any(u in stored for u in range(a, b + 1))]
        for d in self._devices():
            on = [self._stores_on(t, d) for t in items]
            starts = []
            for k, flag in enumerate(on):
                start = self.model.new_bool_var(f"start[{items[k]},{d}]")
                self.model.add(start >= flag - (on[k - 1] if k else 0))
                starts.append(start)
            self.model.add(sum(starts) <= 1)
            for k in range(1, len(items) - 1):
                if self._is_run(t := items[k]):
                    self.model.add(self._stored(t, d) >= self._size(t) * (on[k - 1] + on[k + 1] - 1))

    def _stores_on(self, t: int, d: str) -> Any:
        """1 when some unit of item t stores on d: its 0/1 count for a single unit, a flag over its options' any[t, o]
        for an interior."""
        if not self._is_run(t):
            return self._stored(t, d)
        flags = [self.any[t][o] for o in self.vars[t] if self._options(t)[o].storage == d]
        if not flags:
            return 0
        on = self.model.new_bool_var(f"stores[{t},{d}]")
        for f in flags:
            self.model.add(on >= f)
        self.model.add(on <= sum(flags))
        return on

    def _usage(self, d: str) -> Any:
        """Units stored or computed (in either phase) on d."""
        return sum(v for opt, v in self._terms() if d in (opt.storage, opt.execution, opt.prefill_execution))

    def _stored(self, t: int, d: str) -> Any:
        return sum(v for o, v in self.vars[t].items() if self._options(t)[o].storage == d)

    def _peak(self, dev: str) -> Any:
        # A run's option sets its peak levels (each transient it puts on dev) through its any[t, o] flag
        # (a count is not a 0/1).
        flagged = [(nbytes, self.any[t][o] if self._is_run(t) else v)
                   for t in range(len(self.items)) for o, v in self.vars[t].items()
                   for nbytes in peak_flags(self._options(t)[o], dev)]
        peak, levels, z = peak_levels(self.model, dev, flagged)
        self.levels[dev] = (levels, z)
        return peak

    def _transfer(self, ph: str, costs: dict, src: dict[str, Any], dst: dict[str, Any], name: str) -> Any:
        # xfer >= sum_q c(p, q) dst[q] - max_q c(p, q) (1 - src[p]), one row per p (src and dst sum to 1).
        costs = {pq: self._t(c) for pq, c in costs.items() if pq[0] != pq[1] and self._t(c) > 0}
        if not costs:
            return 0
        var = self.model.new_int_var(0, max(costs.values()), name)
        for p in sorted({pq[0] for pq in costs}):
            row = {q: c for (s, q), c in costs.items() if s == p}
            self.model.add(var >= sum(c * dst.get(q, 0) for q, c in row.items()) - max(row.values()) * (1 - src.get(p, 0)))
        return var

    def _inside(self, ph: str, t: int) -> Any:
        # The interior's own edges: at least c_min per device change in phase ph, and k devices need k - 1 changes.
        a = self.items[t][0]
        link = next(e for e in self.p.edges if self.index[e.src] == a)
        execs = sorted({o.device_in(ph) for o in self._options(t)})
        prices = [self._t(getattr(link, ph).get((p, q), 0)) for p in execs for q in execs if p != q]
        cheapest = min(prices, default=0)
        if not cheapest:
            return 0
        return cheapest * (sum(self.computes[t][ph][d] for d in self._devices()) - 1)

    def _phase(self, ph: str) -> Any:
        # Items in order; an item ends at max(arrivals) + its work (+ the interior's own transfers).
        ends: list[Any] = []
        incoming: dict[int, list[tuple[int, EdgeSpec]]] = {}
        for e in self.p.edges:
            s, d = self.item_of[self.index[e.src]], self.item_of[self.index[e.dst]]
            if s != d:
                incoming.setdefault(d, []).append((s, e))
        has_out = {s for es in incoming.values() for s, _ in es}
        horizon = sum(self._size(t) * max(self._t(getattr(o, ph)) for o in self._options(t)) for t in range(len(self.items)))
        horizon += sum(max([self._t(c) for c in getattr(e, ph).values()], default=0) for e in self.p.edges)
        lat = self.model.new_int_var(0, horizon + self._shared_horizon(ph), f"lat[{ph}]")
        self._shared_rows(ph, lat)
        stall = self._stalls(ph, [(self._options(t)[o], v) for t in range(len(self.items))
                                  if all(u in self.spine for u in range(self.items[t][0], self.items[t][1] + 1))
                                  for o, v in self.vars[t].items()])
        for t in range(len(self.items)):
            work = sum(self._t(getattr(self._options(t)[o], ph)) * v for o, v in self.vars[t].items())
            if self._is_run(t):
                work += self._inside(ph, t)
            arrivals = [ends[s] + self._transfer(ph, getattr(e, ph), self.last[s][ph], self.first[t][ph],
                                                 f"x[{ph},{s},{t}]")
                        for s, e in incoming.get(t, [])]
            if len(arrivals) <= 1:
                ends.append((arrivals[0] if arrivals else 0) + work)
            else:
                end = self.model.new_int_var(0, horizon, f"end[{ph},{t}]")
                for arrival in arrivals:
                    self.model.add(end >= arrival + work)
                ends.append(end)
            if t not in has_out:
                self.model.add(lat >= ends[t] + stall)
        for dev in self._devices():
            work = [self._t(getattr(o, ph)) * v for o, v in self._terms(dev, ph)]
            if work:
                self.model.add(lat >= sum(work))
        return lat

    # -- objective, solve, read -----------------------------------------------------------------
    def read(self, solver: cp_model.CpSolver) -> list[int]:
        """An assignment: singles as solved, each interior in one block per device, first and last at the
        ends; or, when it prices lower, each interior's streamed units spread among its others, so that
        their copies run beside the others' compute (problem.stalls), or every option of an interior spread
        evenly (:func:`interleaved`), or each run of like units, its ends included, dealt out as windows that
        count what computes around it (:func:`.polish.arranged`)."""
        blocks = self._blocks(solver)
        plain = [o for units, _ in blocks for o in units]
        if self.p.contiguous:  # each run's placements sorted by storage device; spreading would interleave them
            return ranged(self.p, plain)
        return self._cheapest(plain, [*(self._dealt(blocks, ph, deal) for ph in _PHASES
                                        for deal in (spread_streamed, balanced, interleaved)),
                                      *(arranged(self.p, plain, ph) for ph in _PHASES)])

    def _blocks(self, solver: cp_model.CpSolver) -> list[tuple[list[int], Sequence[PlacementOption] | None]]:
        """Per item, its options in order and, for a run interior, its menu (None for a single): each interior's
        counts in one block per device, the one computing its first unit first and its last unit's last."""
        out: list[tuple[list[int], Sequence[PlacementOption] | None]] = []
        for t in range(len(self.items)):
            counts = {o: solver.value(v) for o, v in self.vars[t].items()}
            if not self._is_run(t):
                out.append(([next(o for o, c in counts.items() if c)], None))
                continue
            opts = self._options(t)
            head = next(d for d, f in self.first[t]["decode_ns"].items() if solver.boolean_value(f))
            tail = next(d for d, f in self.last[t]["decode_ns"].items() if solver.boolean_value(f))
            order = sorted(counts, key=lambda o: (opts[o].execution != head, opts[o].execution == tail,
                                                  self._devices().index(opts[o].execution), o))
            out.append(([o for o in order for _ in range(counts[o])], opts))
        return out

    @staticmethod
    def _dealt(blocks: list[tuple[list[int], Sequence[PlacementOption] | None]], phase: str, deal: Deal) -> list[int]:
        """:meth:`_blocks` with each run interior's options dealt by ``deal`` for ``phase``."""
        return [o for units, opts in blocks for o in (units if opts is None else deal(units, opts, phase))]


def interleaved(units: list[int], opts: Sequence[PlacementOption], phase: str) -> list[int]:
    """``units`` (option indices of like units) with every option spread evenly among them, the ``k``-th of an
    option's ``c`` units near ``(k + 1/2) / c`` of the way along; at one place, what copies in ``phase`` after what
    does not (its copy then runs beside that compute), the longer compute first.

    :func:`spread_streamed` spreads the streamed units and keeps the rest in blocks per device: a GPU's resident
    units, fast, all together, and a block of CPU-computed ones, slow, that hides more than one copy could use.
    The optimum mixes them: Gemma-2-27B on 4x T4 at batch 16 x 1024 (overlap) pairs each layer streamed to a GPU
    with one computed on the CPU before it, among resident ones, at 175.7 s. The grouped relaxation's counts
    read into 237.3 s in blocks and spread, 178.0 s interleaved (the best of a 2 s run's solutions, each way).

    Sorting the places alone piles options that share one up (three single units and eight of a fourth: the
    fourth falls 1.35 units behind its share), so the deal goes slot by slot: an option is dealt only while it is
    not ahead of its share, and one a whole unit behind goes first. With up to four options every prefix then holds
    each option's share within one unit (checked exhaustively up to 30 units); with five or six, about one mix of
    counts in ten thousand still strays up to 1.2 units (sorted places: one in thirty, up to 1.6)."""
    counts = Counter(units)
    n = len(units)
    ties = {o: (opts[o].copy_in(phase) > 0, -opts[o].work_in(phase), o) for o in counts}
    dealt = dict.fromkeys(counts, 0)
    out: list[int] = []
    for slot in range(1, n + 1):
        # an option's share of the first ``slot`` places is ``slot * c / n``; compared times ``n``, in integers.
        # Places as floats order exactly: distinct ones differ by at least 1 / (2n)^2, far above rounding.
        o = min((o for o, c in counts.items() if dealt[o] * n < slot * c),
                key=lambda o: (slot * counts[o] - dealt[o] * n < n,  # a whole unit behind: first
                               (2 * dealt[o] + 1) * n / (2 * counts[o]), ties[o]))
        dealt[o] += 1
        out.append(o)
    return out


def spread_streamed(units: list[int], opts: Sequence[PlacementOption], phase: str) -> list[int]:
    """``units`` (option indices) with those the prefetch thread copies in ``phase`` spaced evenly among the
    rest, each after its share of them."""
    streamed = [o for o in units if opts[o].copy_in(phase)]
    rest = [o for o in units if not opts[o].copy_in(phase)]
    if not streamed or not rest:
        return units
    out: list[int] = []
    taken = 0
    for k, o in enumerate(streamed):
        upto = round((k + 1) * len(rest) / len(streamed))
        out += rest[taken:upto]
        taken = upto
        out.append(o)
    return out + rest[taken:]
