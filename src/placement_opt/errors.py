"""The one small exception hierarchy of placement_opt.

Every error says what is wrong, by how much, and what to do about it.
``PlacementError`` subclasses ``ValueError`` so that callers that validate
input with ``except ValueError`` keep working.
"""

from __future__ import annotations

__all__ = [
    "PlacementError",
    "InfeasiblePlacementError",
    "TraceError",
    "DispatchError",
]


class PlacementError(ValueError):
    """Base class of every error raised by placement_opt."""


class InfeasiblePlacementError(PlacementError):
    """No placement satisfies every capacity: the message says which one is short and by how much."""


class TraceError(PlacementError):
    """The model could not be turned into a layer graph."""


class DispatchError(PlacementError):
    """A plan could not be applied to a model."""
