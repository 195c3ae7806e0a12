"""The offload store and safetensors memory maps: atomic writes, checksums, zero-copy reads."""

from __future__ import annotations

import json
import mmap
import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from placement_opt.errors import DispatchError
from placement_opt.runtime.offload import (
    LOCK_NAME,
    MANIFEST_NAME,
    OffloadStore,
    SafetensorsFile,
    fingerprint,
)


def _weights() -> dict[str, torch.Tensor]:
    # 16x8 fp32 = 512 bytes, 8 fp16 = 16 bytes, 3 int64 = 24 bytes, 4 bf16 = 8 bytes
    return {"w": torch.randn(16, 8), "b": torch.randn(8).half(), "idx": torch.arange(3),
            "bf": torch.randn(4).to(torch.bfloat16)}


def test_write_then_read_back_bitwise(tmp_path):
    store = OffloadStore(tmp_path)
    weights = _weights()
    path = store.write("model.layers.0", weights)
    assert path.name == f"model.layers.0.{fingerprint(weights)}.safetensors"
    read = SafetensorsFile(path).tensors()
    assert read.keys() == weights.keys()
    for key, value in weights.items():
        assert read[key].dtype == value.dtype
        assert torch.equal(read[key], value)


def test_files_are_safetensors_files_the_library_reads(tmp_path):
    from safetensors.torch import load_file

    weights = _weights()
    read = load_file(OffloadStore(tmp_path).write("u", weights))
    assert read.keys() == weights.keys()
    assert all(torch.equal(read[key], value) for key, value in weights.items())


def test_manifest_lists_size_and_fingerprint(tmp_path):
    import xxhash

    store = OffloadStore(tmp_path)
    weights = _weights()
    path = store.write("lm_head", weights)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert manifest["version"] == 2 and manifest["hash"] == "xxh3_128"
    entry = manifest["files"][path.name]
    assert entry["size_bytes"] == path.stat().st_size
    assert entry["fingerprint"] == xxhash.xxh3_128(path.read_bytes()).hexdigest() == fingerprint(weights)
    assert entry["unit"] == "lm_head"
    OffloadStore(tmp_path).verify()  # a fresh store reads the manifest back


def test_verify_names_a_corrupted_file(tmp_path):
    store = OffloadStore(tmp_path)
    path = store.write("u", _weights())
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DispatchError, match=r"u\.[0-9a-f]{32}\.safetensors: its xxh3_128 hash .* same size"):
        store.verify()
    path.write_bytes(bytes(data[:-4]))
    with pytest.raises(DispatchError, match="bytes on disk"):
        store.verify()


def test_never_overwrites_a_foreign_file_with_its_name(tmp_path):
    weights = _weights()
    foreign = tmp_path / OffloadStore.file_name("model.layers.0", fingerprint(weights))
    foreign.write_bytes(b"not ours")
    store = OffloadStore(tmp_path)
    with pytest.warns(RuntimeWarning, match="not written by placement_opt"):
        path = store.write("model.layers.0", weights)
    assert foreign.read_bytes() == b"not ours"
    assert path.name == foreign.name.replace(".safetensors", ".1.safetensors")
    assert torch.equal(SafetensorsFile(path).tensor("w"), weights["w"])


def test_same_weights_are_written_once(tmp_path):
    store = OffloadStore(tmp_path)
    weights = _weights()
    path = store.write("u", weights)
    first = path.stat().st_mtime_ns
    os.utime(path, ns=(first - 10**9, first - 10**9))
    OffloadStore(tmp_path).write("u", weights)
    assert path.stat().st_mtime_ns == first - 10**9  # untouched
    weights["w"] = weights["w"] + 1
    changed = store.write("u", weights)  # different bytes: another file; the first stays as it was
    assert changed != path and path.stat().st_mtime_ns == first - 10**9
    assert torch.equal(SafetensorsFile(changed).tensor("w"), weights["w"])


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    store = OffloadStore(tmp_path)

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        store.write("u", _weights())
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no partial file, no temp file


def test_tensors_are_views_of_the_mapped_file(tmp_path):
    path = OffloadStore(tmp_path).write("u", _weights())
    file = SafetensorsFile(path)
    w = file.tensor("w")
    assert w.data_ptr() == file._mapped().ctypes.data + file.spans["w"].offset_bytes
    w.add_(1)  # copy-on-write mapping: the file itself never changes
    assert torch.equal(SafetensorsFile(path).tensor("w") + 1, w)


