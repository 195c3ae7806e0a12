"""`placement-opt profile --model`: the machine measured and the model calibrated in one command."""

from __future__ import annotations

import json

from transformers import LlamaConfig

from _cli import run_cli
from placement_opt.hardware.profile_store import saved_calibration


def tiny_checkpoint_config(tmp_path, hidden: int):
    """A 2-layer float32 Llama's config.json in ``tmp_path/tiny`` (the folder)."""
    config = LlamaConfig(hidden_size=hidden, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    config.dtype = "float32"
    folder = tmp_path / "tiny"
    config.save_pretrained(folder)
    return folder


def test_profile_with_a_model_calibrates_it(tmp_path) -> None:
    folder = tiny_checkpoint_config(tmp_path, 64)
    out = tmp_path / "profile.json"
    result = run_cli("profile", "--out", str(out), "--quick", "--model", str(folder), "--prompt", "16",
                     "--new-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "calibrated" in result.output and "model.layers.0 on cpu" in result.output
    saved = saved_calibration(out)
    assert saved is not None and len(saved["models"]) == 1
    recorded = next(iter(saved["models"].values()))
    assert recorded["workload"]["prompt_len"] == 16 and recorded["units"]["model.layers.0"] in saved["units"]
    assert json.loads(out.read_text())["dtype"] == "float32"  # the model's dtype was measured


def test_profile_refuses_a_bad_workload_before_measuring(tmp_path) -> None:
    result = run_cli("profile", "--out", str(tmp_path / "p.json"), "--model", "llama-2-7b", "--prompt", "0",
                     catch_exceptions=True)
    assert result.exit_code != 0 and "prompt_len" in result.output
    assert not (tmp_path / "p.json").exists()


def test_profile_times_the_sublayer_parts_when_asked(tmp_path) -> None:
    folder = tiny_checkpoint_config(tmp_path, 96)  # not 64, the trace's tokens: the tracer would take a
    # (tokens, hidden) output for attention-score shaped
    out = tmp_path / "profile.json"
    result = run_cli("profile", "--out", str(out), "--quick", "--model", str(folder), "--prompt", "16",
                     "--new-tokens", "4", "--granularity", "sublayer")
    assert result.exit_code == 0, result.output
    assert "model.layers.0.self_attn on cpu" in result.output and "model.layers.0 on cpu" not in result.output
    recorded = next(iter(saved_calibration(out)["models"].values()))
    assert "model.layers.0.mlp" in recorded["units"]


def test_profile_refuses_cutting_options_it_cannot_use(tmp_path) -> None:
    out = tmp_path / "p.json"
    alone = run_cli("profile", "--out", str(out), "--granularity", "sublayer", catch_exceptions=True)
    assert alone.exit_code == 2 and "add --model MODEL" in alone.output
    groups = run_cli("profile", "--out", str(out), "--model", "mixtral-8x7b", "--expert-groups", "2",
                     catch_exceptions=True)
    assert groups.exit_code == 2 and "add --granularity sublayer" in groups.output
    assert not out.exists()  # refused before measuring


def _planned(tmp_path, folder, devices) -> dict:
    """``plan FOLDER --devices DEVICES`` at a short workload, as its JSON plan."""
    written = tmp_path / "plan.json"
    result = run_cli("plan", str(folder), "--devices", str(devices), "--prompt", "16", "--new-tokens", "4",
                     "--json", str(written))
    assert result.exit_code == 0, result.output
    return json.loads(written.read_text())


def test_plan_with_devices_path_reads_the_calibration_saved_in_that_file(tmp_path) -> None:
    """`--devices PATH` read the calibration from the default profile, not PATH: a model calibrated with `profile
    --out PATH --model M` was "not calibrated on this machine", and a profile copied from another host was priced
    with this host's unit times (none here: the default profile of every test is empty)."""
    folder = tiny_checkpoint_config(tmp_path, 64)
    out = tmp_path / "m2.json"
    made = run_cli("profile", "--out", str(out), "--quick", "--model", str(folder), "--prompt", "16",
                   "--new-tokens", "4")
    assert made.exit_code == 0, made.output
    calibrated = _planned(tmp_path, folder, out)
    assert "unit times calibrated on this model: 6 of 6 units measured on this machine" in " ".join(calibrated["notes"])

    data = json.loads(out.read_text())  # the same file, as measured on the host that made it
    data["host"] = data["calibration"]["host"] = "gpu-server-7"
    copied = tmp_path / "copied.json"
    copied.write_text(json.dumps(data))
    elsewhere = _planned(tmp_path, folder, copied)
    assert "measured on host 'gpu-server-7', where the profile was made" in " ".join(elsewhere["notes"])
    assert elsewhere["cost"] == calibrated["cost"]  # that host's unit times, not none

    del data["calibration"]
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(data))
    notes = " ".join(_planned(tmp_path, folder, bare)["notes"])
    assert f"this model is not calibrated in the profile {str(bare)!r}" in notes
    assert f"placement-opt profile --model MODEL --out {bare}" in notes and "on host 'gpu-server-7'" in notes
