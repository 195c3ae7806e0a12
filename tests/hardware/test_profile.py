"""Profiling this machine: measured figures saved as JSON and read back as Devices."""

from __future__ import annotations

import importlib
import json
import os
import platform

import pytest

from placement_opt.hardware.detect import detect_device
from placement_opt.hardware.profile_store import (
    PROFILE_ENV_VAR,
    PROFILE_SCHEMA_VERSION,
    load_profile,
    profile_path,
    saved_device,
)
from placement_opt.hardware.profiler import profile
from placement_opt.hardware.resolve import as_machine

# The measuring module; placement_opt.profile is its function.
profile_module = importlib.import_module("placement_opt.hardware.profiler")


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("profile")
    path = folder / "profile.json"
    with pytest.MonkeyPatch.context() as patch:  # fewer points keep the suite fast
        patch.setattr(profile_module, "CURVE_TOKENS", (1, 16, 64))
        machine = profile(["cpu", "disk"], path=path, quick=True, dtype="float32", dtypes=["bfloat16"],
                          offload_folder=folder)
    return path, machine


def test_profile_measures_cpu_and_disk_and_saves_json(measured) -> None:
    path, machine = measured
    assert machine.names == ["cpu", "disk"]
    for device in machine.devices:
        assert device.source.startswith("measured")
        assert device.bandwidth_bytes_per_s > 1e6  # more than a MB/s, whatever the machine
    assert machine["cpu"].flops_per_s > 1e8
    data = json.loads(path.read_text())
    assert data["schema_version"] == PROFILE_SCHEMA_VERSION
    cpu = data["measurements"]["cpu"]
    assert set(cpu["matmul_flops_per_s"]) == {"float32", "bfloat16"}
    assert [t for t, _ in cpu["linear_flops_by_tokens"]["float32"]] == [1, 16, 64]
    assert [t for t, _ in machine["cpu"].flops_by_tokens] == [1, 16, 64]
    assert data["measurements"]["disk"]["page_cache"].startswith("dropped")
    # offloaded weights are read through memory maps: the disk carries that rate
    assert machine["disk"].bandwidth_bytes_per_s == data["measurements"]["disk"]["mapped_read_bytes_per_s"]
    # reads asked for at random places: what a lookup's rows and a router's picks are read at
    disk = data["measurements"]["disk"]
    assert 1e-7 < machine["disk"].random_read_latency_s == disk["random_read_latency_s"] < 0.5
    assert 1e6 < machine["disk"].random_read_bytes_per_s == disk["random_read_bytes_per_s"]
    assert "fault_latency_s" not in disk  # what nothing reads any more is not measured
    # the scratch file is gone
    assert [p.name for p in path.parent.iterdir() if p.name.startswith("placement_opt_profile_")] == []
    # the CLI reads the 'machine' entry
    assert [d["name"] for d in data["machine"]["devices"]] == ["cpu", "disk"]


def test_profile_measures_what_a_large_new_tensor_pays_for_its_pages(measured) -> None:
    path, machine = measured
    rate = json.loads(path.read_text())["measurements"]["cpu"]["fresh_page_bytes_per_s"]
    assert machine["cpu"].fresh_page_bytes_per_s == (rate or None)
    if platform.libc_ver()[0] == "glibc" and "LD_PRELOAD" not in os.environ:
        # glibc maps a 64 MiB allocation anew each time: its pages fault in (this VM: 3.4-4 GB/s of them, against
        # 33 GB/s of writes into existing memory); another allocator may reuse the memory and record 0
        assert rate > 0


def test_profile_measures_the_host_seconds_per_op_of_a_small_model(measured) -> None:
    path, machine = measured
    per_op = json.loads(path.read_text())["measurements"]["cpu"]["op_overhead_s"]
    # a dispatch and the Python around it: this VM 5.2 us; any machine between 0.1 us and 1 ms
    assert 1e-7 < per_op < 1e-3
    assert machine["cpu"].op_overhead_s == per_op


