"""Issue 17's hostile inputs: each gives one clean, specific error of the project's hierarchy.

Every case names the error class and the key words of its message; CLI cases also check the exit
code, a single line on stderr and no traceback.
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
import warnings

import pytest
import torch

import placement_opt as po
from _cli import run_cli
from _models import plan_from, tiny
from placement_opt.cost.build import build_problem
from placement_opt.cost.workload import Workload
from placement_opt.errors import (
    DeviceSpecError,
    DispatchError,
    ModelSpecError,
    PlanFormatError,
    TraceError,
    WorkloadError,
)
from placement_opt.model.graph import chain_graph
from placement_opt.plan import Plan
from placement_opt.runtime.offload import OffloadStore


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny("llama")


@pytest.fixture(scope="module")
def solved(model) -> Plan:
    return po.solve(model, {"cpu": "8GiB", "disk": "100GiB"}, time_limit_s=2, workers=1)


def _edit(plan: Plan, change) -> dict:
    data = copy.deepcopy(plan.to_dict())
    change(data)
    return data


def _layer_index(data: dict) -> int:
    return next(i for i, p in enumerate(data["placements"]) if p["unit"] == "model.layers.1")


# -- plans read from JSON ---------------------------------------------------------------------
JSON_CASES = {
    "storage tpu": (lambda d: d["placements"][0].update(storage="tpu"), r"storage 'tpu' is not a device"),
    "execution disk": (lambda d: d["placements"][0].update(execution="disk"), r"execution 'disk' cannot compute"),
    "mode teleport": (lambda d: d["placements"][0].update(mode="teleport"), r"mode 'teleport' is unknown: accepted"),
    # placements[0] is resident on the CPU: a hand edit of one field leaves its mode contradicting its devices
    "resident moved to disk": (lambda d: d["placements"][0].update(storage="disk"),
                               r"mode 'resident' computes where the weights are stored, but storage is 'disk'"),
    "stream in place": (lambda d: d["placements"][0].update(mode="stream"),
                        r"mode 'stream' copies the weights from storage to execution, but both are 'cpu'"),
    "unit twice": (lambda d: d["placements"].append(dict(d["placements"][1])), r"listed twice"),
    "missing layer": (lambda d: d["placements"].pop(_layer_index(d)), r"miss 1 unit\(s\) of the model: 'model.layers.1'"),
    "missing key": (lambda d: d.pop("cost"), r"no 'cost' field"),
    "missing nested key": (lambda d: d["placements"][0].pop("mode"), r"placements\[0\]: no 'mode' field"),
    "negative batch": (lambda d: d["workload"].update(batch_size=-3), r"workload.batch_size"),
    "negative time": (lambda d: d["cost"].update(decode_s=-1.0), r"cost.decode_s"),
    "string capacity": (lambda d: d["machine"]["devices"][0].update(memory_bytes="lots"), r"memory_bytes"),
    "future version": (lambda d: d.update(schema_version=99), r"schema version 99.*not supported"),
}


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_a_bad_plan_file_is_one_plan_format_error(case, solved, tmp_path):
    change, words = JSON_CASES[case]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_edit(solved, change)), encoding="utf-8")
    with pytest.raises(PlanFormatError, match=words) as info:
        Plan.from_json(str(path))
    assert "\n" not in str(info.value)
    assert str(path) in str(info.value)  # says where


@pytest.mark.parametrize("case", ["storage tpu", "mode teleport", "resident moved to disk", "missing layer", "missing key"])
def test_the_cli_refuses_a_bad_plan_file_in_one_line(case, solved, tmp_path):
    change, words = JSON_CASES[case]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_edit(solved, change)), encoding="utf-8")
    result = run_cli("explain", str(path))
    _one_line_error(result, words)


@pytest.mark.parametrize(("text", "words"), [
    ("", r"plan path is empty"),
    ("   ", r"plan path is empty"),
    ('{"schema_version": 2, "placements": [', r"not JSON .*ends early"),
    ("[1, 2]", r"JSON array, not an object"),
    ("does/not/exist.json", r"cannot read the plan file 'does/not/exist.json'"),
])
def test_empty_truncated_or_missing_text_is_a_plan_format_error(text, words):
    with pytest.raises(PlanFormatError, match=words):
        Plan.from_json(text)


@pytest.mark.parametrize(("content", "words"), [("", r"is empty: give a file"), ("null", r"is a JSON null, not an"),
                                                ('"plan"', r"is a JSON string, not an object")])
def test_a_plan_file_that_is_empty_or_no_object_says_so_in_json_s_words(tmp_path, content, words):
    """An empty file read as cut off ('the text ends early'), and JSON's null as Python's 'NoneType'."""
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(PlanFormatError, match=words) as caught:
        Plan.from_json(str(path))
    assert "NoneType" not in str(caught.value) and "ends early" not in str(caught.value)


def test_truncated_plan_file_says_it_was_cut_off(solved, tmp_path):
    path = tmp_path / "plan.json"
    text = solved.to_json()
    path.write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(PlanFormatError, match=r"plan.json' is not JSON .*cut off"):
        Plan.from_json(path)


def test_baseline_times_are_standard_json(solved):
    inf = po.plan.BaselineResult(strategy="sequential", total_s=float("inf"), fits=False, note="x")
    plan = Plan(**{**vars(solved), "baselines": (inf,)})
    text = plan.to_json()
    assert "Infinity" not in text and "NaN" not in text
    json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    assert Plan.from_json(text).baselines[0].total_s == float("inf")
    # files written before version 2 (bare Infinity, no fingerprint) are still read
    old = json.loads(text)
    old["schema_version"] = 1
    del old["fingerprint"]
    old_text = json.dumps(old).replace('"total_s": null', '"total_s": Infinity')
    assert "Infinity" in old_text
    again = Plan.from_json(old_text)
    assert again.baselines[0].total_s == float("inf") and again.fingerprint is None


# -- a plan against the model it is dispatched on --------------------------------------------
def test_a_plan_missing_a_layer_is_refused_by_dispatch(model, solved):
    data = _edit(solved, lambda d: d["placements"].pop(_layer_index(d)))
    data["schema_version"], data["fingerprint"] = 1, None  # an old plan: no fingerprint to compare
    plan = Plan.from_dict(data)
    with pytest.raises(DispatchError, match=r"in no unit of the plan \(model.layers.1.self_attn"):
        po.dispatch(model, plan)
    assert not hasattr(model.model.layers[0], "_placement_opt_hook")


def test_a_plan_for_another_size_of_the_same_family_is_refused(solved):
    import transformers as T

    torch.manual_seed(0)
    other = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=96,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64))
    with pytest.raises(DispatchError, match=r"differ from the model the plan was solved for .*model.layers.0: "
                                            r".* of weights in the plan, .* in the model"):
        po.dispatch(other, solved)


# -- numbers beyond the solver's 64-bit integers ----------------------------------------------
@pytest.mark.parametrize("devices", [{0: 2**63, "cpu": "8GiB"}, {"cpu": 2**63}, {"cpu": "100000000TB"}])
def test_a_huge_capacity_is_refused_with_the_accepted_range(model, devices):
    with pytest.raises(DeviceSpecError, match=r"accepted are 0 to 8192.00 TiB \(2\*\*53 bytes\)"):
        po.solve(model, devices)


def test_a_huge_workload_is_refused_with_the_accepted_range():
    with pytest.raises(WorkloadError, match=r"1e\+15 tokens .*accepted are up to 2\*\*40"):
        Workload(batch_size=10**6, prompt_len=10**9)


@pytest.mark.parametrize("field", ["training", "activation_checkpointing", "overlap", "padded"])
@pytest.mark.parametrize("value", ["no", "yes", None, 0, 1])
def test_a_workload_flag_that_is_not_a_bool_is_refused(field, value):
    """Workload(training="no") was truthy: a training step priced under a generation's name."""
    with pytest.raises(WorkloadError, match=rf"Workload.{field} is .*: it must be True or False"):
        Workload(**{field: value})


