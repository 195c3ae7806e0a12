"""The workspace the meta trace measures per unit covers what a real forward holds, within 15 %.

The reference is a real CPU forward of the same random-init model, with a dispatch mode that counts the
bytes of every tensor storage an op allocates, alive until torch frees it (a finalizer on the storage),
and the most alive while each unit runs. It is written here independently of the tracer's counter: it
keys storages by their real data pointers and knows nothing of units' inputs, scores or replays.
The trace runs at batch 1 x 32 tokens; the forwards at batch 1 and 4 x 64 and 128 tokens (the issue's
batch 1/16 x prompt 512/1024, scaled down to CPU-test size), so the per-token scaling is what is tested.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
import transformers as T
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from placement_opt.cost.memory import (
    CUBLAS_WORKSPACE_BYTES,
    cpu_gemm_scratch,
    workspace_bytes,
)
from placement_opt.cost.workload import Workload
from placement_opt.model.graph import MEASURED_NODE_ATTRIBUTES, GraphMeta, LayerGraph, UnitInfo
from placement_opt.model.tracer import trace
from placement_opt.runtime.timing import cache_argument, cache_of

TRACE_LEN = 32


def tensors(unit, workload, meta) -> int:
    """The predicted workspace less MKL's packing buffers, which are no tensors: what a live-tensor count sees."""
    rows = workload.batch_size * (1 if workload.logits_kept == "last" and unit.name == meta.extra.get("logits_unit")
                                  else workload.prompt_len)
    return workspace_bytes(unit, workload, meta) - cpu_gemm_scratch(unit, rows)
SHAPES = [(1, 64), (4, 128)]

def _falcon(**sizes: int) -> T.FalconConfig:
    """Falcon-40B's layout (parallel attention, grouped KV, no alibi or bias) at the given sizes, two layers."""
    return T.FalconConfig(num_hidden_layers=2, new_decoder_architecture=True, alibi=False, parallel_attn=True,
                          bias=False, **sizes)


CONFIGS: dict[str, Callable[[], T.PretrainedConfig]] = {
    "llama": lambda: T.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
    "mixtral": lambda: T.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                       num_local_experts=4, num_experts_per_tok=2),
    "gpt2": lambda: T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=512,
                                 bos_token_id=0, eos_token_id=0),
    # Falcon-40B's layout (parallel attention, grouped KV), its head size the traced length (32 here, 64 at
    # trace()'s default length, as Falcon-40B's); it builds its causal mask in every forward, under sdpa too
    "falcon": lambda: _falcon(hidden_size=128, num_attention_heads=4, num_kv_heads=2, vocab_size=512),
    # Falcon-7B's layout: one key/value head for every query head, handed to sdpa without enable_gqa, which a CPU
    # cannot fuse: its math path's scores (charged as fused: 0.23-0.6x of a real forward's bytes)
    "falcon_mqa": lambda: T.FalconConfig(num_hidden_layers=2, new_decoder_architecture=False, multi_query=True,
                                         alibi=False, parallel_attn=True, bias=False, hidden_size=128,
                                         num_attention_heads=8, vocab_size=512),
    # experts half as wide as the model: the fused gate/up is as wide as the model (OLMoE's and Granite-MoE's
    # proportions), and the rows the experts hand back outweigh their intermediates; it also builds a
    # sliding-window mask beside its causal one in every forward (query x key bools), under sdpa too
    "qwen2_moe": lambda: T.Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
    # experts (in its MLP and its attention) told their rows per expert by a router the trace stands in for
    "jetmoe": lambda: T.JetMoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_key_value_heads=2, kv_channels=16, num_local_experts=4,
                                     num_experts_per_tok=2, vocab_size=512),
}


