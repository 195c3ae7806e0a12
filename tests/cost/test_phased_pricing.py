"""Pricing of ``phased`` options: prefill streamed to a GPU, decode on the CPU where the weights are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.cost.build import build_problem
from placement_opt.cost.evaluate import evaluate
from placement_opt.cost.pricing import NS_PER_S
from placement_opt.cost.workload import Workload
from placement_opt.errors import SolverInputError
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import chain_graph
from placement_opt.plan import UnitPlacement
from placement_opt.solver.problem import MODES, PlacementOption

GIB = 2**30


def layer(i: int, *, kv: int = 4096, in_decode: bool = True) -> dict:
    return {"name": f"m.layers.{i}", "param_bytes": GIB // 2, "flops_per_token": 2 * GIB // 2,
            "attn_flops_per_token_per_ctx": 4 * 4096, "out_bytes_per_token": 8192, "kv_bytes_per_token": kv,
            "in_decode": in_decode, "param_names": (f"m.layers.{i}.w",)}


def machine(gpus: int = 1, disk: bool = True) -> Machine:
    devices = [Device(f"cuda:{i}", 8 * GIB, flops=4e14, bandwidth=2e12, host_link=5e10, reserve=0) for i in range(gpus)]
    devices.append(Device("cpu", 64 * GIB, flops=1e12, bandwidth=8e10))
    if disk:
        devices.append(Device("disk", 10**12, bandwidth=3e9))
    return Machine(devices)


def options(problem, unit=0):
    return {(o.storage, o.execution, o.mode, o.prefill_execution): o for o in problem.units[unit].options}


def test_phased_prefill_is_the_stream_plus_one_kv_move_and_decode_is_the_cpus() -> None:
    graph = chain_graph([layer(0), layer(1)])
    wl = Workload(batch_size=2, prompt_len=512, new_tokens=64)
    m = machine()
    opts = options(build_problem(graph, m, wl, modes=MODES))
    phased = opts["cpu", "cpu", "phased", "cuda:0"]
    stream, on_cpu = opts["cpu", "cuda:0", "stream", None], opts["cpu", "cpu", "resident", None]
    prompt_kv = 4096 * 2 * 512
    move_ns = (prompt_kv / m.bandwidth("cuda:0", "cpu") + m.latency_s("cuda:0", "cpu")) * NS_PER_S
    assert phased.prefill_ns == pytest.approx(stream.prefill_ns + move_ns, abs=2)
    assert phased.decode_ns == on_cpu.decode_ns
    # memory: weights on the CPU, the whole KV cache there; the GPU holds the prefill's buffers and prompt KV
    assert phased.stored_bytes == on_cpu.stored_bytes and phased.resident_bytes == on_cpu.resident_bytes
    assert phased.prefill_peak_bytes >= stream.peak_bytes + prompt_kv - 2**25  # cuBLAS scratch aside
    assert phased.peak_bytes <= on_cpu.peak_bytes
    # from disk: the decode reads the memory-mapped weights like a disk -> cpu stream
    from_disk = opts["disk", "cpu", "phased", "cuda:0"]
    assert from_disk.decode_ns == opts["disk", "cpu", "stream", None].decode_ns
    assert from_disk.prefill_ns == pytest.approx(opts["disk", "cuda:0", "stream", None].prefill_ns + move_ns, abs=2)


@given(st.floats(min_value=1e8, max_value=1e11), st.sampled_from([1, 4, 16]), st.sampled_from([64, 512, 4096]))
def test_the_prompts_kv_cache_leaves_at_the_gpus_measured_rate_to_the_host(to_host, batch, prompt) -> None:
    """A GPU whose copies back to the CPU run at ``to_host`` (a profile measures ``.to("cpu")``): the phased
    prefill pays the prompt's KV cache at that rate; streams, which copy the other way, are priced as before."""
    graph = chain_graph([layer(0), layer(1)])
    wl = Workload(batch_size=batch, prompt_len=prompt, new_tokens=8)
    plain = machine(disk=False)
    slow = Machine([Device("cuda:0", 8 * GIB, flops=4e14, bandwidth=2e12, host_link=5e10, reserve=0, to_host=to_host),
                    plain["cpu"]])
    before, after = (options(build_problem(graph, m, wl, modes=MODES)) for m in (plain, slow))
    prompt_kv = 4096 * batch * prompt
    extra_ns = prompt_kv * (1 / to_host - 1 / 5e10) * NS_PER_S
    phased = ("cpu", "cpu", "phased", "cuda:0")
    assert after[phased].prefill_ns - before[phased].prefill_ns == pytest.approx(extra_ns, abs=2)
    stream = ("cpu", "cuda:0", "stream", None)
    assert after[stream].prefill_ns == before[stream].prefill_ns and after[stream].decode_ns == before[stream].decode_ns


def test_phased_options_only_where_there_are_two_phases_and_a_cpu() -> None:
    graph = chain_graph([layer(0), layer(1, in_decode=False)])
    generating = build_problem(graph, machine(gpus=2), Workload(prompt_len=128, new_tokens=8), modes=MODES)
    assert {o.prefill_execution for o in generating.units[0].options if o.mode == "phased"} == {"cuda:0", "cuda:1"}
    assert {o.storage for o in generating.units[0].options if o.mode == "phased"} == {"cpu", "disk"}
    assert not [o for o in generating.units[1].options if o.mode == "phased"]  # outside the decode
    # a one-token prompt is no many-token prefill: the dispatcher, which tells a prefill by its tokens, would compute
    # a phased unit's prompt on the CPU where the plan priced it on the GPU
    for wl in (Workload(prompt_len=128, new_tokens=0), Workload(prompt_len=128, new_tokens=8, training=True),
               Workload(prompt_len=1, new_tokens=8)):
        problem = build_problem(graph, machine(), wl, modes=MODES)
        assert not [o for u in problem.units for o in u.options if o.mode == "phased"]
    assert not [o for o in build_problem(graph, machine(gpus=0), Workload(new_tokens=8), modes=MODES).units[0].options
                if o.mode == "phased"]
    layered = build_problem(graph, machine(), Workload(prompt_len=128, new_tokens=8), modes=("resident", "stream"))
    assert not [o for u in layered.units for o in u.options if o.mode == "phased"]  # only when asked


