"""When not to place a model: the training-loop rules of transformers' ``Trainer`` and TRL.

A training loop must not move a model that is already split across devices, that DeepSpeed or FSDP
will place, or that must be cast to fp16/bf16 before it is moved; ``device_map="auto"`` under DDP
fails or silently doubles memory. This module encodes those rules, following transformers'
``Trainer`` (``place_model_on_device``) and TRL (``device_map=None`` under ``MULTI_GPU``/``DEEPSPEED``).

* :func:`should_place_on_device` says whether a training/evaluation loop should ``.to(device)``.
* :func:`resolve_device_map` turns a ``device_map`` into what is valid on this rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import DeviceSpecError
from ..hardware.devices import normalize_device_name
from .context import RuntimeContext, current_context

__all__ = ["STRATEGIES", "Decision", "should_place_on_device", "resolve_device_map"]


logger = logging.getLogger("placement_opt")


#: ``device_map`` strings that ask for a split of one model across the devices of one process.
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Whether to move a model to a device, and why. Truthy exactly when ``place`` is."""

    place: bool
    rule: str
    """Which rule decided: ``"place"``, ``"model_parallel"``, ``"deepspeed"``, ``"fsdp"``,
    ``"half_precision_eval"``."""
    reason: str
    """What, why and what to do, in one sentence or three."""

    def __bool__(self) -> bool:
        return self.place


def _device_name(value: Any) -> str:
    """A device as a string: ints and bare ``"cuda"`` become ``"cuda:N"``; others lower-cased."""
    if isinstance(value, int) and not isinstance(value, bool):
        return f"cuda:{value}"
    text = str(value).strip().lower()
    try:
        return normalize_device_name(text)
    except DeviceSpecError:
        return text  # "mps", "xpu:0", "meta": compared as written


def _accelerators(device_map: Mapping[str, Any]) -> list[str]:
    return sorted({_device_name(v) for v in device_map.values()} - {"cpu", "disk"})


def should_place_on_device(
    model: Any,
    *,
    device: Any,
    deepspeed: bool = False,
    fsdp: bool = False,
    full_eval_half_precision: bool = False,
    training: bool = True,
) -> Decision:
    """Whether a training or evaluation loop should move ``model`` to ``device`` with ``.to()``.

    The rules of transformers' ``Trainer`` (``place_model_on_device``), in its order. Do not move:

    1. a model-parallel model: its ``hf_device_map`` uses more than one device other than cpu
       and disk, or one such device that is not ``device`` (moving would undo the split);
    2. under DeepSpeed, which loads, casts and places the model itself;
    3. under FSDP, which shards the model and moves each shard itself;
    4. for a full fp16/bf16 evaluation without training: cast first, then move, or the fp32
       weights land on the GPU at twice the size.

    Example::

        decision = should_place_on_device(model, device="cuda:0")
        if decision:
            model.to("cuda:0")
        else:
            print(decision.reason)

    Args:
        model: any object; only its ``hf_device_map`` attribute (if any) is read.
        device: the loop's device (``"cuda:0"``, ``0``, ``torch.device``).
        deepspeed: the loop runs under DeepSpeed.
        fsdp: the loop runs under FSDP.
        full_eval_half_precision: evaluation runs fully in fp16/bf16 (``fp16_full_eval``/``bf16_full_eval``).
        training: the run trains (``do_train``); the half-precision rule applies only when it does not.

    Returns:
        A :class:`Decision`, truthy when the model should be moved.
    """
    if device is None or isinstance(device, bool):  # "move it to none"
        raise DeviceSpecError(f"device is {device!r}: name the loop's device, e.g. 'cuda:0', 0 or torch.device('cpu')")
    target = _device_name(device)
    device_map = getattr(model, "hf_device_map", None)
    if device_map is not None and not isinstance(device_map, Mapping):
        raise DeviceSpecError(f"the model's hf_device_map is a {type(device_map).__name__}, not a dict of module -> "
                              f"device: set it as from_pretrained(device_map=...) does, or remove it")
    if device_map:
        used = _accelerators(device_map)
        if len(used) > 1 or (len(used) == 1 and used[0] != target):
            return Decision(place=False, rule="model_parallel", reason=(
                f"the model is already split across {', '.join(used)} by its hf_device_map; moving it "
                f"to {target} would undo that placement and may not fit. Leave it where it is, or "
                f"reload it with device_map=None to train it on one device"))
    if deepspeed:
        return Decision(place=False, rule="deepspeed", reason=(
            "DeepSpeed places the model itself (it casts to fp16/bf16 and partitions it when the "
            "engine is created); moving it first wastes GPU memory. Pass the model on the CPU to "
            "deepspeed.initialize / the Trainer"))
    if fsdp:
        return Decision(place=False, rule="fsdp", reason=(
            "FSDP shards the model and moves each shard to its rank's device when it wraps it; "
            "moving the full model first needs the whole model on every GPU. Wrap it on the CPU "
            "(or the meta device) and let FSDP place it"))
    if full_eval_half_precision and not training:
        return Decision(place=False, rule="half_precision_eval", reason=(
            "full fp16/bf16 evaluation without training: cast the model to the half dtype first, "
            "then move it, or its fp32 weights reach the device at twice the size"))
    return Decision(place=True, rule="place", reason=(
        f"nothing else places this model: move it to {target}"))


