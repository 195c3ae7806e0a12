"""The saved profile of this machine (JSON) and the measured :class:`~.devices.Device` it gives back.

:func:`~.profiler.profile` writes it; :func:`saved_device` reads it for :func:`~.detect.detect_device`.

The same file keeps the per-unit times of :func:`placement_opt.calibrate` under ``"calibration"``
(an optional key: profiles written before it load as they did). Its ``"host"`` says which machine
measured them; :func:`saved_calibration` returns them only on that host, so a profile copied to
another machine keeps its device figures but never prices that machine with this one's unit times.
"""

from __future__ import annotations

import json
import os
import platform
import re
import tempfile
from pathlib import Path
from typing import Any

from .._files import foreign_file, loads_json, refusal, write_text_atomic
from ..errors import PlanFormatError, ProfileError, ProfileFormatError
from ..schema import ProfileSchema, validated
from .devices import Device, normalize_device_name

__all__ = [
    "saved_device",
    "load_profile",
    "unread_profile",
    "profile_path",
    "DEFAULT_PROFILE_PATH",
    "PROFILE_ENV_VAR",
    "PROFILE_SCHEMA_VERSION",
    "PROFILED_DTYPES",
    "dtype_key",
    "device_from_measurement",
    "fallback_dtype",
    "saved_calibration",
    "measured_elsewhere",
    "save_calibration",
    "write_profile",
    "this_host",
]

PROFILE_SCHEMA_VERSION = 1


PROFILE_ENV_VAR = "PLACEMENT_OPT_PROFILE"


DEFAULT_PROFILE_PATH = Path.home() / ".cache" / "placement_opt" / "profile.json"


#: Dtypes whose compute speed is measured (a Device carries the FLOP/s of one dtype).
PROFILED_DTYPES = ("float32", "bfloat16", "float16")


_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}


def profile_path(path: str | os.PathLike[str] | None = None) -> Path:
    """Where the profile is read and written: ``path``, else ``$PLACEMENT_OPT_PROFILE``, else the default."""
    if path is not None:
        return Path(path)
    env = os.environ.get(PROFILE_ENV_VAR)
    return Path(env) if env else DEFAULT_PROFILE_PATH


