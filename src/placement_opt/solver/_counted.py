"""What the two counting relaxations share: integer time, the three goals, and the CP-SAT run.

Torch-free. :class:`~.aggregate.AggregateModel` (runs of identical units) and
:class:`~.relax.GroupModel` (like units anywhere) differ in what they count and in the path term of
a phase's latency; once each states :meth:`CountedRelaxation._phase` and
:meth:`CountedRelaxation._terms`, the goals and the solve are the same, and live here once.
"""

from __future__ import annotations

from typing import Any

from ortools.sat.python import cp_model

from .problem import PlacementOption, PlacementProblem
from .rows import new_solver, stage_work

__all__ = ["CountedRelaxation", "Snapshot", "STALL_CUT_SIZES", "KEEP_SOLUTIONS", "MIN_BOUND_PASS_S",
           "BOUND_PASS_SUBSOLVERS", "SEARCH_SUBSOLVERS", "hiding"]

#: The stall rows use each of this many largest distinct unit times (below the widest copy gap) as the
#: window's unit size ``B``.
STALL_CUT_SIZES = 4
#: Solutions of a relaxation kept besides its last one (:attr:`CountedRelaxation.solutions`). A
#: relaxation's later solutions are better *counts*, not better plans: on a module-level Llama-3-70B
#: on an RTX 4090 + 3090, one run's 35 solutions read into plans priced from 453.7 s to 508 s, its
#: last one at 466.8 s, its best at its 13th; a 15 s run's 30 solutions read best (453.1 s) at the
#: 21st, and its last 12 had read worse than the start in an earlier run, so that 15 s returned the
#: start (560 s) where 5 s had returned 468 s. Past this many, every other one of the older half is
#: let go: a long run keeps solutions from all along it.
KEEP_SOLUTIONS = 48
#: The bound pass's full workers (as many as the search has): ``max_lp``, CP-SAT's strongest linear
#: relaxation, and ``objective_lb_search``, which searches at the objective's lower bound and raises
#: it, from ``max_lp``'s bound once shared. Module-level Llama-3-70B on RTX 4090 + 3090, alone on the
#: relaxation: 435.6 s after 0.3 s and 436.1 s after 1 s with ``max_lp`` (and neighbourhood search
#: beside it), 443.2 s and 451.1 s with both; on 4x T4 235.1 s and 236.0 s.
BOUND_PASS_SUBSOLVERS = ("max_lp", "objective_lb_search")
#: Least time a bound pass (:attr:`CountedRelaxation.bound_share`) is worth running for: loading the
#: model twice costs about this much.
MIN_BOUND_PASS_S = 0.05
#: :attr:`CountedRelaxation.full_subsolvers` of the grouped relaxation: with two workers or more, one
#: run whose workers are both full solvers, ``objective_lb_search`` (it raises the bound by searching
#: at it, and finds plans there too) beside ``default_lp`` (the plans), instead of a bound pass and
#: then the default pair. The default pair is one full solver beside neighbourhood search, and on
#: these models one neighbourhood call took 0.63 s of a 1 s run for nothing. Module-level Llama-3-70B
#: at 2 s, seeds 0-11, this machine: 24/24 solves within 1 % (4x T4: plans 331.3-331.8 s, bounds
#: 328.8-330.3 s; RTX 4090 + 3090: 706.3-707.3 s, 705.1-705.5 s) against 14/20 with the bound pass
#: at 35 % of the time and 4/8 at 20 % (plans up to 335 s and 766.8 s, bounds down to 695.4 s).
SEARCH_SUBSOLVERS = ("objective_lb_search", "default_lp")


class Snapshot:
    """One solution of a CP-SAT run, read like the solver: ``value(var)`` and ``boolean_value(literal)``."""

    def __init__(self, values: list[int]) -> None:
        self._values = values

    def value(self, var: Any) -> int:
        return self._values[var.index]

    def boolean_value(self, literal: Any) -> bool:
        i = literal.index
        return bool(self._values[i]) if i >= 0 else not self._values[-i - 1]


