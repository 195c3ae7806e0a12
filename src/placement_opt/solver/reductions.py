"""Coarsening (a restriction, for a start plan) and residency on ties, around the CP-SAT model.

Torch-free, like :mod:`placement_opt.solver.search`, which calls them.

* :func:`coarsen_groups` / :func:`coarsen`: runs of chain units with the same option menu and the
  same hinted option become one super-unit (durations and stored/resident bytes summed, peaks the
  max, a phased option's prefill device kept, copies summed). A super-unit stays inside one copy run,
  its group copies summed and the coarse runs the fine ones'. Every coarse assignment costs what it
  expands to (but for stalls: a super-unit waits for its units' copies at once; its plan is priced
  again on the real problem), and the hint stays representable;
  but the coarse problem forbids the units of a run to differ, so it is a *restriction*: its plans
  are plans of the real problem, its bound is not a bound of it (search.py never reports it).
* :func:`block_groups`: a sublayer problem's copy groups (the parts of one decoder layer) as super-units
  for :func:`coarsen`: the layer-granular problem inside the sublayer one, whose plans are sublayer
  plans that move a layer's parts together (another restriction, used for a start).
* :func:`prefer_resident`: a streamed unit that would be no slower stored where it computes is
  stored there when it fits.

The exact reductions live in :mod:`.edges` (covered edges) and :mod:`.symmetry` (interchangeable
devices).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .problem import (
    GROUP_BUFFERS,
    PHASES,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
    device_transients,
)
from .starts import fits

__all__ = ["coarsen_groups", "coarsen", "block_groups", "part_groups", "prefer_resident", "make_room", "copies_first", "copies_apart",
           "TRANSIENT_UNITS"]

#: Most units :func:`make_room`'s transient move prices every option of (each a full score): the run setting
#: the transient and those after it. A sublayer layer and lm_head behind the final norm take 6; round a
#: module-level Llama-3-70B's cycle (724 units, nothing else copying) it took 141 s of a 2 s solve.
TRANSIENT_UNITS = 12


# -- coarsening: merge runs of chain units with the same menu and the same hinted option --------
def _menu_key(u: UnitSpec) -> tuple[tuple[str, str, str, str | None], ...]:
    return tuple(o.kind for o in u.options)


def coarsen_groups(problem: PlacementProblem, hint: Sequence[int], target: int) -> list[list[int]]:
    """Runs of unit indices to merge, each of at most ``ceil(n / target)`` units."""
    n = len(problem.units)
    size = -(-n // target)
    index = problem.index()
    outs = [0] * n
    ins = [0] * n
    linked = [False] * n  # linked[i]: the only edge out of i goes to i + 1 and is the only one into it
    for e in problem.edges:
        outs[index[e.src]] += 1
        ins[index[e.dst]] += 1
    for e in problem.edges:
        i, j = index[e.src], index[e.dst]
        if j == i + 1:
            linked[i] = True
    special = _tied_or_pinned(problem)
    run_of = _run_of(problem)
    groups: list[list[int]] = []
    for i, u in enumerate(problem.units):
        prev = groups[-1][-1] if groups else None
        if (prev is not None and prev == i - 1 and len(groups[-1]) < size and linked[prev]
                and run_of[prev] == run_of[i]
                and outs[prev] == 1 and ins[i] == 1 and u.name not in special
                and problem.units[prev].name not in special
                and _menu_key(u) == _menu_key(problem.units[prev]) and hint[i] == hint[prev]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _tied_or_pinned(problem: PlacementProblem) -> set[str]:
    """Units no super-unit may hold: tied ones and pinned ones keep their own storage rows."""
    return {name for g in problem.tied_groups for name in g} | set(problem.pins)


def _run_of(problem: PlacementProblem) -> Sequence[int]:
    """Each unit's copy run (its own index without runs; every unit 0 when nothing is copied by groups)."""
    if problem.copy_runs is None and not problem.group_copies:
        return [0] * len(problem.units)
    return problem.run_of


