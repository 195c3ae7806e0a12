"""Devices and machines: presets, sizes, links, and every form a machine may be given in."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from placement_opt.errors import DeviceSpecError
from placement_opt.hardware.detect import local_device_names
from placement_opt.hardware.devices import (
    DEFAULT_GPU_RESERVE_BYTES,
    Device,
    Machine,
    replace_device,
)
from placement_opt.hardware.presets import PRESETS, did_you_mean
from placement_opt.hardware.resolve import as_machine, device_names, parse_device_spec
from placement_opt.units import GIB, MIB


def test_catalog_has_the_required_classes() -> None:
    required = {"h100-sxm", "h100-pcie", "a100-40gb", "a100-80gb", "l4", "t4", "rtx-3060", "rtx-3090",
                "rtx-4090", "cpu-desktop", "cpu-server", "nvme-gen4", "nvme-gen3"}
    assert required <= set(PRESETS)


def test_preset_device_figures() -> None:
    a100 = Device.preset("a100-40gb", name=1)
    assert a100.name == "cuda:1" and a100.kind == "gpu"
    assert a100.memory_bytes == 40960 * MIB and a100.flops_per_s == 312e12
    assert a100.usable_bytes == 40960 * MIB - DEFAULT_GPU_RESERVE_BYTES
    assert Device.preset("a100-40gb", dtype="float32").flops_per_s == 19.5e12
    assert a100.source == "datasheet:a100-40gb"


def test_device_from_sizes_and_names() -> None:
    assert Device("cuda:0", "24GiB").memory_bytes == 24 * GIB
    assert Device(0, "500MB").name == "cuda:0"
    assert Device("cpu", 10**9, flops=1e12).source.startswith("default:")
    assert Device("cpu", 10**9, flops=1e12, bandwidth=5e10).source == "user"
    assert Device("cpu", "1GiB").reserve_bytes == 0


@pytest.mark.parametrize(("call", "pattern"), [
    (lambda: Device.preset("a100-41gb"), r"unknown device preset 'a100-41gb' \(did you mean 'a100-40gb' or 'a100-80gb'\?\): accepted are .*a100-40gb"),
    (lambda: Device("cpu", "12 gigs"), r"'12 gigs' is not a size.*units: b, kb"),
    (lambda: Device("cpu", -5), r"-5 is negative.*>= 0"),
    (lambda: Device("cpu", "-5GiB"), r"'-5GiB' is not a size"),
    (lambda: Device("tpu:0", "1GiB"), r"unknown device name 'tpu:0': accepted are 'cuda:N'.*'cpu' and 'disk'"),
    (lambda: Device("cpu", "1GiB", flops=0), r"flops of cpu is 0"),
    (lambda: Device.preset("nvme-gen4", name="cuda:0"), r"preset 'nvme-gen4' is a disk"),
    (lambda: parse_device_spec("cuda:0=a100"), r"'a100' is neither a preset nor a size.*a100-40gb"),
    (lambda: parse_device_spec("cpu=,disk"), r"'cpu=' has nothing after '=': write cpu=SIZE"),
    (lambda: parse_device_spec("cuda:0=h100-80gb"),
     r"'h100-80gb' is neither a preset nor a size \(did you mean 'h100-pcie' or 'h100-sxm'\?\)\. Write"),
    (lambda: Device.preset("a100_40gb"), r"unknown device preset 'a100_40gb' \(did you mean 'a100-40gb'\?\)"),
    (lambda: Device.preset("warp-drive"), r"unknown device preset 'warp-drive': accepted are"),
    (lambda: as_machine(3.5), r"is not a machine"),
    (lambda: as_machine({"npu": "1GiB"}), r"unknown device name 'npu'"),
    (lambda: as_machine({"cpu": "-1GiB"}), r"max_memory\['cpu'\]"),
    (lambda: Device("cpu", "1GiB", to_host=5e9), r"to_host of cpu is 5000000000.0: .*only a GPU takes it"),
    (lambda: Device("cuda:0", "1GiB", to_host=-1), r"to_host of cuda:0 is -1"),
    (lambda: Device("cpu", "1GiB", random_read_latency_s=1e-3), r"of cpu are None and 0.001: .*only the disk"),
    (lambda: Device("cuda:0", "1GiB", random_read=1e9), r"of cuda:0 are 1000000000.0 and None: .*only the disk"),
    (lambda: Device("disk", "1TB", random_read_latency_s=0), r"random_read_latency_s of disk is 0: .*between 0 and 1"),
    (lambda: Device("disk", "1TB", random_read=0), r"random_read of disk"),
    # a reserve over the memory left nothing for the model, silently (every unit then went elsewhere)
    (lambda: Device("cuda:0", "1GiB", reserve="2GiB"), r"reserve of cuda:0 is 2.00 GiB, more than its memory "
                                                        r"\(1.00 GiB\): nothing would be left"),
    (lambda: Device.preset("a100-40gb", reserve="48GiB"), r"reserve of cuda:0 is 48.00 GiB, more than its memory"),
])
def test_errors_name_the_bad_value_and_what_is_accepted(call, pattern) -> None:
    with pytest.raises(DeviceSpecError, match=pattern):  # a ValueError, as callers catch today
        call()


def test_a_reserve_up_to_the_memory_is_taken() -> None:
    assert Device("cuda:0", "2GiB", reserve="2GiB").usable_bytes == 0
    assert Device("cuda:0", "2GiB", reserve="512MiB").usable_bytes == 1536 * MIB


def test_machine_orders_devices_and_defaults_links() -> None:
    machine = Machine([Device("disk", "1TB", bandwidth=2e9), Device("cpu", "64GiB"),
                       Device.preset("rtx-4090", name="cuda:1"), Device.preset("rtx-3060", name="cuda:0")])
    assert machine.names == ["cuda:0", "cuda:1", "cpu", "disk"]
    assert machine.bandwidth("cpu", "cuda:0") == 25e9            # PCIe 4.0 x16 host link
    assert machine.bandwidth("cuda:0", "cuda:1") == 25e9          # slower peer link of the two
    assert machine.bandwidth("disk", "cpu") == 2e9                # the disk's read bandwidth
    assert machine.bandwidth("disk", "cuda:1") == 2e9             # through the host, slower hop
    assert machine.bandwidth("cpu", "cpu") == float("inf")
    assert machine.latency_s("disk", "cpu") > machine.latency_s("cpu", "cuda:0") > 0
    linked = Machine(machine.devices, links={("cpu", 0): 12e9})
    assert linked.bandwidth("cpu", "cuda:0") == 12e9
    with pytest.raises(DeviceSpecError, match="cuda:2"):
        Machine(machine.devices, links={("cpu", "cuda:2"): 1e9})
    with pytest.raises(DeviceSpecError, match="more than once"):
        Machine([Device("cpu", 1), Device("cpu", 2)])


def test_copies_leaving_a_gpu_take_its_measured_rate_and_those_reaching_it_the_host_link() -> None:
    gpu = Device.preset("h100-sxm", name="cuda:0")
    measured = replace_device(gpu, to_host_bytes_per_s=1.3e9)
    for device, leaving in ((gpu, gpu.host_link_bytes_per_s), (measured, 1.3e9)):
        machine = Machine([device, Device("cpu", "64GiB")])
        assert machine.bandwidth("cuda:0", "cpu") == leaving
        assert machine.bandwidth("cpu", "cuda:0") == gpu.host_link_bytes_per_s
    linked = Machine([measured, Device("cpu", "64GiB")], links={("cuda:0", "cpu"): 9e9})
    assert linked.bandwidth("cuda:0", "cpu") == 9e9  # a link the user gives wins


def test_reads_asked_for_at_random_places_pay_the_disk_s_measured_scattered_reads() -> None:
    """What the runtime reads on demand (a router's picks, a lookup's rows) costs a measured latency per read plus its
    bytes at the measured scattered rate; unmeasured, 100 us and the disk's bandwidth. A unit read whole and ahead
    keeps the 100 us transfer latency whatever the disk measured."""
    measured = Device("disk", "1TB", bandwidth=2e9, random_read=1e9, random_read_latency_s=15e-6)
    plain = Device("disk", "1TB", bandwidth=2e9)
    for disk, expected in ((plain, 3 * 100e-6 + 0.5), (measured, 3 * 15e-6 + 1.0)):
        machine = Machine([Device("cuda:0", "8GiB"), Device("cpu", "64GiB"), disk])
        assert machine.random_read_s(3, 1e9) == pytest.approx(expected)
        assert machine.latency_s("disk", "cpu") == machine.latency_s("disk", "cuda:0") == 100e-6
    assert Machine([Device("cpu", "64GiB")]).random_read_s(2, 0) == pytest.approx(200e-6)  # no disk: the default


def test_as_machine_accepts_max_memory_spec_and_lists() -> None:
    from_max = as_machine({0: "20GiB", "cpu": "64GiB"})
    assert from_max.names == ["cuda:0", "cpu"]
    assert from_max["cuda:0"].usable_bytes == 20 * GIB  # the user's budget, no reserve on top
    spec = parse_device_spec("cuda:0=a100-40gb,cuda:1=rtx-4090/20GiB,cpu=256GiB")
    assert spec["cuda:1"].memory_bytes == 20 * GIB and spec["cuda:1"].flops_per_s == 165.2e12
    assert spec["cpu"].memory_bytes == 256 * GIB
    listed = as_machine(["cpu", Device("disk", "1TB")])
    assert listed.names == ["cpu", "disk"] and listed["cpu"].memory_bytes > 0
    assert as_machine(spec) is spec
    assert as_machine("auto").names == as_machine(local_device_names()).names  # the CLI's --devices auto


def test_a_list_takes_spec_items_as_the_spec_string_does() -> None:
    """``["cuda:0=h100-sxm", "cpu=64GiB"]`` is the CLI's ``--devices cuda:0=h100-sxm,cpu=64GiB`` (it was read as a
    device named 'cuda:0=h100-sxm'), beside names and Devices."""
    spec = "cuda:0=h100-sxm/40GiB,cpu=64GiB"
    listed = as_machine(["cuda:0=h100-sxm/40GiB", "cpu=64GiB", Device("disk", "1TB")])
    assert listed.to_dict()["devices"][:2] == parse_device_spec(spec).to_dict()["devices"]
    assert listed.names == device_names(["cuda:0=h100-sxm/40GiB", "cpu=64GiB", Device("disk", "1TB")])
    assert device_names(["cuda:0=h100-sxm,cuda:1=a100-40gb", "cpu"]) == ["cuda:0", "cuda:1", "cpu"]


@pytest.mark.parametrize(("value", "shown"), [("h100-sxm", "'cuda:0=h100-sxm/24GiB,cpu=64GiB'"),
                                              ("h100-80gb", "did you mean 'h100-pcie' or 'h100-sxm'")])
def test_a_preset_in_a_max_memory_dict_is_answered_with_the_forms_that_take_one(value, shown) -> None:
    with pytest.raises(DeviceSpecError, match=r"names a device preset") as caught:
        as_machine({0: value, "cpu": "64GiB"})
    assert shown in str(caught.value)
    with pytest.raises(DeviceSpecError, match=r"'12 gigs' is not a size"):  # not a preset: the size's own message
        as_machine({0: "12 gigs"})
    # a number first is a size meant, though '10G' is near the preset 'a10' (it was answered as that preset)
    for meant in ("10G", "10g"):
        with pytest.raises(DeviceSpecError, match=rf"'{meant}' is not a size: write a number and a unit"):
            as_machine({0: meant})


def test_a_cpu_preset_in_a_max_memory_dict_is_answered_with_one_cpu_in_the_example() -> None:
    """The example named the CPU twice ('cpu=cpu-server/24GiB,cpu=64GiB')."""
    with pytest.raises(DeviceSpecError, match=r"e.g. 'cpu=cpu-server/64GiB' or \['cpu=cpu-server'\]"):
        as_machine({"cpu": "cpu-server"})


def test_a_word_near_auto_is_still_an_unknown_device() -> None:
    with pytest.raises(DeviceSpecError, match="unknown device name 'autos'"):
        as_machine("autos")


def test_round_trips_through_dicts() -> None:
    machine = parse_device_spec("cuda:0=h100-sxm,cpu=cpu-server,disk=nvme-gen3")
    again = Machine.from_dict(machine.to_dict())
    assert again == machine
    measured = Machine([replace_device(machine["cuda:0"], to_host_bytes_per_s=1.3e9), machine["cpu"]])
    assert Machine.from_dict(measured.to_dict()) == measured
    scattered = Machine([machine["cpu"], replace_device(machine["disk"], random_read_bytes_per_s=1.2e9,
                                                        random_read_latency_s=15e-6)])
    assert Machine.from_dict(scattered.to_dict()) == scattered
    old = {**machine["cuda:0"].to_dict()}
    del old["to_host_bytes_per_s"]  # a plan or profile written before the field: the host link's rate
    assert Device.from_dict(old) == machine["cuda:0"]
    faulted = {**machine["disk"].to_dict(), "fault_latency_s": 3e-3}  # written 2026-11-28 to 11-30: read by nothing
    assert Device.from_dict(faulted) == machine["disk"]
    assert machine.max_memory == {0: machine["cuda:0"].usable_bytes, "cpu": 512 * GIB, "disk": 10**12}


@given(st.sampled_from(sorted(PRESETS)), st.booleans())
def test_a_preset_spelled_with_underscores_or_capitals_is_suggested_first(key, upper) -> None:
    typed = key.replace("-", "_").upper() if upper else key.replace("-", "_")
    assume(typed != key)  # a lower-case key without a hyphen is no misspelling
    assert did_you_mean(typed) == f" (did you mean {key!r}?)"


@pytest.mark.parametrize("spec", ["", " , ", ","])
def test_a_spec_naming_no_device_is_refused_in_the_spec_s_own_form(spec):
    """It reached Machine([]), whose message shows Python lists and dicts: no help to a --devices value."""
    with pytest.raises(DeviceSpecError, match=r"names no device: write its devices ','-separated, e.g. "
                                              r"'cuda:0=24GiB,cpu=64GiB'"):
        parse_device_spec(spec)


def test_a_gpu_index_written_with_a_leading_zero_is_that_gpu() -> None:
    """'cuda:01' stayed a device of its own: beside cuda:1 it was no duplicate, and max_memory kept one of the two
    under accelerate's key 1; a machine with cuda:1 did not find 'cuda:01'."""
    assert Device("cuda:01", "1GiB").name == "cuda:1"
    assert as_machine({"gpu:00": "1GiB"}).names == ["cuda:0"]
    with pytest.raises(DeviceSpecError, match="machine lists cuda:1 more than once"):
        as_machine({"cuda:01": "1GiB", 1: "2GiB"})
    assert as_machine({1: "1GiB"})["cuda:01"].name == "cuda:1"


