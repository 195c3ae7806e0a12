"""The prompt's attention is priced at the pairs its kernel computes (``kernels.prompt_attention_pairs``).

sdpa skips the blocks above the diagonal only when transformers hands it no mask and its causal flag; given a
mask it computes every query x key pair (measured on this project's 2-core CPU, 16 heads of 64, fp32: at 2048
tokens the causal mask took 2.0x the flag's time, a 512-token sliding window's mask 2.0x, as no mask at all).
So which call the run makes decides the price: recorded here from real forwards of tiny random models.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

from placement_opt.cost.context import PricingContext
from placement_opt.cost.kernels import prompt_attention_pairs
from placement_opt.cost.workload import Workload
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.tracer import trace

WINDOW = 8


def _mistral() -> torch.nn.Module:
    torch.manual_seed(0)
    config = T.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             sliding_window=WINDOW, attn_implementation="sdpa")
    return T.MistralForCausalLM(config).eval()


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           attn_implementation="sdpa")
    return T.LlamaForCausalLM(config).eval()


def _sdpa_calls(model: torch.nn.Module, prompt: int, padded: bool, monkeypatch) -> list[tuple[int, bool]]:
    """(query length, whether every pair is computed) of each sdpa call a batch-2 forward of ``prompt`` makes."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((query.shape[-2], attn_mask is not None or not is_causal))
        return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    ids = torch.randint(3, 60, (2, prompt))
    mask = torch.ones(2, prompt, dtype=torch.long)
    if padded:
        mask[0, 0] = 0  # the first sequence one token shorter, padded on the left
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    return calls


@pytest.mark.parametrize("family", ["mistral", "llama"])
@pytest.mark.parametrize("prompt", [4, WINDOW - 1, WINDOW, 13])
@pytest.mark.parametrize("padded", [False, True])
def test_the_prompt_pairs_are_the_ones_the_kernel_the_run_calls_computes(family, prompt, padded, monkeypatch):
    """Every pair where the run hands sdpa a mask (a padded batch; Mistral's prompt reaching its window), the
    causal half where it hands the flag alone."""
    model = _mistral() if family == "mistral" else _llama()
    graph = trace(model, seq_len=4)
    calls = _sdpa_calls(model, prompt, padded, monkeypatch)
    assert calls and all(q == prompt for q, _ in calls)
    every_pair = {full for _, full in calls}
    assert len(every_pair) == 1, calls  # both layers alike
    ctx = PricingContext(graph, Machine([Device("cpu", 2**40, flops=1e12, bandwidth=1e11)]),
                         Workload(batch_size=2, prompt_len=prompt, new_tokens=1, padded=padded))
    layers = [graph.unit(n) for n in graph.names() if graph.unit(n).attn_flops_per_token_per_ctx]
    assert len(layers) == 2
    want = prompt * prompt if every_pair.pop() else prompt * (prompt + 1) / 2
    assert all(prompt_attention_pairs(ctx, unit) == want for unit in layers)


def test_an_encoders_attention_is_priced_at_every_pair_and_its_decoders_at_the_causal_half(monkeypatch):
    """BART's encoder attends both ways (is_causal False: every pair); its decoder's self-attention is causal."""
    torch.manual_seed(0)
    config = T.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          max_position_embeddings=64, attn_implementation="sdpa")
    model = T.BartForConditionalGeneration(config).eval()
    graph = trace(model, seq_len=4)
    ctx = PricingContext(graph, Machine([Device("cpu", 2**40, flops=1e12, bandwidth=1e11)]),
                         Workload(batch_size=1, prompt_len=10, new_tokens=1))
    pairs = {n: prompt_attention_pairs(ctx, graph.unit(n)) for n in graph.names()
             if graph.unit(n).attn_flops_per_token_per_ctx}
    encoder = {n for n in pairs if ".encoder." in n or n.startswith("model.encoder")}
    assert encoder and encoder != set(pairs), pairs
    assert all(pairs[n] == 100 for n in encoder) and all(pairs[n] == 55 for n in set(pairs) - encoder), pairs


def test_flash_attention_skips_what_the_window_leaves_out():
    """flash-attention and flex-attention compute a sliding window's band only: sum_i min(i, window)."""
    model = _mistral()
    graph = trace(model, seq_len=4)
    graph.meta.extra["attn_implementation"] = "flash_attention_2"
    layer = next(graph.unit(n) for n in graph.names() if graph.unit(n).attn_flops_per_token_per_ctx)
    for prompt, padded in ((5, False), (WINDOW, True), (20, False), (20, True)):
        ctx = PricingContext(graph, Machine([Device("cpu", 2**40, flops=1e12, bandwidth=1e11)]),
                             Workload(prompt_len=prompt, new_tokens=1, padded=padded))
        assert prompt_attention_pairs(ctx, layer) == sum(min(i, WINDOW) for i in range(1, prompt + 1))
