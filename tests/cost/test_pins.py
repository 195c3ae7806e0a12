"""Pins: accelerate-style prefixes and shell-style patterns -> the storage device of every unit they cover."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement_opt.cost.pins import resolve_pins
from placement_opt.errors import SolverInputError
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import chain_graph

LAYERS = 12
PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp.experts", "mlp.gate")


def sublayer_graph():
    names = ["model.embed_tokens", *(f"model.layers.{i}.{p}" for i in range(LAYERS) for p in PARTS), "model.norm",
             "lm_head"]
    return chain_graph([{"name": n, "param_bytes": 1024} for n in names], granularity="sublayer")


MACHINE = Machine([Device.preset("rtx-4090", name="cuda:0"), Device.preset("cpu-desktop", name="cpu"),
                   Device.preset("nvme-gen4", name="disk")])


def test_a_pattern_pins_every_layers_experts_like_llama_cpps_override_tensor():
    pinned = resolve_pins({"model.layers.*.mlp.experts": "cpu"}, sublayer_graph(), MACHINE)
    assert pinned == {f"model.layers.{i}.mlp.experts": "cpu" for i in range(LAYERS)}


def test_a_pattern_covers_the_units_inside_the_modules_it_matches():
    pinned = resolve_pins({"model.layers.1?": "disk"}, sublayer_graph(), MACHINE)  # layers 10 and 11, every part
    assert pinned == {f"model.layers.{i}.{p}": "disk" for i in (10, 11) for p in PARTS}


def test_a_plain_key_wins_over_a_pattern_and_patterns_that_agree_may_overlap():
    pins = {"model.layers.*": "cpu", "model.layers.3": 0, "model.layers.[0-4].mlp.*": "cpu"}
    pinned = resolve_pins(pins, sublayer_graph(), MACHINE)
    assert {pinned[f"model.layers.3.{p}"] for p in PARTS} == {"cuda:0"}
    assert {pinned[f"model.layers.{i}.{p}"] for i in (0, 4, 11) for p in PARTS} == {"cpu"}


def test_patterns_that_disagree_on_a_unit_are_refused_with_both_named():
    with pytest.raises(SolverInputError, match=r"model.layers.0.mlp.experts' is pinned to different devices.*"
                                               r"'\*.experts' -> cpu.*'model.layers.0.\*' -> disk"):
        resolve_pins({"*.experts": "cpu", "model.layers.0.*": "disk"}, sublayer_graph(), MACHINE)


def test_a_pattern_that_matches_nothing_says_what_units_there_are():
    with pytest.raises(SolverInputError, match=r"pin pattern 'model.layers.\*.mlp.down_proj' matches no unit.*"
                                               r"granularity 'sublayer'"):
        resolve_pins({"model.layers.*.mlp.down_proj": "cpu"}, sublayer_graph(), MACHINE)
    with pytest.raises(SolverInputError, match="cuda:1 is not in the machine"):
        resolve_pins({"*.experts": "cuda:1"}, sublayer_graph(), MACHINE)


@settings(max_examples=60, deadline=None)
@given(layers=st.sets(st.integers(0, 9), min_size=1), part=st.sampled_from(PARTS),
       device=st.sampled_from(["cuda:0", "cpu", "disk"]))
def test_a_pattern_pins_exactly_the_units_a_list_of_their_names_pins(layers, part, device):
    """A character class over one-digit layer indices is the same pins as naming each unit (and never layer 1x)."""
    graph = sublayer_graph()
    names = {f"model.layers.{i}.{part}": device for i in layers}
    digits = "".join(str(i) for i in sorted(layers))
    assert resolve_pins({f"model.layers.[{digits}].{part}": device}, graph, MACHINE) == names
    assert resolve_pins(names, graph, MACHINE) == names
