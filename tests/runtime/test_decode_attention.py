"""Decode steps run with cuDNN's attention off, prefills with torch's choice, and the switch is put back."""

from __future__ import annotations

import pytest
import torch

from _models import tiny
from placement_opt.runtime._decode_attention import (
    cudnn_attention_off,
    decode_without_cudnn_attention,
)
from placement_opt.runtime.timing import cache_argument, cache_of


@pytest.fixture(autouse=True)
def _cudnn_attention_on():
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    torch.backends.cuda.enable_cudnn_sdp(was)


def test_the_switch_is_put_back_after_the_block_and_after_an_error():
    with cudnn_attention_off():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(ValueError), cudnn_attention_off():
        raise ValueError("boom")
    assert torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)  # off already: left off
    with cudnn_attention_off():
        pass
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def _seen_by_layer(model) -> list[tuple[int, bool]]:
    """(tokens, cuDNN attention on) at each call of the first decoder layer."""
    seen: list[tuple[int, bool]] = []
    model.model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append((args[0].shape[1], torch.backends.cuda.cudnn_sdp_enabled())))
    return seen


def test_generate_runs_its_decode_steps_without_cudnn_attention_and_its_prefill_with_it():
    model = tiny("llama").eval()
    seen = _seen_by_layer(model)
    remove = decode_without_cudnn_attention(model)
    ids = torch.randint(0, 128, (2, 5))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 9)
    assert seen == [(5, True), (1, False), (1, False), (1, False)]
    assert torch.backends.cuda.cudnn_sdp_enabled()
    remove()
    seen.clear()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    assert seen == [(5, True), (1, True)]  # removed: torch's choice in every call


def test_a_decode_step_that_fails_puts_the_switch_back():
    model = tiny("llama").eval()
    remove = decode_without_cudnn_attention(model)
    with torch.no_grad():
        cache = cache_of(model(input_ids=torch.randint(0, 128, (1, 4)), use_cache=True))

    def fail(module, args):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        raise RuntimeError("a layer failed")

    model.model.layers[1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="a layer failed"), torch.no_grad():
        model(input_ids=torch.randint(0, 128, (1, 1)), **cache_argument(model, cache), use_cache=True)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    remove()
