"""Units the CPU computes from a memory-mapped disk file read what they use, not all their weights: a lookup table
(an embedding) the rows it looks up, asked for before it looks them up (a random read each, at least a page), or the
whole table for a large share of its rows; an MoE unit in a call of fewer tokens than experts its shared weights, in
order, and the experts the tokens hit, a random read each."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import placement_opt
from placement_opt.cost.kernels import expected_experts
from placement_opt.cost.pricing import PricingContext, price_option
from placement_opt.cost.traffic import PAGE_BYTES, asks_whole_table, lookup_read_s, routed_read_s
from placement_opt.cost.workload import Workload
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import chain_graph

ROW = 8192  # bytes of one embedding row: hidden 4096 in bf16
VOCAB = 128256
DISK_RATE = 2e9  # read in order (the read-ahead of whole units)
RANDOM_RATE = 1.2e9  # regions at random places asked for together (placement-opt profile on this project's disk)
LATENCY_S = 15e-6  # each small read among several asked for together (the same profile: 13-15 us)


def _graph():
    return chain_graph([{"name": "embed", "param_bytes": VOCAB * ROW, "out_bytes_per_token": ROW},
                        {"name": "layer", "param_bytes": 2**24, "flops_per_token": 2**25,
                         "out_bytes_per_token": ROW}], dtype="bfloat16")


def _machine(latency: float | None = LATENCY_S, rate: float | None = RANDOM_RATE) -> Machine:
    return Machine([Device("cpu", "16GiB", flops=1e11, bandwidth=1e10, source="measured"),
                    Device("disk", "1TB", bandwidth=DISK_RATE, source="measured", random_read=rate,
                           random_read_latency_s=latency)])


def _ctx(workload: Workload, latency: float | None = LATENCY_S) -> PricingContext:
    return PricingContext(_graph(), _machine(latency), workload, None)


def test_a_decode_step_reads_a_row_per_sequence_not_the_table() -> None:
    """Batch 2, 16 steps: the disk option costs the RAM option plus two small reads a step (the table, 1 GiB, would
    take half a second a step)."""
    workload = Workload(batch_size=2, prompt_len=64, new_tokens=16)
    ctx = _ctx(workload)
    embed = ctx.graph.unit("embed")
    on_disk = price_option(ctx, embed, "disk", "cpu", "stream")
    in_ram = price_option(ctx, embed, "cpu", "cpu", "resident")
    per_step = 2 * (LATENCY_S + ROW / RANDOM_RATE)
    assert on_disk.decode_s - in_ram.decode_s == pytest.approx(workload.decode_steps * per_step)
    assert per_step < 0.001 * VOCAB * ROW / DISK_RATE  # the table: 0.53 s


def test_the_process_holds_the_rows_of_the_prompt_not_the_table() -> None:
    """The RAM a disk embedding takes while it computes: the rows its largest forward (the prompt, 2 x 64 rows) asks
    for; a layer read from disk maps all its weights; a prompt that asks for the table holds the table."""
    ctx = _ctx(Workload(batch_size=2, prompt_len=64, new_tokens=16))
    embed, layer = ctx.graph.unit("embed"), ctx.graph.unit("layer")
    assert price_option(ctx, embed, "disk", "cpu", "stream").stream_buffer_bytes == 128 * ROW
    assert price_option(ctx, layer, "disk", "cpu", "stream").stream_buffer_bytes == layer.weight_bytes
    long = _ctx(Workload(batch_size=16, prompt_len=8192, new_tokens=16))  # more rows than the table's share
    assert price_option(long, embed, "disk", "cpu", "stream").stream_buffer_bytes == embed.weight_bytes


def test_a_prompt_asks_for_its_rows_until_the_whole_table_reads_faster() -> None:
    """128 prompt tokens: 128 small reads. From the number of rows whose reads take as long as the table's one read
    on: the table, whatever more rows the call has."""
    ctx = _ctx(Workload(batch_size=1, prompt_len=128, new_tokens=1))
    embed = ctx.graph.unit("embed")
    assert lookup_read_s(ctx, embed, "disk", "cpu", 128) == pytest.approx(128 * (LATENCY_S + ROW / RANDOM_RATE))
    whole = LATENCY_S + VOCAB * ROW / RANDOM_RATE
    even = whole / (LATENCY_S + ROW / RANDOM_RATE)  # rows whose reads take the table's time: 8/9 of the table here
    assert not asks_whole_table(ctx.machine, int(even) - 1, ROW, VOCAB * ROW)
    assert asks_whole_table(ctx.machine, int(even) + 1, ROW, VOCAB * ROW)
    for rows in (int(even) + 1, 10**7):
        assert lookup_read_s(ctx, embed, "disk", "cpu", rows) == pytest.approx(whole)
    slow = _ctx(Workload(), latency=1e-3)  # a disk of 1 ms a read: the table wins at a tenth of its rows
    assert asks_whole_table(slow.machine, VOCAB // 10, ROW, VOCAB * ROW)


def test_only_a_lookup_computed_on_the_cpu_from_disk_is_priced_by_its_rows() -> None:
    """A GPU copies the whole table; RAM reads nothing from disk; a layer reads all its weights: None (the whole
    copy)."""
    ctx = _ctx(Workload())
    embed, layer = ctx.graph.unit("embed"), ctx.graph.unit("layer")
    assert lookup_read_s(ctx, layer, "disk", "cpu", 1) is None
    assert lookup_read_s(ctx, embed, "cpu", "cpu", 1) is None
    gpu = Machine([Device("cuda:0", "8GiB"), *_machine().devices])
    assert lookup_read_s(PricingContext(_graph(), gpu, Workload(), None), embed, "disk", "cuda:0", 1) is None


def test_without_measured_scattered_reads_the_nvme_default_and_the_disk_rate_price_them() -> None:
    ctx = PricingContext(_graph(), _machine(latency=None, rate=None), Workload(), None)
    assert lookup_read_s(ctx, ctx.graph.unit("embed"), "disk", "cpu", 1) == pytest.approx(100e-6 + ROW / DISK_RATE)


@given(rows=st.integers(1, 10**6), more=st.integers(0, 10**6), latency=st.floats(1e-6, 0.05),
       vocab=st.integers(1, 300_000), row=st.sampled_from([256, 4096, 8192, 16384]))
def test_rows_cost_the_cheaper_of_a_read_each_and_the_whole_table_and_more_rows_never_less(rows, more, latency, vocab,
                                                                                           row) -> None:
    graph = chain_graph([{"name": "embed", "param_bytes": vocab * row, "out_bytes_per_token": row}])
    ctx = PricingContext(graph, _machine(latency), Workload(), None)
    embed = graph.unit("embed")
    few, many = (lookup_read_s(ctx, embed, "disk", "cpu", n) for n in (rows, rows + more))
    distinct = min(rows, vocab)
    each = distinct * (latency + max(row, PAGE_BYTES) / RANDOM_RATE)
    whole = latency + vocab * row / RANDOM_RATE
    assert few == pytest.approx(min(each, whole))
    assert few <= many * (1 + 1e-12)
    assert few >= latency  # one read at least


def test_the_plan_keeps_layers_in_ram_and_reads_a_large_embedding_from_disk() -> None:
    """RAM for the layers or the embedding, not both: a decode step reads a row of the embedding from disk, where a
    layer on disk would be read whole every step, so the embedding goes to disk."""
    graph = chain_graph([{"name": "embed", "param_bytes": VOCAB * ROW, "out_bytes_per_token": ROW},
                         *({"name": f"layer{i}", "param_bytes": 2**28, "flops_per_token": 2**29,
                            "out_bytes_per_token": ROW} for i in range(4))], dtype="bfloat16")
    machine = Machine([Device("cpu", 4 * 2**28 + 2**27, flops=1e11, bandwidth=1e10, source="measured"),
                       Device("disk", "1TB", bandwidth=DISK_RATE, source="measured", random_read=RANDOM_RATE,
                              random_read_latency_s=LATENCY_S)])
    plan = placement_opt.solve(graph, machine, workload=Workload(batch_size=1, prompt_len=128, new_tokens=64),
                               time_limit_s=1)
    storage = {p.unit: p.storage for p in plan.placements}
    assert storage["embed"] == "disk" and all(storage[f"layer{i}"] == "cpu" for i in range(4)), storage


EXPERT = 3 * 4096 * 14336 * 2  # one Mixtral-8x7B expert's bytes in bf16
SHARED = 2**28  # attention, norms, router


def _moe_graph(experts: int = 8, top_k: int = 2):
    return chain_graph([{"name": "moe", "param_bytes": SHARED + experts * EXPERT, "flops_per_token": 2**30,
                         "moe_num_experts": experts, "moe_experts_per_token": top_k,
                         "moe_expert_bytes": experts * EXPERT, "out_bytes_per_token": ROW}], dtype="bfloat16")


def test_a_decode_step_reads_the_experts_its_tokens_hit_each_a_small_read() -> None:
    """Batch 1, top-2 of 8: the shared weights, read ahead in order, and two experts, two small reads at the
    scattered rate; the unit streamed the same way in a plan's option costs that per step, against a whole read of
    its weights before."""
    workload = Workload(batch_size=1, prompt_len=64, new_tokens=16)
    ctx = PricingContext(_moe_graph(), _machine(), workload, None)
    moe = ctx.graph.unit("moe")
    read = routed_read_s(ctx, moe, "disk", "cpu", 1)
    assert read == pytest.approx(2 * (LATENCY_S + EXPERT / RANDOM_RATE) + SHARED / DISK_RATE)
    on_disk = price_option(ctx, moe, "disk", "cpu", "stream")
    in_ram = price_option(ctx, moe, "cpu", "cpu", "resident")
    assert on_disk.decode_s - in_ram.decode_s == pytest.approx(workload.decode_steps * read)
    whole = price_option(ctx, moe, "disk", "cpu", "stream_sync")  # accelerate's per-tensor copies: every expert
    assert whole.decode_s - in_ram.decode_s > workload.decode_steps * moe.weight_bytes / DISK_RATE


def test_a_call_of_as_many_tokens_as_experts_reads_them_all() -> None:
    ctx = PricingContext(_moe_graph(), _machine(), Workload(batch_size=8), None)
    moe = ctx.graph.unit("moe")
    assert routed_read_s(ctx, moe, "disk", "cpu", 8) is None  # the whole copy prices it
    assert routed_read_s(ctx, moe, "cpu", "cpu", 1) is None and routed_read_s(ctx, moe, "disk", "cpu", 7) is not None
    dense = PricingContext(_graph(), _machine(), Workload(), None)
    assert routed_read_s(dense, dense.graph.unit("layer"), "disk", "cpu", 1) is None  # a dense layer: never


def test_experts_every_token_runs_are_read_whole() -> None:
    """Experts that run on every token (Llama 4's in transformers: the trace gives them top-k = every expert) are
    read ahead whole by the dispatcher, with no fault per expert: priced as a whole read."""
    ctx = PricingContext(_moe_graph(top_k=8), _machine(), Workload(batch_size=1), None)
    assert routed_read_s(ctx, ctx.graph.unit("moe"), "disk", "cpu", 1) is None


def test_a_routed_decode_read_calibrated_without_its_batch_is_priced_from_the_profile() -> None:
    """A profile saved before calibrations kept the batch of their cold decode steps: its figure cannot say what an
    expert's read costs, so the decode's routed read comes from the profile; the prefill keeps the calibration."""
    from placement_opt.cost.calibrated import Calibration

    workload = Workload(batch_size=1, prompt_len=64, new_tokens=16)
    graph = _moe_graph()
    calibration = Calibration(copies={"moe": {("disk", "cpu", "stream"): (0.5, 1e-6)}})
    plain, calibrated = (PricingContext(graph, _machine(), workload, c) for c in (None, calibration))
    moe = graph.unit("moe")
    step = routed_read_s(plain, moe, "disk", "cpu", 1)
    for ctx in (plain, calibrated):
        on_disk, in_ram = (price_option(ctx, moe, *option) for option in (("disk", "cpu", "stream"),
                                                                           ("cpu", "cpu", "resident")))
        assert on_disk.decode_s - in_ram.decode_s == pytest.approx(workload.decode_steps * step)
    prefill = price_option(calibrated, moe, "disk", "cpu", "stream").prefill_s
    assert prefill - price_option(calibrated, moe, "cpu", "cpu", "resident").prefill_s == pytest.approx(0.5)


def _calibrated(graph, measured: dict[str, float], batch: int) -> PricingContext:
    """``graph`` priced with cold decode reads of ``measured`` seconds (unit -> s) calibrated at ``batch``."""
    from placement_opt.cost.calibrated import Calibration

    calibration = Calibration(copies={u: {("disk", "cpu", "stream"): (0.5, s)} for u, s in measured.items()},
                              read_batch={u: batch for u in measured})
    return PricingContext(graph, _machine(), Workload(batch_size=batch, prompt_len=64, new_tokens=16), calibration)


def test_a_calibrated_routed_read_costs_per_expert_what_the_dispatcher_measured() -> None:
    """Calibrated at batch 1 (top-2 of 8: two experts a step), the step read the shared weights and 2 experts in
    10 ms more than the shared weights take: each expert costs 5 ms, so batch 1 is priced at the measured step and
    batch 4, hitting 8 x (1 - 0.75^4) = 5.47 experts, at the shared weights plus 5.47 x 5 ms; the profile's
    scattered rate is not used."""
    shared_s = SHARED / DISK_RATE
    ctx = _calibrated(_moe_graph(), {"moe": shared_s + 0.010}, batch=1)
    moe = ctx.graph.unit("moe")
    assert routed_read_s(ctx, moe, "disk", "cpu", 1) == pytest.approx(shared_s + 0.010)
    assert routed_read_s(ctx, moe, "disk", "cpu", 4) == pytest.approx(shared_s + 5.46875 * 0.005)
    on_disk, in_ram = (price_option(ctx, moe, *o) for o in (("disk", "cpu", "stream"), ("cpu", "cpu", "resident")))
    assert on_disk.decode_s - in_ram.decode_s == pytest.approx(ctx.workload.decode_steps * (shared_s + 0.010))


def test_a_calibration_whose_steps_read_every_expert_leaves_the_routed_read_to_the_profile() -> None:
    """Steps of as many tokens as experts read them all ahead (no read per expert to take from them)."""
    graph = _moe_graph()
    plain = PricingContext(graph, _machine(), Workload(batch_size=1), None)
    ctx = _calibrated(graph, {"moe": 0.030}, batch=8)
    moe = graph.unit("moe")
    assert routed_read_s(ctx, moe, "disk", "cpu", 1) == pytest.approx(routed_read_s(plain, moe, "disk", "cpu", 1))


@given(experts=st.integers(2, 64), top_k=st.integers(1, 8), groups=st.integers(1, 8), batch=st.integers(1, 63),
       more=st.integers(0, 63), seconds=st.floats(0.0, 1.0))
def test_a_calibrated_routed_read_gives_back_its_measurement_and_grows_with_the_batch(experts, top_k, groups, batch,
                                                                                      more, seconds) -> None:
    """Each unit (the whole experts or a group of them) priced at its calibration's batch is priced at what it
    measured there, whenever that covers its shared weights; more tokens never read for less."""
    from placement_opt.model.expert_groups import split_expert_units

    top_k, groups = min(top_k, experts), min(groups, experts)
    name = "model.layers.0.mlp.experts"
    graph = chain_graph([{"name": name, "param_bytes": SHARED + experts * EXPERT, "flops_per_token": 2**30,
                          "moe_num_experts": experts, "moe_experts_per_token": top_k,
                          "moe_expert_bytes": experts * EXPERT, "out_bytes_per_token": ROW}], dtype="bfloat16")
    if groups > 1:
        graph = split_expert_units(graph, groups, [name])
    measured = {u.name: seconds + (u.weight_bytes - u.moe_expert_bytes) / DISK_RATE for u in graph.units()}
    ctx = _calibrated(graph, measured, batch)
    for unit in graph.units():
        at, above = (routed_read_s(ctx, unit, "disk", "cpu", rows) for rows in (batch, batch + more))
        if batch >= experts or top_k == experts:  # read whole: no routed read to price
            assert at is None
            continue
        assert at == pytest.approx(measured[unit.name], rel=1e-9, abs=1e-15)
        assert above is None or above >= at * (1 - 1e-12)


@given(experts=st.integers(2, 64), top_k=st.integers(1, 8), groups=st.integers(2, 8), rows=st.integers(1, 63))
def test_a_layers_expert_groups_read_together_what_the_whole_experts_unit_reads(experts, top_k, groups, rows) -> None:
    """Cut into groups (``trace(expert_groups=...)``), a layer's experts read the router's picks among each group's
    rows (``runtime._routed_reads``): each group its share of the experts hit, latencies included, so the groups' reads
    add up to the whole unit's; a group of ``k`` of the ``E`` experts reads ``k / E`` of it."""
    from placement_opt.model.expert_groups import group_ranges, split_expert_units

    top_k, groups = min(top_k, experts), min(groups, experts)
    graph = chain_graph([{"name": "model.layers.0.mlp.experts", "param_bytes": experts * EXPERT,
                          "flops_per_token": 2**30, "moe_num_experts": experts, "moe_experts_per_token": top_k,
                          "moe_expert_bytes": experts * EXPERT, "out_bytes_per_token": ROW}], dtype="bfloat16")
    cut = split_expert_units(graph, groups, ["model.layers.0.mlp.experts"])
    whole_ctx, cut_ctx = (PricingContext(g, _machine(), Workload(), None) for g in (graph, cut))
    whole = routed_read_s(whole_ctx, graph.unit("model.layers.0.mlp.experts"), "disk", "cpu", rows)
    parts = [routed_read_s(cut_ctx, cut.unit(f"model.layers.0.mlp.experts.groups.{i}"), "disk", "cpu", rows)
             for i in range(groups)]
    if rows >= experts or top_k == experts:  # a prompt, or every expert runs: read whole, groups and unit alike
        assert whole is None and parts == [None] * groups
        return
    assert sum(parts) == pytest.approx(whole, rel=1e-9)
    for part, (start, end) in zip(parts, group_ranges(experts, groups), strict=True):
        assert part == pytest.approx(whole * (end - start) / experts, rel=1e-6)


@given(rows=st.integers(1, 63), more=st.integers(0, 63), experts=st.integers(2, 64), top_k=st.integers(1, 8))
def test_more_tokens_read_more_experts_and_pay_a_small_read_for_each(rows, more, experts, top_k) -> None:
    top_k = min(top_k, experts)
    ctx = PricingContext(_moe_graph(experts, top_k), _machine(), Workload(), None)
    moe = ctx.graph.unit("moe")
    few, many = routed_read_s(ctx, moe, "disk", "cpu", rows), routed_read_s(ctx, moe, "disk", "cpu", rows + more)
    if few is None:
        assert rows >= experts or top_k == experts
        return
    hit = expected_experts(experts, top_k, rows)
    assert few == pytest.approx(hit * (LATENCY_S + EXPERT / RANDOM_RATE) + SHARED / DISK_RATE, rel=1e-9)
    assert many is None or many >= few * (1 - 1e-12)
