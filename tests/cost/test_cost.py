"""The cost model: hand-computed prices on tiny graphs, option menus, crossovers, evaluate."""

from __future__ import annotations

import pytest

from placement_opt.cost.build import build_problem
from placement_opt.cost.evaluate import evaluate
from placement_opt.cost.kernels import _sum_max_lines
from placement_opt.cost.memory import WORKSPACE_FACTOR
from placement_opt.cost.pricing import (
    MAPPED_READ_FACTOR,
    NS_PER_S,
    UNIT_OVERHEAD_S,
    expected_experts,
)
from placement_opt.cost.pricing import _ns as ns
from placement_opt.cost.workload import Workload
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import chain_graph

CPU_OH = UNIT_OVERHEAD_S["cpu"]  # 150 us per unit per forward
GPU_OH = UNIT_OVERHEAD_S["gpu"]  # 60 us


def measured_machine(*, gpu: bool = True, disk: bool = False, gpu_mem: str = "10GB",
                     cpu_mem: str = "100GB") -> Machine:
    """Round numbers, 'measured' so no efficiency derating applies."""
    devices = [Device("cpu", cpu_mem, flops=1e12, bandwidth=1e11, source="measured")]
    if gpu:
        devices.append(Device("cuda:0", gpu_mem, flops=1e14, bandwidth=1e12, host_link=1e10,
                              reserve=0, source="measured"))
    if disk:
        devices.append(Device("disk", "1TB", bandwidth=1e9, source="measured"))
    return Machine(devices)


def option(problem, unit: str, storage: str, execution: str, mode: str):
    spec = next(u for u in problem.units if u.name == unit)
    return next(o for o in spec.options
                if (o.storage, o.execution, o.mode) == (storage, execution, mode))


# -- hand-computed prices --------------------------------------------------------------------------
def test_cpu_resident_unit_prefill_and_decode_by_hand() -> None:
    # One unit: 1 GB of weights, 2 GFLOP per token, no attention; CPU 1 TFLOP/s, 100 GB/s.
    graph = chain_graph([{"name": "w", "param_bytes": 10**9, "flops_per_token": 2 * 10**9}])
    problem = build_problem(graph, measured_machine(gpu=False),
                            Workload(batch_size=1, prompt_len=100, new_tokens=10))
    opt = option(problem, "w", "cpu", "cpu", "resident")
    # prefill: max(100 x 2e9 / 1e12 = 0.2 s, 1e9 / 1e11 = 0.01 s) + 150 us = 0.20015 s
    assert opt.prefill_ns == 200_150_000
    # decode step: max(2e9 / 1e12 = 2 ms, 1e9 / 1e11 = 10 ms) + 150 us = 10.15 ms; x 10 steps
    assert opt.decode_ns == 101_500_000
    assert (opt.stored_bytes, opt.resident_bytes, opt.peak_bytes) == (10**9, 0, 0)


