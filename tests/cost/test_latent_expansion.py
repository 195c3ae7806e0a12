"""Latent attention (DeepSeek's) expands its whole cache at every decode step: priced per cached token, in time
on any device and in memory on the device that runs it (a CPU's unfused attention holding more)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.cost.build import price_problem
from placement_opt.cost.workload import Workload
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import LayerGraph, chain_graph

KV, ATTN = 1152, 81920  # DeepSeek-V3 per layer, bf16: the cached latent, and the query x key FLOPs per cached token
EXPAND_FLOPS, EXPAND_BYTES, CPU_BYTES = 2 * 512 * 128 * 256, 114688, 262144


def _graph(expands: bool, attn: int = ATTN) -> LayerGraph:
    # the traced FLOPs hold the attention's at the traced length (chain_graph: 1 token): the rest, 10**9, is the same
    layer = {"name": "layer", "kv_bytes_per_token": KV, "flops_per_token": 10**9 + attn, "param_bytes": 10**6,
             "attn_flops_per_token_per_ctx": attn, "workspace_bytes_per_token": 1024,
             "workspace_bytes_per_token_ctx": 0}
    if expands:
        layer.update(latent_expand_flops_per_ctx=EXPAND_FLOPS, latent_expand_bytes_per_ctx=EXPAND_BYTES,
                     latent_expand_cpu_bytes_per_ctx=CPU_BYTES)
    return chain_graph([layer])


def _option(graph: LayerGraph, workload: Workload, execution: str, bandwidth: float = 1e11):
    machine = Machine([Device("cuda:0", 2**40, flops=1e14, bandwidth=bandwidth),
                       Device("cpu", 2**40, flops=1e12, bandwidth=bandwidth)])
    assert graph.meta.seq_len == 1
    _, prices = price_problem(graph, machine, workload, ("resident",), None, False)
    return next(p for p in prices[0] if p.execution == execution == p.storage and p.mode == "resident")


@given(batch=st.integers(1, 16), prompt=st.integers(1, 4096), new=st.integers(1, 512))
def test_each_decode_step_computes_the_expansion_of_every_cached_token(batch: int, prompt: int, new: int) -> None:
    # where compute bounds the step (a device with bandwidth to spare) at one FLOP rate whatever the rows (datasheet
    # figures), the expansion is one more FLOP term per cached token, as the attention's own is
    workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new)
    for device in ("cuda:0", "cpu"):
        expanded = _option(_graph(True), workload, device, bandwidth=1e18).decode_s
        folded = _option(_graph(False, ATTN + EXPAND_FLOPS), workload, device, bandwidth=1e18).decode_s
        assert expanded == pytest.approx(folded, rel=1e-9)
        # prefill is unchanged: the trace counted each prompt token's expansion among its own FLOPs
        assert _option(_graph(True), workload, device).prefill_s == _option(_graph(False), workload, device).prefill_s


@given(batch=st.integers(1, 16), prompt=st.integers(1, 64), new=st.integers(64, 4096))
def test_a_long_decode_holds_the_expanded_cache_on_the_device_that_runs_it(batch: int, prompt: int, new: int) -> None:
    # a short prompt and a long generation: the last step, its cache and expanded keys and values outweigh the prompt
    workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new)
    held = batch * workload.context_len
    for device, per_token in (("cuda:0", EXPAND_BYTES), ("cpu", EXPAND_BYTES + CPU_BYTES)):
        extra = (_option(_graph(True), workload, device).workspace_bytes
                 - _option(_graph(False), workload, device).workspace_bytes)
        assert extra == held * per_token


def test_the_expansion_runs_at_the_rate_of_a_matmul_of_every_cached_token_not_at_a_decode_step_s() -> None:
    # a measured CPU does 10 GFLOP/s at one row and 1 TFLOP/s from 1024 rows: one sequence's step at context 4096
    # expands 4096 rows; priced at the step's one-row rate it would take 100x longer
    curve = ((1, 1e10), (1024, 1e12))
    cpu = Device("cpu", 2**40, flops=1e12, bandwidth=1e18, source="measured", flops_by_tokens=curve)
    workload = Workload(batch_size=1, prompt_len=4095, new_tokens=1)  # one step, at 4096 cached tokens
    prices = [next(p for p in price_problem(g, Machine([cpu]), workload, ("resident",), None, False)[1][0]
                   if p.mode == "resident").decode_s for g in (_graph(True), _graph(False))]
    assert prices[0] - prices[1] == pytest.approx(4096 * EXPAND_FLOPS / 1e12, rel=1e-3)
