"""Expert groups: a layer's fused experts cut into groups of consecutive experts, each placed on its own.

The model side (:func:`split_experts`: same outputs, undone bitwise), the graph side (:func:`split_expert_units`:
bytes and FLOPs shared out exactly, a chain through the groups), and the runtime: dispatch() and load() of plans
that keep some of a layer's experts on "cuda:0" (the CPU standing in for it, see ``gpu_on_cpu``) and compute the
rest on the CPU, on Mixtral- and Qwen-MoE-shaped models, from checkpoints with one tensor per expert.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _models import assert_restored, inputs_for, make_plan, snapshot, tiny
from placement_opt import Workload, solve, trace
from placement_opt.errors import DispatchError, TraceError
from placement_opt.model.expert_groups import (
    group_counts,
    group_ranges,
    split_expert_units,
    whole_experts,
)
from placement_opt.plan import Plan
from placement_opt.runtime._expert_groups import ExpertGroups, split_experts
from placement_opt.runtime.dispatcher import dispatch
from placement_opt.runtime.loader import load

MOE = ["mixtral", "qwen2_moe"]  # 2 layers of 4 experts, top-2 (tests/_models.py)


def experts_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n.endswith("mlp.experts")]


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs_for(model)).logits


@given(experts=st.integers(1, 300), groups=st.integers(1, 300))
def test_group_ranges_cover_every_expert_once_in_near_equal_groups(experts, groups):
    if groups > experts:
        with pytest.raises(ValueError, match="groups"):
            group_ranges(experts, groups)
        return
    ranges = group_ranges(experts, groups)
    assert len(ranges) == groups and ranges[0][0] == 0 and ranges[-1][1] == experts
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_names_round_trip():
    assert whole_experts("model.layers.3.mlp.experts.groups.2") == ("model.layers.3.mlp.experts", 2)
    assert whole_experts("model.layers.3.mlp.experts") is None
    assert group_counts(["a.experts.groups.0", "a.experts.groups.1", "b.experts.groups.0", "lm_head"]) == {
        "a.experts": 2, "b.experts": 1}


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("groups", [2, 3, 4])
def test_split_model_computes_what_the_whole_one_does(family, implementation, groups):
    """Every experts kernel of transformers, every cut (3 groups of 4 experts: sizes 2, 1, 1); undone bitwise."""
    model = tiny(family)
    model.config._experts_implementation = implementation
    expected, before = logits(model), snapshot(model)
    undo = split_experts(model, dict.fromkeys(experts_names(model), groups))
    split = model.get_submodule(experts_names(model)[0])
    assert isinstance(split, ExpertGroups) and len(split.groups) == groups
    assert not split.training and not any(g.training for g in split.groups)  # eval, as the model is
    # the groups' weights are the whole module's rows, not copies
    whole = split.groups[0].gate_up_proj
    assert whole.shape[0] == group_ranges(4, groups)[0][1]
    torch.testing.assert_close(logits(model), expected, rtol=1e-6, atol=1e-6)
    undo()
    assert torch.equal(logits(model), expected)
    assert_restored(model, before)


def test_split_refuses_what_it_cannot_cut_and_changes_nothing():
    model = tiny("mixtral")
    before = snapshot(model)
    names = experts_names(model)
    with pytest.raises(DispatchError, match="cannot be cut into expert groups"):
        split_experts(model, {names[0]: 2, "model.layers.1.self_attn": 2})
    with pytest.raises(DispatchError, match="1 to 4 groups"):
        split_experts(model, {names[0]: 2, names[1]: 5})
    with pytest.raises(DispatchError, match="no module"):
        split_experts(model, {"model.layers.9.mlp.experts": 2})
    assert not any(isinstance(m, ExpertGroups) for m in model.modules())
    assert_restored(model, before)


@pytest.mark.parametrize("family", MOE)
def test_the_graph_shares_bytes_and_flops_out_exactly(family):
    whole = trace(tiny(family), granularity="sublayer")
    graph = trace(tiny(family), granularity="sublayer", expert_groups=3)
    assert graph.total_param_bytes == whole.total_param_bytes
    assert graph.total_flops_per_token == whole.total_flops_per_token
    assert graph.meta.extra["expert_groups"] == 3 and len(graph) == len(whole) + 2 * 2
    names = graph.names()
    for experts in (n for n in whole.names() if n.endswith(".experts")):
        unit = whole.unit(experts)
        parts = [graph.unit(f"{experts}.groups.{i}") for i in range(3)]
        assert [p.param_bytes for p in parts] == [unit.param_bytes // 2, unit.param_bytes // 4, unit.param_bytes // 4]
        assert all(p.moe_num_experts == 4 and p.block == unit.block for p in parts)
        # a chain: consecutive in execution order, each group handing its running sum to the next
        at = names.index(parts[0].name)
        assert names[at:at + 3] == [p.name for p in parts]
        assert all(graph.nx.has_edge(a.name, b.name) for a, b in zip(parts, parts[1:], strict=False))
        assert parts[1].in_bytes_per_token == unit.in_bytes_per_token + unit.out_bytes_per_token
        successors = set(whole.nx.successors(experts))
        assert set(graph.nx.successors(parts[-1].name)) - {p.name for p in parts} == successors
    assert sorted(graph.unit(n).exec_index for n in names) == list(range(len(names)))


def test_expert_groups_are_refused_outside_sublayer_graphs_and_ignored_without_experts():
    with pytest.raises(TraceError, match="granularity='sublayer'"):
        trace(tiny("mixtral"), expert_groups=2)
    with pytest.raises(TraceError, match="whole number"):
        trace(tiny("mixtral"), granularity="sublayer", expert_groups=0)
    dense = trace(tiny("llama"), granularity="sublayer")
    with pytest.warns(UserWarning, match="nothing to cut"):
        assert trace(tiny("llama"), granularity="sublayer", expert_groups=4).names() == dense.names()
    graph = trace(tiny("mixtral"), granularity="sublayer")
    assert split_expert_units(graph, 1, graph.names()) is graph


def half_on_the_gpu(unit: str) -> tuple[str, str, str]:
    """Attention, norms, routers and the first group of each layer's experts on the GPU; other groups on the CPU."""
    if ".groups." in unit and not unit.endswith(".groups.0"):
        return ("cpu", "cpu", "resident")
    return ("cuda:0", "cuda:0", "resident")


