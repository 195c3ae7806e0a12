"""Group prefetch: the streamed units of one copy group (a decoder layer cut into sublayer units) are copied
together, started by the group's head (its first unit) one group ahead.

The dispatcher's behaviour is read from a log of one model's calls: each unit's module called (``run``)
and returning (``end``, forward hooks), and every call of the Streamer's ``start``/``take``/``drop``. The
expected log is written from the semantics, not from the dispatcher's code (:class:`Semantics`): with
copy_group None everywhere each streamed unit takes its weights, then starts the next streamed unit, as
before copy groups (the literal log of the first test was taken from the dispatcher before groups); with
groups a group's head starts its own group's streamed units and the next group's before anything else.

This machine may have no GPU: ``gpu_on_cpu`` makes "cuda:0" resolve to the CPU inside the runtime, so
streamed units are CPU -> CPU copies; the disk-stored ones are read by the prefetch thread (Streamer.start
copies ahead only for disk reads and GPU copies), the RAM ones copied when taken. The CUDA test at the end
runs the same plans on a real GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import tempfile
import threading
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _models import assert_restored, make_plan, snapshot, tiny
from placement_opt import trace
from placement_opt.plan import Plan, UnitPlacement
from placement_opt.runtime import _streamer
from placement_opt.runtime.dispatcher import dispatch

GENERATE = {"do_sample": False, "pad_token_id": 0, "output_logits": True, "return_dict_in_generate": True}

# (storage, execution, mode, prefill_execution) and the kind the dispatcher makes of it
ROWS = {
    "gpu": (("cuda:0", "cuda:0", "resident", None), "resident"),
    "cpu": (("cpu", "cpu", "resident", None), "resident"),            # computed off home, on the CPU
    "ram>gpu": (("cpu", "cuda:0", "stream", None), "stream"),         # copied when taken (CPU -> CPU here)
    "disk>gpu": (("disk", "cuda:0", "stream", None), "stream"),       # read ahead by the prefetch thread
    "disk>gpu sync": (("disk", "cuda:0", "stream_sync", None), "stream"),  # alone: prefetched, prefetches nothing; in a group: copied when called
    "mmap": (("disk", "cpu", "stream", None), "mmap"),                # computed from the memory map
    "phased ram": (("cpu", "cpu", "phased", "cuda:0"), "phased"),
    "phased disk": (("disk", "cpu", "phased", "cuda:0"), "phased"),
}
# the rows the units outside the layers draw from: not phased (lm_head sees one token per sequence in
# generate's prefill, so its phase is not the call's), and never mapped; rotary_emb (no weights) stays "gpu"
OUTSIDE = ("gpu", "cpu", "ram>gpu", "disk>gpu", "disk>gpu sync")


def prompt() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def layer_of(unit: str) -> str | None:
    """The decoder layer a sublayer unit was cut from (its copy group), None outside the layers."""
    found = re.match(r"model\.layers\.\d+(?=\.)", unit)
    return found.group(0) if found else None


def group_plan(model: torch.nn.Module, rows: dict[str, str], grouped: bool, granularity: str = "sublayer") -> Plan:
    """A sublayer plan (home cuda:0) with ``rows[unit]`` (a key of ROWS, default "gpu"); ``grouped``: each
    unit's copy_group is its layer. ``granularity="block"``: whole layers, no copy groups, no home."""
    units = trace(model, granularity=granularity).names()
    placements = []
    for unit in units:
        (storage, execution, mode, prefill), _ = ROWS[rows.get(unit, "gpu")]
        placements.append(UnitPlacement(unit=unit, storage=storage, execution=execution, mode=mode,
                                        prefill_execution=prefill, copy_group=layer_of(unit) if grouped else None))
    base = make_plan([(u, "cpu", "cpu", "resident") for u in units], name=type(model).__name__)
    return dataclasses.replace(base, placements=tuple(placements),
                               home="cuda:0" if granularity == "sublayer" else base.home)


# ---------------------------------------------------------------------------------------------
# The log
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def logging_streamer():
    """Every Streamer's start/take/drop, as (operation, unit name), into the list yielded."""
    log: list[tuple[str, str]] = []
    with pytest.MonkeyPatch.context() as patch:
        for op in ("start", "take", "drop"):
            real = getattr(_streamer.Streamer, op)
            patch.setattr(_streamer.Streamer, op,
                          lambda self, unit, _op=op, _real=real: (log.append((_op, unit.name)), _real(self, unit))[1])
        yield log


