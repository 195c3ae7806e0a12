"""Plan: maps in accelerate's vocabulary, the readable reports, and the versioned JSON round trip."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement_opt.cost.evaluate import evaluate
from placement_opt.cost.workload import Workload
from placement_opt.errors import PlanFormatError
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import chain_graph
from placement_opt.plan import PLAN_SCHEMA_VERSION, BaselineResult, Plan, UnitPlacement
from placement_opt.units import format_bytes

MIB = 2**20
DEVICES = ["cuda:0", "cuda:1", "cpu", "disk"]


def _machine() -> Machine:
    return Machine([Device.preset("a100-40gb", name="cuda:0"), Device.preset("t4", name="cuda:1"),
                    Device.preset("cpu-desktop", name="cpu").with_memory("64GiB"), Device.preset("nvme-gen4", name="disk")])


@st.composite
def plans(draw):
    n = draw(st.integers(1, 8))
    graph = chain_graph([{"name": f"model.layers.{i}", "param_bytes": draw(st.integers(0, 300)) * MIB,
                          "flops_per_token": draw(st.integers(0, 10**9)), "kv_bytes_per_token": 512,
                          "out_bytes_per_token": 4096} for i in range(n)])
    placements = []
    for i in range(n):
        storage = draw(st.sampled_from(DEVICES))
        if storage.startswith("cuda"):
            execution, mode = storage, "resident"
        else:
            execution = draw(st.sampled_from(["cuda:0", "cuda:1"] + (["cpu"] if storage == "disk" else [])))
            if storage == "cpu" and draw(st.booleans()):
                execution = "cpu"
            mode = "resident" if execution == storage else draw(st.sampled_from(["stream", "stream_sync"]))
        placements.append(UnitPlacement(unit=f"model.layers.{i}", storage=storage, execution=execution, mode=mode))
    wl = Workload(batch_size=draw(st.integers(1, 16)), prompt_len=draw(st.integers(1, 4096)),
                  new_tokens=draw(st.integers(0, 512)), overlap=draw(st.booleans()), padded=draw(st.booleans()))
    machine = _machine()
    probe = Plan(model_name="m", dtype="float16", objective="latency", strategy="cpsat", placements=tuple(placements),
                 machine=machine, workload=wl, cost=None, status="FEASIBLE", objective_value=0.0, best_bound=0.0,
                 gap=0.0, solve_time_s=0.0)  # type: ignore[arg-type]
    cost = evaluate(probe, graph, machine, wl)
    baselines = tuple(BaselineResult(strategy=s, total_s=draw(st.floats(0, 1e4)), fits=draw(st.booleans()),
                                     short_bytes=draw(st.integers(0, 2**40)), note=draw(st.text(max_size=20)))
                      for s in draw(st.lists(st.sampled_from(["sequential", "balanced", "accelerate"]), unique=True)))
    return Plan(model_name=draw(st.text(min_size=1, max_size=10)), dtype="float16",
                objective=draw(st.sampled_from(["latency", "throughput", "memory"])), strategy="cpsat",
                placements=tuple(placements), machine=machine, workload=wl, cost=cost,
                status=draw(st.sampled_from(["OPTIMAL", "FEASIBLE"])), objective_value=cost.total_s,
                best_bound=cost.total_s * draw(st.floats(0, 1)), gap=draw(st.floats(0, 1)),
                solve_time_s=draw(st.floats(0, 10)), baselines=baselines,
                notes=tuple(draw(st.lists(st.text(max_size=30), max_size=3))),
                extra={"coarse_units": n})


@settings(max_examples=60, deadline=None)
@given(plans())
def test_json_round_trip_is_exact(plan):
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert json.loads(text)["schema_version"] == PLAN_SCHEMA_VERSION
    assert again.summary() == plan.summary() and again.explain() == plan.explain()


@settings(max_examples=30, deadline=None)
@given(plans())
def test_maps_speak_accelerate(plan):
    dm = plan.device_map
    assert set(dm) == {p.unit for p in plan.placements}
    assert all(isinstance(v, int) or v in ("cpu", "disk") for v in dm.values())
    assert plan.streams_weights == any(p.storage != p.execution for p in plan.placements)
    assert plan.max_memory == plan.machine.max_memory


def test_summary_groups_runs_and_shows_every_device(tmp_path):
    plan = Plan.from_json(_example().to_json(str(tmp_path / "plan.json")))
    text = plan.summary()
    assert "model.layers.0 .. model.layers.1" in text  # one run of two resident units on cuda:0
    for d in DEVICES:
        assert d in text
    assert plan.runs() == [(["model.layers.0", "model.layers.1"], "cuda:0", "cuda:0", "resident"),
                           (["model.layers.2"], "cpu", "cuda:0", "stream")]
    rows = [line.split() for line in text.splitlines()]
    assert ["model.layers.2", "1", "cpu", "cuda:0", "stream"] in [r[:5] for r in rows]
    assert ["baseline", "total", "fits", "vs", "this", "plan"] in rows
    assert ["sequential", *_seconds_cells(plan.baselines[0].total_s), "yes", "2.00x"] in rows


def test_summary_cli_and_html_show_the_same_figures_under_the_same_labels():
    """One builder (placement_opt.report): the text, the CLI's rich tables and the HTML agree."""
    from rich.console import Console

    from placement_opt.cli.tables import plan_renderables

    plan = _example()
    c = plan.cost
    text = plan.summary()
    console = Console(width=200, color_system=None, record=True, file=io.StringIO())
    for part in plan_renderables(plan):
        console.print(part)
    cli = console.export_text()
    page = plan._repr_html_()
    end_to_end, decoding = f"{c.tokens_per_s:.2f} end to end", f"{c.decode_tokens_per_s:.2f} while decoding"
    assert c.tokens_per_s != c.decode_tokens_per_s  # the two throughputs differ: both are labelled
    for shown in (text, cli, page):
        assert end_to_end in shown and decoding in shown
        for label in ("Where each run of units lives and computes", "Memory per device", "Baselines"):
            assert label in shown
        for m in c.memory:
            assert format_bytes(m.used_bytes) in shown
    assert page.lstrip().startswith("<div") and "<th>tokens/s</th>" in page


