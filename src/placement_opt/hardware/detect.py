"""The only code that asks this machine about itself: free GPU memory, available RAM, free disk space.

:func:`detect_device` returns a :class:`~placement_opt.hardware.devices.Device` with today's
capacity and the saved profile's speeds (:mod:`.profile_store`), or a datasheet preset's.
"""

from __future__ import annotations

import shutil

from .devices import (
    Device,
    _gpu_index,
    _kind_of,
    _with_default_speeds,
    normalize_device_name,
    replace_device,
)
from .profile_store import saved_device

__all__ = ["detect_device"]


def detect_device(name: str | int, *, dtype: str = "float16") -> Device:
    """Capacity of ``name`` on this machine; speeds from the saved profile when there is one.

    GPUs need torch with CUDA; the CPU's capacity is the RAM available now; the disk's is the
    free space of the current directory. ``dtype`` picks which measured FLOP/s the device carries.
    """
    canonical = normalize_device_name(name)
    measured = saved_device(canonical, dtype=dtype)
    kind = _kind_of(canonical)
    if kind == "cpu":
        import psutil

        capacity = int(psutil.virtual_memory().available * 0.9)
    elif kind == "disk":
        capacity = shutil.disk_usage(".").free
    else:
        capacity = _cuda_capacity(canonical)
    if measured is not None:
        return replace_device(measured, memory_bytes=capacity)
    device = _with_default_speeds(canonical, capacity)
    return replace_device(device, source=f"detected capacity, {device.source}")


def _cuda_capacity(name: str) -> int:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    index = _gpu_index(name)
    if torch is None or not torch.cuda.is_available() or index >= torch.cuda.device_count():
        count = 0 if torch is None or not torch.cuda.is_available() else torch.cuda.device_count()
        raise ValueError(
            f"{name} is not on this machine ({count} CUDA device(s) visible): describe it instead, "
            f"e.g. '{name}=a100-40gb' or Device.preset('a100-40gb', name='{name}')"
        )
    free, _total = torch.cuda.mem_get_info(index)
    return int(free)