@contextlib.contextmanager
def logging_units(model: torch.nn.Module, plan: Plan, log: list[tuple[str, str]]):
    """("run", unit) when a unit's module is called (before its wrapper), ("end", unit) when it returns."""
    hooks = []
    for p in plan.placements:
        module = model.get_submodule(p.unit)
        hooks.append(module.register_forward_pre_hook(lambda m, a, _u=p.unit: log.append(("run", _u))))
        hooks.append(module.register_forward_hook(lambda m, a, o, _u=p.unit: log.append(("end", _u))))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def calls(log: list[tuple[str, str]], first: str) -> list[list[tuple[str, str]]]:
    """The log cut into the model's calls: each begins when ``first`` (the first unit) runs."""
    out: list[list[tuple[str, str]]] = []
    for event in log:
        if event == ("run", first) or not out:
            out.append([])
        out[-1].append(event)
    return out


def streamer_ops(call: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [e for e in call if e[0] in ("start", "take", "drop")]


# ---------------------------------------------------------------------------------------------
# The semantics, written from the brief (not from the dispatcher)
# ---------------------------------------------------------------------------------------------
class Semantics:
    """What each unit does with the Streamer when it runs in a prefill or a decode call of ``plan``."""

    def __init__(self, plan: Plan) -> None:
        self.kind = {}
        for p in plan.placements:
            row = next(name for name, (r, _) in ROWS.items()
                       if r == (p.storage, p.execution, p.mode, p.prefill_execution))
            self.kind[p.unit] = ROWS[row][1]
        self.mode = {p.unit: p.mode for p in plan.placements}
        self.execution = {p.unit: p.execution for p in plan.placements}
        self.groups: list[list[str]] = []  # runs of consecutive units with one copy_group; None: alone
        last = None
        for p in plan.placements:
            if p.copy_group is not None and p.copy_group == last:
                self.groups[-1].append(p.unit)
            else:
                self.groups.append([p.unit])
            last = p.copy_group
        self.index = {u: i for i, g in enumerate(self.groups) for u in g}

    def item(self, g: int, prefill: bool) -> list[str]:
        """A group's units the prefetch thread copies ahead in a phase; in a group of several, only a ``stream``
        to a GPU or a phased unit (the others are priced as copied when called)."""
        streamed = ("stream", "phased") if prefill else ("stream",)
        group = self.groups[g]
        return [u for u in group if self.kind[u] in streamed
                and (len(group) == 1 or self.kind[u] == "phased"
                     or (self.mode[u] == "stream" and self.execution[u] != "cpu"))]

    def following(self, g: int, prefill: bool) -> list[str]:
        """The next group's item: a later group's in this phase, else (wrapping; the call after a prefill is a
        decode) the first group's with a decode item; none when that is ``g`` itself."""
        later = next((j for j in range(g + 1, len(self.groups)) if self.item(j, prefill)), None)
        if later is not None:
            return self.item(later, prefill)
        first = next((j for j in range(len(self.groups)) if self.item(j, False)), None)
        return [] if first is None or first == g else self.item(first, False)

    def again(self, unit: str, prefill: bool) -> list[str]:
        """In a decode, each unit of the only group streaming then starts its own copy again once it has taken
        its weights (a stream-mode one): nothing else would prefetch it for the next step. A plan without
        phased units does not tell a prefill from a decode: there every call does it."""
        streaming = [j for j in range(len(self.groups)) if self.item(j, False)]
        told = prefill and "phased" in self.kind.values()  # only a plan with phased units tells a prefill
        if told or len(streaming) != 1:
            return []
        return [unit] if unit in self.item(streaming[0], False) and self.mode[unit] == "stream" else []

    def ops(self, unit: str, prefill: bool) -> list[tuple[str, str]]:
        """What ``unit`` does with the Streamer when it runs."""
        g, kind = self.index[unit], self.kind[unit]
        group = self.groups[g]
        own = {"stream": [("take", unit)], "phased": [("take" if prefill else "drop", unit)]}.get(kind, [])
        again = [("start", u) for u in self.again(unit, prefill)]
        if len(group) > 1:  # a group streaming in this phase: its head starts its item and the next one, first
            item = self.item(g, prefill)
            starts = item + self.following(g, prefill) if unit == group[0] and item else []
            return [("start", u) for u in starts] + own + again
        # a unit alone: takes its weights, then (stream mode, or phased in a prefill) starts the next group's
        ahead = kind == "stream" and self.mode[unit] == "stream" or kind == "phased" and prefill
        return own + [("start", u) for u in (self.following(g, prefill) if ahead else [])] + again

    def expected(self, call: list[tuple[str, str]], prefill: bool) -> list[tuple[str, str]]:
        return [op for event, unit in call if event == "run" for op in self.ops(unit, prefill)]


# ---------------------------------------------------------------------------------------------
# Plans, and running them
# ---------------------------------------------------------------------------------------------
# Llama's 4 layers: a phased attention before a streamed MLP; a CPU norm heading streamed units, one of
# them stream_sync; a memory-mapped attention before a phased MLP (a group streaming in the prefill only);
# a CPU attention between two streamed units; the embedding and the head streamed alone.
MIXED = {
    "model.embed_tokens": "disk>gpu",
    "model.layers.0.self_attn": "phased ram", "model.layers.0.mlp": "ram>gpu",
    "model.layers.1.input_layernorm": "cpu", "model.layers.1.self_attn": "disk>gpu",
    "model.layers.1.mlp": "disk>gpu sync",
    "model.layers.2.self_attn": "mmap", "model.layers.2.mlp": "phased disk",
    "model.layers.3.self_attn": "cpu", "model.layers.3.post_attention_layernorm": "disk>gpu",
    "model.layers.3.mlp": "disk>gpu",
    "lm_head": "ram>gpu",
}


def run_logged(model: torch.nn.Module, plan: Plan, offload_dir, steps: int = 3, tolerance: float = 1e-6):
    """generate() under ``plan`` checked against the plain model (tokens and logits) and remove() against
    the model before; returns the log cut into calls (the first a prefill, then decode steps)."""
    with torch.no_grad():
        expected = model.generate(**prompt(), max_new_tokens=steps, **GENERATE)
    before = snapshot(model)
    with logging_streamer() as log:
        handle = dispatch(model, plan, offload_dir=offload_dir)
        with logging_units(model, plan, log), torch.no_grad():
            got = handle.generate(**prompt(), max_new_tokens=steps, **GENERATE)
        handle.remove()
    assert torch.equal(got.sequences.cpu(), expected.sequences)
    for a, b in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=tolerance, atol=tolerance)
    assert_restored(model, before)
    cut = calls(log, plan.placements[0].unit)
    assert len(cut) == steps
    return cut