def _merge_options(units: Sequence[UnitSpec]) -> tuple[PlacementOption, ...]:
    merged = []
    for opts in zip(*(u.options for u in units), strict=True):
        first = opts[0]
        # group copies summed; the peak holding them keeps its largest part apart from them on top
        share = sum(o.group_copy_bytes for o in opts)
        peak = max(o.peak_bytes for o in opts)
        prefill_peak = max(o.prefill_peak_bytes for o in opts)
        if share and first.mode == "phased":
            prefill_peak = max(o.prefill_peak_bytes - GROUP_BUFFERS * o.group_copy_bytes for o in opts)
            prefill_peak += GROUP_BUFFERS * share
        elif share:
            peak = max(o.peak_bytes - GROUP_BUFFERS * o.group_copy_bytes for o in opts) + GROUP_BUFFERS * share
        merged.append(PlacementOption(
            storage=first.storage, execution=first.execution, mode=first.mode,
            prefill_ns=sum(o.prefill_ns for o in opts), decode_ns=sum(o.decode_ns for o in opts),
            copy_prefill_ns=sum(o.copy_prefill_ns for o in opts), copy_decode_ns=sum(o.copy_decode_ns for o in opts),
            host_prefill_ns=sum(o.host_prefill_ns for o in opts), host_decode_ns=sum(o.host_decode_ns for o in opts),
            disk_prefill_ns=sum(o.disk_prefill_ns for o in opts), disk_decode_ns=sum(o.disk_decode_ns for o in opts),
            stored_bytes=sum(o.stored_bytes for o in opts), resident_bytes=sum(o.resident_bytes for o in opts),
            peak_bytes=peak, prefill_execution=first.prefill_execution, prefill_peak_bytes=prefill_peak,
            group_copy_bytes=share))
    return tuple(merged)


def coarsen(problem: PlacementProblem, groups: list[list[int]]) -> PlacementProblem:
    units = tuple(UnitSpec(name=problem.units[g[0]].name,
                           options=_merge_options([problem.units[i] for i in g]) if len(g) > 1
                           else problem.units[g[0]].options) for g in groups)
    heads = {u.name for u in units}
    head_of = {problem.units[i].name: problem.units[g[0]].name for g in groups for i in g}
    edges = tuple(EdgeSpec(src=head_of[e.src], dst=e.dst, prefill_ns=e.prefill_ns, decode_ns=e.decode_ns)
                  for e in problem.edges if e.dst in heads and head_of[e.src] != e.dst)
    runs: dict[int, list[str]] = {}  # the fine copy runs' super-units (a super-unit lies in one run)
    for g, run in zip(groups, (_run_of(problem)[g[0]] for g in groups), strict=True):
        runs.setdefault(run, []).append(problem.units[g[0]].name)
    copy_groups = tuple(tuple(names) for names in runs.values()) if problem.copy_runs is not None else ()
    return PlacementProblem(units=units, edges=edges, devices=problem.devices, tied_groups=problem.tied_groups,
                            pins=problem.pins, contiguous=problem.contiguous, copy_groups=copy_groups)


def block_groups(problem: PlacementProblem) -> list[list[int]] | None:
    """Every unit in order, a copy group's units as one group (singletons elsewhere), or None when no
    group of two or more units has one menu: the super-units of a layer-granular start.

    A group's units must offer the same options in the same order (:func:`coarsen` merges them by
    position); a group whose menus differ stays apart, unit by unit. Tied and pinned units stay apart
    too, as in :func:`coarsen_groups`.
    """
    return _merged(problem, problem.copy_groups)


def part_groups(problem: PlacementProblem) -> list[list[int]] | None:
    """Every unit in order, each of ``problem.part_groups`` (a layer's expert groups) as one group, or None when
    none can merge: the super-units of the problem before the cut, on :func:`block_groups`' terms."""
    return _merged(problem, problem.part_groups)


