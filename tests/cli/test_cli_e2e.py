"""``placement-opt plan`` and ``compare`` end to end: trace, solve, print, write JSON and pictures.

The tiny model is a Llama config written to a config.json: hidden 64, 2 layers, 4 heads,
intermediate 128, vocab 128. In float16 its units are: embed_tokens 128 x 64 x 2 B = 16 KiB;
each decoder layer = q,k,v,o 4 x 64 x 64 + gate/up/down 3 x 64 x 128 = 40,960 params (+ 2 norms
x 64) = 82,176 B; norm 128 B; lm_head 16 KiB. Everything fits one preset GPU many times over.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from _cli import run_cli
from placement_opt.compare import STRATEGIES
from placement_opt.plan import Plan

pytest.importorskip("placement_opt.planner")
pytest.importorskip("placement_opt.model.tracer")

REPO = Path(__file__).resolve().parents[2]
MACHINE = "cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=64GiB,disk=nvme-gen4"


def run(*args: str):
    return run_cli(*args)


def _image_size(path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        return image.size


def test_plan_prints_the_summary_and_writes_json_and_png(tiny_config, tmp_path):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    result = run("plan", str(tiny_config), "--devices", MACHINE, "--batch", "2", "--prompt", "32",
                 "--new-tokens", "8", "--json", str(out_json), "--plot", str(out_png))
    assert result.exit_code == 0, result.output
    assert re.search(r"solver +(OPTIMAL|FEASIBLE), objective .+, bound .+, gap", result.output)
    for text in ("Where each run of units lives and computes", "Memory per device",
                 "batch 2 x prompt 32 + 8 new tokens", f"plan written to {out_json}"):
        assert text in result.output, text
    plan = Plan.from_json(str(out_json))
    assert plan.strategy == "cpsat" and plan.workload.batch_size == 2
    # embed, 2 layers, norm, lm_head (rotary embedding has no parameters) -> at least 5 units
    assert len(plan.placements) >= 5
    assert "model.layers.1" in plan.device_map
    assert plan.cost.fits
    width, height = _image_size(out_png)
    assert width > 1000 and height > 300


def test_plan_accepts_every_strategy_and_objective(tiny_config):
    for strategy in ("sequential", "balanced_low_0"):
        result = run("plan", str(tiny_config), "--devices", MACHINE, "--strategy", strategy)
        assert result.exit_code == 0, result.output
        assert f"strategy {strategy}" in result.output
    result = run("plan", str(tiny_config), "--devices", MACHINE, "--objective", "throughput")
    assert result.exit_code == 0, result.output
    assert "objective  throughput" in result.output


def test_compare_runs_every_strategy_solve_accepts():
    """compare keeps its own tuple (the CLI's --help imports no solver): it must name what solve() accepts."""
    from placement_opt.planner import STRATEGIES as accepted

    assert set(STRATEGIES) == set(accepted) and STRATEGIES[0] == "cpsat"


def test_compare_shows_every_strategy_and_writes_results(tiny_config, tmp_path):
    out_json, out_html = tmp_path / "cmp.json", tmp_path / "cmp.html"
    result = run("compare", str(tiny_config), "--devices", MACHINE, "--prompt", "64", "--new-tokens", "4",
                 "--json", str(out_json), "--plot", str(out_html))
    assert result.exit_code == 0, result.output
    for strategy in STRATEGIES:
        assert strategy in result.output
    assert "vs cpsat" in result.output and "1.00x" in result.output
    rows = json.loads(out_json.read_text())
    assert [r["strategy"] for r in rows] == list(STRATEGIES)
    cpsat = Plan.from_dict(rows[0]["plan"])
    for row in rows[1:]:
        if row["plan"] and row["fits"]:  # CP-SAT is never worse than a feasible baseline
            other = Plan.from_dict(row["plan"])
            assert cpsat.cost.total_s <= other.cost.total_s * (1 + 1e-6)
    page = out_html.read_text()
    assert "<svg" in page and "Strategies" in page


def test_impossible_capacity_is_an_infeasible_error_with_exit_code_1(tiny_config):
    # 32 KiB of RAM and nothing else: the decoder layers alone need 160 KiB.
    result = run("plan", str(tiny_config), "--devices", "cpu=32KiB")
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: no placement fits")
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_compare_with_impossible_capacity_lists_why_each_strategy_fails(tiny_config):
    result = run("compare", str(tiny_config), "--devices", "cpu=32KiB")
    assert result.exit_code == 1
    assert "no plan" in result.output or "OOM" in result.output


def test_compare_tells_a_strategy_that_could_not_run_from_one_that_found_nothing(tiny_config):
    from placement_opt.cli.options import resolve_model
    from placement_opt.compare import compare_strategies
    from placement_opt.model.tracer import trace

    graph = trace(resolve_model(str(tiny_config)))
    found = compare_strategies(graph, "cpu=32KiB", strategies=("cpsat", "accelerate"))  # no source: no accelerate
    assert [(o.strategy, o.plan is None, o.ran) for o in found] == [("cpsat", True, True), ("accelerate", True, False)]
    assert "no placement fits" in found[0].error and "needs the model's config" in found[1].error


def test_plan_of_a_preset_on_a_preset_machine():
    result = run("plan", "llama-2-7b", "--devices", "cuda:0=t4,cpu=64GiB,disk=nvme-gen4", "--batch", "1",
                 "--prompt", "512", "--new-tokens", "64")
    assert result.exit_code == 0, result.output
    assert "llama-2-7b" in result.output.lower()
    assert "cuda:0" in result.output


@pytest.mark.slow
def test_acceptance_compare_llama_2_70b_runs_in_seconds():
    started = time.perf_counter()
    result = run("compare", "llama-2-70b", "--devices", "cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=256GiB,disk",
                 "--batch", "1", "--prompt", "512", "--new-tokens", "256")
    took = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    for strategy in STRATEGIES:
        assert strategy in result.output
    assert took < 30.0, f"compare took {took:.1f} s"
    # the README and the quickstart print this command's table: what it prints must be what they show (no saved
    # profile: the tests' own is empty), but for the solve time and gap, which vary from run to run, and the cpsat
    # row's memory and unit counts, which differ between plans of the same time that a search may return
    printed = _strategy_rows(result.output)
    for doc in ("README.md", "docs/quickstart.md"):
        shown = _strategy_rows((REPO / doc).read_text(encoding="utf-8"))
        assert shown == printed, f"{doc}'s compare table is stale: it shows {shown}, the command prints {printed}"


def _strategy_rows(text: str) -> dict[str, list[str]]:
    """``compare``'s table rows by strategy, less the solve and gap columns."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if line.startswith("│") and cells[0] in STRATEGIES:
            rows[cells[0]] = cells[1:7] if cells[0] == "cpsat" else cells[1:-2]  # cpsat: fits .. tokens/s
    return rows


def test_dtype_defaults_to_the_models_own_and_can_be_overridden():
    # Llama-3-8B's published config says bfloat16: 8.03 B parameters, 2 bytes each by default.
    own = run("plan", "llama-3-8b", "--devices", "cuda:0=a100-80gb,cpu=64GiB")
    forced = run("plan", "llama-3-8b", "--devices", "cuda:0=a100-80gb,cpu=64GiB", "--dtype", "float32")
    assert own.exit_code == 0 and forced.exit_code == 0, own.output + forced.output
    assert "llama-3-8b (bfloat16, 36 units)" in own.output
    assert "llama-3-8b (float32, 36 units)" in forced.output
