"""Decode steps without cuDNN's attention kernel, in dispatched models and in calibrate's timing.

torch prefers cuDNN's fused attention for ``scaled_dot_product_attention`` on Hopper GPUs, and cuDNN builds an
execution graph per shape. A decode step's key length grows by one every step, so every step of ``generate()``
is a new shape. Measured on an NVIDIA H200 (torch 2.11+cu130, ``benchmarks/phases/probe.py``, one Llama-3.1-8B
layer, prompt 512, 24 steps per visit, medians): 39 ms per step at key lengths the process had not run, 1.3 ms
at ones it had; with cuDNN's attention off, 1.19 ms at both. Prefills (one shape per prompt length) keep torch's
choice.

The switch is ``torch.backends.cuda.enable_cudnn_sdp``, a process-wide flag: it is turned off for the length of one
decode call of the model and put back after it, exceptions included, and left alone when it was off already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._phases import call_extent

__all__ = ["cudnn_attention_off", "decode_without_cudnn_attention", "is_decode_call"]


@contextlib.contextmanager
def cudnn_attention_off() -> Iterator[None]:
    """cuDNN's SDPA kernel off inside the block, as it was after it."""
    was_on = torch.backends.cuda.cudnn_sdp_enabled()
    if was_on:
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        if was_on:
            torch.backends.cuda.enable_cudnn_sdp(True)


def is_decode_call(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """A model call that adds one token per sequence to a non-empty cache."""
    extent = call_extent(args, kwargs)
    return extent is not None and extent[2] == 1 and extent[1] > 1


def decode_without_cudnn_attention(model: nn.Module) -> Callable[[], None]:
    """Hooks on ``model`` that run its decode calls with cuDNN's attention off (:func:`cudnn_attention_off`);
    returns what removes them. Nested calls of the model (a forward inside a forward) leave the switch to the
    outermost."""
    stack: list[contextlib.ExitStack] = []

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        exits = contextlib.ExitStack()
        if not stack and is_decode_call(args, kwargs):
            exits.enter_context(cudnn_attention_off())
        stack.append(exits)

    def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if stack:
            stack.pop().close()

    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True, always_call=True)]

    def remove() -> None:
        for handle in handles:
            handle.remove()
        while stack:  # a call interrupted between the hooks: put the switch back
            stack.pop().close()

    return remove
