"""load() of checkpoints transformers converts at load time (MoE experts one tensor each): one weight at a time."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import placement_opt.runtime.loader as loader
from _models import MAPPED, MAPPED_SYNC, RESIDENT, inputs_for, mixed, plan_from, tiny
from placement_opt.errors import DispatchError
from placement_opt.runtime.loader import load

FUSED = {"mixtral": ("gate_up_proj", "down_proj"), "qwen2_moe": ("gate_up_proj", "down_proj")}


def test_the_checkpoint_holds_experts_one_tensor_each(saved_moe):
    """What makes these checkpoints special: the model's fused expert weights are not in the file."""
    from safetensors import safe_open

    family, model, path, _ = saved_moe
    with safe_open(path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    fused = [n for n, _ in model.named_parameters() if n.endswith(FUSED[family])]
    assert fused and not keys & set(fused)
    assert any(".experts.0." in k for k in keys)


def test_disk_layers_fused_into_offload_dir_one_unit_each(saved_moe, tmp_path, no_fallback):
    family, model, path, reference = saved_moe
    plan = plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT)
    with pytest.raises(DispatchError, match="offload_dir"):
        load(path, None, plan=plan)
    handle = load(path, None, plan=plan, offload_dir=tmp_path)
    written = sorted(p.name.split(".")[:3] for p in tmp_path.glob("*.safetensors"))
    assert written == [["model", "layers", "0"], ["model", "layers", "1"]]  # the converted weights, per disk unit
    experts = handle.model.model.layers[1].mlp.experts
    original = model.model.layers[1].mlp.experts
    for name in FUSED[family]:
        weight = getattr(experts, name)
        assert torch.equal(weight, getattr(original, name))
        file, key = next((f, k) for unit in handle._units for f, k in unit.disk if k.endswith(f"1.mlp.experts.{name}"))
        assert weight.data_ptr() == file._mapped().ctypes.data + file.spans[key].offset_bytes  # a view of the file
    with torch.no_grad():
        torch.testing.assert_close(handle(**inputs_for(model)).logits, reference, rtol=1e-6, atol=1e-6)
    handle.remove()


def test_mixed_plan_generates_the_same_tokens(saved_moe, tmp_path, no_fallback):
    _, model, path, reference = saved_moe
    handle = load(path, None, plan=plan_from(model, mixed), offload_dir=tmp_path)
    batch = inputs_for(model)
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        torch.testing.assert_close(handle(**batch).logits, reference, rtol=1e-6, atol=1e-6)
        assert torch.equal(handle.generate(**batch, **kwargs), model.generate(**batch, **kwargs))
    handle.remove()


def test_cast_to_another_dtype_while_converting(saved_moe, tmp_path, no_fallback):
    family, model, path, _ = saved_moe
    handle = load(path, None, plan=plan_from(model, mixed), dtype="bfloat16", offload_dir=tmp_path)
    for layer, original in zip(handle.model.model.layers, model.model.layers, strict=True):
        for name in FUSED[family]:
            weight = getattr(layer.mlp.experts, name)
            assert weight.dtype == torch.bfloat16
            assert torch.equal(weight, getattr(original.mlp.experts, name).to(torch.bfloat16))
    handle.remove()


def test_falls_back_to_from_pretrained_when_the_mapping_cannot_be_read(saved_moe, tmp_path, monkeypatch):
    """A transformers whose conversion internals changed: the whole-RAM path, still the same logits."""
    _, model, path, reference = saved_moe
    monkeypatch.setattr(loader, "conversions", lambda *args: None)
    handle = load(path, None, plan=plan_from(model, mixed), offload_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(handle(**inputs_for(model)).logits, reference, rtol=1e-6, atol=1e-6)
    handle.remove()


@pytest.mark.cuda
def test_fused_weights_go_straight_to_the_gpu(saved_moe, tmp_path, no_fallback):
    """GPU-stored layers: each fused weight is built on the CPU and moved, the logits as the CPU model's."""
    family, model, path, reference = saved_moe
    gpu = ("cuda:0", "cuda:0", "resident")
    plan = plan_from(model, lambda i, u: MAPPED if u.endswith("layers.1") else gpu)  # layer 0 on the GPU
    handle = load(path, None, plan=plan, offload_dir=tmp_path)
    layers = handle.model.model.layers
    assert all(getattr(layers[0].mlp.experts, name).device.type == "cuda" for name in FUSED[family])
    assert all(getattr(layers[1].mlp.experts, name).device.type == "cpu" for name in FUSED[family])
    with torch.no_grad():
        torch.testing.assert_close(handle(**inputs_for(model)).logits.cpu(), reference, rtol=1e-4, atol=1e-4)
    handle.remove()


def test_a_missing_expert_tensor_is_refused_by_name(tmp_path, no_fallback):
    """An expert dropped from the checkpoint: the fused weight would be short of it; load() says which."""
    from safetensors.torch import load_file, save_file

    model = tiny("mixtral")
    model.save_pretrained(tmp_path / "ckpt")
    weights = load_file(tmp_path / "ckpt" / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w1.weight"]
    save_file(weights, tmp_path / "ckpt" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DispatchError, match=r"layers\.1\.mlp\.experts\.gate_up_proj, fused from 7 checkpoint tensors"):
        load(tmp_path / "ckpt", None, plan=plan_from(model, mixed), offload_dir=tmp_path / "offload")


def test_a_checkpoint_of_another_configuration_is_refused_before_it_is_used(tmp_path):
    """A tensor of another shape (here: a wider MLP than config.json says) never reaches the model."""
    import json

    model = tiny("llama")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(DispatchError, match=r"'model.layers.0.mlp.gate_proj.weight'.*shape \[64, 32\].*\[48, 32\]"):
        load(tmp_path, None, plan=plan_from(model, lambda i, u: RESIDENT))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(family=st.sampled_from(sorted(FUSED)), experts=st.integers(2, 5), layers=st.integers(1, 3),
       rows=st.lists(st.sampled_from([RESIDENT, MAPPED, MAPPED_SYNC]), min_size=8, max_size=8),
       shards=st.booleans())
def test_every_weight_round_trips_through_a_converted_load(family, experts, layers, rows, shards):
    """Any expert count, layer count and plan, one shard or many (experts of a layer split across files): every
    weight load() puts in the model equals the saved model's, bit for bit, wherever the plan stores it."""
    import tempfile
    from pathlib import Path
    from unittest import mock

    import transformers as T

    shape = dict(vocab_size=64, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                 num_experts_per_tok=2, max_position_embeddings=32)
    torch.manual_seed(experts * 10 + layers)
    if family == "mixtral":
        model = T.MixtralForCausalLM(T.MixtralConfig(**shape, intermediate_size=24, num_local_experts=experts))
    else:
        model = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**shape, intermediate_size=24, moe_intermediate_size=8,
                                                       shared_expert_intermediate_size=16, num_experts=experts,
                                                       decoder_sparse_step=1))
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(loader, "_load_converted", side_effect=AssertionError):
        model.save_pretrained(Path(tmp, "ckpt"), max_shard_size="8KB" if shards else "1GB")
        assert (len(list(Path(tmp, "ckpt").glob("*.safetensors"))) > 1) == shards
        handle = load(Path(tmp, "ckpt"), None, plan=plan_from(model, lambda i, u: rows[i % len(rows)]),
                      offload_dir=Path(tmp, "offload"))
        expected = model.state_dict()
        loaded = handle.model.state_dict()
        assert loaded.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), name
        handle.remove()
