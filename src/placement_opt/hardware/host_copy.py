"""Copying a CUDA tensor to the CPU through a small pinned buffer: how a KV cache or an output leaves a GPU.

A phased unit's prompt KV cache moves from the GPU that ran the prefill to the CPU that runs the
decode, and a GPU unit's outputs bound for a CPU unit leave the same way. A plain ``.to("cpu")``
copies into fresh pageable memory: on a lent H200's host (torch 2.11+cu130) that ran at 1.3-1.6 GB/s
for 33-256 MiB tensors, against 54 GB/s into pinned memory, while that CPU hands out fresh pages at
15 GB/s and copies memory at 90 GB/s. So :func:`to_host` copies in chunks: each chunk goes GPU ->
a pinned staging buffer (DMA at the pinned rate), then staging -> the destination (a CPU memcpy,
fresh pages included), with two buffers in turn so that one chunk's DMA overlaps the previous
chunk's memcpy.

The destination is ordinary pageable memory (``torch.empty``), not pinned: the CUDA caching host
allocator rounds pinned blocks up to powers of two and keeps them, a pool the size of the KV cache
that the cost model's CPU memory would not count. Only the staging buffers stay pinned (two per GPU).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

__all__ = ["CHUNK_BYTES", "SMALL_BYTES", "copy_through", "to_host"]

# Bytes per chunk, the size of each staging buffer. At ~50 GB/s a 64 MiB chunk takes ~1.3 ms, so the
# per-chunk cost (a copy launch, an event wait: tens of microseconds) stays a few percent; two buffers per
# GPU (128 MiB pinned) are small beside any host's RAM. A power of two: the caching host allocator rounds
# pinned blocks up to one, so no pinned memory is wasted.
CHUNK_BYTES = 64 * 2**20
# Tensors below this size take a plain ``.to("cpu")``: their copy takes microseconds either way (glibc
# serves them from heap pages already mapped), and staging would add a lock, an event wait and a second copy
# to every decode step's small outputs.
SMALL_BYTES = 2**20
# Staging buffers alternate: while the CPU copies chunk i out of one, the GPU writes chunk i+1 into the other.
_BUFFERS = 2


class _Staging:
    """A CUDA device's pinned buffers, and the lock a copy holds while it uses them."""

    __slots__ = ("buffers", "lock")

    def __init__(self, buffers: tuple[torch.Tensor, ...]) -> None:
        self.buffers = buffers
        self.lock = threading.Lock()


# Per CUDA device index: its staging, or None when pinning failed there (not retried).
_staging: dict[int, _Staging | None] = {}
# Guards _staging: the dispatcher's prefetch threads may copy too.
_staging_lock = threading.Lock()


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor`` (same shape and dtype, contiguous), staged through pinned memory when it is a
    large CUDA tensor; a CPU tensor is returned as is. Blocks until the copy is complete, as ``.to("cpu")`` does."""
    if tensor.device.type == "cpu":
        return tensor
    staging = _staging_for(tensor.device) if _stageable(tensor) else None
    if staging is None:
        return tensor.to("cpu")
    dest = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    with staging.lock:
        copy_through(_bytes_of(tensor.contiguous()), _bytes_of(dest), staging.buffers)
    return dest


def copy_through(source: torch.Tensor, dest: torch.Tensor, staging: Sequence[torch.Tensor]) -> None:
    """Copy 1-D ``source`` into ``dest`` (same size and dtype) in chunks of a staging buffer's size, each chunk
    into the buffers in turn and from there into ``dest``; returns when ``dest`` holds everything.

    The copies into the other buffers are started before a chunk leaves its own, so on CUDA they overlap; a
    buffer is refilled only after the CPU copied its last chunk out (that copy is synchronous).
    """
    size, chunk, count = source.numel(), staging[0].numel(), len(staging)
    starts = range(0, size, chunk)
    fences: list[torch.cuda.Event | None] = [None] * count

    def start(j: int) -> None:
        if j < len(starts):
            fences[j % count] = _start_chunk(source, staging[j % count], starts[j], chunk)

    for j in range(count - 1):
        start(j)
    for i, at in enumerate(starts):
        start(i + count - 1)  # into the buffer chunk i - 1 has left
        if (fence := fences[i % count]) is not None:
            fence.synchronize()  # the DMA into this buffer is done: its bytes may be read
        n = min(chunk, size - at)
        dest[at:at + n].copy_(staging[i % count][:n])


def _start_chunk(source: torch.Tensor, buffer: torch.Tensor, start: int, chunk: int) -> torch.cuda.Event | None:
    """Start copying ``source[start:start + chunk]`` into ``buffer``; the event that marks its end (None: done)."""
    n = min(chunk, source.numel() - start)
    buffer[:n].copy_(source[start:start + n], non_blocking=source.is_cuda)
    if not source.is_cuda:
        return None
    # On the stream the copy was queued on (the source device's current one), after whatever wrote the source.
    fence = torch.cuda.Event()
    fence.record(torch.cuda.current_stream(source.device))
    return fence


def _stageable(tensor: torch.Tensor) -> bool:
    """Whether staging applies: a large plain strided CUDA tensor whose bytes are its values. Autograd, tensor
    subclasses, quantized, sparse and conjugate/negative-bit tensors keep ``.to("cpu")``, which handles them."""
    return (tensor.is_cuda and type(tensor) is torch.Tensor and tensor.layout == torch.strided
            and not tensor.requires_grad and not tensor.is_quantized and not tensor.is_conj()
            and not tensor.is_neg() and tensor.numel() * tensor.element_size() >= SMALL_BYTES)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a 1-D uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


def _staging_for(device: torch.device) -> _Staging | None:
    """The device's staging, allocated on first use; None when pinned memory cannot be had there."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _staging_lock:
        if index not in _staging:
            _staging[index] = _allocate(index)
        return _staging[index]


def _allocate(index: int) -> _Staging | None:
    try:
        with torch.cuda.device(index):
            return _Staging(tuple(_pinned(CHUNK_BYTES) for _ in range(_BUFFERS)))
    except (RuntimeError, AssertionError):  # no CUDA (torch raises AssertionError when built without it), no pinning
        return None


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
