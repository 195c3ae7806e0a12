"""Constructive starts (solver/starts.py) and best_greedy_choice: a valid start whenever a simple one exists.

Problems are built from integers (no torch, no cost model). Brute force over every assignment is the
reference: whenever some assignment computing every unit on the CPU (weights on the CPU or the disk)
fits, ``best_greedy_choice`` must return a valid assignment; it is never worse than the old
one-unit-at-a-time greedy.
"""

from __future__ import annotations

import itertools

from _problems import problems as grouped_problems
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from placement_opt.solver._transients import MoveMemory, RunTransients
from placement_opt.solver.greedy import (
    GREEDY_RESERVES,
    ONE_GPU_RESERVES,
    _adds,
    _gpu_reserves,
    _room_for,
    best_greedy_choice,
    greedy_choice,
)
from placement_opt.solver.problem import (
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
)
from placement_opt.solver.starts import _pack, executor_starts, fits, improve


def opt(storage, execution=None, *, t=100, stored=1, resident=0, peak=0, mode=None):
    execution = execution or storage
    mode = mode or ("resident" if storage == execution else "stream")
    return PlacementOption(storage=storage, execution=execution, mode=mode, prefill_ns=t // 10, decode_ns=t,
                           stored_bytes=stored, resident_bytes=resident, peak_bytes=peak)


def chain(units, devices, **kw):
    names = [u.name for u in units]
    edges = tuple(EdgeSpec(src=a, dst=b, prefill_ns={}, decode_ns={}) for a, b in itertools.pairwise(names))
    return PlacementProblem(units=tuple(units), edges=edges, devices=tuple(devices), **kw)


def dev(name, cap):
    kind = "gpu" if name.startswith("cuda") else name
    return DeviceSpec(name=name, kind=kind, capacity_bytes=cap)


def assignments(problem, only_cpu=False):
    """Every valid assignment (only those computing every unit on the CPU with ``only_cpu``)."""
    for choice in itertools.product(*(range(len(u.options)) for u in problem.units)):
        if only_cpu and any(u.options[c].execution != "cpu" for u, c in zip(problem.units, choice, strict=True)):
            continue
        if problem.satisfies(choice):
            yield list(choice)


# -- hand-checked cases ---------------------------------------------------------------------------
def test_cpu_full_of_early_weights_leaves_no_room_for_a_later_kv_cache():
    # CPU of 10 bytes, a disk. A: 6 bytes of weights, faster resident on the CPU than streamed from
    # disk (1-byte buffer). B: 1 byte of weights + 8 bytes of KV cache, CPU only. The old greedy puts
    # A on the CPU first (6 + 9 > 10, with every GPU reserve: there is no GPU); the start keeps B's
    # 9 bytes and the 1-byte buffer on the CPU and streams A from the disk: 9 + 1 = 10.
    a = UnitSpec(name="a", options=(opt("cpu", t=100, stored=6), opt("disk", "cpu", t=900, stored=6, peak=1)))
    b = UnitSpec(name="b", options=(opt("cpu", t=100, stored=1, resident=8),))
    problem = chain([a, b], [dev("cpu", 10), dev("disk", 100)])
    assert all(not problem.satisfies(greedy_choice(problem, r)) for r in GREEDY_RESERVES)
    choice = best_greedy_choice(problem)
    assert choice == [1, 0]
    assert problem.score(choice).used_bytes == {"cpu": 10, "disk": 6}


def test_a_prompt_buffer_kept_on_one_gpu_lets_the_others_hold_layers():
    # Two 10-byte GPUs and six layers. Resident on a GPU: 4 bytes + a 1-byte workspace, 100 ns. Phased
    # (weights on the CPU, decode there, the prompt streamed through one GPU): a 7-byte prompt buffer
    # there, 300 ns. On the CPU alone: 2000 ns. No reserve: four layers resident, then no GPU has room
    # for the buffer (two at 2000 ns). The buffer kept on both GPUs: nothing resident (six phased). Kept
    # on cuda:0 only: two resident on cuda:1 and four phased through cuda:0, the fastest of the three.
    def layer(i):
        phased = [PlacementOption(storage="cpu", execution="cpu", mode="phased", prefill_ns=30, decode_ns=300,
                                  stored_bytes=4, resident_bytes=0, peak_bytes=0, prefill_execution=g,
                                  prefill_peak_bytes=7) for g in ("cuda:0", "cuda:1")]
        return UnitSpec(name=f"l{i}", options=(opt("cuda:0", stored=4, peak=1), opt("cuda:1", stored=4, peak=1),
                                               *phased, opt("cpu", t=2000, stored=4)))
    problem = chain([layer(i) for i in range(6)], [dev("cuda:0", 10), dev("cuda:1", 10), dev("cpu", 100)])
    value = {}
    for name, choice in [("none", greedy_choice(problem)), ("every GPU", greedy_choice(problem, 0.0)),
                         ("one GPU", greedy_choice(problem, ONE_GPU_RESERVES[0], one_gpu=True))]:
        assert problem.satisfies(choice), name
        value[name] = problem.objective_value(choice, "latency")
    one = greedy_choice(problem, 0.0, one_gpu=True)
    assert [problem.units[i].options[c].storage for i, c in enumerate(one)] == ["cuda:1"] * 2 + ["cpu"] * 4
    assert value["one GPU"] < min(value["none"], value["every GPU"])
    assert problem.objective_value(best_greedy_choice(problem), "latency") <= value["one GPU"]