def _key(tensor: torch.Tensor) -> int:
    """Its storage's identity: the address, or on meta (no address) the storage object's (0 when it holds nothing)."""
    storage = tensor.untyped_storage()
    return storage._cdata if tensor.is_meta and storage.nbytes() else storage.data_ptr()


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages ops allocate on a real forward, alive now, and the most alive per unit."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: dict[int, int] = {}
        self.live = 0
        self.unit: str | None = None
        self.peak: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        read = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = _key(tensor)
            if key == 0 or key in read or key in self.alive:
                continue  # empty, a view or in-place result, or already counted
            self.alive[key] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, key)
        if self.unit is not None:
            self.peak[self.unit] = max(self.peak[self.unit], self.live)
        return out

    def _free(self, key: int) -> None:
        self.live -= self.alive.pop(key)

    def hold(self, tensors) -> int:  # noqa: ANN001
        """Count ``tensors`` (a cache made before) as alive, so that a step's release of them is seen; their bytes."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.alive:
                self.alive[storage.data_ptr()] = storage.nbytes()
                self.live += storage.nbytes()
                weakref.finalize(storage, self._free, storage.data_ptr())
        return self.live

    def enter(self, unit: str) -> None:
        self.unit = unit
        self.peak[unit] = max(self.peak[unit], self.live)


def measured_peaks(model: torch.nn.Module, units: list[str], batch: int, prompt: int,
                   padded: bool = False) -> dict[str, int]:
    """Each unit's most live bytes in a real forward (``padded``: the first prompt half padding, masked)."""
    counter = LiveStorages()
    handles = []
    for name in units:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda _m, _a, n=name: counter.enter(n)))
        handles.append(module.register_forward_hook(lambda _m, _a, _o: setattr(counter, "unit", None)))
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt))
    mask = torch.ones_like(ids)
    mask[0, :prompt // 2] = 0  # left padding: the mask is read only when given
    try:
        with torch.no_grad(), counter:
            model(input_ids=ids, attention_mask=mask if padded else None, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return dict(counter.peak)


def real_model(family: str, attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation=attention).float().eval()


# Qwen2-MoE under sdpa builds a sliding-window mask (batch x prompt^2 bools) in every forward: the trace runs
# sdpa, sees it, and charges it
@pytest.mark.parametrize(("family", "attention"), [(f, a) for f in sorted(CONFIGS) for a in ("eager", "sdpa")])
def test_predicted_workspace_covers_a_real_cpu_forward_within_15_percent(family: str, attention: str) -> None:
    model = real_model(family, attention)
    graph = trace(model, seq_len=TRACE_LEN)
    assert graph.meta.extra["attn_implementation"] == attention
    blocks = [u.name for u in graph.units() if u.module_class.endswith(("DecoderLayer", "Block"))]
    assert len(blocks) == 2
    for batch, prompt in SHAPES:
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=0)  # a plain forward: every logit
        measured = measured_peaks(model, graph.names(), batch, prompt)
        for unit in graph.units():
            predicted = tensors(unit, workload, graph.meta)
            assert predicted >= measured[unit.name], (unit.name, batch, prompt, predicted, measured[unit.name])
            if unit.name in blocks or unit.name == graph.meta.extra["logits_unit"]:
                assert predicted <= 1.15 * measured[unit.name], (unit.name, batch, prompt, predicted / measured[unit.name])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sdpa_is_counted_by_its_output_not_by_meta_s_float32_math_path(dtype: torch.dtype) -> None:
    """On meta, sdpa decomposes into its math path, which makes float32 copies of half-precision q, k, v and
    output; CPU flash attention allocates its output alone. Counting the math path charged a bf16 layer ~40 %
    too much; counting the output, the layer stays within 15 % of a real CPU forward (GQA: 4 heads, 2 kv)."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation="sdpa").to(dtype).eval()
    graph = trace(model, seq_len=TRACE_LEN)
    layer = graph.unit("model.layers.0")
    for batch, prompt in SHAPES:
        measured = measured_peaks(model, graph.names(), batch, prompt)["model.layers.0"]
        predicted = tensors(layer, Workload(batch_size=batch, prompt_len=prompt, new_tokens=0), graph.meta)
        assert measured <= predicted <= 1.15 * measured, (batch, prompt, predicted / measured)


def test_a_head_size_equal_to_the_traced_length_is_not_taken_for_scores() -> None:
    """q, k and v are (batch, heads, tokens, head size): with head size == traced length they look like scores."""
    model = real_model("llama", "sdpa")
    graph = trace(model, seq_len=16)  # head size 64 / 4 heads = 16
    layer = graph.unit("model.layers.0")
    measured = measured_peaks(model, graph.names(), 4, 128)
    workload = Workload(batch_size=4, prompt_len=128, new_tokens=0)
    predicted = tensors(layer, workload, graph.meta)
    assert measured["model.layers.0"] <= predicted <= 1.15 * measured["model.layers.0"]


def test_eager_scores_are_measured_and_charged_only_where_they_are_materialised() -> None:
    eager = trace(real_model("llama", "eager"), seq_len=TRACE_LEN)
    sdpa = trace(real_model("llama", "sdpa"), seq_len=TRACE_LEN)
    heads = 4
    # eager: float32 scores (+ mask) and their softmax, at least 2 x 4 bytes per head per query x key pair
    assert eager.unit("model.layers.0").scores_workspace_bytes_per_token_ctx >= 2 * 4 * heads
    # sdpa: meta runs it as its math path, but only its output is counted, as its fused kernels allocate
    assert sdpa.unit("model.layers.0").scores_workspace_bytes_per_token_ctx == 0
    long = Workload(batch_size=1, prompt_len=4096, new_tokens=0)
    with_scores = tensors(eager.unit("model.layers.0"), long, eager.meta)
    without = tensors(sdpa.unit("model.layers.0"), long, sdpa.meta)
    assert with_scores >= 4096 * 4096 * 2 * 4 * heads > 10 * without


def test_a_config_is_priced_with_the_attention_transformers_would_run() -> None:
    """trace() builds configs with the attention transformers runs them with (load() runs its default)."""
    llama = trace(CONFIGS["llama"](), seq_len=TRACE_LEN).meta.extra
    assert llama["attn_implementation"] == llama["traced_attention"] == "sdpa"
    gemma = T.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=512)
    expected = "sdpa" if T.Gemma2ForCausalLM._supports_sdpa else "eager"
    assert trace(gemma, seq_len=TRACE_LEN).meta.extra["attn_implementation"] == expected


@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "falcon"])
def test_a_config_traces_as_the_model_transformers_runs(family: str) -> None:
    """A config's graph measures what the sdpa model it becomes holds (the masks of Qwen2-MoE and Falcon
    included; sdpa's output, which reads the mask, is per token though Falcon's head size is the traced
    length), and counts the FLOPs of eager's visible matmuls: on meta, sdpa runs as its math path."""
    from_config = trace(CONFIGS[family](), seq_len=TRACE_LEN, dtype="float32")
    as_run = trace(real_model(family, "sdpa"), seq_len=TRACE_LEN)
    eager = trace(real_model(family, "eager"), seq_len=TRACE_LEN)
    measured = [n for n in MEASURED_NODE_ATTRIBUTES if n.startswith(("workspace", "scores_workspace"))]
    for unit in from_config.units():
        run = as_run.unit(unit.name)
        assert [getattr(unit, n) for n in measured] == [getattr(run, n) for n in measured], unit.name
        assert (unit.flops_per_token, unit.attn_flops_per_token_per_ctx) == \
            (eager.unit(unit.name).flops_per_token, eager.unit(unit.name).attn_flops_per_token_per_ctx)
    layer = from_config.units()[2]  # the first decoder layer (after the embeddings and rotary units)
    assert layer.name.endswith(".0")
    # one bool per query x key pair, built in the model's forward (Qwen2-MoE's is never passed to sdpa); Falcon
    # passes its mask, of which torch makes a float32 copy during the call
    mask, during_call = {"llama": (0, 0), "qwen2_moe": (1, 1), "falcon": (1, 1 + 4)}[family]
    assert (layer.workspace_bytes_per_token_ctx, layer.scores_workspace_bytes_per_token_ctx) == (mask, during_call)


