"""dispatch() and load() are all or nothing (issue 17, item 2): a failure at any step leaves the model exactly
as it was (tensors, devices, forwards, experts configs, attributes), and a later dispatch works.

Failures are injected at each step (the k-th store write, the k-th forward wrapped, the k-th experts config,
the very last step) and also come from real causes (a tensor the store cannot write, an absent GPU, tied
weights on two storages, a truncated checkpoint)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from _models import MAPPED, RESIDENT, inputs_for, make_plan, mixed, plan_from, tiny, units_of
from placement_opt.errors import DispatchError
from placement_opt.runtime import _experts, _hooks, dispatcher
from placement_opt.runtime.dispatcher import dispatch
from placement_opt.runtime.loader import load
from placement_opt.runtime.offload import OffloadStore

_MODEL_ATTRIBUTES = ("hf_device_map", "_placement_opt_dispatch", "_optimize_model_for_decode")


def _state(model: torch.nn.Module) -> dict[str, Any]:
    """Tensors (object, memory, device, dtype, values), and each module's forward, config and attributes."""
    tensors = {name: (t, t.data_ptr(), t.device, t.dtype, t.detach().clone())
               for name, t in [*model.named_parameters(remove_duplicate=False),
                               *model.named_buffers(remove_duplicate=False)]}
    modules = {name: (m.__dict__.get("forward"), m.__dict__.get("config"), sorted(m.__dict__))
               for name, m in model.named_modules()}
    return {"tensors": tensors, "modules": modules}


def _assert_as_before(model: torch.nn.Module, before: dict[str, Any], *, same_memory: bool = True) -> None:
    """``same_memory``: the very same storage (a failed dispatch); remove() copies mapped weights back instead."""
    now = _state(model)
    assert now["tensors"].keys() == before["tensors"].keys()
    for name, (tensor, ptr, device, dtype, value) in before["tensors"].items():
        t, p, d, dt, v = now["tensors"][name]
        assert t is tensor, f"{name}: another tensor object"
        assert (d, dt) == (device, dtype), f"{name}: device or dtype changed ({d}, {dt})"
        assert p == ptr or not same_memory, f"{name}: not the original memory"
        assert torch.equal(v, value), f"{name}: values changed"
    for name, (forward, config, attrs) in before["modules"].items():
        f, c, a = now["modules"][name]
        assert f is forward, f"{name!r}: forward not restored"
        assert c is config, f"{name!r}: config not restored"
        assert a == attrs, f"{name!r}: attributes {set(a) ^ set(attrs)} left or lost"
    assert not any(attr in model.__dict__ for attr in _MODEL_ATTRIBUTES)


def _fail_at(count: int, exc: BaseException):
    """A wrapper factory: the wrapped callable raises ``exc`` on its ``count``-th call (1-based)."""
    calls = itertools.count(1)

    def wrap(real):
        def wrapped(*args, **kwargs):
            if next(calls) == count:
                raise exc
            return real(*args, **kwargs)
        return wrapped
    return wrap


def _dispatch_works(model: torch.nn.Module, plan, offload_dir, reference: torch.Tensor) -> None:
    """A later dispatch succeeds, gives the reference logits, and remove() restores the model."""
    before = _state(model)
    handle = dispatch(model, plan, offload_dir=offload_dir, _hook_every_unit=True)
    with torch.no_grad():
        torch.testing.assert_close(handle(**inputs_for(model)).logits, reference, rtol=1e-6, atol=1e-6)
    handle.remove()
    _assert_as_before(model, before, same_memory=False)


@pytest.fixture(params=["llama", "mixtral"])
def model_and_reference(request):
    model = tiny(request.param)
    with torch.no_grad():
        reference = model(**inputs_for(model)).logits
    return model, reference


_INJECTED = ["store write 1", "store write 3", "hook 1", "hook 4", "experts config 2", "handle", "interrupt"]


