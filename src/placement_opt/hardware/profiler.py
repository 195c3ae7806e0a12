"""Measuring this machine: micro-benchmarks that replace datasheet figures with measured ones.

:func:`profile` measures, in a few seconds:

* CPU: matmul FLOP/s (square), the FLOP/s of a linear layer (2048 x 5632) by tokens per forward
  (1 to 1024: small batches run far below peak), matrix-vector throughput (weight bytes read per
  second, what a decode step achieves) in float32, bfloat16 and float16, memory copy bandwidth, the rate
  at which a large new tensor gets its pages (``fresh_page_bytes_per_s``: what a long KV cache's growth
  pays every decode step under glibc), and the host's seconds per torch op of a tiny transformers model's
  forward (``op_overhead_s``, which the cost model multiplies by each unit's traced op count);
* disk: read bandwidth of a scratch file in the offload folder, **cold**: the file's pages are
  dropped from the page cache (``posix_fadvise(DONTNEED)``) before it is read. Weights go to disk
  when they do not fit in RAM, and then the page cache cannot hold them either, so a warm figure
  would promise RAM speed that offloading never gets. (Where RAM has room for the offloaded
  weights, keeping them on the CPU is the better plan anyway, and the solver sees that.) Two
  figures are kept: plain sequential reads, and reads through a memory map copied into a tensor,
  which is how accelerate loads offloaded weights (``np.memmap``); the disk device carries the
  first (the cost model derates it for accelerate's reads, see ``cost.MAPPED_READ_FACTOR``).
* CUDA (when present; skipped on machines without it): matmul FLOP/s, HBM copy bandwidth, pinned
  and pageable host -> device copies, a copy back into new host memory staged through pinned buffers
  (:func:`.host_copy.to_host`, as the dispatcher copies), peer copies between GPUs, and the seconds
  per op of the tiny model's forward on the GPU (host work and launches).

Results are saved as JSON (default ``~/.cache/placement_opt/profile.json``, or the path in the
``PLACEMENT_OPT_PROFILE`` environment variable) so that solving never re-measures:
:func:`~.profile_store.saved_device` (called by :func:`~.detect.detect_device`) returns the measured
:class:`Device`, whose ``source`` starts with ``"measured"`` so the cost model applies no
efficiency derating. The file also holds ``"machine"`` (``Machine.to_dict()``) so that
``--devices profile.json`` works on the command line.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..progress import Bar, bar
from .detect import cuda_device_count, detect_device, local_device_names
from .devices import FRESH_PAGE_MIN_BYTES, Machine, normalize_device_name, replace_device
from .profile_store import (
    PROFILE_SCHEMA_VERSION,
    PROFILED_DTYPES,
    check_profile_target,
    device_from_measurement,
    dtype_key,
    load_profile,
    profile_path,
    write_profile,
)

__all__ = ["profile"]


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------
#: Least total time spent in the timed calls of one measurement (more repeats for fast calls).
_MIN_MEASURE_S = 0.1
#: Most time one measurement may take once it has a figure (fp16 matmuls on a CPU take seconds each).
_MAX_MEASURE_S = 1.0


def _best_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None,
               min_total_s: float = _MIN_MEASURE_S) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up, repeated for at least ``min_total_s``.

    The fastest call is the one least disturbed by other load: the figure estimates what this
    machine can do, not how busy it was while being measured. A fixed count of fast calls
    (a millisecond matmul) spans too short a time to escape a busy moment, so calls repeat until
    ``min_total_s`` has passed as well (capped at 50 x ``repeats`` calls). Slow calls stop after
    :data:`_MAX_MEASURE_S`; after a warm-up slower than that, one timed call is the figure (the warm-up
    never is: a first-call stall of a few hundred ms, as calibrate saw on a busy 2-core machine, would
    stand for the device's speed).
    """
    start = time.perf_counter()
    fn()
    sync()
    warm = time.perf_counter() - start
    if warm > _MAX_MEASURE_S:
        start = time.perf_counter()
        fn()
        sync()
        return min(warm, time.perf_counter() - start)
    times: list[float] = []
    while not times or (len(times) < repeats and sum(times) < _MAX_MEASURE_S) or (
            sum(times) < min_total_s and len(times) < 50 * repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


#: Tokens per forward at which a linear layer's FLOP/s is measured.
CURVE_TOKENS = (1, 4, 16, 64, 256, 1024)
_CURVE_SHAPE = (2048, 5632)  # (in, out) features: a 1-3B model's MLP projection
_CURVE_BUDGET_S = 0.15
_CURVE_ROUNDS = 3


def _linear_curve(torch: Any, dtype: Any, device: Any, repeats: int,
                  sync: Callable[[], None] = lambda: None, min_total_s: float = _MIN_MEASURE_S) -> list[list[float]]:
    """FLOP/s of ``x @ W.T`` by the number of rows (tokens) of ``x``; stops early on slow dtypes.

    The token counts are swept :data:`_CURVE_ROUNDS` times and each keeps its best figure: a slow
    spell of a shared VM (measured here: a whole sweep at half speed) must then cover that point
    in every sweep to bias it.
    """
    features_in, features_out = _CURVE_SHAPE
    weight = torch.randn(features_out, features_in, dtype=dtype, device=device)
    best: dict[int, float] = {}
    cheap: list[int] = []  # points whose calls are short enough that a slow spell can cover them
    for sweep in range(_CURVE_ROUNDS):
        for tokens in CURVE_TOKENS if sweep == 0 else cheap:
            x = torch.randn(tokens, features_in, dtype=dtype, device=device)
            seconds = _best_time(lambda x=x: torch.nn.functional.linear(x, weight), repeats, sync, min_total_s)
            best[tokens] = max(best.get(tokens, 0.0), 2 * tokens * features_in * features_out / seconds)
            if sweep == 0 and seconds < _CURVE_BUDGET_S / 5:
                cheap.append(tokens)
            if sweep == 0 and seconds > _CURVE_BUDGET_S:
                break
    return [[tokens, flops] for tokens, flops in best.items()]


def _measure_cpu(quick: bool, dtypes: tuple[str, ...], counted: Bar) -> dict[str, Any]:
    import psutil
    import torch

    repeats = 2 if quick else 5
    least = 0.03 if quick else _MIN_MEASURE_S
    n = 512 if quick else 1024
    rows = 4096 if quick else 8192  # 64 MiB or 256 MiB in fp32: larger than any CPU cache
    matmul, matvec, curves = {}, {}, {}
    for dtype in dtypes:
        tdtype = getattr(torch, dtype)
        counted.describe(f"cpu: {dtype} linear layer by tokens")
        curves[dtype] = _linear_curve(torch, tdtype, "cpu", repeats, min_total_s=least)
        counted.advance(1, f"cpu: {dtype} matmul")
        a, b = torch.randn(n, n, dtype=tdtype), torch.randn(n, n, dtype=tdtype)
        matmul[dtype] = 2 * n**3 / _best_time(lambda a=a, b=b: torch.mm(a, b), repeats, min_total_s=least)
        counted.advance(1, f"cpu: {dtype} matrix-vector")
        w, x = torch.randn(rows, rows, dtype=tdtype), torch.randn(rows, 1, dtype=tdtype)
        matvec[dtype] = w.numel() * w.element_size() / _best_time(lambda w=w, x=x: torch.mm(w, x), repeats,
                                                                  min_total_s=least)
        counted.advance(1)
    counted.describe("cpu: memory copy")
    src = torch.empty(64 * 2**20 if quick else 256 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / _best_time(lambda: dst.copy_(src), repeats, min_total_s=least)
    counted.advance(1, "cpu: fresh pages")
    fresh = _fresh_page_rate(torch, repeats, least)
    counted.advance(1, "cpu: seconds per op of a small model")
    per_op = _op_overhead_s(torch, "cpu", repeats, least)
    counted.advance(1)
    return {"memory_bytes": int(psutil.virtual_memory().total), "threads": torch.get_num_threads(),
            "matmul_flops_per_s": matmul, "matvec_bytes_per_s": matvec, "copy_bytes_per_s": copy,
            "fresh_page_bytes_per_s": fresh, "op_overhead_s": per_op, "linear_flops_by_tokens": curves}


#: Size queries a dispatch mode may see that no forward pays as an op.
_QUERIES = ("size", "stride", "sym_size", "sym_stride", "dim", "numel", "sym_numel", "is_contiguous",
            "storage_offset")


def _op_overhead_s(torch: Any, device: str, repeats: int, least: float,
                   sync: Callable[[], None] = lambda: None) -> float:
    """Host seconds per torch op of a small transformers model's forward on ``device``.

    A Llama of hidden 64 (2 layers, 8 tokens) computes next to nothing, so its forward is what the host spends
    dispatching its ops and running the Python around them: its best time over the ops it dispatches, counted
    as the trace counts a unit's (``ops_per_forward``). The cost model multiplies the figure by each unit's count.
    """
    import warnings

    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.ops += func._overloadpacket.__name__ not in _QUERIES
            return func(*args, **(kwargs or {}))

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.LlamaForCausalLM(config).to(device).eval()
    ids = torch.zeros((1, 8), dtype=torch.long, device=device)
    counting = Counting()
    with torch.no_grad():
        with counting:
            model(input_ids=ids)
        seconds = _best_time(lambda: model(input_ids=ids), repeats, sync, least)
    return seconds / max(1, counting.ops)


#: The new tensor whose pages :func:`_fresh_page_rate` times: above glibc's largest mmap threshold
#: (``FRESH_PAGE_MIN_BYTES``), as a KV cache's keys grow past it at long contexts.
_FRESH_BYTES = 2 * FRESH_PAGE_MIN_BYTES
#: A new tensor's fill slower than an existing one's by less than this counts as no cost (timing noise).
_FRESH_NOISE = 1.1


def _fresh_page_rate(torch: Any, repeats: int, least: float) -> float:
    """Bytes/s at which a large new tensor gets its pages, beyond writing them; 0.0 where that costs nothing.

    The time of filling a newly allocated tensor less that of filling one that exists: under glibc each
    such allocation is a new memory map, and each of its pages faults in (and is zeroed) on first touch.
    A decode step's ``torch.cat`` of a long KV cache pays it every step (measured here: 4 GB/s of fresh
    pages against 33 GB/s of copies into existing memory). Allocators that keep freed memory pay nothing.
    """
    kept = torch.empty(_FRESH_BYTES, dtype=torch.uint8)
    warm = _best_time(lambda: kept.fill_(1), repeats, min_total_s=least)
    fresh = _best_time(lambda: torch.empty(_FRESH_BYTES, dtype=torch.uint8).fill_(1), repeats, min_total_s=least)
    return _FRESH_BYTES / (fresh - warm) if fresh > _FRESH_NOISE * warm else 0.0


#: Cold reads of the disk's scratch file (each sequential and through a memory map); the best counts.
_DISK_ROUNDS = 3


def _drop_from_page_cache(path: Path) -> None:
    """Evict a file's pages so that the next read comes from the disk (no-op where unsupported)."""
    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - macOS, Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _measure_disk(folder: Path, quick: bool, counted: Bar) -> dict[str, Any]:
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    size = (64 if quick else 256) * 2**20
    chunk = 8 * 2**20
    block = os.urandom(chunk)
    fd, name = tempfile.mkstemp(prefix="placement_opt_profile_", dir=folder)
    path = Path(name)
    try:
        counted.describe("disk: writing a scratch file")
        with os.fdopen(fd, "wb") as fh:
            for _ in range(size // chunk):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        sequential, mapped = [], []
        counted.advance(1, "disk: cold reads")
        for _ in range(_DISK_ROUNDS):
            _drop_from_page_cache(path)
            start = time.perf_counter()
            with open(path, "rb", buffering=0) as fh:
                while fh.read(chunk):
                    pass
            sequential.append(time.perf_counter() - start)
            _drop_from_page_cache(path)
            start = time.perf_counter()
            _read_mapped(path)
            mapped.append(time.perf_counter() - start)
            counted.advance(1)
        _drop_from_page_cache(path)
        scattered = _random_reads(path, size, 4 if quick else 8)
    finally:
        path.unlink(missing_ok=True)
    return {"memory_bytes": int(shutil.disk_usage(folder).free),
            "sequential_read_bytes_per_s": size / min(sequential),
            "mapped_read_bytes_per_s": size / min(mapped), **scattered,
            "folder": str(folder), "page_cache": "dropped before reading (cold reads)",
            "read": "memory map copied into a tensor (how offloaded weights are loaded)"}


#: Scattered reads of the disk's scratch file: this many regions asked for together, each this large (an expert of
#: a small MoE: hidden 512 x intermediate 1024 x 3 matrices in fp32 is 6 MiB), and this many single pages.
_SCATTERED_REGIONS = 8
_SCATTERED_REGION_BYTES = 4 * 2**20
_SCATTERED_PAGES = 16


def _random_reads(path: Path, size: int, rounds: int) -> dict[str, float]:
    """How the disk reads regions at random places of ``path`` asked for together (``posix_fadvise``), then touched
    through a memory map, cold: as the runtime reads a router's picked experts and a lookup table's rows.

    ``random_read_bytes_per_s``: :data:`_SCATTERED_REGIONS` regions of :data:`_SCATTERED_REGION_BYTES`, the bytes
    of every round over their time, their latency taken off. ``random_read_latency_s``: the median round's time of
    :data:`_SCATTERED_PAGES` single pages, per page (reads asked for together overlap: on this project's virtual
    disk one page alone took 46 µs, sixteen together 13-15 µs each). Not the best round, as the other disk figures
    take: this disk's rounds alternated between about 1.25 and 1.9 GB/s, so the best (and the median) read 1.8-2.85
    GB/s where the routed experts of benchmarks/cost_accuracy's MoE model came in at 1.3-1.5 GB/s."""
    import random
    import statistics

    if not hasattr(os, "posix_fadvise"):  # pragma: no cover - macOS, Windows: the runtime asks for nothing there
        return {}
    rng = random.Random(0)
    pages = [_asked_reads(path, size, _SCATTERED_PAGES, 1, rng) for _ in range(rounds)]
    latency = statistics.median(pages) / _SCATTERED_PAGES
    spent = sum(_asked_reads(path, size, _SCATTERED_REGIONS, _SCATTERED_REGION_BYTES, rng) for _ in range(rounds))
    moved = rounds * _SCATTERED_REGIONS * _SCATTERED_REGION_BYTES
    waited = rounds * _SCATTERED_REGIONS * latency
    return {"random_read_bytes_per_s": moved / max(spent - waited, spent / 2), "random_read_latency_s": latency}


def _asked_reads(path: Path, size: int, count: int, nbytes: int, rng: Any) -> float:
    """Seconds to read ``count`` regions of ``nbytes`` (at least a page), one at a random place of each of ``count``
    equal slices of ``path``, asked for together and then touched page by page, its pages dropped before."""
    import mmap

    page = mmap.PAGESIZE
    nbytes = max(nbytes, page)
    stride = size // count
    offsets = [(k * stride + rng.randrange(max(1, stride - nbytes))) // page * page for k in range(count)]
    _drop_from_page_cache(path)  # the map is opened after: pages a process maps stay in the cache
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        start = time.perf_counter()
        for offset in offsets:
            os.posix_fadvise(fh.fileno(), offset, nbytes, os.POSIX_FADV_WILLNEED)
        for offset in offsets:
            for at in range(offset, offset + nbytes, page):
                mapped[at]  # noqa: B018 - the read is the point: it waits for the page
        return time.perf_counter() - start


def _read_mapped(path: Path) -> None:
    import numpy as np
    import torch

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    torch.tensor(mapped)
    del mapped


def _measure_cuda(index: int, quick: bool, dtypes: tuple[str, ...],
                  counted: Bar) -> dict[str, Any]:  # pragma: no cover - needs a GPU
    import torch

    from .host_copy import to_host as staged_to_host

    device = torch.device(f"cuda:{index}")
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    repeats = 3 if quick else 10
    n = 4096 if quick else 8192
    matmul, curves = {}, {}
    for dtype in dtypes:
        counted.describe(f"{device}: {dtype} matmul")
        a = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
        matmul[dtype] = 2 * n**3 / _best_time(lambda a=a: torch.mm(a, a), repeats, sync)
        counted.advance(1, f"{device}: {dtype} linear layer by tokens")
        curves[dtype] = _linear_curve(torch, getattr(torch, dtype), device, repeats, sync)
        counted.advance(1)
    counted.describe(f"{device}: memory and host copies")
    size = 256 * 2**20 if quick else 1024 * 2**20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = 2 * size / _best_time(lambda: dst.copy_(src), repeats, sync)
    host = torch.empty(size, dtype=torch.uint8)
    pinned = host.pin_memory()
    pageable = size / _best_time(lambda: dst.copy_(host), repeats, sync)
    pinned_rate = size / _best_time(lambda: dst.copy_(pinned, non_blocking=True), repeats, sync)
    # what the dispatcher does with a phased unit's KV cache and a GPU unit's outputs bound for the CPU: a blocking
    # copy staged through pinned buffers into new pageable memory (glibc maps it anew: its pages fault in as the
    # staged chunks are copied into it), see host_copy
    leaving = src[: 256 * 2**20]
    to_host = leaving.numel() / _best_time(lambda: staged_to_host(leaving), repeats, sync)
    counted.advance(1, f"{device}: seconds per op of a small model")
    per_op = _op_overhead_s(torch, device, repeats, _MIN_MEASURE_S, sync)
    counted.advance(1)
    entry: dict[str, Any] = {"memory_bytes": int(torch.cuda.get_device_properties(index).total_memory),
                             "name": torch.cuda.get_device_name(index), "matmul_flops_per_s": matmul,
                             "linear_flops_by_tokens": curves,
                             "copy_bytes_per_s": copy, "pinned_h2d_bytes_per_s": pinned_rate,
                             "pageable_h2d_bytes_per_s": pageable, "staged_to_host_bytes_per_s": to_host,
                             "op_overhead_s": per_op}
    peers = [j for j in range(cuda_device_count()) if j != index]
    if peers:
        other = torch.empty(size, dtype=torch.uint8, device=f"cuda:{peers[0]}")
        counted.describe(f"{device}: peer copy")
        entry["peer_bytes_per_s"] = size / _best_time(lambda: other.copy_(src), repeats, sync)
    counted.advance(1)
    return entry


def profile(devices: Iterable[str | int] | None = None, *, path: str | os.PathLike[str] | None = None,
            quick: bool = False, dtype: str = "bfloat16", dtypes: Iterable[str] | None = None,
            offload_folder: str | os.PathLike[str] | None = None, progress: bool | None = None) -> Machine:
    """Measure this machine, save the figures as JSON, and return it as a :class:`Machine`.

    Example::

        machine = placement_opt.profile(quick=True, dtype="float32")
        print(machine["cpu"])   # cpu (..., 0.21 TFLOP/s, 9.8 GB/s, measured 2026-11-21)

    Args:
        devices: names to measure (``"cpu"``, ``"disk"``, ``"cuda:N"``; one name alone too); default every
            visible GPU, the CPU and the disk.
        path: where to save the JSON; default ``$PLACEMENT_OPT_PROFILE`` or
            ``~/.cache/placement_opt/profile.json``. Figures of devices not measured this time are kept.
        quick: smaller sizes and fewer repeats (less precise; see the CLI's ``--help`` for durations).
        dtype: the dtype the model will run in: its FLOP/s are measured and the returned devices
            carry them. A CPU computes each dtype at a very different speed (float16 matmuls are
            often 20x slower than float32), so measure the one you will run.
        dtypes: every dtype to measure (default ``(dtype,)``; any of float32, bfloat16, float16).
            Figures of dtypes measured earlier and not this time stay in the file.
        offload_folder: where the disk read is measured; default the current directory.
        progress: a bar of the measurements on stderr. ``None`` (default): shown on a terminal or
            in a notebook, silent in pipes and under pytest, or as the environment variable
            ``PLACEMENT_OPT_PROGRESS`` (``1``/``0``/``auto``) says; ``True``/``False`` decide.

    Returns:
        A ``Machine`` with today's capacities and the measured speeds (``source="measured ..."``); with ``path``,
        it carries the path (``profile_path``), so ``solve()`` reads the calibration saved there.

    Raises:
        DeviceSpecError: an unknown device name, or a GPU that is not on this machine.
        ProfileError, PlanFormatError: ``path`` is a directory, or a file there is not a profile (checked before
            measuring; such a file is never written over).
    """
    if isinstance(devices, str | int):  # one device: "cpu" is not the devices "c", "p", "u"
        devices = [devices]
    names = [normalize_device_name(d) for d in (devices if devices is not None else local_device_names())]
    measured_dtypes = _dtypes_to_measure(dtype, (dtypes,) if isinstance(dtypes, str) else dtypes)
    check_profile_target(path)  # before minutes of measuring: a directory or a user's file there is refused
    steps = sum(_measurement_count(name, measured_dtypes) for name in names)
    with bar("Measuring", steps, progress=progress) as counted:
        measurements = {name: _measure(name, quick, offload_folder, measured_dtypes, counted) for name in names}
        counted.describe("Measured")
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    where = profile_path(path)
    previous = load_profile(where) or {}
    merged = {**previous.get("measurements", {})}
    for name, entry in measurements.items():
        merged[name] = _merge_dtypes(merged.get(name), entry)
    machine = _measured_machine(names, merged, dtype, created)
    # `--devices PATH` plans for the file's 'machine': every device measured here, not this call's only (calibrate()
    # profiles the one a profile lacks, and a disk alone has nothing to compute on)
    here = [n for n in local_device_names() if n in merged]
    saved = machine if set(here) <= set(names) else _measured_machine(here, merged, dtype, created)
    _save(where, {"schema_version": PROFILE_SCHEMA_VERSION, "created": created, "host": platform.node(),
                  "quick": quick, "dtype": dtype_key(dtype), "measurements": merged,
                  "machine": saved.to_dict()}, previous)
    # a profile saved apart (path=) prices the returned machine with the unit times calibrate() saves there
    return machine if path is None else Machine(machine.devices, machine.links, where.resolve())


def _measured_machine(names: Iterable[str], merged: dict[str, Any], dtype: str, created: str) -> Machine:
    """The devices ``names`` at their saved figures, with today's capacities."""
    measured = [device_from_measurement(n, merged[n], dtype_key(dtype), created) for n in names]
    return Machine([replace_device(d, memory_bytes=detect_device(d.name).memory_bytes) for d in measured])


def _dtypes_to_measure(dtype: str, dtypes: Iterable[str] | None) -> tuple[str, ...]:
    """The dtypes to time, ``dtype`` first; each one a dtype the profile keys."""
    from ..errors import DeviceSpecError

    wanted = [dtype_key(dtype), *(dtype_key(d) for d in (dtypes or ()))]
    unknown = sorted({d for d in wanted if d not in PROFILED_DTYPES})
    if unknown:
        raise DeviceSpecError(f"cannot measure dtype {', '.join(unknown)}: measured dtypes are "
                              f"{', '.join(PROFILED_DTYPES)}")
    return tuple(dict.fromkeys(wanted))


#: Figures kept per dtype: a new measurement of one dtype keeps the others measured earlier.
_PER_DTYPE = ("matmul_flops_per_s", "matvec_bytes_per_s", "linear_flops_by_tokens")


def _merge_dtypes(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    if not old:
        return new
    merged = dict(new)
    for key in _PER_DTYPE:
        if isinstance(old.get(key), dict) and key in new:
            merged[key] = {**old[key], **new[key]}
    return merged


def _measurement_count(name: str, dtypes: tuple[str, ...]) -> int:
    """How many steps the bar counts for one device (what ``_measure_*`` advance by)."""
    if name == "cpu":
        return 3 * len(dtypes) + 3
    if name == "disk":
        return 1 + _DISK_ROUNDS
    return 2 * len(dtypes) + 3  # pragma: no cover - needs a GPU


def _measure(name: str, quick: bool, offload_folder: str | os.PathLike[str] | None,
             dtypes: tuple[str, ...], counted: Bar) -> dict[str, Any]:
    if name == "cpu":
        return _measure_cpu(quick, dtypes, counted)
    if name == "disk":
        return _measure_disk(Path(offload_folder or "."), quick, counted)
    detect_device(name)  # pragma: no cover - needs a GPU; raises a clear error when it is absent
    return _measure_cuda(int(name.split(":")[1]), quick, dtypes, counted)  # pragma: no cover


def _save(where: Path, data: dict[str, Any], previous: dict[str, Any]) -> None:
    """Write the profile atomically, keeping the calibrated unit times of the previous one."""
    if "calibration" in previous:
        data = {**data, "calibration": previous["calibration"]}
    write_profile(where, data)
