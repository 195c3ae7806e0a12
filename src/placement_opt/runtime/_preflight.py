"""What :func:`~.dispatcher.dispatch` works out and checks before it changes the model.

The plan against this run (no other rank's GPU, CUDA devices present, nothing executes on disk),
the model (not dispatched already, by placement_opt or by accelerate; every unit a module of it),
and each tensor given to the unit that owns it (tied tensors stored on one device). Everything
here raises :class:`~placement_opt.errors.DispatchError` and leaves the model as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DispatchError, PlacementError
from ..hardware.detect import cuda_device_count
from ..model.graph import covering_key
from ..plan import Plan
from ..units import few
from ._streamer import DispatchUnit, torch_device
from .checkpoint import Slot

__all__ = ["check_model", "build_units", "assign_slots", "check_devices"]


def check_model(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan using another rank's GPU, a model dispatched already (by us or by accelerate)."""
    _check_rank(plan)
    existing = getattr(model, "_placement_opt_dispatch", None)
    if existing is not None and not existing._removed:
        raise DispatchError("this model is already dispatched: call .remove() on its handle first")
    hooked_by_accelerate = [name or type(model).__name__ for name, m in model.named_modules() if hasattr(m, "_hf_hook")]
    if hooked_by_accelerate:
        raise DispatchError(
            f"{len(hooked_by_accelerate)} module(s) carry accelerate hooks ({', '.join(hooked_by_accelerate[:3])}): "
            f"the model was dispatched by accelerate (from_pretrained(device_map=...) on several devices). "
            f"Load it with placement_opt.load(), or call accelerate.hooks.remove_hook_from_submodules(model) first"
        )


def _check_rank(plan: Plan) -> None:
    """In a distributed run, a plan may use this rank's GPU only (the framework owns the others)."""
    from ..distributed.context import current_context
    from ..hardware.resolve import check_no_cross_rank_split

    try:
        check_no_cross_rank_split(plan, current_context())
    except PlacementError as exc:
        raise DispatchError(str(exc)) from exc


def build_units(model: nn.Module, plan: Plan) -> list[DispatchUnit]:
    """One :class:`DispatchUnit` per placement of the plan; every unit must be a module of ``model``."""
    modules = dict(model.named_modules())
    missing = [p.unit for p in plan.placements if p.unit not in modules]
    if missing:
        shown = few(missing)
        raise DispatchError(
            f"{len(missing)} unit(s) of the plan are not modules of {type(model).__name__}: {shown}. "
            f"Solve the plan for this model (placement_opt.solve(model, ...))"
        )
    return [DispatchUnit(placement=p, module=modules[p.unit], execution=torch_device(p.execution))
            for p in plan.placements]


def assign_slots(units: list[DispatchUnit], slots: list[Slot], plan: Plan) -> None:
    """Give each tensor to the unit owning its first name; tied tensors must share one storage."""
    by_name = {unit.name: unit for unit in units}
    conflicts = []
    for slot in slots:
        owners = {covering_key(n, by_name) for n in slot.names} - {None}
        storages = {by_name[o].placement.storage for o in owners}
        if len(storages) > 1:
            conflicts.append(f"{'/'.join(slot.names)} stored on {sorted(storages)}")
        owner = covering_key(slot.names[0], by_name)
        if owner is not None:
            by_name[owner].slots.append(slot)
        for user in sorted(owners):
            by_name[user].uses.append(slot)
    if conflicts:
        raise DispatchError(
            f"tied weights must be stored on one device ({len(conflicts)} conflict(s)): {'; '.join(conflicts)}. "
            f"Give the units that share them the same storage"
        )


def check_devices(units: list[DispatchUnit]) -> None:
    """Every CUDA device the units use is present, and no unit executes on disk."""
    wanted = sorted({d for u in units for d in (u.placement.storage, u.placement.execution)
                     if d.startswith("cuda")})
    count = cuda_device_count()
    absent = [d for d in wanted if count == 0 or (torch.device(d).index or 0) >= count]
    if absent:
        raise DispatchError(f"the plan uses {', '.join(absent)} but this machine has {count} CUDA device(s): "
                            f"solve the plan for this machine")
    bad = [u.name for u in units if u.placement.execution == "disk"]
    if bad:
        raise DispatchError(f"units {bad} execute on 'disk', which cannot compute: execute them on cpu or a GPU")
