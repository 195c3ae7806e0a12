"""A catalog of well-known models, rebuilt from their published hyperparameters.

No weights and no hub access: each preset is a ``transformers`` config built from the numbers in the
model's published ``config.json`` / paper, so :func:`placement_opt.trace` can build the model on the
meta device and plan it anywhere.

Example::

    >>> from placement_opt.model import catalog as models
    >>> "llama-3-70b" in models.list_models()
    True
    >>> models.model_config("llama-3-70b").num_hidden_layers
    80
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ModelSpecError

__all__ = ["ModelPreset", "model_config", "list_models", "describe", "preset"]


@dataclass(frozen=True, kw_only=True)
class ModelPreset:
    """One catalog entry: a config class, its published hyperparameters and the advertised size."""

    name: str
    """Catalog key, lower case (``"llama-3-70b"``)."""
    config_class: str
    """Name of the ``transformers`` config class (``"LlamaConfig"``)."""
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the config class, as published."""
    description: str = ""
    """One line for people: who published it, what it is."""
    advertised_params: float = 0.0
    """Parameter count the publisher advertises (tied weights counted once)."""


_LLAMA2 = {"vocab_size": 32000, "rope_theta": 10000.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "torch_dtype": "float16"}
_LLAMA3 = {"vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001}

_PRESETS: tuple[ModelPreset, ...] = (
    ModelPreset(
        name="llama-2-7b", config_class="LlamaConfig", advertised_params=6.74e9,
        description="Meta Llama 2 7B (2023): 32 layers, MHA, 4k context",
        hyperparameters={**_LLAMA2, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                         "num_attention_heads": 32, "num_key_value_heads": 32},
    ),
    ModelPreset(
        name="llama-2-13b", config_class="LlamaConfig", advertised_params=13.0e9,
        description="Meta Llama 2 13B (2023): 40 layers, MHA, 4k context",
        hyperparameters={**_LLAMA2, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                         "num_attention_heads": 40, "num_key_value_heads": 40},
    ),
    ModelPreset(
        name="llama-2-70b", config_class="LlamaConfig", advertised_params=68.98e9,
        description="Meta Llama 2 70B (2023): 80 layers, GQA with 8 KV heads, 4k context",
        hyperparameters={**_LLAMA2, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                         "num_attention_heads": 64, "num_key_value_heads": 8},
    ),
    ModelPreset(
        name="llama-3-8b", config_class="LlamaConfig", advertised_params=8.03e9,
        description="Meta Llama 3 8B (2024): 32 layers, GQA 8 KV heads, 128k vocabulary, 8k context",
        hyperparameters={**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                         "num_attention_heads": 32, "num_key_value_heads": 8},
    ),
    ModelPreset(
        name="llama-3-70b", config_class="LlamaConfig", advertised_params=70.6e9,
        description="Meta Llama 3 70B (2024): 80 layers, GQA 8 KV heads, 128k vocabulary, 8k context",
        hyperparameters={**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                         "num_attention_heads": 64, "num_key_value_heads": 8},
    ),
    ModelPreset(
        name="llama-3.1-405b", config_class="LlamaConfig", advertised_params=405.9e9,
        description="Meta Llama 3.1 405B (2024): 126 layers, GQA 8 KV heads, 128k context (llama3 RoPE scaling)",
        hyperparameters={**_LLAMA3, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                         "num_attention_heads": 128, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    ),
    ModelPreset(
        name="qwen2-72b", config_class="Qwen2Config", advertised_params=72.7e9,
        description="Alibaba Qwen2 72B (2024): 80 layers, GQA 8 KV heads, 152k vocabulary, QKV biases, 128k context",
        hyperparameters={"vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
                         "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                         "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                         "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    ),
    ModelPreset(
        name="mistral-7b", config_class="MistralConfig", advertised_params=7.24e9,
        description="Mistral 7B v0.1 (2023): 32 layers, GQA 8 KV heads, 4k sliding window",
        hyperparameters={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                         "sliding_window": 4096, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                         "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    ),
    ModelPreset(
        name="mixtral-8x7b", config_class="MixtralConfig", advertised_params=46.7e9,
        description="Mistral Mixtral 8x7B (2023): sparse MoE, 8 experts, 2 per token, 32 layers",
        hyperparameters={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                         "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
                         "rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                         "sliding_window": None, "torch_dtype": "bfloat16"},
    ),
    ModelPreset(
        name="dbrx-132b", config_class="DbrxConfig", advertised_params=132e9,
        description="Databricks DBRX (2024): sparse MoE, 16 experts, 4 per token (36B active), 40 layers, 32k context",
        hyperparameters={"vocab_size": 100352, "d_model": 6144, "n_heads": 48, "n_layers": 40, "max_seq_len": 32768,
                         "attn_config": {"kv_n_heads": 8, "clip_qkv": 8.0, "rope_theta": 500000.0},
                         "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4},
                         "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    ),
    ModelPreset(
        name="gpt2-xl", config_class="GPT2Config", advertised_params=1.56e9,
        description="OpenAI GPT-2 XL (2019): 48 layers, Conv1D projections, tied embeddings, 1k context",
        hyperparameters={"vocab_size": 50257, "n_positions": 1024, "n_embd": 1600, "n_layer": 48, "n_head": 25,
                         "tie_word_embeddings": True, "torch_dtype": "float32"},
    ),
    ModelPreset(
        name="opt-30b", config_class="OPTConfig", advertised_params=30.0e9,
        description="Meta OPT 30B (2022): 48 layers, learned positions, tied embeddings, 2k context",
        hyperparameters={"vocab_size": 50272, "hidden_size": 7168, "ffn_dim": 28672, "num_hidden_layers": 48,
                         "num_attention_heads": 56, "max_position_embeddings": 2048, "word_embed_proj_dim": 7168,
                         "do_layer_norm_before": True, "tie_word_embeddings": True, "torch_dtype": "float16"},
    ),
    ModelPreset(
        name="t5-11b", config_class="T5Config", advertised_params=11.3e9,
        description="Google T5 11B (2019): encoder-decoder, 24+24 blocks, 128 heads of 128, tied embeddings",
        hyperparameters={"vocab_size": 32128, "d_model": 1024, "d_kv": 128, "d_ff": 65536, "num_layers": 24,
                         "num_decoder_layers": 24, "num_heads": 128, "feed_forward_proj": "relu",
                         "relative_attention_num_buckets": 32, "tie_word_embeddings": True,
                         "is_encoder_decoder": True, "torch_dtype": "float32"},
    ),
    ModelPreset(
        name="falcon-40b", config_class="FalconConfig", advertised_params=41.8e9,
        description="TII Falcon 40B (2023): 60 layers, parallel attention, 8 KV groups, 2k context",
        hyperparameters={"vocab_size": 65024, "hidden_size": 8192, "num_hidden_layers": 60, "num_attention_heads": 128,
                         "num_kv_heads": 8, "new_decoder_architecture": True, "parallel_attn": True, "bias": False,
                         "alibi": False, "multi_query": True, "tie_word_embeddings": False,
                         "torch_dtype": "bfloat16"},
    ),
    ModelPreset(
        name="gemma-2-9b", config_class="Gemma2Config", advertised_params=9.24e9,
        description="Google Gemma 2 9B (2024): 42 layers, alternating 4k sliding/global attention, tied embeddings",
        hyperparameters={"vocab_size": 256000, "hidden_size": 3584, "intermediate_size": 14336,
                         "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                         "query_pre_attn_scalar": 256, "sliding_window": 4096, "max_position_embeddings": 8192,
                         "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "rope_theta": 10000.0,
                         "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
    ),
    ModelPreset(
        name="gemma-2-27b", config_class="Gemma2Config", advertised_params=27.2e9,
        description="Google Gemma 2 27B (2024): 46 layers, alternating 4k sliding/global attention, tied embeddings",
        hyperparameters={"vocab_size": 256000, "hidden_size": 4608, "intermediate_size": 36864,
                         "num_hidden_layers": 46, "num_attention_heads": 32, "num_key_value_heads": 16,
                         "head_dim": 128, "query_pre_attn_scalar": 144, "sliding_window": 4096,
                         "max_position_embeddings": 8192, "final_logit_softcapping": 30.0,
                         "attn_logit_softcapping": 50.0, "rope_theta": 10000.0, "tie_word_embeddings": True,
                         "torch_dtype": "bfloat16"},
    ),
    ModelPreset(
        name="bert-large", config_class="BertConfig", advertised_params=335e6,
        description="Google BERT large uncased (2018): 24-layer encoder, 512 positions",
        hyperparameters={"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                         "intermediate_size": 4096, "max_position_embeddings": 512, "type_vocab_size": 2,
                         "torch_dtype": "float32"},
    ),
)

_BY_NAME: dict[str, ModelPreset] = {p.name: p for p in _PRESETS}


def list_models() -> list[str]:
    """Names of every preset, in catalog order (``["llama-2-7b", ..., "bert-large"]``)."""
    return [p.name for p in _PRESETS]


def preset(name: str) -> ModelPreset:
    """The catalog entry called ``name`` (case-insensitive).

    Raises:
        ModelSpecError: unknown name; the message lists the known ones.
    """
    key = name.strip().lower()
    if key not in _BY_NAME:
        raise ModelSpecError(f"unknown model preset {name!r}: known presets are {', '.join(list_models())}")
    return _BY_NAME[key]


def describe(name: str) -> str:
    """One line about the preset: ``"Meta Llama 3 70B (2024): ..."``."""
    return preset(name).description


def model_config(name: str) -> Any:
    """A fresh ``transformers.PretrainedConfig`` for the preset ``name`` (nothing downloaded).

    Example::

        >>> from placement_opt.model.catalog import model_config
        >>> cfg = model_config("mixtral-8x7b")
        >>> (cfg.num_local_experts, cfg.num_experts_per_tok)
        (8, 2)

    Raises:
        ModelSpecError: unknown name; the message lists the known ones.
    """
    entry = preset(name)
    import transformers

    config_cls = getattr(transformers, entry.config_class)
    hyper = dict(entry.hyperparameters)
    torch_dtype = hyper.pop("torch_dtype", None)
    config = config_cls(**hyper)
    if torch_dtype is not None:
        config.dtype = torch_dtype
    config.name_or_path = entry.name
    return config