def test_a_phased_units_prefill_counts_on_the_gpus_peak_not_the_cpus() -> None:
    graph = chain_graph([layer(0), layer(1)])
    wl = Workload(batch_size=4, prompt_len=1024, new_tokens=16)
    m = machine(disk=False)
    problem = build_problem(graph, m, wl, modes=MODES)
    keys = [(o.storage, o.execution, o.mode, o.prefill_execution) for o in problem.units[0].options]
    phased = keys.index(("cpu", "cpu", "phased", "cuda:0"))
    resident = keys.index(("cuda:0", "cuda:0", "resident", None))
    score = problem.score([phased, resident])
    opt = problem.units[0].options[phased]
    gpu_only = problem.score([keys.index(("cpu", "cpu", "resident", None)), resident])
    assert score.used_bytes["cuda:0"] == max(gpu_only.used_bytes["cuda:0"],
                                             gpu_only.used_bytes["cuda:0"] - problem.units[1].options[resident].peak_bytes
                                             + opt.prefill_peak_bytes)
    assert score.used_bytes["cpu"] == opt.stored_bytes + opt.resident_bytes + opt.peak_bytes
    # the prefill runs on the GPU, the decode on the CPU: transfers only in the decode; the phased unit streams
    # first in the prefill, with nothing before it to hide its copy: it waits for all of it
    assert score.prefill_ns == opt.copy_prefill_ns + opt.prefill_ns + problem.units[1].options[resident].prefill_ns
    edge = problem.edges[0]
    assert score.decode_ns == opt.decode_ns + problem.units[1].options[resident].decode_ns + \
        edge.decode_ns[("cpu", "cuda:0")]


@pytest.mark.parametrize("bad", [
    {"mode": "phased"},
    {"mode": "phased", "prefill_execution": "cpu"},
    {"mode": "stream", "prefill_execution": "cuda:0"},
    {"mode": "resident", "prefill_peak_bytes": 5},
])
def test_a_phased_option_names_its_prefill_device_and_only_it_does(bad) -> None:
    fields = {"storage": "cpu", "execution": "cpu", "prefill_ns": 1, "decode_ns": 1, "stored_bytes": 1,
              "resident_bytes": 0, "peak_bytes": 0, **bad}
    with pytest.raises(SolverInputError, match="phased"):
        PlacementOption(**fields)


@st.composite
def phased_cases(draw):
    n = draw(st.integers(1, 4))
    units = [{**layer(i, kv=draw(st.integers(0, 10**5)), in_decode=draw(st.booleans())),
              "param_bytes": draw(st.integers(0, 2 * GIB)), "out_bytes_per_token": draw(st.integers(0, 10**5))}
             for i in range(n)]
    m = machine(gpus=draw(st.integers(1, 2)), disk=draw(st.booleans()))
    wl = Workload(batch_size=draw(st.integers(1, 16)), prompt_len=draw(st.integers(1, 2048)),
                  new_tokens=draw(st.integers(1, 256)))
    return chain_graph(units), m, wl


@given(case=phased_cases(), data=st.data())
def test_phased_memory_split_adds_up_and_the_gpu_holds_each_prompts_kv(case, data) -> None:
    graph, m, wl = case
    problem = build_problem(graph, m, wl, modes=MODES)
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    chosen = problem.options(choice)
    placements = tuple(UnitPlacement(unit=u.name, storage=o.storage, execution=o.execution, mode=o.mode,
                                     prefill_execution=o.prefill_execution)
                       for u, o in zip(problem.units, chosen, strict=True))
    cost = evaluate(SimpleNamespace(placements=placements), graph, m, wl)
    for mem in cost.memory:
        assert mem.used_bytes == problem.score(choice).used_bytes[mem.device]
    for unit, o in zip(graph.units(), chosen, strict=True):
        if o.mode == "phased":
            prompt_kv = unit.kv_bytes_per_token * wl.batch_size * wl.prompt_len
            gpu = cost.device_memory(o.prefill_execution)
            assert gpu.workspace_bytes + gpu.stream_buffer_bytes >= prompt_kv + 2 * unit.weight_bytes
            assert cost.device_memory("cpu").kv_cache_bytes >= unit.kv_bytes_per_token * wl.batch_size * wl.context_len


def test_the_logits_unit_is_phased_only_when_the_prefill_computes_every_position() -> None:
    """generate() asks lm_head for the last position: the dispatcher sees one token and runs it on the CPU
    in both phases, so a phased lm_head would be priced for a GPU prefill that never happens."""
    graph = chain_graph([layer(0), {**layer(1, kv=0), "name": "lm_head"}])
    graph.meta.extra["logits_unit"] = "lm_head"
    for logits, offered in (("last", False), ("all", True)):
        problem = build_problem(graph, machine(), Workload(prompt_len=128, new_tokens=8, logits=logits), modes=MODES)
        assert any(o.mode == "phased" for o in problem.units[0].options)
        assert any(o.mode == "phased" for o in problem.units[1].options) == offered
