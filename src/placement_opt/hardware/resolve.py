"""What a user calls a machine -> the :class:`~placement_opt.hardware.devices.Machine` to plan for.

:func:`resolve_machine` is the one entry that ``solve()``, ``load()`` and the CLI use. It accepts
what :func:`as_machine` accepts (a ``Machine``, a list of devices or names, an accelerate-style
``max_memory`` dict, a spec string for :func:`parse_device_spec`) or ``None`` (or ``"auto"``, as
the CLI's ``--devices auto``) for this machine, and, in a distributed run, restricts the machine
to one rank's share (:func:`local_machine`).

The launch context is passed in (:class:`RankContext`, which
:class:`~placement_opt.distributed.context.RuntimeContext` satisfies): this layer sits below
``distributed/`` and never detects it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ..errors import DeviceSpecError
from ..units import MIB, format_bytes, parse_size
from .detect import detect_device, local_device_names
from .devices import Device, Machine, normalize_device_name, replace_device
from .presets import DEFAULT_PRESET, PRESETS, did_you_mean
from .profile_store import saved_device

__all__ = [
    "RankContext",
    "resolve_machine",
    "as_machine",
    "parse_device_spec",
    "device_names",
    "assumed_preset",
    "local_machine",
    "check_no_cross_rank_split",
    "reserve_note",
    "unitless_note",
]

#: Marks a CPU/disk whose capacity :func:`local_machine` already divided among a host's ranks.
_SHARE_TAG = "per-rank share"


def is_auto(devices: Any) -> bool:
    """Whether ``devices`` is the word ``"auto"`` (any case, spaces around): this machine, detected."""
    return isinstance(devices, str) and devices.strip().lower() == "auto"


class RankContext(Protocol):
    """What :func:`resolve_machine` reads of a launch context (``RuntimeContext`` has it all)."""

    @property
    def is_distributed(self) -> bool: ...
    @property
    def local_device(self) -> str: ...
    @property
    def local_world_size(self) -> int: ...
    def describe(self) -> str: ...


def resolve_machine(devices: Any = None, context: RankContext | None = None, *,
                    dtype: str = "float16") -> Machine:
    """The machine to plan for in this process.

    In a single process (``context`` None or not distributed) this is ``as_machine(devices)``, or
    this machine's visible GPUs, CPU and disk when ``devices`` is None or ``"auto"``. In a distributed run the
    devices the user names must not include another rank's GPU (:func:`check_no_cross_rank_split`),
    and the machine is restricted to the rank's own GPU plus its share of CPU RAM and disk
    (:func:`local_machine`); without ``devices`` the rank's own device, CPU and disk are detected.

    Example::

        resolve_machine("cuda:0=a100-40gb,cpu=64GiB,disk")          # single process
        resolve_machine(None, current_context(), dtype="bfloat16")  # this rank's share

    Args:
        devices: anything :func:`as_machine` accepts, or None (``"auto"`` alike) to detect this machine.
        context: the launch context (``placement_opt.distributed.context.current_context()``);
            None means a single process.
        dtype: the model dtype, for detected and preset devices' FLOP/s.

    Raises:
        DeviceSpecError: ``devices`` is malformed, names a GPU this process does not see, or (in a
            distributed run) names another rank's GPU.
    """
    if is_auto(devices):
        devices = None  # in a distributed run, None is the rank's share: not the whole host as_machine() sees
    if context is None or not context.is_distributed:
        return as_machine(local_device_names() if devices is None else devices, dtype=dtype)
    if devices is not None:
        check_no_cross_rank_split(devices, context)
    machine = as_machine(_rank_device_names(context) if devices is None else devices, dtype=dtype)
    return local_machine(machine, context)


# -- the forms a user writes a machine in --------------------------------------------------------


def _spec_items(spec: str) -> list[tuple[str, str, str]]:
    """``"cuda:0=a100-40gb,cpu"`` -> ``[("cuda:0", "a100-40gb", "cuda:0=a100-40gb"), ("cpu", "", "cpu")]``."""
    items = []
    for item in (part.strip() for part in spec.split(",")):
        if item:
            name, _, rest = item.partition("=")
            items.append((normalize_device_name(name), rest, item))
    return items


def parse_device_spec(spec: str, *, dtype: str = "float16") -> Machine:
    """Parse ``"cuda:0=a100-40gb,cuda:1=rtx-4090/20GiB,cpu=256GiB,disk"`` into a :class:`Machine`.

    Each comma-separated item is ``NAME[=VALUE[/VALUE]]`` where a VALUE is a preset key or a
    size. A bare name is detected on this machine; a size alone is this machine's device with that
    budget, as a ``max_memory`` entry is (all of it usable; its measured speeds where the saved profile
    has them, else its kind's default preset's, which the plan's notes then say); a preset with a size
    is a device of that memory, which keeps the GPU reserve.

    Raises:
        DeviceSpecError: an item is malformed; the message names it and shows the accepted forms.
    """
    items = _spec_items(spec)
    if not items:  # Machine's own refusal shows Python forms, which a --devices value is not
        raise DeviceSpecError(f"the device spec {spec!r} names no device: write its devices ','-separated, e.g. "
                              f"'cuda:0=24GiB,cpu=64GiB', 'cpu' or 'auto' (this machine's)")
    return Machine([_spec_device(name, rest, item, dtype) for name, rest, item in items])


def _spec_device(name: str, rest: str, item: str, dtype: str) -> Device:
    if "=" in item and not rest.strip(" /"):  # 'cpu=' read as a bare 'cpu' gave it all the free RAM
        raise DeviceSpecError(f"device spec item {item!r} has nothing after '=': write {name}=SIZE (e.g. "
                              f"'{name}=64GiB'), {name}=PRESET, or a bare '{name}' for what this machine has free")
    preset_key, size = None, None
    for token in (t.strip() for t in rest.split("/") if t.strip()):
        if token.lower() in PRESETS:
            _one_of_each(item, "preset", preset_key)
            preset_key = token.lower()
            continue
        try:
            parsed = parse_size(token, what=f"size of {name}")
        except ValueError:
            raise DeviceSpecError(
                f"device spec item {item!r}: {token!r} is neither a preset nor a size{did_you_mean(token)}. "
                f"Write NAME=PRESET, NAME=SIZE or NAME=PRESET/SIZE, e.g. 'cuda:0=a100-40gb', "
                f"'cpu=256GiB'; presets: {', '.join(sorted(PRESETS))}"
            ) from None
        _one_of_each(item, "size", size)
        size = parsed
    if preset_key:
        return Device.preset(preset_key, name=name, memory=size, dtype=dtype)
    if size is not None:
        return _with_budget(name, size, dtype)
    return detect_device(name, dtype=dtype)


def _one_of_each(item: str, what: str, earlier: object) -> None:
    """Refuse a second preset or size in one item: the last one was taken, the first dropped without a word."""
    if earlier is not None:
        raise DeviceSpecError(f"device spec item {item!r} gives more than one {what}: write NAME=PRESET/SIZE with one "
                              f"of each at most, e.g. 'cuda:0=a100-40gb/36GiB'")


def _with_budget(name: str, size: int, dtype: str, *, max_memory: bool = False) -> Device:
    """``NAME=SIZE`` (or, ``max_memory``, an entry of that dict): this machine's device with a budget, all of it
    usable (no GPU reserve on top, as accelerate reads max_memory), at the saved profile's speeds where it measured
    the device, else at the default preset's, said in the source (the planner's notes name such devices). So
    ``plan --devices cuda:0=10GiB``, ``run --devices cuda:0=10GiB`` and ``{0: "10GiB"}`` plan alike (the spec kept
    1 GiB back)."""
    measured = saved_device(name, dtype=dtype)
    if measured is not None:
        given = "max_memory" if max_memory else "the spec"
        return replace_device(measured, memory_bytes=size, reserve_bytes=0,
                              source=f"{measured.source}, capacity from {given}")
    default = Device.with_default_speeds(name, size)
    given = "max_memory" if max_memory else f"{name}=SIZE"
    return replace_device(default, reserve_bytes=0, source=f"{given}, default speeds of {DEFAULT_PRESET[default.kind]}")


def assumed_preset(source: str) -> str | None:
    """The preset whose datasheet speeds a device of this machine carries for want of a measurement, read from its
    ``source`` as this module and :func:`~.detect.detect_device` write it: a budget alone (``max_memory, default
    speeds of X``, ``NAME=SIZE, default speeds of X``) or a bare name detected (``detected capacity, datasheet:X``);
    None for measured devices and presets one named."""
    if "default speeds of " in source:
        return source.rsplit("default speeds of ", 1)[1]
    if source.startswith("detected capacity, datasheet:"):
        return source.rsplit("datasheet:", 1)[1]
    return None


def as_machine(devices: Any, *, dtype: str = "float16") -> Machine:
    """Coerce anything a user may call a machine into a :class:`Machine`.

    Accepts a ``Machine``; a list of ``Device``s, names (detected locally) and/or spec items
    (``["cuda:0=h100-sxm", "cpu=256GiB", "disk"]``, as :func:`parse_device_spec` reads them);
    an accelerate ``max_memory`` dict (``{0: "20GiB", "cpu": "64GiB"}``; GPUs get the default
    GPU preset's speeds unless this machine has them); a spec string for
    :func:`parse_device_spec`; or ``"auto"``: this machine's visible GPUs, CPU and disk, detected.

    Raises:
        DeviceSpecError: the value is none of these; the message shows the accepted forms.
    """
    if isinstance(devices, Machine):
        return devices
    if isinstance(devices, Device):
        return Machine([devices])
    if is_auto(devices):
        return as_machine(local_device_names(), dtype=dtype)
    if isinstance(devices, str):
        return parse_device_spec(devices, dtype=dtype)
    if isinstance(devices, Mapping):
        return _from_max_memory(devices, dtype)
    if isinstance(devices, Iterable) and not isinstance(devices, bytes | bytearray):  # b"cpu" iterates 99, 112, 117
        return Machine([device for d in devices for device in _listed_devices(d, dtype)])
    raise DeviceSpecError(
        f"devices={devices!r} is not a machine: pass a Machine, a list like ['cuda:0', 'cpu', 'disk'], "
        f"a max_memory dict like {{0: '20GiB', 'cpu': '64GiB'}}, or a spec like 'cuda:0=a100-40gb,cpu=64GiB'"
    )


def _listed_devices(item: Any, dtype: str) -> list[Device]:
    """The devices one item of a list names: a ``Device``, a spec item (``"cuda:0=h100-sxm"``), or a name."""
    if isinstance(item, Device):
        return [item]
    if isinstance(item, str) and "=" in item:
        return parse_device_spec(item, dtype=dtype).devices
    return [detect_device(item, dtype=dtype)]


def device_names(devices: Any) -> list[str]:
    """Names of the devices in anything :func:`as_machine` accepts, without detecting any."""
    if isinstance(devices, Machine):
        return devices.names
    if isinstance(devices, Device):
        return [devices.name]
    if isinstance(devices, str):
        return [name for name, _, _ in _spec_items(devices)]
    if isinstance(devices, Mapping):
        return [normalize_device_name(k) for k in devices]
    if isinstance(devices, Iterable):
        return [name for item in devices for name in _listed_names(item)]
    return [normalize_device_name(devices)]


def _listed_names(item: Any) -> list[str]:
    """The names of the devices one item of a list names (:func:`_listed_devices`), without detecting any."""
    if isinstance(item, Device):
        return [item.name]
    if isinstance(item, str) and "=" in item:
        return [name for name, _, _ in _spec_items(item)]
    return [normalize_device_name(item)]


def _from_max_memory(max_memory: Mapping[Any, Any], dtype: str) -> Machine:
    """accelerate's budgets on this machine: the saved profile's speeds where it measured the device.

    A ``max_memory`` dict describes this machine (accelerate reads it so), so a device the profile
    measured gets its measured speeds, as a list of names does; the others get default speeds.
    """
    return Machine([_with_budget(normalize_device_name(key), _budget(key, value), dtype, max_memory=True)
                    for key, value in max_memory.items()])


def _budget(key: Any, value: Any) -> int:
    """A ``max_memory`` entry's bytes; a preset named there is answered with the forms that take one."""
    try:
        return parse_size(value, what=f"max_memory[{key!r}]")
    except DeviceSpecError as error:
        exact = isinstance(value, str) and value.strip().lower() in PRESETS
        # a value that starts with a number meant a size ('10G'), whatever preset it looks like ('a10')
        sized = isinstance(value, str) and value.strip()[:1].isdigit()
        hint = "" if exact or sized or not isinstance(value, str) else did_you_mean(value)
        if not (exact or hint):
            raise
        name, shown = normalize_device_name(key), value.strip().lower() if exact else "PRESET"
        size = {"cpu": "64GiB", "disk": "1TB"}.get(name, "24GiB")
        other = [] if name == "cpu" else ["cpu=64GiB"]  # the example's second device, never the same one
        raise DeviceSpecError(
            f"max_memory[{key!r}] = {value!r} names a device preset{hint}, but a max_memory dict gives budgets "
            f"(e.g. {{{key!r}: '{size}'}}). For a preset's speeds pass a spec string or a list of its items, e.g. "
            f"'{','.join([f'{name}={shown}/{size}', *other])}' or {[f'{name}={shown}', *other]}; presets: "
            f"{', '.join(sorted(PRESETS))}") from error


# -- one rank's share ----------------------------------------------------------------------------


def check_no_cross_rank_split(devices: Any, context: RankContext) -> None:
    """Raise when a distributed rank is asked to plan over GPUs that are not its own.

    Example::

        ctx = RuntimeContext(kind="ddp", world_size=2, rank=1, local_rank=1, local_world_size=2,
                             local_device="cuda:1")
        check_no_cross_rank_split(["cuda:1", "cpu"], ctx)          # fine
        check_no_cross_rank_split(["cuda:0", "cuda:1", "cpu"], ctx)  # DeviceSpecError

    Args:
        devices: a Machine, Devices, names, a ``max_memory`` dict or a spec string; or a
            :class:`~placement_opt.plan.Plan` (its storage and execution devices), which is
            what ``load(..., plan=plan)`` and ``dispatch(model, plan)`` should check.
        context: the launch context.

    Raises:
        DeviceSpecError: the devices name a GPU other than ``context.local_device``; the message
            names the rank, its device, the GPUs listed and the way out.
    """
    if not context.is_distributed:
        return
    placements = getattr(devices, "placements", None)
    if placements is not None:  # a Plan: the devices it stores on or computes on
        names = sorted({d for p in placements for d in (p.storage, p.execution)})
        noun = "the plan uses"
    else:
        names, noun = device_names(devices), "the machine lists"
    gpus = [n for n in names if n.startswith("cuda:")]
    if all(n == context.local_device for n in gpus):
        return
    owns = (f"owns {context.local_device}" if context.local_device != "cpu"
            else "runs on the CPU (no GPU of its own)")
    raise DeviceSpecError(
        f"{context.describe()} {owns} but {noun} {', '.join(gpus)}: in a distributed run "
        f"each rank plans for its own device; pass devices for one rank "
        f"(e.g. {_rank_device_names(context)}) or run a single process"
    )


def _share(device: Device, ranks: int) -> Device:
    """``device`` with 1/``ranks`` of its capacity; a device already shared is left as it is."""
    if ranks <= 1 or _SHARE_TAG in device.source:
        return device
    return replace_device(device, memory_bytes=device.memory_bytes // ranks,
                          reserve_bytes=device.reserve_bytes // ranks,
                          source=f"{device.source}, {_SHARE_TAG} 1/{ranks}")


def local_machine(machine: Machine, context: RankContext) -> Machine:
    """Restrict ``machine`` to what one rank of a distributed run may use.

    Keeps the rank's own GPU (named as it was, ``cuda:<local_rank>``), the CPU and the disk with
    their capacity divided by ``local_world_size`` (the ranks on one host share them), and the
    links between the kept devices. A single process gets ``machine`` unchanged. Idempotent: a
    device already divided carries ``"per-rank share 1/N"`` in its ``source`` and is kept as is,
    so a local machine passed to ``solve()`` is not divided twice.

    Example::

        machine = parse_device_spec("cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=64GiB,disk=1TB")
        local_machine(machine, ctx_rank_1_of_2).names   # ['cuda:1', 'cpu', 'disk'], cpu 32 GiB

    Raises:
        DeviceSpecError: nothing of ``machine`` is left for this rank.
    """
    if not context.is_distributed:
        return machine
    shares = context.local_world_size
    kept = [d if d.is_gpu else _share(d, shares) for d in machine.devices
            if not d.is_gpu or d.name == context.local_device]
    if not kept:
        raise DeviceSpecError(
            f"{context.describe()} owns {context.local_device} but the machine ({', '.join(machine.names)}) "
            f"has neither it nor a CPU or disk: describe this rank's devices, e.g. "
            f"['{context.local_device}', 'cpu', 'disk']"
        )
    return machine.with_devices(kept)


def _rank_device_names(context: RankContext) -> list[str]:
    return ([context.local_device] if context.local_device != "cpu" else []) + ["cpu", "disk"]


def unitless_note(machine: Machine) -> str | None:
    """Devices that compute but hold less than 1 MiB: a size written without a unit is bytes (``cuda:0=24``, as in
    accelerate's ``max_memory``), and such a device holds nothing of a model: the plan then left the GPU empty,
    without a word."""
    small = [d for d in machine.devices if d.kind != "disk" and 0 < d.memory_bytes < MIB]
    if not small:
        return None
    said = ", ".join(f"{d.name} has {format_bytes(d.memory_bytes)}" for d in small)
    return (f"{said}: a size without a unit is bytes; write the unit, e.g. {small[0].name}="
            f"{small[0].memory_bytes}GiB")


def reserve_note(machine: Machine) -> str | None:
    """GPUs whose reserve (the CUDA context and allocator slack) leaves none of their memory usable: the plan shows
    their memory, and they hold nothing of the model (``cuda:0=a10/512MiB`` under the default 1 GiB)."""
    under = [d for d in machine.gpus if d.reserve_bytes and d.usable_bytes == 0]
    if not under:
        return None
    said = "; ".join(f"{d.name} has {format_bytes(d.memory_bytes)}, all under its {format_bytes(d.reserve_bytes)} "
                     f"reserve" for d in under)
    return (f"{said} (the CUDA context and allocator slack): none of it holds the model; give the card's memory, or "
            f"a budget as max_memory or NAME=SIZE (no reserve on top), or Device(..., reserve=...)")
