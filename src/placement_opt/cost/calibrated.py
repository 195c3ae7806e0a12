"""Unit times measured on the model itself (:func:`placement_opt.calibrate`), as pricing reads them.

:func:`placement_opt.calibrate` runs one unit of each distinct shape through the project's own
dispatch path and saves, per shape and compute device, the seconds of a prefill forward at some
``(batch, prompt)`` and of a decode step at some ``(batch, context)``; with a GPU, also the seconds
of copying the unit's weights in (the pinned prefetch of ``stream``, accelerate's pageable
per-tensor copies of ``stream_sync``). Pricing (:mod:`.pricing`) uses them in place of the roofline
wherever they exist:

* prefill: piecewise linear in ``batch x prompt`` tokens through the measured points, the end
  segments extended (one point: proportional above it, flat below it);
* decode step ``t`` (context ``prompt + t + 1``): for each measured batch a line in the context
  (attention units; a constant for the others), interpolated linearly between measured batches;
* copies: the measured seconds of the unit's copy on that link.

A unit's figure includes the time between it and the next unit (masks, rotary embeddings, the
model's own glue), so the units' figures add up to the whole forward, small models included.

Figures apply only to devices the saved profile of this machine measured (``source`` starting with
``"measured"``, whatever form ``devices`` took) and only on the host that calibrated. Training
steps are always priced by the roofline.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ProfileFormatError
from ..hardware.profile_store import saved_calibration

if TYPE_CHECKING:  # pragma: no cover
    from ..hardware.devices import Machine
    from ..model.graph import LayerGraph, UnitInfo

__all__ = ["UnitTimes", "Calibration", "shape_key", "calibration_for", "line_through"]


def shape_key(unit: UnitInfo, dtype: str, traced_seq_len: int) -> str:
    """A stable name of what a unit's time depends on: its class, sizes, FLOPs and dtype (not its name).

    Two units with the same key run the same kernels on the same shapes (the decoder layers of one
    model; the same layer shape in two models of one family).
    """
    base_flops = max(0, unit.flops_per_token - unit.attn_flops_per_token_per_ctx * traced_seq_len)
    facts = [unit.module_class, dtype, unit.param_bytes, unit.buffer_bytes, base_flops,
             unit.attn_flops_per_token_per_ctx, unit.out_bytes_per_token, unit.kv_bytes_per_token,
             unit.moe_num_experts, unit.moe_experts_per_token, unit.moe_expert_bytes, len(unit.param_names),
             unit.in_decode]
    if unit.kv_window_tokens is not None:  # a sliding layer's decode stops growing; keys of others unchanged
        facts.append(unit.kv_window_tokens)
    if unit.latent_expand_flops_per_ctx is not None:  # latent attention's step grows with it; others unchanged
        facts.append(unit.latent_expand_flops_per_ctx)
    return hashlib.sha1(json.dumps(facts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class UnitTimes:
    """The measured seconds of one unit shape on one compute device."""

    prefill: tuple[tuple[int, int, float, str], ...] = ()
    """``(batch, prompt, seconds, logits kept)`` of prefill forwards."""
    decode: tuple[tuple[int, int, float], ...] = ()
    """``(batch, context, seconds)`` of decode steps (context: cached tokens + 1)."""
    attention: bool = False
    """Whether a decode step grows with the context (the unit attends to a KV cache)."""

    def prefill_s(self, batch: int, prompt: int, logits: str) -> float | None:
        """Seconds of a prefill forward, or None when nothing was measured for ``logits``."""
        points = sorted((b * p, s) for b, p, s, kept in self.prefill if kept == logits)
        if not points:
            return None
        return _along(_merged(points), batch * prompt)

    def decode_line(self, batch: int, first_context: int) -> tuple[float, float] | None:
        """Seconds of decode step ``t`` as ``(a, b)``: ``a + b t``, context ``first_context + t``."""
        by_batch: dict[int, list[tuple[int, float]]] = {}
        for b, context, seconds in self.decode:
            by_batch.setdefault(b, []).append((context, seconds))
        if not by_batch:
            return None
        lines = sorted((b, line_through(points, self.attention)) for b, points in by_batch.items())
        intercept = _along([(b, c) for b, (c, _) in lines], batch)
        slope = max(0.0, _along([(b, m) for b, (_, m) in lines], batch)) if self.attention else 0.0
        return max(0.0, intercept + slope * first_context), slope


def line_through(points: Sequence[tuple[int, float]], sloped: bool) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of seconds against context; slope 0 and the mean when flat."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if not sloped or spread == 0:
        return mean_y, 0.0
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread)
    return mean_y - slope * mean_x, slope


def _merged(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points with equal x averaged (two shapes with the same token count)."""
    groups: dict[float, list[float]] = {}
    for x, y in points:
        groups.setdefault(x, []).append(y)
    return [(x, sum(ys) / len(ys)) for x, ys in sorted(groups.items())]


