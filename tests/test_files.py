"""The user's files are replaced whole or not at all: plans, profiles, pictures, JSON results."""

from __future__ import annotations

import errno
import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _plans import report_plan
from placement_opt._files import replacing, write_text_atomic
from placement_opt.plan import Plan


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(old=st.text(max_size=200), new=st.text(max_size=200))
def test_a_write_replaces_the_file_with_exactly_the_new_text(tmp_path, old, new):
    target = tmp_path / "out.txt"
    target.write_bytes(old.encode("utf-8"))
    write_text_atomic(target, new)
    assert target.read_bytes() == new.encode("utf-8").replace(b"\n", os.linesep.encode())
    assert os.listdir(tmp_path) == ["out.txt"]


def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    old = '{"schema_version": 1, "placements": [], "the old plan": true}'  # a plan: another kind is never written over
    target.write_text(old, encoding="utf-8")

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        report_plan().to_json(target)
    assert target.read_text(encoding="utf-8") == old
    assert os.listdir(tmp_path) == ["plan.json"]


def test_a_write_that_fails_names_the_callers_path_not_the_temporary_one(tmp_path, monkeypatch):
    """The error named the hidden temporary file (``.plan.<host>.<pid>-...tmp.json``), which is gone by then."""
    with pytest.raises(FileNotFoundError) as err:
        report_plan().to_json(tmp_path / "missing" / "plan.json")
    assert err.value.filename == str(tmp_path / "missing" / "plan.json")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError, match=r"No space left on device: '.*plan.json'") as err:
        report_plan().to_json(tmp_path / "plan.json")
    assert err.value.filename == str(tmp_path / "plan.json")


def test_a_block_that_raises_replaces_nothing(tmp_path):
    target = tmp_path / "strip.png"
    target.write_bytes(b"old picture")
    with pytest.raises(RuntimeError), replacing(target) as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path  # writers that go by the suffix see .png
        tmp.write_bytes(b"half a pict")
        raise RuntimeError("the writer failed")
    assert target.read_bytes() == b"old picture"
    assert os.listdir(tmp_path) == ["strip.png"]


def test_a_plan_written_over_another_reads_back_as_the_new_one(tmp_path):
    target = tmp_path / "plan.json"
    report_plan(total_s=9.0).to_json(target)
    plan = report_plan(total_s=2.0)
    plan.to_json(str(target))
    assert Plan.from_json(target).to_dict() == plan.to_dict()


def test_a_file_behind_a_symlink_is_replaced_and_the_link_and_permissions_stay(tmp_path):
    real = tmp_path / "plans" / "real.json"
    real.parent.mkdir()
    real.write_text("old", encoding="utf-8")
    real.chmod(0o640)
    link = tmp_path / "plan.json"
    link.symlink_to(real)
    write_text_atomic(link, "new")
    assert link.is_symlink() and real.read_text(encoding="utf-8") == "new"
    assert real.stat().st_mode & 0o777 == 0o640


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_path_that_is_no_regular_file_is_written_to_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text(encoding="utf-8")))
    reader.start()
    write_text_atomic(fifo, "through the pipe")
    reader.join(timeout=10)
    assert got == ["through the pipe"]
    assert fifo.is_fifo() and os.listdir(tmp_path) == ["pipe"]
    write_text_atomic(os.devnull, "nothing")  # /dev/null stays a device
    assert not os.path.isfile(os.devnull)


def test_threads_writing_one_path_never_tear_it(tmp_path):
    """Each writer has its own temporary file: the file read back is always one writer's text, whole."""
    target = tmp_path / "plan.json"
    texts = [f"{k}" * 20_000 for k in range(8)]
    errors: list[BaseException] = []

    def write(text: str) -> None:
        try:
            for _ in range(20):
                write_text_atomic(target, text)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert target.read_text(encoding="utf-8") in texts
    assert os.listdir(tmp_path) == ["plan.json"]


@pytest.mark.skipif(os.name != "posix", reason="orphans are found by probing pids (POSIX)")
def test_the_temporary_file_of_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    import subprocess
    import sys
    import time

    from placement_opt import _files

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid, host = int(dead.stdout), _files.HOST_TAG
    orphan = tmp_path / f".plan.{host}.{pid}-1-0.tmp.json"  # what a writer killed mid-write leaves
    live = tmp_path / f".plan.{host}.{os.getppid()}-1-0.tmp.json"  # a running process's: it may still be writing
    elsewhere = tmp_path / f".plan.0badcafe.{pid}-1-0.tmp.json"  # another host's: its pids are not ours to probe
    stale = tmp_path / f".plan.0badcafe.{pid}-1-1.tmp.json"  # ... unless unchanged for an hour
    other = tmp_path / f".other.{host}.{pid}-1-0.tmp.json"  # another file's
    for path in (orphan, live, elsewhere, stale, other):
        path.write_text("half a plan", encoding="utf-8")
    old = time.time() - _files.STALE_TEMP_S - 60
    os.utime(stale, (old, old))
    write_text_atomic(tmp_path / "plan.json", "a plan")
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in (live, elsewhere, other, tmp_path / "plan.json"))
