"""A sliding-window layer's KV cache holds its window, not the context (``UnitInfo.kv_window_tokens``)."""

from __future__ import annotations

import pytest
import transformers
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.cost.build import price_problem
from placement_opt.cost.kernels import kv_positions_read
from placement_opt.cost.workload import Workload
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import LayerGraph, chain_graph
from placement_opt.model.tracer import trace

KV = 1024  # bytes per cached token per sequence


def _graph(window: int | None) -> LayerGraph:
    layer = {"name": "layer", "kv_bytes_per_token": KV, "flops_per_token": 10**6, "param_bytes": 10**6,
             "attn_flops_per_token_per_ctx": 512}
    if window is not None:
        layer["kv_window_tokens"] = window
    return chain_graph([layer])


def _cpu_option(graph: LayerGraph, workload: Workload):
    machine = Machine([Device("cpu", 2**40, flops=1e12, bandwidth=1e11)])
    _, prices = price_problem(graph, machine, workload, ("resident",), None, False)
    return next(p for p in prices[0] if p.execution == "cpu" and p.mode == "resident")


@given(ctx0=st.integers(1, 300), steps=st.integers(0, 300), window=st.one_of(st.none(), st.integers(1, 400)))
def test_the_positions_decode_steps_read_are_each_steps_context_capped_at_the_window(ctx0, steps, window) -> None:
    unit = _graph(window).unit("layer")
    cap = window if window is not None else 10**9
    assert kv_positions_read(unit, ctx0, steps) == sum(min(ctx0 + t, cap) for t in range(steps))


@given(batch=st.integers(1, 8), prompt=st.integers(1, 600), new=st.integers(0, 300),
       window=st.one_of(st.none(), st.integers(1, 700)))
def test_a_layers_kv_cache_holds_its_window_or_the_prompt_at_most(batch, prompt, new, window) -> None:
    workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new)
    held = _cpu_option(_graph(window), workload).kv_cache_bytes
    whole = _cpu_option(_graph(None), workload).kv_cache_bytes
    assert whole == KV * batch * workload.context_len
    # the prompt's keys stay allocated under the window's view of them until the first decode step
    tokens = workload.context_len if window is None else max(min(workload.context_len, window), prompt)
    assert held == KV * batch * tokens


def _storage_tokens(cache, per_token: int) -> list[int]:
    return [layer.keys.untyped_storage().nbytes() // per_token for layer in cache.layers]


@pytest.mark.parametrize(("prompt", "window"), [(200, 16), (40, 64), (64, 64)])
def test_the_tokens_priced_are_the_tokens_transformers_cache_keeps_allocated(prompt: int, window: int) -> None:
    """Measured on a tiny random Mistral: the storage under each layer's keys after the prefill and after a
    decode step, against ``UnitInfo.kv_tokens_held``'s peak and ``kv_tokens``' steady state."""
    import torch

    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        sliding_window=window)
    unit = trace(config, dtype="float32").unit("model.layers.0")
    assert unit.kv_window_tokens is not None
    model = transformers.MistralForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, prompt))
    per_token = 2 * 16 * 4  # key heads x head_dim x float32 bytes: the keys alone
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        after_prefill = _storage_tokens(cache, per_token)
        cache = model(ids[:, :1], past_key_values=cache, use_cache=True).past_key_values
        after_step = _storage_tokens(cache, per_token)
    assert after_prefill == [unit.kv_tokens_held(prompt, prompt)] * 2
    assert max(after_prefill + after_step) == unit.kv_tokens_held(prompt, prompt + 1)
    assert after_step == [unit.kv_tokens(prompt + 1)] * 2


def test_a_decode_past_the_window_costs_what_a_step_at_the_window_does() -> None:
    # every step of a long decode reads the window's keys, as the first one past it does
    short, long = Workload(prompt_len=100, new_tokens=2), Workload(prompt_len=100, new_tokens=201)
    per_step = [_cpu_option(_graph(64), w).decode_s / w.decode_steps for w in (short, long)]
    assert per_step[1] == pytest.approx(per_step[0], rel=1e-6)
    assert _cpu_option(_graph(None), long).decode_s > _cpu_option(_graph(64), long).decode_s


@given(prompt=st.integers(1, 200), new=st.integers(1, 120), window=st.one_of(st.none(), st.integers(1, 300)),
       batch=st.integers(1, 4))
def test_a_decode_costs_the_sum_of_its_steps_each_priced_alone(prompt, new, window, batch) -> None:
    # step t of a decode is the one decode step of a workload whose prompt is t tokens longer: summing those
    # single steps prices every step at its own context, capped at the window once the cache reaches it
    graph = _graph(window)
    whole = _cpu_option(graph, Workload(batch_size=batch, prompt_len=prompt, new_tokens=new)).decode_s
    steps = [_cpu_option(graph, Workload(batch_size=batch, prompt_len=prompt + t, new_tokens=1)).decode_s
             for t in range(new)]
    assert whole == pytest.approx(sum(steps), rel=1e-9)


