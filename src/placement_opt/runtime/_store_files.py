"""The offload store's file mechanics: the lock, checking files, temporary files and their owners, links.

Everything here works on files of an offload directory; :mod:`.offload` holds the manifest and the
write path. Here are the directory's lock, the hash of a file and the checks this process
remembers (by size, inode, mtime and ctime), the temporary names writers use and whose they are
(host and process), the removal of temporaries whose writer is gone, the next free file name,
linking a file to its name without replacing another, and making renames durable. The constants
below are public through :mod:`placement_opt.runtime.offload`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import xxhash

from .._files import HOST_TAG, OFFLOAD_MANIFEST, process_alive
from ..errors import DispatchError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: threads of one process still exclude each other
    fcntl = None  # type: ignore[assignment]

__all__ = ["MANIFEST_NAME", "HASH_NAME", "STALE_TEMP_S", "locked", "file_problem",
           "remove_stale_temporaries", "free_name"]

#: File name of the store's manifest inside the offload directory.
MANIFEST_NAME = OFFLOAD_MANIFEST
#: The hash of fingerprints and file checks: xxh3-128 (xxhash), about 17 GB/s on one core, where
#: SHA-256 reaches 1.5 GB/s and BLAKE2b 0.8 GB/s. It guards against accidents (crashes, damage,
#: concurrent writers), not against someone who can write into the directory anyway.
HASH_NAME = "xxh3_128"
#: Seconds after which an unchanged temporary file is removed even when its writer may still run
#: (another host, or its process id reused): a live writer renames its file within seconds.
STALE_TEMP_S = 3600.0
_CHUNK_BYTES = 16 * 1024 * 1024
_NAME_TRIES = 100


_HOST = HOST_TAG  # whose process ids a temporary name holds (shared with placement_opt._files)


def _stamp(st: os.stat_result) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(file identity, what changes when its bytes change) of a stat result."""
    return (st.st_dev, st.st_ino), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


#: Files this process has checked: (device, inode) -> ((size, mtime, ctime), algorithm, hash).
_CHECKED: dict[tuple[int, int], tuple[Any, ...]] = {}
_CHECKED_LOCK = threading.Lock()
_THREADS_LOCK = threading.Lock()  # stands in for flock where there is none
#: What a write into a directory this process may only read fails with.
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _checked_get(key: tuple[int, int]) -> tuple[Any, ...] | None:
    with _CHECKED_LOCK:
        return _CHECKED.get(key)


def _checked_put(key: tuple[int, int], stamp: tuple[int, int, int], algorithm: str, expected: str) -> None:
    with _CHECKED_LOCK:
        _CHECKED[key] = (stamp, algorithm, expected)


@contextlib.contextmanager
def locked(lock_path: Path, *, reading: bool = False) -> Iterator[None]:
    """Hold the exclusive lock of the directory of ``lock_path`` (every thread and process using it waits).

    Each call opens the lock file anew: ``flock`` locks belong to an open file description,
    so two threads of one process exclude each other just as two processes do.

    ``reading``: the holder only reads the manifest. Where this process cannot write (a read-only
    directory or file system), the lock file is opened for reading (``flock`` needs no write access),
    and without one the holder goes on unlocked: the manifest is only ever replaced whole
    (``os.replace``), so a reader sees one version or the next, never a mix.
    """
    fd = _lock_file(lock_path, reading)
    if fd is None:
        yield
        return
    try:
        with _THREADS_LOCK if fcntl is None else contextlib.nullcontext():
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
    finally:
        os.close(fd)  # releases the lock; so does the kernel when a holder is killed


def _lock_file(lock_path: Path, reading: bool) -> int | None:
    """The lock file's descriptor (created when missing); None for a reader that can neither create nor open it."""
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        if not reading or exc.errno not in _NOT_WRITABLE:
            raise
    try:
        return os.open(lock_path, os.O_RDONLY)
    except (FileNotFoundError, PermissionError):  # missing, or another user's lock file it may not read
        return None


def file_problem(path: Path, entry: Mapping[str, Any], *, remembered: bool = True) -> str | None:
    """None when the listed file at ``path`` holds the bytes it was written with, else what differs.

    ``entry`` is its manifest entry (size and fingerprint). ``remembered``: trust an earlier check
    of this process when the file's size, inode, mtime and ctime are unchanged (ctime cannot be
    set back by a program, unlike mtime).
    """
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


def remove_stale_temporaries(directory: Path) -> list[str]:
    """Delete the temporary files in ``directory`` of writers that are gone (call with the lock held).

    A temporary file is its writer's until the writer renames it, so one is removed only
    when its writer cannot come back for it: its process no longer runs on this host, or the
    file has not changed for :data:`STALE_TEMP_S` (a writer on another host, or a process id
    reused since). Only names the store gives its temporary files are considered.
    """
    removed = []
    now = time.time()
    with os.scandir(directory) as entries:
        for item in entries:
            owner = _temporary_owner(item.name)
            if owner is None:
                continue
            host, pid = owner
            try:
                age = now - item.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            gone = host == _HOST and not process_alive(pid)
            if gone or age > STALE_TEMP_S:
                _remove(Path(item.path))
                removed.append(item.name)
    return removed


def _hash_file(fh: Any, algorithm: str) -> str:
    digest = xxhash.xxh3_128() if algorithm == HASH_NAME else hashlib.sha256()
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    while count := fh.readinto(view):
        digest.update(view[:count])
    return digest.hexdigest()


def free_name(directory: Path, manifest: Mapping[str, Any], base: str, unit: str) -> str:
    """``base`` (the file name of ``unit``), or the next free one when a file the store did not write has it.

    A name the manifest lists for other weights is skipped too (only a damaged manifest or a
    fingerprint collision could do that): the store never writes over a file it cannot
    prove holds these weights.
    """
    stem = base.removesuffix(".safetensors")
    foreign = []
    for i in range(_NAME_TRIES):
        name = base if i == 0 else f"{stem}.{i}.safetensors"
        if name in manifest:
            continue
        if os.path.lexists(directory / name):
            foreign.append(name)
            continue
        if foreign:
            warnings.warn(f"{', '.join(foreign)} in {directory} not written by placement_opt: left as "
                          f"it is; unit {unit!r} is stored in {name}", RuntimeWarning, stacklevel=4)
        return name
    raise DispatchError(
        f"{directory} holds {_NAME_TRIES} files named like {base} that this store cannot use "
        f"({len(foreign)} not written by placement_opt): it does not overwrite them. Use another "
        f"offload_dir or remove them yourself"
    )


def _temporary_name(target: str) -> str:
    """A hidden name beside ``target`` that no other writer can pick: host, process, thread, random."""
    return (f".{target}.{_HOST}.{os.getpid()}.{threading.get_native_id()}.{secrets.token_hex(4)}.tmp")


_TEMPORARY = re.compile(r"\.(?P<target>.+)\.(?P<host>[0-9a-f]{8})\.(?P<pid>\d+)\.\d+\.[0-9a-f]{8}\.tmp")


def _temporary_owner(name: str) -> tuple[str | None, int] | None:
    """(host tag, process id) of a temporary name the store gives, else None. The names of placement_opt before
    issue 17 (``.<target>.<pid>.tmp``) are not considered: other tools' atomic writes use that shape too, and a
    file the store cannot prove its own is never removed (a crashed old writer's leftover stays, hidden)."""
    match = _TEMPORARY.fullmatch(name)
    if match and (match["target"].endswith(".safetensors") or match["target"] == MANIFEST_NAME):
        return match["host"], int(match["pid"])
    return None


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
