"""accelerate's offloaded units on a GPU: its hooks hold one module's own parameters at a time, as priced.

A device_map that puts the decoder layers on ``"cpu"`` runs them on the GPU through accelerate's hooks, which copy
each module's own parameters in before its forward and drop them after it. The predicted cuda:0 peak above the
resident weights (``cost.memory.accelerate_held_bytes``: one MLP projection of 32 MiB, where a whole layer is
112 MiB) is checked against ``torch.cuda.max_memory_allocated`` in a forward. Not yet run on a GPU (2026-11-30).
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

from placement_opt.cost.evaluate import predicted_memory
from placement_opt.cost.memory import CUBLAS_WORKSPACE_BYTES
from placement_opt.cost.workload import Workload
from placement_opt.model.tracer import trace

WORKLOAD = Workload(batch_size=1, prompt_len=8, new_tokens=0)


def _model() -> torch.nn.Module:
    config = T.LlamaConfig(hidden_size=1024, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=8, vocab_size=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _layers_offloaded(names: list[str]) -> dict[str, object]:
    return {n: "cpu" if ".layers." in n else 0 for n in names}


def predicted_extra(model: torch.nn.Module) -> int:
    """cuda:0's predicted peak less its resident weights and cuBLAS's workspace (taken before the measurement)."""
    graph = trace(model, dtype="float32")
    device_map = _layers_offloaded(graph.names())
    gpu = predicted_memory(device_map, graph, {"cuda:0": "80GB", "cpu": "64GB"}, WORKLOAD)["cuda:0"]
    return gpu.used_bytes - gpu.weights_bytes - CUBLAS_WORKSPACE_BYTES


def test_the_prediction_holds_one_projection_not_the_layer() -> None:
    """On any machine: the predicted extra is about one 32 MiB projection, well under a 112 MiB layer."""
    with torch.device("meta"):
        model = _model()
    extra = predicted_extra(model)
    assert 32 * 2**20 <= extra < 40 * 2**20


@pytest.mark.cuda
def test_accelerates_hooks_hold_one_modules_parameters_on_the_gpu() -> None:  # pragma: no cover - needs a GPU
    from accelerate import dispatch_model

    model = _model()
    expected = predicted_extra(model)
    dispatch_model(model, device_map=_layers_offloaded(trace(model, dtype="float32").names()))
    ids = torch.randint(0, 1024, (1, WORKLOAD.prompt_len), device="cuda")
    with torch.no_grad():  # cuBLAS takes its workspace at the first matmul: before the measurement
        model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    assert measured <= expected <= 1.15 * measured, (expected / 2**20, measured / 2**20)
