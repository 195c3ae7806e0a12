"""dispatch() of phased units: the prefill streamed to the GPU, the decode on the CPU where the weights are.

This machine may have no GPU: the fixture ``gpu_on_cpu`` makes "cuda:0" resolve to the CPU inside
the runtime (its device mapping and its count of CUDA devices), so the real code paths run end to
end: weights streamed by the Streamer in the prefill (plain copies; pinned memory and side streams
are for real GPUs), the decode from the stored tensors (RAM, or the memory map for disk), the
prompt's KV cache moved after each prefill. Which path a call took is read from the weights a
submodule computes with: a copy in the prefill, the stored tensor itself in the decode. The GPU
versions of these checks are in test_dispatch_cuda.py.

Tiny random-init models: Llama (4 layers), Mixtral-shaped (2 layers, 4 experts top-2) and
Qwen2-MoE-shaped (2 layers, 4 experts top-2 and a shared expert).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as T

from _models import (
    MAPPED,
    RESIDENT,
    assert_restored,
    make_plan,
    snapshot,
    tied_groups,
    tiny,
    units_of,
)
from placement_opt.errors import DispatchError
from placement_opt.plan import Plan, UnitPlacement
from placement_opt.runtime import _hooks, _streamer
from placement_opt.runtime.dispatcher import dispatch
from placement_opt.runtime.loader import load
from placement_opt.runtime.timing import cache_argument, cache_of

PHASED_CPU = ("cpu", "cpu", "phased", "cuda:0")
PHASED_DISK = ("disk", "cpu", "phased", "cuda:0")
GPU_STREAM = ("cpu", "cuda:0", "stream")  # cuda:0 is the CPU under gpu_on_cpu: a CPU -> CPU copy
GENERATE = {"do_sample": False, "pad_token_id": 0, "output_logits": True, "return_dict_in_generate": True}


@pytest.fixture
def kv_moves(monkeypatch):
    """The prompt KV moves of phased units: (unit, layer ids) each time their cache layers move while
    holding tokens (a move before the prefill finds them empty)."""
    moves = []
    real = _hooks.move_cache_layers

    def spy(unit, layer_ids, args, kwargs, device):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.24 renamed it
        if cache is not None and any(cache.layers[i].get_seq_length() > 0 for i in layer_ids):
            moves.append((unit, layer_ids))
        return real(unit, layer_ids, args, kwargs, device)

    monkeypatch.setattr(_hooks, "move_cache_layers", spy)
    return moves


def prompt(length: int = 7) -> dict[str, torch.Tensor]:
    """A batch of 2, the second sequence left-padded by 2 tokens (1 token: no padding)."""
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if length > 2:
        mask[1, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def phased_plan(model: torch.nn.Module, choose, units: list[str] | None = None) -> Plan:
    """``choose(i, unit)`` -> (storage, execution, mode[, prefill_execution]); tied units follow the first."""
    units = units or units_of(model)
    rows = {u: choose(i, u) for i, u in enumerate(units)}
    for group in tied_groups(model, units):
        first = min(group, key=units.index)
        for u in group:
            rows[u] = rows[first]
    placements = tuple(UnitPlacement(unit=u, storage=r[0], execution=r[1], mode=r[2],
                                     prefill_execution=r[3] if len(r) > 3 else None)
                       for u, r in ((u, rows[u]) for u in units))
    base = make_plan([(u, "cpu", "cpu", "resident") for u in units], name=type(model).__name__)
    return dataclasses.replace(base, placements=placements)


class PathRecorder:
    """Per phased unit, the path each call took: "prefill" when the Streamer handed it copied weights,
    "decode" otherwise. Where the unit's weights sit in a submodule, the weights that submodule
    computed from are recorded too (:attr:`sources`): a copy in the prefill, the stored tensor itself
    in the decode; :meth:`close` checks that the two agree."""

    def __init__(self, handle, names: list[str]) -> None:
        self.calls: dict[str, list[str]] = {name: [] for name in names}
        self.sources: dict[str, list[str]] = {}
        self._hooks = []
        for name in names:
            unit = handle.model.get_submodule(name)
            self._hooks.append(unit.register_forward_pre_hook(
                lambda module, args, _name=name: self.calls[_name].append("decode")))
            leaf, weight = self._weighted_leaf(unit)
            if leaf is not None and leaf is not unit:  # a unit's own pre-hooks run before its wrapper swaps copies in
                self.sources[name] = []
                self._hooks.append(leaf.register_forward_pre_hook(self._source(name, weight, weight.data_ptr())))

    @staticmethod
    def _weighted_leaf(module):
        for sub in module.modules():
            weight = sub.__dict__["_parameters"].get("weight")
            if weight is not None and weight.dim() == 2:
                return sub, weight
        return None, None

    def _source(self, name, weight, stored):
        def hook(module, args):
            self.sources[name].append("stored" if weight.data_ptr() == stored else "copy")
        return hook

    def took(self, unit: str) -> None:
        """The Streamer handed ``unit`` its weights: the call under way is a prefill."""
        if unit in self.calls:
            self.calls[unit][-1] = "prefill"

    def counts(self, name: str) -> tuple[int, int]:
        return self.calls[name].count("prefill"), self.calls[name].count("decode")

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for name, sources in self.sources.items():
            assert sources == [{"prefill": "copy", "decode": "stored"}[c] for c in self.calls[name]], name


@pytest.fixture
def record_paths(monkeypatch):
    """``record_paths(handle, unit names)`` -> a :class:`PathRecorder` told of every Streamer.take."""
    recorders: list[PathRecorder] = []
    real_take = _streamer.Streamer.take

    def take(self, unit):
        for recorder in recorders:
            recorder.took(unit.name)
        return real_take(self, unit)

    monkeypatch.setattr(_streamer.Streamer, "take", take)

    def make(handle, names):
        recorders.append(PathRecorder(handle, names))
        return recorders[-1]

    return make


def _phased_names(plan: Plan) -> list[str]:
    return [p.unit for p in plan.placements if p.mode == "phased"]


# ---------------------------------------------------------------------------------------------
# generate(): the plain model's tokens and logits; one prefill per generate, a decode per step
# ---------------------------------------------------------------------------------------------
def _generate_checked(model, plan, tmp_path, record_paths, steps):
    """generate() under ``plan``, its tokens and logits checked against the plain model's; returns (the phased
    units' paths, handle, snapshot of the model before dispatch)."""
    batch = prompt()
    with torch.no_grad():
        expected = model.generate(**batch, max_new_tokens=steps, **GENERATE)
    before = snapshot(model)
    handle = dispatch(model, plan, offload_dir=tmp_path)
    paths = record_paths(handle, _phased_names(plan))
    with torch.no_grad():
        out = handle.generate(**batch, max_new_tokens=steps, **GENERATE)
    paths.close()
    assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(out.logits, expected.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    return paths, handle, before


def _mix(storage_row):
    """Layer 0 phased, layer 1 streamed, layer 2 phased, layer 3 memory-mapped; the rest resident."""
    def choose(i, unit):
        layer = {"model.layers.0": storage_row, "model.layers.1": GPU_STREAM,
                 "model.layers.2": storage_row, "model.layers.3": MAPPED}
        return layer.get(unit, RESIDENT)
    return choose


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("phased", [PHASED_CPU, PHASED_DISK], ids=["cpu", "disk"])
def test_generate_equals_the_plain_model(family, phased, gpu_on_cpu, kv_moves, tmp_path, record_paths):
    model, steps = tiny(family), 5
    plan = phased_plan(model, _mix(phased))
    paths, handle, before = _generate_checked(model, plan, tmp_path, record_paths, steps)
    names = _phased_names(plan)
    assert set(handle.unit_kinds()[n] for n in names) == {"phased"} and "stream" in handle.unit_kinds().values()
    for name in names:  # the prompt streamed once, each new token decoded where the weights are stored
        assert paths.calls[name] == ["prefill"] + ["decode"] * (steps - 1), name
    assert kv_moves == [(n, (int(n.split(".")[-1]),)) for n in names]  # once per layer, its own layer
    handle.remove()
    assert_restored(model, before)


def test_generate_twice_prefills_once_each(gpu_on_cpu, kv_moves, tmp_path, record_paths):
    model = tiny("llama")
    plan = phased_plan(model, _mix(PHASED_DISK))
    handle = dispatch(model, plan, offload_dir=tmp_path)
    paths = record_paths(handle, _phased_names(plan))
    with torch.no_grad():
        first = handle.generate(**prompt(), max_new_tokens=3, **GENERATE).sequences
        second = handle.generate(**prompt(), max_new_tokens=3, **GENERATE).sequences
    paths.close()
    assert torch.equal(first, second)
    assert paths.counts("model.layers.0") == (2, 4)
    assert len(kv_moves) == 4  # 2 phased units x 2 prompts
    handle.remove()


@pytest.mark.parametrize("options", [{"cache_implementation": "static"}, {"num_beams": 3}],
                         ids=["static-cache", "beam-search"])
def test_generate_with_a_static_cache_or_beams(options, gpu_on_cpu, kv_moves, tmp_path, record_paths):
    # a static cache's layers hold a preallocated buffer and a position counter; beams reorder the cache
    model = tiny("llama")
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, **options}
    with torch.no_grad():
        expected = model.generate(**prompt(), **kwargs)
    plan = phased_plan(model, _mix(PHASED_DISK))
    handle = dispatch(model, plan, offload_dir=tmp_path)
    paths = record_paths(handle, _phased_names(plan))
    with torch.no_grad():
        tokens = handle.generate(**prompt(), **kwargs)
    paths.close()
    assert torch.equal(tokens, expected)
    assert paths.calls["model.layers.2"] == ["prefill", "decode", "decode", "decode"]
    assert kv_moves == [("model.layers.0", (0,)), ("model.layers.2", (2,))]
    handle.remove()


