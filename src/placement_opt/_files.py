"""Writing the user's files so that a failure never leaves half of one: a new file is written beside the
old one and renamed over it (``os.replace``, atomic on POSIX and Windows within one file system), so a
reader, or the user after a full disk or a crash, finds the old file or the new one, never a torn one."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = ["replacing", "write_text_atomic"]


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix, for writers that go by it) to write into; renamed over
    ``path`` when the block ends without an error, removed when it raises."""
    target = Path(os.path.realpath(path))  # through a symlink: the link stays, its target is replaced
    if target.exists() and not target.is_file():  # /dev/null, a pipe: written to, never replaced
        yield target
        return
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.tmp{target.suffix}")
    try:
        yield tmp
        if target.exists():
            shutil.copymode(target, tmp)  # the old file's permissions, not the umask's
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path``, replacing any file there only once all of it is written."""
    with replacing(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            if stat.S_ISREG(os.fstat(fh.fileno()).st_mode):  # a pipe or a device cannot be synced
                os.fsync(fh.fileno())