def test_stream_overlaps_copy_and_stream_sync_adds_it() -> None:
    # 1 GB unit on a GPU of 100 TFLOP/s, 1 TB/s, host link 10 GB/s (latency 10 us).
    graph = chain_graph([{"name": "w", "param_bytes": 10**9, "flops_per_token": 2 * 10**9,
                          "param_names": ("w.a", "w.b")}])
    workload = Workload(batch_size=1, prompt_len=1000, new_tokens=2, overlap=True)
    problem = build_problem(graph, measured_machine(), workload, modes=("resident", "stream", "stream_sync"))
    resident = option(problem, "w", "cuda:0", "cuda:0", "resident")
    stream = option(problem, "w", "cpu", "cuda:0", "stream")
    sync = option(problem, "w", "cpu", "cuda:0", "stream_sync")
    # by default the copy hides behind this unit's compute alone: max(compute, copy), no copy apart
    plain = option(build_problem(graph, measured_machine(), Workload(batch_size=1, prompt_len=1000, new_tokens=2),
                                 modes=("stream",)), "w", "cpu", "cuda:0", "stream")
    assert (plain.prefill_ns, plain.decode_ns, plain.copy_prefill_ns, plain.copy_decode_ns) == \
        (100_010_000, 2 * 100_010_000, 0, 0)
    # compute: max(1000 x 2e9 / 1e14 = 20 ms, 1e9 / 1e12 = 1 ms) + 60 us = 20.06 ms
    assert resident.prefill_ns == 20_060_000
    # stream: the compute in prefill_ns, the prefetch thread's copy 1e9 / 1e10 + 10 us = 100.01 ms beside it;
    # alone (nothing before it to hide the copy) it takes the longer of the two
    assert (stream.prefill_ns, stream.copy_prefill_ns) == (20_060_000, 100_010_000)
    assert stream.work_in("prefill_ns") == 100_010_000
    # sync: pageable copy at 0.6 x 10 GB/s = 166.67 ms, + 2 tensors x 10 us, + compute 20.06 ms, no copy beside
    assert stream.work_in("prefill_ns") < sync.prefill_ns == ns(1e9 / 6e9 + 20e-6 + 0.02006)
    assert sync.copy_prefill_ns == sync.copy_decode_ns == 0
    # decode steps: compute max(0.02 ms, 1 ms) + 60 us = 1.06 ms; copies dominate every step
    assert resident.decode_ns == stream.decode_ns == 2_120_000
    assert stream.copy_decode_ns == 2 * 100_010_000
    # host memory (the CPU's 100 GB/s) serves the copy's 1 GB: 10 ms a forward; a resident unit none
    assert (stream.host_prefill_ns, stream.host_decode_ns) == (10_000_000, 20_000_000)
    assert resident.host_prefill_ns == resident.host_decode_ns == 0
    # buffers: stream keeps this and the prefetched next unit (2 x 1 GB), sync one
    assert stream.peak_bytes == 2 * 10**9 and sync.peak_bytes == 10**9 and resident.peak_bytes == 0
    assert stream.stored_bytes == 10**9  # charged to the CPU, where it lives


def test_disk_reads_to_the_cpu_do_not_overlap_compute() -> None:
    # 1 GB unit; disk 1 GB/s sequential (latency 100 us); CPU 1 TFLOP/s, 100 GB/s
    graph = chain_graph([{"name": "w", "param_bytes": 10**9, "flops_per_token": 2 * 10**9,
                          "param_names": ("w.a",)}])
    workload = Workload(batch_size=1, prompt_len=100, new_tokens=0)
    problem = build_problem(graph, measured_machine(disk=True), workload,
                            modes=("resident", "stream", "stream_sync"))
    stream = option(problem, "w", "disk", "cpu", "stream")
    sync = option(problem, "w", "disk", "cpu", "stream_sync")
    # compute 0.2 s + 150 us, plus the read 1e9 / 1e9 + 100 us: the CPU faults pages in itself
    assert stream.prefill_ns == ns(0.20015 + 1.0001)
    # accelerate's per-tensor memmap copies run at MAPPED_READ_FACTOR x the disk's rate
    assert sync.prefill_ns == ns(0.20015 + 1e9 / (MAPPED_READ_FACTOR * 1e9) + 100e-6)
    # streaming to the GPU overlaps: max(compute 20.06 ms, read 1.0001 s)
    assert option(problem, "w", "disk", "cuda:0", "stream").work_in("prefill_ns") == ns(1.0001)


def test_kv_cache_and_attention_grow_with_context() -> None:
    # attention unit: 1 MFLOP per token per context token, 1 kB KV per token; batch 2, 10 + 5 tokens
    graph = chain_graph([{"name": "attn", "param_bytes": 1000, "flops_per_token": 10**6,
                          "attn_flops_per_token_per_ctx": 10**6, "kv_bytes_per_token": 1000,
                          "out_bytes_per_token": 100}])
    # chain_graph traces at seq_len 1, so the context-free part is 1e6 - 1e6 x 1 = 0
    workload = Workload(batch_size=2, prompt_len=10, new_tokens=5)
    opt = option(build_problem(graph, measured_machine(gpu=False), workload), "attn", "cpu", "cpu", "resident")
    # KV cache: 1000 B x batch 2 x (10 + 5) tokens
    assert opt.resident_bytes == 30_000
    # workspace: 2 x 10 prompt tokens x 100 B x WORKSPACE_FACTOR
    assert opt.peak_bytes == 20 * 100 * WORKSPACE_FACTOR
    # prefill FLOPs, causal: 2 x 1e6 x (1 + ... + 10) = 1.1e8 -> 110 us (bytes: 1000 + 4000 + 20000 -> 0.25 us)
    assert opt.prefill_ns == ns(1.1e8 / 1e12 + CPU_OH)
    # decode step t: context 11 + t, FLOPs 2 x 1e6 x (11 + t); summed over t = 0..4: 2e6 x 65 = 1.3e8
    assert opt.decode_ns == ns(1.3e8 / 1e12 + 5 * CPU_OH)
    longer = Workload(batch_size=2, prompt_len=10, new_tokens=50)
    opt_long = option(build_problem(graph, measured_machine(gpu=False), longer), "attn", "cpu", "cpu", "resident")
    assert opt_long.resident_bytes == 2 * 60 * 1000
    assert opt_long.decode_ns > 10 * opt.decode_ns  # 10x the steps, each with a longer context


