"""The only code that asks this machine about itself: GPUs, free GPU memory, available RAM, free disk.

:func:`cuda_device_count` counts the GPUs this process sees; :func:`detect_device` returns a
:class:`~placement_opt.hardware.devices.Device` with today's capacity and the saved profile's
speeds (:mod:`.profile_store`), or a datasheet preset's. torch and psutil are imported only when
asked, so a single process that names its devices never imports torch.
"""

from __future__ import annotations

import shutil

from ..errors import DeviceSpecError
from .devices import Device, device_kind, gpu_index, normalize_device_name, replace_device
from .profile_store import saved_device

__all__ = ["cuda_device_count", "detect_device", "local_device_names"]


def cuda_device_count() -> int:
    """GPUs this process sees (0 without CUDA); imports torch."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_device_names() -> list[str]:
    """This machine as names: every visible GPU, then ``"cpu"`` and ``"disk"``."""
    return [f"cuda:{i}" for i in range(cuda_device_count())] + ["cpu", "disk"]


def detect_device(name: str | int, *, dtype: str = "float16") -> Device:
    """Capacity of ``name`` on this machine; speeds from the saved profile when there is one.

    GPUs need torch with CUDA; the CPU's capacity is the RAM available now; the disk's is the
    free space of the current directory. ``dtype`` picks which measured FLOP/s the device carries.

    Raises:
        DeviceSpecError: ``name`` is a GPU this process does not see.
    """
    canonical = normalize_device_name(name)
    measured = saved_device(canonical, dtype=dtype)
    kind = device_kind(canonical)
    if kind == "cpu":
        import psutil

        capacity = int(psutil.virtual_memory().available * 0.9)
    elif kind == "disk":
        capacity = shutil.disk_usage(".").free
    else:
        capacity = _cuda_capacity(canonical)
    if measured is not None:
        return replace_device(measured, memory_bytes=capacity)
    device = Device.with_default_speeds(canonical, capacity)
    return replace_device(device, source=f"detected capacity, {device.source}")


def _cuda_capacity(name: str) -> int:
    count = cuda_device_count()
    if gpu_index(name) >= count:
        raise DeviceSpecError(
            f"{name} is not on this machine ({count} CUDA device(s) visible): describe it instead, "
            f"e.g. '{name}=a100-40gb' or Device.preset('a100-40gb', name='{name}')"
        )
    import torch

    free, _total = torch.cuda.mem_get_info(gpu_index(name))
    return int(free)
