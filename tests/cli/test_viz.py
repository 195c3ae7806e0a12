"""Pictures of a plan: files are written, non-trivial, and show what they claim.

The plans here are built by hand (no solver), so these tests check only the drawing.
"""

from __future__ import annotations

import io

import pytest

from _plans import report_plan
from placement_opt.cli.pictures import device_colors, save_report
from placement_opt.compare import StrategyOutcome
from placement_opt.units import GIB

pytest.importorskip("matplotlib")


def outcomes() -> list[StrategyOutcome]:
    return [
        StrategyOutcome(strategy="cpsat", plan=report_plan()),
        StrategyOutcome(strategy="sequential", plan=report_plan(strategy="sequential", total_s=5.0,
                                                              over_bytes=3 * GIB)),
        StrategyOutcome(strategy="balanced", plan=report_plan(strategy="balanced", total_s=3.0)),
        StrategyOutcome(strategy="accelerate", error="transformers is not installed"),
    ]


def _image_size(path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as image:
        return image.size


def test_png_report_has_every_chart_and_a_sensible_size(tmp_path):
    path = save_report(report_plan(), tmp_path / "plan.png", outcomes())
    width, height = _image_size(path)
    # 12 in wide at 110 dpi; three charts stacked make it taller than a single strip (2.2 in).
    assert width == 1320
    assert height > 600
    assert path.stat().st_size > 30_000


def test_png_without_comparison_is_shorter(tmp_path):
    with_cmp = save_report(report_plan(), tmp_path / "a.png", outcomes())
    without = save_report(report_plan(), tmp_path / "b.png")
    assert _image_size(without)[1] < _image_size(with_cmp)[1]


def test_svg_names_devices_strategies_and_the_oom(tmp_path):
    text = save_report(report_plan(), tmp_path / "plan.svg", outcomes()).read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    # matplotlib writes text as glyph paths with the string in a comment/id; check the labels.
    # the ratio says what it is of: the table's 'vs cpsat' is the objective's (throughput: the slowest stage)
    for label in ("cuda:0", "cpu", "sequential", "OOM", "1.50x cpsat's total time"):
        assert label in text, label


def test_html_report_is_self_contained(tmp_path):
    page = save_report(report_plan(), tmp_path / "plan.html", outcomes()).read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    assert "src=\"http" not in page and "href=\"http" not in page.replace("http://www.w3.org", "")
    assert '<td>sequential</td><td class="bad">OOM</td>' in page
    assert "no plan: transformers is not installed" in page
    assert "tiny-test" in page
    # make_plan streams layers 5-7 from the CPU: one run of three units in the runs table
    assert "<td>layers.5 .. layers.7</td><td>3</td><td>cpu</td><td>cuda:0</td><td>stream</td>" in page


def test_memory_bars_mark_a_device_over_capacity(tmp_path):
    plan = report_plan(strategy="sequential", over_bytes=3 * GIB)
    text = save_report(plan, tmp_path / "oom.svg").read_text()
    assert "OOM: 3.00 GiB short" in text


def test_unknown_suffix_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"\.png, \.svg or \.html"):
        save_report(report_plan(), tmp_path / "plan.jpg")


def test_device_colors_are_distinct_and_stable():
    colors = device_colors(["cuda:0", "cuda:1", "cpu", "disk"])
    assert len(set(colors.values())) == 4
    assert colors == device_colors(["cuda:0", "cuda:1", "cpu", "disk"])


def test_memory_axis_ends_at_100_percent_when_every_device_fits():
    import matplotlib.pyplot as plt

    from placement_opt.cli.pictures import memory_bars

    ax = memory_bars(report_plan())
    assert ax.get_xlim() == (0.0, 100.0)
    plt.close(ax.figure)


def test_memory_axis_ends_at_the_longest_bar_over_capacity_which_stays_marked():
    import matplotlib.pyplot as plt

    from placement_opt.cli.pictures import memory_bars

    plan = report_plan(strategy="sequential", over_bytes=3 * GIB)
    gpu = plan.cost.device_memory("cuda:0")
    longest = 100.0 * gpu.used_bytes / gpu.capacity_bytes
    ax = memory_bars(plan)
    assert ax.get_xlim() == pytest.approx((0.0, longest))
    assert longest > 100.0
    from matplotlib.colors import to_rgb

    red = to_rgb("#d62828")  # the OOM colour
    outlined = [p for p in ax.patches if tuple(p.get_edgecolor()[:3]) == pytest.approx(red)]
    assert len(outlined) == 1 and outlined[0].get_width() == pytest.approx(longest)  # the whole bar, in red
    texts = [t for t in ax.texts if "OOM: 3.00 GiB short" in t.get_text()]
    assert texts and texts[0].get_position()[0] <= longest  # inside the axis
    plt.close(ax.figure)


