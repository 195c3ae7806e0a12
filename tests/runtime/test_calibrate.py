"""calibrate(): a tiny model's units timed here, saved in the profile, and used by solve() on this machine."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaConfig, MistralConfig, MixtralConfig

import placement_opt
from placement_opt.cost.calibrated import calibration_for, shape_key
from placement_opt.cost.workload import Workload
from placement_opt.errors import PlacementError, ProfileError
from placement_opt.hardware.devices import Machine
from placement_opt.hardware.profile_store import PROFILE_ENV_VAR, saved_calibration
from placement_opt.hardware.resolve import as_machine
from placement_opt.model.graph import chain_graph
from placement_opt.model.tracer import trace

WORKLOAD = Workload(batch_size=1, prompt_len=16, new_tokens=96)


def tiny_config(hidden: int = 64) -> LlamaConfig:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False,
                         max_position_embeddings=256)
    config.dtype = "float32"
    return config


#: What the module's calibrate() warned of (the fixture runs it once).
CAUGHT: list[warnings.WarningMessage] = []


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("calibrate") / "profile.json"
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch.setenv(PROFILE_ENV_VAR, str(path))
        result = placement_opt.calibrate(tiny_config(), ["cpu"], workload=WORKLOAD, repeats=1)
    CAUGHT[:] = caught
    return path, result


def test_calibrate_hands_the_kv_cache_over_by_the_installed_transformers_name(calibrated) -> None:
    """transformers 5.24 renamed past_key_values to cache (the old name goes in 5.40): no call of calibrate's may
    use a name the installed version calls deprecated."""
    deprecated = [str(w.message) for w in CAUGHT if "past_key_values" in str(w.message)]
    assert not deprecated, deprecated


def test_calibrate_times_one_unit_of_each_shape_at_the_workloads_shapes(calibrated) -> None:
    path, result = calibrated
    graph = trace(tiny_config())
    shapes = {shape_key(u, graph.meta.dtype, graph.meta.seq_len) for u in graph.units()}
    assert result.layers_built == 1  # the three layers are alike: one is built
    assert set(result.units.values()) == shapes and "model.layers.0" in result.units
    assert "model.layers.1" not in result.units
    layer = result.times[result.units["model.layers.0"]]["cpu"]
    assert layer.attention
    assert sorted((b, p) for b, p, _, _ in layer.prefill) == [(1, 4), (1, 16)]
    assert {kept for *_, kept in layer.prefill} == {"last"}  # generation computes the last position's logits
    first, last = sorted(c for _, c, _ in layer.decode)  # steps near the first context, and near the last
    assert 17 <= first < 17 + 32 and 112 - 32 < last <= 112
    assert all(s > 0 for *_, s in layer.decode)
    assert result.path == path and result.devices == ("cpu",)


def test_the_calibration_round_trips_through_the_profile_file(calibrated, monkeypatch) -> None:
    path, result = calibrated
    saved = saved_calibration(path)
    assert saved is not None and set(saved["units"]) == set(result.units.values())
    data = json.loads(path.read_text())
    assert data["measurements"]["cpu"]["memory_bytes"] > 0  # the CPU was profiled first (quick)
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    graph = trace(tiny_config())
    found = calibration_for(graph, as_machine(["cpu"], dtype="float32"))
    key = result.units["model.layers.0"]
    for name in ("model.layers.0", "model.layers.2"):  # every layer of the shape, not only the one timed
        assert found.times(name, "cpu") == result.times[key]["cpu"]


def test_solve_uses_the_calibration_for_a_list_and_a_max_memory_dict_alike(calibrated, monkeypatch) -> None:
    path, result = calibrated
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    by_list = placement_opt.solve(tiny_config(), ["cpu"], workload=WORKLOAD, workers=1)
    by_dict = placement_opt.solve(tiny_config(), {"cpu": "4GiB"}, workload=WORKLOAD, workers=1)
    by_spec = placement_opt.solve(tiny_config(), "cpu=4GiB", workload=WORKLOAD, workers=1)  # a budget alone
    assert by_dict.machine["cpu"].source.startswith("measured")
    assert by_list.cost.prefill_s == pytest.approx(by_dict.cost.prefill_s) == pytest.approx(by_spec.cost.prefill_s)
    graph = trace(tiny_config())
    expected = sum(result.times[shape_key(u, "float32", graph.meta.seq_len)]["cpu"].prefill_s(1, 16, "last")
                   for u in graph.units())
    assert by_list.cost.prefill_s == pytest.approx(expected, abs=1e-9 * len(graph))  # each unit rounded up to 1 ns
    assert f"unit times calibrated on this model: {len(graph)} of {len(graph)} units" in " ".join(by_dict.notes)
    # without the calibration, the same measured CPU is priced by the roofline: another figure
    data = json.loads(path.read_text())
    del data["calibration"]
    bare = path.with_name("bare.json")
    bare.write_text(json.dumps(data))
    monkeypatch.setenv(PROFILE_ENV_VAR, str(bare))
    roofline = placement_opt.solve(tiny_config(), {"cpu": "4GiB"}, workload=WORKLOAD, workers=1)
    assert roofline.cost.prefill_s != pytest.approx(expected, rel=1e-3)
    assert "this model is not calibrated on this machine" in " ".join(roofline.notes)  # and the plan says so
    # a preset names a machine described (a budget alone is this machine's device, priced as measured)
    described = placement_opt.solve(tiny_config(), "cpu=cpu-desktop/4GiB", workload=WORKLOAD, workers=1)
    assert not any("calibrated" in note for note in described.notes)  # a machine described: nothing to calibrate


def test_a_model_sharing_only_some_unit_shapes_with_the_calibrated_one_is_told_the_rest_are_not(calibrated,
                                                                                                  monkeypatch) -> None:
    """Another model whose embedding, norm and head have the calibrated shapes, its layers not, was told "unit times
    calibrated on this model: 3 of 6 units" and nothing of the others: as if it had been calibrated."""
    path, _ = calibrated
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    other = tiny_config()
    other.intermediate_size = 96  # its layers another shape; embedding, norm and head the calibrated ones
    for granularity in ("block", "module"):
        plan = placement_opt.solve(other, ["cpu"], workload=WORKLOAD, workers=1, granularity=granularity)
        note = next(n for n in plan.notes if "calibrated" in n)
        assert "the others priced by the device speeds" in note, note


