"""Calibrated unit times in pricing: they replace the roofline, scale as measured, interpolate sanely."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.cost.calibrated import UnitTimes, calibration_for, line_through, shape_key
from placement_opt.cost.pricing import PricingContext, price_option
from placement_opt.cost.workload import Workload
from placement_opt.errors import ProfileError
from placement_opt.hardware.devices import Device, Machine
from placement_opt.model.graph import chain_graph

WORKLOAD = Workload(batch_size=2, prompt_len=64, new_tokens=16)


def graph():
    return chain_graph([{"name": "embed", "param_bytes": 2**20},
                        {"name": "layer", "param_bytes": 2**24, "flops_per_token": 2**25,
                         "attn_flops_per_token_per_ctx": 2**10, "kv_bytes_per_token": 2**9,
                         "out_bytes_per_token": 2**12}], dtype="float32")


def machine(source: str = "measured 2026-11-22") -> Machine:
    return Machine([Device("cpu", "16GiB", flops=1e11, bandwidth=1e10, source=source), Device("disk", "1TB")])


def saved(seconds: float, *, attention: bool = True) -> dict:
    g = graph()
    key = shape_key(g.unit("layer"), "float32", g.meta.seq_len)
    return {"host": "here", "units": {key: {"attention": attention, "devices": {"cpu": {
        "prefill": [[2, 64, seconds, "last"], [2, 16, seconds / 4, "last"]],
        "decode": [[2, 65, seconds / 100, ], [2, 80, seconds / 50]]}}}}}


def price(calibration, unit: str = "layer", mode: tuple[str, str, str] = ("cpu", "cpu", "resident")):
    g = graph()
    ctx = PricingContext(g, machine(), WORKLOAD, calibration)
    return price_option(ctx, g.unit(unit), *mode)


def test_a_unit_calibrated_ten_times_slower_is_priced_ten_times_slower() -> None:
    g, m = graph(), machine()
    fast, slow = price(calibration_for(g, m, saved(0.01))), price(calibration_for(g, m, saved(0.1)))
    assert fast.prefill_s == pytest.approx(0.01)  # the measured figure itself, no overhead added
    assert slow.prefill_s == pytest.approx(10 * fast.prefill_s)
    assert slow.decode_s == pytest.approx(10 * fast.decode_s)
    # decode: the line through the two contexts, summed over the 16 steps (context 65 .. 80)
    assert fast.decode_s == pytest.approx(sum(1e-4 + (1e-4 / 15) * t for t in range(16)))


def test_units_without_a_figure_and_other_devices_keep_the_roofline() -> None:
    g, m = graph(), machine()
    calibration = calibration_for(g, m, saved(0.01))
    assert price(calibration, "embed").prefill_s == price(None, "embed").prefill_s
    assert calibration_for(g, machine(source="datasheet:cpu-desktop"), saved(0.01)) is None
    training = PricingContext(g, m, Workload(training=True), calibration)
    assert price_option(training, g.unit("layer"), "cpu", "cpu", "resident").prefill_s != pytest.approx(0.01)


def test_a_disk_unit_adds_its_read_to_the_calibrated_compute() -> None:
    g, m = graph(), machine()
    calibration = calibration_for(g, m, saved(0.01))
    streamed = price(calibration, mode=("disk", "cpu", "stream"))
    read = g.unit("layer").weight_bytes / m.bandwidth("disk", "cpu") + m.latency_s("disk", "cpu")
    assert streamed.prefill_s == pytest.approx(0.01 + read)


def test_a_malformed_saved_figure_is_a_profile_error() -> None:
    bad = saved(0.01)
    entry = next(iter(bad["units"].values()))
    entry["devices"]["cpu"]["decode"] = [[2, 65, -1.0]]
    with pytest.raises(ProfileError, match="malformed unit time.*profile --model"):
        calibration_for(graph(), machine(), bad)


def _with_read(stream: object) -> dict:
    """``saved(0.01)`` whose layer also has a cold read from disk, saved as ``stream``."""
    found = saved(0.01)
    next(iter(found["units"].values()))["links"] = {"disk->cpu": {"stream": stream}}
    return found


def test_a_cold_read_keeps_the_batch_it_was_timed_at_and_an_older_one_has_none() -> None:
    disk_measured = Machine([Device("cpu", "16GiB", flops=1e11, bandwidth=1e10, source="measured 2026-11-30"),
                             Device("disk", "1TB", bandwidth=2e9, source="measured 2026-11-30")])
    g = graph()
    calibration = calibration_for(g, disk_measured, _with_read({"prefill": 0.02, "decode": 0.01, "decode_batch": 4}))
    assert calibration.read_batch == {"layer": 4}
    assert calibration.copy_s("layer", "disk", "cpu", "stream") == pytest.approx(0.01)
    older = calibration_for(g, disk_measured, _with_read({"prefill": 0.02, "decode": 0.01}))
    assert older.read_batch == {} and older.copy_s("layer", "disk", "cpu", "stream") == pytest.approx(0.01)
    # a disk the profile did not measure: neither the read nor its batch applies
    assert calibration_for(g, machine(), _with_read({"prefill": 0.02, "decode": 0.01, "decode_batch": 4})
                           ).read_batch == {}


@pytest.mark.parametrize("batch", [0, -1, 2.5, "4", True, None])
def test_a_malformed_cold_read_batch_is_a_profile_error(batch) -> None:
    disk_measured = Machine([Device("cpu", "16GiB", flops=1e11, bandwidth=1e10, source="measured 2026-11-30"),
                             Device("disk", "1TB", bandwidth=2e9, source="measured 2026-11-30")])
    with pytest.raises(ProfileError, match="decode_batch=.*whole number >= 1.*profile --model"):
        calibration_for(graph(), disk_measured, _with_read({"prefill": 0.02, "decode": 0.01, "decode_batch": batch}))


tokens = st.integers(min_value=1, max_value=4096)


@given(st.lists(st.tuples(tokens, st.floats(min_value=1e-6, max_value=10.0)), min_size=1, max_size=5,
                unique_by=lambda p: p[0]), tokens)
def test_prefill_interpolation_meets_the_points_and_grows_with_tokens(points, query) -> None:
    points = sorted(points)
    ys = [y for _, y in points]
    increasing = all(a <= b for a, b in zip(ys, ys[1:], strict=False))
    times = UnitTimes(prefill=tuple((1, t, y, "last") for t, y in points))
    for t, y in points:
        assert times.prefill_s(1, t, "last") == pytest.approx(y)
    assert times.prefill_s(1, query, "last") >= 0
    if increasing:  # more tokens never cost less when the measurements say so
        assert times.prefill_s(1, query, "last") <= times.prefill_s(1, query + 1, "last") + 1e-12
    assert times.prefill_s(1, query, "all") is None  # measured for generation only


@given(st.lists(st.tuples(st.integers(1, 10_000), st.floats(0.0, 1.0)), min_size=1, max_size=6))
def test_the_context_line_never_slopes_down(points) -> None:
    intercept, slope = line_through(points, sloped=True)
    assert slope >= 0
    flat_intercept, flat_slope = line_through(points, sloped=False)
    assert flat_slope == 0 and flat_intercept == pytest.approx(sum(y for _, y in points) / len(points))


def test_a_padded_workload_adds_its_masks_pairs_to_the_calibrated_prefill() -> None:
    """calibrate() times equal prompts, which sdpa runs with its causal flag; a padded batch hands it a mask and it
    computes every pair (on this project's CPU a padded 1 x 4096 forward took 1.49x an equal one): the calibrated
    prefill kept the equal prompts' time. The pairs the mask adds, 64^2 - 64 x 65 / 2 a sequence, at the CPU's rate."""
    g, m = graph(), machine()
    calibration = calibration_for(g, m, saved(0.01))
    padded = PricingContext(g, m, Workload(batch_size=2, prompt_len=64, new_tokens=16, padded=True),
                            calibration)
    equal = price(calibration)
    masked = price_option(padded, g.unit("layer"), "cpu", "cpu", "resident")
    assert equal.prefill_s == pytest.approx(0.01)
    assert masked.prefill_s == pytest.approx(0.01 + 2 * 2**10 * (64 * 64 - 64 * 65 / 2) / 1e11)
    assert masked.decode_s == pytest.approx(equal.decode_s)