WINDOW = 48  # tokens: longer than the trace (TRACE_LEN), shorter than the prompts that reach it


def windowed_mistral() -> tuple[torch.nn.Module, LayerGraph]:
    """A Mistral (v0.1: every layer slides) under sdpa, with its graph traced shorter than its window."""
    torch.manual_seed(0)
    config = T.MistralConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, sliding_window=WINDOW)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    return model, trace(model, seq_len=TRACE_LEN)


def test_the_window_mask_a_trace_shorter_than_the_window_did_not_see_is_charged_once_the_prompt_reaches_it() -> None:
    """Mistral (v0.1) under sdpa: below its sliding window the causal mask is left to the kernel; from the window
    on, transformers builds a (batch, 1, prompt, prompt) bool mask, alive through every layer."""
    model, graph = windowed_mistral()
    layer = graph.unit("model.layers.0")
    assert layer.workspace_bytes_per_token_ctx == 0  # the trace (32 tokens) is shorter than the window
    # 40: under the window, no mask; 2048: the mask (4 MiB, one for the batch: no padding tells sequences
    # apart), its float32 copy for the kernel and the keys and values repeated to every head (a masked sdpa call
    # gets no grouped ones) outweigh the rest of the layer's peak, with the 16 bytes per position the mask's
    # building keeps (int64 positions)
    for batch, prompt in [(4, 40), (1, 2048), (2, 2048), (2, 1024), (4, 512)]:
        measured = measured_peaks(model, graph.names(), batch, prompt)
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=0)
        for unit in (layer, graph.unit("lm_head")):  # lm_head runs once the body holding the mask returned
            predicted = tensors(unit, workload, graph.meta)
            assert measured[unit.name] <= predicted <= 1.05 * measured[unit.name], (unit.name, batch, prompt)


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen2_moe", "falcon"])
def test_padded_prompts_are_charged_the_mask_transformers_builds_for_them(family: str) -> None:
    """Prompts padded under an attention mask: transformers builds the (batch, 1, prompt, prompt) bool mask the
    kernel's causal flag spares equal prompts, and sdpa gets its copy and repeated keys and values. Falcon builds
    its mask either way: its trace saw it, and padding adds nothing."""
    model = real_model(family, "sdpa")
    graph = trace(model, seq_len=TRACE_LEN)
    layers = [u for u in graph.units() if u.kv_bytes_per_token]
    for batch, prompt in [(4, 512), (2, 1024)]:
        measured = measured_peaks(model, graph.names(), batch, prompt, padded=True)
        padded = Workload(batch_size=batch, prompt_len=prompt, new_tokens=0, padded=True)
        equal = Workload(batch_size=batch, prompt_len=prompt, new_tokens=0)
        for layer in layers:
            predicted = tensors(layer, padded, graph.meta)
            assert measured[layer.name] <= predicted <= 1.15 * measured[layer.name], (layer.name, batch, prompt)
            unpadded = tensors(layer, equal, graph.meta)  # the equal prompts' figure falls short but for Falcon
            assert (unpadded == predicted) if family == "falcon" else (unpadded < measured[layer.name]), layer.name
        device = max(tensors(u, padded, graph.meta) for u in graph.units())
        assert max(measured.values()) <= device <= 1.15 * max(measured.values()), (batch, prompt)


