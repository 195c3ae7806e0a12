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


def _traced_with_calls(monkeypatch, config):
    """The graph's node data, and how many decoder-layer forwards the trace ran."""
    from transformers.models.falcon import modeling_falcon

    from placement_opt import trace

    calls = []
    original = modeling_falcon.FalconDecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(modeling_falcon.FalconDecoderLayer, "forward", counted)
    graph = trace(config)
    return {n: {k: repr(v) for k, v in d.items()} for n, d in graph.nx.nodes(data=True)}, len(calls)


def test_identical_layers_handing_on_a_tuple_run_once_in_the_decode_probe_with_the_same_figures(monkeypatch):
    # Falcon's decoder layer returns (hidden, None): its like layers take the first's figures instead of running
    # (trace("falcon-40b") spent 2.4 s of 2.6 running all 60 layers at four contexts), and nothing changes
    from placement_opt.model import _decode_probe

    skipped, runs_skipped = _traced_with_calls(monkeypatch, _falcon())
    monkeypatch.setattr(_decode_probe, "_handed_on", lambda hidden, out: None)  # every layer runs, as before
    every, runs_every = _traced_with_calls(monkeypatch, _falcon())
    assert skipped == every
    assert any("decode" in key for node in skipped.values() for key in node)  # the probe's figures are there
    assert runs_every - runs_skipped >= 4 * 5  # four probed forwards, five like layers each that no longer run
