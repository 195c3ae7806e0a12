"""What the CPU's matmul library keeps after a matmul: the resident set left once the output is freed.

MKL's sgemm packs panels of its operands into buffers of its own memory manager, which it keeps for the
next call instead of freeing them. This runs a sequence of ``linear`` calls (``--rows`` x in, a weight of
out x in each) in one process with glibc's mmap threshold fixed (so freed tensors leave the resident set)
and prints, after each call, how much the resident set grew since a warm-up on a tiny matmul.

Usage::

    python benchmarks/cost_accuracy/mkl_pool.py --threads 1 --rows 8 --shapes 14336x4096,4096x14336,4096x256
    python benchmarks/cost_accuracy/mkl_pool.py --threads 1 --rows 8 --shapes 4096x256,16384x256,14336x4096
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def _rss_mib() -> float:
    return int(re.search(r"^VmRSS:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shapes", default="14336x4096,4096x14336,4096x4096,4096x256,16384x256",
                        help="weights as out x in, comma-separated, run in this order")
    args = parser.parse_args()
    from placement_opt.runtime.allocator import fix_mmap_threshold, trim_heap

    fix_mmap_threshold()
    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    weights = [torch.randn(out, inp, dtype=dtype) for out, inp in shapes]
    torch.nn.functional.linear(torch.randn(1, 64, dtype=dtype), torch.randn(16, 64, dtype=dtype))
    trim_heap()
    base = _rss_mib()
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rows} rows, {args.dtype}")
    for (out, inp), weight in zip(shapes, weights, strict=True):
        torch.nn.functional.linear(torch.randn(args.rows, inp, dtype=dtype), weight)  # the output is freed at once
        print(f"after {out} x {inp}: {_rss_mib() - base:.2f} MiB kept")


if __name__ == "__main__":
    main()