def test_sum_max_lines_equals_the_loop() -> None:
    lines = [(5.0, 0.0), (1.0, 1.0), (3.0, 0.5)]
    for steps in (0, 1, 3, 7, 20):
        loop = sum(max(a + b * t for a, b in lines) for t in range(steps))
        assert _sum_max_lines(lines, steps) == pytest.approx(loop)


# -- option menus --------------------------------------------------------------------------------
def test_option_menu_default_and_with_sync() -> None:
    graph = chain_graph([{"name": "a", "param_bytes": 10}])
    machine = Machine([Device("cuda:0", "1GB"), Device("cuda:1", "1GB"), Device("cpu", "1GB"),
                       Device("disk", "1GB")])
    default = build_problem(graph, machine, Workload())
    menu = [(o.storage, o.execution, o.mode, o.prefill_execution) for o in default.units[0].options]
    assert menu == [
        ("cuda:0", "cuda:0", "resident", None), ("cuda:1", "cuda:1", "resident", None),
        ("cpu", "cpu", "resident", None), ("cpu", "cuda:0", "stream", None), ("cpu", "cuda:1", "stream", None),
        ("disk", "cpu", "stream", None), ("disk", "cuda:0", "stream", None), ("disk", "cuda:1", "stream", None),
        ("cpu", "cpu", "phased", "cuda:0"), ("cpu", "cpu", "phased", "cuda:1"),
        ("disk", "cpu", "phased", "cuda:0"), ("disk", "cpu", "phased", "cuda:1"),
    ]
    every = build_problem(graph, machine, Workload(), modes=("resident", "stream", "stream_sync"))
    assert len(every.units[0].options) == 8 + 5  # no phased option unless asked
    cpu_only = build_problem(graph, Machine([Device("cpu", "1GB")]), Workload())
    assert [(o.storage, o.mode) for o in cpu_only.units[0].options] == [("cpu", "resident")]
    with pytest.raises(ValueError, match="'teleport'.*resident, stream, stream_sync, phased"):
        build_problem(graph, machine, Workload(), modes=("resident", "teleport"))


def test_edges_cost_only_between_different_devices() -> None:
    # two units exchange 1000 B per token; CPU <-> GPU link 10 GB/s, 10 us latency
    graph = chain_graph([{"name": "a", "out_bytes_per_token": 1000}, {"name": "b"}])
    problem = build_problem(graph, measured_machine(), Workload(batch_size=4, prompt_len=250, new_tokens=3))
    (edge,) = problem.edges
    # prefill: 4 x 250 x 1000 B / 1e10 + 10 us = 110 us; decode: 3 x (4 x 1000 / 1e10 + 10 us) = 31.2 us
    assert edge.prefill_ns[("cpu", "cuda:0")] == 110_000
    assert edge.decode_ns[("cuda:0", "cpu")] == 31_200
    assert ("cpu", "cpu") not in edge.prefill_ns


def test_units_outside_decode_cost_nothing_there() -> None:
    graph = chain_graph([{"name": "enc", "param_bytes": 10**6, "flops_per_token": 10**6, "in_decode": False}])
    opt = build_problem(graph, measured_machine(gpu=False), Workload(new_tokens=50)).units[0].options[0]
    assert opt.decode_ns == 0 and opt.prefill_ns > 0


