"""The ``placement-opt`` command without the solver: help, bad input, explain, profile files.

End-to-end ``plan``/``compare`` runs live in test_cli_e2e.py.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from dataclasses import replace

import click
import pytest
from hypothesis import given
from hypothesis import strategies as st

from _cli import run_cli
from _plans import report_plan
from placement_opt.cli.options import resolve_devices, resolve_model
from placement_opt.cli.tables import where_computed
from placement_opt.plan import Plan, UnitPlacement

GOOD_DEVICES = "cuda:0=a100-40gb,cpu=64GiB,disk=nvme-gen4"


def run(*args: str):
    return run_cli(*args)


def test_help_is_fast_and_imports_nothing_heavy():
    # A fresh interpreter: --help must not import torch, transformers, ortools or matplotlib.
    code = ("import sys; from placement_opt.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'ortools', 'matplotlib') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    assert "compare" in out and "profile" in out
    assert time.perf_counter() - started < 5.0


def test_every_command_has_help():
    for command in ("plan", "compare", "profile", "explain", "bench"):
        result = run(command, "--help")
        assert result.exit_code == 0, result.output
        assert "Usage: " in result.output


def test_malformed_devices_is_a_one_line_usage_error():
    result = run("plan", "whatever-model", "--devices", "cuda:0=a100-40gbb,cpu=64GiB")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "'a100-40gbb' is neither a preset nor a size" in result.output
    assert result.output.startswith("Error: Invalid value for --devices")
    assert result.output.rstrip().endswith("(see 'placement-opt plan --help')")
    assert len(result.output.strip().splitlines()) == 1


def test_missing_argument_and_unknown_command_are_one_line():
    for argv in (["plan"], ["nope"], ["compare", "x"]):
        result = run(*argv)
        assert result.exit_code == 2, argv
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_unknown_device_name_is_a_usage_error():
    result = run("compare", "whatever-model", "--devices", "tpu:0=64GiB")
    assert result.exit_code == 2
    assert "unknown device name 'tpu:0'" in result.output


def test_unknown_preset_is_a_usage_error():
    result = run("plan", "llama-9-9000b", "--devices", GOOD_DEVICES)
    assert result.exit_code == 2
    assert "unknown model preset 'llama-9-9000b'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("typed", "meant"), [("llama-3-8", "llama-3-8b"), ("llama3-8b", "llama-3-8b"),
                                              ("Mistral_7B", "mistral-7b"), ("llama-3.1-405", "llama-3.1-405b")])
def test_a_mistyped_preset_suggests_the_close_names(typed, meant):
    result = run("plan", typed, "--devices", GOOD_DEVICES)
    assert result.exit_code == 2, result.output
    assert f"unknown model preset {typed!r}: did you mean {meant!r}" in " ".join(result.output.split())
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("typed", ["./nope", "../nope", "/no/such/model", "~/no-such-model", "models/no/such",
                                   "nope/", "./nope/config.json"])
def test_a_path_that_does_not_exist_is_named_as_such_exit_code_2(typed):
    result = run("plan", typed, "--devices", GOOD_DEVICES)
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"no such {'file' if typed.endswith('.json') else 'directory'}: {typed}" in text, text
    assert "Hugging Face" not in text and len(result.output.strip().splitlines()) == 1


def test_a_model_id_is_still_not_taken_for_a_path():
    assert resolve_model("org/name") == "org/name"


def test_a_home_path_is_expanded(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert str(resolve_model("~/ckpt")) == str(tmp_path / "ckpt")


@pytest.mark.parametrize("typed", ["./llama-3-8b", "llama-3-8b/", "llama-3-8b"])
def test_a_folder_named_like_a_preset_is_the_folder(tmp_path, monkeypatch, typed):
    """Path("./llama-3-8b") prints as "llama-3-8b", which trace() took for the preset: the folder is passed whole."""
    (tmp_path / "llama-3-8b").mkdir()
    (tmp_path / "llama-3-8b" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.chdir(tmp_path)
    assert resolve_model(typed) == str(tmp_path / "llama-3-8b")


def test_a_binary_file_or_an_unknown_model_type_is_refused_in_a_short_line(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\xfd\x00" * 64)
    unknown = tmp_path / "config.json"
    unknown.write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 8}))
    for path, said in ((weights, "is not a text file"), (unknown, "model_type 'no_such_model' is not one transformers")):
        result = run("plan", str(path), "--devices", GOOD_DEVICES)
        assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output
        assert len(result.output) < 600  # not transformers' list of every model type


def test_bad_workload_is_a_usage_error():
    result = run("plan", "llama-9-9000b", "--devices", GOOD_DEVICES, "--batch", "0")
    assert result.exit_code == 2
    assert "batch_size is 0" in result.output


def test_bad_plot_suffix_is_refused_before_any_work(tmp_path):
    result = run("plan", "x", "--devices", GOOD_DEVICES, "--plot", str(tmp_path / "a.jpg"))
    assert result.exit_code == 2
    assert ".png, .svg or .html" in result.output


def test_config_json_without_model_type_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 8}))
    result = run("plan", str(path), "--devices", GOOD_DEVICES)
    assert result.exit_code == 2
    assert "no 'model_type' key" in result.output


def test_resolve_model_reads_a_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}))
    config = resolve_model(str(path))
    assert type(config).__name__ == "LlamaConfig"
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)


def test_resolve_devices_reads_a_saved_machine(tmp_path):
    machine = resolve_devices(GOOD_DEVICES)
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(machine.to_dict()))
    assert resolve_devices(str(path)) == machine
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"machine": machine.to_dict(), "measured_at": "now"}))
    read = resolve_devices(str(wrapped))  # a profile: the same devices, and the file its calibration is read from
    assert read.devices == machine.devices and read.links == machine.links
    assert read.profile_path == str(wrapped.resolve())


def test_devices_file_that_is_not_a_profile_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    result = run("plan", "x", "--devices", str(path))
    assert result.exit_code == 2
    assert "is not a saved machine profile" in result.output
    missing = run("plan", "x", "--devices", str(tmp_path / "nope.json"))
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_explain_prints_the_plan_and_writes_pictures(tmp_path):
    plan_path = tmp_path / "plan.json"
    report_plan().to_json(str(plan_path))
    html = tmp_path / "plan.html"
    result = run("explain", str(plan_path), "--plot", str(html))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "tiny-test" in out
    # report_plan streams layers 5, 6 and 7 from the CPU: one run of three units.
    assert "layers.5 .. layers.7" in out and "stream" in out
    assert "Memory per device" in out and "39.00 GiB" in out
    assert html.stat().st_size > 10_000
    assert Plan.from_json(str(plan_path)).model_name == "tiny-test"


def test_explain_shows_oom(tmp_path):
    plan_path = tmp_path / "plan.json"
    report_plan(strategy="sequential", over_bytes=2**30).to_json(str(plan_path))
    result = run("explain", str(plan_path))
    assert result.exit_code == 0
    assert "runs out of memory" in result.output
    assert "OOM cuda:0 needs" in result.output


def test_explain_refuses_a_file_that_is_not_a_plan(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"schema_version": 99}))
    result = run("explain", str(path))
    assert result.exit_code == 2
    assert "is not a placement_opt plan" in result.output
    assert "schema version 99" in result.output


def test_the_command_alone_prints_its_help_not_an_error():
    """``placement-opt`` with no arguments printed ``Error: Usage: ...``, the help as one error line."""
    result = run_cli(catch_exceptions=True)
    assert result.exit_code == 2  # click's code for a missing command
    assert result.output.startswith("Usage: placement-opt [OPTIONS] COMMAND") and "Error" not in result.output
    assert "Commands:" in result.output


@pytest.mark.parametrize("argv", [["--version"], ["-h"]])
def test_top_level_flags(argv):
    result = run(*argv)
    assert result.exit_code == 0
    assert "placement-opt" in result.output


def test_the_profile_table_shows_a_gpus_measured_rate_back_to_the_host():
    from rich.console import Console

    from placement_opt.cli.output import devices_table
    from placement_opt.hardware.devices import Device, Machine

    console = Console(width=160, record=True)
    console.print(devices_table(Machine([Device("cuda:0", "80GiB", to_host=1.3e9), Device("cuda:1", "80GiB"),
                                         Device("cpu", "64GiB")])))
    text = console.export_text()
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.startswith("│")}
    assert "back to host" in text and "1.3 GB/s" in rows["cuda:0"]
    assert rows["cuda:1"].split("│")[6].strip() == "-" and rows["cpu"].split("│")[6].strip() == "-"  # not measured


def test_the_profile_table_shows_a_disks_scattered_reads():
    """What a router's picks and a lookup's rows are read at: a rate and a latency a read; ``-`` unmeasured."""
    from rich.console import Console

    from placement_opt.cli.output import devices_table
    from placement_opt.hardware.devices import Device, Machine

    console = Console(width=200, record=True)
    for disk, said in ((Device("disk", "1TB", random_read=1.2e9, random_read_latency_s=15e-6), "1.2 GB/s + 15"),
                       (Device("disk", "1TB"), "-")):
        console.print(devices_table(Machine([Device("cpu", "64GiB"), disk])))
        text = console.export_text()
        row = next(line for line in text.splitlines() if line.startswith("│ disk"))
        assert "random read" in text and row.split("│")[7].strip().startswith(said), row


def test_profile_quick_writes_a_profile_that_devices_accepts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the disk measurement writes its scratch file here
    out = tmp_path / "machine.json"
    result = run("profile", "--quick", "--out", str(out), "--dtype", "float32")
    assert result.exit_code == 0, result.output
    assert "This machine" in result.output and f"saved to {out}" in result.output
    assert "measured" in result.output
    data = json.loads(out.read_text())
    assert {"cpu", "disk"} <= set(data["measurements"])
    machine = resolve_devices(str(out))
    assert machine.names == ["cpu", "disk"]
    assert machine["cpu"].source.startswith("measured")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["machine.json"]  # no scratch file left
    # a profile file named by path is read for the model's dtype, as --devices auto reads the same file: its machine
    # snapshot holds the dtype profiled last, which priced a float32 model at bfloat16's rate
    data["measurements"]["cpu"]["matmul_flops_per_s"]["bfloat16"] = 7 * data["measurements"]["cpu"][
        "matmul_flops_per_s"]["float32"]
    data["machine"]["devices"][0]["flops_per_s"] = data["measurements"]["cpu"]["matmul_flops_per_s"]["bfloat16"]
    out.write_text(json.dumps(data))
    named = resolve_devices(str(out), dtype="float32")
    monkeypatch.setenv("PLACEMENT_OPT_PROFILE", str(out))
    assert named["cpu"].flops_per_s == resolve_devices("auto", dtype="float32")["cpu"].flops_per_s == data[
        "measurements"]["cpu"]["matmul_flops_per_s"]["float32"]
    assert resolve_devices(str(out), dtype="bfloat16")["cpu"].flops_per_s == data["machine"]["devices"][0]["flops_per_s"]
    # a hand-edited measurement is named with its file, not shown as a bare KeyError ('matvec_bytes_per_s')
    for edit, said in ((lambda m: m.pop("matvec_bytes_per_s"), "no 'matvec_bytes_per_s'"),
                       (lambda m: m["matvec_bytes_per_s"].update(float32="fast"), "TypeError")):
        broken = json.loads(json.dumps(data))
        edit(broken["measurements"]["cpu"])
        out.write_text(json.dumps(broken))
        with pytest.raises(click.BadParameter, match=rf"machine.json' holds a malformed measurement \(.*{said}"):
            resolve_devices(str(out), dtype="float32")
    out.write_text(json.dumps(data))
    assert "float32 figures (float16 not measured)" in resolve_devices(str(out), dtype="float16")["cpu"].source


def test_auto_devices_are_this_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("PLACEMENT_OPT_PROFILE", str(tmp_path / "none.json"))  # no saved profile
    machine = resolve_devices("auto")
    assert machine.names[-2:] == ["cpu", "disk"]
    assert machine["cpu"].memory_bytes > 0 and "detected" in machine["cpu"].source


def test_plot_into_a_missing_folder_is_a_one_line_error(tmp_path):
    plan_path = tmp_path / "plan.json"
    report_plan().to_json(str(plan_path))
    result = run("explain", str(plan_path), "--plot", str(tmp_path / "no" / "such" / "dir.png"))
    assert result.exit_code == 1
    assert "cannot write" in result.output and "Traceback" not in result.output


# -- properties -----------------------------------------------------------------------------------

_OPTIONS = [("cuda:0", "cuda:0", "resident"), ("cpu", "cpu", "resident"), ("cpu", "cuda:0", "stream"),
            ("disk", "cpu", "stream"), ("disk", "cuda:0", "stream")]


@given(st.lists(st.sampled_from(_OPTIONS), min_size=1, max_size=40))
def test_runs_cover_every_unit_once_in_order_and_are_maximal(choices):
    placements = tuple(UnitPlacement(unit=f"u{i}", storage=s, execution=e, mode=m)
                       for i, (s, e, m) in enumerate(choices))
    plan = replace(report_plan(), placements=placements)
    runs = plan.runs()
    assert [n for names, *_ in runs for n in names] == [p.unit for p in placements]
    for names, storage, execution, mode in runs:
        assert all(plan.placement(n).storage == storage and plan.placement(n).execution == execution
                   and plan.placement(n).mode == mode for n in names)
    assert all(a[1:] != b[1:] for a, b in zip(runs, runs[1:], strict=False))  # maximal runs
    gpu, cpu, streamed = map(int, where_computed(plan).split("/"))
    assert gpu + cpu + streamed == len(placements)
    assert streamed == sum(1 for s, e, _ in choices if e == "cuda:0" and s != e)


def test_progress_spinner_shows_on_a_terminal_only(monkeypatch):
    import io

    from rich.console import Console

    import placement_opt.cli.output as output

    buffer = io.StringIO()
    monkeypatch.setattr(output, "console_for",
                        lambda stderr=False: Console(file=buffer, force_terminal=True, width=80))
    with output.progress("Tracing something big ..."):
        time.sleep(0.3)
    assert "Tracing something big" in buffer.getvalue()
    quiet = io.StringIO()
    monkeypatch.setattr(output, "console_for", lambda stderr=False: Console(file=quiet, width=80))
    with output.progress("Solving ..."):
        pass
    assert quiet.getvalue() == ""  # piped output stays clean


def test_logits_flag_prices_every_prompt_position(tmp_path):
    """--logits all: the head computes the whole prompt's logits, so the prefill costs more and the
    workload line says so; the plan JSON keeps the choice."""
    common = ("plan", "llama-2-7b", "-d", "cuda:0=a100-40gb,cpu=64GiB", "--prompt", "2048", "--new-tokens", "8")
    last, every = tmp_path / "last.json", tmp_path / "all.json"
    assert run_cli(*common, "--json", str(last)).exit_code == 0
    result = run_cli(*common, "--logits", "all", "--json", str(every))
    assert result.exit_code == 0 and "logits at every prompt position" in result.output
    from placement_opt import Plan

    plans = Plan.from_json(str(last)), Plan.from_json(str(every))
    assert plans[1].workload.logits == "all" and plans[0].workload.logits_kept == "last"
    assert plans[1].cost.prefill_s > plans[0].cost.prefill_s


def _without_and_with(tmp_path, common: tuple[str, ...], flag: str, said: str):
    """The plans ``common`` writes without and with ``flag``: the flag is kept in the plan file, and ``said`` is
    printed with it only; with --cluster the flag is a usage error."""
    from placement_opt import Plan

    paths = tmp_path / "without.json", tmp_path / "with.json"
    first = run_cli(*common, "--json", str(paths[0]))
    second = run_cli(*common, flag, "--json", str(paths[1]))
    assert first.exit_code == 0 and second.exit_code == 0, second.output
    assert said in second.output and said not in first.output
    plans = Plan.from_json(str(paths[0])), Plan.from_json(str(paths[1]))
    name = flag.removeprefix("--")
    assert (getattr(plans[0].workload, name), getattr(plans[1].workload, name)) == (False, True)
    bad = run_cli("plan", "llama-2-7b", "--cluster", "2x1xa100-40gb", flag, catch_exceptions=True)
    assert bad.exit_code == 2 and f"leave {flag} out" in bad.output and "Traceback" not in bad.output
    return plans


def test_overlap_flag_prices_copies_beside_earlier_compute_and_is_kept_in_the_plan(tmp_path):
    """--overlap: the workload asks for overlap pricing, the plan file keeps it, and the time line counts
    the copies made beside the compute; without it neither."""
    common = ("plan", "llama-2-7b", "-d", "cuda:0=a100-40gb/8GiB,cpu=64GiB", "--new-tokens", "8",
              "--modes", "resident,stream", "--time-limit", "1")
    plans = _without_and_with(tmp_path, common, "--overlap", "beside the compute")
    assert any(p.mode == "stream" for p in plans[1].placements)


def test_padded_flag_charges_the_prompt_mask_and_is_kept_in_the_plan(tmp_path):
    """--padded: the plan file keeps it, the workload line says it, and the GPU's workspace grows by the mask
    (batch x prompt^2 bools)."""
    common = ("plan", "llama-2-7b", "-d", "cuda:0=a100-40gb,cpu=64GiB", "--batch", "4", "--prompt", "2048",
              "--new-tokens", "8", "--modes", "resident", "--time-limit", "1")
    plans = _without_and_with(tmp_path, common, "--padded", "padded under a mask")
    workspace = [next(m.workspace_bytes for m in p.cost.memory if m.device == "cuda:0") for p in plans]
    assert workspace[1] - workspace[0] >= 4 * 2048 * 2048  # the mask, alive through the forward


def test_modes_flag_limits_the_solvers_choices_and_refuses_unknown_modes(tmp_path):
    from placement_opt import Plan

    common = ("plan", "llama-2-7b", "-d", "cuda:0=a100-40gb/8GiB,cpu=64GiB", "--new-tokens", "8")
    for modes in ("resident", "resident,stream"):
        assert run_cli(*common, "--modes", modes, "--json", str(tmp_path / f"{modes}.json")).exit_code == 0
    chosen = {m: {p.mode for p in Plan.from_json(str(tmp_path / f"{m}.json")).placements}
              for m in ("resident", "resident,stream")}
    assert chosen == {"resident": {"resident"}, "resident,stream": {"resident", "stream"}}
    bad = run_cli(*common, "--modes", "resident,teleport", catch_exceptions=True)
    text = " ".join(bad.output.split())
    assert bad.exit_code != 0 and "'teleport' is not a mode" in text and "Traceback" not in bad.output


def test_plan_granularity_places_sublayer_units_or_picks_the_better(tmp_path):
    common = ("plan", "mixtral-8x7b", "-d", "cuda:0=a100-40gb/24GiB,cpu=256GiB", "--new-tokens", "8")
    sub = run_cli(*common, "--granularity", "sublayer", "--json", str(tmp_path / "sub.json"))
    assert sub.exit_code == 0, sub.output
    plan = Plan.from_json(str(tmp_path / "sub.json"))
    assert plan.home == "cuda:0" and any(p.unit.endswith(".mlp.experts") for p in plan.placements)
    auto = run_cli(*common, "--granularity", "auto")
    assert auto.exit_code == 0, auto.output
    assert "granularity auto:" in " ".join(auto.output.split())


def test_pin_fixes_storage_by_name_or_pattern_and_refuses_what_it_cannot_keep(tmp_path):
    common = ("plan", "mixtral-8x7b", "-d", "cuda:0=a100-80gb,cpu=256GiB", "--new-tokens", "8", "--time-limit", "1")
    out = run_cli(*common, "--granularity", "sublayer", "--pin", "model.layers.*.mlp.experts=cpu", "--pin",
                  "lm_head=cpu", "--json", str(tmp_path / "pinned.json"))
    assert out.exit_code == 0, out.output
    storage = {p.unit: p.storage for p in Plan.from_json(str(tmp_path / "pinned.json")).placements}
    experts = [u for u in storage if u.endswith(".mlp.experts")]
    assert len(experts) == 32 and {storage[u] for u in experts} == {"cpu"} and storage["lm_head"] == "cpu"
    free = run_cli(*common, "--granularity", "sublayer", "--json", str(tmp_path / "free.json"))
    assert free.exit_code == 0  # without the pins, an 80 GB GPU keeps some experts: the pins changed the plan
    assert any(p.storage == "cuda:0" and p.unit.endswith(".mlp.experts")
               for p in Plan.from_json(str(tmp_path / "free.json")).placements)
    for args, said in ((("--pin", "lm_head"), "give MODULE=DEVICE"),
                       (("--pin", "model.layers.*.mlp.down_proj=cpu"), "matches no unit"),
                       (("--pin", "lm_head=cpu", "--strategy", "accelerate"), "leave --pin out"),
                       (("--pin", "lm_head=cpu", "--strategy", "balanced"), "--pin fixes storage in the cpsat plan "
                                                                           "only: --strategy balanced fills")):
        bad = run_cli(*common, *args, catch_exceptions=True)
        assert bad.exit_code == 2 and said in " ".join(bad.output.split()) and "Traceback" not in bad.output, args


def test_contiguous_stores_one_range_per_device_and_refuses_what_it_cannot_keep(tmp_path):
    # Two mismatched GPUs, RAM and a disk at batch 16: the plan interleaves its storage devices, and with
    # --contiguous each device stores one range of units, in unit order (every unit of this untied model
    # stores bytes, the rotary table's 512 B included).
    machine = ("-d", "cuda:0=rtx-4090,cuda:1=rtx-3090,cpu=64GiB,disk")
    workload = ("--batch", "16", "--prompt", "1024", "--time-limit", "1")
    ranges = {}
    for flag in ((), ("--contiguous",)):
        out = run_cli("plan", "llama-3-70b", *machine, *workload, *flag, "--json", str(tmp_path / "p.json"))
        assert out.exit_code == 0, out.output
        plan = Plan.from_json(str(tmp_path / "p.json"))
        ranges[flag] = [device for device, _ in itertools.groupby(p.storage for p in plan.placements)]
    assert len(ranges[()]) > len(set(ranges[()]))
    assert len(ranges[("--contiguous",)]) == len(set(ranges[("--contiguous",)])) >= 3
    assert "each device stores one contiguous range" in " ".join(out.output.split())
    assert any("contiguous range" in note for note in plan.notes)
    for args, said in (((*machine, "--strategy", "sequential"), "--strategy sequential places the units by its own rule"),
                       (("--cluster", "2x(a100-80gb*2,cpu-server)@ib-200g"), "stages are contiguous already")):
        bad = run_cli("plan", "llama-3-70b", *args, "--contiguous", catch_exceptions=True)
        assert bad.exit_code == 2 and said in " ".join(bad.output.split()) and "Traceback" not in bad.output, args


@pytest.mark.parametrize(("args", "said"), [
    (("--pin", "lm_head=cuda:1"), "cuda:1 is not in the machine (cuda:0, cpu): pin to one of those, or add cuda:1"),
    (("--strategy", "sequential", "--pin", "lm_head=cuda:0"), "leave --pin out, or use --strategy cpsat"),
    (("--modes", "resident,teleport"), "'teleport' is not a mode; give some of resident, stream, phased"),
    (("--modes", "stream"), "resident is missing"),
])
def test_bad_solver_input_is_one_line_and_exit_code_2(args, said):
    """Pins, modes, a strategy: the library's SolverInputError is bad input, as the docs promise (exit code 2)."""
    bad = run_cli("plan", "llama-2-7b", "-d", "cuda:0=a100-40gb,cpu=64GiB", "--new-tokens", "8", *args,
                  catch_exceptions=True)
    text = " ".join(bad.output.split())
    assert bad.exit_code == 2 and said in text and len(bad.output.strip().splitlines()) == 1, bad.output


