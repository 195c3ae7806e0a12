"""placement-opt plan --cluster: stages per host and rank, JSON out, errors before tracing."""

from __future__ import annotations

import json

import pytest

from _cli import run_cli
from placement_opt.distributed.pipeline_plan import PipelinePlan


def test_plan_cluster_prints_stages_per_host_and_rank(tmp_path) -> None:
    out = tmp_path / "pipe.json"
    result = run_cli("plan", "llama-2-7b", "--cluster", "(a10*2,cpu)+(l4*2,cpu)@eth-25g", "--prompt", "1024",
                     "--microbatches", "4", "--json", str(out))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "pipeline of llama-2-7b: 4 stages, 1f1b, 4 micro-batches of 1 x 1024 tokens (forward)"
    assert "gap 0.0%, OPTIMAL" in lines[1]
    stage_lines = [x for x in lines if x.startswith("  host ")]
    assert [x.split(":")[0] for x in stage_lines] == [
        "  host 0 rank 0 (cuda", "  host 0 rank 1 (cuda", "  host 1 rank 2 (cuda", "  host 1 rank 3 (cuda"]
    assert "(l4))" in stage_lines[3] and stage_lines[0].split("): ")[1].startswith("model.embed_tokens")
    plan = PipelinePlan.from_json(out.read_text())
    assert plan.stages[-1].units[-1] == "lm_head" and plan.n_microbatches == 4
    assert json.loads(out.read_text())["version"] == 1


def test_plan_cluster_errors_are_one_line() -> None:
    result = run_cli("plan", "llama-2-7b", "--cluster", "(a10*2")
    assert result.exit_code != 0 and "unclosed '('" in result.output
    result = run_cli("plan", "llama-2-7b", "--cluster", "(a10*2)", "--schedule", "1f1b", "--microbatches", "1")
    assert result.exit_code == 2 and "give --microbatches 2 or more, or --schedule gpipe" in result.output
    zero = run_cli("plan", "llama-2-7b", "--cluster", "(a10*2)", "--microbatches", "0")
    assert zero.exit_code == 2 and "--microbatches is 0: give 1 to 65536" in zero.output
    huge = run_cli("plan", "llama-2-7b", "--cluster", "(a10*2)", "--microbatches", "10" * 30)
    assert huge.exit_code == 2 and "give 1 to 65536" in huge.output and "n_microbatches" not in huge.output
    result = run_cli("plan", "llama-2-7b")
    assert result.exit_code != 0 and "--devices" in result.output


@pytest.mark.parametrize(("args", "said"), [
    (("--devices", "cpu", "--train"), "--train shapes a pipeline over several machines: add --cluster"),
    (("--devices", "cpu", "--schedule", "gpipe", "--microbatches", "4"), "--schedule, --microbatches shape a pipeline"),
    (("--devices", "cpu", "--cluster", "2x(h100-sxm*2,cpu-server)@ib-200g"), "leave --devices out"),
    # one machine's options given with --cluster were dropped without a word (--plot wrote no file, exit 0)
    (("--cluster", "2x(h100-sxm*2,cpu-server)", "--plot", "p.png", "--objective", "memory"),
     "--plot, --objective shape one machine's plan"),
    (("--cluster", "2x(h100-sxm*2,cpu-server)", "--strategy", "balanced", "--granularity", "sublayer", "--modes",
      "stream", "--new-tokens", "9", "--logits", "all", "--time-limit", "2", "--expert-groups", "2"),
     "--strategy, --granularity, --modes, --new-tokens, --logits, --time-limit, --expert-groups shape one machine's"),
])
def test_options_of_the_other_kind_of_plan_are_refused_not_ignored(args, said):
    result = run_cli("plan", "llama-3-8b", *args, catch_exceptions=True)
    assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output


@pytest.mark.parametrize("name", ["cluster.JSON", "cluster"])
def test_a_cluster_file_is_read_whatever_its_suffix(tmp_path, name) -> None:
    """Only a lowercase '.json' was read as a file: 'cluster.JSON' was parsed as a spec ("device 'cluster.json' is
    no preset")."""
    path = tmp_path / name
    path.write_text(json.dumps({"hosts": [{"devices": "a10,cpu", "count": 2}], "link": "eth-25g"}))
    result = run_cli("plan", "llama-2-7b", "--cluster", str(path))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("pipeline of llama-2-7b: 2 stages")