@pytest.mark.parametrize(("data", "words"), [({"batch_size": 2, "foo": 3}, r"no field\(s\) 'foo'"),
                                             (None, "not a NoneType"), ([1], "not a list")])
def test_a_workload_read_from_data_names_what_it_cannot_use(data, words):
    with pytest.raises(WorkloadError, match=words):
        Workload.from_dict(data)


def test_costs_beyond_the_solver_range_are_refused_before_cp_sat():
    graph = chain_graph([{"name": f"l{i}", "param_bytes": 2**30, "flops_per_token": 2**40} for i in range(4)])
    workload = Workload(batch_size=2**20, prompt_len=2**19, new_tokens=2**19)
    with pytest.raises(WorkloadError, match=r"beyond the solver's range"):
        build_problem(graph, {"cpu": "64GiB"}, workload)


@pytest.mark.parametrize(("args", "words"), [
    (["--devices", "cuda:0=100000000TB,cpu=64GiB"], r"accepted are 0 to 8192.00 TiB"),
    (["--devices", "cpu=64GiB", "--batch", "1000000", "--prompt", "1000000000"], r"accepted are up to 2\*\*40"),
])
def test_the_cli_refuses_huge_numbers_in_one_line(args, words):
    _one_line_error(run_cli("plan", "llama-2-7b", *args), words)


