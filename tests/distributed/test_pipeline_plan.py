"""plan_pipeline: stages over a cluster priced by the cost model, cut by the exact stage program."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import placement_opt as po
from placement_opt.cost.workload import Workload
from placement_opt.distributed.pipeline_plan import (
    PipelinePlan,
    crossing_bytes_per_token,
    layer_count_cuts,
    plan_pipeline,
    stage_problem,
)
from placement_opt.errors import (
    DeviceSpecError,
    InfeasiblePlacementError,
    PlanFormatError,
    SolverInputError,
)
from placement_opt.model.graph import chain_graph
from placement_opt.solver.stages import stage_memory_bytes, stage_time_ns

MIB = 2**20


def _decoder(layers: int = 8, layer_mib: int = 200, hidden_bytes: int = 8192, head_bytes: int = 64000,
             dtype: str = "float16"):
    """embed, a parameter-free rotary unit feeding every layer, the layers, norm, head."""
    units = [{"name": "embed", "param_bytes": 250 * MIB, "flops_per_token": 1000, "out_bytes_per_token": hidden_bytes,
              "module_class": "Embedding"},
             {"name": "rotary", "out_bytes_per_token": 256, "module_class": "Rotary"}]
    units += [{"name": f"layers.{i}", "param_bytes": layer_mib * MIB, "flops_per_token": 2 * layer_mib * MIB // 2,
               "out_bytes_per_token": hidden_bytes, "module_class": "DecoderLayer"} for i in range(layers)]
    units += [{"name": "norm", "param_bytes": 8192, "flops_per_token": 10_000, "out_bytes_per_token": hidden_bytes,
               "module_class": "Norm"},
              {"name": "head", "param_bytes": 250 * MIB, "flops_per_token": 250 * MIB, "out_bytes_per_token": head_bytes,
               "module_class": "Linear"}]
    chain = ["embed", *[f"layers.{i}" for i in range(layers)], "norm", "head"]
    edges = [(a, b, hidden_bytes) for a, b in zip(chain, chain[1:], strict=False)]
    edges += [("rotary", f"layers.{i}", 256) for i in range(layers)]
    return chain_graph(units, edges=edges, dtype=dtype)


def test_rotary_tables_never_cross_a_cut() -> None:
    graph = _decoder(layers=3)
    crossing = crossing_bytes_per_token(graph)
    # cut j sits before unit j: embed | rotary | layers.0 ... every inner cut carries the hidden state only.
    assert crossing == [0, 8192, 8192, 8192, 8192, 8192, 8192, 0]


def test_a_faster_rank_gets_more_layers_and_beats_the_layer_count_split() -> None:
    graph = _decoder()
    plan = plan_pipeline(graph, "(h100-sxm)+(t4)@ib-200g", Workload(batch_size=1, prompt_len=1024))
    fast, slow = (sum(u.startswith("layers.") for u in s.units) for s in plan.stages)
    assert fast > slow
    assert plan.layer_count_s is not None and plan.objective_s < plan.layer_count_s
    assert plan.bound_s == plan.objective_s and plan.gap == 0.0 and plan.status == "OPTIMAL"
    assert [s.host for s in plan.stages] == [0, 1] and plan.stages[1].device == "cuda:0 (t4)"
    assert plan.stages[1].local_device == "cuda:0"


def test_the_network_is_priced_between_hosts_only() -> None:
    graph = _decoder()
    workload = Workload(batch_size=1, prompt_len=1024)
    one_host = plan_pipeline(graph, "(a10*2)@eth-10g", workload)
    two_hosts = plan_pipeline(graph, "2x(a10)@eth-10g", workload)
    assert one_host.stages[0].send_s < two_hosts.stages[0].send_s
    # 1024 tokens x 8192 bytes over 1 GB/s + 50 us, once (forward only)
    assert two_hosts.stages[0].send_s == pytest.approx(1024 * 8192 / 1e9 + 50e-6, rel=1e-6)
    train = plan_pipeline(graph, "2x(a10)@eth-10g", dataclasses.replace(workload, training=True, optimizer="sgd"))
    assert train.stages[0].send_s == pytest.approx(2 * two_hosts.stages[0].send_s, rel=1e-6)


def test_gpipe_keeps_every_micro_batch_in_flight_1f1b_does_not() -> None:
    graph = _decoder(layers=4, layer_mib=100, hidden_bytes=512, head_bytes=512)
    workload = Workload(batch_size=4, prompt_len=2048, training=True, optimizer="sgd")
    roomy = "2x(l4)@ib-100g"
    one_f = plan_pipeline(graph, roomy, workload, schedule="1f1b", n_microbatches=16)
    gpipe = plan_pipeline(graph, roomy, workload, schedule="gpipe", n_microbatches=16)
    peak_1f, peak_gp = (max(s.memory_bytes for s in p.stages) for p in (one_f, gpipe))
    # 16 micro-batches' saved activations (8192 tokens x 512 bytes x 17 per layer each) against 2.
    assert peak_gp - peak_1f > 14 * 8192 * 512 * 17
    between = (peak_1f + peak_gp) // 2 + 2**30  # + the GPU's 1 GiB reserve
    tight = f"2x(l4={between})@ib-100g"
    assert max(s.memory_bytes for s in plan_pipeline(graph, tight, workload, n_microbatches=16).stages) <= between
    with pytest.raises(InfeasiblePlacementError, match="stage|split"):
        plan_pipeline(graph, tight, workload, schedule="gpipe", n_microbatches=16)


def test_solve_with_a_cluster_is_the_pipeline_plan_and_round_trips() -> None:
    graph = _decoder()
    cluster = po.Cluster.from_spec("(a100-40gb*2)+(l4*2)@ib-100g")
    plan = po.solve(graph, cluster, "throughput", workload=Workload(prompt_len=256))
    assert plan == plan_pipeline(graph, cluster, Workload(prompt_len=256))
    assert plan.n_microbatches == 4 and plan.schedule == "1f1b"
    assert PipelinePlan.from_json(plan.to_json()) == plan
    assert plan.stage_of_rank(3).units[-1] == "head"
    with pytest.raises(SolverInputError, match="objective='throughput'"):
        po.solve(graph, cluster)
    with pytest.raises(PlanFormatError, match="not a pipeline plan"):
        PipelinePlan.from_json('{"version": 1}')
    # a spec string is a cluster to solve() as it is to plan_pipeline(); what is neither is named
    assert po.solve(graph, "(a100-40gb*2)+(l4*2)@ib-100g", "throughput", workload=Workload(prompt_len=256)) == plan
    # without parentheses too, as plan_pipeline() reads it (solve() called it an unknown device name)
    for bare in ("2xa10@ib-200g", "2xa10", "a10+a10"):  # the last two on the default network
        assert po.solve(graph, bare, "throughput", workload=Workload(prompt_len=256)) == plan_pipeline(
            graph, bare, Workload(prompt_len=256))
    # the default modes in another order are the default modes, not a choice a cluster cannot take
    assert po.solve(graph, cluster, "throughput", workload=Workload(prompt_len=256),
                    modes=("phased", "stream", "resident")) == plan
    for wrong in (None, {"cpu": "1GiB"}, ["cpu"]):
        with pytest.raises(SolverInputError, match=f"cluster is a {type(wrong).__name__}: pass a Cluster"):
            plan_pipeline(graph, wrong)
    # one machine's arguments were dropped without a word
    with pytest.raises(SolverInputError, match="strategy, pins, granularity shape one machine's plan"):
        po.solve(graph, cluster, "throughput", strategy="balanced", pins={"head": "cpu"}, granularity="sublayer")
    # the stages are an exact search: a time limit, seed, gap or worker count was dropped as silently
    with pytest.raises(SolverInputError, match="time_limit_s, workers shape one machine's plan"):
        po.solve(graph, cluster, "throughput", time_limit_s=5, workers=1)


def test_bad_arguments() -> None:
    graph = _decoder(layers=1)
    with pytest.raises(SolverInputError, match="schedule"):
        plan_pipeline(graph, "(a10*2)", schedule="zb")
    with pytest.raises(SolverInputError, match="n_microbatches >= 2"):
        plan_pipeline(graph, "(a10*2)", n_microbatches=1)
    with pytest.raises(SolverInputError, match="5 units but the cluster has 8 ranks"):
        plan_pipeline(graph, "(a10*8)")


def test_layer_count_cuts_share_the_layers_evenly() -> None:
    graph = _decoder(layers=10)
    cuts = layer_count_cuts(graph, 4)
    names = graph.names()
    per_stage = [sum(n.startswith("layers.") for n in names[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    assert per_stage == [3, 3, 2, 2] and names[cuts[0]] == "embed" and cuts[-1] == len(names)


@pytest.mark.parametrize("granularity", ["sublayer", "module"])
def test_layer_count_cuts_of_a_graph_of_parts_fall_between_layers(granularity: str) -> None:
    """A sublayer graph's most common class was LlamaRMSNorm (two a layer), a module graph's Linear (seven): the
    split it compared against cut layers apart. Each stage now starts at a layer's first unit."""
    from _models import tiny
    from placement_opt.model.tracer import trace

    graph = trace(tiny("llama"), granularity=granularity)
    units = graph.units()
    for stages in (2, 3, 4):
        cuts = layer_count_cuts(graph, stages)
        assert all(units[c].name.endswith(".input_layernorm") for c in cuts[1:-1]), [units[c].name for c in cuts]
        layers = [sum(1 for u in units[a:b] if u.name.endswith(".post_attention_layernorm"))
                  for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        assert sum(layers) == 4 and max(layers) - min(layers) <= 1, layers


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(["h100-sxm", "a100-40gb", "l4", "t4", "a10"]), min_size=2, max_size=4),
       st.integers(1, 4), st.booleans())
