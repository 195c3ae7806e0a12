"""trace(): every family the issue names, on tiny configs; acceptance checks against accelerate and
FlopCounterMode on real (random-init, CPU) copies of the same tiny models."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers
from accelerate.utils import compute_module_sizes
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from placement_opt.errors import TraceError
from placement_opt.model import catalog as models
from placement_opt.model.graph import LayerGraph
from placement_opt.model.tracer import trace

# hidden 32, 4 heads of 8, vocab 128 everywhere: every number below is small enough to check by hand
TINY = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2),
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=8),
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
    "opt": lambda: transformers.OPTConfig(
        vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=0, eos_token_id=0),
    "falcon": lambda: transformers.FalconConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, bos_token_id=0, eos_token_id=0),
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8),
    "t5": lambda: transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0),
    "bert": lambda: transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64),
}
SEQ = 16


def _real_model(family: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A random-init CPU copy of the tiny model, tied like a loaded checkpoint."""
    config = TINY[family]()
    if config.is_encoder_decoder:
        auto = transformers.AutoModelForSeq2SeqLM
    elif family == "bert":
        auto = transformers.AutoModel
    else:
        auto = transformers.AutoModelForCausalLM
    # eager attention and experts: FlopCounterMode has no formula for transformers' grouped-mm experts
    extra = {"experts_implementation": "eager"} if family == "mixtral" else {}
    model = auto.from_config(config, dtype=dtype, attn_implementation="eager", **extra).eval()
    model.tie_weights()
    return model


def _real_inputs(model: nn.Module, batch: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (batch, SEQ))
    inputs = {"input_ids": ids}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(0, 128, (batch, SEQ))
    return inputs


# -- families ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(TINY))
def test_every_family_traces_to_a_valid_graph(family: str) -> None:
    graph = trace(TINY[family](), seq_len=SEQ)
    graph.validate()
    assert graph.meta.traced
    names = graph.names()
    # edges point forward in execution order, and the graph is one connected DAG
    position = {n: i for i, n in enumerate(names)}
    assert all(position[u] < position[v] for u, v, _ in graph.edges())
    reached = {v for _, v, _ in graph.edges()} | {u for u, _, _ in graph.edges()}
    executed = [n for n in names if graph.unit(n).flops_per_token or graph.unit(n).out_bytes_per_token]
    assert set(executed) <= reached
    assert all(b > 0 for _, _, b in graph.edges())


def test_llama_units_attributes_by_hand() -> None:
    graph = trace(TINY["llama"](), seq_len=SEQ, dtype="float16")
    assert graph.names() == ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1",
                             "model.norm", "lm_head"]
    layer = graph.unit("model.layers.0")
    # q 32x32 + k 32x16 + v 32x16 + o 32x32 + mlp 3 x 32x64 + 2 norms of 32 = 9280 params, fp16
    assert layer.param_bytes == 9280 * 2
    # 2 x (9216 matmul params) + attention 4 x 4 heads x 8 x seq 16
    assert layer.flops_per_token == 2 * 9216 + 2048
    assert layer.attn_flops_per_token_per_ctx == 4 * 4 * 8
    assert layer.kv_bytes_per_token == 2 * 2 * 8 * 2  # K and V, 2 KV heads of 8, fp16
    assert layer.out_bytes_per_token == 32 * 2
    # inv_freq and original_inv_freq: head_dim / 2 floats each, kept in float32 by transformers
    assert graph.unit("model.rotary_emb").buffer_bytes == 2 * 4 * 4
    assert graph.unit("lm_head").out_bytes_per_token == 128 * 2
    assert graph.unit("lm_head").flops_per_token == 2 * 32 * 128
    # rotary (cos, sin) reach every layer; hidden states form the chain
    edges = {(u, v): b for u, v, b in graph.edges()}
    assert edges[("model.rotary_emb", "model.layers.0")] == edges[("model.rotary_emb", "model.layers.1")] == 2 * 8 * 2
    assert edges[("model.layers.0", "model.layers.1")] == 32 * 2
    assert graph.meta.extra["num_key_value_heads"] == 2
    assert graph.meta.no_split == ("LlamaDecoderLayer",)


