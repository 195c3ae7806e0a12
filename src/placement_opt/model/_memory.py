"""Live activation bytes during the meta forward, and each unit's peak: its workspace.

Meta tensors have storages with sizes (no data), and torch keeps a storage's Python object alive as
long as any tensor uses it, so a finalizer on it fires exactly when the memory would be freed on a
real device. :class:`LiveBytes` is fed every op's inputs and outputs by the recorder's dispatch mode:

* an output whose storage is none of the op's inputs' storages is a new allocation (views and
  in-place ops share their input's storage; parameters are never allocated by the forward);
* every allocation is either *linear* (scales with the tokens of the forward) or *context-shaped*
  (its last two dimensions are query x key tokens: attention scores, their softmax, the mask);
* each unit keeps two moments of its run, as (linear, context-shaped) bytes alive then: the one with the
  most linear bytes (an MLP's intermediates) and the one with the most context-shaped bytes (the softmax
  of the scores; among equals, such as none at all, a fused attention call). Everything alive counts (its inputs, what earlier units left alive, its intermediates,
  its outputs). The two scale differently with the prompt (tokens against tokens x context), so the cost
  model prices both at the workload's shape and takes the larger.

Context-shaped tensors are recognised by provenance, not by shape alone (a head size may equal the
traced length): the product of two activations whose result ends in ``(seq_len, seq_len)``
(``q @ k^T``), anything computed from such a tensor with the same trailing shape (mask, softmax,
casts), and mask-shaped tensors of that shape made outside every unit (the model's causal mask,
``(batch, 1, q, k)``). A product that reads a context-shaped tensor (``probs @ v``) is linear again.

``F.scaled_dot_product_attention`` is counted by what it allocates on a device, its output and a
boolean mask's copy (:class:`FusedAttention`): on meta it has no fused kernel and decomposes into its math path, which
materialises the scores and, for half-precision inputs, float32 copies of q, k, v and of the output,
none of which CPU flash attention (``_scaled_dot_product_flash_attention_for_cpu``) or CUDA's flash and
memory-efficient kernels make. Counted op by op, a bf16 decoder layer came out 44 % above a real
CPU forward (17,928 against 12,418 bytes per token, benchmarks/cost_accuracy/MEMORY.md). A call a CPU
cannot fuse (queries and values of different head sizes: latent attention) runs the math path there; its
peak is measured apart (:class:`_MathPath`) as a third moment, charged only where the unit computes on a CPU.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "UnitPeak", "FusedAttention"]

#: The most columns a tensor derived from the attention scores may add to them and still be scores-shaped
#: (GPT-OSS appends one per head: its sink).
_APPENDED_COLUMNS = 8

#: Products of two tensors: the ops whose output may start a context-shaped tensor (``q @ k^T``).
_PRODUCTS = frozenset({torch.ops.aten.bmm, torch.ops.aten.mm, torch.ops.aten.baddbmm, torch.ops.aten.addmm,
                       torch.ops.aten.matmul, torch.ops.aten.addbmm})


@dataclass
class UnitPeak:
    """Two moments of one unit's run as (linear, context-shaped) bytes alive then, and what was alive at entry."""

    linear_peak: tuple[int, int] = (0, 0)
    """The moment with the most linear bytes (ties: the most context-shaped)."""
    score_peak: tuple[int, int] = (0, 0)
    """The moment with the most context-shaped bytes (ties: a fused attention call's, then the most linear):
    where a mask's kernel copy lives, so the cost model can charge a mask the trace did not see there."""
    score_at_attention: bool = False
    """Whether :attr:`score_peak` is a fused attention call's moment."""
    entry: tuple[int, int] = (0, 0)
    cpu_peak: tuple[int, int] | None = None
    """The moment of an attention call a CPU cannot fuse (:class:`FusedAttention`), with the math path's
    intermediates alive; None: every call fuses on a CPU too."""
    ops: int = 0
    """Ops the unit ran itself (a fused attention call is one); glue ops charged to it are in :attr:`glue_ops`."""
    glue_ops: int = 0
    """Ops run outside every unit since the unit before it (masks, rotary tables, residual adds of a sublayer
    graph), charged to it as glue FLOPs are."""

    @property
    def all_ops(self) -> int:
        """The ops one forward of the unit costs the host: its own and the glue before it."""
        return self.ops + self.glue_ops

    def see_cpu(self, alive: tuple[int, int]) -> None:
        if self.cpu_peak is None or (alive[1], alive[0]) > (self.cpu_peak[1], self.cpu_peak[0]):
            self.cpu_peak = alive

    def see(self, alive: tuple[int, int], attention: bool = False) -> None:
        if alive > self.linear_peak:
            self.linear_peak = alive
        if (alive[1], attention, alive[0]) > (self.score_peak[1], self.score_at_attention, self.score_peak[0]):
            self.score_peak, self.score_at_attention = alive, attention

    def above_entry(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Both moments less what was alive at entry: what a replay of this unit adds to its own entry."""
        return (_minus(self.linear_peak, self.entry), _minus(self.score_peak, self.entry))


def _minus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return (a[0] - b[0], a[1] - b[1])


def _plus(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return (a[0] + b[0], a[1] + b[1])


@dataclass
class LiveBytes:
    """Bytes of the activations alive during one meta forward, and every unit's peak."""

    seq_len: int
    """Tokens per sequence of the forward: context-shaped tensors end in ``(seq_len, seq_len)``."""
    state_storages: frozenset[int] = frozenset()
    """Storages of the parameters and buffers: products that read one are projections, never scores."""
    linear_bytes: int = 0
    context_bytes: int = 0
    peaks: dict[str, UnitPeak] = field(default_factory=dict)
    paused: bool = False
    """While True (inside a fused op, :class:`FusedAttention`), ops allocate nothing that counts."""
    counting_ops: bool = True
    """While False (a replay making its outputs), ops allocate as they do but are not the model's."""
    _alive: dict[int, tuple[int, bool]] = field(default_factory=dict)
    _glue: UnitPeak = field(default_factory=UnitPeak)
    """Moments seen outside every unit since the last one ran, charged to the next unit (as glue FLOPs are):
    with ``granularity="module"`` that is where attention's ``q @ k^T`` and softmax are counted."""

    # -- the recorder's calls --
    def enter(self, unit: str) -> None:
        peak = self.peaks.setdefault(unit, UnitPeak())
        peak.entry = (self.linear_bytes, self.context_bytes)
        self._raise(unit)
        self.charge_glue(unit)

    def charge_glue(self, unit: str) -> None:
        """Charge the moments seen outside every unit since the last one to ``unit``."""
        peak = self.peaks.setdefault(unit, UnitPeak())
        peak.see(self._glue.linear_peak)
        peak.see(self._glue.score_peak, self._glue.score_at_attention)
        if self._glue.cpu_peak is not None:
            peak.see_cpu(self._glue.cpu_peak)
        peak.glue_ops += self._glue.ops
        self._glue = UnitPeak()

    def record(self, unit: str | None, func: object, inputs: Iterable[torch.Tensor], outputs: Iterable[torch.Tensor],
               *, linear: bool = False, attention: bool = False, op: bool = True) -> None:
        """Account the new storages among ``outputs`` of one op run by ``unit`` (None: outside every unit);
        ``linear``: they scale with the tokens whatever their shape (attention's output, ``(q, head size)``);
        ``attention``: the moment after them is a fused attention call's (:attr:`UnitPeak.score_peak`);
        ``op``: one dispatched op (False: storages made inside another op, a fused call's mask copy)."""
        if self.paused:
            return
        if op and self.counting_ops:
            (self.peaks.setdefault(unit, UnitPeak()) if unit is not None else self._glue).ops += 1
        inputs = list(inputs)
        read = {_storage_key(t) for t in inputs}
        packet = getattr(func, "_overloadpacket", func)
        for tensor in outputs:
            key = _storage_key(tensor)
            if key is None or key in read or key in self._alive:
                continue
            context = not linear and self._is_context(packet, unit, inputs, tensor)
            self._add(key, tensor.untyped_storage(), context)
        if unit is not None:
            self._raise(unit, attention)
        else:
            self._glue.see((self.linear_bytes, self.context_bytes), attention)

    def replayed(self, unit: str, learned_from: str) -> None:
        """``unit`` was replayed from ``learned_from``'s run: it adds what that run added above its entry."""
        peak = self.peaks.setdefault(unit, UnitPeak())
        learned = self.peaks.get(learned_from)
        if learned is None:  # its run was a method call that no hook saw (Gemma-3n's altup): nothing measured
            return
        peak.ops += learned.ops
        linear, scores = learned.above_entry()
        peak.see(_plus(peak.entry, linear))
        peak.see(_plus(peak.entry, scores), learned.score_at_attention)
        if learned.cpu_peak is not None:
            peak.see_cpu(_plus(peak.entry, _minus(learned.cpu_peak, learned.entry)))

    def unfused_call(self, unit: str | None, added: tuple[int, int]) -> None:
        """An attention call a CPU cannot fuse added ``added`` (linear, context-shaped) bytes at its peak, on top
        of what is alive now."""
        moment = _plus((self.linear_bytes, self.context_bytes), added)
        (self.peaks.setdefault(unit, UnitPeak()) if unit is not None else self._glue).see_cpu(moment)

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` as alive already (a cache made before the forward), so that their release is seen."""
        for tensor in tensors:
            key = _storage_key(tensor)
            if key is not None and key not in self._alive:
                self._add(key, tensor.untyped_storage(), False)

    def is_context(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory was counted as attention-score shaped."""
        return self._alive.get(_storage_key(tensor), (0, False))[1]

    def mark_context(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s memory as attention-score shaped (a replayed block's output that was)."""
        key = _storage_key(tensor)
        size, context = self._alive.get(key, (0, True))
        if not context:
            self._alive[key] = (size, True)
            self.linear_bytes -= size
            self.context_bytes += size

    # -- bookkeeping --
    def _is_context(self, packet: object, unit: str | None, inputs: list[torch.Tensor], tensor: torch.Tensor) -> bool:
        if self.seq_len < 2 or tensor.dim() < 2 or tensor.shape[-2] != self.seq_len:
            return False
        from_context = any(self.is_context(t) for t in inputs)
        if tensor.shape[-1] != self.seq_len:
            # scores with a column or a few appended (GPT-OSS's attention sinks: the logits, their max-subtracted
            # copy, the softmax): grown with the context as the scores are, not per token at the traced length
            return (self.seq_len < tensor.shape[-1] <= self.seq_len + _APPENDED_COLUMNS and from_context
                    and packet not in _PRODUCTS)
        if packet in _PRODUCTS:
            return not from_context and not any(_storage_key(t) in self.state_storages for t in inputs)
        # outside every unit: the model's mask, (batch, 1, q, k) or (q, k), boolean or additive; not q, k or v
        # of a module-granularity attention, (batch, heads, q, head size) with head size == q
        mask_shaped = tensor.dtype == torch.bool or tensor.dim() == 2 or tensor.shape[-3] == 1
        return from_context or (unit is None and mask_shaped)

    def _add(self, key: int, storage: torch.UntypedStorage, context: bool) -> None:
        size = int(storage.nbytes())
        self._alive[key] = (size, context)
        if context:
            self.context_bytes += size
        else:
            self.linear_bytes += size
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        size, context = self._alive.pop(key, (0, False))
        if context:
            self.context_bytes -= size
        else:
            self.linear_bytes -= size

    def _raise(self, unit: str, attention: bool = False) -> None:
        self.peaks.setdefault(unit, UnitPeak()).see((self.linear_bytes, self.context_bytes), attention)


def _storage_key(tensor: torch.Tensor) -> int | None:
    """Identity of the memory a tensor uses (None for tensors without a plain storage)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


class FusedAttention(TorchFunctionMode):
    """Counts ``F.scaled_dot_product_attention`` as its fused kernels run it: the output and its log-sum-exp
    are its allocations, beside a boolean mask's copy in the query's dtype (torch converts a boolean ``attn_mask``
    before any kernel runs; measured on the CPU: a float32 ``(1, 1, 2048, 2048)`` copy), alive during the
    call. The math path it decomposes into on meta still runs (FLOPs and data flow are recorded as before);
    only its intermediates are not counted. ``unit()`` names the unit running now."""

    def __init__(self, memory: LiveBytes, unit: Callable[[], str | None]) -> None:
        super().__init__()
        self.memory = memory
        self.unit = unit

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention or self.memory.paused:
            return func(*args, **kwargs)
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self.memory.paused = True
        try:
            converted = _converted_mask(args, kwargs)
        finally:
            self.memory.paused = False
        if converted is not None:  # context-shaped as the mask it is made from
            self.memory.record(self.unit(), func, [_mask(args, kwargs)], [converted], op=False)
        math = _MathPath(self.memory.seq_len) if _cpu_cannot_fuse(args, kwargs) else None
        self.memory.paused = True
        try:
            if math is None:
                out = func(*args, **kwargs)
            else:
                with math:
                    out = func(*args, **kwargs)
        finally:
            self.memory.paused = False
        if math is not None:
            self.memory.unfused_call(self.unit(), math.peak)
        # (batch, heads, q, head size): read from the mask, yet per token even where the head size is the
        # traced length (Falcon-40B's 64); beside it the kernel's float32 log-sum-exp per head and query
        outs = [out, _logsumexp(out)] if isinstance(out, torch.Tensor) else []
        self.memory.record(self.unit(), func, inputs, outs, linear=True, attention=True)
        del converted, outs  # the mask's copy and the log-sum-exp are freed as the call returns
        return out


def _cpu_cannot_fuse(args: tuple, kwargs: dict) -> bool:
    """Whether a CPU runs this ``scaled_dot_product_attention`` call as its math path: torch's CPU flash kernel
    needs queries, keys and values of one head size, which latent attention's differ (DeepSeek-V3: 192, 192
    and 128), and of one head count unless the call says ``enable_gqa`` (Falcon-7B's multi-query attention hands
    one key head to 71 query heads: its scores were 128 MiB of a 300 MiB call charged as fused). A GPU's
    memory-efficient kernel takes other head sizes."""
    names = ("query", "key", "value")
    tensors = [args[i] if len(args) > i else kwargs.get(n) for i, n in enumerate(names)]
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in tensors):
        return False
    if len({t.shape[-1] for t in tensors}) > 1:
        return True
    return all(t.dim() >= 3 for t in tensors) and len({t.shape[-3] for t in tensors}) > 1 and not kwargs.get(
        "enable_gqa", False)


class _MathPath(TorchDispatchMode):
    """The most bytes the math path of one attention call holds at once, as (linear, context-shaped): storages
    its ops allocate, alive until freed; context-shaped when they end in ``(seq_len, seq_len)`` (scores,
    softmax, the causal mask it builds), the query x key moment kept (the softmax's, when every copy of the
    queries, keys and values is alive too)."""

    def __init__(self, seq_len: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.alive: dict[int, tuple[int, bool]] = {}
        self.now = (0, 0)
        self.peak = (0, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        read = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            key = _storage_key(tensor) if isinstance(tensor, torch.Tensor) else None
            if key is None or key in read or key in self.alive:
                continue
            context = tensor.dim() >= 2 and tuple(tensor.shape[-2:]) == (self.seq_len, self.seq_len)
            size = int(tensor.untyped_storage().nbytes())
            self.alive[key] = (size, context)
            self.now = _plus(self.now, (0, size) if context else (size, 0))
            weakref.finalize(tensor.untyped_storage(), self._free, key)
        if (self.now[1], self.now[0]) > (self.peak[1], self.peak[0]):
            self.peak = self.now
        return out

    def _free(self, key: int) -> None:
        size, context = self.alive.pop(key, (0, False))
        self.now = _minus(self.now, (0, size) if context else (size, 0))


def _logsumexp(out: torch.Tensor) -> torch.Tensor:
    """A meta tensor the size of the log-sum-exp a flash kernel returns beside its output (CPU flash attention
    always, CUDA's flash kernel too): float32, one per head and query (measured on the CPU: 64 bytes per token
    for 16 heads, the peak of a Falcon layer at 1 x 4096)."""
    return torch.empty(out.shape[:-1], dtype=torch.float32, device="meta")


def _mask(args: tuple, kwargs: dict) -> object:
    return args[3] if len(args) > 3 else kwargs.get("attn_mask")


def _converted_mask(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A meta tensor the size of the additive mask torch makes of a boolean ``attn_mask`` (None: no such mask)."""
    query = args[0] if args else kwargs.get("query")
    mask = _mask(args, kwargs)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or not isinstance(query, torch.Tensor):
        return None
    return torch.empty(mask.shape, dtype=query.dtype, device="meta")
