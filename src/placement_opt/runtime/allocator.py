"""glibc's mmap threshold, fixed for a process that computes units on the CPU (opt-in).

Call ``fix_mmap_threshold()`` once, before the first forward, where the CPU's RAM is tight enough that
the predicted CPU peak must hold::

    from placement_opt.runtime.allocator import fix_mmap_threshold
    fix_mmap_threshold()                      # 64 KiB: RSS follows the live tensors
    handle = placement_opt.dispatch(model, plan)

glibc serves a block of at least ``M_MMAP_THRESHOLD`` bytes with a mapping of its own, unmapped when
freed; smaller blocks come from the heap, whose freed middle stays in the process. By default the
threshold is *dynamic*: once a mapped block is freed, the threshold rises to that block's size (up to
32 MiB), so later activations below it come from the heap, and the process's peak RSS depends on the
order in which a forward frees its tensors. Measured (benchmarks/cost_accuracy/MEMORY.md): the RSS
peak of one forward ran 1-93 % above its live tensor bytes, and differed from run to run (352, 432
and 504 MiB for one row), so no model of the tensors can bound it.

A fixed threshold (``mallopt(M_MMAP_THRESHOLD, n)``, which also turns the dynamic adjustment off)
gives every activation of ``n`` bytes or more its own mapping, returned when freed: the RSS then
follows the live tensors, which is what the cost model predicts. The price is a page fault per
fresh page of each such block, and a decode step's KV cache, which grows by concatenation, is such a
block in every layer: measured on 2 cores, 1 thread, fp32 (3 fresh processes each, medians), a
hidden-512 batch 16 x 512 prefill +17 % and its decode step +12 %; a hidden-2048 batch 1 x 128 prefill
+5 % and decode step +16 %; again on 2026-11-27 (``benchmarks/cost_accuracy/ALLOCATOR.md``) +18 % and
+12 %, and for a 4-layer hidden-2048 +7 % and +4 %. A fixed 1 MiB costs about the same and lets blocks
below it pile up in the heap (batch-1 rows then measured up to 1 MiB above their prediction). That is why it
is not the default: most plans are priced with room to spare, and the time matters to all of them.

The setting is the process's, and glibc has no way back to the dynamic threshold: it stays after
``remove()``.

:func:`~placement_opt.dispatch` warns when a plan leaves the CPU less free RAM than the activations and
KV cache it computes there (what the heap can hold again; 64 MiB or more) and this process has not fixed the
threshold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from ..errors import PlacementError

__all__ = ["DEFAULT_CPU_MMAP_THRESHOLD_BYTES", "fix_mmap_threshold", "glibc_heap", "mmap_threshold_fixed",
           "trim_heap"]

#: glibc's ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (malloc.h).
_M_MMAP_THRESHOLD = -3

#: The default threshold: 64 KiB, every activation of a real model above it. With it, the predicted CPU peak met ``1.00 <= predicted / measured <= 1.15``
#: in 18 of 28 rows of benchmarks/cost_accuracy/memory.py (glibc's dynamic threshold: 1 of 28).
DEFAULT_CPU_MMAP_THRESHOLD_BYTES = 64 * 2**10

#: glibc's range of the threshold: a page, and ``HEAP_MAX / 2`` (32 MiB) on 64-bit.
_MIN_THRESHOLD_BYTES = 4 * 2**10
_MAX_THRESHOLD_BYTES = 32 * 2**20

_fixed: list[int] = []


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None (musl, macOS, Windows: no ``mallopt``, nothing to fix)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:  # pragma: no cover - no C library by that name
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def fix_mmap_threshold(threshold_bytes: int = DEFAULT_CPU_MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes`` for this process (for good: see the module).

    Returns:
        True once set; False where there is no glibc (nothing to fix) or glibc refused the value.

    Raises:
        PlacementError: ``threshold_bytes`` is not an int between 4 KiB and 32 MiB (glibc's range).
    """
    if isinstance(threshold_bytes, bool) or not isinstance(threshold_bytes, int) or not (
            _MIN_THRESHOLD_BYTES <= threshold_bytes <= _MAX_THRESHOLD_BYTES):
        raise PlacementError(f"fix_mmap_threshold(threshold_bytes={threshold_bytes!r}): want an int from "
                             f"{_MIN_THRESHOLD_BYTES} to {_MAX_THRESHOLD_BYTES} (glibc's range; 65536 is the default)")
    libc = _libc()
    if libc is None:
        return False
    done = bool(libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold_bytes)))
    if done:
        _fixed.append(threshold_bytes)
    return done


def glibc_heap() -> bool:
    """Whether this process allocates from glibc's heap (what :func:`fix_mmap_threshold` fixes)."""
    return _libc() is not None


def mmap_threshold_fixed() -> int | None:
    """The threshold this process fixed last through :func:`fix_mmap_threshold`, or None."""
    return _fixed[-1] if _fixed else None


def trim_heap() -> bool:
    """Give the free pages of glibc's heap back to the system (``malloc_trim(0)``): after a calibration or any
    large work in this process, the RAM a later forward takes is then what it allocates, not what it reuses.

    Returns:
        True when glibc released some memory; False where there is none to release or no glibc.
    """
    libc = _libc()
    return bool(libc.malloc_trim(ctypes.c_size_t(0))) if libc is not None and hasattr(libc, "malloc_trim") else False
