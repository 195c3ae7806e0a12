"""dispatch(): the dispatched model gives the plain model's outputs, and remove() undoes it exactly.

Tiny random-init models (sizes in comments). Plans are built by hand over the units a tracer
would find (instances of ``_no_split_modules`` and the modules outside them that hold weights).
This machine has no GPU: CPU plans mix RAM-resident units, disk units computed from memory maps
and disk units streamed into RAM by the prefetch thread; GPU streaming is in the cuda tests.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _models import (
    FAMILIES,
    MAPPED,
    MAPPED_SYNC,
    RESIDENT,
    assert_restored,
    inputs_for,
    make_plan,
    mixed,
    plan_from,
    snapshot,
    tiny,
    units_of,
)
from placement_opt.cost.memory import DeviceMemory
from placement_opt.errors import DispatchError
from placement_opt.model.graph import covering_key
from placement_opt.runtime import allocator
from placement_opt.runtime._hooks import _move, _move_output
from placement_opt.runtime.dispatcher import DispatchedModel, dispatch
from placement_opt.runtime.timing import cache_argument, cache_of
from placement_opt.units import format_bytes


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    model = tiny(request.param)
    with torch.no_grad():
        reference = model(**inputs_for(model)).logits
    return request.param, model, reference


# ---------------------------------------------------------------------------------------------
# Units and plans
# ---------------------------------------------------------------------------------------------
def test_units_of_tiny_llama():
    units = units_of(tiny("llama"))
    assert units == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
                     "model.layers.3", "model.norm", "model.rotary_emb", "lm_head"]


def test_a_tensors_unit_is_the_longest_covering_unit_name():
    units = {"", "model.layers.1", "model.layers.10"}
    assert covering_key("model.layers.10.mlp.w", units) == "model.layers.10"
    assert covering_key("model.layers.1.mlp.w", units) == "model.layers.1"
    assert covering_key("lm_head.weight", units) == ""
    assert covering_key("lm_head.weight", {"model"}) is None


# ---------------------------------------------------------------------------------------------
# Equality with the plain model
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("disk_reads", ["mmap", "copy"])
def test_mixed_plan_logits_equal_and_remove_restores(family_model, tmp_path, disk_reads):
    family, model, reference = family_model
    before = snapshot(model)
    plan = plan_from(model, mixed)
    handle = dispatch(model, plan, offload_dir=tmp_path, disk_reads=disk_reads)
    try:
        with torch.no_grad():
            logits = handle(**inputs_for(model)).logits
        torch.testing.assert_close(logits, reference, rtol=1e-6, atol=1e-6)
        assert model.hf_device_map == plan.device_map
        kinds = handle.unit_kinds()
        assert "resident" in kinds.values()
        assert ("mmap" if disk_reads == "mmap" else "stream") in kinds.values()
    finally:
        handle.remove()
    assert_restored(model, before)


@pytest.mark.parametrize("row", [MAPPED, MAPPED_SYNC, ("disk", "cpu", "resident")])
def test_remove_gives_a_transposed_weight_back_transposed(tmp_path, row):
    """The offload files hold contiguous tensors: a weight stored transposed (as a tied or converted weight may
    be) came back from the disk contiguous, equal but laid out otherwise, so the model's reductions over it ran
    in another order after remove() (logits ~3e-6 apart in float32)."""
    model = tiny("llama")
    weight = model.model.layers[1].mlp.up_proj.weight
    weight.data = weight.data.t().contiguous().t()  # the same values, column-major
    before = snapshot(model)
    handle = dispatch(model, plan_from(model, lambda i, u: row if "layers" in u else RESIDENT), offload_dir=tmp_path)
    with torch.no_grad():
        handle(**inputs_for(model))
    handle.remove()
    assert before["model.layers.1.mlp.up_proj.weight"].stride() == (1, 64)
    assert_restored(model, before)


def _with_cpu_free(plan, free_bytes: int):
    """``plan`` with a cost whose cpu row leaves ``free_bytes`` of a 1 MiB capacity free."""
    capacity = 1 << 20
    cpu = DeviceMemory(device="cpu", capacity_bytes=capacity, reserve_bytes=0, weights_bytes=capacity - free_bytes,
                       kv_cache_bytes=0, workspace_bytes=0, stream_buffer_bytes=0)
    return dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, memory=(cpu,)))


@pytest.mark.parametrize("disk_reads", ["mmap", "copy"])
def test_copied_disk_reads_warn_when_the_plans_free_ram_cannot_hold_the_next_copy(tmp_path, disk_reads):
    """disk_reads="copy" holds one disk unit's copy more than the plan charges: the user hears how much when
    the plan's free RAM is smaller, and nothing when it is larger or the reads are memory-mapped."""
    model = tiny("llama")
    plan = plan_from(model, mixed)
    mapped = [u for u, row in zip(units_of(model), map(mixed, range(8), units_of(model)), strict=True)
              if row[0] == "disk"]
    params = dict(model.named_parameters())
    largest = max(sum(t.nbytes for n, t in params.items() if n.startswith(u + ".")) for u in mapped)
    for free, warns in ((largest - 1, disk_reads == "copy"), (largest, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = dispatch(model, _with_cpu_free(plan, free), offload_dir=tmp_path, disk_reads=disk_reads)
            handle.remove()
        said = [str(w.message) for w in caught if "more than the plan charges" in str(w.message)]
        assert bool(said) == warns, (free, said)
        if warns:
            assert said[0].startswith(f"disk_reads='copy' holds up to {format_bytes(largest)} of RAM more")
            assert f"leaves {format_bytes(free)} of the cpu's 1.00 MiB free" in said[0]
            assert "plan with 1 B less cpu memory" in said[0]
            assert caught[0].filename == __file__


def _with_cpu_row(plan, free_bytes: int, live_bytes: int):
    """``plan`` with a cost whose cpu row holds ``live_bytes`` of workspace and KV cache and leaves ``free_bytes``."""
    capacity = 1 << 30
    cpu = DeviceMemory(device="cpu", capacity_bytes=capacity, reserve_bytes=0,
                       weights_bytes=capacity - free_bytes - live_bytes, kv_cache_bytes=live_bytes // 2,
                       workspace_bytes=live_bytes - live_bytes // 2, stream_buffer_bytes=0)
    return dataclasses.replace(plan, cost=dataclasses.replace(plan.cost, memory=(cpu,)))


def _heap_warnings(model, plan, tmp_path) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dispatch(model, plan, offload_dir=tmp_path).remove()
    return [str(w.message) for w in caught if "glibc's default heap" in str(w.message)]


@pytest.mark.skipif(not allocator.glibc_heap(), reason="glibc's heap only")
def test_a_plan_with_less_free_cpu_ram_than_its_cpu_activations_names_the_allocator_fix(tmp_path, monkeypatch):
    """glibc's default heap can hold up to the activations again: a plan that leaves less free is told the fix,
    unless the threshold is fixed already or the activations are too few to matter."""
    model = tiny("llama")
    plan = plan_from(model, lambda i, u: RESIDENT)
    mib = 1 << 20
    said = _heap_warnings(model, _with_cpu_row(plan, free_bytes=64 * mib, live_bytes=96 * mib), tmp_path)
    assert len(said) == 1
    assert said[0].startswith("the plan leaves 64.00 MiB of the cpu's 1.00 GiB free, less than the 96.00 MiB")
    assert "fix_mmap_threshold()" in said[0]
    assert not _heap_warnings(model, _with_cpu_row(plan, free_bytes=96 * mib, live_bytes=96 * mib), tmp_path)
    # below HEAP_WARN_MIN_BYTES of activations and KV cache, library scratch decides the RSS anyway
    assert not _heap_warnings(model, _with_cpu_row(plan, free_bytes=1 * mib, live_bytes=48 * mib), tmp_path)
    monkeypatch.setattr(allocator, "_fixed", [allocator.DEFAULT_CPU_MMAP_THRESHOLD_BYTES])
    assert not _heap_warnings(model, _with_cpu_row(plan, free_bytes=64 * mib, live_bytes=96 * mib), tmp_path)


@pytest.mark.parametrize("choose", [lambda i, u: MAPPED, lambda i, u: ("disk", "cpu", "stream_sync")],
                         ids=["all-disk-stream", "all-disk-sync"])
def test_whole_model_on_disk(family_model, tmp_path, choose):
    family, model, reference = family_model
    before = snapshot(model)
    handle = dispatch(model, plan_from(model, choose), offload_dir=tmp_path)
    with torch.no_grad():
        logits = handle(**inputs_for(model)).logits
    torch.testing.assert_close(logits, reference, rtol=1e-6, atol=1e-6)
    handle.remove()
    assert_restored(model, before)


def test_generate_tokens_identical(family_model, tmp_path):
    family, model, _ = family_model
    batch = inputs_for(model)
    batch.pop("decoder_input_ids", None)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = model.generate(**batch, **kwargs)
    before = snapshot(model)
    handle = dispatch(model, plan_from(model, mixed), offload_dir=tmp_path, disk_reads="copy")
    with torch.no_grad():
        tokens = handle.generate(**batch, **kwargs)
    handle.remove()
    assert torch.equal(tokens, expected)
    assert_restored(model, before)


def test_disk_units_compute_from_the_memory_map(tmp_path):
    model = tiny("llama")
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT),
                      offload_dir=tmp_path)
    weight = model.model.layers[2].mlp.up_proj.weight  # 64 x 32 fp32 = 8192 bytes
    file, key = next((f, k) for f, k in handle._units[3].disk if k.endswith("mlp.up_proj.weight"))
    mapped = file._mapped()
    start = mapped.ctypes.data + file.spans[key].offset_bytes
    assert weight.data_ptr() == start  # the parameter IS the file's bytes: no copy
    handle.remove()
    assert not any(True for _ in tmp_path.glob(".*.tmp"))


def test_an_embedding_on_disk_is_never_read_ahead(tmp_path, monkeypatch):
    """Every unit on disk: each reads ahead the next one but the embedding, which looks up a row per token (a
    read-ahead would read its whole table); lm_head, last, reads ahead the first layer. Spied in a decode step."""
    from placement_opt.runtime._safetensors_file import SafetensorsFile
    from placement_opt.runtime.timing import cache_argument, cache_of

    model = tiny("llama")
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED), offload_dir=tmp_path)
    asked: list[str] = []
    monkeypatch.setattr(SafetensorsFile, "prefetch", lambda self, keys: asked.extend(keys))
    links = {u.name: u.next_unit.name if u.next_unit else None for u in handle._units}
    with torch.no_grad():
        out = handle(input_ids=torch.tensor([[3, 4, 5]]), use_cache=True)
        asked.clear()
        handle(input_ids=torch.tensor([[6]]), use_cache=True, **cache_argument(model, cache_of(out)))
    handle.remove()
    assert "model.embed_tokens" not in links.values()
    assert links["model.embed_tokens"] == "model.layers.0" and links["lm_head"] == "model.layers.0"
    assert asked and not any(k.startswith("model.embed_tokens") for k in asked)