@pytest.mark.parametrize("row", [PHASED_CPU, PHASED_DISK, GPU_STREAM, ("disk", "cuda:0", "stream")],
                         ids=["phased-cpu", "phased-disk", "ram-to-gpu", "disk-to-gpu"])
def test_a_weight_assigned_through_data_is_computed_with_and_kept(row, gpu_on_cpu, tmp_path):
    """``param.data = new`` (PEFT's safe LoRA merge, ``Module._apply``) on a unit whose weights are copied for its
    forward: the copies are made from ``new`` from the next call on, and remove() leaves ``new`` in place. A
    streamed forward put the stored weights back when it returned, so the assignment was lost unseen."""
    import copy

    model = tiny("llama")
    changed = copy.deepcopy(model)
    handle = dispatch(model, phased_plan(model, lambda i, u: row if u == "model.layers.1" else RESIDENT),
                      offload_dir=tmp_path)
    new = torch.randn(model.model.layers[1].mlp.up_proj.weight.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        handle.generate(**prompt(), max_new_tokens=3, **GENERATE)  # a copy of the next step may be under way
        for m in (model, changed):
            m.model.layers[1].mlp.up_proj.weight.data = new.clone()
        expected = changed.generate(**prompt(), max_new_tokens=4, **GENERATE)
        for _ in range(2):
            got = handle.generate(**prompt(), max_new_tokens=4, **GENERATE)
            assert torch.equal(got.sequences, expected.sequences)
            torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=1e-6, atol=1e-6)
    handle.remove()
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, new)


