"""dispatch() with a plain accelerate device_map: accelerate's run-time semantics, outputs equal to the model's."""

from __future__ import annotations

import pytest
import torch

from _models import assert_restored, inputs_for, snapshot, tiny
from placement_opt import dispatch
from placement_opt.errors import DispatchError

LAYERS = [f"model.layers.{i}" for i in range(4)]


@pytest.fixture(scope="module")
def llama():
    model = tiny("llama")
    with torch.no_grad():
        reference = model(**inputs_for(model)).logits
    return model, reference


MAPS = {
    "whole model": {"": "cpu"},
    "whole model on disk": {"": "disk"},
    "prefix entry": {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu", "lm_head": "cpu"},
    "layers on disk by prefix": {"model.embed_tokens": "cpu", "model.layers": "disk", "model.norm": "cpu",
                                 "lm_head": "disk"},
    # no model.rotary_emb (buffers only), as accelerate's own maps often leave it out
    "per layer, no rotary_emb": {"model.embed_tokens": "disk", **{k: ("cpu", "disk")[i % 2] for i, k in enumerate(LAYERS)},
                                 "model.norm": "cpu", "lm_head": "cpu"},
    "finer than units": {"": "cpu", "model.layers.1.self_attn": "disk", "model.layers.1.mlp": "disk"},
}


@pytest.mark.parametrize("device_map", MAPS.values(), ids=MAPS.keys())
def test_a_device_map_runs_like_the_model(llama, tmp_path, device_map):
    model, reference = llama
    before = snapshot(model)
    handle = dispatch(model, device_map, offload_dir=tmp_path)
    try:
        with torch.no_grad():
            assert torch.equal(handle(**inputs_for(model)).logits, reference)
        stored = {p.unit: p.storage for p in handle.plan.placements}
        for key, device in device_map.items():
            if key in stored:
                assert stored[key] == device
        # a map without a GPU computes everything on the CPU (disk entries from a memory map)
        assert {p.execution for p in handle.plan.placements} == {"cpu"}
        assert handle.plan.strategy == "device_map"
    finally:
        handle.remove()
    assert_restored(model, before)


def test_storage_follows_the_map_and_rotary_emb_its_neighbour(llama, tmp_path):
    model, _ = llama
    handle = dispatch(model, MAPS["per layer, no rotary_emb"], offload_dir=tmp_path)
    try:
        kinds = handle.unit_kinds()
        assert kinds["model.embed_tokens"] == "mmap" and kinds["model.layers.1"] == "mmap"
        assert kinds["model.layers.0"] == "resident" and kinds["lm_head"] == "resident"
        assert handle.plan.placement("model.rotary_emb").storage == "disk"  # with embed_tokens, before it
        assert model.hf_device_map["model.layers.1"] == "disk"
    finally:
        handle.remove()


def test_a_map_that_splits_decoder_layers_runs_on_sublayer_units_as_it_says(llama, tmp_path):
    model, _ = llama
    handle = dispatch(model, MAPS["finer than units"], offload_dir=tmp_path)
    try:
        stored = {p.unit: p.storage for p in handle.plan.placements}
        assert stored["model.layers.1.self_attn"] == stored["model.layers.1.mlp"] == "disk"
        assert stored["model.layers.1.input_layernorm"] == stored["model.layers.0.self_attn"] == "cpu"
    finally:
        handle.remove()


def test_a_sublayer_plans_map_keeps_its_experts_on_disk(tmp_path):
    """The map solve(granularity="sublayer") writes: most of each layer's bytes (the experts) on disk, its
    many small tensors in RAM. A vote per layer by tensor count kept every layer in RAM."""
    model = tiny("mixtral")
    with torch.no_grad():
        reference = model(**inputs_for(model)).logits
    device_map = {"": "cpu", **{f"model.layers.{i}.mlp.experts": "disk" for i in range(2)}}
    handle = dispatch(model, device_map, offload_dir=tmp_path)
    try:
        stored = {p.unit: p.storage for p in handle.plan.placements}
        assert {stored[f"model.layers.{i}.mlp.experts"] for i in range(2)} == {"disk"}
        assert stored["model.layers.0.self_attn"] == "cpu"
        with torch.no_grad():
            assert torch.equal(handle(**inputs_for(model)).logits, reference)
    finally:
        handle.remove()


def test_a_unit_split_finer_than_any_unit_goes_where_most_of_its_parameters_are_with_a_warning(llama, tmp_path):
    model, _ = llama
    device_map = {"": "cpu", **{f"model.layers.1.self_attn.{p}_proj": "disk" for p in "qkv"}}
    with pytest.warns(UserWarning, match=r"parts of 1 unit\(s\) \(model.layers.1.self_attn\)"):
        handle = dispatch(model, device_map, offload_dir=tmp_path)
    try:  # 3 of the attention's 4 tensors are under the disk keys
        assert handle.plan.placement("model.layers.1.self_attn").storage == "disk"
        assert handle.plan.placement("model.layers.0.self_attn").storage == "cpu"
    finally:
        handle.remove()


@pytest.mark.parametrize(("device_map", "message"), [
    ({"model.layerz": "cpu", "": "cpu"}, r"device_map keys 'model.layerz' name no module of LlamaForCausalLM"),
    ({"": "tpu"}, r"device_map entry '' -> 'tpu' is not a device"),
    ({"model.layers": "cpu"}, r"places no entry for units model.embed_tokens, model.norm, lm_head"),
    ({}, r"the device_map is empty"),
    ({"": 7}, r"the device_map uses cuda:7 but this machine has \d+ CUDA device"),
    ({"model": "cpu", "lm_head": "disk"}, r"stored on disk but dispatch\(\) has no offload_dir"),
    ({0: "cpu"}, r"device_map key 0 is not a module name"),
])
def test_a_bad_map_is_one_clear_dispatch_error(llama, device_map, message):
    model, reference = llama
    before = snapshot(model)
    with pytest.raises(DispatchError, match=message):
        dispatch(model, device_map)
    assert_restored(model, before)


def test_neither_a_plan_nor_a_map_is_refused(llama):
    model, _ = llama
    with pytest.raises(DispatchError, match="takes a Plan or a device_map dict, not list"):
        dispatch(model, ["cpu"])


@pytest.mark.cuda
def test_cpu_and_disk_entries_execute_on_the_first_gpu(llama, tmp_path):  # pragma: no cover - needs a GPU
    model, reference = llama
    device_map = {"model.embed_tokens": "cpu", "model.layers": 0, "model.norm": 0, "lm_head": "disk"}
    handle = dispatch(model, device_map, offload_dir=tmp_path)
    try:
        assert {p.execution for p in handle.plan.placements} == {"cuda:0"}
        assert handle.unit_kinds()["model.embed_tokens"] == "stream"
        with torch.no_grad():
            logits = handle(**inputs_for(model)).logits
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    finally:
        handle.remove()
