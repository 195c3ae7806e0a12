"""load(): a save_pretrained directory read straight to each unit's storage, equal to the reference."""

from __future__ import annotations

import pytest
import torch

from _models import MAPPED, RESIDENT, inputs_for, mixed, plan_from, saved_tiny, tiny
from placement_opt.errors import DeviceSpecError, DispatchError
from placement_opt.runtime.loader import load


@pytest.fixture(scope="module", params=["llama", "gpt2", "t5", "mixtral"])
def saved(request, tmp_path_factory):
    return saved_tiny(request.param, tmp_path_factory.mktemp(request.param))


def test_load_mixed_plan_equals_reference(saved, tmp_path):
    model, path, reference = saved
    handle = load(path, None, plan=plan_from(model, mixed), offload_dir=tmp_path)
    assert not handle.model.training
    with torch.no_grad():
        logits = handle(**inputs_for(model)).logits
    torch.testing.assert_close(logits, reference, rtol=1e-6, atol=1e-6)
    assert all(p.device.type == "cpu" for p in handle.model.parameters())  # nothing left on meta
    handle.remove()


def test_load_generate_tokens_identical(saved, tmp_path):
    model, path, _ = saved
    batch = inputs_for(model)
    batch.pop("decoder_input_ids", None)
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = model.generate(**batch, **kwargs)
        tokens = load(path, None, plan=plan_from(model, mixed), offload_dir=tmp_path).generate(**batch, **kwargs)
    assert torch.equal(tokens, expected)


def test_disk_units_are_mapped_from_the_checkpoint(tmp_path_factory):
    model = tiny("llama")
    path = tmp_path_factory.mktemp("llama-ckpt")
    model.save_pretrained(path)
    handle = load(path, None, plan=plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT))
    layer = handle.model.model.layers[1]
    files = {f.path.name for unit in handle._units for f, _ in unit.disk}
    assert files == {"model.safetensors"}  # no copy written anywhere: the checkpoint is the store
    file, key = next((f, k) for f, k in handle._units[2].disk if k.endswith("self_attn.q_proj.weight"))
    assert layer.self_attn.q_proj.weight.data_ptr() == file._mapped().ctypes.data + file.spans[key].offset_bytes
    assert not (path / "placement_opt_offload.json").exists()


def test_load_casts_to_a_requested_dtype(tmp_path_factory):
    model = tiny("llama")
    path = tmp_path_factory.mktemp("llama-bf16")
    model.save_pretrained(path)
    handle = load(path, None, plan=plan_from(model, lambda i, u: RESIDENT), dtype="bfloat16")
    weight = handle.model.model.layers[0].mlp.up_proj.weight
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, model.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16))


def test_directory_without_checkpoint(tmp_path):
    with pytest.raises(DispatchError, match="no safetensors checkpoint"):
        load(tmp_path, None, plan=plan_from(tiny("llama"), mixed))


@pytest.mark.parametrize("error", [MemoryError("injected"), torch.OutOfMemoryError("injected")],
                         ids=["MemoryError", "OutOfMemoryError"])
def test_running_out_of_memory_while_loading_is_raised_as_itself(tmp_path_factory, monkeypatch, error):
    """As dispatch() does: a caller catches OOM by its type (a benchmark's "OOM" row, a retry with a smaller
    budget), so load() adds a note and re-raises it rather than wrapping it in a DispatchError."""
    from placement_opt.runtime import loader

    model, path, _ = saved_tiny("llama", tmp_path_factory.mktemp("oom"))

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(loader, "materialize", fail)
    with pytest.raises(type(error)) as raised:
        load(path, None, plan=plan_from(model, mixed))
    assert raised.value is error
    assert any("ran out of memory loading" in note for note in raised.value.__notes__)


