"""Shared test setup: seeded randomness, CUDA tests skipped without a GPU, hypothesis profiles."""

from __future__ import annotations

import gc
import itertools
import os
import random

import pytest
from hypothesis import HealthCheck, settings

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One thread a worker (and for the processes a test starts), set before torch is imported: two workers of two
    # threads each on two cores left OpenMP's threads waiting on each other, and a decode step timed beside the
    # sum of its units' marks came out at twice it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.register_profile(
    "ci", max_examples=200, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=50, deadline=None)
# a bug hunt, not a gate: random examples (a new seed each run), many more of them; run a folder at a time
settings.register_profile("deep", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(0)


_PROFILES = itertools.count()


@pytest.fixture(autouse=True)
def _own_profile(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each test reads and writes a profile of its own (absent until it writes one), never the developer's
    ~/.cache/placement_opt/profile.json: CI has none, and a test must run here as it runs there. A test that
    wants a profile sets PLACEMENT_OPT_PROFILE itself."""
    where = tmp_path_factory.getbasetemp() / f"profile-{next(_PROFILES)}.json"
    monkeypatch.setenv("PLACEMENT_OPT_PROFILE", str(where))


@pytest.fixture(autouse=True)
def _own_graph_cache(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each test keeps traced graphs in a cache of its own, never the developer's ~/.cache/placement_opt/graphs:
    a graph another test (or an older checkout) left must not stand in for the trace a test runs."""
    where = tmp_path_factory.getbasetemp() / f"graphs-{next(_PROFILES)}"
    monkeypatch.setenv("PLACEMENT_OPT_CACHE", str(where))


@pytest.fixture(scope="session")
def module_level_70b():
    """Llama-3-70B traced per module on meta (724 units): the largest graph the time-limit tests solve. Traced once
    per session (about 4.5 s on 2 cores); the tests only read it."""
    pytest.importorskip("transformers")
    from placement_opt import trace
    from placement_opt.model import catalog

    return trace(catalog.model_config("llama-3-70b"), granularity="module")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported by now, and with them torch and transformers: about 350 thousand objects that
    live as long as the process. Freezing them takes them out of every later collection: a full ``gc.collect()``
    (``time_generation`` runs one before it reads the resident set) fell from about 0.23 s to microseconds, and the
    suite calls it hundreds of times. Objects the tests create are collected as before."""
    gc.collect()
    gc.freeze()