def test_mixtral_moe_fused_experts() -> None:
    graph = trace(TINY["mixtral"](), seq_len=SEQ, dtype="float16")
    layer = graph.unit("model.layers.0")
    assert (layer.moe_num_experts, layer.moe_experts_per_token) == (4, 2)
    assert layer.moe_expert_bytes == 4 * 3 * 32 * 64 * 2  # 4 experts x (gate, up, down) 32x64, fp16
    # attention 2 x 3072 + 2048, router 2 x 32 x 4, two experts of 2 x 3 x 32 x 64 each
    assert layer.flops_per_token == 2 * 3072 + 2048 + 2 * 32 * 4 + 2 * (2 * 3 * 32 * 64)
    assert graph.unit("model.embed_tokens").moe_num_experts == 0


def test_units_say_what_accelerate_loads_of_them_at_once_and_keep_it_through_json() -> None:
    """accelerate's hooks load each module's own parameters at once: a Llama layer's largest is an MLP projection
    (32 x 64, fp16), and copying it out of its file's map holds the map and the copy; a Mixtral layer's is its
    fused experts (gate_up 4 x 128 x 32, then down 4 x 32 x 64: the worst moment is gate_up's copy beside its map,
    or down's beside the gate_up copy). Units without parameters have neither; expert groups, which accelerate
    never runs, neither."""
    from placement_opt.model.expert_groups import split_expert_units

    llama = trace(TINY["llama"](), seq_len=SEQ, dtype="float16")
    layer = llama.unit("model.layers.0")
    assert (layer.largest_module_bytes, layer.largest_load_bytes) == (32 * 64 * 2, 2 * 32 * 64 * 2)
    assert llama.unit("model.rotary_emb").largest_module_bytes is None
    assert llama.unit("lm_head").largest_module_bytes == 128 * 32 * 2
    again = LayerGraph.from_json(llama.to_json()).unit("model.layers.0")
    assert (again.largest_module_bytes, again.largest_load_bytes) == (layer.largest_module_bytes,
                                                                       layer.largest_load_bytes)
    mixtral = trace(TINY["mixtral"](), seq_len=SEQ, dtype="float16", granularity="sublayer")
    experts = mixtral.unit("model.layers.0.mlp.experts")
    gate_up, down = 4 * 128 * 32 * 2, 4 * 32 * 64 * 2
    assert experts.largest_module_bytes == gate_up + down
    assert experts.largest_load_bytes == max(2 * gate_up, gate_up + 2 * down)
    grouped = split_expert_units(mixtral, 2, ["model.layers.0.mlp.experts"])
    assert grouped.unit("model.layers.0.mlp.experts.groups.0").largest_module_bytes is None


def test_a_graph_written_without_load_figures_prices_accelerates_buffer_as_the_whole_unit() -> None:
    from placement_opt.cost.memory import accelerate_held_bytes

    data = trace(TINY["llama"](), seq_len=SEQ, dtype="float16").to_dict()
    for node in data["nodes"]:
        node.pop("largest_module_bytes", None)
        node.pop("largest_load_bytes", None)
    layer = LayerGraph.from_dict(data).unit("model.layers.0")
    assert layer.largest_module_bytes is None
    assert accelerate_held_bytes(layer, from_disk_map=True) == layer.weight_bytes