def _along(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise linear through ``points`` (sorted by x), the end segments extended.

    One point: proportional above it (more tokens, more work), flat below it (overheads stay). Below
    the first point the value never drops under the first point's times ``x / x0``.
    """
    points = _merged(points)
    if len(points) == 1:
        x0, y0 = points[0]
        return y0 * x / x0 if x > x0 > 0 else y0
    if x <= points[0][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
        extended = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return max(extended, y0 * x / x0 if x0 > 0 else 0.0, 0.0)
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return max(y1 + (y1 - y0) * (x - x1) / (x1 - x0), y1)


@dataclass(frozen=True)
class Calibration:
    """The calibrated figures that apply to one graph on one machine, by unit name."""

    compute: Mapping[str, Mapping[str, UnitTimes]] = field(default_factory=dict)
    """unit name -> execution device -> its measured times."""
    copies: Mapping[str, Mapping[tuple[str, str, str], tuple[float, float]]] = field(default_factory=dict)
    """unit name -> (storage, execution, mode) -> seconds its weights add to a prefill and to a decode step."""
    read_batch: Mapping[str, int] = field(default_factory=dict)
    """MoE unit name -> the batch of its calibrated cold decode steps from disk (``disk -> cpu``, ``stream``): the
    experts that batch hits are what the step read (:func:`~.traffic.routed_read_s` scales by them)."""
    host: str = ""
    """The host that measured them (``""``: unknown)."""

    def times(self, unit: str, device: str) -> UnitTimes | None:
        return self.compute.get(unit, {}).get(device)

    def copy_s(self, unit: str, storage: str, execution: str, mode: str, phase: str = "decode") -> float | None:
        """Seconds the unit's weights add per forward on that path, in ``phase`` (``"prefill"``/``"decode"``)."""
        both = self.copies.get(unit, {}).get((storage, execution, mode))
        return None if both is None else both[0 if phase == "prefill" else 1]

    def __bool__(self) -> bool:
        return bool(self.compute) or bool(self.copies)


def calibration_for(graph: LayerGraph, machine: Machine, saved: Mapping[str, Any] | None = None) -> Calibration | None:
    """The saved calibration's figures for ``graph``'s units on ``machine``'s measured devices; None if none.

    Args:
        saved: the ``"calibration"`` entry of a profile; default the one of ``machine.profile_path`` (whichever host
            measured it: the machine is that file's), else of this host's saved profile
            (:func:`~placement_opt.hardware.profile_store.saved_calibration`).
    """
    measured = {d.name for d in machine.devices if d.source.startswith("measured")}
    if not measured:
        return None
    if saved is None:
        saved = saved_calibration(machine.profile_path, any_host=machine.profile_path is not None)
    if not saved:
        return None
    entries = saved.get("units", {})
    compute: dict[str, dict[str, UnitTimes]] = {}
    copies: dict[str, dict[tuple[str, str, str], float]] = {}
    batches: dict[str, int] = {}
    for unit in graph.units():
        entry = entries.get(shape_key(unit, graph.meta.dtype, graph.meta.seq_len))
        if not entry:
            continue
        attention = bool(entry.get("attention", False))
        on = {d: _unit_times(t, attention) for d, t in entry.get("devices", {}).items() if d in measured}
        if on:
            compute[unit.name] = on
        links = {_link(k, m): _phases(s) for k, modes in entry.get("links", {}).items() for m, s in modes.items()
                 if all(end in measured for end in k.split("->"))}
        if links:
            copies[unit.name] = links
        batch = _read_batch(entry.get("links", {}).get("disk->cpu", {}).get("stream"))
        if batch is not None and ("disk", "cpu", "stream") in links:  # the disk's read applies here
            batches[unit.name] = batch
    found = Calibration(compute, copies, batches, str(saved.get("host", "")))
    return found if found else None


def _phases(seconds: Any) -> tuple[float, float]:
    """A saved copy time: one figure for both phases, or ``{"prefill": s, "decode": s}``."""
    try:
        both = ((float(seconds["prefill"]), float(seconds["decode"])) if isinstance(seconds, Mapping)
                else (float(seconds), float(seconds)))
    except (KeyError, TypeError, ValueError):
        both = (-1.0, -1.0)
    if not all(math.isfinite(s) and s >= 0 for s in both):
        raise ProfileFormatError("the saved profile's calibration holds a malformed copy time (want seconds >= 0, or "
                           "{'prefill': s, 'decode': s}): run `placement-opt profile --model MODEL` again, or "
                           "delete its 'calibration' entry")
    return both


def _read_batch(seconds: Any) -> int | None:
    """The ``"decode_batch"`` a saved cold read from disk (an MoE unit's) was timed at, None where it has none (a
    profile older than it)."""
    if not isinstance(seconds, Mapping) or "decode_batch" not in seconds:
        return None
    batch = seconds["decode_batch"]
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ProfileFormatError(f"the saved profile's calibration holds a cold read timed at decode_batch={batch!r} (want "
                           f"a whole number >= 1): run `placement-opt profile --model MODEL` again, or delete its "
                           f"'calibration' entry")
    return batch


def _link(key: str, mode: str) -> tuple[str, str, str]:
    storage, execution = key.split("->")
    return storage, execution, mode


def _unit_times(entry: Mapping[str, Any], attention: bool) -> UnitTimes:
    """One device's saved figures; a malformed entry is a :class:`ProfileError` saying what to do."""
    try:
        prefill = tuple((int(b), int(p), float(s), str(kept)) for b, p, s, kept in entry.get("prefill", ()))
        decode = tuple((int(b), int(c), float(s)) for b, c, s in entry.get("decode", ()))
    except (TypeError, ValueError, AttributeError):
        prefill, decode = (), ((0, 0, -1.0),)
    if any(not math.isfinite(s) or s < 0 for *_, s in decode) or any(
            not math.isfinite(s) or s < 0 or b < 1 or p < 1 for b, p, s, _ in prefill):
        raise ProfileFormatError("the saved profile's calibration holds a malformed unit time (want [batch, prompt, "
                           "seconds, 'last'|'all'] and [batch, context, seconds], seconds >= 0): run "
                           "`placement-opt profile --model MODEL` again, or delete its 'calibration' entry")
    return UnitTimes(prefill=prefill, decode=decode, attention=attention)