def test_pins_are_checked_and_passed_on() -> None:
    graph = chain_graph([{"name": "a"}, {"name": "b"}])
    problem = build_problem(graph, measured_machine(), Workload(), pins={"a": 0}, contiguous=True)
    assert problem.pins == {"a": "cuda:0"} and problem.contiguous
    with pytest.raises(ValueError, match="'zzz'"):
        build_problem(graph, measured_machine(), Workload(), pins={"zzz": "cpu"})
    with pytest.raises(ValueError, match="cuda:3 is not in the machine"):
        build_problem(graph, measured_machine(), Workload(), pins={"a": "cuda:3"})


# -- the CPU vs streaming crossover ---------------------------------------------------------------------
def crossover_setup(prompt_len: int, new_tokens: int):
    # one fp16 7B-class layer: 200M params = 400 MB, 400 MFLOP per token, on datasheet presets
    graph = chain_graph([{"name": "layer", "param_bytes": 400 * 10**6, "flops_per_token": 400 * 10**6,
                          "out_bytes_per_token": 8192, "kv_bytes_per_token": 4096}])
    machine = Machine([Device.preset("rtx-4090", name="cuda:0"), Device.preset("cpu-desktop")])
    problem = build_problem(graph, machine, Workload(batch_size=1, prompt_len=prompt_len, new_tokens=new_tokens))
    cpu = option(problem, "layer", "cpu", "cpu", "resident")
    stream = option(problem, "layer", "cpu", "cuda:0", "stream")
    return cpu, stream


def test_cpu_execution_beats_streaming_for_small_batches() -> None:
    # 1 token: CPU reads 400 MB at 60 GB/s x 0.6 (11 ms); streaming copies 400 MB at 25 GB/s (16 ms)
    cpu, stream = crossover_setup(prompt_len=1, new_tokens=0)
    assert cpu.prefill_ns < stream.work_in("prefill_ns")
    # decode at batch 1 is the same story at every step
    cpu, stream = crossover_setup(prompt_len=1, new_tokens=100)
    assert cpu.decode_ns < stream.work_in("decode_ns")


def test_streaming_beats_cpu_execution_for_long_prompts() -> None:
    # 4096 tokens x 400 MFLOP = 1.6 TFLOP: 6.6 s on the CPU (0.25 TFLOP/s), 16 ms copy + 17 ms on the GPU
    cpu, stream = crossover_setup(prompt_len=4096, new_tokens=0)
    assert stream.work_in("prefill_ns") * 10 < cpu.prefill_ns


# -- MoE -------------------------------------------------------------------------------------------
def test_expected_experts() -> None:
    assert expected_experts(8, 2, 1) == pytest.approx(2.0)
    assert expected_experts(8, 2, 4) == pytest.approx(8 * (1 - 0.75**4))  # 5.47
    assert expected_experts(8, 2, 10_000) == pytest.approx(8.0)
    assert expected_experts(0, 0, 5) == 0.0


def test_moe_decode_reads_only_the_experts_hit() -> None:
    # 8 experts of 100 MB, top-2, plus 10 MB router/attention; memory-bound on the CPU (100 GB/s)
    moe = {"name": "moe", "param_bytes": 810 * 10**6, "flops_per_token": 1000, "moe_num_experts": 8,
           "moe_experts_per_token": 2, "moe_expert_bytes": 800 * 10**6}
    graph = chain_graph([moe])
    one = build_problem(graph, measured_machine(gpu=False), Workload(batch_size=1, new_tokens=1))
    # batch 1: 10 MB + 2/8 x 800 MB = 210 MB -> 2.1 ms + 150 us
    assert one.units[0].options[0].decode_ns == ns(210e6 / 1e11 + CPU_OH)
    four = build_problem(graph, measured_machine(gpu=False), Workload(batch_size=4, new_tokens=1))
    # batch 4: 10 MB + 5.47/8 x 800 MB = 557 MB
    hit = expected_experts(8, 2, 4)
    assert four.units[0].options[0].decode_ns == ns((10e6 + 100e6 * hit) / 1e11 + CPU_OH)
    # weights stored are all experts, whatever the batch
    assert four.units[0].options[0].stored_bytes == 810 * 10**6


