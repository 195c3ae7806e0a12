"""Identical units anywhere as counts, one path kept: a small relaxation for large DAGs.

Torch-free. A module-level graph repeats one layer's pattern (norm, q, k, v, o, norm, gate, up,
down) 32 or 80 times, and most of those modules are priced alike in every layer; but they are not
consecutive, so :mod:`.aggregate`'s runs do not see them. :class:`GroupModel` keeps, per *group*
of units with the same options and bytes and times within :data:`TIME_STEP` (:func:`groups_of`), the
number of units on each option,
each option priced at the least time and peak of the group's units, and of the latency only what
counts alone can state:

* every device's total work in each phase, on the device computing it there (at most the real one:
  which unit of a group does what changes it only above the least prices);
* the length of a few paths ``P`` of the graph (the hint's critical path, then
  :func:`~.paths.covering_paths` until every unit lies on one): on each, the groups whose every unit lies on
  ``P`` add their work, and the edges between two groups that follow each other on ``P`` the transfers
  their counts prove (:meth:`GroupModel._crossings`, up to :data:`CROSSINGS_UP_TO` units); the rest adds 0
  (at most what the path costs). Parallel
  siblings (``q``/``k``/``v``, ``gate``/``up``) lie on different paths, so a slow option given to a
  sibling costs on its path: with the critical path alone the relaxation made every off-path
  sibling slow for free;
* the critical path with each set of parallel siblings at its slowest: per *kind* of sibling set (a
  layer's ``q, k, v``; its ``gate, up``), the number of sets whose roles take each combination of
  option classes (:data:`MOST_SLOT_COMBOS` at most). The sibling paths bound ``sum over sets of
  max over roles`` only as ``max over roles of sums``: with ``k`` slow in half the layers and ``v``
  in the other half, each of their paths carried half, the real one all of it;
* capacities with the transient peaks (the least ones: at most the real ones), pins and ties
  (pinned and tied units are groups of their own).

Every assignment maps to counts that cost at most as much, so the proven bound is a bound of the
real problem (less the rounding slack). :meth:`GroupModel.read` hands each group's options out in
unit order, one device after another, so that a layer's modules share a device; under overlap it
spreads each group's streamed units among its others instead when that prices lower. The caller
prices the plan exactly.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

from ortools.sat.python import cp_model

from ._counted import SEARCH_SUBSOLVERS, CountedRelaxation, hinted_windows
from .aggregate import Deal, interleaved, most_beside_peak, spread_streamed
from .paths import sibling_slots
from .problem import PHASES, PlacementOption, PlacementProblem, phase_copies, phase_peaks, spine
from .reductions import copies_apart
from .rows import add_capacity_row, computes_on, own_work, peak_flags, peak_levels

__all__ = ["GroupModel", "groups_of", "PEAK_STEP", "TIME_STEP", "CROSSINGS_UP_TO", "MOST_SLOT_COMBOS", "BOUND_SHARE"]

#: Units whose peaks differ by less than this factor may share a group (priced at the least peak):
#: the relaxation then understates a device's transient memory by at most that factor.
PEAK_STEP = 1.1
#: Most peaks past a group's least that its counts of one option are held to on a device
#: (:meth:`GroupModel._graded_peaks`).
GRADED_LEVELS = 3
#: Units whose options' work (prefill + decode) differ by more than this factor are grouped apart
#: (:func:`groups_of`): a group prices each option at its least time, so one cheap or costly member priced
#: the rest (module-level Mistral-7B's first post-attention norm carries the layer's glue, 9.2 ms of decode
#: against its fellows' 0.77-0.89 ms), and left the bound 0.45 % below the optimum. Apart, module cells at 2 s
#: (benchmarks/solve_time --module) went from a median wall of 1.9 s to 0.5-0.8 s, sublayer Llama-3-8B at 1 s
#: from 0.7 s to 0.17 s.
TIME_STEP = 1.1
#: Problems with at most this many units get the transfers counts prove on each path (:meth:`GroupModel._crossings`).
#: Module-level Mistral-7B (292 units) at 2 s, five runs each: on an RTX 3060 at 6 GiB its gap went from
#: 0.38-0.42 % to 0.09-0.12 %, the other cells as before. Module-level Llama-3-70B (724 units) on 4x T4 went
#: from 0.39-0.64 % to 0.31-2.02 %, and on the RTX 3060 from 0.45-0.58 s to 0.53-1.16 s: its relaxation,
#: which does not finish in the time it gets either way, searched worse with the extra rows.
CROSSINGS_UP_TO = 400
#: Most combinations of option classes a kind of sibling set counts (one integer each), else it keeps
#: its sibling paths only: 392 for a module-level Mistral-7B's q, k, v on one GPU + CPU + disk (and for
#: Llama-3-70B on 4x T4, identical GPUs being one class), 576 on an RTX 4090 + 3090, where the larger
#: model left the 2 s solve of Llama-3-70B at a 16 % gap instead of 5 %.
MOST_SLOT_COMBOS = 400
#: :attr:`~._counted.CountedRelaxation.bound_share` of the grouped relaxation with one worker (two or
#: more run :data:`~._counted.SEARCH_SUBSOLVERS` instead). Which options a group
#: uses at all (their transient peaks) is what its default search proves slowly; the bound pass's
#: workers see more of it at once. Measured before units were priced in turn, with the pass's two
#: workers: module-level Llama-3-70B at 2 s, seeds 0-3, four runs (16 solves):
#: on 4x T4, bounds 234.8-235.0 s in 15 (231.5 s once) against 231.5-232.2 s in 8 without a pass; on
#: RTX 4090 + 3090, 435.7-449.1 s in 15 (390.0 s once) against 390.8-436.1 s. Plans move with the
#: seed and the run either way (241.8-286.8 s and 453.9-560 s with it, 241.8-284.5 s and 453.5-500.9 s
#: without); shares of 0.35 and 0.5 gave no better bounds or plans in one run each.
BOUND_SHARE = 0.2
#: Most combinations of (compute, copy) classes a kind of copy run counts in a phase (one integer each): the groups
#: past it are counted apart from their runs (:func:`_majors`, :meth:`GroupModel._whole_run_stalls`).
MOST_RUN_COMBOS = 16


def groups_of(problem: PlacementProblem, path: Sequence[int] = (),
              others: Sequence[Sequence[int]] = ()) -> list[list[int]]:
    """Units with the same options and bytes (their copy group's share included), peaks within :data:`PEAK_STEP`, on the same ones of
    ``path`` and ``others``, each option's work (prefill + decode) within :data:`TIME_STEP`, in order of first
    appearance; pinned and tied units alone. The group prices each option at its least time and peak.

    The same module is priced a little differently in every layer of a traced graph (an ``o_proj``'s
    workspace grows with the residual stream it is charged with): exact menus would leave 160 of
    Llama-3-70B's 724 modules alone. Units on and off the path stay apart, so that the path's
    groups still lie wholly on it.
    """
    alone = {n for g in problem.tied_groups for n in g} | set(problem.pins)
    on_paths = [set(p) for p in (path, *others)]
    by_menu: dict[Any, list[int]] = {}
    for u, spec in enumerate(problem.units):
        key = ("alone", u) if spec.name in alone else (tuple(u in p for p in on_paths), tuple(
            (o.storage, o.execution, o.mode, o.stored_bytes, o.resident_bytes, o.group_copy_bytes,
             _bucket(o.peak_bytes), _bucket(o.work_ns, TIME_STEP))
            + ((o.prefill_execution, _bucket(o.prefill_peak_bytes)) if o.mode == "phased" else ())
            for o in spec.options))
        by_menu.setdefault(key, []).append(u)
    return list(by_menu.values())


#: The whole-run stall rows take each run's compute at the largest and its copy at the least of those within this
#: factor of it (more hiding, less to hide: still a bound), so that runs of near sums share a count: on the H200
#: profile's sublayer Llama-3.1-8B at 10 GiB (overlap, one worker, three seeds) the relaxation proves 0.8825 s in
#: 0.8-4.1 s where exact sums prove 0.8838 s in 4.1-8.3 s.
RUN_STEP = 1.03
#: Copies below this share of a phase's largest are counted as none in the whole-run stall rows (a norm's, beside
#: an MLP's 600x larger): fewer classes to combine, and a bound still.
LEAST_RUN_COPY = 0.01


def _nearest(values: Sequence[int], pick: Any) -> dict[int, int]:
    """Each of ``values`` -> ``pick`` (max or min) of those within :data:`RUN_STEP` of it (one bucket)."""
    buckets: dict[int, list[int]] = {}
    for v in values:
        buckets.setdefault(_bucket(v, RUN_STEP), []).append(v)
    return {v: pick(buckets[_bucket(v, RUN_STEP)]) for v in values}


def _majors(kinds: list[tuple[int, ...]], classes: dict[int, dict[tuple[int, int], list[Any]]]) -> set[int]:
    """The groups whose units the whole-run rows count inside their runs: by their largest copy, then the spread of
    their compute, as long as every kind of run has at most :data:`MOST_RUN_COMBOS` combinations of them (the
    others are counted apart from their runs, and as streaming nothing)."""
    def rank(k: int) -> tuple[int, int]:
        computes = [b for b, _ in classes[k]]
        return max(c for _, c in classes[k]), max(computes) - min(computes)

    majors: set[int] = set()
    for k in sorted(classes, key=rank, reverse=True):
        if len(classes[k]) == 1 or all(math.prod(len(classes[g]) for g in key if g in majors or g == k)
                                       <= MOST_RUN_COMBOS for key in kinds if k in key):
            majors.add(k)
    return majors


def _past_least(values: Sequence[int]) -> list[int]:
    """Of sorted ``values``, the positions ``j`` where a larger one starts (``j`` of them lie below it): up to
    :data:`GRADED_LEVELS`, the first ones and the last."""
    steps = [j for j in range(1, len(values)) if values[j] > values[j - 1]]
    return list(dict.fromkeys([*steps[:GRADED_LEVELS - 1], *steps[-1:]]))


def _bucket(amount: int, step: float = PEAK_STEP) -> int:
    """Amounts within a factor ``step`` share a bucket: the group's least is at most that far below."""
    return 0 if amount <= 0 else int(math.log(amount) / math.log(step))


def _least(options: Sequence[Sequence[PlacementOption]]) -> tuple[PlacementOption, ...]:
    """Option by option, the least time and peaks over the units of a group (bytes and devices are equal)."""
    return tuple(dataclasses.replace(same[0], prefill_ns=min(o.prefill_ns for o in same),
                                     decode_ns=min(o.decode_ns for o in same),
                                     copy_prefill_ns=min(o.copy_prefill_ns for o in same),
                                     copy_decode_ns=min(o.copy_decode_ns for o in same),
                                     host_prefill_ns=min(o.host_prefill_ns for o in same),
                                     host_decode_ns=min(o.host_decode_ns for o in same),
                                     disk_prefill_ns=min(o.disk_prefill_ns for o in same),
                                     disk_decode_ns=min(o.disk_decode_ns for o in same),
                                     peak_bytes=min(o.peak_bytes for o in same),
                                     prefill_peak_bytes=min(o.prefill_peak_bytes for o in same))
                 for same in zip(*options, strict=True))


class GroupModel(CountedRelaxation):
    """The relaxation of one problem with each group of identical units as counts (module docstring)."""

    def __init__(self, problem: PlacementProblem, scale_ns: int, hint: Sequence[int], groups: list[list[int]],
                 path: Sequence[int], max_work_ns: int | None = None,
                 device_classes: Sequence[Sequence[str]] = (), others: Sequence[Sequence[int]] = (),
                 whole_runs: bool = False) -> None:
        """``device_classes``: interchangeable devices, ordered by the units they hold or compute
        (as in :class:`~.aggregate.AggregateModel`); ``others``: more paths whose length bounds the
        latency, as ``path``'s (``groups`` must keep the units on each path apart from the rest);
        ``whole_runs``: the stall rows count whole copy runs too (:meth:`_whole_run_stalls`).
        ``path``'s sibling sets (:func:`~.paths.sibling_slots`) are counted by combination where ``groups``
        keep each role's units apart (:func:`~.paths.sibling_paths` as ``others`` does)."""
        self.p, self.scale, self.hint, self.groups = problem, scale_ns, list(hint), groups
        self.whole_runs = whole_runs
        self.model = cp_model.CpModel()
        self.spines = [[k for k, g in enumerate(groups) if all(u in on for u in g)]
                       for on in (set(p) for p in (path, *others))]
        self.paths = [list(path), *(list(p) for p in others)]
        self._prices: dict[str, dict[tuple[int, int], int]] = {}  # _edge_prices, once per phase
        self.menus = [_least([problem.units[u].options for u in g]) for g in groups]
        # each option's most compute over its group, per phase: what the stall rows let a unit hide
        self.most_ns = [[{ph: max(getattr(problem.units[u].options[o], ph) for u in g) for ph in PHASES}
                         for o in range(len(self.menus[k]))] for k, g in enumerate(groups)]
        self.n = [self._counts(k, max_work_ns) for k in range(len(groups))]
        self.peak = {d.name: self._peak(d.name) for d in problem.devices}
        self._shared_run_peaks()
        self.chain, self.combos = self._slot_combos(path)
        self._capacities()
        self._pins_and_ties()
        for members in device_classes:
            usage = [sum(n for o, n in self._terms() if d in (o.storage, o.execution, o.prefill_execution))
                     for d in members]
            for a, b in itertools.pairwise(usage):
                self.model.add(a >= b)
        self.goal: Any = 0
        self.bound_share = BOUND_SHARE  # with one worker: two or more run SEARCH_SUBSOLVERS instead
        self.full_subsolvers = SEARCH_SUBSOLVERS

    def _options(self, k: int) -> tuple[PlacementOption, ...]:
        return self.menus[k]

    def _counts(self, k: int, max_work_ns: int | None) -> dict[int, tuple[Any, Any]]:
        # n[k, o] units of group k on option o, and any[k, o] = (n[k, o] >= 1) for the peaks.
        size = len(self.groups[k])
        hinted = [self.hint[u] for u in self.groups[k]]
        out = {}
        for o, opt in enumerate(self._options(k)):
            if max_work_ns is not None and o not in hinted and own_work(opt) > max_work_ns:
                continue  # no plan better than the start uses it
            n = self.model.new_int_var(0, size, f"n[{k},{o}]")
            self.model.add_hint(n, hinted.count(o))
            flag = self.model.new_bool_var(f"any[{k},{o}]")
            self.model.add(n <= min(size, most_beside_peak(self.p, opt)) * flag)
            self.model.add(n >= flag)
            out[o] = (n, flag)
        self.model.add(sum(n for n, _ in out.values()) == size)
        return out

    def _terms(self, device: str | None = None, phase: str | None = None) -> list[tuple[PlacementOption, Any]]:
        return [(self._options(k)[o], n) for k in range(len(self.groups)) for o, (n, _) in self.n[k].items()
                if device is None or computes_on(self._options(k)[o], device, phase)]

    def _peak(self, dev: str) -> Any:
        flagged = [(nbytes, flag) for k in range(len(self.groups)) for o, (_, flag) in self.n[k].items()
                   for nbytes in peak_flags(self._options(k)[o], dev)]
        return peak_levels(self.model, dev, flagged + self._graded_peaks(dev))[0]

    def _graded_peaks(self, dev: str) -> list[tuple[int, Any]]:
        """(bytes, flag) past a group's least peak: ``j`` of its units below some peak ``v`` on ``dev`` (for an
        option), more than ``j`` on that option hold ``v`` or more there, whichever units they are. Up to
        :data:`GRADED_LEVELS` such ``v`` per option, the smallest above the least first and the largest.

        A group prices each option at its least peak (within :data:`PEAK_STEP`), which one member may set alone:
        Mixtral-8x7B with four expert groups a layer on 4x T4 (batch 16 x 1024) groups layer 0's first expert
        group (4265 MiB in the prefill) with 31 others at 4393 MiB, and its counts read into plans 73 MiB over a
        T4 that making room took from 241.6 s to 255.6 s."""
        out = []
        for k, g in enumerate(self.groups):
            if len({id(self.p.units[u].options) for u in g}) == 1:
                continue  # one shared options tuple (most groups of a traced graph): one peak per option
            for o, (n, _) in self.n[k].items():
                members = [peak_flags(self.p.units[u].options[o], dev) for u in g]
                for at in range(len(members[0])):
                    values = sorted(m[at] for m in members)
                    for j in _past_least(values):
                        flag = self.model.new_bool_var(f"graded[{dev},{k},{o},{j}]")
                        self.model.add(n <= j + (len(g) - j) * flag)
                        out.append((values[j], flag))
        return out

    def _shared_run_peaks(self) -> None:
        """Per GPU, the copies that must share a copy run somewhere: the peak holds each such run's copies twice.

        Each option's peak counts its own copy twice (its run's and the next one in flight), but a run copies
        all its streamed parts at once (``copy_groups``: a decoder layer's attention and MLP, an MoE layer's
        expert groups), and holds at least the larger own peak plus its copies twice
        (:func:`~.problem.device_transients`, in the prefill, where every copying option copies). Counts force
        such runs by pigeonhole (:meth:`_crowded_rows`, :meth:`_met_rows`). Without them the relaxation priced
        sublayer Llama-3-70B on one RTX 3060 (batch 16 x 1024) 576 MiB under every layer streaming both parts,
        and Mixtral-8x7B with two expert groups a layer on an RTX 4090 (1 x 512 + 128) 2.9 GB under 50 groups
        copied in the prefill over 32 layers: bound 93.8 s against plans of 108.6 s after 30 s of search.
        """
        if self.p.copy_runs is None:
            return
        run_of = self.p.run_of
        per_run = {k: collections.Counter(run_of[u] for u in g) for k, g in enumerate(self.groups)}
        for dev in (d for d in self.p.devices if d.kind == "gpu"):
            copying = [(k, *c) for k in range(len(self.groups)) if (c := self._copying(k, dev.name)) is not None]
            alone: dict[int, dict[int, Any]] = {}  # group -> j -> its flag of j copying in one run
            met = self._crowded_rows(dev.name, copying, per_run, alone)
            met += self._met_rows(dev.name, copying, per_run, alone)
            if met:
                # its own variable: the level expression only takes its levels, and one above the pair's
                # bytes could exceed what the plan holds (a wrong bound, found on sublayer Mixtral-8x7B)
                peak = self.model.new_int_var(0, max(dev.capacity_bytes, 0), f"peak[{dev.name}]")
                self.model.add(peak >= self.peak[dev.name])
                for nbytes, meet in met:
                    self.model.add(peak >= nbytes * meet)
                self.peak[dev.name] = peak

    def _crowded_rows(self, dev: str, copying: list[tuple[int, Any, int, int]],
                      per_run: dict[int, collections.Counter],
                      alone: dict[int, dict[int, Any]]) -> list[tuple[int, Any]]:
        """(bytes, flag) per pool of groups and count ``j``: ``n`` units of the pool copying to ``dev`` put ``j`` in
        one run once ``n`` exceeds the most that runs hold with ``j - 1`` each at most; that run holds the pool's
        least own peak plus ``j`` of its least copy twice. The pools: each group with several units in some run
        (an MoE layer's expert groups), and, per copy size ``c``, the groups copying at least ``c`` (expert groups
        of one layer that differ in their options, and so are grouped apart). Fills ``alone``: each group's flags of
        ``j`` in one run (its pool alone), for :meth:`_met_rows`."""
        pools = {frozenset([k]) for k, *_ in copying if max(per_run[k].values()) > 1}
        pools |= {frozenset(k for k, _, c, _ in copying if c >= least) for least in {c for _, _, c, _ in copying}}
        info = {k: (n, c, own) for k, n, c, own in copying}
        out = []
        for pool in sorted(pools, key=sorted):
            sizes = list(sum((per_run[k] for k in pool), collections.Counter()).values())
            n = sum(info[k][0] for k in pool)
            size = sum(len(self.groups[k]) for k in pool)
            copy, own = min(info[k][1] for k in pool), min(info[k][2] for k in pool)
            for j in range(2, max(sizes) + 1):
                spread = sum(min(s, j - 1) for s in sizes)  # the most copying units with j - 1 a run at most
                flag = self.model.new_bool_var(f"crowded[{dev},{min(pool)},{len(pool)},{j}]")
                self.model.add(n - spread <= (size - spread) * flag)
                out.append((own + 2 * j * copy, flag))
                if len(pool) == 1:
                    alone.setdefault(min(pool), {})[j] = flag
        return out

    def _met_rows(self, dev: str, copying: list[tuple[int, Any, int, int]],
                  per_run: dict[int, collections.Counter], alone: dict[int, dict[int, Any]]) -> list[tuple[int, Any]]:
        """(bytes, flag) per pair of groups and per pair of their :meth:`_touching` terms: group ``k`` puts ``e``
        of its copying units (``e`` copies) in at least ``L / q`` runs, so two such terms above the ``U`` runs
        either group touches put both in one run, which holds the larger least own peak plus both terms' copies
        twice; or one of the flags the terms assume is set (``alone``, whose own rows hold more).

        With one term a group (``n / r`` runs touched, ``r`` a run at most) the relaxation streamed three of four
        expert groups in each of Mixtral-8x7B's layers to an RTX 4090 in the prefill and an attention beside them,
        as if no run held both, and its counts read into plans over memory that making room took from 100.7 s
        to 108.6 s; with two expert groups a layer it bounded at 105.8 s where the best plan found in 60 s priced
        108.5 s."""
        out = []
        for (k1, n1, c1, own1), (k2, n2, c2, own2) in itertools.combinations(copying, 2):
            union = len(per_run[k1].keys() | per_run[k2].keys())
            for (q1, l1, most1, e1, f1), (q2, l2, most2, e2, f2) in itertools.product(
                    self._touching(k1, n1, per_run, alone), self._touching(k2, n2, per_run, alone)):
                most = q2 * most1 + q1 * most2 - q1 * q2 * union
                if most <= 0:
                    continue  # they never have to meet so
                meet = self.model.new_bool_var(f"meet[{dev},{k1},{k2},{e1},{e2}]")
                self.model.add(q2 * l1 + q1 * l2 - q1 * q2 * union <= most * (meet + sum(f1 + f2)))
                out.append((max(own1, own2) + 2 * (e1 * c1 + e2 * c2), meet))
        return out

    def _touching(self, k: int, n: Any, per_run: dict[int, collections.Counter],
                  alone: dict[int, dict[int, Any]]) -> list[tuple[int, Any, int, int, list[Any]]]:
        """Group ``k``'s ways of touching runs, ``n`` of its units copying: ``(q, L, L's largest, e, flags)``, at
        least ``L / q`` runs hold ``e`` or more of them unless one of ``flags`` is set. With ``r`` a run at most,
        ``n / r`` runs hold one or more; with ``e`` a run at most (the flag of ``e + 1`` in one run unset), of the
        ``R`` runs it touches at least ``n - (e - 1) R`` hold ``e``."""
        r, runs, size = max(per_run[k].values()), len(per_run[k]), len(self.groups[k])
        out = [(r, n, size, 1, [])]
        for e in range(1, r + 1):
            flags = [alone[k][e + 1]] if e < r else []  # r > 1: its pool alone has a flag for every j up to r
            if (e, flags) != (1, []) and size > (e - 1) * runs:
                out.append((1, n - (e - 1) * runs, size - (e - 1) * runs, e, flags))
        return out

    def _copying(self, k: int, dev: str) -> tuple[Any, int, int] | None:
        """Group ``k``'s units copying to ``dev`` in the prefill (a count), their least copy and least own peak
        there; None when no option of it copies there."""
        opts = self._options(k)
        on = {o: c for o in self.n[k] if (c := phase_copies(opts[o], "prefill_ns")) and opts[o].group_device == dev}
        if not on:
            return None
        own = min(max((b for d, b in phase_peaks(opts[o], "prefill_ns") if d == dev), default=0) for o in on)
        return sum(self.n[k][o][0] for o in on), min(on.values()), own

    def _capacities(self) -> None:
        terms = self._terms()
        for dev in self.p.devices:
            add_capacity_row(self.model, dev, self.peak[dev.name], terms)

    def _stored(self, u: int, d: str) -> Any:
        k = next(k for k, g in enumerate(self.groups) if g == [u])  # pinned and tied units are alone
        return sum(n for o, (n, _) in self.n[k].items() if self._options(k)[o].storage == d)

    def _pins_and_ties(self) -> None:
        index = self.p.index()
        for name, d in self.p.pins.items():
            self.model.add(self._stored(index[name], d) == 1)
        for group in self.p.tied_groups:
            for name in group[1:]:
                for d in (dev.name for dev in self.p.devices):
                    self.model.add(self._stored(index[group[0]], d) == self._stored(index[name], d))

    def _hiders(self, ph: str) -> list[tuple[int, bool, Any]]:
        # a group's option at the most any of its units computes (its menu has the least): hiding no less
        # streaming only where every unit of the group does on it (else it hides all it computes: more, so safe)
        return [(self._t(self.most_ns[k][o][ph]),
                 all(self._t(self.p.units[u].options[o].copy_in(ph)) > 0 for u in self.groups[k]), n)
                for k in range(len(self.groups)) for o, (n, _) in self.n[k].items()
                if self._t(self.most_ns[k][o][ph]) > 0]

    def _phase(self, ph: str) -> Any:
        # lat >= every device's work, and >= the work of the groups lying wholly on each path (+ their stalls).
        top = sum(len(g) * max(self._t(getattr(o, ph)) for o in self._options(k)) for k, g in enumerate(self.groups))
        crossings = [self._crossings(path, ph) for path in self.paths]
        top += max((sum(c * most for c, _, most in row) for row in crossings), default=0)
        lat = self.model.new_int_var(0, top + self._shared_horizon(ph), f"lat[{ph}]")
        self._shared_rows(ph, lat)
        on_all = spine(self.p)
        stall = self._stalls(ph, [(self._options(k)[o], n) for k, g in enumerate(self.groups)
                                  if all(u in on_all for u in g) for o, (n, _) in self.n[k].items()])
        for dev in {o.device_in(ph) for u in self.p.units for o in u.options}:
            work = [self._t(getattr(o, ph)) * n for o, n in self._terms(dev, ph)]
            if work:
                self.model.add(lat >= sum(work))
        for groups, row in zip(self.spines, crossings, strict=True):
            work = [self._t(getattr(self._options(k)[o], ph)) * n for k in groups for o, (n, _) in self.n[k].items()]
            work += [c * x for c, x, _ in row]
            if work:
                self.model.add(lat >= sum(work) + stall)
        if self.combos:  # the path's chain, and each sibling set at its slowest role
            j = PHASES.index(ph)
            row = [self._t(getattr(self._options(k)[o], ph)) * n for k in self.chain for o, (n, _) in self.n[k].items()]
            row += [max(c[j] for c in combo) * count for kind in self.combos for combo, count in kind]
            self.model.add(lat >= sum(row) + stall)
        return lat

    def _crossings(self, path: Sequence[int], ph: str) -> list[tuple[int, Any, int]]:
        """Per pair of groups ``g -> h`` that follow each other on ``path``, in ``ph``: (the least transfer of the
        edges between them, a variable at most the number of those crossing devices, their number): the path's
        transfers that counts alone prove.

        With ``m`` such edges, an edge crosses devices when its ends compute apart. Of the ``m`` units of ``g``
        the edges leave, at least ``n[g, d] - (|g| - m)`` compute on ``d``, and at most ``n[h, d]`` of the units
        of ``h`` they enter do; so at least ``sum over d of (n[g, d] - n[h, d])+ - (|g| - m)`` edges cross, and
        likewise from ``h``'s side. Each costs at least its least price between two devices (floored to solver
        units, so the rounding slack needs no more). Without this term the relaxation priced modules spread over
        two devices as if they sent nothing to each other: module-level Mistral-7B on a 6 GiB RTX 3060 bounded
        at 36.225 s without it and 36.301 s with it, against a best plan of 36.32 s.
        """
        if len(self.p.units) > CROSSINGS_UP_TO:
            return []
        of = {u: k for k, g in enumerate(self.groups) for u in g}
        edges: dict[tuple[int, int], list[int]] = {}
        prices = self._edge_prices(ph)
        for a, b in itertools.pairwise(path):
            if of[a] != of[b] and (a, b) in prices:
                edges.setdefault((of[a], of[b]), []).append(prices[a, b])
        devices = sorted({o.device_in(ph) for k in range(len(self.groups)) for o in self._options(k)})
        out = []
        for (g, h), costs in edges.items():
            least = min(costs) // self.scale if self.scale > 1 else min(costs)
            if least <= 0:
                continue
            m = len(costs)
            x = self.model.new_int_var(0, m, f"cross[{ph},{g},{h}]")
            for a, b in ((g, h), (h, g)):
                apart = [self._apart(a, b, d, ph) for d in devices]
                self.model.add(x >= sum(apart) - (len(self.groups[a]) - m))
            out.append((least, x, m))
        return out

    def _apart(self, g: int, h: int, d: str, ph: str) -> Any:
        """A variable at least ``n[g, d] - n[h, d]`` and 0: units of ``g`` on ``d`` in ``ph`` beyond ``h``'s."""
        y = self.model.new_int_var(0, len(self.groups[g]), f"apart[{ph},{g},{h},{d}]")
        self.model.add(y >= self._on(g, d, ph) - self._on(h, d, ph))
        return y

    def _on(self, k: int, d: str, ph: str) -> Any:
        return sum(n for o, (n, _) in self.n[k].items() if self._options(k)[o].device_in(ph) == d)

    def _edge_prices(self, ph: str) -> dict[tuple[int, int], int]:
        """Each edge's least price in ``ph`` between two different devices some unit computes on there (a missing
        pair costs 0), by (src, dst) index; the least over parallel edges."""
        if ph in self._prices:
            return self._prices[ph]
        devices = sorted({o.device_in(ph) for u in self.p.units for o in u.options})
        pairs = [(p, q) for p in devices for q in devices if p != q]
        index = self.p.index()
        out: dict[tuple[int, int], int] = {}
        for e in self.p.edges:
            key = (index[e.src], index[e.dst])
            least = min((getattr(e, ph).get(pq, 0) for pq in pairs), default=0)
            out[key] = min(least, out.get(key, least))
        self._prices[ph] = out
        return out

    def _slot_combos(self, path: Sequence[int]) -> tuple[list[int], list[list[tuple[tuple[Any, ...], Any]]]]:
        """The groups of ``path``'s units outside sibling sets, and per kind of sibling set ``[(the
        (prefill, decode) class of each role, count of sets on it)]``: every assignment puts each set
        on one combination, and a role's units on a class number the sets whose combination has it."""
        slots = sibling_slots(self.p, path)
        if not slots:
            return [], []
        of = {u: k for k, g in enumerate(self.groups) for u in g}
        chain_units = set(path) - {u for _, _, alt in slots for u in alt}
        chain = [k for k, g in enumerate(self.groups) if chain_units.issuperset(g)]
        kinds: dict[Any, list[list[int]]] = {}
        for _, kind, alt in slots:
            kinds.setdefault(kind, []).append(alt)
        combos = []
        for sets in kinds.values():
            roles = [self._role_classes([alt[r] for alt in sets], of) for r in range(len(sets[0]))]
            if any(r is None for r in roles) or math.prod(len(r[0]) for r in roles) > MOST_SLOT_COMBOS:
                continue  # its sibling paths still bound it
            combos.append(self._count_combos(roles, sets))  # type: ignore[arg-type]
        return chain, combos

    def _role_classes(self, units: list[int], of: dict[int, int]
                      ) -> tuple[dict[tuple[int, ...], list[Any]], dict[int, tuple[int, ...]]] | None:
        """A role's count variables per (prefill, decode) class of their options (least time over the role,
        solver units), and each option's class; None when a group mixes the role's units with others."""
        groups = {of[u] for u in units}
        if any(not set(self.groups[k]) <= set(units) for k in groups):
            return None
        classes: dict[tuple[int, ...], list[Any]] = {}
        key_of: dict[int, tuple[int, ...]] = {}
        for k in groups:
            for o, (n, _) in self.n[k].items():
                key = key_of.setdefault(o, tuple(min(self._t(getattr(self.p.units[u].options[o], ph)) for u in units)
                                                 for ph in PHASES))
                classes.setdefault(key, []).append(n)
        return classes, key_of

    def _count_combos(self, roles: list[tuple[dict[tuple[int, ...], list[Any]], dict[int, tuple[int, ...]]]],
                      sets: list[list[int]]) -> list[tuple[tuple[Any, ...], Any]]:
        hinted: dict[tuple[Any, ...], int] = {}
        for alt in sets:
            combo = tuple(key_of.get(self.hint[u]) for (_, key_of), u in zip(roles, alt, strict=True))
            hinted[combo] = hinted.get(combo, 0) + 1
        out = []
        for combo in itertools.product(*(classes for classes, _ in roles)):
            count = self.model.new_int_var(0, len(sets), "combo")
            self.model.add_hint(count, hinted.get(combo, 0))
            out.append((combo, count))
        self.model.add(sum(count for _, count in out) == len(sets))
        for r, (classes, _) in enumerate(roles):
            for key, counts in classes.items():
                self.model.add(sum(count for combo, count in out if combo[r] == key) == sum(counts))
        return out

    # -- the copy runs' stalls, over whole runs -------------------------------------------------------
    def _run_stalls(self, ph: str, spine: list[tuple[PlacementOption, Any]]) -> Any:
        """The base rows (a unit's price a window), and the windows of whole runs (:meth:`_whole_run_stalls`)."""
        base = super()._run_stalls(ph, spine)
        whole = self._whole_run_stalls(ph) if self.whole_runs else None
        if whole is None:
            return base
        stall = self.model.new_int_var(0, self._most_copies(ph), f"stalls[{ph}]")
        self.model.add(stall >= base)
        self.model.add(stall >= whole)
        return stall

    def _whole_run_stalls(self, ph: str) -> Any:
        """:meth:`~._counted.CountedRelaxation._stalls`'s windows with copy runs as the items: a run streams at the
        sum of its units' copies and hides the sum of their compute, as the dispatcher's windows hold whole runs
        (:func:`~.schedule.stalls`). Runs of one *kind* (the same group at each position: a decoder layer's norm,
        attention, norm and MLP) are counted per combination of their positions' (compute, copy) classes; over all
        kinds and positions, a group's units on each class number its counts there. Per unit, a layer's attention
        and MLP each hid a part of another layer's copy where the window holds both or neither: on the H200
        profile's sublayer Llama-3.1-8B at 10 GiB (overlap) the relaxation's optimum rose from 0.856 s to 0.883 s
        (plans of 0.957 s). None where a unit is off the spine (its stall is not on every path)."""
        if len(spine(self.p)) < len(self.p.units):
            return None
        items, order = self._run_items(ph)
        if not any(c > 0 for (_, c), _ in items):
            return 0
        a = min(b for (b, c), _ in items if c > 0)  # any credit is valid; the least is exact for that window
        up = _nearest([b if c == 0 else b - a for (b, c), _ in items], max)
        down = _nearest([c for (_, c), _ in items], min)

        def hides(b: int, c: int) -> int:  # a streamed run hides what it computes above the credit
            return up.get(b if c == 0 else b - a, 0)

        streamed: dict[int, list[Any]] = {}
        hiders: dict[tuple[int, bool], list[Any]] = {}
        for (b, c), n in items:
            if c > 0:
                streamed.setdefault(down[c], []).append(n)
            if hides(b, c) > 0:
                hiders.setdefault((hides(b, c), c > 0), []).append(n)
        sizes = {key: key[0] for key in hiders}
        hints = hinted_windows([((hides(b, c), c > 0), b, down.get(c, c)) for b, c in order], ph == "decode_ns")
        return self._shared_windows(f"runs,{ph}", streamed, (a, hiders, sizes), hints, len(self.p.runs),
                                    self._most_copies(ph))

    def _run_items(self, ph: str) -> tuple[list[tuple[tuple[int, int], Any]], list[tuple[int, int]]]:
        """The whole-run rows' items in ``ph``: ``((compute, copy), count)`` per combination of each kind of run's
        major groups, tied to the groups' counts, and the minor groups' units apart (streaming nothing); beside
        them, the start plan's items in execution order."""
        of = {u: k for k, g in enumerate(self.groups) for u in g}
        kinds: dict[tuple[int, ...], list[int]] = {}
        for r, (first, end) in enumerate(self.p.runs):
            kinds.setdefault(tuple(of[u] for u in range(first, end)), []).append(r)
        largest = max((self._t(o.copy_in(ph)) for k in range(len(self.groups)) for o in self._options(k)), default=0)
        classes = {k: self._run_classes(k, ph, math.ceil(largest * LEAST_RUN_COPY)) for k in range(len(self.groups))}
        majors = _majors(list(kinds), {k: c for k, (c, _) in classes.items()})
        items: list[tuple[tuple[int, int], Any]] = []
        slots: dict[tuple[int, tuple[int, int]], list[Any]] = {}  # (group, class) -> the runs' counts there
        hinted_runs: dict[int, list[tuple[int, int]]] = {r: [] for r in range(len(self.p.runs))}
        for key, runs in kinds.items():
            at = [i for i, k in enumerate(key) if k in majors]
            if at:
                items += self._run_combos(key, at, runs, [classes[key[i]] for i in at], slots, hinted_runs)
            for r in runs:  # the minor units' compute, after the run's own item: in the same window
                hinted_runs[r] += [(classes[k][1][self.hint[self.p.runs[r][0] + i]][0], 0)
                                   for i, k in enumerate(key) if k not in majors]
        for (k, cls), counts in slots.items():
            self.model.add(sum(counts) == sum(classes[k][0][cls]))
        for k in set(classes) - majors:  # apart from their runs, and streaming at no price: still a bound
            items += [((b, 0), sum(counts)) for (b, _), counts in classes[k][0].items()]
        return items, [item for r in range(len(self.p.runs)) for item in hinted_runs[r]]

    def _run_combos(self, key: tuple[int, ...], at: list[int], runs: list[int],
                    positions: list[tuple[dict[tuple[int, int], list[Any]], dict[int, tuple[int, int]]]],
                    slots: dict[tuple[int, tuple[int, int]], list[Any]],
                    hinted_runs: dict[int, list[tuple[int, int]]]) -> list[tuple[tuple[int, int], Any]]:
        """``((compute, copy), count)`` of the runs of one kind per combination of the classes of their positions
        ``at`` (the major groups'), each count added to ``slots`` at each position's (group, class), and each
        run's (compute, copy) there under the hint appended to ``hinted_runs``."""
        hinted: dict[tuple[tuple[int, int], ...], int] = {}
        for r in runs:
            first, _ = self.p.runs[r]
            combo = tuple(class_of[self.hint[first + i]] for i, (_, class_of) in zip(at, positions, strict=True))
            hinted[combo] = hinted.get(combo, 0) + 1
            hinted_runs[r].append((sum(b for b, _ in combo), sum(c for _, c in combo)))
        out = []
        for combo in itertools.product(*(classes for classes, _ in positions)):
            count = self.model.new_int_var(0, len(runs), f"runs[{key[0]},{len(out)}]")
            self.model.add_hint(count, hinted.get(combo, 0))
            for i, cls in zip(at, combo, strict=True):
                slots.setdefault((key[i], cls), []).append(count)
            out.append(((sum(b for b, _ in combo), sum(c for _, c in combo)), count))
        self.model.add(sum(count for _, count in out) == len(runs))
        return out

    def _run_classes(self, k: int, ph: str, least_copy: int) -> tuple[dict[tuple[int, int], list[Any]],
                                                                      dict[int, tuple[int, int]]]:
        """Group ``k``'s counts per (compute, copy) class in ``ph`` (the most compute over its units: more hiding,
        so the rows stay a bound; the least copy, its menu's, and none below ``least_copy``: a unit that streams
        less is counted as not streaming, which leaves its run's window to the next, and less to hide), and each
        option's class."""
        classes: dict[tuple[int, int], list[Any]] = {}
        class_of: dict[int, tuple[int, int]] = {}
        for o, (n, _) in self.n[k].items():
            copy = self._t(self._options(k)[o].copy_in(ph))
            cls = class_of[o] = (self._t(self.most_ns[k][o][ph]), copy if copy >= least_copy else 0)
            classes.setdefault(cls, []).append(n)
        return classes, class_of

    def read(self, solver: cp_model.CpSolver) -> list[int]:
        """Each group's options handed out in unit order, one execution device after another; or, where the
        prefetch thread's copies count (``overlap``) and it prices lower, each group's streamed units spread
        evenly among its others, so that their copies run beside the others' compute (problem.stalls), or every
        option of a group spread evenly (:func:`.aggregate.interleaved`).

        In unit order, a group's streamed units sit in consecutive layers, each copy hidden behind one small
        unit at most: sublayer Llama-3-8B on the H100 host at 4 GiB (1 x 512 + 32, overlap, 2 s) read 5.29-5.42 s
        plans that way, 3.89-3.93 s spread."""
        blocks = self._handed(solver)
        if self.p.contiguous:  # spreading would interleave the storage devices' ranges
            return blocks
        others = [self._spread(blocks, ph, deal) for ph in PHASES if "copy" in self.p.shared_used(ph)
                  for deal in (spread_streamed, interleaved)]
        if self.p.copy_runs is not None:  # a group's copies in unit order fill consecutive runs whole
            others.append(copies_apart(self.p, blocks))
        return self._cheapest(blocks, others)

    def _handed(self, solver: cp_model.CpSolver) -> list[int]:
        devices = [d.name for d in self.p.devices]
        choice = [0] * len(self.p.units)
        for k, g in enumerate(self.groups):
            opts = self._options(k)
            order = sorted(self.n[k], key=lambda o: (-opts[o].work_ns,
                                                     devices.index(opts[o].execution), o))
            handed = [o for o in order for _ in range(solver.value(self.n[k][o][0]))]
            for u, o in zip(g, handed, strict=True):
                choice[u] = o
        return choice

    def _spread(self, choice: list[int], phase: str, deal: Deal) -> list[int]:
        """``choice`` with each group's options reordered over its units by ``deal``
        (:func:`.aggregate.spread_streamed` or :func:`.aggregate.interleaved`)."""
        out = list(choice)
        for k, g in enumerate(self.groups):
            for u, o in zip(g, deal([choice[u] for u in g], self._options(k), phase), strict=True):
                out[u] = o
        return out
