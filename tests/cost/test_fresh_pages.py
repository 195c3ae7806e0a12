"""A CPU decode step's cache growth faults in new pages once its keys or values pass glibc's mmap threshold: priced
from the profile's measured rate, on the CPU only, and only for the steps whose cache is that large."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.cost.build import price_problem
from placement_opt.cost.kernels import contexts_at_least
from placement_opt.cost.workload import Workload
from placement_opt.errors import DeviceSpecError
from placement_opt.hardware.devices import FRESH_PAGE_MIN_BYTES, Device, Machine
from placement_opt.model.graph import LayerGraph, chain_graph

KV = 131072  # a layer's keys and values per cached token, per sequence (Llama-3-8B in bf16)
RATE = 4e9  # fresh pages per second: this project's 2-core VM measures 3.4-4 GB/s


@given(ctx0=st.integers(1, 3000), steps=st.integers(0, 2000), floor=st.integers(1, 6000),
       window=st.none() | st.integers(1, 5000))
def test_contexts_at_least_is_the_sum_over_the_steps(ctx0: int, steps: int, floor: int, window: int | None) -> None:
    cached = [ctx0 + t if window is None else min(ctx0 + t, window) for t in range(steps)]
    assert contexts_at_least(ctx0, steps, window, floor) == sum(c for c in cached if c >= floor)


def _graph(window: int | None = None) -> LayerGraph:
    layer = {"name": "layer", "kv_bytes_per_token": KV, "flops_per_token": 10**8, "param_bytes": 10**6,
             "attn_flops_per_token_per_ctx": 1024, "workspace_bytes_per_token": 1024,
             "workspace_bytes_per_token_ctx": 0}
    if window is not None:
        layer["kv_window_tokens"] = window
    return chain_graph([layer])


def _decode_s(workload: Workload, execution: str, fresh_page: float | None, window: int | None = None) -> float:
    machine = Machine([Device("cuda:0", 2**40, flops=1e14, bandwidth=1e12, source="measured"),
                       Device("cpu", 2**40, flops=1e12, bandwidth=1e11, source="measured", fresh_page=fresh_page)])
    _, prices = price_problem(_graph(window), machine, workload, ("resident",), None, False)
    return next(p for p in prices[0] if p.execution == execution == p.storage).decode_s


@given(batch=st.integers(1, 32), prompt=st.integers(1, 8192), new=st.integers(2, 2048),
       window=st.none() | st.integers(256, 8192))
def test_each_step_whose_keys_pass_the_threshold_pays_their_pages(batch: int, prompt: int, new: int,
                                                                   window: int | None) -> None:
    workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new)
    extra = _decode_s(workload, "cpu", RATE, window) - _decode_s(workload, "cpu", None, window)
    # brute force over the steps: step t's cat allocates keys and values of batch x (prompt + 1 + t) tokens each
    expected = 0.0
    for t in range(workload.decode_steps):
        tokens = prompt + 1 + t if window is None else min(prompt + 1 + t, window)
        per_tensor = batch * tokens * KV / 2
        expected += 2 * per_tensor / RATE if per_tensor >= FRESH_PAGE_MIN_BYTES else 0.0
    assert extra == pytest.approx(expected, rel=1e-6, abs=2e-9)


def test_a_gpu_and_an_unmeasured_cpu_pay_nothing() -> None:
    # batch 16 x 4096: a layer's keys are 4 GiB, far past the threshold
    workload = Workload(batch_size=16, prompt_len=4096, new_tokens=64)
    assert _decode_s(workload, "cuda:0", RATE) == _decode_s(workload, "cuda:0", None)
    assert _decode_s(workload, "cpu", RATE) > _decode_s(workload, "cpu", None) + 63 * 2 * 16 * 4097 * KV / 2 / RATE * 0.99


def test_the_figure_travels_with_the_device() -> None:
    cpu = Device("cpu", "64GiB", fresh_page=3.5e9)
    assert Device.from_dict(cpu.to_dict()) == cpu
    assert Device.from_dict(Device("cpu", "64GiB").to_dict()).fresh_page_bytes_per_s is None
    with pytest.raises(DeviceSpecError, match="fresh_page of cpu is 0"):
        Device("cpu", "64GiB", fresh_page=0)
