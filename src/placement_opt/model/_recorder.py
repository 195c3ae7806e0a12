"""The meta forward behind :func:`placement_opt.trace`: FLOPs, execution order and data flow per unit.

One forward runs with every parameter and buffer swapped for a meta tensor
(``torch.func.functional_call``; :func:`~placement_opt.model.tracer.trace` hands it a meta copy of the
user's module, never the module itself), under a ``TorchDispatchMode`` that

* counts FLOPs with ``torch.utils.flop_counter``'s formulas and charges them to the unit running the op
  (glue FLOPs between units go to the next unit that runs);
* follows provenance: every tensor remembers the units it came from (glue ops pass provenance
  through), so an op inside unit B reading a tensor made by unit A is an edge A -> B however the
  tensor travelled: positional or keyword argument, tuple, rotary ``(cos, sin)``, encoder states;
* answers data-dependent scalar reads (``mask.all()``) with the dense case instead of failing, and
  notes those outside transformers' own mask checks (``if x.sum() > 0:`` in a custom module), where
  the graph holds only the branch the guess took (``Record.branches``; ``trace`` warns).

Module hooks mark which unit is running. Two stand-ins keep the forward possible and fast: fused MoE
experts (whose routing needs real data) run densely through ``top_k`` experts, and repeated identical
blocks are run once and replayed.
"""

from __future__ import annotations

import sys
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ._memory import FusedAttention, LiveBytes
from ._meta_experts import stand_in_experts
from ._replay import BlockReplay, tensors_in

__all__ = ["Record", "run", "nbytes", "meta_state", "guessed_scalar", "REPLAY_REPEATED_BLOCKS"]

_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
_META_OPS = {torch.ops.aten.sym_size.default, torch.ops.aten.sym_stride.default, torch.ops.aten.size.default,
             torch.ops.aten.stride.default, torch.ops.aten.dim.default, torch.ops.aten.numel.default,
             torch.ops.aten.is_contiguous.default, torch.ops.aten.sym_numel.default,
             torch.ops.aten.storage_offset.default, torch.ops.prim.layout.default}


def run(
    module: nn.Module,
    units: dict[str, nn.Module],
    *,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype: torch.dtype | None,
    containers: set[str],
    blocks: set[str],
    experts_per_token: Callable[[nn.Module], int],
    private: bool = False,
    seq_len: int = 0,
    frontier: bool = False,
) -> Record:
    """One meta forward of ``module`` with ``args``/``kwargs`` (meta tensors); returns what it observed.

    Args:
        units: unit name -> module.
        dtype: run floating parameters and buffers in this dtype (None: their own).
        containers: units that own only their direct tensors while other units sit below them; they
            are charged for the ops that read those tensors instead of being hooked.
        blocks: units kept whole; identical ones are replayed when :data:`REPLAY_REPEATED_BLOCKS`.
        experts_per_token: top-k of a fused experts module.
        private: ``module`` is a meta copy no one else holds (every tensor on meta): with no ``dtype``
            it runs as it is, without swapping its tensors for stand-ins.
        seq_len: tokens per sequence of the forward, to tell attention scores (query x key tokens) from
            activations that scale with the tokens alone (0: no tensor is taken for scores).
        frontier: a tensor made outside every unit (glue) comes only from its latest producers: a
            producer that another producer of the same tensor already depends on is dropped. A residual
            stream that glue adds up then reaches each unit from its latest producers only, not from every
            earlier unit (edges the longest path never needs); right where edges are only an order
            (``"sublayer"`` graphs, whose data goes through one home device), not transfers.

    Raises:
        Exception: whatever the model's forward raises on meta tensors (the caller falls back).
    """
    record = Record()
    state = None if private and dtype is None else meta_state(module, dtype)
    tensors = state.values() if state is not None else (*module.parameters(), *module.buffers())
    memory = LiveBytes(seq_len=seq_len, state_storages=frozenset(_storage_keys(tensors)))
    recorder = _Recorder(record, _container_tensors(state, units, containers), memory, frontier=frontier)
    handles = _hook_units(recorder, units, containers)
    restore = stand_in_experts(module, experts_per_token)
    replay = BlockReplay(recorder)
    if REPLAY_REPEATED_BLOCKS:
        for name in blocks:
            replay.patch(name, units[name])
    was_training = module.training
    try:
        module.eval()
        with torch.no_grad(), FusedAttention(memory, recorder.running), recorder:
            if state is None:
                module(*args, **kwargs)
            else:
                torch.func.functional_call(module, state, args, kwargs, tie_weights=False, strict=False)
        if recorder.pending_flops and record.order:
            record.flops[record.order[-1]] += recorder.pending_flops
            record.glue_flops += recorder.pending_flops
        if record.order:
            memory.charge_glue(record.order[-1])
    finally:
        module.train(was_training)
        for handle in handles:
            handle.remove()
        replay.restore()
        restore()
    record.replayed_blocks = replay.replayed
    record.workspace = {n: (p.linear_peak, p.score_peak) for n, p in memory.peaks.items()}
    record.cpu_attention = {n: p.cpu_peak for n, p in memory.peaks.items() if p.cpu_peak is not None}
    record.entry_bytes = {n: p.entry[0] for n, p in memory.peaks.items()}
    record.ops = {n: p.all_ops for n, p in memory.peaks.items()}
    return record


