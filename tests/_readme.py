"""The README's CPU-route Quickstart commands, read from README.md: the install line, which tests/test_install.py
replays and .ci/run runs to build its environment (``python3 tests/_readme.py`` prints it, without the CPU index,
which neither can reach), and the test command .ci/run runs (``python3 tests/_readme.py --tests``). Standard
library only: .ci/run calls it before any virtualenv exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def readme_cpu_command() -> str:
    """The first line of the Quickstart's first bash block: the CPU route."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = text[text.index("## Quickstart"):]
    block = re.search(r"```bash\n(.*?)```", quickstart, re.S).group(1)
    return block.splitlines()[0]


def readme_test_command() -> str:
    """The Quickstart's test command: the second line of its first bash block."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = text[text.index("## Quickstart"):]
    return re.search(r"```bash\n(.*?)```", quickstart, re.S).group(1).splitlines()[1]


def without_cpu_index(command: str) -> str:
    """``command`` with the CPU wheel index dropped: torch==2.13.0 then comes from the local pip configuration."""
    return command.replace(f" {CPU_INDEX}", "")


if __name__ == "__main__":
    sys.stdout.write((readme_test_command() if sys.argv[1:] == ["--tests"] else without_cpu_index(readme_cpu_command()))
                     + "\n")
