"""The calibration's place in the profile file: merged, keyed by host, old files loading, corrupt ones refused."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement_opt.errors import ProfileError
from placement_opt.hardware.profile_store import (
    load_profile,
    save_calibration,
    saved_calibration,
    saved_device,
    this_host,
)

OLD_PROFILE = {"schema_version": 1, "created": "2026-11-01T00:00:00+00:00", "host": "box", "quick": True,
               "dtype": "float32", "measurements": {"cpu": {
                   "memory_bytes": 2**34, "threads": 2, "matmul_flops_per_s": {"float32": 1e11},
                   "matvec_bytes_per_s": {"float32": 1e10}, "copy_bytes_per_s": 1e10,
                   "linear_flops_by_tokens": {"float32": [[1, 1e10], [64, 1e11]]}}}}


def unit(seconds: float) -> dict:
    return {"module_class": "Layer", "devices": {"cpu": {"prefill": [[1, 8, seconds, "last"]], "decode": []}}}


def model(name: str) -> dict:
    return {"fingerprint": name, "name": name, "created": "2026-11-22T00:00:00+00:00"}


def test_an_old_profile_without_calibration_still_loads(tmp_path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(OLD_PROFILE))
    assert saved_device("cpu", dtype="float32", path=path).flops_per_s == 1e11
    assert saved_calibration(path) is None


def test_calibrations_merge_into_the_profile_and_keep_its_measurements(tmp_path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(OLD_PROFILE))
    save_calibration({"a": unit(1.0), "b": unit(2.0)}, model("m1"), path=path)
    save_calibration({"b": unit(3.0)}, model("m2"), path=path)
    saved = saved_calibration(path)
    assert saved["host"] == this_host()
    assert saved["units"]["a"]["devices"]["cpu"]["prefill"][0][2] == 1.0
    assert saved["units"]["b"]["devices"]["cpu"]["prefill"][0][2] == 3.0  # measured again: replaced
    assert set(saved["models"]) == {"m1", "m2"}
    assert saved_device("cpu", dtype="float32", path=path) is not None
    assert load_profile(path)["measurements"] == OLD_PROFILE["measurements"]


def test_a_calibration_of_another_host_is_dropped_when_this_one_saves(tmp_path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**OLD_PROFILE, "calibration": {"host": "elsewhere", "units": {"a": unit(1.0)},
                                                                "models": {}}}))
    assert saved_calibration(path) is None
    save_calibration({"b": unit(2.0)}, model("m"), path=path)
    assert set(saved_calibration(path)["units"]) == {"b"}


def test_a_calibration_alone_makes_a_profile(tmp_path) -> None:
    path = tmp_path / "new" / "profile.json"
    save_calibration({"a": unit(1.0)}, model("m"), path=path)
    assert set(saved_calibration(path)["units"]) == {"a"}


@pytest.mark.parametrize("text", ["{not json", '{"schema_version": 1, "created": "x", "measurements": {}, '
                                                '"calibration": []}'])
def test_a_corrupt_profile_is_a_profile_error_that_says_what_to_do(tmp_path, text) -> None:
    path = tmp_path / "profile.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match=r"profile.json.*(placement-opt profile|delete)"):
        saved_calibration(path)


def _points(prefill: list, decode: list) -> dict:
    return {"module_class": "Layer", "devices": {"cpu": {"prefill": prefill, "decode": decode}}}


def test_a_second_workload_adds_its_points_and_a_shape_measured_again_replaces_its_own(tmp_path) -> None:
    """The lent H200's memory step calibrated six workloads in turn, and the profile kept the last one's batch-16
    points alone: a batch-1 decode then read a CPU layer at 45 ms against the 6.6 ms its own calibration had
    measured. Each workload's points now stay beside the others'."""
    path = tmp_path / "profile.json"
    save_calibration({"a": _points([[1, 512, 0.1, "last"]], [[1, 520, 0.006]])}, model("m"), path=path)
    save_calibration({"a": _points([[16, 4096, 2.0, "last"]], [[16, 4100, 0.045]])}, model("m"), path=path)
    save_calibration({"a": _points([[1, 512, 0.2, "last"]], [])}, model("m"), path=path)  # measured again
    cpu = saved_calibration(path)["units"]["a"]["devices"]["cpu"]
    assert cpu["prefill"] == [[1, 512, 0.2, "last"], [16, 4096, 2.0, "last"]]
    assert cpu["decode"] == [[1, 520, 0.006], [16, 4100, 0.045]]


def test_a_second_workload_prices_each_batch_from_its_own_points(tmp_path) -> None:
    from placement_opt.cost.calibrated import _unit_times

    path = tmp_path / "profile.json"
    save_calibration({"a": _points([], [[1, 520, 0.006]])}, model("m"), path=path)
    save_calibration({"a": _points([], [[16, 4100, 0.045]])}, model("m"), path=path)
    times = _unit_times(saved_calibration(path)["units"]["a"]["devices"]["cpu"], attention=False)
    assert times.decode_line(1, 520)[0] == pytest.approx(0.006)
    assert times.decode_line(16, 4100)[0] == pytest.approx(0.045)


def test_malformed_old_points_are_dropped_when_new_ones_are_saved(tmp_path) -> None:
    path = tmp_path / "profile.json"
    save_calibration({"a": _points([[1, 8, 1.0, "last"]], [[1, 9, 0.1]])}, model("m"), path=path)
    data = json.loads(path.read_text())
    data["calibration"]["units"]["a"]["devices"]["cpu"]["decode"] = [[1, 9], "x"]
    path.write_text(json.dumps(data))
    save_calibration({"a": _points([[2, 8, 1.5, "last"]], [[2, 9, 0.2]])}, model("m"), path=path)
    cpu = saved_calibration(path)["units"]["a"]["devices"]["cpu"]
    assert cpu["decode"] == [[2, 9, 0.2]] and len(cpu["prefill"]) == 2


_SHAPES = st.tuples(st.sampled_from([1, 4, 16]), st.sampled_from([8, 512, 4096]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(_SHAPES, st.floats(0.001, 1.0)), min_size=1, max_size=4), min_size=1, max_size=5))
def test_saved_points_are_the_last_measured_figure_of_every_shape_ever_measured(runs) -> None:
    """Any sequence of calibrations: each (batch, prompt) and (batch, context) shape ever measured is saved once,
    with the figure of the last calibration that measured it."""
    import tempfile
    from pathlib import Path

    last: dict[tuple[int, int], float] = {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "profile.json"
        for run in runs:
            fresh = dict(run)  # a calibration measures a shape once
            save_calibration({"a": _points([[b, p, s, "last"] for (b, p), s in fresh.items()],
                                           [[b, p, s] for (b, p), s in fresh.items()])}, model("m"), path=path)
            last.update(fresh)
        cpu = saved_calibration(path)["units"]["a"]["devices"]["cpu"]
    assert {(b, p): s for b, p, s, _ in cpu["prefill"]} == last and len(cpu["prefill"]) == len(last)
    assert {(b, c): s for b, c, s in cpu["decode"]} == last and len(cpu["decode"]) == len(last)