def test_gpt2_tie_reported_and_counted_once() -> None:
    graph = trace(TINY["gpt2"](), seq_len=SEQ, dtype="float32")
    assert graph.meta.tied_param_groups == (("lm_head.weight", "transformer.wte.weight"),)
    assert graph.meta.tied_unit_groups == (("transformer.wte", "lm_head"),)
    assert graph.unit("transformer.wte").param_bytes == 128 * 32 * 4
    assert graph.unit("lm_head").param_bytes == 0
    assert graph.unit("lm_head").param_names == ("lm_head.weight",)
    # Conv1D blocks: c_attn 32x96, c_proj 32x32, c_fc 32x128, c_proj 128x32 (+ biases, 2 layer norms)
    block = graph.unit("transformer.h.0")
    assert block.param_bytes == 4 * (32 * 96 + 96 + 32 * 32 + 32 + 32 * 128 + 128 + 128 * 32 + 32 + 4 * 32)
    # token and position embeddings are summed in glue code: both feed the first block
    assert {u for u, v, _ in graph.edges() if v == "transformer.h.0"} == {"transformer.wte", "transformer.wpe"}


def test_t5_encoder_decoder_cross_edges_and_decode_flags() -> None:
    graph = trace(TINY["t5"](), seq_len=SEQ, dtype="float16")
    assert graph.meta.is_encoder_decoder
    assert not graph.is_chain()
    decoder_blocks = [n for n in graph.names() if n.startswith("decoder.block.")]
    assert len(decoder_blocks) == 2
    for block in decoder_blocks:
        assert ("encoder.final_layer_norm", block) in {(u, v) for u, v, _ in graph.edges()}
        assert graph.unit(block).in_decode
        assert graph.unit(block).kv_bytes_per_token == 2 * 4 * 8 * 2  # self-attention only
    assert not graph.unit("encoder.block.0").in_decode
    assert graph.unit("encoder.block.0").kv_bytes_per_token == 0
    assert graph.meta.extra["cross_attn_kv_bytes_per_token"] == 2 * 4 * 8 * 2
    # shared embedding / lm_head are one tensor, counted once
    group = next(g for g in graph.meta.tied_param_groups if "shared.weight" in g)
    assert "lm_head.weight" in group
    assert sum(graph.unit(n).param_bytes for g in graph.meta.tied_unit_groups for n in g) == 128 * 32 * 2


def test_bert_encoder_has_no_kv_cache() -> None:
    graph = trace(TINY["bert"](), seq_len=SEQ)
    assert graph.names()[0] == "embeddings"
    assert graph.unit("encoder.layer.0").attn_flops_per_token_per_ctx == 4 * 4 * 8
    assert all(u.kv_bytes_per_token == 0 for u in graph.units())
    assert graph.is_chain()


def test_falcon_gemma2_opt_kv_heads() -> None:
    # 2 KV groups of 4 heads of 8, but transformers caches them broadcast to all 4 heads (test_kv_truth.py)
    assert trace(TINY["falcon"](), seq_len=SEQ, dtype="float16").unit("transformer.h.0").kv_bytes_per_token == 2 * 4 * 8 * 2
    gemma = trace(TINY["gemma2"](), seq_len=SEQ, dtype="float16")
    assert gemma.unit("model.layers.0").kv_bytes_per_token == 2 * 2 * 8 * 2
    assert gemma.meta.tied_unit_groups == (("model.embed_tokens", "lm_head"),)
    opt = trace(TINY["opt"](), seq_len=SEQ, dtype="float16")
    assert opt.unit("model.decoder.layers.0").kv_bytes_per_token == 2 * 4 * 8 * 2


def test_plain_sequential() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    graph = trace(model, seq_len=5, batch_size=3)
    assert graph.names() == ["0", "2"]
    assert graph.edges() == [("0", "2", 16 * 4)]
    assert graph.unit("0").flops_per_token == 2 * 8 * 16
    assert graph.unit("0").param_bytes == (8 * 16 + 16) * 4
    assert graph.meta.dtype == "float32"