# -- training --------------------------------------------------------------------------------------
def test_training_states_in_memory_and_time() -> None:
    # 1000 fp16 params (2000 B), Adam; batch 2 x 8 tokens, output 64 B per token
    graph = chain_graph([{"name": "a", "param_bytes": 2000, "flops_per_token": 10**9, "out_bytes_per_token": 64,
                          "kv_bytes_per_token": 10}])
    train = Workload(training=True, batch_size=2, prompt_len=8, new_tokens=0)
    opt = option(build_problem(graph, measured_machine(gpu=False), train), "a", "cpu", "cpu", "resident")
    # stored: weights 2000 + grads 2000 + Adam 1000 x (8 + 4 master) = 16000
    assert opt.stored_bytes == 16_000
    # resident: saved activations 16 x 64 x 17 = 17408, no KV cache in training
    assert opt.resident_bytes == 17_408
    # time: forward (16 x 1e9 / 1e12 = 16 ms + 150 us) x 3 for forward + backward
    assert opt.prefill_ns == ns(3 * (0.016 + CPU_OH)) and opt.decode_ns == 0
    ckpt = Workload(training=True, batch_size=2, prompt_len=8, new_tokens=0, activation_checkpointing=True)
    opt_ckpt = option(build_problem(graph, measured_machine(gpu=False), ckpt), "a", "cpu", "cpu", "resident")
    assert opt_ckpt.resident_bytes == 16 * 64 and opt_ckpt.prefill_ns > opt.prefill_ns


# -- evaluate ---------------------------------------------------------------------------------------
def llama_like():
    # embed 1 MB, two 100 MB layers with attention, norm, lm_head 1 MB; 4 kB activations per token
    return chain_graph([
        {"name": "model.embed_tokens", "param_bytes": 10**6, "out_bytes_per_token": 4096,
         "param_names": ("model.embed_tokens.weight",)},
        *({"name": f"model.layers.{i}", "param_bytes": 10**8, "flops_per_token": 10**8,
           "attn_flops_per_token_per_ctx": 8192, "kv_bytes_per_token": 2048, "out_bytes_per_token": 4096,
           "param_names": (f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.mlp.up_proj.weight",
                           f"model.layers.{i}.mlp.down_proj.weight")} for i in range(2)),
        {"name": "model.norm", "param_bytes": 4096, "flops_per_token": 4096, "out_bytes_per_token": 4096},
        {"name": "lm_head", "param_bytes": 10**6, "flops_per_token": 10**6, "out_bytes_per_token": 1000},
    ])


def test_evaluate_accelerate_map_with_prefix_keys() -> None:
    graph = llama_like()
    machine = measured_machine(disk=True)
    workload = Workload(batch_size=2, prompt_len=64, new_tokens=8)
    cost = evaluate({"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu", "model.norm": "disk",
                     "lm_head": "cuda:0"}, graph, machine, workload)
    by_unit = {u.name: (u.storage, u.execution, u.mode) for u in cost.units}
    # accelerate runs cpu/disk entries on the main GPU, copying weights synchronously
    assert by_unit["model.layers.1"] == ("cpu", "cuda:0", "stream_sync")
    assert by_unit["model.norm"] == ("disk", "cuda:0", "stream_sync")
    assert by_unit["lm_head"] == ("cuda:0", "cuda:0", "resident")
    # a coarser key covers every layer; the same map spelled coarsely costs the same
    coarse = evaluate({"model.embed_tokens": 0, "model.layers": 0, "model.layers.1": "cpu",
                       "model.norm": "disk", "lm_head": 0}, graph, machine, workload)
    assert coarse.total_s == cost.total_s
    # memory: cuda:0 stores embed + layer 0 + lm_head and keeps the KV cache of both layers
    gpu = cost.device_memory("cuda:0")
    assert gpu.weights_bytes == 10**6 + 10**8 + 10**6
    assert gpu.kv_cache_bytes == 2 * 2048 * 2 * 72
    assert gpu.stream_buffer_bytes == 10**8  # layer 1 passes through one buffer
    assert cost.device_memory("cpu").weights_bytes == 10**8
    assert cost.fits and cost.transfer_s == 0.0