def _storage_keys(tensors: Any) -> list[int]:
    return [int(t.untyped_storage()._cdata) for t in tensors if isinstance(t, torch.Tensor)]


def _container_tensors(state: dict[str, torch.Tensor] | None, units: dict[str, nn.Module],
                       containers: set[str]) -> dict[int, str]:
    """id of each meta stand-in (or, with no ``state``, tensor) of a container unit's direct tensors -> that unit."""
    if state is None:
        return {id(t): n for n in containers for t in (*units[n]._parameters.values(), *units[n]._buffers.values())
                if t is not None}
    return {id(state[f"{n}.{k}" if n else k]): n for n in containers
            for k in (*units[n]._parameters, *units[n]._buffers) if (f"{n}.{k}" if n else k) in state}


def _hook_units(recorder: _Recorder, units: dict[str, nn.Module], containers: set[str]) -> list[Any]:
    """Hooks that tell the recorder which unit runs (containers are charged per tensor instead)."""
    handles = []
    for name, sub in units.items():
        if name in containers:
            continue
        # a list unit (a "sublayer" list of experts) has no forward of its own: its members run as the unit
        called = list(sub.children()) if isinstance(sub, (nn.ModuleList, nn.ModuleDict)) else [sub]
        for module in called:
            handles.append(module.register_forward_pre_hook(lambda _m, _a, n=name: recorder.enter(n)))
            handles.append(module.register_forward_hook(lambda _m, _a, out, n=name: recorder.leave(n, out)))
    return handles


@dataclass
class Record:
    """What the meta forward observed."""

    order: list[str] = field(default_factory=list)
    flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    out_bytes: dict[str, int] = field(default_factory=dict)
    edges: dict[tuple[str, str], dict[int, int]] = field(default_factory=lambda: defaultdict(dict))
    guessed_scalars: int = 0
    branches: dict[tuple[str | None, str], Any] = field(default_factory=dict)
    """Data-dependent reads other than transformers' mask checks: (unit or None, code location) -> the
    value assumed. The forward's control flow there followed the guess; the other branch was not traced."""
    glue_flops: int = 0
    replayed_blocks: int = 0
    workspace: dict[str, tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)
    """Unit -> (linear, context-shaped) activation bytes alive at the moment of its run with the most linear
    bytes, and at the moment with the most context-shaped bytes (:mod:`._memory`)."""
    cpu_attention: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Units whose attention a CPU cannot fuse: (linear, context-shaped) bytes alive at its math path's peak."""
    entry_bytes: dict[str, int] = field(default_factory=dict)
    """Unit -> linear activation bytes alive when it started (what earlier units left alive)."""
    ops: dict[str, int] = field(default_factory=dict)
    """Unit -> torch ops one forward dispatches for it: its own (a fused attention call counted once) and the glue
    ops since the unit before it. Each costs the host its dispatch and the Python around it."""
    returned_bytes: dict[str, int] = field(default_factory=dict)
    """Unit -> bytes of the distinct tensors its forward returned, attention-score shaped ones apart (eager
    attention's probabilities, which the fused kernels that run never return)."""
    _read_index: dict[str, dict[int, int]] = field(default_factory=dict, repr=False, compare=False)
    _read_key: int = field(default=-1, repr=False, compare=False)

    def read_from(self, unit: str) -> dict[int, int]:
        """The distinct tensors other units read from ``unit``: tensor id -> bytes (of :attr:`edges`, merged over
        the readers), once the forward that fills :attr:`edges` is over. Indexed once (again only when new pairs
        of units appeared): a scan of every edge per unit took a module-level Qwen2-72B's trace 2.3 s (724 units)."""
        key = len(self.edges)
        if self._read_key != key:
            index: dict[str, dict[int, int]] = defaultdict(dict)
            for (src, _dst), tensors in self.edges.items():
                index[src].update(tensors)
            self._read_index, self._read_key = dict(index), key
        return self._read_index.get(unit, {})