def test_read_into_fills_a_buffer_and_checks_its_shape(tmp_path):
    weights = _weights()
    file = SafetensorsFile(OffloadStore(tmp_path).write("u", weights))
    out = torch.empty(16, 8)
    assert file.read_into("w", out) is out
    assert torch.equal(out, weights["w"])
    with pytest.raises(DispatchError, match="float32"):
        file.read_into("w", torch.empty(8, 16).half())
    file.prefetch(["w", "b"])  # advisory; must not fail
    file.close()


def test_not_a_safetensors_file(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x05")
    with pytest.raises(DispatchError, match="not a readable safetensors"):
        SafetensorsFile(bad)


def test_a_git_lfs_pointer_says_to_pull_the_weights(tmp_path):
    pointer = tmp_path / "model.safetensors"
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 4965799096\n")
    with pytest.raises(DispatchError, match="Git LFS pointer.*git lfs pull"):
        SafetensorsFile(pointer)


def test_a_header_longer_than_the_file_is_refused_without_reading_it(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(struct.pack("<Q", 2**62) + b"{}")  # a length that would ask for exabytes
    with pytest.raises(DispatchError, match=r"header claims 4611686018427387904 bytes and the file has 10"):
        SafetensorsFile(bad)


@pytest.mark.parametrize("entry, problem", [
    ({"dtype": "F32", "shape": [2]}, "KeyError"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "are no range"),
    ("F32", "TypeError"),
])
def test_a_malformed_header_is_a_dispatch_error_naming_the_file(tmp_path, entry, problem):
    header = json.dumps({"w": entry}).encode()
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(DispatchError, match=rf"x\.safetensors has a malformed safetensors header \(.*{problem}"):
        SafetensorsFile(bad)


def test_an_unknown_dtype_names_the_file_and_the_tensor(tmp_path):
    header = json.dumps({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(struct.pack("<Q", len(header)) + header + bytes(1))
    with pytest.raises(DispatchError, match=r"x\.safetensors:w has dtype Q4"):
        SafetensorsFile(bad)


def test_unit_names_become_safe_file_names():
    assert OffloadStore.file_name("", "0" * 32) == f"_root.{'0' * 32}.safetensors"
    assert OffloadStore.file_name("a/b c", "f" * 32) == f"a_b_c.{'f' * 32}.safetensors"


_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=4),
       dtypes=st.lists(st.sampled_from(range(len(_DTYPES))), min_size=4, max_size=4))
def test_round_trip_any_shapes_and_dtypes(tmp_path_factory, shapes, dtypes):
    weights = {f"t{i}": (torch.rand(shape) * 10).to(_DTYPES[dtypes[i]]) for i, shape in enumerate(shapes)}
    file = SafetensorsFile(OffloadStore(tmp_path_factory.mktemp("store")).write("u", weights))
    for key, value in weights.items():
        got = file.tensor(key)
        assert got.dtype == value.dtype and got.shape == value.shape
        assert torch.equal(got, value)
        out = torch.empty_like(value)
        assert torch.equal(file.read_into(key, out), value)


def test_prefetch_asks_the_kernel_only_for_pages_not_cached(tmp_path, monkeypatch):
    file = SafetensorsFile(OffloadStore(tmp_path).write("u", _weights()))
    file.tensor("w").sum()  # touched: its pages are in the page cache
    assert file.cached("w")
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append((offset, length)))
    file.prefetch(["w"])
    assert calls == []
    monkeypatch.setattr(SafetensorsFile, "cached", lambda self, key: False)
    file.prefetch(["w", "b"])
    assert calls == [(file.spans["w"].offset_bytes, 512), (file.spans["b"].offset_bytes, 16)]


def test_prefetch_rows_asks_for_those_rows_only(tmp_path, monkeypatch):
    """An expert group's rows of a whole weight: only their bytes are read ahead."""
    file = SafetensorsFile(OffloadStore(tmp_path).write("u", {"w": torch.zeros(8, 16)}))
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append((offset, length)))
    file.prefetch_rows("w", 2, 5)
    assert calls == [(file.spans["w"].offset_bytes + 2 * 64, 3 * 64)]  # a row: 16 float32


