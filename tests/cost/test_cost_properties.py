"""Hypothesis properties of the cost model: evaluate agrees with an independent computation, more room never hurts."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from _overlap import simulated_waits
from placement_opt.cost.build import build_problem
from placement_opt.cost.evaluate import evaluate
from placement_opt.cost.kernels import _sum_max_lines
from placement_opt.cost.pricing import NS_PER_S
from placement_opt.cost.workload import Workload
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import chain_graph
from placement_opt.plan import UnitPlacement
from placement_opt.solver.problem import MODES


@st.composite
def graphs(draw):
    n = draw(st.integers(1, 6))
    units = []
    for i in range(n):
        moe = draw(st.booleans())
        experts = draw(st.integers(2, 8)) if moe else 0
        param = draw(st.integers(0, 10**9))
        units.append({
            "name": f"m.layers.{i}", "param_bytes": param, "buffer_bytes": draw(st.integers(0, 10**6)),
            "flops_per_token": draw(st.integers(0, 10**10)),
            "attn_flops_per_token_per_ctx": draw(st.integers(0, 10**5)),
            "out_bytes_per_token": draw(st.integers(0, 10**5)),
            "kv_bytes_per_token": draw(st.integers(0, 10**5)),
            "moe_num_experts": experts, "moe_experts_per_token": min(2, experts),
            "moe_expert_bytes": param // 2 if moe else 0, "in_decode": draw(st.booleans()),
            "param_names": tuple(f"m.layers.{i}.w{j}" for j in range(draw(st.integers(0, 4)))),
        })
    names = [u["name"] for u in units]
    edges = [(a, b, draw(st.integers(0, 10**5))) for i, a in enumerate(names) for b in names[i + 1:]
             if draw(st.booleans())]
    return chain_graph(units, edges=edges)


@st.composite
def machines(draw, scale: float = 1.0):
    sizes = st.integers(0, 2 * 10**9)
    devices = [Device(f"cuda:{i}", int(draw(sizes) * scale), flops=draw(st.floats(1e12, 1e15)),
                      bandwidth=draw(st.floats(1e11, 3e12)), host_link=draw(st.floats(1e9, 6e10)), reserve=0)
               for i in range(draw(st.integers(0, 2)))]
    devices.append(Device("cpu", draw(sizes), flops=draw(st.floats(1e10, 1e13)), bandwidth=draw(st.floats(1e9, 3e11))))
    if draw(st.booleans()):
        devices.append(Device("disk", draw(sizes), bandwidth=draw(st.floats(1e8, 1e10))))
    return Machine(devices)


workloads = st.builds(Workload, batch_size=st.integers(1, 32), prompt_len=st.integers(1, 4096),
                      new_tokens=st.integers(0, 512), training=st.booleans(),
                      activation_checkpointing=st.booleans(), overlap=st.booleans(), padded=st.booleans())


def reference_phase_s(graph, machine, workload, units, key):
    """One phase's latency written from the cost model's definition, not from PlacementProblem.score:
    max(longest path, busiest device, the prefetch thread's copies), an edge costing
    ``bytes x tokens / link + latency`` per transfer when its ends compute on different devices, each
    unit starting no earlier than the one before it in execution order ends (one forward runs them in turn), a
    streamed unit waiting for what the prefetch thread has left of its copy (tests/_overlap.py), and host
    memory's and the disk's time summed over units."""
    wl = workload
    at = {u.name: u for u in units}
    copy_key = "copy_prefill_s" if key == "prefill_s" else "copy_decode_s"
    wait = dict(zip(at, simulated_waits([getattr(u, key) for u in units], [getattr(u, copy_key) for u in units],
                                        cyclic=key == "decode_s"), strict=True))
    finish = {}
    previous = None
    for u in units:  # execution order; edges point forward
        arrivals = [0.0 if previous is None else finish[previous]]
        previous = u.name
        for src, dst, bytes_per_token in graph.edges():
            if dst != u.name:
                continue
            phase = "prefill" if key == "prefill_s" else "decode"
            a, b = _device_in(at[src], phase), _device_in(u, phase)
            transfer = 0.0
            if a != b:
                if key == "prefill_s":
                    tokens, times = wl.batch_size * wl.prompt_len, 2 if wl.training else 1
                else:
                    in_decode = graph.unit(src).in_decode and graph.unit(dst).in_decode
                    tokens, times = wl.batch_size, wl.decode_steps if in_decode else 0
                transfer = times * (tokens * bytes_per_token / machine.bandwidth(a, b) + machine.latency_s(a, b))
            arrivals.append(finish[src] + transfer)
        finish[u.name] = max(arrivals) + wait[u.name] + getattr(u, key)
    load = {}
    for u in units:
        device = _device_in(u, "prefill" if key == "prefill_s" else "decode")
        load[device] = load.get(device, 0.0) + getattr(u, key)
    copies = sum(getattr(u, copy_key) for u in units)
    host = sum(u.host_prefill_s if key == "prefill_s" else u.host_decode_s for u in units)
    disk = sum(u.disk_prefill_s if key == "prefill_s" else u.disk_decode_s for u in units)
    return max(max(finish.values(), default=0.0), max(load.values(), default=0.0), copies, host, disk)


def _device_in(unit, phase):
    """A phased unit computes the prefill on its prefill_execution, the decode on its execution."""
    return unit.prefill_execution if phase == "prefill" and unit.prefill_execution else unit.execution


def reference_used_bytes(machine, graph, units):
    """Stored + resident + the transient, restated from the dispatcher's rule: the prefetch thread copies a
    unit's weights ahead when it streams to a GPU (and a phased unit's in the prefill, to its prefill GPU), one
    unit ahead. While a unit runs in a phase its device holds its own peak (the option's, less the two copies it
    counts), its own copy, and the next copying unit's in flight (the decode round the cycle, the prefill's last
    followed by the decode's first), at least as much as its own."""
    gpus = {d.name for d in machine.devices if d.is_gpu}

    def copied(u, prefill):  # (device, bytes) the prefetch thread copies ahead for u in the phase
        weights = graph.unit(u.name).weight_bytes
        if u.mode == "stream" and u.execution in gpus:
            return u.execution, weights
        return (u.prefill_execution, weights) if u.mode == "phased" and prefill else (None, 0)

    def own(u, prefill, device):  # u's own transient on device in the phase, its copies apart; None: not there
        sides = [(u.execution, u.peak_bytes)] + ([(u.prefill_execution, u.prefill_peak_bytes)]
                                                 if prefill and u.prefill_execution else [])
        to, weights = copied(u, True)  # the side its two copies are counted on
        held = [peak - 2 * weights * (d == to) for d, peak in sides if d == device]
        return max(held) if held else None

    used = {}
    for d in machine.devices:
        made = {prefill: [copied(u, prefill)[1] if copied(u, prefill)[0] == d.name else 0 for u in units]
                for prefill in (True, False)}
        first_decode = next((c for c in made[False] if c), 0)
        values = []
        for prefill in (True, False):
            for i, u in enumerate(units):
                later = made[prefill][i + 1:] + ([] if prefill else made[prefill][:i + 1])
                following = next((c for c in later if c), first_decode if prefill else 0)
                mine, c = own(u, prefill, d.name), made[prefill][i]
                if mine is not None or c:
                    values.append((mine or 0) + c + (max(c, following) if any(made[prefill]) else 0))
        used[d.name] = (sum(u.stored_bytes for u in units if u.storage == d.name)
                        + sum(u.resident_bytes for u in units if u.execution == d.name) + max(values, default=0))
    return used


