"""What the model will be asked to do: the workload the cost model prices.

Also the memory of a training step (:func:`training_memory`): gradients, optimizer states and
the activations saved for the backward, and whether they force optimizer states off the GPU.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from ..errors import ModelSpecError, WorkloadError
from ..units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware.devices import Device
    from ..model.graph import LayerGraph, UnitInfo

__all__ = [
    "Workload",
    "TrainingMemory",
    "UnitTrainingBytes",
    "training_memory",
    "unit_training_bytes",
    "dtype_bytes",
    "DTYPE_NAMES",
    "SAVED_ACTIVATION_FACTOR",
    "MAX_TOKENS",
    "OPTIMIZER_STATE_BYTES_PER_PARAM",
    "LOGITS",
]

#: Bytes per element of the dtypes a graph may name.
_DTYPE_BYTES = {"float64": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1, "uint8": 1}

#: The dtype names a graph, and so a plan, may carry: floating ones (a model of integer weights does not build),
#: as ``model.dtypes.dtype_name`` writes them.
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")

#: Activations a transformer layer saves for its backward, in multiples of its output per token.
#: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models")
#: count ``34 * s * b * h`` bytes per layer in half precision with memory-efficient attention,
#: i.e. 17 outputs of ``2 h`` bytes each.
SAVED_ACTIVATION_FACTOR = 17

#: fp32 optimizer-state bytes per parameter (master weights counted separately, half dtypes only).
OPTIMIZER_STATE_BYTES_PER_PARAM = {"adam": 8, "sgd": 4, "none": 0}
_MASTER_WEIGHT_BYTES_PER_PARAM = 4

#: Which positions' logits the prefill computes: ``"last"`` (``generate()`` asks the model for the last
#: position only), ``"all"`` (a plain forward, scoring, training: every prompt token).
LOGITS = ("last", "all")

#: The most tokens a workload may hold at once, ``batch_size x (prompt_len + new_tokens)``: 2**40
#: (about 1.1e12). Beyond it the KV cache bytes and times overflow the solver's 64-bit integers.
MAX_TOKENS = 2**40


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A generation run: one prefill of ``prompt_len`` tokens, then ``new_tokens`` decode steps.

    ``new_tokens=0`` is a single forward over the prompt. The context grows by one token per
    decode step, so the KV cache must hold ``batch_size x (prompt_len + new_tokens)`` tokens.

    Example::

        Workload(batch_size=16, prompt_len=2048, new_tokens=256)
    """

    batch_size: int = 1
    """Sequences generated together."""
    prompt_len: int = 512
    """Tokens in each prompt (prefill length)."""
    new_tokens: int = 128
    """Tokens generated per sequence after the prefill (decode steps)."""
    training: bool = False
    """Price a training step instead of generation (gradients, optimizer states, saved activations)."""
    optimizer: str = "adam"
    """Optimizer whose states a training step keeps: ``"adam"`` (two fp32 moments + fp32 master
    weights), ``"sgd"`` (momentum) or ``"none"``."""
    activation_checkpointing: bool = False
    """Training only: keep only unit inputs and recompute the rest in the backward."""
    logits: str | None = None
    """Positions whose logits the prefill computes: ``"last"`` (``generate()``, which asks for the last
    position only) or ``"all"`` (a plain forward, scoring, training). Default (None): follows the workload,
    see :attr:`logits_kept`; kept unresolved so that ``dataclasses.replace(w, training=True)`` follows too."""
    overlap: bool = False
    """Price a streamed unit's copy as the dispatcher's prefetch thread makes it: beside the compute of every
    unit since the previous streamed unit started, CPU-computed ones included (``solver.problem``'s Overlap),
    instead of beside its own unit's compute only (``max(compute, copy)`` each). Measured on a lent H200
    (benchmarks/phases/GPU.md): Llama-3.1-8B layer plans decoded at 0.98x (10 GiB) and 0.91x (4 GiB) of the
    speed it predicted. Opt-in: its 1 s solves end within 1 % of their bound less often (89 % of
    benchmarks/solve_time's cells against 99 % without: OVERLAP.md), the stalls' bound being the weaker."""
    padded: bool = False
    """The prompts differ in length and are padded to ``prompt_len`` under an attention mask (a batch of real
    prompts). transformers then hands fused attention a ``(batch, 1, prompt, prompt)`` boolean mask, which
    the prefill holds, with the copy the kernel makes of it and, for grouped-query attention, the keys and
    values repeated to every head, during the attention call. A Llama-3-8B layer at 16 x 4096: 256 MiB more
    (the mask; the call's 1.5 GiB stay under its MLP's peak). Given a mask, the kernel computes every query x
    key pair, not the causal half, which the prefill's time is priced at. Default: every prompt is
    ``prompt_len`` tokens, and no mask is built where the kernel's causal flag does."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "prompt_len", "new_tokens"):  # numpy's ints (a batch from a DataFrame) are ints
            value = getattr(self, name)
            if not isinstance(value, int) and hasattr(value, "__index__"):
                try:
                    object.__setattr__(self, name, operator.index(value))
                except TypeError:  # numpy's bool: refused below as it is
                    pass
        for name in ("batch_size", "prompt_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise WorkloadError(f"Workload.{name} is {value!r}: it must be an int >= 1")
        if not isinstance(self.new_tokens, int) or isinstance(self.new_tokens, bool) or self.new_tokens < 0:
            raise WorkloadError(f"Workload.new_tokens is {self.new_tokens!r}: it must be an int >= 0 "
                             f"(0 means a single forward)")
        tokens = self.batch_size * (self.prompt_len + self.new_tokens)
        if tokens > MAX_TOKENS:
            raise WorkloadError(
                f"Workload holds {tokens:.3g} tokens (batch_size {self.batch_size} x (prompt_len {self.prompt_len} "
                f"+ new_tokens {self.new_tokens})): accepted are up to 2**40 ({MAX_TOKENS:.3g}) tokens, beyond "
                f"which sizes and times overflow the solver's 64-bit integers; reduce the batch or the context")
        for name in ("training", "activation_checkpointing", "overlap", "padded"):
            if not isinstance(getattr(self, name), bool):
                raise WorkloadError(f"Workload.{name} is {getattr(self, name)!r}: it must be True or False")
        if self.optimizer not in ("adam", "sgd", "none"):
            raise WorkloadError(f"Workload.optimizer is {self.optimizer!r}: accepted are 'adam', 'sgd', 'none'")
        self._resolve_logits()

    def _resolve_logits(self) -> None:
        if self.logits is None:
            return
        if self.logits not in LOGITS:
            raise WorkloadError(f"Workload.logits is {self.logits!r}: accepted are 'last' (generate(): the last "
                                f"position only) and 'all' (a plain forward, scoring, training)")
        elif self.training and self.logits == "last":
            raise WorkloadError("Workload.logits is 'last' for a training step, whose loss reads every position's "
                                "logits: leave logits unset or give 'all'")

    @property
    def logits_kept(self) -> str:
        """``logits`` resolved: as given, else ``"all"`` for training and single forwards (``new_tokens=0``)
        and ``"last"`` for generation."""
        if self.logits is not None:
            return self.logits
        return "all" if self.training or self.new_tokens == 0 else "last"

    @property
    def context_len(self) -> int:
        """Tokens per sequence once generation ends: what the KV cache must hold. A training step generates none
        (:attr:`decode_steps` is 0): its ``new_tokens`` were counted in shortage messages ("the KV cache for batch
        64 x 8192 tokens 64 GiB", which it never holds) and in the note on contexts past the model's positions."""
        return self.prompt_len + self.decode_steps

    @property
    def decode_steps(self) -> int:
        return 0 if self.training else self.new_tokens

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("overlap", "padded"):  # written only when set: plan files read as before
            if not data[name]:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        """The workload :meth:`to_dict` wrote (a plan file's ``workload``).

        Raises:
            WorkloadError: ``data`` is not a mapping, or names a field a Workload does not have.
        """
        if not isinstance(data, Mapping):
            raise WorkloadError(f"a workload is a mapping of its fields (Workload.to_dict()), not a "
                                f"{type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise WorkloadError(f"a workload has no field(s) {', '.join(map(repr, unknown))}: its fields are "
                                f"{', '.join(f.name for f in fields(cls))}")
        return cls(**data)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (``"float16"`` -> 2, ``"torch.float32"`` -> 4).

    Raises:
        ModelSpecError: the dtype is unknown; lists the accepted names.
    """
    key = str(dtype).replace("torch.", "")
    if key not in _DTYPE_BYTES:
        raise ModelSpecError(f"dtype {dtype!r} is unknown: accepted are {', '.join(sorted(_DTYPE_BYTES))}")
    return _DTYPE_BYTES[key]


@dataclass(frozen=True, kw_only=True)
class UnitTrainingBytes:
    """Training states of one unit, in bytes."""

    gradient_bytes: int
    """One gradient per parameter, in the parameter dtype."""
    optimizer_bytes: int
    """Optimizer moments (fp32) plus fp32 master weights when the model is in a half dtype."""
    activation_bytes: int
    """Activations kept from the forward to the backward (only the unit's input when checkpointing)."""

    @property
    def total_bytes(self) -> int:
        return self.gradient_bytes + self.optimizer_bytes + self.activation_bytes


def unit_training_bytes(unit: UnitInfo, workload: Workload, dtype: str) -> UnitTrainingBytes:
    """Gradients, optimizer states and saved activations of one unit for ``workload``.

    Example: a unit with 1,000 fp16 parameters (2,000 bytes), Adam, batch 2 x 8 tokens and an
    output of 64 bytes per token: gradients 2,000; optimizer 1,000 x (8 + 4) = 12,000;
    activations 16 x 64 x 17 = 17,408 (16 x 64 = 1,024 with checkpointing).
    """
    if not workload.training:
        return UnitTrainingBytes(gradient_bytes=0, optimizer_bytes=0, activation_bytes=0)
    elem = dtype_bytes(dtype)
    params = unit.param_bytes // elem
    master = _MASTER_WEIGHT_BYTES_PER_PARAM if elem < 4 and workload.optimizer != "none" else 0
    optimizer = params * (OPTIMIZER_STATE_BYTES_PER_PARAM[workload.optimizer] + master)
    tokens = workload.batch_size * workload.prompt_len
    factor = 1 if workload.activation_checkpointing else SAVED_ACTIVATION_FACTOR
    activations = tokens * unit.out_bytes_per_token * factor if unit.param_bytes else 0
    return UnitTrainingBytes(gradient_bytes=unit.param_bytes, optimizer_bytes=optimizer,
                             activation_bytes=activations)


@dataclass(frozen=True, kw_only=True)
class TrainingMemory:
    """Memory of one training step of a whole model, and whether it fits a device."""

    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    capacity_bytes: int | None
    """The device it was checked against (None when no capacity was given)."""
    needs_optimizer_offload: bool
    """True when everything does not fit but everything except the optimizer states does."""
    fits: bool
    """True when weights, gradients, optimizer states and activations all fit the capacity."""
    message: str

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes


def training_memory(graph: LayerGraph, workload: Workload,
                    capacity_bytes: int | Device | None = None) -> TrainingMemory:
    """Price a training step of ``graph`` and say whether it needs CPU offload of optimizer states.

    Example::

        report = training_memory(graph, Workload(training=True, batch_size=8, prompt_len=1024),
                                 capacity_bytes=machine["cuda:0"].usable_bytes)
        if report.needs_optimizer_offload:
            print(report.message)

    Args:
        graph: the model's layer graph (its dtype is the parameter dtype).
        workload: a workload with ``training=True`` (a generation workload prices zero states).
        capacity_bytes: usable bytes of the device that trains, or the ``Device`` itself (its
            ``usable_bytes``: memory less the reserve).

    Returns:
        A :class:`TrainingMemory` with the split, ``fits``, ``needs_optimizer_offload`` and a
        message that says what takes the space and what to do.
    """
    if capacity_bytes is not None and not isinstance(capacity_bytes, int):
        capacity_bytes = capacity_bytes.usable_bytes
    units = graph.units()
    parts = [unit_training_bytes(u, workload, graph.meta.dtype) for u in units]
    weights = sum(u.weight_bytes for u in units)
    grads = sum(p.gradient_bytes for p in parts)
    optim = sum(p.optimizer_bytes for p in parts)
    acts = sum(p.activation_bytes for p in parts)  # all alive when the backward starts
    total = weights + grads + optim + acts
    split = (f"weights {format_bytes(weights)}, gradients {format_bytes(grads)}, "
             f"{workload.optimizer} optimizer states {format_bytes(optim)}, saved activations "
             f"{format_bytes(acts)} (batch {workload.batch_size} x {workload.prompt_len} tokens"
             f"{', checkpointed' if workload.activation_checkpointing else ''})")
    if capacity_bytes is None:
        return TrainingMemory(weights_bytes=weights, gradient_bytes=grads, optimizer_bytes=optim,
                              activation_bytes=acts, capacity_bytes=None, needs_optimizer_offload=False,
                              fits=True, message=f"training needs {format_bytes(total)}: {split}")
    fits = total <= capacity_bytes
    offload = not fits and total - optim <= capacity_bytes
    if fits:
        message = f"training fits: needs {format_bytes(total)} of {format_bytes(capacity_bytes)}: {split}"
    elif offload:
        message = (f"training needs {format_bytes(total)}, the device has {format_bytes(capacity_bytes)} "
                   f"({format_bytes(total - capacity_bytes)} short): {split}. Offload the optimizer "
                   f"states to the CPU (e.g. DeepSpeed ZeRO-Offload) to free {format_bytes(optim)}")
    else:
        hint = ("turn on activation checkpointing, " if not workload.activation_checkpointing
                and acts > 0 else "")
        message = (f"training needs {format_bytes(total)}, the device has {format_bytes(capacity_bytes)} "
                   f"({format_bytes(total - capacity_bytes)} short) even with optimizer states on the "
                   f"CPU: {split}. {hint.capitalize() or ''}reduce the batch or sequence, or shard the "
                   f"model (FSDP/DeepSpeed ZeRO-3)")
    return TrainingMemory(weights_bytes=weights, gradient_bytes=grads, optimizer_bytes=optim,
                          activation_bytes=acts, capacity_bytes=capacity_bytes,
                          needs_optimizer_offload=offload, fits=fits, message=message)

