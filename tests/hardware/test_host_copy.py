"""Copies to the CPU staged through pinned buffers: the chunking, the fallbacks, and (with a GPU) the values."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.hardware import host_copy
from placement_opt.hardware.host_copy import copy_through, to_host

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool)


@pytest.fixture(autouse=True)
def _fresh_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test allocates its own staging (and its failures), whatever an earlier test left."""
    monkeypatch.setattr(host_copy, "_staging", {})


def _values(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


def test_a_cpu_tensor_comes_back_as_is() -> None:
    tensor = torch.randn(1024, 1024)  # above the staging threshold: the device decides, not the size
    assert to_host(tensor) is tensor
    small = torch.arange(3)
    assert to_host(small) is small


@given(shape=st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
       dtype=st.sampled_from(DTYPES), chunk=st.integers(1, 40), buffers=st.integers(1, 3))
def test_copy_through_copies_every_chunk(shape: tuple[int, ...], dtype: torch.dtype, chunk: int,
                                         buffers: int) -> None:
    source = _values(shape, dtype)
    dest = torch.empty(shape, dtype=dtype)
    staging = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(buffers)]
    copy_through(host_copy._bytes_of(source), host_copy._bytes_of(dest), staging)
    assert torch.equal(dest, source)


@pytest.mark.parametrize("size", [1, 7, 8, 9, 23, 24, 25])
def test_copy_through_sizes_around_the_chunk(size: int) -> None:
    source = torch.arange(size, dtype=torch.uint8)
    dest = torch.full((size,), 255, dtype=torch.uint8)
    copy_through(source, dest, [torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)])
    assert torch.equal(dest, source)


def test_copy_through_nothing_to_copy() -> None:
    dest = torch.empty(0, dtype=torch.uint8)
    copy_through(torch.empty(0, dtype=torch.uint8), dest, [torch.zeros(4, dtype=torch.uint8)])
    assert dest.numel() == 0


def test_staging_is_none_when_pinning_fails_and_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def refuse(nbytes: int) -> torch.Tensor:
        calls.append(nbytes)
        raise RuntimeError("no pinned memory allocator is available on this system")

    monkeypatch.setattr(host_copy, "_pinned", refuse)
    monkeypatch.setattr(torch.cuda, "device", lambda index: _NoDevice())  # so the allocation is reached on CPU
    device = torch.device("cuda", 0)
    assert host_copy._staging_for(device) is None
    assert host_copy._staging_for(device) is None
    assert calls == [host_copy.CHUNK_BYTES]


class _NoDevice:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_staging_without_cuda_is_none() -> None:
    assert host_copy._staging_for(torch.device("cuda", 0)) is None


# --- with a GPU -------------------------------------------------------------------------------------


def _cuda_cases() -> list[torch.Tensor]:
    device = "cuda:0"
    big = 3 * 2**20 + 5  # elements: several chunks of the small staging the tests use, plus a remainder
    return [torch.randn(big, device=device).to(torch.bfloat16),
            torch.randn(7, 512, 333, device=device),
            torch.randint(-2**40, 2**40, (big // 4,), device=device, dtype=torch.int64),
            torch.randn(1200, 900, device=device).t(),  # non-contiguous
            torch.randn(64, 2048, 3, device=device)[:, ::2, 1],  # non-contiguous, strided
            torch.randn(10, device=device)]  # below the threshold: a plain copy


@pytest.mark.cuda
@pytest.mark.parametrize("chunk", [host_copy.CHUNK_BYTES, 2**20 + 12345])
def test_to_host_equals_cpu_and_is_not_pinned(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr(host_copy, "CHUNK_BYTES", chunk)
    for tensor in _cuda_cases():
        copied = to_host(tensor)
        assert copied.device.type == "cpu" and not copied.is_pinned()
        assert copied.dtype == tensor.dtype and copied.shape == tensor.shape
        assert torch.equal(copied, tensor.cpu())
    assert host_copy._staging[0] is not None


@pytest.mark.cuda
def test_to_host_after_work_on_a_side_stream() -> None:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tensor = torch.full((2**22,), 3.0, device="cuda:0")
        tensor.mul_(2)  # queued on the side stream: the copy must wait for it
        copied = to_host(tensor)
    assert torch.equal(copied, torch.full((2**22,), 6.0))


@pytest.mark.cuda
def test_to_host_from_threads() -> None:
    tensors = [torch.randn(2**21, device="cuda:0") + i for i in range(6)]
    results: list[torch.Tensor | None] = [None] * len(tensors)

    def copy(i: int) -> None:
        results[i] = to_host(tensors[i])

    threads = [threading.Thread(target=copy, args=(i,)) for i in range(len(tensors))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for tensor, result in zip(tensors, results, strict=True):
        assert result is not None and torch.equal(result, tensor.cpu())


@pytest.mark.cuda
def test_to_host_falls_back_when_pinning_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(nbytes: int) -> torch.Tensor:
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(host_copy, "_pinned", refuse)
    tensor = torch.randn(2**21, device="cuda:0")
    assert torch.equal(to_host(tensor), tensor.cpu())
    assert host_copy._staging[0] is None


@pytest.mark.cuda
def test_the_dispatchers_moves_to_the_cpu_are_staged(monkeypatch: pytest.MonkeyPatch) -> None:
    from placement_opt.runtime import _hooks, _phases

    seen = []

    def recording(tensor: torch.Tensor) -> torch.Tensor:
        seen.append(tensor)
        return to_host(tensor)

    monkeypatch.setattr(_phases, "to_host", recording)
    monkeypatch.setattr(_hooks, "to_host", recording)
    tensor = torch.randn(2**21, device="cuda:0")
    cpu = torch.device("cpu")
    moved = _phases._to({"keys": [tensor]}, cpu)["keys"][0]
    output = _hooks._move((tensor,), cpu)[0]
    assert len(seen) == 2 and torch.equal(moved, tensor.cpu()) and torch.equal(output, tensor.cpu())
