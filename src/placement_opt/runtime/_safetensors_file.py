"""Safetensors files: read through memory maps, and laid out byte for byte before they are written.

:class:`SafetensorsFile` maps a file once and hands out tensors that *are* the file's bytes
(``mmap`` -> ``numpy`` -> ``torch.from_numpy``, no copy): a unit executed on the CPU computes
straight from the page cache. It can also copy a tensor into a preallocated buffer
(``readinto``, no intermediate copy) and ask the kernel to read ahead (``posix_fadvise``).

:func:`fingerprint` and ``_layout`` describe the exact file a unit's tensors make (header bytes,
tensors in file order, xxh3-128 hash) without copying them; :mod:`.offload` writes it. The public
home of these names is :mod:`placement_opt.runtime.offload`, which re-exports them.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from .._files import loads_json
from ..errors import DispatchError

__all__ = ["SafetensorsFile", "TensorSpan", "fingerprint", "DTYPES", "drop_page_cache"]

_PAGE_BYTES = mmap.PAGESIZE
try:  # mincore(2) tells whether a page is in the page cache
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
    _LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _LIBC = None
#: Private pages by the top byte of their /proc/self/pagemap entry (Linux,
#: Documentation/admin-guide/mm/pagemap.rst: bit 63 present, 62 swapped, 61 file page): present but not a
#: file page (a copy this process wrote), or swapped out (only a private page can be).
_PRIVATE_TOP_BYTE = np.array([(b & 0xA0) == 0x80 or bool(b & 0x40) for b in range(256)])
_TOP_BYTE = 7 if sys.byteorder == "little" else 0  # where a native u64's top byte lies
_PAGEMAP: dict[int, int] = {}  # pid -> fd of its /proc/self/pagemap (a forked child opens its own)

#: safetensors dtype code -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True, kw_only=True)
class TensorSpan:
    """Where one tensor lies in a safetensors file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset_bytes: int
    """Absolute offset of the first byte in the file."""
    nbytes: int


