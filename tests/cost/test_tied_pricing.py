"""A tied LM head is priced for the embedding matrix it multiplies by, which its embedding stores.

Before, the head owned no bytes (the matrix counts once, at the embedding), so its reads, its copies when
streamed, its stream buffer and its host traffic were all priced at zero: a plan streamed Gemma's 1.8 GB head
to the GPU for free. Tied and untied heads of one shape do the same work; they differ in where the matrix is
stored, and in that only.
"""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig

from placement_opt.cost.pricing import PricingContext, price_option
from placement_opt.cost.workload import Workload
from placement_opt.hardware.resolve import as_machine
from placement_opt.model.tracer import trace

MACHINE = as_machine("cuda:0=a100-40gb,cpu=64GiB,disk=nvme-gen4")


def _graph(tied: bool):
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         vocab_size=32000, tie_word_embeddings=tied)
    return trace(config, dtype="float16")


def _equal(a: object, b: object) -> bool:
    return a == pytest.approx(b, rel=1e-9) if isinstance(b, float) else a == b


@pytest.fixture(scope="module")
def graphs():
    return _graph(True), _graph(False)


def test_the_trace_says_what_the_tied_head_reads(graphs):
    tied, untied = graphs
    head, own = tied.unit("lm_head"), untied.unit("lm_head")
    assert head.param_bytes == 0 and head.tied_param_bytes == own.param_bytes == 32000 * 256 * 2
    assert head.read_bytes == own.read_bytes
    assert tied.unit("model.embed_tokens").tied_param_bytes == 0  # the embedding stores it: nothing extra
    assert tied.total_param_bytes == untied.total_param_bytes - own.param_bytes  # stored once


@pytest.mark.parametrize(("storage", "execution", "mode"), [
    ("cpu", "cuda:0", "stream"), ("cpu", "cuda:0", "stream_sync"), ("disk", "cuda:0", "stream"),
    ("cpu", "cpu", "resident"), ("disk", "cpu", "stream"), ("cuda:0", "cuda:0", "resident"),
])
@pytest.mark.parametrize("workload", [Workload(batch_size=1, prompt_len=128, new_tokens=32),
                                      Workload(batch_size=8, prompt_len=512, new_tokens=4)])
def test_a_tied_head_costs_what_an_untied_one_of_its_shape_costs_but_its_storage(graphs, storage, execution,
                                                                                  mode, workload):
    tied, untied = graphs
    prices = [price_option(PricingContext(g, MACHINE, workload), g.unit("lm_head"), storage, execution, mode)
              for g in (tied, untied)]
    assert prices[0].weights_bytes == 0 and prices[1].weights_bytes == 32000 * 256 * 2
    same = {f.name for f in dataclasses.fields(prices[0])} - {"weights_bytes"}
    differ = {name: (getattr(prices[0], name), getattr(prices[1], name)) for name in same
              if not _equal(getattr(prices[0], name), getattr(prices[1], name))}
    assert not differ, differ
    if storage != execution:  # a streamed head copies the matrix: time and a buffer where it computes
        assert prices[0].prefill_s > 0 and prices[0].decode_s > prices[1].decode_s / 2 > 0
        assert prices[0].stream_buffer_bytes >= (32000 * 256 * 2 if mode == "stream" and execution == "cuda:0" else 0)
