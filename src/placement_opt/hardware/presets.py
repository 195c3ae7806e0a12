"""Datasheet figures of device classes: the speeds a device gets when nothing was measured.

Pure data and one lookup, :func:`preset`; :class:`~.devices.Device` and ``Device.preset`` use them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from ..errors import DeviceSpecError
from ..units import GIB, MIB

__all__ = ["DevicePreset", "PRESETS", "DEFAULT_PRESET", "preset"]


@dataclass(frozen=True, kw_only=True)
class DevicePreset:
    """Datasheet figures of one device class (peak, not achieved: the cost model applies efficiencies)."""

    key: str
    kind: str
    """``"gpu"``, ``"cpu"`` or ``"disk"``."""
    description: str
    memory_bytes: int
    half_flops_per_s: float
    """Peak dense FP16/BF16 FLOP/s (tensor cores with FP32 accumulate, as PyTorch uses them)."""
    fp32_flops_per_s: float
    bandwidth_bytes_per_s: float
    """Memory bandwidth; for disks the sequential read bandwidth."""
    host_link_bytes_per_s: float = 0.0
    """GPU <-> host bandwidth achieved with pinned memory (PCIe generation x16)."""
    peer_link_bytes_per_s: float = 0.0
    """GPU <-> GPU bandwidth (NVLink per direction where the form factor has it, else PCIe)."""


def _gpu(key: str, desc: str, mem_mib: int, half_tf: float, fp32_tf: float, bw_gbs: float,
         host_gbs: float, peer_gbs: float) -> DevicePreset:
    return DevicePreset(key=key, kind="gpu", description=desc, memory_bytes=mem_mib * MIB,
                        half_flops_per_s=half_tf * 1e12, fp32_flops_per_s=fp32_tf * 1e12,
                        bandwidth_bytes_per_s=bw_gbs * 1e9, host_link_bytes_per_s=host_gbs * 1e9,
                        peer_link_bytes_per_s=peer_gbs * 1e9)


# Memory is the total the driver reports (MiB); FLOP/s are NVIDIA datasheet dense figures;
# host links are achieved pinned-copy rates (PCIe 3.0 x16 ~12, 4.0 ~25, 5.0 ~50 GB/s).
_GPU_PRESETS = [
    _gpu("h100-sxm", "NVIDIA H100 SXM5 80GB", 81559, 989.0, 67.0, 3350, 50, 450),
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", 81559, 756.0, 51.0, 2000, 50, 50),
    _gpu("h200", "NVIDIA H200 SXM 141GB", 143771, 989.0, 67.0, 4800, 50, 450),
    _gpu("a100-40gb", "NVIDIA A100 SXM4 40GB", 40960, 312.0, 19.5, 1555, 25, 300),
    _gpu("a100-80gb", "NVIDIA A100 SXM4 80GB", 81920, 312.0, 19.5, 2039, 25, 300),
    _gpu("l40s", "NVIDIA L40S 48GB", 46068, 362.0, 91.6, 864, 25, 25),
    _gpu("a10", "NVIDIA A10 24GB", 23028, 125.0, 31.2, 600, 25, 25),
    _gpu("l4", "NVIDIA L4 24GB", 23034, 121.0, 30.3, 300, 25, 25),
    _gpu("t4", "NVIDIA T4 16GB", 15360, 65.0, 8.1, 320, 12, 12),
    _gpu("v100-32gb", "NVIDIA V100 SXM2 32GB", 32768, 125.0, 15.7, 900, 12, 150),
    _gpu("rtx-3060", "NVIDIA GeForce RTX 3060 12GB", 12288, 25.6, 12.7, 360, 25, 25),
    _gpu("rtx-3090", "NVIDIA GeForce RTX 3090 24GB", 24576, 35.6, 35.6, 936, 25, 25),
    _gpu("rtx-4090", "NVIDIA GeForce RTX 4090 24GB", 24564, 165.2, 82.6, 1008, 25, 25),
]
_HOST_PRESETS = [
    DevicePreset(key="cpu-laptop", kind="cpu", description="4-8 core laptop CPU, dual-channel DDR4",
                 memory_bytes=16 * GIB, half_flops_per_s=0.1e12, fp32_flops_per_s=0.3e12,
                 bandwidth_bytes_per_s=40e9),
    DevicePreset(key="cpu-desktop", kind="cpu", description="16-core desktop CPU, dual-channel DDR5",
                 memory_bytes=64 * GIB, half_flops_per_s=0.5e12, fp32_flops_per_s=1.0e12,
                 bandwidth_bytes_per_s=60e9),
    DevicePreset(key="cpu-server", kind="cpu", description="2-socket 64-core server, 16-channel DDR5",
                 memory_bytes=512 * GIB, half_flops_per_s=4.0e12, fp32_flops_per_s=4.0e12,
                 bandwidth_bytes_per_s=300e9),
    DevicePreset(key="nvme-gen4", kind="disk", description="PCIe 4.0 NVMe SSD", memory_bytes=2 * 10**12,
                 half_flops_per_s=0.0, fp32_flops_per_s=0.0, bandwidth_bytes_per_s=7e9),
    DevicePreset(key="nvme-gen3", kind="disk", description="PCIe 3.0 NVMe SSD", memory_bytes=1 * 10**12,
                 half_flops_per_s=0.0, fp32_flops_per_s=0.0, bandwidth_bytes_per_s=3.5e9),
    DevicePreset(key="sata-ssd", kind="disk", description="SATA SSD", memory_bytes=1 * 10**12,
                 half_flops_per_s=0.0, fp32_flops_per_s=0.0, bandwidth_bytes_per_s=0.55e9),
    DevicePreset(key="hdd", kind="disk", description="7200 rpm hard disk", memory_bytes=4 * 10**12,
                 half_flops_per_s=0.0, fp32_flops_per_s=0.0, bandwidth_bytes_per_s=0.2e9),
]
#: Every preset by key.
PRESETS: dict[str, DevicePreset] = {p.key: p for p in _GPU_PRESETS + _HOST_PRESETS}
#: The preset whose speeds a device of each kind gets when nothing better is known.
DEFAULT_PRESET = {"gpu": "a100-40gb", "cpu": "cpu-desktop", "disk": "nvme-gen4"}


def preset(key: str) -> DevicePreset:
    """The preset named ``key`` (case-insensitive, spaces around ignored, as in a spec string).

    Raises:
        DeviceSpecError: no preset has that key; the message lists every key.
    """
    if not isinstance(key, str):  # None or an int raised a bare AttributeError
        raise DeviceSpecError(f"device preset {key!r} is a {type(key).__name__}, not a preset's name: give one of "
                              f"{', '.join(sorted(PRESETS))}")
    try:
        return PRESETS[key.strip().lower()]
    except KeyError:
        raise DeviceSpecError(
            f"unknown device preset {key!r}{did_you_mean(key)}: accepted are {', '.join(sorted(PRESETS))}"
        ) from None


def did_you_mean(token: str) -> str:
    """`` (did you mean ...?)`` for a mistyped preset: the same name spelled with hyphens, else the presets of
    its family (``h100-80gb``: the H100s, not the A100-80GB that spells closest), else the closest spellings;
    empty when nothing is close."""
    norm = token.strip().lower().replace("_", "-")
    family = norm.split("-")[0]
    close = ([norm] if norm in PRESETS else sorted(p for p in PRESETS if p.split("-")[0] == family)
             or difflib.get_close_matches(norm, list(PRESETS), n=3, cutoff=0.6))
    if not close:
        return ""
    names = [repr(c) for c in close]
    return f" (did you mean {', '.join(names[:-1]) + ' or ' + names[-1] if len(names) > 1 else names[0]}?)"