def _merged(problem: PlacementProblem, named: Sequence[Sequence[str]]) -> list[list[int]] | None:
    """Units ``0..n-1`` in order, each of the ``named`` runs of two or more units with one menu and no tied or
    pinned unit as one group, every other unit alone; None when no run merges."""
    index = problem.index()
    special = _tied_or_pinned(problem)
    head: dict[int, list[int]] = {}
    for names in named:
        members = [index[name] for name in names]
        if len(members) > 1 and len({_menu_key(problem.units[i]) for i in members}) == 1 \
                and not special.intersection(names):
            head[members[0]] = members
    if not head:
        return None
    groups: list[list[int]] = []
    i = 0
    while i < len(problem.units):
        group = head.get(i, [i])
        groups.append(group)
        i = group[-1] + 1
    return groups


def prefer_resident(problem: PlacementProblem, choice: Sequence[int]) -> list[int]:
    """Store streamed units on their execution device where that costs nothing and fits.

    The time model often ties (a norm of a few KiB streams as fast as it sits on the GPU), and the
    solver then picks either. A resident unit is simpler to run (plain ``from_pretrained`` maps) and
    never slower: its execution device and every transfer stay the same and its copy disappears.
    Only units outside tied groups and pins move, and only while the device keeps room for them.
    Phased units stay: residency would move their prefill (its load and transfers) to another device.
    """
    if problem.contiguous:
        return list(choice)
    out = _residency(problem, choice, exact=False)
    if problem.group_copies and not fits(problem, out):
        # a unit that stops copying can grow the others' transients: the runs before it then wait with a
        # later run's copies in flight (device_transients)
        out = _residency(problem, choice, exact=True)
    return out


def _residency(problem: PlacementProblem, choice: Sequence[int], exact: bool) -> list[int]:
    """prefer_resident's moves, each checked by its own bytes, or (``exact``) by the whole plan's memory."""
    out = list(choice)
    score = problem.score(out)
    free = {d.name: d.capacity_bytes - score.used_bytes[d.name] for d in problem.devices}
    fixed = {n for g in problem.tied_groups for n in g} | set(problem.pins)
    for i, u in enumerate(problem.units):
        o = u.options[out[i]]
        if o.storage == o.execution or u.name in fixed or o.mode == "phased":
            continue
        target = next((k for k, c in enumerate(u.options) if c.storage == c.execution == o.execution
                       and c.mode == "resident"), None)
        if target is None:
            continue
        c = u.options[target]
        grow = c.stored_bytes + c.resident_bytes - o.resident_bytes
        if (c.work_in("prefill_ns") <= o.prefill_ns and c.work_in("decode_ns") <= o.decode_ns
                and all(c.shared_in(r, ph) <= o.shared_in(r, ph) for r in ("host", "disk") for ph in PHASES)
                and grow <= free[o.execution]
                and c.peak_bytes <= o.peak_bytes
                and (not exact or not o.group_copy_bytes or fits(problem, [*out[:i], target, *out[i + 1:]]))):
            out[i] = target
            free[o.execution] -= grow
            free[o.storage] += o.stored_bytes
    return out


