"""load() and dispatch() leave what the user owns as it was, and say what a full disk or a foreign checkpoint asks.

Tiny random-init Llama (4 layers, hidden 32: 177 KiB of float32 weights) and GPT-2 (3 blocks, 64 learned
positions) written by ``save_pretrained`` into temporary folders.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import re
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _models import (
    MAPPED,
    RESIDENT,
    assert_restored,
    inputs_for,
    plan_from,
    saved_tiny,
    snapshot,
    tiny,
)
from placement_opt.cost.workload import Workload
from placement_opt.errors import DispatchError, WorkloadError
from placement_opt.model._ties import checkpoint_safetensors
from placement_opt.runtime import offload
from placement_opt.runtime.dispatcher import dispatch
from placement_opt.runtime.loader import load


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _layers_on_disk(model: torch.nn.Module):
    return plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT)


def test_an_offload_dir_that_is_the_checkpoint_folder_is_refused_before_anything_is_written(tmp_path):
    """load(path, offload_dir=path) wrote its bfloat16 casts of the disk layers beside the checkpoint's own file; a
    checkpoint not named model.safetensors (read as every *.safetensors there) then loaded those casts as its weights:
    logits off by 1.8e-3, with no word."""
    model, path, _ = saved_tiny("llama", tmp_path / "ckpt")
    before = _files(path)
    with pytest.raises(DispatchError, match=r"offload_dir is the checkpoint folder .*pass offload_dir='some/dir' naming another folder"):
        load(path, None, plan=_layers_on_disk(model), dtype="bfloat16", offload_dir=path)
    with pytest.raises(DispatchError, match=r"offload_dir is the checkpoint folder"):
        load(path, None, plan=_layers_on_disk(model), dtype="bfloat16", offload_dir=path / "." / "")
    assert _files(path) == before


def test_files_an_offload_store_wrote_into_a_checkpoint_folder_are_not_read_as_the_checkpoint(tmp_path):
    """A folder an earlier dispatch() or load() used as its offload_dir holds the store's files of the same tensor
    names (here the layers of other weights): load() reads the checkpoint's own file, not those."""
    model, path, reference = saved_tiny("llama", tmp_path / "ckpt")
    (path / "model.safetensors").rename(path / "consolidated.safetensors")  # found as *.safetensors
    other = tiny("llama")
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(1.0)
    dispatch(other, _layers_on_disk(other), offload_dir=path).remove()
    assert len(list(path.glob("model.layers.*.safetensors"))) == 4
    handle = load(path, None, plan=_layers_on_disk(model))
    with torch.no_grad():
        assert torch.equal(handle(**inputs_for(model)).logits, reference)
    assert {f.path.name for unit in handle._units for f, _ in unit.disk} == {"consolidated.safetensors"}
    # the tie check reads the same listing: the store's files are no checkpoint shards there either
    assert checkpoint_safetensors(path) == [path / "consolidated.safetensors"]


