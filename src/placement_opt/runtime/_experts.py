"""Mixture-of-experts kernels chosen by where each experts module computes, not by the model's device.

transformers' experts modules read one shared ``config._experts_implementation``, and ``generate()``
switches it for the whole model at decode time (``_optimize_model_for_decode``): ``grouped_mm``
becomes ``batched_mm`` whenever ``model.device`` is not the CPU, because on a GPU batched_mm is
faster for a few tokens. ``batched_mm`` gathers the routed experts' weights into a new tensor on
every call, which on a CPU costs a copy of those weights per token: with a plan whose first unit
sits on a GPU, the CPU-executed experts slowed down 4.5x (../shared/measurements, issue 14).

Here every experts module gets a view of the config whose ``_experts_implementation`` follows the
module's own execution device, and the model's decode switch flips the views instead of the
shared config: GPU-executed experts switch as transformers intends, CPU-executed ones keep the
implementation a CPU-only model would use. Expert groups (:mod:`._expert_groups`) never switch: batched_mm
gathers a weight for every routed row, a group's rows of other groups' experts included (clamped onto its own),
so every group on a GPU would read the layer's routed weights again; grouped_mm skips those rows.
Everything is undone by the returned function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from ._expert_groups import is_expert_group

__all__ = ["experts_modules", "pin_experts_to_devices"]

_DECODE_SWITCH = "_optimize_model_for_decode"  # transformers' GenerationMixin hook (5.x)


class _ExpertsConfigView:
    """The model's config as one experts module sees it; every other attribute is the config's own."""

    __slots__ = ("_base", "_on_accelerator", "decoding")

    def __init__(self, base: object, on_accelerator: bool) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_on_accelerator", on_accelerator)
        object.__setattr__(self, "decoding", False)

    @property
    def _experts_implementation(self) -> str | None:
        # transformers' own rule, applied to this module's device instead of the model's.
        chosen = self._base._experts_implementation
        if self.decoding and self._on_accelerator and chosen == "grouped_mm":
            return "batched_mm"
        return chosen

    def __getattr__(self, name: str) -> object:
        return getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "decoding":
            object.__setattr__(self, name, value)
        else:
            setattr(self._base, name, value)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module whose forward goes through transformers' experts interface."""
    found = []
    for name, module in model.named_modules():
        config = module.__dict__.get("config")
        # ``use_experts_implementation`` sets ``_is_expert_parallel`` on every instance it decorates.
        if hasattr(module, "_is_expert_parallel") and hasattr(config, "_experts_implementation"):
            found.append((name, module))
    return found


def pin_experts_to_devices(model: nn.Module, execution: Mapping[str, torch.device],
                           default: torch.device) -> Callable[[], None]:
    """Make each experts module pick its kernel for its own device; returns the undo function.

    All or nothing: when it raises, every config it had replaced is back.

    Args:
        model: the dispatched model.
        execution: unit name -> the device the unit computes on; an experts module takes the
            device of the longest unit name that is a prefix of its own name.
        default: the device of modules outside every unit.
    """
    found = experts_modules(model)
    if not found:
        return lambda: None
    views: list[_ExpertsConfigView] = []
    originals: list[tuple[nn.Module, object]] = []
    undo = _restorer(model, originals)
    try:  # all or nothing: a failure half-way puts back the configs already replaced
        for name, module in found:
            device = _device_of(name, execution, default)
            view = _ExpertsConfigView(module.config, on_accelerator=device.type != "cpu" and not is_expert_group(module))
            originals.append((module, module.__dict__["config"]))
            module.__dict__["config"] = view
            views.append(view)
        model.__dict__[_DECODE_SWITCH] = _decode_switch(views)
    except BaseException:
        undo()
        raise
    return undo


def _restorer(model: nn.Module, originals: list[tuple[nn.Module, object]]) -> Callable[[], None]:
    """The undo of :func:`pin_experts_to_devices`: puts back every ``(module, config)`` of
    ``originals`` (filled after this call) and the model's decode switch as it is now."""
    had_own = _DECODE_SWITCH in model.__dict__
    previous = model.__dict__.get(_DECODE_SWITCH)

    def undo() -> None:
        for module, config in reversed(originals):
            module.__dict__["config"] = config
        originals.clear()
        if had_own:
            model.__dict__[_DECODE_SWITCH] = previous
        else:
            model.__dict__.pop(_DECODE_SWITCH, None)

    return undo


def _decode_switch(views: list[_ExpertsConfigView]) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """The model's decode switch: flips the ``views`` to decoding instead of the shared config."""

    @contextlib.contextmanager
    def decode_switch() -> Iterator[None]:
        for view in views:
            view.decoding = True
        try:
            yield
        finally:
            for view in views:
                view.decoding = False

    return decode_switch


def _device_of(name: str, execution: Mapping[str, torch.device], default: torch.device) -> torch.device:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        device = execution.get(".".join(parts[:end]))
        if device is not None:
            return device
    return execution.get("", default)
