"""Options the command would have ignored, and output paths it could not write: refused in one line, before any
work where that can be known, and never a traceback.

The tiny model is a Llama config written to a config.json (hidden 64, 2 layers, 4 heads, intermediate 128,
vocab 128: about 200 KiB of float16 weights), so every solve here takes a fraction of a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _cli import run_cli
from _models import tiny

MACHINE = "cuda:0=t4,cpu=16GiB,disk=nvme-gen4"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-run")
    tiny("llama").save_pretrained(path)
    return path


def _one_line(result, code: int) -> str:
    """The output of a refused command, on one line, after checking it ended with ``code`` and no traceback."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and (result.exception is None or isinstance(result.exception, SystemExit))
    assert len(result.output.strip().splitlines()) == 1, result.output
    return " ".join(result.output.split())


@pytest.mark.parametrize(("args", "said"), [
    (("--modes", "resident,stream"), "--modes says what the cpsat search may choose: --strategy sequential"),
    (("--granularity", "auto"), "--granularity auto keeps the better of two cpsat plans: --strategy sequential"),
    (("--time-limit", "2"), "--time-limit bounds the cpsat search: --strategy sequential"),
])
def test_plan_refuses_the_solvers_options_with_another_strategy(tiny_config, args, said):
    """--modes, --granularity auto and --time-limit were accepted with --strategy sequential and changed nothing."""
    result = run_cli("plan", str(tiny_config), "-d", MACHINE, "--strategy", "sequential", *args, catch_exceptions=True)
    assert said in _one_line(result, 2)


def test_plan_takes_the_solvers_options_with_cpsat_and_a_sublayer_greedy_plan(tiny_config):
    assert run_cli("plan", str(tiny_config), "-d", MACHINE, "--modes", "resident,stream", "--time-limit", "1",
                   "--granularity", "auto").exit_code == 0
    assert run_cli("plan", str(tiny_config), "-d", MACHINE, "--strategy", "balanced",
                   "--granularity", "sublayer").exit_code == 0


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc: a folder that exists and takes no new file")
@pytest.mark.parametrize("command", [("compare", "{model}", "-d", MACHINE),
                                     ("plan", "{model}", "--cluster", "2xa10@ib-200g")])
def test_a_json_path_that_cannot_be_written_is_one_line(tiny_config, command):
    """compare --json and plan --cluster --json ended in a FileNotFoundError traceback (plan --json said one line)."""
    args = [a.format(model=tiny_config) for a in command]
    result = run_cli(*args, "--json", "/proc/placement_opt_test.json", catch_exceptions=True)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert f"cannot write the {'comparison' if command[0] == 'compare' else 'pipeline plan'} to" in result.output


def test_plan_cluster_names_the_file_it_wrote(tiny_config, tmp_path):
    out = tmp_path / "pipeline.json"
    result = run_cli("plan", str(tiny_config), "--cluster", "2xa10@ib-200g", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert f"plan written to {out}" in result.output and json.loads(out.read_text())["stages"]


def test_run_refuses_a_json_path_in_a_missing_folder_before_loading(checkpoint, tmp_path):
    """It loaded, generated and timed the model, then ended in a FileNotFoundError traceback."""
    result = run_cli("run", str(checkpoint), "-d", "cpu=1GB", "--prompt", "4", "--new-tokens", "2",
                     "--json", str(tmp_path / "nope" / "run.json"), catch_exceptions=True)
    assert "folder" in _one_line(result, 2) and "does not exist" in result.output


def test_run_json_dash_writes_the_figures_to_stdout_and_the_tables_to_stderr(checkpoint, tmp_path, monkeypatch):
    """--json - wrote a file called '-', where plan and compare write the JSON to stdout."""
    monkeypatch.chdir(tmp_path)
    result = run_cli("run", str(checkpoint), "-d", "cpu=1GB", "--prompt", "4", "--new-tokens", "2", "--repeats", "1",
                     "--json", "-")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout)  # the whole of stdout is one JSON document
    assert figures["measured"]["decode_step_s"] and "measured / predicted" in result.stderr
    assert not (tmp_path / "-").exists()


