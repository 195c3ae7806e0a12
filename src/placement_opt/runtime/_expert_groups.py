"""Cutting a fused experts module into groups at run time (the unit names: :mod:`placement_opt.model.expert_groups`).

:func:`split_experts` replaces a fused experts module by an :class:`ExpertGroups` whose ``groups`` are instances of
the same experts class holding consecutive rows of every weight (views: no copy). A group answers only for its own
experts: routed indices outside its rows become transformers' expert-parallel sentinel (its expert count), with
weight 0, which every experts implementation of transformers skips or zeroes. Each group adds its share to the
running sum it is handed (``partial``). The model's ``state_dict`` and ``load_state_dict`` keep the fused weights'
names; the undo puts the groups' rows back into the whole module's own Parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import DispatchError, PlanMismatchError
from ..model._units import groupable
from ..model.expert_groups import group_ranges, whole_experts

__all__ = ["ExpertGroups", "split_experts", "source_rows", "is_expert_group"]


class ExpertGroups(nn.Module):
    """Stands where a fused experts module stood; its ``groups`` hold the experts' rows, in order."""

    def __init__(self, whole: nn.Module, ranges: Sequence[tuple[int, int]]) -> None:
        super().__init__()
        self.num_experts = whole.num_experts
        self.groups = nn.ModuleList(_group(whole, start, end) for start, end in ranges)
        self.train(whole.training)  # a new module is in training mode; the model may be in eval
        self._fused = tuple(k for k, t in whole._parameters.items() if t is not None)
        # the model's state_dict keeps the fused names (save_pretrained, load_state_dict): groups are how it runs
        self.register_state_dict_post_hook(_fused_state)
        self.register_load_state_dict_pre_hook(_split_state)

    def fused(self, name: str) -> torch.Tensor:
        """The fused weight ``name`` as the groups hold it now: their rows, in order (on the first group's device
        where they are on several; on the meta device where any is)."""
        parts = [g._parameters[name].data for g in self.groups]
        if any(p.is_meta for p in parts):
            return torch.empty((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype,
                               device="meta")
        return torch.cat([p.to(parts[0].device) for p in parts], dim=0)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        partial = None
        for group in self.groups:
            partial = group(hidden_states, top_k_index, top_k_weights, *args, partial=partial, **kwargs)
        return partial


def _fused_state(module: ExpertGroups, state: dict[str, Any], prefix: str, _metadata: Any) -> None:
    """``state_dict`` post-hook: each group's rows under the fused weight's own name, as the model had it (a
    checkpoint written while the experts ran cut into groups reloaded with them at random)."""
    for name in module._fused:
        keys = [f"{prefix}groups.{i}.{name}" for i in range(len(module.groups))]
        if all(k in state for k in keys):
            for key in keys:
                del state[key]
            state[prefix + name] = module.fused(name)


def _split_state(module: ExpertGroups, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: a fused weight given under its own name is cut into the groups' rows."""
    for name in module._fused:
        if prefix + name in state:
            whole = state.pop(prefix + name)
            for i, group in enumerate(module.groups):
                start = group.first_expert
                state[f"{prefix}groups.{i}.{name}"] = whole[start:start + group.num_experts]


def _write_back(groups: ExpertGroups, whole: nn.Module) -> None:
    """Before ``whole`` stands again: its weights are the groups' rows as they are now. Rows that dispatch moved
    (to the disk, a GPU) or that a caller changed are no longer views of its own tensors, and a change made while
    dispatched was lost at ``remove()``."""
    for name in groups._fused:
        tensor = whole._parameters[name]
        parts = [g._parameters[name].data for g in groups.groups]
        if tensor.is_meta:
            continue  # never released (_release): the groups of a meta model are meta too
        joined = _in_place(parts, tensor.device)
        tensor.data = joined if joined is not None else torch.cat([p.to(tensor.device) for p in parts])


def _in_place(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The whole tensor the groups' rows still are consecutive views of, on ``device`` (no copy: a copy at
    ``remove()`` held the experts twice), or None when a group's rows live elsewhere now."""
    first = parts[0]
    if first.is_meta or first.device != device:
        return None
    rows = 0
    for p in parts:
        if (p.device != device or p.stride() != first.stride() or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or p.storage_offset() != first.storage_offset() + rows * first.stride()[0]):
            return None
        rows += p.shape[0]
    whole = first.new_empty(0)
    return whole.set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]), first.stride())


