"""The one builder of a plan's tables: ``Plan.summary()``, the CLI and the HTML pages render them.

:func:`plan_report` turns a :class:`~placement_opt.plan.Plan` into plain rows of strings (facts,
unit runs, memory per device, baselines, then warnings and notes), each figure formatted once.
Three renderers show the same rows: :func:`rich_renderables` (the ``placement-opt`` command),
:func:`report_text` (``Plan.summary()``) and :func:`report_html` (``Plan._repr_html_()`` in
notebooks and the ``--plot report.html`` page, from the jinja2 template ``templates/report.html.j2``).

Example::

    report = plan_report(plan)
    print(report_text(report))          # what plan.summary() returns

Two throughputs are shown, labelled: *end to end* (generated tokens over prefill + decode time,
what a user waits for) and *decoding* (generated tokens over the decode phase only).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._files import PICTURE_MARK
from .model.expert_groups import group_counts, whole_experts
from .units import format_bytes, format_seconds, ratio_or_dash, seconds_or_dash

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan

__all__ = ["Cell", "ReportTable", "PlanReport", "plan_report", "strategies_table", "rich_renderables",
           "report_text", "report_html", "TEXT_WIDTH", "GAP_TARGET", "EXTRA_SEARCH_S", "gap_advice",
           "longer_time_limit_s"]

#: Columns of the text ``Plan.summary()`` renders (wide enough that no table row wraps).
TEXT_WIDTH = 160
#: A plan whose search stopped (status FEASIBLE) further than this from its proven bound is flagged
#: in every report, with what to do about it.
GAP_TARGET = 0.01
#: ``placement-opt plan`` without ``--time-limit`` and :func:`~placement_opt.runtime.loader.load` without
#: ``time_limit_s``: when the default search stops above :data:`GAP_TARGET`, they search again for at most
#: this long and keep the better plan (:func:`~placement_opt.planner.searched_again`).
EXTRA_SEARCH_S = 4.0


@dataclass(frozen=True)
class Cell:
    """One cell: its text and what it is (``"bad"``, ``"good"``, a device kind), for colouring."""

    text: str
    tone: str = ""


@dataclass(frozen=True)
class ReportTable:
    """A titled table of cells; ``right`` names the right-aligned (numeric) columns."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]
    right: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PlanReport:
    """Everything shown about a plan: facts (label, value), tables, then warning and note lines."""

    facts: tuple[tuple[str, Cell], ...]
    tables: tuple[ReportTable, ...]
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    cautions: tuple[str, ...] = ()
    """Lines about how far the plan may be from the best (:func:`gap_advice`)."""


def _device_tone(name: str) -> str:
    return "gpu" if name.startswith("cuda:") else name if name in ("cpu", "disk") else ""


#: What each objective's value is, on the summary's objective line (the solver line gives the value).
OBJECTIVE_MEANS = {
    "latency": "minimised: prefill + every decode step, the total below",
    "throughput": "minimised: the busiest device's work per request, what back-to-back requests wait on; "
                  "not the total below",
    "memory": "minimised: bytes on the GPUs",
}


def _objective_text(plan: Plan, value: float) -> str:
    return format_bytes(value) if plan.objective == "memory" else seconds_or_dash(value)


def longer_time_limit_s(plan: Plan) -> int:
    """The time limit to suggest for another search: about five times this one's, at least 5 s."""
    return max(5, round(5 * plan.solve_time_s))


def gap_advice(plan: Plan) -> str | None:
    """What the user should know and do when the search stopped above :data:`GAP_TARGET` (else None).

    Example::

        gap_advice(plan)  # "not proven within 1 % of the best: the best plan's latency may be up to
                          #  57.0 % lower than this one's (...); search longer: time_limit_s=5 ..."
    """
    if plan.status != "FEASIBLE" or plan.gap <= GAP_TARGET:
        return None
    longer = longer_time_limit_s(plan)
    return (f"not proven within {GAP_TARGET:.0%} of the best: the best plan's {plan.objective} may be up to "
            f"{plan.gap:.1%} lower than this one's ({_objective_text(plan, plan.objective_value)} against a proven "
            f"bound of {_objective_text(plan, plan.best_bound)}); the search stopped after {plan.solve_time_s:.1f} s, "
            f"at its time limit (or at a gap_limit above {GAP_TARGET:.0%}). Search longer for a better plan or a tighter bound: time_limit_s={longer} "
            f"in solve(), --time-limit {longer} on the command line.")


