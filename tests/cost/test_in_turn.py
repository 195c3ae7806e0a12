"""A forward runs its units one after another: no placement makes parallel branches overlap.

The dispatcher calls a forward's units in execution order on one Python thread, so however a
module-level graph's parallel siblings (``q/k/v_proj``, ``gate/up_proj``) are spread over devices,
each phase takes at least the sum of its units' durations. Before ``cost/build.py`` linked each unit
to the next, the longest path let siblings on different devices (and on one device that was not the
busiest) run side by side.
"""

from __future__ import annotations

import functools

import transformers
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.cost.build import build_problem
from placement_opt.cost.workload import Workload
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import LayerGraph
from placement_opt.model.tracer import trace
from placement_opt.solver.problem import MODES

GIB = 2**30


@functools.cache
def _module_graph() -> LayerGraph:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return trace(config, seq_len=16, granularity="module")


def _machine() -> Machine:
    gpus = [Device(f"cuda:{i}", 8 * GIB, flops=4e14, bandwidth=2e12, host_link=2.5e10, reserve=0) for i in range(2)]
    return Machine([*gpus, Device("cpu", 64 * GIB, flops=1e12, bandwidth=8e10), Device("disk", 10**12, bandwidth=3e9)])


def test_the_module_graph_has_parallel_siblings() -> None:
    graph = _module_graph()
    reads = {}
    for src, dst, _ in graph.edges():
        reads.setdefault(src, set()).add(dst)
    norm = "model.layers.0.input_layernorm"
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj"} <= reads[norm]  # the premise of the property below


@given(data=st.data(), prompt=st.integers(1, 64), new_tokens=st.integers(0, 8))
def test_a_phase_takes_at_least_every_units_duration_in_turn(data, prompt, new_tokens) -> None:
    problem = build_problem(_module_graph(), _machine(), Workload(prompt_len=prompt, new_tokens=new_tokens),
                            modes=MODES)
    choice = [data.draw(st.integers(0, len(u.options) - 1)) for u in problem.units]
    score = problem.score(choice)
    chosen = problem.options(choice)
    for key, latency in (("prefill_ns", score.prefill_ns), ("decode_ns", score.decode_ns)):
        assert latency >= sum(getattr(o, key) for o in chosen), key


def test_siblings_split_over_two_gpus_take_as_long_as_on_one() -> None:
    # q_proj on cuda:0 with k_proj and v_proj on cuda:1 in every layer, everything else on cuda:0
    problem = build_problem(_module_graph(), _machine(), Workload(prompt_len=32, new_tokens=4))
    def resident(u, device: str) -> int:
        return next(k for k, o in enumerate(u.options) if o.storage == o.execution == device and o.mode == "resident")

    one = [resident(u, "cuda:0") for u in problem.units]
    split = [resident(u, "cuda:1" if u.name.endswith(("k_proj", "v_proj")) else "cuda:0") for u in problem.units]
    alone = problem.score(one)
    spread = problem.score(split)
    # the same modules run in turn either way; the split adds the transfers to and from cuda:1
    assert spread.prefill_ns >= alone.prefill_ns
    assert spread.decode_ns >= alone.decode_ns