class _Recorder(TorchDispatchMode):
    """Counts FLOPs per unit and follows which unit produced every tensor."""

    def __init__(self, record: Record, param_owner: dict[int, str], memory: LiveBytes | None = None,
                 frontier: bool = False) -> None:
        super().__init__()
        self.frontier = frontier
        self.ancestors: dict[str, set[str]] = defaultdict(set)
        """Unit -> every unit it (transitively) read from: what :meth:`_made_by` drops with ``frontier``."""
        self.record = record
        self.memory = memory if memory is not None else LiveBytes(seq_len=0)
        self.param_owner = param_owner
        """id of a direct tensor of a container unit (a unit with units below it) -> that unit."""
        self.stack: list[str] = []
        self.producers = _Producers()
        self.pending_flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _META_OPS:
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._guess_scalar(args[0])
        if func._overloadpacket not in flop_registry and func is not torch.ops.prim.device.default:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        inputs = tensors_in((args, kwargs))
        current = self._current(inputs, out)
        self.memory.record(current, func, inputs, tensors_in(out))
        packet = func._overloadpacket
        if packet in flop_registry:
            self._charge(current, int(flop_registry[packet](*args, **kwargs, out_val=out)))
        elif packet is _GROUPED_MM and isinstance(out, torch.Tensor):
            # grouped experts matmul (no flop_counter formula): every output row is one token x one expert
            self._charge(current, 2 * out.numel() * int(args[0].shape[-1]))
        self._follow(current, inputs, out)
        return out

    def _current(self, inputs: list[torch.Tensor], out: Any) -> str | None:
        """The unit running this op: the innermost hooked unit, else a container whose own tensor it reads."""
        if self.stack:
            return self.stack[-1]
        owner = next((self.param_owner[id(t)] for t in inputs if id(t) in self.param_owner), None)
        if owner is not None:
            self._start(owner)
            self.record.out_bytes[owner] = sum(nbytes(t) for t in tensors_in(out))
        return owner

    def running(self) -> str | None:
        """The innermost hooked unit running now (None: glue between units)."""
        return self.stack[-1] if self.stack else None

    def _guess_scalar(self, tensor: torch.Tensor) -> Any:
        # data-dependent checks (`mask.all()`, `x.max().item()`): assume the common, dense case
        self.record.guessed_scalars += 1
        value = guessed_scalar(tensor)
        where = _asking_code()
        if where is not None:
            self.record.branches.setdefault((self.stack[-1] if self.stack else None, where), value)
        return value

    def _charge(self, current: str | None, flops: int) -> None:
        if current is not None:
            self.record.flops[current] += flops
        else:
            self.pending_flops += flops

    def _follow(self, current: str | None, inputs: list[torch.Tensor], out: Any) -> None:
        sources: set[str] = set()
        for tensor in inputs:
            entry = self.producers.get(tensor)
            if entry is None:
                continue
            for unit in entry[1]:
                if current is not None and unit != current:
                    self.edge(unit, current, entry[0], tensor)
                sources.add(unit)
        made = frozenset({current}) if current is not None else self._made_by(sources)
        if made:
            for tensor in tensors_in(out):
                self.producers.set(tensor, made)

    def edge(self, src: str, dst: str, serial: int, tensor: torch.Tensor) -> None:
        self.record.edges[(src, dst)][serial] = nbytes(tensor)
        if self.frontier and src not in self.ancestors[dst]:
            self.ancestors[dst] |= self.ancestors[src]
            self.ancestors[dst].add(src)

    def _made_by(self, sources: set[str]) -> frozenset[str]:
        """The producers of a glue tensor made from tensors of ``sources`` (see ``frontier`` in :func:`run`)."""
        if not self.frontier or len(sources) < 2:
            return frozenset(sources)
        return frozenset(s for s in sources if not any(s in self.ancestors[t] for t in sources if t != s))

    def _start(self, name: str) -> None:
        """First time ``name`` runs: give it the next execution index and the glue FLOPs before it."""
        if name not in self.record.flops:
            self.record.flops[name] = 0
            self.record.order.append(name)
        if self.pending_flops:
            self.record.flops[name] += self.pending_flops
            self.record.glue_flops += self.pending_flops
            self.pending_flops = 0

    # -- module hooks --
    def enter(self, name: str) -> None:
        self._start(name)
        self.stack.append(name)
        self.memory.enter(name)

    def leave(self, name: str, output: Any) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        if name not in self.record.out_bytes:
            seen: dict[int, int] = {id(t): nbytes(t) for t in tensors_in(output)}
            self.record.out_bytes[name] = sum(seen.values())
            context = {id(t) for t in tensors_in(output) if self.memory.is_context(t)}
            self.record.returned_bytes[name] = sum(b for i, b in seen.items() if i not in context)
        made = frozenset({name})
        for tensor in tensors_in(output):
            if self.producers.get(tensor) is None:
                self.producers.set(tensor, made)