def test_a_unit_streamed_to_the_cpu_holds_one_copy_of_its_weights_and_one_streamed_to_a_gpu_two() -> None:
    # On the CPU the unit computes from its mapped pages, the unit before it gone before it starts (the
    # dispatcher settles the release); a GPU holds the unit's copy and the next one's, prefetched.
    from placement_opt.cost.build import build_problem

    graph = llama_like()
    machine = measured_machine(disk=True)
    problem = build_problem(graph, machine, Workload(batch_size=2, prompt_len=64, new_tokens=8))
    layer = problem.units[problem.index()["model.layers.1"]]
    buffers = {(o.storage, o.execution): o.peak_bytes for o in layer.options if o.mode == "stream"}
    resident = {o.execution: o.peak_bytes for o in layer.options if o.mode == "resident"}
    assert buffers[("disk", "cpu")] - resident["cpu"] == 10**8
    assert buffers[("cpu", "cuda:0")] - resident["cuda:0"] == 2 * 10**8


def test_evaluate_finer_keys_take_the_majority_of_parameters() -> None:
    graph = llama_like()
    fine = {"model.embed_tokens": "cpu", "model.layers.0.self_attn": 0, "model.layers.0.mlp": "cpu",
            "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    cost = evaluate(fine, graph, measured_machine(), Workload(prompt_len=8, new_tokens=2))
    # layer 0 has two mlp parameters on cpu and one attention parameter on the GPU: cpu wins
    assert cost.units[1].storage == "cpu"
    # a coarse key with one finer exception: the parameters not under the exception follow the coarse key
    mixed = evaluate({"": 0, "model.layers.1.mlp.down_proj": "cpu"}, graph, measured_machine(),
                     Workload(prompt_len=8, new_tokens=2))
    assert mixed.units[2].storage == "cuda:0"  # 2 of its 3 parameters are on cuda:0
    flipped = evaluate({"": 0, "model.layers.1.mlp": "cpu"}, graph, measured_machine(),
                       Workload(prompt_len=8, new_tokens=2))
    assert flipped.units[2].storage == "cpu" and flipped.units[1].storage == "cuda:0"


def test_evaluate_without_gpu_runs_on_cpu() -> None:
    graph = llama_like()
    cost = evaluate({"": "cpu", "model.layers.1": "disk"}, graph, measured_machine(gpu=False, disk=True),
                    Workload(prompt_len=8, new_tokens=2))
    assert {u.execution for u in cost.units} == {"cpu"}
    assert cost.units[2].mode == "stream_sync" and cost.units[2].storage == "disk"


def test_evaluate_a_plan_uses_its_placements() -> None:
    from placement_opt.plan import Plan, UnitPlacement

    graph = llama_like()
    machine = measured_machine(disk=True)
    workload = Workload(prompt_len=32, new_tokens=4)
    chosen = [("cuda:0", "cuda:0", "resident"), ("cpu", "cpu", "resident"), ("disk", "cuda:0", "stream"),
              ("cpu", "cpu", "resident"), ("cuda:0", "cuda:0", "resident")]
    placements = tuple(UnitPlacement(unit=n, storage=s, execution=e, mode=m)
                       for n, (s, e, m) in zip(graph.names(), chosen, strict=True))
    first = evaluate({"": "cpu"}, graph, machine, workload)
    plan = Plan(model_name="t", dtype="float16", objective="latency", strategy="cpsat", placements=placements,
                machine=machine, workload=workload, cost=first, status="OPTIMAL", objective_value=0.0,
                best_bound=0.0, gap=0.0, solve_time_s=0.0)
    cost = evaluate(plan, graph, machine)
    assert [(u.storage, u.execution, u.mode) for u in cost.units] == chosen
    problem = build_problem(graph, machine, workload)
    keys = [[(o.storage, o.execution, o.mode) for o in u.options] for u in problem.units]
    score = problem.score([k.index(c) for k, c in zip(keys, chosen, strict=True)])
    assert round(cost.prefill_s * NS_PER_S) == score.prefill_ns
    assert round(cost.decode_s * NS_PER_S) == score.decode_ns
    assert cost.transfer_s > 0  # embed -> layer 0 crosses cuda:0 -> cpu, and back


def test_violation_message_says_what_takes_the_space_and_what_to_do() -> None:
    graph = llama_like()
    machine = measured_machine(gpu_mem="150MB")
    cost = evaluate({"": 0}, graph, machine, Workload(batch_size=16, prompt_len=1024, new_tokens=1024))
    (violation,) = cost.violations
    assert violation.device == "cuda:0" and violation.short_bytes > 0
    msg = violation.message
    assert msg.startswith("cuda:0 needs ") and "short" in msg
    assert "weights 192." in msg and "KV cache for batch 16 x 2048 tokens" in msg
    assert msg.endswith(": raise max_memory, add 'disk' to the devices, or reduce the batch or context")
    assert violation.needed_bytes == cost.device_memory("cuda:0").used_bytes


@pytest.mark.parametrize(("gpu", "disk", "advice"), [
    (True, True, "raise max_memory, or reduce the batch or context"),
    (False, False, "raise the CPU's max_memory, add 'disk' to the devices, or reduce the batch or context"),
    (False, True, "raise the CPU's max_memory, or reduce the batch or context"),
])
def test_a_shortage_never_asks_to_add_a_device_the_machine_has(gpu: bool, disk: bool, advice: str) -> None:
    """compare on a CPU with a disk told each OOM strategy to "add 'disk' to the devices"."""
    machine = measured_machine(gpu=gpu, disk=disk, gpu_mem="150MB", cpu_mem="150MB")
    cost = evaluate({"": 0 if gpu else "cpu"}, llama_like(), machine,
                    Workload(batch_size=16, prompt_len=1024, new_tokens=1024))
    assert [v.message.rsplit(": ", 1)[1] for v in cost.violations] == [advice]


def test_evaluate_errors_name_the_bad_value() -> None:
    graph = llama_like()
    with pytest.raises(ValueError, match="'disk'.*not in the machine"):
        evaluate({"": "disk"}, graph, measured_machine(), Workload())
    with pytest.raises(ValueError, match="no entry for units model.norm, lm_head"):
        evaluate({"model.embed_tokens": 0, "model.layers": 0}, graph, measured_machine(), Workload())
    with pytest.raises(ValueError, match="Plan or an accelerate device_map"):
        evaluate(["cpu"], graph, measured_machine(), Workload())
    with pytest.raises(ValueError, match="unknown device name 'tpu'"):
        evaluate({"": "tpu"}, graph, measured_machine(), Workload())


def test_evaluate_traces_a_model_and_scores_an_accelerate_map() -> None:
    from transformers import LlamaConfig

    # 2 layers, hidden 64, vocab 128, fp32: embed and lm_head 128 x 64 x 4 = 32 KiB each
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False, dtype="float32")
    machine = Machine([Device("cuda:0", "1GB", reserve=0), Device("cpu", "1GB"), Device("disk", "1GB")])
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": "disk",
                  "model.norm": "cpu", "lm_head": "cpu"}
    cost = evaluate(device_map, config, machine, Workload(batch_size=2, prompt_len=16, new_tokens=4))
    by_unit = {u.name: u for u in cost.units}
    assert by_unit["lm_head"].stored_bytes == 128 * 64 * 4
    assert (by_unit["model.layers.1"].storage, by_unit["model.layers.1"].mode) == ("disk", "stream_sync")
    # KV cache: both layers compute on cuda:0; 2 x 2 KV heads x 16 dims x 4 B = 256 B per token,
    # for batch 2 x (16 + 4) tokens, per layer
    assert cost.device_memory("cuda:0").kv_cache_bytes == 2 * 256 * 2 * 20
    assert cost.total_s > 0 and cost.fits


