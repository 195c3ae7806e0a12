"""Pictures of a plan: where the units sit, what fills each device, and how strategies compare.

Three charts, each drawn on a matplotlib ``Axes`` you may pass in (or a new figure):

- :func:`placement_strip`: units in execution order, top row coloured by storage device,
  bottom row by execution device; streamed units are hatched.
- :func:`parts_grid` (plans of sublayer units): one column per decoder layer, one row per part
  (attention, norms, MLP, router, experts or expert groups), so that "attention on the GPU, experts on
  the CPU" reads at a glance where the strip draws an 80 MiB attention as a sliver beside 2.6 GiB of experts.
- :func:`memory_bars`: memory per device as stacked bars (weights / KV cache / workspace /
  stream buffer / other / free), in percent of capacity with the absolute sizes written on.
- :func:`comparison_chart`: estimated time per strategy, OOM strategies marked in red.

:func:`save_report` writes all of them to a ``.png``/``.svg`` (one figure) or to a
self-contained ``.html`` report (inline SVG plus the plan's tables from
:mod:`placement_opt.report`, rendered by its jinja2 template; no external assets).

matplotlib is imported lazily with the non-interactive Agg backend, so importing this module is
cheap and works on a headless machine. Install it with ``pip install placement-opt[plot]``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._files import PICTURE_MARK, foreign_picture, refusal, replacing, write_text_atomic
from ..errors import PlacementError
from ..units import format_bytes, format_seconds

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ..compare import StrategyOutcome
    from ..plan import Plan, UnitPlacement

__all__ = [
    "placement_strip",
    "parts_grid",
    "memory_bars",
    "comparison_chart",
    "report_figure",
    "save_report",
    "device_colors",
]

#: Segment order and colours of :func:`memory_bars`.
_MEMORY_PARTS = (
    ("weights_bytes", "weights", "#4c72b0"),
    ("kv_cache_bytes", "KV cache", "#dd8452"),
    ("workspace_bytes", "workspace", "#55a868"),
    ("stream_buffer_bytes", "stream buffer", "#8172b3"),
    ("other_bytes", "other", "#937860"),
)
_GPU_COLORS = ("#2a9d8f", "#264653", "#8ab17d", "#457b9d", "#1d3557", "#6a994e", "#3a86ff", "#00b4d8")
_HOST_COLORS = {"cpu": "#e9c46a", "disk": "#9e9e9e"}
_OOM_COLOR = "#d62828"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def device_colors(names: Sequence[str]) -> dict[str, str]:
    """A stable colour per device name: GPUs cycle through cool colours, cpu yellow, disk grey."""
    colors = {}
    for name in names:
        if name.startswith("cuda:"):
            colors[name] = _GPU_COLORS[int(name.split(":")[1]) % len(_GPU_COLORS)]
        else:
            colors[name] = _HOST_COLORS.get(name, "#cccccc")
    return colors


def _axes(ax: Axes | None, size: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    fig = _pyplot().figure(figsize=size)
    return fig.add_subplot(1, 1, 1)


def placement_strip(plan: Plan, ax: Axes | None = None) -> Axes:
    """Draw the units of ``plan`` in execution order: storage row on top, execution row below.

    Each unit is as wide as its weights (equal widths when the plan has no per-unit costs), so the picture
    shows how much lives where: an expert block of 2.6 GiB is not drawn like its 8 KiB norm. A unit whose
    weights are streamed (stored away from where it computes) is hatched in both rows; a phased unit's
    execution cell is split: the prefill's device in its upper half, the decode's below; the legend names
    every device.

    Example::

        ax = placement_strip(plan)
        ax.figure.savefig("strip.png")
    """
    from matplotlib.patches import Patch

    ax = _axes(ax, (12, 2.2))
    colors = device_colors(plan.machine.names)
    widths, scale, unit = _unit_widths(plan)
    left = 0.0
    for p, width in zip(plan.placements, widths, strict=True):
        hatch = _hatch(p)
        cell = {"width": width, "align": "edge", "edgecolor": "white", "linewidth": 0.3}
        ax.bar(left, 1, bottom=1.1, color=colors.get(p.storage, "#cccccc"), hatch=hatch, **cell)
        if p.prefill_execution:  # upper half: the prefill's device (streamed), lower half: the decode's
            ax.bar(left, 0.5, bottom=0.5, color=colors.get(p.prefill_execution, "#cccccc"), hatch=hatch, **cell)
            ax.bar(left, 0.5, bottom=0.0, color=colors.get(p.execution, "#cccccc"), **cell)
        else:
            ax.bar(left, 1, bottom=0.0, color=colors.get(p.execution, "#cccccc"), hatch=hatch, **cell)
        left += width
    n = len(plan.placements)
    ax.set_xlim(0, max(left, 1e-9))
    ax.set_ylim(0, 2.1)
    ax.set_yticks([0.5, 1.6])
    ax.set_yticklabels(["executes on\n(phased: prefill / decode)" if any(p.prefill_execution for p in plan.placements)
                        else "executes on", "stored on"])
    span = f"{plan.placements[0].unit} ... {plan.placements[-1].unit}" if n else ""
    ax.set_xlabel(f"{n} units in execution order ({span}), each as wide as its weights ({unit})" if scale
                  else f"{n} units in execution order ({span})" if n else "no units")
    ax.spines[["top", "right", "left"]].set_visible(False)
    used = [d for d in plan.machine.names
            if any(d in (p.storage, p.execution) for p in plan.placements)]
    handles = [Patch(color=colors[d], label=d) for d in used]
    if plan.streams_weights:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="streamed"))
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0),
              ncol=max(1, len(handles)), frameon=False, fontsize=8)
    ax.set_title(f"{plan.model_name}: placement ({plan.strategy}, {plan.objective})", fontsize=10,
                 loc="left")
    return ax


#: The strip's axis unit, the largest whose total is at least 1 (a tiny model's 400 KiB read as 0.0004 GiB).
_WIDTH_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _unit_widths(plan: Plan) -> tuple[list[float], bool, str]:
    """Each placement's width in the strip: its weights in the axis unit, or 1 each when the plan's cost has no
    per-unit weights; whether the widths are weights; and the unit."""
    stored = {u.name: u.stored_bytes for u in plan.cost.units}
    sizes = [stored.get(p.unit, 0) for p in plan.placements]
    if sum(sizes) <= 0:
        return [1.0] * len(plan.placements), False, ""
    name, size = next((n, b) for n, b in _WIDTH_UNITS if sum(sizes) >= b)
    return [s / size for s in sizes], True, name


def memory_bars(plan: Plan, ax: Axes | None = None) -> Axes:
    """Draw memory per device as horizontal stacked bars in percent of the device's capacity.

    Each bar is split into weights, KV cache, workspace, stream buffer and other, then free
    space; a device over capacity is outlined in red and labelled with the shortfall. The axis
    ends where the data ends: at 100 %, or at the longest bar when a device is over capacity.
    """
    ax = _axes(ax, (8, 0.6 + 0.55 * len(plan.cost.memory)))
    memory = list(plan.cost.memory)
    widest = max([100.0] + [100.0 * m.used_bytes / max(m.capacity_bytes, 1) for m in memory])
    labels = []
    for row, m in enumerate(memory):
        cap = max(m.capacity_bytes, 1)
        left = 0.0
        for attr, label, color in _MEMORY_PARTS:
            share = 100.0 * getattr(m, attr) / cap
            if share > 0:
                ax.barh(row, share, left=left, color=color, label=label, height=0.6)
                left += share
        free = max(0.0, 100.0 - left)
        if free > 0:
            ax.barh(row, free, left=left, color="#eeeeee", height=0.6, label="free")
        over = m.free_bytes < 0
        text = f"{format_bytes(m.used_bytes)} / {format_bytes(m.capacity_bytes)}"
        if over:
            ax.barh(row, left, color="none", edgecolor=_OOM_COLOR, linewidth=2, height=0.6, clip_on=False)
            text += f"  OOM: {format_bytes(-m.free_bytes)} short"
        # inside the axis, at its right end: the sizes never need room past the data
        ax.text(widest - 0.01 * widest, row, text, va="center", ha="right", fontsize=8,
                color=_OOM_COLOR if over else "black",
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1.0})
        labels.append(m.device)
    ax.set_yticks(range(len(memory)))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlim(0, widest)
    ax.axvline(100.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("% of usable capacity (dashed line: capacity)")
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title("memory per device", fontsize=10)
    return ax


def comparison_chart(outcomes: Sequence[StrategyOutcome], ax: Axes | None = None) -> Axes:
    """Draw the estimated total time (prefill + decode) of each strategy; OOM bars in red.

    A strategy without a plan (infeasible) gets an empty slot labelled with why. The bar of
    ``cpsat`` is outlined, and every other bar is labelled with its ratio to it.
    """
    ax = _axes(ax, (8, 0.8 + 0.5 * len(outcomes)))
    reference = next((o.total_s for o in outcomes if o.strategy == "cpsat" and o.fits), None)
    times = [o.total_s or 0.0 for o in outcomes]
    longest = max(times, default=1.0) or 1.0
    for row, o in enumerate(outcomes):
        if o.plan is None:
            ax.text(0.02 * longest, row, f"{'no plan' if o.ran else 'not run'}: {o.error[:90]}", va="center",
                    fontsize=8, color=_OOM_COLOR if o.ran else "#7a7a7a")
            continue
        dark, light = ("#1f7a6f", "#7cc7bd") if o.fits else (_OOM_COLOR, "#f08080")
        cost = o.plan.cost
        ax.barh(row, cost.prefill_s, color=dark, height=0.6, label="prefill" if o.fits else None)
        ax.barh(row, cost.decode_s, left=cost.prefill_s, color=light, height=0.6,
                label="decode" if o.fits else None, hatch=None if o.fits else "xx")
        if o.strategy == "cpsat":
            ax.barh(row, cost.total_s, color="none", edgecolor="black", linewidth=1.5, height=0.6)
        label = format_seconds(o.total_s or 0.0)
        if not o.fits:
            label += "  OOM: would need more memory than the device has"
        elif reference and o.strategy != "cpsat":
            # the bars' measure, named: compare's table ranks by the objective (the slowest stage, GPU bytes)
            label += f"  ({(o.total_s or 0.0) / reference:.2f}x cpsat's total time)"
        ax.text((o.total_s or 0.0) + 0.01 * longest, row, label, va="center", fontsize=8,
                color="black" if o.fits else _OOM_COLOR)
    ax.set_yticks(range(len(outcomes)))
    ax.set_yticklabels([o.strategy for o in outcomes])
    ax.set_ylim(len(outcomes) - 0.5, -0.5)
    ax.set_xlim(0, longest * 1.6)
    ax.set_xlabel("estimated time of the workload, seconds (dark: prefill, light: all decode steps)")
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    if unique:
        ax.legend(unique.values(), unique.keys(), loc="lower right", fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_title("strategies compared (red hatched: runs out of memory)", fontsize=10)
    return ax


def report_figure(plan: Plan, outcomes: Sequence[StrategyOutcome] = ()) -> Figure:
    """One figure with the placement strip, the parts grid (plans of sublayer units), the memory bars and (if
    given) the comparison."""
    plt = _pyplot()
    parts = _layer_parts(plan)[1]
    charts: list[tuple[float, Any]] = [(1.3, lambda ax: placement_strip(plan, ax))]
    if parts:
        charts.append((0.3 * len(parts) + 0.4, lambda ax: parts_grid(plan, ax)))
    charts.append((0.8 + 0.45 * len(plan.cost.memory), lambda ax: memory_bars(plan, ax)))
    if outcomes:
        charts.append((0.8 + 0.45 * len(outcomes), lambda ax: comparison_chart(outcomes, ax)))
    heights = [height for height, _ in charts]
    fig = plt.figure(figsize=(12, sum(heights) + 1.6 * len(charts)), layout="constrained")
    axes = fig.subplots(len(charts), 1, gridspec_kw={"height_ratios": heights})
    for ax, (_, draw) in zip(axes, charts, strict=True):
        draw(ax)
    return fig


def parts_grid(plan: Plan, ax: Axes | None = None) -> Axes:
    """Draw a plan's sublayer units as a grid: a column per decoder layer, a row per part.

    A cell is coloured by where the part computes in the decode, with a band along its top in the colour of
    where it is stored; a streamed part is hatched (a phased one too: streamed to its prefill device for the
    prompt). Units that are not parts of a layer (embeddings, the final norm, lm_head) are the strip's alone.

    Example::

        ax = parts_grid(plan)       # plan = solve(model, devices, granularity="sublayer")
        ax.figure.savefig("parts.png")

    Raises:
        PlacementError: the plan has no sublayer units (a ValueError): draw :func:`placement_strip` instead.
    """
    layers, parts = _layer_parts(plan)
    if not parts:
        raise PlacementError(f"the plan for {plan.model_name!r} places whole units, no parts of layers: "
                             f"draw placement_strip(plan), or solve with granularity='sublayer'")
    ax = _axes(ax, (12, 0.3 * len(parts) + 1.2))
    colors = device_colors(plan.machine.names)
    column = {layer: k for k, layer in enumerate(layers)}
    row = {part: len(parts) - 1 - k for k, part in enumerate(parts)}  # the first part on top
    for p in plan.placements:
        part = _part(p)
        if part is None:
            continue
        x, y = column[p.copy_group], row[part]
        hatch = _hatch(p)
        cell = {"width": 1.0, "align": "edge", "edgecolor": "white", "linewidth": 0.5}
        ax.bar(x, 0.75, bottom=y, color=colors.get(p.execution, "#cccccc"), hatch=hatch, **cell)
        ax.bar(x, 0.25, bottom=y + 0.75, color=colors.get(p.storage, "#cccccc"), **cell)
    ax.set_xlim(0, len(layers))
    ax.set_ylim(0, len(parts))
    ax.set_yticks([row[part] + 0.5 for part in parts])
    ax.set_yticklabels(parts, fontsize=8)
    step = max(1, len(layers) // 16)
    ax.set_xticks([k + 0.5 for k in range(0, len(layers), step)])
    ax.set_xticklabels([str(k) for k in range(0, len(layers), step)], fontsize=8)
    ax.set_xlabel(f"decoder layers ({layers[0]} ... {layers[-1]}); cell: computes on (decode), top band: stored on, "
                  f"hatched: streamed (phased: for the prompt)")
    ax.spines[["top", "right", "left"]].set_visible(False)
    ax.set_title("parts of each layer", fontsize=10, loc="left")
    return ax


def _layer_parts(plan: Plan) -> tuple[list[str], list[str]]:
    """The layers whose parts a plan places (``copy_group``, in execution order) and the parts' names under a
    layer, in the order they first run (``self_attn``, ``mlp.experts.groups.0``, ...); both empty for a plan of
    whole units."""
    layers: dict[str, None] = {}
    parts: dict[str, None] = {}
    for p in plan.placements:
        if (part := _part(p)) is not None:
            layers[p.copy_group] = None
            parts[part] = None
    return list(layers), list(parts)


def _part(p: UnitPlacement) -> str | None:
    """A placement's name under the layer it is part of (``self_attn``), None for a unit that is no part."""
    group = p.copy_group
    return p.unit[len(group) + 1:] if group is not None and p.unit.startswith(f"{group}.") else None