class _Branchy(nn.Module):
    """x -> a -> b -> c, with a skip a -> c and a side branch s reading x too."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.s = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h) + h + self.s(x)) * self.scale


def test_custom_module_with_branch_and_direct_parameter() -> None:
    graph = trace(_Branchy(), example_inputs=(torch.zeros(2, 4, 8),), seq_len=4, batch_size=2)
    assert set(graph.names()) == {"", "a", "b", "s", "c"}
    edges = {(u, v) for u, v, _ in graph.edges()}
    assert {("a", "b"), ("a", "c"), ("b", "c"), ("s", "c")} <= edges
    assert not graph.is_chain()
    assert graph.unit("").param_names == ("scale",)  # the root owns only its direct parameter


def test_granularity_module_splits_blocks() -> None:
    graph = trace(TINY["llama"](), seq_len=SEQ, granularity="module")
    assert "model.layers.0.self_attn.q_proj" in graph
    assert "model.layers.0" not in graph
    block = trace(TINY["llama"](), seq_len=SEQ)
    assert graph.total_param_bytes == block.total_param_bytes
    assert graph.total_flops_per_token == pytest.approx(block.total_flops_per_token, rel=0.02)
    # the output projection owns the attention (it receives the QK^T and AV glue FLOPs) and its KV cache
    o_proj, layer = graph.unit("model.layers.0.self_attn.o_proj"), block.unit("model.layers.0")
    assert o_proj.kv_bytes_per_token == layer.kv_bytes_per_token > 0
    assert o_proj.attn_flops_per_token_per_ctx == layer.attn_flops_per_token_per_ctx
    assert o_proj.flops_per_token >= o_proj.attn_flops_per_token_per_ctx * SEQ


def test_module_units_know_their_layer_and_keep_it_through_json() -> None:
    """A module unit inside a decoder layer names it (``layer``: what a GPU's launch-ahead overlaps over, as a
    sublayer unit's ``block``); units outside the layers, and every unit of a block or sublayer graph, have none."""
    graph = trace(TINY["llama"](), seq_len=SEQ, granularity="module")
    layers = {u.name: u.layer for u in graph.units()}
    inside = {n: ".".join(n.split(".")[:3]) if n.startswith("model.layers.") else None for n in layers}
    assert layers == inside and set(inside.values()) == {None, "model.layers.0", "model.layers.1"}
    assert {u.name: u.layer for u in LayerGraph.from_json(graph.to_json()).units()} == layers
    for granularity in ("block", "sublayer"):
        assert all(u.layer is None for u in trace(TINY["llama"](), seq_len=SEQ, granularity=granularity).units())
    kept = trace(TINY["llama"](), seq_len=SEQ, granularity="module", no_split={"LlamaDecoderLayer"})
    assert "model.layers.0" in kept and all(u.layer is None for u in kept.units())  # a whole layer is its own


def test_module_units_send_their_output_once_however_many_residual_sums_read_it() -> None:
    """The residual adds run between modules: every later norm reads a sum that derives from an early
    ``o_proj``, but only the projection's own output (one hidden state) leaves its device."""
    config = TINY["llama"]()
    config.num_hidden_layers = 4
    graph = trace(config, seq_len=SEQ, dtype="float16", granularity="module")
    hidden = 32 * 2
    for name in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj", "model.layers.3.mlp.down_proj"):
        assert graph.unit(name).out_bytes_per_token == hidden, name
    # ...while the data flow keeps every read: layer 3's norm still depends on layer 0's projection
    assert ("model.layers.0.self_attn.o_proj", "model.layers.3.input_layernorm", hidden) in graph.edges()


def test_user_no_split_coarsens() -> None:
    graph = trace(TINY["llama"](), seq_len=SEQ, no_split={"LlamaModel"})
    assert graph.names() == ["model", "lm_head"]
    assert graph.edges() == [("model", "lm_head", 32 * 2)]


# -- acceptance: accelerate sizes, FLOPs, weights untouched ------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5", "bert", "mixtral", "falcon"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_unit_bytes_equal_accelerate_compute_module_sizes(family: str, dtype: torch.dtype) -> None:
    model = _real_model(family, dtype)
    sizes = compute_module_sizes(model)
    buffers = compute_module_sizes(model, buffers_only=True)
    graph = trace(model, seq_len=SEQ)
    assert graph.meta.traced
    tied = {n for g in graph.meta.tied_unit_groups for n in g}
    for unit in graph.units():
        if unit.name in tied:
            continue
        assert unit.param_bytes + unit.buffer_bytes == sizes[unit.name], unit.name
        assert unit.buffer_bytes == buffers.get(unit.name, 0), unit.name
    assert graph.total_param_bytes + graph.total_buffer_bytes == sizes[""]


def test_dtype_override_matches_accelerate_rule() -> None:
    model = _real_model("bert", torch.float32)  # int64 position_ids / token_type_ids buffers stay 8 bytes
    sizes = compute_module_sizes(model, dtype=torch.float16)
    graph = trace(model, seq_len=SEQ, dtype=torch.float16)
    assert graph.unit("embeddings").weight_bytes == sizes["embeddings"]
    assert graph.meta.dtype == "float16"


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt", "falcon", "gemma2", "t5", "bert", "mixtral"])
def test_unit_flops_sum_within_2_percent_of_flop_counter(family: str) -> None:
    model = _real_model(family)
    batch = 2
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**_real_inputs(model, batch))
    expected = counter.get_total_flops()
    graph = trace(model, seq_len=SEQ, batch_size=batch)
    assert graph.total_flops_per_token * batch * SEQ == pytest.approx(expected, rel=0.02)