def S(*names: str) -> list[tuple[str, str]]:
    """("start", "model.layers.N.x") written S("3.x"); T(...) and D(...) for take and drop."""
    return [("start", _name(n)) for n in names]


def T(name: str) -> list[tuple[str, str]]:
    return [("take", _name(name))]


def D(name: str) -> list[tuple[str, str]]:
    return [("drop", _name(name))]


def _name(short: str) -> str:
    return short if short in ("lm_head", "model.embed_tokens") else f"model.layers.{short}"


# ---------------------------------------------------------------------------------------------
# copy_group None everywhere: as before groups
# ---------------------------------------------------------------------------------------------
def test_without_copy_groups_each_streamed_unit_starts_the_next_one_as_before(gpu_on_cpu, tmp_path):
    """Pinned before group prefetch existed: take your weights, then start the next streamed unit (in the
    prefill phased ones too, wrapping to the first stream unit); stream_sync starts none; a phased unit's
    decode drops what a prefill started for it."""
    model = tiny("llama")
    prefill, *decodes = run_logged(model, group_plan(model, MIXED, grouped=False), tmp_path)
    embed = "model.embed_tokens"
    assert streamer_ops(prefill) == [
        *T(embed), *S("0.self_attn"), *T("0.self_attn"), *S("0.mlp"), *T("0.mlp"), *S("1.self_attn"),
        *T("1.self_attn"), *S("1.mlp"), *T("1.mlp"), *T("2.mlp"), *S("3.post_attention_layernorm"),
        *T("3.post_attention_layernorm"), *S("3.mlp"), *T("3.mlp"), *S("lm_head"), *T("lm_head"), *S(embed)]
    for decode in decodes:
        assert streamer_ops(decode) == [
            *T(embed), *S("0.mlp"), *D("0.self_attn"), *T("0.mlp"), *S("1.self_attn"), *T("1.self_attn"),
            *S("1.mlp"), *T("1.mlp"), *D("2.mlp"),  # 1.mlp (stream_sync) starts none, 2.mlp decodes on the CPU
            *T("3.post_attention_layernorm"), *S("3.mlp"), *T("3.mlp"), *S("lm_head"), *T("lm_head"), *S(embed)]


