"""The ``placement-opt`` command: plan, compare strategies, profile, explain, benchmark.

Example::

    placement-opt plan llama-2-70b --devices cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=256GiB,disk
    placement-opt compare llama-2-70b --devices cuda:0=a100-40gb,cpu=256GiB,disk --plot cmp.png
    placement-opt profile --out machine.json --quick
    placement-opt plan mistral-7b --devices machine.json --json plan.json
    placement-opt explain plan.json

Heavy modules (torch, transformers, the solver, matplotlib) are imported inside the commands,
so ``placement-opt --help`` answers at once. Bad input ends with one line on stderr and exit
code 2; a problem no placement can satisfy ends with the reason and exit code 1.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..compare import STRATEGIES, _one_line, _solve, compare_strategies
from ..units import format_bytes
from .tables import comparison_table, plan_renderables, why_lines

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

    from ..compare import StrategyOutcome
    from ..cost.workload import Workload
    from ..hardware.devices import Machine
    from ..plan import Plan

__all__ = ["main", "cli", "resolve_model", "resolve_devices"]

_OBJECTIVES = ("latency", "throughput", "memory")
_DTYPES = ("float16", "bfloat16", "float32")
_EXIT_INFEASIBLE = 1


class _Failure(click.ClickException):
    """A one-line error that is not the user's typing: exit code 1."""

    exit_code = _EXIT_INFEASIBLE


# -- consoles and progress -------------------------------------------------------------------


def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, highlight=False, width=160)
    return console


@contextmanager
def _progress(message: str) -> Iterator[None]:
    """A spinner on stderr while a slow step runs (shown only on a terminal)."""
    console = _console(stderr=True)
    if not console.is_terminal:
        yield
        return
    with console.status(message, spinner="dots"):
        yield


# -- resolving the user's words into objects ---------------------------------------------------


def _preset_names() -> list[str]:
    try:
        from ..model import catalog as models
    except ImportError:
        return []
    return list(models.list_models())