def _facts(plan: Plan) -> tuple[tuple[str, Cell], ...]:
    cost, w = plan.cost, plan.workload
    if plan.status == "GREEDY":
        solver = Cell(f"GREEDY (a baseline strategy: no optimality bound), {format_seconds(plan.solve_time_s)}")
    else:
        far = gap_advice(plan) is not None
        solver = Cell(f"{plan.status}, objective {_objective_text(plan, plan.objective_value)}, bound "
                      f"{_objective_text(plan, plan.best_bound)}, gap {plan.gap:.2%}"
                      f"{f' (above {GAP_TARGET:.0%}: see the gap line below)' if far else ''}, solved in "
                      f"{format_seconds(plan.solve_time_s)}", "bad" if far else "")
    return (
        ("model", Cell(f"{plan.model_name} ({plan.dtype}, {len(plan.placements)} units)")),
        ("machine", Cell(", ".join(f"{d.name} {format_bytes(d.memory_bytes)}" for d in plan.machine.devices))),
        *_home_fact(plan),
        ("workload", Cell((f"a training step of batch {w.batch_size} x {w.prompt_len} tokens" if w.training else
                           f"batch {w.batch_size} x prompt {w.prompt_len} + {w.new_tokens} new tokens")
                          + (", logits at every prompt position" if w.logits == "all" and w.new_tokens else "")
                          + (", logits at the last position only" if w.logits == "last" and not w.new_tokens else "")
                          + (", prompts padded under a mask" if w.padded else ""))),
        ("objective", Cell(f"{plan.objective} ({OBJECTIVE_MEANS.get(plan.objective, 'as solved')}), strategy "
                           f"{plan.strategy}")),
        ("solver", solver),
        ("time", Cell(f"prefill {format_seconds(cost.prefill_s)}, decode {format_seconds(cost.decode_s)}, "
                      f"total {format_seconds(cost.total_s)} (transfers {format_seconds(cost.transfer_s)}"
                      + (f"; weight copies {format_seconds(cost.copy_s)} beside the compute, "
                         f"{format_seconds(cost.wait_s)} of them waited for" if cost.copy_s else "") + ")")),
        # a training step generates nothing: its rate is of the tokens it takes in (batch x prompt a step)
        ("tokens/s", Cell(f"{cost.tokens_per_s:.2f} trained on (batch x tokens a step)"
                          if w.training and cost.total_s > 0 else
                          f"{cost.tokens_per_s:.2f} end to end (prefill included), "
                          f"{cost.decode_tokens_per_s:.2f} while decoding")),
        ("fits", Cell("yes", "good") if cost.fits else Cell("NO, runs out of memory", "bad")),
    )


def _home_fact(plan: Plan) -> tuple[tuple[str, Cell], ...]:
    """A sublayer plan's home line (none for other plans): where its residual stream stays, which every unit placed
    elsewhere pays a round trip to at each forward."""
    if plan.home is None:
        return ()
    # one line of the summary's 160 columns: a unit computed elsewhere takes its inputs from it, returns its outputs
    return (("home", Cell(f"{plan.home}: the residual stream and the glue between units stay here, a round trip away "
                          f"from each unit computed elsewhere")),)


def _runs_table(plan: Plan) -> ReportTable:
    by_unit = {u.name: u for u in plan.cost.units}
    rows = []
    for names, storage, execution, mode in plan.runs():
        rows.append((_span(names), Cell(str(len(names))), Cell(storage, _device_tone(storage)),
                     Cell(execution, _device_tone(execution)), Cell(mode), *_cost_cells(by_unit, names)))
    return ReportTable("Where each run of units lives and computes",
                       ("units", "n", "stored on", "executes on", "mode", "weights", "prefill", "decode"),
                       tuple(rows), frozenset({"n", "weights", "prefill", "decode"}))


def _layers_table(plan: Plan) -> ReportTable:
    """A sublayer plan by decoder layer: consecutive layers whose parts are placed alike in one row, the
    parts named by where they differ from the layer's most common placement (units outside every layer:
    rows of their own)."""
    by_unit = {u.name: u for u in plan.cost.units}
    rows: list[tuple[list[str], str, list[str]]] = []  # (layers or units, what their parts do, unit names)
    kinds: list[bool] = []  # whether each row is of layers
    for group, parts in _by_layer(plan):
        text = _parts_text(group, parts) if group else _placement_text(parts[0])
        if rows and kinds[-1] == (group is not None) and rows[-1][1] == text:
            rows[-1][0].append(group or parts[0].unit)
            rows[-1][2].extend(p.unit for p in parts)
        else:
            rows.append(([group or parts[0].unit], text, [p.unit for p in parts]))
            kinds.append(group is not None)
    cells = [(_span(labels), Cell(str(len(labels))), Cell(text), *_cost_cells(by_unit, units))
             for labels, text, units in rows]
    return ReportTable("Where each layer's parts live and compute (consecutive layers placed alike in one row)",
                       ("layers", "n", "parts", "weights", "prefill", "decode"), tuple(cells),
                       frozenset({"n", "weights", "prefill", "decode"}))