def test_calls_from_two_threads_run_one_at_a_time(gpu_on_cpu, tmp_path):
    """A streamed forward sets its weights to their copy and back when it returns: thread A returning from the
    unit while thread B computes in it left B computing from the host-stored weights (a device mismatch on a GPU).
    Forced here: A waits, inside the unit, for B to enter it (1 s at most); B then waits for A to leave it. Calls
    run one at a time, so B enters after A has returned."""
    import threading

    model = tiny("llama")
    handle = dispatch(model, phased_plan(model, lambda i, u: GPU_STREAM if u == "model.layers.1" else RESIDENT),
                      offload_dir=tmp_path)
    layer = model.model.layers[1]
    stored = {slot.stored.data_ptr() for u in handle._units if u.name == "model.layers.1" for slot in u.uses}
    b_inside, a_left, host_weights = threading.Event(), threading.Event(), []

    def first_matmul(module, args):
        if threading.current_thread().name == "B":
            b_inside.set()
            a_left.wait(timeout=1)
            host_weights.append(module.weight.data_ptr() in stored)

    def last_matmul(module, args):
        if threading.current_thread().name == "A":
            b_inside.wait(timeout=1)

    hooks = [layer.self_attn.q_proj.register_forward_pre_hook(first_matmul),
             layer.mlp.down_proj.register_forward_pre_hook(last_matmul),
             layer.register_forward_hook(lambda m, a, o: a_left.set() if threading.current_thread().name == "A"
                                         else None)]
    outputs = {}

    def call(name):
        with torch.no_grad():
            outputs[name] = handle(**prompt()).logits

    a = threading.Thread(target=call, args=("A",), name="A")
    b = threading.Thread(target=call, args=("B",), name="B")
    a.start()
    b.start()
    a.join()
    b.join()
    for hook in hooks:
        hook.remove()
    assert host_weights == [False]
    with torch.no_grad():
        expected = handle(**prompt()).logits
    assert torch.equal(outputs["A"], expected) and torch.equal(outputs["B"], expected)
    handle.remove()


