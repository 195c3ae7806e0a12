"""Plans of ``"sublayer"`` graphs: ``Plan.home`` is set by solve(), written only when set, and checked."""

from __future__ import annotations

import functools
import json

import pytest
import transformers

from placement_opt.cost.workload import Workload
from placement_opt.errors import PlanFormatError
from placement_opt.model.graph import LayerGraph
from placement_opt.model.tracer import trace
from placement_opt.plan import Plan
from placement_opt.planner import solve

MACHINE = {0: "1MiB", "cpu": "1GiB"}
WORKLOAD = Workload(prompt_len=16, new_tokens=4)


@functools.cache
def _graph(granularity: str) -> LayerGraph:
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return trace(config, seq_len=16, granularity=granularity)


@functools.cache
def _plan(granularity: str, devices: str = "gpu") -> Plan:
    machine = MACHINE if devices == "gpu" else {"cpu": "1GiB"}
    return solve(_graph(granularity), machine, workload=WORKLOAD, workers=1, time_limit_s=2.0)


def test_solve_sets_home_for_sublayer_graphs_only() -> None:
    assert _plan("sublayer").home == "cuda:0"
    assert _plan("sublayer", "cpu").home == "cpu"
    assert _plan("block").home is None


def test_home_is_written_only_when_set_and_read_back() -> None:
    sub, block = _plan("sublayer"), _plan("block")
    assert json.loads(sub.to_json())["home"] == "cuda:0"
    assert "home" not in json.loads(block.to_json())
    for plan in (sub, block):
        again = Plan.from_json(plan.to_json())
        assert again == plan and again.to_json() == plan.to_json()


@pytest.mark.parametrize("home", ["disk", "cuda:7", ""])
def test_home_must_be_a_computing_device_of_the_plans_machine(home: str) -> None:
    data = json.loads(_plan("sublayer").to_json())
    data["machine"]["devices"].append({"name": "disk", "memory_bytes": 10**12})
    data["home"] = home
    with pytest.raises(PlanFormatError, match="home"):
        Plan.from_dict(data)


def test_summary_names_home_in_one_line() -> None:
    lines = [x for x in _plan("sublayer").summary().splitlines() if "home" in x]
    assert len(lines) == 1 and lines[0].startswith("home       cuda:0")
    assert "home" not in _plan("block").summary()
