"""trace() across transformers' architectures: how each is built from its config, the attention work an encoder's
prompt costs, and the module a user hands over (compiled, or with no_split classes it does not have)."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from placement_opt.errors import TraceError
from placement_opt.model.tracer import trace

# encoder types whose causal-LM class (run without is_decoder: bidirectional, no cache) the trace built, with an LM
# head and a KV cache they never keep; Reformer's refused to be built at all
ENCODERS = ["xlm-roberta-xl", "roberta-prelayernorm", "roformer", "big_bird", "megatron-bert", "data2vec-text",
            "bert-generation", "reformer"]


def _quiet_trace(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - trace()'s own arguments
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(*args, **kwargs)


@pytest.mark.parametrize("model_type", ENCODERS)
def test_an_encoder_config_is_traced_as_the_encoder_without_a_kv_cache(model_type: str) -> None:
    config = transformers.CONFIG_MAPPING[model_type]()
    for key in ("num_hidden_layers", "num_layers"):
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, 2)
    graph = _quiet_trace(config, seq_len=16)
    assert graph.meta.traced
    assert graph.meta.extra["kv_cache"] is False
    assert sum(unit.kv_bytes_per_token for unit in graph.units()) == 0
    # the bare encoder, as AutoModel builds it: no LM head (built on meta: xlm-roberta-xl's embedding is 2.5 GB)
    with torch.device("meta"):
        bare = transformers.AutoModel.from_config(config)
    assert graph.meta.extra["module_class"] == type(bare).__name__


def test_an_encoder_config_that_says_is_decoder_is_a_decoder_with_its_cache() -> None:
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, is_decoder=True)
    graph = _quiet_trace(config, seq_len=16, dtype="float32")
    assert graph.meta.extra["module_class"] == "BertLMHeadModel"
    assert [u.kv_bytes_per_token for u in graph.units() if u.kv_bytes_per_token] == [2 * 32 * 4] * 2


def _attention_flops_per_ctx(model: torch.nn.Module, layer: torch.nn.Module, inputs) -> float:  # noqa: ANN001
    """FLOPs per token per context token of ``layer`` in a real forward: its growth between two prompt lengths."""
    counts = []
    for length in (16, 32):
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(**inputs(length))
        counts.append(sum(sum(c.values()) for m, c in counter.get_flop_counts().items()
                          if m.endswith(layer)) / length)
    return (counts[1] - counts[0]) / 16


@pytest.mark.parametrize("family", ["bart", "modernbert"])
def test_an_encoder_layer_s_attention_grows_with_the_prompt_as_the_real_forward_does(family: str) -> None:
    """Bidirectional attention (is_causal False: BART's encoder, ModernBERT) reported no FLOPs per context token, so
    its score matmuls were priced as at the traced 64 tokens for any prompt; BERT's and T5's encoders had them."""
    if family == "bart":
        config = transformers.BartConfig(vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                         decoder_ffn_dim=64, max_position_embeddings=64)
        auto, unit, layer = transformers.AutoModelForSeq2SeqLM, "model.encoder.layers.0", "encoder.layers.0"
    else:
        config = transformers.ModernBertConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, pad_token_id=0,
                                               bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0)
        auto, unit, layer = transformers.AutoModel, "layers.0", "layers.0"
    model = auto.from_config(config, attn_implementation="eager").eval()

    def inputs(length: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 128, (1, length))
        return {"input_ids": ids, "decoder_input_ids": ids[:, :1]} if family == "bart" else {"input_ids": ids}

    traced = _quiet_trace(config, seq_len=16, dtype="float32").unit(unit)
    assert traced.attn_flops_per_token_per_ctx == 2 * 4 * (8 + 8)  # QK^T and AV: 4 heads of 8
    assert traced.attn_flops_per_token_per_ctx == _attention_flops_per_ctx(model, layer, inputs)
    assert traced.attn_flops_per_token_per_ctx * 16 <= traced.flops_per_token


def test_a_vision_tower_s_attention_is_not_priced_per_prompt_token() -> None:
    config = transformers.LlavaConfig()
    config.text_config.num_hidden_layers = 1
    config.vision_config.num_hidden_layers = 1
    graph = _quiet_trace(config, dtype="float32")
    assert [u.name for u in graph.units() if u.attn_flops_per_token_per_ctx] == ["model.language_model.layers.0"]


def _tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_a_compiled_model_traces_as_the_module_it_compiled() -> None:
    """torch.compile's wrapper fell back to a static graph (its forward is an instance attribute the meta copy drops),
    every unit named ``_orig_mod.``..., which no checkpoint's device map has."""
    model = _tiny_llama()
    compiled = torch.compile(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        graph = trace(compiled, seq_len=16)
    plain = trace(model, seq_len=16)
    assert graph.meta.traced
    assert graph.names() == plain.names()
    assert [u.flops_per_token for u in graph.units()] == [u.flops_per_token for u in plain.units()]


def test_no_split_classes_the_model_lacks_are_refused_with_the_close_match() -> None:
    model = _tiny_llama()
    with pytest.raises(TraceError, match="did you mean LlamaDecoderLayer") as info:
        trace(model, no_split=["LLamaDecoderLayer"])
    assert "['LlamaDecoderLayer']" in str(info.value)
    # one name it has is enough (a list meant for several models), and an empty list keeps nothing whole
    assert trace(model, no_split=["LlamaDecoderLayer", "MistralDecoderLayer"]).names() == trace(model).names()
    assert "model.layers.0.self_attn.q_proj" in trace(model, no_split=[]).names()
