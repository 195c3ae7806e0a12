"""Command-line conventions: ``--json -`` on stdout only, the ``presets`` listing, no stray lines.

The tiny model is a Llama config written to a config.json: hidden 64, 2 layers, 4 heads,
intermediate 128, vocab 128 (about 200 KiB of float16 weights): it fits any preset GPU, so every
run here solves in well under a second.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from _cli import run_cli
from placement_opt.cost.device_map import accelerate_device_map
from placement_opt.hardware.presets import PRESETS
from placement_opt.model import catalog

TINY_CONFIG = TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 128,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "float16"}
MACHINE = "cuda:0=t4,cpu=16GiB,disk=nvme-gen4"


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_json_dash_writes_only_json_to_stdout(tiny_config, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    result = run_cli(command, str(tiny_config), "--devices", MACHINE, "--json", "-")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)  # the whole of stdout is one JSON document
    plans = [data] if command == "plan" else [row["plan"] for row in data if row["plan"]]
    assert plans and all(len(p["placements"]) >= 5 for p in plans)
    assert "Memory per device" in result.stderr or "Strategies side by side" in result.stderr
    assert not (tmp_path / "-").exists()  # no file called '-'


def test_json_to_a_file_still_names_the_file(tiny_config, tmp_path):
    out = tmp_path / "plan.json"
    result = run_cli("plan", str(tiny_config), "--devices", MACHINE, "--json", str(out))
    assert result.exit_code == 0
    assert f"plan written to {out}" in result.stdout and json.loads(out.read_text())["placements"]


def test_presets_lists_models_and_devices_with_their_figures():
    result = run_cli("presets")
    assert result.exit_code == 0
    out = result.stdout
    for title in ("Models", "GPUs", "CPUs", "Disks"):
        assert title in out
    for name in catalog.list_models():
        assert f" {name} " in out
    for key in PRESETS:
        assert f" {key} " in out
    a100 = next(line for line in out.splitlines() if " a100-40gb " in line)
    assert "40.00 GiB" in a100 and "312" in a100 and "1555 GB/s" in a100 and "300 GB/s" in a100
    hdd = next(line for line in out.splitlines() if " hdd " in line)
    assert "0.2 GB/s" in hdd and hdd.count(" - ") >= 4  # a disk has no FLOP/s and no links


def test_a_normal_plan_prints_no_stray_lines(tiny_config):
    """In a real process (a library's logging reaches the terminal there): stderr stays empty."""
    # both processes at once: importing torch and transformers takes most of their 10 s each
    procs = [subprocess.Popen([sys.executable, "-c", "from placement_opt.cli.main import main; main()", "plan",
                               str(tiny_config), "--devices", MACHINE, *extra], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
             for extra in ([], ["--strategy", "accelerate"])]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        assert stderr == ""
        lines = stdout.splitlines()
        assert lines[0].startswith("model ") and "fits" in stdout
        assert not any("available" in line or "Warning" in line or "warn" in line for line in lines)


def test_accelerate_map_for_preset_gpus_logs_nothing(caplog):
    config = catalog.model_config("gpt2-xl")
    with caplog.at_level(logging.INFO):
        device_map = accelerate_device_map(config, {0: 16 * 2**30, "cpu": 64 * 2**30})
    assert device_map and not [r for r in caplog.records if "not available" in r.getMessage()]
    # only that warning is filtered: the logger itself still works afterwards
    with caplog.at_level(logging.WARNING):
        logging.getLogger("accelerate.utils.modeling").warning("other message")
    assert "other message" in caplog.text