# -- models, files and names ------------------------------------------------------------------
def test_an_empty_model_says_it_has_nothing_to_place():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one clear error, not a tracing warning first
        with pytest.raises(TraceError, match=r"'Module' has no placement units: it holds no parameters or buffers"):
            po.solve(torch.nn.Module(), {"cpu": "8GiB"})


def test_an_empty_offload_dir_is_refused_not_the_current_directory(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = plan_from(model, lambda i, unit: ("disk", "cpu", "stream"))
    with pytest.raises(DispatchError, match=r"offload_dir '' names no directory"):
        po.dispatch(model, plan, offload_dir="")
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_offload_dir_is_one_dispatch_error(model, tmp_path, monkeypatch):
    store = OffloadStore(tmp_path)  # the lock file exists: only writing the weights fails

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "x.tmp"))

    monkeypatch.setattr(OffloadStore, "_write_temporary", refuse)
    with pytest.raises(DispatchError, match=r"offload directory .* is not writable \(Permission denied\)"):
        store.write("model.norm", {"weight": torch.ones(4)})
    plan = plan_from(model, lambda i, unit: ("disk", "cpu", "stream"))
    with pytest.raises(DispatchError, match=r"not writable"):
        po.dispatch(model, plan, offload_dir=tmp_path)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_chmod_read_only_offload_dir_is_one_dispatch_error(model, tmp_path):  # pragma: no cover - root CI
    tmp_path.chmod(0o555)
    try:
        plan = plan_from(model, lambda i, unit: ("disk", "cpu", "stream"))
        with pytest.raises(DispatchError, match=r"offload directory"):
            po.dispatch(model, plan, offload_dir=tmp_path / "sub")
    finally:
        tmp_path.chmod(0o755)


def test_load_of_a_truncated_checkpoint_is_one_dispatch_error(model, tmp_path):
    model.save_pretrained(tmp_path)
    shard = next(tmp_path.glob("*.safetensors"))
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    plan = plan_from(model, lambda i, unit: ("cpu", "cpu", "resident"))
    with pytest.raises(DispatchError, match=r"checkpoint file .* is truncated: .* missing\); download or save"):
        po.load(tmp_path, None, plan=plan)


def test_json_into_a_missing_folder_fails_before_solving(tmp_path):
    target = tmp_path / "no" / "such" / "plan.json"
    started = time.perf_counter()
    result = run_cli("plan", "llama-2-7b", "--devices", "cpu=64GiB", "--json", str(target))
    _one_line_error(result, r"--json.*folder .* does not exist")
    assert "Solving" not in result.output and time.perf_counter() - started < 10
    assert not target.parent.exists()