def test_a_gpu_under_its_default_reserve_reads_back_and_takes_another_capacity() -> None:
    """Device('cuda:0', '512MiB') keeps the default 1 GiB reserve (the plan's notes say so), but its dict read back as
    a reserve given over the memory: a plan solved on 'cuda:0=a10/512MiB' did not load, nor did with_memory work."""
    small = Device.preset("a10", memory="512MiB")
    assert small.reserve_bytes == DEFAULT_GPU_RESERVE_BYTES and small.usable_bytes == 0
    machine = Machine([small, Device("cpu", "64GiB")])
    assert Machine.from_dict(machine.to_dict()) == machine
    assert Device("cuda:0", "24GiB").with_memory("512MiB").usable_bytes == 0
    assert small.with_memory("24GiB").usable_bytes == 23 * GIB
    with pytest.raises(DeviceSpecError, match="more than its memory"):  # a reserve one gives is still checked
        Device("cuda:0", "512MiB", reserve="1GiB")


@pytest.mark.parametrize(("call", "pattern"), [
    # a bare ValueError or TypeError of float(), naming neither the device nor the field
    (lambda: Device("cpu", "1GiB", op_overhead_s="5us"), r"op_overhead_s of cpu is '5us': .*between 0 and 1"),
    (lambda: Device("cpu", "1GiB", op_overhead_s=[5e-6]), r"op_overhead_s of cpu is \[5e-06\]"),
    (lambda: Device("disk", "1TB", random_read_latency_s="x"), r"random_read_latency_s of disk is 'x'"),
    # infinite speeds were taken: the device's compute or copies then cost no time at all
    (lambda: Device("cuda:0", "1GiB", flops=float("inf")), r"flops of cuda:0 is inf: speeds are numbers > 0 per second, and finite"),
    (lambda: Device("cpu", "1GiB", bandwidth=float("inf")), r"bandwidth of cpu is inf"),
])
def test_a_non_numeric_time_or_an_infinite_speed_is_refused_in_the_device_s_words(call, pattern) -> None:
    with pytest.raises(DeviceSpecError, match=pattern):
        call()