def test_a_checkpoint_of_bin_files_says_how_to_make_it_safetensors(tmp_path):
    model = tiny("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(DispatchError, match=r"PyTorch .bin weights \(pytorch_model\.bin\).*save_pretrained\(path\)"):
        load(tmp_path, None, plan=_layers_on_disk(model))


def test_a_checkpoint_cloned_without_git_lfs_says_to_pull_its_weights(tmp_path):
    model, folder, _ = saved_tiny("llama", tmp_path / "ckpt")
    weights = folder / "model.safetensors"
    weights.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 181248\n")
    with pytest.raises(DispatchError, match="Git LFS pointer.*git lfs pull"):
        load(folder, None, plan=_layers_on_disk(model))


def _full_after(monkeypatch, writes: int) -> None:
    """The offload store's disk is full once ``writes`` files have been written."""
    real = offload.OffloadStore._write_temporary
    done = []

    def write(self, name, layout):
        if len(done) >= writes:
            raise OSError(errno.ENOSPC, "No space left on device")
        done.append(name)
        return real(self, name, layout)

    monkeypatch.setattr(offload.OffloadStore, "_write_temporary", write)


@pytest.mark.parametrize("writes", [0, 2])
def test_dispatch_that_fills_the_disk_says_how_much_it_needs_and_leaves_the_model_as_it_was(monkeypatch, tmp_path,
                                                                                         writes):
    """It said 'failed while placing unit ... (OSError: No space left on device) ... fix the cause': neither the
    folder, nor how much the disk units take, nor what to do."""
    model = tiny("llama")
    before = snapshot(model)
    disk_bytes = sum(t.nbytes for name, t in model.state_dict().items() if ".layers." in name)
    # each layer 9280 float32 (q, o 32x32; k, v 16x32; gate, up, down 64x32; two norms of 32): 36.25 KiB
    _full_after(monkeypatch, writes)
    with pytest.raises(DispatchError) as caught:
        dispatch(model, _layers_on_disk(model), offload_dir=tmp_path)
    text = str(caught.value)
    assert f"ran out of disk space writing unit 'model.layers.{writes}'" in text
    assert str(tmp_path) in text and "free space there or choose a folder on a larger disk" in text
    assert disk_bytes == 4 * 9280 * 4 and "stores 145.00 KiB of weights on disk" in text
    assert re.search(r"[0-9.]+ [KMGT]iB free there now", text)
    assert isinstance(caught.value.__cause__, OSError)
    assert_restored(model, before)


def test_load_that_fills_the_disk_says_how_much_its_plan_writes(monkeypatch, tmp_path):
    model, path, _ = saved_tiny("llama", tmp_path / "ckpt")
    _full_after(monkeypatch, 1)
    # the 4 layers in bfloat16: 4 x 9280 x 2 bytes
    with pytest.raises(DispatchError, match=r"ran out of disk space .* stores 72\.50 KiB of weights on disk, .* free there"):
        load(path, None, plan=_layers_on_disk(model), dtype="bfloat16", offload_dir=tmp_path / "offload")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.integers(1, 90), new_tokens=st.integers(0, 40), training=st.booleans())
def test_a_workload_past_the_learned_position_table_is_refused_before_solving(gpt2_checkpoint, prompt, new_tokens,
                                                                              training):
    """GPT-2 has 64 learned positions (wpe): load() solved and read a plan for 60 + 20 tokens, and generate()
    stopped in the middle with 'IndexError: index out of range in self'. A forward (new_tokens=0) or a training step
    feeds its prompt only: 65 tokens are past the table, 64 are not."""
    workload = Workload(batch_size=1, prompt_len=prompt, new_tokens=new_tokens, training=training)
    generated = 0 if training else new_tokens
    if prompt + max(generated - 1, 0) <= 64:
        load(gpt2_checkpoint, {"cpu": "1GiB"}, workload=workload).remove()
        return
    detail = rf"{prompt} \+ {new_tokens} - 1" if generated > 1 else rf"of prompt_len {prompt}"
    with pytest.raises(WorkloadError, match=rf"64 learned positions \(transformer\.wpe\).*{detail}"):
        load(gpt2_checkpoint, {"cpu": "1GiB"}, workload=workload)


@pytest.mark.parametrize(("prompt", "new_tokens", "training", "refused"),
                         [(64, 0, False, False), (65, 0, False, True), (64, 1, False, False), (64, 2, False, True),
                          (64, 128, True, False), (65, 0, True, True)])
def test_the_position_check_counts_the_tokens_a_forward_feeds(gpt2_checkpoint, prompt, new_tokens, training, refused):
    """At the table's edge: 64 prompt tokens fit, one generated token is never fed back, a training step feeds no
    generated ones whatever its new_tokens (the check counted prompt + new_tokens - 1 in every case)."""
    workload = Workload(batch_size=1, prompt_len=prompt, new_tokens=new_tokens, training=training)
    if refused:
        with pytest.raises(WorkloadError, match="64 learned positions"):
            load(gpt2_checkpoint, {"cpu": "1GiB"}, workload=workload)
    else:
        load(gpt2_checkpoint, {"cpu": "1GiB"}, workload=workload).remove()


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory) -> Path:
    return saved_tiny("gpt2", tmp_path_factory.mktemp("gpt2"))[1]


