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


def test_another_tools_json_with_a_placements_key_is_not_taken_for_a_plan(tmp_path):
    """Any JSON object with "placements" was taken for an earlier plan and written over."""
    theirs = tmp_path / "layout.json"
    theirs.write_text(json.dumps({"placements": [{"op": "matmul", "core": 3}], "tool": "another placer"}))
    before = theirs.read_text()
    result = run_cli("plan", "llama-3-8b", "--devices", "cuda:0=rtx-4090,cpu=64GiB,disk", "--json", str(theirs),
                     catch_exceptions=True)
    assert result.exit_code == 2 and "not a plan placement_opt wrote" in result.output
    assert theirs.read_text() == before


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


@pytest.mark.parametrize("suffix", [".png", ".svg", ".html"])
def test_a_picture_is_drawn_over_its_own_earlier_picture_but_never_over_the_users_file(tmp_path, suffix):
    """--plot, plan, compare and explain: a file placement_opt did not draw is refused before any work, and kept."""
    pytest.importorskip("matplotlib")
    plan_path, picture = tmp_path / "plan.json", tmp_path / f"picture{suffix}"
    for _ in range(2):  # the second draws over the first one's picture
        result = run_cli("plan", "llama-3-8b", "--devices", "cuda:0=rtx-4090,cpu=64GiB,disk", "--json",
                         str(plan_path), "--plot", str(picture))
        assert result.exit_code == 0, result.output
    mine = tmp_path / f"mine{suffix}"
    mine.write_bytes(b"<html>my page</html>" if suffix == ".html" else b"\x89PNG\r\n\x1a\n my picture")
    for argv in (["plan", "llama-3-8b", "--devices", "cuda:0=rtx-4090,cpu=64GiB,disk"],
                 ["compare", "llama-3-8b", "--devices", "cuda:0=rtx-4090,cpu=64GiB,disk"], ["explain", str(plan_path)]):
        result = run_cli(*argv, "--plot", str(mine), catch_exceptions=True)
        assert result.exit_code == 2 and "is a file placement_opt did not draw" in " ".join(result.output.split()), argv
    assert mine.read_bytes().endswith((b"my page</html>", b"my picture"))


def test_save_report_refuses_a_users_file_too(tmp_path):
    pytest.importorskip("matplotlib")
    from placement_opt.cli.pictures import save_report
    from placement_opt.errors import PlacementError

    mine = tmp_path / "mine.svg"
    mine.write_text("<svg>mine</svg>")
    with pytest.raises(PlacementError, match="did not draw"):
        save_report(solve("llama-3-8b", "cuda:0=rtx-4090,cpu=64GiB,disk"), mine)
    assert mine.read_text() == "<svg>mine</svg>"


def test_bench_never_writes_its_report_over_a_users_file(tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("my notes")
    result = run_cli("bench", "--collect", "--out", str(notes), catch_exceptions=True)
    assert result.exit_code == 2 and "is a file that is not this suite's report" in " ".join(result.output.split())
    assert notes.read_text() == "my notes"
    report = tmp_path / "report.md"
    for _ in range(2):  # an earlier report is rewritten
        result = run_cli("bench", "--collect", "--out", str(report), catch_exceptions=True)
        assert result.exit_code == 0, result.output
    assert report.read_text().startswith("# placement_opt benchmark results")


def test_one_path_for_json_and_plot_is_refused_before_solving(tmp_path):
    """--json X.svg --plot X.svg wrote the plan, then failed with a traceback: the plan was no picture placement_opt
    drew. Refused before any work now, nothing written."""
    path = tmp_path / "out.svg"
    result = run_cli("plan", "llama-3-8b", "--devices", "cuda:0=rtx-4090,cpu=64GiB,disk", "--json", str(path),
                     "--plot", str(tmp_path / "." / "out.svg"), catch_exceptions=True)
    assert result.exit_code == 2 and "is the --json file too" in " ".join(result.output.split())
    assert not path.exists()


def test_a_users_file_put_at_the_json_path_while_solving_is_a_one_line_error(tmp_path, monkeypatch):
    """The check before solving passed (no file yet); one that appears meanwhile is kept, and said in one line."""
    from placement_opt.cli import output

    path = tmp_path / "plan.json"
    real = output.write_outputs

    def after_a_user_wrote(console, result, json_path, plot, outcomes=()):
        path.write_text(json.dumps(CONFIG))
        return real(console, result, json_path, plot, outcomes)

    monkeypatch.setattr("placement_opt.cli.main.write_outputs", after_a_user_wrote)
    result = run_cli("plan", "llama-3-8b", "--devices", "cuda:0=rtx-4090,cpu=64GiB,disk", "--json", str(path),
                     catch_exceptions=True)
    assert result.exit_code == 1 and "never over another file" in " ".join(result.output.split())
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert json.loads(path.read_text()) == CONFIG
