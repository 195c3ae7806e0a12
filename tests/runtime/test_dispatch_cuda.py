"""dispatch() on a GPU: streamed weights (CPU -> GPU from pinned memory, disk -> GPU through the
prefetch thread), units split between the CPU and the GPU, KV cache on each layer's device.

Skipped without a CUDA GPU (conftest). GPU kernels differ from the CPU's, so logits are compared
with a float32 tolerance; greedy tokens are compared against the same model run on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from _models import RESIDENT, assert_restored, inputs_for, plan_from, snapshot, tiny
from placement_opt.runtime.dispatcher import dispatch

pytestmark = pytest.mark.cuda

GPU_RESIDENT = ("cuda:0", "cuda:0", "resident")
CPU_STREAM = ("cpu", "cuda:0", "stream")
CPU_STREAM_SYNC = ("cpu", "cuda:0", "stream_sync")
DISK_STREAM = ("disk", "cuda:0", "stream")


def gpu_mixed(i: int, unit: str) -> tuple[str, str, str]:
    return (GPU_RESIDENT, CPU_STREAM, DISK_STREAM, RESIDENT, CPU_STREAM_SYNC)[i % 5]


@pytest.mark.parametrize("family", ["llama", "mixtral", "gpt2", "t5"])
@pytest.mark.parametrize("choose", [gpu_mixed, lambda i, u: CPU_STREAM, lambda i, u: DISK_STREAM],
                         ids=["mixed", "all-cpu-streamed", "all-disk-streamed"])
def test_gpu_plans_match_reference(family, choose, tmp_path):
    model = tiny(family)
    batch = inputs_for(model)
    with torch.no_grad():
        reference = model(**batch).logits
    before = snapshot(model)
    handle = dispatch(model, plan_from(model, choose), offload_dir=tmp_path)
    with torch.no_grad():
        logits = handle(**batch).logits
        again = handle(**batch).logits  # second forward: uses the weights prefetched at the end of the first
    assert logits.device.type == "cpu"  # returned on the caller's device
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, logits, rtol=0, atol=0)
    handle.remove()
    assert_restored(model, before)


def test_streamed_weights_stay_on_cpu_pinned_between_forwards():
    model = tiny("llama")
    handle = dispatch(model, plan_from(model, lambda i, u: CPU_STREAM if "layers" in u else GPU_RESIDENT))
    weight = model.model.layers[1].mlp.up_proj.weight
    assert weight.device.type == "cpu" and weight.is_pinned()
    assert model.lm_head.weight.device.type == "cuda"
    with torch.no_grad():
        handle(**inputs_for(model))
    assert weight.device.type == "cpu"  # released after the forward
    handle.remove()
    assert not model.model.layers[1].mlp.up_proj.weight.is_pinned()


def test_generate_matches_the_model_on_the_gpu(tmp_path):
    model = tiny("llama")
    batch = inputs_for(model)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    gpu_model = tiny("llama").cuda()
    with torch.no_grad():
        expected = gpu_model.generate(**{k: v.cuda() for k, v in batch.items()}, **kwargs).cpu()
    handle = dispatch(model, plan_from(model, lambda i, u: (GPU_RESIDENT, CPU_STREAM, DISK_STREAM)[i % 3]),
                      offload_dir=tmp_path)
    with torch.no_grad():
        tokens = handle.generate(**batch, **kwargs)
    assert torch.equal(tokens.cpu(), expected)
    handle.remove()


def test_kv_cache_lives_where_each_layer_computes():
    model = tiny("llama")
    plan = plan_from(model, lambda i, u: RESIDENT if u in ("model.layers.1", "model.layers.3") else GPU_RESIDENT)
    handle = dispatch(model, plan)
    with torch.no_grad():
        out = handle(**inputs_for(model), use_cache=True)
    devices = [layer.keys.device.type for layer in out.past_key_values.layers]
    assert devices == ["cuda", "cpu", "cuda", "cpu"]
    handle.remove()
