"""``load()``: a checkpoint directory -> a meta model -> a plan -> every weight read straight to its place."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..cost.workload import Workload
from ..errors import DeviceSpecError, DispatchError, ModelSpecError, PlacementError, WorkloadError
from ..model.expert_groups import group_counts
from ..plan import Plan
from ._conversion import Converted, conversions
from ._disk_full import disk_bytes, disk_full_error, is_disk_full, plan_disk_slots
from ._expert_groups import split_experts
from ._phases import workload_past_plan
from .checkpoint import (
    OFFLOAD_DIR_HINT,
    checkpoint_files,
    checkpoint_index,
    learned_positions,
    materialize,
    meta_model,
    needs_conversion,
)
from .dispatcher import DispatchedModel, dispatch
from .offload import SafetensorsFile

__all__ = ["load"]


def load(model_id_or_path: str | os.PathLike[str], devices: Any, *, objective: str = "latency",
         workload: Any = None, dtype: torch.dtype | str | None = None,
         offload_dir: str | os.PathLike[str] | None = None, plan: Plan | str | os.PathLike[str] | None = None,
         progress: bool | None = None, granularity: str | None = None,
         time_limit_s: float | None = None, pins: Mapping[str, Any] | None = None,
         expert_groups: int = 1) -> DispatchedModel:
    """Build a model on the meta device, solve its placement, read every weight straight to its place.

    Each tensor goes from the checkpoint's safetensors files straight to its storage device:
    GPU tensors are read one by one through pinned memory; CPU- and disk-stored tensors in the
    checkpoint's dtype are views of the memory-mapped shards (zero copy, copy-on-write; CPU ones
    are read ahead at once, disk ones when first used); other dtypes are read and cast one
    tensor at a time. The whole model is never in RAM twice, and disk units never enter it.

    Example::

        handle = placement_opt.load("out/my-llama", ["cuda:0", "cpu", "disk"], dtype="float16")
        tokens = handle.generate(input_ids, max_new_tokens=32)

    Args:
        model_id_or_path: a local directory written by ``save_pretrained`` (``config.json`` and
            ``model.safetensors`` or a ``model.safetensors.index.json`` with shards).
        devices: anything :func:`~placement_opt.hardware.resolve.resolve_machine` accepts
            (``["cuda:0", "cpu", "disk"]``, a ``Machine``, a ``max_memory`` dict, a spec string,
            None for this machine). With ``plan``: the budgets the plan must keep (None: the plan's own).
        objective: ``"latency"``, ``"throughput"`` or ``"memory"``, passed to the solver.
        workload: the :class:`~placement_opt.cost.workload.Workload` to optimise for. With ``plan``: the one it
            will run (``placement-opt run --plan`` passes it); one holding more tokens than the plan's own is
            warned of before anything is read (the plan counted no memory for them).
        dtype: weights' dtype; default (or ``"auto"``, as from_pretrained takes it): the checkpoint's, or a given
            ``plan``'s (a plan is priced for its dtype: another is refused). Disk-stored units whose checkpoint
            dtype differs are converted once into ``offload_dir``.
        offload_dir: where converted disk weights go (only needed in that case, or for disk units of a
            checkpoint whose layout transformers converts at load: Mixtral's and Qwen-MoE's experts, one
            tensor each in the checkpoint, are fused per layer one weight at a time, with transformers' own
            conversion mapping).
        plan: a plan to use instead of solving, or the path of a plan file (:meth:`Plan.to_json`).
        progress: a bar of the checkpoint's bytes read, on stderr. ``None`` (default): shown on a
            terminal or in a notebook, silent in pipes and under pytest, or as the environment
            variable ``PLACEMENT_OPT_PROGRESS`` (``1``/``0``/``auto``) says; ``True``/``False`` decide.
        granularity: what the solver places (:func:`~placement_opt.planner.solve`): ``"block"``
            (default: decoder layers whole), ``"sublayer"`` (attention, MLP, experts apart), ``"module"``
            or ``"auto"`` (block and sublayer both, the better plan kept); ignored when ``plan`` is given.
        time_limit_s: the solver's time limit. ``None`` (default): the solver's 1 s, and where that search
            stops more than 1 % above its bound, up to :data:`~placement_opt.report.EXTRA_SEARCH_S` more
            (reading the weights takes far longer); the plan's notes say so.
        pins: storage devices fixed by the caller, as :func:`~placement_opt.planner.solve` takes them
            (``{"lm_head": 0}``, or a pattern: ``{"model.layers.*.mlp.experts": "cpu"}`` with
            ``granularity="sublayer"``); ignored when ``plan`` is given.
        expert_groups: with ``granularity="sublayer"`` or ``"auto"``, each MoE layer's experts in this many groups
            placed on their own (:func:`~placement_opt.planner.solve`); ignored when ``plan`` is given (its units
            say it). Each group's weights are read as rows of the checkpoint's; disk-stored groups are written
            once to ``offload_dir``.

    Returns:
        A :class:`DispatchedModel` in eval mode.

    Raises:
        DispatchError: no safetensors checkpoint in the directory, or a weight the model needs
            is missing from it; a given ``plan`` of another model, for GPUs this machine does not have,
            or using more of a device than ``devices`` gives it (checked before anything is read); ``offload_dir`` the
            checkpoint's own folder; the disk full while converted weights are written (with the figures).
        WorkloadError: ``workload`` feeds the model more tokens than its learned position table holds (GPT-2's).
        DeviceSpecError: ``devices`` names a GPU this machine does not have (before solving).
        ModelSpecError: ``model_id_or_path`` is not a path, or its config.json cannot be read or builds no model.
        PlanFormatError: ``plan`` is a path of a file that is not a plan.
        MemoryError, torch.OutOfMemoryError: memory ran out while loading; raised as they are, with a
            note, as :func:`dispatch` raises them.
    """
    if not isinstance(model_id_or_path, str | os.PathLike):
        raise ModelSpecError(f"load() reads a checkpoint directory: pass its path, not a "
                             f"{type(model_id_or_path).__name__} (an nn.Module already built goes to dispatch())")
    if isinstance(dtype, str) and dtype.strip().lower() == "auto":  # from_pretrained's word for the checkpoint's own
        dtype = None
    plan = _given_plan(plan)
    root = Path(model_id_or_path)
    files = checkpoint_files(root)
    _check_offload_dir(root, offload_dir)
    if plan is not None:
        dtype = _plan_dtype(plan, dtype)
    model = meta_model(root, dtype)
    _check_positions(model, workload)
    if plan is not None:
        _warn_past_plan(plan, workload)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # before reading, so tied names share one tensor and are read once
    given = plan is not None
    if plan is None:
        plan = _solve(model, devices, time_limit_s, objective=objective, workload=workload, granularity=granularity,
                      pins=pins, expert_groups=expert_groups)
    # a plan's expert groups are modules from here (on meta: nothing is allocated), read as rows of their weights
    split_experts(model, group_counts(p.unit for p in plan.placements))
    _preflight(model, plan)  # first: a plan of another model or for absent GPUs fits no budget
    if given and devices is not None:
        _check_budgets(plan, devices)
    sources: dict[str, tuple[SafetensorsFile, str]] = {}
    try:  # the model is load()'s own; on failure only the open files need letting go (dispatch undoes itself)
        sources = checkpoint_index(files)
        converted: dict[str, Converted] = {}
        if needs_conversion(model, sources):
            found = conversions(model, sources)
            if found is None or needs_conversion(model, {**sources, **found[0], **found[1]}):
                return _load_converted(root, model, plan, offload_dir, _told(given, workload))
            sources = {**sources, **found[0]}
            converted = found[1]
        disk_sources = materialize(model, plan, sources, offload_dir, converted=converted, progress=progress,
                                   description=f"Loading {root.name}")
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        model.eval()
        return dispatch(model, plan, offload_dir=offload_dir, _disk_sources=disk_sources, _restore=False,
                        _told=_told(given, workload))
    except BaseException as exc:
        _on_failure(exc, root, offload_dir, sources, model, plan)
        raise


def _on_failure(exc: BaseException, root: Path, offload_dir: Any,
                sources: Mapping[str, tuple[SafetensorsFile, str]], model: nn.Module, plan: Plan) -> None:
    """None once the open checkpoint files are let go (and an out-of-memory noted): :func:`load` then raises
    ``exc`` as it is; or the DispatchError that says what a full disk or an unreadable checkpoint asks of the
    caller, raised in its place."""
    for file in {id(f): f for f, _ in sources.values()}.values():
        file.close()
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        # as dispatch() does: callers catch running out of memory by its own type (to retry smaller)
        exc.add_note(f"placement_opt.load ran out of memory loading {root} in its plan")
    elif is_disk_full(exc):
        raise disk_full_error(f"load() of {root}", "the weights its plan converts", offload_dir,
                              disk_bytes(plan_disk_slots(model, plan)),
                              "the units written so far are kept and reused by the next load") from exc
    elif isinstance(exc, Exception) and not isinstance(exc, PlacementError):
        text = (str(exc).strip().splitlines() or [""])[0][:300]
        raise DispatchError(f"load() of {root} failed reading its checkpoint ({type(exc).__name__}: {text}): "
                            f"check that the directory is a complete checkpoint of this model "
                            f"(save or download it again)") from exc


def _check_offload_dir(root: Path, offload_dir: Any) -> None:
    """Refuse the checkpoint's own folder as ``offload_dir``: the store's files there hold the checkpoint's tensor
    names (casts, fused experts), and a checkpoint read as every ``*.safetensors`` of its folder would load them."""
    if offload_dir is None or not isinstance(offload_dir, str | os.PathLike):
        return  # not given, or not a path: the offload store says what it takes
    if Path(offload_dir).expanduser().resolve() == root.resolve():
        raise DispatchError(f"offload_dir is the checkpoint folder {root}: converted weights would be written there "
                            f"under the checkpoint's tensor names, beside its own files; pass {OFFLOAD_DIR_HINT} naming "
                            f"another folder (e.g. {root.name}-offload beside it)")


def _check_positions(model: nn.Module, workload: Any) -> None:
    """Refuse a ``workload`` past the model's learned position table (:func:`~.checkpoint.learned_positions`):
    generate() would stop mid-run at its lookup."""
    if not isinstance(workload, Workload) or (table := learned_positions(model)) is None:
        return  # no workload (the solver's default), one the solver refuses with its own message, or no table
    name, most = table
    fed_back = max(workload.decode_steps - 1, 0)  # the last token generated is never fed back; training feeds none
    positions = workload.prompt_len + fed_back
    if positions > most:
        what = (f"prompt_len + new_tokens - 1, {workload.prompt_len} + {workload.new_tokens} - 1," if fed_back else
                f"{'training step' if workload.training else 'forward'} of prompt_len {workload.prompt_len}")
        raise WorkloadError(
            f"the model has {most} learned positions ({name}), and the workload's {what} feeds it {positions}: "
            f"give a workload whose prompt and fed-back tokens take at most {most} positions")


def _warn_past_plan(plan: Plan, workload: Any) -> None:
    """Warn, before a byte is read, of a ``workload`` beside a given plan that holds more KV cache (batch x context)
    or computes more tokens at once (batch x prompt) than the plan counted memory for: dispatch's hooks warn of
    such a call when it runs, after the whole checkpoint has been read."""
    if not isinstance(workload, Workload):
        return
    past = workload_past_plan(workload, plan.workload)
    if past:
        warnings.warn(f"the workload given beside the plan {' and '.join(past)}: its KV cache and activations take "
                      f"more memory than the plan counted, and may not fit; leave plan out to solve one for this "
                      f"workload, or run the plan's own", UserWarning, stacklevel=3)


def _told(given: bool, workload: Any) -> tuple[int, int, int] | None:
    """The (batch, prompt, context) of a workload given beside a plan: :func:`_warn_past_plan` has said what it
    holds past the plan, so the dispatched model's calls within it are not warned of again, in other words."""
    if not given or not isinstance(workload, Workload):
        return None
    return workload.batch_size, workload.prompt_len, workload.context_len


def _given_plan(plan: Any) -> Plan | None:
    """``plan`` as a :class:`Plan`: one given, or read from the path of a file :meth:`Plan.to_json` wrote."""
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, str | os.PathLike):
        return Plan.from_json(plan)
    raise DispatchError(f"plan is a {type(plan).__name__}: load() takes a Plan (placement_opt.solve) or the path of "
                        f"a plan file (Plan.to_json); a device_map dict goes to from_pretrained(device_map=...)")


def _preflight(model: nn.Module, plan: Plan) -> None:
    """What :func:`dispatch` checks of a plan, before a byte is read: it is this model's (its units and their
    sizes), its phased units are runnable, and every GPU it names is here. Else a plan for another model or
    machine failed part-way through reading, as a checkpoint error, with converted weights already written."""
    from ..plan_check import check_plan
    from ._preflight import build_units, check_devices, check_phased

    check_phased(plan)
    units = build_units(model, plan)
    check_plan(model, plan)
    check_devices(units)


def _plan_dtype(plan: Plan, dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    """The dtype a given plan is loaded in: the one it was priced for (its bytes, its times). A float16 plan read
    in a float32 checkpoint's own dtype held twice the memory the plan counts, and passed its budget check."""
    from ..model.dtypes import as_torch_dtype, dtype_name

    if not plan.cost.memory:  # not priced (made by hand): nothing counted in a dtype to hold it to
        return dtype
    if dtype is None:
        return plan.dtype
    asked = dtype_name(as_torch_dtype(dtype))
    if asked != plan.dtype:
        raise DispatchError(f"dtype={asked!r}, but the plan was priced for {plan.dtype!r} (its memory and times): "
                            f"leave dtype out to load in {plan.dtype}, or solve a plan for {asked}")
    return dtype


def _check_here(machine: Any) -> None:
    """load() runs the model in this process: every GPU of the machine it plans for must be here. A max_memory dict
    or a ``cuda:0=SIZE`` spec describes a GPU without looking for it (solve() plans for machines one does not have)."""
    from ..hardware.devices import gpu_index
    from ._preflight import cuda_device_count

    count = cuda_device_count()
    absent = [d.name for d in machine.devices if d.kind == "gpu" and gpu_index(d.name) >= count]
    if absent:
        raise DeviceSpecError(f"devices names {', '.join(absent)}, but this machine has {count} CUDA device(s): load() "
                            f"runs the model here, so name only devices it has (without a GPU: the CPU and the disk); "
                            f"{ELSEWHERE_HINT}")


#: Where a Python caller plans for a machine it does not have (the command line names its own command).
ELSEWHERE_HINT = "placement_opt.solve() plans for a machine you do not have"
#: What a plan over its budgets asks of a Python caller (``run`` says it in its flags).
BUDGET_HINT = ("solve a plan for these devices (leave plan out), or pass devices=None to run the plan on the budgets "
               "it was solved for")


def _check_budgets(plan: Plan, devices: Any) -> None:
    """Refuse a given ``plan`` that uses more of a GPU or the CPU than ``devices`` gives it (or one it leaves out):
    a budget passed beside a plan is a limit the caller means, and running over it is the OOM it guards against."""
    from ..distributed.context import current_context
    from ..hardware.resolve import resolve_machine
    from ..units import format_bytes

    machine = resolve_machine(devices, current_context(), dtype=plan.dtype)
    given = {d.name: d.usable_bytes for d in machine.devices}
    over = []
    for use in plan.cost.memory:
        # the disk is left out: load() maps disk units from the checkpoint's own files, which take no new space
        if use.used_bytes == 0 or use.device == "disk":
            continue
        if use.device not in given:
            over.append(f"{use.device} ({format_bytes(use.used_bytes)}), which devices does not name")
        elif use.used_bytes > given[use.device]:
            over.append(f"{format_bytes(use.used_bytes)} of {use.device}, more than the {format_bytes(given[use.device])} "
                        f"devices gives it")
    if over:
        raise DispatchError(f"the plan for {plan.model_name!r} uses {'; '.join(over)} (its own workload, batch "
                            f"{plan.workload.batch_size} x {plan.workload.prompt_len} + {plan.workload.new_tokens}): "
                            f"{BUDGET_HINT}")


def _solve(model: nn.Module, devices: Any, time_limit_s: float | None, **options: Any) -> Plan:
    """Plan the meta model for the machine ``resolve_machine`` gives this process (or rank), with ``solve``'s
    ``options``; without a time limit, search again where the default search stopped far from its bound."""
    from ..distributed.context import current_context
    from ..hardware.resolve import resolve_machine
    from ..model.dtypes import dtype_name, module_dtype
    from ..planner import searched_again, solve  # the planner imports no runtime module
    from ..report import gap_advice

    machine = resolve_machine(devices, current_context(), dtype=dtype_name(module_dtype(model)))
    _check_here(machine)

    def solved(limit_s: float | None) -> Plan:
        extra = {} if limit_s is None else {"time_limit_s": limit_s}
        return solve(model, machine, **options, **extra)

    plan = solved(time_limit_s)
    if time_limit_s is None and gap_advice(plan) is not None:
        plan = searched_again(plan, solved)
    return plan


def _load_converted(root: Path, skeleton: nn.Module, plan: Plan, offload_dir: Any,
                    told: tuple[int, int, int] | None = None) -> DispatchedModel:
    """Checkpoints in a layout transformers converts at load time and :func:`~._conversion.conversions` cannot
    read (its mapping changed, or it does not cover every weight): transformers reads and converts them into
    RAM, then the plan is applied (disk units are written once to ``offload_dir``)."""
    if offload_dir is None and any(p.storage == "disk" for p in plan.placements):
        raise DispatchError(
            f"{root} stores weights in a layout transformers converts at load time ({type(skeleton).__name__}), "
            f"so they cannot be mapped from the checkpoint: pass {OFFLOAD_DIR_HINT} for the disk units"
        )
    dtype = next(iter(skeleton.parameters())).dtype
    model, info = type(skeleton).from_pretrained(root, dtype=dtype, output_loading_info=True)
    if missing := sorted(info.get("missing_keys") or ()):  # transformers drew them at random: never a model's weights
        raise DispatchError(f"{len(missing)} weight(s) are not in the checkpoint: {', '.join(missing[:5])}"
                            f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}: transformers would start "
                            f"them at random; is the directory a complete checkpoint of this architecture (save or "
                            f"download it again)?")
    return dispatch(model.eval(), plan, offload_dir=offload_dir, _restore=False, _told=told)
