"""The workspace the cost model charges: measured figures at the workload's shape, logits by what runs."""

from __future__ import annotations

import dataclasses
import time

import pytest
import transformers as T
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.cost.evaluate import evaluate, predicted_memory
from placement_opt.cost.memory import (
    CUBLAS_WORKSPACE_BYTES,
    WORKSPACE_FACTOR,
    cpu_gemm_scratch,
    workspace_bytes,
)
from placement_opt.cost.workload import Workload
from placement_opt.errors import WorkloadError
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import LayerGraph, chain_graph
from placement_opt.model.tracer import trace
from placement_opt.planner import solve

GIB = 2**30

LAYER = {"name": "layer", "out_bytes_per_token": 200, "kv_bytes_per_token": 100,
         "workspace_bytes_per_token": 1000, "workspace_bytes_per_token_ctx": 2,
         "scores_workspace_bytes_per_token": 400, "scores_workspace_bytes_per_token_ctx": 50}
HEAD = {"name": "head", "out_bytes_per_token": 200, "workspace_bytes_per_token": 1000,
        "workspace_bytes_per_token_ctx": 0, "scores_workspace_bytes_per_token": 1000,
        "scores_workspace_bytes_per_token_ctx": 0}


def gemm(unit, rows: int = 1) -> int:
    """MKL's packing buffers charged on the CPU: a few MiB, none for a unit without weights."""
    return cpu_gemm_scratch(unit, rows)


def graph_with(attention: str | None, layer: dict | None = None) -> LayerGraph:
    """LAYER and HEAD as traced under ``attention``: an sdpa trace counts the fused kernel by its output, so its
    layer holds no query x context bytes (``layer`` overrides the figures)."""
    if layer is None:
        layer = LAYER if attention != "sdpa" else {**LAYER, "workspace_bytes_per_token_ctx": 0,
                                                   "scores_workspace_bytes_per_token": 1000,
                                                   "scores_workspace_bytes_per_token_ctx": 0}
    graph = chain_graph([layer, HEAD], dtype="float16")
    extra = {"logits_unit": "head"} | ({"attn_implementation": attention} if attention else {})
    return LayerGraph(graph.nx, dataclasses.replace(graph.meta, extra=extra))


def test_both_moments_are_priced_at_the_workload_shape_by_hand() -> None:
    eager, sdpa = graph_with("eager"), graph_with("sdpa")
    layer = eager.unit("layer")
    short = Workload(batch_size=2, prompt_len=10, new_tokens=5)
    # prefill, 2 x 10 tokens: MLP moment 20 x (1000 + 2 x 10) = 20,400; score moment 20 x (400 + 50 x 10) = 18,000
    assert workspace_bytes(layer, short, eager.meta) == 20_400 + gemm(layer)  # + MKL's packing buffers
    long = Workload(batch_size=2, prompt_len=100, new_tokens=5)
    # at 100 tokens the scores win: 200 x (400 + 50 x 100) = 1,080,000 (MLP moment: 200 x 1,200 = 240,000)
    assert workspace_bytes(layer, long, eager.meta) == 1_080_000 + gemm(layer)
    # sdpa holds no scores: the larger per-token figure alone, 200 x 1,000, whatever query x context terms the trace saw
    assert workspace_bytes(sdpa.unit("layer"), long, sdpa.meta) == 200_000 + gemm(sdpa.unit("layer"))
    traced = graph_with("sdpa", LAYER)
    assert workspace_bytes(traced.unit("layer"), long, traced.meta) == 200_000 + gemm(traced.unit("layer"))
    # on a GPU, cuBLAS's workspace instead of MKL's
    assert workspace_bytes(layer, long, eager.meta, on_gpu=True) == 1_080_000 + CUBLAS_WORKSPACE_BYTES


def test_decode_holds_one_layer_of_kv_cache_twice() -> None:
    graph = graph_with("sdpa")
    layer = graph.unit("layer")
    # prompt 1, 1,000 new tokens: prefill 4 x 1 x 1,000 = 4,000; decode at context 1,001:
    # 4 x 1,000 activations + the concatenated copy of this layer's cache 4 x 1,001 x 100
    workload = Workload(batch_size=4, prompt_len=1, new_tokens=1000)
    assert workspace_bytes(layer, workload, graph.meta) == 4_000 + 400_400 + gemm(layer)