def decode_step_peak(model: torch.nn.Module, unit: str, batch: int, prompt: int,
                     mask: torch.Tensor | None = None) -> int:
    """The most live bytes ``unit`` holds in the decode step after a prompt, above the cache (``mask``: the prompt's
    attention mask, a column of ones added for the step). The cache's tensors are counted as alive before the step,
    so that the step's release of those it replaces (the cache grows by concatenation) is seen."""
    step_mask = None if mask is None else torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype)], dim=1)
    counter = LiveStorages()
    module = model.get_submodule(unit)
    with torch.no_grad():
        cache = cache_of(model(input_ids=torch.randint(0, 512, (batch, prompt)), attention_mask=mask, use_cache=True))
        baseline = counter.hold(t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor))
        hooks = [module.register_forward_pre_hook(lambda _m, _a: counter.enter(unit)),
                 module.register_forward_hook(lambda _m, _a, _o: setattr(counter, "unit", None))]
        try:
            with counter:
                model(input_ids=torch.randint(0, 512, (batch, 1)), attention_mask=step_mask,
                      **cache_argument(model, cache), use_cache=True)
        finally:
            for hook in hooks:
                hook.remove()
    return counter.peak[unit] - baseline


def _decode_workspace(unit: UnitInfo, workload: Workload, meta: GraphMeta) -> int:
    """The predicted decode workspace less MKL's scratch, which no tensor holds."""
    return workspace_bytes(unit, workload, meta, phase="decode") - cpu_gemm_scratch(unit, workload.batch_size)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_a_padded_decode_step_holds_a_mask_row_per_sequence(family: str) -> None:
    """A decode step after padded prompts is given a (batch, 1, 1, context) bool mask: charged, it covers the
    step's live bytes; the step of equal prompts, which gets none, is charged none."""
    model = real_model(family, "sdpa")
    graph = trace(model, seq_len=TRACE_LEN)
    layer = graph.unit("model.layers.0")
    batch, prompt = 4, 500
    mask = torch.ones((batch, prompt), dtype=torch.long)
    mask[0, :prompt // 2] = 0
    for padded in (False, True):
        measured = decode_step_peak(model, layer.name, batch, prompt, mask if padded else None)
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=2, padded=padded)  # last step: 502
        predicted = _decode_workspace(layer, workload, graph.meta)
        # the step's figures are measured at one sequence, and what sequences share counts once per sequence
        assert measured <= predicted <= 1.15 * measured, (padded, predicted, measured)


def test_a_decode_step_past_the_window_reads_the_sliding_cache_unmasked() -> None:
    """transformers keeps the last window - 1 keys of a sliding layer and attends to them with no mask: a step
    past the window holds its cache's update (48 tokens, not the context) and none of a prefill's mask terms."""
    model, graph = windowed_mistral()
    layer = graph.unit("model.layers.0")
    batch, prompt = 4, 100
    measured = decode_step_peak(model, layer.name, batch, prompt)  # context 101: the step after the prompt
    workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=2)  # its last step's context, 102
    predicted = _decode_workspace(layer, workload, graph.meta)
    assert layer.kv_window_tokens == WINDOW
    assert measured <= predicted <= 1.15 * measured, (predicted, measured)


def test_the_score_moment_of_a_unit_without_scores_is_its_fused_attention_call() -> None:
    """Under sdpa a Llama layer holds no score bytes: its score moment is the attention call (where a mask's
    kernel copy would live), with fewer bytes alive than the MLP's peak; a unit without attention keeps its
    linear peak there."""
    graph = trace(real_model("llama", "sdpa"), seq_len=TRACE_LEN)
    layer, head = graph.unit("model.layers.0"), graph.unit("lm_head")
    assert layer.scores_workspace_bytes_per_token_ctx == 0
    assert 0 < layer.scores_workspace_bytes_per_token < layer.workspace_bytes_per_token
    assert head.scores_workspace_bytes_per_token == head.workspace_bytes_per_token


def test_a_graph_traced_with_eager_but_run_fused_drops_its_query_x_context_terms() -> None:
    """Graphs written before traces ran the attention that runs hold eager's scores and masks as one figure:
    under sdpa neither is charged (a bound to the scores that never exist beats a 30x over-count)."""
    graph = trace(real_model("llama", "eager"), seq_len=TRACE_LEN)
    old = LayerGraph.from_dict(graph.to_dict())
    old.meta.extra.pop("traced_attention")
    old.meta.extra["attn_implementation"] = "sdpa"
    fused = LayerGraph.from_dict(old.to_dict())
    fused.meta.extra["traced_attention"] = "sdpa"
    layer = "model.layers.0"
    long = Workload(batch_size=1, prompt_len=1024, new_tokens=0)
    assert graph.unit(layer).scores_workspace_bytes_per_token_ctx > 0
    assert tensors(old.unit(layer), long, old.meta) < tensors(fused.unit(layer), long, fused.meta)
    assert tensors(old.unit(layer), long, old.meta) == 1024 * graph.unit(layer).workspace_bytes_per_token


