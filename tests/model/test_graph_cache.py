"""The graph cache (placement_opt.model.graph_cache): what it keeps, what it tells apart, what it never touches.

Each test has a cache directory of its own (conftest's ``_own_graph_cache``, ``$PLACEMENT_OPT_CACHE``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from _cli import TINY_LLAMA, run_cli
from placement_opt.model import graph_cache
from placement_opt.model.graph import LayerGraph, chain_graph
from placement_opt.model.graph_cache import cache_dir, trace_key, traced

MACHINE = "cuda:0=a100-40gb,cpu=64GiB,disk=nvme-gen4"
ARGS = {"dtype": None, "granularity": "block", "expert_groups": 1}


def _graph(name: str = "g") -> LayerGraph:
    return chain_graph([{"name": f"{name}.{i}", "param_bytes": 100 * (i + 1)} for i in range(3)])


def _entries() -> list[str]:
    return sorted(p.name for p in cache_dir().glob("graph-*.json")) if cache_dir().is_dir() else []


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return path


def test_the_second_call_reads_the_graph_the_first_traced(config_json):
    from placement_opt.model.tracer import trace

    calls = []

    def trace_it():
        calls.append(1)
        return trace(str(config_json))

    first, hit_first = traced(str(config_json), trace_it, **ARGS)
    second, hit_second = traced(str(config_json), trace_it, **ARGS)
    assert (hit_first, hit_second, len(calls)) == (False, True, 1)
    assert second.to_dict() == first.to_dict()
    assert len(_entries()) == 1


@pytest.mark.parametrize("granularity", ["block", "auto"])
def test_a_plan_from_the_cache_imports_neither_torch_nor_transformers(config_json, tmp_path, granularity):
    """The point of the cache: the second `placement-opt plan` of a model pays neither import nor trace, and
    plans the same placements (with --granularity auto, from both graphs)."""
    script = ("import sys\nfrom placement_opt.cli.main import main\ntry:\n    main(sys.argv[1:])\n"
              "except SystemExit as exc:\n    code = exc.code\n"
              "print('IMPORTED', 'torch' in sys.modules, 'transformers' in sys.modules)\nsys.exit(code)\n")
    plans = []
    for i in range(2):
        out = tmp_path / f"plan{i}.json"
        done = subprocess.run([sys.executable, "-c", script, "plan", str(config_json), "--devices", MACHINE,
                               "--granularity", granularity, "--json", str(out)],
                              capture_output=True, text=True, env=os.environ, timeout=300)
        assert done.returncode == 0, done.stderr
        plans.append((done.stdout.strip().splitlines()[-1], json.loads(out.read_text())["placements"]))
    assert plans[0][0] == "IMPORTED True True"
    assert plans[1][0] == "IMPORTED False False"
    assert plans[1][1] == plans[0][1]


def test_plan_no_cache_traces_again_and_keeps_nothing(config_json, monkeypatch):
    from placement_opt.model import tracer

    traces = []
    real = tracer.trace
    monkeypatch.setattr(tracer, "trace", lambda *a, **k: traces.append(1) or real(*a, **k))
    args = ("plan", str(config_json), "--devices", MACHINE)
    assert run_cli(*args, "--no-cache").exit_code == 0
    assert (len(traces), _entries()) == (1, [])
    assert run_cli(*args).exit_code == 0
    assert run_cli(*args).exit_code == 0
    assert len(traces) == 2 and len(_entries()) == 1  # the third read what the second kept
    assert run_cli(*args, "--no-cache").exit_code == 0
    assert len(traces) == 3


def test_granularity_auto_keeps_both_graphs(config_json, monkeypatch):
    from placement_opt.model import tracer

    traces = []
    real = tracer.trace
    monkeypatch.setattr(tracer, "trace", lambda *a, **k: traces.append(k["granularity"]) or real(*a, **k))
    for _ in range(2):
        result = run_cli("plan", str(config_json), "--devices", MACHINE, "--granularity", "auto")
        assert result.exit_code == 0, result.output
    assert sorted(traces) == ["block", "sublayer"]


def test_the_key_tells_apart_what_the_trace_reads(tmp_path, config_json):
    key = trace_key(str(config_json), **ARGS)
    assert key is not None and key == trace_key(str(config_json), **ARGS)
    others = {trace_key(str(config_json), **{**ARGS, "dtype": "float32"}),
              trace_key(str(config_json), **{**ARGS, "granularity": "sublayer"}),
              trace_key(str(config_json), **{**ARGS, "granularity": "sublayer", "expert_groups": 2}),
              trace_key(str(tmp_path), **ARGS),  # the directory: its files count too
              trace_key("llama-3-8b", **ARGS), trace_key("llama-3-70b", **ARGS)}
    assert key not in others and len(others) == 6
    assert trace_key("Llama-3-8B", **ARGS) == trace_key("llama-3-8b", **ARGS)
    config_json.write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 3}))
    assert trace_key(str(config_json), **ARGS) != key


def test_a_checkpoint_beside_the_config_changes_the_directory_key(tmp_path, config_json):
    """A directory's trace reads the checkpoint's headers (ties the config states but the weights break)."""
    before = trace_key(str(tmp_path), **ARGS)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    written = trace_key(str(tmp_path), **ARGS)
    weights.write_bytes(b"x" * 20)
    assert len({before, written, trace_key(str(tmp_path), **ARGS)}) == 3


def test_the_code_is_part_of_the_key(config_json, monkeypatch):
    key = trace_key(str(config_json), **ARGS)
    code = graph_cache._code_identity()
    for part in ("placement_opt", "torch", "transformers", "source"):
        monkeypatch.setattr(graph_cache, "_code_identity", lambda part=part: {**code, part: "other"})
        assert trace_key(str(config_json), **ARGS) != key, part


@pytest.mark.parametrize("model", ["org/name", "no/such/dir", "not-a-preset"])
def test_what_is_not_a_local_file_or_a_preset_is_not_cached(model):
    calls = []
    for _ in range(2):
        traced(model, lambda: calls.append(1) or _graph(), **ARGS)
    assert trace_key(model, **ARGS) is None
    assert (len(calls), _entries()) == (2, [])


@pytest.mark.parametrize("damage", ["cut", "other key", "not json", "empty", "bad graph"])
def test_an_entry_that_cannot_be_read_is_traced_again_and_replaced(damage):
    graph = _graph()
    traced("llama-3-8b", lambda: graph, **ARGS)
    (entry,) = cache_dir().glob("graph-*.json")
    text = entry.read_text()
    data = json.loads(text)
    entry.write_text({"cut": text[: len(text) // 2], "not json": "\x00\x01", "empty": "",
                      "other key": json.dumps({**data, "key": "0" * 64}),
                      "bad graph": json.dumps({**data, "graph": {"schema_version": 1, "nodes": 3}})}[damage])
    again, hit = traced("llama-3-8b", lambda: _graph("new"), **ARGS)
    assert not hit and again.names() == _graph("new").names()
    assert traced("llama-3-8b", lambda: graph, **ARGS)[1]  # the replaced entry reads back


def test_a_trace_that_warns_is_not_kept_and_its_warning_is_shown_once_per_place():
    def trace_it():
        for _ in range(3):  # once per layer, from one place
            warnings.warn("a static graph", RuntimeWarning, stacklevel=1)
        return _graph()

    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="a static graph") as shown:
            _, hit = traced("llama-3-8b", trace_it, **ARGS)
        assert not hit and len(shown) == 1
    assert _entries() == []


def test_a_cache_that_cannot_be_written_warns_and_the_graph_is_returned(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("the user's")
    monkeypatch.setenv(graph_cache.CACHE_ENV_VAR, str(blocker / "graphs"))
    with pytest.warns(UserWarning, match="could not keep the traced graph"):
        graph, hit = traced("llama-3-8b", _graph, **ARGS)
    assert not hit and graph.names() == _graph().names()
    assert blocker.read_text() == "the user's"


def test_use_cache_false_neither_reads_nor_writes():
    traced("llama-3-8b", _graph, **ARGS)
    calls = []
    traced("llama-3-8b", lambda: calls.append(1) or _graph(), **ARGS, use_cache=False)
    assert calls == [1] and len(_entries()) == 1


@given(ours=st.integers(0, 8), foreign=st.lists(st.sampled_from(
    ["notes.txt", "graph-1.json", "graph-" + "a" * 64 + ".json.bak", "profile.json", "graph-" + "G" * 64 + ".json"]),
    unique=True))
def test_pruning_keeps_the_newest_entries_and_never_touches_other_files(tmp_path_factory, ours, foreign):
    directory = tmp_path_factory.mktemp("graphs")
    old = [directory / f"graph-{i:064x}.json" for i in range(ours)]
    for i, path in enumerate(old):
        path.write_text("{}")
        os.utime(path, ns=(10**18 + i, 10**18 + i))
    for name in foreign:
        (directory / name).write_text("theirs")
    most = 3
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(graph_cache.CACHE_ENV_VAR, str(directory))
        patch.setattr(graph_cache, "MOST_ENTRIES", most)
        traced("llama-3-8b", _graph, **ARGS)
    new = directory / f"graph-{trace_key('llama-3-8b', **ARGS)}.json"
    kept = sorted(p.name for p in directory.iterdir() if graph_cache._ENTRY.fullmatch(p.name))
    newest_old = old[max(0, len(old) - (most - 1)):]  # the new entry is the most recent of all
    assert kept == sorted([new.name, *(p.name for p in newest_old)])
    assert all((directory / name).read_text() == "theirs" for name in foreign)


def test_a_read_entry_counts_as_recently_used(monkeypatch):
    """Pruning removes the least recently used entries: one read just now outlives newer ones not read since."""
    monkeypatch.setattr(graph_cache, "MOST_ENTRIES", 2)
    traced("llama-3-8b", _graph, **ARGS)
    first = cache_dir() / f"graph-{trace_key('llama-3-8b', **ARGS)}.json"
    os.utime(first, ns=(10**18, 10**18))  # written long ago (2001)
    traced("llama-3-70b", _graph, **ARGS)
    second = cache_dir() / f"graph-{trace_key('llama-3-70b', **ARGS)}.json"
    os.utime(second, ns=(15 * 10**17, 15 * 10**17))  # written after the first (2017), never read
    assert traced("llama-3-8b", _graph, **ARGS)[1]  # read: now the most recent of the two
    traced("mistral-7b", _graph, **ARGS)  # a third entry: the least recently used goes
    assert first.is_file() and not second.is_file()
