"""Runtime rules: launch-context detection, when not to place, device_map resolution, local machines.

Every rule is a table: environment variables are passed as a dict (``env=``), frameworks are faked in
``sys.modules``, and models are a tiny ``nn.Linear`` with a crafted ``hf_device_map``.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.distributed.context import RuntimeContext, detect_context
from placement_opt.distributed.ranks import plan_note
from placement_opt.distributed.rules import resolve_device_map, should_place_on_device
from placement_opt.errors import DeviceSpecError, PlacementError
from placement_opt.hardware.devices import Device, Machine
from placement_opt.hardware.resolve import (
    check_no_cross_rank_split,
    local_machine,
    parse_device_spec,
    resolve_machine,
)
from placement_opt.units import GIB

SINGLE = RuntimeContext(kind="single", local_device="cuda:0")
DDP_R1 = RuntimeContext(kind="ddp", world_size=2, rank=1, local_rank=1, local_world_size=2,
                        local_device="cuda:1")
DDP_CPU = RuntimeContext(kind="ddp", world_size=2, rank=0, local_rank=0, local_world_size=2,
                         local_device="cpu")
DS_R1 = RuntimeContext(kind="deepspeed", world_size=2, rank=1, local_rank=1, local_world_size=2,
                       local_device="cuda:1", zero_stage=2)
DS3_R1 = RuntimeContext(kind="deepspeed", world_size=2, rank=1, local_rank=1, local_world_size=2,
                        local_device="cuda:1", zero_stage=3)
FSDP_R0 = RuntimeContext(kind="fsdp", world_size=4, rank=0, local_rank=0, local_world_size=4,
                         local_device="cuda:0")

TORCHRUN_R1 = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}


# ---------------------------------------------------------------------------------------------
# detect_context
# ---------------------------------------------------------------------------------------------
# (env, visible GPUs) -> (kind, world_size, rank, local_rank, local_world_size, local_device)
DETECT_TABLE = [
    pytest.param({}, 0, ("single", 1, 0, 0, 1, "cpu"), id="plain-cpu"),
    pytest.param({}, 2, ("single", 1, 0, 0, 1, "cuda:0"), id="plain-2gpu"),
    pytest.param({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}, 1,
                 ("single", 1, 0, 0, 1, "cuda:0"), id="torchrun-one-process"),
    pytest.param(TORCHRUN_R1, 2, ("ddp", 2, 1, 1, 2, "cuda:1"), id="torchrun-rank1"),
    pytest.param(TORCHRUN_R1, 0, ("ddp", 2, 1, 1, 2, "cpu"), id="torchrun-gloo-cpu"),
    pytest.param({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, 4,
                 ("ddp", 8, 5, 1, 4, "cuda:1"), id="torchrun-2-nodes"),
    # No LOCAL_* variables (torch.distributed.launch without --use-env): all ranks on this host.
    pytest.param({"WORLD_SIZE": "4", "RANK": "3"}, 4, ("ddp", 4, 3, 3, 4, "cuda:3"), id="no-local-vars"),
    # CUDA_VISIBLE_DEVICES narrowed to one GPU per rank: it is cuda:0 in every process.
    pytest.param({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 1,
                 ("ddp", 4, 3, 3, 4, "cuda:0"), id="one-visible-gpu-per-rank"),
    pytest.param({**TORCHRUN_R1, "ACCELERATE_USE_CPU": "true"}, 2, ("ddp", 2, 1, 1, 2, "cpu"),
                 id="accelerate-cpu"),
    pytest.param({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "CROSS_RANK": "0",
                  "CROSS_SIZE": "1", "LOCAL_SIZE": "2"}, 2,
                 ("deepspeed", 2, 0, 0, 2, "cuda:0"), id="deepspeed-launcher"),
    pytest.param({**TORCHRUN_R1, "ACCELERATE_USE_DEEPSPEED": "true"}, 2,
                 ("deepspeed", 2, 1, 1, 2, "cuda:1"), id="accelerate-deepspeed"),
    pytest.param({"ACCELERATE_USE_DEEPSPEED": "TRUE"}, 1, ("deepspeed", 1, 0, 0, 1, "cuda:0"),
                 id="deepspeed-one-gpu"),
    pytest.param({**TORCHRUN_R1, "ACCELERATE_USE_FSDP": "1"}, 2, ("fsdp", 2, 1, 1, 2, "cuda:1"),
                 id="accelerate-fsdp"),
    pytest.param({**TORCHRUN_R1, "ACCELERATE_USE_FSDP": "false", "FSDP_SHARDING_STRATEGY": "1"}, 2,
                 ("ddp", 2, 1, 1, 2, "cuda:1"), id="fsdp-flag-off"),
    pytest.param({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2,
                 ("ddp", 2, 1, 1, 2, "cuda:1"), id="mpirun"),
]


@pytest.mark.parametrize(("env", "gpus", "expected"), DETECT_TABLE)
def test_detect_context_from_env(env: dict[str, str], gpus: int, expected: tuple) -> None:
    ctx = detect_context(env, cuda_device_count=gpus, frameworks=False)
    got = (ctx.kind, ctx.world_size, ctx.rank, ctx.local_rank, ctx.local_world_size, ctx.local_device)
    assert got == expected
    assert ctx.is_distributed == (expected[0] != "single")


def test_detect_context_reads_zero_stage_only_under_deepspeed() -> None:
    env = {**TORCHRUN_R1, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    assert detect_context({**env, "ACCELERATE_USE_DEEPSPEED": "true"}, cuda_device_count=2,
                          frameworks=False).zero_stage == 3
    assert detect_context(env, cuda_device_count=2, frameworks=False).zero_stage is None


@pytest.mark.parametrize(("env", "message"), [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "rank 2 is not in [0, world_size=2)"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"},
     "local_world_size 4 exceeds world_size 2"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_FSDP": "true"},
     "both ACCELERATE_USE_DEEPSPEED and ACCELERATE_USE_FSDP"),
    # every process read itself as rank 0 of 4; a world of 0 read as one process
    ({"WORLD_SIZE": "4"}, "names 4 processes but no RANK"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "names 4 processes but no RANK"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0: a run has at least one process"),
    # a switch's typo read as off, and a ZeRO stage DeepSpeed does not have
    ({"ACCELERATE_USE_DEEPSPEED": "enabled"}, "ACCELERATE_USE_DEEPSPEED='enabled' is neither on nor off"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "7"}, "ZeRO stages are 0 to 3"),
])
def test_detect_context_rejects_inconsistent_env(env: dict[str, str], message: str) -> None:
    with pytest.raises(PlacementError) as err:
        detect_context(env, cuda_device_count=0, frameworks=False)
    assert message in str(err.value)


def test_a_local_rank_past_the_visible_gpus_is_refused_not_given_another_ranks_gpu() -> None:
    """Local rank 3 of 4 with two GPUs visible got cuda:1, local rank 1's; with one GPU visible per process (the
    launcher's CUDA_VISIBLE_DEVICES) every rank's own is cuda:0."""
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}
    with pytest.raises(PlacementError, match="local rank 3 sees 2 GPUs: cuda:1 is local rank 1's"):
        detect_context(env, cuda_device_count=2, frameworks=False)
    assert detect_context(env, cuda_device_count=1, frameworks=False).local_device == "cuda:0"


def _fake_accelerate(monkeypatch: pytest.MonkeyPatch, accelerator: dict, partial: dict) -> None:
    """Stand-in for ``accelerate.state`` with the given shared states (the real one is untouched)."""
    # The real enum, so .value is what accelerate writes.
    from accelerate.utils import DistributedType

    for state in (accelerator, partial):
        if "distributed_type" in state:
            state["distributed_type"] = DistributedType[state["distributed_type"]]
    module = types.ModuleType("accelerate.state")
    module.AcceleratorState = type("AcceleratorState", (), {"_shared_state": accelerator})
    module.PartialState = type("PartialState", (), {"_shared_state": partial})
    monkeypatch.setitem(sys.modules, "accelerate.state", module)


PARTIAL_2 = {"distributed_type": "MULTI_GPU", "num_processes": 2, "process_index": 1,
             "local_process_index": 1}


@pytest.mark.parametrize(("accelerator", "partial", "expected"), [
    pytest.param({}, {}, ("single", 1, 0), id="no-state"),
    pytest.param({}, {"distributed_type": "NO", "num_processes": 1, "process_index": 0,
                      "local_process_index": 0}, ("single", 1, 0), id="partial-no"),
    pytest.param({}, dict(PARTIAL_2), ("ddp", 2, 1), id="partial-multi-gpu"),
    pytest.param({}, {**PARTIAL_2, "distributed_type": "MULTI_CPU"}, ("ddp", 2, 1), id="partial-multi-cpu"),
    pytest.param({**PARTIAL_2, "distributed_type": "FSDP"}, dict(PARTIAL_2), ("fsdp", 2, 1),
                 id="accelerator-fsdp-wins"),
    pytest.param({**PARTIAL_2, "distributed_type": "DEEPSPEED"}, {}, ("deepspeed", 2, 1),
                 id="accelerator-deepspeed"),
])
def test_detect_context_reads_accelerate_state(monkeypatch: pytest.MonkeyPatch, accelerator: dict,
                                               partial: dict, expected: tuple) -> None:
    _fake_accelerate(monkeypatch, dict(accelerator), dict(partial))
    ctx = detect_context({}, cuda_device_count=2)
    assert (ctx.kind, ctx.world_size, ctx.rank) == expected
    assert ctx.local_device == f"cuda:{expected[2]}"


def test_env_flag_beats_a_state_that_only_knows_several_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Trainer makes a PartialState (MULTI_GPU) before the Accelerator that will say FSDP.
    _fake_accelerate(monkeypatch, {}, dict(PARTIAL_2))
    env = {**TORCHRUN_R1, "ACCELERATE_USE_FSDP": "true"}
    assert detect_context(env, cuda_device_count=2).kind == "fsdp"
    assert detect_context(TORCHRUN_R1, cuda_device_count=2).kind == "ddp"


def test_detect_context_never_creates_accelerate_state() -> None:
    # A fresh interpreter: importing accelerate and detecting must leave both shared states empty.
    import subprocess

    code = ("import accelerate.state as s\n"
            "from placement_opt.distributed.context import detect_context\n"
            "ctx = detect_context({}, cuda_device_count=0)\n"
            "print(ctx.kind, dict(s.PartialState._shared_state), dict(s.AcceleratorState._shared_state))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60)
    assert out.stdout.split() == ["single", "{}", "{}"]


@pytest.mark.parametrize("module_name", ["deepspeed", "transformers.integrations.deepspeed"])
def test_detect_context_sees_initialised_deepspeed(monkeypatch: pytest.MonkeyPatch, module_name: str) -> None:
    if module_name == "deepspeed":
        fake = types.SimpleNamespace(comm=types.SimpleNamespace(is_initialized=lambda: True))
    else:  # transformers' HfDeepSpeedConfig with ZeRO-3 alive
        fake = types.SimpleNamespace(is_deepspeed_zero3_enabled=lambda: True)
    monkeypatch.setitem(sys.modules, module_name, fake)
    assert detect_context({}, cuda_device_count=1).kind == "deepspeed"
    assert detect_context({}, cuda_device_count=1, frameworks=False).kind == "single"


def test_detect_context_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in TORCHRUN_R1.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    ctx = detect_context(cuda_device_count=2, frameworks=False)
    assert (ctx.kind, ctx.rank, ctx.local_device) == ("fsdp", 1, "cuda:1")
    assert ctx.describe() == "rank 1 of 2 (FSDP)"


# ---------------------------------------------------------------------------------------------
# should_place_on_device
# ---------------------------------------------------------------------------------------------
def _model(device_map: dict | None) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)  # 6 fp32 parameters, 24 bytes: only the attribute matters
    if device_map is not None:
        model.hf_device_map = device_map
    return model


# (hf_device_map, device, flags) -> (place, rule)
PLACE_TABLE = [
    pytest.param(None, "cuda:0", {}, (True, "place"), id="plain-model"),
    pytest.param({"": 0}, "cuda:0", {}, (True, "place"), id="map-on-the-device"),
    pytest.param({"": "cuda:0"}, 0, {}, (True, "place"), id="int-device"),
    pytest.param({"": "cuda:0"}, torch.device("cuda", 0), {}, (True, "place"), id="torch-device"),
    pytest.param({"": 0}, "cuda", {}, (True, "place"), id="bare-cuda-is-cuda0"),
    pytest.param({"a": 0, "b": "cpu", "c": "disk"}, "cuda:0", {}, (True, "place"), id="one-gpu-plus-offload"),
    pytest.param({"a": "cpu", "b": "disk"}, "cuda:0", {}, (True, "place"), id="cpu-and-disk-only"),
    pytest.param({"": "cuda:0"}, "cuda:1", {}, (False, "model_parallel"), id="other-gpu"),
    pytest.param({"a": 0, "b": 1}, "cuda:0", {}, (False, "model_parallel"), id="two-gpus"),
    pytest.param({"a": 0, "b": "cuda:1", "c": "cpu"}, "cuda:1", {}, (False, "model_parallel"),
                 id="two-gpus-mixed-spelling"),
    pytest.param(None, "cuda:0", {"deepspeed": True}, (False, "deepspeed"), id="deepspeed"),
    pytest.param(None, "cuda:0", {"fsdp": True}, (False, "fsdp"), id="fsdp"),
    pytest.param(None, "cuda:0", {"full_eval_half_precision": True, "training": False},
                 (False, "half_precision_eval"), id="half-eval-only"),
    pytest.param(None, "cuda:0", {"full_eval_half_precision": True, "training": True}, (True, "place"),
                 id="half-eval-while-training"),
    pytest.param(None, "cuda:0", {"training": False}, (True, "place"), id="fp32-eval"),
    # Trainer's order: model parallelism is named first, then DeepSpeed, then FSDP.
    pytest.param({"a": 0, "b": 1}, "cuda:0", {"deepspeed": True, "fsdp": True},
                 (False, "model_parallel"), id="mp-before-deepspeed"),
    pytest.param(None, "cuda:0", {"deepspeed": True, "fsdp": True}, (False, "deepspeed"),
                 id="deepspeed-before-fsdp"),
]


@pytest.mark.parametrize(("device_map", "device", "flags", "expected"), PLACE_TABLE)
def test_should_place_on_device(device_map: dict | None, device: object, flags: dict, expected: tuple) -> None:
    decision = should_place_on_device(_model(device_map), device=device, **flags)
    assert (decision.place, decision.rule) == expected
    assert bool(decision) is decision.place
    assert decision.reason  # every decision explains itself


def test_should_place_reasons_say_what_why_and_what_to_do() -> None:
    mp = should_place_on_device(_model({"a": 0, "b": 1}), device="cuda:0")
    assert "cuda:0, cuda:1" in mp.reason and "device_map=None" in mp.reason
    ds = should_place_on_device(_model(None), device="cuda:0", deepspeed=True)
    assert "DeepSpeed places the model itself" in ds.reason and "on the CPU" in ds.reason
    half = should_place_on_device(_model(None), device="cuda:0", full_eval_half_precision=True,
                                  training=False)
    assert "cast" in half.reason and "twice the size" in half.reason


def test_should_place_reads_only_the_attribute() -> None:
    plain = types.SimpleNamespace(hf_device_map={"x": 3})  # not even a module
    assert should_place_on_device(plain, device="cuda:3").place
    assert not should_place_on_device(plain, device="cuda:0").place


# ---------------------------------------------------------------------------------------------
# resolve_device_map
# ---------------------------------------------------------------------------------------------
KEEP = object()  # marker: the input comes back unchanged
RESOLVE_TABLE = [
    # single process: everything unchanged
    pytest.param(SINGLE, "auto", KEEP, id="single-auto"),
    pytest.param(SINGLE, {"a": 0, "b": 1}, KEEP, id="single-split"),
    pytest.param(DDP_R1, None, None, id="ddp-none"),
    # DDP: strategies and foreign GPUs become one full replica on the rank's GPU
    pytest.param(DDP_R1, "auto", {"": "cuda:1"}, id="ddp-auto"),
    pytest.param(DDP_R1, "balanced", {"": "cuda:1"}, id="ddp-balanced"),
    pytest.param(DDP_R1, "balanced_low_0", {"": "cuda:1"}, id="ddp-balanced-low-0"),
    pytest.param(DDP_R1, "sequential", {"": "cuda:1"}, id="ddp-sequential"),
    pytest.param(DDP_R1, {"a": 0, "b": 1}, {"": "cuda:1"}, id="ddp-cross-device"),
    pytest.param(DDP_R1, {"": 0}, {"": "cuda:1"}, id="ddp-other-rank-gpu"),
    pytest.param(DDP_R1, "cuda:0", {"": "cuda:1"}, id="ddp-other-rank-device-string"),
    pytest.param(DDP_R1, {"": 1}, KEEP, id="ddp-own-gpu"),
    pytest.param(DDP_R1, {"a": "cuda:1", "b": "cpu", "c": "disk"}, KEEP, id="ddp-own-gpu-with-offload"),
    pytest.param(DDP_R1, 1, KEEP, id="ddp-own-int"),
    pytest.param(DDP_R1, torch.device("cuda", 1), KEEP, id="ddp-own-torch-device"),
    pytest.param(DDP_R1, "cpu", KEEP, id="ddp-cpu"),
    pytest.param(DDP_CPU, "auto", {"": "cpu"}, id="ddp-gloo-auto"),
    pytest.param(DDP_CPU, {"": 0}, {"": "cpu"}, id="ddp-gloo-gpu-map"),
    # DeepSpeed / FSDP: let the framework place (TRL's device_map=None)
    pytest.param(DS_R1, "auto", None, id="deepspeed-auto"),
    pytest.param(DS_R1, {"a": 0, "b": 1}, None, id="deepspeed-cross-device"),
    pytest.param(DS_R1, {"a": 1, "b": "cpu"}, None, id="deepspeed-with-cpu-offload"),
    pytest.param(DS_R1, {"": 1}, KEEP, id="deepspeed-own-gpu"),
    pytest.param(DS3_R1, {"": 1}, None, id="zero3-own-gpu"),
    pytest.param(FSDP_R0, "auto", None, id="fsdp-auto"),
    pytest.param(FSDP_R0, "cuda:0", KEEP, id="fsdp-own-gpu"),
    pytest.param(FSDP_R0, {"a": 0, "b": 1}, None, id="fsdp-cross-device"),
]


@pytest.mark.parametrize(("context", "device_map", "expected"), RESOLVE_TABLE)
def test_resolve_device_map(context: RuntimeContext, device_map: object, expected: object,
                            caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="placement_opt"):
        got = resolve_device_map(device_map, context)
    warnings = [r for r in caplog.records if r.name == "placement_opt"]
    if expected is KEEP or (device_map is None and expected is None):
        assert got is device_map
        assert warnings == []
    else:
        assert got == expected
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert context.describe() in warnings[0].getMessage()


@pytest.mark.parametrize(("context", "words"), [
    (DDP_R1, ["rank 1 of 2 (DDP)", "'auto'", "one full replica", "{'': 'cuda:1'}"]),
    (DS_R1, ["rank 1 of 2 (DeepSpeed)", "places and shards the model itself", "device_map=None"]),
    (FSDP_R0, ["rank 0 of 4 (FSDP)", "let FSDP place it"]),
])
def test_resolve_device_map_warning_says_why(context: RuntimeContext, words: list[str],
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="placement_opt"):
        resolve_device_map("auto", context)
    message = caplog.records[-1].getMessage()
    for word in words:
        assert word in message


def test_resolve_device_map_zero3_warning_names_zero3(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="placement_opt"):
        resolve_device_map({"": 1}, DS3_R1)
    message = caplog.records[-1].getMessage()
    assert "ZeRO-3" in message and "not only on this rank" not in message


def test_resolve_device_map_detects_context_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_DEEPSPEED",
                "ACCELERATE_USE_FSDP", "CROSS_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delitem(sys.modules, "accelerate.state", raising=False)
    assert resolve_device_map("auto") == "auto"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert resolve_device_map("auto") is None


@given(context=st.sampled_from([DDP_R1, DDP_CPU, DS_R1, DS3_R1, FSDP_R0]),
       values=st.lists(st.sampled_from([0, 1, 2, "cuda:1", "cpu", "disk"]), min_size=1, max_size=5))
def test_resolved_map_never_leaves_the_rank(context: RuntimeContext, values: list) -> None:
    device_map = {f"m{i}": v for i, v in enumerate(values)}
    got = resolve_device_map(device_map, context)
    if got is not None:
        names = {str(v) if not isinstance(v, int) else f"cuda:{v}" for v in got.values()}
        assert names <= {context.local_device, "cpu", "disk"}


# ---------------------------------------------------------------------------------------------
# local_machine, check_no_cross_rank_split, resolve_machine with a context, plan_note
# ---------------------------------------------------------------------------------------------
def _host() -> Machine:
    return parse_device_spec("cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=64GiB,disk=1TB")


def test_local_machine_keeps_own_gpu_and_a_share_of_the_host() -> None:
    host = Machine(_host().devices, links={("cuda:0", "cuda:1"): 50e9, ("cpu", "cuda:1"): 20e9})
    local = local_machine(host, DDP_R1)
    assert local.names == ["cuda:1", "cpu", "disk"]
    assert local["cuda:1"] == host["cuda:1"]              # the GPU is the rank's alone: unchanged
    assert local["cpu"].memory_bytes == 32 * GIB          # 64 GiB shared by 2 ranks
    assert local["disk"].memory_bytes == 500_000_000_000  # 1 TB shared by 2 ranks
    assert local["cpu"].bandwidth_bytes_per_s == host["cpu"].bandwidth_bytes_per_s
    assert dict(local.links) == {("cpu", "cuda:1"): 20e9}  # links to cuda:0 are gone


def test_local_machine_is_idempotent() -> None:
    once = local_machine(_host(), DDP_R1)
    twice = local_machine(once, DDP_R1)
    assert twice == once and twice["cpu"].memory_bytes == 32 * GIB
    assert "per-rank share 1/2" in once["cpu"].source


def test_local_machine_single_process_is_unchanged() -> None:
    host = _host()
    assert local_machine(host, SINGLE) is host


def test_local_machine_cpu_rank_keeps_no_gpu() -> None:
    local = local_machine(_host(), DDP_CPU)
    assert local.names == ["cpu", "disk"]


def test_local_machine_with_nothing_left_raises() -> None:
    with pytest.raises(PlacementError, match="owns cuda:1 but the machine"):
        local_machine(Machine([Device.preset("a100-40gb", name="cuda:0")]), DDP_R1)


@given(world=st.integers(1, 16), data=st.data())
def test_local_machine_shares_add_up(world: int, data: st.DataObject) -> None:
    local_world = data.draw(st.integers(1, world))
    rank = data.draw(st.integers(0, world - 1))
    ram = data.draw(st.integers(1, 2**40))
    ctx = RuntimeContext(kind="ddp" if world > 1 else "deepspeed", world_size=world, rank=rank,
                         local_rank=rank % local_world, local_world_size=local_world, local_device="cpu")
    share = local_machine(Machine([Device("cpu", ram), Device("disk", 2**41)]), ctx)["cpu"].memory_bytes
    assert share * local_world <= ram < (share + 1) * local_world


CROSS_TABLE = [
    pytest.param(["cuda:1", "cpu", "disk"], DDP_R1, None, id="own-gpu"),
    pytest.param(["cpu", "disk"], DDP_R1, None, id="no-gpu"),
    pytest.param(_host(), SINGLE, None, id="single-process"),
    pytest.param(_host(), DDP_R1, "rank 1 of 2 (DDP) owns cuda:1 but the machine lists cuda:0, cuda:1",
                 id="machine-with-both"),
    pytest.param("cuda:0=a100-40gb,cpu=64GiB", DDP_R1, "lists cuda:0:", id="spec-other-gpu"),
    pytest.param({0: "20GiB", 1: "20GiB", "cpu": "64GiB"}, DS_R1, "rank 1 of 2 (DeepSpeed) owns cuda:1",
                 id="max-memory-dict"),
    pytest.param([Device.preset("t4", name="cuda:0")], FSDP_R0, None, id="fsdp-own-device"),
    pytest.param(["cuda:0", "cpu"], DDP_CPU, "runs on the CPU (no GPU of its own) but the machine lists "
                 "cuda:0: in a distributed run each rank plans for its own device; pass devices for one "
                 "rank (e.g. ['cpu', 'disk'])", id="cpu-rank"),
]


@pytest.mark.parametrize(("devices", "context", "message"), CROSS_TABLE)
def test_check_no_cross_rank_split(devices: object, context: RuntimeContext, message: str | None) -> None:
    if message is None:
        check_no_cross_rank_split(devices, context)
        return
    with pytest.raises(PlacementError) as err:
        check_no_cross_rank_split(devices, context)
    assert message in str(err.value)
    assert "each rank plans for its own device" in str(err.value)
    assert "run a single process" in str(err.value)


def test_check_no_cross_rank_split_reads_a_plans_devices() -> None:
    def plan(*pairs: tuple[str, str]) -> types.SimpleNamespace:  # only .placements is read
        return types.SimpleNamespace(placements=[types.SimpleNamespace(storage=s, execution=e)
                                                 for s, e in pairs])

    check_no_cross_rank_split(plan(("cuda:1", "cuda:1"), ("cpu", "cuda:1"), ("disk", "cpu")), DDP_R1)
    with pytest.raises(PlacementError, match="owns cuda:1 but the plan uses cuda:0, cuda:1"):
        check_no_cross_rank_split(plan(("cuda:1", "cuda:1"), ("cpu", "cuda:0")), DDP_R1)


def _plan_for(devices: object, context: RuntimeContext) -> tuple[Machine, str | None]:
    """What solve() does with its devices: the machine for this rank, and the plan's note."""
    machine = resolve_machine(devices, context)
    return machine, plan_note(machine, context)


