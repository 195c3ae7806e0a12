"""Writing the user's files so that a failure never leaves half of one: a new file is written beside the
old one and renamed over it (``os.replace``, atomic on POSIX and Windows within one file system), so a
reader, or the user after a full disk or a crash, finds the old file or the new one, never a torn one.
Each writer (process and thread) has its own temporary file; one left by a writer that was killed is removed
by the next write of the same file."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["replacing", "write_text_atomic"]

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
    tmp = _new_temporary(target)
    try:
        yield tmp
        if target.exists():
            shutil.copymode(target, tmp)  # the old file's permissions, not the umask's
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _new_temporary(target: Path) -> Path:
    """An empty file beside ``target`` that no other writer has: named by this process, thread and a counter, and
    created exclusively (two threads writing one path each get their own, the umask sets its permissions)."""
    while True:
        tmp = target.with_name(f".{target.stem}.{os.getpid()}-{threading.get_ident()}-{next(_COUNTER)}.tmp{target.suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:  # left by an earlier process with this pid: take the next name
            continue


#: A temporary file is an orphan only once it is this old: a writer on another machine sharing the directory
#: (whose process this one cannot see) has long renamed or removed its own by then.
ORPHAN_AGE_S = 600


def _remove_orphans(target: Path) -> None:
    """Remove the temporary files of writers of ``target`` that died before renaming them (killed mid-write):
    only names this module makes, at least :data:`ORPHAN_AGE_S` old, whose process no longer runs. POSIX only
    (on Windows, ``os.kill(pid, 0)`` would end the process, not probe it)."""
    if os.name != "posix":
        return
    pattern = re.compile(rf"\.{re.escape(target.stem)}\.(\d+)-\d+-\d+\.tmp{re.escape(target.suffix)}")
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            match = pattern.fullmatch(entry.name)
            if (match and entry.stat(follow_symlinks=False).st_mtime < time.time() - ORPHAN_AGE_S
                    and not _running(int(match.group(1)))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _running(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts: it may be writing)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists; anything else: do not guess
        return True
    return True


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, replacing any file there only once all of it is written."""
    with replacing(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            if stat.S_ISREG(os.fstat(fh.fileno()).st_mode):  # a pipe or a device cannot be synced
                os.fsync(fh.fileno())
