"""The line of a decode step's bytes per cached token (model/_decode_probe.py): above the step at every context."""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from placement_opt.model._decode_probe import fit_line, probe_contexts


@given(lines=st.lists(st.tuples(st.integers(0, 10**7), st.integers(0, 10**5)), min_size=1, max_size=5),
       window=st.one_of(st.none(), st.integers(2, 5000)))
def test_the_fitted_line_stays_above_a_step_whose_largest_moment_at_the_longest_contexts_stays_so(
        lines: list[tuple[int, int]], window: int | None) -> None:
    # the most a step holds is the larger of moments linear in the context (MLP, attention): convex
    contexts = probe_contexts(window)
    assert 0 < contexts[0] < contexts[1] < contexts[2]

    def held(context: int) -> int:
        return max(a + b * context for a, b in lines)

    top = [max(lines, key=lambda line, c=c: (line[0] + line[1] * c, line[1])) for c in contexts[1:]]
    # the moment largest at the two longest contexts, and beyond them: none grows faster (the attention's, once
    # the context outweighs the MLP's one token)
    assume(top[0] == top[1] and top[1][1] == max(b for _, b in lines))
    base, per_token = fit_line(contexts, [held(c) for c in contexts])
    for context in range(contexts[0], 4 * contexts[2], max(1, contexts[2] // 50)):
        assert base + per_token * context >= held(context), context
    assert per_token == top[0][1]  # and it is that moment's own slope: no more


def _falcon():
    import transformers

    return transformers.FalconConfig(vocab_size=256, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                                     num_hidden_layers=6, new_decoder_architecture=True, parallel_attn=True,
                                     alibi=False, bias=False)


def _llama():
    import transformers

    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=6)


def _traced_with_calls(monkeypatch, config, layer_class, granularity="block"):
    """The graph's node data, and how many forwards of ``layer_class`` (a decoder layer) the trace ran."""
    from placement_opt import trace

    calls = []
    original = layer_class.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(layer_class, "forward", counted)
    graph = trace(config, granularity=granularity)
    monkeypatch.setattr(layer_class, "forward", original)
    return {n: {k: repr(v) for k, v in d.items()} for n, d in graph.nx.nodes(data=True)}, len(calls)


def test_identical_layers_handing_on_a_tuple_run_twice_in_the_decode_probe_with_the_same_figures(monkeypatch):
    # Falcon's decoder layer returns (hidden, None): its like layers take the second's figures instead of running
    # (trace("falcon-40b") spent 2.4 s of 2.6 running all 60 layers at four contexts), and nothing changes
    from transformers.models.falcon.modeling_falcon import FalconDecoderLayer

    from placement_opt.model import _decode_probe

    skipped, runs_skipped = _traced_with_calls(monkeypatch, _falcon(), FalconDecoderLayer)
    monkeypatch.setattr(_decode_probe, "_handed_on", lambda hidden, out: None)  # every layer runs, as before
    every, runs_every = _traced_with_calls(monkeypatch, _falcon(), FalconDecoderLayer)
    assert skipped == every
    assert any("decode" in key for node in skipped.values() for key in node)  # the probe's figures are there
    # four probed forwards, four like layers each that no longer run
    assert runs_every - runs_skipped == 4 * (6 - _decode_probe.RUN_EACH)


def test_a_module_level_trace_probes_two_layers_of_each_kind_and_the_rest_take_the_seconds_figures(monkeypatch):
    # module granularity keeps no block whole, yet its decoder layers are as alike as a block graph's
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from placement_opt.model import _decode_probe

    skipped, runs_skipped = _traced_with_calls(monkeypatch, _llama(), LlamaDecoderLayer, "module")
    monkeypatch.setattr(_decode_probe, "_handed_on", lambda hidden, out: None)
    every, runs_every = _traced_with_calls(monkeypatch, _llama(), LlamaDecoderLayer, "module")
    assert runs_every - runs_skipped == 4 * (6 - _decode_probe.RUN_EACH)
    for name, node in skipped.items():
        if name.startswith(("model.layers.0.", "model.layers.1.")) or not name.startswith("model.layers."):
            assert node == every[name], name  # the layers that ran, and the units outside them: as before
        else:  # the probe's figures are the second layer's, everything else the layer's own
            second = skipped["model.layers.1." + name.split(".", 3)[3]]
            assert {k: v for k, v in node.items() if "decode" in k} == {k: v for k, v in second.items() if "decode" in k}
            assert {k: v for k, v in node.items() if "decode" not in k} == {
                k: v for k, v in every[name].items() if "decode" not in k}