def test_the_logits_unit_is_the_output_embeddings_unit() -> None:
    assert trace(CONFIGS["gpt2"](), seq_len=TRACE_LEN).meta.extra["logits_unit"] == "lm_head"
    encoder = trace(T.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=4, vocab_size=512), seq_len=TRACE_LEN)
    assert "logits_unit" not in encoder.meta.extra  # an encoder has no logits


def test_measured_figures_round_trip_and_older_graphs_load_without_them() -> None:
    graph = trace(CONFIGS["mixtral"](), seq_len=TRACE_LEN)
    data = graph.to_dict()
    assert all(set(MEASURED_NODE_ATTRIBUTES) <= set(node) for node in data["nodes"])
    again = LayerGraph.from_json(graph.to_json()).to_dict()
    assert again["nodes"] == data["nodes"]
    for node in data["nodes"]:
        for key in MEASURED_NODE_ATTRIBUTES:
            del node[key]
    older = LayerGraph.from_dict(data)
    older.validate()
    layer = older.unit("model.layers.0")
    assert layer.workspace_bytes_per_token is None
    # no figures: the old estimate, 6 outputs per prompt token
    workload = Workload(batch_size=2, prompt_len=100, new_tokens=4)
    assert workspace_bytes(layer, workload, older.meta, on_gpu=True) == 2 * 100 * layer.out_bytes_per_token * 6


@pytest.mark.cuda
def test_predicted_peak_covers_max_memory_allocated_on_a_gpu() -> None:
    """A model resident on one GPU: the forward's peak above the weights, against the largest unit workspace."""
    config = T.LlamaConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=2, num_attention_heads=16,
                           num_key_value_heads=4, vocab_size=32000)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to("cuda", torch.bfloat16).eval()
    graph = trace(model)
    with torch.no_grad():  # cuBLAS takes its workspace at the first matmul: before the measurement
        model(input_ids=torch.zeros((1, 8), dtype=torch.long, device="cuda"), use_cache=False)
    for batch, prompt in [(1, 512), (16, 512), (4, 1024)]:
        ids = torch.randint(0, config.vocab_size, (batch, prompt), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=0)
        # cuBLAS's workspace was taken by the warm-up, so it is in `before`: the activations alone are compared
        predicted = max(workspace_bytes(u, workload, graph.meta, on_gpu=True) - CUBLAS_WORKSPACE_BYTES
                        for u in graph.units())
        assert measured <= predicted <= 1.15 * measured, (batch, prompt, predicted / measured)


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_decode_step_s_peak_is_covered_on_a_gpu(attention: str) -> None:
    """A decode step on a GPU, its cache made by a prompt before: the step's peak above what was allocated then (the
    weights and the cache) against the largest unit's decode workspace, measured by meta decode steps. Eager
    attention repeats the grouped keys and values to every head (16 heads, 4 KV heads)."""
    config = T.LlamaConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=2, num_attention_heads=16,
                           num_key_value_heads=4, vocab_size=32000)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation=attention).to("cuda", torch.bfloat16)
    model = model.eval()
    graph = trace(model)
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 8), dtype=torch.long, device="cuda"), use_cache=False)  # cuBLAS's workspace
    for batch, prompt in [(1, 4096), (4, 2048)]:
        with torch.no_grad():
            out = model(input_ids=torch.randint(0, 32000, (batch, prompt), device="cuda"), use_cache=True)
            cache = cache_of(out)
            del out
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            model(input_ids=torch.randint(0, 32000, (batch, 1), device="cuda"), use_cache=True, **cache_argument(model, cache))
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=1)
        predicted = max(workspace_bytes(u, workload, graph.meta, on_gpu=True, phase="decode") - CUBLAS_WORKSPACE_BYTES
                        for u in graph.units() if u.in_decode)
        assert measured <= predicted <= 1.15 * measured, (batch, prompt, predicted / measured)


#: Models that give sdpa a mask, at a GPU's size: Falcon always builds its causal mask; Qwen2-MoE builds a
#: sliding-window mask beside it that no layer reads; a Llama builds one for padded prompts only.
GPU_MASKED = {
    "falcon": lambda: _falcon(hidden_size=1024, num_attention_heads=16, num_kv_heads=4, vocab_size=32000),
    "qwen2_moe": lambda: T.Qwen2MoeConfig(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704,
                                          shared_expert_intermediate_size=2816, num_hidden_layers=2,
                                          num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                                          num_experts=8, num_experts_per_tok=2),
    "llama": lambda: T.LlamaConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
}