def test_resolve_machine_single_process_returns_the_machine_without_note() -> None:
    machine, note = _plan_for("cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=64GiB", SINGLE)
    assert machine.names == ["cuda:0", "cuda:1", "cpu"] and note is None
    assert resolve_machine("cuda:0=a100-40gb,cpu=64GiB", None).names == ["cuda:0", "cpu"]


def test_resolve_machine_distributed_restricts_and_notes() -> None:
    machine, note = _plan_for("cuda:1=a100-40gb,cpu=64GiB,disk=1TB", DDP_R1)
    assert machine.names == ["cuda:1", "cpu", "disk"]
    assert machine["cpu"].memory_bytes == 32 * GIB
    assert note.startswith("planned for rank 1 of 2 (DDP) only: cuda:1, cpu 32.00 GiB")
    _, fsdp_note = _plan_for("cuda:0=a100-40gb,cpu=64GiB", FSDP_R0)
    assert "FSDP will place and shard the model itself" in fsdp_note


def test_resolve_machine_rejects_explicit_cross_rank_split() -> None:
    with pytest.raises(DeviceSpecError, match="owns cuda:1 but the machine lists cuda:0, cuda:1"):
        resolve_machine(_host(), DDP_R1)


def test_resolve_machine_detects_the_rank_devices_when_none_given() -> None:
    machine, note = _plan_for(None, DDP_CPU)  # CPU rank: this host's RAM and disk, halved
    assert machine.names == ["cpu", "disk"]
    assert note.startswith("planned for rank 0 of 2 (DDP) only: no GPU, cpu ")