def grouped_plan(model: torch.nn.Module, groups: int, choose=half_on_the_gpu) -> Plan:
    units = trace(model, granularity="sublayer", expert_groups=groups).names()
    base = make_plan([(u, *choose(u)) for u in units], name=type(model).__name__)
    home = "cuda:0" if any(p.execution == "cuda:0" for p in base.placements) else "cpu"
    return dataclasses.replace(base, home=home)


@pytest.mark.parametrize("family", MOE)
def test_dispatch_runs_a_layer_split_between_gpu_and_cpu(family, gpu_on_cpu):
    model = tiny(family)
    expected, before = logits(model), snapshot(model)
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        tokens = model.generate(**inputs_for(model), **kwargs)
    plan = grouped_plan(model, 2)
    handle = dispatch(model, plan)
    assert set(handle.unit_kinds()) == {p.unit for p in plan.placements}
    torch.testing.assert_close(logits(handle), expected, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(handle.generate(**inputs_for(model), **kwargs), tokens)
    handle.remove()
    assert not any(isinstance(m, ExpertGroups) for m in model.modules())
    assert_restored(model, before)


def test_a_failed_dispatch_puts_the_whole_experts_back(gpu_on_cpu):
    model = tiny("mixtral")
    before = snapshot(model)
    plan = grouped_plan(model, 2, lambda u: ("disk", "cpu", "stream") if u.endswith("groups.1") else ("cpu", "cpu",
                                                                                                      "resident"))
    with pytest.raises(DispatchError, match="offload_dir"):
        dispatch(model, plan)  # disk groups without an offload folder
    assert not any(isinstance(m, ExpertGroups) for m in model.modules())
    assert_restored(model, before)


def on_disk_and_in_ram(device: str):
    """Group 1 of each layer's experts on disk (the memory map computed on the CPU), the rest on ``device``."""
    def choose(unit: str) -> tuple[str, str, str]:
        if unit.endswith(".groups.1"):
            return ("disk", "cpu", "stream")
        return ("cpu", "cpu", "resident") if ".groups." in unit else (device, device, "resident")
    return choose


def test_a_disk_group_reads_the_router_picks_among_its_rows_in_a_decode_step(saved_moe, tmp_path, monkeypatch):
    """Group 1 of 2 of each layer on disk (experts 2 and 3 of 4), the rest in RAM: a prompt of more tokens than the
    layer has experts reads the group ahead whole; a decode step reads it ahead not at all, and asks for the
    router's picks among the group's rows (as rows of the group's own tensors), before the layer's first group
    computes. Outputs equal the whole model's."""
    from placement_opt.runtime._safetensors_file import SafetensorsFile
    from placement_opt.runtime.timing import cache_argument, cache_of

    _, model, path, _ = saved_moe
    plan = grouped_plan(model, 2, on_disk_and_in_ram("cpu"))
    handle = load(path, None, plan=plan, offload_dir=tmp_path)
    picked: dict[int, set[int]] = {}
    for i, layer in enumerate(handle.model.model.layers):  # the router's picks, seen before the groups compute
        layer.mlp.experts.register_forward_pre_hook(
            lambda _m, args, i=i: picked.setdefault(i, set()).update(args[1].flatten().tolist()))
    ahead: list[str] = []
    rows: dict[str, set[int]] = {}
    monkeypatch.setattr(SafetensorsFile, "prefetch", lambda self, keys: ahead.extend(keys))
    monkeypatch.setattr(SafetensorsFile, "prefetch_rows",
                        lambda self, key, start, end: rows.setdefault(key, set()).update(range(start, end)))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        out = handle(input_ids=ids, use_cache=True)
        assert rows == {} and any(".groups.1.gate_up_proj" in k for k in ahead)  # 7 tokens, 4 experts: whole
        ahead.clear(), picked.clear()
        step = handle(input_ids=torch.tensor([[6]]), use_cache=True, **cache_argument(handle.model, cache_of(out)))
    handle.remove()
    with torch.no_grad():
        reference = model(input_ids=ids, use_cache=True)
        expected = model(input_ids=torch.tensor([[6]]), use_cache=True, **cache_argument(model, cache_of(reference)))
    torch.testing.assert_close(step.logits, expected.logits, rtol=1e-5, atol=1e-5)
    assert not any(".experts." in k for k in ahead), ahead
    for layer, experts in picked.items():
        local = {e - 2 for e in experts if e >= 2}  # group 1 holds experts 2 and 3: its rows 0 and 1
        for tensor in ("gate_up_proj", "down_proj"):
            assert rows.get(f"model.layers.{layer}.mlp.experts.groups.1.{tensor}", set()) == local, (layer, rows)
    assert len(picked) == 2 and all(len(e) == 2 for e in picked.values())


def check_load(saved_moe, tmp_path, groups: int, device: str) -> None:
    _, model, path, reference = saved_moe
    plan = grouped_plan(model, groups, on_disk_and_in_ram(device))
    handle = load(path, None, plan=plan, offload_dir=tmp_path)
    torch.testing.assert_close(logits(handle).cpu(), reference, rtol=1e-5, atol=1e-5)
    for layer in range(2):
        whole = model.model.layers[layer].mlp.experts.gate_up_proj
        split = handle.model.model.layers[layer].mlp.experts
        for (start, end), group in zip(group_ranges(4, groups), split.groups, strict=True):
            assert torch.equal(group.gate_up_proj.cpu(), whole[start:end])
    assert sorted(p.name.split(".")[2] for p in tmp_path.glob("*.safetensors")) == ["0", "1"]  # one group a layer
    handle.remove()


@pytest.mark.parametrize("groups", [2, 4])
def test_load_reads_each_group_its_rows(saved_moe, no_fallback, tmp_path, groups):
    """Checkpoints with one tensor per expert (transformers' own save): each group gets its rows of the fused
    weight, in RAM or written to the offload folder (one file per layer's disk group); the logits are the model's."""
    check_load(saved_moe, tmp_path, groups, "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
def test_load_puts_some_groups_on_the_gpu(saved_moe, no_fallback, tmp_path):
    check_load(saved_moe, tmp_path, 2, "cuda:0")


def test_load_without_an_offload_folder_says_so_for_disk_groups(saved_moe, gpu_on_cpu, no_fallback):
    _, model, path, _ = saved_moe
    plan = grouped_plan(model, 2, lambda u: ("disk", "cpu", "stream") if ".groups." in u else ("cpu", "cpu",
                                                                                              "resident"))
    with pytest.raises(DispatchError, match="offload_dir"):
        load(path, None, plan=plan)


def test_a_solved_grouped_plan_runs(gpu_on_cpu):
    """solve() of a grouped graph: a plan over the groups, which dispatch() runs as the plain model."""
    model = tiny("mixtral")
    graph = trace(model, granularity="sublayer", expert_groups=4)
    plan = solve(graph, {"cuda:0": graph.total_param_bytes // 2, "cpu": "1GiB"},
                 workload=Workload(batch_size=2, prompt_len=7, new_tokens=5))
    assert [p.unit for p in plan.placements] == graph.names() and plan.home == "cuda:0"
    expected = logits(model)
    handle = dispatch(model, plan)
    torch.testing.assert_close(logits(handle), expected, rtol=1e-6, atol=1e-6)
    handle.remove()


@settings(max_examples=15, deadline=None)
@given(groups=st.integers(1, 4), gpu=st.lists(st.booleans(), min_size=8, max_size=8))
def test_any_gpu_cpu_assignment_of_groups_runs_as_the_model(groups, gpu):
    """Property: whichever groups sit on the GPU, the outputs are the plain model's (tolerance of a sum's order)."""
    model = tiny("qwen2_moe")
    expected = logits(model)
    flags = iter(gpu * 2)

    def choose(unit: str) -> tuple[str, str, str]:
        if ".groups." in unit:
            return ("cuda:0", "cuda:0", "resident") if next(flags) else ("cpu", "cpu", "resident")
        return ("cuda:0", "cuda:0", "resident")

    with pytest.MonkeyPatch.context() as patch:
        from placement_opt.runtime import _preflight, _streamer

        patch.setattr(_streamer, "torch_device", lambda n: torch.device("cpu" if n.startswith("cuda") else n))
        patch.setattr(_preflight, "cuda_device_count", lambda: 1)
        handle = dispatch(model, grouped_plan(model, groups, choose))
        torch.testing.assert_close(logits(handle), expected, rtol=1e-6, atol=1e-6)
        handle.remove()


def test_device_map_has_one_entry_per_experts_module_on_its_farthest_device():
    """accelerate places a module whole: a split layer's experts go where no GPU holds more than planned."""
    rows = [("model.layers.0.mlp.experts.groups.0", "cuda:0", "cuda:0", "resident"),
            ("model.layers.0.mlp.experts.groups.1", "cpu", "cpu", "resident"),
            ("model.layers.1.mlp.experts.groups.0", "cpu", "cpu", "resident"),
            ("model.layers.1.mlp.experts.groups.1", "disk", "cpu", "stream"),
            ("model.layers.2.mlp.experts.groups.0", "cuda:0", "cuda:0", "resident"),
            ("model.layers.2.mlp.experts.groups.1", "cuda:0", "cuda:0", "resident"),
            ("lm_head", "cuda:0", "cuda:0", "resident")]
    assert make_plan(rows).device_map == {"model.layers.0.mlp.experts": "cpu", "model.layers.1.mlp.experts": "disk",
                                          "model.layers.2.mlp.experts": 0, "lm_head": 0}


def test_a_plan_splitting_a_layer_says_what_device_map_does_with_it():
    graph = trace(tiny("mixtral"), granularity="sublayer", expert_groups=2)
    plan = solve(graph, {"cuda:0": "1GiB", "cpu": "1GiB"}, workload=Workload(prompt_len=7, new_tokens=5),
                 pins={"model.layers.0.mlp.experts.groups.0": "cuda:0", "model.layers.0.mlp.experts.groups.1": "cpu"})
    note = next(n for n in plan.notes if "experts on more than one device" in n)
    assert "1 layer(s)" in note and "model.layers.0.mlp.experts" in note
    assert plan.device_map["model.layers.0.mlp.experts"] == "cpu"


def test_a_plan_says_which_layers_keep_their_groups_together_and_what_calls_that_costs():
    """Groups placed alike still run as one call each: 4 groups a layer on the CPU alone are 3 calls a layer more than
    the experts whole (priced so), and expert_groups=1 places them the same. A layer split across devices is not
    counted."""
    graph = trace(tiny("mixtral"), granularity="sublayer", expert_groups=4)
    alone = solve(graph, {"cpu": "1GiB"}, workload=Workload(prompt_len=7, new_tokens=5))
    note = next(n for n in alone.notes if "keep all their expert groups in one placement" in n)
    assert note.startswith("2 of 2 layer(s)") and "6 call(s) a forward more" in note and "expert_groups=1" in note
    pins = {f"model.layers.{k}.mlp.experts.groups.{i}": "cuda:0" if k == 0 and i < 2 else "cpu"
            for k in range(2) for i in range(4)}
    split = solve(graph, {"cuda:0": "1GiB", "cpu": "1GiB"}, workload=Workload(prompt_len=7, new_tokens=5), pins=pins)
    layer1 = {(p.storage, p.execution, p.mode) for p in split.placements if p.unit.startswith("model.layers.1.mlp.exp")}
    (kept,) = [n for n in split.notes if "keep all their expert groups in one placement" in n]
    assert len(layer1) == 1 and kept.startswith("1 of 2 layer(s) keep") and "model.layers.1.mlp.experts" in kept
    assert "3 call(s) a forward more" in kept and "expert_groups=1" not in kept
    dense = solve(trace(tiny("mixtral"), granularity="sublayer"), {"cpu": "1GiB"},
                  workload=Workload(prompt_len=7, new_tokens=5))
    assert not any("expert groups" in n for n in dense.notes)


def test_solve_takes_expert_groups_with_sublayer_units_only():
    from placement_opt.errors import SolverInputError

    model = tiny("mixtral")
    plan = solve(model, {"cpu": "1GiB"}, granularity="sublayer", expert_groups=2,
                 workload=Workload(prompt_len=7, new_tokens=5))
    assert sum(".groups." in p.unit for p in plan.placements) == 4
    with pytest.raises(SolverInputError, match="granularity='sublayer'"):
        solve(model, {"cpu": "1GiB"}, expert_groups=2)
    with pytest.raises(SolverInputError, match="LayerGraph"):
        solve(trace(model, granularity="sublayer"), {"cpu": "1GiB"}, expert_groups=2)
    with pytest.raises(SolverInputError, match="whole number"):
        solve(model, {"cpu": "1GiB"}, granularity="sublayer", expert_groups=True)


def test_cli_plans_expert_groups_and_refuses_them_without_sublayer_units(tmp_path):
    from _cli import run_cli

    common = ("plan", "mixtral-8x7b", "-d", "cuda:0=a100-40gb/24GiB,cpu=256GiB", "--new-tokens", "8")
    out = run_cli(*common, "--granularity", "sublayer", "--expert-groups", "2", "--json", str(tmp_path / "p.json"))
    assert out.exit_code == 0, out.output
    units = [p.unit for p in Plan.from_json(str(tmp_path / "p.json")).placements]
    assert sum(u.endswith(".experts.groups.1") for u in units) == 32
    bad = run_cli(*common, "--expert-groups", "2", catch_exceptions=True)
    assert bad.exit_code == 2 and "--granularity sublayer" in bad.output


def test_cli_runs_a_checkpoint_in_grouped_plans_solved_and_saved(saved_moe, tmp_path):
    """`run --expert-groups` solves and loads a grouped plan; `run --plan` reprices a saved one on a grouped graph."""
    from _cli import run_cli

    _, _, path, _ = saved_moe
    common = ("-d", "cpu=1GB", "--prompt", "4", "--new-tokens", "3")
    solved = run_cli("run", str(path), *common, "--repeats", "1", "--granularity", "sublayer", "--expert-groups", "2")
    assert solved.exit_code == 0, solved.output
    made = run_cli("plan", str(path), *common, "--granularity", "sublayer", "--expert-groups", "2", "--json",
                   str(tmp_path / "plan.json"))
    assert made.exit_code == 0, made.output
    again = run_cli("run", str(path), *common, "--repeats", "1", "--plan", str(tmp_path / "plan.json"))
    assert again.exit_code == 0, again.output


def test_groups_on_a_gpu_keep_the_grouped_kernel_at_decode():
    """generate() switches GPU experts to batched_mm for decode steps; a group would then gather a weight for
    every routed row, other groups' rows included, so groups keep grouped_mm (a whole module still switches)."""
    from placement_opt.runtime._experts import pin_experts_to_devices

    model = tiny("mixtral")
    model.config._experts_implementation = "grouped_mm"
    undo_split = split_experts(model, {"model.layers.0.mlp.experts": 2})
    gpu = torch.device("cuda:0")  # a device object only: nothing runs
    undo = pin_experts_to_devices(model, {"model.layers.0": gpu, "model.layers.1": gpu}, torch.device("cpu"))
    group = model.model.layers[0].mlp.experts.groups[0]
    whole = model.model.layers[1].mlp.experts
    with model._optimize_model_for_decode():
        assert group.config._experts_implementation == "grouped_mm"
        assert whole.config._experts_implementation == "batched_mm"
    undo()
    undo_split()


def _generate_peak(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes a batch's second generate() allocates above what was allocated before it (the first warms up)."""
    kwargs = {"max_new_tokens": 4, "min_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(input_ids=ids, **kwargs)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model.generate(input_ids=ids, **kwargs)
        torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
def test_on_a_gpu_groups_decode_without_gathering_expert_weights():
    """The cost model charges GPU groups no batched_mm gathers (``cost.memory._gathered_expert_bytes``): at batch 16
    a model whose groups all compute on the GPU holds less than half of what one group was charged before (its
    share of the layer's gathers), where the whole experts on the GPU hold at least the gathers they are charged."""
    import transformers as T

    torch.manual_seed(0)
    config = T.MixtralConfig(vocab_size=1024, hidden_size=1024, intermediate_size=3584, num_hidden_layers=2,
                             num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                             num_experts_per_tok=2, max_position_embeddings=64)
    config._experts_implementation = "grouped_mm"
    model = T.MixtralForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (16, 8), device="cuda")
    expert_bytes = 3 * config.hidden_size * config.intermediate_size * 4  # float32
    gathers = 16 * 2 * expert_bytes  # batch x top-2 experts' weights, gathered by batched_mm per decode step
    whole = _generate_peak(model.to("cuda"), ids)
    model.to("cpu")
    handle = dispatch(model, grouped_plan(model, 2, lambda unit: ("cuda:0", "cuda:0", "resident")))
    grouped = _generate_peak(handle, ids)
    handle.remove()
    assert whole >= gathers, (whole, gathers)  # the whole experts switched to batched_mm: the contrast holds
    assert grouped < gathers // 2 // 2, (grouped, gathers)  # a group of 4 of 8 experts was charged gathers // 2


def test_cli_says_when_expert_groups_have_nothing_to_cut(tmp_path):
    """A warning on the command line is one line, without the library's source line Python would show."""
    from _cli import run_cli

    tiny("llama").save_pretrained(tmp_path / "llama")
    out = run_cli("plan", str(tmp_path / "llama"), "-d", "cpu=1GB", "--granularity", "sublayer", "--expert-groups",
                  "2", "--prompt", "4", "--new-tokens", "3")
    assert out.exit_code == 0, out.output
    assert "warning: placement_opt.trace: expert_groups=2 has nothing to cut" in out.output
    assert "return trace(" not in out.output and "UserWarning" not in out.output
    # the trace's warning is not repeated from the graph cache: the plan says it too
    again = run_cli("plan", str(tmp_path / "llama"), "-d", "cpu=1GB", "--granularity", "sublayer", "--expert-groups",
                    "2", "--prompt", "4", "--new-tokens", "3")
    for said in (out.output, again.output):
        assert "note: expert_groups=2 cut nothing" in " ".join(said.split()), said


def test_a_plan_with_expert_groups_of_a_dense_model_says_they_cut_nothing():
    from placement_opt import solve

    for granularity in ("sublayer", "auto"):
        with pytest.warns(UserWarning, match="nothing to cut"):
            plan = solve(tiny("llama"), "cpu=1GB", granularity=granularity, expert_groups=2, time_limit_s=0.5)
        assert sum("expert_groups=2 cut nothing" in n for n in plan.notes) == 1, plan.notes
    grouped = solve(tiny("mixtral"), "cpu=1GB", granularity="sublayer", expert_groups=2, time_limit_s=0.5)
    assert not any("cut nothing" in n for n in grouped.notes)


def test_another_models_plan_is_bad_input_on_the_command_line(saved_moe, tmp_path):
    """A --plan of another model exits 2 (bad input), with the library's PlanMismatchError: a DispatchError for
    callers that catch those, and a PlanFormatError (a plan made for another model)."""
    from _cli import run_cli
    from placement_opt.errors import PlanFormatError, PlanMismatchError

    _, model, _, _ = saved_moe
    tiny("llama").save_pretrained(tmp_path / "llama")
    common = ("-d", "cpu=1GB", "--prompt", "4", "--new-tokens", "3")
    grouped = grouped_plan(model, 2, lambda u: ("cpu", "cpu", "resident"))
    grouped.to_json(tmp_path / "grouped.json")
    whole = run_cli("plan", str(tmp_path / "llama"), *common, "--json", str(tmp_path / "llama.json"))
    assert whole.exit_code == 0, whole.output
    for plan, said in (("grouped.json", "cuts it into expert groups"), ("llama.json", "are not modules of")):
        other = tmp_path / ("mix" if plan == "llama.json" else "llama")
        if plan == "llama.json":
            model.save_pretrained(other)
        out = run_cli("run", str(other), *common, "--plan", str(tmp_path / plan), catch_exceptions=True)
        assert out.exit_code == 2, out.output
        assert said in out.output
    with pytest.raises(PlanMismatchError) as caught:
        load(tmp_path / "llama", None, plan=grouped)
    assert isinstance(caught.value, DispatchError) and isinstance(caught.value, PlanFormatError)


def test_each_group_beyond_the_first_is_priced_one_call_more():
    """A group runs the experts' routing and kernels again: on the CPU, G groups a layer cost G - 1 runs of the
    experts' ops more per call than the experts whole (measured on this CPU: 1054 -> 551 tokens/s, tiny Mixtral:
    about 143 us per extra call, where the experts' traced ops at the default rate make 125 us)."""
    from placement_opt.cost.pricing import OP_OVERHEAD_S

    model = tiny("mixtral")
    workload = Workload(batch_size=1, prompt_len=32, new_tokens=9)
    times, graphs = {}, {}
    for groups in (1, 4):
        graphs[groups] = trace(model, granularity="sublayer", expert_groups=groups)
        plan = solve(graphs[groups], {"cpu": "1GiB"}, workload=workload)
        assert {p.execution for p in plan.placements} == {"cpu"}
        times[groups] = plan.cost
    ops = graphs[1].unit("model.layers.0.mlp.experts").ops_per_forward
    assert ops > 0
    extra = 2 * 3 * ops * OP_OVERHEAD_S["cpu"]  # 2 layers, 3 more calls each
    assert times[4].prefill_s - times[1].prefill_s == pytest.approx(extra, rel=0.02)
    # the decode is priced over new_tokens steps (Workload's convention)
    assert times[4].decode_s - times[1].decode_s == pytest.approx(extra * workload.new_tokens, rel=0.02)


def test_load_maps_each_group_its_rows_of_a_fused_checkpoint(tmp_path, monkeypatch):
    """A checkpoint holding the fused weights themselves (the model's own state_dict): CPU groups are views of the
    mapped file, their rows read ahead (only theirs), disk groups written to the offload folder."""
    from safetensors.torch import save_file

    from placement_opt.runtime._safetensors_file import SafetensorsFile

    model = tiny("mixtral")
    folder = tmp_path / "fused"
    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    asked = []
    real = SafetensorsFile.prefetch_rows
    monkeypatch.setattr(SafetensorsFile, "prefetch_rows",
                        lambda self, key, start, end: (asked.append((key, start, end)), real(self, key, start, end)))
    plan = grouped_plan(model, 2, on_disk_and_in_ram("cpu"))
    handle = load(folder, None, plan=plan, offload_dir=tmp_path / "offload")
    torch.testing.assert_close(logits(handle), logits(model), rtol=1e-6, atol=1e-6)
    group = handle.model.model.layers[0].mlp.experts.groups[0]
    assert sorted(asked) == sorted((f"model.layers.{i}.mlp.experts.{p}", 0, 2) for i in range(2)
                                   for p in ("gate_up_proj", "down_proj"))
    assert len(list((tmp_path / "offload").glob("*.safetensors"))) == 2  # group 1 of each layer
    assert torch.equal(group.gate_up_proj, model.model.layers[0].mlp.experts.gate_up_proj[:2])
    handle.remove()


def test_the_layer_table_names_a_layers_groups_placed_alike_in_one_entry():
    from placement_opt.report import _parts_text

    base = make_plan([("model.layers.0.self_attn", "cuda:0", "cuda:0", "resident"),
                      *((f"model.layers.0.mlp.experts.groups.{i}", *(("cpu", "cpu", "resident") if i in (0, 2)
                                                                      else ("cuda:0", "cuda:0", "resident")))
                        for i in range(4)),
                      ("model.layers.0.mlp.gate", "cuda:0", "cuda:0", "resident")])
    parts = list(base.placements)
    assert _parts_text("model.layers.0", parts) == "mlp.experts groups 0, 2 of 4 resident cpu; the rest resident cuda:0"
    on_cpu = [dataclasses.replace(p, storage="cpu", execution="cpu") if p.unit.endswith(("groups.1", "groups.3",
                                                                                          "self_attn")) else p
              for p in parts]  # every group on the CPU: the experts module by its name
    assert _parts_text("model.layers.0", on_cpu) == "mlp.gate resident cuda:0; the rest resident cpu"
    on_gpu = [dataclasses.replace(p, storage="cuda:0", execution="cuda:0") for p in on_cpu[:1]] + on_cpu[1:]
    assert _parts_text("model.layers.0", on_gpu) == ("self_attn resident cuda:0; mlp.gate resident cuda:0; the rest "
                                                    "resident cpu")


def test_a_layers_groups_all_placed_alike_are_named_by_their_experts_module():
    from placement_opt.report import _parts_text

    gpu = [(f"model.layers.0.{n}", "cuda:0", "cuda:0", "resident") for n in
           ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp.gate", "mlp.shared_expert")]
    cpu = [(f"model.layers.0.mlp.experts.groups.{i}", "cpu", "cpu", "resident") for i in range(4)]
    parts = list(make_plan([*gpu[:4], *cpu, gpu[4]]).placements)
    assert _parts_text("model.layers.0", parts) == "mlp.experts resident cpu; the rest resident cuda:0"


def test_plan_prints_the_merged_start_note_with_verbose_only():
    """The search's note about its start from merged groups is one of its own notes (``plan --verbose``)."""
    from placement_opt.cli.tables import plan_renderables
    from placement_opt.planner import SOLVER_NOTES

    plan = solve(trace(tiny("mixtral"), granularity="sublayer", expert_groups=2), {"cpu": "1GiB"},
                 workload=Workload(prompt_len=7, new_tokens=5))
    note = next(n for n in plan.notes if "expert groups together" in n)
    assert note.startswith(SOLVER_NOTES)
    def printed(solver_notes: bool) -> str:
        import io

        from rich.console import Console

        console = Console(record=True, width=400, file=io.StringIO())
        for part in plan_renderables(plan, solver_notes=solver_notes):
            console.print(part)
        return console.export_text()

    assert "expert groups together" in printed(True) and "expert groups together" not in printed(False)


@pytest.mark.parametrize("family", MOE)
def test_a_grouped_model_keeps_its_fused_state_dict_and_changes_made_while_dispatched(family, tmp_path):
    """The groups are how the experts run, not what the model is: its state_dict (save_pretrained) kept the groups'
    names, a checkpoint written so reloaded its experts at random, load_state_dict of its own state failed, and a
    change made to a disk group while dispatched was lost at remove()."""

    model = tiny(family)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    experts = [n for n in params if ".experts." in n]
    plan = grouped_plan(model, 2, on_disk_and_in_ram("cpu"))
    handle = dispatch(model, plan, offload_dir=tmp_path / "off")
    shown = handle.state_dict()
    assert set(shown) == set(state) and all(torch.equal(shown[k], state[k]) for k in state)
    with warnings.catch_warnings():  # transformers' note on saving a model whose map names the disk: expected here
        warnings.simplefilter("ignore", UserWarning)
        handle.save_pretrained(tmp_path / "saved")
    again = type(model).from_pretrained(tmp_path / "saved").eval()
    torch.testing.assert_close(logits(again), logits(handle), rtol=1e-5, atol=1e-6)  # groups sum in turn
    handle.load_state_dict(state)  # its own state, fused names and all
    with torch.no_grad():
        for p in handle.parameters():
            p.mul_(2)  # the disk groups' rows too
    handle.remove()
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(model.get_parameter(n) is params[n] for n in experts)  # the same Parameters, an optimizer's
    for name in experts:
        torch.testing.assert_close(params[name], 2 * state[name], rtol=0, atol=0)


def test_resident_groups_put_the_experts_back_without_a_copy():
    """remove() wrote the groups' rows back with a copy, holding the experts twice for a moment."""
    model = tiny("mixtral")
    name = next(n for n, _ in model.named_parameters() if ".experts." in n)
    address = model.get_parameter(name).data_ptr()
    handle = dispatch(model, grouped_plan(model, 2, lambda u: ("cpu", "cpu", "resident")))
    handle.remove()
    assert model.get_parameter(name).data_ptr() == address


def test_a_model_cut_already_says_what_another_plan_needs(saved_moe, tmp_path):
    """A model dispatched in groups, given another plan, was told its experts could not be cut ("plan with
    expert_groups=1"); one load() built in groups, after remove(), refused another plan of its own model the same
    way, or as another model's plan."""
    _, model, path, _ = saved_moe
    on_cpu = lambda u: ("cpu", "cpu", "resident")  # noqa: E731
    copy = load(path, None, plan=grouped_plan(model, 2, on_cpu))
    with pytest.raises(DispatchError, match="already dispatched"):
        dispatch(copy.model, grouped_plan(model, 4, on_cpu))
    copy.remove()
    for groups, said in ((4, "cuts it into 4"), (1, "places it whole")):
        with pytest.raises(DispatchError, match=f"cut into 2 expert groups already.*{said}.*plan of 2 groups"):
            dispatch(copy.model, grouped_plan(model, groups, on_cpu))
    again = dispatch(copy.model, grouped_plan(model, 2, on_cpu))  # its own cut still runs
    again.remove()


def test_a_model_cut_into_groups_is_not_traced_as_dense_experts(saved_moe):
    """A model load() built in groups keeps them after remove(): traced, its experts read as dense units (no MoE
    facts, every weight on every token), whose plans cannot run on it; trace() refuses it and names the fix."""
    _, model, path, _ = saved_moe
    copy = load(path, None, plan=grouped_plan(model, 2, lambda u: ("cpu", "cpu", "resident")))
    copy.remove()
    with pytest.raises(TraceError, match=r"mlp\.experts is cut into expert groups .*Trace its checkpoint"):
        trace(copy.model, granularity="sublayer", expert_groups=2)
    assert trace(path, granularity="sublayer", expert_groups=2).names() == [p.unit for p in grouped_plan(model, 2).placements]
