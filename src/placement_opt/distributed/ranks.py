"""Per-rank planning: what a plan made on one rank of a distributed run says about itself.

The machine a rank plans for (its own GPU and 1/N of the host's CPU RAM and disk) is worked out by
:func:`placement_opt.hardware.resolve.resolve_machine`, given the launch context from
:func:`~.context.current_context`; :func:`plan_note` is the line ``solve()`` adds to such a plan.
"""

from __future__ import annotations

from ..hardware.devices import Machine
from ..units import format_bytes
from .context import RuntimeContext

__all__ = ["plan_note"]


def plan_note(machine: Machine, context: RuntimeContext) -> str | None:
    """The note a plan made for one rank carries, or None in a single process.

    Example::

        plan_note(local, ddp_rank_1_of_2)
        # "planned for rank 1 of 2 (DDP) only: cuda:1, cpu 32.00 GiB, disk ... (1/2 of this host's)"
    """
    if not context.is_distributed:
        return None
    host = [f"{d.name} {format_bytes(d.memory_bytes)}" for d in machine.devices if not d.is_gpu]
    share = f" (1/{context.local_world_size} of this host's)" if context.local_world_size > 1 and host else ""
    gpu = next((d.name for d in machine.devices if d.is_gpu), "no GPU")
    placed = (f"; {context.label} will place and shard the model itself, so this plan sizes one "
              f"full replica" if context.framework_places else "")
    return (f"planned for {context.describe()} only: {gpu}, {', '.join(host) or 'no host memory'}{share}"
            f"{placed}")