def test_an_embedding_on_disk_asks_for_its_tokens_rows_or_its_whole_table_whichever_the_machine_reads_faster(
        tmp_path, monkeypatch):
    """Left to fault its rows in, a lookup brings the kernel's read-around window with each (8 MiB, 6 ms a row on
    this project's disk): the embedding asks for the rows of its call's tokens before looking them up, and for the
    whole table where the plan's machine reads that faster (here from 12 distinct rows of a 1 MiB table). Spied in
    a prompt of 3 distinct tokens, a decode step and a prompt of 16; the outputs are the model's."""
    import transformers as T

    from placement_opt.cost.traffic import asks_whole_table
    from placement_opt.hardware.devices import Device, Machine
    from placement_opt.runtime._safetensors_file import SafetensorsFile

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64)).eval()
    key, table_bytes = "model.embed_tokens.weight", 4096 * 64 * 4
    short, step, long = torch.tensor([[3, 4, 5, 4]]), torch.tensor([[9]]), torch.arange(100, 116)[None]
    with torch.no_grad():
        reference = model(input_ids=short, use_cache=True)
        expected = [reference.logits, model(input_ids=step, use_cache=True,
                                            **cache_argument(model, cache_of(reference))).logits,
                    model(input_ids=long).logits]
    disk = Device("disk", "100GiB", bandwidth=2e9, random_read=1e9, random_read_latency_s=100e-6)
    plan = dataclasses.replace(plan_from(model, lambda i, u: MAPPED), machine=Machine([Device("cpu", "8GiB"), disk]))
    assert not asks_whole_table(plan.machine, 11, 256, table_bytes) and asks_whole_table(plan.machine, 12, 256,
                                                                                         table_bytes)
    handle = dispatch(model, plan, offload_dir=tmp_path)
    rows: dict[str, set[int]] = {}
    whole: list[str] = []
    monkeypatch.setattr(SafetensorsFile, "prefetch_rows",
                        lambda self, k, start, end: rows.setdefault(k, set()).update(range(start, end)))
    monkeypatch.setattr(SafetensorsFile, "prefetch", lambda self, keys: whole.extend(keys))
    got, asked = [], []
    with torch.no_grad():
        for call in ("short", "step", "long"):
            rows.clear(), whole.clear()
            if call == "short":
                out = handle(input_ids=short, use_cache=True)
                got.append(out.logits)
            elif call == "step":
                got.append(handle(input_ids=step, use_cache=True, **cache_argument(model, cache_of(out))).logits)
            else:
                got.append(handle(input_ids=long).logits)
            asked.append((rows.get(key), key in whole))
    handle.remove()
    assert asked == [({3, 4, 5}, False), ({9}, False), (None, True)]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_the_read_ahead_is_asked_for_off_the_computing_thread_and_done_when_the_forward_returns(tmp_path,
                                                                                               monkeypatch):
    """posix_fadvise allocates and queues the next unit's pages before it returns (18 ms of a 73 ms cold decode
    step of a small all-disk model): the release thread asks while the unit computes. Every ask made in a forward
    is done when the forward returns, and the outputs are the model's."""
    import threading

    from placement_opt.runtime._safetensors_file import SafetensorsFile

    model = tiny("llama")
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED), offload_dir=tmp_path)
    asked: list[tuple[str, str]] = []
    real = SafetensorsFile.prefetch

    def spy(self, keys):
        keys = list(keys)
        real(self, keys)
        asked.extend((threading.current_thread().name, k) for k in keys)

    monkeypatch.setattr(SafetensorsFile, "prefetch", spy)
    with torch.no_grad():
        out = handle(input_ids=ids).logits
    done = list(asked)
    handle.remove()
    torch.testing.assert_close(out, reference)
    assert {k.rsplit(".", 1)[0] for _, k in done} >= {"model.layers.1.mlp.down_proj", "lm_head"}  # each unit's next
    # the read-ahead on placement_opt-release, not MainThread; the embedding asks for its own table as it computes
    # (a lookup is never read ahead: nothing before it computes that its read could overlap)
    ahead = [(name, k) for name, k in done if not k.startswith("model.embed_tokens.")]
    assert {name.split("_")[0] for name, _ in ahead} == {"placement"}, done
    assert len(done) == len(asked)  # none landed after the forward returned


