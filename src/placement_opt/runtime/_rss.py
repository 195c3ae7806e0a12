"""The process's resident set, read from ``/proc/self`` (Linux): its peak since a reset.

``echo 5 > /proc/self/clear_refs`` sets the peak (``VmHWM``) to the current resident set (``VmRSS``), so the
peak read afterwards is what the process reached since, pages of memory-mapped files included. Elsewhere (no
``/proc``, or a kernel that refuses the write) both functions answer None and the figure is not measured.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["reset_peak", "peak_bytes"]

_PROC = Path("/proc/self")


def reset_peak() -> int | None:
    """Start a new peak at the current resident set; return that resident set in bytes (None: not measurable)."""
    try:
        (_PROC / "clear_refs").write_text("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


def peak_bytes() -> int | None:
    """The resident set's peak since the last :func:`reset_peak` (or the process's start), in bytes."""
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int | None:
    try:
        lines = (_PROC / "status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == field:
            number, _, unit = value.strip().partition(" ")
            return int(number) * 1024 if unit == "kB" else None
    return None