def test_measured_flops_by_tokens_curve_prices_small_batches() -> None:
    # CPU reaching 10 GFLOP/s at 1 token, 100 GFLOP/s at 100 tokens (interpolated in log tokens)
    cpu = Device("cpu", "10GB", flops=1e12, bandwidth=1e15, source="measured",
                 flops_by_tokens=[(100, 1e11), (1, 1e10)])
    assert cpu.flops_by_tokens == ((1, 1e10), (100, 1e11))  # sorted
    graph = chain_graph([{"name": "w", "param_bytes": 1000, "flops_per_token": 10**9}])

    def prefill_ns(tokens: int) -> int:
        problem = build_problem(graph, Machine([cpu]), Workload(prompt_len=tokens, new_tokens=0))
        return problem.units[0].options[0].prefill_ns

    assert prefill_ns(1) == ns(1e9 / 1e10 + CPU_OH)           # 100 ms
    assert prefill_ns(10) == ns(10e9 / 5.5e10 + CPU_OH)       # halfway in log: 55 GFLOP/s
    assert prefill_ns(1000) == ns(1000e9 / 1e11 + CPU_OH)     # flat beyond the last point
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        Device("cpu", "1GB", flops_by_tokens=[(0, 1e9)])


def test_evaluate_accepts_a_map_that_leaves_out_buffers_only_units():
    """accelerate accepts a map without ``rotary_emb`` (no parameters); every parameter must be placed."""
    import pytest

    from placement_opt import evaluate, trace
    from placement_opt.errors import PlanFormatError
    from placement_opt.model import catalog

    graph = trace(catalog.model_config("llama-2-7b"))
    assert graph.unit("model.rotary_emb").param_bytes == 0
    machine = {0: "24GiB", "cpu": "64GiB"}
    with_rotary = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers": "cpu", "model.norm": 0,
                   "lm_head": 0}
    without = {k: v for k, v in with_rotary.items() if k != "model.rotary_emb"}
    assert evaluate(without, graph, machine).total_s == evaluate(with_rotary, graph, machine).total_s
    with pytest.raises(PlanFormatError, match="no entry for units model.norm"):
        evaluate({k: v for k, v in without.items() if k != "model.norm"}, graph, machine)