def test_a_decode_step_reads_no_routed_experts_ahead_and_a_prompt_reads_them_all(tmp_path, monkeypatch):
    """A Mixtral on disk (4 experts, top-2): a decode step's token uses two experts, which fault in on demand, so the
    next layer's experts are not read ahead; a prompt of 7 tokens uses nearly all, and they are. Outputs equal."""
    from placement_opt.runtime._safetensors_file import SafetensorsFile
    from placement_opt.runtime.timing import cache_argument, cache_of

    model = tiny("mixtral")
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED), offload_dir=tmp_path)
    asked: list[str] = []
    monkeypatch.setattr(SafetensorsFile, "prefetch", lambda self, keys: asked.extend(keys))
    with torch.no_grad():
        out = handle(input_ids=ids, use_cache=True)
        prompt, asked[:] = list(asked), []
        handle(input_ids=torch.tensor([[6]]), use_cache=True, **cache_argument(model, cache_of(out)))
    handle.remove()
    torch.testing.assert_close(out.logits, reference)
    experts = {k.split(".mlp.")[0] for k in prompt if ".experts." in k}
    assert experts == {"model.layers.0", "model.layers.1"}  # the embedding reads layer 0's ahead, layer 0 layer 1's
    assert asked and not any(".experts." in k for k in asked)
    assert any(k.startswith("model.layers.1.") for k in asked)  # the rest of the layer still is


def test_a_decode_step_asks_for_the_experts_its_router_picked_before_computing_them(tmp_path, monkeypatch):
    """The experts' rows read ahead in a decode step are the router's picks for the token, per layer and per fused
    tensor; a prompt (as many tokens as experts) asks for none this way."""
    from placement_opt.runtime._safetensors_file import SafetensorsFile
    from placement_opt.runtime.timing import cache_argument, cache_of

    model = tiny("mixtral")
    picked: dict[str, set[int]] = {}
    for i, layer in enumerate(model.model.layers):  # what the router gives the experts, seen from outside
        layer.mlp.experts.register_forward_pre_hook(
            lambda _m, args, i=i: picked.setdefault(f"model.layers.{i}", set()).update(args[1].flatten().tolist()))
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED), offload_dir=tmp_path)
    rows: dict[str, set[int]] = {}
    monkeypatch.setattr(SafetensorsFile, "prefetch_rows",
                        lambda self, key, start, end: rows.setdefault(key, set()).update(range(start, end)))
    with torch.no_grad():
        out = handle(input_ids=torch.tensor([[3, 4, 5, 6, 7, 8, 9]]), use_cache=True)
        assert rows == {}  # 7 tokens, 4 experts: the prompt's read-ahead asked for them all
        picked.clear()
        handle(input_ids=torch.tensor([[6]]), use_cache=True, **cache_argument(model, cache_of(out)))
    handle.remove()
    for layer, experts in picked.items():
        for tensor in ("gate_up_proj", "down_proj"):
            assert rows[f"{layer}.mlp.experts.{tensor}"] == experts
    assert len(picked) == 2 and all(len(e) == 2 for e in picked.values())


