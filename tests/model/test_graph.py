"""graph.py: schema checks, JSON round trips (hypothesis) and chain detection."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.model.graph import (
    GRAPH_SCHEMA_VERSION,
    LATENT_NODE_ATTRIBUTES,
    NODE_ATTRIBUTES,
    GraphMeta,
    LayerGraph,
    chain_graph,
)

_INT_KEYS = [k for k, t in NODE_ATTRIBUTES.items() if t is int and k not in ("exec_index", "module_index")]


@st.composite
def _graphs(draw: st.DrawFn) -> LayerGraph:
    n = draw(st.integers(min_value=1, max_value=8))
    units = []
    for i in range(n):
        spec = {"name": f"layers.{i}", "module_class": draw(st.sampled_from(["Block", "Linear", "Embedding"])),
                "in_decode": draw(st.booleans()),
                "param_names": tuple(f"layers.{i}.w{j}" for j in range(draw(st.integers(0, 3))))}
        spec.update({k: draw(st.integers(min_value=0, max_value=2**50)) for k in _INT_KEYS})
        if draw(st.booleans()):  # latent attention's optional figures
            spec.update({k: draw(st.integers(min_value=0, max_value=2**40)) for k in LATENT_NODE_ATTRIBUTES})
        units.append(spec)
    names = [u["name"] for u in units]
    edges = None
    if draw(st.booleans()) and n > 1:  # forward skip edges on top of a chain
        pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=6))
        edges = [(names[a], names[b], draw(st.integers(0, 2**20))) for a, b in pairs if a < b]
    return chain_graph(units, edges=edges, model_name=draw(st.text(max_size=10)),
                       tied_unit_groups=((names[0], names[-1]),) if n > 1 and draw(st.booleans()) else ())


@given(_graphs())
def test_json_round_trip(graph: LayerGraph) -> None:
    graph.validate()
    again = LayerGraph.from_json(graph.to_json())
    assert again.to_dict() == graph.to_dict()
    assert again.meta == graph.meta
    assert again.units() == graph.units()
    assert again.edges() == graph.edges() or sorted(again.edges()) == sorted(graph.edges())


@given(_graphs())
def test_totals_are_sums_of_units(graph: LayerGraph) -> None:
    units = graph.units()
    assert graph.total_param_bytes == sum(u.param_bytes for u in units)
    assert graph.total_flops_per_token == sum(u.flops_per_token for u in units)
    assert [u.exec_index for u in units] == sorted(u.exec_index for u in units)


@given(_graphs(), st.sampled_from(_INT_KEYS), st.integers(min_value=0, max_value=2**50))
def test_unit_views_follow_edits_of_the_networkx_graph(graph: LayerGraph, key: str, value: int) -> None:
    # unit() reuses a UnitInfo while its node is unchanged: an edit through graph.nx must still show
    name = graph.names()[-1]
    before = graph.unit(name)
    graph.nx.nodes[name][key] = value
    assert getattr(graph.unit(name), key) == value
    assert graph.units()[-1] == dataclasses.replace(before, **{key: value})
    graph.nx.nodes[name]["in_decode"] = not before.in_decode
    assert graph.unit(name).in_decode is not before.in_decode


def test_chain_and_not_chain() -> None:
    units = [{"name": n, "out_bytes_per_token": 4} for n in "abc"]
    assert chain_graph(units).is_chain()
    assert chain_graph(units).edges() == [("a", "b", 4), ("b", "c", 4)]
    assert not chain_graph(units, edges=[("a", "b", 1), ("b", "c", 1), ("a", "c", 1)]).is_chain()


def test_validate_lists_every_problem() -> None:
    graph = chain_graph([{"name": "a"}, {"name": "b"}])
    graph.nx.nodes["a"]["param_bytes"] = -1
    graph.nx.nodes["b"]["in_decode"] = 1
    del graph.nx.nodes["b"]["flops_per_token"]
    graph.nx.edges["a", "b"]["bytes_per_token"] = 1.5
    with pytest.raises(ValueError) as info:
        graph.validate()
    message = str(info.value)
    assert "a.param_bytes = -1 is negative" in message
    assert "b: missing ['flops_per_token']" in message
    assert "edge a -> b has no integer bytes_per_token" in message


def test_bool_is_not_an_int() -> None:
    graph = chain_graph([{"name": "a", "param_bytes": True}])
    with pytest.raises(ValueError, match="param_bytes = True is not int"):
        graph.validate()


def test_unknown_schema_version_is_refused() -> None:
    data = chain_graph([{"name": "a"}]).to_dict()
    data["schema_version"] = GRAPH_SCHEMA_VERSION + 1
    with pytest.raises(ValueError, match="re-trace the model"):
        LayerGraph.from_dict(data)


def test_meta_extra_survives_json() -> None:
    graph = chain_graph([{"name": "a"}])
    graph.meta = GraphMeta(model_name="m", dtype="bfloat16", batch_size=2, seq_len=8, traced=True,
                           tied_param_groups=(("a.w", "b.w"),), extra={"num_layers": 3})
    again = LayerGraph.from_json(json.dumps(json.loads(graph.to_json())))
    assert again.meta == graph.meta
    assert again.meta.extra["num_layers"] == 3


def test_covering_key_is_the_longest_prefix_and_keys_below_lists_the_finer_ones():
    from placement_opt.model.graph import covering_key, keys_below

    keys = {"": "cpu", "model.layers": 0, "model.layers.1": 1, "model.layers.1.mlp": "disk"}
    assert covering_key("model.layers.1.mlp.up", keys) == "model.layers.1.mlp"
    assert covering_key("model.layers.10", keys) == "model.layers"  # a prefix of the name, not of the string
    assert covering_key("lm_head", keys) == ""
    assert covering_key("lm_head", {"model": 0}) is None
    below = keys_below(keys)
    assert below["model.layers"] == ["model.layers.1", "model.layers.1.mlp"]
    assert below["model.layers.1"] == ["model.layers.1.mlp"]
    assert "model.layers.1.mlp" not in below
