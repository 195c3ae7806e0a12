"""The ``placement-opt`` command: plan, compare strategies, profile, explain, benchmark.

Example::

    placement-opt plan llama-2-70b --devices cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=256GiB,disk
    placement-opt compare llama-2-70b --devices cuda:0=a100-40gb,cpu=256GiB,disk --plot cmp.png
    placement-opt profile --out machine.json --quick
    placement-opt plan mistral-7b --devices machine.json --json plan.json
    placement-opt explain plan.json

The command group and plan, compare and explain live here (run in :mod:`.run`; profile, presets
and bench in :mod:`._machine_commands`); :mod:`.options` turns the command line's words into objects and
:mod:`.output` prints and writes. Heavy modules (torch, transformers, the solver, matplotlib) are
imported inside the commands,
so ``placement-opt --help`` answers at once. Bad input ends with one line on stderr and exit
code 2; a problem no placement can satisfy ends with the reason and exit code 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .._files import loads_json
from ..compare import STRATEGIES, compare_strategies, one_line, solve_strategy
from ..plan_notes import uncut_note
from ..report import EXTRA_SEARCH_S, gap_advice
from ._machine_commands import bench, presets, profile
from .options import (
    check_expert_groups,
    check_model,
    check_outputs,
    check_plot_suffix,
    cluster_options,
    expert_groups_option,
    parse_modes,
    parse_pins,
    require_devices,
    resolve_devices,
    resolve_model,
    solve_options,
    workload_from,
)
from .output import (
    STDOUT,
    Failure,
    console_for,
    errors_as_messages,
    progress,
    write_json,
    write_outputs,
)
from .run import run
from .tables import comparison_table, plan_renderables, why_lines

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

    from ..compare import StrategyOutcome
    from ..cost.workload import Workload
    from ..hardware.devices import Machine
    from ..plan import Plan

__all__ = ["main", "cli"]


def _trace(model: str, dtype: str | None, granularity: str = "block", expert_groups: int = 1,
           use_cache: bool = True) -> Any:
    """The graph of ``model`` (a checked model argument): from the graph cache when it holds it, else traced
    (on the meta device) and kept there (:mod:`placement_opt.model.graph_cache`)."""
    from ..model.graph_cache import traced

    def trace_now() -> Any:
        from ..model.tracer import trace

        with progress(f"Tracing {model} on the meta device ..."):
            return trace(resolve_model(model), dtype=dtype, granularity=granularity, expert_groups=expert_groups)

    graph, _ = traced(model, trace_now, dtype=dtype, granularity=granularity, expert_groups=expert_groups,
                      use_cache=use_cache)
    return graph


class _Group(click.Group):
    """A click group whose errors are one line on stderr (click's own add a usage preamble)."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            with _warnings_as_lines():
                code = super().main(args, prog_name, complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # `placement-opt` alone: its help, not an error line
            click.echo(exc.format_message(), err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            hint = ""
            if isinstance(exc, click.UsageError) and exc.ctx is not None:
                hint = f" (see '{exc.ctx.command_path} --help')"
            click.echo(f"Error: {exc.format_message()}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted.", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """Warnings as ``warning: MESSAGE`` on stderr, as the errors are lines: Python's own format shows a source
    line of the library (``return trace(...)``) that means nothing to someone at a prompt."""
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        click.echo(f"warning: {message}", err=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="placement-opt", prog_name="placement-opt")
def cli() -> None:
    """Decide where every layer of a large model lives (GPU, CPU RAM, disk) and computes."""


def _prepare(model: str, devices: str, batch: int, prompt: int, new_tokens: int,
             dtype: str | None, logits: str | None = None, granularity: str = "block",
             overlap: bool = False, expert_groups: int = 1, padded: bool = False, use_cache: bool = True
             ) -> tuple[Any, Machine, Workload, str]:
    """(graph, machine, workload, checked model argument) from the command-line words (``auto``: the block
    graph)."""
    devices = require_devices(devices)
    workload = workload_from(batch, prompt, new_tokens, logits, overlap, padded)
    machine = resolve_devices(devices, dtype=dtype or "float16")  # bad specs fail before tracing
    checked = check_model(model)
    graph = (_trace(checked, dtype, use_cache=use_cache) if granularity == "auto"
             else _trace(checked, dtype, granularity, expert_groups, use_cache))
    if dtype is None:  # the model's own dtype: devices' FLOP/s are looked up for it
        machine = resolve_devices(devices, dtype=graph.meta.dtype)
    return graph, machine, workload, checked


@cli.command()
@solve_options
@click.option("--strategy", type=click.Choice(STRATEGIES), default="cpsat", show_default=True,
              help="who places: cpsat (the optimizer), placement_opt's re-implementations of accelerate's "
                   "device_map strings (sequential, balanced, balanced_low_0), or the installed accelerate itself")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="write the plan as JSON here ('-': to stdout, with the tables on stderr)")
@click.option("--plot", type=click.Path(dir_okay=False), help="write pictures here (.png, .svg or .html)")
@click.option("--modes", default=None, metavar="LIST",
              help="what the solver may choose for weights off the GPUs, e.g. 'resident,stream': resident, stream, "
                   "phased (prompt on the GPU, decode steps on the CPU; run by placement_opt's dispatch/load "
                   "only). Default: all of them")
@click.option("--granularity", type=click.Choice(["block", "sublayer", "module", "auto"]), default="block",
              show_default=True,
              help="units to place: decoder layers whole (block), attention/MLP/experts apart (sublayer), every "
                   "module, or auto: block and sublayer both, each in half the time limit, the better plan kept")
@click.option("--pin", "pin", multiple=True, metavar="MODULE=DEVICE",
              help="fix where MODULE's weights are stored (repeatable): e.g. lm_head=cuda:0, model.layers.0=cpu, or a "
                   "quoted pattern, 'model.layers.*.mlp.experts=cpu' (with --granularity sublayer)")
@expert_groups_option
@click.option("--contiguous", is_flag=True,
              help="each device stores one contiguous range of the units that hold weights, as pipeline stages "
                   "on one machine need (the solver's plan only; plan --cluster cuts stages over several)")
@click.option("--verbose", "-v", is_flag=True,
              help="also print the notes about the search itself (its warm start, where its bound came from); "
                   "--json keeps them either way")
@cluster_options
def plan(model: str, devices: str, objective: str, batch: int, prompt: int, new_tokens: int, logits: str | None,
         padded: bool, dtype: str | None, overlap: bool, time_limit: float | None, strategy: str, json_path: str | None, plot: str | None,
         modes: str, granularity: str, pin: tuple[str, ...], expert_groups: int, contiguous: bool, verbose: bool,
         cluster: str | None, schedule: str, microbatches: int | None, train: bool, no_cache: bool) -> None:
    """Plan MODEL (a preset name, config.json, model directory or model id) for a machine."""
    check_outputs(json_path, plot, "pipeline plan" if cluster is not None else "plan")
    pins = parse_pins(pin)
    _check_cluster_options(cluster, devices)
    _check_plan_options(strategy, bool(pins), contiguous, cluster, overlap, padded)
    _check_search_options(strategy, cluster, modes, granularity, time_limit)
    if cluster is not None:
        return _plan_cluster(model, cluster, batch, prompt, dtype, schedule, microbatches, train, json_path,
                             not no_cache)
    console = console_for(stderr=json_path == STDOUT)
    with errors_as_messages():
        check_expert_groups(expert_groups, granularity)
        graph, machine, workload, checked = _prepare(model, devices, batch, prompt, new_tokens, dtype, logits,
                                                     granularity, overlap, expert_groups, padded, not no_cache)
        chosen: dict[str, Any] = {"modes": parse_modes(modes)} if modes is not None else {}
        if pins:
            chosen["pins"] = pins
        if contiguous:
            chosen["contiguous"] = True
        if granularity == "auto":  # cpsat only (_check_search_options)
            sublayer = _trace(checked, graph.meta.dtype, "sublayer", expert_groups, not no_cache)
            chosen.update(granularity="auto", expert_groups=expert_groups, sublayer=sublayer)
        # accelerate's own map needs the transformers config: read only then (the cached graph needs none)
        resolved = resolve_model(checked) if strategy == "accelerate" else None
        with progress(f"Solving ({strategy}, {objective}) ..."):
            result = solve_strategy(graph, machine, objective=objective, workload=workload, strategy=strategy,
                                    time_limit_s=time_limit, source=resolved, **chosen)
        if time_limit is None and gap_advice(result) is not None:
            result = _search_longer(console, result, lambda limit: solve_strategy(
                graph, machine, objective=objective, workload=workload, strategy=strategy, time_limit_s=limit,
                source=resolved, **chosen))
        cut = chosen.get("sublayer", graph)
        result = dataclasses.replace(result, notes=(*result.notes, *uncut_note(cut, expert_groups)))
    for part in plan_renderables(result, solver_notes=verbose):
        console.print(part)
    write_outputs(console, result, json_path, plot)
    if not result.cost.fits:  # a baseline's plan that runs out of memory is written to be read, never to be run
        raise Failure(f"the {strategy} plan does not fit (see the note above): --strategy cpsat finds one that "
                      f"fits where one exists")


def _check_plan_options(strategy: str, pinned: bool, contiguous: bool, cluster: str | None, overlap: bool,
                        padded: bool) -> None:
    """``plan``'s options that mean nothing together, refused in one line each (exit code 2)."""
    if pinned and cluster is not None:
        raise click.UsageError("--pin fixes storage on one machine for the solver's plan: leave it out with --cluster")
    if pinned and strategy != "cpsat":
        how = "is the installed library's own map" if strategy == "accelerate" else "fills the devices in its own order"
        raise click.UsageError(f"--pin fixes storage in the cpsat plan only: --strategy {strategy} {how}, whatever is "
                               f"pinned; leave --pin out, or use --strategy cpsat")
    if contiguous and (strategy != "cpsat" or cluster is not None):
        what = "plan --cluster's stages are contiguous already" if cluster is not None else (
            f"--strategy {strategy} places the units by its own rule")
        raise click.UsageError(f"--contiguous asks the cpsat plan for one range of units per device: {what}; leave "
                               f"--contiguous out")
    if cluster is not None and overlap:
        raise click.UsageError("--overlap prices one machine's prefetch thread; plan --cluster prices "
                               "pipeline stages without it: leave --overlap out")
    if cluster is not None and padded:
        raise click.UsageError("--padded is priced on one machine's plan; plan --cluster does not take it yet: "
                               "leave --padded out")


def _check_search_options(strategy: str, cluster: str | None, modes: str | None, granularity: str,
                          time_limit: float | None) -> None:
    """Options of the cpsat search, refused with a strategy that does not search: they were ignored without a word
    (the greedy fills and accelerate's own map choose no modes, solve nothing twice and take no time limit)."""
    if strategy == "cpsat" or cluster is not None:  # --cluster refuses them itself, naming all at once
        return
    does = ("is the installed library's own map" if strategy == "accelerate"
            else "fills the devices in its own order")
    if modes is not None:
        raise click.UsageError(f"--modes says what the cpsat search may choose: --strategy {strategy} {does}, and "
                               f"runs it as accelerate does; leave --modes out, or use --strategy cpsat")
    if granularity == "auto":
        raise click.UsageError(f"--granularity auto keeps the better of two cpsat plans: --strategy {strategy} {does}; "
                               f"give --granularity block or sublayer, or use --strategy cpsat")
    if time_limit is not None:
        raise click.UsageError(f"--time-limit bounds the cpsat search: --strategy {strategy} {does}, without a "
                               f"search; leave --time-limit out, or use --strategy cpsat")


def _plan_cluster(model: str, cluster: str, batch: int, prompt: int, dtype: str | None, schedule: str,
                  microbatches: int | None, train: bool, json_path: str | None, use_cache: bool) -> None:
    """``plan --cluster``: contiguous pipeline stages, one per rank, printed per host and rank."""
    from ..cost.workload import Workload
    from ..distributed.pipeline_plan import plan_pipeline
    from ..hardware.cluster import Cluster

    def parse(dtype_name: str) -> Cluster:
        # a file: 'cluster.JSON' or 'cluster' (a spec never names one) were parsed as specs ("no preset 'cluster.json'")
        if cluster.lower().endswith(".json") or Path(cluster).is_file():
            return Cluster.from_file(cluster, dtype=dtype_name)
        return Cluster.from_spec(cluster, dtype=dtype_name)

    console = console_for(stderr=json_path == STDOUT)
    with errors_as_messages():
        _check_microbatches(schedule, microbatches, len(parse(dtype or "float16").ranks))  # before tracing
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=0, training=train)
        graph = _trace(check_model(model), dtype, use_cache=use_cache)
        result = plan_pipeline(graph, parse(dtype or graph.meta.dtype), workload, schedule=schedule,
                               n_microbatches=microbatches)
    console.print(result.summary(), markup=False, highlight=False)
    if json_path:
        write_json(console, json_path, result.to_json(), "pipeline plan", "plan")


def _check_microbatches(schedule: str, microbatches: int | None, ranks: int) -> None:
    """--microbatches as the options name it (plan_pipeline's own message names its Python arguments)."""
    from ..distributed.pipeline_plan import MAX_MICROBATCHES

    if microbatches is not None and not 1 <= microbatches <= MAX_MICROBATCHES:
        raise click.UsageError(f"--microbatches is {microbatches}: give 1 to {MAX_MICROBATCHES} (default: one per rank)")
    if schedule == "1f1b" and microbatches is not None and microbatches < ranks:
        raise click.UsageError(f"--schedule 1f1b needs a micro-batch per stage: --microbatches {microbatches} for "
                               f"{ranks} ranks; give --microbatches {ranks} or more, or --schedule gpipe")


def _check_cluster_options(cluster: str | None, devices: str | None) -> None:
    """--devices and --cluster describe the machine(s) one way each; --schedule, --microbatches and --train shape
    a pipeline: given where they mean nothing, they were ignored without a word."""
    given = click.get_current_context().get_parameter_source
    if cluster is not None and devices is not None:
        raise click.UsageError("--cluster describes the machines the pipeline runs on: leave --devices out (or "
                               "--cluster, for one machine's plan)")
    if cluster is not None:
        # options of one machine's plan that the pipeline planner has no use for: given, they were dropped unsaid
        unused = [f"--{name.replace('_', '-')}" for name in ("plot", "objective", "strategy", "granularity", "modes",
                                                             "new_tokens", "logits", "time_limit", "expert_groups")
                  if given(name) == click.core.ParameterSource.COMMANDLINE]
        if unused:
            raise click.UsageError(f"{', '.join(unused)} {'shapes' if len(unused) == 1 else 'shape'} one machine's "
                                   f"plan; plan --cluster cuts whole-sequence forwards into pipeline stages, the "
                                   f"slowest one least, and takes none of them: leave them out")
    if cluster is None:
        shaping = [f"--{name}" for name in ("schedule", "microbatches", "train")
                   if given(name) == click.core.ParameterSource.COMMANDLINE]
        if shaping:
            one = len(shaping) == 1
            raise click.UsageError(f"{', '.join(shaping)} {'shapes' if one else 'shape'} a pipeline over several "
                                   f"machines: add --cluster SPEC, or leave {'it' if one else 'them'} out")


def _search_longer(console: Console, first: Plan, solve_again: Callable[[float], Plan]) -> Plan:
    """Solve again with :data:`EXTRA_SEARCH_S` when the default search stopped far from its bound;
    says so, and keeps the better plan (with a note saying what was done)."""
    console.print(f"[yellow]gap {first.gap:.1%} after the default {first.solve_time_s:.1f} s search: searching "
                  f"again for up to {EXTRA_SEARCH_S:g} s (give --time-limit to choose the time yourself)[/]")
    from ..planner import searched_again  # not at import: `--help` loads no solver

    with progress(f"Searching up to {EXTRA_SEARCH_S:g} s more ..."):
        return searched_again(first, solve_again)


@cli.command()
@solve_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True),
              help="write every strategy's result as JSON here ('-': to stdout, with the table on stderr)")