# ---------------------------------------------------------------------------------------------
# Copy groups: the head starts its group's copies and the next group's
# ---------------------------------------------------------------------------------------------
def test_a_groups_head_starts_its_group_and_the_next_one_first_thing(gpu_on_cpu, tmp_path):
    """The same plan with each layer a copy group. Each layer's head (its input norm: resident on the GPU,
    or on the CPU for layer 1) starts its layer's streamed units and the next streaming layer's before
    anything else; the other units of a layer only take (or drop) their own; the embedding and the head,
    alone, take theirs then start the next group's, as before. Layer 2 streams in the prefill only (a
    phased MLP): in a decode layer 1's head starts layer 3's units, and layer 2's starts none. Layer 1's
    stream_sync MLP is no group's copy: it is copied when called, as the cost model prices it."""
    model = tiny("llama")
    prefill, *decodes = run_logged(model, group_plan(model, MIXED, grouped=True), tmp_path)
    embed, post = "model.embed_tokens", "3.post_attention_layernorm"
    assert streamer_ops(prefill) == [
        *T(embed), *S("0.self_attn", "0.mlp"),
        *S("0.self_attn", "0.mlp", "1.self_attn"), *T("0.self_attn"), *T("0.mlp"),
        *S("1.self_attn", "2.mlp"), *T("1.self_attn"), *T("1.mlp"),  # 1.mlp (stream_sync): copied when called
        *S("2.mlp", post, "3.mlp"), *T("2.mlp"),
        *S(post, "3.mlp", "lm_head"), *T(post), *T("3.mlp"),
        *T("lm_head"), *S(embed)]
    for decode in decodes:
        assert streamer_ops(decode) == [
            *T(embed), *S("0.mlp"),
            *S("0.mlp", "1.self_attn"), *D("0.self_attn"), *T("0.mlp"),
            *S("1.self_attn", post, "3.mlp"), *T("1.self_attn"), *T("1.mlp"),
            *D("2.mlp"),
            *S(post, "3.mlp", "lm_head"), *T(post), *T("3.mlp"),
            *T("lm_head"), *S(embed)]
    sem = Semantics(group_plan(model, MIXED, grouped=True))
    for call, in_prefill in ((prefill, True), *((d, False) for d in decodes)):
        assert_heads_prefetch_one_group_ahead(sem, call, in_prefill)


def test_a_prefill_wraps_to_the_first_group_streaming_in_the_decode(gpu_on_cpu, tmp_path):
    """Layer 0 is phased only: it streams in the prefill, not in the decode. The last streaming group's head
    wraps to layer 1 in both phases, for the call after a prefill is a decode step."""
    model = tiny("llama")
    rows = {"model.layers.0.self_attn": "phased ram", "model.layers.0.mlp": "phased disk",
            "model.layers.1.mlp": "disk>gpu", "model.layers.3.self_attn": "phased disk",
            "model.layers.3.mlp": "disk>gpu"}
    prefill, *decodes = run_logged(model, group_plan(model, rows, grouped=True), tmp_path)
    assert streamer_ops(prefill) == [
        *S("0.self_attn", "0.mlp", "1.mlp"), *T("0.self_attn"), *T("0.mlp"),
        *S("1.mlp", "3.self_attn", "3.mlp"), *T("1.mlp"),
        *S("3.self_attn", "3.mlp", "1.mlp"), *T("3.self_attn"), *T("3.mlp")]
    for decode in decodes:
        assert streamer_ops(decode) == [
            *D("0.self_attn"), *D("0.mlp"),
            *S("1.mlp", "3.mlp"), *T("1.mlp"),
            *S("3.mlp", "1.mlp"), *D("3.self_attn"), *T("3.mlp")]


def test_a_head_is_wrapped_only_when_its_group_streams(gpu_on_cpu, tmp_path):
    """Layer 1 streams its MLP: its input norm (resident on the GPU, home) gets a forward wrapper to start
    the copies. Layer 2 streams nothing: its norm stays unwrapped, as every norm is without copy groups.
    remove() puts every forward back."""
    model = tiny("llama")
    rows = {"model.layers.1.mlp": "disk>gpu"}
    for grouped, wrapped in ((True, {"model.layers.1.input_layernorm"}), (False, set())):
        handle = dispatch(model, group_plan(model, rows, grouped), offload_dir=tmp_path)
        names = {n for n, m in model.named_modules() if m in handle.hooked_modules}
        assert {n for n in names if n.endswith("layernorm")} == wrapped
        assert "model.layers.1.mlp" in names and "model.layers.2.mlp" not in names
        handle.remove()
        assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == []


