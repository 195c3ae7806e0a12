"""Stage modules in one process: chained, they are the model; only a stage's tensors are read."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from placement_opt.cost.workload import Workload  # noqa: E402
from placement_opt.distributed.pipeline_plan import plan_pipeline  # noqa: E402
from placement_opt.errors import DispatchError  # noqa: E402
from placement_opt.runtime.pipelining import stage_module  # noqa: E402


def _llama(tie: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_stages_chained_are_the_model(tmp_path, ranks: int) -> None:
    model = _llama()
    model.save_pretrained(tmp_path)
    plan = plan_pipeline(model, f"(cpu*{ranks})", Workload(batch_size=1, prompt_len=8), schedule="gpipe")
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        for source in (model, tmp_path):
            x = ids
            for k in range(ranks):
                x = stage_module(source, plan, k)(x)
            torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


@pytest.mark.parametrize(("family", "extra"), [
    ("Mistral", dict(sliding_window=4)),
    ("Qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)),
    ("Gemma2", dict(head_dim=16, sliding_window=4)),  # every other layer sliding; final logits capped
    ("Gemma3Text", dict(head_dim=16, sliding_window=4)),  # a rotary table per kind of layer
    ("Granite", dict(embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5)),
    ("Cohere", dict(logit_scale=0.25)),
])
def test_stages_chained_are_the_model_for_windows_and_scalings_the_models_forward_applies(family, extra) -> None:
    """Stages built every layer's causal mask and called only the units: past the window a sliding-window layer
    attended to the whole prompt, Gemma 3's rotary table refused the call, and the embedding and logit scalings
    of the model's own forward were skipped (logits 0.3-0.9 apart from the model's, without an error)."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**{**_COMMON, **extra})
    model = getattr(transformers, f"{family.removesuffix('Text')}ForCausalLM")(config).eval()
    plan = plan_pipeline(model, "(cpu*3)", Workload(batch_size=1, prompt_len=12), schedule="gpipe")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        x = ids
        for k in range(3):
            x = stage_module(model, plan, k)(x)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


def test_a_stage_holds_only_its_units_under_their_names(tmp_path) -> None:
    model = _llama()
    model.save_pretrained(tmp_path)
    plan = plan_pipeline(model, "(cpu*2)", Workload(batch_size=1, prompt_len=8), schedule="gpipe")
    first = stage_module(tmp_path, plan, 0)
    names = set(dict(first.named_parameters()))
    units = plan.stages[0].units
    assert names and all(any(n.startswith(u + ".") for u in units) for n in names)
    assert not any(p.is_meta for p in first.parameters())
    reference = dict(model.named_parameters())
    for name, param in first.named_parameters():
        torch.testing.assert_close(param, reference[name])


def test_meta_models_and_tied_training_are_refused(tmp_path) -> None:
    with torch.device("meta"):
        meta = _llama()
    plan = plan_pipeline(meta, "(cpu*2)", Workload(batch_size=1, prompt_len=8), schedule="gpipe")
    with pytest.raises(DispatchError, match="meta device: pass its checkpoint directory"):
        stage_module(meta, plan, 0)
    tied = _llama(tie=True)
    from placement_opt.errors import SolverInputError

    with pytest.raises(SolverInputError, match="ties weights between stages"):  # said when planning
        plan_pipeline(tied, "(cpu*2)", Workload(batch_size=1, prompt_len=8, training=True), schedule="gpipe")
    infer = plan_pipeline(tied, "(cpu*2)", Workload(batch_size=1, prompt_len=8), schedule="gpipe")
    import dataclasses

    train = dataclasses.replace(infer, workload=Workload(batch_size=1, prompt_len=8, training=True))  # edited by hand
    with pytest.raises(DispatchError, match="ties weights"):
        stage_module(tied, train, 0)
    assert stage_module(tied, infer, 1) is not None  # two copies are right for inference


def test_a_model_without_decoder_roles_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    plan = plan_pipeline(model, "(cpu*2)", Workload(batch_size=1, prompt_len=4), schedule="gpipe")
    with pytest.raises(DispatchError, match="decoder-only"):
        stage_module(model, plan, 0)


def test_a_plan_of_a_smaller_model_is_refused_on_a_larger_one(tmp_path) -> None:
    """A 2-layer model's plan run on a 4-layer checkpoint ran without layers 2-3, with other logits and no word."""
    torch.manual_seed(0)
    small = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64)).eval()
    plan = plan_pipeline(small, "(cpu*2)", Workload(batch_size=1, prompt_len=8), schedule="gpipe")
    large = _llama()
    large.save_pretrained(tmp_path)
    for source in (large, tmp_path):
        with pytest.raises(DispatchError, match=r"parameter\(s\) of this model are in no stage of the plan "
                                                r"\(model.layers.2.*the plan was made for another model"):
            stage_module(source, plan, 0)


def test_a_stage_read_from_a_checkpoint_keeps_tied_weights_one_parameter(tmp_path) -> None:
    """A one-stage plan of a tied model read from its checkpoint gave lm_head and embed_tokens a Parameter each over
    one tensor: an optimizer stepped the shared weights twice, with two gradients, not their sum."""
    model = _llama(tie=True)
    model.save_pretrained(tmp_path)
    plan = plan_pipeline(model, "(cpu*1)", Workload(batch_size=1, prompt_len=8, training=True), schedule="gpipe")
    stage = stage_module(tmp_path, plan, 0)
    params = dict(stage.named_parameters(remove_duplicate=False))
    head, embed = (next(p for n, p in params.items() if n.endswith(k)) for k in ("lm_head.weight",
                                                                                 "embed_tokens.weight"))
    assert head is embed
    assert len(list(stage.parameters())) == len(list(model.parameters()))  # what the model itself counts
    torch.testing.assert_close(embed, model.model.embed_tokens.weight, rtol=0, atol=0)


def test_stages_of_a_mixtral_checkpoint_read_its_experts_as_from_pretrained_fuses_them(tmp_path) -> None:
    """save_pretrained writes each expert's w1/w2/w3 apart and the router as block_sparse_moe.gate; a stage read
    from it failed with "has no tensor model.layers.0.mlp.gate.weight"."""
    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    plan = plan_pipeline(model, "(cpu*2)", Workload(batch_size=1, prompt_len=8), schedule="gpipe")
    ids = torch.randint(0, 128, (1, 8))
    x = ids
    with torch.no_grad():
        for k in range(2):
            x = stage_module(tmp_path, plan, k)(x)
        torch.testing.assert_close(x, model(ids).logits, rtol=0, atol=0)
