"""What the command prints and writes: consoles, the progress spinner, errors as one line, output files."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from ..compare import one_line
from ..units import format_bytes, format_seconds

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

    from ..compare import StrategyOutcome
    from ..hardware.devices import Device, Machine
    from ..plan import Plan

__all__ = ["EXIT_INFEASIBLE", "STDOUT", "Failure", "console_for", "progress", "errors_as_messages", "write_outputs",
           "write_json", "say_written", "devices_table"]


EXIT_INFEASIBLE = 1
#: ``--json -``: the JSON goes to standard output, and every human line to stderr.
STDOUT = "-"


class Failure(click.ClickException):
    """A one-line error that is not the user's typing: exit code 1."""

    exit_code = EXIT_INFEASIBLE


def console_for(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr); 160 columns when it is not a terminal and COLUMNS is unset."""
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, highlight=False, width=160)
    return console


@contextmanager
def progress(message: str) -> Iterator[None]:
    """A spinner on stderr while a slow step runs (on a terminal, unless ``PLACEMENT_OPT_PROGRESS=0``)."""
    from ..progress import switch

    console = console_for(stderr=True)
    if not console.is_terminal or switch() == "off":
        yield
        return
    with console.status(message, spinner="dots"):
        yield


@contextmanager
def errors_as_messages() -> Iterator[None]:
    """Turn the library's errors into one-line CLI errors with the right exit code: bad input (a device spec,
    a workload, a model name, solve()'s arguments such as pins or modes, a plan file that is unreadable or
    another model's) exit code 2, anything else 1."""
    from ..errors import (
        DeviceSpecError,
        InfeasiblePlacementError,
        ModelSpecError,
        PlacementError,
        PlanFormatError,
        SolverInputError,
        TraceError,
        WorkloadError,
    )

    try:
        yield
    except click.ClickException:
        raise
    except (DeviceSpecError, WorkloadError, ModelSpecError, SolverInputError, PlanFormatError) as exc:
        raise click.UsageError(one_line(exc)) from None
    except InfeasiblePlacementError as exc:
        text = one_line(exc)
        raise Failure(text if text.startswith("no placement fits") else f"no placement fits: {text}") from None
    except TraceError as exc:
        raise Failure(f"cannot trace the model: {one_line(exc)}") from None
    except PlacementError as exc:
        raise Failure(one_line(exc)) from None
    except (ValueError, OSError) as exc:
        raise click.UsageError(one_line(exc)) from None


def say_written(console: Console, text: str) -> None:
    """A line that names a file: never wrapped, so the path can be copied whatever the width."""
    console.print(text, soft_wrap=True, markup=False)


def write_json(console: Console, path: str, text: str, what: str, written: str) -> None:
    """``text``, a JSON document holding ``what`` ("comparison", "run's figures"), on stdout for ``--json -``, else
    written to ``path`` and named (``"WRITTEN written to PATH"``); a path that cannot be written is a one-line
    :class:`Failure`, not a traceback after the work."""
    from .._files import write_text_atomic

    if path == STDOUT:
        click.echo(text)
        return
    try:
        write_text_atomic(path, text)
    except OSError as exc:
        raise Failure(f"cannot write the {what} to {path}: {exc.strerror or exc}; give --json a path in a folder "
                      f"you can write to") from None
    say_written(console, f"{written} written to {path}")


def write_outputs(console: Console, result: Plan, json_path: str | None, plot: str | None,
                  outcomes: Sequence[StrategyOutcome] = ()) -> None:
    """Write the plan as JSON and/or its pictures, as ``--json``/``--plot`` ask (``--json -``: stdout)."""
    from ..errors import PlacementError

    if json_path == STDOUT:
        click.echo(result.to_json())
    elif json_path:
        try:
            result.to_json(json_path)
        except OSError as exc:
            raise Failure(f"cannot write the plan to {json_path}: {exc.strerror or exc}") from None
        except PlacementError as exc:  # a file of the user's put there since the check before solving
            raise Failure(one_line(exc)) from None
        say_written(console, f"plan written to {json_path}")
    if plot:
        from .pictures import save_report

        try:
            with progress("Drawing ..."):
                save_report(result, plot, outcomes)
        except ImportError as exc:
            raise Failure(f"pictures need matplotlib ({exc}): pip install 'placement-opt[plot]'") from None
        except OSError as exc:
            raise Failure(f"cannot write {plot}: {exc}") from None
        except PlacementError as exc:  # as above: a picture placement_opt did not draw, never drawn over
            raise Failure(one_line(exc)) from None
        say_written(console, f"pictures written to {plot}")


def _random_read(device: Device) -> str:
    """A disk's measured scattered reads, ``1.2 GB/s + 15 µs a read``; ``-`` where not measured or not a disk."""
    rate, latency = device.random_read_bytes_per_s, device.random_read_latency_s
    if rate is None and latency is None:
        return "-"
    said = [f"{rate / 1e9:.3g} GB/s" if rate else "", f"{format_seconds(latency)} a read" if latency else ""]
    return " + ".join(part for part in said if part)


def devices_table(machine: Machine) -> Any:
    """The ``profile`` command's table: one row per measured device; ``-`` where a figure does not apply."""
    from rich.table import Table

    table = Table(title="This machine", title_justify="left")
    for col in ("device", "memory", "GFLOP/s", "bandwidth", "host link", "back to host", "random read", "source"):
        table.add_column(col, justify="left" if col in ("device", "source") else "right")
    for d in machine.devices:
        back = d.to_host_bytes_per_s  # host_copy.to_host into new memory: what a KV cache or an output leaving the GPU costs
        scattered = _random_read(d)  # what the experts a router picks and a lookup's rows are read at
        table.add_row(d.name, format_bytes(d.memory_bytes), f"{d.flops_per_s / 1e9:.3g}" if d.flops_per_s else "-",
                      f"{d.bandwidth_bytes_per_s / 1e9:.3g} GB/s",
                      f"{d.host_link_bytes_per_s / 1e9:.3g} GB/s" if d.is_gpu else "-",
                      f"{back / 1e9:.3g} GB/s" if back else "-", scattered, d.source)
    return table