@pytest.mark.cuda
@pytest.mark.parametrize(("family", "padded"), [("falcon", False), ("qwen2_moe", False), ("llama", True),
                                                ("falcon", True)])
def test_the_masks_sdpa_is_given_are_covered_on_a_gpu(family: str, padded: bool) -> None:
    """A boolean mask, and the copy in the query's dtype torch makes of it for the kernel (measured on the CPU),
    against ``max_memory_allocated`` on a GPU; long prompts, where the mask is a large part of a layer's peak.
    Padded prompts (a quarter of the first one padding): the mask transformers builds for them, with the keys
    and values repeated for a masked call."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(GPU_MASKED[family](), attn_implementation="sdpa")
    model = model.to("cuda", torch.bfloat16).eval()
    graph = trace(model)
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 8), dtype=torch.long, device="cuda"), use_cache=False)
    rows = []  # every shape measured before any is judged: a miss then says how it scales
    for batch, prompt in [(1, 4096), (4, 2048)]:
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda")
        mask = torch.ones_like(ids)
        mask[0, :prompt // 4] = 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask if padded else None, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - before
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=0, logits="last", padded=padded)
        predicted = max(workspace_bytes(u, workload, graph.meta, on_gpu=True) - CUBLAS_WORKSPACE_BYTES
                        for u in graph.units())  # cuBLAS's workspace is in `before`, as above
        rows.append((batch, prompt, measured, predicted))
    misses = [row for row in rows if not row[2] <= row[3] <= 1.15 * row[2]]
    assert not misses, [f"{b} x {p}: measured {m} B, predicted {q} B ({q / m:.4f}x)" for b, p, m, q in rows]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_module_granularity_charges_the_glue_between_units_to_the_next_unit(attention: str) -> None:
    """With every Linear a unit, attention's scores and the MLP's activation run between units: the next
    unit carries them, so the largest unit workspace still covers the whole forward's peak."""
    model = real_model("llama", attention)
    whole = measured_peaks(model, [""], 4, 128)[""]  # the root module: the peak of the whole forward
    graph = trace(model, seq_len=TRACE_LEN, granularity="module")
    workload = Workload(batch_size=4, prompt_len=128, new_tokens=0)
    predicted = max(tensors(u, workload, graph.meta) for u in graph.units())
    assert whole <= predicted <= 1.15 * whole


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_last_logits_workspace_covers_a_forward_that_keeps_one_position(family: str) -> None:
    """generate()'s prefill asks for the last position's logits only (``logits_to_keep=1``); Gemma-2 also
    soft-caps them outside lm_head, so what lm_head adds is more than the logits alone."""
    if family == "gemma2":
        config = T.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, vocab_size=512, final_logit_softcapping=30.0)
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    else:
        model = real_model("llama", "eager")
    graph = trace(model, seq_len=TRACE_LEN)
    head = graph.unit(graph.meta.extra["logits_unit"])
    for batch, prompt in SHAPES:
        counter = LiveStorages()
        module = model.get_submodule(head.name)
        pre = module.register_forward_pre_hook(lambda _m, _a, c=counter: c.enter(head.name))
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt))
        try:
            with torch.no_grad(), counter:
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
        finally:
            pre.remove()
        measured = counter.peak[head.name]  # from lm_head's start to the end of the forward (softcapping included)
        predicted = tensors(head, Workload(batch_size=batch, prompt_len=prompt, new_tokens=0, logits="last"),
                            graph.meta)
        every = tensors(head, Workload(batch_size=batch, prompt_len=prompt, new_tokens=0), graph.meta)
        assert measured <= predicted <= 1.15 * measured, (batch, prompt, predicted / measured)
        assert predicted < every / 2


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_each_expert_group_s_workspace_covers_its_dispatched_cpu_forward_within_15_percent(family: str) -> None:
    """Expert groups as dispatch cuts and runs them: each holds the gathered rows of the whole unit and, after the
    first, the running sum it adds to."""
    import placement_opt

    model = real_model(family, "sdpa")
    graph = trace(model, seq_len=TRACE_LEN, granularity="sublayer", expert_groups=2)
    batch, prompt = SHAPES[-1]
    workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=0)
    handle = placement_opt.dispatch(model, placement_opt.solve(graph, {"cpu": "1GiB"}, workload=workload))
    try:
        measured = measured_peaks(model, graph.names(), batch, prompt)
    finally:
        handle.remove()
    groups = [u for u in graph.units() if ".experts.groups." in u.name]
    assert len(groups) == 4
    for unit in groups:
        predicted = tensors(unit, workload, graph.meta)
        assert measured[unit.name] <= predicted <= 1.15 * measured[unit.name], (unit.name, predicted, measured[unit.name])


def tiny_deepseek(dtype: torch.dtype, dense_first: bool) -> torch.nn.Module:
    """A DeepSeek-V3 (multi-head latent attention; query and key heads 24 wide, values 16) under sdpa, its first
    layer dense or MoE."""
    torch.manual_seed(0)
    config = T.DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                num_experts_per_tok=2, n_group=1, topk_group=1,
                                first_k_dense_replace=1 if dense_first else 0, vocab_size=512)
    return T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dense_first", [True, False])