class LoopExperts(torch.nn.Module):
    """A fused experts module outside transformers' experts interface, its loop written by hand over the picked
    experts (as LongCat-Flash's and Step-3.7's are), holding a Mixtral experts module's weights."""

    def __init__(self, whole: torch.nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = whole.gate_up_proj, whole.down_proj, whole.act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            gate, up = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, -1)
            done = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[expert])
            out.index_add_(0, token, done * top_k_weights[token, slot, None])
        return out


def _decode_reads(model, tmp_path, monkeypatch):
    """(the keys read ahead, the rows asked for per key) in a decode step of ``model`` all on disk, and whether its
    prompt and step computed what the model does."""
    from placement_opt.runtime._safetensors_file import SafetensorsFile

    ids, step_ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]]), torch.tensor([[6]])
    with torch.no_grad():
        reference = model(input_ids=ids, use_cache=True)
        expected = model(input_ids=step_ids, use_cache=True, **cache_argument(model, cache_of(reference))).logits
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED), offload_dir=tmp_path)
    ahead: list[str] = []
    rows: dict[str, set[int]] = {}
    monkeypatch.setattr(SafetensorsFile, "prefetch", lambda self, keys: ahead.extend(keys))
    monkeypatch.setattr(SafetensorsFile, "prefetch_rows",
                        lambda self, key, start, end: rows.setdefault(key, set()).update(range(start, end)))
    with torch.no_grad():
        out = handle(input_ids=ids, use_cache=True)
        ahead.clear()
        step = handle(input_ids=step_ids, use_cache=True, **cache_argument(model, cache_of(out))).logits
    handle.remove()
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step, expected, rtol=1e-5, atol=1e-5)
    return ahead, {k: v for k, v in rows.items() if not k.startswith("model.embed_tokens.")}  # its token's row


def test_a_hand_written_experts_loop_also_reads_the_router_picks(tmp_path, monkeypatch):
    """Fused experts outside transformers' experts interface whose forward takes the router's picks: a decode
    step reads them as it reads the interface's (the cost model prices both alike)."""
    model = tiny("mixtral")
    picked: dict[int, set[int]] = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.experts = LoopExperts(layer.mlp.experts)
        layer.mlp.experts.register_forward_pre_hook(
            lambda _m, args, i=i: picked.setdefault(i, set()).update(args[1].flatten().tolist()))
    ahead, rows = _decode_reads(model, tmp_path, monkeypatch)
    assert not any(".experts." in k for k in ahead)
    for layer, experts in picked.items():  # the prompt's picks too: the step's are among them
        assert set().union(*(rows[f"model.layers.{layer}.mlp.experts.{t}"] for t in ("gate_up_proj", "down_proj")))
        assert rows[f"model.layers.{layer}.mlp.experts.gate_up_proj"] <= experts


def test_experts_that_run_on_every_token_are_read_ahead_whole(tmp_path, monkeypatch):
    """Llama 4's experts take the hidden states alone and run every expert on every token (the trace prices each
    token reading them all): a decode step reads them ahead with the rest of the layer, and asks for no rows."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
        max_position_embeddings=64, interleave_moe_layer_step=1, no_rope_layers=[1, 1])
    model = transformers.Llama4ForCausalLM(config).eval()
    ahead, rows = _decode_reads(model, tmp_path, monkeypatch)
    assert rows == {}
    assert {k for k in ahead if ".experts." in k} >= {"model.layers.1.feed_forward.experts.gate_up_proj",
                                                      "model.layers.1.feed_forward.experts.down_proj"}


def test_dbrx_s_stacked_experts_are_read_for_the_router_s_picks_only(tmp_path, monkeypatch):
    """DBRX stacks each expert's weights along the rows of 2-D tensors its experts module's child holds
    (``ffn.experts.mlp.w1``: [4 experts x 64, 32]): a decode step reads none of them ahead and asks for the
    picked experts' rows, as the cost model prices the unit (routed). Outputs equal."""
    model = tiny("dbrx")
    picked: dict[int, list[set[int]]] = {}
    for i, block in enumerate(model.transformer.blocks):
        block.ffn.experts.register_forward_pre_hook(
            lambda _m, args, i=i: picked.setdefault(i, []).append(set(args[1].flatten().tolist())))
    ahead, rows = _decode_reads(model, tmp_path, monkeypatch)
    assert not any(".ffn.experts." in k for k in ahead)
    for block, calls in picked.items():
        step = calls[-1]  # the decode step's picks; the prompt's 7 tokens (more than 4 experts) asked for none
        assert len(step) == 2
        for tensor in ("w1", "v1", "w2"):
            assert rows[f"transformer.blocks.{block}.ffn.experts.mlp.{tensor}"] == {
                r for e in step for r in range(64 * e, 64 * (e + 1))}