def load_profile(path: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The saved profile as a dict, or None when there is none (or it has another schema version).

    Raises:
        ProfileFormatError: the file exists but is not JSON (names the file and what to do).
        PlanFormatError: a profile of this schema version whose entries are malformed (names the file).
    """
    where = profile_path(path)
    try:
        raw = where.read_bytes()
    except OSError:
        return None
    try:
        data = loads_json(raw)
    except ValueError as exc:  # UnicodeDecodeError too: a binary file is not a profile
        raise ProfileFormatError(f"the saved profile {str(where)!r} is not JSON (cut off? {exc}): delete it "
                                 f"(placement-opt profile then writes a new one there), or name another file") from None
    if not isinstance(data, dict) or data.get("schema_version") != PROFILE_SCHEMA_VERSION:
        return None
    validated(ProfileSchema, data, what=f"the saved profile {str(where)!r}",
              fix="run `placement-opt profile` again, or delete the file")
    return data


def dtype_key(dtype: str) -> str:
    """A dtype as the profile keys it: ``"torch.float16"``, ``"half"``, ``"fp16"`` -> ``"float16"``."""
    key = str(dtype).replace("torch.", "")
    return _ALIASES.get(key, key)


def saved_device(name: str, *, dtype: str = "float16",
                 path: str | os.PathLike[str] | None = None) -> Device | None:
    """The measured figures of ``name`` from the saved profile of this machine, if any.

    Args:
        name: ``"cpu"``, ``"disk"`` or ``"cuda:N"``.
        dtype: the model dtype whose compute speed the device should carry.
        path: profile file; default :func:`profile_path`.

    Returns:
        A ``Device`` whose ``source`` starts with ``"measured"``, or None when nothing was measured.
    """
    data = load_profile(path)
    if data is None:
        return None
    entry = data.get("measurements", {}).get(normalize_device_name(name))
    if entry is None:
        return None
    return device_from_measurement(normalize_device_name(name), entry, dtype_key(dtype), data["created"])


def device_from_measurement(name: str, entry: dict[str, Any], dtype: str, created: str) -> Device:
    """The :class:`Device` one saved measurement describes, carrying the FLOP/s of ``dtype``."""
    source = f"measured {created[:10]}"
    memory = int(entry["memory_bytes"])
    if name == "disk":
        # Offloaded weights are read through memory maps (placement_opt computes from them,
        # accelerate copies out of them): the rate of that path, not of read() calls, is the figure.
        rate = entry.get("mapped_read_bytes_per_s") or entry["sequential_read_bytes_per_s"]
        return Device(name, memory, bandwidth=rate, source=source, random_read=entry.get("random_read_bytes_per_s"),
                      random_read_latency_s=entry.get("random_read_latency_s"))
    flops = _of_dtype(entry["matmul_flops_per_s"], dtype)
    curve = [tuple(p) for p in _of_dtype(entry.get("linear_flops_by_tokens", {}), dtype) or ()]
    used = _measured_key(entry["matmul_flops_per_s"], dtype)
    if used is not None and used != dtype:  # said in the source (fallback_dtype reads it): dtypes' speeds differ
        source = f"{source}, {used} figures ({dtype} not measured)"
    if name == "cpu":
        bandwidth = _of_dtype(entry["matvec_bytes_per_s"], dtype)
        # RAM served at least the fastest matvec (some dtype's cores keep up with it) and a copy's reads
        # and writes together: what the cores and the GPUs' copies share.
        shared = max([*entry["matvec_bytes_per_s"].values(), 2 * entry.get("copy_bytes_per_s", 0), bandwidth])
        return Device(name, memory, flops=flops, bandwidth=bandwidth, source=source, flops_by_tokens=curve,
                      shared_bandwidth=shared, fresh_page=entry.get("fresh_page_bytes_per_s") or None,
                      op_overhead_s=entry.get("op_overhead_s") or None)
    # CUDA path (not exercised on machines without a GPU). The rate back to the host is the staged copy the
    # dispatcher makes (host_copy.to_host); profiles of 2026-11-29 measured a plain .to("cpu") under another key,
    # 40x slower than that copy: they are read without it (the host link prices the copy, as before it was measured)
    return Device(name, memory, flops=flops, bandwidth=entry["copy_bytes_per_s"],
                  host_link=entry["pinned_h2d_bytes_per_s"], peer_link=entry.get("peer_bytes_per_s") or None,
                  source=source, flops_by_tokens=curve, op_overhead_s=entry.get("op_overhead_s") or None,
                  to_host=entry.get("staged_to_host_bytes_per_s") or None)


def _of_dtype(figures: dict[str, Any], dtype: str) -> Any:
    """The figure measured for ``dtype``; else float32's; else the first dtype measured (None if none).

    ``profile`` measures the dtype the user runs, so a profile may hold one dtype only.
    """
    key = _measured_key(figures, dtype)
    return None if key is None else figures[key]


def _measured_key(figures: dict[str, Any], dtype: str) -> str | None:
    """The dtype whose figure :func:`_of_dtype` takes."""
    return next((key for key in (dtype, "float32", *figures) if figures.get(key)), None)


def fallback_dtype(source: str, dtype: str) -> str | None:
    """The dtype whose figures a measured device's ``source`` says it carries because ``dtype`` was not measured
    (:func:`device_from_measurement` writes it); None when it carries ``dtype``'s own."""
    found = re.search(rf"(\w+) figures \({re.escape(dtype)} not measured\)", source)
    return found.group(1) if found else None


# -- calibrated unit times (placement_opt.calibrate) ---------------------------------------------
def this_host() -> str:
    """The name calibrations are keyed by: the machine's network name."""
    return platform.node()


def measured_elsewhere(path: str | os.PathLike[str]) -> str | None:
    """The host that measured the profile at ``path`` when it is another than this one, else None (this host's, no
    host recorded, or no profile there)."""
    host = (load_profile(path) or {}).get("host")
    return host if isinstance(host, str) and host != this_host() else None


def saved_calibration(path: str | os.PathLike[str] | None = None, *,
                      any_host: bool = False) -> dict[str, Any] | None:
    """The calibrated unit times measured on this host, as saved: ``{"host": ..., "units": {...}, "models": {...}}``.

    None when the profile has none, or when another host measured them (unless ``any_host``: a profile named
    as the machine to plan for, whose host is the machine its unit times describe).

    Raises:
        ProfileFormatError: the file is not JSON, or its ``"calibration"`` entry is not a mapping of units.
    """
    data = load_profile(path)
    if data is None or "calibration" not in data:
        return None
    calibration = data["calibration"]
    if (not isinstance(calibration, dict) or not isinstance(calibration.get("units"), dict)
            or not isinstance(calibration.get("models", {}), dict)):
        # calibrating again reads it first, so the entry must go before a new one can be saved
        raise ProfileFormatError(f"the saved profile {str(profile_path(path))!r} has a malformed 'calibration' "
                                 f"entry: delete the entry, then run `placement-opt profile --model MODEL` again")
    if calibration.get("host") != this_host() and not any_host:
        return None
    return calibration


def save_calibration(units: dict[str, Any], model: dict[str, Any], *,
                     path: str | os.PathLike[str] | None = None) -> Path:
    """Merge calibrated unit times into the profile: a unit's device keeps its points at other shapes, so that
    calibrating a second workload adds to the first's (pricing interpolates between them) instead of pricing
    the first from the second's; a point measured again at the same shape replaces the old one, and the
    copies (``links``) are replaced whole.

    ``units``: shape key -> ``{"module_class": ..., "devices": {device: {...}}}``; ``model``: what was
    calibrated (name, fingerprint, workload), listed under ``"models"``. A profile measured on
    another host loses its old calibration (it priced that host, not this one).
    """
    where = profile_path(path)
    data = load_profile(where) or {"schema_version": PROFILE_SCHEMA_VERSION, "created": model["created"],
                                   "measurements": {}}
    old = data.get("calibration") if isinstance(data.get("calibration"), dict) else {}
    if old.get("host") != this_host():
        old = {}
    merged_units = dict(old.get("units", {}))
    for key, entry in units.items():
        previous = merged_units.get(key, {})
        before = previous.get("devices", {})
        devices = {**before, **{d: _with_points(before.get(d), times) for d, times in entry.get("devices", {}).items()}}
        merged_units[key] = {**previous, **entry, "devices": devices}
    models = {**old.get("models", {}), model["fingerprint"]: model}
    data["calibration"] = {"host": this_host(), "units": merged_units, "models": models}
    write_profile(where, data)
    return where


# A calibrated point's shape, the fields before its seconds: prefill (batch, prompt, seconds, logits kept),
# decode (batch, context, seconds).
_POINT_SHAPE = {"prefill": lambda p: (p[0], p[1], p[3]), "decode": lambda p: (p[0], p[1])}


def _point_of(point: Any, phase: str) -> bool:
    """Whether an old saved ``point`` has its phase's form (a malformed one is dropped, not merged)."""
    return isinstance(point, list) and len(point) == (4 if phase == "prefill" else 3)


def _with_points(old: Any, new: dict[str, Any]) -> dict[str, Any]:
    """A device's new figures, with the old points at shapes the new ones did not measure."""
    if not isinstance(old, dict):
        return new
    merged = dict(new)
    for phase, shape in _POINT_SHAPE.items():
        fresh = list(new.get(phase, []))
        measured = {shape(p) for p in fresh}
        points = old.get(phase)
        kept = [p for p in points if _point_of(p, phase) and shape(p) not in measured] if isinstance(points, list) else []
        merged[phase] = sorted(kept + fresh, key=shape)
    return merged


def check_profile_target(path: str | os.PathLike[str] | None) -> Path:
    """The profile file a measurement will be saved to, refused before any measuring where it cannot be: a
    directory, or a file placement_opt did not write as a profile (never written over).

    Raises:
        ProfileError: the path is a directory (or lies under a file), or no file can be made in its folder.
        PlanFormatError: a file there is not a profile.
    """
    where = profile_path(path)
    if where.is_dir():
        raise ProfileError(f"the profile path {str(where)!r} is a directory: name a file in it (path=, "
                           f"$PLACEMENT_OPT_PROFILE), e.g. {str(where / 'profile.json')!r}")
    blocking = next((p for p in where.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ProfileError(f"the profile path {str(where)!r} lies under {str(blocking)!r}, which is a file: name "
                           f"a path in a directory")
    if (why := foreign_file(where, "profile")) is not None:
        raise PlanFormatError(refusal(where, "profile", why))
    if (version := _newer_version(where)) is not None:
        raise ProfileError(f"the profile {str(where)!r} has schema version {version}, written by a newer placement_opt "
                           f"(this one reads version {PROFILE_SCHEMA_VERSION}): it is kept as it is; upgrade "
                           f"placement_opt, or name another path (path=, --out, ${PROFILE_ENV_VAR})")
    if (why := _unwritable(where)) is not None:
        raise ProfileError(_cannot_save(where, why))
    return where


def unread_profile(path: str | os.PathLike[str] | None = None) -> str | None:
    """Why the profile at ``path`` (default :func:`profile_path`) is there but not read, else None: a newer
    placement_opt wrote it (:func:`load_profile` returns None for it, and the devices fall back to presets)."""
    where = profile_path(path)
    if (version := _newer_version(where)) is None:
        return None
    return (f"the saved profile {str(where)!r} has schema version {version}, a newer placement_opt's, and is not read "
            f"(this one reads version {PROFILE_SCHEMA_VERSION}): upgrade placement_opt to use it")


def _newer_version(where: Path) -> int | None:
    """The schema version of a profile at ``where`` newer than this code reads (never written over: the figures and
    calibrations it holds may be keyed in ways this version would drop), else None. Older versions are replaced."""
    try:
        version = loads_json(where.read_text(encoding="utf-8")).get("schema_version")
    except (OSError, ValueError, AttributeError):  # absent, unreadable or not a mapping: foreign_file said so first
        return None
    newer = isinstance(version, int) and not isinstance(version, bool) and version > PROFILE_SCHEMA_VERSION
    return version if newer else None


def _unwritable(where: Path) -> str | None:
    """Why no file can be made where ``where`` goes (a read-only folder, /proc), or None: its nearest existing folder
    is tried with a temporary file, as the atomic write makes one there."""
    folder = next((p for p in where.parents if p.exists()), Path("."))
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def _cannot_save(where: Path, why: str) -> str:
    return (f"the profile cannot be saved to {str(where)!r} ({why}): name a path in a directory you can write to "
            f"(path=, --out, ${PROFILE_ENV_VAR})")


def write_profile(where: Path, data: dict[str, Any]) -> None:
    """Write the profile atomically: a reader sees the old file or the new one, never half of one.

    Raises:
        PlanFormatError: a file at ``where`` is not a profile (a plan, a checkpoint's config.json): never written over.
        ProfileError: the file cannot be written (the folder is read-only, the disk is full).
    """
    if (why := foreign_file(where, "profile")) is not None:
        raise PlanFormatError(refusal(where, "profile", why))
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(where, json.dumps(data, indent=1))
    except OSError as exc:  # the folder became read-only, or the disk is full: the old file is kept whole
        raise ProfileError(_cannot_save(where, exc.strerror or str(exc))) from None