def test_fill_moves_the_units_that_gain_most_per_byte_to_the_gpu():
    # A 4-byte GPU and three units on the CPU. a: 4 bytes, saves 400 ns on the GPU (100/byte);
    # b, c: 2 bytes each, save 300 ns each (150/byte). Best: b and c on the GPU (600 ns saved).
    def unit(name, stored, saved):
        return UnitSpec(name=name, options=(opt("cuda:0", t=1000 - saved, stored=stored),
                                            opt("cpu", t=1000, stored=stored)))
    problem = chain([unit("a", 4, 400), unit("b", 2, 300), unit("c", 2, 300)], [dev("cuda:0", 4), dev("cpu", 100)])
    assert improve(problem, [1, 1, 1]) == [1, 0, 0]


def test_fill_never_breaks_a_tie_and_keeps_pins():
    # a and b share weights (tied): a alone may not move to the GPU; c is pinned to the CPU.
    units = [UnitSpec(name=n, options=(opt("cpu", t=1000), opt("cuda:0", t=10))) for n in "abc"]
    problem = chain(units, [dev("cuda:0", 100), dev("cpu", 100)], tied_groups=(("a", "b"),), pins={"c": "cpu"})
    assert improve(problem, [0, 0, 0]) == [0, 0, 0]


def test_no_valid_start_returns_the_plain_greedy():
    # 5 bytes of weights, 4 bytes of memory in all: nothing fits, the first greedy variant comes back.
    problem = chain([UnitSpec(name="a", options=(opt("cpu", stored=5), opt("cuda:0", stored=5)))],
                    [dev("cuda:0", 2), dev("cpu", 2)])
    assert executor_starts(problem) == []
    assert best_greedy_choice(problem) == greedy_choice(problem)


def test_pack_is_exact_where_largest_first_is_not():
    # Budget 10 and items 6, 5, 5: largest first takes 6 and stops there; the best is 5 + 5.
    assert sorted(_pack([(6, 6), (5, 5), (5, 5)], 10)) == [1, 2]


# -- properties against brute force ---------------------------------------------------------------
_MENU = [("cuda:0", "cuda:0"), ("cpu", "cpu"), ("cpu", "cuda:0"), ("disk", "cpu"), ("disk", "cuda:0")]


@st.composite
def problems(draw, host: bool = False):
    """2-5 units with 1-5 options of the cost model's menu; random bytes, ties, pins and contiguity.

    ``host``: every unit can compute on the CPU (resident there, and streamed from the disk when there
    is one), so that the all-on-CPU family is often feasible, and often only just.
    """
    n = draw(st.integers(2, 5))
    has_disk = draw(st.booleans())
    menu = [m for m in _MENU if has_disk or "disk" not in m]
    host_menu = [m for m in menu if m[1] == "cpu"] if host else []
    units = []
    for i in range(n):
        where = draw(st.lists(st.sampled_from(menu), min_size=1, max_size=len(menu), unique=True))
        where = host_menu + [m for m in where if m not in host_menu]
        stored = draw(st.integers(0, 8))
        resident = {e: draw(st.integers(0, 4)) for e in ("cpu", "cuda:0")}
        options = tuple(opt(s, e, t=draw(st.integers(1, 1000)), stored=stored, resident=resident[e],
                            peak=draw(st.integers(0, 4))) for s, e in where)
        units.append(UnitSpec(name=f"u{i}", options=options))
    devices = [dev("cuda:0", draw(st.integers(0, 16))), dev("cpu", draw(st.integers(0, 24)))]
    devices += [dev("disk", draw(st.integers(0, 24)))] if has_disk else []
    names = [u.name for u in units]
    tied = (tuple(draw(st.lists(st.sampled_from(names), min_size=2, max_size=3, unique=True))),) \
        if draw(st.booleans()) else ()
    pins = {}
    if draw(st.booleans()):
        u = draw(st.sampled_from(units))
        pins = {u.name: draw(st.sampled_from(sorted({o.storage for o in u.options})))}
    return chain(units, devices, tied_groups=tied, pins=pins, contiguous=draw(st.booleans()))


