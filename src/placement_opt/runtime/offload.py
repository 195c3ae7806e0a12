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
import errno
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from .._files import loads_json
from ..errors import DispatchError
from ._safetensors_file import (
    _LIBC,  # noqa: F401 - benchmarks/offload_store reads it here
    DTYPES,
    SafetensorsFile,
    TensorSpan,
    _bytes_of,
    _Layout,
    _layout,
    fingerprint,
)
from ._store_files import (  # noqa: F401 - the tests and benchmarks/offload_store use them here
    _CHECKED,
    _CHUNK_BYTES,
    _HOST,
    HASH_NAME,
    MANIFEST_NAME,
    STALE_TEMP_S,
    _checked_put,
    _fsync_directory,
    _link_new,
    _remove,
    _stamp,
    _temporary_name,
    file_problem,
    free_name,
    locked,
    remove_stale_temporaries,
)

__all__ = ["SafetensorsFile", "OffloadStore", "TensorSpan", "fingerprint", "MANIFEST_NAME", "LOCK_NAME",
           "HASH_NAME", "STALE_TEMP_S", "WRITE_POINTS", "DTYPES"]

#: File every user of an offload directory locks (``flock``) to change the manifest; never deleted.
LOCK_NAME = "placement_opt_offload.lock"
#: The points of the write path, in order (the crash tests stop a writer at each one).
WRITE_POINTS = ("fingerprinted", "temp-created", "header-written", "tensor-written", "data-written",
                "temp-synced", "locked", "manifest-temp-written", "manifest-replaced", "linked", "committed")
_MANIFEST_VERSION = 2
_UNIT_NAME_CHARS = 120  # file names stay under NAME_MAX (255) with the fingerprint and a temporary suffix


# ---------------------------------------------------------------------------------------------
# The offload store
# ---------------------------------------------------------------------------------------------
def _reached(point: str, name: str) -> None:
    """Called at each point of the write path (:data:`WRITE_POINTS`) with the file being written.

    Does nothing. The crash tests replace it in a subprocess, to stop a writer at one point and
    kill it there (``tests/test_offload_faults.py``).
    """


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
        directory: created when missing. One this process cannot write (a store written elsewhere, on a
            read-only mount) is read as it is: a unit whose intact file it lists is used, any other refused.

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
            self.writable = os.access(self.directory, os.W_OK)
            if not self.writable:  # a store prepared elsewhere, read as it is: nothing to clean up or forget
                with locked(self.lock_path, reading=True):
                    manifest = self._read_manifest()
                self.manifest = manifest
                return
            with locked(self.lock_path):
                manifest = self._read_manifest()
                remove_stale_temporaries(self.directory)
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
        with locked(self.lock_path, reading=True):
            manifest = self._read_manifest()
        self.manifest = manifest
        name = _listed_with(manifest, layout.fingerprint)
        # Checked outside the lock: a listed file is only ever replaced by the same bytes.
        if name is not None and file_problem(self.directory / name, manifest[name]) is None:
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
            if not self.writable:
                raise DispatchError(
                    f"offload directory {self.directory} is read-only ({exc.strerror or exc}) and holds no intact "
                    f"file of unit {unit!r} with these weights (fingerprint {layout.fingerprint}): write the store "
                    f"where it can be written first, or pass an offload_dir you can write files in") from exc
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
        problem = file_problem(self.directory / name, entry)
        if problem is not None:
            raise DispatchError(
                f"offload file {self.directory / name} of unit {unit!r} is damaged: {problem}. Nothing is "
                f"read from it: dispatch the model again (its weights rewrite the file) or delete the file"
            )
        return SafetensorsFile(self.directory / name)

    def verify(self) -> None:
        """Read every listed file and check it against its fingerprint; raise listing every mismatch."""
        with locked(self.lock_path, reading=True):
            self.manifest = self._read_manifest()
        problems = []
        for name, entry in sorted(self.manifest.items()):
            problem = file_problem(self.directory / name, entry, remembered=False)
            if problem is not None:
                problems.append(f"{name}: {problem}")
        if problems:
            raise DispatchError(f"offload store {self.directory} is damaged ({len(problems)} file(s)): "
                                + "; ".join(problems) + ". Delete the listed files and dispatch again")

    # -- finding and checking files -------------------------------------------------------------
    def _listed(self, unit: str, fingerprint: str | None) -> tuple[str, dict[str, Any]]:
        with locked(self.lock_path, reading=True):
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
        with locked(self.lock_path):
            _reached("locked", preferred)
            manifest = self._read_manifest()
            self.manifest = manifest
            name = _listed_with(manifest, fp)
            if name is not None and file_problem(self.directory / name, manifest[name]) is None:
                return self.directory / name  # another writer stored the same tensors meanwhile
            repair = name is not None
            if name is None:
                name = free_name(self.directory, manifest, self.file_name(unit, fp), unit)
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

    # -- manifest ------------------------------------------------------------
    def _read_manifest(self) -> dict[str, dict[str, Any]]:
        """The files this store wrote (call with the lock held); checked so that no entry points
        outside the directory or lacks what the store reads."""
        path = self.directory / MANIFEST_NAME
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        try:
            data = loads_json(text)
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

# ---------------------------------------------------------------------------------------------
# Helpers of the store
# ---------------------------------------------------------------------------------------------
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