@pytest.mark.parametrize(("links", "pattern"), [
    # each was a bare TypeError, ValueError or AttributeError, or (inf, True) taken as a rate
    ({("disk", "cpu"): None}, r"link disk->cpu bandwidth is None: it must be a finite number > 0 bytes/s"),
    ({("disk", "cpu"): "fast"}, r"link disk->cpu bandwidth is 'fast'"),
    ({("disk", "cpu"): float("inf")}, r"link disk->cpu bandwidth is inf"),
    ({("disk", "cpu"): True}, r"link disk->cpu bandwidth is True"),
    ({"cpu": 1e9}, r"link 'cpu' is not a \(src, dst\) pair of device names: e.g. links="),
    ([("disk", "cpu", 1e9)], r"links is a list: give a dict of \(src, dst\) pairs to bytes/s"),
    # never read: bandwidth() of a device to itself is infinite whatever the links say
    ({("cpu", "cpu"): 1e9}, r"link cpu->cpu joins cpu to itself"),
])
def test_a_malformed_link_is_refused_in_the_machine_s_words(links, pattern) -> None:
    with pytest.raises(DeviceSpecError, match=pattern):
        Machine([Device("cpu", "1GiB"), Device("disk", "1TB")], links)


@pytest.mark.parametrize(("spec", "what"), [("cuda:0=a100-80gb/h100-sxm", "preset"), ("cuda:0=10GiB/20GiB", "size"),
                                            ("cpu=cpu-server/64GiB/cpu-desktop", "preset")])