def test_an_unknown_name_fails_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    started = time.perf_counter()
    # a name that resolves to nothing is the caller's input: ModelSpecError (the CLI's exit code 2)
    with pytest.raises(ModelSpecError, match=r"did you mean 'llama-2-7b'\? accepted are a preset \(llama-2-7b"):
        po.solve("llama-2-7bb", {"cpu": "64GiB"})
    with pytest.raises(ModelSpecError, match=r"hub cannot be reached"):
        po.trace("nobody/no-such-model")
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("name", ["llama-2-7bb", "nobody/no-such-model"])
def test_the_cli_refuses_an_unknown_name_fast(name, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    started = time.perf_counter()
    _one_line_error(run_cli("plan", name, "--devices", "cpu=64GiB"), r"llama-2-7b")
    assert time.perf_counter() - started < 5


def test_a_malformed_saved_profile_names_its_file(tmp_path):
    from placement_opt.hardware.profile_store import saved_device

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"schema_version": 1, "created": "2025-01-01",
                                "measurements": {"cpu": {"memory_bytes": -1}}}), encoding="utf-8")
    with pytest.raises(PlanFormatError, match=r"saved profile .*profile.json.*memory_bytes.*profile` again"):
        saved_device("cpu", path=path)


def test_a_malformed_layer_graph_is_a_plan_format_error():
    graph = chain_graph([{"name": "a", "param_bytes": 8}, {"name": "b"}])
    data = graph.to_dict()
    data["nodes"][1]["param_bytes"] = "eight"
    data["edges"].append({"src": "a", "dst": "ghost", "bytes_per_token": 1})
    with pytest.raises(PlanFormatError, match=r"nodes\[1\].param_bytes"):
        po.model.graph.LayerGraph.from_dict(data)
    with pytest.raises(PlanFormatError, match=r"not JSON"):
        po.model.graph.LayerGraph.from_json(graph.to_json()[:40])


_DEEP = "[" * 200_000 + "]" * 200_000  # json raises RecursionError reading it
_HUGE_NUMBER = '{"schema_version": ' + "9" * 5000 + "}"  # int() refuses more than 4,300 digits: a plain ValueError


@pytest.mark.parametrize("text", [_DEEP, _HUGE_NUMBER], ids=["nested-too-deep", "huge-number"])
def test_json_python_cannot_read_is_malformed_json_in_every_reader(text, tmp_path, monkeypatch, model):
    """Both raised past every reader of plans, graphs, profiles and clusters: a traceback from the CLI."""
    from placement_opt._files import foreign_file
    from placement_opt.errors import ProfileError
    from placement_opt.hardware.cluster import Cluster

    path = tmp_path / "odd.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PlanFormatError, match="is not JSON"):
        Plan.from_json(path)
    with pytest.raises(PlanFormatError, match="not JSON"):
        po.model.graph.LayerGraph.from_json(text)
    with pytest.raises(DeviceSpecError, match="cluster file .* is unreadable"):
        Cluster.from_file(path)
    assert foreign_file(path, "plan") == "a file that is not JSON"
    _one_line_error(run_cli("explain", str(path)), r"is not a placement_opt plan.*not JSON")
    monkeypatch.setenv("PLACEMENT_OPT_PROFILE", str(path))
    with pytest.raises(ProfileError, match="is not JSON"):
        po.solve(model, ["cpu"])


def test_a_plan_file_with_a_byte_order_mark_is_read(solved, tmp_path):
    """Some Windows editors save UTF-8 with a byte order mark: such a plan was "not JSON"."""
    path = tmp_path / "bom.json"
    path.write_text("\ufeff" + solved.to_json(), encoding="utf-8")
    assert Plan.from_json(path).placements == solved.placements