def test_a_workload_beside_a_plan_past_the_learned_position_table_is_refused(gpt2_checkpoint):
    """As placement-opt run --plan does: the workload the plan is run at, not only the one it was solved for."""
    plan = plan_from(tiny("gpt2"), lambda i, u: RESIDENT)
    with pytest.raises(WorkloadError, match="64 learned positions"):
        load(gpt2_checkpoint, None, plan=plan, workload=Workload(batch_size=1, prompt_len=60, new_tokens=20))


def test_a_compiled_model_is_refused_with_the_module_it_compiled_named():
    """trace() plans torch.compile's wrapper as the module it wraps; dispatch() of the wrapper said the plan's units
    were 'not modules of OptimizedModule' and to solve a plan for this model, which is what had been done."""
    model = tiny("llama")
    compiled = torch.compile(model)
    plan = plan_from(model, lambda i, unit: RESIDENT)
    with pytest.raises(DispatchError, match=r"torch.compile's wrapper of a LlamaForCausalLM: dispatch the module it "
                                            r"compiled \(dispatch\(model._orig_mod, plan\)"):
        dispatch(compiled, plan)
    dispatch(compiled._orig_mod, plan).remove()


@pytest.mark.parametrize(("batch", "prompt", "new", "warned"), [
    (1, 8, 4, ()),                                  # the plan's own
    (1, 4, 2, ()),                                  # less of everything
    (2, 8, 4, ("in the KV cache", "prompt tokens")),  # twice the sequences: both
    (1, 8, 12, ("in the KV cache",)),                 # a longer context, the same prompt
    (1, 9, 1, ("prompt tokens",)),                  # a longer prompt, a cache no longer
])
def test_a_workload_beside_a_plan_holding_more_than_it_counted_is_warned_of_before_reading(
        gpt2_checkpoint, batch, prompt, new, warned):
    """load() ran a given plan at the workload beside it with no word until generate() passed the plan's memory:
    the warning now comes before the checkpoint is read, naming what is past the plan's."""
    plan = dataclasses.replace(plan_from(tiny("gpt2"), lambda i, u: RESIDENT),
                               workload=Workload(batch_size=1, prompt_len=8, new_tokens=4))
    workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(gpt2_checkpoint, None, plan=plan, workload=workload).remove()
    said = [str(w.message) for w in caught if "beside the plan" in str(w.message)]
    if not warned:
        assert not said, said
        return
    (message,) = said
    assert "leave plan out" in message, message
    assert {what for what in ("in the KV cache", "prompt tokens") if what in message} == set(warned), message


def test_a_workload_warned_of_by_load_is_not_warned_of_again_by_its_calls(gpt2_checkpoint):
    """load() warned of the workload beside its plan, then the first call of that workload warned again in other
    words; a call past that workload is still warned of."""
    import placement_opt

    plan = placement_opt.solve(str(gpt2_checkpoint), "cpu=1GB", workload=Workload(batch_size=1, prompt_len=8,
                                                                                    new_tokens=4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = load(gpt2_checkpoint, None, plan=plan, workload=Workload(batch_size=2, prompt_len=16, new_tokens=4))
    try:
        assert len([w for w in caught if "beside the plan" in str(w.message)]) == 1
        ids = torch.randint(0, 100, (2, 16))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                handle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert not [str(w.message) for w in caught if "this call" in str(w.message)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                handle(torch.cat([ids, ids]))  # 4 sequences: past the workload load() named too
        assert [str(w.message) for w in caught if "this call" in str(w.message)]
    finally:
        handle.remove()


def test_a_vision_towers_patch_positions_are_not_the_text_models_limit():
    """LLaVA's CLIP tower holds 577 learned patch positions and its Llama text model none (rotary): load() and run
    refused a 1024-token prompt as past '577 learned positions (model.vision_tower.embeddings.position_embedding)'."""
    import transformers

    from placement_opt.runtime.checkpoint import learned_positions

    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=336, patch_size=14)
    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        llava = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(vision_config=vision,
                                                                                   text_config=text))
    assert learned_positions(llava) is None
    assert llava.model.vision_tower.embeddings.position_embedding.num_embeddings == 577  # there, unread