class SafetensorsFile:
    """One safetensors file, mapped once (copy-on-write: the file is never modified).

    Args:
        path: the ``.safetensors`` file.

    Raises:
        DispatchError: the file is not a safetensors file or names an unknown dtype.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.spans = _read_header(self.path)
        self._fd: int | None = None
        self._fd_lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._array: np.ndarray | None = None
        self._written: set[str] = set()
        """Tensors with pages this process wrote to (private copies): never released."""

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, tensors={len(self.spans)})"

    def keys(self) -> list[str]:
        return list(self.spans)

    def _descriptor(self) -> int:
        """The file opened once for ``posix_fadvise``; read-aheads ask from the release thread while a hook asks for
        routed rows from the computing one, so the first to ask opens it, under a lock."""
        with self._fd_lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            return self._fd

    def _mapped(self) -> np.ndarray:
        if self._array is None:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                self._map = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) if size else None
            self._array = np.frombuffer(self._map, dtype=np.uint8) if self._map is not None else np.empty(0, np.uint8)
        return self._array

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor ``key`` as a view of the mapped file (no copy; pages load on first touch)."""
        span = self.spans[key]
        raw = torch.from_numpy(self._mapped()[span.offset_bytes:span.offset_bytes + span.nbytes])
        if span.dtype.itemsize > 1 and span.offset_bytes % span.dtype.itemsize:
            raw = raw.clone()  # misaligned (never in files safetensors writes): copy to view it
        return raw.view(span.dtype).reshape(span.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the file, as zero-copy views."""
        return {key: self.tensor(key) for key in self.spans}

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """Copy tensor ``key`` into the contiguous CPU tensor ``out`` with one ``readinto``.

        ``out`` must have the file's dtype and shape; nothing else is allocated, so a model
        loaded this way never holds the file's pages and its own copy at the same time.
        """
        span = self.spans[key]
        if out.dtype != span.dtype or tuple(out.shape) != span.shape or not out.is_contiguous():
            raise DispatchError(
                f"{self.path.name}:{key} is {span.dtype} {list(span.shape)}, the buffer is "
                f"{out.dtype} {list(out.shape)}: allocate a contiguous buffer of the file's dtype and shape"
            )
        if span.nbytes:
            view = memoryview(out.view(-1).view(torch.uint8).numpy())
            with open(self.path, "rb", buffering=0) as fh:
                fh.seek(span.offset_bytes)
                got = fh.readinto(view)
            if got != span.nbytes:
                raise DispatchError(f"{self.path}: read {got} of {span.nbytes} bytes of {key}: the file is truncated")
        return out

    def prefetch(self, keys: Iterable[str]) -> None:
        """Ask the kernel to start reading these tensors into the page cache (returns at once).

        Tensors whose first, middle and last pages are already cached are skipped: asking again
        would cost the kernel a walk over every cached page (~0.3 ms per 50 MB).
        """
        if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not Linux
            return
        for key in keys:
            span = self.spans[key]
            if span.nbytes and not self.cached(key):
                os.posix_fadvise(self._descriptor(), span.offset_bytes, span.nbytes, os.POSIX_FADV_WILLNEED)

    def prefetch_rows(self, key: str, start: int, end: int) -> None:
        """:meth:`prefetch` of rows ``[start, end)`` (along the first dimension) of tensor ``key`` only."""
        span = self.spans[key]
        if not hasattr(os, "posix_fadvise") or not span.nbytes or not span.shape:  # pragma: no cover - not Linux
            return
        row = span.nbytes // span.shape[0]
        os.posix_fadvise(self._descriptor(), span.offset_bytes + start * row, (end - start) * row, os.POSIX_FADV_WILLNEED)

    def cached(self, key: str) -> bool:
        """True when the first, middle and last pages of tensor ``key`` are in the page cache."""
        span = self.spans[key]
        if not span.nbytes or _LIBC is None:
            return _LIBC is not None
        base = self._mapped().ctypes.data
        start, end = base + span.offset_bytes, base + span.offset_bytes + span.nbytes - 1
        vec = (ctypes.c_ubyte * 1)()
        for address in (start, (start + end) // 2, end):
            page = address - address % _PAGE_BYTES
            if _LIBC.mincore(ctypes.c_void_p(page), ctypes.c_size_t(_PAGE_BYTES), vec) != 0 or not vec[0] & 1:
                return False
        return True

    def release(self, keys: Iterable[str]) -> None:
        """Let go of the pages these tensors' views brought into this process; the page cache keeps them.

        A unit computed from the map touches every page of its weights, and each stays in the
        process (its RSS) after the unit has run, so without this the RSS of a model stored on disk
        grows to the whole model. Afterwards the views are as before: the next touch maps the page
        again from the page cache (a minor fault; a read from disk once the kernel dropped it).
        Neighbouring tensors go in one range, and only whole pages inside it are let go (a page shared
        with a tensor not released stays). A tensor the process wrote to holds private copies of its
        pages (the map is copy-on-write): those are the only copy of the change, so that tensor is
        never released again; none is on a system without ``/proc/self/pagemap`` to tell.
        """
        if self._map is None:
            return
        for start, end, keys_in in _page_ranges(self.spans, [k for k in keys if k not in self._written]):
            if self._clean(start, end):
                self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
            elif len(keys_in) > 1:  # find which tensor was written; its neighbours still go
                for key in keys_in:
                    self.release([key])
            else:
                self._written.update(keys_in)

    def _clean(self, start: int, end: int) -> bool:
        """True when no page of bytes ``[start, end)`` of the map is a private copy (or none can tell)."""
        return _written_pages(self._mapped().ctypes.data + start, end - start) == 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def let_go(self) -> None:
        """Close the descriptor and drop this object's hold on the map: the map goes once no tensor views it
        (a tensor still viewing it keeps it, so nothing is unmapped under a weight). A later read maps again."""
        with self._fd_lock:
            self.close()
        self._array = self._map = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _page_ranges(spans: Mapping[str, TensorSpan], keys: Iterable[str]) -> list[tuple[int, int, list[str]]]:
    """``keys``' tensors as ``(start, end, keys)`` ranges of whole pages inside them, neighbours merged."""
    ranges: list[tuple[int, int, list[str]]] = []
    for key in sorted(keys, key=lambda k: spans[k].offset_bytes):
        span = spans[key]
        start, end = span.offset_bytes, span.offset_bytes + span.nbytes
        if ranges and start <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(end, ranges[-1][1]), ranges[-1][2] + [key])
        else:
            ranges.append((start, end, [key]))
    inner = [(-(-a // _PAGE_BYTES) * _PAGE_BYTES, b // _PAGE_BYTES * _PAGE_BYTES, k) for a, b, k in ranges]
    return [(a, b, k) for a, b, k in inner if b > a]


def _written_pages(address: int, nbytes: int) -> int:
    """How many pages of ``[address, address + nbytes)`` (page-aligned) are private copies this process wrote
    (present but not file pages, or swapped out). -1 when the process cannot tell (no ``/proc/self/pagemap``)."""
    pid = os.getpid()
    if pid not in _PAGEMAP:
        try:
            _PAGEMAP[pid] = os.open("/proc/self/pagemap", os.O_RDONLY)
        except OSError:  # pragma: no cover - not Linux
            _PAGEMAP[pid] = -1
    fd = _PAGEMAP[pid]
    if fd < 0:  # pragma: no cover - not Linux
        return -1
    pages = nbytes // _PAGE_BYTES
    try:
        entries = os.pread(fd, pages * 8, address // _PAGE_BYTES * 8)
    except OSError:  # pragma: no cover - a kernel that refuses the read
        return -1
    if len(entries) != pages * 8:  # pragma: no cover - a short read
        return -1
    top = np.frombuffer(entries, dtype=np.uint8)[_TOP_BYTE::8]
    return int(np.count_nonzero(_PRIVATE_TOP_BYTE[top]))


def _read_header(path: Path) -> dict[str, TensorSpan]:
    """Parse a safetensors header: 8-byte little-endian length, then JSON."""
    try:
        with open(path, "rb") as fh:
            size_bytes = os.fstat(fh.fileno()).st_size
            first = fh.read(8)
            if first.startswith(b"version "):  # a Git LFS pointer: the weights were never downloaded
                raise DispatchError(f"{path} is a Git LFS pointer ({size_bytes} bytes), not the weights: run "
                                    f"`git lfs pull` in its repository, or download the checkpoint again")
            (length,) = struct.unpack("<Q", first)
            if length > size_bytes - 8:  # read nothing a corrupt length asks for: it can be exabytes
                raise DispatchError(f"{path} is not a safetensors file: its header claims {length} bytes and "
                                    f"the file has {size_bytes}; re-save or re-download the weights")
            header = loads_json(fh.read(length))
    except DispatchError:
        raise
    except (OSError, struct.error, ValueError) as exc:
        raise DispatchError(f"{path} is not a readable safetensors file ({exc}): re-save the weights") from exc
    try:
        return _spans(header, 8 + length)
    except DispatchError as exc:
        raise DispatchError(f"{path}:{exc}") from None
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise DispatchError(f"{path} has a malformed safetensors header ({type(exc).__name__}: {exc}): "
                            f"re-save or re-download the weights") from None


def _spans(header: dict[str, Any], base: int) -> dict[str, TensorSpan]:
    spans = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise DispatchError(f"{key} has dtype {info['dtype']}, which placement_opt cannot map; "
                                f"known: {', '.join(DTYPES)}")
        start, end = (int(offset) for offset in info["data_offsets"])
        if not 0 <= start <= end:  # past the file's end is a truncated file: the reader says so with its size
            raise ValueError(f"{key}'s bytes [{start}, {end}) are no range")
        spans[key] = TensorSpan(dtype=DTYPES[info["dtype"]], shape=tuple(info["shape"]),
                                offset_bytes=base + start, nbytes=end - start)
    return spans


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """The fingerprint of a unit's tensors: the xxh3-128 hash of the safetensors file they make.

    It covers every name, dtype and shape (they are in the file's header) and every byte; the
    store names each file after it and checks files against it, so two different sets of weights
    never share a file and a file is used only when it holds exactly these tensors.

    Example::

        fp = fingerprint({"w": torch.zeros(2, 2)})     # 32 hex digits
    """
    return _layout(tensors).fingerprint


# ---------------------------------------------------------------------------------------------
# The layout of a file before it is written
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    """A unit's safetensors file, before it is written: header bytes, tensors in file order, hash."""

    header: bytes
    tensors: tuple[tuple[str, torch.Tensor], ...]
    size_bytes: int
    fingerprint: str


_CODES = {dtype: code for code, dtype in DTYPES.items()}


def _layout(tensors: Mapping[str, torch.Tensor]) -> _Layout:
    """The exact bytes of the file ``tensors`` make, described without copying them.

    The store writes its files itself (not through ``safetensors.torch.save``) so that the
    fingerprint, hashed here from the tensors in memory, is the hash of the file on disk: checking
    a file needs no other record. The format is safetensors' own (readable by ``safetensors``):
    8-byte little-endian header length, compact JSON header padded with spaces to 8 bytes, then
    the data with no gaps, larger items first and by name, so that every tensor is aligned.
    """
    items = []
    for name, tensor in tensors.items():
        if tensor.dtype not in _CODES:
            raise DispatchError(f"{name} is {tensor.dtype}, which the offload store cannot write; "
                                f"it stores {', '.join(str(d) for d in _CODES)}: store this unit on cpu or a GPU")
        # CPU tensors already contiguous are used as they are; others are copied once here.
        items.append((name, tensor.detach().to("cpu").contiguous()))
    items.sort(key=lambda item: (-item[1].element_size(), item[0]))
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    head = struct.pack("<Q", len(text)) + text
    digest = xxhash.xxh3_128(head)
    for _, tensor in items:
        digest.update(_bytes_of(tensor))
    return _Layout(header=head, tensors=tuple(items), size_bytes=len(head) + offset,
                   fingerprint=digest.hexdigest())


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, as a uint8 array sharing its memory."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def drop_page_cache(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Ask the kernel to drop these files' pages from the page cache (``POSIX_FADV_DONTNEED``), so the next read
    comes from the disk. Pages some process still maps are kept: release them first. Nothing off Linux/POSIX."""
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not POSIX
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
