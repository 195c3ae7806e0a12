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

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DeviceSpecError, PlacementError
from ..units import GIB, format_bytes, parse_size
from .presets import DEFAULT_PRESET, PRESETS, preset

__all__ = [
    "Device",
    "Machine",
    "normalize_device_name",
    "device_kind",
    "gpu_index",
    "DEFAULT_GPU_RESERVE_BYTES",
    "MAX_MEMORY_BYTES",
    "FRESH_PAGE_MIN_BYTES",
    "replace_device",
]

#: The largest capacity a device may have: 8 PiB. The solver sums bytes in 64-bit integers, and
#: capacities far beyond any real device would overflow them.
MAX_MEMORY_BYTES = 2**53

#: CUDA context plus allocator slack kept free on every GPU whose capacity was not given by the user.
DEFAULT_GPU_RESERVE_BYTES = 1 * GIB
#: Allocations from this size on get new pages from the OS at every allocation under glibc's malloc: its
#: ``mmap`` threshold rises with the chunks a process frees up to this cap (``DEFAULT_MMAP_THRESHOLD_MAX``
#: on 64-bit Linux) and never above it, so a tensor this large is mapped anew, and faults its pages in.
FRESH_PAGE_MIN_BYTES = 32 * 2**20

_NAME_RE = re.compile(r"^(cuda:(\d+)|cpu|disk)$")
_HALF_DTYPES = ("float16", "bfloat16", "half", "fp16", "bf16")
_DEFAULT_NAME = {"gpu": "cuda:0", "cpu": "cpu", "disk": "disk"}


# Link latencies: a kernel launch plus copy setup over PCIe/NVLink, a read request on a disk.
_LATENCY_S = {"pcie": 10e-6, "nvlink": 5e-6, "disk": 100e-6}


def normalize_device_name(name: str | int) -> str:
    """``0`` / ``"0"`` / ``"cuda"`` / ``"cuda:0"`` -> ``"cuda:0"``; ``"cpu"``, ``"disk"`` unchanged.

    Raises:
        DeviceSpecError: the name is not a device; lists the accepted forms.
    """
    if isinstance(name, bool):
        raise DeviceSpecError(f"device {name!r} is not a device name: use 'cuda:N', 'cpu' or 'disk'")
    if isinstance(name, int):
        if name < 0:
            raise DeviceSpecError(f"device index {name} is negative: GPU indices start at 0")
        return f"cuda:{name}"
    text = str(name).strip().lower()
    if text.isdigit():
        return f"cuda:{int(text)}"
    if text in ("cuda", "gpu"):
        return "cuda:0"
    if text.startswith("gpu:"):
        text = "cuda:" + text[4:]
    match = _NAME_RE.match(text)
    if not match:
        raise DeviceSpecError(
            f"unknown device name {name!r}: accepted are 'cuda:N' (also written 'gpu:N', an int N, or 'cuda' for "
            f"cuda:0), 'cpu' and 'disk'"
        )
    # 'cuda:01' is cuda:1: kept as written, it was another device beside cuda:1, and accelerate's key 1 for both
    return f"cuda:{int(match.group(2))}" if match.group(2) else text


def device_kind(name: str) -> str:
    """``"gpu"``, ``"cpu"`` or ``"disk"`` for a normalized device name."""
    return "gpu" if name.startswith("cuda:") else name


def gpu_index(name: str) -> int:
    """N of ``"cuda:N"``; 0 for the CPU and the disk (they sort after the GPUs by kind)."""
    return int(name.split(":")[1]) if name.startswith("cuda:") else 0


def _is_half(dtype: str) -> bool:
    return str(dtype).replace("torch.", "") in _HALF_DTYPES


#: What :meth:`Device.from_dict` cannot do without (the rest default as :class:`Device` does).
_DEVICE_FIELDS = ("name", "memory_bytes", "reserve_bytes", "flops_per_s", "bandwidth_bytes_per_s")


