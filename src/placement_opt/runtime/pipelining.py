"""Run a :class:`~..distributed.pipeline_plan.PipelinePlan` on ``torch.distributed.pipelining``.

:func:`pipeline` is called on every rank of a ``torchrun`` launch (the process group already
initialised). It builds the rank's stage as an ``nn.Module`` that holds only the plan's units for
that rank, under their original names (``model.layers.3.mlp.up_proj.weight``), so the stage's
``state_dict`` keys are the checkpoint's. From a checkpoint directory (``save_pretrained``) the
model is built on the meta device and only the stage's tensors are read. It wraps the module in a
``PipelineStage`` and returns it with the plan's schedule (``ScheduleGPipe`` or ``Schedule1F1B``).

A stage of a Hugging Face decoder-only model runs, in order, the units it holds among: the token
embedding (first stage: token ids in), the decoder layers (each stage computes the rotary tables
and the causal masks itself, from the hidden states' shape, one per kind of layer as the model's
forward does), the final norm and the output head (last stage: logits out), with the scalings the
model's forward applies after the embedding and the head. Between stages only the hidden states
travel. ``use_cache`` is off: a pipeline runs whole sequences (forward for inference, forward +
backward for training). A plan made for ``Workload(activation_checkpointing=True)`` runs each
decoder layer under ``torch.utils.checkpoint`` (non-reentrant) when gradients are on, as it was
priced.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from ..distributed.pipeline_plan import PipelinePlan
from ..errors import DispatchError
from ._conversion import Converted, conversions
from .checkpoint import (
    checkpoint_files,
    checkpoint_index,
    collect_slots,
    meta_model,
    needs_conversion,
)

__all__ = ["pipeline", "PipelineRun", "DecoderStage", "stage_module"]


@dataclass(frozen=True)
class PipelineRun:
    """What :func:`pipeline` returns on one rank."""

    stage: Any
    """The rank's ``torch.distributed.pipelining.PipelineStage``."""
    schedule: Any
    """``ScheduleGPipe`` or ``Schedule1F1B``: call ``schedule.step(...)`` on every rank."""
    module: DecoderStage
    """The stage's module (its parameters: the ones to give the optimizer on this rank)."""
    stage_index: int


