"""An offload store on a read-only mount: its intact files are used as they are, nothing else is written.

A read-only directory is made for real: a private mount namespace (``unshare -m``) bind-mounts the store read-only
for one child process, so the mount vanishes with it. Where that is not allowed (no root, no ``unshare``), the
test is skipped, and a chmod-ed directory stands in when the tests do not run as root.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from placement_opt.runtime.offload import LOCK_NAME, MANIFEST_NAME, OffloadStore

# Runs in the child, the store read-only at argv[1]; prints what it found as JSON.
_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from placement_opt.errors import DispatchError
    from placement_opt.runtime.offload import OffloadStore

    torch.manual_seed(0)
    weights = {"w": torch.randn(16, 8), "b": torch.randn(8).half()}
    store = OffloadStore(sys.argv[1])
    path = store.write("model.layers.0", weights)          # listed and intact: used, nothing written
    back = store.open("model.layers.0").tensors()
    store.verify()
    try:
        store.write("model.layers.1", {"w": torch.ones(4)})  # not there, and cannot be written
        refused = ""
    except DispatchError as exc:
        refused = str(exc)
    print(json.dumps({"writable": store.writable, "path": str(path),
                      "equal": all(torch.equal(back[k], v) for k, v in weights.items()), "refused": refused}))
""")


def _prepare(folder) -> list[str]:
    """A store with one unit (the child's weights), written normally; the directory's names."""
    torch.manual_seed(0)
    OffloadStore(folder).write("model.layers.0", {"w": torch.randn(16, 8), "b": torch.randn(8).half()})
    return sorted(os.listdir(folder))


def _check(found: dict, folder, names_before: list[str], seen_at=None) -> None:
    """``found``: the child's report on the store it read at ``seen_at`` (default ``folder``, where it lies)."""
    assert found["writable"] is False
    assert found["equal"] and found["path"].startswith(str(seen_at or folder))
    assert "read-only" in found["refused"] and "model.layers.1" in found["refused"]
    assert sorted(os.listdir(folder)) == names_before  # nothing created, nothing removed
    assert set(json.loads((folder / MANIFEST_NAME).read_text())["files"]) == {
        n for n in names_before if n.endswith(".safetensors")}


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ})


@pytest.mark.parametrize("with_lock_file", [True, False], ids=["lock file", "no lock file"])
def test_a_read_only_mount_of_a_prepared_store_serves_its_files(tmp_path, with_lock_file):
    if shutil.which("unshare") is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root and unshare to mount a directory read-only for one child process")
    source, mounted = tmp_path / "store", tmp_path / "ro"
    mounted.mkdir()
    names = _prepare(source)
    if not with_lock_file:  # a store copied onto read-only media need not carry its lock file
        os.remove(source / LOCK_NAME)
        names.remove(LOCK_NAME)
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    shell = (f"mount --bind {source} {mounted} && mount -o remount,ro,bind {mounted} && "
             f"{sys.executable} {script} {mounted}")
    probe = _run(["unshare", "-m", "sh", "-c", f"mount --bind {source} {mounted} && mount -o remount,ro,bind {mounted}"])
    if probe.returncode != 0:
        pytest.skip(f"this sandbox refuses a private read-only mount: {probe.stderr.strip()[:200]}")
    done = _run(["unshare", "-m", "sh", "-c", shell])
    assert done.returncode == 0, done.stderr
    _check(json.loads(done.stdout.strip().splitlines()[-1]), source, names, seen_at=mounted)


def test_a_store_without_write_permission_serves_its_files(tmp_path):
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        pytest.skip("root writes whatever the permissions say")
    folder = tmp_path / "store"
    names = _prepare(folder)
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    folder.chmod(0o555)
    try:
        done = _run([sys.executable, str(script), str(folder)])
    finally:
        folder.chmod(0o755)
    assert done.returncode == 0, done.stderr
    _check(json.loads(done.stdout.strip().splitlines()[-1]), folder, names)


def test_a_reader_that_may_not_open_the_lock_file_reads_without_it(tmp_path, monkeypatch):
    """A store written by another user under umask 077 leaves a lock file this one may neither write nor read: a
    reader goes on without the lock (the manifest is replaced whole, so it still reads one version), where it
    raised a bare PermissionError; a writer still gets the error, since it may not write unlocked."""
    import errno

    from placement_opt.runtime import _store_files

    lock = tmp_path / LOCK_NAME
    lock.write_bytes(b"")
    real_open = os.open

    def refused(path, flags, *args):
        if os.fspath(path) == os.fspath(lock):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(_store_files.os, "open", refused)
    assert _store_files._lock_file(lock, reading=True) is None
    with pytest.raises(PermissionError):
        _store_files._lock_file(lock, reading=False)