def test_generate_keeps_the_last_logits_only() -> None:
    graph = graph_with("sdpa")
    head = graph.unit("head")
    generation = Workload(batch_size=2, prompt_len=10, new_tokens=5)
    forward = Workload(batch_size=2, prompt_len=10, new_tokens=5, logits="all")
    assert generation.logits_kept == "last"
    sampling = 2 * 2 * 100 * 4  # generate()'s 2 float32 copies of 100 logits, per sequence
    assert workspace_bytes(head, forward, graph.meta) == 20 * 1000 + sampling + gemm(head)
    # 200 logit bytes per position kept for 2 positions instead of 20
    assert workspace_bytes(head, generation, graph.meta) == 20 * 1000 - 18 * 200 + sampling + gemm(head)
    single = Workload(batch_size=2, prompt_len=10, new_tokens=0)  # a plain forward: every logit, no sampling
    assert single.logits_kept == "all" and workspace_bytes(head, single, graph.meta) == 20 * 1000 + gemm(head)
    assert workspace_bytes(graph.unit("layer"), generation, graph.meta) == workspace_bytes(
        graph.unit("layer"), forward, graph.meta)  # only the logits unit changes


def test_moe_experts_on_a_gpu_gather_the_chosen_experts_weights_at_decode() -> None:
    moe = dict(LAYER, name="moe", moe_num_experts=8, moe_experts_per_token=2, moe_expert_bytes=8 * 10**6)
    graph = chain_graph([moe])
    unit = graph.unit("moe")
    workload = Workload(batch_size=16, prompt_len=1, new_tokens=4)
    cpu = workspace_bytes(unit, workload, graph.meta)
    gpu = workspace_bytes(unit, workload, graph.meta, on_gpu=True)
    assert gpu - cpu == CUBLAS_WORKSPACE_BYTES - gemm(unit) + 16 * 2 * 10**6  # 32 (token, expert) pairs x 1 MB


def test_expert_groups_on_a_gpu_gather_no_weights_at_decode() -> None:
    """A group keeps grouped_mm at decode (runtime/_experts.py): a GPU holds what the CPU does, plus cuBLAS's own."""
    group = dict(LAYER, name="model.layers.0.mlp.experts.groups.1", moe_num_experts=8, moe_experts_per_token=2,
                 moe_expert_bytes=4 * 10**6)
    graph = chain_graph([group])
    unit = graph.unit(group["name"])
    workload = Workload(batch_size=16, prompt_len=1, new_tokens=4)
    cpu = workspace_bytes(unit, workload, graph.meta)
    gpu = workspace_bytes(unit, workload, graph.meta, on_gpu=True)
    assert gpu - cpu == CUBLAS_WORKSPACE_BYTES - gemm(unit)


def test_graphs_without_figures_keep_the_old_factor() -> None:
    graph = chain_graph([{"name": "a", "out_bytes_per_token": 64}])
    workload = Workload(batch_size=3, prompt_len=7, new_tokens=2)
    assert workspace_bytes(graph.unit("a"), workload, graph.meta, on_gpu=True) == 21 * 64 * WORKSPACE_FACTOR


@pytest.fixture(scope="module")
def traced() -> LayerGraph:
    config = T.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, dtype="float32")
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return trace(model, seq_len=32)


shapes = st.tuples(st.integers(1, 64), st.integers(1, 4096), st.integers(0, 512))


@given(shape=shapes, more_batch=st.integers(0, 64), more_prompt=st.integers(0, 4096))
def test_workspace_grows_with_tokens_and_last_never_exceeds_all(traced: LayerGraph, shape, more_batch: int,
                                                                more_prompt: int) -> None:
    batch, prompt, new = shape
    small = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new)
    bigger = Workload(batch_size=batch + more_batch, prompt_len=prompt + more_prompt, new_tokens=new)
    every = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new, logits="all")
    for unit in traced.units():
        assert workspace_bytes(unit, small, traced.meta) <= workspace_bytes(unit, bigger, traced.meta)
        assert workspace_bytes(unit, small, traced.meta) <= workspace_bytes(unit, every, traced.meta)