def test_the_plan_is_never_slower_than_the_layer_count_split(gpus: list[str], batch: int, gpipe: bool) -> None:
    graph = _decoder(layers=6)
    spec = "+".join(f"({g})" for g in gpus) + "@eth-25g"
    workload = Workload(batch_size=batch, prompt_len=512)
    schedule = "gpipe" if gpipe else "1f1b"
    plan = plan_pipeline(graph, spec, workload, schedule=schedule)
    problem = stage_problem(graph, po.Cluster.from_spec(spec), workload, schedule, len(gpus))
    even = layer_count_cuts(graph, len(gpus))
    even_s = max(stage_time_ns(problem, k, a, b) for k, (a, b) in enumerate(zip(even[:-1], even[1:], strict=True)))
    assert plan.objective_s <= even_s / 1e9 + 1e-12
    assert [u for s in plan.stages for u in s.units] == graph.names()


@pytest.mark.parametrize("edit", [
    lambda d: "null", lambda d: "42",
    lambda d: {**d, "schedule": "zb"},  # pipeline() ran it as 1F1B
    lambda d: {**d, "n_microbatches": 0}, lambda d: {**d, "n_microbatches": "8"},
    lambda d: {**d, "stages": []},  # summary() raised a ValueError
    lambda d: {**d, "stages": [{**d["stages"][0], "units": []}, *d["stages"][1:]]},  # an IndexError
    lambda d: {**d, "stages": [d["stages"][0], {**d["stages"][1], "units": d["stages"][0]["units"]}]},
    lambda d: {**d, "stages": [{**d["stages"][0], "compute_s": float("nan")}, *d["stages"][1:]]},
    # read, then summary() raised a TypeError comparing text with numbers
    lambda d: {**d, "bound_s": "fast"}, lambda d: {**d, "layer_count_s": "1"},
    lambda d: {**d, "stages": [{**d["stages"][0], "memory_bytes": "3GiB"}, *d["stages"][1:]]},
    lambda d: {**d, "stages": [{**d["stages"][0], "capacity_bytes": None}, *d["stages"][1:]]},
    # read as its letters, one unit each
    lambda d: {**d, "stages": [{**d["stages"][0], "units": "head"}, *d["stages"][1:]]},
    # pipeline() on rank 1 said "rank 1 has no stage: launch as many processes as the plan has stages"
    lambda d: {**d, "stages": [d["stages"][0], {**d["stages"][1], "rank": 0}]},
    lambda d: {**d, "stages": [{**d["stages"][0], "rank": "0"}, *d["stages"][1:]]},
    lambda d: {**d, "stages": [d["stages"][0], {**d["stages"][1], "stage": True}]},
    lambda d: {**d, "stages": [{**d["stages"][0], "host": -1}, *d["stages"][1:]]},
    lambda d: {**d, "stages": [{**d["stages"][0], "local_rank": None}, *d["stages"][1:]]},
    # pipeline() raised an AttributeError (local_device split it), or torch.device() a RuntimeError
    lambda d: {**d, "stages": [{**d["stages"][0], "device": 0}, *d["stages"][1:]]},
    lambda d: {**d, "stages": [{**d["stages"][0], "device": "gpu0 (a100-40gb)"}, *d["stages"][1:]]},
    # step_s raised an OverflowError
    lambda d: {**d, "n_microbatches": 10**400},
    # plan_pipeline() refuses it: pipeline() builds a causal mask only
    lambda d: {**d, "workload": {**d["workload"], "padded": True}},
    # summary() printed them as they were; a step of 1e308-second stages was infinite
    lambda d: {**d, "model_name": 7}, lambda d: {**d, "status": None}, lambda d: {**d, "cluster_spec": ["(a10*2)"]},
    lambda d: {**d, "stages": [{**d["stages"][0], "compute_s": 1e308}, *d["stages"][1:]]},
], ids=["null", "number", "schedule", "no micro-batches", "micro-batches text", "no stages", "empty stage",
        "units twice", "nan time", "bound text", "layer-count text", "memory text", "capacity null", "units text",
        "rank of another stage", "rank text", "stage bool", "host negative", "local rank null", "device number",
        "device unknown", "micro-batches huge", "padded", "name number", "status null", "cluster list",
        "step infinite"])
