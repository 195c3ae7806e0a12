"""solve(): the front end on hand-built layer graphs (no tracer needed), scored by cost.evaluate."""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement_opt.cost.build import build_problem
from placement_opt.cost.evaluate import evaluate
from placement_opt.cost.pins import resolve_pins
from placement_opt.cost.workload import Workload
from placement_opt.errors import InfeasiblePlacementError, PlacementError
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import GraphMeta, LayerGraph, chain_graph
from placement_opt.planner import solve

GIB = 2**30
MIB = 2**20


def llama_like(layers: int = 8, layer_bytes: int = 200 * MIB, tied: bool = False) -> LayerGraph:
    """embed (100 MiB) -> layers (200 MiB, 1 MiB of KV per 1k tokens each) -> norm -> lm_head (100 MiB)."""
    units = [{"name": "model.embed_tokens", "param_bytes": 100 * MIB, "out_bytes_per_token": 4096,
              "module_class": "Embedding"}]
    units += [{"name": f"model.layers.{i}", "param_bytes": layer_bytes, "flops_per_token": layer_bytes,
               "kv_bytes_per_token": 1024, "out_bytes_per_token": 4096, "attn_flops_per_token_per_ctx": 8192,
               "module_class": "DecoderLayer"} for i in range(layers)]
    units += [{"name": "model.norm", "param_bytes": 4096, "flops_per_token": 8192, "out_bytes_per_token": 4096},
              {"name": "lm_head", "param_bytes": 0 if tied else 100 * MIB, "flops_per_token": 100 * MIB,
               "out_bytes_per_token": 64000}]
    groups = (("model.embed_tokens", "lm_head"),) if tied else ()
    g = chain_graph(units, tied_unit_groups=groups)
    return LayerGraph(g.nx, GraphMeta(model_name="llama-like", dtype="float16", batch_size=1, seq_len=1,
                                      traced=False, tied_unit_groups=groups, no_split=("DecoderLayer",)))


def machine(*gpu_mib: int, cpu_gib: int = 64, disk: bool = True) -> Machine:
    """GPUs with ``gpu_mib`` usable MiB each (the preset's 1 GiB reserve comes on top), CPU RAM, a disk."""
    devices = [Device.preset("a100-40gb", name=f"cuda:{i}").with_memory(f"{m + 1024}MiB")
               for i, m in enumerate(gpu_mib)]
    devices.append(Device.preset("cpu-desktop", name="cpu").with_memory(f"{cpu_gib}GiB"))
    if disk:
        devices.append(Device.preset("nvme-gen4", name="disk"))
    return Machine(devices)


def test_plan_fits_beats_baselines_and_matches_evaluate():
    graph, m, wl = llama_like(), machine(1200, 1500), Workload(batch_size=2, prompt_len=256, new_tokens=32)
    plan = solve(graph, m, workload=wl, time_limit_s=2)
    assert plan.cost.fits and plan.status in ("OPTIMAL", "FEASIBLE")
    assert {p.unit for p in plan.placements} == set(graph.names())
    assert plan.cost.total_s == pytest.approx(evaluate(plan, graph, m, wl).total_s)
    assert plan.objective_value == pytest.approx(plan.cost.total_s, rel=1e-9)
    assert {b.strategy for b in plan.baselines} == {"sequential", "balanced", "balanced_low_0"}
    for b in plan.baselines:
        if b.fits:
            assert plan.cost.total_s <= b.total_s * (1 + 1e-9)
    assert "cuda:0" in plan.summary() and "baseline" in plan.explain()


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14's incremental collector has no full collections")
def test_solve_makes_no_full_cycle_collection_and_leaves_the_collector_as_it_found_it(monkeypatch):
    # A full collection scans every live object (a large traced graph) inside the time limit. With thresholds
    # that allow one after every few young collections, a solve without the deferral makes some (the control,
    # which shows the test can fail); with it, none, and the caller's thresholds and freeze are as they were.
    from placement_opt import planner

    graph, m = llama_like(), machine(1200, 1500)
    full = []
    monkeypatch.setattr(planner, "_cpsat_plan", _counting_full_collections(full))
    callers = gc.get_threshold()
    gc.set_threshold(50, 2, 2)
    frozen = gc.get_freeze_count()  # not 0 on every interpreter: CPython 3.12.1 starts with 375
    try:
        with monkeypatch.context() as undeferred:
            undeferred.setattr(planner, "_full_collections_deferred", contextlib.nullcontext)
            solve(graph, m, time_limit_s=1)
        solve(graph, m, time_limit_s=1)
        assert gc.get_threshold() == (50, 2, 2) and gc.isenabled()
        # frozen objects can still die: the count may drop by the few freed
        assert frozen - 1000 < gc.get_freeze_count() <= frozen
    finally:
        gc.set_threshold(*callers)
    assert full[0] > 0, "the control solve made no full collection: the test cannot tell"
    assert full[1] == 0


