"""time_units: each unit's measured seconds, beside the plan's, on a dispatched model (CPU)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers as T

import placement_opt
from placement_opt.cost.workload import Workload
from placement_opt.runtime.breakdown import time_units
from placement_opt.runtime.dispatcher import dispatch

SLEEP_S = 0.03


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a loaded 2-core machine a second thread, idle through a unit's 30 ms sleep, took up
    to 85 ms to be scheduled again, in the next unit's figures (the tests compare units' times)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return T.LlamaForCausalLM(config).eval()


def _plan(model: torch.nn.Module, devices: dict, new_tokens: int = 4):
    workload = Workload(batch_size=1, prompt_len=16, new_tokens=new_tokens)
    return placement_opt.solve(placement_opt.trace(model), devices, workload=workload, time_limit_s=1)


def _slowed(module: torch.nn.Module) -> object:
    """``module`` made ``SLEEP_S`` slower after it computes (a forward hook: what runs before the next unit)."""
    return module.register_forward_hook(lambda *_: time.sleep(SLEEP_S))


def _broken_down(slowing: Callable[[torch.nn.Module], Any], slow: str = "model.layers.2") -> Any:
    """``time_units`` of the dispatched tiny model, ``slowing`` (which returns a hook handle) put on unit ``slow``."""
    model = _model()
    plan = _plan(model, {"cpu": "8GiB"})
    handle = dispatch(model, plan)
    hook = slowing(model.get_submodule(slow))
    try:
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
        return time_units(handle, plan.cost, ids, new_tokens=4)
    finally:
        hook.remove()
        handle.remove()


def test_a_slow_unit_is_the_worst_miss_and_carries_its_own_time(tmp_path) -> None:
    """A unit made 30 ms slower than its plan: the breakdown names it first, with the 30 ms in its own figures
    (prefill and each decode step), not in the unit after it."""
    slow = "model.layers.2"
    breakdown = _broken_down(_slowed, slow)
    by_name = {u.name: u for u in breakdown.units}
    assert breakdown.misses(1)[0].name == slow
    assert by_name[slow].measured_decode_step_s >= SLEEP_S
    assert by_name[slow].measured_prefill_s >= SLEEP_S
    after = by_name["model.layers.3"]
    assert after.measured_decode_step_s < SLEEP_S / 2 and after.measured_prefill_s < SLEEP_S / 2
    assert breakdown.untimed == ()
    assert breakdown.decode_step_s >= SLEEP_S


def test_a_unit_s_own_pre_hooks_count_with_it_not_with_the_unit_before(tmp_path) -> None:
    """Work a module's pre-hooks do at its call (the dispatcher's ask for a disk unit's routed experts is one)
    counts with that unit: the marks are the first pre-hook of each unit, whenever they are registered."""
    slow = "model.layers.2"
    breakdown = _broken_down(lambda module: module.register_forward_pre_hook(lambda *_: time.sleep(SLEEP_S)), slow)
    by_name = {u.name: u for u in breakdown.units}
    assert by_name[slow].measured_decode_step_s >= SLEEP_S and by_name[slow].measured_prefill_s >= SLEEP_S
    before = by_name["model.layers.1"]
    assert before.measured_decode_step_s < SLEEP_S / 2 and before.measured_prefill_s < SLEEP_S / 2


def test_kinds_sum_their_units_and_name_how_they_run(tmp_path) -> None:
    """A plan with units on disk: one row per kind, the unit counts adding up to the plan's, each row the sum
    of its units' figures."""
    model = _model()
    model.save_pretrained(tmp_path / "ckpt")
    workload = Workload(batch_size=1, prompt_len=16, new_tokens=4)
    weights = sum(p.numel() * 4 for p in model.parameters())
    # half the weights in RAM and room for a prefill's workspace and MKL's scratch: the rest goes to disk
    handle = placement_opt.load(tmp_path / "ckpt", {"cpu": weights // 2 + 2**16, "disk": "1GiB"}, workload=workload,
                                offload_dir=tmp_path / "offload", time_limit_s=1)
    try:
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
        breakdown = time_units(handle, handle.plan.cost, ids, new_tokens=4)
    finally:
        handle.remove()
    kinds = breakdown.kinds()
    names = {k.kind for k in kinds}
    assert any(k.startswith("resident cpu") for k in names), names
    assert any("disk -> cpu" in k for k in names), names
    assert sum(int(k.name.split()[0]) for k in kinds) == len(handle.plan.placements)
    for kind in kinds:
        members = [u for u in breakdown.units if u.kind == kind.kind]
        assert kind.measured_decode_step_s == pytest.approx(sum(u.measured_decode_step_s for u in members))
        assert kind.predicted_prefill_s == pytest.approx(sum(u.predicted_prefill_s for u in members))
    # (a step's units add up to its whole call by construction: the first one's time starts with the call. The median
    # step against the sum of the units' medians compared noise alone: 1.8x apart beside a busy core)


def test_a_prompt_it_cannot_time_is_refused_before_any_forward() -> None:
    model = _model()
    plan = _plan(model, {"cpu": "8GiB"})
    with pytest.raises(ValueError, match="new_tokens at least 2"):
        time_units(model, plan.cost, torch.zeros((1, 4), dtype=torch.long), new_tokens=1)
    with pytest.raises(ValueError, match="batch x prompt"):
        time_units(model, plan.cost, torch.zeros((4,), dtype=torch.long), new_tokens=3)


@pytest.mark.cuda
def test_a_unit_slow_on_the_gpu_carries_its_own_time_on_the_gpu_s_clock() -> None:  # pragma: no cover - needs a GPU
    """A GPU unit whose kernels run 30 ms longer (``torch.cuda._sleep`` queued after it: the host goes on at once):
    the marks are CUDA events, so the time lands on that unit, not on whichever later call the host waits in."""
    model = _model()
    plan = _plan(model, {0: "1GiB", "cpu": "8GiB"})
    handle = dispatch(model, plan)
    on_gpu = [p.unit for p in plan.placements if p.execution == "cuda:0" and p.unit.startswith("model.layers.")]
    assert on_gpu, plan.summary()
    slow = on_gpu[0]
    cycles = int(SLEEP_S * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # clock_rate: kHz
    hook = model.get_submodule(slow).register_forward_hook(lambda *_: torch.cuda._sleep(cycles))
    try:
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0)).to("cuda:0")
        breakdown = time_units(handle, plan.cost, ids, new_tokens=4)
    finally:
        hook.remove()
        handle.remove()
    assert breakdown.misses(1)[0].name == slow
    assert {u.name: u for u in breakdown.units}[slow].measured_decode_step_s >= 0.8 * SLEEP_S