def test_html_escapes_what_it_shows():
    plan = replace(_example(), notes=("<script>alert(1)</script>",))
    assert "<script>" not in plan._repr_html_() and "&lt;script&gt;" in plan._repr_html_()


def test_explain_names_the_streamed_unit_and_compares_the_baseline():
    plan = _example()
    lines = plan.explain().splitlines()
    assert lines[0].startswith("cpsat plan for m: ") and lines[0].endswith("fits (OPTIMAL, gap 0.0%).")
    streamed = [line for line in lines if line.startswith("- model.layers.2: ")]
    assert len(streamed) == 1
    assert "weights stay on cpu and are streamed to cuda:0 at every forward" in streamed[0]
    assert not any(line.startswith(("- model.layers.0: ", "- model.layers.1: ")) for line in lines)  # resident
    baseline = [line for line in lines if line.startswith("- baseline sequential: ")]
    assert len(baseline) == 1 and baseline[0].endswith(", fits, 2.00x this plan's time.")


def test_explain_says_a_baseline_that_does_not_fit_would_run_out_of_memory_whatever_its_time():
    """Its time read '0.47x this plan's time' beside 'does not fit', as if it were a faster plan."""
    short = BaselineResult(strategy="balanced", total_s=0.5, fits=False, short_bytes=3 * 2**30,
                           note="cuda:0 needs 9.00 GiB, has 6.00 GiB (3.00 GiB short): it would run out of memory")
    plan = replace(_example(), baselines=(short,))
    (line,) = [line for line in plan.explain().splitlines() if line.startswith("- baseline balanced")]
    ratio = f"{0.5 / plan.cost.total_s:.2f}x"
    assert line == (f"- baseline balanced: does not fit (cuda:0 needs 9.00 GiB, has 6.00 GiB (3.00 GiB short)), so it "
                    f"would run out of memory; priced as if it fit, 500.00 ms ({ratio} this plan's time).")
    bare = replace(plan, baselines=(replace(short, note=""),))
    assert "does not fit (3.00 GiB short), so it would run out of memory" in bare.explain()