@click.option("--plot", type=click.Path(dir_okay=False),
              help="write the comparison and the cpsat plan's pictures here (.png, .svg or .html)")
def compare(model: str, devices: str, objective: str, batch: int, prompt: int, new_tokens: int,
            logits: str | None, padded: bool, dtype: str | None, overlap: bool,
            time_limit: float | None, json_path: str | None, plot: str | None, no_cache: bool) -> None:
    """Run every strategy (cpsat and the device_map="auto" family) on MODEL, side by side."""
    check_outputs(json_path, plot, "comparison")
    console = console_for(stderr=json_path == STDOUT)
    with errors_as_messages():
        graph, machine, workload, checked = _prepare(model, devices, batch, prompt, new_tokens, dtype, logits,
                                                     overlap=overlap, padded=padded, use_cache=not no_cache)
        resolved = resolve_model(checked)  # accelerate's own map is one of the strategies
        with progress("Solving with every strategy ..."):
            outcomes = compare_strategies(graph, machine, objective=objective, workload=workload,
                                          time_limit_s=time_limit, source=resolved)
        if time_limit is None:  # as `plan` does: cpsat searches longer where it stopped far from its bound
            outcomes = [_searched_longer(console, o, lambda limit: solve_strategy(
                graph, machine, objective=objective, workload=workload, strategy="cpsat", time_limit_s=limit,
                source=resolved)) for o in outcomes]
    w = workload
    console.print(f"[bold]{model}[/] ({graph.meta.dtype}) on {', '.join(machine.names)}; batch {w.batch_size} x prompt "
                  f"{w.prompt_len} + {w.new_tokens} new tokens; objective {objective}")
    console.print(comparison_table(outcomes, machine.names, objective))
    for line in why_lines(outcomes):
        console.print(line)
    _write_comparison(console, outcomes, json_path, plot)
    if all(o.plan is None for o in outcomes):
        raise Failure("no strategy produced a plan (see above)")
    if not any(o.fits for o in outcomes):  # a table of OOM rows is no placement: scripts read the exit code
        raise Failure("no strategy produced a plan that fits (see above): reduce the batch or context, or add "
                      "memory")


