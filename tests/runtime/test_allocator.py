"""fix_mmap_threshold(): glibc's threshold fixed, so that freed activations leave the process.

The setting is the process's for good, so it runs in a subprocess: the test process keeps glibc's defaults.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from placement_opt.errors import PlacementError
from placement_opt.runtime.allocator import fix_mmap_threshold

CHILD = """
import re, torch
from pathlib import Path
from placement_opt.runtime.allocator import fix_mmap_threshold, mmap_threshold_fixed

def anon():
    return int(re.search(r"RssAnon:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024

big = torch.ones(8 * 2**20 // 4)  # freed first: under glibc's defaults the threshold would rise to 8 MiB
del big
assert fix_mmap_threshold() and mmap_threshold_fixed() == 65536
before = anon()
blocks = [torch.ones(2**20 // 4) for _ in range(64)]  # 64 x 1 MiB, each its own mapping now
held = anon() - before
del blocks[:-1]                                       # free all but the last (the heap's top would stay)
print(held // 2**20, (anon() - before) // 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_fixed_threshold_returns_freed_blocks_to_the_system() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    held, left = (int(x) for x in out.stdout.split())
    assert held >= 60  # the 64 MiB were resident ...
    assert left <= 4   # ... and gone once freed, but for the one still alive


@pytest.mark.parametrize("value", [0, 1024, 64 * 2**20, 65536.0, True])
def test_a_threshold_outside_glibc_s_range_is_refused(value) -> None:
    with pytest.raises(PlacementError, match="65536 is the default"):
        fix_mmap_threshold(value)


TRIM_CHILD = """
import re, torch
from pathlib import Path
from placement_opt.runtime.allocator import trim_heap

def anon():
    return int(re.search(r"RssAnon:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024

kept, freed = [], []
for i in range(400):  # 100 KiB blocks, under glibc's threshold: the heap's; one in eight kept alive
    (kept if i % 8 == 0 else freed).append(torch.ones(100 * 1024 // 4))
freed.clear()  # ~34 MiB free in the heap's middle: still resident
before = anon()
released = trim_heap()
print(int(released), (before - anon()) // 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trimming_the_heap_gives_its_free_middle_back_to_the_system() -> None:
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True, check=True)
    released, returned_mib = (int(x) for x in out.stdout.split())
    assert released == 1 and returned_mib >= 30  # what free() left resident, and trim_heap() gave back