def make_room(problem: PlacementProblem, choice: Sequence[int], moves: int = 8,
              until: float | None = None) -> list[int]:
    """A plan a little over some capacity moved into it, from ``choice`` and from :func:`copies_first` of it, the
    faster of the two that fit: up to ``moves`` units, one at a time, each the cheapest move (least added prefill
    + decode, among those freeing enough bytes when some do) of a unit off the most overfull device to an option
    that puts no bytes there and no transient above the largest it holds already; where that leaves it over,
    the move around the copy run setting the device's transient that lowers the excess more
    (:func:`_transient_move`, tried until ``until``, a :func:`time.perf_counter` time). A counted relaxation's
    plan prices each group at its least peak (within :data:`~.relax.PEAK_STEP`) and can land a few MiB over,
    and its per-option peaks leave out the next copy in flight beside each unit; without this its plan was
    dropped. Returns ``choice`` unchanged when nothing fits; the caller checks the result.
    """
    starts = [list(choice)]
    for reordered in (copies_first(problem, choice), copies_apart(problem, choice)):
        if reordered not in starts:
            starts.append(reordered)
    fitted = [c for c in (_moved_into_room(problem, start, moves, until) for start in starts) if c is not None]
    return min(fitted, key=lambda c: problem.score(c).latency_ns) if fitted else list(choice)


def _moved_into_room(problem: PlacementProblem, choice: Sequence[int], moves: int,
                     until: float | None) -> list[int] | None:
    """:func:`make_room`'s moves from ``choice``; None when they do not make it fit."""
    out = list(choice)
    for _ in range(moves):
        over = problem.score(out).over_bytes
        if not over:
            return out
        dev = max(over, key=over.get)
        move = _cheapest_move(problem, out, dev)
        if move is None:  # every move off it overfills another device: spill to the host, which the disk relieves next
            move = _cheapest_move(problem, out, dev, spill=True)
        left = sum(over.values()) if move is None else _over_bytes(problem, out, *move)
        if left and (until is None or time.perf_counter() < until):  # a transient's copies may be what is over
            other = _transient_move(problem, out, dev, left, until)
            move = other if other is not None else move
        if move is None:
            return None
        out[move[0]] = move[1]
    return None if problem.score(out).over_bytes else out


def _over_bytes(problem: PlacementProblem, choice: Sequence[int], unit: int, option: int) -> int:
    """Bytes over every capacity with ``unit`` moved to ``option`` (memory only: no schedule is priced)."""
    chosen = problem.options(choice)
    chosen[unit] = problem.units[unit].options[option]
    used = problem.used_bytes(chosen)
    return sum(max(0, used[d.name] - d.capacity_bytes) for d in problem.devices)


def _transient_move(problem: PlacementProblem, choice: Sequence[int], dev: str, over_bytes: int,
                    until: float | None = None) -> tuple[int, int] | None:
    """(unit, option) that lowers the bytes over capacity most (then adds the least work), among the units of
    the copy run setting ``dev``'s transient and of the runs up to the next one copying there, changing
    what the unit copies to ``dev`` (or the peak unit's own): a moved copy, or a small one put between the two
    (a streamed final norm, so that ``lm_head``'s 2 GiB copy is no longer in flight beside the last layer's
    run). Moving bytes off the device does not lower a transient; without this sublayer Llama-3-70B on one
    RTX 3060 (batch 16 x 1024) lost its relaxation's plan, 303 MiB over. None when no such move lowers it."""
    chosen = problem.options(choice)
    peak = device_transients(chosen, problem.copy_runs).get(dev)
    if peak is None or peak.unit is None:
        return None
    runs, r = problem.runs, problem.run_of[peak.unit]
    units = list(range(*runs[r]))
    for step in range(1, len(runs)):  # the runs after it, round the cycle, to the next that copies there
        a, b = runs[(r + step) % len(runs)]
        units += range(a, b)
        if len(units) >= TRANSIENT_UNITS or any(_copies_to(chosen[u], dev)[0] for u in range(a, b)):
            break
    best: tuple[int, int, int, int] | None = None  # (over bytes, added work, unit, option)
    for u in units[:TRANSIENT_UNITS]:
        spec, now = problem.units[u], chosen[u]
        for k, o in enumerate(spec.options):
            if (k == choice[u] or not problem.allows(spec, o)
                    or (u != peak.unit and _copies_to(o, dev) == _copies_to(now, dev))):
                continue
            key = (_over_bytes(problem, choice, u, k), o.work_ns - now.work_ns, u, k)
            best = key if best is None or key < best else best
        if until is not None and time.perf_counter() > until:
            break
    return None if best is None or best[0] >= over_bytes else (best[2], best[3])


