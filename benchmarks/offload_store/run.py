"""What does the safe offload store (issue 17) cost a dispatch, compared with the store before it?

One run, both stores side by side in one process, alternating; writes RESULTS.md beside this
script. A Llama (hidden 1024, MLP 2816, 4 layers, vocab 256, fp32) is dispatched with its 4
layers stored on disk (205.6 MB in the offload directory; embeddings, norm and head in RAM):

* **fresh**: into an empty directory (every file written and fsynced);
* **reuse, first check**: into the directory that holds the files, by a process that has not
  checked them yet (the new store hashes every file once; its record of checks is cleared);
* **reuse**: the same again (the new store only ``stat``s files it has checked);
* **reuse, files evicted**: the first check with the files dropped from the page cache
  (``posix_fadvise(DONTNEED)``), so the check reads them from disk.

Also the hash candidates on the same bytes in memory (why the store depends on xxhash): the
fastest of 3 runs of SHA-256 and BLAKE2b (hashlib) and xxh3-128.

"before" is ``OffloadStore`` of the commit given by ``--before`` (default: the last commit
before issue 17's store), loaded from git and patched into ``placement_opt.dispatch``.
Times are of ``dispatch()`` alone (``remove()`` is not timed); medians over ``--repeats``.

Usage::

    python benchmarks/offload_store/run.py              # 5 repeats, ~1 minute on 2 cores
    python benchmarks/offload_store/run.py --quick      # 2 repeats, 1 layer
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import gc
import importlib.util
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as T

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
from placement_opt.cost.evaluate import Cost  # noqa: E402
from placement_opt.cost.workload import Workload  # noqa: E402
from placement_opt.hardware.resolve import as_machine  # noqa: E402
from placement_opt.plan import Plan, UnitPlacement  # noqa: E402
from placement_opt.runtime import offload  # noqa: E402
from run_all import machine_description  # noqa: E402

dispatch_module = importlib.import_module("placement_opt.runtime.dispatcher")

BEFORE = "446739d"  # main when issue 17's store was started


def old_store(rev: str) -> type:
    """``OffloadStore`` as it was at ``rev``, imported as ``placement_opt._offload_before``."""
    source = subprocess.run(["git", "show", f"{rev}:src/placement_opt/offload.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "_offload_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("placement_opt._offload_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.OffloadStore


def model_and_plan(layers: int) -> tuple[torch.nn.Module, Plan, int]:
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                           num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=64)
    model = T.LlamaForCausalLM(config).eval()
    units = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(layers)), "model.norm",
             "model.rotary_emb", "lm_head"]
    workload = Workload(batch_size=1, prompt_len=8, new_tokens=1)
    cost = Cost(workload=workload, prefill_s=0.0, decode_s=0.0, transfer_s=0.0, stage_s={}, units=(), memory=())
    placements = tuple(UnitPlacement(unit=u, storage="disk" if "layers" in u else "cpu", execution="cpu",
                                     mode="stream" if "layers" in u else "resident") for u in units)
    plan = Plan(model_name="llama-bench", dtype="float32", objective="latency", strategy="manual",
                placements=placements, machine=as_machine({"cpu": "8GiB", "disk": "100GiB"}), workload=workload,
                cost=cost, status="GREEDY", objective_value=0.0, best_bound=0.0, gap=0.0, solve_time_s=0.0)
    disk_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".layers." in n)
    return model, plan, disk_bytes


def evict(directory: Path) -> float:
    """Drop the directory's files from the page cache; return the fraction of their pages still cached."""
    gc.collect()  # drop the memory maps of the last dispatch: fadvise skips mapped pages
    resident = total = 0
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        file = offload.SafetensorsFile(path)
        pages = (path.stat().st_size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        offload._LIBC.mincore(ctypes.c_void_p(file._mapped().ctypes.data),
                              ctypes.c_size_t(path.stat().st_size), vec)
        resident += sum(v & 1 for v in vec)
        total += pages
        del file
    return resident / max(total, 1)


def hash_rates(model: torch.nn.Module) -> dict[str, float]:
    """GB/s of each candidate hash over the disk-stored weights in memory (fastest of 3)."""
    import hashlib

    import xxhash

    arrays = [p.detach().reshape(-1).view(torch.uint8).numpy() for n, p in model.named_parameters()
              if ".layers." in n]
    total = sum(a.nbytes for a in arrays)
    candidates = {"sha256 (hashlib)": hashlib.sha256, "blake2b (hashlib)": hashlib.blake2b,
                  "xxh3_128 (xxhash)": xxhash.xxh3_128}
    rates = {}
    for name, make in candidates.items():
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            digest = make()
            for array in arrays:
                digest.update(array)
            digest.hexdigest()
            best = min(best, time.perf_counter() - start)
        rates[name] = total / best / 1e9
    return rates


def timed_dispatch(model: torch.nn.Module, plan: Plan, directory: Path) -> float:
    start = time.perf_counter()
    handle = dispatch_module.dispatch(model, plan, offload_dir=directory)
    elapsed = time.perf_counter() - start
    handle.remove()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", default=BEFORE, help="git revision of the store to compare with")
    parser.add_argument("--work", default=None, help="scratch directory (default: benchmarks/_work)")
    args = parser.parse_args()
    repeats, layers = (2, 1) if args.quick else (args.repeats, 4)
    stores = {"before": old_store(args.before), "after": offload.OffloadStore}
    model, plan, disk_bytes = model_and_plan(layers)
    work = Path(args.work or ROOT / "benchmarks" / "_work" / "offload_store")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cases = ("fresh", "reuse, first check", "reuse", "reuse, files evicted")
    times: dict[tuple[str, str], list[float]] = {(s, c): [] for s in stores for c in cases}
    still_cached = []
    started = time.time()
    for r in range(repeats):
        for variant in (("before", "after") if r % 2 == 0 else ("after", "before")):
            dispatch_module.OffloadStore = stores[variant]
            directory = work / f"{variant}-{r}"
            times[variant, "fresh"].append(timed_dispatch(model, plan, directory))
            offload._CHECKED.clear()
            times[variant, "reuse, first check"].append(timed_dispatch(model, plan, directory))
            times[variant, "reuse"].append(timed_dispatch(model, plan, directory))
            offload._CHECKED.clear()
            still_cached.append(evict(directory))
            times[variant, "reuse, files evicted"].append(timed_dispatch(model, plan, directory))
            shutil.rmtree(directory)
    dispatch_module.OffloadStore = offload.OffloadStore
    rates = hash_rates(model)
    wall = time.time() - started

    rows = []
    for case in cases:
        before = statistics.median(times["before", case])
        after = statistics.median(times["after", case])
        rows.append(f"| {case} | {before * 1e3:.0f} | {after * 1e3:.0f} | {after / before:.2f}x |")
    command = "python benchmarks/offload_store/run.py" + (" --quick" if args.quick else "")
    text = "\n".join([
        "# Offload store: the cost of a safe store (issue 17)",
        "",
        f"- Machine: {machine_description()}",
        f"- Command: `{command}`",
        f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; wall time {wall:.0f} s; "
        f"1-minute load average at the end {os.getloadavg()[0]:.1f}",
        f"- Before: `OffloadStore` of {args.before} (serialise with safetensors, SHA-256, compare with the "
        f"manifest); after: this tree's (xxh3-128 fingerprint from memory, files checked once per process).",
        "",
        f"Llama, hidden 1024, MLP 2816, {layers} layer(s) on disk: {disk_bytes / 1e6:.1f} MB written to the "
        f"offload directory ({work.relative_to(ROOT) if work.is_relative_to(ROOT) else work}); embeddings, norm and head in RAM. Time of `dispatch()`, median of "
        f"{repeats}, before and after alternating.",
        "",
        "| case | before ms | after ms | after / before |",
        "|---|---:|---:|---:|",
        *rows,
        "",
        f"After eviction, at most {max(still_cached):.1%} of the files' pages were still in the page cache "
        f"(mincore): the check then reads them from disk.",
        "",
        f"Hashing the same {disk_bytes / 1e6:.1f} MB in memory, one core: "
        + ", ".join(f"{name} {rate:.2f} GB/s" for name, rate in rates.items()) + ".",
        "",
        "Every time, per case (ms): " + "; ".join(
            f"{variant} {case}: {', '.join(f'{t * 1e3:.0f}' for t in times[variant, case])}"
            for case in cases for variant in stores),
        "",
    ])
    if not args.quick:
        (HERE / "RESULTS.md").write_text(text)
    print(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
