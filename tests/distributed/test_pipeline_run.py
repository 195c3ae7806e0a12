"""Planned pipelines run on torch.distributed.pipelining: 2 and 4 CPU processes, gloo, localhost.

The test saves a tiny random Llama (hidden 64, 4 layers) with ``save_pretrained``, plans it over
``cpu*N`` with :func:`plan_pipeline`, and launches N processes the torchrun way (rank variables in
the environment). Each rank builds only its stage from the checkpoint (meta first) with
:func:`placement_opt.runtime.pipelining.pipeline` and runs the plan's schedule: forward only (the
last rank's logits must equal the plain model's) and one training step (every rank's gradients,
under their original names, must equal the plain model's). Bounded by ``TIMEOUT_S``; processes
are killed on timeout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from placement_opt.cost.workload import Workload  # noqa: E402
from placement_opt.distributed.pipeline_plan import PipelinePlan, plan_pipeline  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TIMEOUT_S = 120
BATCH, SEQ, VOCAB = 4, 8, 128

WORKER = r'''
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

work, modes = Path(sys.argv[1]), sys.argv[2].split(",")
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=90))
rank = dist.get_rank()

from placement_opt.distributed.pipeline_plan import PipelinePlan
from placement_opt.runtime.pipelining import pipeline

data = torch.load(work / "data.pt")
vocab = data["vocab"]

def loss_fn(logits, target):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

# one process group for every mode asked: each launch of N interpreters costs seconds on 2 cores
for mode in modes:
    plan = PipelinePlan.from_json((work / f"plan-{mode}.json").read_text())
    run = pipeline(work / "ckpt", plan, loss_fn=loss_fn if mode == "train" else None)
    last = run.stage_index == len(plan.stages) - 1
    args = (data["ids"],) if run.stage_index == 0 else ()
    if mode == "forward":
        with torch.no_grad():
            out = run.schedule.step(*args)
        if last:
            torch.save(out, work / "logits.pt")
    else:
        losses = []
        kwargs = {"target": data["labels"], "losses": losses} if last else {}
        run.schedule.step(*args, **kwargs)
        grads = {n: p.grad for n, p in run.module.named_parameters()}
        torch.save({"grads": grads, "losses": losses}, work / f"grads-{rank}.pt")
    dist.barrier()
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(world: int, work: Path, modes: str) -> None:
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    base.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = []
    for rank in range(world):
        env = dict(base, WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(work), modes], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [proc.communicate(timeout=TIMEOUT_S) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.communicate()
        pytest.fail(f"the {world}-process pipeline did not finish in {TIMEOUT_S} s")
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed (exit {proc.returncode}):\n{err[-4000:]}"


def _tiny_llama(work: Path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(work / "ckpt")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    torch.save({"ids": ids, "labels": labels, "vocab": VOCAB}, work / "data.pt")
    return model, ids, labels


@pytest.mark.parametrize(("world", "schedule"), [(2, "gpipe"), (4, "1f1b")])
def test_planned_pipeline_matches_the_plain_model(tmp_path: Path, world: int, schedule: str) -> None:
    model, ids, labels = _tiny_llama(tmp_path)
    for mode in ("forward", "train"):
        workload = Workload(batch_size=BATCH // world, prompt_len=SEQ, training=mode == "train")
        plan = plan_pipeline(model, f"(cpu*{world})", workload, schedule=schedule, n_microbatches=world)
        assert [u for s in plan.stages for u in s.units] == [n for n, _ in _units(model)]
        (tmp_path / f"plan-{mode}.json").write_text(plan.to_json())
    _launch(world, tmp_path, "forward,train")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-5)

    model.train()
    loss = torch.nn.functional.cross_entropy(model(ids, use_cache=False).logits.reshape(-1, VOCAB),
                                             labels.reshape(-1))
    loss.backward()
    got: dict[str, torch.Tensor] = {}
    for rank in range(world):
        part = torch.load(tmp_path / f"grads-{rank}.pt")
        assert not set(part["grads"]) & set(got), "a parameter lives on two stages"
        got.update(part["grads"])
    expected_grads = {n: p.grad for n, p in model.named_parameters()}
    assert set(got) == set(expected_grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _units(model):
    from placement_opt.model.tracer import trace

    return [(u.name, u) for u in trace(model).units()]


def test_plan_refuses_a_world_of_another_size(tmp_path: Path) -> None:
    """pipeline() checks the process group against the plan before building anything."""
    from placement_opt.errors import DispatchError
    from placement_opt.runtime import pipelining

    model, _, _ = _tiny_llama(tmp_path)
    plan = plan_pipeline(model, "(cpu*2)", Workload(batch_size=1, prompt_len=SEQ))

    class _OneRank:
        @staticmethod
        def get_world_size(group=None):
            return 3

    import torch.distributed as dist

    real = dist.get_world_size
    dist.get_world_size = _OneRank.get_world_size
    try:
        with pytest.raises(DispatchError, match="3 ranks but the plan has 2 stages"):
            pipelining.pipeline(tmp_path / "ckpt", plan)
    finally:
        dist.get_world_size = real
    assert PipelinePlan.from_json(plan.to_json()) == plan


def test_under_torchrun_standalone(tmp_path: Path) -> None:
    """The real launcher: ``torchrun --standalone`` sets the rank variables, GROUP_RANK included."""
    import shutil

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    if not Path(torchrun).exists():
        pytest.skip("torchrun is not installed beside this Python")
    model, ids, _ = _tiny_llama(tmp_path)
    plan = plan_pipeline(model, "(cpu*2)", Workload(batch_size=2, prompt_len=SEQ), schedule="gpipe", n_microbatches=2)
    (tmp_path / "plan-forward.json").write_text(plan.to_json())
    (tmp_path / "worker.py").write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([torchrun, "--standalone", "--nproc-per-node", "2", str(tmp_path / "worker.py"),
                             str(tmp_path), "forward"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and its workers: the session this test started
        proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s")
    assert proc.returncode == 0, err[-4000:]
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-5)
