"""Sublayer units whose own forward the model never calls (their parent uses their weights through other
methods): the dispatcher copies a unit's weights when its forward is called, so a plan that streams such a unit
or stores it away from the home device would leave its weights where they are stored. They are pinned home."""

from __future__ import annotations

import warnings

import pytest
import transformers

import placement_opt
from placement_opt import Workload, trace
from placement_opt.cost.build import build_problem, run_as_glue
from placement_opt.errors import InfeasiblePlacementError
from placement_opt.model.catalog import model_config
from placement_opt.model.graph import LayerGraph

DEVICES = "cuda:0=2MiB,cpu=64GiB,disk=1TB"


def jetmoe(layers: int = 2) -> transformers.JetMoeConfig:
    return transformers.JetMoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                     num_key_value_heads=2, kv_channels=16, num_local_experts=4, num_experts_per_tok=2)


def _trace(config, granularity: str) -> LayerGraph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace(config, granularity=granularity)


def test_jetmoe_s_attention_experts_and_gemma_3n_s_altup_are_glue_and_nothing_else_is() -> None:
    """JetMoE calls its attention experts' map() and reduce(); Gemma-3n's layers call altup's predict() and
    correct(): the trace counts no op of their own forward. Every other unit ran (replayed layers included)."""
    assert run_as_glue(_trace(jetmoe(), "sublayer")) == ["model.layers.0.self_attention.experts",
                                                          "model.layers.1.self_attention.experts"]
    gemma = transformers.Gemma3nTextConfig(num_hidden_layers=4, num_kv_shared_layers=2)
    gemma.layer_types = list(gemma.layer_types)[:4]
    assert run_as_glue(_trace(gemma, "sublayer")) == [f"model.layers.{i}.altup" for i in range(4)]
    for name in ("mixtral-8x7b", "llama-3-8b"):
        config = model_config(name)
        config.num_hidden_layers = 2
        assert run_as_glue(_trace(config, "sublayer")) == []
    assert run_as_glue(_trace(jetmoe(), "block")) == []


def test_a_graph_saved_without_op_counts_marks_no_unit() -> None:
    data = _trace(jetmoe(), "sublayer").to_dict()
    for node in data["nodes"]:
        node.pop("ops_per_forward", None)
    assert run_as_glue(LayerGraph.from_dict(data)) == []


def test_glue_units_are_solved_resident_on_home_whatever_the_pins_and_the_plan_says_so() -> None:
    graph = _trace(jetmoe(), "sublayer")
    glue = run_as_glue(graph)
    problem = build_problem(graph, DEVICES, Workload())
    assert {problem.pins[n] for n in glue} == {"cuda:0"}
    for pins in ({}, {"model.layers.1": "cpu"}):
        plan = placement_opt.solve(graph, DEVICES, workload=Workload(), pins=pins)
        placed = {p.unit: (p.storage, p.execution, p.mode) for p in plan.placements}
        assert all(placed[n] == ("cuda:0", "cuda:0", "resident") for n in glue)
        assert any("their own forward" in note and "cuda:0" in note for note in plan.notes)
        if pins:  # the rest of the pinned layer went where it was pinned
            assert placed["model.layers.1.mlp"][0] == "cpu"
            assert any("stored where pinned" in note for note in plan.notes)


def test_a_home_too_small_for_them_is_said_and_what_to_do() -> None:
    with pytest.raises(InfeasiblePlacementError, match=r"kept on the home device cuda:0.*granularity='block'"):
        placement_opt.solve(_trace(jetmoe(), "sublayer"), "cuda:0=20KiB,cpu=64GiB,disk=1TB", workload=Workload())


def test_a_fill_strategy_that_stores_glue_off_home_says_the_plan_cannot_run_as_placed() -> None:
    """The accelerate-like fills know no pins: sequential stored JetMoE's attention experts on the disk while the
    plan's note said they were kept on the home device. The note now says what the fill did, and the cure."""
    graph = _trace(jetmoe(), "sublayer")
    glue = run_as_glue(graph)
    plan = placement_opt.solve(graph, "cuda:0=200KiB,cpu=200KiB,disk=1TB", workload=Workload(), strategy="sequential")
    placed = {p.unit: p.storage for p in plan.placements}
    assert any(placed[n] != "cuda:0" for n in glue)  # the case the note is for
    (note,) = [n for n in plan.notes if "their own forward" in n]
    assert "kept on the home device" not in note and "strategy='cpsat' keeps them there" in note
