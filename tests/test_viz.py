"""Pictures of a plan: files are written, non-trivial, and show what they claim.

The plans here are built by hand (no solver), so these tests check only the drawing.
"""

from __future__ import annotations

import pytest

from placement_opt.cli.pictures import device_colors, save_report
from placement_opt.compare import StrategyOutcome
from placement_opt.cost.evaluate import Cost, UnitCost
from placement_opt.cost.memory import DeviceMemory, Violation
from placement_opt.cost.workload import Workload
from placement_opt.hardware.resolve import parse_device_spec
from placement_opt.plan import Plan, UnitPlacement
from placement_opt.units import GIB, MIB

pytest.importorskip("matplotlib")

MACHINE = parse_device_spec("cuda:0=a100-40gb,cpu=64GiB,disk=nvme-gen4")
WORKLOAD = Workload(batch_size=1, prompt_len=512, new_tokens=16)


def make_plan(*, strategy: str = "cpsat", total_s: float = 2.0, over_bytes: int = 0,
              n_layers: int = 8) -> Plan:
    """A hand-made plan: embed + n layers + head; the last 3 layers are streamed from the CPU.

    Sizes: 1 GiB per layer; cuda:0 holds embed (0.5 GiB) + 5 layers + head (0.5 GiB) = 6 GiB.
    """
    names = ["embed"] + [f"layers.{i}" for i in range(n_layers)] + ["head"]
    placements, units = [], []
    for i, name in enumerate(names):
        streamed = name.startswith("layers.") and i > n_layers - 3
        storage, mode = ("cpu", "stream") if streamed else ("cuda:0", "resident")
        placements.append(UnitPlacement(unit=name, storage=storage, execution="cuda:0", mode=mode))
        units.append(UnitCost(name=name, storage=storage, execution="cuda:0", mode=mode,
                              prefill_s=total_s / len(names) / 2, decode_s=total_s / len(names) / 2,
                              stored_bytes=GIB, resident_bytes=0, peak_bytes=0))
    capacity = 39 * GIB
    gpu_used = capacity + over_bytes
    memory = (
        DeviceMemory(device="cuda:0", capacity_bytes=capacity, reserve_bytes=GIB,
                     weights_bytes=gpu_used - 3 * GIB - 512 * MIB, kv_cache_bytes=2 * GIB,
                     workspace_bytes=GIB, stream_buffer_bytes=512 * MIB),
        DeviceMemory(device="cpu", capacity_bytes=64 * GIB, reserve_bytes=0, weights_bytes=3 * GIB,
                     kv_cache_bytes=0, workspace_bytes=0, stream_buffer_bytes=0),
        DeviceMemory(device="disk", capacity_bytes=2 * 10**12, reserve_bytes=0, weights_bytes=0,
                     kv_cache_bytes=0, workspace_bytes=0, stream_buffer_bytes=0),
    )
    violations = ()
    if over_bytes:
        violations = (Violation(device="cuda:0", needed_bytes=gpu_used, capacity_bytes=capacity,
                                message=f"cuda:0 needs {over_bytes} more bytes"),)
    cost = Cost(workload=WORKLOAD, prefill_s=total_s / 2, decode_s=total_s / 2, transfer_s=0.0,
                stage_s={"cuda:0": total_s}, units=tuple(units), memory=memory, violations=violations)
    return Plan(model_name="tiny-test", dtype="float16", objective="latency", strategy=strategy,
                placements=tuple(placements), machine=MACHINE, workload=WORKLOAD, cost=cost,
                status="OPTIMAL" if strategy == "cpsat" else "GREEDY", objective_value=total_s,
                best_bound=total_s, gap=0.0, solve_time_s=0.1)


def outcomes() -> list[StrategyOutcome]:
    return [
        StrategyOutcome(strategy="cpsat", plan=make_plan()),
        StrategyOutcome(strategy="sequential", plan=make_plan(strategy="sequential", total_s=5.0,
                                                              over_bytes=3 * GIB)),
        StrategyOutcome(strategy="balanced", plan=make_plan(strategy="balanced", total_s=3.0)),
        StrategyOutcome(strategy="accelerate", error="transformers is not installed"),
    ]


def _image_size(path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        return image.size


def test_png_report_has_every_chart_and_a_sensible_size(tmp_path):
    path = save_report(make_plan(), tmp_path / "plan.png", outcomes())
    width, height = _image_size(path)
    # 12 in wide at 110 dpi; three charts stacked make it taller than a single strip (2.2 in).
    assert width == 1320
    assert height > 600
    assert path.stat().st_size > 30_000


def test_png_without_comparison_is_shorter(tmp_path):
    with_cmp = save_report(make_plan(), tmp_path / "a.png", outcomes())
    without = save_report(make_plan(), tmp_path / "b.png")
    assert _image_size(without)[1] < _image_size(with_cmp)[1]


def test_svg_names_devices_strategies_and_the_oom(tmp_path):
    text = save_report(make_plan(), tmp_path / "plan.svg", outcomes()).read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    # matplotlib writes text as glyph paths with the string in a comment/id; check the labels.
    for label in ("cuda:0", "cpu", "sequential", "OOM", "1.50x cpsat"):
        assert label in text, label


def test_html_report_is_self_contained(tmp_path):
    page = save_report(make_plan(), tmp_path / "plan.html", outcomes()).read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "src=\"http" not in page and "href=\"http" not in page.replace("http://www.w3.org", "")
    assert "<td>sequential</td><td>OOM</td>" in page
    assert "no plan: transformers is not installed" in page
    assert "tiny-test" in page
    # make_plan streams layers 5-7 from the CPU: one run of three units in the runs table
    assert "<td>layers.5 .. layers.7</td><td>3</td><td>cpu</td><td>cuda:0</td><td>stream</td>" in page


def test_memory_bars_mark_a_device_over_capacity(tmp_path):
    plan = make_plan(strategy="sequential", over_bytes=3 * GIB)
    text = save_report(plan, tmp_path / "oom.svg").read_text()
    assert "OOM: 3.00 GiB short" in text


def test_unknown_suffix_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\.png, \.svg or \.html"):
        save_report(make_plan(), tmp_path / "plan.jpg")


def test_device_colors_are_distinct_and_stable():
    colors = device_colors(["cuda:0", "cuda:1", "cpu", "disk"])
    assert len(set(colors.values())) == 4
    assert colors == device_colors(["cuda:0", "cuda:1", "cpu", "disk"])
