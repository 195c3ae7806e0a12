"""What :func:`~.dispatcher.dispatch` works out and checks before it changes the model.

The plan against this run (no other rank's GPU, CUDA devices present, nothing executes on disk,
phased units stored on the CPU or disk, prefilled on a GPU and decoded on the CPU), the model (not
dispatched already, by placement_opt or by accelerate; every unit a module of it), and each tensor
given to the unit that owns it (tied tensors stored on one device). Everything here raises
:class:`~placement_opt.errors.DispatchError` and leaves the model as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DispatchError, PlacementError, PlanMismatchError
from ..hardware.detect import cuda_device_count
from ..model.graph import covering_key
from ..plan import Plan, UnitPlacement
from ..plan_check import MISMATCH_HINT
from ..units import few
from . import _streamer
from ._phases import attention_layers
from ._streamer import DispatchUnit
from .checkpoint import Slot

__all__ = ["check_model", "check_phased", "build_units", "assign_slots", "check_devices"]


def check_model(model: nn.Module, plan: Plan) -> None:
    """Refuse a plan using another rank's GPU, a model dispatched already (by us or by accelerate), a compiled
    wrapper."""
    _check_rank(plan)
    # torch.compile's wrapper (by name: importing torch._dynamo to test for it costs a second): its modules are
    # named _orig_mod.*, where the plan's units are the compiled module's names
    if type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
        raise DispatchError(f"the model is torch.compile's wrapper of a {type(model._orig_mod).__name__}: dispatch the "
                            f"module it compiled (dispatch(model._orig_mod, plan), the units trace() named), then "
                            f"compile the dispatched model if at all")
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
        raise PlanMismatchError(
            f"{len(missing)} unit(s) of the plan are not modules of {type(model).__name__}: {shown}; {MISMATCH_HINT}"
        )
    return [_unit(p, modules[p.unit]) for p in plan.placements]


def _unit(placement: UnitPlacement, module: nn.Module) -> DispatchUnit:
    torch_device = _streamer.torch_device  # looked up at each dispatch: tests map GPUs onto the CPU through it
    execution = torch_device(placement.execution)
    if placement.mode != "phased" or placement.prefill_execution is None:  # the latter: refused by check_phased
        return DispatchUnit(placement=placement, module=module, execution=execution)
    return DispatchUnit(placement=placement, module=module, execution=execution,
                        prefill=torch_device(placement.prefill_execution), layer_ids=attention_layers(module))


def check_phased(plan: Plan) -> None:
    """Phased units are stored on cpu/disk, decode on the CPU and prefill on a GPU; no other mode names a
    prefill device. Read from the plan's names, before any of them becomes a ``torch.device``."""
    problems = [text for text in map(_phased_problem, plan.placements) if text]
    if problems:
        raise DispatchError(f"{len(problems)} placement(s) cannot run phased: {'; '.join(problems[:3])}"
                            f"{'; ...' if len(problems) > 3 else ''}. A phased unit is stored on 'cpu' or "
                            f"'disk', computes its prefill on a GPU (prefill_execution='cuda:N', its weights "
                            f"streamed there) and its decode on 'cpu' (execution): fix those placements or "
                            f"solve the plan again")


def _phased_problem(p: UnitPlacement) -> str:
    prefill = p.prefill_execution
    if p.mode != "phased":
        if prefill is not None and prefill != p.execution:
            return f"{p.unit!r} ({p.mode}) names prefill_execution {prefill!r}, which only phased units have"
        return ""
    if prefill is None or prefill == p.execution:
        return f"{p.unit!r} has no prefill_execution other than its execution {p.execution!r}"
    if not prefill.startswith("cuda"):
        return f"{p.unit!r} would compute its prefill on {prefill!r}, not a GPU"
    if p.execution != "cpu":
        return f"{p.unit!r} would decode on {p.execution!r}, not 'cpu'"
    if p.storage not in ("cpu", "disk"):
        return f"{p.unit!r} is stored on {p.storage!r}, not 'cpu' or 'disk'"
    return ""


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
    wanted = sorted({d for u in units for d in (u.placement.storage, u.placement.execution,
                                                u.placement.prefill_execution or "")
                     if d.startswith("cuda")})
    count = cuda_device_count()
    absent = [d for d in wanted if count == 0 or (torch.device(d).index or 0) >= count]
    if absent:
        phased = sorted({u.name for u in units if u.placement.prefill_execution in absent})
        hint = (f" ({len(phased)} phased unit(s) compute their prefill there: {few(phased)}; without that "
                f"GPU, place them resident on 'cpu')" if phased else "")
        raise DispatchError(f"the plan uses {', '.join(absent)} but this machine has {count} CUDA device(s){hint}: "
                            f"solve a plan for this machine's devices (placement_opt.load() without plan= does)")
    bad = [u.name for u in units if u.placement.execution == "disk"]
    if bad:
        raise DispatchError(f"units {bad} execute on 'disk', which cannot compute: execute them on cpu or a GPU")
