"""One offload directory shared by threads and processes that dispatch different models.

Issue 17: with per-process temporary names and one file per unit name, two threads dispatching
different models into one ``offload_dir`` swapped each other's weights (17 of 20 runs), and two
processes left one model's bytes under the other's checksums. Here 4 threads and 2 processes
each dispatch their own tiny Llama (same architecture, so the same unit names; different seeds,
so different weights) 20 times into one directory; every round checks the model's weights while
dispatched, its logits against the plain model's, and its weights after ``.remove()``.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _offload_helpers import dispatch_rounds, tiny_llama
from placement_opt.runtime.offload import MANIFEST_NAME, OffloadStore

ROUNDS = 20
THREAD_SEEDS = (11, 12, 13, 14)
PROCESS_SEEDS = (21, 22)
HELPERS = Path(__file__).parents[1] / "_offload_helpers.py"


def test_threads_and_processes_dispatch_different_models_into_one_directory(tmp_path):
    shared = tmp_path / "offload"
    processes = [subprocess.Popen([sys.executable, str(HELPERS), "rounds", str(shared), str(seed), str(ROUNDS)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for seed in PROCESS_SEEDS]
    try:
        built = {seed: tiny_llama(seed) for seed in THREAD_SEEDS}
        with ThreadPoolExecutor(len(THREAD_SEEDS)) as pool:
            futures = [pool.submit(dispatch_rounds, shared, model, ROUNDS, f"thread seed {seed}")
                       for seed, model in built.items()]
            for future in futures:
                future.result()  # re-raises the thread's assertion, naming seed, round and tensor
        for process in processes:
            out, err = process.communicate(timeout=300)
            assert process.returncode == 0 and out.strip() == "ok", err[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    # Every writer's files are listed and intact; no temporary file is left.
    store = OffloadStore(shared)
    store.verify()
    names = {p.name for p in shared.iterdir()}
    assert not [n for n in names if n.endswith(".tmp")]
    # One file per model for each unit, but one in all for the final norm (initialised to ones) and
    # the rotary table (computed from the config): identical bytes are stored once.
    models = len(THREAD_SEEDS) + len(PROCESS_SEEDS)
    per_unit = Counter(entry["unit"] for entry in store.manifest.values())
    assert per_unit == {"model.embed_tokens": models, "model.layers.0": models, "model.layers.1": models,
                        "lm_head": models, "model.norm": 1, "model.rotary_emb": 1}
    assert names == set(store.manifest) | {MANIFEST_NAME, store.lock_path.name}