def _seconds_cells(seconds: float) -> list[str]:
    from placement_opt.units import format_seconds

    return format_seconds(seconds).split()


def test_unknown_schema_version_is_refused():
    data = _example().to_dict()
    data["schema_version"] = 99
    with pytest.raises(PlanFormatError, match="schema version 99"):
        Plan.from_dict(data)


def test_a_missing_file_says_which_and_what_to_give(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(PlanFormatError, match=r"cannot read the plan file .*nope\.json.*Plan\.to_json"):
        Plan.from_json(str(path))
    with pytest.raises(PlanFormatError, match="nope.json"):
        Plan.from_json(path)  # a Path works like a str


def test_text_that_is_not_json_is_refused_with_the_position(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"schema_version": 1,', encoding="utf-8")
    with pytest.raises(PlanFormatError, match=r"plan\.json' is not JSON \(.*: line 1, column 22\)"):
        Plan.from_json(str(path))
    with pytest.raises(PlanFormatError, match="the plan text is not JSON"):
        Plan.from_json("{oops")
    path.write_text('{"model_name": "llama', encoding="utf-8")  # json's message ends "starting at"
    with pytest.raises(PlanFormatError, match=r"\(Unterminated string starting at: line 1, column 16\) \(the text ends"):
        Plan.from_json(str(path))


@pytest.mark.parametrize("field", ["model_name", "placements", "machine", "cost", "gap"])
def test_a_missing_field_is_named(field):
    data = _example().to_dict()
    del data[field]
    with pytest.raises(PlanFormatError, match=f"no '{field}' field"):
        Plan.from_json(json.dumps(data))


def test_a_malformed_placement_is_refused():
    data = _example().to_dict()
    data["placements"][0]["colour"] = "red"
    with pytest.raises(PlanFormatError, match="malformed.*colour"):
        Plan.from_dict(data)
    with pytest.raises(PlanFormatError, match="JSON array, not an object"):
        Plan.from_dict([1, 2])  # type: ignore[arg-type]


def test_plan_errors_are_value_errors_for_older_callers():
    with pytest.raises(ValueError):
        Plan.from_json("{}")


def _example() -> Plan:
    graph = chain_graph([{"name": f"model.layers.{i}", "param_bytes": 100 * MIB, "flops_per_token": 10**8}
                         for i in range(3)])
    placements = (UnitPlacement(unit="model.layers.0", storage="cuda:0", execution="cuda:0", mode="resident"),
                  UnitPlacement(unit="model.layers.1", storage="cuda:0", execution="cuda:0", mode="resident"),
                  UnitPlacement(unit="model.layers.2", storage="cpu", execution="cuda:0", mode="stream"))
    machine, wl = _machine(), Workload()
    probe = Plan(model_name="m", dtype="float16", objective="latency", strategy="cpsat", placements=placements,
                 machine=machine, workload=wl, cost=None, status="OPTIMAL", objective_value=0.0, best_bound=0.0,
                 gap=0.0, solve_time_s=0.0)  # type: ignore[arg-type]
    cost = evaluate(probe, graph, machine, wl)
    return Plan(model_name="m", dtype="float16", objective="latency", strategy="cpsat", placements=placements,
                machine=machine, workload=wl, cost=cost, status="OPTIMAL", objective_value=cost.total_s,
                best_bound=cost.total_s, gap=0.0, solve_time_s=0.1,
                baselines=(BaselineResult(strategy="sequential", total_s=2 * cost.total_s, fits=True),))


# -- a plan far from its bound says so (issue 12, item 4) -----------------------------------------
def _far(gap: float = 0.57, status: str = "FEASIBLE") -> Plan:
    plan = _example()
    return replace(plan, status=status, gap=gap, best_bound=plan.objective_value * (1 - gap), solve_time_s=1.0)


def test_a_plan_far_from_its_bound_says_how_far_and_what_to_do_in_every_report():
    plan = _far()
    advice = ("gap: not proven within 1% of the best: the best plan's latency may be up to 57.0% lower than "
              "this one's")
    summary = " ".join(plan.summary().split())  # the text report wraps long lines
    assert advice in summary
    assert "time_limit_s=5 in solve(), --time-limit 5 on the command line" in summary
    assert "gap 57.00% (above 1%: see the gap line below)" in summary
    assert f"- the {advice}" in plan.explain().splitlines()[1]
    assert '<p class="bad">' + advice.replace("'", "&#39;") in plan._repr_html_()


@given(st.sampled_from(["OPTIMAL", "FEASIBLE", "GREEDY"]), st.floats(0, 1))
def test_the_gap_line_appears_exactly_when_the_search_stopped_above_one_percent(status, gap):
    plan = _far(gap, status)
    far = status == "FEASIBLE" and gap > 0.01
    assert ("gap: not proven" in plan.summary()) == far
    assert ("- the gap: " in plan.explain()) == far
    assert ("gap: not proven" in plan._repr_html_()) == far


def _sublayer_plan(rows: list[tuple[str, str | None, str, str, str, str | None]]) -> Plan:
    """A hand-made plan whose placements are (unit, copy group, storage, execution, mode, prefill execution)."""
    from _plans import report_plan

    return replace(report_plan(), placements=tuple(
        UnitPlacement(unit=u, copy_group=g, storage=s, execution=e, mode=m, prefill_execution=pre)
        for u, g, s, e, m, pre in rows))


def test_a_sublayer_plan_is_shown_by_layer_with_the_parts_that_differ_named():
    from placement_opt.report import plan_report

    def layer(i: int, attn: tuple[str, str, str, str | None]) -> list:
        g = f"model.layers.{i}"
        return [(f"{g}.input_layernorm", g, "cuda:0", "cuda:0", "resident", None), (f"{g}.self_attn", g, *attn),
                (f"{g}.mlp", g, "cuda:0", "cuda:0", "resident", None)]

    home = ("cuda:0", "cuda:0", "resident", None)
    streamed, phased = ("cpu", "cuda:0", "stream", None), ("disk", "cpu", "phased", "cuda:0")
    plan = _sublayer_plan([("model.embed_tokens", None, "cpu", "cpu", "resident", None),
                           ("model.rotary_emb", None, "cpu", "cpu", "resident", None),
                           *layer(0, home), *layer(1, streamed), *layer(2, streamed), *layer(3, phased),
                           *layer(4, home), ("lm_head", None, "cuda:0", "cuda:0", "resident", None)])
    table = plan_report(plan).tables[0]
    assert table.title.startswith("Where each layer's parts live and compute")
    assert [tuple(c.text for c in row[:3]) for row in table.rows] == [
        ("model.embed_tokens .. model.rotary_emb", "2", "resident cpu"),
        ("model.layers.0", "1", "all resident cuda:0"),
        ("model.layers.1 .. model.layers.2", "2", "self_attn stream cpu -> cuda:0; the rest resident cuda:0"),
        ("model.layers.3", "1", "self_attn phased disk -> cpu (prefill cuda:0); the rest resident cuda:0"),
        ("model.layers.4", "1", "all resident cuda:0"),
        ("lm_head", "1", "resident cuda:0"),
    ]
    block = replace(plan, placements=tuple(replace(p, copy_group=None) for p in plan.placements))
    assert plan_report(block).tables[0].title == "Where each run of units lives and computes"


def test_a_baseline_that_never_ran_reads_not_run_with_its_reason_not_as_a_misfit():
    """``solve("llama-3-8b", ...)`` cannot run accelerate on a preset name: not a baseline that does not fit."""
    why = "strategy='accelerate' runs the installed library on the model itself, so it needs a transformers model"
    skipped = BaselineResult(strategy="accelerate", total_s=float("inf"), fits=False, note=f"not run: {why}")
    plan = replace(_example(), baselines=(*_example().baselines, skipped))
    assert not skipped.ran and plan.baselines[0].ran
    rows = [line.split() for line in plan.summary().splitlines()]
    assert ["accelerate", "-", "not", "run", "-"] in rows
    assert not any(r[:1] == ["accelerate"] and "NO" in r for r in rows)
    assert f"baseline accelerate not run: {why}" in " ".join(plan.summary().split())
    explained = [line for line in plan.explain().splitlines() if line.startswith("- baseline accelerate")]
    assert explained == [f"- baseline accelerate: not run ({why})."]
    assert "not run" in plan._repr_html_() and ">NO<" not in plan._repr_html_()
    again = Plan.from_dict(plan.to_dict())  # the note travels, so does "not run"
    assert not again.baselines[-1].ran


def test_a_baseline_that_does_not_fit_reads_oom_not_a_speed_ratio():
    import dataclasses

    from placement_opt import solve
    from placement_opt.plan import BaselineResult

    plan = solve("llama-3-8b", "cuda:0=rtx-4090,cpu=64GiB,disk")
    plan = dataclasses.replace(plan, baselines=(BaselineResult(strategy="sequential", total_s=plan.cost.total_s / 2,
                                                               fits=False, short_bytes=2**20, note=""),))
    row = next(line for line in plan.summary().splitlines() if "sequential" in line)
    assert "OOM" in row and "0.50x" not in row, row


def test_a_plan_whose_placements_were_edited_after_pricing_says_its_figures_are_stale():
    from placement_opt import solve
    from placement_opt._plan_json import EDITED_NOTE
    from placement_opt.plan import Plan

    plan = solve("llama-3-8b", "cuda:0=rtx-4090,cpu=64GiB,disk")
    assert not any(n.startswith(EDITED_NOTE) for n in Plan.from_json(plan.to_json()).notes)
    data = plan.to_dict()
    moved = next(p for p in data["placements"] if p["mode"] == "resident" and p["storage"] == "cuda:0")
    moved.update(storage="cpu", mode="stream")  # consistent, so it is read; but priced as resident
    edited = Plan.from_dict(data)
    notes = [n for n in edited.notes if n.startswith(EDITED_NOTE)]
    assert len(notes) == 1 and moved["unit"] in notes[0]
    again = Plan.from_json(edited.to_json())
    assert [n for n in again.notes if n.startswith(EDITED_NOTE)] == notes  # once, however often it is read


def test_a_sublayer_plans_home_is_shown_by_the_cli_and_the_html_as_by_summary():
    """summary() added the home line to its text alone: `placement-opt plan/explain` and the notebook's HTML left out
    where the residual stream stays, which every unit computed elsewhere pays a round trip to."""
    from rich.console import Console

    from placement_opt.cli.tables import plan_renderables

    plan = replace(_example(), home="cuda:0")
    console = Console(width=200, color_system=None, record=True, file=io.StringIO())
    for part in plan_renderables(plan):
        console.print(part)
    for shown in (plan.summary(), console.export_text(), plan._repr_html_()):
        assert "cuda:0: the residual stream" in shown
    assert "residual stream" not in _example().summary()


def test_a_plan_whose_workload_was_edited_after_pricing_says_its_figures_are_of_the_solved_one():
    """The summary's workload line is the file's, its times and memory the cost's: an edited batch read silently,
    batch 8 shown beside batch 1's figures."""
    EDITED_WORKLOAD_NOTE = "workload edited after the plan was priced:"  # noqa: N806
    plan = _example()
    assert not any(n.startswith(EDITED_WORKLOAD_NOTE) for n in Plan.from_json(plan.to_json()).notes)
    data = plan.to_dict()
    data["workload"]["batch_size"] = 8
    edited = Plan.from_dict(data)
    notes = [n for n in edited.notes if n.startswith(EDITED_WORKLOAD_NOTE)]
    assert len(notes) == 1 and f"batch_size {plan.workload.batch_size})" in notes[0]
    assert EDITED_WORKLOAD_NOTE in edited.summary()
    again = Plan.from_json(edited.to_json())
    assert [n for n in again.notes if n.startswith(EDITED_WORKLOAD_NOTE)] == notes  # once, however often it is read


def test_explain_never_says_a_disk_would_compute_a_streamed_unit():
    """A unit streamed from disk read "cuda:0 still computes them faster than disk would" (a disk computes nothing),
    one streamed synchronously "stream_synced", and the CPU beside GPUs "the GPUs memory"."""
    rows = [("model.layers.0", "disk", "cuda:0", "stream"), ("model.layers.1", "disk", "cpu", "stream"),
            ("model.layers.2", "cpu", "cuda:0", "stream_sync"), ("model.layers.3", "cpu", "cpu", "resident")]
    graph = chain_graph([{"name": u, "param_bytes": 100 * MIB, "flops_per_token": 10**8} for u, *_ in rows])
    placements = tuple(UnitPlacement(unit=u, storage=s, execution=e, mode=m) for u, s, e, m in rows)
    machine, wl = _machine(), Workload()
    probe = Plan(model_name="m", dtype="float16", objective="latency", strategy="cpsat", placements=placements,
                 machine=machine, workload=wl, cost=None, status="OPTIMAL", objective_value=0.0, best_bound=0.0,
                 gap=0.0, solve_time_s=0.0)  # type: ignore[arg-type]
    text = replace(probe, cost=evaluate(probe, graph, machine, wl)).explain()
    assert "than disk would" not in text and "stream_synced" not in text and "GPUs memory" not in text
    assert "model.layers.0: weights stay on disk and are streamed to cuda:0" in text
    assert "cuda:0 still computes them faster than the CPU would" in text
    assert "model.layers.2: weights stay on cpu and are streamed synchronously to cuda:0" in text
    assert "the GPUs' memory" in text


def test_a_training_plans_summary_adds_up_and_claims_no_generated_tokens():
    """The memory table left out the gradients and optimizer states that `used` holds (9.10 GiB of weights 'used'
    78 GiB), and a training step read 'batch 1 x prompt 512 + 128 new tokens' at a tokens/s of tokens it never
    generates."""
    import placement_opt as po
    from placement_opt.model.graph import chain_graph
    from placement_opt.units import format_bytes

    graph = chain_graph([{"name": f"l{i}", "param_bytes": 2**20} for i in range(4)])
    plan = po.solve(graph, {"cpu": "1GiB"}, workload=po.Workload(batch_size=2, prompt_len=16, training=True))
    (memory,) = plan.cost.memory
    assert memory.other_bytes > 0 and memory.used_bytes == (memory.weights_bytes + memory.kv_cache_bytes
                                                            + memory.workspace_bytes + memory.stream_buffer_bytes
                                                            + memory.other_bytes)
    text = plan.summary()
    assert "grads + optimizer" in text and format_bytes(memory.other_bytes) in text
    assert "new tokens" not in text and "a training step of batch 2 x 16 tokens" in text
    assert f"{32 / plan.cost.total_s:.2f} trained on" in text


def test_explain_says_a_kv_cache_moves_only_for_phased_units_that_have_one():
    """explain() said "their KV cache moves to cpu" of phased expert units, which cache nothing."""
    from _plans import report_plan

    base = report_plan(n_layers=4)

    def phased(kv_bytes: int) -> Plan:
        names = {"layers.1", "layers.2"}
        placements = tuple(replace(p, storage="cpu", execution="cpu", mode="phased", prefill_execution="cuda:0")
                           if p.unit in names else p for p in base.placements)
        units = tuple(replace(u, storage="cpu", execution="cpu", mode="phased", prefill_execution="cuda:0",
                              resident_bytes=kv_bytes) if u.name in names else u for u in base.cost.units)
        return replace(base, placements=placements, cost=replace(base.cost, units=units))

    with_cache, without = phased(2**20).explain(), phased(0).explain()
    assert "layers.1 .. layers.2 (2 units): weights stay on cpu" in with_cache
    assert "their KV cache moves to cpu once, after the prompt" in with_cache
    assert "layers.1 .. layers.2 (2 units): weights stay on cpu" in without and "KV cache moves" not in without
