"""The latency rows of :class:`~.cpsat.PlacementModel`: transfers, longest paths, stalls, the slowest stage.

Torch-free. A mixin: it reads the model's data and variables (``p``, ``x``, ``model``, ``chosen``,
``index``, ``devices``, ``chain``, ``_exec_devices``) and its helpers (``_t``, ``_opts``, ``_on``,
``_hinted``, ``_terms``, ``_duration``, ``_in_time``), all set up by :class:`~.cpsat.PlacementModel`;
the variables it adds (``xfer``, ``end``, ``wait``, ``beside``, ``streams``, ``lat``, ``stage``) are
defined in :mod:`.cpsat`'s docstring.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from .problem import stalls
from .rows import stage_work

__all__: list[str] = []


class _LatencyRows:
    """Each phase's latency (longest path, transfers and stalls included; every device's and shared resource's
    load) and the throughput objective's slowest stage."""

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