def test_the_calibration_is_ignored_for_other_machines_hosts_and_models(calibrated, monkeypatch) -> None:
    path, _ = calibrated
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    graph = trace(tiny_config())
    described = as_machine("cpu=cpu-desktop/4GiB")  # datasheet speeds: a machine described, not this one measured
    assert calibration_for(graph, described) is None
    assert calibration_for(trace(tiny_config(hidden=96)), as_machine(["cpu"], dtype="float32")) is None
    data = json.loads(path.read_text())
    data["calibration"]["host"] = "another-host"
    elsewhere = path.with_name("elsewhere.json")
    elsewhere.write_text(json.dumps(data))
    assert saved_calibration(elsewhere) is None
    monkeypatch.setenv(PROFILE_ENV_VAR, str(elsewhere))
    assert calibration_for(graph, as_machine(["cpu"], dtype="float32")) is None


def test_calibrate_refuses_what_it_cannot_run(tmp_path) -> None:
    graph = chain_graph([{"name": "a", "param_bytes": 8}])
    with pytest.raises(PlacementError, match="LayerGraph has no modules"):
        placement_opt.calibrate(graph, ["cpu"], path=tmp_path / "p.json")
    with pytest.raises(PlacementError, match="compute devices.*add 'cpu'"):
        placement_opt.calibrate(tiny_config(), ["disk"], path=tmp_path / "p.json")
    with pytest.raises(PlacementError, match="repeats"):
        placement_opt.calibrate(tiny_config(), ["cpu"], path=tmp_path / "p.json", repeats=0)


def test_calibrate_times_cold_disk_reads_both_ways_and_pricing_takes_them(tmp_path, monkeypatch) -> None:
    path = tmp_path / "profile.json"
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    workload = Workload(batch_size=1, prompt_len=8, new_tokens=4)
    result = placement_opt.calibrate(tiny_config(), ["cpu", "disk"], workload=workload, offload_dir=tmp_path,
                                     repeats=1)
    key = result.units["model.layers.0"]
    reads = result.copies[key]["disk->cpu"]
    assert set(reads) == {"stream", "stream_sync"}
    assert result.layers_built == 3  # the timed layer, the one read beside it, and one read as later ones are
    assert all(set(r) == {"prefill", "decode"} and min(r.values()) >= 0 for r in reads.values())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("placement_opt_calibrate_")] == []
    graph = trace(tiny_config())
    machine = as_machine(["cpu", "disk"], dtype="float32")
    found = calibration_for(graph, machine)
    assert found.copy_s("model.layers.1", "disk", "cpu", "stream_sync") == reads["stream_sync"]["decode"]
    assert found.copy_s("model.layers.1", "disk", "cpu", "stream", "prefill") == reads["stream"]["prefill"]
    plan = placement_opt.evaluate({"model.layers": "disk", "model.embed_tokens": "cpu", "model.norm": "cpu",
                                   "model.rotary_emb": "cpu", "lm_head": "cpu"}, graph, machine, workload)
    layer = next(u for u in plan.units if u.name == "model.layers.1")
    assert layer.mode == "stream_sync"  # a device_map runs as accelerate runs it: tensors copied out
    calibrated = found.times("model.layers.1", "cpu").prefill_s(1, 8, "last")
    assert layer.prefill_s == pytest.approx(calibrated + reads["stream_sync"]["prefill"], rel=1e-6)


def test_a_model_with_tied_embeddings_times_its_disk_reads_the_head_stored_with_them(tmp_path, monkeypatch) -> None:
    """The LM head shares the embeddings' weights, so it is stored on disk with them while they are timed (it
    failed: "tied weights must be stored on one device"); the embeddings get their disk figures."""
    monkeypatch.setenv(PROFILE_ENV_VAR, str(tmp_path / "profile.json"))
    config = tiny_config()
    config.tie_word_embeddings = True
    result = placement_opt.calibrate(config, ["cpu", "disk"], workload=Workload(batch_size=1, prompt_len=8,
                                                                                  new_tokens=2),
                                     offload_dir=tmp_path, repeats=1)
    reads = result.copies[result.units["model.embed_tokens"]]["disk->cpu"]
    assert set(reads) == {"stream", "stream_sync"}
    assert all(set(r) == {"prefill", "decode"} for r in reads.values())


def test_a_model_accelerate_cannot_run_from_disk_keeps_its_own_disk_figures_and_says_so(tmp_path,
                                                                                         monkeypatch) -> None:
    """accelerate loads a module's weights when its forward is called; JetMoE reads its attention experts' bias in
    map() and reduce(), never through that module's forward, so accelerate's offload meets it on the meta device.
    calibrate() warns and times placement_opt's reads (it failed before)."""
    from transformers import JetMoeConfig

    monkeypatch.setenv(PROFILE_ENV_VAR, str(tmp_path / "profile.json"))
    config = JetMoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_key_value_heads=2, kv_channels=8, num_local_experts=4, num_experts_per_tok=2)
    config.dtype = "float32"
    with pytest.warns(UserWarning, match="accelerate's offload did not run JetMoeForCausalLM"):
        result = placement_opt.calibrate(config, ["cpu", "disk"], workload=Workload(batch_size=1, prompt_len=8,
                                                                                      new_tokens=2),
                                         offload_dir=tmp_path, repeats=1)
    reads = result.copies[result.units["model.layers.0"]]["disk->cpu"]
    assert set(reads) == {"stream"} and reads["stream"]["decode_batch"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("placement_opt_calibrate_")] == []


