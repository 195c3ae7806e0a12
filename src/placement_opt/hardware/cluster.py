"""Clusters: several hosts, each a :class:`~.devices.Machine`, and the network between them.

A pipeline puts one stage on each *rank* (one process per GPU, as ``torchrun`` starts them). A
:class:`Cluster` lists its hosts in ``torchrun``'s node order and, within a host, its ranks in
local-rank order: GPUs by index, or, on a host without GPUs, ``cpu_ranks`` processes that share
its CPU. Rank ``r`` of the cluster is ``RANK == r`` under ``torchrun`` (``GROUP_RANK`` is the host).

The spec string (one line, whitespace ignored)::

    cluster := group ("+" group)* ["@" link]
    group   := [N "x"] "(" device ("," device)* ")"  |  [N "x"] device
    device  := preset ["*" COUNT] ["=" SIZE]          # h100-sxm*8, cpu-server=1TiB, cpu*4
    link    := link preset | BANDWIDTH ["/" LATENCY]  # ib-200g, 25GB/s, 12.5GB/s/20us

``"2x(h100-sxm*8,cpu-server)+(a100-40gb*4,cpu-server)@ib-200g"`` is two H100 hosts and one
A100 host on 200 Gb/s InfiniBand. A GPU preset with ``*N`` is N GPUs; ``cpu`` (or a CPU preset)
with ``*N`` is one CPU shared by N ranks (only on hosts without GPUs, which then compute on the
CPU); ``=SIZE`` overrides the capacity. Files (:meth:`Cluster.from_file`) are JSON:
``{"hosts": [{"devices": "h100-sxm*8,cpu-server", "count": 2}], "link": "ib-200g"}``.

Pure values and parsing; no torch. :meth:`Cluster.from_torchrun_env` reads a mapping the caller
passes (``os.environ`` by default).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._files import loads_json
from ..errors import DeviceSpecError
from ..units import parse_size
from .devices import Device, Machine, _is_half
from .presets import PRESETS

__all__ = ["Link", "Host", "Rank", "Cluster", "LINK_PRESETS", "parse_cluster_spec", "MAX_RANKS"]

#: Achieved rates of common inter-host networks (line rate x ~0.8) and their one-message latency.
LINK_PRESETS: dict[str, tuple[float, float]] = {
    "ib-400g": (40e9, 5e-6), "ib-200g": (20e9, 5e-6), "ib-100g": (10e9, 5e-6),
    "eth-100g": (10e9, 20e-6), "eth-25g": (2.5e9, 30e-6), "eth-10g": (1.0e9, 50e-6),
}
#: Ranks a cluster may have: more stages than this are not a pipeline anyone runs.
MAX_RANKS = 4096
#: Ranks sharing one host's CPU talk through shared memory (gloo over loopback): this latency.
_LOOPBACK_LATENCY_S = 20e-6

_ITEM_RE = re.compile(r"^([a-z0-9][a-z0-9.\-]*)(?:\*(\d+))?(?:=(.+))?$")
_GROUP_RE = re.compile(r"^(?:(\d+)x)?(?:\((.*)\)|([^()]*))$")
_RATE_RE = re.compile(r"^(.+?)/s(?:/(.+))?$")
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_ALIASES = {"cpu": "cpu-desktop", "disk": "nvme-gen4"}  # the spec's short names for the default presets
_HINT = ("write e.g. '2x(h100-sxm*8,cpu-server)@ib-200g' (hosts '+'-separated, devices ','-separated, "
         "'@' the network: a preset or a rate such as '25GB/s' or '25GB/s/10us')")


@dataclass(frozen=True)
class Link:
    """A network path between two hosts."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or not self.bandwidth_bytes_per_s < float("inf"):
            raise DeviceSpecError(f"link bandwidth is {self.bandwidth_bytes_per_s!r} bytes/s: it must be a finite "
                                  f"number > 0 (e.g. 25e9 for 200 Gb/s)")
        if not 0 <= self.latency_s < 1:
            raise DeviceSpecError(f"link latency is {self.latency_s!r} s: accepted are 0 to 1 s (e.g. 5e-6)")

    def seconds(self, nbytes: float) -> float:
        """Time to send ``nbytes`` once."""
        return nbytes / self.bandwidth_bytes_per_s + self.latency_s


