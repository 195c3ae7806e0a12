"""trace() properties over random plain models (hypothesis), and the CUDA case (weights on a GPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from placement_opt.model.graph import LayerGraph
from placement_opt.model.tracer import trace

_widths = st.lists(st.integers(min_value=1, max_value=48), min_size=2, max_size=6)


def _mlp(widths: list[int], bias: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b, bias=bias), nn.ReLU()]
    return nn.Sequential(*layers)


@settings(max_examples=40)
@given(widths=_widths, bias=st.booleans(), batch=st.integers(1, 4), seq=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_random_mlp_graph_is_exact(widths: list[int], bias: bool, batch: int, seq: int, dtype: torch.dtype) -> None:
    model = _mlp(widths, bias).to(dtype)
    graph = trace(model, batch_size=batch, seq_len=seq)
    size = torch.empty((), dtype=dtype).element_size()
    pairs = list(zip(widths, widths[1:], strict=False))
    assert graph.meta.traced and graph.is_chain()
    assert graph.names() == [str(2 * i) for i in range(len(pairs))]
    for unit, (a, b) in zip(graph.units(), pairs, strict=True):
        assert unit.param_bytes == (a * b + (b if bias else 0)) * size
        assert unit.flops_per_token == 2 * a * b  # per token, whatever the batch and length
        assert unit.out_bytes_per_token == b * size
    assert [bpt for _, _, bpt in graph.edges()] == [b * size for _, b in pairs[:-1]]
    assert LayerGraph.from_json(graph.to_json()).to_dict() == graph.to_dict()


@settings(max_examples=10)
@given(batch=st.integers(1, 3), seq=st.integers(1, 12))
def test_transformer_bytes_do_not_depend_on_the_traced_shape(batch: int, seq: int) -> None:
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    graph = trace(config, batch_size=batch, seq_len=seq, dtype="float32")
    layer = graph.unit("model.layers.0")
    assert layer.param_bytes == 4 * (16 * 16 * 2 + 16 * 8 * 2 + 3 * 16 * 32 + 2 * 16)
    assert layer.kv_bytes_per_token == 2 * 1 * 8 * 4
    # the attention term is the only part of the FLOPs that grows with the context
    assert layer.flops_per_token - layer.attn_flops_per_token_per_ctx * seq == 2 * (
        16 * 16 * 2 + 16 * 8 * 2 + 3 * 16 * 32)


@pytest.mark.cuda
def test_weights_on_gpu_are_not_copied() -> None:
    model = _mlp([1024, 4096, 1024], True).cuda()
    pointers = [p.data_ptr() for p in model.parameters()]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    graph = trace(model, seq_len=16)
    assert torch.cuda.max_memory_allocated() == before  # nothing allocated on the GPU
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert graph.total_param_bytes == sum(p.numel() for p in model.parameters()) * 4
