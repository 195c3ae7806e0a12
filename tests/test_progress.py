"""Progress bars: one switch (``PLACEMENT_OPT_PROGRESS`` / ``progress=``), stderr only, silent in pipes.

Under pytest stderr is captured (a pipe to rich), so "auto" must print nothing; forced on, rich
writes the finished bar once when the work ends, which is what these tests read.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from _cli import run_cli
from _models import MAPPED, RESIDENT, plan_from, tiny
from placement_opt.hardware.profiler import profile
from placement_opt.progress import ENV, bar, progress_enabled
from placement_opt.runtime.loader import load


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("on", True), ("0", False), ("off", False),
                                                 ("auto", False), ("", False), ("bogus", False)])
def test_the_switch_reads_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(ENV, value)  # auto under pytest, on a captured stderr: off
    assert progress_enabled() is expected
    assert progress_enabled(True) is True and progress_enabled(False) is False  # the keyword wins


def test_auto_is_off_in_a_pipe_even_outside_pytest(monkeypatch, capsys):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    assert progress_enabled() is False  # capsys: stderr is no terminal
    with bar("Counting", 10) as counted:
        for _ in range(10):
            counted.advance(1)
    assert capsys.readouterr() == ("", "")


def test_forced_on_the_final_bar_is_on_stderr_with_its_totals(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "1")
    with bar("Counting", 250) as counted:
        for _ in range(250):
            counted.advance(1)
    out, err = capsys.readouterr()
    assert out == ""
    assert "Counting" in err and "250/250" in err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny("llama")
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    model.save_pretrained(path)
    return path, model


def _bytes_in(path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for key in f.keys():
            sl = f.get_slice(key)
            total += math.prod(sl.get_shape()) * 4  # float32
    return total


def test_load_shows_the_checkpoint_bytes_on_stderr_when_forced(checkpoint, monkeypatch, capsys, tmp_path):
    path, model = checkpoint
    monkeypatch.setenv(ENV, "1")
    plan = plan_from(model, lambda i, u: (RESIDENT, MAPPED)[i % 2])
    load(path, None, plan=plan, offload_dir=tmp_path)
    out, err = capsys.readouterr()
    assert out == ""
    assert "Loading tiny-llama" in err
    total_kib = _bytes_in(path) / 1024
    done = re.search(r"([\d.]+)/([\d.]+) KiB", err)
    assert done, err
    assert done.group(1) == done.group(2) == f"{total_kib:.1f}"


def test_load_is_silent_by_default_and_when_asked(checkpoint, monkeypatch, capsys, tmp_path):
    path, model = checkpoint
    plan = plan_from(model, lambda i, u: RESIDENT)
    monkeypatch.delenv(ENV, raising=False)
    load(path, None, plan=plan)
    monkeypatch.setenv(ENV, "1")
    load(path, None, plan=plan, progress=False)  # the keyword wins over the environment
    assert capsys.readouterr() == ("", "")


def test_profile_counts_its_measurements(tmp_path, capsys):
    profile(["disk"], path=tmp_path / "p.json", quick=True, offload_folder=tmp_path, progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "Measured" in err and "4/4" in err  # the scratch file, then three cold reads


def test_cli_profile_keeps_stdout_for_the_table(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setenv("PLACEMENT_OPT_PROFILE", str(tmp_path / "p.json"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("placement_opt.hardware.profiler._measure_cpu", _fake_cpu)
    result = run_cli("profile", "--quick", "--dtype", "float32")
    assert result.exit_code == 0, result.stderr
    assert "Measured" in result.stderr and "/" in result.stderr
    assert "Measured" not in result.stdout and "This machine" in result.stdout


def _fake_cpu(quick, dtypes, counted):
    for _ in range(3 * len(dtypes) + 1):
        counted.advance(1)
    return {"memory_bytes": 2**30, "matmul_flops_per_s": dict.fromkeys(dtypes, 1e9),
            "matvec_bytes_per_s": dict.fromkeys(dtypes, 1e9), "copy_bytes_per_s": 1e9,
            "linear_flops_by_tokens": {d: [[1, 1e8]] for d in dtypes}}


def test_json_on_stdout_stays_pure_with_progress_forced_on(tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 128,
                                  "vocab_size": 128, "max_position_embeddings": 256, "torch_dtype": "float16"}))
    monkeypatch.setenv(ENV, "1")
    monkeypatch.chdir(tmp_path)
    result = run_cli("plan", str(config), "--devices", "cuda:0=t4,cpu=16GiB,disk", "--json", "-")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["placements"]


def test_the_cli_spinner_obeys_the_switch_set_to_0(monkeypatch):
    import io

    from rich.console import Console

    import placement_opt.cli.output as output

    buffer = io.StringIO()
    monkeypatch.setattr(output, "console_for", lambda stderr=False: Console(file=buffer, force_terminal=True))
    monkeypatch.setenv(ENV, "0")
    with output.progress("Tracing something big ..."):
        pass
    assert buffer.getvalue() == ""  # on a terminal too