MOE_ROWS = {  # attention streamed, routers on the GPU, experts phased from disk, the shared expert streamed
    "self_attn": "disk>gpu", "mlp.experts": "phased disk", "mlp.shared_expert": "ram>gpu",
    "mlp.gate": "gpu", "post_attention_layernorm": "cpu",
}


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_layers_prefetched_as_groups_generate_the_plain_models_tokens(family, gpu_on_cpu, tmp_path):
    model = tiny(family)
    units = trace(model, granularity="sublayer").names()
    rows = {u: MOE_ROWS[u.split(".", 3)[3]] for u in units if layer_of(u) and u.split(".", 3)[3] in MOE_ROWS}
    rows["lm_head"] = "disk>gpu"
    plan = group_plan(model, rows, grouped=True)
    sem = Semantics(plan)
    prefill, *decodes = run_logged(model, plan, tmp_path, steps=4)
    for call, in_prefill in ((prefill, True), *((d, False) for d in decodes)):
        assert streamer_ops(call) == sem.expected(call, in_prefill)
        assert_heads_prefetch_one_group_ahead(sem, call, in_prefill)

# ---------------------------------------------------------------------------------------------
# Any modes: the semantics' log, outputs equal, the model restored
# ---------------------------------------------------------------------------------------------
def assert_heads_prefetch_one_group_ahead(sem: Semantics, call: list[tuple[str, str]], prefill: bool) -> None:
    """Within a group of several units only the head starts copies; a group's head starts the whole item of
    the next group streaming in this call before any unit of that group runs."""
    running, starts_by, position = None, {}, {}
    for i, (event, unit) in enumerate(call):
        position.setdefault((event, unit), i)
        if event in ("run", "end"):
            running = unit if event == "run" else None
        elif event == "start":
            assert running is not None, f"{unit} started outside every unit"
            starts_by.setdefault(running, []).append(unit)
    for group in sem.groups:
        if len(group) > 1:
            assert not any(starts_by.get(u) for u in group[1:]), (group, starts_by)
    copying = [g for g in range(len(sem.groups)) if sem.item(g, prefill)]
    for g, after in zip(copying, copying[1:], strict=False):
        head = sem.groups[g][0]
        if len(sem.groups[g]) > 1:
            assert set(sem.item(after, prefill)) <= set(starts_by.get(head, ())), (head, after)
            assert position[("end", head)] < min(position[("run", u)] for u in sem.groups[after])


_FAMILIES = ("llama", "qwen2_moe")
_MODELS = {family: tiny(family) for family in _FAMILIES}
_UNITS = {family: trace(model, granularity="sublayer").names() for family, model in _MODELS.items()}


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), family=st.sampled_from(_FAMILIES))
@pytest.mark.parametrize("grouped", [False, True], ids=["copy_group None", "grouped"])
def test_any_modes_run_as_the_semantics_say(gpu_on_cpu, grouped, data, family):
    model, units = _MODELS[family], _UNITS[family]
    inside = sorted(name for name in ROWS)
    rows = {u: data.draw(st.sampled_from(inside if layer_of(u) else OUTSIDE), label=u)
            for u in units if u != "model.rotary_emb"}
    plan = group_plan(model, rows, grouped)
    sem = Semantics(plan)
    with tempfile.TemporaryDirectory() as offload_dir:
        prefill, *decodes = run_logged(model, plan, offload_dir)
    for call, in_prefill in ((prefill, True), *((d, False) for d in decodes)):
        assert streamer_ops(call) == sem.expected(call, in_prefill)
        assert_heads_prefetch_one_group_ahead(sem, call, in_prefill)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_on_a_gpu_group_prefetch_generates_the_plain_models_tokens(family, tmp_path):
    """Pinned copies on the side stream, disk reads in the thread, real devices: the same log and outputs."""
    model = tiny(family)
    rows = MIXED if family == "llama" else {
        u: MOE_ROWS[u.split(".", 3)[3]] for u in trace(model, granularity="sublayer").names()
        if layer_of(u) and u.split(".", 3)[3] in MOE_ROWS}
    plan = group_plan(model, rows, grouped=True)
    sem = Semantics(plan)
    prefill, *decodes = run_logged(model, plan, tmp_path, tolerance=1e-4)
    for call, in_prefill in ((prefill, True), *((d, False) for d in decodes)):
        assert streamer_ops(call) == sem.expected(call, in_prefill)
        assert_heads_prefetch_one_group_ahead(sem, call, in_prefill)


