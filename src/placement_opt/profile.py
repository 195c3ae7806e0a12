"""Measuring this machine: micro-benchmarks that replace datasheet figures with measured ones.

(Skeleton: ``profile()`` is built by the cost-model work; ``saved_device`` is used by device detection.)
"""

from __future__ import annotations

from .devices import Device

__all__ = ["saved_device"]


def saved_device(name: str) -> Device | None:
    """The measured figures of ``name`` from the saved profile of this machine, if any."""
    return None
