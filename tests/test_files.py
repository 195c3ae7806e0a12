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
    target.write_text("the old plan", encoding="utf-8")

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        report_plan().to_json(target)
    assert target.read_text(encoding="utf-8") == "the old plan"
    assert os.listdir(tmp_path) == ["plan.json"]


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