@given(graph=graphs(), machine=machines(), workload=workloads, data=st.data())
def test_evaluate_totals_match_an_independent_computation(graph, machine, workload, data) -> None:
    # Per-unit prices are evaluate's own (tested in test_cost.py); what is checked here is everything
    # evaluate builds from them: the placements it scores, both phase latencies with the transfers
    # priced anew, the stage times, the memory per device and the violations.
    problem = build_problem(graph, machine, workload, modes=MODES)
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    placements = tuple(UnitPlacement(unit=u.name, storage=o.storage, execution=o.execution, mode=o.mode,
                                     prefill_execution=o.prefill_execution)
                       for u, o in zip(problem.units, problem.options(choice), strict=True))
    cost = evaluate(SimpleNamespace(placements=placements), graph, machine, workload)
    units = cost.units
    assert [(u.name, u.storage, u.execution, u.mode, u.prefill_execution) for u in units] == \
        [(p.unit, p.storage, p.execution, p.mode, p.prefill_execution) for p in placements]
    tolerance = (len(units) + len(graph.edges())) / NS_PER_S  # every price is rounded up to a whole ns
    for key in ("prefill_s", "decode_s"):
        want = reference_phase_s(graph, machine, workload, units, key)
        assert abs(getattr(cost, key) - want) <= tolerance + 1e-9 * want, key
    stages = {}
    for u in units:
        for phase, seconds in (("prefill", max(u.prefill_s, u.copy_prefill_s)), ("decode", max(u.decode_s, u.copy_decode_s))):
            stages[_device_in(u, phase)] = stages.get(_device_in(u, phase), 0.0) + seconds
    assert cost.stage_s.keys() == stages.keys()
    assert all(abs(cost.stage_s[d] - stages[d]) <= 1e-9 * max(1.0, stages[d]) for d in stages)
    used = reference_used_bytes(machine, graph, units)
    assert {m.device: m.used_bytes for m in cost.memory} == used
    over = {d.name: used[d.name] - d.usable_bytes for d in machine.devices if used[d.name] > d.usable_bytes}
    assert {v.device: v.short_bytes for v in cost.violations} == over
    assert cost.fits == (not over)


