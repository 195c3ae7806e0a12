"""The offload store under faults: damaged and truncated files, foreign files, writers killed mid-write.

After every fault, the next dispatch must compute with the model's own weights (bitwise), leave
every file the store did not write as it was (bytes and mtime), and leave no temporary file
once a store has been opened on the directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _offload_helpers import (
    assert_same_tensors,
    disk_plan,
    input_ids,
    snapshot,
    tiny_llama,
    units_of,
    write_and_pause_child,
)
from placement_opt.errors import DispatchError
from placement_opt.model.graph import covering_key
from placement_opt.runtime.checkpoint import collect_slots
from placement_opt.runtime.dispatcher import dispatch
from placement_opt.runtime.offload import (
    LOCK_NAME,
    MANIFEST_NAME,
    WRITE_POINTS,
    OffloadStore,
    fingerprint,
)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
class Model:
    """A tiny Llama with its original weights and plain-model logits, to check dispatches against."""

    def __init__(self, seed: int) -> None:
        self.module = tiny_llama(seed)
        self.seed = seed
        self.original = snapshot(self.module)
        with torch.no_grad():
            self.reference = self.module(input_ids=input_ids()).logits

    def unit_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """What dispatch gives OffloadStore.write for each unit: {unit: {first name: tensor}}."""
        units = units_of(self.module)
        per_unit: dict[str, dict[str, torch.Tensor]] = {}
        for slot in collect_slots(self.module):
            per_unit.setdefault(covering_key(slot.names[0], units), {})[slot.names[0]] = slot.tensor.data
        return per_unit

    def file_name(self, unit: str) -> str:
        return OffloadStore.file_name(unit, fingerprint(self.unit_tensors()[unit]))

    def check_dispatch(self, directory: Path) -> None:
        """Dispatch into ``directory``: weights, logits and weights after remove() are the model's own."""
        handle = dispatch(self.module, disk_plan(self.module), offload_dir=directory)
        try:
            assert_same_tensors(self.module, self.original, f"seed {self.seed}, dispatched")
            with torch.no_grad():
                logits = handle(input_ids=input_ids()).logits
        finally:
            handle.remove()
        assert torch.equal(logits, self.reference), f"seed {self.seed}: logits differ from the plain model's"
        assert_same_tensors(self.module, self.original, f"seed {self.seed}, after remove()")


def temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def foreign_state(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def damage(path: Path, *, keep_mtime: bool) -> None:
    """Overwrite 4 KiB in the middle of the file in place (same size, same inode)."""
    stat = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(stat.st_size // 2)
        fh.write(os.urandom(min(4096, stat.st_size // 2)))
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size


# Built anew for every test (0.1 s): a failed check may leave a model with wrong weights.
@pytest.fixture
def model_a() -> Model:
    return Model(31)


@pytest.fixture
def model_b() -> Model:
    return Model(32)


# ---------------------------------------------------------------------------------------------
# Damaged, truncated and foreign files
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep_mtime", [False, True], ids=["mtime-changed", "mtime-restored"])
def test_a_damaged_file_of_the_right_size_is_rewritten_from_the_weights(tmp_path, model_a, keep_mtime):
    model_a.check_dispatch(tmp_path)
    path = tmp_path / model_a.file_name("model.layers.1")
    before = path.read_bytes()
    damage(path, keep_mtime=keep_mtime)  # after this process checked it: its cached check must not hide this
    with pytest.raises(DispatchError, match=r"model.layers.1.* same size, different bytes"):
        OffloadStore(tmp_path).verify()
    model_a.check_dispatch(tmp_path)
    assert path.read_bytes() == before  # rewritten in place of the damaged file
    OffloadStore(tmp_path).verify()


def test_a_truncated_file_is_rewritten_from_the_weights(tmp_path, model_a):
    model_a.check_dispatch(tmp_path)
    path = tmp_path / model_a.file_name("lm_head")
    before = path.read_bytes()
    os.truncate(path, len(before) - 1000)
    model_a.check_dispatch(tmp_path)
    assert path.read_bytes() == before
    path.unlink()  # deleted: written again, and no stale manifest entry remains
    model_a.check_dispatch(tmp_path)
    assert path.read_bytes() == before


def test_a_damaged_file_is_refused_when_there_are_no_weights_to_rewrite_it(tmp_path, model_a):
    tensors = model_a.unit_tensors()["model.layers.0"]
    store = OffloadStore(tmp_path)
    path = store.write("model.layers.0", tensors)
    assert torch.equal(store.open("model.layers.0").tensors()["model.layers.0.mlp.up_proj.weight"],
                       model_a.original["model.layers.0.mlp.up_proj.weight"])
    damage(path, keep_mtime=True)
    with pytest.raises(DispatchError) as err:
        OffloadStore(tmp_path).open("model.layers.0")
    message = str(err.value)
    assert path.name in message and "same size, different bytes" in message and "dispatch the model again" in message
    os.truncate(path, 100)
    with pytest.raises(DispatchError, match=r"100 bytes on disk, \d+ written \(truncated"):
        store.open("model.layers.0")


def test_a_foreign_file_with_the_stores_name_is_never_touched(tmp_path, model_a, model_b):
    tmp_path.mkdir(exist_ok=True)
    clash = tmp_path / model_a.file_name("model.layers.0")
    clash.write_bytes(os.urandom(5000))
    old_style = tmp_path / "model.layers.0.safetensors"  # the name placement_opt used before issue 17
    old_style.write_bytes(b"user data")
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    foreign = {p: foreign_state(p) for p in (clash, old_style, other)}
    time.sleep(0.01)
    with pytest.warns(RuntimeWarning, match="not written by placement_opt"):
        model_a.check_dispatch(tmp_path)
    model_b.check_dispatch(tmp_path)
    model_a.check_dispatch(tmp_path)  # the unit's file under the next name is reused
    OffloadStore(tmp_path).verify()
    assert {p: foreign_state(p) for p in foreign} == foreign
    assert (tmp_path / clash.name.replace(".safetensors", ".1.safetensors")).exists()


def test_a_manifest_naming_files_outside_the_directory_is_refused(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(
        '{"version": 2, "files": {"../x.safetensors": {"unit": "u", "size_bytes": 1, "fingerprint": "%s"}}}'
        % ("0" * 32))
    with pytest.raises(DispatchError, match="not a placement_opt manifest.*not a safetensors file name"):
        OffloadStore(tmp_path)


def test_a_directory_that_cannot_be_created_is_one_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DispatchError, match="cannot be used.*NotADirectoryError.*offload_dir you can"):
        OffloadStore(tmp_path / "file" / "offload")


def test_temporary_files_of_dead_writers_go_and_of_live_writers_stay(tmp_path):
    from placement_opt.runtime import offload

    OffloadStore(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)  # exited and reaped: no such process now
    host = offload._HOST
    live = tmp_path / f".u.{'0' * 32}.safetensors.{host}.{os.getpid()}.1.0123abcd.tmp"
    gone = tmp_path / f".u.{'0' * 32}.safetensors.{host}.{dead_pid}.1.0123abcd.tmp"
    # placement_opt's names before issue 17, which other tools' atomic writes share: never provably ours
    old_format = tmp_path / f".model.layers.0.safetensors.{dead_pid}.tmp"
    elsewhere = tmp_path / f".u.{'0' * 32}.safetensors.ffffffff.{dead_pid}.1.0123abcd.tmp"  # another host
    not_ours = tmp_path / f".notes.txt.{dead_pid}.tmp"
    for path in (live, gone, old_format, elsewhere, not_ours):
        path.write_bytes(b"partial")
    OffloadStore(tmp_path)
    assert temporaries(tmp_path) == sorted([live.name, old_format.name, elsewhere.name, not_ours.name])
    old = time.time() - offload.STALE_TEMP_S - 60
    os.utime(elsewhere, (old, old))  # another host's: removed once older than STALE_TEMP_S
    OffloadStore(tmp_path)
    assert temporaries(tmp_path) == sorted([live.name, old_format.name, not_ours.name])


# ---------------------------------------------------------------------------------------------
# Writers killed with SIGKILL at every point of the write path
# ---------------------------------------------------------------------------------------------
PAUSED_UNIT = "model.layers.1"
"""The child writes model.embed_tokens, model.layers.0, then is killed while writing this unit."""
HOLDS_LOCK = WRITE_POINTS[WRITE_POINTS.index("locked"):]


def lock_is_free(directory: Path) -> bool:
    fd = os.open(directory / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def killed_writers(tmp_path_factory):
    """One directory per write point, whose writer was killed there with SIGKILL.

    Each directory first holds a foreign file carrying the name model A's ``model.layers.0``
    file would get. Each writer is its own process, forked from a forkserver that imported torch and
    the offload store once (a fresh interpreter per writer took 20 s for the twelve on two cores).
    Returns {point: (directory, foreign file, its (sha256, mtime) before, temporaries seen)}.
    """
    model_a = Model(31)
    tensors = tmp_path_factory.mktemp("tensors") / "units.pt"
    units = model_a.unit_tensors()
    torch.save({u: units[u] for u in ("model.embed_tokens", "model.layers.0", PAUSED_UNIT, "lm_head")}, tensors)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "placement_opt.runtime.offload", "_offload_helpers"])
    runs = {}
    for point in WRITE_POINTS:
        directory = tmp_path_factory.mktemp(f"killed-at-{point}")
        foreign = directory / model_a.file_name("model.layers.0")
        foreign.write_bytes(os.urandom(3000))
        heard, told = context.Pipe(duplex=False)
        child = context.Process(target=write_and_pause_child,
                                args=(str(directory), str(tensors), point, f"{PAUSED_UNIT}.", told))
        child.start()
        told.close()
        runs[point] = (directory, foreign, foreign_state(foreign), child, heard)
    results = {}
    try:
        for point, (directory, foreign, state, child, heard) in runs.items():
            said = heard.recv() if heard.poll(120) else "(nothing within 120 s)"
            assert said == point, f"the writer did not stop at {point!r}: {said}"
            seen = temporaries(directory)
            if point in HOLDS_LOCK:  # the paused writer holds the lock
                assert not lock_is_free(directory)
            else:  # opening a store now must leave the live writer's temporary file alone
                OffloadStore(directory)
                assert temporaries(directory) == seen
            child.kill()
            child.join(timeout=30)
            assert child.exitcode == -signal.SIGKILL
            results[point] = (directory, foreign, state, seen)
    finally:
        for *_, child, heard in runs.values():
            if child.exitcode is None:
                child.kill()
                child.join()
            heard.close()
    return results


def test_the_write_path_has_at_least_ten_points():
    assert len(WRITE_POINTS) >= 10 and len(set(WRITE_POINTS)) == len(WRITE_POINTS)


@pytest.mark.parametrize("point", WRITE_POINTS)
def test_a_writer_killed_at_any_point_leaves_nothing_wrong(killed_writers, model_a, model_b, point):
    directory, foreign, state, seen = killed_writers[point]
    writing = WRITE_POINTS.index("temp-created") <= WRITE_POINTS.index(point) < WRITE_POINTS.index("committed")
    assert bool(seen) == writing, seen  # the kill left a temporary file exactly while one existed
    assert lock_is_free(directory)  # the kernel released the dead writer's lock
    store = OffloadStore(directory)
    assert temporaries(directory) == []
    assert all((directory / name).exists() for name in store.manifest)
    store.verify()
    model_a.check_dispatch(directory)  # the same weights: committed files reused, the rest written
    model_b.check_dispatch(directory)  # other weights under the same unit names: never model A's
    store = OffloadStore(directory)
    store.verify()
    units = [entry["unit"] for entry in store.manifest.values()]
    assert units.count(PAUSED_UNIT) == 2  # one file per model, whatever the crash left
    assert foreign_state(foreign) == state
    assert temporaries(directory) == []
    names = {p.name for p in directory.iterdir()}
    assert names == set(store.manifest) | {foreign.name, MANIFEST_NAME, LOCK_NAME}