@given(shape=shapes, training=st.booleans(), logits=st.sampled_from([None, "last", "all"]))
def test_workload_round_trips_and_resolves_its_logits(shape, training: bool, logits: str | None) -> None:
    batch, prompt, new = shape
    if training and logits == "last":
        with pytest.raises(WorkloadError, match="training"):
            Workload(batch_size=batch, prompt_len=prompt, new_tokens=new, training=True, logits=logits)
        return
    workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new, training=training, logits=logits)
    assert Workload.from_dict(workload.to_dict()) == workload
    expected = logits or ("all" if training or new == 0 else "last")
    assert workload.logits_kept == expected
    older = {k: v for k, v in workload.to_dict().items() if k != "logits"}  # written before the field existed
    assert Workload.from_dict(older).logits_kept == ("all" if training or new == 0 else "last")


def test_unknown_logits_are_refused() -> None:
    with pytest.raises(WorkloadError, match="'last'.*'all'"):
        Workload(logits="first")


def test_predicted_memory_splits_each_device_and_names_the_peak_unit(traced: LayerGraph) -> None:
    workload = Workload(batch_size=4, prompt_len=256, new_tokens=8)
    device_map = {"": "cpu"}
    memory = predicted_memory(device_map, traced, {"cpu": "8GiB"}, workload)
    cpu = memory["cpu"]
    assert cpu == evaluate(device_map, traced, {"cpu": "8GiB"}, workload).device_memory("cpu")
    assert cpu.used_bytes == (cpu.weights_bytes + cpu.kv_cache_bytes + cpu.workspace_bytes + cpu.stream_buffer_bytes
                              + cpu.other_bytes)
    widest = max(traced.units(), key=lambda u: workspace_bytes(u, workload, traced.meta))
    assert cpu.peak_unit == widest.name
    assert cpu.workspace_bytes == workspace_bytes(widest, workload, traced.meta)
    short = evaluate(device_map, traced, {"cpu": "1MiB"}, workload).violations[0]
    assert f"activation workspace of {widest.name} for 4 x 256 prompt tokens" in short.message


QWEN2_72B = dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=152064, dtype="bfloat16", tie_word_embeddings=False)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen2-72b-shaped", "gemma-2-27b"])
def test_batch_16_grid_cells_are_not_infeasible_because_of_logits(model: str) -> None:
    """The issue's cells: batch 16 x 1024 on a 12 GB GPU, 32 GiB of RAM and an NVMe disk."""
    graph = trace(T.Qwen2Config(**QWEN2_72B) if model == "qwen2-72b-shaped" else model)
    machine = Machine([Device.preset("rtx-3060", name="cuda:0", dtype="bfloat16"),
                       Device.preset("cpu-desktop", memory="32GiB"), Device.preset("nvme-gen4")])
    workload = Workload(batch_size=16, prompt_len=1024, new_tokens=128)
    head = graph.unit(graph.meta.extra["logits_unit"])
    # the old price: 6 x the logits of every prompt token, 28-47 GiB, more than any compute device holds
    assert 16 * 1024 * head.out_bytes_per_token * WORKSPACE_FACTOR > 27 * GIB
    assert workspace_bytes(head, workload, graph.meta, on_gpu=True) < 0.5 * GIB
    start = time.perf_counter()
    plan = solve(graph, machine, workload=workload, time_limit_s=5)
    assert plan.cost.fits, [v.message for v in plan.cost.violations]
    assert time.perf_counter() - start < 120


def test_an_unset_logits_follows_a_replaced_workload() -> None:
    # Kept unresolved: turning a generation workload into a training step must not trip the 'last' check.
    generation = Workload(prompt_len=64, new_tokens=8)
    training = dataclasses.replace(generation, training=True)
    assert (generation.logits_kept, training.logits_kept) == ("last", "all")
