"""What does letting a disk unit's mapped pages go after it runs cost, and what does it save?

``dispatch`` computes a disk unit executed on the CPU straight from its memory-mapped safetensors file,
then lets the unit's pages leave the process (``SafetensorsFile.release``: a ``/proc/self/pagemap``
check that none was written to, then ``madvise(MADV_DONTNEED)``, in a background thread). This script
runs the cost_accuracy models (random fp32 Llama, decoder layers on disk, everything executed on the
CPU, 1 intra-op thread, the page cache warm) with the release on and off (``release`` replaced by a
no-op: the behaviour before it) in one process:

* decode steps, the two settings interleaved step by step over one KV cache (the order alternating),
  median and range of each;
* the RSS growth over two prefills (batch 1 x 128) from a state with no page of the files mapped.

Usage::

    python benchmarks/dispatch/release.py                 # small and mid; writes RELEASE.md here
    python benchmarks/dispatch/release.py --shapes small --steps 8 --out /tmp/r.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "cost_accuracy"))
import run as cost_accuracy  # noqa: E402 - the models and the page-cache helpers of that benchmark


def measure(shape: str, steps: int, work: Path) -> dict[str, object]:
    from placement_opt.cost.workload import Workload
    from placement_opt.hardware.resolve import as_machine
    from placement_opt.model.tracer import trace
    from placement_opt.runtime import _safetensors_file
    from placement_opt.runtime.dispatcher import dispatch
    from placement_opt.runtime.timing import cache_argument, cache_of

    model = cost_accuracy.build(cost_accuracy.config_of(shape, None), work / shape)
    graph = trace(model, dtype="float32")
    workload = Workload(batch_size=1, prompt_len=128, new_tokens=steps)
    placement = cost_accuracy.placements(graph)["disk (all layers)"]
    plan = cost_accuracy.make_plan(placement, graph, as_machine(["cpu", "disk"], dtype="float32"), workload)
    release = _safetensors_file.SafetensorsFile.release
    settings = {"on": release, "off": lambda self, keys: None}
    handle = dispatch(model, plan, offload_dir=str(work / f"{shape}-offload"))
    ids = torch.randint(0, cost_accuracy.VOCAB, (1, 128), generator=torch.Generator().manual_seed(0))
    process = psutil.Process()
    rss: dict[str, float] = {}
    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        with torch.inference_mode():
            for name, function in settings.items():
                _safetensors_file.SafetensorsFile.release = function
                cost_accuracy._unmap_safetensors_pages()
                start = process.memory_info().rss
                for _ in range(2):
                    out = handle(input_ids=ids, use_cache=True, logits_to_keep=1)
                rss[name] = (process.memory_info().rss - start) / 2**20
            cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
            for step in range(steps):
                for name in ("on", "off") if step % 2 else ("off", "on"):
                    _safetensors_file.SafetensorsFile.release = settings[name]
                    started = time.perf_counter()
                    out = handle(input_ids=token, **cache_argument(handle, cache), use_cache=True)
                    times[name].append(time.perf_counter() - started)
                cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
    finally:
        _safetensors_file.SafetensorsFile.release = release
        handle.remove()
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".layers." in n)
    return {"shape": shape, "disk_mib": weights / 2**20, "rss": rss, "times": times}


def table(results: list[dict[str, object]]) -> list[str]:
    lines = ["| model | layers on disk (MiB) | release | decode step median (s) | range (s) | on / off | "
             "RSS growth over 2 prefills (MiB) |", "|---|---:|---|---:|---|---:|---:|"]
    for result in results:
        times, rss = result["times"], result["rss"]
        ratio = statistics.median(times["on"]) / statistics.median(times["off"])
        for name in ("off", "on"):
            steps = times[name]
            lines.append(f"| {result['shape']} | {result['disk_mib']:.0f} | {name} | {statistics.median(steps):.4f} | "
                         f"{min(steps):.4f}-{max(steps):.4f} | {ratio:.3f} | {rss[name]:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="small,mid")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per setting")
    parser.add_argument("--out", default=str(HERE / "RELEASE.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="release_") as work:
        results = [measure(shape, args.steps, Path(work)) for shape in args.shapes.split(",")]
    lines = ["# Mapped pages let go after each disk unit: decode-step cost and RSS saved", "",
             f"- Date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; x86_64, {os.cpu_count()} cores, "
             f"torch {torch.__version__}, 1 intra-op thread, Python {platform.python_version()}; 1-minute load "
             f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
             f"- Command: `python benchmarks/dispatch/release.py --shapes {args.shapes} --steps {args.steps}`",
             "- Every decoder layer on disk, executed on the CPU from the memory map; the page cache warm (this "
             "measures the release, not the disk). `on / off`: the ratio of the two medians.", "",
             *table(results), ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