def test_tracing_real_weights_leaves_them_untouched() -> None:
    import psutil

    model = nn.Sequential(nn.Linear(2048, 4096), nn.GELU(), nn.Linear(4096, 2048))  # 2 x 32 MiB of fp32
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    trace(model, seq_len=8)  # warm up imports and caches
    process = psutil.Process()
    rss = process.memory_info().rss
    graph = trace(model, seq_len=8, dtype=torch.float16)
    grown = process.memory_info().rss - rss
    assert grown < 16 * 2**20, f"tracing grew RSS by {grown} bytes"
    for name, param in model.named_parameters():
        assert param.device.type == "cpu"
        assert param.data_ptr() == before[name][0]
        assert torch.equal(param, before[name][1])
    assert graph.unit("0").param_bytes == (2048 * 4096 + 4096) * 2


def test_weights_on_meta_module() -> None:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(TINY["llama"](), dtype=torch.bfloat16)
    graph = trace(model, seq_len=SEQ)
    assert graph.meta.dtype == "bfloat16"
    assert graph.meta.traced


# -- inputs accepted ---------------------------------------------------------------------------------


def test_preset_name_config_json_and_directory(tmp_path) -> None:
    config = TINY["llama"]()
    config.save_pretrained(tmp_path)
    by_dir = trace(str(tmp_path), seq_len=SEQ)
    by_file = trace(tmp_path / "config.json", seq_len=SEQ)
    assert by_dir.to_dict()["nodes"] == by_file.to_dict()["nodes"]
    assert trace("LLaMA-2-7B", seq_len=4).meta.model_name == "llama-2-7b"


def test_hub_id_offline_raises_model_spec_error(monkeypatch) -> None:
    """A name that resolves to nothing is the caller's input (ModelSpecError), not a model that fails to trace."""
    import huggingface_hub.constants

    from placement_opt.errors import ModelSpecError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSpecError, match="local config.json"):
        trace("no-such-org/no-such-model")


def test_bad_arguments() -> None:
    with pytest.raises(TraceError, match="cannot trace a int"):
        trace(42)
    with pytest.raises(ValueError, match="granularity"):
        trace(TINY["llama"](), granularity="layer")
    with pytest.raises(ValueError, match="seq_len"):
        trace(TINY["llama"](), seq_len=0)