@pytest.mark.parametrize("grouped", [False, True], ids=["copy_group None", "grouped"])
def test_the_only_group_streaming_in_a_decode_copies_itself_for_the_next_step(gpu_on_cpu, tmp_path, grouped):
    """One streamed MLP (from disk, so the prefetch thread reads it): no other group's head would start its
    copy, so once it has its weights it starts them again for the next call; the next call takes that copy
    (its head's start finds it under way). The cost model prices the decode so. A plan without phased
    units does not tell a prefill from a decode (both stream alike): every call does the same."""
    model = tiny("llama")
    plan = group_plan(model, {"model.layers.2.mlp": "disk>gpu"}, grouped=grouped)
    calls_ = run_logged(model, plan, tmp_path)
    head = S("2.mlp") if grouped else []
    for call in calls_:
        assert streamer_ops(call) == [*head, *T("2.mlp"), *S("2.mlp")]


def test_in_a_group_a_disk_read_for_the_cpu_is_made_when_called(gpu_on_cpu, tmp_path):
    """disk_reads="copy": a CPU-executed disk unit is copied out of the file, by the prefetch thread when it is
    alone (as before groups); in a group, its read is made when it is called, as the cost model prices it,
    and only the layer's GPU-streamed MLP is its head's to start."""
    model = tiny("llama")
    rows = {"model.layers.1.self_attn": "mmap", "model.layers.1.mlp": "disk>gpu"}
    plan = group_plan(model, rows, grouped=True)
    with torch.no_grad():
        expected = model.generate(**prompt(), max_new_tokens=2, **GENERATE)
    before = snapshot(model)
    with logging_streamer() as log:
        handle = dispatch(model, plan, offload_dir=tmp_path, disk_reads="copy")
        with torch.no_grad():
            got = handle.generate(**prompt(), max_new_tokens=2, **GENERATE)
        handle.remove()
    assert torch.equal(got.sequences.cpu(), expected.sequences)
    assert_restored(model, before)
    starts = {unit for op, unit in log if op == "start"}
    assert starts == {"model.layers.1.mlp"}
    assert ("take", "model.layers.1.self_attn") in log  # copied out of the file when called


# ---------------------------------------------------------------------------------------------
# Memory: the copies alive at once, against the group buffer the cost model charges
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def live_copies():
    """The most bytes of Streamer copies alive at once (a copy lives until its last reference goes: the
    prefetch's future, the unit's forward) and each unit's copy size, in the dict yielded."""
    state: dict = {"live": 0, "most": 0, "size": {}}
    lock = threading.Lock()
    real = _streamer.Streamer._copy

    def release(nbytes: int) -> None:
        with lock:
            state["live"] -= nbytes

    def copy(self, unit, side, after=()):
        tensors, event = real(self, unit, side, after)
        sizes = [t.numel() * t.element_size() for t in tensors]
        with lock:
            state["size"][unit.name] = sum(sizes)
            state["live"] += sum(sizes)
            state["most"] = max(state["most"], state["live"])
            for watch in state.get("watch", ()):
                watch(state["live"])
        for tensor, nbytes in zip(tensors, sizes, strict=True):
            weakref.finalize(tensor, release, nbytes)
        return tensors, event

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_streamer.Streamer, "_copy", copy)
        yield state


def group_buffer(plan: Plan, size: dict[str, int]) -> int:
    """The most copies the cost model lets a device hold (solver.problem.device_transients: a run's own copies
    and those of the next run that copies, in flight, at least its own), written anew from the plan: the runs
    are the copy groups (a unit without one: alone); in the prefill stream and phased units copy, and the last
    is followed by the decode's first; in the decode stream units only, round the cycle."""
    runs: list[list] = []
    for p in plan.placements:
        if not runs or p.copy_group is None or p.copy_group != runs[-1][0].copy_group:
            runs.append([])
        runs[-1].append(p)
    prefill = [sum(size.get(p.unit, 0) for p in run if p.mode in ("stream", "phased")) for run in runs]
    decode = [sum(size.get(p.unit, 0) for p in run if p.mode == "stream") for run in runs]

    def following(copies, r, cycle):  # a prefill's last copying run is followed by the decode's first
        later = copies[r + 1:] + (copies[:r + 1] if cycle else [])
        return next((c for c in later if c), 0 if cycle else next((c for c in decode if c), 0))

    return max((c[r] + max(c[r], following(c, r, cycle)) for c, cycle in ((prefill, False), (decode, True))
                for r in range(len(runs))), default=0)


