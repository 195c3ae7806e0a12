"""Traced graphs kept on disk, so that planning a model again skips torch, transformers and the meta trace.

``placement-opt plan llama-3-70b ...`` spent 4 of its 4.8 s (2-core CPU, 1 s solve limit) importing torch and
transformers and tracing; the solve took the rest. The graph a trace returns depends only on what is traced and on the code
that traces it, so :func:`traced` keeps each graph under a key of both:

* the model: a catalog preset's published hyperparameters, a ``config.json``'s bytes, or a model directory's
  ``config.json`` with the name, size and modification time of every file beside it (the checkpoint's
  headers can untie the config's ties); a hub id is not cached (its config lives in the hub's own cache);
* the trace's arguments (dtype, granularity, expert groups);
* the code: the installed torch, transformers and placement_opt versions and a digest of placement_opt's own
  source files, so an upgrade or an edit traces again instead of reading a graph the new code would not build.

Only clean traces are kept: one that warned (a static fallback graph, branches) traces again next time, so its
warning is seen every time. An entry that cannot be read (cut off, or written by another version) is traced
again and replaced. The directory holds the :data:`MOST_ENTRIES` most recently used entries; it is
``$PLACEMENT_OPT_CACHE`` or ``~/.cache/placement_opt/graphs``, and removing it loses nothing but time.

Imports no torch: a hit costs a file read (2 ms for Llama-3-70B's block graph, 98 KB, on a 2-core CPU).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from .._files import loads_json, write_text_atomic
from ..errors import PlanFormatError
from .graph import LayerGraph

__all__ = ["traced", "trace_key", "cache_dir", "CACHE_ENV_VAR", "DEFAULT_CACHE_DIR", "MOST_ENTRIES"]

CACHE_ENV_VAR = "PLACEMENT_OPT_CACHE"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "placement_opt" / "graphs"

#: Entries kept: each is a graph (some 50 KB for a 8B block graph, 1 MB for a sublayer 405B one), and a new
#: placement_opt or transformers version writes new ones beside the old.
MOST_ENTRIES = 64

#: What an entry's file is named; only such files are ever removed from the directory (it may be the user's).
_ENTRY = re.compile(r"graph-[0-9a-f]{64}\.json")

#: Bumped when an entry's layout changes (the graph's own schema version is checked by LayerGraph.from_dict).
_FORMAT = 1


def cache_dir() -> Path:
    """Where the graphs are kept: ``$PLACEMENT_OPT_CACHE``, else :data:`DEFAULT_CACHE_DIR`."""
    where = os.environ.get(CACHE_ENV_VAR)
    return Path(where).expanduser() if where else DEFAULT_CACHE_DIR


def traced(model: str, trace_it: Callable[[], LayerGraph], *, dtype: str | None, granularity: str,
           expert_groups: int, use_cache: bool = True) -> tuple[LayerGraph, bool]:
    """(the graph of ``model``, whether it came from the cache): the cached graph when there is one, else
    ``trace_it()``'s, kept when its trace raised no warning.

    ``model``: what the user named (a preset, a config.json path, a model directory, a hub id);
    ``trace_it``: traces it with the same ``dtype``, ``granularity`` and ``expert_groups``. A cache that cannot
    be written (a read-only home) is said in one warning, and the graph is returned all the same.
    """
    key = trace_key(model, dtype=dtype, granularity=granularity, expert_groups=expert_groups) if use_cache else None
    if key is not None and (graph := _read(key)) is not None:
        return graph, True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = trace_it()
    # shown as the trace raised them, after the block that held them back; "always" above records a warning
    # raised once per layer as many times, and the default filters would have shown it once per place
    for w in {(w.category, str(w.message), w.filename, w.lineno): w for w in caught}.values():
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if key is not None and not caught:
        try:
            _write(key, graph)
        except OSError as exc:
            warnings.warn(f"placement_opt: could not keep the traced graph in {cache_dir()} ({exc}); the next "
                          f"plan traces again. Set {CACHE_ENV_VAR} to a writable directory", UserWarning,
                          stacklevel=2)
    return graph, False


def trace_key(model: str, *, dtype: str | None, granularity: str, expert_groups: int) -> str | None:
    """The hex digest naming ``model``'s graph under these arguments and this code; None for what is not cached
    (a hub id, or a path that cannot be read)."""
    try:
        source = _source_identity(model)
    except OSError:
        return None
    if source is None:
        return None
    facts = {"format": _FORMAT, "source": source, "dtype": dtype, "granularity": granularity,
             "expert_groups": expert_groups, "code": _code_identity()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _source_identity(model: str) -> dict[str, Any] | None:
    """What the trace of ``model`` reads, as JSON-able facts (module docstring)."""
    from . import catalog

    path = Path(model).expanduser()  # a path first, as the command line reads its MODEL
    if path.is_file():
        return {"config_json": hashlib.sha256(path.read_bytes()).hexdigest()}
    if path.is_dir():
        files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path) if e.is_file())
        return {"config_json": hashlib.sha256((path / "config.json").read_bytes()).hexdigest(), "files": files}
    name = model.strip().lower()
    if name in catalog.list_models():
        entry = catalog.preset(name)
        return {"preset": entry.name, "class": entry.config_class, "hyperparameters": entry.hyperparameters}
    return None


@functools.cache
def _code_identity() -> dict[str, str]:
    """The versions of what traces, and a digest of placement_opt's source (an editable install's edits)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return {"placement_opt": _version("placement-opt"), "torch": _version("torch"),
            "transformers": _version("transformers"), "source": digest.hexdigest()}


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "absent"


def _entry(key: str) -> Path:
    return cache_dir() / f"graph-{key}.json"


def _read(key: str) -> LayerGraph | None:
    """The graph kept under ``key``, or None when there is none or it cannot be read back."""
    path = _entry(key)
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("key") != key:
            return None
        graph = LayerGraph.from_dict(data["graph"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, PlanFormatError):
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # most recently used: the last to be removed
    return graph


def _write(key: str, graph: LayerGraph) -> None:
    """Keep ``graph`` under ``key``, then remove the least recently used entries beyond :data:`MOST_ENTRIES`."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    write_text_atomic(_entry(key), json.dumps({"format": _FORMAT, "key": key, "graph": graph.to_dict()}))
    _prune(directory)


def _prune(directory: Path) -> None:
    """Remove the oldest entries beyond :data:`MOST_ENTRIES` (by modification time, which a read renews)."""
    entries = []
    with contextlib.suppress(OSError):
        for e in os.scandir(directory):
            if _ENTRY.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    entries.append((e.stat(follow_symlinks=False).st_mtime_ns, e.path))
    for _, path in sorted(entries)[:-MOST_ENTRIES]:
        with contextlib.suppress(OSError):
            os.unlink(path)
