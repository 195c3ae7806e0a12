"""Helpers for the offload-store tests, also run as a script by their subprocesses.

Kept apart from the test modules so that a subprocess can import it without pytest and
without importing a test module (copies of the few lines of ``test_dispatch``'s helpers that
these tests need).

Script use (the subprocesses of ``test_offload_concurrency`` and ``test_offload_faults``)::

    python tests/_offload_helpers.py rounds DIR SEED ROUNDS
        dispatch tiny Llama SEED into DIR ROUNDS times, checking weights and outputs each round;
        prints "ok" at the end (any mismatch raises: non-zero exit with the traceback).
    python tests/_offload_helpers.py write-and-pause DIR TENSORS POINT FILE_PREFIX
        write the units saved in TENSORS (torch.save of {unit: {name: tensor}}) through
        OffloadStore.write; when the writer reaches write point POINT on a file whose name starts
        with FILE_PREFIX, print POINT and sleep until killed (``test_offload_faults`` runs the same
        as ``write_and_pause_child`` in forked children).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from _models import units_of  # tests/ is on sys.path: under pytest, and as this script's folder

UNIT_ROWS = ("disk", "cpu", "stream"), ("disk", "cpu", "stream_sync")
"""Storage, execution, mode of the disk units (alternating): computed from the memory map."""


def tiny_llama(seed: int) -> torch.nn.Module:
    """A random Llama: hidden 32, 2 layers, vocab 128 (about 100 KB of fp32 weights)."""
    import transformers as T

    torch.manual_seed(seed)
    config = T.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return T.LlamaForCausalLM(config).eval()


def disk_plan(model: torch.nn.Module):
    """A plan storing every unit of ``model`` on disk (no tied weights in tiny_llama)."""
    from placement_opt.cost.evaluate import Cost
    from placement_opt.cost.workload import Workload
    from placement_opt.hardware.resolve import as_machine
    from placement_opt.plan import Plan, UnitPlacement

    workload = Workload(batch_size=1, prompt_len=8, new_tokens=4)
    cost = Cost(workload=workload, prefill_s=0.0, decode_s=0.0, transfer_s=0.0, stage_s={},
                units=(), memory=())
    rows = [UnitPlacement(unit=u, storage=s, execution=e, mode=m)
            for i, u in enumerate(units_of(model)) for s, e, m in [UNIT_ROWS[i % 2]]]
    return Plan(model_name="tiny-llama", dtype="float32", objective="latency", strategy="sequential",
                placements=tuple(rows), machine=as_machine({"cpu": "8GiB", "disk": "100GiB"}),
                workload=workload, cost=cost, status="GREEDY", objective_value=0.0, best_bound=0.0,
                gap=0.0, solve_time_s=0.0)


def input_ids() -> torch.Tensor:
    return torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_tensors(model: torch.nn.Module, original: dict[str, torch.Tensor], where: str) -> None:
    """Every tensor of ``model`` bitwise equal to ``original``; the message names the first that differs."""
    state = model.state_dict()
    assert state.keys() == original.keys(), where
    for key, value in original.items():
        assert torch.equal(state[key], value), f"{where}: {key} differs from the model's own weights"


def dispatch_rounds(directory: str | Path, model: torch.nn.Module, rounds: int, label: str) -> None:
    """Dispatch ``model`` into ``directory`` ``rounds`` times; check weights and outputs each time.

    The model's reference outputs are computed before any dispatch; in every round its weights
    while dispatched, its logits, and its weights after ``.remove()`` must equal its own.
    (Build the model before starting threads: random init and transformers' lazy imports are
    not thread-safe.)
    """
    from placement_opt.runtime.dispatcher import dispatch

    original = snapshot(model)
    ids = input_ids()
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    plan = disk_plan(model)
    for round_ in range(rounds):
        handle = dispatch(model, plan, offload_dir=directory)
        try:
            assert_same_tensors(model, original, f"{label} round {round_}, dispatched")
            with torch.no_grad():
                logits = handle(input_ids=ids).logits
        finally:
            handle.remove()
        assert torch.equal(logits, reference), f"{label} round {round_}: logits differ from the plain model's"
        assert_same_tensors(model, original, f"{label} round {round_}, after remove()")


def _write_and_pause(directory: str, tensors_path: str, point: str, prefix: str, say=None) -> None:
    """``say``: how the writer reports the point it stopped at (default: a line on stdout)."""
    from placement_opt.runtime import offload

    say = say or (lambda text: print(text, flush=True))

    def pause(reached: str, name: str) -> None:
        if reached == point and name.startswith(prefix):
            say(reached)
            time.sleep(120)  # the test kills us here

    offload._reached = pause
    units = torch.load(tensors_path)
    store = offload.OffloadStore(directory)
    for unit, tensors in units.items():
        store.write(unit, tensors)
    say("finished")


def write_and_pause_child(directory: str, tensors_path: str, point: str, prefix: str, connection) -> None:
    """``write-and-pause`` as a ``multiprocessing`` child: the point it stopped at goes down ``connection``.

    Forked from a forkserver that imported torch and the offload store once, a child starts in
    milliseconds where a fresh interpreter takes seconds (twelve of them on two cores: 20 s)."""
    _write_and_pause(directory, tensors_path, point, prefix, connection.send)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "rounds":
        dispatch_rounds(args[0], tiny_llama(int(args[1])), int(args[2]), f"process seed {args[1]}")
        print("ok", flush=True)
    elif command == "write-and-pause":
        _write_and_pause(*args)
    else:
        raise SystemExit(f"unknown command {command!r}")