def test_a_spec_item_with_two_presets_or_two_sizes_is_refused(spec, what) -> None:
    """The last one was taken and the first dropped: 'cuda:0=a100-80gb/h100-sxm' planned for an H100."""
    with pytest.raises(DeviceSpecError, match=rf"item '{spec}' gives more than one {what}: write NAME=PRESET/SIZE"):
        parse_device_spec(spec)


def test_a_preset_key_is_read_as_a_spec_reads_it_and_a_non_string_is_refused() -> None:
    """Device.preset(None) raised a bare AttributeError; ' A100-80GB ' (a spec item's spelling) was unknown, with a
    'did you mean' naming the very preset."""
    assert Device.preset(" A100-80GB ").source == "datasheet:a100-80gb"
    for key in (None, 40):
        with pytest.raises(DeviceSpecError, match=rf"device preset {key!r} is a \w+, not a preset's name: give one of"):
            Device.preset(key)  # type: ignore[arg-type]


def test_bytes_are_not_a_list_of_gpu_indices() -> None:
    """b'cpu' was iterated as the ints 99, 112 and 117: 'cuda:99 is not on this machine'."""
    with pytest.raises(DeviceSpecError, match=r"devices=b'cpu' is not a machine: pass a Machine"):
        as_machine(b"cpu")


@pytest.mark.parametrize(("curve", "pattern"), [
    ([(1, float("inf"))], r"has \[\(1, inf\)\]: tokens must be >= 1 and FLOP/s > 0 and finite"),
    ([(1, 1e12), (64, 5e12), (1, 2e12)], r"gives tokens \[1\] more than once: one FLOP/s each"),
])
def test_a_measured_curve_with_an_infinite_or_a_repeated_point_is_refused(curve, pattern) -> None:
    with pytest.raises(DeviceSpecError, match=pattern):
        Device("cpu", "1GiB", flops_by_tokens=curve)