def test_a_one_token_prompt_never_takes_the_prefill_path(gpu_on_cpu, kv_moves, tmp_path, record_paths):
    model = tiny("llama")
    batch = prompt(1)
    with torch.no_grad():
        expected = model.generate(**batch, max_new_tokens=4, **GENERATE)
    plan = phased_plan(model, _mix(PHASED_CPU))
    handle = dispatch(model, plan, offload_dir=tmp_path)
    paths = record_paths(handle, _phased_names(plan))
    with torch.no_grad():
        out = handle.generate(**batch, max_new_tokens=4, **GENERATE)
    paths.close()
    assert torch.equal(out.sequences, expected.sequences)
    assert all(calls == ["decode"] * 4 for calls in paths.calls.values()), paths.calls
    assert kv_moves == []
    handle.remove()


def test_a_multi_token_call_on_a_filled_cache_runs_where_the_unit_decodes(gpu_on_cpu, kv_moves, tmp_path, record_paths):
    # chunked prefill (or a speculative verification): 4 tokens, then 3 more on that cache
    model = tiny("llama")
    ids = prompt()["input_ids"]
    with torch.no_grad():
        head = model(input_ids=ids[:, :4], use_cache=True)
        expected = model(input_ids=ids[:, 4:], **cache_argument(model, cache_of(head)), use_cache=True).logits
    plan = phased_plan(model, _mix(PHASED_CPU))
    handle = dispatch(model, plan, offload_dir=tmp_path)
    paths = record_paths(handle, _phased_names(plan))
    with torch.no_grad():
        head = handle(input_ids=ids[:, :4], use_cache=True)
        logits = handle(input_ids=ids[:, 4:], **cache_argument(model, cache_of(head)), use_cache=True).logits
    paths.close()
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    assert paths.calls["model.layers.0"] == ["prefill", "decode"]
    assert kv_moves == [("model.layers.0", (0,)), ("model.layers.2", (2,))]  # after the first call only
    handle.remove()


def test_a_forward_without_cache_is_a_prefill_with_nothing_to_move(gpu_on_cpu, tmp_path, record_paths):
    model = tiny("llama")
    with torch.no_grad():
        expected = model(**prompt(), use_cache=False).logits
    plan = phased_plan(model, _mix(PHASED_DISK))
    handle = dispatch(model, plan, offload_dir=tmp_path)
    paths = record_paths(handle, _phased_names(plan))
    with torch.no_grad():
        logits = handle(**prompt(), use_cache=False).logits
    paths.close()
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    assert paths.counts("model.layers.2") == (1, 0)
    handle.remove()


# ---------------------------------------------------------------------------------------------
# Units finer than a decoder layer: an attention module, an MLP, lm_head
# ---------------------------------------------------------------------------------------------
def _fine_units(model: torch.nn.Module, kinds: tuple[str, ...]) -> list[str]:
    """Modules of the classes ``kinds`` as units, and every other module holding weights."""
    units: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(u + ".") for u in units):
            continue
        if type(module).__name__ in kinds or list(module.parameters(recurse=False)) \
                or list(module.buffers(recurse=False)):
            units.append(name)
    return units