def test_a_plan_of_a_dtype_no_model_has_or_two_dtypes_is_refused(solved):
    """The dtype was never checked: int8 passed as a plan's and failed later, blaming the model's config.json."""
    with pytest.raises(PlanFormatError, match=r"dtype 'int8' is unknown: accepted are float64, float32"):
        Plan.from_dict(_edit(solved, lambda d: d.update(dtype="int8")))
    assert solved.fingerprint is not None
    with pytest.raises(PlanFormatError, match=r"fingerprint.dtype 'float32' is not the plan's dtype 'bfloat16'"):
        Plan.from_dict(_edit(solved, lambda d: d.update(dtype="bfloat16")))


def test_a_size_written_without_a_unit_is_said_to_be_bytes():
    """``cuda:0=24`` is 24 bytes: the plan left the GPU empty and said nothing of it."""
    result = run_cli("plan", "llama-2-7b", "--devices", "cuda:0=24,cpu=64GiB")
    assert result.exit_code == 0, result.output
    assert "cuda:0 has 24 B: a size without a unit is bytes; write the unit, e.g. cuda:0=24GiB" in result.output
    assert "without a unit" not in run_cli("plan", "llama-2-7b", "--devices", "cuda:0=24GiB,cpu=64GiB").output


def test_a_schema_version_of_true_is_not_version_1(solved):
    with pytest.raises(PlanFormatError, match=r"schema version True, which is not supported"):
        Plan.from_dict(_edit(solved, lambda d: d.update(schema_version=True)))


def test_a_machine_edited_after_pricing_is_noted(solved):
    """A machine of 1 GiB less RAM than the plan was priced for was shown as fitting, without a word."""
    def smaller(data):
        cpu = next(d for d in data["machine"]["devices"] if d["name"] == "cpu")
        cpu["memory_bytes"] -= 2**30
    edited = Plan.from_dict(_edit(solved, smaller))
    assert any(n.startswith("machine edited after the plan was priced: its memory and fit were counted for other "
                            "capacities of cpu (7.00 GiB usable, counted against 8.00 GiB)") for n in edited.notes)
    assert not any("machine edited" in n for n in Plan.from_dict(solved.to_dict()).notes)


def test_units_listed_twice_in_a_long_plan_are_found_at_once(solved):
    """The check counted each unit's occurrences in the whole list: 14,400 placements took 6 s to refuse."""
    def many(data):
        first = data["placements"][0]
        data["placements"] = [dict(first, unit=f"u{i % 10_000}") for i in range(20_000)]
    data = _edit(solved, many)
    started = time.perf_counter()
    with pytest.raises(PlanFormatError, match=r"units 'u0', 'u1', 'u10'.* are listed twice"):
        Plan.from_dict(data)
    assert time.perf_counter() - started < 2


def test_explain_of_a_run_file_with_a_malformed_plan_names_the_fault(solved, tmp_path):
    """The run's file is one, its plan is wrong: that was hidden behind "not a plan (no schema_version)"."""
    data = {"measured": {}, "plan": _edit(solved, lambda d: d["placements"][0].update(mode="magic"))}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    _one_line_error(run_cli("explain", str(path)), r"holds what placement-opt run measured.*mode 'magic' is unknown")


def test_a_malformed_profile_is_a_usage_error_of_the_cli(tmp_path):
    """A calibration entry of the wrong kind, or a profile that is not JSON, exited 1 (a failure); other malformed
    profile entries 2 (bad input)."""
    import click

    from placement_opt.cli.output import errors_as_messages
    from placement_opt.errors import ProfileError, ProfileFormatError
    from placement_opt.hardware.profile_store import saved_calibration

    path = tmp_path / "profile.json"
    for text in ("{not json", json.dumps({"schema_version": 1, "created": "x", "measurements": {}, "calibration": 1})):
        path.write_text(text, encoding="utf-8")
        with pytest.raises(ProfileFormatError) as err:
            saved_calibration(path)
        assert isinstance(err.value, ProfileError)  # what callers caught before
        with pytest.raises(click.UsageError), errors_as_messages():
            raise err.value


def _one_line_error(result, words: str) -> None:
    assert result.exit_code != 0, result.output
    text = result.stderr if hasattr(result, "stderr") else result.output
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    assert re.search(words, lines[0]), lines[0]