def test_a_pipeline_plan_edited_into_nonsense_is_a_plan_format_error(edit) -> None:
    import json

    plan = po.solve(_decoder(), po.Cluster.from_spec("(a100-40gb*2)"), "throughput", workload=Workload(prompt_len=64))
    edited = edit(json.loads(plan.to_json()))
    with pytest.raises(PlanFormatError, match="not a pipeline plan"):
        PipelinePlan.from_json(edited if isinstance(edited, str) else json.dumps(edited))


def test_a_tied_output_head_holds_its_copy_on_its_stage_and_is_not_trained_across_stages() -> None:
    """The tracer counts a tied tensor once, on the embedding; pipeline() reads the head's copy on the last stage, so
    a stage problem of several ranks counts it there (gemma-2-9b's last stage was 1.71 GiB short). Training such a
    plan was refused only when pipeline() ran it."""
    graph = po.trace("gpt2-xl")
    embed, head = graph.meta.tied_unit_groups[0]
    names = graph.names()
    cluster = po.Cluster.from_spec("(a100-40gb*2,cpu)", dtype=graph.meta.dtype)
    two = stage_problem(graph, cluster, Workload(prompt_len=64), "gpipe", 2)
    one = stage_problem(graph, po.Cluster.from_spec("(a100-40gb)"), Workload(prompt_len=64), "gpipe", 1)
    assert graph.unit(head).param_bytes == 0 < graph.unit(embed).param_bytes
    assert two.stored_bytes[1][names.index(head)] >= graph.unit(embed).param_bytes  # its own copy
    assert one.stored_bytes[0][names.index(head)] < graph.unit(embed).param_bytes  # one stage shares the one tensor
    plan_pipeline(graph, cluster, Workload(prompt_len=64))  # the forward plans
    with pytest.raises(SolverInputError, match=r"ties weights between stages \(transformer.wte and lm_head\)"):
        plan_pipeline(graph, cluster, Workload(prompt_len=64, training=True))


