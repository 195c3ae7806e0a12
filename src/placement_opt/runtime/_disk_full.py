"""The error of an offload folder whose disk filled up while :func:`~.dispatcher.dispatch` or :func:`~.loader.load`
wrote into it: what was being written, where, how much the plan stores on disk, how much is free, what to do.

A bare ``OSError: [Errno 28] No space left on device`` names none of these: the caller cannot tell whether the
folder was merely too small for the plan or on the wrong disk altogether.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterable

from torch import nn

from ..errors import DispatchError
from ..model.graph import covering_key
from ..plan import Plan
from ..units import format_bytes
from .checkpoint import Slot, collect_slots

__all__ = ["is_disk_full", "disk_full_error", "disk_bytes", "plan_disk_slots"]


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the user's quota on it) is full."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full_error(who: str, what: str, folder: str | os.PathLike[str], needed_bytes: int,
                    kept: str) -> DispatchError:
    """The DispatchError of ``who`` (``"dispatch of LlamaForCausalLM"``) running out of space writing ``what`` into
    ``folder``, whose plan stores ``needed_bytes`` on disk; ``kept``: what became of the model and the files written."""
    try:
        free = f"{format_bytes(shutil.disk_usage(folder).free)} free there now"
    except OSError:
        free = "the free space there cannot be read"
    return DispatchError(
        f"{who} ran out of disk space writing {what} into offload_dir ({folder}): its plan stores "
        f"{format_bytes(needed_bytes)} of weights on disk, {free}; free space there or choose a folder on a larger "
        f"disk ({kept})")


def disk_bytes(slots: Iterable[Slot]) -> int:
    """The bytes of these tensors, each counted once (meta tensors count their size too)."""
    return sum({id(slot): slot.tensor.nbytes for slot in slots}.values())


def plan_disk_slots(model: nn.Module, plan: Plan) -> list[Slot]:
    """The tensors of ``model`` that ``plan`` stores on disk."""
    storage = {p.unit: p.storage for p in plan.placements}
    return [slot for slot in collect_slots(model) if storage.get(covering_key(slot.names[0], storage) or "") == "disk"]