def test_each_unit_of_the_strip_is_as_wide_as_its_weights():
    from dataclasses import replace

    import matplotlib

    matplotlib.use("Agg")
    from placement_opt.cli.pictures import placement_strip

    plan = report_plan(n_layers=3)  # embed, 3 layers, head: given 1, 2, 3, 4 and 5 GiB below
    units = tuple(replace(u, stored_bytes=(k + 1) * GIB) for k, u in enumerate(plan.cost.units))
    ax = placement_strip(replace(plan, cost=replace(plan.cost, units=units)))
    storage_row = sorted((b for b in ax.patches if b.get_y() == pytest.approx(1.1)), key=lambda b: b.get_x())
    assert [b.get_width() for b in storage_row] == pytest.approx([1, 2, 3, 4, 5])
    assert [b.get_x() for b in storage_row] == pytest.approx([0, 1, 3, 6, 10])
    assert ax.get_xlim() == pytest.approx((0, 15)) and "as wide as its weights" in ax.get_xlabel()
    bare = placement_strip(replace(plan, cost=replace(plan.cost, units=())))  # no per-unit costs: equal widths
    assert {b.get_width() for b in bare.patches if b.get_y() == pytest.approx(1.1)} == {1.0}
    assert "as wide" not in bare.get_xlabel()


def test_a_strategy_that_could_not_run_reads_not_run_not_no_plan(tmp_path):
    """compare: a strategy that could not be run (ran=False) is not one that found nothing that fits."""
    from rich.console import Console

    from placement_opt.cli.tables import comparison_table, why_lines

    skipped = StrategyOutcome(strategy="accelerate", error="strategy 'accelerate' needs the model's config", ran=False)
    found = [*outcomes()[:3], skipped]
    console = Console(width=200, color_system=None, record=True, file=io.StringIO())
    console.print(comparison_table(found, ["cuda:0", "cpu"]))
    for line in why_lines(found):
        console.print(line)
    text = console.export_text()
    row = next(line for line in text.splitlines() if "│ accelerate" in line)
    assert "not run" in row and "no plan" not in row
    assert "accelerate not run: strategy 'accelerate' needs the model's config" in text
    page = save_report(report_plan(), tmp_path / "plan.html", found).read_text()
    assert "not run: strategy" in page and "no plan: strategy" not in page


def test_the_parts_grid_draws_each_layers_parts_where_they_compute_and_are_stored():
    from dataclasses import replace

    import matplotlib

    matplotlib.use("Agg")
    from placement_opt.cli.pictures import parts_grid, placement_strip, report_figure
    from placement_opt.errors import PlacementError
    from placement_opt.plan import UnitPlacement

    plan = report_plan(n_layers=3)
    with pytest.raises(PlacementError, match="no parts of layers"):
        parts_grid(plan)  # whole units: the strip alone
    # attention resident on the GPU; the MLP computed on the CPU in layers 0-1, streamed from the CPU in layer 2
    parts = [UnitPlacement(unit="embed", storage="cuda:0", execution="cuda:0", mode="resident")]
    for i in range(3):
        parts += [UnitPlacement(unit=f"layers.{i}.self_attn", storage="cuda:0", execution="cuda:0",
                                mode="resident", copy_group=f"layers.{i}"),
                  UnitPlacement(unit=f"layers.{i}.mlp", storage="cpu", execution="cpu" if i < 2 else "cuda:0",
                                mode="resident" if i < 2 else "stream", copy_group=f"layers.{i}")]
    parts.append(UnitPlacement(unit="head", storage="cuda:0", execution="cuda:0", mode="resident"))
    split = replace(plan, placements=tuple(parts), cost=replace(plan.cost, units=()))
    ax = parts_grid(split)
    colors = device_colors(split.machine.names)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["self_attn", "mlp"]
    cells = {(round(b.get_x()), round(b.get_y(), 2)): b for b in ax.patches}  # (layer, row bottom)

    def rgb(name):
        return matplotlib.colors.to_rgba(colors[name])

    for layer in range(3):  # the first part on top: self_attn's row starts at 1, mlp's at 0
        assert cells[(layer, 1.0)].get_facecolor() == rgb("cuda:0")   # attention computes on the GPU ...
        assert cells[(layer, 1.75)].get_facecolor() == rgb("cuda:0")  # ... where it is stored
        assert cells[(layer, 0.75)].get_facecolor() == rgb("cpu")     # the MLP is stored on the CPU
    assert cells[(0, 0.0)].get_facecolor() == rgb("cpu") and not cells[(0, 0.0)].get_hatch()
    assert cells[(2, 0.0)].get_facecolor() == rgb("cuda:0") and cells[(2, 0.0)].get_hatch()  # streamed
    figure = report_figure(split)
    assert len(figure.axes) == 3  # strip, parts, memory
    assert len(report_figure(plan).axes) == 2  # whole units: no grid
    matplotlib.pyplot.close("all")
    placement_strip(split)  # the strip still draws every unit
    matplotlib.pyplot.close("all")