def test_saved_device_returns_the_measured_figures_per_dtype(measured) -> None:
    path, machine = measured
    cpu32 = saved_device("cpu", dtype="float32", path=path)
    assert cpu32 is not None and cpu32.flops_per_s == machine["cpu"].flops_per_s
    data = load_profile(path)
    assert saved_device("cpu", dtype="torch.bfloat16", path=path).flops_per_s == \
        data["measurements"]["cpu"]["matmul_flops_per_s"]["bfloat16"]
    assert saved_device("cuda:0", path=path) is None


def test_env_var_points_detection_at_the_profile(measured, monkeypatch: pytest.MonkeyPatch) -> None:
    path, machine = measured
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    assert profile_path() == path
    cpu = detect_device("cpu", dtype="float32")
    assert cpu.source.startswith("measured") and cpu.flops_per_s == machine["cpu"].flops_per_s
    assert as_machine(["cpu", "disk"], dtype="float32")["disk"].source.startswith("measured")


@pytest.mark.parametrize("form", ["spec", "max_memory", "names"])
def test_every_form_of_this_machines_devices_prices_at_the_measured_speeds(measured, monkeypatch, form) -> None:
    """Issue 13: the saved figures apply whatever form ``devices`` takes. ``cpu=64GiB`` in a spec took the
    datasheet (cpu-desktop) while ``{"cpu": "64GiB"}`` took the profile, so ``plan`` and ``run`` priced apart."""
    path, machine = measured
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    devices = {"spec": "cpu=64GiB,disk=200GiB", "max_memory": {"cpu": "64GiB", "disk": "200GiB"},
               "names": ["cpu", "disk"]}[form]
    got = as_machine(devices, dtype="float32")
    for name in ("cpu", "disk"):
        assert got[name].source.startswith("measured")
        assert got[name].bandwidth_bytes_per_s == machine[name].bandwidth_bytes_per_s
    assert got["cpu"].flops_per_s == machine["cpu"].flops_per_s
    if form != "names":
        assert got["cpu"].memory_bytes == 64 * 2**30


def test_a_budget_alone_without_a_measurement_is_priced_at_a_preset_and_the_plan_says_so(tmp_path, monkeypatch):
    from placement_opt import solve

    monkeypatch.setenv(PROFILE_ENV_VAR, str(tmp_path / "none.json"))
    spec = as_machine("cuda:0=24GiB,cpu=64GiB", dtype="bfloat16")
    assert spec["cuda:0"].source == "cuda:0=SIZE, default speeds of a100-40gb"
    # a budget, as max_memory reads it: all of it usable (a preset with a size keeps the GPU reserve)
    assert spec.max_memory == as_machine({0: "24GiB", "cpu": "64GiB"}).max_memory == {0: 24 * 2**30, "cpu": 64 * 2**30}
    assert as_machine("cuda:0=a100-40gb/24GiB")["cuda:0"].usable_bytes == 23 * 2**30
    for devices in ("cuda:0=24GiB,cpu=64GiB", {0: "24GiB", "cpu": "64GiB"}):
        notes = solve("llama-3-8b", devices).notes
        assert any("speeds assumed, not measured: cuda:0 at a100-40gb's, cpu at cpu-desktop's" in n for n in notes)
    named = solve("llama-3-8b", "cuda:0=rtx-4090,cpu=cpu-desktop/64GiB").notes
    assert not any("speeds assumed" in n for n in named)
    detected = solve("llama-3-8b", ["cpu", "disk"]).notes  # bare names: this machine's, and unmeasured here
    assert any("speeds assumed, not measured: cpu at cpu-desktop's, disk at nvme-gen4's" in n for n in detected)


