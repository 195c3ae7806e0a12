"""Devices and machines: where weights can live and where layers can compute.

A :class:`Device` is one memory (a GPU's HBM, CPU RAM, a disk) with its capacity and
speeds; a :class:`Machine` is a set of devices plus the links between them. Speeds
come from a datasheet preset, a profile measured on this machine
(:func:`placement_opt.profile`), or the user; measured figures win.

No I/O here: :mod:`.detect` asks this machine for capacities, and :mod:`.resolve` turns what a
user calls a machine (a list of devices or names, an accelerate-style ``max_memory`` dict, a spec
string such as ``"cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=256GiB,disk"``) into a :class:`Machine`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..units import GIB, MIB, format_bytes, parse_size

__all__ = [
    "Device",
    "Machine",
    "DevicePreset",
    "PRESETS",
    "normalize_device_name",
    "DEFAULT_GPU_RESERVE_BYTES",
    "replace_device",
]

#: CUDA context plus allocator slack kept free on every GPU whose capacity was not given by the user.
DEFAULT_GPU_RESERVE_BYTES = 1 * GIB

_NAME_RE = re.compile(r"^(cuda:(\d+)|cpu|disk)$")
_HALF_DTYPES = ("float16", "bfloat16", "half", "fp16", "bf16")


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

# Link latencies: a kernel launch plus copy setup over PCIe/NVLink, a read request on a disk.
_LATENCY_S = {"pcie": 10e-6, "nvlink": 5e-6, "disk": 100e-6}


def normalize_device_name(name: str | int) -> str:
    """``0`` / ``"0"`` / ``"cuda"`` / ``"cuda:0"`` -> ``"cuda:0"``; ``"cpu"``, ``"disk"`` unchanged.

    Raises:
        ValueError: the name is not a device; lists the accepted forms.
    """
    if isinstance(name, bool):
        raise ValueError(f"device {name!r} is not a device name: use 'cuda:N', 'cpu' or 'disk'")
    if isinstance(name, int):
        if name < 0:
            raise ValueError(f"device index {name} is negative: GPU indices start at 0")
        return f"cuda:{name}"
    text = str(name).strip().lower()
    if text.isdigit():
        return f"cuda:{int(text)}"
    if text in ("cuda", "gpu"):
        return "cuda:0"
    if text.startswith("gpu:"):
        text = "cuda:" + text[4:]
    if not _NAME_RE.match(text):
        raise ValueError(
            f"unknown device name {name!r}: accepted are 'cuda:N' (or an int N), 'cpu' and 'disk'"
        )
    return text


def _kind_of(name: str) -> str:
    return "gpu" if name.startswith("cuda:") else name


def _preset(key: str) -> DevicePreset:
    try:
        return PRESETS[key.lower()]
    except KeyError:
        raise ValueError(
            f"unknown device preset {key!r}: accepted are {', '.join(sorted(PRESETS))}"
        ) from None


def _is_half(dtype: str) -> bool:
    return str(dtype).replace("torch.", "") in _HALF_DTYPES


@dataclass(frozen=True, init=False)
class Device:
    """One memory and compute resource.

    Example::

        Device("cuda:0", "24GiB", flops=165e12, bandwidth=1.0e12)
        Device.preset("a100-40gb", name="cuda:1")
        Device("cpu", "64GiB")          # speeds of the 'cpu-desktop' class
        Device("disk", "1TB", bandwidth=3e9)

    Args:
        name: ``"cuda:N"``, ``"cpu"`` or ``"disk"`` (an int N means ``"cuda:N"``).
        memory: capacity in bytes, or a size string (``"24GiB"``, ``"500MB"``).
        flops: peak dense FLOP/s in the model's dtype; default: the kind's default preset.
        bandwidth: memory bandwidth (disk: sequential read) in bytes/s; default as ``flops``.
        reserve: bytes kept free for the CUDA context and allocator slack (GPUs only).
        source: where the speeds come from (``"user"``, ``"datasheet:<preset>"``, ``"measured"``...).
        flops_by_tokens: measured achieved FLOP/s of a linear layer by tokens per forward, as
            ``((tokens, flop_per_s), ...)`` (small batches run matmuls far below peak); the cost
            model interpolates it and uses ``flops`` where it is empty.

    Raises:
        ValueError: unknown name, malformed or negative size, non-positive speed.
    """

    name: str
    kind: str
    memory_bytes: int
    flops_per_s: float
    bandwidth_bytes_per_s: float
    reserve_bytes: int
    host_link_bytes_per_s: float
    peer_link_bytes_per_s: float
    source: str
    flops_by_tokens: tuple[tuple[int, float], ...]

    def __init__(
        self,
        name: str | int,
        memory: int | float | str,
        *,
        flops: float | None = None,
        bandwidth: float | None = None,
        reserve: int | str | None = None,
        host_link: float | None = None,
        peer_link: float | None = None,
        source: str | None = None,
        flops_by_tokens: Iterable[tuple[int, float]] = (),
    ) -> None:
        canonical = normalize_device_name(name)
        kind = _kind_of(canonical)
        default = PRESETS[DEFAULT_PRESET[kind]]
        memory_bytes = parse_size(memory, what=f"memory of {canonical}")
        for label, value in (("flops", flops), ("bandwidth", bandwidth), ("host_link", host_link),
                             ("peer_link", peer_link)):
            if value is not None and not (float(value) > 0):
                raise ValueError(f"{label} of {canonical} is {value!r}: speeds must be > 0 per second")
        if kind == "gpu":
            reserve_bytes = DEFAULT_GPU_RESERVE_BYTES if reserve is None else parse_size(
                reserve, what=f"reserve of {canonical}")
        else:
            reserve_bytes = 0 if reserve is None else parse_size(reserve, what=f"reserve of {canonical}")
        guessed = flops is None or bandwidth is None
        values = {
            "name": canonical,
            "kind": kind,
            "memory_bytes": memory_bytes,
            "flops_per_s": float(flops if flops is not None else default.half_flops_per_s),
            "bandwidth_bytes_per_s": float(
                bandwidth if bandwidth is not None else default.bandwidth_bytes_per_s),
            "reserve_bytes": reserve_bytes,
            "host_link_bytes_per_s": float(host_link or default.host_link_bytes_per_s),
            "peer_link_bytes_per_s": float(peer_link or default.peer_link_bytes_per_s),
            "source": source or (f"default:{default.key}" if guessed else "user"),
            "flops_by_tokens": _check_curve(canonical, flops_by_tokens),
        }
        for key, value in values.items():
            object.__setattr__(self, key, value)

    @classmethod
    def preset(
        cls,
        key: str,
        *,
        name: str | int | None = None,
        memory: int | str | None = None,
        dtype: str = "float16",
        reserve: int | str | None = None,
    ) -> Device:
        """A device with a preset's datasheet figures, e.g. ``Device.preset("a100-40gb", name="cuda:0")``.

        Args:
            key: a key of :data:`PRESETS`.
            name: device name; default ``"cuda:0"``, ``"cpu"`` or ``"disk"`` by the preset's kind.
            memory: capacity override (e.g. the RAM of this particular server).
            dtype: the model dtype, which picks the half-precision or FP32 FLOP/s.
        """
        p = _preset(key)
        canonical = normalize_device_name(name if name is not None else
                                          {"gpu": "cuda:0", "cpu": "cpu", "disk": "disk"}[p.kind])
        if _kind_of(canonical) != p.kind:
            raise ValueError(f"preset {key!r} is a {p.kind} but device {canonical!r} is a "
                             f"{_kind_of(canonical)}: pick a {_kind_of(canonical)} preset")
        flops = p.half_flops_per_s if _is_half(dtype) else p.fp32_flops_per_s
        return cls(canonical, p.memory_bytes if memory is None else memory,
                   flops=flops or None, bandwidth=p.bandwidth_bytes_per_s, reserve=reserve,
                   host_link=p.host_link_bytes_per_s or None, peer_link=p.peer_link_bytes_per_s or None,
                   source=f"datasheet:{p.key}")

    def with_memory(self, memory: int | str) -> Device:
        """The same device with another capacity."""
        return replace_device(self, memory_bytes=parse_size(memory, what=f"memory of {self.name}"))

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def usable_bytes(self) -> int:
        """Capacity left for the model once the reserve is taken."""
        return max(0, self.memory_bytes - self.reserve_bytes)

    @property
    def accelerate_key(self) -> int | str:
        """This device as accelerate writes it in ``device_map``/``max_memory``: ``0``, ``"cpu"``, ``"disk"``."""
        return int(self.name.split(":")[1]) if self.is_gpu else self.name

    def to_dict(self) -> dict[str, Any]:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["flops_by_tokens"] = [list(point) for point in self.flops_by_tokens]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Device:
        return cls(data["name"], int(data["memory_bytes"]), flops=data["flops_per_s"] or None,
                   bandwidth=data["bandwidth_bytes_per_s"], reserve=int(data["reserve_bytes"]),
                   host_link=data.get("host_link_bytes_per_s") or None,
                   peer_link=data.get("peer_link_bytes_per_s") or None, source=data.get("source"),
                   flops_by_tokens=[tuple(p) for p in data.get("flops_by_tokens", ())])

    def __str__(self) -> str:
        return (f"{self.name} ({format_bytes(self.memory_bytes)}, {self.flops_per_s / 1e12:.3g} TFLOP/s, "
                f"{self.bandwidth_bytes_per_s / 1e9:.3g} GB/s, {self.source})")


def _check_curve(name: str, points: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    curve = tuple(sorted((int(t), float(f)) for t, f in points))
    bad = [p for p in curve if p[0] < 1 or not p[1] > 0]
    if bad:
        raise ValueError(f"flops_by_tokens of {name} has {bad}: tokens must be >= 1 and FLOP/s > 0")
    return curve


def replace_device(device: Device, **changes: Any) -> Device:
    """A copy of ``device`` with some fields changed (``dataclasses.replace`` cannot call our __init__)."""
    data = device.to_dict()
    data.update(changes)
    return Device.from_dict(data)


@dataclass(frozen=True)
class Machine:
    """Devices plus the bandwidth of every link between them.

    Args:
        devices: the devices; at most one ``cpu`` and one ``disk``; names unique.
        links: ``{(src, dst): bytes_per_s}`` overrides. Defaults: host <-> GPU at the GPU's host
            link (PCIe), GPU <-> GPU at the slower peer link of the two, disk -> host at the disk's
            read bandwidth, disk -> GPU through the host (the slower of the two hops).

    Raises:
        ValueError: duplicate devices, or a link naming a device the machine lacks.
    """

    devices: tuple[Device, ...]
    links: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def __init__(self, devices: Iterable[Device], links: Mapping[tuple[str, str], float] | None = None):
        devs = tuple(devices)
        names = [d.name for d in devs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"machine lists {', '.join(duplicates)} more than once: name each device once")
        if not devs:
            raise ValueError("a machine needs at least one device, e.g. ['cpu'] or {'cpu': '64GiB'}")
        checked: dict[tuple[str, str], float] = {}
        for (src, dst), bw in (links or {}).items():
            key = (normalize_device_name(src), normalize_device_name(dst))
            unknown = [n for n in key if n not in names]
            if unknown:
                raise ValueError(f"link {src}->{dst} names {unknown}, not in the machine ({', '.join(names)})")
            if not float(bw) > 0:
                raise ValueError(f"link {src}->{dst} bandwidth is {bw!r}: it must be > 0 bytes/s")
            checked[key] = float(bw)
        # GPUs in index order first, then cpu, then disk: the fill order accelerate uses.
        order = {"gpu": 0, "cpu": 1, "disk": 2}
        devs = tuple(sorted(devs, key=lambda d: (order[d.kind], _gpu_index(d.name))))
        object.__setattr__(self, "devices", devs)
        object.__setattr__(self, "links", checked)

    # -- lookup -------------------------------------------------------------------------
    def __getitem__(self, name: str | int) -> Device:
        canonical = normalize_device_name(name)
        for device in self.devices:
            if device.name == canonical:
                return device
        raise ValueError(f"device {canonical!r} is not in this machine ({', '.join(self.names)})")

    def __contains__(self, name: object) -> bool:
        try:
            return any(d.name == normalize_device_name(name) for d in self.devices)  # type: ignore[arg-type]
        except ValueError:
            return False

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.devices]

    @property
    def gpus(self) -> list[Device]:
        return [d for d in self.devices if d.is_gpu]

    @property
    def cpu(self) -> Device | None:
        return next((d for d in self.devices if d.kind == "cpu"), None)

    @property
    def disk(self) -> Device | None:
        return next((d for d in self.devices if d.kind == "disk"), None)

    @property
    def compute_devices(self) -> list[Device]:
        """Devices that can execute a layer: GPUs and the CPU."""
        return [d for d in self.devices if d.kind != "disk"]

    # -- links --------------------------------------------------------------------------
    def bandwidth(self, src: str, dst: str) -> float:
        """Bytes/s from ``src`` to ``dst`` (infinite for a device to itself)."""
        if src == dst:
            return float("inf")
        if (src, dst) in self.links:
            return self.links[(src, dst)]
        a, b = self[src], self[dst]
        kinds = {a.kind, b.kind}
        if kinds == {"gpu"}:
            return min(a.peer_link_bytes_per_s, b.peer_link_bytes_per_s)
        if kinds == {"gpu", "cpu"}:
            return (a if a.is_gpu else b).host_link_bytes_per_s
        if kinds == {"cpu", "disk"}:
            return (a if a.kind == "disk" else b).bandwidth_bytes_per_s
        if kinds == {"gpu", "disk"}:
            host = self.cpu.name if self.cpu else "cpu"
            gpu = a if a.is_gpu else b
            disk = a if a.kind == "disk" else b
            via_host = self.links.get((disk.name, host), disk.bandwidth_bytes_per_s)
            return min(via_host, self.links.get((host, gpu.name), gpu.host_link_bytes_per_s))
        return min(a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s)

    def latency_s(self, src: str, dst: str) -> float:
        """Fixed cost of one transfer from ``src`` to ``dst``."""
        if src == dst:
            return 0.0
        kinds = {_kind_of(src), _kind_of(dst)}
        if "disk" in kinds:
            return _LATENCY_S["disk"]
        if kinds == {"gpu"} and self.bandwidth(src, dst) > 100e9:
            return _LATENCY_S["nvlink"]
        return _LATENCY_S["pcie"]

    # -- conversions ----------------------------------------------------------------------
    @property
    def max_memory(self) -> dict[int | str, int]:
        """accelerate-style ``max_memory`` (usable bytes, reserve already taken off)."""
        return {d.accelerate_key: d.usable_bytes for d in self.devices}

    def to_dict(self) -> dict[str, Any]:
        return {"devices": [d.to_dict() for d in self.devices],
                "links": [[s, t, bw] for (s, t), bw in self.links.items()]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Machine:
        return cls([Device.from_dict(d) for d in data["devices"]],
                   {(s, t): bw for s, t, bw in data.get("links", [])})

    def __str__(self) -> str:
        return "Machine(" + "; ".join(str(d) for d in self.devices) + ")"


def _gpu_index(name: str) -> int:
    return int(name.split(":")[1]) if name.startswith("cuda:") else 0


def _with_default_speeds(name: str, memory: int) -> Device:
    kind = _kind_of(name)
    return Device.preset(DEFAULT_PRESET[kind], name=name, memory=memory)
