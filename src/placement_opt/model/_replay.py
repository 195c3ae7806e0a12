"""Identical blocks run once on meta and replayed: the meta forward's shortcut for deep models.

Torch only, no weights. :class:`BlockReplay` patches each block's ``forward``; the first block of a signature
(:func:`static_signature`: class, plain attributes and tensor shapes of every submodule, and the inputs' shapes)
runs for real under :mod:`._recorder`'s dispatch mode, and what it did is learned: its FLOPs, which of its
inputs its ops read, and its outputs' shapes. A later identical block replays that record: the FLOPs charged,
the edges drawn from the producers of the tensors it actually receives, new meta tensors for its outputs.
A block that returns anything but tensors and plain values (a cache) always runs for real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:  # pragma: no cover
    from ._recorder import _Recorder as Recorder

__all__ = ["BlockReplay", "static_signature", "tensors_in"]

_PRIMITIVES = (int, float, bool, str, type(None))


@dataclass
class _Learned:
    """What one real run of a block did, enough to replay it for an identical block."""

    unit: str
    """The unit whose real run this is (its workspace is the replay's)."""
    flops: int
    consumed: list[int]
    """Positions of the input tensors its ops read (the edges a replay must draw)."""
    outputs: list[int | tuple[tuple[int, ...], torch.dtype, bool]]
    """Per output tensor: the position of the input it passes through, or (shape, dtype, whether it is
    attention-score shaped) of a new one."""
    spec: Any


class BlockReplay:
    """Replays identical blocks: same class, attributes, parameter and input shapes -> same FLOPs and outputs.

    A 126-layer model then costs two real block forwards on meta instead of 126; the edges are still drawn
    per block from the producers of the tensors each block actually receives.
    """

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.cache: dict[Any, _Learned | None] = {}
        self.patched: list[tuple[nn.Module, Any]] = []
        self.replayed = 0

    def patch(self, name: str, module: nn.Module) -> None:
        static = static_signature(module)
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            key = (static, _input_signature(args, kwargs))
            learned = self.cache.get(key)
            if learned is not None:
                self.replayed += 1
                return self._replay(name, learned, args, kwargs)
            before = self.recorder.record.flops.get(name, 0)
            out = original(*args, **kwargs)
            if key not in self.cache:
                self.cache[key] = self._learn(name, args, kwargs, out, self.recorder.record.flops[name] - before)
            return out

        self.patched.append((module, module.__dict__.get("forward")))
        module.forward = forward

    def restore(self) -> None:
        for module, before in self.patched:
            if before is None:
                del module.forward
            else:  # a stand-in installed before (fused experts): its own restore removes it
                module.forward = before

    def _learn(self, name: str, args: Any, kwargs: Any, out: Any, flops: int) -> _Learned | None:
        inputs = tensors_in((args, kwargs))
        leaves, spec = tree_flatten(out)
        if any(not isinstance(leaf, (torch.Tensor, *_PRIMITIVES)) for leaf in leaves):
            return None  # caches or other objects with side effects: always run for real
        read = {serial for (_src, dst), tensors in self.recorder.record.edges.items() if dst == name
                for serial in tensors}
        entries = [self.recorder.producers.get(t) for t in inputs]
        consumed = [i for i, entry in enumerate(entries) if entry is not None and entry[0] in read]
        outputs: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                same = next((i for i, t in enumerate(inputs) if t is leaf), None)
                outputs.append(same if same is not None else
                               (tuple(leaf.shape), leaf.dtype, self.recorder.memory.is_context(leaf)))
            else:
                outputs.append(("value", leaf))
        return _Learned(unit=name, flops=flops, consumed=consumed, outputs=outputs, spec=spec)

    def _replay(self, name: str, learned: _Learned, args: Any, kwargs: Any) -> Any:
        recorder = self.recorder
        inputs = tensors_in((args, kwargs))
        recorder.record.flops[name] += learned.flops
        recorder.memory.replayed(name, learned.unit)
        for i in learned.consumed:
            tensor = inputs[i]
            entry = recorder.producers.get(tensor)
            if entry is not None:
                for unit in entry[1] - {name}:
                    recorder.edge(unit, name, entry[0], tensor)
        leaves: list[Any] = []
        for item in learned.outputs:
            if isinstance(item, int):
                leaves.append(inputs[item])
            elif item[0] == "value":
                leaves.append(item[1])
            else:
                recorder.memory.counting_ops = False  # the stand-in's, not an op of the model
                try:
                    tensor = torch.empty(item[0], dtype=item[1], device="meta")
                finally:
                    recorder.memory.counting_ops = True
                if item[2]:
                    recorder.memory.mark_context(tensor)
                recorder.producers.set(tensor, frozenset({name}))
                leaves.append(tensor)
        return tree_unflatten(leaves, learned.spec)


def static_signature(module: nn.Module) -> tuple[Any, ...]:
    """Class, plain attributes (except indices) and tensor shapes of every submodule."""
    parts = []
    for sub_name, sub in module.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items()
                             if isinstance(v, _PRIMITIVES) and not k.startswith("_") and "idx" not in k
                             and "index" not in k))
        tensors = tuple((k, tuple(t.shape), t.dtype) for k, t in (*sub._parameters.items(), *sub._buffers.items())
                        if t is not None)
        parts.append((sub_name, type(sub).__name__, attrs, tensors))
    return tuple(parts)


def _input_signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    leaves, spec = tree_flatten((args, kwargs))
    items = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor)
                  else (type(x).__name__, x if isinstance(x, _PRIMITIVES) else id(x)) for x in leaves)
    return (str(spec), items)


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a pytree of arguments or outputs, transformers' ``ModelOutput`` included."""
    leaves, _ = tree_flatten(tree)
    out: list[torch.Tensor] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif hasattr(leaf, "to_tuple"):  # transformers ModelOutput
            out.extend(tensors_in(leaf.to_tuple()))
    return out
