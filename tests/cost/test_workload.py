"""Workloads and the memory of a training step."""

from __future__ import annotations

import pytest

from placement_opt.cost.workload import Workload, dtype_bytes, training_memory, unit_training_bytes
from placement_opt.errors import WorkloadError
from placement_opt.hardware.devices import Device
from placement_opt.model.graph import chain_graph


def test_workload_defaults_and_derived_lengths() -> None:
    wl = Workload(batch_size=16, prompt_len=2048, new_tokens=256)
    assert wl.context_len == 2304 and wl.decode_steps == 256
    assert Workload(new_tokens=0).decode_steps == 0
    assert Workload(training=True, new_tokens=50).decode_steps == 0  # a training step has no decode
    assert Workload.from_dict(wl.to_dict()) == wl


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"batch_size": 0}, "batch_size is 0"),
    ({"prompt_len": -1}, "prompt_len is -1"),
    ({"new_tokens": -3}, "new_tokens is -3"),
    ({"batch_size": True}, "batch_size is True"),
    ({"optimizer": "lion"}, "'lion': accepted are 'adam', 'sgd', 'none'"),
])
def test_workload_rejects_bad_values(kwargs, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        Workload(**kwargs)


def test_dtype_bytes() -> None:
    assert dtype_bytes("torch.bfloat16") == 2 and dtype_bytes("float32") == 4
    with pytest.raises(ValueError, match="'complex32' is unknown: accepted are"):
        dtype_bytes("complex32")


def tiny(dtype: str = "float16"):
    # two units of 1000 params each (2000 B in fp16), outputs of 64 B per token
    return chain_graph([{"name": f"l{i}", "param_bytes": 2000 if dtype == "float16" else 4000,
                         "out_bytes_per_token": 64} for i in range(2)], dtype=dtype)


def test_unit_training_bytes_by_hand() -> None:
    unit = tiny().unit("l0")
    wl = Workload(training=True, batch_size=2, prompt_len=8)
    parts = unit_training_bytes(unit, wl, "float16")
    # grads 2000; Adam: 1000 params x (8 B moments + 4 B fp32 master) = 12000; activations 16 x 64 x 17
    assert (parts.gradient_bytes, parts.optimizer_bytes, parts.activation_bytes) == (2000, 12000, 17408)
    sgd = unit_training_bytes(unit, Workload(training=True, optimizer="sgd", batch_size=2, prompt_len=8), "float16")
    assert sgd.optimizer_bytes == 1000 * (4 + 4)
    fp32 = unit_training_bytes(tiny("float32").unit("l0"), wl, "float32")
    assert fp32.optimizer_bytes == 1000 * 8  # fp32 weights are their own master copy
    assert unit_training_bytes(unit, Workload(), "float16").total_bytes == 0  # inference


def test_training_memory_says_when_optimizer_offload_is_needed() -> None:
    graph = tiny()
    wl = Workload(training=True, batch_size=2, prompt_len=8)
    # total: weights 4000 + grads 4000 + Adam 24000 + activations 2 x 17408 = 66816
    report = training_memory(graph, wl)
    assert report.total_bytes == 66_816 and report.fits
    assert training_memory(graph, wl, capacity_bytes=70_000).fits
    assert not training_memory(graph, wl, capacity_bytes=Device("cuda:0", 60_000, reserve=0)).fits
    # without the optimizer states: 42816; fits 50000 only with offload
    offload = training_memory(graph, wl, capacity_bytes=50_000)
    assert offload.needs_optimizer_offload and not offload.fits
    assert "Offload the optimizer states to the CPU" in offload.message and "short" in offload.message
    hopeless = training_memory(graph, wl, capacity_bytes=10_000)
    assert not hopeless.needs_optimizer_offload and not hopeless.fits
    assert "activation checkpointing" in hopeless.message
    ckpt = training_memory(graph, Workload(training=True, batch_size=2, prompt_len=8,
                                           activation_checkpointing=True), capacity_bytes=10_000)
    assert ckpt.activation_bytes == 2 * 16 * 64 and "activation checkpointing" not in ckpt.message


@pytest.mark.parametrize("flag", ["overlap", "padded"])
def test_opt_in_flags_are_written_only_when_set(flag: str) -> None:
    assert flag not in Workload().to_dict()  # plan files read as before
    on = Workload(**{flag: True})
    assert on.to_dict()[flag] is True and Workload.from_dict(on.to_dict()) == on
    with pytest.raises(WorkloadError, match=flag):
        Workload(**{flag: "yes"})


def test_a_training_step_holds_no_generated_tokens_in_its_context() -> None:
    """A training step's new_tokens (128 by default) were counted in its context: a shortage message named a KV cache
    it never holds, and a note said a 4096-token step ran past a 4096-position model."""
    from placement_opt.plan_notes import context_note

    step = Workload(training=True, batch_size=2, prompt_len=4096)
    assert step.context_len == 4096 and Workload(prompt_len=4096).context_len == 4096 + 128
    graph = tiny()
    graph.meta.extra["max_position_embeddings"] = 4096
    assert context_note(graph, step) is None
    assert "4096 + 128 = 4224 tokens" in context_note(graph, Workload(prompt_len=4096))
    # a training step past the positions: its context is its prompt (the note said '8192 + 128 = 8192 tokens')
    assert "(8192 tokens) is past" in context_note(graph, Workload(training=True, prompt_len=8192))


def test_numpy_integers_are_integers_and_numpy_bools_and_floats_are_not():
    """A batch size read from a DataFrame or an array is a numpy int: it was refused as 'np.int64(4): it must be an
    int >= 1'. It is kept as the Python int it is; a numpy bool or a float stays refused."""
    import numpy as np

    workload = Workload(batch_size=np.int64(4), prompt_len=np.int32(16), new_tokens=np.uint8(3))
    assert workload == Workload(batch_size=4, prompt_len=16, new_tokens=3)
    assert all(type(v) is int for v in (workload.batch_size, workload.prompt_len, workload.new_tokens))
    for bad in (np.True_, np.float64(4.0)):
        with pytest.raises(WorkloadError, match="it must be an int >= 1"):
            Workload(batch_size=bad)