def test_a_stage_holding_two_units_of_one_tied_tensor_counts_it_once() -> None:
    """t5-11b's embedding is tied across the encoder's, the decoder's and the output head: the tracer counts it on
    the encoder's, and each stage that holds one of the others loads it. A stage holding the decoder's embedding and
    the head loads it once; every unit that counts it was charged it, twice there."""
    units = [{"name": "enc.embed", "param_bytes": 64 * MIB, "flops_per_token": 1000, "out_bytes_per_token": 100},
             {"name": "enc.layer", "param_bytes": MIB, "flops_per_token": 1000, "out_bytes_per_token": 100},
             {"name": "dec.embed", "flops_per_token": 1000, "out_bytes_per_token": 100},
             {"name": "dec.layer", "param_bytes": MIB, "flops_per_token": 1000, "out_bytes_per_token": 100},
             {"name": "head", "flops_per_token": 1000, "out_bytes_per_token": 100}]
    edges = [("enc.embed", "enc.layer", 100), ("enc.layer", "dec.layer", 100), ("dec.embed", "dec.layer", 100),
             ("dec.layer", "head", 100)]
    graph = chain_graph(units, edges=edges, tied_unit_groups=(("enc.embed", "dec.embed", "head"),))
    problem = stage_problem(graph, po.Cluster.from_spec("(a10*2)"), Workload(prompt_len=16), "gpipe", 1)
    assert problem.shared_bytes == (((0, 2, 4), 64 * MIB),)

    def held(k, a, b):  # what stage k loads of units a .. b-1: their own bytes as traced (the tensor on the
        copies = sum(i in (2, 4) for i in range(a, b))  # encoder's embedding), and the tensor for the others once
        return sum(problem.stored_bytes[k][a:b]) - 64 * MIB * copies + (64 * MIB if copies and a > 0 else 0)

    for a, b in [(2, 5), (0, 3), (0, 5), (1, 3), (3, 5), (4, 5), (1, 2)]:
        extra = stage_memory_bytes(problem, 1, a, b) - held(1, a, b)
        assert extra == max(problem.peak_bytes[1][a:b]) + problem.in_bytes[1][a] + problem.out_bytes[1][b], (a, b)


