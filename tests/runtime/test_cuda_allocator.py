"""The CUDA allocator's expandable segments: what the environment says, who sets it, and the warning a tight GPU
plan gets without them."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _models import RESIDENT, plan_from, tiny
from placement_opt.cli import main as cli_main
from placement_opt.cost.memory import DeviceMemory
from placement_opt.runtime import cuda_allocator
from placement_opt.runtime._dispatch_warnings import warn_gpu_segments

_OTHER = st.sampled_from(["max_split_size_mb:128", "garbage_collection_threshold:0.6", "roundup_power2_divisions:4",
                          "pinned_use_cuda_host_register:True"])


@given(before=st.lists(_OTHER, max_size=2), after=st.lists(_OTHER, max_size=2),
       value=st.sampled_from(["True", "true", " True", "False", "false", "1"]),
       variable=st.sampled_from(["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"]))
def test_expandable_segments_are_read_from_either_variable_among_other_settings(before, after, value, variable):
    settings = ",".join([*before, f"expandable_segments:{value}", *after])
    assert cuda_allocator.expandable_segments({variable: settings}) == (value.strip().lower() == "true")
    assert cuda_allocator.allocator_settings({variable: settings}) == settings


def test_the_newer_variable_wins_and_none_set_means_off():
    both = {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert not cuda_allocator.expandable_segments(both)
    assert not cuda_allocator.expandable_segments({})
    assert cuda_allocator.allocator_settings({"PYTORCH_CUDA_ALLOC_CONF": ""}) is None


def test_use_expandable_segments_sets_them_only_where_the_environment_is_silent():
    env: dict[str, str] = {}
    assert cuda_allocator.use_expandable_segments(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert not cuda_allocator.use_expandable_segments(mine)
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}  # the user's choice stands
    newer = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert cuda_allocator.use_expandable_segments(newer)
    assert newer == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}


def test_use_expandable_segments_leaves_a_process_whose_cuda_is_initialised(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    env: dict[str, str] = {}
    assert not cuda_allocator.use_expandable_segments(env)
    assert env == {}


def test_the_command_sets_them_for_its_own_process(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    monkeypatch.setattr(os, "environ", env)
    with pytest.raises(SystemExit) as exit_:
        cli_main.main(["--version"])
    assert exit_.value.code == 0
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def _with_gpu_row(plan, free_bytes: int, transient_bytes: int):
    capacity = 10 << 30
    gpu = DeviceMemory(device="cuda:0", capacity_bytes=capacity, reserve_bytes=0,
                       weights_bytes=capacity - free_bytes - transient_bytes, kv_cache_bytes=0,
                       workspace_bytes=transient_bytes // 4, stream_buffer_bytes=transient_bytes - transient_bytes // 4)
    return dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, memory=(gpu,)))


def _said(plan) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_gpu_segments(plan)
    return [str(w.message) for w in caught]


def test_a_gpu_plan_with_less_free_memory_than_its_transients_names_expandable_segments(monkeypatch):
    plan = plan_from(tiny("llama"), lambda i, u: RESIDENT)
    mib = 1 << 20
    monkeypatch.setattr(os, "environ", {})
    said = _said(_with_gpu_row(plan, free_bytes=100 * mib, transient_bytes=400 * mib))
    assert len(said) == 1
    assert "cuda:0: 100.00 MiB of 10.00 GiB free, 400.00 MiB allocated and freed" in said[0]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in said[0]
    assert not _said(_with_gpu_row(plan, free_bytes=400 * mib, transient_bytes=400 * mib))
    monkeypatch.setattr(os, "environ", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert not _said(_with_gpu_row(plan, free_bytes=100 * mib, transient_bytes=400 * mib))


@pytest.mark.cuda
def test_the_allocator_honours_the_setting_made_before_the_process_first_uses_cuda():
    """A fresh process that calls use_expandable_segments() after importing torch, before any CUDA work: its
    segments are expandable (torch reads the variable when its allocator starts, not when torch is imported)."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from placement_opt.runtime.cuda_allocator import use_expandable_segments\n"
            "assert use_expandable_segments()\n"
            "x = torch.empty(64 << 20, dtype=torch.uint8, device='cuda')\n"
            "print(all(s.get('is_expandable', False) for s in torch.cuda.memory_snapshot()))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", out.stdout + out.stderr