def test_jetmoe_experts_are_read_for_the_rows_the_router_gives_them(tmp_path, monkeypatch):
    """JetMoE's experts (its MLP's and its attention's ``ParallelExperts``) are told how many rows each expert gets,
    not each token's picks, and an expert with none reads none of its weights. A decode step reads none of them
    ahead and asks for the experts with rows, as the cost model prices every routed MoE unit (before, they were
    read ahead whole). A call whose rows reach every expert asks for them all: its rows do not say whether it was a
    prompt the read-ahead read whole or a few tokens it read none of (it asked for none there before)."""
    model = tiny("jetmoe")
    calls: dict[str, list[list[int]]] = {}
    experts = {n: m for n, m in model.named_modules() if type(m).__name__ == "JetMoeParallelExperts"}
    for name, module in experts.items():
        module.register_forward_pre_hook(lambda _m, args, name=name: calls.setdefault(name, []).append(list(args[1])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # JetMoE's meta forward fails: a static graph
        ahead, rows = _decode_reads(model, tmp_path, monkeypatch)
    assert len(experts) == 8 and not any(k.removesuffix(".weight") in experts for k in ahead)
    for name, counts in calls.items():
        wanted = set().union(*({i for i, n in enumerate(call) if n} for call in counts))
        assert rows.get(f"{name}.weight", set()) == wanted, name
    step = [c[-1] for c in calls.values()]  # the decode step's one token: top-2 of 4 in every experts module
    assert all(sum(1 for n in call if n) == 2 for call in step)
    assert all(rows[f"{name}.weight"] >= {i for i, n in enumerate(c[-1]) if n} for name, c in calls.items())
    # 4 tokens, top-2 over 8 experts, one row each: the read-ahead asked for none at 4 tokens, so these are asked for
    from placement_opt.runtime._routed_reads import _counted

    assert _counted(torch.ones(8, dtype=torch.long), 8) == list(range(8)) and _counted([0, 3, 0], 3) == [1]


@given(st.sets(st.integers(0, 63)))
def test_expert_runs_cover_exactly_the_picked_ones(ids) -> None:
    from placement_opt.runtime._routed_reads import _runs

    runs = _runs(sorted(ids))
    assert {i for start, end in runs for i in range(start, end)} == ids
    assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(runs, runs[1:], strict=False))  # apart


def _mapped_pages(handle: DispatchedModel) -> dict[str, int]:
    """Per disk unit, its pages mapped in this process that lie wholly inside one of its tensors."""
    import mmap
    import struct

    mapped = {}
    with open("/proc/self/pagemap", "rb") as fh:
        for unit in handle._units:
            if not unit.disk:
                continue
            mapped[unit.name] = 0
            for file, key in unit.disk:
                span, base = file.spans[key], file._mapped().ctypes.data
                start = -(-(base + span.offset_bytes) // mmap.PAGESIZE)
                end = (base + span.offset_bytes + span.nbytes) // mmap.PAGESIZE
                if end > start:
                    fh.seek(start * 8)
                    entries = struct.unpack(f"{end - start}Q", fh.read((end - start) * 8))
                    mapped[unit.name] += sum(e >> 63 & 1 for e in entries)
    return mapped


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux /proc/self/pagemap")
@pytest.mark.parametrize("disk_reads", ["mmap", "copy"])
def test_disk_units_pages_leave_the_process_after_each_forward(tmp_path, disk_reads):
    """The RSS of a model stored on disk holds what runs, not every unit it ever read (the memory model's
    stream buffer); the outputs are the plain model's forward after forward."""
    model = tiny("llama")
    with torch.no_grad():
        reference = model(**inputs_for(model)).logits
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT),
                      offload_dir=tmp_path, disk_reads=disk_reads)
    first = next(u.name for u in handle._units if u.disk)
    for _ in range(3):
        with torch.no_grad():
            torch.testing.assert_close(handle(**inputs_for(model)).logits, reference, rtol=1e-6, atol=1e-6)
        mapped = _mapped_pages(handle)
        if disk_reads == "copy":  # the first unit's copy for the next call is made (or under way) already
            mapped.pop(first)
        assert sum(mapped.values()) == 0, mapped
    handle.remove()


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux /proc/self/pagemap")
def test_while_a_mapped_unit_computes_the_process_maps_its_pages_alone(tmp_path, monkeypatch):
    """The memory model charges a unit streamed to the CPU one copy of its weights: the unit before it lets
    its pages go before this one starts, even when that release is slow (here 0.2 s, in the background)."""
    import time

    from placement_opt.runtime import _streamer

    real_release = _streamer._release_pages
    monkeypatch.setattr(_streamer, "_release_pages", lambda unit: (time.sleep(0.2), real_release(unit))[1])
    model = tiny("llama")
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT),
                      offload_dir=tmp_path)
    seen = []
    for k in range(1, len(model.model.layers)):
        def inside(_module, _args, k=k):  # runs within layer k's forward, after its wrapper's first steps
            seen.append(_mapped_pages(handle)[f"model.layers.{k - 1}"])
        model.model.layers[k].input_layernorm.register_forward_pre_hook(inside)
    with torch.no_grad():
        handle(**inputs_for(model))
    assert len(seen) == len(model.model.layers) - 1 and not any(seen), seen
    handle.remove()


def test_a_disk_weight_written_in_place_keeps_the_change(tmp_path):
    """A write into a memory-mapped weight makes private pages, the only copy of the change: they are
    never let go, the next forwards use the change, and remove() hands it back to the model."""
    import copy

    model = tiny("llama")
    changed = copy.deepcopy(model)
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT),
                      offload_dir=tmp_path)
    with torch.no_grad():
        handle(**inputs_for(model))
        for m in (model, changed):
            m.model.layers[1].mlp.up_proj.weight.data.mul_(2)
        expected = changed(**inputs_for(changed)).logits
        for _ in range(2):
            torch.testing.assert_close(handle(**inputs_for(model)).logits, expected, rtol=1e-6, atol=1e-6)
    handle.remove()
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, changed.model.layers[1].mlp.up_proj.weight)


def _copied_layers_and_a_twin(tmp_path, monkeypatch):
    """A tiny Llama whose layers are disk units copied by the prefetch thread, dispatched; the streamers made
    (recorded as they start), the model, an undispatched copy of it, the handle, and the first disk unit."""
    import copy

    from placement_opt.runtime import _streamer

    streamers = []
    real_init = _streamer.Streamer.__init__
    monkeypatch.setattr(_streamer.Streamer, "__init__", lambda self: (streamers.append(self), real_init(self))[1])
    model = tiny("llama")
    changed = copy.deepcopy(model)
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT),
                      offload_dir=tmp_path, disk_reads="copy")
    return streamers, model, changed, handle, next(u for u in handle._units if u.disk)