def _check_written(data: Any, what: str, fields: Sequence[str], writer: str) -> None:
    """Refuse ``data`` that is no mapping or lacks one of ``fields`` (a plain KeyError said only the key)."""
    if not isinstance(data, Mapping):
        raise DeviceSpecError(f"{what} as a dict is a mapping, as {writer} writes it, not a {type(data).__name__}")
    if missing := [f for f in fields if f not in data]:
        raise DeviceSpecError(f"{what} as a dict lacks {', '.join(map(repr, missing))}: from_dict reads what "
                              f"{writer} writes")


def _checked_speed(label: str, device: str, value: float | None) -> float | None:
    if value is None:
        return value
    if not _finite_rate(value):
        raise DeviceSpecError(f"{label} of {device} is {value!r}: speeds are numbers > 0 per second, and finite "
                              f"(e.g. flops=165e12, bandwidth=1.0e12)")
    return value


def _between(value: Any, high: float) -> bool:
    """Whether ``value`` is a number strictly between 0 and ``high`` (a string, a bool or NaN is not: 'abc', '5us'
    or a list are refused in the caller's words, not float()'s)."""
    try:
        return not isinstance(value, bool) and 0 < float(value) < high
    except (TypeError, ValueError):
        return False


def _finite_rate(value: Any) -> bool:
    """Whether ``value`` is a finite number > 0 (an infinite speed priced a device's work or a copy at no time)."""
    return _between(value, math.inf)


def _under_a_second(value: Any) -> bool:
    """Whether ``value`` is a number of seconds strictly between 0 and 1."""
    return _between(value, 1)