def test_a_unit_never_called_through_its_forward_gets_no_figures(tmp_path, monkeypatch) -> None:
    """JetMoE's attention experts run through map() and reduce(), never their forward: no hook times them, and
    their weights are read while the units that call those methods run. They were saved with no times at all
    (summary() failed on them) and a disk read of 0 s; now they are left uncalibrated, priced as before."""
    from transformers import JetMoeConfig

    monkeypatch.setenv(PROFILE_ENV_VAR, str(tmp_path / "profile.json"))
    config = JetMoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_key_value_heads=2, kv_channels=8, num_local_experts=4, num_experts_per_tok=2)
    config.dtype = "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # accelerate's offload does not run it
        result = placement_opt.calibrate(config, ["cpu", "disk"], workload=Workload(batch_size=1, prompt_len=8,
                                                                                      new_tokens=2),
                                         granularity="sublayer", offload_dir=tmp_path, repeats=1)
    never = result.units["model.layers.0.self_attention.experts"]
    called = result.units["model.layers.0.mlp"]
    assert result.times[never] == {} and never not in result.copies
    assert set(result.times[called]) == {"cpu"} and "disk->cpu" in result.copies[called]
    assert "self_attention.experts" not in result.summary() and "model.layers.0.mlp" in result.summary()


@given(layers=st.integers(1, 6), timed=st.lists(st.integers(0, 5), max_size=3), chain=st.booleans())
def test_the_cut_copy_holds_every_timed_layer_and_two_more_for_disk_reads_where_the_model_has_them(
        layers: int, timed: list[int], chain: bool) -> None:
    from placement_opt.runtime import _calibrate_build as calibrate_module

    indices = [i for i in timed if i < layers]
    names = [f"model.layers.{i}" for i in indices] + ["model.embed_tokens"]
    cut = calibrate_module.cut_config(LlamaConfig(num_hidden_layers=layers), names, chain=chain)
    # every timed layer is built, the next two too for disk reads, never a layer the model lacks
    assert cut.num_hidden_layers == (min(layers, max(indices) + 1 + 2 * chain) if indices else layers)


def test_a_mapped_prefills_cold_read_is_capped_at_the_decode_steps_where_both_read_every_weight(
        tmp_path, monkeypatch) -> None:
    # A dense layer's prefill reads the bytes a decode step reads, with more compute to hide them behind; an
    # embedding's prefill looks up more rows than a step does, and keeps its own figure; accelerate's
    # synchronous reads copy every tensor in both phases: capped too, the embedding's included.
    from placement_opt.runtime import _calibrate_disk as calibrate_module

    graph = trace(tiny_config())
    cold = {"prefill": {"model.layers.0": 0.9, "model.embed_tokens": 0.9},
            "decode": {"model.layers.0": 0.3, "model.embed_tokens": 0.1}}
    monkeypatch.setattr(calibrate_module, "_run_mapped", lambda *args: cold)
    monkeypatch.setattr(calibrate_module, "_run_accelerate", lambda *args: cold)
    resident = {"prefill": {"model.layers.0": 0.1, "model.embed_tokens": 0.1},
                "decode": {"model.layers.0": 0.1, "model.embed_tokens": 0.0}}
    names = {"model.layers.0": "layer", "model.embed_tokens": "embed"}
    reads = calibrate_module.time_disk_reads(None, graph, graph, names, WORKLOAD, resident, tmp_path)
    assert reads["layer"]["disk->cpu"]["stream"] == pytest.approx({"prefill": 0.2, "decode": 0.2})
    assert reads["embed"]["disk->cpu"]["stream"] == pytest.approx({"prefill": 0.8, "decode": 0.1})
    assert reads["layer"]["disk->cpu"]["stream_sync"] == pytest.approx({"prefill": 0.2, "decode": 0.2})
    assert reads["embed"]["disk->cpu"]["stream_sync"] == pytest.approx({"prefill": 0.1, "decode": 0.1})


def test_a_prefill_over_budget_is_timed_shorter_and_the_cache_grown_for_decode(tmp_path, monkeypatch) -> None:
    from placement_opt.runtime import _calibrate_timing as calibrating

    monkeypatch.setattr(calibrating, "PREFILL_BUDGET_S", 0.0)  # as if the prompt's prefill took too long
    workload = Workload(batch_size=2, prompt_len=64, new_tokens=8)
    result = placement_opt.calibrate(tiny_config(), ["cpu"], workload=workload, path=tmp_path / "p.json",
                                     repeats=1)
    layer = result.times[result.units["model.layers.0"]]["cpu"]
    assert sorted((b, p) for b, p, _, _ in layer.prefill) == [(2, 4), (2, 16)]  # a quarter, a sixteenth
    assert [c for _, c, _ in layer.decode] and all(65 <= c <= 72 for _, c, _ in layer.decode)
    assert layer.prefill_s(2, 64, "last") >= layer.prefill_s(2, 16, "last")  # extended to the prompt


def _stall_first_visits(monkeypatch) -> set[tuple[int, ...]]:
    """SDPA that sleeps 20 ms the first time a decode step meets a key shape (as cuDNN attention builds a graph per
    key length on Hopper GPUs); the shapes it met."""
    import time

    import torch

    real = torch.nn.functional.scaled_dot_product_attention
    seen: set[tuple[int, ...]] = set()

    def stalling(query, key, *args, **kwargs):
        if query.shape[-2] == 1 and tuple(key.shape) not in seen:
            seen.add(tuple(key.shape))
            time.sleep(0.02)
        return real(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", stalling)
    return seen


def _mistral_config() -> MistralConfig:
    """Sliding-window layers (a cache kind of their own), the window past the calibrated contexts."""
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, sliding_window=256, max_position_embeddings=512)
    config.dtype = "float32"
    return config


