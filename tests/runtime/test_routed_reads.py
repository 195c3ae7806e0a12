"""The routed-reads hook (``runtime._routed_reads``) on its own: which rows of which fused expert tensors a call of
some router picks asks the kernel for, for a whole experts module and for a layer's expert groups."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.model.expert_groups import group_ranges
from placement_opt.runtime._routed_reads import _reader


class _File:
    """A stand-in for a mapped file: its tensors' row counts, and the rows asked for."""

    def __init__(self, rows: dict[str, int]) -> None:
        self.spans = {key: SimpleNamespace(shape=(n, 4, 4)) for key, n in rows.items()}
        self.asked: dict[str, set[int]] = {}

    def prefetch_rows(self, key: str, start: int, end: int) -> None:
        assert 0 <= start < end <= self.spans[key].shape[0], (key, start, end)
        self.asked.setdefault(key, set()).update(range(start, end))


@given(data=st.data(), experts=st.integers(2, 64), groups=st.integers(1, 8), top_k=st.integers(1, 8),
       tokens=st.integers(1, 70))
def test_each_disk_group_is_asked_for_its_picks_among_its_rows_and_nothing_else(data, experts, groups, top_k, tokens):
    groups, top_k = min(groups, experts), min(top_k, experts)
    ranges = group_ranges(experts, groups)
    on_disk = data.draw(st.sets(st.integers(0, groups - 1), min_size=1))
    files = {i: _File({f"g{i}.gate_up_proj": end - start, f"g{i}.down_proj": end - start})
             for i, (start, end) in enumerate(ranges) if i in on_disk}
    reads = [([(files[i], f"g{i}.gate_up_proj"), (files[i], f"g{i}.down_proj")], ranges[i][0],
               ranges[i][1] - ranges[i][0]) for i in sorted(files)]
    picks = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, experts - 1), min_size=top_k, max_size=top_k),
                                            min_size=tokens, max_size=tokens)))
    _reader(reads, experts)(None, (torch.zeros(tokens, 4), picks, torch.ones(tokens, top_k)), {})
    picked = set(picks.flatten().tolist())
    for i, file in files.items():
        start, end = ranges[i]
        wanted = {e - start for e in picked if start <= e < end}
        if tokens >= experts:  # a prompt: the read-ahead asked for every row already
            wanted = set()
        for key in file.spans:
            assert file.asked.get(key, set()) == wanted, (i, key)


def test_the_picks_may_come_by_name_and_sentinels_are_skipped():
    """transformers passes the picks by keyword as often as by position; an expert-parallel sentinel (the expert
    count) names no row."""
    file = _File({"e.gate_up_proj": 8})
    read = _reader([([(file, "e.gate_up_proj")], 0, 8)], 8)
    read(None, (torch.zeros(2, 4),), {"top_k_index": torch.tensor([[1, 8], [2, 1]])})
    assert file.asked == {"e.gate_up_proj": {1, 2}}


@given(counts=st.lists(st.integers(0, 5), min_size=1, max_size=16), as_tensor=st.booleans())
def test_experts_told_their_rows_are_asked_for_those_with_rows(counts, as_tensor):
    """JetMoE's experts take the rows of each expert (``expert_size``, a list; a tensor is read alike). Every
    expert with rows is asked for, all of them included: the rows do not say how many tokens the call has, and a
    few tokens reaching every expert had none read ahead."""
    file = _File({"e.weight": len(counts)})
    read = _reader([([(file, "e.weight")], 0, len(counts))], len(counts), "expert_size")
    read(None, (torch.zeros(sum(counts), 4), torch.tensor(counts) if as_tensor else counts), {})
    assert file.asked.get("e.weight", set()) == {i for i, n in enumerate(counts) if n}


class _Table:
    """A stand-in for a mapped file holding one lookup table: the rows asked for, and whether the whole was."""

    def __init__(self, rows: int, row_bytes: int) -> None:
        self.spans = {"t": SimpleNamespace(shape=(rows, row_bytes // 4), nbytes=rows * row_bytes)}
        self.rows: set[int] = set()
        self.whole = False

    def prefetch_rows(self, key: str, start: int, end: int) -> None:
        assert 0 <= start < end <= self.spans[key].shape[0], (key, start, end)
        assert not self.rows & set(range(start, end)), "a row asked for twice"
        self.rows.update(range(start, end))

    def prefetch(self, keys) -> None:
        assert list(keys) == ["t"]
        self.whole = True


@given(ids=st.lists(st.lists(st.integers(0, 299), min_size=1, max_size=40), min_size=1, max_size=4),
       row_bytes=st.sampled_from([256, 4096, 16384]),
       latency=st.integers(-70, -33).map(lambda e: 10 ** (e / 10)),  # 0.1-500 us, log-uniform: both ways taken
       rate=st.integers(80, 100).map(lambda e: 10 ** (e / 10)))  # 0.1-10 GB/s
def test_a_lookup_asks_for_its_distinct_rows_once_or_for_the_table_whichever_the_machine_reads_faster(
        ids, row_bytes, latency, rate):
    """Any batch of token ids: exactly the distinct ids' rows, each once, or the table alone where
    ``asks_whole_table`` says so for that many rows (the rule the cost model prices)."""
    from placement_opt.cost.traffic import asks_whole_table
    from placement_opt.hardware.devices import Device, Machine
    from placement_opt.runtime._routed_reads import _row_asker

    width = min(len(row) for row in ids)
    batch = torch.tensor([row[:width] for row in ids])
    table = _Table(300, row_bytes)
    machine = Machine([Device("cpu", "8GiB"), Device("disk", "1TB", bandwidth=rate, random_read=rate,
                                                     random_read_latency_s=latency)])
    _row_asker([(table, "t")], machine)(None, (batch,))
    distinct = set(batch.flatten().tolist())
    if asks_whole_table(machine, len(distinct), row_bytes, 300 * row_bytes):
        assert table.whole and not table.rows
    else:
        assert table.rows == distinct and not table.whole