def test_resolve_machine_detects_this_machine_when_none_given() -> None:
    machine = resolve_machine(None, SINGLE)
    assert machine.names[-2:] == ["cpu", "disk"]
    assert all(d.is_gpu for d in machine.devices[:-2])


@pytest.mark.parametrize("word", ["auto", " AUTO ", "Auto"])
def test_auto_is_what_none_is_single_and_distributed(word: str) -> None:
    """The CLI's ``--devices auto`` spelled in Python: this machine, or in a distributed run the rank's share (not
    the whole host, which as_machine() alone would detect)."""
    assert resolve_machine(word, SINGLE).names == resolve_machine(None, SINGLE).names
    machine, note = _plan_for(word, DDP_CPU)  # detected sizes move with what else runs: names and halving only
    assert machine.names == ["cpu", "disk"] and note.startswith("planned for rank 0 of 2 (DDP) only: no GPU, cpu ")
    assert machine["cpu"].memory_bytes < resolve_machine(word, SINGLE)["cpu"].memory_bytes


@pytest.mark.cuda
def test_detect_context_counts_real_gpus() -> None:
    count = torch.cuda.device_count()
    assert detect_context({}, frameworks=False).local_device == "cuda:0"
    ctx = detect_context({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
                         frameworks=False)
    assert ctx.local_device == f"cuda:{1 % count}"
    model = _model({"": torch.cuda.current_device()})
    assert should_place_on_device(model, device=torch.device("cuda", torch.cuda.current_device())).place


def test_single_process_rules_never_import_torch() -> None:
    # The solver side stays torch-free: solve() resolves its machine with the context in every run.
    import os
    import subprocess

    code = ("import sys\n"
            "from placement_opt.distributed.context import current_context\n"
            "from placement_opt.distributed.ranks import plan_note\n"
            "from placement_opt.distributed.rules import resolve_device_map\n"
            "from placement_opt.hardware.resolve import resolve_machine\n"
            "ctx = current_context()\n"
            "machine = resolve_machine('cpu=8GiB,disk=1TB', ctx)\n"
            "note = plan_note(machine, ctx)\n"
            "print(machine.names, note, resolve_device_map('auto'), 'torch' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "ACCELERATE_USE_FSDP",
                                                             "ACCELERATE_USE_DEEPSPEED")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=60, env=env)
    assert out.stdout.strip() == "['cpu', 'disk'] None auto False"


@pytest.mark.parametrize(("model", "device", "words"), [
    (object(), None, "device is None: name the loop's device"), (object(), True, "device is True"),
    (type("Mapped", (), {"hf_device_map": "auto"})(), "cuda:0", "hf_device_map is a str, not a dict"),
])
def test_should_place_on_device_refuses_no_device_and_a_map_that_is_no_map(model, device, words) -> None:
    """device=None answered "move it to none"; a string hf_device_map raised an AttributeError."""
    from placement_opt.errors import DeviceSpecError

    with pytest.raises(DeviceSpecError, match=words):
        should_place_on_device(model, device=device)