def test_overlapping_solves_on_threads_restore_the_callers_thresholds():
    # Each solve raising the oldest threshold and putting back what it found would leave the raised value
    # behind whenever one solve starts while another runs.
    graph, m = llama_like(), machine(1200, 1500)
    callers = gc.get_threshold()
    gc.set_threshold(700, 10, 7)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            plans = list(pool.map(lambda seed: solve(graph, m, time_limit_s=1, seed=seed), range(6)))
        assert gc.get_threshold() == (700, 10, 7)
        assert all(plan.cost.fits for plan in plans)
    finally:
        gc.set_threshold(*callers)


def _counting_full_collections(full):
    """_cpsat_plan, appending how many full (generation 2) collections ran while it did."""
    from placement_opt import planner

    real = planner._cpsat_plan

    def run(*args, **kwargs):
        seen = []

        def note(phase, info):
            if phase == "start" and info["generation"] == 2:
                seen.append(1)
        kept = []
        gc.callbacks.append(note)
        try:
            # objects that outlive young collections, a third of what lives: CPython makes a full collection
            # once they reach a quarter of what the last one left
            kept.extend([] for _ in range(len(gc.get_objects()) // 3))
            return real(*args, **kwargs)
        finally:
            gc.callbacks.remove(note)
            full.append(len(seen))
            kept.clear()
    return run


def test_pins_use_accelerate_vocabulary():
    graph, m = llama_like(), machine(2000, 2000)
    plan = solve(graph, m, pins={"model.layers": 1, "lm_head": "cpu"}, time_limit_s=1)
    storage = {p.unit: p.storage for p in plan.placements}
    assert all(storage[f"model.layers.{i}"] == "cuda:1" for i in range(8))
    assert storage["lm_head"] == "cpu"
    assert "9 unit(s) stored where pinned ('model.layers' -> 1, 'lm_head' -> cpu)" in plan.notes[0]
    assert resolve_pins({"": "cpu"}, graph, m) == dict.fromkeys(graph.names(), "cpu")


def test_bad_pins_list_close_names_and_inner_modules():
    graph, m = llama_like(), machine(2000)
    with pytest.raises(PlacementError, match="close names: model.layers"):
        solve(graph, m, pins={"model.layer": 0})
    with pytest.raises(PlacementError, match="pin 'model.layers.0' instead"):
        solve(graph, m, pins={"model.layers.0.mlp": 0})
    with pytest.raises(PlacementError, match="cuda:3 is not in the machine"):
        solve(graph, m, pins={"lm_head": 3})


@pytest.mark.parametrize("strategy", ["sequential", "balanced", "balanced_low_0"])
def test_pins_with_a_greedy_strategy_are_refused_not_ignored(strategy):
    """The device_map-string fills know no pins: a plan from one would say 'pinned' and store lm_head elsewhere."""
    graph, m = llama_like(), machine(2000, 2000)
    with pytest.raises(PlacementError, match="pins apply to strategy 'cpsat' only"):
        solve(graph, m, strategy=strategy, pins={"lm_head": "cpu"})
    assert solve(graph, m, strategy=strategy, pins={}).placements  # no pins: as before


def test_bad_arguments_list_the_accepted_values():
    graph, m = llama_like(), machine(2000)
    with pytest.raises(PlacementError, match="latency, throughput, memory"):
        solve(graph, m, "fast")
    with pytest.raises(PlacementError, match="cpsat, sequential, balanced, balanced_low_0, accelerate"):
        solve(graph, m, strategy="auto")
    with pytest.raises(PlacementError, match="time_limit_s"):
        solve(graph, m, time_limit_s=0)
    with pytest.raises(PlacementError, match="workers must be a positive int"):
        solve(graph, m, workers=0)
    with pytest.raises(PlacementError, match="gap_limit must be a fraction"):
        solve(graph, m, gap_limit=2)
    with pytest.raises(ValueError, match="not a LayerGraph"):
        solve(graph, m, strategy="accelerate")
    with pytest.raises(PlacementError, match="workload must be a placement_opt.Workload"):
        solve(graph, m, workload={"batch_size": 4})
    with pytest.raises(PlacementError, match="pins must be a dict"):
        solve(graph, m, pins=["lm_head"])


def test_infeasible_says_what_is_short_and_why():
    graph, m = llama_like(), machine(1000, cpu_gib=1, disk=False)
    with pytest.raises(InfeasiblePlacementError) as err:
        solve(graph, m, workload=Workload(batch_size=64, prompt_len=4096, new_tokens=512), time_limit_s=1)
    text = str(err.value)
    assert "needs" in text and "more across cuda:0, cpu" in text
    assert "the KV cache for batch 64 x 4608 tokens alone is" in text
    assert "(usable: cuda:0 " in text and "add a disk device" in text


def test_infeasible_with_a_disk_says_how_large_the_disk_is():
    """A bare 'disk' beside a described machine is the free space here: "add a disk device" read wrong when one
    was listed; the message gives each device's usable size and asks for a larger disk."""
    graph = llama_like()
    m = Machine([*machine(1000, cpu_gib=1, disk=False).devices, Device.preset("nvme-gen4", name="disk").with_memory("1GiB")])
    with pytest.raises(InfeasiblePlacementError) as err:
        solve(graph, m, workload=Workload(batch_size=64, prompt_len=4096, new_tokens=512), time_limit_s=1)
    text = str(err.value)
    assert "more across cuda:0, cpu, disk (usable: " in text and ", disk " in text
    assert "add a larger disk (disk=SIZE" in text and "add a disk device" not in text


def test_infeasible_names_the_weights_when_they_are_the_bigger_part():
    # 8 x 200 MiB layers + 2 x 100 MiB = 1800 MiB of weights; KV at batch 1 x 80 tokens is 8 x 80 KiB.
    graph, m = llama_like(), machine(500, cpu_gib=1, disk=False)
    with pytest.raises(InfeasiblePlacementError) as err:
        solve(graph, m, workload=Workload(batch_size=1, prompt_len=64, new_tokens=16), time_limit_s=1)
    text = str(err.value)
    assert "the weights alone are 1.76 GiB (the KV cache for batch 1 x 80 tokens 640.00 KiB)" in text


def test_infeasible_training_names_the_weights_with_their_states_and_no_kv_cache():
    """A training step keeps no KV cache, and its weights come with gradients and optimizer states: the message said
    "the weights alone" of a total 8x the weights', beside a KV cache the step never holds."""
    graph, m = llama_like(), machine(500, cpu_gib=1, disk=False)
    with pytest.raises(InfeasiblePlacementError) as err:
        solve(graph, m, workload=Workload(batch_size=1, prompt_len=64, new_tokens=16, training=True), time_limit_s=1)
    text = str(err.value)
    assert "the weights with their gradients and optimizer states alone are" in text and "KV cache" not in text, text


def test_baseline_strategies_return_accelerate_semantics():
    graph, m = llama_like(), machine(900, 900)
    plan = solve(graph, m, strategy="sequential")
    assert plan.status == "GREEDY" and plan.strategy == "sequential"
    offloaded = [p for p in plan.placements if p.storage == "cpu"]
    assert offloaded and all(p.execution == "cuda:0" and p.mode == "stream_sync" for p in offloaded)


def test_tied_units_share_storage_and_contiguous_ranges():
    graph, m = llama_like(tied=True), machine(700, 900)
    plan = solve(graph, m, contiguous=False, time_limit_s=1)
    storage = {p.unit: p.storage for p in plan.placements}
    assert storage["model.embed_tokens"] == storage["lm_head"]
    plan = solve(llama_like(), m, contiguous=True, time_limit_s=1)
    order = [p.storage for p in plan.placements]
    blocks = [d for i, d in enumerate(order) if i == 0 or order[i - 1] != d]
    assert len(blocks) == len(set(blocks))


def test_objectives_throughput_and_memory():
    graph, m, wl = llama_like(), machine(4000, 4000), Workload(batch_size=1, prompt_len=64, new_tokens=8)
    fast = solve(graph, m, "latency", workload=wl, time_limit_s=1)
    thr = solve(graph, m, "throughput", workload=wl, time_limit_s=1)
    lean = solve(graph, m, "memory", workload=wl, time_limit_s=2)
    assert max(thr.cost.stage_s.values()) <= max(fast.cost.stage_s.values()) * (1 + 1e-6)
    gpu_bytes = sum(mm.used_bytes for mm in lean.cost.memory if mm.device.startswith("cuda"))
    assert lean.objective_value == gpu_bytes
    assert lean.cost.total_s <= fast.cost.total_s * 1.05 + 1e-3


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(2, 10), gpus=st.lists(st.integers(300, 3000), min_size=1, max_size=3),
       batch=st.integers(1, 8), objective=st.sampled_from(["latency", "throughput"]))
def test_random_graphs_solve_at_least_as_well_as_every_hinted_baseline(layers, gpus, batch, objective):
    graph, m = llama_like(layers), machine(*gpus)
    wl = Workload(batch_size=batch, prompt_len=128, new_tokens=16)
    plan = solve(graph, m, objective, workload=wl, time_limit_s=0.5)
    problem = build_problem(graph, m, wl)
    keys = [[(o.storage, o.execution, o.mode, o.prefill_execution) for o in u.options] for u in problem.units]
    choice = [k.index((p.storage, p.execution, p.mode, p.prefill_execution)) for k, p in zip(keys, plan.placements,
                                                                                           strict=True)]
    assert problem.score(choice).feasible
    from placement_opt.solver.greedy import baseline_storage, choice_from_storage

    for strategy in ("sequential", "balanced", "balanced_low_0"):
        hint = choice_from_storage(problem, baseline_storage(graph, m, strategy))
        if problem.score(hint).feasible:
            assert problem.objective_value(choice, objective) <= problem.objective_value(hint, objective)


@pytest.mark.parametrize("pins", [{}, {"lm_head": "cpu"}])
def test_one_pricing_gives_the_problem_build_problem_gives(pins):
    """solve() prices every option once (stream_sync included, for the scorer) and drops stream_sync for
    the solver: the problem must be exactly build_problem's, option order included."""
    from placement_opt.planner import _priced
    from placement_opt.solver.edges import prune_edges

    graph, wl = llama_like(tied=True), Workload(batch_size=2, prompt_len=128, new_tokens=8)
    for m in (machine(1200, 1500), machine(300), machine(300, disk=False)):
        problem, score = _priced(graph, m, wl, pins, False)
        assert problem == prune_edges(build_problem(graph, m, wl, pins=pins))
        device_map = {u: "cpu" for u in graph.names()}
        assert score(device_map) == evaluate(device_map, graph, m, wl)


@pytest.mark.slow
@pytest.mark.parametrize("limit_s", [1.0, 2.0])
def test_solve_keeps_its_time_limit_on_a_module_level_70b(limit_s, monkeypatch, module_level_70b):
    """Pricing, baselines, search and the final scoring together stay within the limit + 0.5 s.

    The contract (solve's docstring): the search gets what pricing and baselines leave, at least
    MIN_SEARCH_S. Pricing a module-level 70B takes ~0.7 s of a quiet 2-core machine and can exceed
    a 1 s limit on a busy one, so the test times each part: the search must end within the budget it
    was given, the budget must be what was left, and the whole call within the limit whenever
    pricing left room for the minimum search.
    """
    import time

    import placement_opt.planner as planner

    graph = module_level_70b
    m = Machine([Device.preset("t4", name=f"cuda:{i}") for i in range(4)]
                + [Device.preset("cpu-desktop", name="cpu").with_memory("128GiB"), Device.preset("nvme-gen4", name="disk")])
    searches = []
    search = planner.solve_problem

    def timed_search(*args, **kwargs):
        begun = time.perf_counter()
        sol = search(*args, **kwargs)
        searches.append((begun, kwargs["time_limit_s"], time.perf_counter() - begun))
        return sol

    monkeypatch.setattr(planner, "solve_problem", timed_search)

    def timed() -> tuple[float, float, float, float, Any]:
        searches.clear()
        t0 = time.perf_counter()
        plan = solve(graph, m, workload=Workload(prompt_len=512, new_tokens=128), time_limit_s=limit_s)
        [(begun, budget_s, searched_s)] = searches
        return time.perf_counter() - t0, begun - t0, budget_s, searched_s, plan

    # a run whose search overran its budget is timed once more and the faster search counts: other work on a
    # shared 2-core CI machine stretched one search to 0.70 s of a 0.2 s budget (0.3 s quiet), while a search
    # that does not keep its budget overruns both
    total_s, before_s, budget_s, searched_s, plan = timed()
    if searched_s > budget_s + 0.25:
        total_s, before_s, budget_s, searched_s, plan = min((total_s, before_s, budget_s, searched_s, plan), timed(),
                                                            key=lambda run: run[3] - run[2])
    assert searched_s <= budget_s + 0.25
    assert budget_s <= max(planner.MIN_SEARCH_S, limit_s - before_s) + 1e-6
    assert total_s - before_s - searched_s <= 0.25  # the final scoring
    if before_s + planner.MIN_SEARCH_S <= limit_s:
        assert total_s <= limit_s + 0.5
    assert plan.cost.fits and plan.best_bound <= plan.objective_value


@pytest.mark.parametrize("devices", ["cuda:0=t4,cpu=cpu-desktop/32GiB,disk=nvme-gen4",
                                     "cuda:0=h100-sxm,cpu=cpu-desktop/32GiB", "cpu=cpu-desktop/64GiB"])
def test_a_plan_says_when_from_pretrained_would_not_compute_its_cpu_units_on_the_cpu(devices):
    """accelerate offloads every "cpu" entry of a map that has GPUs (computed on the first GPU, copied at every
    forward), so a plan computing units on the CPU from RAM beside GPU units says so; plans without GPU units or
    without such units say nothing. On a T4 Llama-3-8B does not fit: some units compute on the CPU."""
    plan = solve("llama-3-8b", devices, workers=1)
    on_cpu = [p.unit for p in plan.placements if (p.storage, p.execution, p.mode) == ("cpu", "cpu", "resident")]
    with_gpu = any(p.execution.startswith("cuda") for p in plan.placements)
    notes = [n for n in plan.notes if "beside GPU units" in n]
    assert bool(notes) == bool(on_cpu and with_gpu)
    if notes:
        assert notes[0].startswith(f"{len(on_cpu)} unit(s) compute on the CPU from RAM beside GPU units")
        assert "placement_opt.dispatch() or load()" in notes[0]
    assert devices.startswith("cuda:0=t4") == bool(notes)  # the cases are what they are meant to be


def test_infeasible_under_tied_weights_names_them_and_what_to_do():
    """Enough memory in all, but the tied embedding and lm_head (100 MiB, one device) fit next to nothing: the
    message named "the tied groups" and said "relax them", which a user cannot do; it names the units, their size
    and the two ways out."""
    graph = llama_like(layers=2, layer_bytes=55 * MIB, tied=True)
    m = Machine([Device.preset("a100-40gb", name="cuda:0").with_memory(f"{1024 + 110}MiB"),
                 Device.preset("cpu-desktop", name="cpu").with_memory("110MiB")])
    with pytest.raises(InfeasiblePlacementError) as err:
        solve(graph, m, workload=Workload(batch_size=1, prompt_len=8, new_tokens=2), time_limit_s=1)
    text = str(err.value)
    assert "the total memory suffices" in text and "relax them" not in text
    assert "tied weights, stored on one device: model.embed_tokens + lm_head (at least 100.00 MiB together)" in text
    assert "tie_word_embeddings=False" in text


def test_a_context_past_the_models_positions_is_noted():
    """Llama-3-8B was trained for 8192 positions: a plan for 100k tokens is priced as asked, and says so."""
    long = solve("llama-3-8b", "cuda:0=h100-sxm,cpu=cpu-server/256GiB", workers=1,
                 workload=Workload(batch_size=1, prompt_len=100_000, new_tokens=128))
    assert any("100000 + 128 = 100128 tokens) is past the model's max_position_embeddings (8192)" in n
               for n in long.notes)
    short = solve("llama-3-8b", "cuda:0=h100-sxm,cpu=cpu-server/256GiB", workers=1,
                  workload=Workload(batch_size=1, prompt_len=8000, new_tokens=192))
    assert not any("max_position_embeddings" in n for n in short.notes)


def test_a_split_that_does_not_work_out_says_how_much_more_is_enough_and_that_much_is():
    """The totals fit but no split over the devices does: the message names an amount for one device, and a
    solve with that much more there finds a plan (sufficient, as said; a search could need less)."""
    import re

    from placement_opt.units import parse_size

    with pytest.raises(InfeasiblePlacementError) as info:
        solve("llama-3-8b", "cpu=1GiB,disk")
    text = str(info.value)
    found = re.search(r"\(([\d.]+ [KMG]iB) more on cpu is enough: a plan fits with it\)", text)
    assert "the total memory suffices" in text and found, text
    enough = parse_size(found.group(1).replace(" ", ""))
    plan = solve("llama-3-8b", f"cpu={2**30 + enough + 2**14}B,disk")  # + 16 KiB: the amount is shown rounded
    assert plan.status in ("OPTIMAL", "FEASIBLE")