def test_a_workload_that_is_not_a_workload_is_a_solver_input_error() -> None:
    """A dict reached dataclasses.replace, which raised a TypeError; solve() says the same for one machine."""
    for wrong in ({"batch_size": 2}, 4):
        with pytest.raises(SolverInputError, match=f"workload must be a placement_opt.Workload, got "
                                                   f"{type(wrong).__name__}"):
            plan_pipeline(_decoder(layers=2), "(a10*2)", wrong)
        with pytest.raises(SolverInputError, match="workload must be a placement_opt.Workload"):
            po.solve(_decoder(layers=2), "(a10*2)", "throughput", workload=wrong)


def test_the_last_stage_holds_every_micro_batchs_output_and_its_merged_copy() -> None:
    """step() keeps the last stage's output of every micro-batch and returns them merged (torch.cat): llama-3-8b's
    logits of 16 micro-batches of 8192 tokens (2 GiB each) were not counted, and an A100-40GB's last stage was
    planned at 10 GiB."""
    graph = _decoder(layers=4, layer_mib=100, hidden_bytes=512, head_bytes=64000)
    workload = Workload(batch_size=2, prompt_len=1024)
    tokens = 2 * 1024
    problem = stage_problem(graph, po.Cluster.from_spec("(l4*2)"), workload, "gpipe", 8)
    n = len(graph)
    assert problem.out_bytes[1] == (0,) * n + (2 * 8 * tokens * 64000,)
    few, many = (plan_pipeline(graph, "(l4*2)", workload, schedule="gpipe", n_microbatches=m) for m in (2, 8))
    assert many.stages[1].memory_bytes - few.stages[1].memory_bytes >= 2 * 6 * tokens * 64000
    with pytest.raises(InfeasiblePlacementError, match=r"last stage \(rank 1, cuda:1\) holds the outputs of all "
                                                       r"64 micro-batches"):
        plan_pipeline(graph, "(l4*2)", Workload(batch_size=8, prompt_len=1024), schedule="gpipe", n_microbatches=64)


