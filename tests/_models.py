"""Tiny transformers models and hand-made plans over their units, shared by the runtime tests.

The models are random-init and small enough to run on a CPU in milliseconds (sizes in comments).
Plans are built by hand over the units a tracer would find: the instances of ``_no_split_modules``
and the modules outside them that hold weights. Test modules import from here, never from each other.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

from placement_opt.cost.evaluate import Cost
from placement_opt.cost.workload import Workload
from placement_opt.hardware.resolve import as_machine
from placement_opt.model.graph import covering_key
from placement_opt.plan import Plan, UnitPlacement

__all__ = ["FAMILIES", "MAPPED", "MAPPED_SYNC", "RESIDENT", "assert_restored", "inputs_for", "make_plan", "saved_tiny",
           "mixed", "plan_from", "snapshot", "tied_groups", "tiny", "units_of"]


def units_of(model: torch.nn.Module) -> list[str]:
    """Instances of ``_no_split_modules`` plus modules outside them that hold weights, in order."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    units: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(u + ".") for u in units if u):
            continue
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if type(module).__name__ in no_split or own:
            units.append(name)
    return units


def make_plan(placements: list[tuple[str, str, str, str]], name: str = "tiny") -> Plan:
    """A Plan with the given (unit, storage, execution, mode) rows and an empty cost."""
    workload = Workload(batch_size=1, prompt_len=8, new_tokens=4)
    cost = Cost(workload=workload, prefill_s=0.0, decode_s=0.0, transfer_s=0.0, stage_s={},
                units=(), memory=())
    return Plan(
        model_name=name, dtype="float32", objective="latency", strategy="sequential",
        placements=tuple(UnitPlacement(unit=u, storage=s, execution=e, mode=m) for u, s, e, m in placements),
        machine=as_machine({"cpu": "8GiB", "disk": "100GiB"}), workload=workload, cost=cost,
        status="GREEDY", objective_value=0.0, best_bound=0.0, gap=0.0, solve_time_s=0.0,
    )


def tied_groups(model: torch.nn.Module, units: list[str]) -> list[set[str]]:
    """Sets of units that hold one shared tensor (they must share storage)."""
    by_id: dict[int, set[str]] = {}
    for name, tensor in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(tensor), set()).add(covering_key(name, set(units)))
    return [group for group in by_id.values() if len(group) > 1]


def plan_from(model: torch.nn.Module, choose) -> Plan:
    """A plan where ``choose(i, unit)`` gives (storage, execution, mode); tied units follow the first."""
    units = units_of(model)
    rows = {u: choose(i, u) for i, u in enumerate(units)}
    for group in tied_groups(model, units):
        first = min(group, key=units.index)
        for u in group:
            rows[u] = rows[first]
    return make_plan([(u, *rows[u]) for u in units], name=type(model).__name__)


RESIDENT = ("cpu", "cpu", "resident")
MAPPED = ("disk", "cpu", "stream")          # computed from the memory map, next unit read ahead
MAPPED_SYNC = ("disk", "cpu", "stream_sync")


def mixed(i: int, unit: str) -> tuple[str, str, str]:
    return (RESIDENT, MAPPED, MAPPED_SYNC)[i % 3]


# Tiny models. Llama: 4 layers x (4 x 32x32-ish attention + 3 x 32x64 MLP) + 128x32 embed/head.
def tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        config = T.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        model = T.LlamaForCausalLM(config)
    elif family == "mixtral":  # 2 layers, 4 experts of 3 x 32x64, top-2
        config = T.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                 num_experts_per_tok=2, max_position_embeddings=64)
        model = T.MixtralForCausalLM(config)
    elif family == "qwen2_moe":  # 2 layers, 4 experts of 2 x 32x16 + 32x16, top-2, a shared expert of 3 x 32x32
        config = T.Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                  max_position_embeddings=64, decoder_sparse_step=1)
        model = T.Qwen2MoeForCausalLM(config)
    elif family == "dbrx":  # 2 blocks, 4 experts (top-2) stacked in 2-D tensors [4 x 64, 32]
        config = T.DbrxConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=128,
                              attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
                              ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2})
        model = T.DbrxForCausalLM(config)
    elif family == "jetmoe":  # 2 layers; MLP and attention experts (4 each, top-2) told their rows per expert
        config = T.JetMoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_key_value_heads=2, kv_channels=8, num_local_experts=4, num_experts_per_tok=2,
                                max_position_embeddings=64)
        model = T.JetMoeForCausalLM(config)
    elif family == "gpt2":  # 3 blocks, n_embd 32, lm_head tied to wte (128 x 32 = 4096 params)
        config = T.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=3, n_head=4,
                              bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = T.GPT2LMHeadModel(config)
    elif family == "t5":  # 2 + 2 blocks, d_model 32, shared embedding tied to both stacks and lm_head
        config = T.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                            num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = T.T5ForConditionalGeneration(config)
    else:
        raise ValueError(family)
    return model.eval()


FAMILIES = ["llama", "mixtral", "gpt2", "t5"]


def inputs_for(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A batch of 2, the second sequence left-padded by 2 tokens."""
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        batch["decoder_input_ids"] = torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(2))
    return batch


def saved_tiny(family: str, folder: Path) -> tuple[torch.nn.Module, Path, torch.Tensor]:
    """A tiny ``family`` model written to ``folder`` by ``save_pretrained``, with its logits on :func:`inputs_for`."""
    model = tiny(family)
    model.save_pretrained(folder)
    with torch.no_grad():
        reference = model(**inputs_for(model)).logits
    return model, folder, reference


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_restored(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert after[key].device == value.device, key
        assert torch.equal(after[key], value), key
        assert after[key].stride() == value.stride(), key  # a transposed buffer comes back transposed
    assert not hasattr(model, "hf_device_map")
    hooked = [n for n, m in model.named_modules() if "forward" in m.__dict__ or hasattr(m, "_hf_hook")]
    assert hooked == []