class _Keep(cp_model.CpSolverSolutionCallback):
    """Keeps up to ``most`` solutions' variable values (a copy of the response's list: cheap), the last
    one always; when full, every other one of the older half goes."""

    def __init__(self, most: int) -> None:
        super().__init__()
        self.most = max(2, most)
        self.kept: list[list[int]] = []

    def on_solution_callback(self) -> None:
        self.add(list(self.response_proto.solution))

    def add(self, values: list[int]) -> None:
        self.kept.append(values)
        if len(self.kept) > self.most:
            half = (len(self.kept) + 1) // 2
            self.kept[:half] = self.kept[:half][::2]


def hiding(b: int, size: int, j0: int, delta: int) -> int:
    """What one unit computing ``b`` takes off a window's stall row (:meth:`CountedRelaxation._stalls`, unit
    size ``size``, ``j0`` and ``delta`` of its copy gap): ``min(b, delta)`` up to the unit size, where it
    hides ``b`` of a gap that whole units of ``size`` leave at ``delta``; above it, as ``ceil(b / size)``
    units of ``size`` (which hide more), ``delta`` each, at most ``j0 + 1`` (the whole gap)."""
    if b <= size:
        return min(b, delta)
    return delta * min(j0 + 1, -(-b // size))


def _window_rows(gap: int, sizes: dict[Any, int]) -> list[tuple[int, dict[Any, int]]]:
    """``(each, worth)`` rows of the windows of one copy price whose ``gap`` units hide, ``sizes`` what each kind
    of unit hides: ``stall >= each x n_streamed - sum of worth x units of that kind in those windows``. Per
    window ``max(0, gap - x) >= gap - sum of min(b, gap)``, and the convex envelope of whole units of each of
    the :data:`STALL_CUT_SIZES` largest sizes below the gap (:func:`hiding`). No rows when ``gap <= 0``."""
    if gap <= 0:
        return []
    rows = [(gap, {key: min(b, gap) for key, b in sizes.items()})]
    for size in sorted({b for b in sizes.values() if b < gap})[-STALL_CUT_SIZES:]:
        j0, delta = divmod(gap, size)
        if delta:
            rows.append((delta * (j0 + 1), {key: hiding(b, size, j0, delta) for key, b in sizes.items()}))
    return rows + _lifted_rows(gap, sizes)


def _lifted_rows(gap: int, sizes: dict[Any, int]) -> list[tuple[int, dict[Any, int]]]:
    """:func:`_window_rows` for windows mixing two sizes: ``m = gap // s`` units of a larger size ``s`` leave ``h``,
    which whole units of a smaller size ``B`` round (``j0 = h // B``, ``delta = h % B``, ``d = delta (j0 + 1)``, the
    single-size row on ``h``), lifted in the ``s`` units by ``d`` each: ``(m + 1) d - d n_s - delta n_B``, zero at
    ``m + 1`` units of ``s``. Other units count ``min(b, each)``, which keeps any valid row valid. A row is kept
    only where it holds at every mix of the two sizes (checked: beyond ``ceil(gap / b)`` units of a size the
    window's stall is 0 and the row lower still), as it need not when ``s`` is small beside ``B``.

    Llama-2-13B on an RTX 3060 (chat, overlap): streamed layers whose 25.4 ms copy leaves 23.1 ms to hide, beside
    CPU-decoded layers (19.2 ms) and resident ones (2.3 ms): one CPU layer and two resident hide a copy, one and
    one leave 1.5 ms. The single-size rows bound the decode's stall at 0.93 s over 128 steps where 15 resident
    layers for 12 windows leave at least 1.35 s; this row (``s`` the CPU layer, ``B`` the resident one) states it."""
    distinct = sorted({b for b in sizes.values() if b < gap})[-STALL_CUT_SIZES:]
    rows = []
    for s in distinct:
        m, h = divmod(gap, s)
        for small in (b for b in distinct if b < min(s, h)):
            j0, delta = divmod(h, small)
            if not delta:
                continue
            d = delta * (j0 + 1)
            each = (m + 1) * d
            if _holds(gap, (s, d), (small, delta), each):
                rows.append((each, {key: d if b == s else delta if b == small else min(b, each)
                                    for key, b in sizes.items()}))
    return rows


#: Most mixes of two sizes :func:`_holds` checks; past it a row is left out (tiny units beside a long gap).
_MOST_MIXES = 4096


def _holds(gap: int, first: tuple[int, int], second: tuple[int, int], each: int) -> bool:
    """Whether ``each - w1 n1 - w2 n2 <= max(0, gap - b1 n1 - b2 n2)`` at every whole ``n1, n2 >= 0``
    (``first``, ``second``: a size and its worth)."""
    (b1, w1), (b2, w2) = first, second
    n1_most, n2_most = -(-gap // b1), -(-gap // b2)
    if (n1_most + 1) * (n2_most + 1) > _MOST_MIXES:
        return False
    return all(each - w1 * n1 - w2 * n2 <= max(0, gap - b1 * n1 - b2 * n2)
               for n1 in range(n1_most + 1) for n2 in range(n2_most + 1))


def hinted_windows(items: list[tuple[Any, int, int]], cyclic: bool) -> tuple[dict[tuple[Any, int], int], dict[int, int]]:
    """Of ``items`` in order (``(key, compute, copy)``): how many of each key sit in the windows of each copy price
    (``(key, price) -> count``; a streamed item hides in the next one's window), and how many streamed items each
    price has; ``cyclic``: the decode, whose last window wraps round to the first."""
    streamed: dict[int, int] = {}
    for *_, c in items:
        if c > 0:
            streamed[c] = streamed.get(c, 0) + 1
    windows: dict[tuple[Any, int], int] = {}
    ahead = next((c for *_, c in items if c > 0), 0) if cyclic else 0  # round the decode's cycle
    for key, b, c in reversed(items):
        if ahead and b > 0:
            windows[key, ahead] = windows.get((key, ahead), 0) + 1
        if c > 0:
            ahead = c
    return windows, streamed


class CountedRelaxation:
    """Base of the counting relaxations; a subclass sets ``p``, ``scale``, ``hint``, ``model`` and ``peak``."""

    p: PlacementProblem
    hint: list[int]
    """The start plan (an option per unit): the model's hints, and :meth:`_hinted_windows`'."""
    scale: int
    """Nanoseconds per solver time unit."""
    model: cp_model.CpModel
    peak: dict[str, Any]
    """Device name -> its transient peak bytes (a linear expression)."""
    goal: Any = 0
    bound_share: float = 0.0
    """Share of :meth:`solve`'s time for a first pass by :data:`BOUND_PASS_SUBSOLVERS`, mostly for the
    bound (its solutions are kept too); the search for plans gets the rest. Not with
    :attr:`full_subsolvers` and two workers or more."""
    full_subsolvers: tuple[str, ...] = ()
    """With as many workers or more: :meth:`solve`'s one run has these as its full workers (the
    default: one full worker, the others neighbourhood search)."""
    pass_bound: float = 0.0
    """After :meth:`solve`: the bound pass's proven objective bound (0 without one), solver units."""
    solutions: list[Snapshot] = []
    """After :meth:`solve`: up to :data:`KEEP_SOLUTIONS` earlier solutions (from all along a long run),
    newest first; each reads (``read(snapshot)``) into a plan that may price lower than the last one's."""

    def _terms(self, device: str | None = None, phase: str | None = None) -> list[tuple[PlacementOption, Any]]:
        """(option, count of units on it), for the options computing on ``device`` in ``phase`` (in either
        phase when None; every option when ``device`` is None)."""
        raise NotImplementedError

    def _phase(self, ph: str) -> Any:
        """A lower bound of phase ``ph``'s latency, in solver units."""
        raise NotImplementedError

    def _t(self, ns: int) -> int:
        return (ns + self.scale // 2) // self.scale if self.scale > 1 else ns

    def _cheapest(self, first: list[int], others: list[list[int]]) -> list[int]:
        """``first`` (the plain read), or the one of ``others`` (the same counts in other orders) over the devices'
        memory by the fewest bytes, then the lowest-priced; ``first`` wins ties, and is not priced at all when no
        other order differs from it. (The caller makes room in a plan over memory: the less over, the less moves.)"""
        others = [c for c in others if c != first]
        if not others:
            return first

        def key(choice: list[int]) -> tuple[int, int]:
            score = self.p.score(choice)
            return sum(score.over_bytes.values()), score.latency_ns

        return min([first, *others], key=key)

    def _shared_rows(self, ph: str, lat: Any) -> None:
        """``lat >=`` each of ``SHARED``'s time in ``ph`` (copies, host memory, disk). Durations count compute
        alone and stalls are left out: both models stay relaxations (stalls are >= 0)."""
        for res in self.p.shared_used(ph):
            shared = [self._t(o.shared_in(res, ph)) * n for o, n in self._terms() if self._t(o.shared_in(res, ph))]
            if shared:
                self.model.add(lat >= sum(shared))

    def _stalls(self, ph: str, spine: list[tuple[PlacementOption, Any]]) -> Any:
        """A lower bound of the total stall of the units of ``spine`` (their options and counts) in phase ``ph``,
        in solver units (0 when none copies in ``ph``).

        ``spine``: units on every path of the DAG (:func:`~.problem.spine`): each longest path holds their
        stalls, so the caller adds this to it. Each streamed
        unit waits for what the units since the previous streamed unit (a *window*: that unit and the ones
        after it) leave of its copy ``c``: at least ``max(0, c - x)``, ``x`` what the window's units compute.
        The window's first unit is credited with ``a`` (:meth:`_credited`: what the streamed option most
        units offer computes), so ``g = c - a`` is left to the others; a streamed unit computing more than
        ``a`` hides its excess as one of them, shared out like them (one window each). Credited with the
        most any streamed option computes instead, a streamed lm_head's 33.8 ms over the decode gave every
        layer's window (15.4 ms) 18 ms it does not have: on the H100 host's Llama-3-8B at 10 GiB, batch 1 x
        512 + 32 with overlap, the bound stopped at 1.888 s against plans of 1.988 s; credited so, 1.982 s.
        With windows of whole units of at most ``B`` each, ``j`` units
        hide at most ``j B``, and over integers ``j`` the convex envelope of ``max(0, g - j B)``
        (``g = c - a``) is ``delta (j0 + 1 - j)`` above ``j0 = g // B`` (``delta = g - j0 B``): summed over
        the windows of the units on one copy price, ``stall >= delta (j0 + 1) n_streamed - sum of worths``,
        a unit's worth (:func:`hiding`) ``delta`` for a unit of ``B``. Exact for identical layers: the
        bound balanced windows reach. (Valid per window for every mix of units: tests/solver/test_bound.py.)
        Per window also ``max(0, g - x) >= g - sum of min(b, g)``: a unit wider than the gap hides only the gap;
        and, for windows mixing a larger and a smaller size, the lifted rows of :func:`_lifted_rows`.

        A unit sits in one window at most, so the prices' windows share the hiding units out: counts
        ``in[b, c]`` of the units computing ``b`` in windows of price ``c``, at most the units computing
        ``b``, and the stall is the sum of each price's rows over its share. Stated per price with every
        hiding unit available to each (as before), Mistral-7B on an RTX 3060 at batch 16 x 1024 (overlap)
        had seven CPU-decoded layers of 3.7 s hide every layer's 2.2 s copy, an embedding's and lm_head's
        at once: bound 47.3 s at 1, 5 and 30 s against plans of 48.8 s; shared out, 48.7 s.

        With copy runs (``copy_groups``) a run's copy hides behind one window for all its streamed units, so
        the per-unit windows above would over-count: :meth:`_run_stalls` states those.
        """
        if "copy" not in self.p.shared_used(ph):
            return 0
        if self.p.copy_runs is not None:
            return self._run_stalls(ph, spine)
        streamed = self._streamed(ph, spine)
        if not streamed:
            return 0
        a, hiders, sizes = self._hiding_kinds(ph)
        return self._shared_windows(ph, streamed, (a, hiders, sizes), self._hinted_windows(ph), len(self.p.units),
                                    self._most_copies(ph))

    def _shared_windows(self, tag: str, streamed: dict[int, list[Any]],
                        kinds: tuple[int, dict[Any, list[Any]], dict[Any, int]],
                        hints: tuple[dict[tuple[Any, int], int], dict[int, int]], most_in: int, most: int) -> Any:
        """The stall of windows whose first item is credited ``a`` and whose other items hide what ``sizes`` says,
        each item in one window at most (:meth:`_stalls`; its units, or :meth:`.relax.GroupModel`'s copy runs).

        ``streamed``: copy price -> counts of the items streaming at it; ``kinds``: ``(a, hiders, sizes)``, hiders
        keyed like sizes; ``hints``: the start plan's ``(key, price) -> items of key in windows of that price`` and
        ``price -> streamed items``; ``most_in``: the most items of a kind a price's windows hold."""
        a, hiders, sizes = kinds
        hinted, hinted_streamed = hints
        stall = self.model.new_int_var(0, most, f"stall[{tag}]")
        # in[key][copy]: hiding items of that kind in the windows of the streamed items of that copy price; an item
        # sits in one window at most, so each price's windows share the hiding items out
        share = {key: {copy: self.model.new_int_var(0, most_in, f"in[{tag},{key},{copy}]") for copy in streamed}
                 for key in hiders}
        for key, by_copy in share.items():  # a partial hint slowed the relaxation's first solution down
            for copy, var in by_copy.items():
                self.model.add_hint(var, hinted.get((key, copy), 0))
        for key, counts in hiders.items():
            self.model.add(sum(share[key].values()) <= sum(counts))
        per_price = []
        for copy, counts in streamed.items():
            part = self.model.new_int_var(0, most, f"stall[{tag},{copy}]")
            rows = _window_rows(copy - a, sizes)
            if not rows:
                continue
            for each, worth in rows:
                self.model.add(part >= each * sum(counts) - sum(w * share[key][copy] for key, w in worth.items()))
            self.model.add_hint(part, min(most, max([0, *(
                each * hinted_streamed.get(copy, 0) - sum(w * hinted.get((key, copy), 0) for key, w in worth.items())
                for each, worth in rows)])))
            per_price.append(part)
        self.model.add(stall >= sum(per_price))
        return stall

    def _hiding_kinds(self, ph: str) -> tuple[int, dict[tuple[int, bool], list[Any]], dict[tuple[int, bool], int]]:
        """:meth:`_stalls`'s credit ``a`` (:meth:`_credited`), and per kind of unit that hides copies in ``ph``
        (``(compute b, streamed?)``) its counts and what it hides (solver units); kinds that hide nothing are
        left out."""
        # (compute b, streamed?) -> counts of the units computing b in ph: every unit hides in one window at most
        hiders: dict[tuple[int, bool], list[Any]] = {}
        for b, streams, n in self._hiders(ph):
            hiders.setdefault((b, streams), []).append(n)
        a = self._credited(ph)
        # what each hides: its compute; a streamed unit (a window's first) what it computes above the credit
        sizes = {key: key[0] - a if key[1] else key[0] for key in hiders}
        hiders = {key: counts for key, counts in hiders.items() if sizes[key] > 0}
        sizes = {key: sizes[key] for key in hiders}
        return a, hiders, sizes

    def _run_stalls(self, ph: str, spine: list[tuple[PlacementOption, Any]]) -> Any:
        """:meth:`_stalls` with copy runs (a sublayer graph's parts of one layer, copied as one), in solver units.

        A run's copy waits for what the units from the previous streaming run's head on compute, and it is at
        least the copy of each of its streamed units: so the windows of the runs that stream a unit of price
        ``c`` each leave at least ``max(0, c - x)``, one window per such unit where no run holds two units
        offering price ``c`` (a layer's attention and MLP: yes; an MoE layer's experts: no, and that price
        is left out). Each price's rows (:func:`_window_rows`, every unit a hider as it computes, the
        streamed ones included, at most every unit computing so) bound the stall alone, so the stall is at
        least the largest of them: a window streaming two prices is counted once.
        """
        prices = self._run_prices(ph)
        streamed = {c: counts for c, counts in self._streamed(ph, spine).items() if c in prices}
        if not streamed:
            return 0
        hiders: dict[int, list[Any]] = {}
        for b, _, n in self._hiders(ph):
            hiders.setdefault(b, []).append(n)
        stall = self.model.new_int_var(0, self._most_copies(ph), f"stall[{ph}]")
        for copy, counts in streamed.items():
            for each, worth in _window_rows(copy, {b: b for b in hiders}):
                self.model.add(stall >= each * sum(counts) - sum(w * sum(hiders[b]) for b, w in worth.items()))
        return stall

    def _streamed(self, ph: str, spine: list[tuple[PlacementOption, Any]]) -> dict[int, list[Any]]:
        """Copy price in ``ph`` -> the counts of ``spine``'s options that copy at it (solver units)."""
        streamed: dict[int, list[Any]] = {}
        for o, n in spine:
            if self._t(o.copy_in(ph)) > 0:
                streamed.setdefault(self._t(o.copy_in(ph)), []).append(n)
        return streamed

    def _most_copies(self, ph: str) -> int:
        """The most the stall of ``ph`` can be: every unit's largest copy."""
        return sum(max(self._t(o.copy_in(ph)) for o in u.options) for u in self.p.units)

    def _hiders(self, ph: str) -> list[tuple[int, bool, Any]]:
        """``(compute in ph, streams in ph, count)`` of the units that may hide copies, in solver units; the
        compute at most what any unit so counted computes (more hiding: the stall rows stay a bound)."""
        return [(self._t(getattr(o, ph)), self._t(o.copy_in(ph)) > 0, n) for o, n in self._terms()
                if self._t(getattr(o, ph)) > 0]

    def _run_prices(self, ph: str) -> set[int]:
        """The copy prices in ``ph`` that no copy run offers to two of its units (:meth:`_run_stalls`)."""
        seen: set[int] = set()
        twice: set[int] = set()
        for first, end in self.p.copy_runs or ():
            in_run: set[int] = set()
            for u in range(first, end):
                for c in {self._t(o.copy_in(ph)) for o in self.p.units[u].options} - {0}:
                    (twice if c in in_run else in_run).add(c)
            seen |= in_run
        return seen - twice

    def _credited(self, ph: str) -> int:
        """What every window's first unit (the streamed unit before the window's copy) is credited with computing
        in ``ph``: the streamed compute the most units offer (the decoder layers'), the larger on a tie; a
        streamed unit computing more hides the rest as a unit of the window (a costlier option alone, a
        streamed lm_head, would otherwise credit every window with its compute), one computing less is
        credited too much (the rows stay a bound)."""
        offered: dict[int, int] = {}
        for u in self.p.units:
            for b in {self._t(getattr(o, ph)) for o in u.options if self._t(o.copy_in(ph)) > 0}:
                offered[b] = offered.get(b, 0) + 1
        return max(offered, key=lambda b: (offered[b], b), default=0)

    def _hinted_windows(self, ph: str) -> tuple[dict[tuple[Any, int], int], dict[int, int]]:
        """Under the hint, in phase ``ph``: how many units computing ``b`` (streamed or not) sit in windows of copy
        price ``c`` (``((b, streamed), c) -> count``; :meth:`_stalls`'s ``in``), and how many streamed units each
        price has."""
        times = [(self._t(getattr(o, ph)), self._t(o.copy_in(ph))) for o in self.p.options(self.hint)]
        return hinted_windows([((b, c > 0), b, c) for b, c in times], ph == "decode_ns")

    def _shared_horizon(self, ph: str) -> int:
        """The most the shared rows can ask of ``lat[ph]``: what its horizon must allow."""
        used = self.p.shared_used(ph)
        if not used:
            return 0
        # each row rounds each of a unit's terms by at most half a solver unit
        return sum(self._t(most) + len(used) for most in self.p.shared_most(ph))

    def minimize(self, objective: str, latency_cap_ns: int | None, slack: int) -> None:
        """The goals of :meth:`.cpsat.PlacementModel.minimize`; ``slack`` is the latency's rounding slack
        in solver units, added to the memory objective's latency cap."""
        if objective == "throughput":
            stage = self.model.new_int_var(0, sum(self._t(o.work_in("prefill_ns")) + self._t(o.work_in("decode_ns"))
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
        """CP-SAT's run; the solutions before its last, newest first, are left in :attr:`solutions`, and
        the bound pass's bound (when :attr:`bound_share` asks for one) in :attr:`pass_bound`:
        :meth:`proven_bound` reads both."""
        self.model.minimize(self.goal)
        found: list[list[int]] = []  # the bound pass's solutions, read like the search's
        full = self.full_subsolvers if 1 < len(self.full_subsolvers) <= workers else ()
        if not full and self.bound_share * time_limit_s >= MIN_BOUND_PASS_S:
            first, status, found = self._bound_pass(self.bound_share * time_limit_s, seed, workers, gap_limit)
            if status in (cp_model.INFEASIBLE, cp_model.OPTIMAL):  # settled: nothing left to search
                self.solutions = [Snapshot(v) for v in reversed(found[:-1])]
                return first, status
            # The bound is not added to the model as a constraint: that led the search to worse plans
            # (module-level Llama-3-70B on 4x T4, 4 seeds: 249-309 s against 242-284 s without).
            self.pass_bound = first.best_objective_bound
            time_limit_s *= 1 - self.bound_share
        solver = new_solver(time_limit_s, seed, workers, gap_limit)
        if full:
            solver.parameters.subsolvers.extend(full)
            solver.parameters.num_full_subsolvers = len(full)
        keep = _Keep(KEEP_SOLUTIONS + 1)
        status = solver.solve(self.model, keep)
        self.solutions = [Snapshot(v) for v in reversed(found + keep.kept[:-1])]
        return solver, status

    def _bound_pass(self, time_limit_s: float, seed: int, workers: int,
                    gap_limit: float) -> tuple[cp_model.CpSolver, Any, list[list[int]]]:
        """CP-SAT's run with :data:`BOUND_PASS_SUBSOLVERS` as its full workers (no neighbourhood search):
        the solver, its status and its solutions. One worker runs ``max_lp``'s linearization alone."""
        first = new_solver(time_limit_s, seed, workers, gap_limit)
        if workers == 1:
            first.parameters.linearization_level = 2
        else:
            names = BOUND_PASS_SUBSOLVERS[:workers]
            first.parameters.subsolvers.extend(names)
            first.parameters.num_full_subsolvers = len(names)
        keep = _Keep(KEEP_SOLUTIONS)
        return first, first.solve(self.model, keep), keep.kept

    def proven_bound(self, solver: cp_model.CpSolver) -> float:
        """The objective bound proven by ``solver`` (this model's last :meth:`solve`) or its bound pass."""
        return max(solver.best_objective_bound, self.pass_bound)