def _copies_to(opt: PlacementOption, dev: str) -> tuple[int, bool]:
    """What ``opt`` copies to ``dev`` (its group copy there, 0 elsewhere), and whether in both phases."""
    return (opt.group_copy_bytes if opt.group_device == dev else 0), opt.prefill_execution is None


def copies_first(problem: PlacementProblem, choice: Sequence[int]) -> list[int]:
    """``choice``'s options dealt out again among like units (options of the same kinds storing the same
    bytes; pinned and tied units keep theirs), in each class those the prefetch thread copies ahead
    (``group_copy_bytes``) first, the rest after them in their order.

    Every unit runs beside the next copy in flight, and in the prefill the units after its last copy hold only
    the decode's first (:func:`~.problem.device_transients`). A relaxation reads its counts into an order that
    can put a layer of large workspace just before a copied one: Mixtral-8x7B on A100-80GB + T4, batch 16 x
    1024, a phased layer after resident ones, 1.4 GiB over cuda:0, which moving a unit off it repaired to a
    plan 8 % slower; the same counts with the phased layers first fit. The counts per device do not change.
    """
    out = list(choice)
    for members in _like_units(problem):
        picked = [problem.units[i].options[choice[i]] for i in members]
        if len(members) < 2 or not any(o.group_copy_bytes for o in picked):
            continue
        ordered = sorted(picked, key=lambda o: not o.group_copy_bytes)  # stable: the rest keep their order
        for i, o in zip(members, ordered, strict=True):
            out[i] = _same_kind(problem, i, o)
    return out


def copies_apart(problem: PlacementProblem, choice: Sequence[int]) -> list[int]:
    """``choice``'s options dealt out again among like units (as :func:`copies_first`), each class's copied
    options (``group_copy_bytes``, largest first) to the units whose copy runs copy least to that device so
    far (classes of larger copies first), the rest after them in their order.

    A copy run copies all its streamed parts at once, and a run copying two of them holds both twice
    (:func:`~.problem.device_transients`). A relaxation reads each group's counts on its own, in unit order:
    sublayer Llama-3-70B on RTX 4090 + RTX 3090 (1 x 512 + 128) streamed 14 attentions to cuda:1 in layers
    whose MLPs streamed there too, 531 MiB over, where 17 layers kept their MLP resident; moving units off
    repaired it 3.5 % slower. The counts per device do not change.
    """
    out = list(choice)
    load: dict[tuple[int, str], int] = {}  # (copy run, device) -> bytes copied there so far
    classes = [(members, [problem.units[i].options[choice[i]] for i in members]) for members in _like_units(problem)]
    classes = [(m, picked) for m, picked in classes if len(m) >= 2 and any(o.group_copy_bytes for o in picked)]
    for members, picked in sorted(classes, key=lambda c: -max(o.group_copy_bytes for o in c[1])):
        copied = sorted((o for o in picked if o.group_copy_bytes), key=lambda o: -o.group_copy_bytes)
        rest = iter([o for o in picked if not o.group_copy_bytes])
        free = list(members)
        for o in copied:  # to the unit whose run copies least there (the first such in order)
            i = min(free, key=lambda j: load.get((problem.run_of[j], o.group_device), 0))
            free.remove(i)
            out[i] = _same_kind(problem, i, o)
            key = (problem.run_of[i], o.group_device)
            load[key] = load.get(key, 0) + o.group_copy_bytes
        for i in free:
            out[i] = _same_kind(problem, i, next(rest))
    return out


