"""A config that ties lm_head to the embeddings, a checkpoint that stores both with other values: from_pretrained
keeps them apart (the checkpoint wins), and so must load(), trace() and the plan built from the directory."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from _models import tiny
from placement_opt.errors import ModelSpecError
from placement_opt.model.tracer import trace
from placement_opt.runtime.loader import load


def _checkpoint(family: str, path, *, same: bool = False) -> torch.Tensor:
    """``family``'s tiny model, its config tying lm_head to the embeddings, saved to ``path``; then its own output
    head written beside the embeddings (other values, or ``same`` ones)."""
    model = tiny(family)
    model.config.tie_word_embeddings = True  # the tiny Llama's config does not tie: make it
    model.tie_weights()
    model.save_pretrained(path)
    state = load_file(path / "model.safetensors")
    source = model.get_input_embeddings().weight.detach()
    state["lm_head.weight"] = source.clone() if same else torch.randn_like(source)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return state["lm_head.weight"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_head_stored_apart_with_other_values_is_loaded_untied_as_from_pretrained_does(family, tmp_path):
    stored = _checkpoint(family, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(reference.get_output_embeddings().weight, stored)  # transformers kept the checkpoint's head
    with pytest.warns(UserWarning, match="kept apart, as from_pretrained does"):
        handle = load(tmp_path, {"cpu": "64MiB"})
    model = handle.model
    assert torch.equal(model.get_output_embeddings().weight, stored)
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(handle(input_ids=ids).logits, reference(input_ids=ids).logits)
    # the plan counted the head's own bytes: a trace of the directory holds them, as the loaded model does
    with pytest.warns(UserWarning, match="kept apart"):
        graph = trace(str(tmp_path))
    params = sum(p.numel() * p.element_size() for p in model.parameters())  # distinct tensors: the head counted
    assert graph.total_param_bytes == params
    handle.remove()


def test_a_head_stored_beside_equal_embeddings_stays_tied(tmp_path):
    _checkpoint("gpt2", tmp_path, same=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no untie warning
        handle = load(tmp_path, {"cpu": "64MiB"})
    model = handle.model
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    handle.remove()


def test_some_ties_apart_and_some_not_is_refused_with_what_to_do(tmp_path):
    """T5 ties three weights to ``shared``; a config cannot untie one of them only."""
    model = tiny("t5")
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = torch.randn_like(state["shared.weight"])
    state["encoder.embed_tokens.weight"] = state["shared.weight"].clone()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelSpecError, match="cannot untie some ties only.*from_pretrained"):
        trace(str(tmp_path))
