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
from placement_opt.runtime.timing import cache_of

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
    devices = [layer.keys.device.type for layer in cache_of(out).layers]
    assert devices == ["cuda", "cpu", "cuda", "cpu"]
    handle.remove()


# ---------------------------------------------------------------------------------------------
# Phased units: the prefill streamed to the GPU, the decode on the CPU where the weights are stored
# ---------------------------------------------------------------------------------------------
PHASED_CPU = ("cpu", "cpu", "phased", "cuda:0")
PHASED_DISK = ("disk", "cpu", "phased", "cuda:0")


def phased_plan(model, choose):
    """``choose(i, unit)`` -> (storage, execution, mode[, prefill_execution]); tied units follow the first."""
    import dataclasses

    from _models import tied_groups, units_of
    from placement_opt.plan import UnitPlacement

    units = units_of(model)
    rows = {u: choose(i, u) for i, u in enumerate(units)}
    for group in tied_groups(model, units):
        for u in group:
            rows[u] = rows[min(group, key=units.index)]
    placements = tuple(UnitPlacement(unit=u, storage=r[0], execution=r[1], mode=r[2],
                                     prefill_execution=r[3] if len(r) > 3 else None) for u, r in rows.items())
    return dataclasses.replace(plan_from(model, lambda i, u: RESIDENT), placements=placements)


def record_weight_devices(model, names):
    """Per unit, the device its first 2-d weight computes from at each call (a forward pre-hook)."""
    seen, hooks = {name: [] for name in names}, []
    for name in names:
        leaf = next(m for m in model.get_submodule(name).modules()
                    if m._parameters.get("weight") is not None and m.weight.dim() == 2)
        hooks.append(leaf.register_forward_pre_hook(
            lambda module, args, _name=name: seen[_name].append(module.weight.device.type)))
    return seen, hooks


@pytest.mark.parametrize("family", ["llama", "mixtral"])
@pytest.mark.parametrize("phased", [PHASED_CPU, PHASED_DISK], ids=["cpu", "disk"])
def test_phased_generate_matches_the_plain_model(family, phased, tmp_path):
    model = tiny(family)
    batch = inputs_for(model)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "output_logits": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        expected = model.generate(**batch, **kwargs)
    before = snapshot(model)
    layers = {"model.layers.0": phased, "model.layers.1": CPU_STREAM, "model.layers.2": phased}
    plan = phased_plan(model, lambda i, u: layers.get(u, GPU_RESIDENT))
    handle = dispatch(model, plan, offload_dir=tmp_path)
    phased_units = [u for u in layers if layers[u] is phased and u in handle.unit_kinds()]
    seen, hooks = record_weight_devices(model, phased_units)
    with torch.no_grad():
        out = handle.generate(**batch, **kwargs)
    for hook in hooks:
        hook.remove()
    assert torch.equal(out.sequences.cpu(), expected.sequences)
    for got, want in zip(out.logits, expected.logits, strict=True):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    for name in phased_units:  # prefill from the GPU copy, every decode step from the CPU's weights
        assert seen[name] == ["cuda"] + ["cpu"] * 5, name
        assert cache_of(out).layers[int(name.split(".")[-1])].keys.device.type == "cpu"
    assert cache_of(out).layers[1].keys.device.type == "cuda"  # the streamed layer's cache stays on the GPU
    handle.remove()
    assert_restored(model, before)


def test_phased_weights_leave_the_gpu_after_the_prefill(tmp_path):
    model = tiny("llama")
    # even layers in RAM, odd ones on disk: by the layer's number, not the unit's index (the embedding comes first)
    plan = phased_plan(model, lambda i, u: (PHASED_CPU, PHASED_DISK)[int(u.split(".")[2]) % 2] if "layers." in u
                       else GPU_RESIDENT)
    handle = dispatch(model, plan, offload_dir=tmp_path)
    layer = model.model.layers[0]
    assert layer.mlp.up_proj.weight.device.type == "cpu" and layer.mlp.up_proj.weight.is_pinned()
    layer_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    with torch.no_grad():
        handle(**inputs_for(model), use_cache=False)  # warm up: cuBLAS workspace and the allocator's pools
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        out = handle(**inputs_for(model), use_cache=True)
        torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - baseline
    assert held < layer_bytes, f"{held} bytes still on the GPU after the prefill (a layer is {layer_bytes})"
    assert {layer.keys.device.type for layer in cache_of(out).layers} == {"cpu"}
    assert layer.mlp.up_proj.weight.device.type == "cpu"
    handle.remove()
    assert not model.model.layers[0].mlp.up_proj.weight.is_pinned()


def test_streamed_weights_of_two_layers_at_most_while_the_gpu_lags_behind_the_host():
    """Each layer keeps the GPU busy for milliseconds while the host queues the next ones: a copy started ahead waits
    for the layers before to have run on the GPU, so the streamed weights of the running layer and the next one are
    allocated, not every layer's the host has queued (benchmarks/phases/GPU.md: a Mixtral plan held three expert
    blocks where the plan counted two)."""
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = T.LlamaForCausalLM(config).eval()
    layer_bytes = sum(p.nbytes for p in model.model.layers[0].parameters())
    handle = dispatch(model, plan_from(model, lambda i, u: CPU_STREAM if ".layers." in u else GPU_RESIDENT))
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: torch.cuda._sleep(20_000_000))  # ~10 ms of GPU
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        handle(input_ids=ids)  # the allocator's blocks, and the copies the next forward starts with
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        handle(input_ids=ids)
        torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - before
    handle.remove()
    assert grown <= 3 * layer_bytes + (2 << 20), grown / layer_bytes


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_large_outputs_leaving_the_gpu_for_cpu_layers_arrive_intact(family, monkeypatch):
    """A GPU unit's hidden states bound for a CPU-computed layer leave through pinned staging once they reach
    ``SMALL_BYTES`` (``hardware.host_copy``); the tiny models' usual batches never do. The lent H200's Mixtral
    layer plan (embedding on the GPU, every layer on the CPU) gave other greedy tokens than accelerate's in one run
    (benchmarks/phases/GPU.md): this says whether staged hand-offs are where a fault is. Each staged copy must equal
    a plain ``.to("cpu")`` of the same tensor bit for bit; the dense model's logits must match the plain model's
    (the MoE's may not: 10,240 tokens' top-2 routing can flip on a near-tie between the GPU's rounding and the CPU's)."""
    import placement_opt.runtime._hooks as hooks
    from placement_opt.hardware.host_copy import SMALL_BYTES, to_host

    model = tiny(family)
    ids = torch.randint(3, 128, (160, 64), generator=torch.Generator().manual_seed(3))  # 1.25 MiB of float32 states
    assert ids.numel() * model.config.hidden_size * 4 >= SMALL_BYTES
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    staged = []

    def spied(tensor: torch.Tensor) -> torch.Tensor:
        out = to_host(tensor)
        staged.append((tensor.numel() * tensor.element_size(), torch.equal(out, tensor.to("cpu"))))
        return out

    monkeypatch.setattr(hooks, "to_host", spied)
    handle = dispatch(model, plan_from(model, lambda i, u: RESIDENT if "layers" in u and i % 2 else GPU_RESIDENT))
    with torch.no_grad():
        logits = handle(input_ids=ids).logits
    handle.remove()
    assert max(size for size, _ in staged) >= SMALL_BYTES  # the hand-off went through the staging path
    assert all(exact for _, exact in staged), staged
    if family == "llama":
        torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