def _span(names: Sequence[str]) -> Cell:
    """``first .. last`` of a run of names (the one name of a run of one)."""
    return Cell(names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}")


def _cost_cells(by_unit: dict[str, Any], names: Sequence[str]) -> tuple[Cell, Cell, Cell]:
    """The weights, prefill and decode time of the named units, summed (units without a cost count 0)."""
    costs = [by_unit[n] for n in names if n in by_unit]
    return (Cell(format_bytes(sum(c.stored_bytes for c in costs))), Cell(format_seconds(sum(c.prefill_s for c in costs))),
            Cell(format_seconds(sum(c.decode_s for c in costs))))


def _by_layer(plan: Plan) -> list[tuple[str | None, list[Any]]]:
    """(copy group, its placements) in plan order; a unit of no group is a group of its own, named None."""
    out: list[tuple[str | None, list[Any]]] = []
    for p in plan.placements:
        if p.copy_group is not None and out and out[-1][0] == p.copy_group:
            out[-1][1].append(p)
        else:
            out.append((p.copy_group, [p]))
    return out


def _placement_text(p: Any) -> str:
    """``resident cuda:0``, ``stream cpu -> cuda:0``, ``phased disk -> cpu (prefill cuda:0)``: the mode, the
    storage, the device it computes on (the decode's, for a phased unit) where that differs."""
    where = p.execution if p.storage == p.execution else f"{p.storage} -> {p.execution}"
    return f"phased {where} (prefill {p.prefill_execution})" if p.prefill_execution else f"{p.mode} {where}"


def _parts_text(group: str, parts: list[Any]) -> str:
    """The layer's parts by placement: the most common placement as "the rest", the others by part name; a layer's
    expert groups placed alike in one entry (``mlp.experts groups 0, 1, 3 of 4 phased cpu (prefill cuda:0)``)."""
    texts = [_placement_text(p) for p in parts]
    common = max(dict.fromkeys(texts), key=texts.count)
    counts = group_counts(p.unit for p in parts)
    named: dict[tuple[str, str], list[int]] = {}  # (part or experts module, placement) -> group indices
    for p, text in zip(parts, texts, strict=True):
        if text == common:
            continue
        parsed = whole_experts(p.unit)
        name = (parsed[0] if parsed else p.unit).removeprefix(group + ".")
        named.setdefault((name, text), []).extend([parsed[1]] if parsed else [])
    shown = [f"{name} {text}" if not groups or len(groups) == counts[group + "." + name] else
             f"{name} group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups))} of "
             f"{counts[group + '.' + name]} {text}" for (name, text), groups in named.items()]
    return "; ".join([*shown, f"{'the rest' if shown else 'all'} {common}"])


def _memory_table(plan: Plan) -> ReportTable:
    # a training step's gradients and optimizer states are in `used`: a column of their own, so that the row adds up
    training = any(m.other_bytes for m in plan.cost.memory)
    rows = []
    for m in plan.cost.memory:
        free = Cell(format_bytes(m.free_bytes), "bad" if m.free_bytes < 0 else "")
        parts = (m.weights_bytes, m.kv_cache_bytes, m.workspace_bytes, m.stream_buffer_bytes,
                 *((m.other_bytes,) if training else ()), m.used_bytes, m.capacity_bytes)
        rows.append((Cell(m.device, _device_tone(m.device)), *(Cell(format_bytes(v)) for v in parts), free))
    columns = ("device", "weights", "KV cache", "workspace", "stream buf",
               *(("grads + optimizer",) if training else ()), "used", "capacity", "free")
    return ReportTable("Memory per device", columns, tuple(rows), frozenset(columns[1:]))


def _baselines_table(plan: Plan) -> ReportTable:
    """One row per baseline; one that could not be run reads ``not run`` (why: :func:`_not_run_lines`)."""
    rows = tuple((Cell(b.strategy), Cell("-"), Cell("not run"), Cell("-")) if not b.ran else
                 (Cell(b.strategy), Cell(seconds_or_dash(b.total_s)),
                  Cell("yes", "good") if b.fits else Cell("NO", "bad"),
                  # a time of a placement that does not fit is no speed to compare: it would run out of memory
                  Cell(ratio_or_dash(b.total_s, plan.cost.total_s)) if b.fits else Cell("OOM", "bad"))
                 for b in plan.baselines)
    # a plan solved from a graph alone (the CLI's cached one) has no map of the installed accelerate: say where it is
    title = "Baselines on the same cost model (total time)" if any(b.strategy == "accelerate" for b in plan.baselines) \
        else "Baselines on the same cost model (total time; the installed accelerate's own map: placement-opt compare)"
    return ReportTable(title, ("baseline", "total", "fits", "vs this plan"), rows, frozenset({"total", "vs this plan"}))


