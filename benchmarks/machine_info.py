"""The processor a benchmark ran on, for the line each results file opens with.

Sessions of this project run on more than one kind of 2-core VM (an Intel Xeon and an AMD EPYC so far), whose
speeds differ by up to 2x: a wall time or a profiled rate means little without the processor's name beside it.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

__all__ = ["cpu_model"]


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it, else what :mod:`platform` knows (``x86_64``)."""
    try:
        match = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    except OSError:
        match = None
    return match.group(1).strip() if match else (platform.processor() or platform.machine())
