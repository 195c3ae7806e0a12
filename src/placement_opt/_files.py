"""Writing the user's files so that a failure never leaves half of one: a new file is written beside the
old one and renamed over it (``os.replace``, atomic on POSIX and Windows within one file system), so a
reader, or the user after a full disk or a crash, finds the old file or the new one, never a torn one.
Each writer (process and thread) has its own temporary file; one left by a writer that was killed is removed
by the next write of the same file."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import xxhash

__all__ = ["replacing", "write_text_atomic", "process_alive", "HOST_TAG", "foreign_file", "refusal", "OWN_JSON",
           "PICTURE_MARK", "foreign_picture", "OFFLOAD_MANIFEST", "offload_store_files"]

#: File name of an offload store's manifest inside its folder (:class:`placement_opt.runtime.offload.OffloadStore`).
OFFLOAD_MANIFEST = "placement_opt_offload.json"

_COUNTER = itertools.count()  # with the pid and thread: each temporary file's own name


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix, for writers that go by it) to write into; renamed over
    ``path`` when the block ends without an error, removed when it raises."""
    target = Path(os.path.realpath(path))  # through a symlink: the link stays, its target is replaced
    if target.exists() and not target.is_file():  # /dev/null, a pipe: written to, never replaced
        yield target
        return
    _remove_orphans(target)
    tmp = None
    try:
        tmp = _new_temporary(target)
        yield tmp
        if target.exists():
            shutil.copymode(target, tmp)  # the old file's permissions, not the umask's
        os.replace(tmp, target)
    except OSError as exc:  # name the caller's path: the temporary one is ours, hidden, and gone
        ours = exc.filename is None or Path(exc.filename).name.startswith(f".{target.stem}.{HOST_TAG}.")
        if ours and exc.errno is not None:
            raise type(exc)(exc.errno, exc.strerror, os.fspath(path)) from exc
        raise
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _new_temporary(target: Path) -> Path:
    """An empty file beside ``target`` that no other writer has: named by this host, process, thread and a counter,
    and created exclusively (two threads writing one path each get their own; the umask sets its permissions)."""
    while True:
        tmp = target.with_name(f".{target.stem}.{HOST_TAG}.{os.getpid()}-{threading.get_ident()}-{next(_COUNTER)}"
                               f".tmp{target.suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:  # left by an earlier process with this pid: take the next name
            continue


#: Seconds after which an unchanged temporary file is removed even when its writer may still run (another host,
#: or its process id reused): a live writer renames its file within seconds. The offload store's rule too.
STALE_TEMP_S = 3600.0


def _remove_orphans(target: Path) -> None:
    """Remove the temporary files of writers of ``target`` that died before renaming them (killed mid-write):
    only names this module gives, whose process no longer runs on this host, or unchanged for
    :data:`STALE_TEMP_S`. POSIX only (on Windows, ``os.kill(pid, 0)`` would end the process, not probe it)."""
    if os.name != "posix":
        return
    pattern = re.compile(rf"\.{re.escape(target.stem)}\.([0-9a-f]{{8}})\.(\d+)-\d+-\d+\.tmp{re.escape(target.suffix)}")
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            match = pattern.fullmatch(entry.name)
            if match is None:
                continue
            gone = match.group(1) == HOST_TAG and not process_alive(int(match.group(2)))
            if gone or now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_S:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _process_ids_tag() -> str:
    """8 hex digits naming this host and process-id namespace: whose process ids a temporary name holds.

    Containers sharing a volume may share a host name but not their process ids.
    """
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # pragma: no cover - not Linux
        namespace = 0
    return xxhash.xxh32_hexdigest(f"{socket.gethostname()}:{namespace}".encode())


HOST_TAG = _process_ids_tag()


def process_alive(pid: int) -> bool:
    """True when process ``pid`` exists on this host and is not a zombie (a killed writer not yet reaped)."""
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


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, replacing any file there only once all of it is written."""
    with replacing(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            if stat.S_ISREG(os.fstat(fh.fileno()).st_mode):  # a pipe or a device cannot be synced
                os.fsync(fh.fileno())


#: What each kind of JSON file placement_opt writes looks like, read back: a file at an output path that is none
#: of them is the user's (a checkpoint's config.json, a plan given where a profile goes) and is never written over.
OWN_JSON: dict[str, Callable[[Any], bool]] = {
    "plan": lambda d: isinstance(d, dict) and "schema_version" in d and "placements" in d,
    "pipeline plan": lambda d: isinstance(d, dict) and "stages" in d and "schedule" in d,
    "profile": lambda d: isinstance(d, dict) and "schema_version" in d and ("measurements" in d or "calibration" in d),
    "comparison": lambda d: isinstance(d, list) and all(isinstance(r, dict) and "strategy" in r for r in d),
    "run's figures": lambda d: isinstance(d, dict) and "measured" in d and "rows" in d,
}

#: Larger than any file placement_opt writes as JSON: such a file is not read to find out.
_OWN_JSON_MAX_BYTES = 256 * 2**20


def loads_json(text: str | bytes) -> Any:
    """``json.loads`` of a file's text that fails only as malformed JSON does, with ``json.JSONDecodeError`` (a
    ValueError): nesting deeper than Python's stack (``[[[[...``) raised RecursionError, and an integer of more
    digits than Python converts (4,300) a plain ValueError, past the readers of plans, profiles and caches. A UTF-8
    byte order mark, which some Windows editors write, is skipped. Bytes that are not UTF-8 still raise
    UnicodeDecodeError."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    text = text.removeprefix("\ufeff")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested deeper than Python reads", text, 0) from None
    except ValueError as exc:
        raise json.JSONDecodeError(str(exc), text, 0) from None