def test_config_is_not_mutated() -> None:
    config = models.model_config("llama-2-7b")
    before = config.to_dict()
    trace(config, seq_len=4, dtype="float32")
    assert config.to_dict() == before


# -- fallback ------------------------------------------------------------------------------------------


class _CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.emb = nn.Embedding(10, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        _ = h.cpu().numpy()  # needs real data: impossible on meta
        return self.b(h)


def test_fallback_warns_and_returns_a_static_chain() -> None:
    with pytest.warns(RuntimeWarning, match="static graph"):
        graph = trace(_CustomOp(), example_inputs=(torch.zeros(1, 3, 4),), seq_len=3)
    graph.validate()
    assert not graph.meta.traced
    assert graph.names() == ["a", "emb", "b"]  # registration order
    assert graph.is_chain()
    assert graph.unit("a").flops_per_token == 2 * 4 * 8  # 2 x weight parameters
    assert graph.unit("emb").flops_per_token == 0  # an embedding is a lookup
    assert LayerGraph.from_json(graph.to_json()).to_dict() == graph.to_dict()


def test_json_round_trip_of_a_traced_graph() -> None:
    graph = trace(TINY["t5"](), seq_len=SEQ)
    again = LayerGraph.from_json(graph.to_json())
    assert again.to_dict() == graph.to_dict()
    assert again.meta == graph.meta
    json.loads(graph.to_json())  # plain JSON, nothing exotic in extra
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.validate()


@pytest.mark.parametrize("family", sorted(TINY))
def test_replaying_identical_blocks_changes_nothing(family: str, monkeypatch) -> None:
    import placement_opt.model._recorder as trace_module

    fields = TINY[family]().to_dict()
    fields.pop("layer_types", None)
    for key in ("num_hidden_layers", "num_layers", "num_decoder_layers", "n_layer"):
        if key in fields:
            fields[key] = 4  # 4 blocks: the first of each kind runs, the others can be replayed
    config = type(TINY[family]())(**fields)
    replayed = trace(config, seq_len=SEQ)
    monkeypatch.setattr(trace_module, "REPLAY_REPEATED_BLOCKS", False)
    real = trace(config, seq_len=SEQ)
    assert replayed.meta.extra.pop("replayed_blocks") > 0
    assert real.meta.extra.pop("replayed_blocks") == 0
    assert replayed.to_dict() == real.to_dict()


def test_real_mixtral_traces_like_its_config() -> None:
    model = _real_model("mixtral")  # CPU weights: the expert stand-in must use the meta copies
    pointers = [p.data_ptr() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_module = trace(model, seq_len=SEQ, dtype=torch.float32)
    from_config = trace(TINY["mixtral"](), seq_len=SEQ, dtype="float32")
    assert from_module.unit("model.layers.1").flops_per_token == from_config.unit("model.layers.1").flops_per_token
    assert [p.data_ptr() for p in model.parameters()] == pointers


class _DeclaredTie(nn.Module):
    """A v4-style model: lm head declared tied to the input embeddings, but not (yet) the same tensor."""

    _tied_weights_keys = ["head.weight"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_declared_tie_without_shared_tensor_is_counted_once() -> None:
    graph = trace(_DeclaredTie(), seq_len=3)
    assert graph.meta.tied_param_groups == (("embed.weight", "head.weight"),)
    assert graph.meta.tied_unit_groups == (("embed", "head"),)
    assert (graph.unit("embed").param_bytes, graph.unit("head").param_bytes) == (10 * 4 * 4, 0)


_SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
MORE_MOE = {
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**_SMALL, moe_intermediate_size=16, num_experts=4,
                                                     num_experts_per_tok=2, shared_expert_intermediate_size=32),
    "gpt_oss": lambda: transformers.GptOssConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=8),
    # experts told their rows per expert by a router that gives them as Python ints: traced with even routing
    "jetmoe": lambda: transformers.JetMoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
                                                num_local_experts=4, num_experts_per_tok=2),
}


