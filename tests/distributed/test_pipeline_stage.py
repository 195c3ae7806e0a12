"""One stage module in one process: what it runs is what plan_pipeline() priced (no process group needed)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from placement_opt.cost.workload import Workload  # noqa: E402
from placement_opt.distributed.pipeline_plan import plan_pipeline  # noqa: E402
from placement_opt.runtime.pipelining import stage_module  # noqa: E402

VOCAB = 128


def _tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).eval()  # as from_pretrained returns it, and it trains so


def _saved_bytes(module, ids) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for the backward of one forward (tensors a checkpoint recomputes are not kept)."""
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(ids)
    return sum(saved), out


def test_a_plan_priced_with_activation_checkpointing_runs_checkpointed() -> None:
    """Workload(activation_checkpointing=True) priced each stage's saved activations as the layers' inputs only
    (llama-2-7b, 4 x A100-80GB, 8 micro-batches of 4096 tokens: stage 0 at 28 GiB), but the stage module kept every
    activation (46 GiB on that stage): a plan that fit an A100-40GB ran out of its memory."""
    model = _tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 16))
    labels = torch.randint(0, VOCAB, (2, 16))
    kept = {}
    for checkpointed in (False, True):
        workload = Workload(batch_size=2, prompt_len=16, training=True, activation_checkpointing=checkpointed)
        plan = plan_pipeline(model, "(cpu)", workload)
        model.zero_grad()
        kept[checkpointed], logits = _saved_bytes(stage_module(model, plan, 0), ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if not checkpointed:
            plain = grads
    assert kept[True] < kept[False] / 2
    for name, grad in plain.items():  # recomputed in the backward, the same gradients
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_batch_that_does_not_split_into_the_micro_batches_is_refused(tmp_path) -> None:
    """torch's stages take their buffers' shape from the first micro-batch: a batch of 5 in 2 micro-batches came
    out of the last stage as 6 rows, one of them of no input, without an error. One process, one stage, gloo."""
    import torch.distributed as dist

    from placement_opt.errors import DispatchError
    from placement_opt.runtime.pipelining import pipeline

    model = _tiny_llama()
    plan = plan_pipeline(model, "(cpu*1)", Workload(batch_size=2, prompt_len=8), schedule="gpipe", n_microbatches=2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        run = pipeline(model, plan)
        ids = torch.randint(0, VOCAB, (5, 8))
        with torch.no_grad(), pytest.raises(DispatchError, match=r"a batch of 5 sequences does not split into the "
                                                                 r"plan's 2 micro-batches.*e\.g\. 4"):
            run.schedule.step(ids)
        with torch.no_grad():
            logits = run.schedule.step(ids[:4])
            torch.testing.assert_close(logits, model(ids[:4], use_cache=False).logits, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()
