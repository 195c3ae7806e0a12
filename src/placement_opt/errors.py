"""The one small exception hierarchy of placement_opt.

Every error says what is wrong, by how much, and what to do about it.
``PlacementError`` subclasses ``ValueError`` so that callers that validate
input with ``except ValueError`` keep working. Raise the most specific class:

====================  ===========================================================================
class                 raised when
====================  ===========================================================================
DeviceSpecError       a device, machine or capacity description is invalid (names, sizes, specs)
WorkloadError         a workload is invalid (batch, token counts, training settings)
ModelSpecError        a model name, preset or config cannot be resolved
SolverInputError      solve() arguments are invalid (objective, limits, pins, strategy)
InfeasiblePlacement…  no placement fits the capacities (says which is short and by how much)
TraceError            the model cannot be turned into a layer graph
PlanFormatError       a plan or profile file is unreadable, malformed or for another model
DispatchError         a plan cannot be applied to a model, or a checkpoint cannot be loaded
PlanMismatchError     a plan made for another model is applied (both of the two above)
ProfileError          measuring this machine failed
ProfileFormatError    a saved profile is not JSON or malformed (both of the two above it)
====================  ===========================================================================
"""

from __future__ import annotations

__all__ = [
    "PlacementError",
    "DeviceSpecError",
    "WorkloadError",
    "ModelSpecError",
    "SolverInputError",
    "InfeasiblePlacementError",
    "TraceError",
    "PlanFormatError",
    "DispatchError",
    "PlanMismatchError",
    "ProfileError",
    "ProfileFormatError",
]


class PlacementError(ValueError):
    """Base class of every error raised by placement_opt; a ``ValueError`` for older callers.

    Example::

        try:
            plan = placement_opt.solve("llama-2-70b", {0: "24GiB", "cpu": "16GiB"})
        except placement_opt.InfeasiblePlacementError as err:
            print(err)        # which device is short, by how much, and what to change
        except placement_opt.PlacementError as err:
            print(err)        # any other bad input: the message names it and the fix
    """


class DeviceSpecError(PlacementError):
    """A device, machine or capacity description is invalid."""


class WorkloadError(PlacementError):
    """A workload is invalid."""


class ModelSpecError(PlacementError):
    """A model name, preset or configuration cannot be resolved."""


class SolverInputError(PlacementError):
    """The arguments of solve() are invalid (objective, limits, pins, strategy)."""


class InfeasiblePlacementError(PlacementError):
    """No placement satisfies every capacity: the message says which one is short and by how much."""


class TraceError(PlacementError):
    """The model could not be turned into a layer graph."""


class PlanFormatError(PlacementError):
    """A plan or profile file is unreadable, malformed, or made for another model."""


class DispatchError(PlacementError):
    """A plan could not be applied to a model."""


class PlanMismatchError(DispatchError, PlanFormatError):
    """A plan does not match the model it is applied to (units or sizes of another model): the plan is wrong for it,
    so it is both a :class:`DispatchError` (what dispatch and load raise) and a :class:`PlanFormatError`."""


class ProfileError(PlacementError):
    """Measuring this machine's devices failed."""


class ProfileFormatError(ProfileError, PlanFormatError):
    """A saved profile is not JSON, or an entry of it is malformed: the file is wrong, not the measuring, so it is
    both a :class:`ProfileError` and a :class:`PlanFormatError` (the CLI's usage errors, exit code 2)."""


def first_line(exc: BaseException) -> str:
    """The exception's first line, and the next one when the first only announces it (ends with ':'):
    huggingface_hub's validation errors put the cause on line 2."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text[:300]
