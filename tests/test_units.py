"""Sizes and durations: parsing what users type, printing what people read."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from placement_opt.errors import DeviceSpecError
from placement_opt.hardware.devices import Device
from placement_opt.units import GIB, MIB, format_bytes, format_seconds, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * GIB),
        ("500MB", 500 * 10**6),  # accelerate's convention: MB is decimal
        ("1.5 GB", 1_500_000_000),
        ("512mib", 512 * MIB),
        ("1024", 1024),
        (2048, 2048),
        ("0", 0),
    ],
)
def test_parse_size_accepts_units(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["12QB", "GiB", "-3GiB", "", "1.2.3GB", True, None, [1]])
def test_parse_size_rejects_with_the_value_and_the_units(bad: object) -> None:
    with pytest.raises(DeviceSpecError) as info:  # a ValueError too
        parse_size(bad, what="max_memory['cpu']")  # type: ignore[arg-type]
    message = str(info.value)
    assert "max_memory['cpu']" in message
    assert repr(bad) in message


@given(st.integers(min_value=0, max_value=2**50))
def test_parse_size_round_trips_integers(n: int) -> None:
    assert parse_size(n) == n
    assert parse_size(str(n)) == n


def test_format_bytes_reads_well() -> None:
    assert format_bytes(1_712_324_608) == "1.59 GiB"
    assert format_bytes(-int(0.69 * GIB)) == "-706.56 MiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * MIB) == "3.00 MiB"


def test_format_seconds_picks_the_unit() -> None:
    assert format_seconds(0.000812) == "812 us"
    assert format_seconds(0.00341) == "3.41 ms"
    assert format_seconds(2.5) == "2.50 s"
    assert format_seconds(150) == "2.50 min"


def test_a_ratio_too_small_for_two_decimals_keeps_a_digit():
    from placement_opt.units import ratio_or_dash

    assert ratio_or_dash(0.004, 1.0) == "0.004x" and ratio_or_dash(1.0, 3.0) == "0.33x" and ratio_or_dash(0, 1) == "0.00x"


def test_parse_size_keeps_integers_exact_and_refuses_absurd_ones_in_its_own_words() -> None:
    """An int past a float's range raised a bare OverflowError; one past 2**53 was rounded down under the cap."""
    assert parse_size(2**53 + 1) == 2**53 + 1
    with pytest.raises(DeviceSpecError, match=r"max_memory\[0\] is an int of 1329 bits, beyond 2\*\*1000 bytes"):
        parse_size(10**400, what="max_memory[0]")
    with pytest.raises(DeviceSpecError, match=r"beyond 2\*\*1000 bytes"):
        parse_size(10**5000)
    with pytest.raises(DeviceSpecError, match=r"memory of cpu is .* accepted are 0 to"):
        Device("cpu", 2**53 + 1)
    with pytest.raises(DeviceSpecError, match=r"memory of cpu is .* accepted are 0 to"):  # far past the cap, a float still
        Device("cpu", 2**900)
