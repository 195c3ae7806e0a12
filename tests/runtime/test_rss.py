"""The process's resident set and its peak since a reset (``/proc/self``): what ``placement-opt run`` measures of
the CPU's memory."""

from __future__ import annotations

import sys

import pytest
import torch

from placement_opt.runtime._rss import peak_bytes, reset_peak

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs")


@linux
def test_the_peak_restarts_at_the_reset_and_counts_what_was_touched_after_it() -> None:
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB resident, then freed: the peak before the reset holds it
    del block
    before = reset_peak()
    assert before is not None and peak_bytes() - before < 16 * 2**20  # the freed block is not in the new peak
    # above glibc's largest mmap threshold (32 MiB): a fresh mapping whatever the heap holds, all of it touched
    block = torch.ones(48 * 2**20 // 4)
    grown = peak_bytes() - before
    del block
    assert 47 * 2**20 <= grown <= 64 * 2**20


def test_without_proc_both_figures_are_none(monkeypatch, tmp_path) -> None:
    from placement_opt.runtime import _rss

    monkeypatch.setattr(_rss, "_PROC", tmp_path / "absent")
    assert reset_peak() is None and peak_bytes() is None