def test_a_tied_unit_within_the_chain_sends_its_output_across_a_cut() -> None:
    """t5-11b's decoder embedding counts no bytes of its own (tied to the encoder's) but is no rotary table: its output
    reaches the next layer only over the cut between them, which was priced at nothing."""
    units = [{"name": "enc.embed", "param_bytes": MIB, "out_bytes_per_token": 100},
             {"name": "enc.layer", "param_bytes": MIB, "out_bytes_per_token": 100},
             {"name": "dec.embed", "out_bytes_per_token": 100},
             {"name": "dec.layer", "param_bytes": MIB, "out_bytes_per_token": 100}]
    edges = [("enc.embed", "enc.layer", 100), ("enc.layer", "dec.layer", 100), ("dec.embed", "dec.layer", 100)]
    graph = chain_graph(units, edges=edges, tied_unit_groups=(("enc.embed", "dec.embed"),))
    assert crossing_bytes_per_token(graph) == [0, 100, 100, 200, 0]


def test_a_generation_workload_keeping_the_last_logits_is_priced_as_the_whole_sequence_it_runs() -> None:
    """A stage module computes the head at every position; logits="last" priced it for one token a sequence."""
    graph = _decoder(layers=2, head_bytes=64000)
    graph.meta.extra["logits_unit"] = "head"  # as the tracer marks it
    plans = [plan_pipeline(graph, "(a10*2)", Workload(batch_size=4, prompt_len=1024, new_tokens=64, logits=kept))
             for kept in ("last", "all", None)]
    assert plans[0].stages[1].memory_bytes == plans[1].stages[1].memory_bytes  # 4 x 1024 logits, not 4
    assert plans[0] == plans[1] == plans[2]
    assert plans[0].workload.logits is None and plans[0].workload.new_tokens == 0


def test_a_plan_read_back_with_no_time_at_all_still_summarises() -> None:
    """Every stage at 0 s is finite and >= 0, so it reads; summary() then divided the layer-count split by zero."""
    import json

    data = json.loads(plan_pipeline(_decoder(layers=2), "(a10*2)").to_json())
    data["stages"] = [{**s, "compute_s": 0.0, "send_s": 0.0} for s in data["stages"]]
    assert "layer-count split: slowest stage" in PipelinePlan.from_json(json.dumps(data)).summary()


def test_a_rank_its_gpus_reserve_leaves_nothing_of_is_said_in_the_refusal() -> None:
    # '(a10=0.5GiB)' keeps the default 1 GiB reserve: the refusal showed "against 0 B" without saying why
    with pytest.raises(InfeasiblePlacementError, match=r"against 0 B.*hosts 0, 1: cuda:0 has 512.00 MiB, all under "
                                                       r"its 1.00 GiB reserve"):
        plan_pipeline("llama-3-8b", "2x(a10=0.5GiB)")
    with pytest.raises(InfeasiblePlacementError) as plain:  # short for another reason: no reserve note
        plan_pipeline("llama-3-70b", "2x(a10)")
    assert "reserve" not in str(plain.value)


def test_a_padded_workload_is_refused_as_the_cli_refuses_it() -> None:
    """pipeline() builds a causal mask only: a padded plan was accepted here and refused by plan --cluster."""
    with pytest.raises(SolverInputError, match=r"padded=True.*plan with padded=False"):
        plan_pipeline(_decoder(layers=2), "(a10*2)", Workload(batch_size=2, prompt_len=64, padded=True))