def _generate_fine(model, kinds, chosen, tmp_path, record_paths, steps=4):
    """:func:`_generate_checked` with the units of ``kinds`` placed as ``chosen`` (the rest resident); returns
    (plan, the phased units' paths, handle, snapshot before)."""
    plan = phased_plan(model, lambda i, u: chosen.get(u, RESIDENT), _fine_units(model, kinds))
    return (plan, *_generate_checked(model, plan, tmp_path, record_paths, steps))


def test_attention_mlp_and_lm_head_units(gpu_on_cpu, kv_moves, tmp_path, record_paths):
    model, steps = tiny("llama"), 4
    chosen = {"model.layers.1.self_attn": PHASED_CPU, "model.layers.1.mlp": PHASED_DISK,
              "model.layers.2.self_attn": PHASED_DISK, "model.layers.2.mlp": GPU_STREAM, "lm_head": PHASED_CPU}
    plan, paths, handle, before = _generate_fine(model, ("LlamaAttention", "LlamaMLP"), chosen, tmp_path,
                                                 record_paths, steps)
    for name in ("model.layers.1.self_attn", "model.layers.1.mlp", "model.layers.2.self_attn"):
        assert paths.calls[name] == ["prefill"] + ["decode"] * (steps - 1), name
    # generate() keeps the last position's logits: lm_head sees one token per sequence, a decode
    assert paths.calls["lm_head"] == ["decode"] * steps
    assert kv_moves == [("model.layers.1.self_attn", (1,)), ("model.layers.2.self_attn", (2,))]
    handle.remove()
    assert_restored(model, before)


def test_experts_units_take_the_phase_of_the_models_call(gpu_on_cpu, kv_moves, tmp_path, record_paths):
    # an experts module gets the tokens of all sequences flattened ([tokens, hidden]): its input does not
    # say how many each sequence has, so it follows the phase the model's call (and the units before it) set
    model, steps = tiny("qwen2_moe"), 4
    chosen = {"model.layers.0.self_attn": PHASED_CPU, "model.layers.0.mlp.experts": PHASED_DISK,
              "model.layers.1.mlp.experts": PHASED_CPU, "model.layers.1.self_attn": GPU_STREAM}
    plan, paths, handle, before = _generate_fine(model, ("Qwen2MoeAttention", "Qwen2MoeExperts"), chosen, tmp_path,
                                                 record_paths, steps)
    for name in _phased_names(plan):
        assert paths.calls[name] == ["prefill"] + ["decode"] * (steps - 1), name
    assert kv_moves == [("model.layers.0.self_attn", (0,))]
    handle.remove()
    assert_restored(model, before)


# ---------------------------------------------------------------------------------------------
# Weights: the decode computes from the stored tensors, the checkpoint's own bytes for load()
# ---------------------------------------------------------------------------------------------
def test_load_decodes_from_the_checkpoints_memory_map(gpu_on_cpu, tmp_path_factory, record_paths):
    model = tiny("llama")
    path = tmp_path_factory.mktemp("llama-ckpt")
    model.save_pretrained(path)
    batch = prompt()
    with torch.no_grad():
        expected = model.generate(**batch, max_new_tokens=4, **GENERATE).sequences
    plan = phased_plan(model, _mix(PHASED_DISK))
    handle = load(path, None, plan=plan)
    weight = handle.model.model.layers[2].mlp.up_proj.weight
    file, key = next((f, k) for u in handle._units for f, k in u.disk if k.endswith("layers.2.mlp.up_proj.weight"))
    assert weight.data_ptr() == file._mapped().ctypes.data + file.spans[key].offset_bytes  # no copy
    paths = record_paths(handle, _phased_names(plan))
    with torch.no_grad():
        tokens = handle.generate(**batch, max_new_tokens=4, **GENERATE).sequences
    paths.close()
    assert torch.equal(tokens, expected)
    assert paths.counts("model.layers.2") == (1, 3)
    assert weight.data_ptr() == file._mapped().ctypes.data + file.spans[key].offset_bytes  # put back after the prefill
    handle.remove()


