"""Fused MoE experts on the meta device: a dense stand-in, since their routing needs real data.

:func:`stand_in_experts` is installed by :func:`._recorder.run` for the meta forward and removed after. Experts
told their rows per expert (JetMoE's) run as they are: it stands in for their router instead, which must hand
them Python ints.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["stand_in_experts", "is_fused_experts", "is_stacked_experts", "expert_count", "routing_argument",
           "PICKS_ARGUMENT", "COUNTS_ARGUMENT"]

#: The experts module's argument that holds each token's experts (transformers 5's experts interface).
PICKS_ARGUMENT = "top_k_index"
#: The experts module's argument that holds how many rows each expert gets, in expert order (JetMoE's
#: ``ParallelExperts``, for its MLP and its attention experts): its rows come sorted by expert and split by these
#: counts, every expert computing its share; one with no rows multiplies an empty input and reads none of its
#: weights.
COUNTS_ARGUMENT = "expert_size"


def stand_in_experts(module: nn.Module, experts_per_token: Callable[[nn.Module], int]) -> Callable[[], None]:
    """Replace fused MoE expert modules by a shape-correct dense stand-in for the meta forward.

    Fused experts (transformers 5 ``MixtralExperts``: 3D weights ``[num_experts, out, in]``) route tokens
    with data-dependent ops (``nonzero``) that cannot run on meta tensors. The stand-in sends every
    token through ``top_k`` experts' weights, so the FLOPs counted are exactly ``top_k / num_experts`` of
    all experts' dense FLOPs: what a routed forward computes on average. It does so for all
    ``tokens x top_k`` rows at once, as the ``grouped_mm`` implementation does (transformers 5's default),
    so the activation bytes the trace measures are those of the widest implementation.

    DBRX's experts (:func:`is_stacked_experts`) loop over the experts hit, one at a time: their stand-in runs that
    loop with the rows spread evenly over the experts.

    Experts told their rows per expert (JetMoE's ``ParallelExperts``) split their input by Python ints and compute
    every expert's share: they run on meta once their router (:func:`_counts_rows`) gives evenly split counts.
    """
    patched: list[nn.Module] = []
    for sub in module.modules():
        if is_fused_experts(sub) and not _told_rows(sub):
            top_k = experts_per_token(sub)
            sub.forward = _dense_experts(sub, top_k)  # instance attribute, removed again below
            patched.append(sub)
        elif is_stacked_experts(sub):
            sub.forward = _stacked_experts(sub, experts_per_token(sub))
            patched.append(sub)
        elif _counts_rows(sub):
            sub.forward = _even_routing(sub)
            patched.append(sub)

    def restore() -> None:
        for sub in patched:
            del sub.forward
    return restore


def is_stacked_experts(module: nn.Module) -> bool:
    """DBRX's experts module: told the router's picks (``top_k_index``), every expert's weights stacked along the
    rows of its child's 2-D tensors (``mlp.w1``, ``mlp.v1``, ``mlp.w2``: ``[experts x ffn, hidden]``), the child
    computing one expert from their slices."""
    experts = getattr(module, "num_experts", None)
    child = getattr(module, "mlp", None)
    if (not isinstance(experts, int) or experts < 1 or not type(module).__name__.endswith("Experts")
            or not isinstance(child, nn.Module) or routing_argument(module) != PICKS_ARGUMENT):
        return False
    weights = [getattr(child, name, None) for name in _STACKED]
    return all(isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] % experts == 0 for w in weights)


def expert_count(module: nn.Module) -> int:
    """The experts of a fused (the first dimension of its 3-D tensors) or stacked (:func:`is_stacked_experts`)
    experts module; 0 for any other module."""
    fused = [p.shape[0] for p in module._parameters.values() if p is not None and p.dim() == 3]
    if fused:
        return int(max(fused))
    return module.num_experts if is_stacked_experts(module) else 0


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers 5 fused experts module (``MixtralExperts``): 3D weights ``[experts, out, in]``."""
    params = [p for p in module._parameters.values() if p is not None]
    return type(module).__name__.endswith("Experts") and any(p.dim() == 3 for p in params)


#: DBRX's stacked expert tensors, in the order its expert module takes their slices.
_STACKED = ("w1", "v1", "w2")


def routing_argument(module: nn.Module) -> str | None:
    """The argument of ``module``'s forward that names the experts a call computes (:data:`PICKS_ARGUMENT`,
    :data:`COUNTS_ARGUMENT`), or None: Llama 4's experts take the hidden states alone and run every expert on
    every token."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in (PICKS_ARGUMENT, COUNTS_ARGUMENT) if name in parameters), None)


def _told_rows(module: nn.Module) -> bool:
    """Whether ``module`` is told its rows per expert: it runs on meta as it is once they are known
    (:func:`_even_routing`), and computes exactly the routed rows' FLOPs."""
    return routing_argument(module) == COUNTS_ARGUMENT


def _stacked_experts(module: nn.Module, top_k: int) -> Callable[..., torch.Tensor]:
    """DBRX's experts loop on meta: each expert in turn gathers its rows, computes them through the child with its
    slices of the stacked tensors and adds them back, the ``tokens x top_k`` rows spread evenly over the experts
    (an expert without rows is skipped, as the real loop skips the experts no token picked)."""
    child = module.mlp

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = torch.zeros_like(flat)
        experts = module.num_experts
        rows = flat.shape[0] * top_k
        weights = top_k_weights.reshape(-1)
        # the loop's bookkeeping, alive throughout: a one-hot int64 mask of every (token, pick) over the experts
        # and the sentinel, and the experts hit (their counts, then their ids)
        mask = torch.empty(rows, experts + 1, dtype=torch.int64, device=flat.device)
        hit = torch.empty(2, experts + 1, dtype=torch.int64, device=flat.device)
        for expert in range(experts):
            count = rows // experts + (expert < rows % experts)
            if count == 0:
                continue
            # the expert's (pick, token) positions, as torch.where gives them; the routing read through them
            where = torch.empty(2, count, dtype=torch.int64, device=flat.device)
            picked = top_k_index.reshape(-1)[:count]
            slices = [getattr(child, name).view(experts, -1, flat.shape[-1])[expert] for name in _STACKED]
            states = child(flat[picked], *slices) * weights[:count, None]
            out.index_add_(0, picked, states)
            del where
        del mask, hit
        return out.view(hidden_states.shape)
    return forward


def _counts_rows(module: nn.Module) -> bool:
    """JetMoE's router (``JetMoeTopKGating``): it returns the rows per expert as Python ints (``.tolist()``), which
    a meta tensor cannot give."""
    return (type(module).__name__.endswith("TopKGating") and isinstance(getattr(module, "layer", None), nn.Linear)
            and isinstance(getattr(module, "top_k", None), int) and isinstance(getattr(module, "num_experts", None), int))


def _even_routing(module: nn.Module) -> Callable[..., tuple[Any, ...]]:
    """The router's outputs with its rows spread evenly over the experts: the uniform routing the cost model
    assumes, so the experts' FLOPs are the routed average. Its ops run as the real router's do, so the trace sees
    the data flow from the router's input to the experts."""

    def forward(hidden_states: torch.Tensor) -> tuple[Any, ...]:
        logits = module.layer(hidden_states).float()
        top_k_logits, top_k_indices = logits.topk(module.top_k, dim=1)
        gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states).flatten()
        _, sorted_rows = top_k_indices.flatten().sort(0)
        rows = sorted_rows.shape[0]
        sizes = [rows // module.num_experts + (i < rows % module.num_experts) for i in range(module.num_experts)]
        return sorted_rows, sorted_rows.div(module.top_k, rounding_mode="trunc"), gates[sorted_rows], sizes, logits
    return forward


def _dense_experts(module: nn.Module, top_k: int) -> Callable[..., torch.Tensor]:
    # the module's own gate where it has one (Inkling2's activation takes the gate and up halves together)
    act = getattr(module, "_apply_gate", None) or _gated(getattr(module, "act_fn", torch.nn.functional.silu))

    def forward(hidden_states: torch.Tensor, *routing: Any, **more: Any) -> torch.Tensor:
        # read the router's choice as the routed forward does, so that the trace sees the data flow from
        # the router to the experts (a "sublayer" graph's edge); a view allocates nothing and counts no FLOPs
        for tensor in (*routing, *more.values()):
            if isinstance(tensor, torch.Tensor):
                tensor.view(tensor.shape)
        # read the parameters at call time: functional_call has swapped in their meta stand-ins
        named = [(n, p) for n, p in module._parameters.items() if p is not None and p.dim() == 3]
        weights = [p for _, p in named]
        # per weight its bias (GPT-OSS), which grouped_mm gathers per row: (rows, out), alive until the next
        # weight's gather replaces it, the down projection's through the tail (charged 0.70-0.79x without them)
        biases = [module._parameters.get(f"{n}_bias") for n, _ in named]
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        # one row per (token, chosen expert), all at once, as transformers' grouped_mm experts do: the
        # activations alive then are what the trace measures (the eager loop holds one expert's rows at a time)
        routed = flat.repeat_interleave(top_k, dim=0)  # kept to the end, as grouped_mm keeps its gathered rows
        # and its routing bookkeeping: per row the sorted expert ids, the permutation and the float copy histc
        # reads, per expert the token counts and their offsets
        experts = max(w.shape[0] for w in weights) if weights else 1
        bookkeeping = (torch.empty(routed.shape[0], 3, dtype=torch.int64, device=routed.device),
                       torch.empty(2 * experts, dtype=torch.int32, device=routed.device))
        h, gathered = routed, None
        for k, w in enumerate(weights):
            last = k == len(weights) - 1 and len(weights) > 1
            # the last call applies the gate first, while the gather before it is still alive
            h = _apply_expert_weight(h, w[0], act, hidden=flat.shape[-1] if last else None)
            if biases[k] is not None and biases[k].dim() == 2:
                gathered = torch.empty(h.shape[0], biases[k].shape[-1], dtype=biases[k].dtype, device=h.device)
        if h.shape[-1] != flat.shape[-1]:
            return torch.zeros_like(hidden_states)
        # grouped_mm's tail: the rows times their routing weight, then put back in token order (a gather), each a
        # new tensor while the rows before them stay alive until the experts return. Where the experts are
        # narrower than the model (Qwen2-MoE, Qwen3-MoE), these four row tensors are the unit's peak: without
        # them a Qwen2-MoE experts unit was charged 0.78 of a real CPU forward's live bytes
        weighted = h * torch.empty(h.shape[0], 1, dtype=h.dtype, device=h.device)
        back = weighted[torch.empty(h.shape[0], dtype=torch.int64, device=h.device)]
        out = back.view(flat.shape[0], top_k, -1).sum(dim=1).reshape(hidden_states.shape)
        del routed, bookkeeping, h, weighted, back, gathered
        return out
    return forward


def _apply_expert_weight(h: torch.Tensor, w: torch.Tensor, act: Any, *, hidden: int | None = None) -> torch.Tensor:
    """``h`` through one expert weight ``w`` (``[out, in]`` or ``[in, out]``). ``hidden``: ``w`` is the down
    projection, whose output is the model's width; where ``h`` holds the fused gate and up halves, the gated
    activation comes first.

    The down projection's orientation is fixed by its output, not guessed from the shapes: read from the shapes
    alone, a model whose fused gate/up is as wide as the model (twice the expert width equal to the hidden size:
    OLMoE, Granite-MoE) had its down projection transposed and its activation skipped, and the stand-in
    returned zeros without its tail (a Qwen2-MoE-shaped experts unit charged 0.78 of its live bytes).
    """
    if hidden is None:
        return torch.nn.functional.linear(h, w if w.shape[-1] == h.shape[-1] else w.t())
    w = w if w.shape[0] == hidden else w.t()  # [hidden, expert width]
    if h.shape[-1] == 2 * w.shape[1]:
        h = act(h)
    return torch.nn.functional.linear(h, w)


def _gated(act: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gated activation of a fused gate and up projection's output, from its activation function."""

    def gate(gate_up: torch.Tensor) -> torch.Tensor:
        gate_half, up = gate_up.chunk(2, dim=-1)
        return act(gate_half) * up
    return gate