def _not_run_lines(plan: Plan) -> list[str]:
    """The baselines table's footnotes: why each baseline marked ``not run`` was not."""
    return [f"baseline {b.strategy} not run: {b.why_not_run}" for b in plan.baselines if not b.ran]


def plan_report(plan: Plan, *, notes: bool = True) -> PlanReport:
    """The facts, tables, warnings and notes shown about ``plan`` (``notes=False``: without the notes)."""
    sublayer = any(p.copy_group is not None for p in plan.placements)
    tables = [_layers_table(plan) if sublayer else _runs_table(plan), _memory_table(plan)]
    if plan.baselines:
        tables.append(_baselines_table(plan))
    lines = [*_not_run_lines(plan), *plan.notes]
    if plan.streams_weights:
        lines.append("some units compute away from their storage: run the plan with placement_opt.dispatch "
                     "(plan.device_map alone gives accelerate's synchronous hooks)")
    advice = gap_advice(plan)
    return PlanReport(facts=_facts(plan), tables=tuple(tables),
                      warnings=tuple(v.message for v in plan.cost.violations), notes=tuple(lines) if notes else (),
                      cautions=(advice,) if advice else ())


def strategies_table(outcomes: Sequence[Any]) -> ReportTable:
    """Strategies side by side (``compare``'s outcomes): fits, total time, end-to-end tokens/s."""
    rows = []
    for o in outcomes:
        if o.plan is None:
            said = Cell(f"no plan: {o.error}", "bad") if o.ran else Cell(f"not run: {o.error}")
            rows.append((Cell(o.strategy), said, Cell("-"), Cell("-")))
        else:
            rows.append((Cell(o.strategy), Cell("yes", "good") if o.fits else Cell("OOM", "bad"),
                         Cell(format_seconds(o.plan.cost.total_s)), Cell(f"{o.plan.cost.tokens_per_s:.2f}")))
    return ReportTable("Strategies", ("strategy", "fits", "total", "tokens/s end to end"), tuple(rows),
                       frozenset({"total", "tokens/s end to end"}))


# -- renderers ----------------------------------------------------------------------------------
_RICH_TONES = {"bad": "bold red", "good": "green", "gpu": "green", "cpu": "yellow", "disk": "magenta"}


def rich_renderables(report: PlanReport, *, box: Any = "default") -> list[Any]:
    """The report as rich renderables: a facts grid, one table per table, warning and note lines."""
    from rich import box as boxes
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for label, cell in report.facts:
        head.add_row(label, Text(cell.text, style=_RICH_TONES.get(cell.tone, "")))
    parts: list[Any] = [head]
    for t in report.tables:
        table = Table(title=t.title, title_justify="left",
                      **({} if box == "default" else {"box": box or boxes.SIMPLE_HEAD}))
        for col in t.columns:
            table.add_column(col, justify="right" if col in t.right else "left")
        for row in t.rows:
            table.add_row(*(Text(c.text, style=_RICH_TONES.get(c.tone, "")) for c in row))
        parts.append(table)
    parts += [Text.assemble(("OOM", "bold red"), f" {w}") for w in report.warnings]
    parts += [Text.assemble(("gap:", "bold yellow"), f" {c}") for c in report.cautions]
    parts += [Text.assemble(("note:", "dim"), f" {n}") for n in report.notes]
    return parts


def report_text(report: PlanReport, width: int = TEXT_WIDTH) -> str:
    """The report as plain text (no colours, simple rules under the headers): ``Plan.summary()``."""
    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False, highlight=False)
    for part in rich_renderables(report, box=None):
        console.print(part)
    return "\n".join(line.rstrip() for line in buffer.getvalue().rstrip().splitlines())


def report_html(report: PlanReport, *, title: str | None = None, extra_tables: Sequence[ReportTable] = (),
                svg: str = "") -> str:
    """The report as HTML from ``templates/report.html.j2``: a fragment, or a whole page with ``title``.

    ``svg`` (inline pictures) and ``extra_tables`` (a strategy comparison) are added to a page.
    Every text is escaped by the template.
    """
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("placement_opt", "templates"),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("report.html.j2").render(
        report=report, title=title, extra_tables=list(extra_tables), svg=svg, mark=PICTURE_MARK)
