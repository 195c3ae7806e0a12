"""How long does tracing take, and how much memory? Llama-3-70B, Llama-3.1-405B and Falcon-40B from their published
configs, per decoder block, and Llama-3.1-405B per module (``granularity="module"``, 1138 units).

Each measurement runs in a fresh interpreter (so imports, lazy module loading and peak RSS are those of a
new user process) and reports:

* ``first_s``: wall time of the first ``trace(preset)`` in a new process, split into the transformers
  modules it has to import (``hf_import_s``: config, Auto classes, modeling code) and placement_opt's own
  work (``trace_s``: build the model on meta, one meta forward, the graph); CPU times beside them are less
  sensitive to other load on the machine;
* ``warm_s``: a second call in the same process;
* ``process_s``: the whole child process, interpreter start and ``import placement_opt`` included;
* ``peak_rss``: ``ru_maxrss`` of the child (the whole process, torch and transformers included).

Goal (issue 2): <= 5 s and <= 2 GB RSS per model.

Usage::

    python benchmarks/tracing/run.py            # 5 fresh processes per model, writes RESULTS.md here
    python benchmarks/tracing/run.py --quick    # 1 process per model
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: (catalog preset, granularity): the two largest Llama shapes per block; Falcon-40B, whose decoder layers return a
#: tuple (the decode probe ran all 60 of them until 2026-12-01); the 405B per module, the finest graph.
MODELS = (("llama-3-70b", "block"), ("llama-3.1-405b", "block"), ("falcon-40b", "block"), ("llama-3.1-405b", "module"))
GOAL_S = 5.0
GOAL_RSS_BYTES = 2 * 10**9

_CHILD = """
import json, resource, time
t0 = time.perf_counter()
from placement_opt import trace
t1 = time.perf_counter()
c1 = time.process_time()
import importlib
import transformers  # what the first trace() imports anyway: timed apart from our own work
from transformers import AutoModelForCausalLM
from placement_opt.model import catalog
kind = catalog.model_config({model!r}).model_type
importlib.import_module(f"transformers.models.{{kind}}.modeling_{{kind}}")
t2 = time.perf_counter()
c2 = time.process_time()
graph = trace({model!r}, granularity={granularity!r})
c3 = time.process_time()
t3 = time.perf_counter()
trace({model!r}, granularity={granularity!r})
t4 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "hf_import_s": t2 - t1, "hf_import_cpu_s": c2 - c1,
                  "trace_s": t3 - t2, "trace_cpu_s": c3 - c2, "first_s": t3 - t1, "first_cpu_s": c3 - c1,
                  "warm_s": t4 - t3,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "units": len(graph), "edges": graph.nx.number_of_edges(),
                  "param_bytes": graph.total_param_bytes, "traced": graph.meta.traced,
                  "replayed": graph.meta.extra.get("replayed_blocks", 0)}}))
"""


def measure(model: str, granularity: str) -> dict[str, float]:
    """One fresh interpreter tracing ``model`` at ``granularity``; returns its timings and peak RSS."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD.format(model=model, granularity=granularity)],
                          capture_output=True, text=True,
                          check=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def machine() -> str:
    import torch
    import transformers

    mem = ""
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / 2**20:.0f} GiB RAM, "
    except OSError:
        pass
    load = ", load average {:.1f} / {:.1f} / {:.1f} at start".format(*os.getloadavg())
    return (f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {mem}"
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
            f"{load}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one process per model")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per model (default 5)")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    host = machine()
    runs: dict[tuple[str, str], list[dict[str, float]]] = {m: [] for m in MODELS}
    for _ in range(repeats):  # interleaved, so that load from elsewhere hits every model alike
        for model in MODELS:
            runs[model].append(measure(*model))
    rows = []
    for model in MODELS:
        keys = ("first_s", "first_cpu_s", "hf_import_s", "hf_import_cpu_s", "trace_s", "trace_cpu_s", "warm_s",
                "import_s", "process_s", "peak_rss")
        med = {k: statistics.median(r[k] for r in runs[model]) for k in keys}
        rows.append((f"{model[0]} ({model[1]})", runs[model][0], med, max(r["peak_rss"] for r in runs[model])))
        print(f"{model[0]} ({model[1]}): first trace {med['first_s']:.2f} s (CPU {med['first_cpu_s']:.2f} s, of which transformers "
              f"imports {med['hf_import_cpu_s']:.2f} s), warm {med['warm_s']:.2f} s, process {med['process_s']:.2f} s,"
              f" peak RSS {med['peak_rss'] / 2**20:.0f} MiB", flush=True)
    write_results(host, repeats, rows, " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]))


def write_results(host: str, repeats: int, rows: list, command: str) -> None:
    lines = [
        "# Tracing: time and memory", "",
        "Question: how long does `placement_opt.trace` take on the largest catalog models, and how much memory?",
        f"Goal: <= {GOAL_S:.0f} s and <= {GOAL_RSS_BYTES / 1e9:.0f} GB peak RSS per model.", "",
        f"- Machine: {host}",
        f"- Command: `python {command}`",
        f"- Date: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- Medians of {repeats} fresh processes per model, models interleaved (batch 1, seq_len 64, dtype from "
        "the config). The goal is judged on the first trace() call (wall) and the worst peak RSS.",
        "",
        "| model (granularity) | units | edges | weights (GiB) | first trace() wall (CPU) s | transformers imports wall (CPU) s "
        "| placement_opt's work wall (CPU) s | warm trace() s | import placement_opt s | whole process s "
        "| peak RSS MiB | goal met |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for model, first, med, worst_rss in rows:
        met = med["first_s"] <= GOAL_S and worst_rss <= GOAL_RSS_BYTES
        lines.append(
            f"| {model} | {first['units']} | {first['edges']} | {first['param_bytes'] / 2**30:.1f} "
            f"| {med['first_s']:.2f} ({med['first_cpu_s']:.2f}) | {med['hf_import_s']:.2f} ({med['hf_import_cpu_s']:.2f}) "
            f"| {med['trace_s']:.2f} ({med['trace_cpu_s']:.2f}) | {med['warm_s']:.2f} | {med['import_s']:.2f} "
            f"| {med['process_s']:.2f} "
            f"| {med['peak_rss'] / 2**20:.0f} (max {worst_rss / 2**20:.0f}) | {'yes' if met else 'NO'} |")
    lines += [
        "",
        "`first trace()` is the first call in a new process: the transformers modules it imports (config, "
        "Auto classes, modeling code; timed apart) plus placement_opt's own work (build on meta, one meta "
        "forward, the graph). `warm trace()` is a second call in the same process. Peak RSS is the whole process "
        "(torch and transformers included); no weight is ever allocated. Identical decoder blocks are run once "
        "on meta and replayed (`graph.meta.extra['replayed_blocks']`); the decode probe runs two of each kind.",
        "",
    ]
    (HERE / "RESULTS.md").write_text("\n".join(lines), encoding="utf-8")


if __name__ == "__main__":
    main()