@pytest.mark.parametrize("config", [tiny_config, _mistral_config], ids=["llama", "mistral-sliding"])
def test_a_decode_step_is_timed_at_a_context_run_before(tmp_path, monkeypatch, config) -> None:
    """A stall at each first-visited key length: the decode figure is the step's own time, and the stall is said.
    Timed on first visits (as before the second pass, and as the test below does), the step read >= 20 ms."""
    seen = _stall_first_visits(monkeypatch)
    with pytest.warns(UserWarning, match="context length this process had not run before"):
        result = placement_opt.calibrate(config(), ["cpu"], workload=WORKLOAD, path=tmp_path / "p.json", repeats=1)
    assert seen, "the stall never ran: the copy's attention does not call torch's SDPA"
    layer = result.times[result.units["model.layers.0"]]["cpu"]
    assert layer.decode and all(seconds < 0.01 for _, _, seconds in layer.decode), layer.decode


def test_a_cache_that_cannot_be_copied_keeps_its_first_visits(tmp_path, monkeypatch) -> None:
    from placement_opt.runtime import _calibrate_timing as calibrating

    _stall_first_visits(monkeypatch)
    monkeypatch.setattr(calibrating, "_copy_of", lambda cache: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = placement_opt.calibrate(tiny_config(), ["cpu"], workload=WORKLOAD, path=tmp_path / "p.json",
                                         repeats=1)
    assert not [w for w in caught if "not run before" in str(w.message)]  # nothing to compare first visits with
    layer = result.times[result.units["model.layers.0"]]["cpu"]
    assert layer.decode and all(seconds >= 0.02 for _, _, seconds in layer.decode), layer.decode


@pytest.mark.parametrize(("prompt", "first"), [(1, 1), (16, 4), (64, 16), (128, 8), (512, 8), (4096, 16)])
def test_prefills_start_short_and_grow_4x_toward_the_prompt(prompt: int, first: int) -> None:
    from placement_opt.runtime._calibrate_timing import PROBE_TOKENS, _first_length

    assert _first_length(prompt) == first
    assert first == prompt or first <= prompt // 4  # a shorter point beside the prompt: a line to extend
    assert prompt < 4 * PROBE_TOKENS or first >= PROBE_TOKENS


def test_the_copy_is_built_without_initialisers_and_its_weights_are_finite_and_varied() -> None:
    import torch

    from placement_opt.runtime._calibrate_build import build

    model = build(tiny_config(), "float32", torch.device("cpu"))
    for name, param in model.named_parameters():
        assert param.isfinite().all() and param.std() > 0.01, name  # tiled N(0, 0.02): no garbage, no zeros
    rotary = model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, type(rotary)(tiny_config()).inv_freq)  # buffers as __init__ made them