# FLOPs per token of layer 0 by hand: attention 2 x (32x32 + 32x16 + 32x16 + 32x32) + 4 x 4 heads x 8 x 16
# context = 8192 and router 2 x 32 x 4 = 256 for both, then
# qwen2_moe: shared expert 2 x 3 x 32x32 + its gate 2 x 32 + two experts of 2 x 3 x 32x16 -> 20800
# gpt_oss: two experts of 2 x (32x128 gate_up + 64x32 down) -> 33024; expert bytes with biases
# 4 x (32x128 + 128 + 64x32 + 32) x 4 bytes = 100864
# jetmoe: attention experts of 32 -> 16 and back, two per token: 2 x 2 x (2 x 16x32), two routers 2 x 256, kv_proj
# 2 x 32x32, 4 x 4 heads (2 key-value heads x top-2) x 8 x 16 context; MLP experts, two per token: 2 x (2 x 32x128
# gate_up + 2 x 64x32 down) -> 33280; expert bytes 4 x (16x32 + 32x16 + 32x128 + 64x32) x 4 bytes = 114688
EXPECTED_MOE = {"qwen2_moe": (20800, 4 * 3 * 32 * 16 * 4), "gpt_oss": (33024, 100864), "jetmoe": (33280, 114688)}


@pytest.mark.parametrize("family", sorted(MORE_MOE))
def test_other_fused_expert_layouts(family: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        graph = trace(MORE_MOE[family](), seq_len=SEQ, dtype="float32")
    layer = graph.unit("model.layers.0")
    assert (layer.moe_num_experts, layer.moe_experts_per_token) == (4, 2)
    assert (layer.flops_per_token, layer.moe_expert_bytes) == EXPECTED_MOE[family]


def test_dbrx_s_stacked_experts_are_traced_as_routed_experts() -> None:
    """DBRX's experts loop over the experts hit (``nonzero``: no meta implementation), their weights stacked along
    the rows of 2-D tensors (``mlp.w1``: [experts x ffn, hidden]); its top-k sits in a nested ``ffn_config``. The
    trace fell back to the static graph (every expert's FLOPs, no MoE facts). By hand, hidden 64, 4 heads of 16,
    2 key-value heads: Wqkv 2 x 64x128 + out 2 x 64x64 + scores 4 x 4 x 16 x 16 = 28672, router 2 x 64x4 = 512,
    two experts of 2 x 3 x 64x128 = 98304; expert bytes 4 x 3 x 128x64 x 4 bytes."""
    config = transformers.DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=128,
                                     attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 500000.0},
                                     ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        graph = trace(config, seq_len=SEQ, dtype="float32")
    block = graph.unit("transformer.blocks.0")
    assert (block.moe_num_experts, block.moe_experts_per_token, block.moe_expert_bytes) == (4, 2, 4 * 3 * 128 * 64 * 4)
    assert block.flops_per_token == 28672 + 512 + 98304


@pytest.mark.parametrize("granularity", ["sublayer", "module"])
def test_dbrx_s_stacked_experts_are_routed_experts_at_every_granularity(granularity: str) -> None:
    """Cut per module, DBRX's experts' weights sit on ``ffn.experts.mlp``, the child its routing parent slices: that
    unit was traced with no MoE facts, and a decode priced reading every expert's rows, not its top-k's."""
    from placement_opt.cost.kernels import touched_weight_bytes

    config = transformers.DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=128,
                                     attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 500000.0},
                                     ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2})
    graph = trace(config, seq_len=SEQ, dtype="float32", granularity=granularity)
    (name,) = [n for n in graph.names() if n.startswith("transformer.blocks.0.ffn.experts")]
    experts = graph.unit(name)
    every = 4 * 3 * 128 * 64 * 4
    assert (experts.moe_num_experts, experts.moe_experts_per_token, experts.moe_expert_bytes) == (4, 2, every)
    assert touched_weight_bytes(experts, 1) == every / 2  # one token reads its 2 experts of 4