def _like_units(problem: PlacementProblem) -> list[list[int]]:
    """Classes of units with options of the same kinds storing the same bytes, in order; pinned and tied
    units in none."""
    fixed = set(problem.pins) | {n for g in problem.tied_groups for n in g}
    keys: dict[int, tuple] = {}  # id(options) -> the class key (units share option tuples)
    classes: dict[tuple, list[int]] = {}
    for i, u in enumerate(problem.units):
        if u.name not in fixed:
            key = keys.get(id(u.options))
            if key is None:
                key = keys[id(u.options)] = tuple(sorted((*o.kind, o.stored_bytes) for o in u.options))
            classes.setdefault(key, []).append(i)
    return list(classes.values())


def _same_kind(problem: PlacementProblem, unit: int, opt: PlacementOption) -> int:
    """The index of ``unit``'s option of ``opt``'s kind."""
    return next(k for k, m in enumerate(problem.units[unit].options) if m.kind == opt.kind)


def _cheapest_move(problem: PlacementProblem, choice: Sequence[int], dev: str,
                   spill: bool = False) -> tuple[int, int] | None:
    """(unit, option) of the least extra time that takes bytes off ``dev`` (enough of them to fit, if any
    move does), raises no transient there and puts its bytes where there is room. A device that is over
    itself only refuses moves that add to it: one that adds nothing there stays allowed (a relaxation's
    plan over on two GPUs was dropped because every move off the first was checked against the second's
    negative room). With ``spill``, a move may overfill the CPU when a disk can take its units next: sublayer
    Mixtral-8x7B on RTX 4090 + 3090 with 64 GiB of RAM (batch 16 x 1024) lost its relaxation's plan 80 MB over
    the 3090, whose units fitted nowhere else (a 1 s solve then returned a plan 46 % slower)."""
    score = problem.score(choice)
    spills = {d.name for d in problem.devices if d.kind == "cpu"} if spill and any(
        d.kind == "disk" for d in problem.devices) else set()
    free = {d.name: d.capacity_bytes - score.used_bytes[d.name] for d in problem.devices}
    peak = dict.fromkeys(free, 0)  # the transient each device already holds room for
    for o in problem.options(choice):
        for d, nbytes in o.peaks():
            peak[d] = max(peak[d], nbytes)

    def fits(o: PlacementOption, now: PlacementOption) -> bool:
        # what o adds to every other device, its transient included (a phased option's prompt buffer
        # lands on a GPU), fits there; a move adding nothing is fine even where the device is over
        return all(_bytes_on(o, d) - _bytes_on(now, d) + max(0, _peak_on(o, d) - peak[d]) <= max(0, free[d])
                   for d in free if d != dev and d not in spills)

    # A transient up to the one dev already holds room for does not raise its peak: streaming a resident
    # unit from the disk instead is allowed under a larger stream buffer. Only the unit's own transient
    # (a 6 GiB GPU holding 79 units' 1 GiB buffers and a relaxation's plan 6 MiB over) refused every
    # move off it once the CPU was full.
    top = peak[dev]
    best: tuple[bool, int, int, int] | None = None  # (frees too little, extra ns, unit, option): least first
    for u, spec in enumerate(problem.units):
        now = spec.options[choice[u]]
        if _bytes_on(now, dev) == 0 or not problem.allows(spec, now):
            continue
        too_little = _bytes_on(now, dev) < -free[dev]
        for k, o in enumerate(spec.options):
            if _bytes_on(o, dev) or not problem.allows(spec, o) or _peak_on(o, dev) > top:
                continue
            key = (too_little, o.work_ns - now.work_ns, u, k)
            if (best is None or key < best) and fits(o, now):  # fits() last: most keys lose to the best already
                best = key
    return None if best is None else (best[2], best[3])


def _peak_on(opt: PlacementOption, dev: str) -> int:
    return max((b for d, b in opt.peaks() if d == dev), default=0)


def _bytes_on(opt: PlacementOption, dev: str) -> int:
    return (opt.stored_bytes if opt.storage == dev else 0) + (opt.resident_bytes if opt.execution == dev else 0)