def run_counting(model: torch.nn.Module, plan: Plan, offload_dir) -> dict:
    with live_copies() as state:
        handle = dispatch(model, plan, offload_dir=offload_dir)
        with torch.no_grad():
            handle.generate(**prompt(), max_new_tokens=3, **GENERATE)
        handle.remove()
    assert state["live"] == 0, "every copy is let go after the call"
    return state


def test_streaming_every_part_holds_two_layers_copies_not_each_parts_twice(gpu_on_cpu, tmp_path):
    """Every attention and MLP read from the disk ahead by their layer's head: at its most the prefetch holds
    a layer's parts and the next layer's (the group buffer), more than any part's own two copies, the price
    before copy groups were counted as one."""
    model = tiny("llama")
    rows = {u: "disk>gpu" for u in _UNITS["llama"] if u.endswith(("self_attn", "mlp"))}
    plan = group_plan(model, rows, grouped=True)
    state = run_counting(model, plan, tmp_path)
    assert 2 * max(state["size"].values()) < state["most"] <= group_buffer(plan, state["size"])


def test_an_attention_streamed_alone_holds_its_own_copies_not_its_layers(gpu_on_cpu, tmp_path):
    model = tiny("llama")
    rows = {u: "disk>gpu" for u in _UNITS["llama"] if u.endswith("self_attn")}
    plan = group_plan(model, rows, grouped=True)
    state = run_counting(model, plan, tmp_path)
    attention = max(state["size"].values())
    assert state["most"] <= group_buffer(plan, state["size"]) == 2 * attention


_STREAMING = ("gpu", "cpu", "ram>gpu", "disk>gpu", "phased ram", "phased disk")


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), family=st.sampled_from(_FAMILIES))
def test_the_copies_alive_at_once_never_exceed_the_group_buffer(gpu_on_cpu, data, family):
    model, units = _MODELS[family], _UNITS[family]
    rows = {u: data.draw(st.sampled_from(_STREAMING if layer_of(u) else _STREAMING[:4]), label=u)
            for u in units if u != "model.rotary_emb"}
    plan = group_plan(model, rows, grouped=True)
    with tempfile.TemporaryDirectory() as offload_dir:
        state = run_counting(model, plan, offload_dir)
    assert state["most"] <= group_buffer(plan, state["size"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
def test_on_a_gpu_the_copies_alive_at_once_never_exceed_the_group_buffer(tmp_path):
    """Pinned copies on the side stream: the prefetch's copies alive at once stay within the group buffer (how many
    are alive at once depends on how far the thread is ahead: only the bound is asserted)."""
    model = tiny("llama")
    rows = {u: "disk>gpu" if u.endswith("mlp") else "ram>gpu" for u in _UNITS["llama"]
            if u.endswith(("self_attn", "mlp"))}
    plan = group_plan(model, rows, grouped=True)
    state = run_counting(model, plan, tmp_path)
    assert 0 < state["most"] <= group_buffer(plan, state["size"])


def run_bounds(plan: Plan, size: dict[str, int]) -> dict[tuple[str, str], int]:
    """(phase, unit) -> the copies the cost model lets the device hold while the unit runs
    (solver.problem.device_transients, restated): its run's copies in the phase and the larger of those and the
    next copying run's (the prefill's last copying run is followed by the decode's first; the decode cycles)."""
    runs: list[list] = []
    for p in plan.placements:
        if not runs or p.copy_group is None or p.copy_group != runs[-1][0].copy_group:
            runs.append([])
        runs[-1].append(p)
    copies = {"prefill": [sum(size.get(p.unit, 0) for p in run if p.mode in ("stream", "phased")) for run in runs],
              "decode": [sum(size.get(p.unit, 0) for p in run if p.mode == "stream") for run in runs]}
    first = next((c for c in copies["decode"] if c), 0)
    bounds = {}
    for phase, made in copies.items():
        for r, run in enumerate(runs):
            later = made[r + 1:] + (made[:r + 1] if phase == "decode" else [])
            following = next((c for c in later if c), 0 if phase == "decode" else first)
            for p in run:
                bounds[phase, p.unit] = made[r] + max(made[r], following)
    return bounds


def run_counting_per_unit(model: torch.nn.Module, plan: Plan, offload_dir) -> tuple[dict, list]:
    """As run_counting, and per call of each unit: (phase, unit, the most copies alive while it ran). The phase is
    the call's, read where it starts (the embedding: generate's prefill hands lm_head one token per row)."""
    calls, active, phase = [], {}, {"now": "prefill"}
    with live_copies() as state:
        watch = state.setdefault("watch", [])
        watch.append(lambda live: [active.__setitem__(u, max(m, live)) for u, m in list(active.items())])
        handles = [model.get_submodule("model.embed_tokens").register_forward_pre_hook(
            lambda module, args: phase.__setitem__("now", "prefill" if args[0].shape[-1] > 1 else "decode"))]
        for unit in (p.unit for p in plan.placements):
            module = model.get_submodule(unit)
            handles.append(module.register_forward_pre_hook(
                lambda module, args, unit=unit: active.__setitem__(unit, state["live"])))
            handles.append(module.register_forward_hook(
                lambda module, args, out, unit=unit: calls.append((phase["now"], unit, active.pop(unit)))))
        handle = dispatch(model, plan, offload_dir=offload_dir)
        with torch.no_grad():
            handle.generate(**prompt(), max_new_tokens=3, **GENERATE)
        handle.remove()
        for h in handles:
            h.remove()
    return state, calls


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), family=st.sampled_from(_FAMILIES))
def test_while_a_unit_runs_the_copies_alive_stay_within_its_runs_bound(gpu_on_cpu, data, family):
    """Unit by unit and phase by phase, the copies alive while a unit runs never exceed what the cost model
    charges its copy run then: its own copies and the next copying run's (or its own, if more)."""
    model, units = _MODELS[family], _UNITS[family]
    rows = {u: data.draw(st.sampled_from(_STREAMING if layer_of(u) else _STREAMING[:4]), label=u)
            for u in units if u != "model.rotary_emb"}
    plan = group_plan(model, rows, grouped=data.draw(st.booleans(), label="grouped"))
    assert_copies_within_run_bounds(model, plan)