@pytest.mark.parametrize("write", ["data", "load_state_dict"])
def test_a_weight_changed_between_calls_reaches_the_next_sequence_though_its_copy_was_under_way(tmp_path, write,
                                                                                                monkeypatch):
    """A decode step starts the next step's first copy and returns before it is done. A weight the caller
    changes after that step (a write into ``.data``, ``load_state_dict``) is read again by the next call that
    starts a sequence: its outputs are the changed model's."""
    streamers, model, changed, handle, first = _copied_layers_and_a_twin(tmp_path, monkeypatch)
    inputs = inputs_for(model)
    with torch.no_grad():
        out = handle(**inputs, use_cache=True)
        step = {"input_ids": out.logits[:, -1:].argmax(-1),
                "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)}
        handle(**step, **cache_argument(model, cache_of(out)), use_cache=True)
        assert id(first) in streamers[0].inflight  # the next step's first copy, begun
        for m in (model, changed):
            weight = m.model.layers[0].mlp.up_proj.weight
            if write == "data":
                weight.data.mul_(2)
            else:
                m.model.layers[0].mlp.up_proj.load_state_dict({"weight": weight.detach() * 2})
        expected = changed(**inputs).logits
        torch.testing.assert_close(handle(**inputs).logits, expected, rtol=1e-6, atol=1e-6)
    handle.remove()


def test_refresh_makes_a_weight_changed_between_two_decode_steps_reach_the_next_one(tmp_path, monkeypatch):
    """In the middle of a sequence the next step's first copy is under way when a step returns; after a change,
    ``refresh()`` makes the next decode step compute with the changed weight, as the changed model does."""
    streamers, model, changed, handle, first = _copied_layers_and_a_twin(tmp_path, monkeypatch)
    inputs = inputs_for(model)
    ones = torch.ones(2, 1, dtype=torch.long)
    with torch.no_grad():
        outs = [m(**inputs, use_cache=True) for m in (handle, changed)]
        token = outs[1].logits[:, -1:].argmax(-1)
        mask = torch.cat([inputs["attention_mask"], ones], 1)
        outs = [m(input_ids=token, attention_mask=mask, **cache_argument(model, cache_of(o)), use_cache=True)
                for m, o in zip((handle, changed), outs, strict=True)]
        assert id(first) in streamers[0].inflight  # the next step's first copy, begun before the change
        for m in (model, changed):
            m.model.layers[0].mlp.up_proj.weight.data.mul_(2)
        handle.refresh()
        mask = torch.cat([mask, ones], 1)
        got, expected = (m(input_ids=token, attention_mask=mask, **cache_argument(model, cache_of(o))).logits
                         for m, o in zip((handle, changed), outs, strict=True))
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    handle.remove()
    handle.refresh()  # after remove(): nothing to copy, no error


# ---------------------------------------------------------------------------------------------
# Hooks: the fewest, and the hot path cheap
# ---------------------------------------------------------------------------------------------
def test_all_cpu_plan_hooks_only_the_model(tmp_path):
    model = tiny("llama")
    handle = dispatch(model, plan_from(model, lambda i, u: RESIDENT))
    assert handle.hooked_modules == [model]
    handle.remove()
    assert "forward" not in model.__dict__


def test_wrapped_forward_keeps_signature(tmp_path):
    import inspect

    model = tiny("llama")
    expected = inspect.signature(model.forward)
    handle = dispatch(model, plan_from(model, mixed), offload_dir=tmp_path)
    assert inspect.signature(model.forward) == expected  # generate() reads it to filter kwargs
    assert inspect.signature(model.model.layers[1].forward) == inspect.signature(type(model.model.layers[1]).forward.__get__(model.model.layers[1]))
    handle.remove()


def test_move_returns_same_objects_when_nothing_moves():
    cpu = torch.device("cpu")
    a, b = torch.ones(2), torch.zeros(3)
    pair = (a, b)
    assert _move(pair, cpu) is pair
    nested = [a, (b, 3), {"x": a}]
    moved = _move(nested, cpu)
    assert moved is nested
    marker = object()
    assert _move(marker, cpu) is marker  # caches and unknown objects pass through untouched


def test_move_reaches_tensors_in_tuples_dicts_and_model_outputs():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    meta = torch.device("meta")  # a second device that exists on every machine
    cache = object()
    cos, sin = torch.ones(2), torch.zeros(2)
    moved = _move({"position_embeddings": (cos, sin), "past_key_values": cache, "use_cache": True}, meta)
    assert [t.device for t in moved["position_embeddings"]] == [meta, meta]
    assert moved["past_key_values"] is cache and moved["use_cache"] is True
    out = CausalLMOutputWithPast(logits=torch.ones(1, 2, 3), past_key_values=cache)
    back = _move_output(out, meta)
    assert back is out and out.logits.device == meta and out["logits"].device == meta
    assert out.past_key_values is cache


def test_handle_proxies_the_model(tmp_path):
    model = tiny("llama")
    handle = dispatch(model, plan_from(model, mixed), offload_dir=tmp_path)
    assert isinstance(handle, DispatchedModel)
    assert handle.config is model.config
    assert handle.model is model
    assert "mmap" in repr(handle)
    handle.remove()
    handle.remove()  # idempotent


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
def test_unknown_units_are_listed():
    model = tiny("llama")
    plan = make_plan([("model.layers.9", "cpu", "cpu", "resident"), ("nope", "cpu", "cpu", "resident")])
    with pytest.raises(DispatchError, match=r"2 unit\(s\).*model.layers.9, nope"):
        dispatch(model, plan)


def test_disk_without_offload_dir_says_what_to_do():
    model = tiny("llama")
    with pytest.raises(DispatchError, match="offload_dir"):
        dispatch(model, plan_from(model, lambda i, u: MAPPED))


def test_tied_weights_on_two_storages_are_refused():
    model = tiny("gpt2")
    units = units_of(model)
    rows = [(u, "disk" if u == "lm_head" else "cpu", "cpu", "resident") for u in units]
    with pytest.raises(DispatchError, match="tied weights"):
        dispatch(model, make_plan(rows), offload_dir="unused")


def test_absent_gpu_is_refused():
    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    model = tiny("llama")
    rows = [(u, "cpu", "cuda:7", "stream") for u in units_of(model)]
    with pytest.raises(DispatchError, match="cuda:7"):
        dispatch(model, make_plan(rows))


def test_a_plan_using_another_ranks_gpu_is_refused_under_ddp(monkeypatch):
    # Rank 0 of a 2-process torchrun owns cuda:0 (or the CPU); a plan that computes on cuda:1 would
    # split the model onto rank 1's GPU: refused before anything moves.
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    model = tiny("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rows = [(u, "cpu", "cuda:1", "stream") for u in units_of(model)]
    with pytest.raises(DispatchError, match="cuda:1") as err:
        dispatch(model, make_plan(rows))
    assert "rank 0" in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_dispatching_twice_is_refused(tmp_path):
    model = tiny("llama")
    handle = dispatch(model, plan_from(model, lambda i, u: RESIDENT))
    with pytest.raises(DispatchError, match="already dispatched"):
        dispatch(model, plan_from(model, lambda i, u: RESIDENT))
    handle.remove()
    dispatch(model, plan_from(model, lambda i, u: RESIDENT)).remove()


# ---------------------------------------------------------------------------------------------
# Property: any CPU/disk plan gives the reference logits and is undone exactly
# ---------------------------------------------------------------------------------------------
_OPTIONS = [RESIDENT, MAPPED, MAPPED_SYNC]


@settings(max_examples=8, deadline=None, derandomize=True)
@given(choice=st.lists(st.sampled_from(range(3)), min_size=8, max_size=8),
       disk_reads=st.sampled_from(["mmap", "copy"]))
def test_any_cpu_disk_plan_matches_reference(tmp_path_factory, choice, disk_reads):
    model = _PROPERTY_MODEL
    plan = plan_from(model, lambda i, u: _OPTIONS[choice[i]])
    handle = dispatch(model, plan, offload_dir=tmp_path_factory.mktemp("offload"), disk_reads=disk_reads)
    with torch.no_grad():
        logits = handle(**_PROPERTY_INPUTS).logits
    handle.remove()
    torch.testing.assert_close(logits, _PROPERTY_REFERENCE, rtol=1e-6, atol=1e-6)
    assert_restored(model, _PROPERTY_STATE)


_PROPERTY_MODEL = tiny("llama")  # 8 units: embed, 4 layers, norm, rotary, lm_head
_PROPERTY_INPUTS = inputs_for(_PROPERTY_MODEL)
with torch.no_grad():
    _PROPERTY_REFERENCE = _PROPERTY_MODEL(**_PROPERTY_INPUTS).logits
_PROPERTY_STATE = snapshot(_PROPERTY_MODEL)


# ---------------------------------------------------------------------------------------------
# Plans over the tracer's units (execution order, tied groups from the graph)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_plan_over_traced_units_matches_reference(family, tmp_path):
    trace_module = pytest.importorskip("placement_opt.model.tracer")
    model = tiny(family)
    graph = trace_module.trace(model)
    names = graph.names()
    assert set(names) == set(units_of(model))  # the test helper's units are the tracer's units
    rows = {u: mixed(i, u) for i, u in enumerate(names)}
    for group in graph.meta.tied_unit_groups:
        for u in group:
            rows[u] = rows[group[0]]
    batch = inputs_for(model)
    with torch.no_grad():
        reference = model(**batch).logits
    before = snapshot(model)
    handle = dispatch(model, make_plan([(u, *rows[u]) for u in names]), offload_dir=tmp_path)
    with torch.no_grad():
        logits = handle(**batch).logits
    handle.remove()
    torch.testing.assert_close(logits, reference, rtol=1e-6, atol=1e-6)
    assert_restored(model, before)


def test_every_unit_hooked_gives_the_same_logits(tmp_path):
    # the wrappers a multi-device plan installs on every unit (input moving), run here on one device
    model = _PROPERTY_MODEL
    handle = dispatch(model, plan_from(model, mixed), offload_dir=tmp_path, _hook_every_unit=True)
    assert len(handle.hooked_modules) == len(units_of(model)) + 1  # every unit and the model
    with torch.no_grad():
        logits = handle(**_PROPERTY_INPUTS).logits
    handle.remove()
    torch.testing.assert_close(logits, _PROPERTY_REFERENCE, rtol=1e-6, atol=1e-6)
    assert_restored(model, _PROPERTY_STATE)


def test_package_attribute_dispatches_even_after_the_module_is_imported(tmp_path):
    import placement_opt

    # this file imported placement_opt.runtime.dispatcher (the module) first: the attribute is the function
    model = tiny("llama")
    handle = placement_opt.dispatch(model, plan_from(model, lambda i, u: RESIDENT))
    assert isinstance(handle, DispatchedModel)
    handle.remove()


def test_a_model_with_accelerate_hooks_is_refused():
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_submodules

    model = tiny("llama")
    add_hook_to_module(model.model.layers[0], AlignDevicesHook(io_same_device=True))
    with pytest.raises(DispatchError, match=r"accelerate hooks \(model.layers.0\)"):
        dispatch(model, plan_from(model, lambda i, u: RESIDENT))
    remove_hook_from_submodules(model)
    dispatch(model, plan_from(model, lambda i, u: RESIDENT)).remove()


def test_drop_disk_cache_lets_the_disk_units_pages_go_and_the_next_call_reads_them_again(tmp_path):
    """For cold timings: after it, no disk unit's tensor is in the page cache but each file's first (its first page
    holds the file's header too, which stays mapped); the next forward gives the same logits."""
    model = tiny("llama")
    batch = inputs_for(model)
    with torch.no_grad():
        reference = model(**batch).logits
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT),
                      offload_dir=tmp_path / "offload")
    with torch.no_grad():
        handle(**batch)
    files: dict[int, tuple] = {}
    for unit in handle._units:
        for file, key in unit.disk:
            files.setdefault(id(file), (file, []))[1].append(key)
    assert len(files) == 4 and all(all(f.cached(k) for k in keys) for f, keys in files.values())
    handle.drop_disk_cache()
    still = {f.path.name: [k for k in keys if f.cached(k)] for f, keys in files.values()}
    if sum(map(len, still.values())) == sum(len(k) for _, k in files.values()):
        pytest.skip("this file system keeps dropped pages (tmpfs?): nothing to measure cold here")
    for file, keys in files.values():
        first = min(keys, key=lambda k: file.spans[k].offset_bytes)
        assert still[file.path.name] in ([], [first]), file.path.name
    with torch.no_grad():
        torch.testing.assert_close(handle(**batch).logits, reference, rtol=1e-6, atol=1e-6)
    handle.remove()