def _reserve_bytes(device: str, kind: str, reserve: int | str | None, memory_bytes: int) -> int:
    if reserve is None:
        return DEFAULT_GPU_RESERVE_BYTES if kind == "gpu" else 0
    reserve_bytes = parse_size(reserve, what=f"reserve of {device}")
    if reserve_bytes > memory_bytes:  # nothing left for the model: a typo (GiB for MiB) more likely than meant
        raise DeviceSpecError(f"reserve of {device} is {format_bytes(reserve_bytes)}, more than its memory "
                              f"({format_bytes(memory_bytes)}): nothing would be left for the model; give a reserve "
                              f"of at most the memory (the CUDA context and allocator slack take about 1 GiB)")
    return reserve_bytes


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
        reserve: bytes kept free for the CUDA context and allocator slack (GPUs only), at most ``memory``.
        source: where the speeds come from (``"user"``, ``"datasheet:<preset>"``, ``"measured"``...).
        flops_by_tokens: measured achieved FLOP/s of a linear layer by tokens per forward, as
            ``((tokens, flop_per_s), ...)`` (small batches run matmuls far below peak); the cost
            model interpolates it and uses ``flops`` where it is empty.
        shared_bandwidth: CPU: what host RAM serves all its readers together, the cores and the GPUs'
            copies (bytes/s); default ``bandwidth`` (a datasheet's memory bandwidth). A profile sets it
            from its fastest measured traffic, as ``bandwidth`` there is one dtype's matrix-vector rate.
        fresh_page: CPU: bytes/s at which the OS hands a large new tensor its pages, on top of writing
            them (glibc's malloc maps every allocation of :data:`FRESH_PAGE_MIN_BYTES` or more anew, and
            each page faults in on first touch); None: not measured, or no such cost measured (another
            allocator, such as jemalloc, reuses the memory). A profile measures it.
        op_overhead_s: seconds the host spends per torch op a model's forward dispatches to this device
            (the dispatch and the Python around it), whatever the op's size; None: the cost model's default
            for the kind. A profile measures it on a small transformers model.
        to_host: GPU: bytes/s of :func:`~.host_copy.to_host` of a large tensor, a blocking copy in 64 MiB chunks
            through pinned staging buffers into new pageable memory, as a phased unit's KV cache and a GPU unit's
            outputs leave for the CPU; None: ``host_link`` (the pinned host -> device rate). A profile measures it.
            A plain ``.to("cpu")`` is far slower: on a lent H200's host it copied at 1.3-1.6 GB/s, and phased
            prefills ran as if their KV caches moved at about 1.3 GB/s, against 54 GB/s into pinned memory
            (benchmarks/cost_accuracy/GPU.md).
        random_read: disk: bytes/s of regions at random places of a file, several asked for together
            (``posix_fadvise``) and then touched through its memory map: how the runtime reads the experts a router
            picks and the rows a lookup table looks up (:meth:`Machine.random_read_s`); None: ``bandwidth``. A
            profile measures it: 1.50-1.69 GB/s on this project's virtual disk, against 2.1-2.25 GB/s mapped in order.
        random_read_latency_s: disk: seconds each small read asked for that way adds, at a random place, when
            several are asked for together; None: 100 µs (an NVMe drive's). A profile measures it: 13-15 µs
            here. A read nobody asks for ahead costs far more: the page fault brings the kernel's read-around
            window (``read_ahead_kb``: 8 MiB on this project's disk, 7 ms a fault).

    Raises:
        DeviceSpecError: unknown name, malformed or negative size, a speed not finite and > 0, a time not in (0, 1).
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
    shared_bandwidth_bytes_per_s: float
    fresh_page_bytes_per_s: float | None
    op_overhead_s: float | None
    to_host_bytes_per_s: float | None
    random_read_bytes_per_s: float | None
    random_read_latency_s: float | None

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
        shared_bandwidth: float | None = None,
        fresh_page: float | None = None,
        op_overhead_s: float | None = None,
        to_host: float | None = None,
        random_read: float | None = None,
        random_read_latency_s: float | None = None,
    ) -> None:
        canonical = normalize_device_name(name)
        kind = device_kind(canonical)
        default = PRESETS[DEFAULT_PRESET[kind]]
        memory_bytes = parse_size(memory, what=f"memory of {canonical}")
        if memory_bytes > MAX_MEMORY_BYTES:
            raise DeviceSpecError(
                f"memory of {canonical} is {format_bytes(memory_bytes)} ({memory_bytes} bytes): accepted are "
                f"0 to {format_bytes(MAX_MEMORY_BYTES)} (2**53 bytes); give the device's real capacity")
        for label, value in (("flops", flops), ("bandwidth", bandwidth), ("host_link", host_link),
                             ("peer_link", peer_link), ("shared_bandwidth", shared_bandwidth),
                             ("fresh_page", fresh_page), ("to_host", to_host),
                             ("random_read", random_read)):
            _checked_speed(label, canonical, value)
        if to_host is not None and kind != "gpu":
            raise DeviceSpecError(f"to_host of {canonical} is {to_host!r}: it is the rate of copies leaving a GPU for "
                                  f"the CPU, so only a GPU takes it; leave it None for {canonical}")
        if op_overhead_s is not None and not _under_a_second(op_overhead_s):
            raise DeviceSpecError(f"op_overhead_s of {canonical} is {op_overhead_s!r}: the host's seconds per torch op "
                                  f"must be between 0 and 1 (a few microseconds: 5e-6); leave it None for the default")
        if (random_read is not None or random_read_latency_s is not None) and kind != "disk":
            raise DeviceSpecError(f"random_read and random_read_latency_s of {canonical} are {random_read!r} and "
                                  f"{random_read_latency_s!r}: they describe a disk's scattered reads, so only the "
                                  f"disk takes them; leave them None for {canonical}")
        if random_read_latency_s is not None and not _under_a_second(random_read_latency_s):
            raise DeviceSpecError(f"random_read_latency_s of {canonical} is {random_read_latency_s!r}: a disk's seconds "
                                  f"per small read, between 0 and 1 (NVMe: about 1e-4); leave it None for the default")
        guessed = flops is None or bandwidth is None
        values = {
            "name": canonical,
            "kind": kind,
            "memory_bytes": memory_bytes,
            "flops_per_s": float(flops if flops is not None else default.half_flops_per_s),
            "bandwidth_bytes_per_s": float(
                bandwidth if bandwidth is not None else default.bandwidth_bytes_per_s),
            "reserve_bytes": _reserve_bytes(canonical, kind, reserve, memory_bytes),
            "host_link_bytes_per_s": float(host_link or default.host_link_bytes_per_s),
            "peer_link_bytes_per_s": float(peer_link or default.peer_link_bytes_per_s),
            "source": source or (f"default:{default.key}" if guessed else "user"),
            "flops_by_tokens": _check_curve(canonical, flops_by_tokens),
        }
        values["shared_bandwidth_bytes_per_s"] = float(shared_bandwidth or values["bandwidth_bytes_per_s"])
        values["fresh_page_bytes_per_s"] = float(fresh_page) if fresh_page is not None else None
        values["op_overhead_s"] = float(op_overhead_s) if op_overhead_s is not None else None
        values["to_host_bytes_per_s"] = float(to_host) if to_host is not None else None
        values["random_read_bytes_per_s"] = float(random_read) if random_read is not None else None
        values["random_read_latency_s"] = float(random_read_latency_s) if random_read_latency_s is not None else None
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
        p = preset(key)
        canonical = normalize_device_name(name if name is not None else _DEFAULT_NAME[p.kind])
        kind = device_kind(canonical)
        if kind != p.kind:
            raise DeviceSpecError(f"preset {key!r} is a {p.kind} but device {canonical!r} is a "
                                  f"{kind}: pick a {kind} preset")
        flops = p.half_flops_per_s if _is_half(dtype) else p.fp32_flops_per_s
        return cls(canonical, p.memory_bytes if memory is None else memory,
                   flops=flops or None, bandwidth=p.bandwidth_bytes_per_s, reserve=reserve,
                   host_link=p.host_link_bytes_per_s or None, peer_link=p.peer_link_bytes_per_s or None,
                   source=f"datasheet:{p.key}")

    @classmethod
    def with_default_speeds(cls, name: str, memory: int) -> Device:
        """Device ``name`` of ``memory`` bytes with the datasheet speeds of its kind's default preset."""
        return cls.preset(DEFAULT_PRESET[device_kind(name)], name=name, memory=memory)

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
        """The device :meth:`to_dict` wrote.

        Raises:
            DeviceSpecError: ``data`` is not a mapping, lacks a field :meth:`to_dict` writes, or holds a value of
                the wrong kind.
        """
        _check_written(data, "a device", _DEVICE_FIELDS, "Device.to_dict()")
        try:
            return cls._from_fields(data)
        except PlacementError:
            raise
        except (TypeError, ValueError, OverflowError) as exc:  # int("12 GB"), int(inf), a point that is no pair
            raise DeviceSpecError(f"device {data['name']!r} as a dict: {exc}; Device.from_dict reads what "
                                  f"Device.to_dict() writes (numbers of bytes and bytes/s)") from None

    @classmethod
    def _from_fields(cls, data: Mapping[str, Any]) -> Device:
        reserve: int | None = int(data["reserve_bytes"])
        if reserve > int(data["memory_bytes"]) and reserve == DEFAULT_GPU_RESERVE_BYTES:
            # the default reserve over a small GPU, as Device accepts it (reserve_note says so): read back as that
            # default, not as a reserve given over the memory, which it refuses (a saved plan did not read back)
            reserve = None
        return cls(data["name"], int(data["memory_bytes"]), flops=data["flops_per_s"] or None,
                   bandwidth=data["bandwidth_bytes_per_s"], reserve=reserve,
                   host_link=data.get("host_link_bytes_per_s") or None,
                   peer_link=data.get("peer_link_bytes_per_s") or None, source=data.get("source"),
                   flops_by_tokens=[tuple(p) for p in data.get("flops_by_tokens", ())],
                   shared_bandwidth=data.get("shared_bandwidth_bytes_per_s") or None,
                   fresh_page=data.get("fresh_page_bytes_per_s") or None,
                   op_overhead_s=data.get("op_overhead_s") or None,
                   to_host=data.get("to_host_bytes_per_s") or None,
                   random_read=data.get("random_read_bytes_per_s") or None,
                   random_read_latency_s=data.get("random_read_latency_s") or None)

    def __str__(self) -> str:
        return (f"{self.name} ({format_bytes(self.memory_bytes)}, {self.flops_per_s / 1e12:.3g} TFLOP/s, "
                f"{self.bandwidth_bytes_per_s / 1e9:.3g} GB/s, {self.source})")


def _check_curve(name: str, points: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    try:
        curve = tuple(sorted((int(t), float(f)) for t, f in points))
    except (TypeError, ValueError):
        raise DeviceSpecError(f"flops_by_tokens of {name} is {points!r}: give (tokens, FLOP/s) pairs, e.g. "
                              f"[(1, 2e12), (512, 150e12)]") from None
    bad = [p for p in curve if p[0] < 1 or not 0 < p[1] < math.inf]  # inf priced those tokens' matmuls at no time
    if bad:
        raise DeviceSpecError(f"flops_by_tokens of {name} has {bad}: tokens must be >= 1 and FLOP/s > 0 and finite")
    tokens = [t for t, _ in curve]
    if twice := sorted({t for t in tokens if tokens.count(t) > 1}):  # which one the interpolation took was chance
        raise DeviceSpecError(f"flops_by_tokens of {name} gives tokens {twice} more than once: one FLOP/s each")
    return curve


def _checked_links(links: Any, names: list[str]) -> dict[tuple[str, str], float]:
    """``{(src, dst): bytes_per_s}`` with canonical names, each naming two devices of the machine at a finite rate > 0
    (a bare ValueError, TypeError or AttributeError came of a rate like None, a key like 'cpu' or a list of links)."""
    example = "e.g. links={('cpu', 'cuda:0'): 12e9}"
    if not isinstance(links, Mapping):
        raise DeviceSpecError(f"links is a {type(links).__name__}: give a dict of (src, dst) pairs to bytes/s, "
                              f"{example}")
    checked: dict[tuple[str, str], float] = {}
    for pair, bw in links.items():
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise DeviceSpecError(f"link {pair!r} is not a (src, dst) pair of device names: {example}")
        src, dst = pair
        key = (normalize_device_name(src), normalize_device_name(dst))
        unknown = [n for n in key if n not in names]
        if unknown:
            raise DeviceSpecError(f"link {src}->{dst} names {unknown}, not in the machine ({', '.join(names)})")
        if key[0] == key[1]:  # bandwidth() never reads it: a device reaches itself at no cost
            raise DeviceSpecError(f"link {src}->{dst} joins {key[0]} to itself: a link joins two devices, {example}")
        if not _finite_rate(bw):
            raise DeviceSpecError(f"link {src}->{dst} bandwidth is {bw!r}: it must be a finite number > 0 bytes/s, "
                                  f"{example}")
        checked[key] = float(bw)
    return checked


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
        profile_path: the saved profile the devices were read from (``--devices PATH``,
            ``profile(path=...)``); the unit times :func:`placement_opt.calibrate` saved in it price
            the machine, whichever host measured them. None: the saved profile of this host
            (``$PLACEMENT_OPT_PROFILE`` or the default), whose unit times apply on that host only.

    Raises:
        DeviceSpecError: duplicate devices, or a link that is no (src, dst) pair of two of its devices at a finite
            rate > 0.
    """

    devices: tuple[Device, ...]
    links: Mapping[tuple[str, str], float] = field(default_factory=dict)
    profile_path: str | None = None

    def __init__(self, devices: Iterable[Device], links: Mapping[tuple[str, str], float] | None = None,
                 profile_path: str | os.PathLike[str] | None = None):
        if isinstance(devices, str | Mapping) or not isinstance(devices, Iterable):
            raise DeviceSpecError(f"Machine takes Device objects, not a {type(devices).__name__}: pass names, a spec "
                                  f"string or a max_memory dict to solve() as they are, or build the Machine with "
                                  f"placement_opt.hardware.resolve.as_machine(...)")
        devs = tuple(devices)
        if wrong := [d for d in devs if not isinstance(d, Device)]:
            raise DeviceSpecError(f"Machine takes Device objects, not {wrong[0]!r} ({type(wrong[0]).__name__}): "
                                  f"Device('cpu', '64GiB'), Device.preset('a100-40gb', name='cuda:0'), or "
                                  f"placement_opt.hardware.resolve.as_machine(...) for names and specs")
        names = [d.name for d in devs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise DeviceSpecError(f"machine lists {', '.join(duplicates)} more than once: name each device once")
        if not devs:
            raise DeviceSpecError("a machine needs at least one device, e.g. ['cpu'] or {'cpu': '64GiB'}")
        checked = _checked_links(links or {}, names)
        # GPUs in index order first, then cpu, then disk: the fill order accelerate uses.
        order = {"gpu": 0, "cpu": 1, "disk": 2}
        devs = tuple(sorted(devs, key=lambda d: (order[d.kind], gpu_index(d.name))))
        object.__setattr__(self, "devices", devs)
        object.__setattr__(self, "links", checked)
        object.__setattr__(self, "profile_path", None if profile_path is None else os.fspath(profile_path))

    # -- lookup -------------------------------------------------------------------------
    def __getitem__(self, name: str | int) -> Device:
        for device in self.devices:  # pricing looks up canonical names tens of thousands of times
            if device.name == name:
                return device
        canonical = normalize_device_name(name)
        for device in self.devices:
            if device.name == canonical:
                return device
        raise DeviceSpecError(f"device {canonical!r} is not in this machine ({', '.join(self.names)})")

    def __contains__(self, name: object) -> bool:
        try:
            canonical = normalize_device_name(name)  # type: ignore[arg-type]
        except DeviceSpecError:
            return False
        return any(d.name == canonical for d in self.devices)

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
            if a.is_gpu and a.to_host_bytes_per_s:  # leaving the GPU: a blocking copy into new host memory
                return a.to_host_bytes_per_s
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
        kinds = {device_kind(src), device_kind(dst)}
        if "disk" in kinds:
            return _LATENCY_S["disk"]
        if kinds == {"gpu"} and self.bandwidth(src, dst) > 100e9:
            return _LATENCY_S["nvlink"]
        return _LATENCY_S["pcie"]

    def random_read_s(self, reads: float, nbytes: float) -> float:
        """Seconds to read ``nbytes`` off the disk as ``reads`` regions at random places asked for together (the
        experts a router picks, the rows a lookup table looks up): the disk's measured ``random_read_latency_s``
        per read (else 100 µs) plus the bytes at its ``random_read`` rate (else its bandwidth). A unit read whole
        and ahead pays neither: the kernel's read-ahead runs beside the compute at the mapped read rate."""
        disk = self.disk
        if disk is None:
            return reads * _LATENCY_S["disk"]
        latency = disk.random_read_latency_s or _LATENCY_S["disk"]
        return reads * latency + nbytes / (disk.random_read_bytes_per_s or disk.bandwidth_bytes_per_s)

    # -- conversions ----------------------------------------------------------------------
    @property
    def max_memory(self) -> dict[int | str, int]:
        """accelerate-style ``max_memory`` (usable bytes, reserve already taken off)."""
        return {d.accelerate_key: d.usable_bytes for d in self.devices}

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"devices": [d.to_dict() for d in self.devices],
                                "links": [[s, t, bw] for (s, t), bw in self.links.items()]}
        if self.profile_path is not None:  # absent otherwise: plans of the default profile read as they always have
            data["profile_path"] = self.profile_path
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Machine:
        """The machine :meth:`to_dict` wrote.

        Raises:
            DeviceSpecError: ``data`` is not a mapping, lacks its ``devices``, or holds a device or link
                :meth:`Device.from_dict` and :class:`Machine` refuse.
        """
        _check_written(data, "a machine", ("devices",), "Machine.to_dict()")
        devices, links = data["devices"], data.get("links", [])
        if not isinstance(devices, list) or not isinstance(links, list):
            raise DeviceSpecError("a machine as a dict holds a list of 'devices' (and one of 'links', [source, "
                                  "target, bytes/s] each), as Machine.to_dict() writes it")
        if any(not isinstance(link, list | tuple) or len(link) != 3 for link in links):
            raise DeviceSpecError(f"a machine's links are [source, target, bytes/s] each, got {links!r}")
        return cls([Device.from_dict(d) for d in devices], {(s, t): bw for s, t, bw in links},
                   data.get("profile_path"))

    def with_devices(self, devices: Iterable[Device], links: Mapping[tuple[str, str], float] | None = None) -> Machine:
        """Another machine of the same profile: ``devices`` (and ``links``, default the kept devices' links)."""
        devs = tuple(devices)
        names = {d.name for d in devs}
        if links is None:
            links = {k: v for k, v in self.links.items() if k[0] in names and k[1] in names}
        return Machine(devs, links, self.profile_path)

    def __str__(self) -> str:
        return "Machine(" + "; ".join(str(d) for d in self.devices) + ")"