def _map_devices(device_map: Any) -> list[str] | None:
    """Devices a ``device_map`` names, or None for a strategy string."""
    if isinstance(device_map, Mapping):
        return sorted({_device_name(v) for v in device_map.values()})
    if isinstance(device_map, str) and device_map.strip().lower() in STRATEGIES:
        return None
    return [_device_name(device_map)]


def resolve_device_map(device_map: Any, context: RuntimeContext | None = None) -> Any:
    """The ``device_map`` that is valid on this rank (TRL's ``device_map=None`` rule, generalised).

    ``from_pretrained(device_map="auto")`` splits one model over every GPU of one process. In a
    distributed run every rank would do so, over the same GPUs. So, with ``context.kind``:

    * ``"single"``: returned unchanged;
    * ``"ddp"``: a strategy string, or a map that uses a GPU other than the rank's own, becomes
      ``{"": local_device}``: one full replica per rank, as DDP expects; a map on the rank's own
      GPU, CPU or disk is kept;
    * ``"deepspeed"``/``"fsdp"``: anything but a map entirely on the rank's own device becomes
      ``None``: load on the CPU and let the framework place and shard (under ZeRO-3 even the
      rank's own device becomes ``None``: transformers refuses any ``device_map`` there).

    Every change is logged as a warning on the ``placement_opt`` logger, saying why.

    Example::

        model = AutoModelForCausalLM.from_pretrained(name, device_map=resolve_device_map("auto"))

    Args:
        device_map: ``None``, a strategy (``"auto"``, ``"balanced"``, ``"balanced_low_0"``,
            ``"sequential"``), a device (``"cuda:1"``, ``1``, ``"cpu"``) or a ``{module: device}`` map.
        context: the launch context; default :func:`detect_context`.

    Returns:
        ``device_map`` itself, ``None`` or ``{"": local_device}``.
    """
    if device_map is None:
        return None
    ctx = current_context(context)
    if not ctx.is_distributed:
        return device_map
    devices = _map_devices(device_map)
    own = {ctx.local_device, "cpu", "disk"} if ctx.kind == "ddp" else {ctx.local_device}
    zero3 = ctx.kind == "deepspeed" and ctx.zero_stage == 3
    if devices is not None and set(devices) <= own and not zero3:
        return device_map
    if ctx.kind == "ddp":
        replacement: Any = {"": ctx.local_device}
        why = (f"DDP keeps one full replica of the model per rank on its own device; "
               f"using {{'': '{ctx.local_device}'}}")
    else:
        replacement = None
        why = (f"{ctx.label} places and shards the model itself"
               f"{' (ZeRO-3 accepts no device_map)' if zero3 else ''}; using device_map=None "
               f"(load on the CPU, let {ctx.label} place it)")
    if devices is None:
        asked = f"device_map={device_map!r} asks to split the model over the devices of one process"
    elif set(devices) <= own:  # ZeRO-3 only
        asked = f"device_map={device_map!r} places the model on this rank's {', '.join(devices)}"
    else:
        asked = f"device_map={device_map!r} puts the model on {', '.join(devices)}, not only on this rank's own device"
    logger.warning("%s: %s, but %s. Pass device_map=%r yourself to silence this warning.",
                   ctx.describe(), asked, why, replacement)
    return replacement
