"""The logits unit's prefill is priced at the positions generate() asks for (Workload.logits)."""

from __future__ import annotations

from transformers import LlamaConfig

from placement_opt.cost.pricing import PricingContext, price_option
from placement_opt.cost.workload import Workload
from placement_opt.hardware.resolve import as_machine
from placement_opt.model.tracer import trace


def test_the_last_position_only_costs_a_prompt_times_less_compute() -> None:
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         vocab_size=32000, tie_word_embeddings=False)
    graph = trace(config, dtype="float32")
    head = graph.unit(graph.meta.extra["logits_unit"])
    machine = as_machine("cpu=16GiB")

    def prefill(workload: Workload) -> float:
        return price_option(PricingContext(graph, machine, workload), head, "cpu", "cpu", "resident").prefill_s

    last = prefill(Workload(prompt_len=1024, new_tokens=8))  # generate(): logits of the last position
    every = prefill(Workload(prompt_len=1024, new_tokens=8, logits="all"))
    one = prefill(Workload(prompt_len=1, new_tokens=8))
    assert last < every / 50  # 1024 positions against one: at most the weights' read is shared
    assert last == one  # the prompt's length no longer matters to the head
    layer = graph.unit("model.layers.0")
    ctx_last, ctx_all = (PricingContext(graph, machine, Workload(prompt_len=1024, new_tokens=8, logits=k))
                         for k in ("last", "all"))
    assert price_option(ctx_last, layer, "cpu", "cpu", "resident").prefill_s == \
        price_option(ctx_all, layer, "cpu", "cpu", "resident").prefill_s  # other units see every position


def test_the_logits_units_input_crosses_devices_for_the_last_positions_only() -> None:
    """The edge into the logits unit was priced at batch x prompt rows where generate() hands it one row a sequence."""
    from placement_opt.cost.build import price_problem

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         vocab_size=32000, tie_word_embeddings=False)
    graph = trace(config, dtype="float32")
    head = graph.meta.extra["logits_unit"]
    machine = as_machine("cuda:0=a100-40gb,cpu=64GiB")

    def crossing_ns(logits: str, dst: str) -> int:
        problem, _ = price_problem(graph, machine, Workload(batch_size=4, prompt_len=2048, new_tokens=8, logits=logits),
                                   ("resident",), None, False)
        edge = next(e for e in problem.edges if e.dst == dst and e.prefill_ns)
        return edge.prefill_ns["cuda:0", "cpu"]

    into_layer = next(dst for src, dst, _ in graph.edges() if dst != head)
    assert crossing_ns("last", head) < crossing_ns("all", head) / 20  # 4 rows against 8192, the link latency aside
    assert crossing_ns("last", into_layer) == crossing_ns("all", into_layer)  # other units get every position