def foreign_file(path: str | os.PathLike[str], kind: str) -> str | None:
    """Why ``path`` must not be written over by a ``kind`` file (a key of :data:`OWN_JSON`), or None where it may: it
    is absent, not a regular file (``/dev/null``), empty, or a JSON file of that kind (an earlier result)."""
    target = Path(os.path.realpath(path))
    try:
        if not target.is_file() or (size := target.stat().st_size) == 0:
            return None
        if size > _OWN_JSON_MAX_BYTES:
            return f"a {size} byte file"
        data = loads_json(target.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return "a file that is not JSON"
    return None if OWN_JSON[kind](data) else f"a JSON file that is not a {kind} placement_opt wrote"


#: Written into every picture placement_opt draws (a PNG's ``Software`` text, an SVG's ``Creator``, an HTML page's
#: ``generator``), near its start: a picture at an output path without it is the user's and is never written over.
PICTURE_MARK = "placement_opt picture"
#: How far into a picture the mark is looked for (matplotlib writes both metadata before the image data).
_PICTURE_MARK_WITHIN = 64 * 2**10


def foreign_picture(path: str | os.PathLike[str]) -> str | None:
    """Why the picture at ``path`` must not be written over, or None where it may: absent, not a regular file,
    empty, or one that placement_opt drew (it carries :data:`PICTURE_MARK`)."""
    target = Path(os.path.realpath(path))
    try:
        if not target.is_file() or target.stat().st_size == 0:
            return None
        with open(target, "rb") as fh:
            head = fh.read(_PICTURE_MARK_WITHIN)
    except OSError as exc:
        return f"a file that cannot be read ({exc.strerror or exc})"
    return None if PICTURE_MARK.encode() in head else "a file placement_opt did not draw"


def refusal(path: str | os.PathLike[str], kind: str, what: str) -> str:
    """The message of a write refused by :func:`foreign_file` or :func:`foreign_picture` (``what``: its answer)."""
    return (f"{os.fspath(path)} is {what}: placement_opt writes a {kind} only over an earlier one, never over another "
            f"file; name another path, or move that file away first")


def offload_store_files(folder: Path) -> set[str]:
    """Names of the files the offload store's manifest in ``folder`` lists (none where there is none, or it cannot
    be read): a folder used as an ``offload_dir`` holds safetensors files of the checkpoint's tensor names (other
    weights, or casts of these), which a checkpoint read as every ``*.safetensors`` of its folder must skip."""
    try:
        files = loads_json((folder / OFFLOAD_MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {name for name in files if isinstance(name, str)} if isinstance(files, dict) else set()