def test_a_tied_models_copy_ties_its_head_and_calibrates(tmp_path, monkeypatch) -> None:
    """The copy is built without initialisers, which in transformers 5 also skips tying: an untied head was another
    model than the one planned, and calibrate() of GPT-2 (or any tied model) failed on a plan mismatch."""
    import torch

    from placement_opt.runtime._calibrate_build import build

    config = tiny_config()
    config.tie_word_embeddings = True
    model = build(config, "float32", torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    monkeypatch.setenv(PROFILE_ENV_VAR, str(tmp_path / "profile.json"))
    result = placement_opt.calibrate(config, ["cpu"], workload=Workload(batch_size=1, prompt_len=8, new_tokens=4),
                                     repeats=1)
    assert result.units


@pytest.mark.parametrize(("budget_s", "most", "steps"), [(0.0, 16, 3), (1e9, 5, 5)])
def test_accelerates_cold_reads_evict_each_units_files_as_it_is_called(tmp_path, monkeypatch, budget_s, most,
                                                                         steps) -> None:
    from placement_opt.runtime import _calibrate_disk as calibrate_module

    evicted: list[list[str]] = []  # the names of the files of each eviction, in order
    monkeypatch.setattr(calibrate_module, "drop_page_cache", lambda paths: evicted.append([p.name for p in paths]))
    monkeypatch.setattr(calibrate_module, "DISK_BUDGET_S", budget_s)
    monkeypatch.setattr(calibrate_module, "MAX_DISK_STEPS", most)
    monkeypatch.setenv(PROFILE_ENV_VAR, str(tmp_path / "profile.json"))
    placement_opt.calibrate(tiny_config(), ["cpu", "disk"], workload=Workload(batch_size=1, prompt_len=8, new_tokens=4),
                            offload_dir=tmp_path, repeats=1)
    dat = [names for names in evicted if names and all(n.endswith(".dat") for n in names)]  # accelerate's files
    # the layers are alike: one is timed, and two more built to read after it, as a plan's disk units read
    order = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.norm", "lm_head"]
    units = [next(u for u in order if all(n.startswith(f"{u}.") for n in names)) for names in dat]
    # one unit's files at a time, as the forward calls it (never the folder), in the warm-up, each cold
    # prefill (one with no budget left, the most with all the time in the world) and each cold decode step
    prefills = 1 if budget_s == 0 else calibrate_module.MAX_DISK_PREFILLS
    assert units == order * (1 + prefills + steps)


def test_calibrate_makes_a_missing_offload_dir_and_names_one_it_cannot_use(tmp_path, monkeypatch) -> None:
    """As ``dispatch`` does, a missing ``offload_dir`` is made (it failed with a bare FileNotFoundError from a
    temporary folder inside); a file in its place is a PlacementError naming it, raised before any trace."""
    monkeypatch.setenv(PROFILE_ENV_VAR, str(tmp_path / "profile.json"))
    folder = tmp_path / "not" / "yet"
    placement_opt.calibrate(tiny_config(), ["cpu", "disk"], workload=Workload(batch_size=1, prompt_len=8, new_tokens=2),
                            offload_dir=folder, repeats=1)
    assert folder.is_dir() and list(folder.iterdir()) == []  # the scratch files are gone
    taken = tmp_path / "a-file"
    taken.write_text("mine")
    with pytest.raises(PlacementError, match="offload_dir .*a-file.* cannot hold calibration's scratch files"):
        placement_opt.calibrate(tiny_config(), ["cpu", "disk"], offload_dir=taken)
    assert taken.read_text() == "mine"


class _Clock:
    """A stand-in for the calibration clock's ``time``: seconds pass only when a :class:`_Forward` runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _forward(clock: _Clock, schedule: list[float]):
    """A unit whose n-th call takes ``schedule[n]`` seconds on ``clock`` (the last one for every call after)."""
    from torch import nn

    class Forward(nn.Module):
        calls = 0

        def forward(self) -> int:
            clock.now += schedule[min(self.calls, len(schedule) - 1)]
            self.calls += 1
            return self.calls

    return Forward()


@pytest.mark.parametrize(("schedule", "figure", "calls"), [
    ([0.6, 0.001], 0.001, 1 + 1 + 2 + 20),  # a first-call stall: the next call is the warm-up, then as if fast
    ([2.0, 0.9, 0.3, 0.001], 0.001, 3 + 20),  # a stall wearing off over three calls, each much faster
    ([0.7, 0.6], 0.6, 2),  # a slow forward: one timed call after the warm-up, which is not the figure
    ([3.0], 3.0, 2),  # a 3 s forward is timed twice, no more
    ([3.0, 1.0, 0.9], 0.9, 3),  # a stall before a slow forward: one more call than the slow forward alone
    ([0.001], 0.001, 1 + 2 + 20),  # a fast forward: three warm-ups, then calls until MIN_TIMED_S or MAX_RUNS
    ([0.3], 0.3, 1 + 2),  # a middling one: one warm-up, then calls until MIN_TIMED_S
], ids=["stall", "stall-wearing-off", "slow", "slow-3s", "stall-then-slow", "fast", "middling"])
def test_a_slow_first_call_is_never_the_figure_and_a_slow_forward_is_timed_twice(monkeypatch, schedule, figure,
                                                                                  calls) -> None:
    import types

    import torch

    from placement_opt.runtime import _calibrate_clock as calibrate_module
    from placement_opt.runtime import _stamps

    clock = _Clock()
    for module in (calibrate_module, _stamps):  # the calls' clock and the units' marks
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    unit = _forward(clock, schedule)
    stamps = _stamps.Stamps({"unit": unit}, torch.device("cpu"))
    runs, out = calibrate_module.repeated(lambda: unit(), stamps, repeats=2)
    assert unit.calls == calls
    assert calibrate_module.typical(runs) == {"unit": pytest.approx(figure)}
    assert out == calls  # the last call's output


def test_a_stalled_first_forward_is_not_saved_as_the_units_prefill(tmp_path, monkeypatch) -> None:
    # The user's report: a first forward stalled in a fresh process (180-860 ms where a whole forward takes
    # ~2 ms) was saved as model.layers.0's prefill. Here the layer's first call sleeps 0.6 s in its MLP.
    import time

    from placement_opt.runtime import calibrate as calibrate_module

    build = calibrate_module.build
    stalled: list[float] = []

    def built_with_a_stall(*args, **kwargs):
        model = build(*args, **kwargs)

        def stall(_module, _args) -> None:
            if not stalled:
                stalled.append(0.6)
                time.sleep(0.6)

        model.model.layers[0].mlp.register_forward_pre_hook(stall)  # inside the layer: its time, as stamped
        return model

    monkeypatch.setattr(calibrate_module, "build", built_with_a_stall)
    result = placement_opt.calibrate(tiny_config(), ["cpu"], workload=Workload(batch_size=1, prompt_len=16, new_tokens=8),
                                     path=tmp_path / "p.json", repeats=1)
    assert stalled  # the first prefill's warm-up stalled
    layer = result.times[result.units["model.layers.0"]]["cpu"]
    assert all(seconds < 0.1 for _, _, seconds, _ in layer.prefill), layer.prefill  # ~1 ms each, not 600
    assert all(seconds < 0.1 for times in result.times.values() for _, _, seconds, _ in times["cpu"].prefill)
    # and the prompts grew to the workload's: a 0.6 s figure at 4 tokens, 2.4 s estimated at 16, stopped them
    assert sorted((b, p) for b, p, _, _ in layer.prefill) == [(1, 4), (1, 16)]


def test_no_calibration_note_for_described_compute_devices_beside_a_measured_disk(calibrated, monkeypatch) -> None:
    """The note said "this model is not calibrated on this machine" for a preset CPU because the disk was measured;
    calibration times units on compute devices, so a machine whose compute devices are described gets no note."""
    path, _ = calibrated
    data = json.loads(path.read_text())
    data["measurements"]["disk"] = {"memory_bytes": 2**40, "sequential_read_bytes_per_s": 2e9,
                                    "mapped_read_bytes_per_s": 1.5e9}
    with_disk = path.with_name("with_disk.json")
    with_disk.write_text(json.dumps(data))
    monkeypatch.setenv(PROFILE_ENV_VAR, str(with_disk))
    assert as_machine("cpu=cpu-desktop/4GiB,disk")["disk"].source.startswith("measured")
    plan = placement_opt.solve(tiny_config(), "cpu=cpu-desktop/4GiB,disk", workload=WORKLOAD, workers=1)
    assert not any("calibrated" in note for note in plan.notes)


def tiny_mixtral() -> MixtralConfig:
    # hidden 96, not the trace's 64 tokens: a (tokens, hidden) output would look attention-score shaped
    config = MixtralConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                           max_position_embeddings=256)
    config.dtype = "float32"
    return config


MOE_WORKLOAD = Workload(batch_size=1, prompt_len=16, new_tokens=8)


@pytest.fixture(scope="module")
def calibrated_parts(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Mixtral calibrated at both granularities, its experts in 2 groups."""
    path = tmp_path_factory.mktemp("calibrate_parts") / "profile.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PROFILE_ENV_VAR, str(path))
        result = placement_opt.calibrate(tiny_mixtral(), ["cpu"], workload=MOE_WORKLOAD, granularity="auto",
                                         expert_groups=2, repeats=1)
    return path, result


def test_calibrate_times_the_parts_a_sublayer_plan_places_expert_groups_included(calibrated_parts) -> None:
    _, result = calibrated_parts
    block = trace(tiny_mixtral())
    sublayer = trace(tiny_mixtral(), granularity="sublayer", expert_groups=2)
    keys = {shape_key(u, "float32", g.meta.seq_len) for g in (block, sublayer) for u in g.units()}
    assert set(result.times) == keys  # every shape of both graphs, each timed once
    assert set(result.granularities) == {"block", "sublayer"}
    parts = result.granularities["sublayer"]
    assert {"model.layers.0.self_attn", "model.layers.0.mlp.gate", "model.layers.0.mlp.experts.groups.0"} <= set(parts)
    assert "model.embed_tokens" not in parts  # the block pass timed its shape already
    group = result.times[parts["model.layers.0.mlp.experts.groups.0"]]["cpu"]
    assert group.prefill and group.decode and all(s > 0 for *_, s in group.decode)
    assert result.layers_built == 1
    text = result.summary()
    assert "model.layers.0 (block) on cpu" in text and "model.layers.0.mlp.experts.groups.0 (sublayer) on cpu" in text


def test_a_sublayer_plan_is_priced_by_its_calibrated_parts_and_says_what_is_not(calibrated_parts, monkeypatch) -> None:
    path, result = calibrated_parts
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    plan = placement_opt.solve(tiny_mixtral(), {"cpu": "1GiB"}, workload=MOE_WORKLOAD, granularity="sublayer",
                               expert_groups=2, workers=1)
    graph = trace(tiny_mixtral(), granularity="sublayer", expert_groups=2)
    assert f"unit times calibrated on this model: {len(graph)} of {len(graph)} units" in " ".join(plan.notes)
    group = next(u for u in plan.cost.units if u.name == "model.layers.1.mlp.experts.groups.1")
    timed = result.times[result.granularities["sublayer"]["model.layers.0.mlp.experts.groups.0"]]["cpu"]
    assert group.prefill_s == pytest.approx(timed.prefill_s(1, 16, "last"), abs=1e-9)  # costs are rounded to 1 ns
    # whole experts (no groups) are another shape: not timed, and the note says how to time them
    whole = placement_opt.solve(tiny_mixtral(), {"cpu": "1GiB"}, workload=MOE_WORKLOAD, granularity="sublayer",
                                workers=1)
    said = next(n for n in whole.notes if n.startswith("unit times calibrated"))
    assert "--granularity sublayer times these units" in said and not said.startswith(f"unit times calibrated on "
                                                                                       f"this model: {len(graph)} of")


def test_auto_granularity_says_when_its_two_prices_rest_on_unlike_figures(calibrated, monkeypatch) -> None:
    path, _ = calibrated  # the block units only
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    plan = placement_opt.solve(tiny_config(), {"cpu": "4GiB"}, workload=WORKLOAD, granularity="auto", workers=1)
    unlike = [n for n in plan.notes if n.startswith("granularity auto compared prices of unlike sources")]
    assert unlike and "--granularity auto" in unlike[0]
    graph = trace(tiny_config())
    assert f"{len(graph)} of {len(graph)} block units" in unlike[0]


def test_calibrate_refuses_granularities_solve_would_refuse(tmp_path) -> None:
    with pytest.raises(PlacementError, match="granularity='module'.*accepted are 'block', 'sublayer', 'auto'"):
        placement_opt.calibrate(tiny_config(), ["cpu"], path=tmp_path / "p.json", granularity="module")
    with pytest.raises(PlacementError, match="expert_groups=2 cuts the experts units of sublayer graphs"):
        placement_opt.calibrate(tiny_mixtral(), ["cpu"], path=tmp_path / "p.json", expert_groups=2)
    assert not (tmp_path / "p.json").exists()  # refused before anything was measured


def test_a_routed_units_cold_read_keeps_its_batch_and_prices_the_same_step_as_measured(tmp_path, monkeypatch) -> None:
    """Calibrated through the dispatcher from disk (top-2 of 4 experts at batch 1: each step asks for its two
    picks), the experts' cold decode is saved with its batch, and pricing a disk step of that batch gives the
    figure back (the profile's scattered rate does not replace it)."""
    from placement_opt.cost.context import PricingContext
    from placement_opt.cost.traffic import routed_read_s

    path = tmp_path / "profile.json"
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))
    result = placement_opt.calibrate(tiny_mixtral(), ["cpu", "disk"], workload=MOE_WORKLOAD, granularity="sublayer",
                                     offload_dir=tmp_path, repeats=1)
    name = "model.layers.0.mlp.experts"
    read = result.copies[result.units[name]]["disk->cpu"]["stream"]
    assert read["decode_batch"] == MOE_WORKLOAD.batch_size and read["decode"] >= 0
    assert f"{name} weights disk->cpu: stream prefill" in result.summary() and "(batch 1)" in result.summary()
    graph = trace(tiny_mixtral(), granularity="sublayer")
    machine = as_machine(["cpu", "disk"], dtype="float32")
    ctx = PricingContext(graph, machine, MOE_WORKLOAD, calibration_for(graph, machine))
    shared_s = (graph.unit(name).weight_bytes - graph.unit(name).moe_expert_bytes) / machine.bandwidth("disk", "cpu")
    assert routed_read_s(ctx, graph.unit(name), "disk", "cpu", 1) == pytest.approx(max(read["decode"], shared_s))