def test_run_refuses_a_prompt_length_beside_text(checkpoint):
    """--text sets the prompt: a --prompt given beside it was dropped without a word."""
    result = run_cli("run", str(checkpoint), "-d", "cpu=1GB", "--text", "hello", "--prompt", "100",
                     catch_exceptions=True)
    assert "--prompt 100 with --text" in _one_line(result, 2)


@pytest.mark.parametrize("args", [("--batch", "4"), ("--prompt", "64"), ("--new-tokens", "8")])
def test_profile_refuses_a_workload_without_a_model_before_measuring(tmp_path, args):
    """--batch, --prompt and --new-tokens shape the --model calibration only: alone they were ignored."""
    out = tmp_path / "p.json"
    result = run_cli("profile", "--out", str(out), *args, catch_exceptions=True)
    assert f"{args[0]} says" in _one_line(result, 2) and "add --model MODEL" in result.output
    assert not out.exists()


@pytest.mark.parametrize("args", [("--quick",), ("--only", "tracing")])
def test_bench_collect_refuses_the_options_of_a_run(tmp_path, args):
    """--collect runs nothing: --quick and --only were dropped (and --quick labelled the report a smoke run)."""
    out = tmp_path / "r.md"
    result = run_cli("bench", "--collect", *args, "--out", str(out), catch_exceptions=True)
    assert f"{args[0]} with --collect" in _one_line(result, 2)
    assert not out.exists()


def test_profile_of_a_model_id_it_cannot_read_is_one_line_before_measuring(tmp_path):
    """transformers' message for a model id neither cached nor fetched ran over two lines."""
    out = tmp_path / "p.json"
    result = run_cli("profile", "--out", str(out), "--model", "no-such-org/no-such-model", catch_exceptions=True)
    assert "'no-such-org/no-such-model' is not a preset" in _one_line(result, 2)
    assert not out.exists()


def test_an_output_path_under_a_file_is_named_as_such(tiny_config, tmp_path):
    """A --json path whose folder is a file was refused as a folder that 'does not exist'."""
    result = run_cli("plan", str(tiny_config), "-d", MACHINE, "--json", str(tiny_config / "plan.json"),
                     catch_exceptions=True)
    assert "is a file, not a folder" in _one_line(result, 2)


SMALL = ("-d", "cuda:0=t4/64MiB,cpu=64MiB", "--batch", "512", "--prompt", "2048")  # a KV cache of ~1 GiB


@pytest.mark.parametrize("strategy", ["balanced", "sequential"])
def test_a_baseline_plan_that_runs_out_of_memory_exits_1_and_is_still_written(tiny_config, tmp_path, strategy):
    """plan --strategy balanced exited 0 with a plan that runs out of memory: a script took it for a placement."""
    out = tmp_path / "plan.json"
    result = run_cli("plan", str(tiny_config), *SMALL, "--strategy", strategy, "--json", str(out),
                     catch_exceptions=True)
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert f"Error: the {strategy} plan does not fit" in said and "GiB short" in said
    assert json.loads(out.read_text())["cost"]["violations"]  # written, with its OOM: the user asked to read it


def test_compare_where_no_strategy_fits_exits_1(tiny_config):
    """compare exited 0 with a table of OOM rows and no plan that fits."""
    result = run_cli("compare", str(tiny_config), *SMALL, catch_exceptions=True)
    assert result.exit_code == 1, result.output
    assert "no strategy produced a plan that fits" in " ".join(result.output.split())
    assert run_cli("compare", str(tiny_config), "-d", MACHINE).exit_code == 0


@pytest.mark.parametrize("command", [("plan", "{model}", "-d", MACHINE, "--json", ""),
                                     ("plan", "{model}", "-d", MACHINE, "--plot", " "),
                                     ("compare", "{model}", "-d", MACHINE, "--json", ""),
                                     ("explain", "{plan}", "--plot", "")])
def test_an_empty_output_path_is_refused(tiny_config, tmp_path, command):
    """``--json ''`` (a shell variable left unset) was accepted and wrote nothing, with exit code 0."""
    plan = tmp_path / "plan.json"
    if "{plan}" in command:
        assert run_cli("plan", str(tiny_config), "-d", MACHINE, "--json", str(plan)).exit_code == 0
    args = [a.format(model=tiny_config, plan=plan) for a in command]
    said = _one_line(run_cli(*args, catch_exceptions=True), 2)
    assert "an empty path writes nothing" in said and ("--json" in said or "--plot" in said)
