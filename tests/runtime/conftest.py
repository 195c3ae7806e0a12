"""Fixtures of the runtime tests."""

from __future__ import annotations

import pytest
import torch

import placement_opt.runtime.loader as loader
from _models import saved_tiny
from placement_opt.runtime import _preflight, _streamer


@pytest.fixture
def gpu_on_cpu(monkeypatch):
    """"cuda:N" computes on the CPU inside the runtime, and preflight counts one CUDA device: the real code
    paths of GPU placements (streams, phases, home devices) run end to end on a machine without a GPU."""
    monkeypatch.setattr(_streamer, "torch_device", lambda name: torch.device("cpu" if name.startswith("cuda") else name))
    monkeypatch.setattr(_preflight, "cuda_device_count", lambda: 1)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def saved_moe(request, tmp_path_factory):
    """(family, model, checkpoint folder, logits) of a tiny MoE model saved by ``save_pretrained``: one tensor per
    expert in the file, which transformers fuses at load."""
    return request.param, *saved_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture
def no_fallback(monkeypatch):
    """Fail if load() reads the checkpoint whole through from_pretrained instead of converting weight by weight."""
    def refuse(*args, **kwargs):
        raise AssertionError("load() fell back to from_pretrained")
    monkeypatch.setattr(loader, "_load_converted", refuse)