def _release(whole: nn.Module) -> None:
    """Out of the model, ``whole`` need not hold its weights: the groups' rows are views of them, and the undo
    writes them back (:func:`_write_back`). Held, the whole tensors stayed in RAM while dispatch moved every group
    to the disk or a GPU, memory the plan does not count."""
    for tensor in whole._parameters.values():
        if tensor is not None and not tensor.is_meta:  # the same Parameter (an optimizer may hold it), emptied
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def split_experts(model: nn.Module, counts: Mapping[str, int]) -> Callable[[], None]:
    """Cut each experts module named in ``counts`` into that many groups; returns the undo.

    The groups' weights are views of the whole module's rows (no copy; dispatch moves or maps them as any weight).
    A module already cut into as many groups is left as it is. All or nothing: when it raises, every module
    it had replaced is back.

    Raises:
        DispatchError: a name that is no module of ``model``, a module that is not a fused experts module of
            transformers' experts interface, more groups than it has experts, or a module cut already into
            another number of groups (or cut, where ``counts`` leaves it whole).
    """
    replaced: list[tuple[nn.Module, str, nn.Module]] = []

    def undo() -> None:
        for parent, attr, original in reversed(replaced):
            current = parent._modules[attr]
            if isinstance(current, ExpertGroups):
                _write_back(current, original)
            parent._modules[attr] = original
        replaced.clear()

    try:
        for name, module in model.named_modules():
            if isinstance(module, ExpertGroups) and counts.get(name) != len(module.groups):
                raise DispatchError(_cut_already(name, module, counts.get(name)))
        for name, groups in counts.items():
            parent_name, _, attr = name.rpartition(".")
            module = _submodule(model, name)
            if isinstance(module, ExpertGroups):
                continue  # as many groups: checked above
            if not groupable(module):
                raise DispatchError(f"{name} ({type(module).__name__}) cannot be cut into expert groups: only fused "
                                    f"experts modules of transformers' experts interface can (transformers 5 MoE "
                                    f"models); plan with expert_groups=1")
            try:
                ranges = group_ranges(module.num_experts, groups)
            except ValueError as exc:
                raise DispatchError(f"{name}: {exc}") from None
            parent = model.get_submodule(parent_name)
            parent._modules[attr] = ExpertGroups(module, ranges)
            replaced.append((parent, attr, module))
            _release(module)
    except BaseException:
        undo()
        raise
    return undo


def _cut_already(name: str, module: ExpertGroups, groups: int | None) -> str:
    """Why a model whose experts are cut (load() leaves them so: its weights are the groups' rows) cannot take a
    plan that cuts them otherwise."""
    wanted = f"cuts it into {groups}" if groups else "places it whole"
    return (f"{name} is cut into {len(module.groups)} expert groups already (a model load() built in groups keeps "
            f"them after remove()), but the plan {wanted}: dispatch it with a plan of {len(module.groups)} groups, "
            f"or load() the checkpoint again with this plan")


def is_expert_group(module: nn.Module) -> bool:
    """A group made by :func:`split_experts`."""
    return bool(getattr(type(module), "_expert_group", False))


def source_rows(model: nn.Module, name: str) -> tuple[str, int, int] | None:
    """For a weight of an expert group, ``(the whole module's weight name, first row, end row)``; else None."""
    owner_name, _, attr = name.rpartition(".")
    parsed = whole_experts(owner_name)
    if parsed is None:
        return None
    owner = _submodule(model, owner_name)
    start = getattr(owner, "first_expert", None)
    if start is None:
        return None
    return f"{parsed[0]}.{attr}", start, start + owner.num_experts


def _submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise PlanMismatchError(f"{name} is no module of {type(model).__name__}, but the plan cuts it into expert "
                                f"groups: is the plan this model's? Solve a plan for this model") from None


def _group(whole: nn.Module, start: int, end: int) -> nn.Module:
    """An instance of ``whole``'s class (its group subclass) holding rows ``[start, end)`` of its weights."""
    cls = _group_class(type(whole))
    part = cls.__new__(cls)
    nn.Module.__init__(part)
    # module internals (hooks, training) are the group's own; a forward patched on the whole module's instance
    # (hooks of another library) is for its rows, not a group's
    internals = {*part.__dict__, "forward", "_hf_hook", "_old_forward"}
    for key, value in whole.__dict__.items():
        if key not in internals:
            part.__dict__[key] = value  # config, act_fn settings, implementation flags: shared, read-only
    part._modules.update(whole._modules)  # parameter-free (an activation): groupable() checked
    for key, tensor in whole._parameters.items():
        if tensor is not None:
            part._parameters[key] = nn.Parameter(tensor.data[start:end], requires_grad=tensor.requires_grad)
    for key, tensor in whole._buffers.items():
        if tensor is not None:
            part._buffers[key] = tensor[start:end]
    part.num_experts = end - start
    part.first_expert = start
    part.layer_experts = whole.num_experts  # a call of fewer tokens reads only its picks (runtime._routed_reads)
    # transformers' kernels honour the sentinel (skip or zero its rows) only in expert-parallel mode
    part._is_expert_parallel = True
    return part


@functools.cache
def _group_class(base: type[nn.Module]) -> type[nn.Module]:
    """``base`` answering for its own rows only: routed indices outside them become the sentinel."""

    def forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, *args: Any, partial: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        local = top_k_index - self.first_expert
        outside = (local < 0) | (local >= self.num_experts)
        local = local.masked_fill(outside, self.num_experts)  # transformers' expert-parallel sentinel
        weights = top_k_weights.masked_fill(outside, 0)
        out = base.forward(self, hidden_states, local, weights, *args, **kwargs)
        return out if partial is None else partial + out

    return type(f"{base.__name__}Group", (base,), {"forward": forward, "__module__": __name__, "_expert_group": True,
                                                   "__doc__": f"Consecutive experts of a {base.__name__}."})