def resolve_model(text: str) -> Any:
    """A model argument as ``trace`` accepts it: a preset's config, a config.json's config, or an id.

    Accepted: a preset name of :mod:`placement_opt.model.catalog` (``llama-2-70b``), a path to a
    ``config.json`` (or to a directory holding one), or a Hugging Face model id (``org/name``;
    only its config is read).

    Raises:
        click.BadParameter: none of these (the message lists the presets).
    """
    path = Path(text)
    if path.is_file():
        return _config_from_json(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise click.BadParameter(f"directory {text!r} has no config.json", param_hint="MODEL")
        return str(path)
    presets = _preset_names()
    if text.lower() in presets:
        from ..model import catalog as models

        return models.model_config(text.lower())
    if "/" in text:
        return text
    known = ", ".join(presets) if presets else "none yet"
    raise click.BadParameter(
        f"unknown model preset {text!r}: known presets are {known}; or give a config.json, "
        f"a local model directory or a model id like 'org/name'", param_hint="MODEL")


def _config_from_json(path: Path) -> Any:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise click.BadParameter(f"cannot read {str(path)!r} as JSON: {exc}", param_hint="MODEL") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise click.BadParameter(
            f"{str(path)!r} is not a transformers config.json (no 'model_type' key)", param_hint="MODEL")
    from transformers import AutoConfig

    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(data["model_type"], **fields)
    except ValueError as exc:
        raise click.BadParameter(f"{str(path)!r}: {exc}", param_hint="MODEL") from None


def resolve_devices(spec: str, *, dtype: str = "float16") -> Machine:
    """The ``--devices`` value as a Machine: a spec string, ``auto``, or a saved profile JSON.

    Raises:
        click.BadParameter: the spec is malformed or the file is not a profile.
    """
    from ..hardware.resolve import parse_device_spec

    try:
        if spec.strip().lower() == "auto":
            return _local_machine(dtype)
        path = Path(spec)
        if path.suffix.lower() == ".json" or path.is_file():
            return _machine_from_file(path)
        return parse_device_spec(spec, dtype=dtype)
    except click.BadParameter:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise click.BadParameter(str(exc), param_hint="--devices") from None


def _machine_from_file(path: Path) -> Machine:
    from ..hardware.devices import Machine

    if not path.is_file():
        raise click.BadParameter(f"profile file {str(path)!r} does not exist", param_hint="--devices")
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and "machine" in data:
        data = data["machine"]
    if not isinstance(data, dict) or "devices" not in data:
        raise click.BadParameter(
            f"{str(path)!r} is not a saved machine profile (no 'devices' list): write one with "
            f"'placement-opt profile --out {path}'", param_hint="--devices")
    return Machine.from_dict(data)


def _local_machine(dtype: str) -> Machine:
    """This machine: every visible GPU, the CPU and the disk, with the saved profile's speeds."""
    from ..hardware.resolve import as_machine

    names = [f"cuda:{i}" for i in range(_cuda_count())] + ["cpu", "disk"]
    return as_machine(names, dtype=dtype)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _workload(batch: int, prompt: int, new_tokens: int) -> Workload:
    from ..cost.workload import Workload

    try:
        return Workload(batch_size=batch, prompt_len=prompt, new_tokens=new_tokens)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


# -- solving ----------------------------------------------------------------------------------


def _trace(model: Any, workload: Workload, dtype: str | None) -> Any:
    from ..model.tracer import trace

    return trace(model, dtype=dtype)


@contextmanager
def _errors_as_messages() -> Iterator[None]:
    """Turn the library's errors into one-line CLI errors with the right exit code."""
    from ..errors import InfeasiblePlacementError, PlacementError, TraceError

    try:
        yield
    except click.ClickException:
        raise
    except InfeasiblePlacementError as exc:
        text = _one_line(exc)
        raise _Failure(text if text.startswith("no placement fits") else f"no placement fits: {text}") from None
    except TraceError as exc:
        raise _Failure(f"cannot trace the model: {_one_line(exc)}") from None
    except PlacementError as exc:
        raise _Failure(_one_line(exc)) from None
    except (ValueError, OSError) as exc:
        raise click.UsageError(_one_line(exc)) from None


# -- rendering --------------------------------------------------------------------------------


# -- commands ---------------------------------------------------------------------------------


class _Group(click.Group):
    """A click group whose errors are one line on stderr (click's own add a usage preamble)."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
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


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="placement-opt", prog_name="placement-opt")
def cli() -> None:
    """Decide where every layer of a large model lives (GPU, CPU RAM, disk) and computes."""


def _solve_options(func: Any) -> Any:
    options = [
        click.argument("model"),
        click.option("--devices", "-d", required=True, metavar="SPEC",
                     help="'cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=256GiB,disk', 'auto' (this machine) "
                          "or a saved profile .json"),
        click.option("--objective", type=click.Choice(_OBJECTIVES), default="latency", show_default=True),
        click.option("--batch", type=int, default=1, show_default=True, help="sequences generated together"),
        click.option("--prompt", type=int, default=512, show_default=True, help="prompt tokens (prefill)"),
        click.option("--new-tokens", type=int, default=128, show_default=True, help="tokens generated"),
        click.option("--dtype", type=click.Choice(_DTYPES), default=None,
                     help="weight dtype (default: the model's own, from its config)"),
        click.option("--time-limit", type=float, default=None, metavar="S",
                     help="CP-SAT time limit in seconds (default: the solver's)"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _prepare(model: str, devices: str, batch: int, prompt: int, new_tokens: int,
             dtype: str | None) -> tuple[Any, Machine, Workload, Any]:
    """(graph, machine, workload, resolved model) from the command-line words."""
    workload = _workload(batch, prompt, new_tokens)
    machine = resolve_devices(devices, dtype=dtype or "float16")  # bad specs fail before tracing
    resolved = resolve_model(model)
    with _progress(f"Tracing {model} on the meta device ..."):
        graph = _trace(resolved, workload, dtype)
    if dtype is None:  # the model's own dtype: devices' FLOP/s are looked up for it
        machine = resolve_devices(devices, dtype=graph.meta.dtype)
    return graph, machine, workload, resolved


def _check_plot_suffix(path: str | None) -> None:
    if path and Path(path).suffix.lower() not in (".png", ".svg", ".html", ".htm"):
        raise click.BadParameter(f"{path!r}: use a .png, .svg or .html file name", param_hint="--plot")


@cli.command()
@_solve_options
@click.option("--strategy", type=click.Choice(STRATEGIES), default="cpsat", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write the plan as JSON here")
@click.option("--plot", type=click.Path(dir_okay=False), help="write pictures here (.png, .svg or .html)")
def plan(model: str, devices: str, objective: str, batch: int, prompt: int, new_tokens: int, dtype: str | None,
         time_limit: float | None, strategy: str, json_path: str | None, plot: str | None) -> None:
    """Plan MODEL (a preset name, config.json, model directory or model id) for a machine."""
    _check_plot_suffix(plot)
    console = _console()
    with _errors_as_messages():
        graph, machine, workload, resolved = _prepare(model, devices, batch, prompt, new_tokens, dtype)
        with _progress(f"Solving ({strategy}, {objective}) ..."):
            result = _solve(graph, machine, objective=objective, workload=workload, strategy=strategy,
                            time_limit_s=time_limit, source=resolved)
    for part in plan_renderables(result):
        console.print(part)
    _write_outputs(console, result, json_path, plot)


def _write_outputs(console: Console, result: Plan, json_path: str | None, plot: str | None,
                   outcomes: Sequence[StrategyOutcome] = ()) -> None:
    if json_path:
        result.to_json(json_path)
        console.print(f"plan written to {json_path}")
    if plot:
        from .pictures import save_report

        try:
            with _progress("Drawing ..."):
                save_report(result, plot, outcomes)
        except ImportError as exc:
            raise _Failure(f"pictures need matplotlib ({exc}): pip install 'placement-opt[plot]'") from None
        except OSError as exc:
            raise _Failure(f"cannot write {plot}: {exc}") from None
        console.print(f"pictures written to {plot}")


@cli.command()
@_solve_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False),
              help="write every strategy's result as JSON here")
@click.option("--plot", type=click.Path(dir_okay=False),
              help="write the comparison and the cpsat plan's pictures here (.png, .svg or .html)")
def compare(model: str, devices: str, objective: str, batch: int, prompt: int, new_tokens: int,
            dtype: str | None,
            time_limit: float | None, json_path: str | None, plot: str | None) -> None:
    """Run every strategy (cpsat and the device_map="auto" family) on MODEL, side by side."""
    _check_plot_suffix(plot)
    console = _console()
    with _errors_as_messages():
        graph, machine, workload, resolved = _prepare(model, devices, batch, prompt, new_tokens, dtype)
        with _progress("Solving with every strategy ..."):
            outcomes = compare_strategies(graph, machine, objective=objective, workload=workload,
                                          time_limit_s=time_limit, source=resolved)
    w = workload
    console.print(f"[bold]{model}[/] ({graph.meta.dtype}) on {', '.join(machine.names)}; batch {w.batch_size} x prompt "
                  f"{w.prompt_len} + {w.new_tokens} new tokens; objective {objective}")
    console.print(comparison_table(outcomes, machine.names, objective))
    for line in why_lines(outcomes):
        console.print(line)
    if json_path:
        rows = [{"strategy": o.strategy, "fits": o.fits, "error": o.error,
                 "plan": o.plan.to_dict() if o.plan else None} for o in outcomes]
        Path(json_path).write_text(json.dumps(rows, indent=1), encoding="utf-8")
        console.print(f"results written to {json_path}")
    if plot:
        best = next((o.plan for o in outcomes if o.strategy == "cpsat" and o.plan), None)
        best = best or next((o.plan for o in outcomes if o.plan), None)
        if best is None:
            raise _Failure("no strategy produced a plan: nothing to draw")
        _write_outputs(console, best, None, plot, outcomes)
    if all(o.plan is None for o in outcomes):
        raise _Failure("no strategy produced a plan (see above)")


@cli.command()
@click.argument("plan_path", metavar="PLAN.json", type=click.Path(exists=True, dir_okay=False))
@click.option("--plot", type=click.Path(dir_okay=False), help="write pictures here (.png, .svg or .html)")
def explain(plan_path: str, plot: str | None) -> None:
    """Show a saved plan and why its units sit where they are."""
    from ..plan import Plan

    _check_plot_suffix(plot)
    console = _console()
    try:
        result = Plan.from_json(plan_path)
    except (ValueError, KeyError, TypeError) as exc:
        raise click.BadParameter(f"{plan_path!r} is not a placement_opt plan: {_one_line(exc)}",
                                 param_hint="PLAN.json") from None
    for part in plan_renderables(result, notes=False):  # explain() lists the notes
        console.print(part)
    console.print(result.explain(), markup=False)
    _write_outputs(console, result, None, plot)


@cli.command()
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="where to save the profile (default: $PLACEMENT_OPT_PROFILE or "
                   "~/.cache/placement_opt/profile.json)")
@click.option("--quick", is_flag=True, help="shorter measurements (about a second; less precise)")
@click.option("--dtype", type=click.Choice(_DTYPES), default="float16", show_default=True,
              help="dtype whose FLOP/s the table shows (every dtype is measured and saved)")
def profile(out: str | None, quick: bool, dtype: str) -> None:
    """Measure this machine (compute, memory and disk bandwidth, links) and save the profile.

    Use the saved file with --devices PATH, or --devices auto when it is at the default place.
    """
    console = _console()
    with _errors_as_messages():
        from ..hardware.profile_store import profile_path
        from ..hardware.profiler import profile as measure

        with _progress("Measuring this machine ..."):
            started = time.perf_counter()
            machine = measure(path=out, quick=quick, dtype=dtype)
            took = time.perf_counter() - started
    console.print(_devices_table(machine))
    console.print(f"measured in {took:.1f} s; saved to {profile_path(out)}")


def _devices_table(machine: Machine) -> Any:
    from rich.table import Table

    table = Table(title="This machine", title_justify="left")
    for col in ("device", "memory", "GFLOP/s", "bandwidth", "host link", "source"):
        table.add_column(col, justify="left" if col in ("device", "source") else "right")
    for d in machine.devices:
        table.add_row(d.name, format_bytes(d.memory_bytes), f"{d.flops_per_s / 1e9:.3g}",
                      f"{d.bandwidth_bytes_per_s / 1e9:.3g} GB/s",
                      f"{d.host_link_bytes_per_s / 1e9:.3g} GB/s" if d.is_gpu else "-", d.source)
    return table


@cli.command()
@click.option("--quick", is_flag=True, help="small sizes and few repeats (a smoke run)")
@click.option("--only", multiple=True, metavar="NAME", help="run only these experiments (repeatable)")
@click.option("--collect", is_flag=True, help="run nothing: rebuild the report from the results there")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="where to write the report (default benchmarks/RESULTS.md)")
def bench(quick: bool, only: tuple[str, ...], collect: bool, out: str | None) -> None:
    """Run the benchmark suite (benchmarks/run_all.py) and regenerate benchmarks/RESULTS.md."""
    import subprocess

    script = _benchmarks_dir() / "run_all.py"
    if not script.is_file():
        raise _Failure(f"{script} not found: 'bench' needs a source checkout of placement_opt")
    command = [sys.executable, str(script)] + (["--quick"] if quick else []) + (["--collect"] if collect else [])
    for name in only:
        command += ["--only", name]
    if out:
        command += ["--out", str(Path(out).resolve())]
    proc = subprocess.run(command, cwd=script.parent.parent, capture_output=True, text=True)
    click.echo(proc.stdout, nl=False)
    if proc.returncode == 2:
        raise click.UsageError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "bad arguments")
    if proc.returncode:
        click.echo(proc.stderr, nl=False, err=True)
        raise _Failure(f"benchmark suite failed (exit code {proc.returncode}); see the report for which")


def _benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[3] / "benchmarks"


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``placement-opt`` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="placement-opt")