# ---------------------------------------------------------------------------------------------
# release(): a unit's mapped pages leave the process after it ran; written pages never do
# ---------------------------------------------------------------------------------------------
needs_pagemap = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux /proc/self/pagemap")


def _present_pages(file: SafetensorsFile, key: str) -> tuple[int, int]:
    """(present, of which private) pages wholly inside tensor ``key``, read off /proc/self/pagemap here."""
    page = mmap.PAGESIZE
    span = file.spans[key]
    base = file._mapped().ctypes.data
    start = -(-(base + span.offset_bytes) // page)
    end = (base + span.offset_bytes + span.nbytes) // page
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(start * 8)
        entries = struct.unpack(f"{end - start}Q", fh.read((end - start) * 8))
    present = [e for e in entries if e >> 63 & 1]
    return len(present), sum(1 for e in present if not e >> 61 & 1)


@needs_pagemap
def test_release_lets_the_mapped_pages_go_and_the_values_stay(tmp_path):
    weights = {"a": torch.randn(64, 1024), "b": torch.randn(3), "c": torch.randn(32, 1024)}  # 256 KiB, 128 KiB
    file = SafetensorsFile(OffloadStore(tmp_path).write("u", weights))
    views = file.tensors()
    assert all(float(v.sum()) == float(weights[k].sum()) for k, v in views.items())  # every page touched
    assert _present_pages(file, "a")[0] >= 63 and _present_pages(file, "c")[0] >= 31
    file.release(["a", "b"])
    assert _present_pages(file, "a") == (0, 0)
    assert _present_pages(file, "c")[0] >= 31  # not asked for: stays
    assert all(torch.equal(views[k], weights[k]) for k in weights)  # mapped again from the page cache


@needs_pagemap
def test_a_tensor_the_process_wrote_to_is_never_released(tmp_path):
    file = SafetensorsFile(OffloadStore(tmp_path).write("u", {"w": torch.zeros(64, 1024), "v": torch.ones(8, 1024)}))
    w, v = file.tensor("w"), file.tensor("v")
    w[40, 7] = 5.0  # copy-on-write: a private page, the only copy of this change
    float(v.sum())
    for _ in range(2):
        file.release(["w", "v"])
        assert float(w[40, 7]) == 5.0 and float(w.sum()) == 5.0
        assert _present_pages(file, "w")[1] == 1
    assert _present_pages(file, "v") == (0, 0)  # its own range: released
    OffloadStore(tmp_path).verify()  # raises if the file changed
    assert float(SafetensorsFile(file.path).tensor("w").sum()) == 0.0


@settings(max_examples=200, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(0, 3 * 4096), min_size=1, max_size=6),
       gaps=st.lists(st.integers(0, 6000), min_size=6, max_size=6), first=st.integers(0, 9000),
       chosen=st.lists(st.booleans(), min_size=6, max_size=6))
def test_released_ranges_are_exactly_the_whole_pages_inside_the_chosen_tensors(sizes, gaps, first, chosen):
    from placement_opt.runtime._safetensors_file import TensorSpan, _page_ranges

    page = mmap.PAGESIZE
    spans, offset = {}, first
    for i, size in enumerate(sizes):
        spans[f"t{i}"] = TensorSpan(dtype=torch.uint8, shape=(size,), offset_bytes=offset, nbytes=size)
        offset += size + gaps[i]
    keys = [k for i, k in enumerate(spans) if chosen[i]]
    covered = bytearray(offset + page)
    for key in keys:
        covered[spans[key].offset_bytes:spans[key].offset_bytes + spans[key].nbytes] = b"\1" * spans[key].nbytes
    expected = {p for p in range(len(covered) // page) if all(covered[p * page:(p + 1) * page])}
    ranges = _page_ranges(spans, keys)
    got = {p for start, end, _ in ranges for p in range(start // page, end // page)}
    assert got == expected
    assert all(start % page == 0 and end % page == 0 and end > start for start, end, _ in ranges)
    for start, end, named in ranges:  # each range names the chosen tensors it overlaps
        assert set(named) <= set(keys)
        assert all(spans[k].offset_bytes < end and spans[k].offset_bytes + spans[k].nbytes > start
                   for k in named if spans[k].nbytes)
