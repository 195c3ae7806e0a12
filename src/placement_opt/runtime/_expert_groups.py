"""Cutting a fused experts module into groups at run time (the unit names: :mod:`placement_opt.model.expert_groups`).

:func:`split_experts` replaces a fused experts module by an :class:`ExpertGroups` whose ``groups`` are instances of
the same experts class holding consecutive rows of every weight (views: no copy). A group answers only for its own
experts: routed indices outside its rows become transformers' expert-parallel sentinel (its expert count), with
weight 0, which every experts implementation of transformers skips or zeroes. Each group adds its share to the
running sum it is handed (``partial``).
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

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        partial = None
        for group in self.groups:
            partial = group(hidden_states, top_k_index, top_k_weights, *args, partial=partial, **kwargs)
        return partial


def split_experts(model: nn.Module, counts: Mapping[str, int]) -> Callable[[], None]:
    """Cut each experts module named in ``counts`` into that many groups; returns the undo.

    The groups' weights are views of the whole module's rows (no copy; dispatch moves or maps them as any weight).
    A module already cut into as many groups is left as it is. All or nothing: when it raises, every module
    it had replaced is back.

    Raises:
        DispatchError: a name that is no module of ``model``, a module that is not a fused experts module of
            transformers' experts interface, or more groups than it has experts.
    """
    replaced: list[tuple[nn.Module, str, nn.Module]] = []

    def undo() -> None:
        for parent, attr, original in reversed(replaced):
            parent._modules[attr] = original
        replaced.clear()

    try:
        for name, groups in counts.items():
            parent_name, _, attr = name.rpartition(".")
            module = _submodule(model, name)
            if isinstance(module, ExpertGroups) and len(module.groups) == groups:
                continue
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
    except BaseException:
        undo()
        raise
    return undo


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
