"""Disk storage for weights: safetensors files read through memory maps, and a store safe to share.

Used by :mod:`placement_opt.runtime.dispatcher` for units whose plan stores them on ``"disk"``. Two
sources of files:

* the model's own checkpoint shards (:func:`placement_opt.load` reads them in place), and
* an :class:`OffloadStore`: a directory the user names, shared safely by any number of threads
  and processes. Each unit's file is named after the fingerprint of its tensors (the hash of the
  file's bytes), so different weights never share a file; a file is used only after its bytes
  are checked against that fingerprint (once per process, then remembered by size, inode and
  times); writers write private temporary files and commit them under an exclusive lock, with
  a manifest replaced atomically; files the store did not write are never touched; temporary
  files of writers that died are removed when a store is opened.

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

import contextlib
import ctypes
import errno
import hashlib
import json
import mmap
import os
import re
import secrets
import socket
import struct
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ..errors import DispatchError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: threads of one process still exclude each other
    fcntl = None  # type: ignore[assignment]

__all__ = ["SafetensorsFile", "OffloadStore", "TensorSpan", "fingerprint", "MANIFEST_NAME", "LOCK_NAME",
           "HASH_NAME", "STALE_TEMP_S", "WRITE_POINTS", "DTYPES"]

#: File name of the store's manifest inside the offload directory.
MANIFEST_NAME = "placement_opt_offload.json"
#: File every user of an offload directory locks (``flock``) to change the manifest; never deleted.
LOCK_NAME = "placement_opt_offload.lock"
#: The hash of fingerprints and file checks: xxh3-128 (xxhash), about 17 GB/s on one core, where
#: SHA-256 reaches 1.5 GB/s and BLAKE2b 0.8 GB/s. It guards against accidents (crashes, damage,
#: concurrent writers), not against someone who can write into the directory anyway.
HASH_NAME = "xxh3_128"
#: Seconds after which an unchanged temporary file is removed even when its writer may still run
#: (another host, or its process id reused): a live writer renames its file within seconds.
STALE_TEMP_S = 3600.0
#: The points of the write path, in order (the crash tests stop a writer at each one).
WRITE_POINTS = ("fingerprinted", "temp-created", "header-written", "tensor-written", "data-written",
                "temp-synced", "locked", "manifest-temp-written", "manifest-replaced", "linked", "committed")
_MANIFEST_VERSION = 2
_CHUNK_BYTES = 16 * 1024 * 1024
_UNIT_NAME_CHARS = 120  # file names stay under NAME_MAX (255) with the fingerprint and a temporary suffix
_NAME_TRIES = 100


def _process_ids_tag() -> str:
    """8 hex digits naming this host and process-id namespace: whose process ids a temporary name holds.

    Containers sharing a volume may share a host name but not their process ids.
    """
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # pragma: no cover - not Linux
        namespace = 0
    return xxhash.xxh32_hexdigest(f"{socket.gethostname()}:{namespace}".encode())


_HOST = _process_ids_tag()

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
def _reached(point: str, name: str) -> None:
    """Called at each point of the write path (:data:`WRITE_POINTS`) with the file being written.

    Does nothing. The crash tests replace it in a subprocess, to stop a writer at one point and
    kill it there (``tests/test_offload_faults.py``).
    """


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> str:
    """The fingerprint of a unit's tensors: the xxh3-128 hash of the safetensors file they make.

    It covers every name, dtype and shape (they are in the file's header) and every byte; the
    store names each file after it and checks files against it, so two different sets of weights
    never share a file and a file is used only when it holds exactly these tensors.

    Example::

        fp = fingerprint({"w": torch.zeros(2, 2)})     # 32 hex digits
    """
    return _layout(tensors).fingerprint


class OffloadStore:
    """A directory of safetensors files that placement_opt wrote, with a manifest.

    Safe to share between threads and processes, and to crash in:

    * **Files are named by their content.** Each unit's file is
      ``<unit>.<fingerprint>.safetensors``, the fingerprint being the xxh3-128 hash of the file's
      bytes (:func:`fingerprint`: names, dtypes, shapes and data of the unit's tensors). Two models
      dispatched into one directory get different files for different weights, so neither can
      overwrite or use the other's; identical weights (a rotary table every model computes the
      same way) are stored once. A file is never changed once written, only repaired.
    * **A file is used only after its bytes are checked** against its fingerprint, once per
      process and file: the check is remembered with the file's size, inode, mtime and ctime, so
      later dispatches only ``stat`` it. A damaged file (bytes changed, truncated, deleted) is
      rewritten from the weights being stored; :meth:`open`, which has no weights, refuses it.
    * **Writers never meet.** Each writes its own temporary file (host, process id, thread id and
      a random token in the name), then commits it under an exclusive ``flock`` on
      :data:`LOCK_NAME`: the manifest is read, updated and replaced atomically (temporary file,
      ``fsync``, ``os.replace``) inside the lock, and the file is linked to its name after the
      manifest lists it, so a file under a listed name is always one this store wrote.
    * **Foreign files are never touched.** A file the manifest does not list is never
      overwritten, renamed or deleted; when one carries the name a unit would get, the unit is
      written under the next free name (``<unit>.<fingerprint>.1.safetensors``, ...).
    * **Crashes leave nothing behind for long.** Opening a store removes the temporary files of
      writers that are gone (their process no longer exists on this host, or the file is older
      than :data:`STALE_TEMP_S`) and forgets listed files that were never linked.

    Files of weights that changed stay until you delete them (the store cannot know whether
    another process still uses them): delete the directory when no dispatch uses it.

    Args:
        directory: created when missing.

    Example::

        store = OffloadStore("/scratch/offload")
        path = store.write("model.layers.0", layer.state_dict())
        store.verify()          # every listed file against its fingerprint

    Raises:
        DispatchError: the directory cannot be written, the manifest is not a placement_opt
            manifest, or (:meth:`open`, :meth:`verify`) a listed file does not hold the bytes
            it was written with.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory).strip():
            raise DispatchError(
                f"offload_dir {directory!r} names no directory (an empty path would be the current directory): "
                f"pass offload_dir='some/empty/dir', where the weights of disk-stored units are written once")
        self.directory = Path(directory)
        self.lock_path = self.directory / LOCK_NAME
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with self._locked():
                manifest = self._read_manifest()
                self._remove_stale_temporaries()
                # A listed file that is absent: its writer died between the manifest and the link
                # (or someone deleted it). Forget it, so the listing matches the directory.
                missing = [name for name in manifest if not (self.directory / name).exists()]
                for name in missing:
                    del manifest[name]
                if missing:
                    self._write_manifest(manifest, "")
        except OSError as exc:
            raise DispatchError(
                f"offload directory {self.directory} cannot be used ({type(exc).__name__}: {exc}): "
                f"pass an offload_dir you can create and write files in"
            ) from exc
        self.manifest = manifest

    def __repr__(self) -> str:
        return f"OffloadStore({str(self.directory)!r}, files={len(self.manifest)})"

    @staticmethod
    def file_name(unit: str, fingerprint: str) -> str:
        """``("model.layers.3", fp)`` -> ``"model.layers.3.<fp>.safetensors"`` (the root unit ``""`` -> ``"_root"``)."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", unit)[:_UNIT_NAME_CHARS] or "_root"
        return f"{safe}.{fingerprint}.safetensors"

    def path(self, unit: str, fingerprint: str | None = None) -> Path:
        """The listed file of ``unit`` (of these weights, given their ``fingerprint``); not checked.

        Raises:
            DispatchError: no listed file, or several and no ``fingerprint`` to choose.
        """
        return self.directory / self._listed(unit, fingerprint)[0]

    def write(self, unit: str, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Store ``unit``'s tensors; return the path of a file that holds exactly them.

        A listed file with these tensors' fingerprint is reused once its bytes are checked (no
        write). A damaged one is rewritten from ``tensors``. Otherwise a new file is written.

        Raises:
            DispatchError: a dtype safetensors files cannot hold, the tensors changed while they
                were written, no free file name for the unit, or a directory that is not writable.
            OSError: the write itself failed (disk full, ...); nothing is left behind.
        """
        layout = _layout(tensors)
        preferred = self.file_name(unit, layout.fingerprint)
        _reached("fingerprinted", preferred)
        with self._locked():
            manifest = self._read_manifest()
        self.manifest = manifest
        name = _listed_with(manifest, layout.fingerprint)
        # Checked outside the lock: a listed file is only ever replaced by the same bytes.
        if name is not None and self._problem(name, manifest[name]) is None:
            return self.directory / name
        try:
            tmp = self._write_temporary(preferred, layout)
            try:
                return self._commit(unit, layout, tmp, preferred)
            finally:
                _remove(tmp)  # already linked or renamed, or a copy no longer needed
        except OSError as exc:  # a read-only directory (or file system): one clear line
            if not isinstance(exc, PermissionError) and exc.errno != errno.EROFS:
                raise
            raise DispatchError(
                f"offload directory {self.directory} is not writable ({exc.strerror or exc}): unit {unit!r} "
                f"cannot be stored there; pass an offload_dir you can write files in") from exc

    def open(self, unit: str, fingerprint: str | None = None) -> SafetensorsFile:
        """The unit's file, mapped (no tensor bytes read yet), after checking its bytes once.

        Args:
            unit: the unit name given to :meth:`write`.
            fingerprint: which version of the unit's weights, when the store holds several.

        Raises:
            DispatchError: the unit has no file (or several and no ``fingerprint``), or its file
                is damaged; the store has no weights to rewrite it from.
        """
        name, entry = self._listed(unit, fingerprint)
        problem = self._problem(name, entry)
        if problem is not None:
            raise DispatchError(
                f"offload file {self.directory / name} of unit {unit!r} is damaged: {problem}. Nothing is "
                f"read from it: dispatch the model again (its weights rewrite the file) or delete the file"
            )
        return SafetensorsFile(self.directory / name)

    def verify(self) -> None:
        """Read every listed file and check it against its fingerprint; raise listing every mismatch."""
        with self._locked():
            self.manifest = self._read_manifest()
        problems = []
        for name, entry in sorted(self.manifest.items()):
            problem = self._problem(name, entry, remembered=False)
            if problem is not None:
                problems.append(f"{name}: {problem}")
        if problems:
            raise DispatchError(f"offload store {self.directory} is damaged ({len(problems)} file(s)): "
                                + "; ".join(problems) + ". Delete the listed files and dispatch again")

    # -- finding and checking files -------------------------------------------------------------
    def _listed(self, unit: str, fingerprint: str | None) -> tuple[str, dict[str, Any]]:
        with self._locked():
            self.manifest = self._read_manifest()
        found = [(name, entry) for name, entry in sorted(self.manifest.items()) if entry["unit"] == unit
                 and (fingerprint is None or entry.get("fingerprint") == fingerprint)]
        if not found:
            which = f" with fingerprint {fingerprint}" if fingerprint else ""
            raise DispatchError(f"unit {unit!r} has no file{which} in {self.directory}: write it first")
        if len(found) > 1:
            raise DispatchError(
                f"unit {unit!r} has {len(found)} files in {self.directory} (one per version of its weights: "
                f"{', '.join(name for name, _ in found[:3])}): pass fingerprint=offload.fingerprint(tensors)"
            )
        return found[0]

    def _problem(self, name: str, entry: Mapping[str, Any], *, remembered: bool = True) -> str | None:
        """None when the listed file ``name`` holds the bytes it was written with, else what differs.

        ``remembered``: trust an earlier check of this process when the file's size, inode,
        mtime and ctime are unchanged (ctime cannot be set back by a program, unlike mtime).
        """
        path = self.directory / name
        expected = entry.get("fingerprint") or entry.get("sha256")
        algorithm = HASH_NAME if "fingerprint" in entry else "sha256"  # sha256: version 1 manifests
        try:
            with open(path, "rb", buffering=0) as fh:
                before = os.fstat(fh.fileno())
                if before.st_size != entry["size_bytes"]:
                    what = "truncated" if before.st_size < entry["size_bytes"] else "longer"
                    return (f"{before.st_size} bytes on disk, {entry['size_bytes']} written ({what} "
                            f"since placement_opt wrote it)")
                key, stamp = _stamp(before)
                if remembered and _checked_get(key) == (stamp, algorithm, expected):
                    return None
                digest = _hash_file(fh, algorithm)
                after = os.fstat(fh.fileno())
        except FileNotFoundError:
            return "the file is missing"
        except OSError as exc:  # a directory, a file we may not read, ...
            return f"it cannot be read ({type(exc).__name__}: {exc})"
        if digest != expected:
            return (f"its {algorithm} hash is {digest}, it was written with {expected}: same size, "
                    f"different bytes")
        if _stamp(after) == (key, stamp):  # unchanged while read: remember the check
            _checked_put(key, stamp, algorithm, expected)
        return None

    # -- writing ----------------------------------------------------------------------------------
    def _write_temporary(self, name: str, layout: _Layout) -> Path:
        """Write the file to a temporary name only this thread uses, hashing what it writes; fsync."""
        tmp = self.directory / _temporary_name(name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # EXCL: never someone else's file
        try:
            with open(fd, "wb") as fh:
                _reached("temp-created", name)
                digest = xxhash.xxh3_128(layout.header)
                fh.write(layout.header)
                _reached("header-written", name)
                for _, tensor in layout.tensors:
                    data = _bytes_of(tensor)
                    for start in range(0, len(data), _CHUNK_BYTES):
                        chunk = data[start:start + _CHUNK_BYTES]
                        digest.update(chunk)
                        fh.write(chunk)
                    _reached("tensor-written", name)
                fh.flush()
                _reached("data-written", name)
                os.fsync(fh.fileno())
                _reached("temp-synced", name)
        except BaseException:
            _remove(tmp)
            raise
        if digest.hexdigest() != layout.fingerprint:
            _remove(tmp)
            raise DispatchError(
                f"the weights of {name.split('.' + layout.fingerprint)[0]!r} changed while they were written "
                f"to {self.directory}: another thread is modifying the model; dispatch it when it is not"
            )
        return tmp

    def _commit(self, unit: str, layout: _Layout, tmp: Path, preferred: str) -> Path:
        """Give the temporary file its name, under the lock; return the path holding these tensors."""
        fp = layout.fingerprint
        with self._locked():
            _reached("locked", preferred)
            manifest = self._read_manifest()
            self.manifest = manifest
            name = _listed_with(manifest, fp)
            if name is not None and self._problem(name, manifest[name]) is None:
                return self.directory / name  # another writer stored the same tensors meanwhile
            repair = name is not None
            if name is None:
                name = self._free_name(manifest, unit, fp)
            target = self.directory / name
            # The manifest lists the name before the file exists: a file under a listed name is
            # then always ours, and a crash in between leaves an entry the next open forgets.
            manifest[name] = {"unit": unit, "fingerprint": fp, "size_bytes": layout.size_bytes}
            self._write_manifest(manifest, preferred)
            _reached("manifest-replaced", preferred)
            try:
                if repair:
                    os.replace(tmp, target)  # our own damaged file: readers that mapped it keep their copy
                else:
                    _link_new(tmp, target)
            except BaseException:
                del manifest[name]
                with contextlib.suppress(OSError):
                    self._write_manifest(manifest, preferred)
                raise
            _reached("linked", preferred)
            _remove(tmp)
            _fsync_directory(self.directory)
            _checked_put(*_stamp(os.stat(target)), HASH_NAME, fp)  # we just wrote and hashed it
            _reached("committed", preferred)
        return target

    def _free_name(self, manifest: Mapping[str, Any], unit: str, fp: str) -> str:
        """The unit's file name, or the next free one when a file the store did not write has it.

        A name the manifest lists for other weights is skipped too (only a damaged manifest or a
        fingerprint collision could do that): the store never writes over a file it cannot
        prove holds these weights.
        """
        base = self.file_name(unit, fp)
        stem = base.removesuffix(".safetensors")
        foreign = []
        for i in range(_NAME_TRIES):
            name = base if i == 0 else f"{stem}.{i}.safetensors"
            if name in manifest:
                continue
            if os.path.lexists(self.directory / name):
                foreign.append(name)
                continue
            if foreign:
                warnings.warn(f"{', '.join(foreign)} in {self.directory} not written by placement_opt: left as "
                              f"it is; unit {unit!r} is stored in {name}", RuntimeWarning, stacklevel=4)
            return name
        raise DispatchError(
            f"{self.directory} holds {_NAME_TRIES} files named like {base} that this store cannot use "
            f"({len(foreign)} not written by placement_opt): it does not overwrite them. Use another "
            f"offload_dir or remove them yourself"
        )

    # -- lock, manifest, temporary files ------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the directory's exclusive lock (every thread and process using it waits for it).

        Each call opens the lock file anew: ``flock`` locks belong to an open file description,
        so two threads of one process exclude each other just as two processes do.
        """
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with _THREADS_LOCK if fcntl is None else contextlib.nullcontext():
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                yield
        finally:
            os.close(fd)  # releases the lock; so does the kernel when a holder is killed

    def _read_manifest(self) -> dict[str, dict[str, Any]]:
        """The files this store wrote (call with the lock held); checked so that no entry points
        outside the directory or lacks what the store reads."""
        path = self.directory / MANIFEST_NAME
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(text)
            if data["version"] not in (1, _MANIFEST_VERSION):
                raise ValueError(f"version {data['version']}, this placement_opt reads 1 and {_MANIFEST_VERSION}")
            files = dict(data["files"])
            for name, entry in files.items():
                _check_entry(name, entry)
            return files
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DispatchError(f"{path} is not a placement_opt manifest ({exc}): use another offload_dir") from exc

    def _write_manifest(self, manifest: Mapping[str, Any], name: str) -> None:
        """Replace the manifest atomically (call with the lock held)."""
        text = json.dumps({"version": _MANIFEST_VERSION, "hash": HASH_NAME, "files": manifest},
                          indent=1, sort_keys=True)
        target = self.directory / MANIFEST_NAME
        tmp = self.directory / _temporary_name(MANIFEST_NAME)
        try:
            with open(tmp, "xb") as fh:
                fh.write(text.encode("utf-8"))
                fh.flush()
                os.fsync(fh.fileno())
            _reached("manifest-temp-written", name)
            os.replace(tmp, target)
        finally:
            _remove(tmp)
        _fsync_directory(self.directory)

    def _remove_stale_temporaries(self) -> list[str]:
        """Delete the temporary files of writers that are gone (call with the lock held).

        A temporary file is its writer's until the writer renames it, so one is removed only
        when its writer cannot come back for it: its process no longer runs on this host, or the
        file has not changed for :data:`STALE_TEMP_S` (a writer on another host, or a process id
        reused since). Only names the store gives its temporary files are considered.
        """
        removed = []
        now = time.time()
        with os.scandir(self.directory) as entries:
            for item in entries:
                owner = _temporary_owner(item.name)
                if owner is None:
                    continue
                host, pid = owner
                try:
                    age = now - item.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue
                gone = host in (None, _HOST) and not _process_alive(pid)
                if gone or age > STALE_TEMP_S:
                    _remove(Path(item.path))
                    removed.append(item.name)
        return removed


# ---------------------------------------------------------------------------------------------
# Helpers of the store
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


def _listed_with(manifest: Mapping[str, Mapping[str, Any]], fp: str) -> str | None:
    return next((name for name, entry in manifest.items() if entry.get("fingerprint") == fp), None)


def _check_entry(name: str, entry: Any) -> None:
    """A manifest entry the store can trust to name a file of the directory, or ValueError."""
    if name != Path(name).name or name.startswith(".") or not name.endswith(".safetensors"):
        raise ValueError(f"entry {name!r} is not a safetensors file name of the directory")
    if not isinstance(entry["unit"], str) or type(entry["size_bytes"]) is not int:
        raise ValueError(f"entry {name!r} lacks a unit name or a size")
    expected = entry.get("fingerprint", entry.get("sha256"))
    if not isinstance(expected, str) or not re.fullmatch(r"[0-9a-f]{32}|[0-9a-f]{64}", expected):
        raise ValueError(f"entry {name!r} has no fingerprint")


def _stamp(st: os.stat_result) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(file identity, what changes when its bytes change) of a stat result."""
    return (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: Files this process has checked: (device, inode) -> ((size, mtime, ctime), algorithm, hash).
_CHECKED: dict[tuple[int, int], tuple[Any, ...]] = {}
_CHECKED_LOCK = threading.Lock()
_THREADS_LOCK = threading.Lock()  # stands in for flock where there is none


def _checked_get(key: tuple[int, int]) -> tuple[Any, ...] | None:
    with _CHECKED_LOCK:
        return _CHECKED.get(key)


def _checked_put(key: tuple[int, int], stamp: tuple[int, int, int], algorithm: str, expected: str) -> None:
    with _CHECKED_LOCK:
        _CHECKED[key] = (stamp, algorithm, expected)


def _hash_file(fh: Any, algorithm: str) -> str:
    digest = xxhash.xxh3_128() if algorithm == HASH_NAME else hashlib.sha256()
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    while count := fh.readinto(view):
        digest.update(view[:count])
    return digest.hexdigest()


def _temporary_name(target: str) -> str:
    """A hidden name beside ``target`` that no other writer can pick: host, process, thread, random."""
    return (f".{target}.{_HOST}.{os.getpid()}.{threading.get_native_id()}.{secrets.token_hex(4)}.tmp")


_TEMPORARY = re.compile(r"\.(?P<target>.+)\.(?P<host>[0-9a-f]{8})\.(?P<pid>\d+)\.\d+\.[0-9a-f]{8}\.tmp")
_TEMPORARY_V1 = re.compile(r"\.(?P<target>.+)\.(?P<pid>\d+)\.tmp")  # placement_opt before issue 17


def _temporary_owner(name: str) -> tuple[str | None, int] | None:
    """(host tag or None when unknown, process id) of a temporary name the store gives, else None."""
    for pattern in (_TEMPORARY, _TEMPORARY_V1):
        match = pattern.fullmatch(name)
        if match and (match["target"].endswith(".safetensors") or match["target"] == MANIFEST_NAME):
            return match.groupdict().get("host"), int(match["pid"])
    return None


def _process_alive(pid: int) -> bool:
    """True when process ``pid`` exists and is not a zombie (a killed writer not yet reaped)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _link_new(tmp: Path, target: Path) -> None:
    """Give ``tmp`` the name ``target`` only if nothing has that name (never replaces a file)."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise DispatchError(
            f"{target} appeared while placement_opt was writing it and was not written by placement_opt: "
            f"left as it is. Dispatch again (the unit goes to another name) or use another offload_dir"
        ) from None
    except OSError:  # a file system without hard links: we hold the lock and checked the name
        if os.path.lexists(target):
            raise
        os.replace(tmp, target)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _fsync_directory(directory: Path) -> None:
    """Make renames in ``directory`` durable (a crash after it keeps the new names)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