def test_experts_with_a_gate_of_their_own_trace_through_it() -> None:
    """Inkling2's experts gate through ``_apply_gate`` (an activation taking the gate and up halves together): the
    meta stand-in calls it (the trace fell back to the static graph). Two experts per token of 2 x 3 x 64x32."""
    config = transformers.Inkling2TextConfig(hidden_size=64, moe_intermediate_size=32, n_routed_experts=4,
                                             num_experts_per_tok=2, num_hidden_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        graph = trace(config, seq_len=SEQ, dtype="float32", granularity="sublayer")
    experts = graph.unit("model.layers.0.mlp.experts")
    assert (experts.moe_num_experts, experts.moe_experts_per_token) == (4, 2)
    assert experts.flops_per_token == 2 * 2 * 3 * 64 * 32


def test_grouped_mm_flops_are_counted() -> None:
    """transformers' grouped experts matmul has no flop_counter formula: 2 x tokens x in x out."""
    from placement_opt.model._recorder import Record, _Recorder

    record = Record()
    recorder = _Recorder(record, {})
    tokens = torch.empty(8, 32, device="meta", dtype=torch.bfloat16)
    experts = torch.empty(4, 32, 64, device="meta", dtype=torch.bfloat16)
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    recorder.enter("experts")
    with recorder:
        out = torch._grouped_mm(tokens, experts, offs=offsets)
    assert out.shape == (8, 64)
    assert record.flops["experts"] == 2 * 8 * 32 * 64


def test_bare_decoder_module_keeps_a_kv_cache() -> None:
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(TINY["llama"](), dtype=torch.float16)  # LlamaModel, no head
    graph = trace(model, seq_len=SEQ)
    assert graph.unit("layers.0").kv_bytes_per_token == 2 * 2 * 8 * 2
    with torch.device("meta"):
        bert = transformers.AutoModel.from_config(TINY["bert"]())
    assert all(u.kv_bytes_per_token == 0 for u in trace(bert, seq_len=SEQ).units())


def test_experts_that_get_no_routing_run_every_expert_and_say_so() -> None:
    """Llama-4's experts in transformers take the hidden states alone: every token runs through every expert, so
    each decode step reads all of their weights (it was priced as reading its top-1 expert's: 16x under)."""
    import warnings

    import transformers

    config = transformers.Llama4TextConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=32,
                                           intermediate_size_mlp=64, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=16, num_local_experts=4, num_experts_per_tok=1, vocab_size=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = trace(config, dtype="float32")
    unit = next(u for u in graph.units() if u.is_moe)
    assert (unit.moe_num_experts, unit.moe_experts_per_token) == (4, 4)
    mixtral = next(u for u in trace("mixtral-8x7b").units() if u.is_moe)  # routed experts: their top-k
    assert (mixtral.moe_num_experts, mixtral.moe_experts_per_token) == (8, 2)


def test_a_fallback_says_whether_the_forward_failed_in_placement_opt_or_in_the_model(monkeypatch) -> None:
    """An error in the project's own code is a bug to report; asking for example_inputs then misled (Gemma-3n)."""
    import warnings

    from placement_opt.model import _recorder, tracer
    from placement_opt.units import parse_size

    def theirs(*args, **kwargs):
        raise ValueError("needs pixel_values")

    def ours(*args, **kwargs):
        parse_size("lots")  # raises in placement_opt/units.py: the innermost frame is the project's

    for fail, said in ((theirs, "pass example_inputs"), (ours, "raised in placement_opt itself (placement_opt/units.py")):
        monkeypatch.setattr(_recorder, "run", fail)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tracer.trace("llama-2-7b")
        text = " ".join(str(w.message) for w in caught if "meta forward" in str(w.message))
        assert said in text, text
