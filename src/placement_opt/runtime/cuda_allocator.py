"""PyTorch's CUDA caching allocator under a plan's GPU budget: expandable segments.

A plan's GPU figures are allocated bytes, what ``torch.cuda.max_memory_allocated`` reports. What the allocator
reserves around them is not charged, and with its default settings that can be a lot: a segment is cut up for
the requests that land in it, and a block freed in a segment that still holds a live one serves only requests
that fit in it, so a prefill whose activations change size from unit to unit leaves freed blocks no later request
fits. With ``expandable_segments:True`` a stream's memory is one segment that grows and shrinks by pages, and
what is freed goes back to the device: reserved memory follows allocated memory.

Measured on an NVIDIA H200 (torch 2.11, 2026-11-29, ``benchmarks/cost_accuracy/GPU.md``), the Llama-3.1-8B shape
under a cap of 10 GiB (``torch.cuda.set_per_process_memory_fraction``) and plans predicted at 9.93 GiB (batch 1 x
4096 prompt tokens) and 9.88 GiB (16 x 4096) allocated:

* default allocator: both ran out of memory, with 315 MiB and 2.81 GiB reserved but unallocated beside 9.66 and
  6.35 GiB allocated;
* ``expandable_segments:True``: both ran, allocated peaks 9.89 and 9.60 GiB (under the predictions), reserved peaks
  10.01 and 9.95 GiB.

The allocator reads the setting when the process first allocates CUDA memory, from ``PYTORCH_ALLOC_CONF`` or
``PYTORCH_CUDA_ALLOC_CONF``. The ``placement-opt`` command sets it for itself unless either variable is set; a
Python program sets it in its environment, or calls :func:`use_expandable_segments` before anything uses CUDA.
:func:`~placement_opt.dispatch` warns when a plan leaves a GPU less free memory than what it computes there
allocates and frees, and the setting is off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

__all__ = ["EXPANDABLE_SEGMENTS", "allocator_settings", "expandable_segments", "use_expandable_segments"]

#: The allocator setting this module is about, as the environment variables write it.
EXPANDABLE_SEGMENTS = "expandable_segments:True"

#: The variables torch reads its allocator settings from, the newer name first (torch 2.9 and later read it and
#: fall back to the older one).
_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_settings(environ: Mapping[str, str] | None = None) -> str | None:
    """The allocator settings the environment gives torch (``"expandable_segments:True,..."``), None when unset."""
    env = os.environ if environ is None else environ
    return next((env[name] for name in _VARIABLES if env.get(name)), None)


def expandable_segments(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment turns expandable segments on (``key:value`` pairs separated by commas)."""
    settings = allocator_settings(environ) or ""
    pairs = (part.split(":", 1) for part in settings.split(",") if ":" in part)
    return any(key.strip() == "expandable_segments" and value.strip().lower() == "true" for key, value in pairs)


def use_expandable_segments(environ: MutableMapping[str, str] | None = None) -> bool:
    """Turn expandable segments on for this process, unless the environment sets the allocator already (the user's
    choice stands) or CUDA was initialised before (the allocator has read its settings). Returns whether they are
    on."""
    env = os.environ if environ is None else environ
    if allocator_settings(env) is not None:
        return expandable_segments(env)
    torch = sys.modules.get("torch")  # not imported: nothing has used CUDA (and --help stays quick without it)
    if torch is not None and torch.cuda.is_initialized():
        return False
    env["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return True