# ---------------------------------------------------------------------------------------------
# Prefetching: phased units are streamed ahead in the prefill only
# ---------------------------------------------------------------------------------------------
def test_prefetch_includes_phased_units_in_the_prefill_only(gpu_on_cpu, monkeypatch, tmp_path):
    model = tiny("llama")
    plan = phased_plan(model, lambda i, u: {"model.layers.0": GPU_STREAM, "model.layers.1": PHASED_DISK,
                                            "model.layers.2": GPU_STREAM, "model.layers.3": PHASED_CPU}
                       .get(u, RESIDENT))
    started, taken, dropped = [], [], []
    for name, log in (("start", started), ("take", taken), ("drop", dropped)):
        real = getattr(_streamer.Streamer, name)
        monkeypatch.setattr(_streamer.Streamer, name,
                            lambda self, unit, _real=real, _log=log: (_log.append(unit.name), _real(self, unit))[1])
    handle = dispatch(model, plan, offload_dir=tmp_path)
    with torch.no_grad():
        out = handle(**prompt(), use_cache=True)
        assert started == ["model.layers.1", "model.layers.2", "model.layers.3", "model.layers.0"]
        assert taken == ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3"]
        started.clear(), taken.clear()
        step = {"input_ids": out.logits[:, -1:].argmax(-1), **cache_argument(model, cache_of(out))}
        handle(**step, use_cache=True)
    assert started == ["model.layers.2", "model.layers.0"]  # streamed units only: phased ones decode on the CPU
    assert taken == ["model.layers.0", "model.layers.2"]
    handle.remove()


def test_a_phased_unit_drops_a_prefetch_it_does_not_take(gpu_on_cpu, monkeypatch, tmp_path, record_paths):
    # Layer 0 streamed, layer 1 phased from disk. The model's call looks like a prefill (several tokens,
    # layer 0's cache empty), so layer 0 starts reading layer 1; layer 1 finds its own cache filled and
    # decodes: the read it will not take is let go, nothing stays in flight.
    model = tiny("llama")
    plan = phased_plan(model, lambda i, u: {"model.layers.0": GPU_STREAM, "model.layers.1": PHASED_DISK}
                       .get(u, RESIDENT))
    streamers = []
    real_init = _streamer.Streamer.__init__
    monkeypatch.setattr(_streamer.Streamer, "__init__", lambda self: (streamers.append(self), real_init(self))[1])
    handle = dispatch(model, plan, offload_dir=tmp_path)
    paths = record_paths(handle, ["model.layers.1"])
    ids = prompt()["input_ids"]
    with torch.no_grad():
        cache = cache_of(handle(input_ids=ids[:, :4], use_cache=True))
        cache.layers[0].reset()
        handle(input_ids=ids[:, 4:], **cache_argument(model, cache), use_cache=True)
    paths.close()
    assert paths.calls["model.layers.1"] == ["prefill", "decode"]
    assert streamers[0].inflight == {}
    handle.remove()


# ---------------------------------------------------------------------------------------------
# Hostile plans and caches: refused before anything changes, or said clearly at the boundary
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("row, message", [
    (("cpu", "cpu", "phased", "cpu"), "no prefill_execution other than its execution"),
    (("cpu", "cpu", "phased", "disk"), "prefill on 'disk', not a GPU"),
    (("cpu", "cpu", "phased"), "no prefill_execution"),
    (("cpu", "cuda:0", "phased", "cuda:0"), "no prefill_execution other than its execution"),
    (("cpu", "cuda:1", "phased", "cuda:0"), "decode on 'cuda:1', not 'cpu'"),
    (("cuda:0", "cpu", "phased", "cuda:0"), "stored on 'cuda:0', not 'cpu' or 'disk'"),
    (("cpu", "cpu", "resident", "cuda:0"), "only phased units have"),
], ids=["prefill-on-cpu", "prefill-on-disk", "no-prefill-device", "same-devices", "decode-on-gpu",
        "stored-on-gpu", "resident-with-prefill"])