@dataclass(frozen=True)
class Host:
    """One host: its machine, and how many ranks share its CPU when it has no GPU."""

    machine: Machine
    cpu_ranks: int = 0

    def __post_init__(self) -> None:
        gpus = len(self.machine.gpus)
        if gpus and self.cpu_ranks:
            raise DeviceSpecError(f"a host with {gpus} GPU(s) runs one rank per GPU, not {self.cpu_ranks} on its "
                                  f"CPU: drop '*{self.cpu_ranks}' from its cpu")
        if not gpus and self.machine.cpu is None:
            raise DeviceSpecError("a host needs a GPU or a CPU to compute on: add e.g. 'cpu' to its devices")
        if not gpus and self.cpu_ranks < 1:
            object.__setattr__(self, "cpu_ranks", 1)

    @property
    def n_ranks(self) -> int:
        return len(self.machine.gpus) or self.cpu_ranks

    def rank_devices(self) -> list[Device]:
        """The device each local rank computes on; CPU ranks get an equal share of the CPU."""
        if self.machine.gpus:
            return list(self.machine.gpus)
        cpu = self.machine.cpu
        assert cpu is not None  # __post_init__ guarantees a CPU on a host without GPUs
        share = Device("cpu", cpu.memory_bytes // self.cpu_ranks, flops=cpu.flops_per_s / self.cpu_ranks,
                       bandwidth=cpu.bandwidth_bytes_per_s / self.cpu_ranks,
                       reserve=cpu.reserve_bytes // self.cpu_ranks, source=cpu.source,
                       flops_by_tokens=[(t, f / self.cpu_ranks) for t, f in cpu.flops_by_tokens],
                       shared_bandwidth=cpu.shared_bandwidth_bytes_per_s / self.cpu_ranks,
                       fresh_page=cpu.fresh_page_bytes_per_s / self.cpu_ranks if cpu.fresh_page_bytes_per_s else None,
                       op_overhead_s=cpu.op_overhead_s)
        return [share] * self.cpu_ranks


@dataclass(frozen=True)
class Rank:
    """One process of the pipeline: its global rank, host, local rank and compute device."""

    rank: int
    host: int
    local_rank: int
    device: Device

    @property
    def device_name(self) -> str:
        """``cuda:<local GPU>`` or ``cpu``: what this rank computes on, on its own host."""
        return self.device.name


