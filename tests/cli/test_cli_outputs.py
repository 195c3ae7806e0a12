"""Output paths: a file placement_opt did not write (a checkpoint's config.json, a plan where a profile goes) is
never written over, by the CLI or the library; an earlier file of the same kind is replaced."""

from __future__ import annotations

import json

import pytest

from _cli import run_cli
from placement_opt import solve
from placement_opt.errors import PlanFormatError
from placement_opt.hardware.profile_store import write_profile

CONFIG = {"model_type": "llama", "hidden_size": 64}


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def test_plan_json_over_a_config_is_refused_and_the_file_kept(config_json):
    result = run_cli("plan", "llama-3-8b", "--devices", "cuda:0=rtx-4090,cpu=64GiB,disk", "--json", str(config_json),
                     catch_exceptions=True)
    assert result.exit_code == 2
    assert "is a JSON file that is not a plan placement_opt wrote" in result.output
    assert json.loads(config_json.read_text()) == CONFIG


def test_profile_out_over_a_plan_is_refused_before_measuring(tmp_path):
    plan_path = tmp_path / "plan.json"
    run_cli("plan", "llama-3-8b", "--devices", "cuda:0=rtx-4090,cpu=64GiB,disk", "--json", str(plan_path))
    before = plan_path.read_text()
    result = run_cli("profile", "--quick", "--out", str(plan_path), catch_exceptions=True)
    assert result.exit_code == 2 and "not a profile placement_opt wrote" in result.output
    assert plan_path.read_text() == before


@pytest.mark.parametrize("content", ["", None], ids=["empty file", "no file"])
def test_an_empty_or_absent_path_and_an_earlier_plan_are_written(tmp_path, content):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    for _ in range(2):  # the second run replaces the first run's plan
        result = run_cli("plan", "llama-3-8b", "--devices", "cuda:0=rtx-4090,cpu=64GiB,disk", "--json", str(path))
        assert result.exit_code == 0, result.output
        assert "placements" in json.loads(path.read_text())


def test_the_library_refuses_too(config_json, tmp_path):
    plan = solve("llama-3-8b", "cuda:0=rtx-4090,cpu=64GiB,disk")
    with pytest.raises(PlanFormatError, match="never over another file"):
        plan.to_json(config_json)
    with pytest.raises(PlanFormatError, match="not a profile"):
        write_profile(config_json, {"schema_version": 1, "measurements": {}})
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\xfd\x00" * 100)
    with pytest.raises(PlanFormatError, match="not JSON"):
        plan.to_json(binary)
    assert json.loads(config_json.read_text()) == CONFIG and binary.read_bytes() == b"\xfd\x00" * 100


def test_a_pipeline_plan_is_written_over_by_plan_cluster_and_named_for_what_it_is_by_explain(tmp_path):
    path = tmp_path / "pipeline.json"
    for _ in range(2):  # the second run replaces the first one's pipeline plan
        result = run_cli("plan", "llama-3-8b", "--cluster", "2x(h100-sxm*2,cpu-server)@ib-200g", "--json", str(path))
        assert result.exit_code == 0, result.output
    result = run_cli("explain", str(path), catch_exceptions=True)
    assert result.exit_code == 2 and "is a pipeline plan over several machines" in " ".join(result.output.split())


def test_bench_refuses_a_report_in_a_missing_folder_before_running(tmp_path):
    result = run_cli("bench", "--collect", "--out", str(tmp_path / "nodir" / "b.md"), catch_exceptions=True)
    assert result.exit_code == 2 and "does not exist; create it first" in " ".join(result.output.split())
    assert "Traceback" not in result.output
