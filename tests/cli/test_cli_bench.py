"""``placement-opt bench`` and benchmarks/run_all.py: the registry, the report, the exit codes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _cli import run_cli

# The repository root, wherever this file sits under tests/.
REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
RUN_ALL = REPO / "benchmarks" / "run_all.py"


def _script_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run_all_module():
    return _script_module("run_all", RUN_ALL)


def test_registry_names_every_question_once():
    run_all = _run_all_module()
    names = [e.name for e in run_all.EXPERIMENTS]
    assert len(names) == len(set(names))
    assert {"tracing", "solve_time", "plan_quality", "cost_accuracy", "dispatch", "strategies"} <= set(names)


def test_collect_writes_a_report_with_machine_and_rerun_per_section(tmp_path):
    out = tmp_path / "RESULTS.md"
    result = run_cli("bench", "--collect", "--out", str(out), catch_exceptions=True)
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.startswith("# placement_opt benchmark results")
    assert "logical cores" in text  # the machine line
    assert "nothing ran here" in text and "Regenerated" not in text  # collected: measured elsewhere, maybe
    names = [e.name for e in _run_all_module().EXPERIMENTS]
    for name in names:
        assert f"<!-- section:{name} -->" in text and f'<a id="{name}"></a>' in text
    assert text.count("Rerun: ") == len(names)


def test_collect_keeps_a_previous_section_of_run_all_itself(tmp_path):
    run_all = _run_all_module()
    out = tmp_path / "RESULTS.md"
    out.write_text(f"{run_all.TITLE}\n\n<!-- section:strategies -->\nthe old table\n<!-- /section:strategies -->\n")
    assert run_all.main(["--collect", "--out", str(out)]) == 0
    assert "the old table" in out.read_text()


def test_unknown_experiment_is_a_usage_error(tmp_path):
    result = run_cli("bench", "--only", "nope", "--out", str(tmp_path / "r.md"), catch_exceptions=True)
    assert result.exit_code == 2
    assert "unknown experiment(s) nope" in result.output


def test_the_suite_counts_its_experiments_on_stderr_when_progress_is_on(tmp_path, monkeypatch, capsys):
    run_all = _run_all_module()
    fake = [run_all.Experiment(name=name, question=f"{name}?", folder=name, func=lambda quick, n=name: f"body {n}")
            for name in ("first", "second", "third")]
    monkeypatch.setattr(run_all, "EXPERIMENTS", fake)
    monkeypatch.setenv("PLACEMENT_OPT_PROGRESS", "1")
    assert run_all.main(["--only", "first", "--only", "third", "--out", str(tmp_path / "r.md")]) == 0
    out, err = capsys.readouterr()
    assert "Benchmarks" in err and "2/2" in err  # the two selected; "second" is only collected
    assert "[run_all] third: ok" in out and "Benchmarks" not in out


def test_bench_hands_the_terminal_to_the_suite_when_progress_is_on(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PLACEMENT_OPT_PROGRESS", "1")
    result = run_cli("bench", "--only", "nope", "--out", str(tmp_path / "r.md"), catch_exceptions=True)
    assert result.exit_code == 2
    assert "its message is above" in result.output
    assert "unknown experiment(s) nope" in capfd.readouterr().err  # written by the suite itself


def test_cost_accuracy_tells_swapped_near_ties_from_swapped_placements():
    run = _script_module("cost_accuracy_run", REPO / "benchmarks" / "cost_accuracy" / "run.py")

    def rows(**predicted_and_measured):
        return [run.Row("m", "r", name, "prefill", 0.0, after, after, measured)
                for name, (after, measured) in predicted_and_measured.items()]

    assert run.ranking(rows(a=(1.0, 1.0), b=(2.0, 3.0)), "m", "r", "prefill", "after_s") == "matches"
    near = run.ranking(rows(a=(1.1, 1.00), b=(1.0, 1.02), c=(5.0, 4.0)), "m", "r", "prefill", "after_s")
    assert near.startswith("matches but for near ties") and "a measured 2% faster than b" in near
    far = run.ranking(rows(a=(1.1, 1.00), b=(1.0, 1.20)), "m", "r", "prefill", "after_s")
    assert far.startswith("DIFFERS") and "a measured 20% faster than b" in far


def test_the_latent_benchmark_times_each_layer_at_a_fixed_context_and_prices_it_with_and_without_the_expansion():
    """benchmarks/cost_accuracy/latent.py on a tiny DeepSeek-V2: every layer timed at each step (the cache cropped
    back to the context), and the figures it removes for "before" are the ones that price the expansion."""
    import transformers as T

    from placement_opt.hardware.devices import Device, Machine
    from placement_opt.model.tracer import trace

    latent = _script_module("cost_accuracy_latent", REPO / "benchmarks" / "cost_accuracy" / "latent.py")
    config = T.DeepseekV2Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
                                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                                num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                vocab_size=1000)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    layers = ["model.layers.0", "model.layers.1"]
    times = latent.step_times(model, layers, context=40, steps=3)
    assert set(times) == set(layers) and all(t > 0 for t in times.values())
    graph = trace(model, seq_len=16)
    machine = Machine([Device("cpu", 2**40, flops=1e11, bandwidth=1e10)])
    after = latent.predicted_step(graph, machine, "model.layers.0", 4096)
    before = latent.predicted_step(latent.without_latent(graph), machine, "model.layers.0", 4096)
    from placement_opt.cost.pricing import OP_OVERHEAD_S

    host = graph.unit("model.layers.0").ops_per_forward * OP_OVERHEAD_S["cpu"]  # the host's time, in both
    assert after - host > 5 * (before - host)


def test_the_gpu_benchmarks_share_one_checkpoint_per_shape_within_a_device_check_call(tmp_path, monkeypatch):
    """BENCH_SHARED: a checkpoint written once under a name of its shape, read again by a later step, and left for
    the machine's life (device_check.sh); without it, written into the step's own folder and removed by it."""
    from transformers import LlamaConfig

    common = _script_module("gpu_common", REPO / "benchmarks" / "gpu_common.py")
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    config.dtype = "float32"
    monkeypatch.delenv(common.SHARED_ENV, raising=False)
    own = common.random_checkpoint(config, tmp_path / "step")
    assert own.parent == tmp_path / "step" and (own / "config.json").exists()
    common.remove_unshared(own)
    assert not own.exists()

    monkeypatch.setenv(common.SHARED_ENV, str(tmp_path / "shared"))
    first = common.random_checkpoint(config, tmp_path / "step1")
    written = {f.name: f.stat().st_mtime_ns for f in first.iterdir()}
    again = common.random_checkpoint(config, tmp_path / "step2")
    assert again == first and {f.name: f.stat().st_mtime_ns for f in again.iterdir()} == written  # not rewritten
    common.remove_unshared(again)
    assert first.exists()  # the call's later steps still read it
    other = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 2})
    assert common.random_checkpoint(other, tmp_path / "step3") != first  # another shape, another checkpoint


def _table_rows(text: str, first_cell: tuple[str, ...]) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in first_cell]


def test_the_gpu_benchmarks_run_their_steps_on_the_cpu_with_a_tiny_model(tmp_path):
    """--smoke / --gpu-smoke: what a lent GPU machine runs (benchmarks/DEVICE.md), checked here before it does:
    every row complete, and every runner's greedy tokens equal to the first runner's."""
    env = {**os.environ, "PLACEMENT_OPT_PROFILE": str(tmp_path / "profile.json")}
    memory = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cost_accuracy" / "run.py"), "--gpu-smoke",
                             "--gpu-prompts", "16", "--steps", "3"], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300)
    assert memory.returncode == 0, memory.stdout + memory.stderr
    rows = {(r[0], r[1]): r for r in _table_rows(memory.stdout, ("accelerate", "placement_opt"))}  # printed twice
    assert len(rows) == 4 and all(len(r) == 11 and not r[3].startswith(("error", "OOM")) and float(r[7]) > 0
               for r in rows.values()), rows
    decode = subprocess.run([sys.executable, str(REPO / "benchmarks" / "phases" / "gpu.py"), "--smoke"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert decode.returncode == 0, decode.stdout + decode.stderr
    runners = ("accelerate auto", "layer", "phased", "sublayer", "expert groups")
    rows = _table_rows(decode.stdout, ("tiny-llama (smoke)", "tiny-mixtral (smoke)"))
    final = {(r[0], r[2]): r for r in rows}  # the table is printed again after every row: its last form
    assert {runner for _, runner in final} == set(runners)
    def equal(cell: str) -> bool:  # "9/9": every greedy token of the run equal to the reference's
        same, of = cell.split("/")
        return same == of

    assert all((r[9] == "reference" or equal(r[9])) and not r[10] and float(r[7]) > 0 and float(r[11]) > 0
               for r in final.values()), final  # r[11]: the mean step at contexts the process had not run
    probe = subprocess.run([sys.executable, str(REPO / "benchmarks" / "phases" / "probe.py"), "--smoke"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    visits = {(r[0], r[1]) for r in _table_rows(probe.stdout, ("default", "cuDNN off"))}
    assert visits == {(s, b) for s in ("default", "cuDNN off") for b in ("1", "16")}, probe.stdout
    assert len({r[1] for r in _table_rows(probe.stdout, ("leaving cpu",))}) == 2, probe.stdout
    segments = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cost_accuracy" / "segments.py"),
                               str(tmp_path / "segments.jsonl"), "--smoke"], capture_output=True, text=True,
                              env={**env, "PROFILE": str(tmp_path / "profile.json")}, cwd=tmp_path, timeout=300)
    assert segments.returncode == 0, segments.stdout + segments.stderr
    (row,) = [json.loads(line) for line in (tmp_path / "segments.jsonl").read_text().splitlines()]
    assert row["predicted"]["used_bytes"] > row["predicted"]["weights_bytes"] > 0, row


def test_the_ops_benchmark_prices_one_graph_with_and_without_its_op_counts(monkeypatch):
    """benchmarks/cost_accuracy/ops.py: "before" is the same graph with every op count removed (the fixed overhead
    per unit), "after" the graph as traced; both through evaluate, every unit on the CPU."""
    from placement_opt.cost.pricing import OP_OVERHEAD_S, UNIT_OVERHEAD_S
    from placement_opt.cost.workload import Workload
    from placement_opt.hardware.devices import Device, Machine
    from placement_opt.model.tracer import trace

    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "cost_accuracy"))
    ops = _script_module("cost_accuracy_ops", REPO / "benchmarks" / "cost_accuracy" / "ops.py")
    graph = trace(ops.tiny_configs()["tiny llama"], seq_len=16)
    bare = ops.uncounted(graph)
    assert all(bare.unit(n).ops_per_forward is None for n in bare.names())
    machine, workload = Machine([Device("cpu", 2**40, flops=1e12, bandwidth=1e11)]), Workload(prompt_len=16,
                                                                                             new_tokens=4)
    (before_prefill, _), (after_prefill, _) = (ops.predicted(g, machine, workload) for g in (bare, graph))
    counted = sum(graph.unit(n).ops_per_forward for n in graph.names())
    fixed = len(graph.names()) * UNIT_OVERHEAD_S["cpu"]
    assert after_prefill - before_prefill == pytest.approx(counted * OP_OVERHEAD_S["cpu"] - fixed, rel=1e-6)


def test_the_decode_floor_lies_under_every_solved_plan_and_meets_the_resident_one():
    """benchmarks/phases/floor.py: its linear program is a relaxation of solve()'s problem, so its step is never
    slower than a solved plan's (the script exits non-zero if it is); with the GPU's memory no limit, every unit
    resident is feasible and optimal for both, so the floor must price it as the plan does."""
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "phases" / "floor.py"), "--smoke", "--case", "all"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {(r[0], r[1]): r for r in _table_rows(run.stdout, ("tiny-llama (smoke)", "tiny-mixtral (smoke)"))}
    assert set(rows) == {(c, b) for c in ("tiny-llama (smoke)", "tiny-mixtral (smoke)") for b in ("1MiB", "whole GPU")}
    for r in rows.values():
        floor = float(r[6].strip("*"))
        assert floor >= float(r[4]) and floor >= float(r[5]), r  # tokens/s: the floor is the fastest
    for case in ("tiny-llama (smoke)", "tiny-mixtral (smoke)"):
        whole = rows[case, "whole GPU"]
        assert abs(float(whole[6].strip("*")) / float(whole[5]) - 1) < 0.01, whole


def test_the_masked_prompt_benchmark_prices_a_padded_prompt_above_the_equal_one(tmp_path):
    """benchmarks/cost_accuracy/masked.py: every row complete; the padded prompt priced at more than the equal one
    (the mask's pairs), before calibration and after; its "as equal" column the equal prompt's calibrated price."""
    env = {**os.environ, "PLACEMENT_OPT_PROFILE": str(tmp_path / "profile.json")}
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cost_accuracy" / "masked.py"), "--prompts", "64",
                          "--repeats", "1", "--out", "-"], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {(r[0], r[2]): [float(x) for x in r[3:10]] for r in _table_rows(run.stdout, ("llama", "mistral"))}
    assert set(rows) == {(m, p) for m in ("llama", "mistral") for p in ("equal", "padded")}, run.stdout
    for model in ("llama", "mistral"):
        equal, padded = rows[model, "equal"], rows[model, "padded"]
        assert padded[0] > equal[0] and padded[1] > equal[1], (equal, padded)  # before, after
        assert padded[2] == equal[2] == equal[1] and all(x > 0 for x in (*equal, *padded)), (equal, padded)


def test_the_decode_benchmark_says_how_far_apart_parted_logits_are():
    """A runner whose greedy tokens part from the reference's gets the prompt's last logits against it in its note:
    a gap within the reference's top-2 margin reads as rounding, non-finite values as a fault."""
    import torch

    other = sys.modules.pop("run", None)  # gpu.py imports its own folder's run.py by that name; so may other tests
    try:
        gpu = _script_module("phases_gpu", REPO / "benchmarks" / "phases" / "gpu.py")
    finally:
        sys.modules.pop("run", None)
        if other is not None:
            sys.modules["run"] = other
    reference = torch.tensor([[3.0, 2.5, 0.0]])
    rounding = gpu.logits_apart(torch.tensor([[2.9, 2.95, 0.0]]), reference)
    assert "max |diff| 0.45" in rounding and "top-2 margin is 0.5" in rounding
    assert "all finite" in rounding and "argmax apart" in rounding
    broken = gpu.logits_apart(torch.tensor([[float("nan"), 2.5, 0.0]]), reference)
    assert "NON-FINITE" in broken


def test_bench_list_names_every_experiment_and_runs_nothing(tmp_path):
    """run_all.py --list, through the CLI (it answered 'No such option')."""
    result = run_cli("bench", "--list", "--out", str(tmp_path / "r.md"), catch_exceptions=True)
    assert result.exit_code == 0, result.output
    assert all(e.name in result.output for e in _run_all_module().EXPERIMENTS)
    assert not (tmp_path / "r.md").exists()