class DecoderStage(nn.Module):
    """The units of one stage of a decoder-only model, under their original names."""

    def __init__(self, model: nn.Module, units: tuple[str, ...], *, checkpoint: bool = False) -> None:
        super().__init__()
        self.unit_names = units
        # a plan priced with activation checkpointing kept each layer's input only: run it so, or the stage holds
        # every activation it was not priced for (llama-2-7b's first of 4 stages: 46 GiB, planned at 28 GiB)
        self.checkpoint = checkpoint
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        roles = _roles(model, decoder)
        self._steps: list[tuple[str, str]] = []  # (role, unit name), in the plan's order
        for name in units:
            module = model.get_submodule(name)
            role = roles.get(id(module))
            if role is None:
                raise DispatchError(f"unit {name} ({type(module).__name__}) is not a token embedding, decoder layer, "
                                    f"rotary table, norm or output head: pipeline() runs Hugging Face decoder-only "
                                    f"models (LlamaForCausalLM and kin); plan with those, or split the model yourself")
            _graft(self, name, module)
            if role != "rotary":
                self._steps.append((role, name))
        # Rotary tables are recomputed on every stage with layers (only hidden states travel).
        self._rotary = getattr(decoder, "rotary_emb", None)
        # Gemma 3's table differs by kind of layer: it is told the kind
        self._typed_rotary = self._rotary is not None and "layer_type" in inspect.signature(
            self._rotary.forward).parameters
        self._config = getattr(decoder, "config", None) or getattr(model, "config", None)
        layers = {id(layer): i for i, layer in enumerate(getattr(decoder, "layers", ()))}
        self._kinds = {name: _attention_kind(self._config, layers[id(model.get_submodule(name))])
                       for role, name in self._steps if role == "layer"}
        self._scales = _model_scales(model, self._config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x
        extras: dict[str, dict[str, Any]] | None = None
        for role, name in self._steps:
            module = self.get_submodule(name)
            if role == "layer":
                extras = extras or self._layer_inputs(hidden)
                inputs = extras[self._kinds[name]]
                if self.checkpoint and torch.is_grad_enabled():  # from_pretrained's models train in eval() mode too
                    hidden = torch.utils.checkpoint.checkpoint(module, hidden, use_cache=False, use_reentrant=False,
                                                               **inputs)
                else:
                    hidden = module(hidden, use_cache=False, **inputs)
                hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            else:
                hidden = _scaled(role, module(hidden), self._scales)
        return hidden

    def _layer_inputs(self, hidden: torch.Tensor) -> dict[str, dict[str, Any]]:
        """Per kind of attention among this stage's layers, what the model's own forward hands such a layer: its
        mask (sliding-window layers see only their window) and its rotary table (Gemma 3's differ by kind)."""
        from transformers.masking_utils import create_masks_for_generate

        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self._rotary.to(hidden.device) if self._rotary is not None else None
        # the masks as the modeling files make them, one per kind of layer; the cache (None) goes by position:
        # transformers 5.24 renamed the argument past_key_values -> cache
        masks = create_masks_for_generate(self._config, hidden, None, None, position_ids=position_ids)
        out = {}
        for kind in set(self._kinds.values()):
            mask = masks[kind] if isinstance(masks, dict) else masks
            inputs: dict[str, Any] = {"attention_mask": mask, "position_ids": position_ids}
            if rotary is not None:
                typed = {"layer_type": kind} if self._typed_rotary else {}
                inputs["position_embeddings"] = rotary(hidden, position_ids=position_ids, **typed)
            out[kind] = inputs
        return out


def _attention_kind(config: Any, index: int) -> str:
    """The kind of attention of decoder layer ``index`` (a key of the masks ``create_masks_for_generate`` makes):
    the config's ``layer_types`` entry, else one kind for every layer. A kind transformers has no mask function of
    is refused: its layers would run under another mask than the model's."""
    from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING

    types = getattr(config, "layer_types", None)
    if not types:
        return "full_attention"  # create_masks_for_generate returns one mask: the key is not read
    kind = types[index]
    if kind not in LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING or isinstance(LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING[kind],
                                                                         dict):
        raise DispatchError(f"decoder layer {index} is of kind {kind!r}, whose mask the model builds itself: "
                            f"pipeline() runs models whose layers use full, sliding-window or chunked attention")
    return kind


#: What the model's own forward does around its units, by the config field that says how much, and the role it
#: follows: Granite scales the embeddings and the logits, Cohere the logits, Gemma 2 and 3 cap them.
_SCALES = ("embedding_multiplier", "logits_scaling", "logit_scale", "final_logit_softcapping")


def _model_scales(model: nn.Module, config: Any) -> dict[str, float]:
    """The scalings of :data:`_SCALES` that ``model`` applies: those its config sets to anything but a no-op
    (1, or None for a cap); a stage applies them after its embedding or output head, as the model does."""
    scales = {}
    for key in _SCALES:
        value = getattr(model, key, None) if key == "logit_scale" else getattr(config, key, None)
        if value is not None and not (key != "final_logit_softcapping" and value == 1):
            scales[key] = float(value)
    return scales


def _scaled(role: str, hidden: torch.Tensor, scales: dict[str, float]) -> torch.Tensor:
    if role == "embed" and "embedding_multiplier" in scales:
        return hidden * scales["embedding_multiplier"]
    if role != "head":
        return hidden
    if "logits_scaling" in scales:
        hidden = hidden / scales["logits_scaling"]
    if "logit_scale" in scales:
        hidden = hidden * scales["logit_scale"]
    if "final_logit_softcapping" in scales:
        cap = scales["final_logit_softcapping"]
        hidden = torch.tanh(hidden / cap) * cap
    return hidden


def _roles(model: nn.Module, decoder: nn.Module | None) -> dict[int, str]:
    if decoder is None:
        return {}
    roles: dict[int, str] = {}
    for attr, role in (("embed_tokens", "embed"), ("rotary_emb", "rotary"), ("norm", "norm")):
        if getattr(decoder, attr, None) is not None:
            roles[id(getattr(decoder, attr))] = role
    for layer in getattr(decoder, "layers", ()):
        roles[id(layer)] = "layer"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        roles[id(head)] = "head"
    return roles


def _graft(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at dotted ``name`` under ``root``, creating empty containers on the way."""
    *path, leaf = name.split(".")
    node = root
    for part in path:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]
    node.add_module(leaf, module)


def stage_module(model_or_checkpoint: Any, plan: PipelinePlan, stage_index: int, *,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> DecoderStage:
    """The module of stage ``stage_index``: units from ``model`` (real weights), or built on meta and read
    from the checkpoint directory (only this stage's tensors are read)."""
    units = plan.stages[stage_index].units
    if isinstance(model_or_checkpoint, (str, os.PathLike)):
        root = Path(model_or_checkpoint)
        model = meta_model(root, dtype)
        _check_units(model, units, plan)
        _load_stage(model, units, root, torch.device(device))
    else:
        model = model_or_checkpoint
        _check_units(model, units, plan)
        if any(p.is_meta for n, p in model.named_parameters() if _covered(n, units)):
            raise DispatchError("the model's weights are on the meta device: pass its checkpoint directory "
                                "(model.save_pretrained(path)) so that pipeline() reads this stage's tensors")
    checkpoint = plan.workload.training and plan.workload.activation_checkpointing
    module = DecoderStage(model, units, checkpoint=checkpoint).to(device)
    if plan.workload.training and _tied_across(model, plan, stage_index):
        raise DispatchError("the model ties weights (e.g. lm_head to embed_tokens) between stages; their gradients "
                            "would not be summed across ranks: untie them (tie_word_embeddings=False) to train")
    return module


def _covered(param: str, units: tuple[str, ...]) -> bool:
    return any(param == u or param.startswith(u + ".") for u in units)


def _check_units(model: nn.Module, units: tuple[str, ...], plan: PipelinePlan) -> None:
    """This stage's units are modules of ``model``, and the plan's stages together hold every parameter of it: a
    plan of a 2-layer model run on a 4-layer one ran without layers 2-3 and gave other logits, without a word."""
    names = dict(model.named_modules())
    missing = [u for u in units if u not in names]
    if missing:
        raise DispatchError(f"the plan's units {missing[:3]} are not modules of this model: plan with the same "
                            f"model (plan_pipeline(model, ...)) that you run")
    every = tuple(u for stage in plan.stages for u in stage.units)
    uncovered = [n for n, _ in model.named_parameters(remove_duplicate=False) if not _covered(n, every)]
    if uncovered:
        raise DispatchError(f"{len(uncovered)} parameter(s) of this model are in no stage of the plan "
                            f"({', '.join(uncovered[:3])}{' ...' if len(uncovered) > 3 else ''}): the plan was made "
                            f"for another model ({plan.model_name!r}); plan with the model you run "
                            f"(plan_pipeline(model, ...))")


def _load_stage(model: nn.Module, units: tuple[str, ...], root: Path, device: torch.device) -> None:
    index, converted = _stage_sources(model, root)
    for slot in collect_slots(model):
        if not any(_covered(n, units) for n in slot.names):
            continue
        key = next((n for n in slot.names if n in index), None)
        built = next((converted[n] for n in slot.names if n in converted), None) if key is None else None
        if key is None and built is None:
            if not slot.tensor.is_meta:
                continue  # a buffer computed at init (rotary tables), not in checkpoints
            raise DispatchError(f"checkpoint {root} has no tensor {slot.names[0]}: save the model with "
                                f"save_pretrained and plan with the same model")
        if built is not None:  # fused from the checkpoint's tensors as from_pretrained fuses them (Mixtral's experts)
            data = built.build(model)
        else:
            file, name = index[key]
            data = torch.empty(file.spans[name].shape, dtype=file.spans[name].dtype)
            file.read_into(name, data)
        data = data.to(device=device, dtype=slot.tensor.dtype)
        param = nn.Parameter(data, requires_grad=slot.tensor.requires_grad)
        for full in slot.names:  # tied names share the one Parameter, as the model had them (one gradient)
            owner_name, _, attr = full.rpartition(".")
            owner = model.get_submodule(owner_name)
            if attr in owner._parameters:
                owner._parameters[attr] = param
            else:
                owner._buffers[attr] = data


def _stage_sources(model: nn.Module, root: Path) -> tuple[dict[str, Any], dict[str, Converted]]:
    """The checkpoint's tensors under the model's names, and the weights transformers builds from several of them
    at load (:func:`~._conversion.conversions`); a layout it converts that cannot be read here is refused."""
    index = checkpoint_index(checkpoint_files(root))
    if not needs_conversion(model, index):
        return index, {}
    found = conversions(model, index)
    if found is None or needs_conversion(model, {**index, **found[0], **found[1]}):
        raise DispatchError(f"checkpoint {root} stores weights in a layout transformers converts at load, which this "
                            f"transformers' mapping does not let placement_opt read tensor by tensor: pass the model "
                            f"itself (from_pretrained, real weights) to stage_module/pipeline")
    return {**index, **found[0]}, found[1]


def _tied_across(model: nn.Module, plan: PipelinePlan, stage_index: int) -> bool:
    mine = plan.stages[stage_index].units
    for slot in collect_slots(model):
        owners = {k for n in slot.names for k, s in enumerate(plan.stages) if _covered(n, s.units)}
        if len(owners) > 1 and any(_covered(n, mine) for n in slot.names):
            return True
    return False


def pipeline(model_or_checkpoint: Any, plan: PipelinePlan, *, rank: int | None = None,
             loss_fn: Callable[..., torch.Tensor] | None = None, device: str | torch.device | None = None,
             group: Any = None, dtype: torch.dtype | None = None) -> PipelineRun:
    """This rank's ``PipelineStage`` and schedule for ``plan``.

    Example (every rank of ``torchrun --nnodes 2 --nproc-per-node 4 run.py``)::

        dist.init_process_group("nccl")
        run = placement_opt.pipeline("/ckpt/llama", plan, loss_fn=loss)
        optimizer = torch.optim.AdamW(run.module.parameters())
        if run.stage_index == 0:
            run.schedule.step(input_ids)
        elif run.stage_index == len(plan.stages) - 1:
            run.schedule.step(target=labels, losses=losses)
        else:
            run.schedule.step()

    Args:
        model_or_checkpoint: a checkpoint directory written by ``save_pretrained`` (built on meta,
            only this stage's tensors read), or the model itself with real weights.
        plan: from :func:`placement_opt.distributed.pipeline_plan.plan_pipeline`.
        rank: this process's global rank; default ``torch.distributed.get_rank(group)``.
        loss_fn: ``loss_fn(output, target)`` for training steps; None for forward-only batches.
        device: where the stage runs; default the plan's device for this rank (``cuda:<local rank>``, ``cpu``).
        group: the process group of the pipeline; default the world.
        dtype: the dtype to build a checkpoint's model in; default the checkpoint's.

    Raises:
        DispatchError: the world size is not the plan's stage count, the model is not a decoder-only
            Hugging Face model, the checkpoint lacks a tensor, or tied weights span stages in training.
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    world = dist.get_world_size(group)
    if world != len(plan.stages):
        raise DispatchError(f"the process group has {world} ranks but the plan has {len(plan.stages)} stages: launch "
                            f"one process per stage (torchrun --nproc-per-node ... for {len(plan.stages)} in all)")
    rank = dist.get_rank(group) if rank is None else rank
    stage_plan = plan.stage_of_rank(rank)
    where = torch.device(device if device is not None else stage_plan.local_device)
    module = stage_module(model_or_checkpoint, plan, stage_plan.stage, device=where, dtype=dtype)
    stage = PipelineStage(module, stage_plan.stage, len(plan.stages), where, group=group)
    kind = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=plan.n_microbatches, loss_fn=loss_fn)
    schedule.step = _whole_microbatches(schedule.step, plan)
    return PipelineRun(stage=stage, schedule=schedule, module=module, stage_index=stage_plan.stage)


def _whole_microbatches(step: Callable[..., Any], plan: PipelinePlan) -> Callable[..., Any]:
    """``schedule.step`` refusing a batch (the first stage's input, the last stage's target) that does not split
    into the plan's micro-batches: torch's stages take their receive buffers' shape from the first micro-batch, so
    a batch of 5 in 2 came out of the last stage as 6 rows, one of them of no input, without an error."""
    n, rows = plan.n_microbatches, plan.workload.batch_size

    def whole(*args: Any, **kwargs: Any) -> Any:
        for given in (*args, kwargs.get("target")):
            if isinstance(given, torch.Tensor) and given.dim() and given.shape[0] % n:
                raise DispatchError(f"a batch of {given.shape[0]} sequences does not split into the plan's {n} "
                                    f"micro-batches (the last stage would return rows of no input): give a multiple "
                                    f"of {n}, e.g. {n * rows} ({n} micro-batches of the {rows} the plan counted)")
        return step(*args, **kwargs)

    return whole