@pytest.mark.parametrize("granularity", ["block", "sublayer"])
def test_trace_reads_each_layers_window_from_transformers_cache_layout(granularity: str) -> None:
    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                       sliding_window=32)
    graph = trace(config, granularity=granularity)
    windows = {u.name: u.kv_window_tokens for u in graph.units() if u.kv_bytes_per_token}
    assert len(windows) == 4
    kinds = config.layer_types
    for name, window in windows.items():
        index = int(name.split(".")[2])
        assert window == (32 if kinds[index] == "sliding_attention" else None), name
    assert all(u.kv_window_tokens is None for u in graph.units() if not u.kv_bytes_per_token)
    again = LayerGraph.from_dict(graph.to_dict())
    assert [u.kv_window_tokens for u in again.units()] == [u.kv_window_tokens for u in graph.units()]


def test_layers_that_alternate_windows_still_get_a_relaxation_bound() -> None:
    # past the window, Gemma-2's sliding and global layers price apart and alternate: no run of identical layers
    # for the aggregated relaxation to count, so the grouped one must bound them (Gemma-2-27B at 8064 + 128 tokens
    # had none: 55-84 % gaps at 1 s)
    from placement_opt.cost.build import build_problem
    from placement_opt.solver._relaxing import relaxations_for
    from placement_opt.solver.aggregate import identical_runs
    from placement_opt.solver.edges import prune_edges

    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=12,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                       sliding_window=32)
    graph = trace(config)
    machine = Machine([Device("cuda:0", 2**30, flops=1e13, bandwidth=3e11), Device("cpu", 2**34, flops=1e12,
                                                                                   bandwidth=5e10)])

    def relaxations(prompt: int) -> tuple[list, list[str]]:
        problem = prune_edges(build_problem(graph, machine, Workload(batch_size=1, prompt_len=prompt, new_tokens=8)))
        kinds = ["grouped" if "groups of like units" in n else "runs" for n, _, _ in relaxations_for(problem, [])]
        return identical_runs(problem), kinds

    assert relaxations(16) == ([(4, 12)], ["runs"])  # within the window every layer is alike
    assert relaxations(256) == ([], ["grouped"])


@given(batch=st.integers(1, 16), prompt=st.integers(1, 4000))
def test_a_decode_step_moves_its_cache_three_times(batch: int, prompt: int) -> None:
    # transformers' DynamicCache grows by torch.cat: each step reads the old keys and values, writes them anew,
    # and attention reads them; where bytes bound the step, each cached token costs three passes over its KV
    from placement_opt.cost.pricing import CACHE_PASSES_PER_STEP

    cpu = Device("cpu", 2**40, flops=1e18, bandwidth=1e10, source="measured")
    machine = Machine([cpu])
    layer = {"name": "layer", "kv_bytes_per_token": KV, "flops_per_token": 1, "param_bytes": 1,
             "attn_flops_per_token_per_ctx": 1}

    def step(context: int) -> float:
        _, prices = price_problem(chain_graph([layer]), machine, Workload(batch_size=batch, prompt_len=context,
                                                                         new_tokens=1), ("resident",), None, False)
        return prices[0][0].decode_s

    per_token = step(prompt + 1) - step(prompt)
    assert CACHE_PASSES_PER_STEP == 3
    assert per_token == pytest.approx(3 * KV * batch / 1e10, rel=1e-6)


def test_a_sliding_models_decode_step_never_gets_cheaper_with_a_longer_run_or_a_bigger_batch():
    """Mistral-7B on one GPU: the middle decode step's kernels were priced on the uncapped lines, past any real step
    of a sliding layer, and hid its host time; a step cost 19.93 ms at 1 x 512 + 128, 18.64 ms at 1 x 8192 + 8192
    and 16.88 ms at batch 4 of that (a batch of 2 finished before a batch of 1)."""
    from placement_opt.cost.evaluate import evaluate

    graph = trace("mistral-7b")
    machine = {0: "1000GiB", "cpu": "64GiB"}

    def step_s(batch: int, prompt: int, new_tokens: int) -> float:
        cost = evaluate({"": 0}, graph, machine, Workload(batch_size=batch, prompt_len=prompt, new_tokens=new_tokens))
        return cost.decode_s / new_tokens

    short, long = step_s(1, 8192, 128), [step_s(b, 8192, 8192) for b in (1, 2, 4)]
    assert short <= long[0] * (1 + 1e-9) and long == sorted(long), (short, long)