def test_a_phased_placement_that_cannot_run_is_refused(row, message, gpu_on_cpu):
    model = tiny("llama")
    before = snapshot(model)
    plan = phased_plan(model, lambda i, u: row if u == "model.layers.1" else RESIDENT)
    with pytest.raises(DispatchError, match=message) as err:
        dispatch(model, plan)
    assert "model.layers.1" in str(err.value) and "solve the plan again" in str(err.value)
    assert_restored(model, before)


def test_a_phased_unit_without_its_gpu_is_refused():
    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 GPUs")
    model = tiny("llama")
    before = snapshot(model)
    plan = phased_plan(model, lambda i, u: ("cpu", "cpu", "phased", "cuda:7") if "layers" in u else RESIDENT)
    with pytest.raises(DispatchError, match=r"uses cuda:7 .*\(4 phased unit\(s\) compute their prefill there: model.layers.0, .*"
                                             r"resident on 'cpu'"):
        dispatch(model, plan)
    assert_restored(model, before)


class _PairLayer(T.cache_utils.DynamicLayer):
    """A cache layer keeping its keys and values as one pair: no ``keys``/``values`` of its own."""

    @property
    def keys(self):
        return self.__dict__.get("pair", (None, None))[0]

    @keys.setter
    def keys(self, value):
        self.pair = (value, self.values)

    @property
    def values(self):
        return self.__dict__.get("pair", (None, None))[1]

    @values.setter
    def values(self, value):
        self.pair = (self.keys, value)


def test_a_cache_whose_layers_hold_no_keys_values_is_refused_at_the_boundary(gpu_on_cpu, tmp_path):
    model = tiny("llama")
    before = snapshot(model)
    handle = dispatch(model, phased_plan(model, _mix(PHASED_CPU)), offload_dir=tmp_path)
    cache = T.DynamicCache(config=model.config)
    cache.layers = [_PairLayer() for _ in cache.layers]
    with torch.no_grad(), pytest.raises(DispatchError, match=r"'model.layers.0': cache layer 0 is a _PairLayer, "
                                                            r"which holds no keys/values .*mode 'resident' or 'stream'"):
        handle(**prompt(), **cache_argument(model, cache), use_cache=True)
    with torch.no_grad():  # a Cache of keys/values still runs
        handle(**prompt(), use_cache=True)
    handle.remove()
    assert_restored(model, before)


@pytest.mark.parametrize("disk_reads, warned", [("copy", True), ("mmap", False)])
def test_copied_disk_reads_warn_about_phased_units_that_decode_from_the_map(disk_reads, warned, gpu_on_cpu,
                                                                            tmp_path):
    """disk_reads='copy' cannot reach a phased disk unit's decode: the user is told which units and what to do."""
    import warnings

    model = tiny("llama")
    plan = phased_plan(model, lambda i, u: {"model.layers.1": PHASED_DISK}.get(u, RESIDENT))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = dispatch(model, plan, offload_dir=tmp_path, disk_reads=disk_reads)
    said = [str(w.message) for w in caught if "phased" in str(w.message)]
    assert bool(said) == warned
    if warned:
        assert "model.layers.1" in said[0] and "modes=('resident', 'stream')" in said[0]
    handle.remove()


def test_a_call_starts_a_sequence_without_a_cache_or_with_an_empty_one_whatever_its_length():
    from placement_opt.runtime._phases import call_is_prefill, call_starts_sequence

    config = T.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)
    empty = T.DynamicCache(config=config)
    filled = T.DynamicCache(config=config)
    filled.update(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 8), 0)
    one, many = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)
    for ids in (one, many):
        assert call_starts_sequence((), {"input_ids": ids})
        assert call_starts_sequence((), {"input_ids": ids, "past_key_values": empty})
        assert not call_starts_sequence((), {"input_ids": ids, "past_key_values": filled})
    # a prefill is a sequence's start with more than one token per sequence
    assert call_is_prefill((), {"input_ids": many, "past_key_values": empty})
    assert not call_is_prefill((), {"input_ids": one, "past_key_values": empty})
    assert not call_is_prefill((), {"input_ids": many, "past_key_values": filled})