@pytest.mark.parametrize("where", _INJECTED)
def test_a_failure_at_any_step_leaves_the_model_as_it_was(model_and_reference, tmp_path, monkeypatch, where):
    model, reference = model_and_reference
    plan = plan_from(model, mixed)  # resident, mapped and streamed units: every kind of change
    error: BaseException = OSError("injected: disk full")
    if where.startswith("store write"):
        monkeypatch.setattr(OffloadStore, "write", _fail_at(int(where.split()[-1]), error)(OffloadStore.write))
    elif where.startswith("hook"):
        monkeypatch.setattr(_hooks, "_wrap", _fail_at(int(where.split()[-1]), error)(_hooks._wrap))
    elif where.startswith("experts config"):
        if not _experts.experts_modules(model):
            pytest.skip("no experts modules in this model")
        view = _experts._ExpertsConfigView
        monkeypatch.setattr(_experts, "_ExpertsConfigView", _fail_at(int(where.split()[-1]), error)(view))
    elif where == "handle":  # every change made, the last step fails
        monkeypatch.setattr(dispatcher, "DispatchedModel", _fail_at(1, error)(dispatcher.DispatchedModel))
    else:  # Ctrl-C in the middle of writing the offload files
        error = KeyboardInterrupt()
        monkeypatch.setattr(OffloadStore, "write", _fail_at(2, error)(OffloadStore.write))
    before = _state(model)
    expected = KeyboardInterrupt if isinstance(error, KeyboardInterrupt) else DispatchError
    with pytest.raises(expected) as raised:
        dispatch(model, plan, offload_dir=tmp_path, _hook_every_unit=True)
    if expected is DispatchError:
        assert raised.value.__cause__ is error
        assert "undone" in str(raised.value) and "injected: disk full" in str(raised.value)
    _assert_as_before(model, before)
    monkeypatch.undo()
    _dispatch_works(model, plan, tmp_path, reference)


@pytest.mark.parametrize("error", [MemoryError("injected"), torch.OutOfMemoryError("injected")],
                         ids=["MemoryError", "OutOfMemoryError"])
def test_running_out_of_memory_is_undone_and_raised_as_itself(model_and_reference, tmp_path, monkeypatch, error):
    """Callers catch OOM by its type (to retry with a smaller plan): dispatch undoes, then re-raises it."""
    model, reference = model_and_reference
    plan = plan_from(model, mixed)
    monkeypatch.setattr(OffloadStore, "write", _fail_at(2, error)(OffloadStore.write))
    before = _state(model)
    with pytest.raises(type(error)) as raised:
        dispatch(model, plan, offload_dir=tmp_path)
    assert raised.value is error
    assert any("ran out of memory while placing unit" in note for note in raised.value.__notes__)
    _assert_as_before(model, before)
    monkeypatch.undo()
    _dispatch_works(model, plan, tmp_path, reference)


def test_the_message_names_the_unit_being_placed(tmp_path, monkeypatch):
    model = tiny("llama")
    monkeypatch.setattr(OffloadStore, "write", _fail_at(2, OSError("injected"))(OffloadStore.write))
    plan = plan_from(model, lambda i, u: MAPPED)
    with pytest.raises(DispatchError, match=r"while placing unit 'model\.layers\.0' \(disk storage, cpu execution\)"):
        dispatch(model, plan, offload_dir=tmp_path)


def test_a_tensor_the_store_cannot_write_fails_late_and_leaves_the_model_as_it_was(tmp_path):
    # a real failure after two units were written and mapped: layer 1 holds a complex buffer
    model = tiny("llama")
    with torch.no_grad():
        reference = model(**inputs_for(model)).logits
    model.model.layers[1].register_buffer("freqs_cis", torch.ones(4, dtype=torch.complex64))
    before = _state(model)
    with pytest.raises(DispatchError, match="complex64"):
        dispatch(model, plan_from(model, lambda i, u: MAPPED), offload_dir=tmp_path)
    _assert_as_before(model, before)
    assert list(tmp_path.glob("*.safetensors")), "the earlier units were written: the failure came late"
    plan = plan_from(model, lambda i, u: RESIDENT if u == "model.layers.1" else MAPPED)
    _dispatch_works(model, plan, tmp_path, reference)


def test_an_absent_gpu_and_tied_weights_on_two_storages_leave_the_model_as_it_was(tmp_path):
    model = tiny("gpt2")
    with torch.no_grad():
        reference = model(**inputs_for(model)).logits
    before = _state(model)
    units = units_of(model)
    absent = make_plan([(u, "disk", "cuda:7", "stream") if u == "transformer.h.2" else (u, *MAPPED)
                        for u in units])
    if torch.cuda.device_count() <= 7:
        with pytest.raises(DispatchError, match="cuda:7"):
            dispatch(model, absent, offload_dir=tmp_path)
        _assert_as_before(model, before)
    tied = make_plan([(u, "disk" if u == "lm_head" else "cpu", "cpu", "resident") for u in units])
    with pytest.raises(DispatchError, match="tied weights"):
        dispatch(model, tied, offload_dir=tmp_path)
    _assert_as_before(model, before)
    _dispatch_works(model, plan_from(model, mixed), tmp_path, reference)


