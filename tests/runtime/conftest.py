"""Fixtures of the runtime tests."""

from __future__ import annotations

import pytest
import torch

from placement_opt.runtime import _preflight, _streamer


@pytest.fixture
def gpu_on_cpu(monkeypatch):
    """"cuda:N" computes on the CPU inside the runtime, and preflight counts one CUDA device: the real code
    paths of GPU placements (streams, phases, home devices) run end to end on a machine without a GPU."""
    monkeypatch.setattr(_streamer, "torch_device", lambda name: torch.device("cpu" if name.startswith("cuda") else name))
    monkeypatch.setattr(_preflight, "cuda_device_count", lambda: 1)