def test_a_plan_for_a_gpu_this_machine_lacks_is_refused_before_anything_is_read(tmp_path_factory, monkeypatch):
    """Before, the read of the first GPU tensor failed, reported as a checkpoint to save again."""
    from placement_opt.runtime import _preflight, loader

    model, path, _ = saved_tiny("llama", tmp_path_factory.mktemp("nogpu"))
    monkeypatch.setattr(_preflight, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(loader, "materialize", lambda *a, **k: pytest.fail("read before the plan was checked"))
    plan = plan_from(model, lambda i, u: ("cuda:0", "cuda:0", "resident"))
    with pytest.raises(DispatchError, match=r"the plan uses cuda:0 but this machine has 0 CUDA device"):
        load(path, None, plan=plan)
    # with budgets beside it, the absent GPU is still what is said (not "pass devices=None", which would fail next)
    with pytest.raises(DispatchError, match=r"the plan uses cuda:0 but this machine has 0 CUDA device"):
        load(path, {"cpu": "1GiB"}, plan=plan)


def test_devices_naming_a_gpu_this_machine_lacks_are_refused_before_solving(tmp_path_factory, monkeypatch):
    """A max_memory dict describes a GPU without looking for it; load() runs here, so it says so first."""
    from placement_opt.runtime import _preflight

    _, path, _ = saved_tiny("llama", tmp_path_factory.mktemp("nogpu2"))
    monkeypatch.setattr(_preflight, "cuda_device_count", lambda: 1)
    with pytest.raises(DeviceSpecError, match=r"devices names cuda:1, but this machine has 1 CUDA device"):
        load(path, {1: "1GiB", "cpu": "1GiB"})


def test_a_plan_of_another_model_is_refused_before_a_file_is_written(tmp_path_factory, tmp_path):
    """A Llama's plan given with a Mixtral checkpoint (whose disk experts are fused into offload_dir) wrote the
    fused layers first and refused the plan after."""
    llama = tiny("llama")
    _, mixtral_path, _ = saved_tiny("mixtral", tmp_path_factory.mktemp("other"))
    with pytest.raises(DispatchError, match="not modules of MixtralForCausalLM|does not match this model"):
        load(mixtral_path, None, plan=plan_from(llama, lambda i, u: MAPPED), offload_dir=tmp_path / "off")
    assert not (tmp_path / "off").exists() or not any((tmp_path / "off").iterdir())


def test_a_plan_over_the_budgets_given_beside_it_is_refused(tmp_path_factory):
    """A budget passed with a plan is a limit: a plan solved for more of the CPU is refused, with both figures;
    within the budgets (or with devices=None) it loads."""
    from placement_opt import solve

    model, path, reference = saved_tiny("llama", tmp_path_factory.mktemp("budget"))
    plan = solve(path, {"cpu": "64MiB"}, strategy="sequential")
    used = next(m.used_bytes for m in plan.cost.memory if m.device == "cpu")
    with pytest.raises(DispatchError, match=r"of cpu, more than the .* devices gives it") as raised:
        load(path, {"cpu": used // 2, "disk": "1GiB"}, plan=plan)
    assert "solve a plan for these devices" in str(raised.value)
    with pytest.raises(DispatchError, match=r"which devices does not name"):
        load(path, {"disk": "1GiB"}, plan=plan)
    on_disk = solve(path, {"cpu": "16KB", "disk": "1GiB"}, strategy="sequential")
    assert any(m.device == "disk" and m.used_bytes for m in on_disk.cost.memory)
    offload = tmp_path_factory.mktemp("offload")  # for the rotary buffers, which no checkpoint file holds
    load(path, {"cpu": "1GiB", "disk": "1KB"}, plan=on_disk, offload_dir=offload).remove()  # no new space for the rest
    for devices in ({"cpu": used, "disk": "1GiB"}, None):
        handle = load(path, devices, plan=plan)
        with torch.no_grad():
            torch.testing.assert_close(handle(**inputs_for(model)).logits, reference, rtol=1e-6, atol=1e-6)
        handle.remove()


def test_load_solves_when_no_plan_is_given(tmp_path_factory):
    pytest.importorskip("placement_opt.planner")
    from placement_opt.cost.workload import Workload

    model = tiny("llama")  # ~180 KB of fp32 weights: 4 layers of ~36 KB, embed and head 16 KB each
    path = tmp_path_factory.mktemp("llama-solve")
    model.save_pretrained(path)
    handle = load(path, {"cpu": "150KB", "disk": "1GB"}, workload=Workload(batch_size=2, prompt_len=8, new_tokens=4))
    storages = {p.storage for p in handle.plan.placements}
    assert storages == {"cpu", "disk"}  # 150 KB of RAM cannot hold it all
    with torch.no_grad():
        logits = handle(**inputs_for(model)).logits
        reference = model(**inputs_for(model)).logits
    torch.testing.assert_close(logits, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("time_limit_s", [None, 2.0])
def test_load_searches_again_only_where_the_default_search_stopped_far_from_its_bound(tmp_path_factory, monkeypatch,
                                                                                     time_limit_s):
    """Without a time limit, a plan more than 1 % above its bound is solved again for up to EXTRA_SEARCH_S and
    the better plan kept, with a note; a time limit the caller gives is the only search."""
    import dataclasses

    from placement_opt import planner
    from placement_opt.cost.workload import Workload
    from placement_opt.report import EXTRA_SEARCH_S

    real, limits = planner.solve, []

    def solve(*args, **kwargs):  # the first search stops at a 5 % gap; a longer one lowers the objective
        limits.append(kwargs.get("time_limit_s"))
        plan = real(*args, **kwargs)
        first = len(limits) == 1
        return dataclasses.replace(plan, status="FEASIBLE", gap=0.05 if first else 0.0,
                                   objective_value=plan.objective_value * (1.1 if first else 1.0))

    monkeypatch.setattr(planner, "solve", solve)
    model = tiny("llama")
    path = tmp_path_factory.mktemp("llama-again")
    model.save_pretrained(path)
    handle = load(path, {"cpu": "150KB", "disk": "1GB"}, workload=Workload(batch_size=2, prompt_len=8, new_tokens=4),
                  time_limit_s=time_limit_s)
    if time_limit_s is None:
        assert limits == [None, EXTRA_SEARCH_S]
        assert handle.plan.gap == 0.0 and "this is the second search's plan" in handle.plan.notes[-1]
    else:
        assert limits == [time_limit_s] and handle.plan.gap == 0.05
    handle.remove()


def test_cpu_units_map_the_checkpoint_copy_on_write(tmp_path_factory):
    import hashlib

    model = tiny("llama")
    path = tmp_path_factory.mktemp("llama-cow")
    model.save_pretrained(path)
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    handle = load(path, None, plan=plan_from(model, lambda i, u: RESIDENT))
    weight = handle.model.model.layers[0].mlp.down_proj.weight  # 32 x 64 fp32, mapped, not copied
    assert all(not unit.disk for unit in handle._units)  # CPU-stored: not disk units
    with torch.no_grad():
        weight.add_(1.0)  # a write lands in private memory ...
    assert torch.equal(weight, model.model.layers[0].mlp.down_proj.weight + 1.0)
    # ... never in the checkpoint
    assert hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest() == digest


def test_disk_units_in_another_dtype_are_cast_once_into_offload_dir(tmp_path_factory):
    model = tiny("llama")
    path = tmp_path_factory.mktemp("llama-fp32")
    model.save_pretrained(path)
    offload = tmp_path_factory.mktemp("offload-bf16")
    plan = plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT)
    with pytest.raises(DispatchError, match="offload_dir"):
        load(path, None, plan=plan, dtype="bfloat16")
    handle = load(path, None, plan=plan, dtype="bfloat16", offload_dir=offload)
    written = sorted(p.name.split(".")[:3] for p in offload.glob("*.safetensors"))  # <unit>.<fingerprint>...
    assert written == [["model", "layers", str(i)] for i in range(4)]  # one file per disk unit
    weight = handle.model.model.layers[2].mlp.up_proj.weight
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, model.model.layers[2].mlp.up_proj.weight.to(torch.bfloat16))
    import transformers

    reference = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        torch.testing.assert_close(handle(**inputs_for(model)).logits, reference(**inputs_for(model)).logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("granularity", ["sublayer", "auto"])
def test_load_places_sublayer_units_when_asked(granularity, tmp_path_factory):
    """load(granularity=...) plans attention and MLP apart (or picks block or sublayer): same logits."""
    from placement_opt.cost.workload import Workload

    model = tiny("llama")
    path = tmp_path_factory.mktemp(f"llama-{granularity}")
    model.save_pretrained(path)
    handle = load(path, {"cpu": "150KB", "disk": "1GB"}, workload=Workload(batch_size=2, prompt_len=8, new_tokens=4),
                  granularity=granularity)
    assert {p.storage for p in handle.plan.placements} == {"cpu", "disk"}  # as in the block test above
    names = [p.unit for p in handle.plan.placements]
    if granularity == "sublayer":
        assert "model.layers.0.mlp" in names and "model.layers.0" not in names
        assert handle.plan.home == "cpu"
    else:
        assert any(n.startswith("granularity auto:") for n in handle.plan.notes)
    with torch.no_grad():
        logits = handle(**inputs_for(model)).logits
        reference = model(**inputs_for(model)).logits
    torch.testing.assert_close(logits, reference, rtol=1e-6, atol=1e-6)
    handle.remove()


def test_load_keeps_the_callers_pins(tmp_path_factory):
    """load(pins=...) reaches the solver: the pinned layers are stored where the caller said, the logits unchanged."""
    model = tiny("llama")
    path = tmp_path_factory.mktemp("llama-pins")
    model.save_pretrained(path)
    handle = load(path, {"cpu": "1GB", "disk": "1GB"}, pins={"model.layers.[13]": "disk"})
    storage = {p.unit: p.storage for p in handle.plan.placements}
    assert storage["model.layers.1"] == storage["model.layers.3"] == "disk"
    assert storage["model.layers.0"] == storage["model.layers.2"] == "cpu"  # RAM is plenty: unpinned stay there
    with torch.no_grad():
        torch.testing.assert_close(handle(**inputs_for(model)).logits, model(**inputs_for(model)).logits,
                                   rtol=1e-6, atol=1e-6)
    handle.remove()


def test_a_priced_plan_loads_in_the_dtype_it_was_priced_for(tmp_path_factory):
    """A float16 plan of a float32 checkpoint was read in float32 (twice the bytes it counts, and its budget check
    passed on the float16 figures); it loads in float16 now, and another dtype asked beside it is refused."""
    from placement_opt import solve, trace

    model, path, _ = saved_tiny("llama", tmp_path_factory.mktemp("dtype"))
    plan = solve(trace(path, dtype="float16"), {"cpu": "64MiB"}, strategy="sequential")
    assert plan.dtype == "float16"
    handle = load(path, {"cpu": "64MiB"}, plan=plan)
    assert {p.dtype for p in handle.model.parameters()} == {torch.float16}
    handle.remove()
    with pytest.raises(DispatchError, match=r"dtype='float32', but the plan was priced for 'float16'"):
        load(path, None, plan=plan, dtype="float32")
    # dtype="auto", as from_pretrained takes it: the checkpoint's own without a plan, the plan's with one
    handle = load(path, {"cpu": "64MiB"}, plan=plan, dtype="auto")
    assert {p.dtype for p in handle.model.parameters()} == {torch.float16}
    handle.remove()
    handle = load(path, {"cpu": "64MiB"}, dtype="auto")
    assert {p.dtype for p in handle.model.parameters()} == {torch.float32}
    handle.remove()


def test_a_disk_unit_with_a_buffer_no_checkpoint_holds_loads_without_offload_dir(tmp_path):
    """Gemma-2's embeddings hold ``embed_scale``, a buffer computed at init and saved nowhere: the unit's weight is
    mapped from the checkpoint and the buffer stays in RAM. It used to send the unit to an offload store, and
    load() without offload_dir failed telling the user to call load()."""
    import transformers
    from transformers import AutoModelForCausalLM

    from placement_opt import Workload, solve

    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4)
    transformers.Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    plan = solve(reference, {"cpu": "64MiB", "disk": "1GiB"}, pins={"model.embed_tokens": "disk", "model.rotary_emb": "disk"},
                 workload=Workload(batch_size=1, prompt_len=8, new_tokens=4))
    handle = load(tmp_path, None, plan=plan)
    assert handle.unit_kinds()["model.embed_tokens"] == "mmap"
    ids = torch.tensor([[3, 7, 11, 2, 9, 4, 8, 1]])
    kwargs = {"max_new_tokens": 4, "do_sample": False}
    with torch.no_grad():
        assert torch.equal(handle.model.generate(ids, **kwargs), reference.generate(ids, **kwargs))


def test_a_full_offload_dir_is_said_to_be_full_not_a_bad_checkpoint(tmp_path_factory, monkeypatch):
    import errno

    from placement_opt.runtime import loader

    model, path, _ = saved_tiny("llama", tmp_path_factory.mktemp("enospc"))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loader, "materialize", full)
    with pytest.raises(DispatchError, match="ran out of disk space writing .* into offload_dir"):
        load(path, None, plan=plan_from(model, mixed), offload_dir=tmp_path_factory.mktemp("offload"))


def test_a_plan_file_path_loads_as_its_plan_and_other_things_are_refused(tmp_path_factory, tmp_path):
    from placement_opt import solve

    _, path, reference = saved_tiny("llama", tmp_path_factory.mktemp("planpath"))
    solve(path, {"cpu": "1GiB"}).to_json(tmp_path / "plan.json")
    handle = load(path, None, plan=tmp_path / "plan.json")
    handle.remove()
    for wrong in ({"model.embed_tokens": "cpu"}, 5):
        with pytest.raises(DispatchError, match=r"load\(\) takes a Plan .* or the path of a plan file"):
            load(path, None, plan=wrong)


@pytest.mark.parametrize(("config", "words"), [
    ("{not json", "cannot read the transformers config of"),
    ({"model_type": "no-such-model"}, "cannot read the transformers config of"),
    ({"num_hidden_layers": -2}, "has num_hidden_layers=-2: a model has 0 or more layers"),
    (None, "cannot read the transformers config of"),
])
def test_a_checkpoint_whose_config_builds_no_model_is_a_model_spec_error(tmp_path_factory, tmp_path, config, words):
    """transformers' own ValueError / OSError, or a model with no layers at all, were what load() raised."""
    import json
    import shutil

    from placement_opt.errors import ModelSpecError

    _, path, _ = saved_tiny("llama", tmp_path_factory.mktemp("badconfig"))
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    if config is None:
        (broken / "config.json").unlink()
    elif isinstance(config, str):
        (broken / "config.json").write_text(config)
    else:
        (broken / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), **config}))
    with pytest.raises(ModelSpecError, match=words):
        load(broken, {"cpu": "1GiB"})
    for not_a_path in (None, 5):
        with pytest.raises(ModelSpecError, match="load\\(\\) reads a checkpoint directory: pass its path"):
            load(not_a_path, {"cpu": "1GiB"})


def test_a_checkpoint_missing_a_weight_is_refused_not_filled_at_random(tmp_path_factory, tmp_path):
    """A missing tensor sent the load through transformers' converting path, which started it at random (its load
    report the only sign)."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, path, _ = saved_tiny("llama", tmp_path_factory.mktemp("missing"))
    cut = tmp_path / "cut"
    shutil.copytree(path, cut)
    tensors = load_file(cut / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, cut / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DispatchError, match=r"1 weight\(s\) are not in the checkpoint: "
                                            r"model.layers.1.mlp.up_proj.weight: transformers would start them at random"):
        load(cut, {"cpu": "1GiB"})