@dataclass(frozen=True)
class Cluster:
    """Hosts in ``torchrun`` node order and the network between them.

    Example::

        Cluster.from_spec("2x(h100-sxm*8,cpu-server)+(a100-40gb*4,cpu-server)@ib-200g")
        Cluster.from_torchrun_env(host="cpu*2")   # inside a torchrun launch

    Args:
        hosts: the hosts, at least one.
        network: the link between any two hosts.
        dtype: the dtype its preset devices' rates were read for (:meth:`from_spec` and the other constructors
            set it); None for hosts built from devices directly. :func:`~placement_opt.plan_pipeline` refuses a
            model of the other precision (:meth:`priced_for`): a float32 model priced at float16's tensor-core
            rate ran 16x fast on paper.

    Raises:
        DeviceSpecError: no host, or more than :data:`MAX_RANKS` ranks.
    """

    hosts: tuple[Host, ...]
    network: Link = Link(*LINK_PRESETS["ib-200g"])
    dtype: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple(self.hosts))
        if not self.hosts:
            raise DeviceSpecError("a cluster needs at least one host, e.g. '(cpu)' or '2x(h100-sxm*8)'")
        if (total := sum(h.n_ranks for h in self.hosts)) > MAX_RANKS:
            raise DeviceSpecError(f"cluster has {total} ranks: accepted are up to {MAX_RANKS}; describe the hosts "
                                  f"that run the pipeline only")

    def priced_for(self, dtype: str) -> bool:
        """Whether its devices' rates are ``dtype``'s: a preset has two, half precision (float16, bfloat16 and
        their aliases) and float32, so a cluster read for float16 prices a bfloat16 model right. True where
        ``dtype`` is None (devices built directly: their rates are the caller's)."""
        return self.dtype is None or _is_half(self.dtype) == _is_half(dtype)

    # -- ranks and links ------------------------------------------------------------------
    @property
    def ranks(self) -> tuple[Rank, ...]:
        out: list[Rank] = []
        for h, host in enumerate(self.hosts):
            for local, device in enumerate(host.rank_devices()):
                out.append(Rank(rank=len(out), host=h, local_rank=local, device=device))
        return tuple(out)

    world_size = property(lambda self: sum(h.n_ranks for h in self.hosts), doc="Ranks in all hosts.")

    def link(self, a: Rank, b: Rank) -> Link:
        """The path from rank ``a`` to rank ``b``: the network between hosts, else the host's own link."""
        if a.host != b.host:
            return self.network
        machine = self.hosts[a.host].machine
        if a.device.is_gpu and b.device.is_gpu:
            return Link(machine.bandwidth(a.device.name, b.device.name),
                        machine.latency_s(a.device.name, b.device.name))
        # Two processes on one CPU: a copy through shared memory at the CPU's memory bandwidth.
        cpu = machine.cpu
        assert cpu is not None
        return Link(cpu.bandwidth_bytes_per_s, _LOOPBACK_LATENCY_S)

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: str, *, dtype: str = "float16") -> Cluster:
        """Parse the spec string described in the module docstring."""
        return parse_cluster_spec(spec, dtype=dtype)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, dtype: str = "float16") -> Cluster:
        """A JSON file ``{"hosts": [{"devices": SPEC, "count": N}, ...], "link": LINK}``."""
        try:
            data = loads_json(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise DeviceSpecError(f"cluster file {path} is unreadable ({err}): write JSON such as "
                                  f'{{"hosts": [{{"devices": "h100-sxm*8,cpu-server", "count": 2}}], '
                                  f'"link": "ib-200g"}}') from None
        return cls.from_dict(data, dtype=dtype)

    @classmethod
    def from_dict(cls, data: Any, *, dtype: str = "float16") -> Cluster:
        if not isinstance(data, Mapping) or not isinstance(data.get("hosts"), Sequence) or isinstance(data.get("hosts"), str):
            raise DeviceSpecError(f"a cluster description needs a 'hosts' list, got {type(data).__name__}: {_HINT}")
        _check_keys(data, {"hosts", "link"}, "a cluster description")
        if not data["hosts"]:  # joined into a spec, an empty list was said as "cluster spec '' has an empty host"
            raise DeviceSpecError("a cluster description's 'hosts' is empty: list one host or more, e.g. "
                                  '{"hosts": [{"devices": "h100-sxm*8,cpu-server", "count": 2}]}')
        groups = []
        for entry in data["hosts"]:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("devices"), str):
                raise DeviceSpecError(f"host entry {entry!r} needs 'devices': a string such as 'h100-sxm*8,cpu-server'")
            _check_keys(entry, {"devices", "count"}, f"host entry {dict(entry)!r}")
            _check_one_host(entry["devices"])
            count = entry.get("count", 1)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise DeviceSpecError(f"host count is {count!r}: it must be an int >= 1")
            groups.append(f"{count}x({entry['devices']})")
        link = data.get("link", "ib-200g")
        if not isinstance(link, str):
            raise DeviceSpecError(f"a cluster's 'link' is {link!r}: a preset ({', '.join(LINK_PRESETS)}) or a rate "
                                  f"such as '25GB/s'")
        return parse_cluster_spec("+".join(groups) + f"@{link}", dtype=dtype)

    @classmethod
    def from_torchrun_env(cls, env: Mapping[str, str] | None = None, *, host: str = "cpu",
                          network: str = "ib-200g", dtype: str = "float16") -> Cluster:
        """The cluster a ``torchrun`` launch describes: ``WORLD_SIZE / LOCAL_WORLD_SIZE`` hosts like ``host``.

        torchrun starts the same number of processes on every node, so every host is ``host`` (a
        device list such as ``"h100-sxm*8,cpu-server"``; ``"cpu"`` means ``cpu*LOCAL_WORLD_SIZE``).

        Raises:
            DeviceSpecError: a variable is missing or malformed, ``RANK``/``GROUP_RANK`` disagree with
                the sizes, or ``host`` has another number of ranks than ``LOCAL_WORLD_SIZE``.
        """
        env = os.environ if env is None else env
        world, local = _env_int(env, "WORLD_SIZE", 1), _env_int(env, "LOCAL_WORLD_SIZE", 1)
        if world % local:
            raise DeviceSpecError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: torchrun starts "
                                  f"the same number of ranks on every host; check the launch")
        rank = _env_int(env, "RANK", 0, minimum=0)
        if rank >= world:
            raise DeviceSpecError(f"RANK={rank} is not below WORLD_SIZE={world}: check the launch")
        group = _env_int(env, "GROUP_RANK", rank // local, minimum=0)
        if group != rank // local:
            raise DeviceSpecError(f"GROUP_RANK={group} but RANK={rank} with LOCAL_WORLD_SIZE={local} is on host "
                                  f"{rank // local}: ranks must be numbered host by host, as torchrun does")
        spec = host.strip().strip("()")
        if any(c in spec for c in "()+@"):  # one host's devices: another host or a network would change the count
            raise DeviceSpecError(f"host {host!r} is not one host's devices: write them alone, e.g. "
                                  f"'h100-sxm*8,cpu-server' (every host of a torchrun launch is alike)")
        spec = _cpu_host_ranks(spec, local)
        cluster = parse_cluster_spec(f"{world // local}x({spec})@{network}", dtype=dtype)
        if cluster.hosts[0].n_ranks != local:
            raise DeviceSpecError(f"host {host!r} has {cluster.hosts[0].n_ranks} ranks but LOCAL_WORLD_SIZE={local}: "
                                  f"describe the devices of one host, one GPU per local rank")
        return cluster

    # -- description ----------------------------------------------------------------------
    def to_spec(self) -> str:
        """A spec string that parses back to this cluster (capacities and presets as given)."""
        hosts = "+".join(f"({_host_spec(h)})" for h in self.hosts)
        return f"{hosts}@{_format_rate(self.network)}"

    def describe(self) -> str:
        lines = [f"{len(self.hosts)} host(s), {self.world_size} rank(s), network "
                 f"{self.network.bandwidth_bytes_per_s / 1e9:.3g} GB/s, {self.network.latency_s * 1e6:.3g} us"]
        for r in self.ranks:
            lines.append(f"  rank {r.rank}: host {r.host}, local rank {r.local_rank}, {r.device}")
        return "\n".join(lines)


def _cpu_host_ranks(spec: str, local: int) -> str:
    """A host without GPUs runs ``local`` ranks on its CPU: its CPU item without a count gets ``*local``, whatever
    the disk and the order ('cpu,disk' did; 'disk,cpu' and 'cpu,nvme-gen3' ran one rank, refused as GPUs short)."""
    items = re.sub(r"\s+", "", spec).lower().split(",")
    matches = [_ITEM_RE.match(item) for item in items]
    kinds = [_preset_kind(m.group(1)) if m else None for m in matches]
    if "gpu" in kinds:
        return spec
    return ",".join(f"{m.group(1)}*{local}" + (f"={m.group(3)}" if m.group(3) else "")
                    if m and kind == "cpu" and m.group(2) is None else item
                    for item, m, kind in zip(items, matches, kinds, strict=True))


def _preset_kind(name: str) -> str | None:
    key = _ALIASES.get(name, name)
    return PRESETS[key].kind if key in PRESETS else None


def _check_one_host(devices: str) -> None:
    """A host entry's ``devices`` is joined into a spec: ``"a10*4)+(h100-sxm*4"`` became two hosts per count (three
    hosts for ``"count": 2``) and ``"a10@eth-10g"`` a network, without a word."""
    if any(c in devices for c in "()+@"):
        raise DeviceSpecError(f"host entry devices {devices!r} is not one host's devices: write them alone, e.g. "
                              f"'h100-sxm*8,cpu-server'; give another host its own entry and the network as 'link'")


def _check_keys(data: Mapping[str, Any], known: set[str], what: str) -> None:
    """Refuse keys ``data`` may not have: a typo (``"lnk"``, ``"cuont"``) was read as the default, without a word."""
    if unknown := sorted(set(map(str, data)) - known):
        close = {k: difflib.get_close_matches(k, sorted(known), n=1) for k in unknown}
        hints = ", ".join(f"{k!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for k, c in close.items())
        raise DeviceSpecError(f"{what} has key(s) {hints} it does not take: its keys are {', '.join(sorted(known))}")


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------
def parse_cluster_spec(spec: str, *, dtype: str = "float16") -> Cluster:
    """``"2x(h100-sxm*8,cpu-server)@ib-200g"`` -> :class:`Cluster` (grammar: module docstring).

    Raises:
        DeviceSpecError: the part that does not parse, and what is accepted.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DeviceSpecError(f"cluster spec {spec!r} is empty: {_HINT}")
    _check_bytes(spec)
    text = re.sub(r"\s+", "", spec).lower()
    hosts_text, at, link_text = text.partition("@")
    if at and not link_text:  # '...@' or a file's "link": "" read as the default network, without a word
        raise DeviceSpecError(f"cluster spec {spec!r} has nothing after '@': name the network, a preset "
                              f"({', '.join(LINK_PRESETS)}) or a rate such as '25GB/s', or leave '@' out for ib-200g")
    network = _parse_link(link_text) if link_text else Link(*LINK_PRESETS["ib-200g"])
    hosts: list[Host] = []
    for group in _split_top(hosts_text, "+"):
        count, host = _parse_group(group, dtype)
        if len(hosts) + count > MAX_RANKS:
            raise DeviceSpecError(f"cluster spec has more than {MAX_RANKS} hosts: describe the pipeline's hosts only")
        hosts.extend([host] * count)
    return Cluster(tuple(hosts), network, dtype=dtype)


def _split_top(text: str, sep: str) -> list[str]:
    """Split at ``sep`` outside parentheses; refuse unbalanced ones and empty parts."""
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise DeviceSpecError(f"cluster spec has unbalanced or nested parentheses in {text!r}: {_HINT}")
        if ch == sep and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise DeviceSpecError(f"cluster spec has an unclosed '(' in {text!r}: {_HINT}")
    parts.append(current)
    if any(not p for p in parts):
        raise DeviceSpecError(f"cluster spec {text!r} has an empty host between '{sep}': {_HINT}")
    return parts


def _parse_group(group: str, dtype: str) -> tuple[int, Host]:
    match = _GROUP_RE.match(group)
    if not match:
        raise DeviceSpecError(f"host {group!r} does not parse: {_HINT}")
    count = int(match.group(1) or 1)
    if count < 1:
        raise DeviceSpecError(f"host {group!r} is repeated {count} times: the count must be >= 1")
    body = match.group(2) if match.group(2) is not None else match.group(3)
    items = body.split(",") if body else []
    if not items or any(not i for i in items):
        raise DeviceSpecError(f"host {group!r} has an empty device: list devices as 'h100-sxm*8,cpu-server'")
    return count, _build_host(items, dtype)


def _build_host(items: list[str], dtype: str) -> Host:
    devices: list[Device] = []
    cpu_ranks = 0
    for item in items:
        match = _ITEM_RE.match(item)
        if not match:
            raise DeviceSpecError(f"device {item!r} does not parse: write PRESET[*COUNT][=SIZE], e.g. "
                                  f"'a100-40gb*4' or 'cpu-server=1TiB'")
        name, count_text, size = match.groups()
        count = int(count_text or 1)
        if not 1 <= count <= MAX_RANKS:
            raise DeviceSpecError(f"device {item!r} has count {count}: accepted are 1 to {MAX_RANKS}")
        key = _ALIASES.get(name, name)
        if key not in PRESETS:
            raise DeviceSpecError(f"device {name!r} in {item!r} is no preset: accepted are 'cpu', 'disk' and "
                                  f"{', '.join(sorted(PRESETS))}")
        kind = PRESETS[key].kind
        if kind == "gpu":
            start = len([d for d in devices if d.is_gpu])
            devices += [Device.preset(key, name=f"cuda:{start + i}", memory=size, dtype=dtype) for i in range(count)]
            continue
        if any(d.kind == kind for d in devices):
            raise DeviceSpecError(f"host lists more than one {kind} ({item!r}): name one {kind} per host; "
                                  f"'cpu*N' is one CPU shared by N ranks")
        if kind == "disk" and count > 1:
            raise DeviceSpecError(f"device {item!r}: a host has one disk in this model; drop '*{count}'")
        devices.append(Device.preset(key, memory=size, dtype=dtype))
        cpu_ranks = count if kind == "cpu" and count_text else cpu_ranks
    return Host(Machine(devices), cpu_ranks)


#: A network rate written in bits (``25Gb/s``, ``10gbps``, ``100Gbit/s``): the spec is read in bytes, so such a
#: rate priced the link 8x too fast.
_BITS_RE = re.compile(r"[0-9.]+\s*[kKmMgGtT]i?(?:b|bits?|bps)(?:/s)?(?![A-Za-z])")


def _check_bytes(spec: str) -> None:
    _, _, link = spec.partition("@")
    if (found := _BITS_RE.search(link)) is not None:
        raise DeviceSpecError(f"network rate {found.group(0)!r} in {spec!r} reads as bits (a lowercase b): the spec "
                              f"takes bytes per second, e.g. '3.125GB/s' for 25 Gbit/s, or a preset such as "
                              f"eth-25g ({', '.join(LINK_PRESETS)})")


def _parse_link(text: str) -> Link:
    if text in LINK_PRESETS:
        return Link(*LINK_PRESETS[text])
    match = _RATE_RE.match(text)
    if not match:
        raise DeviceSpecError(f"network {text!r} is neither a preset ({', '.join(LINK_PRESETS)}) nor a rate such "
                              f"as '25GB/s' or '25GB/s/10us'")
    rate = parse_size(match.group(1), what="network bandwidth (per second)")
    latency = _parse_seconds(match.group(2)) if match.group(2) else 10e-6
    if rate <= 0:
        raise DeviceSpecError(f"network {text!r} has bandwidth 0: give a rate > 0, e.g. '25GB/s'")
    return Link(float(rate), latency)


def _parse_seconds(text: str) -> float:
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(s|ms|us|ns)", text)
    if not match:
        raise DeviceSpecError(f"latency {text!r} does not parse: write e.g. '5us', '0.2ms' or '1e-5s'")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def _env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 1) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise DeviceSpecError(f"{name}={raw!r} is not an integer: torchrun sets it; check the launch") from None
    if value < minimum:
        raise DeviceSpecError(f"{name}={value}: it must be >= {minimum}")
    return value


def _host_spec(host: Host) -> str:
    parts: list[Any] = []
    for device in host.machine.devices:
        key = device.source.split(":", 1)[1] if device.source.startswith("datasheet:") else None
        if key is None:
            raise DeviceSpecError(f"{device.name} has measured or user speeds ({device.source}): only preset "
                                  f"devices have a spec; keep the Cluster object (or its JSON) instead")
        if device.kind == "cpu" and host.cpu_ranks > 1:
            # A CPU share's capacity is the whole CPU's divided; the spec names the whole CPU.
            parts.append(f"{key}*{host.cpu_ranks}={device.memory_bytes}")
        elif parts and parts[-1][0] == (key, device.memory_bytes) and device.is_gpu:
            parts[-1] = ((key, device.memory_bytes), parts[-1][1] + 1)
            continue
        else:
            parts.append(((key, device.memory_bytes), 1) if device.is_gpu else f"{key}={device.memory_bytes}")
    return ",".join(p if isinstance(p, str) else f"{p[0][0]}*{p[1]}={p[0][1]}" for p in parts)


def _format_rate(link: Link) -> str:
    return f"{link.bandwidth_bytes_per_s!r}/s/{link.latency_s!r}s"