def test_a_shapes_cold_read_is_the_mean_of_the_copys_units_of_that_shape(tmp_path, monkeypatch) -> None:
    # Consecutive units of one shape read side by side (the read-ahead chain): the first waits for its pages
    # while the next one's compete with them. Each group is charged the pair's mean, not the first's read.
    from placement_opt.runtime import _calibrate_disk as calibrate_module

    graph = trace(tiny_mixtral(), granularity="sublayer", expert_groups=2)
    first, second = "model.layers.0.mlp.experts.groups.0", "model.layers.0.mlp.experts.groups.1"
    cold = {"prefill": {first: 0.5, second: 0.1}, "decode": {first: 0.4, second: 0.2}}
    monkeypatch.setattr(calibrate_module, "_run_mapped", lambda *args: cold)
    resident = {"prefill": {first: 0.05, second: 0.05}, "decode": {first: 0.01, second: 0.01}}
    key = shape_key(graph.unit(first), graph.meta.dtype, graph.meta.seq_len)
    reads = calibrate_module.time_disk_reads(None, graph, graph, {first: key}, MOE_WORKLOAD, resident, tmp_path)
    assert set(reads[key]["disk->cpu"]) == {"stream"}  # accelerate has no expert groups to run
    assert reads[key]["disk->cpu"]["stream"] == pytest.approx({"prefill": 0.25, "decode": 0.29,
                                                                "decode_batch": MOE_WORKLOAD.batch_size})