@pytest.mark.parametrize("cut", ['{"schema_version": 0.', '{"schema_version": 1', '{"a": tru', '{"a": "x'])
def test_a_plan_cut_inside_a_number_or_literal_says_it_was_cut_off(cut):
    with pytest.raises(PlanFormatError, match="cut off"):
        Plan.from_json(cut)


def test_a_plan_with_a_bad_token_inside_is_not_called_cut_off():
    with pytest.raises(PlanFormatError) as err:
        Plan.from_json('{"a": 1, "b": x}')
    assert "cut off" not in str(err.value)


# -- files and arguments of the wrong kind ------------------------------------------------------
@pytest.mark.parametrize("given", [5, None, b"{}"])
def test_a_plan_read_from_what_is_neither_text_nor_a_path_is_a_plan_format_error(given):
    with pytest.raises(PlanFormatError, match="read from JSON text or a file path, not a"):
        Plan.from_json(given)


def test_binary_files_given_as_a_plan_or_a_profile_are_named_for_what_they_are(tmp_path, monkeypatch, model):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00\x01garbage")
    with pytest.raises(PlanFormatError, match=r"is not text \(not UTF-8\)"):
        Plan.from_json(binary)
    monkeypatch.setenv("PLACEMENT_OPT_PROFILE", str(binary))
    from placement_opt.errors import ProfileError

    with pytest.raises(ProfileError, match="is not JSON"):
        po.solve(model, ["cpu"])


def test_a_profile_path_that_cannot_be_written_is_refused_before_measuring(tmp_path, monkeypatch, model):
    """A directory, or a file of the user's, at path= used to be found after minutes of measuring."""
    from placement_opt.errors import ProfileError
    from placement_opt.hardware import profiler

    monkeypatch.setattr(profiler, "_measure", lambda *a, **k: pytest.fail("measured before checking the path"))
    with pytest.raises(ProfileError, match="is a directory: name a file in it"):
        po.profile(["cpu"], quick=True, path=tmp_path)
    mine = tmp_path / "config.json"
    mine.write_text('{"model_type": "llama"}')
    with pytest.raises(PlanFormatError, match="never over another file"):
        po.profile("cpu", quick=True, path=mine)  # one name alone is one device
    with pytest.raises(ProfileError, match="is a directory"):
        po.calibrate(model, ["cpu"], path=tmp_path)
    assert mine.read_text() == '{"model_type": "llama"}'


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_a_profile_path_in_a_folder_that_cannot_be_written_is_refused_before_measuring(monkeypatch, model):
    """A profile or calibration saved under a folder no file can be made in ended, after the measuring, in a raw
    FileNotFoundError naming a temporary file."""
    from placement_opt.errors import ProfileError
    from placement_opt.hardware import profiler

    monkeypatch.setattr(profiler, "_measure", lambda *a, **k: pytest.fail("measured before checking the path"))
    for measure in (lambda: po.profile(["cpu"], quick=True, path="/proc/placement_opt.json"),
                    lambda: po.calibrate(model, ["cpu"], path="/proc/placement_opt.json")):
        with pytest.raises(ProfileError, match="cannot be saved to '/proc/placement_opt.json'.*a directory you can"):
            measure()


def test_a_profile_a_newer_placement_opt_wrote_is_never_written_over(tmp_path, monkeypatch, model):
    """A profile of a newer schema version read as no profile, and profile()/calibrate() replaced it with this
    version's figures alone: its calibrations and whatever else the newer version kept were gone."""
    from placement_opt.errors import ProfileError
    from placement_opt.hardware import profiler

    monkeypatch.setattr(profiler, "_measure", lambda *a, **k: pytest.fail("measured before checking the path"))
    newer = tmp_path / "profile.json"
    text = '{"schema_version": 2, "created": "2027-01-01", "measurements": {}, "calibration": {"units": {}}}'
    newer.write_text(text)
    for measure in (lambda: po.profile(["cpu"], quick=True, path=newer),
                    lambda: po.calibrate(model, ["cpu"], path=newer)):
        with pytest.raises(ProfileError, match="schema version 2, written by a newer placement_opt.*upgrade"):
            measure()
    assert newer.read_text() == text


