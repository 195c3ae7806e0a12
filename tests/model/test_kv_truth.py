"""The KV cache a trace records is the one transformers keeps: for each architecture below, the sum over units of
``kv_bytes_per_token`` equals what a meta forward's ``DynamicCache`` holds per token, layer kinds included (grouped
heads, sliding windows, DeepSeek's latent attention, MiniMax's linear-attention layers, Falcon-H1's hybrid layers,
Gemma-4's per-layer heads, Gemma-3n's layers that reuse an earlier layer's cache, Falcon's grouped keys cached per
head, MiMo-V2-Flash's sliding layers of other head counts, Phi-4-multimodal's media encoders)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

from placement_opt.model.tracer import trace
from placement_opt.runtime.timing import cache_argument, cache_of

TOKENS = 16

# model type -> config overrides (transformers' defaults otherwise, cut to 4 layers)
CASES = {
    "llama": {"num_key_value_heads": 8},
    "gemma2": {},
    "deepseek_v3": {"first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1,
                    "topk_group": 1},
    "minimax": {"layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]},
    "gemma4_text": {},
    "falcon_h1": {},  # a hybrid: each layer's cache holds a linear state and its attention's KV
    "gemma3n_text": {"num_kv_shared_layers": 2},  # the last two layers reuse earlier layers' keys and values
    # Falcon-40B's layout: transformers caches the 4 KV groups broadcast to all 16 heads (the trace said 4)
    "falcon": {"hidden_size": 1024, "num_attention_heads": 16, "num_kv_heads": 4, "new_decoder_architecture": True},
    # sliding layers with twice the config's num_key_value_heads, told only by num_key_value_groups (the trace
    # charged them the config's)
    "mimo_v2_flash": {},
    # a vision and an audio encoder named image_embed and audio_embed: charged a KV cache in every decode step
    "phi4_multimodal": {},
}


def _config(model_type: str) -> object:
    cls = transformers.CONFIG_MAPPING[model_type]
    config = cls(num_hidden_layers=4, **CASES[model_type])
    if getattr(config, "layer_types", None) is not None and len(config.layer_types) != 4:
        config.layer_types = list(config.layer_types)[:4]
    config.dtype = "float32"
    return config


def _cache_bytes_per_token(config: object) -> int:
    from placement_opt.model._meta_experts import stand_in_experts

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    stand_in_experts(model, lambda experts: getattr(config, "num_experts_per_tok", None) or 2)  # routing on meta
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, TOKENS, dtype=torch.long, device="meta"), use_cache=True)
    total = 0
    for layer in cache_of(out).layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 3:
                total += tensor.numel() * tensor.element_size()
    return total // TOKENS


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_the_traced_kv_cache_is_the_one_transformers_keeps(model_type: str) -> None:
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config = _config(model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(copy.deepcopy(config), dtype="float32")
    traced = sum(unit.kv_bytes_per_token for unit in graph.units())
    assert traced == _cache_bytes_per_token(config)


def test_a_bart_decoders_encoder_attention_is_cross_attention_not_a_second_self_cache() -> None:
    """BART's family names its decoder's cross-attention ``encoder_attn``: its keys and values are the encoder's, once
    per prompt, not a second cache that grows with each token."""
    config = transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                     decoder_ffn_dim=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(config, dtype="float32")
    per_layer = 2 * 64 * 4  # keys and values of d_model, float32
    assert sum(unit.kv_bytes_per_token for unit in graph.units()) == 2 * per_layer  # two decoder layers
    assert graph.meta.extra["cross_attn_kv_bytes_per_token"] > 0


def test_a_multimodal_config_is_traced_with_its_lm_head_and_its_vision_tower_keeps_no_cache() -> None:
    """LLaVA has no causal-LM class: it was built as the bare LlavaModel (no lm_head, so no plan could match its
    checkpoint), and its vision tower's attention was charged a KV cache in every decode step."""
    config = transformers.LlavaConfig()
    config.text_config.num_hidden_layers = 2
    config.vision_config.num_hidden_layers = 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(config, dtype="float32")
    assert graph.meta.extra["module_class"] == "LlavaForConditionalGeneration" and "lm_head" in graph.names()
    cached = [u.name for u in graph.units() if u.kv_bytes_per_token]
    assert cached == ["model.language_model.layers.0", "model.language_model.layers.1"]
    assert not any(u.in_decode for u in graph.units() if u.name.startswith("model.vision_tower"))


def test_a_latent_attention_decode_step_s_flops_per_cached_token_are_the_traced_ones() -> None:
    """transformers expands DeepSeek's cached latents through ``kv_b_proj`` at every step: counted by torch's flop
    counter over two contexts, a step's FLOPs grow per cached token by the attention's query x key term plus that
    expansion, which the trace records apart (here 26x the attention term; on DeepSeek-V3 410x)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        vocab_size=512)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    graph = trace(model, seq_len=TOKENS)

    def step_flops(context: int) -> dict[str, int]:
        with torch.no_grad():
            cache = cache_of(model(input_ids=torch.randint(0, 512, (1, context)), use_cache=True))
            counter = FlopCounterMode(display=False)
            with counter:
                model(input_ids=torch.randint(0, 512, (1, 1)), **cache_argument(model, cache), use_cache=True)
        return {name: sum(counts.values()) for name, counts in counter.get_flop_counts().items()}

    short, long = step_flops(100), step_flops(300)
    for index in (0, 1):
        unit = graph.unit(f"model.layers.{index}")
        key = f"{type(model).__name__}.model.layers.{index}"
        per_cached_token = (long[key] - short[key]) / 200
        assert per_cached_token == unit.attn_flops_per_token_per_ctx + unit.latent_expand_flops_per_ctx
        assert unit.latent_expand_flops_per_ctx == 2 * 32 * 4 * (16 + 16)  # kv_lora_rank x heads x (nope + v)
    assert all(u.latent_expand_flops_per_ctx is None for u in trace(_config("llama")).units())