def assert_copies_within_run_bounds(model: torch.nn.Module, plan: Plan) -> tuple[dict, list]:
    """generate() under ``plan``: no unit, in either phase, runs beside more copies than :func:`run_bounds` lets
    it; returns :func:`run_counting_per_unit`'s state and calls."""
    with tempfile.TemporaryDirectory() as offload_dir:
        state, calls = run_counting_per_unit(model, plan, offload_dir)
    bounds = run_bounds(plan, state["size"])
    assert {phase for phase, *_ in calls} == {"prefill", "decode"}
    over = [(phase, unit, most, bounds[phase, unit]) for phase, unit, most in calls if most > bounds[phase, unit]]
    assert not over, over
    return state, calls


_BLOCK_UNITS = {family: trace(model).names() for family, model in _MODELS.items()}


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), family=st.sampled_from(_FAMILIES))
def test_at_layer_granularity_a_unit_runs_beside_the_next_streamed_layers_copy(gpu_on_cpu, data, family):
    """Whole layers: while a unit runs (a resident one too), the copies alive never exceed its own and the next
    streaming unit's, the rule the cost model charges every graph by (tests/cost/test_cost_properties.py checks
    the prices against the same rule). A resident layer before a streamed one holds that one's copy: the
    under-count of the layer model before every stream was priced with the next copy."""
    model, units = _MODELS[family], _BLOCK_UNITS[family]
    rows = {u: data.draw(st.sampled_from(_STREAMING if layer_of(u + ".") else _STREAMING[:4]), label=u)
            for u in units if u != "model.rotary_emb"}
    state, calls = assert_copies_within_run_bounds(model, group_plan(model, rows, grouped=False, granularity="block"))
    # what the layer model charged before: a streamed unit its own two copies, a resident or phased one none
    before = {unit: 2 * state["size"].get(unit, 0) if rows.get(unit) in ("ram>gpu", "disk>gpu") else 0
              for unit in units}
    beside = [(unit, most) for phase, unit, most in calls if most > before[unit]]
    if any(rows.get(u) in ("ram>gpu", "disk>gpu", "phased ram", "phased disk") for u in units):
        assert beside, "no unit ran beside another unit's copy"
