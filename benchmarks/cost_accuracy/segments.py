"""Where a capped plan runs out of GPU memory: allocated against reserved at the OOM, by allocator setting.

The Llama-3.1-8B shape with tiled random bf16 weights built in RAM (no checkpoint), solved for batch 1 and 16 x 4096
prompt tokens with ``max_memory={0: "10GiB", "cpu": "100GiB"}`` from the profile ``PROFILE`` (default
``benchmarks/phases/h200-host-profile-2.json``, whose calibrations apply on a host of its name), dispatched under
``torch.cuda.set_per_process_memory_fraction(10 GiB / total)`` and run through ``time_generation`` (4 decode steps);
one JSON line per row is appended to OUT: the predicted cuda:0 parts, the OOM message or the prefill time, the
allocator's statistics and its largest segments. Run once per allocator setting, in fresh processes:

    python benchmarks/cost_accuracy/segments.py OUT.json
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/cost_accuracy/segments.py OUT.json

``--smoke``: a tiny Llama, solved only (no GPU needed): checks the script. Results: GPU.md beside this file.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
os.environ["PLACEMENT_OPT_PROFILE"] = os.environ.get("PROFILE", str(HERE.parent / "phases" / "h200-host-profile-2.json"))

import torch  # noqa: E402 - after the profile's variable
import transformers as T  # noqa: E402

import placement_opt  # noqa: E402
from placement_opt.cost.evaluate import predicted_memory  # noqa: E402
from placement_opt.cost.workload import Workload  # noqa: E402
from placement_opt.model.tracer import trace  # noqa: E402
from placement_opt.runtime.timing import time_generation  # noqa: E402

sys.path.insert(0, str(HERE.parent))
from run import GPU_SHAPE as SHAPE  # noqa: E402 - the memory step's Llama-3.1-8B shape, and its smoke one
from run import SMOKE_SHAPE  # noqa: E402

from gpu_common import freeze_imports, random_model  # noqa: E402

MAX_MEMORY = {0: "10GiB", "cpu": "100GiB"}
STATS = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
         "reserved_bytes.all.peak", "inactive_split_bytes.all.current", "inactive_split_bytes.all.peak",
         "num_alloc_retries", "num_ooms", "active_bytes.all.peak")


def build(shape: dict[str, int]) -> tuple[Any, Path]:
    """The model in RAM with tiled random weights (norms at 1), and a folder with its config to solve from."""
    config = T.LlamaConfig(**shape, tie_word_embeddings=False, max_position_embeddings=8192)
    config.dtype = "bfloat16"
    folder = Path(tempfile.mkdtemp())
    config.save_pretrained(folder)
    return random_model(config).eval(), folder


def run_capped(model: Any, plan: Any, row: dict[str, Any], vocab: int) -> None:
    """Dispatch ``plan`` under the 10 GiB cap and generate; the outcome and the allocator's figures into ``row``."""
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((10 << 30) / total, 0)
    torch.cuda.reset_peak_memory_stats(0)
    handle = None
    try:
        handle = placement_opt.dispatch(model, plan)
        row["after_dispatch"] = torch.cuda.memory_allocated(0)
        ids = torch.randint(0, vocab, (row["batch"], row["prompt"]), device="cuda:0")
        row["prefill_s"] = time_generation(handle, ids, 5).prefill_s
        row["ok"] = True
    except torch.cuda.OutOfMemoryError as exc:
        row["ok"], row["oom"] = False, str(exc)
    except Exception:  # noqa: BLE001 - a row that failed says why
        row["ok"], row["error"] = False, traceback.format_exc()[-1500:]
    stats = torch.cuda.memory_stats(0)
    row["stats"] = {k: stats.get(k) for k in STATS}
    row["snapshot_segments"] = sorted((s["total_size"], s["allocated_size"]) for s in torch.cuda.memory_snapshot())[-12:]
    if handle is not None:
        handle.remove()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0, 0)


def main() -> None:
    smoke = "--smoke" in sys.argv
    shape = SMOKE_SHAPE if smoke else SHAPE
    started = time.time()
    model, folder = build(shape)
    print("built", time.time() - started, flush=True)
    graph = trace(str(folder))
    mode = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"
    with open(sys.argv[1], "a", encoding="utf-8") as out:
        for batch, prompt in [(1, 64)] if smoke else [(1, 4096), (16, 4096)]:
            row: dict[str, Any] = {"alloc_conf": mode, "batch": batch, "prompt": prompt}
            workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=16)
            plan = placement_opt.solve(str(folder), MAX_MEMORY, workload=workload, time_limit_s=2)
            use = predicted_memory(plan, graph, MAX_MEMORY, workload)["cuda:0"]
            row["predicted"] = {k: getattr(use, k) for k in ("weights_bytes", "kv_cache_bytes", "workspace_bytes",
                                                             "stream_buffer_bytes", "used_bytes", "peak_unit")}
            if torch.cuda.is_available():
                run_capped(model, plan, row, shape["vocab_size"])
            print(json.dumps(row)[:600], flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()


if __name__ == "__main__":
    freeze_imports()
    main()