def test_a_latent_attention_decode_step_holds_the_keys_and_values_it_expands_from_the_whole_cache(
        dtype: torch.dtype, dense_first: bool) -> None:
    """transformers caches DeepSeek's compressed latents and expands all of them at every step: a step at context
    501 held 8x (float32) to 18x (bf16) what a prefill trace's per-token figures charge for one query. Charged
    per cached token (the CPU's unfused attention's copies included), it covers the real step within 5 % (the
    first layer, dense or MoE)."""
    model = tiny_deepseek(dtype, dense_first)
    graph = trace(model, seq_len=TRACE_LEN)
    layer = graph.unit("model.layers.0")
    assert layer.latent_expand_bytes_per_ctx and layer.latent_expand_cpu_bytes_per_ctx
    for batch, prompt in [(1, 500), (4, 300)]:
        measured = decode_step_peak(model, layer.name, batch, prompt)
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=1)
        predicted = _decode_workspace(layer, workload, graph.meta)
        assert measured <= predicted <= 1.05 * measured, (batch, prompt, predicted / measured)
        if not dense_first:
            continue  # a GPU is charged the expert weights an MoE layer gathers: compared on the dense one
        # a GPU's fused kernel takes the expanded keys and values as they are: the CPU's copies are not charged
        on_gpu = workspace_bytes(layer, workload, graph.meta, on_gpu=True, phase="decode") - CUBLAS_WORKSPACE_BYTES
        assert predicted - on_gpu >= batch * (prompt + 1) * layer.latent_expand_cpu_bytes_per_ctx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_prefill_of_latent_attention_holds_the_math_path_s_scores(dtype: torch.dtype) -> None:
    """A CPU's flash kernel needs one head size for queries, keys and values; DeepSeek's differ, so the CPU runs
    sdpa's math path, with its scores and their softmax. Counted as fused, a layer's prefill was charged 8 % (bf16)
    to 60 % (float32) of its real peak; with the math path's peak measured on meta, it covers it within 15 %. A
    GPU (memory-efficient kernel) is not charged it; attention of one head size (Llama) has no such figure."""
    model = tiny_deepseek(dtype, dense_first=True)
    graph = trace(model, seq_len=TRACE_LEN)
    layers = [graph.unit(f"model.layers.{i}") for i in (0, 1)]
    assert all(u.cpu_attention_bytes_per_token_ctx for u in layers)
    for batch, prompt in [(1, 64), (4, 128), (1, 512)]:
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=0)
        measured = measured_peaks(model, graph.names(), batch, prompt)
        for unit in layers:
            predicted = tensors(unit, workload, graph.meta)
            assert measured[unit.name] <= predicted <= 1.15 * measured[unit.name], (unit.name, batch, prompt)
            on_gpu = workspace_bytes(unit, workload, graph.meta, on_gpu=True) - CUBLAS_WORKSPACE_BYTES
            assert on_gpu < predicted
    assert all(u.cpu_attention_bytes_per_token is None for u in trace(real_model("llama", "sdpa")).units())