def test_a_profile_a_newer_placement_opt_wrote_is_said_to_be_unread(tmp_path, monkeypatch):
    """load_profile() skips it (its entries may be keyed otherwise), and the devices fall back to presets: the note
    told the user to run `placement-opt profile`, which refuses to write over that file."""
    from placement_opt import solve

    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({"schema_version": PROFILE_SCHEMA_VERSION + 1, "measurements": {}}))
    monkeypatch.setenv(PROFILE_ENV_VAR, str(newer))
    (note,) = [n for n in solve("llama-3-8b", ["cpu", "disk"]).notes if "speeds assumed" in n]
    assert (f"the saved profile {str(newer)!r} has schema version {PROFILE_SCHEMA_VERSION + 1}, a newer "
            f"placement_opt's, and is not read") in note
    assert "run placement-opt profile" not in note


def test_missing_or_foreign_profile_is_ignored(tmp_path) -> None:
    assert load_profile(tmp_path / "none.json") is None
    (tmp_path / "old.json").write_text(json.dumps({"schema_version": 0}))
    assert load_profile(tmp_path / "old.json") is None
    assert saved_device("cpu", path=tmp_path / "old.json") is None


def test_profile_rejects_unknown_devices(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown device name 'tpu'"):
        profile(["tpu"], path=tmp_path / "p.json", quick=True)


@pytest.mark.cuda
def test_profile_measures_a_gpu(tmp_path) -> None:  # pragma: no cover - needs a GPU
    machine = profile(["cuda:0"], path=tmp_path / "p.json", quick=True)
    gpu = machine["cuda:0"]
    assert gpu.source.startswith("measured") and gpu.host_link_bytes_per_s > 1e9
    assert gpu.to_host_bytes_per_s is not None and gpu.to_host_bytes_per_s > 1e9  # staged through pinned buffers


def test_a_saved_gpu_measurement_carries_its_rate_back_to_the_host_when_it_has_one(tmp_path) -> None:
    """Profiles written before the rate was measured load as they did (copies leaving the GPU at the host link), and
    so do those that measured a plain ``.to("cpu")``, a copy the dispatcher no longer makes (the H200's 1.3 GB/s)."""
    gpu = {"memory_bytes": 80 * 2**30, "name": "NVIDIA H200", "matmul_flops_per_s": {"bfloat16": 8e14},
           "copy_bytes_per_s": 4e12, "pinned_h2d_bytes_per_s": 55e9, "pageable_h2d_bytes_per_s": 17e9}
    for extra, leaving in (({"staged_to_host_bytes_per_s": 41e9}, 41e9), ({}, None),
                           ({"to_host_bytes_per_s": 1.3e9}, None),
                           ({"to_host_bytes_per_s": 1.3e9, "staged_to_host_bytes_per_s": 41e9}, 41e9)):
        path = tmp_path / f"p{'-'.join(extra)}.json"
        path.write_text(json.dumps({"schema_version": 1, "created": "2026-11-29T00:00:00+00:00",
                                    "measurements": {"cuda:0": {**gpu, **extra}}}))
        device = saved_device("cuda:0", dtype="bfloat16", path=path)
        assert device is not None and device.to_host_bytes_per_s == leaving


def test_a_saved_disk_carries_its_scattered_reads_and_an_older_profile_s_page_fault_is_read_by_nothing(tmp_path):
    """Profiles of 2026-11-28 to 11-30 measured a cold page fault with its read-around instead: they load, with the
    defaults for scattered reads (100 us a read, the disk's rate)."""
    disk = {"memory_bytes": 2**40, "sequential_read_bytes_per_s": 3e9, "mapped_read_bytes_per_s": 2e9}
    for extra, read in (({"random_read_bytes_per_s": 1.3e9, "random_read_latency_s": 14e-6}, (1.3e9, 14e-6)),
                        ({"fault_latency_s": 3e-3}, (None, None))):
        path = tmp_path / f"p{len(extra)}.json"
        path.write_text(json.dumps({"schema_version": 1, "created": "2026-11-30T00:00:00+00:00",
                                    "measurements": {"disk": {**disk, **extra}}}))
        device = saved_device("disk", path=path)
        assert device is not None and (device.random_read_bytes_per_s, device.random_read_latency_s) == read
        assert device.bandwidth_bytes_per_s == 2e9


def test_profile_measures_only_the_dtype_run_and_keeps_earlier_ones(tmp_path, monkeypatch) -> None:
    timed: list[tuple[str, ...]] = []

    def fake_cpu(quick, dtypes, counted):
        timed.append(dtypes)
        return {"memory_bytes": 2**30, "matmul_flops_per_s": {d: 1e9 * (1 + i) for i, d in enumerate(dtypes)},
                "matvec_bytes_per_s": {d: 1e9 for d in dtypes}, "copy_bytes_per_s": 1e9,
                "linear_flops_by_tokens": {d: [[1, 1e8]] for d in dtypes}}

    monkeypatch.setattr(profile_module, "_measure_cpu", fake_cpu)
    path = tmp_path / "p.json"
    assert profile(["cpu"], path=path).devices[0].flops_per_s == 1e9  # bfloat16 by default
    profile(["cpu"], path=path, dtype="float32")
    assert timed == [("bfloat16",), ("float32",)]
    figures = load_profile(path)["measurements"]["cpu"]["matmul_flops_per_s"]
    assert set(figures) == {"bfloat16", "float32"}  # the earlier dtype is kept
    # a dtype never measured reads float32's figures instead of failing
    assert saved_device("cpu", dtype="float16", path=path).flops_per_s == figures["float32"]
    with pytest.raises(ValueError, match="cannot measure dtype int8"):
        profile(["cpu"], path=path, dtype="int8")


def test_a_profile_of_one_device_keeps_the_others_in_the_machine_that_devices_path_plans_for(tmp_path, monkeypatch):
    """calibrate() profiles the devices a profile lacks (profile(["disk"])): the file's 'machine', which
    `--devices PATH` reads, then held the disk alone and planning refused it (no compute device)."""
    monkeypatch.setattr(profile_module, "_measure_cpu", lambda quick, dtypes, counted: {
        "memory_bytes": 2**30, "matmul_flops_per_s": {d: 1e9 for d in dtypes}, "matvec_bytes_per_s": {d: 1e9 for d in dtypes},
        "copy_bytes_per_s": 1e9, "linear_flops_by_tokens": {d: [[1, 1e8]] for d in dtypes}})
    monkeypatch.setattr(profile_module, "_measure_disk", lambda folder, quick, counted: {
        "memory_bytes": 2**34, "sequential_read_bytes_per_s": 1e9})
    path = tmp_path / "p.json"
    profile(["cpu"], path=path)
    assert profile(["disk"], path=path).names == ["disk"]  # what was measured this time
    assert [d["name"] for d in load_profile(path)["machine"]["devices"]] == ["cpu", "disk"]



def test_a_profile_saved_apart_is_the_one_its_machine_is_priced_from(tmp_path, monkeypatch) -> None:
    """profile(path=P) returns a machine that carries P, so solve() reads the unit times calibrated into P (the
    default profile's before); profile() at the default place keeps the machine of this host's profile."""
    monkeypatch.setattr(profile_module, "_measure_cpu", lambda quick, dtypes, counted: {
        "memory_bytes": 2**30, "matmul_flops_per_s": {d: 1e9 for d in dtypes}, "matvec_bytes_per_s": {d: 1e9 for d in dtypes},
        "copy_bytes_per_s": 1e9, "linear_flops_by_tokens": {d: [[1, 1e8]] for d in dtypes}})
    monkeypatch.chdir(tmp_path)
    assert profile(["cpu"], path="apart.json").profile_path == str(tmp_path / "apart.json")  # absolute
    assert profile(["cpu"]).profile_path is None


@pytest.mark.parametrize(("calls", "figure"), [((1.5, 0.002), 0.002), ((1.5, 1.4), 1.4), ((0.01, 0.003, 0.002), 0.002)],
                         ids=["stalled-warm-up", "slow", "fast"])
def test_a_slow_warm_up_is_never_the_measured_figure(monkeypatch, calls, figure) -> None:
    """On a fake clock: a warm-up over the limit (a first-call stall) was returned as the figure itself."""
    now = [0.0]
    seconds = iter([*calls, *[calls[-1]] * 500])

    def fn() -> None:
        now[0] += next(seconds)

    monkeypatch.setattr(profile_module.time, "perf_counter", lambda: now[0])
    assert profile_module._best_time(fn, repeats=3) == pytest.approx(figure)


def test_a_dtype_the_profile_did_not_measure_is_said_in_the_plan(measured, monkeypatch) -> None:
    """The fixture measured float32 and bfloat16 on the CPU: a float16 plan is priced at float32's figures (CPUs run
    dtypes at very different speeds) and says so, with the command that measures it; a bfloat16 plan says nothing."""
    from placement_opt import solve, trace

    path, _ = measured
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    assert "(float16 not measured)" in as_machine(["cpu"], dtype="float16")["cpu"].source
    half = solve(trace("llama-3-8b", dtype="float16"), "cpu=64GiB,disk=nvme-gen4/2TB").notes
    assert any("cpu priced at float32's measured speeds: float16 was not measured" in n
               and "placement-opt profile --dtype float16" in n for n in half)
    bf16 = solve(trace("llama-3-8b", dtype="bfloat16"), "cpu=64GiB,disk=nvme-gen4/2TB").notes
    assert not any("was not measured" in n for n in bf16)


def test_a_preset_given_more_memory_than_its_card_has_is_planned_as_given_and_said():
    """cuda:0=rtx-4090/40GiB (a 24 GiB card) planned silently with 40 GiB: a what-if one may mean, a typo the same."""
    from placement_opt import solve

    beyond = solve("llama-3-8b", "cuda:0=rtx-4090/40GiB,cpu=cpu-desktop/64GiB")
    assert next(m for m in beyond.cost.memory if m.device == "cuda:0").capacity_bytes > 24 * 2**30
    (note,) = [n for n in beyond.notes if "more than the" in n]
    assert note.startswith("cuda:0 has 40.00 GiB, more than the rtx-4090 preset's 23.99 GiB: planned with the memory "
                           "given, which that card does not have")
    for within in ("cuda:0=rtx-4090/20GiB,cpu=cpu-desktop/64GiB", "cuda:0=rtx-4090,cpu=cpu-desktop/64GiB"):
        assert not any("more than the" in n for n in solve("llama-3-8b", within).notes)


def test_a_gpu_its_reserve_leaves_nothing_of_says_so_in_the_plan_and_the_refusal():
    """cuda:0=a10/512MiB keeps the default 1 GiB reserve: the plan showed a 512 MiB GPU that held nothing, and a
    refusal said "usable: cuda:0 0 B" without a word of why."""
    from placement_opt import solve
    from placement_opt.errors import InfeasiblePlacementError

    plan = solve("llama-3-8b", "cuda:0=a10/512MiB,cpu=cpu-desktop/64GiB")
    (note,) = [n for n in plan.notes if "all under its" in n]
    assert note.startswith("cuda:0 has 512.00 MiB, all under its 1.00 GiB reserve")
    with pytest.raises(InfeasiblePlacementError, match="usable: cuda:0 0 B.*cuda:0 has 512.00 MiB, all under its"):
        solve("llama-3-8b", "cuda:0=a10/512MiB,cpu=cpu-desktop/2GiB")
    assert not [n for n in solve("llama-3-8b", "cuda:0=a10/4GiB,cpu=cpu-desktop/64GiB").notes if "all under its" in n]
