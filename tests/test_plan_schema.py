"""The plan's JSON schema: round trips, random corruptions, and the fingerprint against real models."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import placement_opt as po
from _models import FAMILIES, inputs_for, make_plan, tiny
from _plans import report_plan
from placement_opt.errors import PlanFormatError
from placement_opt.plan import PLAN_SCHEMA_VERSION, BaselineResult, Plan
from placement_opt.plan_check import check_plan, graph_fingerprint
from placement_opt.schema import plan_json_schema

_ROWS = [("cpu", "cpu", "resident"), ("disk", "cpu", "stream"), ("disk", "cpu", "stream_sync")]

names = st.text(alphabet="abcdefghij.0123456789_", min_size=1, max_size=12)
times = st.one_of(st.floats(min_value=0, max_value=1e6), st.just(float("inf")))


@st.composite
def plans(draw) -> Plan:
    units = draw(st.lists(names, min_size=1, max_size=8, unique=True))
    rows = [(u, *draw(st.sampled_from(_ROWS))) for u in units]
    base = make_plan(rows, name=draw(names))
    groups = draw(st.lists(st.one_of(st.none(), names), min_size=len(units), max_size=len(units)))
    base = dataclasses.replace(base, placements=tuple(dataclasses.replace(p, copy_group=g)
                                                      for p, g in zip(base.placements, groups, strict=True)))
    baselines = tuple(BaselineResult(strategy=draw(names), total_s=draw(times), fits=draw(st.booleans()),
                                     short_bytes=draw(st.integers(0, 2**40)), note=draw(st.text(max_size=20)))
                      for _ in range(draw(st.integers(0, 3))))
    return Plan(**{**vars(base), "baselines": baselines, "notes": tuple(draw(st.lists(st.text(max_size=10))))})


@given(plans())
def test_every_plan_survives_a_json_round_trip_as_standard_json(plan):
    text = plan.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard constant {c}"))
    again = Plan.from_json(text)
    assert again.to_dict() == plan.to_dict()
    assert again.baselines == plan.baselines  # inf included


_VALID = make_plan([("a", "cpu", "cpu", "resident"), ("b", "disk", "cpu", "stream")]).to_dict()


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


_ALL_PATHS = [p for p in _paths(_VALID) if p]
junk = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                 st.text(max_size=8), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3),
                                                                                            st.integers(), max_size=2))


def _set(data, path, value):
    for key in path[:-1]:
        data = data[key]
    if value is _DELETE:
        if isinstance(data, list):
            data.pop(path[-1])
        else:
            del data[path[-1]]
    else:
        data[path[-1]] = value


_DELETE = object()


@given(st.lists(st.tuples(st.sampled_from(_ALL_PATHS), st.one_of(junk, st.just(_DELETE))), min_size=1, max_size=3))
def test_a_corrupted_plan_is_read_or_refused_with_plan_format_error(edits):
    data = json.loads(json.dumps(_VALID))
    for path, value in edits:
        try:
            _set(data, path, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced the parent
    try:
        Plan.from_dict(data)
    except PlanFormatError as err:
        assert "\n" not in str(err) and str(err)


@given(st.integers(0, len(json.dumps(_VALID)) - 1))
def test_truncated_plan_text_is_always_a_plan_format_error(cut):
    text = json.dumps(_VALID)[:cut]
    with pytest.raises(PlanFormatError):
        Plan.from_json(text)


def test_the_json_schema_is_exported_and_names_the_fields():
    schema = plan_json_schema()
    assert {"placements", "machine", "fingerprint", "schema_version"} <= set(schema["properties"])
    assert PLAN_SCHEMA_VERSION == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_a_solved_plan_matches_its_own_model(family):
    model = tiny(family)
    plan = po.solve(model, {"cpu": "8GiB", "disk": "100GiB"}, time_limit_s=2, workers=1)
    assert plan.fingerprint is not None
    assert plan.fingerprint == graph_fingerprint(po.trace(model))
    check_plan(model, Plan.from_json(plan.to_json()))  # no difference reported
    handle = po.dispatch(model, plan)
    handle(**inputs_for(model))
    handle.remove()


def test_the_fingerprint_catches_a_renamed_parameter():
    model = tiny("llama")
    plan = po.solve(model, {"cpu": "8GiB"}, time_limit_s=2, workers=1)
    layer = model.model.layers[0].mlp
    layer.register_parameter("renamed", layer.up_proj.weight)
    del layer.up_proj.weight
    with pytest.raises(po.errors.DispatchError, match=r"model.layers.0: .*parameters in the plan"):
        check_plan(model, plan)


def test_a_sublayer_plan_names_each_parts_layer_as_its_copy_group():
    model = tiny("llama")
    plan = po.solve(po.trace(model, granularity="sublayer"), {"cpu": "8GiB"}, time_limit_s=2, workers=1)
    groups = {p.unit: p.copy_group for p in plan.placements}
    assert groups["model.layers.1.mlp"] == groups["model.layers.1.input_layernorm"] == "model.layers.1"
    assert groups["model.embed_tokens"] is None and groups["lm_head"] is None
    assert Plan.from_json(plan.to_json()).placements == plan.placements
    data = plan.to_dict()
    data["placements"][3]["copy_group"] = ""
    with pytest.raises(PlanFormatError, match="copy_group"):
        Plan.from_dict(data)


@pytest.mark.parametrize("data", [{"measurements": {}}, {"model": "x", "devices": "cpu"}, {}])
def test_a_json_object_that_is_no_plan_says_so(data):
    """A profile or any other object read as a plan said 'schema version None ... solve the plan again'."""
    with pytest.raises(PlanFormatError, match=r"is not a plan \(no schema_version, no placements\)"):
        Plan.from_dict(data)
    other = {"schema_version": 0, "placements": []}
    with pytest.raises(PlanFormatError, match="schema version 0, which is not supported"):
        Plan.from_dict(other)


_PRICED = json.loads(report_plan(over_bytes=2**20).to_json())  # per-unit costs, memory rows and a violation
_PRICED_PATHS = [p for p in _paths(_PRICED) if p and p[0] in ("cost", "baselines", "objective_value", "best_bound",
                                                              "gap", "solve_time_s")]
numbers = st.one_of(st.sampled_from(["NaN", "Infinity", "-Infinity", "12", "x"]), st.floats(), st.integers(-10**15, -1))


@given(st.lists(st.tuples(st.sampled_from(_PRICED_PATHS), st.one_of(numbers, junk)), min_size=1, max_size=3))
def test_a_priced_plan_with_corrupted_figures_is_refused_or_shown(edits):
    """The figures summary() and explain() add up (per-unit times, memory rows) went unchecked: a hand edit to
    "NaN" read fine and then failed in summary() with a TypeError, a negative size showed as -931 GiB used."""
    data = json.loads(json.dumps(_PRICED))
    for path, value in edits:
        try:
            _set(data, path, value)
        except (KeyError, IndexError, TypeError):
            continue
    try:
        plan = Plan.from_dict(data)
    except PlanFormatError as err:
        assert "\n" not in str(err) and str(err)
        return
    plan.summary(), plan.explain()


@pytest.mark.parametrize(("path", "value", "said"), [
    (("cost", "memory", 0, "weights_bytes"), -10**12, r"cost.memory\[0\].weights_bytes: .* 0, not -1000000000000"),
    (("cost", "memory", 0, "kv_cache_bytes"), "NaN", r"cost.memory\[0\].kv_cache_bytes: .*, not 'NaN'"),
    (("cost", "units", 2, "decode_s"), float("nan"), r"cost.units\[2\].decode_s: .*, not nan"),
    (("cost", "units", 0, "stored_bytes"), -5, r"cost.units\[0\].stored_bytes: .*, not -5"),
    (("gap",), float("nan"), r"gap: .*finite.*, not nan"),
    (("solve_time_s",), -3, r"solve_time_s: .*, not -3"),
    (("objective_value",), "NaN", r"objective_value: .*, not 'NaN'"),
])
def test_a_negative_or_nan_figure_is_refused_naming_the_field_and_the_value(path, value, said):
    data = json.loads(json.dumps(_PRICED))
    _set(data, path, value)
    with pytest.raises(PlanFormatError, match=said):
        Plan.from_dict(data)


@pytest.mark.parametrize(("field", "word"), [("status", "FOO"), ("objective", "speed"), ("strategy", "magic")])
def test_an_unknown_status_objective_or_strategy_is_refused_naming_the_accepted_words(field, word):
    """They were read as written and shown by summary() and explain() as if a solver had said them."""
    data = json.loads(json.dumps(_PRICED))
    data[field] = word
    with pytest.raises(PlanFormatError, match=rf"{field}: {field} '{word}' is unknown: accepted are "):
        Plan.from_dict(data)


def test_figures_written_as_strings_read_back_as_numbers():
    """json_safe writes an infinite time as "Infinity": the plan built from the checked cost has a float there."""
    data = json.loads(json.dumps(_PRICED))
    data["cost"]["units"][1]["prefill_s"] = "Infinity"
    assert Plan.from_dict(data).cost.units[1].prefill_s == float("inf")


def test_a_non_phased_placement_naming_its_own_execution_for_the_prefill_is_read_without_it():
    """The schema lets a resident or streamed unit name its execution as prefill_execution (the same device); read
    as it was, the unit showed as "phased (prefill on ...)" and counted as streaming its weights."""
    data = json.loads(json.dumps(_PRICED))
    placement = next(p for p in data["placements"] if p["mode"] == "resident")
    placement["prefill_execution"] = placement["execution"]
    plan = Plan.from_dict(data)
    read = next(p for p in plan.placements if p.unit == placement["unit"])
    assert read.prefill_execution is None and "phased" not in plan.summary()
    assert plan.streams_weights == Plan.from_dict(json.loads(json.dumps(_PRICED))).streams_weights
