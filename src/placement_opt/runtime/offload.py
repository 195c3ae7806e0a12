"""Disk storage for weights: safetensors files read through memory maps, written atomically.

Used by :mod:`placement_opt.runtime.dispatcher` for units whose plan stores them on ``"disk"``. Two
sources of files:

* the model's own checkpoint shards (:func:`placement_opt.load` reads them in place), and
* an :class:`OffloadStore`: one ``<unit>.safetensors`` file per unit, written once into a
  directory the user names, atomically (temporary file, ``fsync``, ``os.replace``), listed in a
  manifest with sizes and SHA-256 checksums. The store never writes over a file its manifest
  does not list.

:class:`SafetensorsFile` maps a file once and hands out tensors that *are* the file's bytes
(``mmap`` -> ``numpy`` -> ``torch.from_numpy``, no copy): a unit executed on the CPU computes
straight from the page cache. It can also copy a tensor into a preallocated buffer
(``readinto``, no intermediate copy) and ask the kernel to read ahead (``posix_fadvise``).

Example::

    store = OffloadStore("offload/")
    path = store.write("model.layers.3", {"self_attn.q_proj.weight": w})
    weights = SafetensorsFile(path).tensors()       # zero-copy views of the file
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import DispatchError

__all__ = ["SafetensorsFile", "OffloadStore", "TensorSpan", "MANIFEST_NAME", "DTYPES"]

#: File name of the store's manifest inside the offload directory.
MANIFEST_NAME = "placement_opt_offload.json"
_MANIFEST_VERSION = 1
_CHUNK_BYTES = 16 * 1024 * 1024

_PAGE_BYTES = mmap.PAGESIZE
try:  # mincore(2) tells whether a page is in the page cache
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
    _LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _LIBC = None

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
        self._array: np.ndarray | None = None

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, tensors={len(self.spans)})"

    def keys(self) -> list[str]:
        return list(self.spans)

    def _mapped(self) -> np.ndarray:
        if self._array is None:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) if size else None
            self._array = np.frombuffer(mm, dtype=np.uint8) if mm is not None else np.empty(0, np.uint8)
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
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_RDONLY)
                os.posix_fadvise(self._fd, span.offset_bytes, span.nbytes, os.POSIX_FADV_WILLNEED)

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

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _read_header(path: Path) -> dict[str, TensorSpan]:
    """Parse a safetensors header: 8-byte little-endian length, then JSON."""
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise DispatchError(f"{path} is not a readable safetensors file ({exc}): re-save the weights") from exc
    base = 8 + length
    spans = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise DispatchError(f"{path}:{key} has dtype {info['dtype']}, which placement_opt cannot map; "
                                f"known: {', '.join(DTYPES)}")
        start, end = info["data_offsets"]
        spans[key] = TensorSpan(dtype=DTYPES[info["dtype"]], shape=tuple(info["shape"]),
                                offset_bytes=base + start, nbytes=end - start)
    return spans


# ---------------------------------------------------------------------------------------------
# The offload store
# ---------------------------------------------------------------------------------------------
class OffloadStore:
    """A directory of safetensors files that placement_opt wrote, with a manifest.

    Args:
        directory: created when missing. Files already there that the manifest does not list
            are never overwritten or deleted.

    Example::

        store = OffloadStore("/scratch/offload")
        store.write("model.layers.0", layer.state_dict())
        store.verify()          # sizes and SHA-256 of every listed file

    Raises:
        DispatchError: the manifest is unreadable, a write would overwrite a foreign file, or a
            listed file does not match its size or checksum.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.manifest = self._read_manifest()

    def __repr__(self) -> str:
        return f"OffloadStore({str(self.directory)!r}, files={len(self.manifest)})"

    @staticmethod
    def file_name(unit: str) -> str:
        """``"model.layers.3"`` -> ``"model.layers.3.safetensors"`` (the root unit ``""`` -> ``"_root"``)."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", unit) or "_root"
        return f"{safe}.safetensors"

    def path(self, unit: str) -> Path:
        return self.directory / self.file_name(unit)

    def write(self, unit: str, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Write ``unit``'s tensors once; a listed file with the same bytes is kept as it is.

        Returns:
            The file's path.

        Raises:
            DispatchError: the target exists but was not written by this store.
        """
        name = self.file_name(unit)
        target = self.directory / name
        data = _serialize(tensors)
        digest = hashlib.sha256(data).hexdigest()
        entry = self.manifest.get(name)
        if target.exists() and entry is None:
            raise DispatchError(
                f"{target} exists and is not in {MANIFEST_NAME}: placement_opt does not overwrite files "
                f"it did not write. Use an empty offload_dir or remove the file yourself"
            )
        if entry is not None and entry["sha256"] == digest and _size(target) == entry["size_bytes"]:
            return target
        _atomic_write(target, data)
        self.manifest[name] = {"unit": unit, "size_bytes": len(data), "sha256": digest}
        self._write_manifest()
        return target

    def open(self, unit: str) -> SafetensorsFile:
        """The unit's file, mapped (no bytes read yet)."""
        name = self.file_name(unit)
        if name not in self.manifest:
            raise DispatchError(f"unit {unit!r} has no file in {self.directory}: write it first")
        return SafetensorsFile(self.directory / name)

    def verify(self) -> None:
        """Check every listed file's size and SHA-256; raise listing every mismatch."""
        problems = []
        for name, entry in self.manifest.items():
            path = self.directory / name
            size = _size(path)
            if size != entry["size_bytes"]:
                problems.append(f"{name}: {size} bytes on disk, manifest says {entry['size_bytes']}")
            elif _file_sha256(path) != entry["sha256"]:
                problems.append(f"{name}: checksum differs from the manifest")
        if problems:
            raise DispatchError(f"offload store {self.directory} is damaged ({len(problems)} file(s)): "
                                + "; ".join(problems) + ". Delete the listed files and dispatch again")

    def _read_manifest(self) -> dict[str, dict[str, Any]]:
        path = self.directory / MANIFEST_NAME
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data["version"] != _MANIFEST_VERSION:
                raise ValueError(f"version {data['version']}")
            return dict(data["files"])
        except (ValueError, KeyError, TypeError) as exc:
            raise DispatchError(f"{path} is not a placement_opt manifest ({exc}): use another offload_dir") from exc

    def _write_manifest(self) -> None:
        text = json.dumps({"version": _MANIFEST_VERSION, "files": self.manifest}, indent=1, sort_keys=True)
        _atomic_write(self.directory / MANIFEST_NAME, text.encode("utf-8"))


def _serialize(tensors: Mapping[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()})


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else -1


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _atomic_write(target: Path, data: bytes) -> None:
    """Write to a temporary file beside ``target``, fsync, then rename over it."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
