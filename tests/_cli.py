"""Running the ``placement-opt`` command in-process for the CLI tests.

The runner fixes the console width, so what the tests assert on (tables, summaries) never depends
on the width of the terminal pytest runs in; lines naming a file are never wrapped by the CLI, so
they do not depend on the length of the temporary directory's path either.
"""

from __future__ import annotations

from typing import Any

from click.testing import CliRunner, Result

from placement_opt.cli.main import cli

__all__ = ["CLI_COLUMNS", "TINY_LLAMA", "run_cli"]

#: The console width every CLI test runs with (rich reads COLUMNS), whatever the real terminal's.
CLI_COLUMNS = 200

#: A tiny Llama's config.json (hidden 64, 2 layers, 4 heads, intermediate 128, vocab 128): traces and plans in
#: a fraction of a second, and fits any preset GPU many times over.
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 128,
              "max_position_embeddings": 256, "tie_word_embeddings": False}


def run_cli(*args: str, **invoke: Any) -> Result:
    """``placement-opt ARGS`` in-process with a fixed console width; exceptions propagate by default."""
    invoke.setdefault("catch_exceptions", False)
    runner = CliRunner(env={"COLUMNS": str(CLI_COLUMNS)})
    return runner.invoke(cli, list(args), prog_name="placement-opt", **invoke)