def _balanced_dbrx(attention: str) -> torch.nn.Module:
    """A DBRX (4 experts, top-2) whose router sends token t to experts 2t and 2t + 1 (mod 4): every expert gets
    the same rows, the uniform routing the cost model assumes. Random weights route unevenly: an expert got up to
    a third more rows than its share in a 64-token prompt, and its loop's peak with them."""
    torch.manual_seed(0)
    config = T.DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=512, vocab_size=512,
                          attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 500000.0},
                          ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2})
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation=attention).float().eval()

    def route(_self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        token = torch.arange(logits.shape[0], device=logits.device)[:, None]
        picks = (2 * token + torch.arange(2, device=logits.device)) % 4
        return torch.full((logits.shape[0], 2), 0.5, dtype=logits.dtype, device=logits.device), picks

    for block in model.transformer.blocks:
        block.ffn.route_tokens_to_experts = route.__get__(block.ffn)
    return model


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_dbrx_s_expert_loop_is_charged_what_a_real_forward_holds_within_15_percent(attention: str) -> None:
    """DBRX's experts loop over the experts hit, one at a time, their weights rows of 2-D tensors: the trace runs
    that loop on meta with the rows spread evenly (it fell back to the static graph: no workspace at all)."""
    model = _balanced_dbrx(attention)
    graph = trace(model, seq_len=TRACE_LEN)
    blocks = [u.name for u in graph.units() if u.module_class == "DbrxBlock"]
    for batch, prompt in SHAPES:
        measured = measured_peaks(model, blocks, batch, prompt)
        for name in blocks:
            predicted = tensors(graph.unit(name), Workload(batch_size=batch, prompt_len=prompt, new_tokens=0),
                                graph.meta)
            assert measured[name] <= predicted <= 1.15 * measured[name], (name, batch, prompt, predicted / measured[name])
    for batch, prompt in [(1, 500), (4, 300)]:
        measured = decode_step_peak(model, blocks[0], batch, prompt)
        predicted = _decode_workspace(graph.unit(blocks[0]), Workload(batch_size=batch, prompt_len=prompt,
                                                                      new_tokens=1), graph.meta)
        assert measured <= predicted <= 1.15 * measured, (batch, prompt, predicted / measured)


_DECODE_GAPS = {  # known, not fixed: what a Falcon-7B-layout decode step holds per cached token is not what is charged
    ("falcon_mqa", "eager"): "charged 0.21x of a step's bytes at batch 4 x 300 (its one key head repeated?)",
    ("falcon_mqa", "sdpa"): "charged 1.40x of a step's bytes at batch 1 x 500 (on the safe side)",
}


@pytest.mark.parametrize(("family", "attention"), [
    pytest.param(f, a, marks=pytest.mark.xfail(strict=True, reason=_DECODE_GAPS[f, a])) if (f, a) in _DECODE_GAPS
    else (f, a) for f in sorted(CONFIGS) for a in ("eager", "sdpa")])
def test_a_decode_step_is_charged_what_meta_decode_steps_measured_it_holds(family: str, attention: str) -> None:
    """What a step holds per cached token is measured by meta decode steps, not read off the prefill (whose queries
    are its keys): eager attention repeats grouped keys and values to every head (Llama, Mixtral, Qwen2-MoE: the
    step's layer was charged 54 % of what it held), while a whole layer's cache copy was charged where the cache
    grows keys, then values (GPT-2, and every sdpa model but Falcon: 2x)."""
    model = real_model(family, attention)
    graph = trace(model, seq_len=TRACE_LEN)
    layer = next(u for u in graph.units() if u.module_class.endswith(("DecoderLayer", "Block")))
    assert layer.decode_workspace_bytes_per_ctx is not None
    for batch, prompt in [(1, 500), (4, 300)]:
        measured = decode_step_peak(model, layer.name, batch, prompt)
        predicted = _decode_workspace(layer, Workload(batch_size=batch, prompt_len=prompt, new_tokens=1), graph.meta)
        assert measured <= predicted <= 1.15 * measured, (batch, prompt, predicted / measured)


def test_the_experts_stand_in_holds_the_bias_rows_grouped_mm_gathers() -> None:
    """GPT-OSS's experts have biases, which transformers' grouped_mm gathers per routed row: the gate/up's
    (rows x 2 x intermediate) alive across the gate, the down projection's through the tail. The trace's stand-in
    held none, and the experts were charged 86 of a real forward's 612 MiB less (4 x 1024 tokens, its layer's
    whole peak 0.70-0.79x). The stand-in's peak on meta is the real CPU forward's."""
    from placement_opt.model._meta_experts import stand_in_experts

    config = T.GptOssConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=512, num_local_experts=4,
                            num_experts_per_tok=2)
    torch.manual_seed(0)
    real = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.device("meta"):
        meta = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    stand_in_experts(meta, lambda _experts: config.num_experts_per_tok)
    experts = "model.layers.0.mlp.experts"
    peaks = []
    for model, device in ((real, "cpu"), (meta, "meta")):
        counter = LiveStorages()
        model.get_submodule(experts).register_forward_pre_hook(lambda _m, _a, c=counter: c.enter(experts))
        ids = torch.randint(0, 512, (4, 128)).to(device)
        with torch.no_grad(), counter:
            model(input_ids=ids, use_cache=False)
        peaks.append(counter.peak[experts])
    measured, stood_in = peaks
    assert measured <= stood_in <= 1.05 * measured, (stood_in / measured)


def test_scores_with_a_sink_column_grow_with_the_context_and_cover_a_real_forward() -> None:
    """GPT-OSS appends a sink column to each head's scores: (q, k + 1) logits, their max-subtracted copy and the
    softmax were counted per token at the traced length (a layer's per-token bytes grew 6 KiB from 64 to 256
    traced tokens); they grow with the context, and the layer covers a real CPU forward within 15 %."""
    config = T.GptOssConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=512, num_local_experts=4,
                            num_experts_per_tok=2, layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    short, long = (trace(model, seq_len=n).unit("model.layers.1") for n in (TRACE_LEN, 4 * TRACE_LEN))
    assert short.workspace_bytes_per_token == long.workspace_bytes_per_token
    assert short.workspace_bytes_per_token_ctx == long.workspace_bytes_per_token_ctx
    graph = trace(model, seq_len=TRACE_LEN)
    for batch, prompt in SHAPES:
        measured = measured_peaks(model, graph.names(), batch, prompt)["model.layers.1"]
        predicted = tensors(graph.unit("model.layers.1"), Workload(batch_size=batch, prompt_len=prompt, new_tokens=0),
                            graph.meta)
        assert measured <= predicted <= 1.15 * measured, (batch, prompt, predicted / measured)