def _quickstart_errors() -> list[tuple[list[str], str, int | None]]:
    """docs/quickstart.md's Errors block: (arguments, the line printed, the exit code shown or None)."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "quickstart.md").read_text(encoding="utf-8")
    block = re.search(r"## Errors\n.*?```text\n(.*?)```", text, re.S).group(1).splitlines()
    found = []
    for i, line in enumerate(block):
        if line.startswith("$ placement-opt "):
            code = int(block[i + 3]) if i + 3 < len(block) and block[i + 2] == "$ echo $?" else None
            found.append((shlex.split(line)[2:], block[i + 1], code))
    return found


@pytest.mark.parametrize(("args", "printed", "code"), _quickstart_errors(), ids=lambda v: str(v)[:40])
def test_the_quickstarts_error_examples_are_what_the_command_prints(args, printed, code):
    result = run(*args)
    assert result.output.strip() == printed
    assert result.exit_code == (code if code is not None else 2)  # the doc: bad input ends with exit code 2


def test_plan_hides_the_solvers_own_notes_unless_verbose(tmp_path):
    """'warm start: ...' and 'bound also from ...' are for whoever tunes the solver: --verbose and --json keep them."""
    common = ("plan", "llama-2-7b", "-d", "cuda:0=t4,cpu=64GiB", "--new-tokens", "8", "--time-limit", "1")
    default = " ".join(run(*common, "--json", str(tmp_path / "plan.json")).output.split())
    verbose = " ".join(run(*common, "--verbose").output.split())
    notes = Plan.from_json(str(tmp_path / "plan.json")).notes
    solver = [n for n in notes if n.startswith(("warm start:", "bound also from"))]
    assert solver and all(n not in default for n in solver) and all(n in verbose for n in solver)
    assert "note: warm start" not in default and "note: warm start" in verbose
    others = [n for n in notes if n not in solver]
    assert all(" ".join(n.split()) in default for n in others)  # what a user acts on stays


def test_compare_runs_accelerate_on_a_model_directory(tmp_path):
    """A save_pretrained directory, the most common input, reached the accelerate strategy as a bare str:
    'not run ... needs a transformers model or config'. Its config is read now, as for a config.json."""
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    out = run("compare", str(tmp_path / "llama"), "--devices", "cpu=1GiB,disk", "--prompt", "16", "--new-tokens", "4",
              "--json", str(tmp_path / "c.json"))
    assert out.exit_code == 0, out.output
    rows = {r["strategy"]: r for r in json.loads((tmp_path / "c.json").read_text())}
    assert rows["accelerate"]["ran"] and rows["accelerate"]["fits"], rows["accelerate"]["error"]