def _hatch(p: UnitPlacement) -> str | None:
    """Streamed units (and phased ones, streamed for the prompt) are hatched."""
    return "///" if p.storage != p.execution or p.prefill_execution else None


def _svg(fig: Figure) -> str:
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Creator": PICTURE_MARK})
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def save_report(plan: Plan, path: str | Path, outcomes: Sequence[StrategyOutcome] = ()) -> Path:
    """Write the pictures of ``plan`` (and of a strategy comparison) to ``path``.

    The suffix picks the format: ``.png`` and ``.svg`` get one figure with every chart;
    ``.html`` gets a self-contained page (inline SVG, the summary and memory tables, the
    comparison table) that opens anywhere without network access.

    Example::

        save_report(plan, "plan.html")

    Returns:
        The path written.

    Raises:
        PlacementError: the suffix is not ``.png``, ``.svg`` or ``.html`` (a ValueError), or a file that
            placement_opt did not draw is at ``path`` (it is never written over).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".png", ".svg", ".html", ".htm"):
        raise PlacementError(f"cannot write a picture to {str(path)!r}: use a .png, .svg or .html file name")
    if (why := foreign_picture(path)) is not None:
        raise PlacementError(refusal(path, "picture", why))
    plt = _pyplot()
    fig = report_figure(plan, outcomes)
    try:
        if suffix in (".png", ".svg"):
            with replacing(path) as tmp:
                fig.savefig(tmp, dpi=110, metadata={"Software" if suffix == ".png" else "Creator": PICTURE_MARK})
            return path
        from ..report import plan_report, report_html, strategies_table

        page = report_html(plan_report(plan), title=f"placement_opt: {plan.model_name}", svg=_svg(fig),
                           extra_tables=[strategies_table(outcomes)] if outcomes else [])
        write_text_atomic(path, page)
        return path
    finally:
        plt.close(fig)