def test_a_call_past_the_planned_kv_tokens_or_batch_is_warned_of_once():
    """A plan counts memory for its workload: batch x context tokens in the KV cache, batch x prompt computed at
    once. generate() past either grows what the plan says fits; within them (a smaller batch with a longer
    context included), or for a device_map's plan, nothing is said."""
    from placement_opt import Workload, solve

    model = tiny("llama")
    plan = solve(model, {"cpu": "1GiB"}, workload=Workload(batch_size=2, prompt_len=8, new_tokens=4), workers=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    kwargs = {"do_sample": False, "pad_token_id": 0}

    def said(caught):
        return [str(w.message) for w in caught if "than the plan counted" in str(w.message)]

    handle = dispatch(model, plan)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle.generate(ids, max_new_tokens=4, **kwargs)
            handle.generate(ids[:1], max_new_tokens=16, **kwargs)  # 1 x 24 = 24 tokens: the plan's 2 x 12
            assert said(caught) == []
            handle.generate(torch.cat([ids, ids]), max_new_tokens=2, **kwargs)  # 4 x 8 at once, past 2 x 8
            handle.generate(torch.cat([ids, ids]), max_new_tokens=2, **kwargs)
            assert len(said(caught)) == 1
            assert ("holds 4 x 8 tokens in the KV cache, past the plan's 2 x 12 and computes 4 x 8 tokens at once, "
                    "past the plan's 2 x 8") in said(caught)[0]
            # it names the caller's line (this test), not torch's Module._call_impl
            assert [w.filename for w in caught if "than the plan counted" in str(w.message)] == [__file__]
    finally:
        handle.remove()
    handle = dispatch(model, {name: "cpu" for name in units_of(model)})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle.generate(torch.cat([ids, ids]), max_new_tokens=8, **kwargs)
        assert said(caught) == []
    finally:
        handle.remove()


def test_a_copy_waits_for_the_streamed_forwards_that_ended_before_it_started(monkeypatch):
    """The events of streamed GPU forwards that ended before a copy was started go with that copy (it waits for them
    before it allocates); those ending later go with the next; CPU forwards mark nothing."""
    from types import SimpleNamespace

    from placement_opt.runtime._streamer import MAX_ENDED, Streamer

    class Event:
        def record(self, stream) -> None:
            pass

        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    streamer = Streamer()
    copies = []
    monkeypatch.setattr(streamer, "_copy", lambda unit, side, after=(): copies.append((unit, list(after))) or ([], None))
    gpu = torch.device("cuda:0")
    first, second, third = (SimpleNamespace(disk=[], streams_to=gpu) for _ in range(3))
    streamer.finished(gpu)
    streamer.finished(gpu)
    streamer.finished(torch.device("cpu"))
    ended = list(streamer.ended[gpu])
    streamer.start(first)
    streamer.finished(gpu)
    later = list(streamer.ended[gpu])
    streamer.start(second)
    streamer.start(third)
    streamer.pool.shutdown(wait=True)
    assert [(unit, after) for unit, after in copies] == [(first, ended), (second, later), (third, [])]
    assert len(ended) == 2 and len(later) == 1
    for _ in range(MAX_ENDED + 5):
        streamer.finished(gpu)
    assert len(streamer.ended[gpu]) == MAX_ENDED
    assert set(streamer.ended) == {gpu}  # a CPU forward marks nothing


def test_a_copy_to_one_gpu_waits_for_that_gpus_forwards_only(monkeypatch):
    """One list of ended forwards served every GPU: a copy to cuda:1 waited for cuda:0's forwards, and cuda:1's
    many forwards pushed cuda:0's out of the list, so a copy to cuda:0 allocated before its memory was free."""
    from types import SimpleNamespace

    from placement_opt.runtime._streamer import MAX_ENDED, Streamer

    class Event:
        def __init__(self) -> None:
            self.device = None

        def record(self, stream) -> None:
            self.device = stream

        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: device)  # the event knows its GPU
    streamer = Streamer()
    copies = []
    monkeypatch.setattr(streamer, "_copy", lambda unit, side, after=(): copies.append((unit, list(after))) or ([], None))
    zero, one = torch.device("cuda:0"), torch.device("cuda:1")
    streamer.finished(zero)
    for _ in range(MAX_ENDED + 3):
        streamer.finished(one)
    to_zero, to_one = SimpleNamespace(disk=[], streams_to=zero), SimpleNamespace(disk=[], streams_to=one)
    streamer.start(to_zero)
    streamer.start(to_one)
    streamer.pool.shutdown(wait=True)
    (_, after_zero), (_, after_one) = copies
    assert [e.device for e in after_zero] == [zero]
    assert len(after_one) == MAX_ENDED and {e.device for e in after_one} == {one}