def test_one_device_name_and_one_dtype_name_are_taken_whole():
    """profile('cpu') measured the devices 'c', 'p' and 'u'; dtypes='float32' the dtypes 'f', 'l', ..."""
    from placement_opt.hardware.profiler import _dtypes_to_measure

    assert _dtypes_to_measure("float32", ("bfloat16",)) == ("float32", "bfloat16")
    with pytest.raises(DeviceSpecError, match="unknown device name 'gpu0'|cannot"):
        po.profile("gpu0", quick=True)


def test_a_workload_given_as_a_dict_and_pins_keyed_by_numbers_are_refused_by_name(model, solved):
    with pytest.raises(WorkloadError, match="workload must be a placement_opt.Workload, got dict"):
        po.evaluate(solved, model, {"cpu": "8GiB", "disk": "100GiB"}, workload={"batch_size": 2})
    with pytest.raises(WorkloadError, match="workload is a dict: pass a placement_opt.Workload"):
        po.calibrate(model, ["cpu"], workload={"batch_size": 2})
    from placement_opt.errors import SolverInputError

    with pytest.raises(SolverInputError, match=r"pins are keyed by module names .* not 5 \(int\)"):
        po.solve(model, {"cpu": "8GiB"}, pins={5: "cpu"})


@pytest.mark.parametrize("devices", [["cpu"], {"cpu": "1GiB"}, None, "cpu"])
def test_a_machine_built_from_what_is_not_devices_says_what_builds_one(devices):
    with pytest.raises(DeviceSpecError, match="Machine takes Device objects"):
        po.Machine(devices)


@pytest.mark.parametrize(("options", "words"), [
    ({"flops": "x"}, "speeds are numbers > 0"), ({"bandwidth": True}, "speeds are numbers > 0"),
    ({"flops_by_tokens": [(1,)]}, r"give \(tokens, FLOP/s\) pairs"), ({"flops_by_tokens": 5}, r"give \(tokens, FLOP/s\)"),
])
def test_a_device_with_speeds_that_are_not_numbers_is_refused(options, words):
    with pytest.raises(DeviceSpecError, match=words):
        po.Device("cpu", "1GiB", **options)


def test_trace_refuses_counts_and_class_lists_of_the_wrong_type_and_takes_one_class_name(model):
    with pytest.raises(TraceError, match="must both be ints >= 1"):
        po.trace(model, batch_size="2")
    with pytest.raises(TraceError, match="give module class names to keep whole"):
        po.trace(model, no_split=5)
    one = po.trace(model, no_split="LlamaDecoderLayer")  # one name, not its letters
    assert one.names() == po.trace(model, no_split=["LlamaDecoderLayer"]).names()


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_a_time_limit_of_zero_is_a_usage_error_for_every_command(command):
    """compare --time-limit 0 exited 0 with every solver row 'not run'."""
    result = run_cli(command, "llama-3-8b", "--devices", "cpu=64GiB", "--time-limit", "0", catch_exceptions=True)
    assert result.exit_code == 2 and "'--time-limit': 0.0 is not in the range x>0" in result.output


def test_evaluate_refuses_a_plan_solved_for_another_model_as_dispatch_does(model, solved):
    """A plan priced on the graph of a wider model of the same unit names gave that model's figures under the
    plan's name; dispatch() refused the same pair."""
    import transformers as T

    from placement_opt.errors import PlanMismatchError

    wider = T.LlamaForCausalLM(T.LlamaConfig(**{**model.config.to_dict(), "intermediate_size": 4 * model.config.intermediate_size}))
    assert po.evaluate(solved, model, {"cpu": "8GiB", "disk": "100GiB"}).total_s > 0
    with pytest.raises(PlanMismatchError, match=r"was solved for another model than this graph's .* unit\(s\) differ "
                                                r"\(model.layers.0: .* of weights in the plan, .* in the model"):
        po.evaluate(solved, wider, {"cpu": "8GiB", "disk": "100GiB"})