class _Producers:
    """Which units every live tensor came from, with a serial number per tensor (edges count tensors by it).

    Tensors are held weakly, so that they die when the forward lets go of them, as they would on a device
    (:class:`~._memory.LiveBytes` counts on it); serials, unlike ``id()``, are never reused.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], int, frozenset[str]]] = {}
        self._next = 0

    def get(self, tensor: torch.Tensor) -> tuple[int, frozenset[str]] | None:
        """(serial, producing units) of ``tensor``; None when no unit made it."""
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor:
            return None
        return entry[1], entry[2]

    def set(self, tensor: torch.Tensor, units: frozenset[str]) -> None:
        self._next += 1
        self._entries[id(tensor)] = (weakref.ref(tensor), self._next, units)


#: transformers modules whose data-dependent reads are mask and padding checks: with no attention mask
#: (how the tracer calls a model) the guessed answer is the one a real unpadded batch gives.
_MASK_CHECK_MODULES = frozenset({"transformers.masking_utils", "transformers.modeling_attn_mask_utils",
                                 "transformers.modeling_flash_attention_utils",
                                 "transformers.integrations.sdpa_attention"})
#: Single functions elsewhere in transformers that only check padding and log: (module, function).
_PADDING_CHECKS = frozenset({("transformers.modeling_utils", "warn_if_padding_and_no_attention_mask")})


#: This package's modules that run inside the forward (never the model code that asked).
_OWN_MODULES = frozenset({__name__, FusedAttention.__module__, BlockReplay.__module__})


def _asking_code() -> str | None:
    """``file:line (function)`` of the model code that read a tensor's value; None for a known mask check."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module not in _OWN_MODULES and module != "torch" and not module.startswith("torch."):
            code = frame.f_code
            if module in _MASK_CHECK_MODULES or (module, code.co_name) in _PADDING_CHECKS:
                return None
            return f"{code.co_filename}:{frame.f_lineno} ({code.co_name})"
        frame = frame.f_back
    return None


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


#: Run only the first block of each signature for real; later identical blocks replay its record.
REPLAY_REPEATED_BLOCKS = True


def guessed_scalar(tensor: torch.Tensor) -> bool | int | float:
    """The value assumed for a data-dependent read of a meta tensor (``mask.all()``, ``x.max().item()``): the
    common, dense case."""
    if tensor.dtype == torch.bool:
        return True
    return 0.0 if tensor.is_floating_point() else 1


def meta_state(module: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """A meta stand-in for every parameter and buffer (floating ones in ``dtype`` if given); no data is read."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in list(module.named_parameters(remove_duplicate=False)) + list(
            module.named_buffers(remove_duplicate=False)):
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        state[name] = torch.empty(tensor.shape, dtype=target, device="meta")
    return state
