"""What a user calls a machine -> a :class:`~placement_opt.hardware.devices.Machine`.

Everywhere a machine is expected, :func:`as_machine` accepts a ``Machine``, a list of devices or
names (names are detected on this machine), an accelerate-style ``max_memory`` dict, or a spec
string such as ``"cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=256GiB,disk"`` (:func:`parse_device_spec`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..units import parse_size
from .detect import detect_device
from .devices import (
    DEFAULT_PRESET,
    PRESETS,
    Device,
    Machine,
    _kind_of,
    _with_default_speeds,
    normalize_device_name,
    replace_device,
)

__all__ = ["as_machine", "parse_device_spec"]


def parse_device_spec(spec: str, *, dtype: str = "float16") -> Machine:
    """Parse ``"cuda:0=a100-40gb,cuda:1=rtx-4090/20GiB,cpu=256GiB,disk"`` into a :class:`Machine`.

    Each comma-separated item is ``NAME[=VALUE[/VALUE]]`` where a VALUE is a preset key or a
    size. A bare name is detected on this machine.

    Raises:
        ValueError: an item is malformed; the message names it and shows the accepted forms.
    """
    devices = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, _, rest = item.partition("=")
        canonical = normalize_device_name(name)
        preset_key, size = None, None
        for token in (t.strip() for t in rest.split("/") if t.strip()):
            if token.lower() in PRESETS:
                preset_key = token.lower()
            else:
                try:
                    size = parse_size(token, what=f"size of {canonical}")
                except ValueError:
                    raise ValueError(
                        f"device spec item {item!r}: {token!r} is neither a preset nor a size. "
                        f"Write NAME=PRESET, NAME=SIZE or NAME=PRESET/SIZE, e.g. 'cuda:0=a100-40gb', "
                        f"'cpu=256GiB'; presets: {', '.join(sorted(PRESETS))}"
                    ) from None
        if preset_key:
            devices.append(Device.preset(preset_key, name=canonical, memory=size, dtype=dtype))
        elif size is not None:
            devices.append(_with_default_speeds(canonical, size))
        else:
            devices.append(detect_device(canonical, dtype=dtype))
    return Machine(devices)


def as_machine(devices: Any, *, dtype: str = "float16") -> Machine:
    """Coerce anything a user may call a machine into a :class:`Machine`.

    Accepts a ``Machine``; a list of ``Device``s and/or names (names are detected locally);
    an accelerate ``max_memory`` dict (``{0: "20GiB", "cpu": "64GiB"}``; GPUs get the default
    GPU preset's speeds unless this machine has them); or a spec string for
    :func:`parse_device_spec`.

    Raises:
        ValueError: the value is none of these; the message shows the accepted forms.
    """
    if isinstance(devices, Machine):
        return devices
    if isinstance(devices, Device):
        return Machine([devices])
    if isinstance(devices, str):
        return parse_device_spec(devices, dtype=dtype)
    if isinstance(devices, Mapping):
        return _from_max_memory(devices)
    if isinstance(devices, Iterable):
        return Machine([d if isinstance(d, Device) else detect_device(d, dtype=dtype) for d in devices])
    raise ValueError(
        f"devices={devices!r} is not a machine: pass a Machine, a list like ['cuda:0', 'cpu', 'disk'], "
        f"a max_memory dict like {{0: '20GiB', 'cpu': '64GiB'}}, or a spec like 'cuda:0=a100-40gb,cpu=64GiB'"
    )


def _from_max_memory(max_memory: Mapping[Any, Any]) -> Machine:
    devices = []
    for key, value in max_memory.items():
        name = normalize_device_name(key)
        capacity = parse_size(value, what=f"max_memory[{key!r}]")
        # The user's budget is what we may use: no reserve on top of it, as accelerate does.
        devices.append(replace_device(_with_default_speeds(name, capacity), reserve_bytes=0,
                                      source=f"max_memory, default speeds of {DEFAULT_PRESET[_kind_of(name)]}"))
    return Machine(devices)