def test_a_cluster_spec_string_is_priced_in_the_models_dtype() -> None:
    """A spec string was read at float16 whatever the model: a float32 model's stages were priced at the GPUs' half
    precision rate (llama-2-7b on two A100-80GB: 18.7 ms a micro-batch, against 298 ms at float32), while plan
    --cluster and solve() on one machine read the devices in the model's dtype."""
    graph = _decoder(layers=4, dtype="float32")
    spec = "(a100-80gb*2)"
    as_string = plan_pipeline(graph, spec, Workload(prompt_len=512))
    assert as_string == plan_pipeline(graph, po.Cluster.from_spec(spec, dtype="float32"), Workload(prompt_len=512))
    as_half = plan_pipeline(_decoder(layers=4), po.Cluster.from_spec(spec), Workload(prompt_len=512))
    assert as_string.objective_s > 2 * as_half.objective_s  # the same units at float16's rate


def test_a_cluster_read_for_another_dtype_is_refused_with_the_one_to_read() -> None:
    """A Cluster object carries the dtype its presets were read for (Cluster.from_spec's default, float16): planned
    with a float32 model, its stages were priced at the half-precision rate, 16x fast on tensor cores."""
    graph = _decoder(layers=4, dtype="float32")
    with pytest.raises(DeviceSpecError, match=r"read for float16 and the model is float32.*dtype='float32'"):
        plan_pipeline(graph, po.Cluster.from_spec("(a100-80gb*2)"), Workload(prompt_len=512))
    assert po.Cluster.from_spec("(a100-80gb*2)", dtype="float32").dtype == "float32"


@pytest.mark.parametrize(("read_for", "model"), [("float16", "bfloat16"), ("fp16", "float16"), ("half", "bfloat16"),
                                                 ("bfloat16", "float16"), ("float32", "float32")])
def test_a_cluster_read_for_the_same_precision_plans_as_the_spec_string(read_for: str, model: str) -> None:
    """A preset has two rates, half precision and float32: a cluster read for float16 (from_spec's default) prices a
    bfloat16 model exactly as the spec string read in the model's dtype does, and so do the dtypes' aliases."""
    graph = _decoder(layers=4, dtype=model)
    spec = "(a100-80gb*2)"
    assert (plan_pipeline(graph, po.Cluster.from_spec(spec, dtype=read_for), Workload(prompt_len=512))
            == plan_pipeline(graph, spec, Workload(prompt_len=512)))


@pytest.mark.parametrize("training", [False, True], ids=["forward", "training"])
def test_every_micro_batch_has_its_receive_buffer_whatever_the_schedule(training: bool) -> None:
    """torch.distributed.pipelining allocates a receive buffer for every micro-batch when a step starts (and, training,
    a gradient receive buffer for every one on the sending side); forward only, a stage's fwd_cache keeps every
    micro-batch's output until the next step. Under 1F1B these were priced for the micro-batches in flight only: the
    last of 2 stages, 1 buffer of the 8 a 2-process gloo run holds."""
    graph = _decoder(layers=4, layer_mib=100, hidden_bytes=512, head_bytes=512)
    workload = Workload(batch_size=2, prompt_len=1024, training=training, optimizer="sgd")
    tokens, micro = 2 * 1024, 8
    problem = stage_problem(graph, po.Cluster.from_spec("(l4*2)"), workload, "1f1b", micro)
    cut = 5  # embed, rotary, layers.0 .. layers.2 | layers.3
    assert problem.in_bytes[1][cut] == micro * tokens * 512
    # the sender: outputs awaiting their backward (2 in flight on stage 0 of 2) and a gradient buffer each, training
    assert problem.out_bytes[0][cut] == (2 + micro if training else micro) * tokens * 512


def test_more_micro_batches_than_a_step_holds_is_a_solver_input_error() -> None:
    """10**400 micro-batches raised an OverflowError from the byte counts, through plan --cluster as a traceback."""
    with pytest.raises(SolverInputError, match=r"n_microbatches is 1000.*: it must be an int from 1 to 65536"):
        plan_pipeline(_decoder(layers=2), "(a10*2)", schedule="gpipe", n_microbatches=10**400)