def _searched_longer(console: Console, outcome: StrategyOutcome,
                     solve_again: Callable[[float], Plan]) -> StrategyOutcome:
    """The cpsat outcome with :func:`_search_longer`'s plan where its search stopped above the gap target."""
    if outcome.strategy != "cpsat" or outcome.plan is None or gap_advice(outcome.plan) is None:
        return outcome
    return dataclasses.replace(outcome, plan=_search_longer(console, outcome.plan, solve_again))


def _write_comparison(console: Console, outcomes: Sequence[StrategyOutcome], json_path: str | None,
                      plot: str | None) -> None:
    """``compare --json``: every strategy's result; ``--plot``: the cpsat plan (else the first) drawn."""
    if json_path:
        rows = [{"strategy": o.strategy, "fits": o.fits, "ran": o.ran, "error": o.error,
                 "plan": o.plan.to_dict() if o.plan else None} for o in outcomes]
        write_json(console, json_path, json.dumps(rows, indent=1), "comparison", "results")
    if plot:
        best = next((o.plan for o in outcomes if o.strategy == "cpsat" and o.plan), None)
        best = best or next((o.plan for o in outcomes if o.plan), None)
        if best is None:
            raise Failure("no strategy produced a plan: nothing to draw")
        write_outputs(console, best, None, plot, outcomes)