def test_a_plan_counting_the_weights_in_a_narrower_dtype_is_refused_and_the_model_left_alone():
    """A float16 plan on a float32 model would hold twice the bytes its budgets hold: refused before any change,
    saying both sizes and the way out. A model of the plan's width (bfloat16 for a float16 plan), or one keeping a
    few tensors in float32 (norms), is the plan's."""
    import placement_opt
    from placement_opt.errors import PlanMismatchError

    model = tiny("llama")
    plan = placement_opt.solve(placement_opt.trace(model, dtype="float16"), "cpu=10GiB")
    before = snapshot(model)
    with pytest.raises(PlanMismatchError, match=r"its weights are float32 \(.+\), the plan counts them in float16 "
                                                r"\(.+\): convert the model to float16 first"):
        dispatch(model, plan)
    assert_restored(model, before)
    narrow = tiny("llama").to(torch.bfloat16)
    for module in narrow.modules():  # norms kept in float32, as some checkpoints keep them
        if "Norm" in type(module).__name__:
            module.float()
    dispatch(narrow, plan).remove()


def _open_and_mapped(folder) -> tuple[set[str], set[str]]:
    """Files under ``folder`` this process holds open, and those it has mapped."""
    root = str(folder)
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    with open("/proc/self/maps") as maps:
        mapped = {line.split(maxsplit=5)[-1].strip() for line in maps if root in line}
    return {f for f in fds if f.startswith(root)}, mapped


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to list open and mapped files")
def test_remove_lets_go_of_the_offload_files_while_the_handle_lives(tmp_path):
    """remove() kept every disk unit's file open and mapped until the handle itself was collected."""
    model = tiny("llama")
    handle = dispatch(model, plan_from(model, mixed), offload_dir=tmp_path, disk_reads="mmap")
    with torch.no_grad():
        handle(**inputs_for(model))
    held, mapped = _open_and_mapped(tmp_path)
    assert mapped, "the dispatched model computes from mapped offload files"
    handle.remove()
    import gc

    gc.collect()
    assert _open_and_mapped(tmp_path) == (set(), set()), (held, mapped)
    with torch.no_grad():
        model(**inputs_for(model))  # the restored weights are ordinary memory
    assert handle.unit_kinds()  # the handle still answers
