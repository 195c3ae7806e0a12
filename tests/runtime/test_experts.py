"""CPU-executed experts keep their CPU kernel through generate()'s decode-time switch (issue 14).

transformers switches every experts module to ``batched_mm`` at decode when ``model.device`` is
not the CPU. ``batched_mm`` copies the routed experts' weights per token: on a CPU that is the
5x slowdown measured on the H100 host. The switch is driven here without a GPU by making
``model.device`` read as ``cuda:0``; the kernels that run are recorded through the experts
interface.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from _models import RESIDENT, plan_from
from placement_opt.runtime._experts import experts_modules, pin_experts_to_devices
from placement_opt.runtime.dispatcher import dispatch

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def tiny_moe(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "mixtral":
        config = T.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                 num_experts_per_tok=2, max_position_embeddings=64)
        return T.MixtralForCausalLM(config).eval()
    config = T.Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                              shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=64)
    return T.Qwen2MoeForCausalLM(config).eval()


@pytest.fixture(params=["mixtral", "qwen2_moe"])
def moe_model(request) -> torch.nn.Module:
    return tiny_moe(request.param)


class _Calls(list):
    """``(experts module name, implementation)`` of every experts call, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: dict[int, str] = {}


@pytest.fixture
def kernels(monkeypatch) -> _Calls:
    """Records which kernel every experts call runs."""
    calls = _Calls()
    names = calls.names

    def recording(impl: str):
        original = ALL_EXPERTS_FUNCTIONS[impl]

        def run(module, *args, **kwargs):
            calls.append((names.get(id(module), "?"), impl))
            return original(module, *args, **kwargs)

        return run

    for impl in ("grouped_mm", "batched_mm"):
        monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._local_mapping, impl, recording(impl))
    return calls


def _decode_step(model: torch.nn.Module) -> None:
    """A forward inside the model's own decode switch, with model.device reading as cuda:0."""
    ids = torch.tensor([[3, 5, 7]])
    device_property = type(model).device
    type(model).device = property(lambda self: CUDA)
    try:
        switch = model._optimize_model_for_decode()
        switch.__enter__()
    finally:
        type(model).device = device_property
    try:
        with torch.no_grad():
            model(ids)
    finally:
        switch.__exit__(None, None, None)


def _name_experts(model: torch.nn.Module, kernels) -> list[str]:
    found = experts_modules(model)
    kernels.names.update({id(m): n for n, m in found})
    return [n for n, _ in found]


def test_transformers_still_has_the_decode_switch():
    """The method we replace per model; if transformers renames it, this says so."""
    assert hasattr(T.GenerationMixin, "_optimize_model_for_decode")


def test_the_switch_is_driven_without_a_gpu(moe_model, kernels):
    """Control: an undispatched model whose device reads as cuda switches every experts module."""
    experts = _name_experts(moe_model, kernels)
    assert len(experts) == 2
    _decode_step(moe_model)
    assert kernels and {impl for _, impl in kernels} == {"batched_mm"}
    assert moe_model.get_experts_implementation() == {"": "grouped_mm"}  # restored after the switch


def test_cpu_executed_experts_keep_grouped_mm_whatever_the_main_device(moe_model, kernels):
    experts = _name_experts(moe_model, kernels)
    handle = dispatch(moe_model, plan_from(moe_model, lambda i, u: RESIDENT))
    _decode_step(moe_model)
    assert sorted(kernels) == sorted((name, "grouped_mm") for name in experts)
    handle.remove()
    assert "config" in vars(moe_model.model.layers[0].mlp.experts)
    assert moe_model.model.layers[0].mlp.experts.config is moe_model.config
    assert "_optimize_model_for_decode" not in vars(moe_model)


def test_each_experts_module_follows_its_own_units_device(moe_model, kernels):
    """A GPU-executed layer switches as transformers intends; a CPU-executed one does not."""
    experts = _name_experts(moe_model, kernels)
    undo = pin_experts_to_devices(moe_model, {"model.layers.0": CUDA, "model.layers.1": CPU}, default=CPU)
    _decode_step(moe_model)
    assert dict(kernels) == {experts[0]: "batched_mm", experts[1]: "grouped_mm"}
    kernels.clear()
    undo()
    _decode_step(moe_model)
    assert {impl for _, impl in kernels} == {"batched_mm"}


def test_gpu_experts_switch_even_when_the_model_starts_on_the_cpu(moe_model, kernels):
    """transformers would not switch (model.device is cpu); a GPU-executed unit still should."""
    experts = _name_experts(moe_model, kernels)
    undo = pin_experts_to_devices(moe_model, {"model.layers.0": CPU, "model.layers.1": CUDA}, default=CPU)
    with moe_model._optimize_model_for_decode(), torch.no_grad():
        moe_model(torch.tensor([[1, 2]]))
    undo()
    assert dict(kernels) == {experts[0]: "grouped_mm", experts[1]: "batched_mm"}


def test_outside_decode_every_module_uses_the_configured_kernel(moe_model, kernels):
    experts = _name_experts(moe_model, kernels)
    undo = pin_experts_to_devices(moe_model, {"model.layers.0": CUDA}, default=CPU)
    with torch.no_grad():
        moe_model(torch.tensor([[1, 2]]))
    moe_model.set_experts_implementation("eager")  # a user's choice still reaches every module
    with torch.no_grad():
        moe_model(torch.tensor([[1, 2]]))
    undo()
    assert sorted(kernels) == sorted((name, "grouped_mm") for name in experts)


def test_generate_through_the_switch_gives_the_plain_models_tokens(moe_model, kernels):
    """generate() on a dispatched model: same greedy tokens, only grouped_mm on the CPU."""
    ids = torch.tensor([[3, 5, 7, 9]])
    expected = moe_model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    kernels.clear()
    handle = dispatch(moe_model, plan_from(moe_model, lambda i, u: RESIDENT))
    type_device = type(moe_model).device
    got = handle.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    handle.remove()
    assert type(moe_model).device is type_device
    assert torch.equal(got, expected)
    assert kernels and {impl for _, impl in kernels} == {"grouped_mm"}


def test_models_without_experts_are_left_alone():
    config = T.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2)
    model = T.LlamaForCausalLM(config)
    undo = pin_experts_to_devices(model, {"model.layers.0": CUDA}, default=CPU)
    assert "_optimize_model_for_decode" not in vars(model)
    undo()