@given(st.one_of(problems(), problems(host=True)))
def test_valid_whenever_everything_can_compute_on_the_cpu(problem):
    if next(assignments(problem, only_cpu=True), None) is None:
        return
    assert problem.satisfies(best_greedy_choice(problem))


@given(problems(), st.sampled_from(["latency", "throughput"]))
def test_never_worse_than_the_one_unit_at_a_time_greedy(problem, objective):
    old = [c for c in (greedy_choice(problem, r) for r in GREEDY_RESERVES) if problem.satisfies(c)]
    choice = best_greedy_choice(problem, objective)
    if old:
        assert problem.satisfies(choice)
        assert problem.objective_value(choice, objective) <= min(problem.objective_value(c, objective) for c in old)


@given(problems())
def test_every_start_and_its_fill_is_valid_and_the_fill_no_slower(problem):
    for start in executor_starts(problem):
        assert problem.satisfies(start)
        filled = improve(problem, start)
        assert problem.satisfies(filled)
        assert problem.objective_value(filled, "latency") <= problem.objective_value(start, "latency")


@given(problems(), st.data())
def test_fits_agrees_with_satisfies(problem, data):
    # fits() is satisfies() without the time schedule: the same verdict on any assignment
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    assert fits(problem, choice) == problem.satisfies(choice)


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=8), st.integers(0, 40))
def test_pack_finds_the_best_value_within_the_budget(items, budget):
    chosen = _pack(items, budget)
    assert len(set(chosen)) == len(chosen)
    assert sum(items[i][0] for i in chosen) <= budget
    best = max(sum(v for _, v in sub) for k in range(len(items) + 1) for sub in itertools.combinations(items, k)
               if sum(w for w, _ in sub) <= budget)
    assert sum(items[i][1] for i in chosen) == best


def _within_capacities(problem, choice):
    used = problem.score(choice).used_bytes
    return all(used[d.name] <= d.capacity_bytes for d in problem.devices)


@settings(max_examples=80)
@given(grouped_problems(), st.data())
def test_the_fill_accepts_a_move_exactly_when_the_moved_plan_fits(problem, data):
    """The fill's running account (MoveMemory: transients, copy-group buffers) against the problem's memory model,
    move by move: a move is taken if and only if every device still fits after it."""
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    assume(_within_capacities(problem, choice))
    memory = MoveMemory(problem, problem.options(choice))
    for _ in range(8):
        i = data.draw(st.integers(0, len(problem.units) - 1))
        k = data.draw(st.integers(0, len(problem.units[i].options) - 1))
        trial = [*choice[:i], k, *choice[i + 1:]]
        old, new = problem.units[i].options[choice[i]], problem.units[i].options[k]
        assert memory.move(i, old, new) == _within_capacities(problem, trial)
        if _within_capacities(problem, trial):
            choice = trial




def _scanned_greedy(problem, reserve_fraction, one_gpu):
    """greedy_choice as first written: every option's bytes counted until one is allowed, tied right and fits."""
    free = {d.name: d.capacity_bytes for d in problem.devices}
    peak = dict.fromkeys(free, 0)
    reserve = _gpu_reserves(problem, reserve_fraction, one_gpu)
    tied_to = {n: g[0] for g in problem.tied_groups for n in g[1:]}
    groups = RunTransients(problem) if problem.group_copies else None
    storage, choice = {}, []
    for k, u in enumerate(problem.units):
        if groups is not None:
            groups.enter(k)
        lead = tied_to.get(u.name)
        ranked = []
        for rank, i in enumerate(sorted(range(len(u.options)), key=lambda i: (u.options[i].work_ns, i))):
            o = u.options[i]
            adds = _adds(o, peak, groups) if o.mode == "phased" or groups is not None else None
            ranked.append(((not problem.allows(u, o), lead in storage and o.storage != storage[lead],
                            not _room_for(o, free, peak, reserve, adds)), rank, i))
        best = min(ranked)[2]  # the first of the least flaws in work order
        o = u.options[best]
        for d, added in _adds(o, peak, groups).items():
            free[d] -= added
        if groups is not None:
            groups.add(o)
        else:
            for d, nbytes in o.peaks():
                peak[d] = max(peak[d], nbytes)
        storage[u.name] = o.storage
        choice.append(best)
    return choice


@settings(max_examples=300)
@given(grouped_problems(copying=True), st.sampled_from([*GREEDY_RESERVES, *ONE_GPU_RESERVES]), st.booleans())
def test_the_greedy_skips_counting_only_options_that_cannot_win(problem, reserve, one_gpu):
    """greedy_choice leaves an option's bytes uncounted when it cannot beat the best so far, or when its stored and
    resident bytes alone overfill a device: it picks what counting every option picks."""
    assert greedy_choice(problem, reserve, one_gpu=one_gpu) == _scanned_greedy(problem, reserve, one_gpu)
