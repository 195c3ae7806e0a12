"""What the GPU benchmarks share (``cost_accuracy/run.py --gpu-only`` and ``phases/gpu.py``): a checkpoint of a
published shape with random weights, and the machine's profile.

A GPU machine is lent for minutes, and writing a 16 GB checkpoint or profiling the machine takes a good share of
them. With ``BENCH_SHARED`` set to a folder (``device_check.sh`` sets it; the folder stays for the next call while
the machine is warm, and goes with the machine), each checkpoint is written there once, under a name made of its shape, and every later step of
the call that asks for the same shape reads it; the profile (and the calibrations ``calibrate()`` adds to it) lives
there as well, and a step whose devices and dtype were profiled already skips ``profile()``. Without it each
benchmark writes into its own scratch folder, which it removes.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["SHARED_ENV", "freeze_imports", "shared_folder", "use_profile", "profile_once", "random_checkpoint", "remove_unshared"]

#: The environment variable naming the folder the steps of one device_check.sh call share.
SHARED_ENV = "BENCH_SHARED"


#: What transformers imports lazily, on the first model of a shape: imported before the freeze, so that it is frozen too.
MODELING_MODULES = ("transformers.models.llama.modeling_llama", "transformers.models.mixtral.modeling_mixtral",
                    "transformers.models.qwen2_moe.modeling_qwen2_moe", "transformers.generation.utils")


def freeze_imports() -> None:
    """Take what is alive now, and the modules of :data:`MODELING_MODULES` (torch, transformers and placement_opt:
    some 260 thousand objects that live as long as the process), out of every later garbage collection.
    ``time_generation`` runs a full ``gc.collect()`` before it reads the resident set, once per timed run: about
    0.16-0.23 s each with those objects counted, microseconds without. What the runs leave unreachable is collected
    as before. Call it in a script's ``__main__`` block, after the imports and before the first model is built."""
    for name in MODELING_MODULES:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()


def shared_folder() -> Path | None:
    """The folder the steps share (created), or None."""
    name = os.environ.get(SHARED_ENV)
    if not name:
        return None
    folder = Path(name)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def use_profile(work: Path) -> Path:
    """Point placement_opt at the shared profile, else at one in ``work`` (never the user's own); return it."""
    where = (shared_folder() or work) / "profile.json"
    os.environ["PLACEMENT_OPT_PROFILE"] = str(where)
    return where


def profile_once(devices: Iterable[str], dtype: str, quick: bool) -> None:
    """``placement_opt.profile(devices, dtype=dtype)``, unless a step of this call profiled them already."""
    import placement_opt

    devices = list(devices)
    shared = shared_folder()
    marker = None if shared is None else shared / f"profiled-{'-'.join(devices)}-{dtype}{'-quick' if quick else ''}"
    if marker is not None and marker.exists():
        print(f"profile of {', '.join(devices)} ({dtype}) read from {shared}: measured by an earlier step", flush=True)
        return
    placement_opt.profile(devices, dtype=dtype, quick=quick)
    if marker is not None:
        marker.touch()


def random_checkpoint(config: Any, work: Path, shard: str = "4GB") -> Path:
    """A ``save_pretrained`` checkpoint of ``config`` (a transformers config, its ``dtype`` set) with
    :func:`random_model`'s weights. In the shared folder when there is one (written once; a step stopped while
    writing leaves no half checkpoint under the name), else in ``work``. Free it with :func:`remove_unshared`."""
    shared = shared_folder()
    key = json.dumps({"class": type(config).__name__, **config.to_diff_dict()}, sort_keys=True, default=str)
    name = f"{config.model_type}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    path = (shared or work) / name
    if shared is not None and (path / "config.json").exists():
        print(f"checkpoint {path} written by an earlier step: read again", flush=True)
        return path
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = random_model(config)
    model.save_pretrained(partial, max_shard_size=shard)
    del model
    partial.rename(path)  # config.json appears under the name only with every shard beside it
    return path


def random_model(config: Any) -> torch.nn.Module:
    """``config``'s causal LM in RAM, in its ``dtype``: calibrate's tiled random block (a copy at memory speed, where
    drawing 8 B values one by one takes about 90 s), norms at 1, so that many layers keep their activations (and
    greedy tokens) apart."""
    import transformers as T
    from transformers.initialization import no_init_weights

    from placement_opt.runtime._calibrate_build import fill

    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype))
    with no_init_weights():
        model = T.AutoModelForCausalLM.from_config(config, dtype=dtype)
    fill(model)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)
    return model


def remove_unshared(path: Path) -> None:
    """Remove a checkpoint of :func:`random_checkpoint` unless the steps share it (it stays for the next step)."""
    if shared_folder() is None or path.parent != shared_folder():
        shutil.rmtree(path, ignore_errors=True)
