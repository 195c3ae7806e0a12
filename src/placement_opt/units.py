"""Byte sizes and durations: parsing user strings and printing them for people."""

from __future__ import annotations

import math
import re

from .errors import DeviceSpecError

__all__ = ["parse_size", "format_bytes", "format_seconds", "seconds_or_dash", "ratio_or_dash", "few", "GIB", "MIB", "KIB"]

KIB = 1024
MIB = 1024**2
GIB = 1024**3

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": 1024**4,
}
#: Past this an int size is refused by parse_size itself: float() and format_bytes overflow near 2**1024, so the
#: device's own cap (far lower) could not say how much it is.
_MAX_SIZE = 2**1000
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, *, what: str = "size") -> int:
    """Return a byte count from an int or a string such as ``"24GiB"``, ``"500MB"`` or ``"1.5 GB"``.

    Follows accelerate's convention: ``GB`` is 10**9 bytes, ``GiB`` is 2**30.

    Example::

        >>> from placement_opt.units import parse_size
        >>> parse_size("24GiB"), parse_size("500MB"), parse_size(1024)
        (25769803776, 500000000, 1024)

    Raises:
        DeviceSpecError: the value is malformed or negative (a ``ValueError``); the message names
            it and lists the units.
    """
    if isinstance(value, bool):
        raise DeviceSpecError(f"{what} {value!r} is not a size: give bytes (int) or a string like '24GiB'")
    if isinstance(value, int):  # exact: float() of an int past 1e308 raised OverflowError, and rounds past 2**53
        if value < 0:
            raise DeviceSpecError(f"{what} {value!r} is negative: capacities are >= 0 bytes")
        if value > _MAX_SIZE:  # its digits would flood the message (and str() raises past 4300 of them)
            raise DeviceSpecError(f"{what} is an int of {value.bit_length()} bits, beyond 2**1000 bytes: give the "
                                  f"device's real capacity, e.g. '24GiB'")
        return value
    if isinstance(value, float):
        number, scale = value, 1
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            accepted = ", ".join(u for u in _SIZE_UNITS if u)
            raise DeviceSpecError(
                f"{what} {value!r} is not a size: write a number and a unit, e.g. '24GiB' or '500MB' "
                f"(units: {accepted})"
            )
        number, scale = float(match.group(1)), _SIZE_UNITS[unit]
    else:
        raise DeviceSpecError(
            f"{what} {value!r} has type {type(value).__name__}: give bytes (int) or a string like '24GiB'"
        )
    if not math.isfinite(number) or number < 0:
        raise DeviceSpecError(f"{what} {value!r} is negative or not finite: capacities are >= 0 bytes")
    return int(number * scale)


def format_bytes(num_bytes: int | float) -> str:
    """``1712324608`` -> ``'1.59 GiB'``; keeps the sign of negative numbers."""
    sign = "-" if num_bytes < 0 else ""
    size = abs(float(num_bytes))
    for unit, scale in (("TiB", 1024**4), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if size >= scale:
            return f"{sign}{size / scale:.2f} {unit}"
    return f"{sign}{int(size)} B"


def format_seconds(seconds: float) -> str:
    """A duration with a unit people read at a glance: ``'812 us'``, ``'3.41 ms'``, ``'2.50 s'``."""
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.2f} min"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.0f} us"


def seconds_or_dash(seconds: float) -> str:
    """:func:`format_seconds`, or ``"-"`` for a time that does not exist (NaN, or infinite: did not fit)."""
    return format_seconds(seconds) if seconds == seconds and seconds != float("inf") else "-"


def ratio_or_dash(value: float, reference: float) -> str:
    """``value / reference`` as ``"1.93x"``, or ``"-"`` when either is not a finite time."""
    if not (value == value) or value == float("inf") or reference <= 0:
        return "-"
    ratio = value / reference
    return f"{ratio:.2f}x" if ratio >= 0.01 or ratio == 0 else f"{ratio:.1g}x"  # 0.004x, never 0.00x


def few(items: list[str], limit: int = 5) -> str:
    """The first ``limit`` of ``items`` joined for a message, with how many more were left out."""
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")
