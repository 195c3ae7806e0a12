"""Cluster descriptions: the spec string, JSON files, torchrun's environment, ranks and links."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from placement_opt.errors import DeviceSpecError
from placement_opt.hardware.cluster import LINK_PRESETS, Cluster, parse_cluster_spec
from placement_opt.hardware.presets import PRESETS

GPUS = sorted(k for k, p in PRESETS.items() if p.kind == "gpu")
CPUS = sorted(k for k, p in PRESETS.items() if p.kind == "cpu")


def test_spec_hosts_ranks_and_links() -> None:
    cluster = Cluster.from_spec("2x(h100-sxm*8, cpu-server) + (a100-40gb*4,cpu-server=1TiB)@ib-200g")
    assert [h.n_ranks for h in cluster.hosts] == [8, 8, 4]
    ranks = cluster.ranks
    assert cluster.world_size == len(ranks) == 20
    assert (ranks[9].host, ranks[9].local_rank, ranks[9].device_name) == (1, 1, "cuda:1")
    assert ranks[19].device.source == "datasheet:a100-40gb"
    assert cluster.hosts[2].machine.cpu.memory_bytes == 2**40
    # Within a host: NVLink (the H100's 450 GB/s peer link); across hosts: the network.
    assert cluster.link(ranks[0], ranks[1]).bandwidth_bytes_per_s == 450e9
    assert cluster.link(ranks[7], ranks[8]).bandwidth_bytes_per_s == LINK_PRESETS["ib-200g"][0]


def test_cpu_ranks_share_their_cpu() -> None:
    cluster = Cluster.from_spec("(cpu-server*4)@25GB/s/10us")
    whole = PRESETS["cpu-server"]
    devices = [r.device for r in cluster.ranks]
    assert len(devices) == 4 and {d.name for d in devices} == {"cpu"}
    assert devices[0].memory_bytes == whole.memory_bytes // 4
    assert devices[0].flops_per_s == pytest.approx(whole.half_flops_per_s / 4)
    assert cluster.network.bandwidth_bytes_per_s == 25e9 and cluster.network.latency_s == pytest.approx(10e-6)


def test_json_file(tmp_path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"hosts": [{"devices": "l4*2,cpu", "count": 3}], "link": "eth-25g"}))
    cluster = Cluster.from_file(path)
    assert cluster == Cluster.from_spec("3x(l4*2,cpu)@eth-25g")
    path.write_text("{not json")
    with pytest.raises(DeviceSpecError, match="unreadable"):
        Cluster.from_file(path)
    with pytest.raises(DeviceSpecError, match="count"):
        Cluster.from_dict({"hosts": [{"devices": "cpu", "count": 0}]})


def test_torchrun_environment() -> None:
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "5", "GROUP_RANK": "1"}
    cluster = Cluster.from_torchrun_env(env, host="a10*4,cpu")
    assert [h.n_ranks for h in cluster.hosts] == [4, 4]
    assert Cluster.from_torchrun_env(env).hosts[0].cpu_ranks == 4  # default: CPU ranks
    for bad, message in [({**env, "GROUP_RANK": "0"}, "GROUP_RANK=0"), ({**env, "WORLD_SIZE": "6"}, "multiple"),
                         ({**env, "RANK": "8"}, "RANK=8"), ({**env, "WORLD_SIZE": "two"}, "not an integer")]:
        with pytest.raises(DeviceSpecError, match=message):
            Cluster.from_torchrun_env(bad)
    with pytest.raises(DeviceSpecError, match="LOCAL_WORLD_SIZE=4"):
        Cluster.from_torchrun_env(env, host="a10*2")


@pytest.mark.parametrize("spec, message", [
    ("", "empty"), ("2x(", "unclosed"), ("((cpu))", "nested"), ("(cpu)+", "empty host"),
    ("(h100)", "no preset"), ("(h100-sxm*0)", "count 0"), ("0x(cpu)", "count must be >= 1"),
    ("(cpu,cpu-server)", "more than one cpu"), ("(a10,cpu*2)", "one rank per GPU"),
    ("(a10)@carrier-pigeon", "neither a preset"), ("(a10)@1GB/s/fast", "latency"),
    ("(a10)@0GB/s", "bandwidth"), ("(nvme-gen4)", "GPU or a CPU"),
    ("5000x(cpu)", "more than 4096"), ("(a10=-1GB)", "size"),
    # read as bytes, a rate in bits priced the network 8x too fast; a bare '@' read as the default network
    ("(a10)@25Gb/s", "'25Gb/s' .* reads as bits"), ("(a10)@10gbps/5us", "'10gbps' .* reads as bits"),
    ("(a10)@100Gbit/s", "reads as bits"), ("(a10)@", "nothing after '@'"),
])
def test_bad_specs_say_what_and_how(spec: str, message: str) -> None:
    with pytest.raises(DeviceSpecError, match=message):
        parse_cluster_spec(spec)


@pytest.mark.parametrize(("data", "message"), [
    ({"hosts": [{"devices": "a10,cpu"}], "lnk": "eth-10g"}, r"key\(s\) 'lnk' \(did you mean 'link'\?\)"),
    ({"hosts": [{"devices": "a10,cpu", "cuont": 4}]}, r"key\(s\) 'cuont' \(did you mean 'count'\?\)"),
    ({"hosts": [{"devices": "a10,cpu"}], "link": ""}, "nothing after '@'"),
    ({"hosts": [{"devices": "a10,cpu"}], "link": 25}, "a cluster's 'link' is 25"),
])
def test_a_cluster_description_with_a_typo_is_refused_not_read_as_the_defaults(data, message) -> None:
    """A misspelt "link" planned on ib-200g, a misspelt "count" on one host, without a word."""
    with pytest.raises(DeviceSpecError, match=message):
        Cluster.from_dict(data)
    assert Cluster.from_dict({"hosts": [{"devices": "a10,cpu", "count": 2}], "link": "25GB/s"}).ranks


@pytest.mark.parametrize(("data", "message"), [
    # joined into "2x(a10*4)+(h100-sxm*4)": three hosts for a count of 2
    ({"hosts": [{"devices": "a10*4)+(h100-sxm*4", "count": 2}]}, "'a10\\*4\\)\\+\\(h100-sxm\\*4' is not one host's"),
    ({"hosts": [{"devices": "a10*4@eth-10g"}]}, "is not one host's devices"),  # said as network 'eth-10g)@ib-200g'
    ({"hosts": []}, "'hosts' is empty"),  # said as "cluster spec '' has an empty host between '+'"
])
def test_a_host_entry_is_one_hosts_devices(data, message) -> None:
    with pytest.raises(DeviceSpecError, match=message):
        Cluster.from_dict(data)



@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        count = draw(st.integers(1, 3))
        gpus = draw(st.lists(st.tuples(st.sampled_from(GPUS), st.integers(1, 4)), max_size=2))
        cpu = draw(st.sampled_from(CPUS))
        devices = [f"{g}*{n}" for g, n in gpus]
        cpu_ranks = "" if gpus else draw(st.sampled_from(["", "*2", "*3"]))
        devices.append(cpu + cpu_ranks)
        groups.append(f"{count}x({','.join(devices)})")
    link = draw(st.sampled_from([*LINK_PRESETS, "12GB/s/7us", "3e9/s"]))
    return parse_cluster_spec("+".join(groups) + "@" + link)


@settings(max_examples=100, deadline=None)
@given(clusters())
def test_spec_round_trip(cluster: Cluster) -> None:
    again = parse_cluster_spec(cluster.to_spec())
    assert again == cluster
    assert [r.rank for r in cluster.ranks] == list(range(cluster.world_size))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="()+@*=,x.-/0123456789abcdefghsu ", max_size=40))
def test_hostile_specs_parse_or_raise_device_spec_error(text: str) -> None:
    try:
        cluster = parse_cluster_spec(text)
    except DeviceSpecError as err:
        assert str(err)
        return
    assert cluster.world_size >= 1


def test_a_torchrun_host_is_one_hosts_devices_and_a_cpu_host_runs_every_local_rank() -> None:
    """A host naming another host ('...)+(cpu') built 9 ranks for WORLD_SIZE=8; 'cpu=64GiB' and 'cpu,disk' were
    not spread over the local ranks as 'cpu' is, and the error spoke of GPUs."""
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "0"}
    for host in ("cpu", "cpu=64GiB", "cpu,disk", "cpu-server", "cpu=64GiB,disk",
                 "disk,cpu", "cpu,nvme-gen3", "hdd, cpu-server = 1TiB"):  # these ran one rank: "one GPU per local rank"
        assert Cluster.from_torchrun_env(env, host=host).world_size == 4, host
    with pytest.raises(DeviceSpecError, match="is not one host's devices"):
        Cluster.from_torchrun_env({**env, "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, host="a100-40gb*4,cpu)+(cpu")
