"""A rank's share of the machine: its own GPU and 1/N of the host's CPU RAM and disk.

:func:`plan_for_context`, :func:`local_machine` and :func:`check_no_cross_rank_split` restrict a
:class:`~placement_opt.hardware.devices.Machine` to the rank's own devices before solving.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import PlacementError
from ..hardware.devices import Device, Machine, normalize_device_name, replace_device
from ..hardware.resolve import as_machine
from ..units import format_bytes
from .context import _LABEL, RuntimeContext, _context, _cuda_device_count

__all__ = ["local_machine", "check_no_cross_rank_split", "plan_for_context"]


#: Marks a CPU/disk whose capacity :func:`local_machine` already divided among a host's ranks.
_SHARE_TAG = "per-rank share"


def _device_names(devices: Any) -> list[str]:
    """Names of the devices in anything :func:`as_machine` accepts, without detecting any."""
    if isinstance(devices, Machine):
        return devices.names
    if isinstance(devices, Device):
        return [devices.name]
    if isinstance(devices, str):
        return [normalize_device_name(item.split("=")[0]) for item in devices.split(",") if item.strip()]
    if isinstance(devices, Mapping):
        return [normalize_device_name(k) for k in devices]
    if isinstance(devices, Iterable):
        return [d.name if isinstance(d, Device) else normalize_device_name(d) for d in devices]
    return [normalize_device_name(devices)]


def check_no_cross_rank_split(devices: Any, context: RuntimeContext) -> None:
    """Raise when a distributed rank is asked to plan over GPUs that are not its own.

    Example::

        ctx = RuntimeContext(kind="ddp", world_size=2, rank=1, local_rank=1, local_world_size=2,
                             local_device="cuda:1")
        check_no_cross_rank_split(["cuda:1", "cpu"], ctx)          # fine
        check_no_cross_rank_split(["cuda:0", "cuda:1", "cpu"], ctx)  # PlacementError

    Args:
        devices: a Machine, Devices, names, a ``max_memory`` dict or a spec string; or a
            :class:`~placement_opt.plan.Plan` (its storage and execution devices), which is
            what ``load(..., plan=plan)`` and ``dispatch(model, plan)`` should check.
        context: the launch context.

    Raises:
        PlacementError: the devices name a GPU other than ``context.local_device``; the message
            names the rank, its device, the GPUs listed and the way out.
    """
    if not context.is_distributed:
        return
    placements = getattr(devices, "placements", None)
    if placements is not None:  # a Plan: the devices it stores on or computes on
        names = sorted({d for p in placements for d in (p.storage, p.execution)})
        noun = "the plan uses"
    else:
        names, noun = _device_names(devices), "the machine lists"
    gpus = [n for n in names if n.startswith("cuda:")]
    foreign = [n for n in gpus if n != context.local_device]
    if not foreign:
        return
    owns = (f"owns {context.local_device}" if context.local_device != "cpu"
            else "runs on the CPU (no GPU of its own)")
    raise PlacementError(
        f"{context.describe()} {owns} but {noun} {', '.join(gpus)}: in a distributed run "
        f"each rank plans for its own device; pass devices for one rank "
        f"(e.g. {_default_devices(context)}) or run a single process"
    )


def _share(device: Device, ranks: int) -> Device:
    """``device`` with 1/``ranks`` of its capacity; a device already shared is left as it is."""
    if ranks <= 1 or _SHARE_TAG in device.source:
        return device
    return replace_device(device, memory_bytes=device.memory_bytes // ranks,
                          reserve_bytes=device.reserve_bytes // ranks,
                          source=f"{device.source}, {_SHARE_TAG} 1/{ranks}")


def local_machine(machine: Machine, context: RuntimeContext) -> Machine:
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
        PlacementError: nothing of ``machine`` is left for this rank.
    """
    if not context.is_distributed:
        return machine
    shares = context.local_world_size
    kept = [d if d.is_gpu else _share(d, shares) for d in machine.devices
            if not d.is_gpu or d.name == context.local_device]
    if not kept:
        raise PlacementError(
            f"{context.describe()} owns {context.local_device} but the machine ({', '.join(machine.names)}) "
            f"has neither it nor a CPU or disk: describe this rank's devices, e.g. "
            f"['{context.local_device}', 'cpu', 'disk']"
        )
    names = {d.name for d in kept}
    links = {k: v for k, v in machine.links.items() if k[0] in names and k[1] in names}
    return Machine(kept, links)


def _default_devices(context: RuntimeContext) -> list[str]:
    return ([context.local_device] if context.local_device != "cpu" else []) + ["cpu", "disk"]


def plan_for_context(
    devices: Any = None,
    context: RuntimeContext | None = None,
    *,
    dtype: str = "float16",
) -> tuple[Machine, str | None]:
    """The machine ``solve()``/``load()`` should plan for on this rank, and a note for the plan.

    In a single process this is ``as_machine(devices)`` (or this machine's detected GPU(s), CPU
    and disk when ``devices`` is None) and no note. In a distributed run, devices the user names
    must not include another rank's GPU (:func:`check_no_cross_rank_split`), and the machine is
    restricted to the rank's own GPU plus its share of CPU RAM and disk (:func:`local_machine`);
    without ``devices`` the rank's own device, CPU and disk are detected.

    Example::

        machine, note = plan_for_context(devices)   # inside solve(graph, devices, ...)
        plan = ...solve on machine...; notes += (note,) if note else ()

    Args:
        devices: anything :func:`~placement_opt.hardware.resolve.as_machine` accepts, or None to detect.
        context: the launch context; default :func:`detect_context` (torch is not imported in a
            plain single process).
        dtype: the model dtype, for detected devices' FLOP/s.

    Returns:
        ``(machine, note)``; ``note`` is None in a single process.

    Raises:
        PlacementError: the user's devices name another rank's GPU.
    """
    ctx = _context(context)
    if not ctx.is_distributed:
        if devices is None:
            devices = _single_default_devices()
        return as_machine(devices, dtype=dtype), None
    if devices is not None:
        check_no_cross_rank_split(devices, ctx)
    machine = local_machine(as_machine(devices if devices is not None else _default_devices(ctx),
                                       dtype=dtype), ctx)
    return machine, _note(machine, ctx)


def _single_default_devices() -> list[str]:
    return [f"cuda:{i}" for i in range(_cuda_device_count())] + ["cpu", "disk"]


def _note(machine: Machine, ctx: RuntimeContext) -> str:
    host = [f"{d.name} {format_bytes(d.memory_bytes)}" for d in machine.devices if not d.is_gpu]
    share = f" (1/{ctx.local_world_size} of this host's)" if ctx.local_world_size > 1 and host else ""
    gpu = next((d.name for d in machine.devices if d.is_gpu), "no GPU")
    placed = (f"; {_LABEL[ctx.kind]} will place and shard the model itself, so this plan sizes one "
              f"full replica" if ctx.framework_places else "")
    return (f"planned for {ctx.describe()} only: {gpu}, {', '.join(host) or 'no host memory'}{share}"
            f"{placed}")
