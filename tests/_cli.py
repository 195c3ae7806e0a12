"""Running the ``placement-opt`` command in-process for the CLI tests.

The runner fixes the console width, so what the tests assert on (tables, summaries) never depends
on the width of the terminal pytest runs in; lines naming a file are never wrapped by the CLI, so
they do not depend on the length of the temporary directory's path either.
"""

from __future__ import annotations

from typing import Any

from click.testing import CliRunner, Result

from placement_opt.cli.main import cli

__all__ = ["CLI_COLUMNS", "run_cli"]

#: The console width every CLI test runs with (rich reads COLUMNS), whatever the real terminal's.
CLI_COLUMNS = 200


def run_cli(*args: str, **invoke: Any) -> Result:
    """``placement-opt ARGS`` in-process with a fixed console width; exceptions propagate by default."""
    invoke.setdefault("catch_exceptions", False)
    runner = CliRunner(env={"COLUMNS": str(CLI_COLUMNS)})
    return runner.invoke(cli, list(args), prog_name="placement-opt", **invoke)