_SIZES = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=8)


@given(first=_SIZES, second=_SIZES)
def test_the_passes_time_every_shape_of_every_cut_once_and_first_where_it_first_appears(first, second) -> None:
    # Units of a size class share a shape; each pass times the first unit of each shape no earlier pass timed.
    from placement_opt.runtime.calibrate import _passes

    def graph(sizes: list[int], prefix: str):
        return chain_graph([{"name": f"{prefix}{i}", "param_bytes": 64 * (s + 1)} for i, s in enumerate(sizes)])

    graphs = [graph(first, "a"), graph(second, "b")]
    passes = _passes(graphs, [{"granularity": "block"}, {"granularity": "sublayer"}])
    timed = [key for one in passes for key in one.representatives.values()]
    every = {shape_key(u, g.meta.dtype, g.meta.seq_len) for g in graphs for u in g.units()}
    assert sorted(timed) == sorted(every)  # each shape once, none left out
    for one in passes:
        for name, key in one.representatives.items():  # the first unit of its shape in that graph
            units = one.graph.units()
            assert next(u.name for u in units if shape_key(u, one.graph.meta.dtype, one.graph.meta.seq_len) == key) \
                == name
    assert passes[0].graph is graphs[0] and passes[0].representatives  # the first cut always runs
    assert len(passes) == 1 + bool(set(second) - set(first))  # a pass with nothing new is skipped


@pytest.mark.parametrize("least_bytes", [0, 1 << 20])
def test_disk_reads_are_timed_in_chains_of_one_shape_as_a_plan_offloading_that_part_reads_them(
        monkeypatch, least_bytes: int) -> None:
    from placement_opt.runtime import _calibrate_disk as calibrate_module

    monkeypatch.setattr(calibrate_module, "CHAIN_MIN_BYTES", least_bytes)
    graph = trace(tiny_mixtral(), granularity="sublayer")
    chains = calibrate_module._disk_chains(graph, graph)
    weighted = {u.name for u in graph.units() if u.weight_bytes > 0}
    assert sorted(n for chain in chains for n in chain) == sorted(weighted)  # each unit with weights once
    keys = {u.name: shape_key(u, graph.meta.dtype, graph.meta.seq_len) for u in graph.units()}
    experts = {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    if least_bytes == 0:  # every repeated shape a chain alone (the norms one); the embedding and head together
        assert experts in chains and {"model.layers.0.self_attn", "model.layers.1.self_attn"} in chains
        assert all(len({keys[n] for n in chain}) == 1 for chain in chains[:-1])
        assert {"model.embed_tokens", "lm_head"} <= chains[-1]
    else:  # the tiny model's units are all small: one chain, as every unit on disk was timed before
        assert chains == [weighted]


@given(runs=st.lists(st.fixed_dictionaries({"a": st.floats(0, 1), "b": st.floats(0, 1)}), min_size=1, max_size=9))
def test_typical_takes_the_median_but_of_the_routed_units_the_mean(runs) -> None:
    import statistics

    from placement_opt.runtime._calibrate_clock import typical

    figures = typical(runs, mean_of={"b"})
    assert figures["a"] == statistics.median(r["a"] for r in runs)
    assert figures["b"] == pytest.approx(statistics.fmean(r["b"] for r in runs))


def test_an_expert_groups_decode_figure_is_the_mean_over_the_groups_of_its_shape(tmp_path, monkeypatch) -> None:
    """A router that sends every step's tokens to one group of four: each group's decode figure is a quarter of the
    busy group's time (what a plan pays per group on average), not the representative's own time (0 here)."""
    from placement_opt.runtime import calibrate as calibrate_module

    def forwards(model, stamps, workload, repeats, device):
        names = [name for name, _ in stamps_modules(stamps)]
        run = {name: (1.0 if name.endswith("groups.1") else 0.0) if ".groups." in name else 0.5 for name in names}
        assert {n for n in names if ".groups." in n} <= stamps.routed  # the groups' steps are averaged too
        return {(1, 16): dict(run)}, {(1, 17): dict(run)}

    def stamps_modules(stamps):
        return [(name, None) for name in stamps.names]

    real = calibrate_module.Stamps

    class Recording(real):
        def __init__(self, modules, device, routed=()):
            super().__init__(modules, device, routed)
            self.names = list(modules)

    monkeypatch.setattr(calibrate_module, "Stamps", Recording)
    monkeypatch.setattr(calibrate_module, "time_forwards", forwards)
    config = MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=128)
    result = placement_opt.calibrate(config, ["cpu"], workload=Workload(batch_size=1, prompt_len=16, new_tokens=2),
                                     granularity="sublayer", expert_groups=4, path=tmp_path / "p.json")
    group = next(key for name, key in result.units.items() if ".groups." in name)
    (decode,) = result.times[group]["cpu"].decode
    assert decode[2] == pytest.approx(0.25)
    norm = next(key for name, key in result.units.items() if name.endswith("input_layernorm"))
    assert result.times[norm]["cpu"].decode[0][2] == 0.5  # others: their own figure