@pytest.mark.parametrize("limit", [True, float("inf"), float("nan"), "1s", 10**400, 0, -1])
def test_a_time_limit_that_is_no_finite_number_of_seconds_is_refused(limit):
    """``time_limit_s=True`` ran as a 1 s limit, and infinity with ``gap_limit=0`` could search for ever; an int too
    large for a float raised a bare OverflowError."""
    from placement_opt.errors import SolverInputError

    graph = chain_graph([{"name": "a", "param_bytes": 8}, {"name": "b", "param_bytes": 8}])
    with pytest.raises(SolverInputError, match="time_limit_s must be a positive, finite number of seconds"):
        po.solve(graph, {"cpu": "1GiB"}, time_limit_s=limit)


def test_a_mode_named_twice_is_one_mode():
    """``modes=('resident', 'stream', 'stream')`` reached the problem builder as given: every unit's streamed options
    twice over, for the search to tell apart."""
    from placement_opt._solve_inputs import check_modes

    assert check_modes(("resident", "stream", "stream", "resident")) == ("resident", "stream")
    assert check_modes("resident") == ("resident",)



#: Values a hand-edited or damaged profile may hold where to_dict() wrote a number, a name or a list.
_NASTY = (float("inf"), float("-inf"), float("nan"), -1, 0, 2**70, "12 GB", "", None, True, [[1]], [1, 2, 3], {"a": 1})


def _outcome(data):
    """The machine read back, or the DeviceSpecError saying why not (anything else escapes and fails the test)."""
    try:
        return po.Machine.from_dict(data)
    except DeviceSpecError as exc:
        assert str(exc)
        return exc


def test_a_machine_dict_with_fields_missing_or_of_another_kind_is_one_device_spec_error():
    """Machine.from_dict and Device.from_dict are public (a saved profile's machine, a plan's): a dict lacking a field
    raised a bare KeyError, a size that is no number a ValueError, an infinite one an OverflowError. Every field of
    what to_dict() wrote, dropped or replaced by each of the values above, now reads back or is refused with
    DeviceSpecError; so is the machine's own devices or links replaced."""
    written = po.Machine([po.Device("cpu", "8GiB"), po.Device("cuda:0", "24GiB", flops=1e14)],
                         {("cpu", "cuda:0"): 2e10}).to_dict()
    assert _outcome(written) == po.Machine.from_dict(written)
    for index in range(2):
        for key in written["devices"][index]:
            for value in (*_NASTY, KeyError):  # KeyError: the field left out
                damaged = copy.deepcopy(written)
                if value is KeyError:
                    del damaged["devices"][index][key]
                else:
                    damaged["devices"][index][key] = value
                _outcome(damaged)
    for key in ("devices", "links"):
        for value in _NASTY:
            _outcome({**copy.deepcopy(written), key: value})
    for data in ({}, [], "machine", None):
        assert isinstance(_outcome(data), DeviceSpecError)


def test_a_config_with_a_negative_size_is_the_callers_input_and_says_which():
    """A hand-edited config.json with hidden_size -64 was a TraceError (exit 1) advising to build the model by hand;
    it is the caller's input: ModelSpecError (exit 2), naming the field."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    config.hidden_size = -64
    with pytest.raises(ModelSpecError, match=r"negative sizes \(hidden_size=-64\).*fix them in its config.json"):
        po.trace(config)


def test_a_config_transformers_refuses_is_one_line_with_its_cause(tmp_path):
    """transformers 5 validates configs with huggingface_hub's errors (not ValueError): a config.json path ended
    in a traceback, and a folder's message stopped at 'Class validation error for validator ...:'."""
    from _cli import run_cli

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                      "num_attention_heads": 3, "num_hidden_layers": 2}))
    for given in (tmp_path / "config.json", tmp_path):
        out = run_cli("plan", str(given), "-d", "cpu=1GiB,disk", "--no-cache")
        assert out.exit_code == 2 and "not a multiple of the number of attention heads (3)" in out.output, out.output