def test_transfers_count_a_residual_stream_once_not_once_per_reader():
    """A skip edge a -> c beside the path a -> b -> c (a module graph's residual stream) moves nothing of
    its own: with a on one GPU and b, c on the other, the plan pays one crossing, as its latency does."""
    units = [{"name": n, "param_bytes": 2**20, "flops_per_token": 2**20, "out_bytes_per_token": 4096}
             for n in ("a", "b", "c")]
    machine = Machine([Device.preset("rtx-4090", name="cuda:0"), Device.preset("rtx-4090", name="cuda:1"),
                       Device.preset("cpu-desktop", name="cpu")])
    workload = Workload(prompt_len=64, new_tokens=4)
    placement = {"a": 1, "b": 0, "c": 0}
    skip = evaluate(placement, chain_graph(units, edges=[("a", "b", 4096), ("b", "c", 4096), ("a", "c", 4096)]),
                    machine, workload)
    chain = evaluate(placement, chain_graph(units), machine, workload)
    assert skip.transfer_s == pytest.approx(chain.transfer_s) and chain.transfer_s > 0
    assert (skip.prefill_s, skip.decode_s) == pytest.approx((chain.prefill_s, chain.decode_s))


def test_accelerates_buffer_is_one_modules_load_and_ours_the_whole_unit() -> None:
    """A unit of 100 MiB whose largest module holds 30 MiB (60 MiB while copied out of its files' maps):
    accelerate's per-module hooks hold 30 MiB of it on a GPU and 60 MiB on the CPU reading from disk; the
    dispatcher's ``stream`` keeps the whole unit (its prefetch, its mapped pages)."""
    from placement_opt.cost.pricing import PricingContext, price_option
    from placement_opt.model.graph import chain_graph

    mib = 2**20
    graph = chain_graph([{"name": "layer", "param_bytes": 100 * mib, "flops_per_token": 2**20,
                          "out_bytes_per_token": 1024, "largest_module_bytes": 30 * mib,
                          "largest_load_bytes": 60 * mib}])
    machine = Machine([Device("cuda:0", "8GB", reserve=0), Device("cpu", "8GB"), Device("disk", "1TB")])
    ctx = PricingContext(graph, machine, Workload(), None)
    unit = graph.unit("layer")
    buffer = {option: price_option(ctx, unit, *option).stream_buffer_bytes
              for option in (("cpu", "cuda:0", "stream_sync"), ("disk", "cpu", "stream_sync"),
                             ("disk", "cpu", "stream"), ("cpu", "cuda:0", "stream"))}
    assert buffer[("cpu", "cuda:0", "stream_sync")] == 30 * mib
    assert buffer[("disk", "cpu", "stream_sync")] == 60 * mib
    assert buffer[("disk", "cpu", "stream")] == 100 * mib
    assert buffer[("cpu", "cuda:0", "stream")] == 200 * mib  # the unit and the next one's prefetch