@cli.command()
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(exists=True, dir_okay=False))
@click.option("--plot", type=click.Path(dir_okay=False), help="write pictures here (.png, .svg or .html)")
def explain(plan_path: str, plot: str | None) -> None:
    """Show a saved plan and why its units sit where they are."""
    from ..plan import Plan

    check_plot_suffix(plot)
    console = console_for()
    try:
        result = Plan.from_json(plan_path)
    except (ValueError, KeyError, TypeError) as exc:
        result = _plan_inside(plan_path)  # placement-opt run --json: the plan beside what was measured
        if result is None:
            raise click.BadParameter(f"{plan_path!r} is not a placement_opt plan: {one_line(exc)}",
                                     param_hint="PLAN.json") from None
    for part in plan_renderables(result, notes=False):  # explain() lists the notes
        console.print(part)
    console.print(result.explain(), markup=False)
    write_outputs(console, result, None, plot)


def _plan_inside(path: str) -> Plan | None:
    """The plan a ``placement-opt run --json`` file holds under ``"plan"``, or None where the file is not one; a
    malformed plan inside one is refused in the plan's own words (the file is one, its plan is wrong)."""
    from ..plan import Plan

    try:
        data = loads_json(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "measured" not in data or "plan" not in data:
        return None
    try:
        return Plan.from_dict(data["plan"])
    except (ValueError, KeyError, TypeError) as exc:
        raise click.BadParameter(f"{path!r} holds what placement-opt run measured, and its plan is not a readable "
                                 f"plan: {one_line(exc)}", param_hint="PLAN.json") from None


cli.add_command(profile)
cli.add_command(presets)
cli.add_command(bench)
cli.add_command(run)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``placement-opt`` console script. The process runs PyTorch's CUDA allocator with expandable
    segments unless the environment sets the allocator (:mod:`~placement_opt.runtime.cuda_allocator`: with the
    default one, a plan that fills a GPU can run out of it in split segments)."""
    from ..runtime.cuda_allocator import use_expandable_segments

    use_expandable_segments()
    cli.main(args=list(argv) if argv is not None else None, prog_name="placement-opt")