@pytest.mark.parametrize("entry", [{"units": "x"}, {"units": {}, "models": []}], ids=["units", "models"])
def test_a_malformed_saved_calibration_is_refused_before_timing(calibrated, tmp_path, monkeypatch, entry) -> None:
    """calibrate() into a profile whose 'calibration' entry is malformed timed the model, then failed saving with a raw
    ValueError or TypeError (from the CLI, in dispatch: "cannot dispatch this device_map")."""
    from placement_opt.errors import ProfileError
    from placement_opt.hardware.profile_store import this_host
    from placement_opt.runtime import calibrate as calibrate_module

    path, _ = calibrated
    data = json.loads(path.read_text())
    data["calibration"] = {"host": this_host(), **entry}
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(data))
    monkeypatch.setattr(calibrate_module, "build", lambda *a, **k: pytest.fail("timed before checking the profile"))
    with pytest.raises(ProfileError, match="malformed 'calibration' entry: delete"):
        placement_opt.calibrate(tiny_config(), ["cpu"], workload=WORKLOAD, path=broken, repeats=1)
    assert json.loads(broken.read_text()) == data  # kept as it was


def test_calibrate_takes_auto_for_this_machine_as_solve_does(tmp_path, monkeypatch) -> None:
    """devices='auto' (solve()'s and --devices' word for this machine) was an unknown device name to calibrate()."""
    monkeypatch.setattr("placement_opt.hardware.detect.local_device_names", lambda: ["cpu"])  # no disk: quicker
    result = placement_opt.calibrate(tiny_config(), "auto", workload=Workload(batch_size=1, prompt_len=8, new_tokens=2),
                                     path=tmp_path / "p.json", repeats=1)
    assert result.devices == ("cpu",)


def test_a_machine_read_from_a_profile_file_is_priced_by_that_files_calibration(calibrated, tmp_path,
                                                                                monkeypatch) -> None:
    """A machine from ``profile(path=P)`` (or ``--devices P``) was priced with the default profile's calibration:
    none here, where the default profile is another file, and another host's times where it was copied from one."""
    path, _ = calibrated
    monkeypatch.setenv(PROFILE_ENV_VAR, str(tmp_path / "default.json"))  # no profile there
    data = json.loads(path.read_text())
    machine = Machine.from_dict({**data["machine"], "profile_path": str(path)})
    plan = placement_opt.solve(tiny_config(), machine, workload=WORKLOAD, workers=1)
    graph = trace(tiny_config())
    assert f"{len(graph)} of {len(graph)} units measured on this machine" in " ".join(plan.notes)
    unpriced = placement_opt.solve(tiny_config(), Machine.from_dict(data["machine"]), workload=WORKLOAD, workers=1)
    assert "not calibrated on this machine" in " ".join(unpriced.notes)
    assert plan.cost.prefill_s != pytest.approx(unpriced.cost.prefill_s, rel=1e-3)
    # the plan keeps where its figures came from: priced again from its JSON, it is the same plan
    again = placement_opt.Plan.from_json(plan.to_json())
    assert again.machine.profile_path == str(path)
    assert placement_opt.evaluate(again, tiny_config(), again.machine, WORKLOAD).total_s == pytest.approx(
        plan.cost.total_s)
    assert "profile_path" not in unpriced.to_json()  # plans of this host's profile read as they always have


def test_calibrate_saves_where_a_machine_read_from_a_profile_is_priced_from(calibrated, tmp_path, monkeypatch) -> None:
    """A machine read from a profile file is priced from that file's calibration, so calibrate(model, machine)
    saves there (it saved to the default profile, which that machine's plans never read); a file another host
    measured is refused before timing, and kept."""
    path, _ = calibrated
    default = tmp_path / "default.json"
    monkeypatch.setenv(PROFILE_ENV_VAR, str(default))
    data = json.loads(path.read_text())
    del data["calibration"]
    apart = tmp_path / "apart.json"
    apart.write_text(json.dumps(data))
    machine = Machine.from_dict({**data["machine"], "profile_path": str(apart)})
    placement_opt.calibrate(tiny_config(), machine, workload=WORKLOAD, repeats=1)
    assert saved_calibration(apart) is not None and not default.exists()
    plan = placement_opt.solve(tiny_config(), machine, workload=WORKLOAD, workers=1)
    assert "units measured on this machine" in " ".join(plan.notes)
    data["host"] = "gpu-server-7"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="which host 'gpu-server-7' measured: calibrate on that host"):
        placement_opt.calibrate(tiny_config(), Machine.from_dict({**data["machine"], "profile_path": str(other)}),
                                workload=WORKLOAD)
    assert json.loads(other.read_text()) == data
