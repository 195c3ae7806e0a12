"""Random placement problems for hypothesis: chains and DAGs with runs of identical units, identical GPUs,
pins, ties, contiguity, options that copy beside the compute, and copy groups. Shared by test_bound (against brute force)
and test_polish."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from placement_opt.solver.problem import (
    DeviceSpec,
    EdgeSpec,
    PlacementOption,
    PlacementProblem,
    UnitSpec,
)

_MAX_ASSIGNMENTS = 3200  # brute force stays around 0.1 s a case


def _matrix(draw, devices, twins):
    """Transfer prices per ordered pair; with ``twins`` the GPUs are interchangeable (one price per kind pair)."""
    if twins:
        kinds = {(a, b): draw(st.integers(0, 9)) for a in ("gpu", "cpu") for b in ("gpu", "cpu")}
        return {(p, q): kinds["gpu" if p.startswith("cuda") else "cpu", "gpu" if q.startswith("cuda") else "cpu"]
                for p in devices for q in devices if p != q}
    return {(p, q): draw(st.integers(0, 9)) for p in devices for q in devices if p != q}


def _menu(draw, gpus, twins, copying=False):
    """Resident on every GPU and on the CPU, streamed from the CPU to every GPU; twins price GPUs alike;
    ``copying``: streamed options may copy with their group (``group_copy_bytes``)."""
    def numbers(copies=False):
        out = dict(prefill_ns=draw(st.integers(0, 30)), decode_ns=draw(st.integers(0, 60)),
                   resident_bytes=draw(st.integers(0, 2)), peak_bytes=draw(st.integers(0, 4)))
        if copies:  # the prefetch thread's copies, and host memory's time (cf. problem.py's Overlap)
            out.update(copy_prefill_ns=draw(st.integers(0, 40)), copy_decode_ns=draw(st.integers(0, 80)),
                       host_prefill_ns=draw(st.integers(0, 20)), host_decode_ns=draw(st.integers(0, 40)),
                       disk_prefill_ns=draw(st.integers(0, 20)), disk_decode_ns=draw(st.integers(0, 40)))
            share = draw(st.integers(0, 2)) if copying else 0  # its group copy, twice in its peak (problem.py)
            out.update(group_copy_bytes=share, peak_bytes=out["peak_bytes"] + 2 * share)
        return out
    stored = draw(st.integers(0, 6))
    on_gpu, streamed = numbers(), numbers(copies=True)
    options = []
    for g in gpus:
        if not twins:
            on_gpu, streamed = numbers(), numbers(copies=True)
        options.append(PlacementOption(storage=g, execution=g, mode="resident", stored_bytes=stored, **on_gpu))
        options.append(PlacementOption(storage="cpu", execution=g, mode="stream", stored_bytes=stored, **streamed))
    on_cpu = numbers() | dict(host_prefill_ns=draw(st.integers(0, 20)), host_decode_ns=draw(st.integers(0, 40)),
                              disk_prefill_ns=draw(st.integers(0, 20)), disk_decode_ns=draw(st.integers(0, 40)))
    options.append(PlacementOption(storage="cpu", execution="cpu", mode="resident", stored_bytes=stored, **on_cpu))
    return tuple(options)


@st.composite
def problems(draw, run=False, copying=None):
    """Chains and DAGs with runs of identical units, identical GPUs, pins, ties and contiguity.

    ``run``: units 1 to n - 1 (n >= 5) are identical and joined by one price: a run with an interior
    of 2+ units that the solver counts per option (``u0`` may still take a skip edge or a pin).
    ``copying``: streamed options may copy with their group (None: in one problem in three).
    """
    n_gpus = draw(st.integers(1, 2 if run else 3))
    gpus = [f"cuda:{i}" for i in range(n_gpus)]
    twins = n_gpus > 1 and draw(st.booleans())
    options = 2 * n_gpus + 1
    most = max(1, int(math.log(_MAX_ASSIGNMENTS) / math.log(options)))
    n = draw(st.integers(5, max(5, most)) if run else st.integers(1, most))
    if copying is None:
        copying = draw(st.integers(0, 2)) == 0  # one problem in three copies with groups
    menus = [_menu(draw, gpus, twins, copying)]
    for k in range(n - 1):  # runs of identical units (decoder layers) or a new menu
        same = (run and k > 0) or (not run and draw(st.integers(0, 3)) > 0)
        menus.append(menus[-1] if same else _menu(draw, gpus, twins, copying))
    units = tuple(UnitSpec(name=f"u{i}", options=m) for i, m in enumerate(menus))
    devices = [*gpus, "cpu"]
    shared = _matrix(draw, devices, twins)
    pairs = [(i, i + 1) for i in range(n - 1)]
    if run and n >= 6 and draw(st.booleans()):  # the run's ends then take two edges: 6 units keep 2 inside
        pairs.append((0, n - 1))
    elif not run and draw(st.booleans()):  # a DAG: skip edges, some chain edges dropped
        pairs = [p for p in pairs if draw(st.integers(0, 3))] + \
            [(i, j) for i in range(n) for j in range(i + 2, n) if draw(st.booleans())]
    shared_decode = _matrix(draw, devices, twins)
    edges = []
    for i, j in pairs:  # mostly one price for every edge, as the hidden state between layers
        same = run or draw(st.integers(0, 3)) > 0
        edges.append(EdgeSpec(src=f"u{i}", dst=f"u{j}", prefill_ns=shared if same else _matrix(draw, devices, twins),
                              decode_ns=shared_decode if same else _matrix(draw, devices, twins)))
    gpu_cap = draw(st.integers(0, 16))
    specs = tuple(DeviceSpec(name=g, kind="gpu", capacity_bytes=gpu_cap if twins else draw(st.integers(0, 16)))
                  for g in gpus) + (DeviceSpec(name="cpu", kind="cpu", capacity_bytes=draw(st.integers(0, 30))),)
    tied = (("u0", f"u{n - 1}"),) if n >= 2 and not run and draw(st.integers(0, 3)) == 0 else ()
    pinned = f"u{draw(st.integers(0, 0 if run else n - 1))}"
    pins = {pinned: draw(st.sampled_from(devices))} if draw(st.integers(0, 3)) == 0 else {}
    return PlacementProblem(units=units, edges=tuple(edges), devices=specs, tied_groups=tied, pins=pins,
                            contiguous=draw(st.integers(0, 4)) == 0, copy_groups=copy_groups(draw, n))


def copy_groups(draw, n):
    """Now and then, runs of consecutive units copied as one (a sublayer graph's layers)."""
    if n < 2 or draw(st.integers(0, 2)):
        return ()
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)))
    bounds = [0, *cuts, n]
    return tuple(tuple(f"u{i}" for i in range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False))
