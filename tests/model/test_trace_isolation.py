"""trace() and solve() never touch the model they are given (issue 17, item 3), and warn when the traced
forward branched on tensor values it could not see."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from _models import RESIDENT, inputs_for, plan_from, tiny, units_of
from placement_opt import dispatch, solve
from placement_opt.model.tracer import trace

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
               "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def _state(model: nn.Module) -> dict[str, Any]:
    """Everything trace could change: tensors (object, storage, device, values), flags, forwards, hooks."""
    tensors = {name: (t, t.data_ptr(), t.device, t.dtype, t.requires_grad, t.detach().clone())
               for name, t in [*model.named_parameters(remove_duplicate=False),
                               *model.named_buffers(remove_duplicate=False)]}
    modules = {name: (m, m.training, m.__dict__.get("forward"), sorted(m.__dict__),
                      {key: dict(getattr(m, key)) for key in _HOOK_DICTS if hasattr(m, key)})
               for name, m in model.named_modules()}
    return {"tensors": tensors, "modules": modules}


def _assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["tensors"].keys() == after["tensors"].keys()
    for name, (tensor, ptr, device, dtype, grad, value) in before["tensors"].items():
        now = after["tensors"][name]
        assert now[0] is tensor, f"{name}: another tensor object"
        assert (now[1], now[2], now[3], now[4]) == (ptr, device, dtype, grad), name
        assert torch.equal(now[5], value), f"{name}: values changed"
    assert before["modules"].keys() == after["modules"].keys()
    for name, (module, training, forward, attrs, hooks) in before["modules"].items():
        now = after["modules"][name]
        assert now[0] is module and now[1] == training, f"{name!r}: module or training flag changed"
        assert now[2] is forward, f"{name!r}: forward attribute changed"
        assert now[3] == attrs, f"{name!r}: attributes {set(now[3]) ^ set(attrs)} added or removed"
        assert now[4] == hooks, f"{name!r}: hooks changed"


@pytest.mark.parametrize("family", ["llama", "mixtral", "t5"])
@pytest.mark.parametrize("training", [False, True])
def test_trace_leaves_model_identical(family: str, training: bool) -> None:
    model = tiny(family).train(training)
    calls: list[str] = []
    model.register_forward_hook(lambda *_: calls.append("hook"))  # the user's hook: not run by the trace
    before = _state(model)
    graph = trace(model)
    _assert_same(before, _state(model))
    assert calls == [], "trace ran a hook of the live model"
    assert graph.meta.traced


def test_trace_with_dtype_and_example_inputs_leaves_model_identical() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    before = _state(model)
    trace(model, dtype="float16", example_inputs=(torch.randn(2, 3, 8),))
    _assert_same(before, _state(model))


class _Shortcut(nn.Module):
    """Calls a submodule through an unregistered attribute as well as through its registered name."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.__dict__["peer"] = self.inner  # not in _modules: the copy must point it at its own inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.peer(self.inner(x))


def test_unregistered_references_point_into_the_copy() -> None:
    model = _Shortcut()
    calls: list[str] = []
    model.inner.register_forward_pre_hook(lambda *_: calls.append("live inner ran"))
    before = _state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to the static graph would warn
        graph = trace(model, example_inputs=(torch.randn(2, 8),))
    _assert_same(before, _state(model))
    assert calls == [] and graph.meta.traced


def test_dispatched_model_traces_like_the_plain_one_and_keeps_running() -> None:
    model = tiny("llama")
    batch = inputs_for(model)
    reference = model(**batch).logits
    plain = trace(model)
    handle = dispatch(model, plan_from(model, lambda i, u: RESIDENT), _hook_every_unit=True)
    before = _state(model)
    graph = trace(model)  # the copy drops dispatch's forward wrappers: the model's own forwards are traced
    _assert_same(before, _state(model))
    assert graph.to_json() == plain.to_json()
    assert torch.equal(handle(**batch).logits, reference)
    handle.remove()


def test_forwards_keep_working_while_another_thread_solves() -> None:
    model = tiny("llama")
    batch = inputs_for(model)
    with torch.no_grad():
        reference = model(**batch).logits
    failures: list[str] = []
    mismatches = 0
    forwards = 0
    stop = threading.Event()

    def serve() -> None:
        nonlocal forwards, mismatches
        while not stop.is_set():
            try:
                with torch.no_grad():
                    out = model(**batch).logits
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            forwards += 1
            mismatches += not torch.equal(out, reference)

    server = threading.Thread(target=serve)
    server.start()
    try:
        started = time.perf_counter()
        plans = 0
        while plans < 4 or time.perf_counter() - started < 3.0:
            plan = solve(model, {"cpu": "1GiB", "disk": "100GiB"}, time_limit_s=0.2)
            assert sorted(p.unit for p in plan.placements) == sorted(units_of(model))
            plans += 1
    finally:
        stop.set()
        server.join()
    assert failures == [], f"{len(failures)} of {forwards + len(failures)} forwards failed: {failures[:3]}"
    assert mismatches == 0, f"{mismatches} of {forwards} outputs differ from the reference"
    assert forwards >= 10


class _Gate(nn.Module):
    """Runs one or two layers depending on the data: a branch the meta trace cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.first(x)
        return self.second(self.first(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.gate = _Gate()
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.embed(x)))


def _trace_warnings(model: Any, **kwargs: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace(model, **kwargs)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)
            and "placement_opt.trace" in str(w.message)]


def test_data_dependent_branch_warns_with_unit_and_line() -> None:
    found = _trace_warnings(_Net(), no_split=["_Gate"])
    assert len(found) == 1, found
    assert "unit 'gate'" in found[0]
    assert f"{__file__}:" in found[0] and "(forward)" in found[0]
    assert "torch.where" in found[0]  # what to do


@pytest.mark.parametrize("family", ["llama", "mixtral", "gpt2", "t5"])
def test_transformers_mask_checks_do_not_warn(family: str) -> None:
    assert _trace_warnings(tiny(family)) == []


def test_llama_config_does_not_warn() -> None:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    assert _trace_warnings(config) == []


_RSS_CHILD = """
import json, resource, torch, transformers
from placement_opt import trace
config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504,
                                  num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
model = model.to_empty(device="cpu")
for p in model.parameters():
    p.data.fill_(0.01)  # touch every page: the weights are resident
weights = sum(p.numel() * p.element_size() for p in model.parameters())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
graph = trace(model)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"weights": weights, "before": before, "after": after, "units": len(graph)}))
"""


def test_peak_rss_stays_flat_when_tracing_a_1gb_model() -> None:
    done = subprocess.run([sys.executable, "-c", _RSS_CHILD], capture_output=True, text=True, timeout=300, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["weights"] > 0.9e9
    grown = figures["after"] - figures["before"]
    assert grown < 0.1 * figures["weights"], f"peak RSS grew by {grown / 2**20:.0f} MiB while tracing"
