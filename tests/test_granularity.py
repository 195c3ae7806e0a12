"""solve(granularity=...): what a model is cut into, and "auto", which keeps the better of block and sublayer."""

from __future__ import annotations

import pytest
import torch
import transformers

from placement_opt import Workload, solve, trace
from placement_opt.errors import SolverInputError

WL = Workload(batch_size=1, prompt_len=64, new_tokens=8)


def _mixtral() -> transformers.MixtralConfig:
    # wide enough that the cost model's choices matter; traced on the meta device, never built
    return transformers.MixtralConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                                      num_experts_per_tok=2)


@pytest.mark.parametrize("devices", [{0: "12MiB", "cpu": "1GiB"}, {0: "1GiB", "cpu": "1GiB"}], ids=["small", "large"])
def test_auto_keeps_the_better_of_the_two_plans_each_solved_in_half_the_time(devices):
    config = _mixtral()
    options = {"workload": WL, "time_limit_s": 2.0, "workers": 1}
    auto = solve(config, devices, granularity="auto", **options)
    half = {**options, "time_limit_s": 1.0}
    block = solve(trace(config, granularity="block"), devices, **half)
    sublayer = solve(trace(config, granularity="sublayer"), devices, **half)
    best = min((block, sublayer), key=lambda p: p.objective_value)
    assert auto.objective_value == best.objective_value
    assert [p.unit for p in auto.placements] == [p.unit for p in best.placements]
    assert auto.home == best.home
    [note] = [n for n in auto.notes if n.startswith("granularity auto:")]
    chosen = "block" if best is block else "sublayer"
    assert f"{chosen} units chosen ({len(best.placements)} units" in note
    assert f"{sublayer.objective_value:.4g} s" in note and f"{block.objective_value:.4g} s" in note


def test_explicit_granularity_traces_the_model_at_it():
    config = _mixtral()
    plan = solve(config, {0: "1GiB", "cpu": "1GiB"}, workload=WL, granularity="sublayer")
    names = [p.unit for p in plan.placements]
    assert "model.layers.0.mlp.experts" in names and plan.home == "cuda:0"
    assert [p.unit for p in solve(config, {0: "1GiB", "cpu": "1GiB"}, workload=WL).placements] == \
        trace(config).names()  # None: a model is traced at block granularity, as before


def test_a_model_without_parts_to_split_is_solved_once():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    plan = solve(model, {"cpu": "1GiB"}, workload=Workload(batch_size=1, prompt_len=4, new_tokens=0),
                 granularity="auto")
    assert not any(n.startswith("granularity auto:") for n in plan.notes)


@pytest.mark.parametrize("model, granularity, words", [
    ("graph-block", "sublayer", "a LayerGraph traced at 'block' was given"),
    ("graph-block", "auto", "needs the model itself"),
    ("config", "layer", "granularity 'layer' is not one of block, module, sublayer, auto"),
])
def test_bad_granularities_are_refused_with_what_to_do(model, granularity, words):
    source = trace(_mixtral()) if model == "graph-block" else _mixtral()
    with pytest.raises(SolverInputError, match=words):
        solve(source, {0: "1GiB", "cpu": "1GiB"}, workload=WL, granularity=granularity)


def test_a_graph_with_its_own_granularity_is_accepted():
    graph = trace(_mixtral(), granularity="sublayer")
    plan = solve(graph, {0: "1GiB", "cpu": "1GiB"}, workload=WL, granularity="sublayer", workers=1)
    same = solve(graph, {0: "1GiB", "cpu": "1GiB"}, workload=WL, workers=1)
    assert (plan.placements, plan.objective_value) == (same.placements, same.objective_value)


@pytest.mark.parametrize("gpu", ["2GiB", "3GiB", "40GiB"])
def test_a_plan_says_when_a_layers_parts_stream_together(gpu):
    """The note is there exactly when some layer streams a part, and counts those layers; block plans have none.
    A 4-layer Llama-3-8B shape on an H100 preset: a tight budget streams parts, a roomy one keeps all resident."""
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    devices = f"cuda:0=h100-sxm/{gpu},cpu=64GiB"
    options = {"workload": Workload(batch_size=1, prompt_len=512, new_tokens=32, overlap=True), "time_limit_s": 1.0,
               "workers": 1}
    plan = solve(trace(config, dtype="bfloat16", granularity="sublayer"), devices, **options)
    layers = {p.copy_group for p in plan.placements if p.copy_group and p.mode in ("stream", "phased")}
    assert bool(layers) == (gpu != "40GiB")  # the case streams, or not, as it is meant to
    notes = [n for n in plan.notes if "(copy_group)" in n]
    assert notes == ([f"{len(layers)} layer(s) stream some of their sublayer units (copy_group): placement_opt's "
                      "dispatcher copies a layer's streamed units together, one layer ahead, and the estimate "
                      "assumes it; from_pretrained(device_map=...) would copy each unit when it is called"]
                     if layers else [])
    grouped = "a layer's streamed sublayer units are copied together"
    assert (grouped in plan.explain()) == bool(layers)  # explain() says where the waits are charged
    block = solve(trace(config, dtype="bfloat16"), devices, **options)
    assert all(p.copy_group is None for p in block.placements)
    assert not [n for n in block.notes if "(copy_group)" in n]
    assert grouped not in block.explain()
    assert ("each starts when the streamed unit before it does" in block.explain()) == (block.cost.copy_s > 0)