@given(graph=graphs(), small=machines(), factor=st.floats(1.0, 4.0), workload=workloads, data=st.data())
def test_more_capacity_never_creates_violations(graph, small, factor, workload, data) -> None:
    big = Machine([d.with_memory(int(d.memory_bytes * factor)) for d in small.devices])
    device_map = {name: data.draw(st.sampled_from(small.names)) for name in graph.names()}
    tight = evaluate(device_map, graph, small, workload)
    roomy = evaluate(device_map, graph, big, workload)
    short = {v.device: v.short_bytes for v in tight.violations}
    for violation in roomy.violations:
        assert violation.device in short and violation.short_bytes <= short[violation.device]
    assert roomy.total_s == tight.total_s  # capacity changes memory, never time


@given(graph=graphs(), machine=machines(), batch=st.integers(1, 16), prompt=st.integers(1, 2048),
       new=st.integers(0, 256), more=st.integers(1, 256))
def test_more_tokens_never_cost_less(graph, machine, batch, prompt, new, more) -> None:
    short = build_problem(graph, machine, Workload(batch_size=batch, prompt_len=prompt, new_tokens=new))
    long = build_problem(graph, machine, Workload(batch_size=batch, prompt_len=prompt, new_tokens=new + more))
    def key(o):
        return o.storage, o.execution, o.mode, o.prefill_execution

    for unit_a, unit_b in zip(short.units, long.units, strict=True):
        longer = {key(o): o for o in unit_b.options}  # generating adds phased options
        assert {key(o) for o in unit_a.options} <= longer.keys()
        for a in unit_a.options:
            b = longer[key(a)]
            assert b.decode_ns >= a.decode_ns and b.prefill_ns == a.prefill_ns
            assert b.resident_bytes >= a.resident_bytes  # the KV cache grows with the context


@given(lines=st.lists(st.tuples(st.floats(-1e3, 1e3), st.floats(-10, 10)), min_size=1, max_size=4),
       steps=st.integers(0, 300))
def test_closed_form_decode_sum_equals_the_loop(lines, steps) -> None:
    loop = sum(max(a + b * t for a, b in lines) for t in range(steps))
    assert abs(_sum_max_lines(lines, steps) - loop) <= 1e-6 * max(1.0, abs(loop)) + 1e-6


@st.composite
def _measured_curves(draw):
    """A FLOP/s-by-tokens curve as the profiler measures it: increasing token counts, any positive rates (noise
    included: a rate may fall)."""
    tokens = sorted(set(draw(st.lists(st.integers(1, 4096), min_size=1, max_size=6))))
    return tuple((t, draw(st.floats(1e8, 1e14))) for t in tokens)


@given(curve=_measured_curves(), tokens=st.integers(1, 8192))
def test_a_measured_curve_never_prices_more_tokens_faster(curve, tokens):
    """Interpolated in the rate (linear in log tokens), a forward's time dipped between two points whose rate grew
    more than (1 + ln(t1/t0))-fold: llama-2-7b's batch of 2 was priced 11 % faster than its batch of 1."""
    from placement_opt.cost.kernels import _interpolate

    assert tokens / _interpolate(curve, tokens) <= (tokens + 1) / _interpolate(curve, tokens + 1) * (1 + 1e-12)
    first, last = curve[0], curve[-1]
    assert _interpolate(curve, first[0]) == first[1]  # the first point as measured, and the flat ends
    assert _interpolate(curve, max(tokens, last[0])) == _interpolate(curve, last[0])


def test_a_batch_of_two_on_a_measured_curve_is_not_priced_faster_than_one():
    curve = ((1, 0.2e12), (4, 0.7e12), (16, 2.8e12), (64, 11.2e12))  # time flat from 1 to 4 tokens, as memory-bound
    gpu = Device("cuda:0", 2**40, flops=11.2e12, bandwidth=3e12, source="measured", flops_by_tokens=curve)
    graph = chain_graph([{"name": f"l{i}", "param_bytes": 2**20, "flops_per_token": 2**21} for i in range(4)])
    totals = [evaluate({"": "cuda:0"}, graph, Machine([gpu, Device("cpu", 2**40)]),
                       Workload(batch_size=b, prompt_len=8, new_tokens=16)).total_s for b in (1, 2, 3)]
    assert totals == sorted(totals), totals


def test_a_training_steps_tokens_per_s_are_the_tokens_it_trains_on():
    """A training step generates nothing: its rate counted new_tokens (128 by default), so the compare tables
    printed 1050 tokens/s for a step of 4 x 512 tokens in 0.49 s, and 8.2 with new_tokens=0."""
    graph = chain_graph([{"name": f"l{i}", "param_bytes": 2**20, "flops_per_token": 2**21} for i in range(3)])
    machine = Machine([Device("cuda:0", 2**40), Device("cpu", 2**40)])
    rates = []
    for new_tokens in (0, 128):
        cost = evaluate({"": "cuda:0"}, graph, machine,
                        Workload(batch_size=4, prompt_len=512, new_tokens=new_tokens, training=True))
        rates.append(cost.tokens_per_s)
        assert cost.tokens_per_s == 4 * 512 / cost.total_s
    assert rates[0] == rates[1]