def test_remove_after_a_failed_dispatch_elsewhere_is_not_needed_and_a_second_dispatch_is_not_refused(tmp_path,
                                                                                                    monkeypatch):
    model = tiny("llama")
    monkeypatch.setattr(dispatcher, "DispatchedModel", _fail_at(1, RuntimeError("late"))(dispatcher.DispatchedModel))
    with pytest.raises(DispatchError):
        dispatch(model, plan_from(model, mixed), offload_dir=tmp_path)
    monkeypatch.undo()
    dispatch(model, plan_from(model, mixed), offload_dir=tmp_path).remove()  # not "already dispatched"


def test_load_that_fails_late_can_be_retried(tmp_path, monkeypatch):
    model = tiny("llama")
    with torch.no_grad():
        reference = model(**inputs_for(model)).logits
    model.save_pretrained(tmp_path / "ckpt")
    files = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    plan = plan_from(model, mixed)
    monkeypatch.setattr(_hooks, "_wrap", _fail_at(2, OSError("injected"))(_hooks._wrap))
    with pytest.raises(DispatchError, match="undone"):
        load(tmp_path / "ckpt", None, plan=plan, offload_dir=tmp_path / "off")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == files
    handle = load(tmp_path / "ckpt", None, plan=plan, offload_dir=tmp_path / "off")
    with torch.no_grad():
        torch.testing.assert_close(handle(**inputs_for(model)).logits, reference, rtol=1e-6, atol=1e-6)
    handle.remove()


def test_load_of_a_truncated_checkpoint_is_a_dispatch_error(tmp_path):
    model = tiny("llama")
    model.save_pretrained(tmp_path)
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(DispatchError, match="truncated|complete checkpoint"):
        load(tmp_path, None, plan=plan_from(model, mixed))


def test_remove_forgets_a_failed_prefetch_of_a_call_that_never_comes_and_stops_its_threads(tmp_path, monkeypatch):
    """The last unit of a call starts copying the next call's first streamed unit. When that copy failed (a GPU out
    of memory after the last step) remove() raised it, as 'could not undo 1 change', and left the prefetch and
    release threads running, though the model was restored."""
    import threading

    from _models import assert_restored, snapshot
    from placement_opt.runtime._streamer import Streamer

    model = tiny("llama")
    before = snapshot(model)
    handle = dispatch(model, plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT),
                      offload_dir=tmp_path / "offload", disk_reads="copy")
    first = next(u for u in units_of(model) if "layers" in u)
    real = Streamer._copy

    def failing(self, unit, side, after=()):
        if unit.name == first and threading.current_thread().name.startswith("placement_opt-prefetch"):
            raise RuntimeError(f"prefetch of {unit.name} failed")
        return real(self, unit, side, after)

    monkeypatch.setattr(Streamer, "_copy", failing)
    with torch.no_grad():
        handle(**inputs_for(model))
    monkeypatch.setattr(Streamer, "_copy", real)
    assert any(f.exception() for _, f in handle._streamer.inflight.values())  # the case: a failed copy in flight
    handle.remove()
    assert_restored(model, before)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("placement_opt-")]


def test_a_failure_between_two_routed_expert_hooks_leaves_no_hook(tmp_path, monkeypatch):
    """read_routed_experts hooked the experts modules one by one and returned its undo only at the end: an error
    at the second layer's experts left the first layer's hook on the model after dispatch's rollback."""
    from placement_opt.runtime import _routed_reads

    model = tiny("mixtral")
    hooks = {name: dict(m._forward_pre_hooks) for name, m in model.named_modules()}
    real, seen = _routed_reads.routing_argument, []

    def second_fails(module):
        seen.append(module)
        if len(seen) == 2:
            raise DispatchError("the second experts module cannot be read")
        return real(module)

    monkeypatch.setattr(_routed_reads, "routing_argument", second_fails)
    with pytest.raises(DispatchError, match="second experts module"):
        dispatch(model, plan_from(model, lambda i, u: MAPPED if "layers" in u else RESIDENT),
                 offload_dir=tmp_path / "offload")
    assert len(seen) == 2  # the case: one hook was in place when the error came
    assert {name: dict(m._forward_pre_hooks) for name, m in model.named_modules()} == hooks
