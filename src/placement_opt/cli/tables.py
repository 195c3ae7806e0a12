"""Rich tables for the ``placement-opt`` command: a plan, its memory per device, strategies side by side.

Pure rendering: every figure comes from a :class:`~placement_opt.plan.Plan` and its ``Cost``.
``rich`` is imported inside the functions, like everything heavy the CLI uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..compare import objective_value
from ..units import format_bytes, format_seconds

if TYPE_CHECKING:  # pragma: no cover
    from ..compare import StrategyOutcome
    from ..plan import Plan

__all__ = ["plan_renderables", "memory_table", "comparison_table",
           "where_computed", "why_lines", "presets_tables"]


def _device_style(name: str) -> str:
    return "green" if name.startswith("cuda:") else {"cpu": "yellow", "disk": "magenta"}.get(name, "")


def plan_renderables(plan: Plan, *, notes: bool = True) -> list[Any]:
    from rich.table import Table

    cost, w = plan.cost, plan.workload
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("model", f"{plan.model_name} ({plan.dtype}, {len(plan.placements)} units)")
    head.add_row("machine", ", ".join(f"{d.name} {format_bytes(d.memory_bytes)}" for d in plan.machine.devices))
    head.add_row("workload", f"batch {w.batch_size} x prompt {w.prompt_len} + {w.new_tokens} new tokens")
    head.add_row("objective", f"{plan.objective}, strategy {plan.strategy}")
    if plan.status == "GREEDY":
        head.add_row("solver", f"GREEDY (a baseline strategy: no optimality bound), {plan.solve_time_s:.2f} s")
    else:
        head.add_row("solver", f"{plan.status}, gap {plan.gap:.2%}, solved in {plan.solve_time_s:.2f} s")
    head.add_row("time", f"prefill {format_seconds(cost.prefill_s)}, decode {format_seconds(cost.decode_s)}, "
                         f"total {format_seconds(cost.total_s)}, {cost.tokens_per_s:.2f} tokens/s")
    fits = "[green]yes[/]" if cost.fits else "[bold red]NO, runs out of memory[/]"
    head.add_row("fits", fits)

    by_unit = {u.name: u for u in cost.units}
    units = Table(title="Where each run of units lives and computes", title_justify="left")
    for col in ("units", "n", "stored on", "executes on", "mode", "weights", "prefill", "decode"):
        units.add_column(col, justify="right" if col in ("n", "weights", "prefill", "decode") else "left")
    for names, storage, execution, mode in plan.runs():
        costs = [by_unit[n] for n in names if n in by_unit]
        label = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        units.add_row(label, str(len(names)), f"[{_device_style(storage)}]{storage}[/]",
                      f"[{_device_style(execution)}]{execution}[/]", mode,
                      format_bytes(sum(c.stored_bytes for c in costs)),
                      format_seconds(sum(c.prefill_s for c in costs)),
                      format_seconds(sum(c.decode_s for c in costs)))
    return [head, units, memory_table(plan), *violation_lines(plan), *(plan_notes(plan) if notes else [])]


def memory_table(plan: Plan) -> Any:
    from rich.table import Table

    table = Table(title="Memory per device", title_justify="left")
    for col in ("device", "weights", "KV cache", "workspace", "stream buf", "used", "capacity", "free"):
        table.add_column(col, justify="left" if col == "device" else "right")
    for m in plan.cost.memory:
        free = format_bytes(m.free_bytes)
        table.add_row(m.device, format_bytes(m.weights_bytes), format_bytes(m.kv_cache_bytes),
                      format_bytes(m.workspace_bytes), format_bytes(m.stream_buffer_bytes),
                      format_bytes(m.used_bytes), format_bytes(m.capacity_bytes),
                      f"[bold red]{free}[/]" if m.free_bytes < 0 else free)
    return table


def violation_lines(plan: Plan) -> list[str]:
    return [f"[bold red]OOM[/] {v.message}" for v in plan.cost.violations]


def plan_notes(plan: Plan) -> list[str]:
    lines = [f"[dim]note:[/] {n}" for n in plan.notes]
    if plan.streams_weights:
        lines.append("[dim]note:[/] some units compute away from their storage: run the plan with "
                     "placement_opt.dispatch (plan.device_map alone gives accelerate's synchronous hooks)")
    return lines


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
                        f"to a GPU", title_justify="left")
    for col in ("strategy", "fits", "prefill", "decode", "total", "vs cpsat", "tokens/s"):
        table.add_column(col, justify="left" if col in ("strategy", "fits") else "right")
    for d in devices:
        table.add_column(d, justify="right")
    table.add_column("GPU/CPU/strm", justify="right")
    table.add_column("solve", justify="right")
    table.add_column("gap", justify="right")
    for o in outcomes:
        if o.plan is None:
            table.add_row(o.strategy, "[bold red]no plan[/]", *["-"] * (5 + len(devices) + 3))
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
    """``"40/44/0"``: units resident on a GPU, computed by the CPU, streamed to a GPU."""
    gpu = sum(1 for p in plan.placements if p.execution.startswith("cuda:") and p.storage == p.execution)
    cpu = sum(1 for p in plan.placements if p.execution == "cpu")
    streamed = sum(1 for p in plan.placements if p.execution.startswith("cuda:") and p.storage != p.execution)
    return f"{gpu}/{cpu}/{streamed}"


def why_lines(outcomes: Sequence[StrategyOutcome]) -> list[str]:
    lines = []
    for o in outcomes:
        if o.plan is None:
            error = o.error.removeprefix(f"{o.strategy}: ")
            lines.append(f"[bold red]{o.strategy}[/]: {error}")
        else:
            lines += [f"[bold red]{o.strategy} OOM[/]: {v.message}" for v in o.plan.cost.violations]
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
