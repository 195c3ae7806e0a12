"""Rich tables for the ``placement-opt`` command: a plan, strategies side by side, the presets.

Pure rendering: every figure comes from a :class:`~placement_opt.plan.Plan` and its ``Cost``; a
plan's own tables are built once by :mod:`placement_opt.report` (shared with ``Plan.summary()``).
``rich`` is imported inside the functions, like everything heavy the CLI uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..compare import objective_value
from ..report import gap_advice
from ..units import format_bytes, format_seconds

if TYPE_CHECKING:  # pragma: no cover
    from ..compare import StrategyOutcome
    from ..plan import Plan

__all__ = ["plan_renderables", "comparison_table", "where_computed", "why_lines", "presets_tables"]


def plan_renderables(plan: Plan, *, notes: bool = True, solver_notes: bool = True) -> list[Any]:
    """The plan's facts, unit runs, memory, baselines, warnings and notes as rich renderables.

    The rows come from :func:`placement_opt.report.plan_report`, the builder ``Plan.summary()``
    and the HTML report use too: the same figures under the same labels everywhere.
    ``solver_notes=False`` leaves out the notes about the search itself
    (:data:`placement_opt.planner.SOLVER_NOTES`); ``Plan.notes``, ``--json`` and ``explain`` keep them.
    """
    import dataclasses

    from ..planner import SOLVER_NOTES
    from ..report import plan_report, rich_renderables

    if not solver_notes:
        plan = dataclasses.replace(plan, notes=tuple(n for n in plan.notes if not n.startswith(SOLVER_NOTES)))
    return rich_renderables(plan_report(plan, notes=notes))


def comparison_table(outcomes: Sequence[StrategyOutcome], devices: Sequence[str],
                     objective: str = "latency") -> Any:
    """The ``compare`` command's table: one row per strategy, priced by one cost model."""
    from rich.table import Table

    reference = next((objective_value(o.plan, objective) for o in outcomes
                      if o.strategy == "cpsat" and o.fits and o.plan), None)
    measure = {"latency": "total time", "throughput": "slowest stage", "memory": "GPU memory"}[objective]
    table = Table(title=f"Strategies side by side, one cost model. total = prefill + every decode step; "
                        f"'vs cpsat' compares the {objective} objective ({measure}); device columns: memory "
                        f"used; GPU/CPU/strm: units resident on a GPU / computed by the CPU / streamed "
                        f"to a GPU (+N: N more phased, prompt on a GPU, decode on the CPU)", title_justify="left")
    for col in ("strategy", "fits", "prefill", "decode", "total", "vs cpsat", "tokens/s"):
        table.add_column(col, justify="left" if col in ("strategy", "fits") else "right")
    for d in devices:
        table.add_column(d, justify="right")
    table.add_column("GPU/CPU/strm", justify="right")
    table.add_column("solve", justify="right")
    table.add_column("gap", justify="right")
    for o in outcomes:
        if o.plan is None:  # "no plan": it ran and nothing fits; "not run": it could not run (why_lines says why)
            table.add_row(o.strategy, "[bold red]no plan[/]" if o.ran else "[yellow]not run[/]",
                          *["-"] * (5 + len(devices) + 3))
            continue
        cost = o.plan.cost
        table.add_row(o.strategy, "[green]fits[/]" if cost.fits else "[bold red]OOM[/]",
                      format_seconds(cost.prefill_s), format_seconds(cost.decode_s),
                      format_seconds(cost.total_s), _ratio(o, objective, reference), f"{cost.tokens_per_s:.2f}",
                      *_memory_cells(o.plan, devices), where_computed(o.plan), f"{o.plan.solve_time_s:.2f} s",
                      f"{o.plan.gap:.1%}" if o.strategy == "cpsat" else "-",
                      style=None if cost.fits else "red")
    return table


def _ratio(outcome: StrategyOutcome, objective: str, reference: float | None) -> str:
    """The 'vs cpsat' cell: the objective over cpsat's, bold when 5 % or more worse."""
    value = objective_value(outcome.plan, objective)
    ratio = "-" if not reference else f"{value / reference:.2f}x"
    if not outcome.plan.cost.fits:
        return "OOM"  # a time that needs memory the device lacks compares with nothing
    if reference and outcome.strategy != "cpsat" and value / reference >= 1.05:
        return f"[bold]{ratio}[/]"
    return ratio


def _memory_cells(plan: Plan, devices: Sequence[str]) -> list[str]:
    """Memory used per device column; red with the capacity where it does not fit."""
    cells = []
    for d in devices:
        m = next((x for x in plan.cost.memory if x.device == d), None)
        if m is None:
            cells.append("-")
            continue
        text = f"{format_bytes(m.used_bytes)}"
        cells.append(f"[bold red]{text} (>{format_bytes(m.capacity_bytes)})[/]" if m.free_bytes < 0 else text)
    return cells


def where_computed(plan: Plan) -> str:
    """``"40/44/0"``: units resident on a GPU, computed by the CPU, streamed to a GPU; ``"40/20/0+24"``
    when 24 more are phased (prefill streamed to a GPU, decode on the CPU)."""
    gpu = sum(1 for p in plan.placements if p.execution.startswith("cuda:") and p.storage == p.execution)
    cpu = sum(1 for p in plan.placements if p.execution == "cpu" and not p.prefill_execution)
    streamed = sum(1 for p in plan.placements if p.execution.startswith("cuda:") and p.storage != p.execution)
    phased = sum(1 for p in plan.placements if p.prefill_execution)
    return f"{gpu}/{cpu}/{streamed}" + (f"+{phased}" if phased else "")


def why_lines(outcomes: Sequence[StrategyOutcome]) -> list[str]:
    """Under the ``compare`` table: why each strategy has no plan, was not run, or runs out of memory."""
    lines = []
    for o in outcomes:
        if o.plan is None:
            error = o.error.removeprefix(f"{o.strategy}: ")
            lines.append(f"[bold red]{o.strategy}[/]: {error}" if o.ran else f"[bold yellow]{o.strategy} not run[/]: {error}")
        else:
            lines += [f"[bold red]{o.strategy} OOM[/]: {v.message}" for v in o.plan.cost.violations]
            advice = gap_advice(o.plan)
            lines += [f"[bold yellow]{o.strategy} gap[/]: {advice}"] if advice else []
    return lines


def presets_tables() -> list[Any]:
    """The ``presets`` command: model presets, then GPU, CPU and disk presets with their figures.

    A figure that does not apply to a kind (a disk's FLOP/s, a CPU's host link) is ``-``.
    """
    from rich.table import Table

    from ..hardware.presets import PRESETS
    from ..model import catalog

    models = Table(title="Models (placement-opt plan NAME)", title_justify="left")
    for col in ("name", "parameters", "dtype", "description"):
        models.add_column(col, justify="right" if col == "parameters" else "left")
    for name in catalog.list_models():
        entry = catalog.preset(name)
        models.add_row(name, f"{entry.advertised_params / 1e9:.3g} B",
                       str(entry.hyperparameters.get("torch_dtype", "-")), entry.description)
    tables = [models]
    titles = {"gpu": "GPUs (--devices cuda:0=NAME)", "cpu": "CPUs (--devices cpu=NAME)",
              "disk": "Disks (--devices disk=NAME)"}
    for kind, title in titles.items():
        table = Table(title=title, title_justify="left")
        for col in ("name", "memory", "FP16/BF16 TFLOP/s", "FP32 TFLOP/s", "bandwidth", "host link",
                    "peer link", "description"):
            table.add_column(col, justify="left" if col in ("name", "description") else "right")
        for p in (p for p in PRESETS.values() if p.kind == kind):
            table.add_row(p.key, format_bytes(p.memory_bytes), _figure(p.half_flops_per_s, 1e12),
                          _figure(p.fp32_flops_per_s, 1e12), _figure(p.bandwidth_bytes_per_s, 1e9, " GB/s"),
                          _figure(p.host_link_bytes_per_s, 1e9, " GB/s"),
                          _figure(p.peer_link_bytes_per_s, 1e9, " GB/s"), p.description)
        tables.append(table)
    return tables


def _figure(value: float, scale: float, suffix: str = "") -> str:
    """``value / scale`` to 4 significant figures, or ``-`` where the figure does not apply (zero)."""
    return f"{value / scale:.4g}{suffix}" if value else "-"
