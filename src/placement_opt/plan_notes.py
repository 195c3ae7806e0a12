"""What a plan says beside its figures: the notes :func:`~placement_opt.planner.solve` attaches to it.

Two kinds. What the figures rest on: speeds measured in another dtype, assumed instead of measured, or
calibrated on the model itself; a context past the model's trained length. And what accelerate cannot express
of the placement, so that ``from_pretrained(device_map=plan.device_map)`` would not run it as priced: phased
units, CPU-computed units beside GPUs, a layer's experts split, sublayer units copied together. Each function
returns its note (or notes), or nothing when it does not apply.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .cost.calibrated import calibration_for
from .hardware.presets import PRESETS
from .hardware.profile_store import fallback_dtype, measured_elsewhere, this_host, unread_profile
from .hardware.resolve import assumed_preset, reserve_note, unitless_note
from .model.expert_groups import group_counts, whole_experts
from .units import few, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .cost.workload import Workload
    from .hardware.devices import Machine
    from .model.graph import LayerGraph
    from .plan import UnitPlacement

__all__ = [
    "other_dtype_note",
    "context_note",
    "default_speeds_note",
    "beyond_preset_note",
    "reserve_note",
    "unitless_note",
    "uncut_note",
    "calibration_note",
    "phased_note",
    "cpu_beside_gpu_note",
    "split_experts_note",
    "kept_groups_note",
    "group_note",
    "contiguous_note",
]


def other_dtype_note(machine: Machine, dtype: str) -> str | None:
    """Measured devices priced with another dtype's figures, the model's not measured: a CPU runs float16 matmuls
    about 100x slower than float32 ones on this project's machine, bfloat16 4x faster."""
    found = [(d.name, used) for d in machine.devices if (used := fallback_dtype(d.source, dtype))]
    if not found:
        return None
    return (f"{', '.join(name for name, _ in found)} priced at {found[0][1]}'s measured speeds: {dtype} was not "
            f"measured, and dtypes run at very different speeds; placement-opt profile --dtype {dtype} measures it")


def context_note(graph: LayerGraph, workload: Workload) -> str | None:
    """A workload longer than the positions the model was trained for: priced as asked (its KV cache grows with
    it), but the model may refuse it or degrade past them."""
    most = graph.meta.extra.get("max_position_embeddings")
    if not isinstance(most, int) or workload.context_len <= most:
        return None
    parts = f"{workload.prompt_len} + {workload.decode_steps} = " if workload.decode_steps else ""
    return (f"the workload's context ({parts}{workload.context_len} tokens) is past the model's "
            f"max_position_embeddings ({most}): the plan prices it as asked, but the model may refuse such inputs or "
            f"degrade past its trained length")


def default_speeds_note(machine: Machine) -> str | None:
    """This machine's devices that no profile measured (a ``max_memory`` entry, ``NAME=SIZE``, a bare name): priced
    at their kind's default preset, which may be far from the real device (a laptop GPU is not an A100)."""
    assumed = [d for d in machine.devices if assumed_preset(d.source)]
    if not assumed:
        return None
    guessed = ", ".join(f"{d.name} at {assumed_preset(d.source)}'s" for d in assumed)
    example = {"gpu": "cuda:0=rtx-4090/24GiB", "cpu": "cpu=cpu-server/64GiB", "disk": "disk=nvme-gen3/500GiB"}
    if (unread := unread_profile()) is not None:  # "run placement-opt profile" would be refused: it keeps that file
        return f"speeds assumed, not measured: {guessed} datasheet figures; {unread}"
    return (f"speeds assumed, not measured: {guessed} datasheet figures; run placement-opt profile on the machine "
            f"that has the devices, or name a preset (NAME=PRESET/SIZE, e.g. {example[assumed[0].kind]}; "
            f"placement-opt presets lists them)")


def beyond_preset_note(machine: Machine) -> str | None:
    """Devices given more memory than their preset's card has (``cuda:0=rtx-4090/40GiB``): planned as given (a
    card with more memory than its datasheet's is a what-if one may mean), but said, since a typo looks the same."""
    beyond = []
    for d in machine.devices:
        key = d.source.removeprefix("datasheet:") if d.source.startswith("datasheet:") else None
        if key in PRESETS and d.memory_bytes > PRESETS[key].memory_bytes:
            beyond.append(f"{d.name} has {format_bytes(d.memory_bytes)}, more than the {key} preset's "
                          f"{format_bytes(PRESETS[key].memory_bytes)}")
    if not beyond:
        return None
    return (f"{'; '.join(beyond)}: planned with the memory given, which that card does not have; to plan for the "
            f"card itself, give at most its memory (NAME=PRESET/SIZE) or the preset alone")


def calibration_note(graph: LayerGraph, machine: Machine) -> str | None:
    """Whether this plan's times were measured on the model itself, for a machine with measured devices (a
    described machine has no calibration to apply, and no note)."""
    if not any(d.source.startswith("measured") and d.kind != "disk" for d in machine.devices):
        return None  # calibration times units on compute devices: a measured disk beside described ones has none
    found = calibration_for(graph, machine)
    units = graph.names()
    how = _calibrate_how(graph, machine.profile_path)
    if found is None:
        where, there = _profile_said(machine.profile_path)
        return (f"this model is not calibrated {where}: its units are priced by the measured device speeds "
                f"(roofline) and a fixed per-unit overhead; placement-opt profile --model MODEL{how[0]} (or "
                f"placement_opt.calibrate{how[1]}) times them through the dispatcher{there}")
    timed = sum(1 for u in units if u in found.compute)
    host = "this machine" if found.host == this_host() else f"host {found.host!r}, where the profile was made"
    said = f"unit times calibrated on this model: {timed} of {len(units)} units measured on {host}"
    # a block calibration covers a few parts of a sublayer graph only, and another model's calibration the units of
    # the shapes it shares with this one (embedding, norm, head): the rest are not calibrated, and said so
    if timed < len(units) and graph.meta.granularity == "module":
        said += " (the others priced by the device speeds: calibrate() times block and sublayer units, not modules)"
    elif timed < len(units):
        said += (f" (the others priced by the device speeds: placement-opt profile --model MODEL{how[0]} times "
                 f"these units)")
    return said


def _profile_said(path: str | None) -> tuple[str, str]:
    """Where a plan looked for a calibration (``"on this machine"``, ``"in the profile P"``), and where to time one
    when that profile was measured on another host (the machine it describes), else ``""``."""
    if path is None:
        return "on this machine", ""
    host = measured_elsewhere(path)
    return f"in the profile {path!r}", f", on host {host!r} (the profile's)" if host else ""


def _calibrate_how(graph: LayerGraph, profile: str | None = None) -> tuple[str, str]:
    """The CLI options and calibrate() arguments that time ``graph``'s units (sublayer parts, expert groups) into
    ``profile`` (None: the default profile)."""
    cli, call = "", ""
    if graph.meta.granularity == "sublayer":
        groups = max(group_counts(graph.names()).values(), default=1)
        cli = " --granularity sublayer" + (f" --expert-groups {groups}" if groups > 1 else "")
        call = ", granularity='sublayer'" + (f", expert_groups={groups}" if groups > 1 else "")
    if profile is not None:  # the plan reads that file's calibration: timing into the default one would not reach it
        cli = f" --out {shlex.quote(profile)}" + cli
        call = f", path={profile!r}" + call
    return cli, f"(...{call})" if call else ""


def phased_note(placements: Sequence[UnitPlacement]) -> list[str]:
    """What accelerate cannot express: a unit computed on a GPU for the prompt and on the CPU after."""
    phased = [p for p in placements if p.prefill_execution]
    if not phased:
        return []
    span = phased[0].unit + (f" .. {phased[-1].unit}" if len(phased) > 1 else "")
    gpus = ", ".join(sorted({str(p.prefill_execution) for p in phased}))
    return [f"{len(phased)} unit(s) are phased ({span}): the prompt computes them on {gpus}, each decode step "
            f"on the CPU. plan.device_map gives their storage, and from_pretrained(device_map=...) would stream "
            f"them to the GPU at every step instead: run the plan with placement_opt.dispatch() or load() to get "
            f"its speed"]


def cpu_beside_gpu_note(placements: Sequence[UnitPlacement]) -> list[str]:
    """What accelerate runs otherwise: a ``"cpu"`` entry of a map that has GPUs is offloaded, computed on the first
    GPU with its weights copied at every forward, so a unit the plan computes on the CPU from RAM is not run so."""
    on_cpu = [p.unit for p in placements if p.storage == "cpu" and p.execution == "cpu" and p.mode == "resident"]
    if not on_cpu or not any(p.execution.startswith("cuda") for p in placements):
        return []
    return [f"{len(on_cpu)} unit(s) compute on the CPU from RAM beside GPU units ({few(on_cpu)}): from_pretrained("
            f"device_map=plan.device_map) would compute them on the first GPU, copying their weights at every "
            f"forward (accelerate offloads every 'cpu' entry of a map with GPUs): run the plan with "
            f"placement_opt.dispatch() or load() to get its speed"]


def split_experts_note(placements: Sequence[UnitPlacement]) -> list[str]:
    """What accelerate cannot express: one layer's experts on two devices (expert groups)."""
    devices: dict[str, set[str]] = {}
    for p in placements:
        if (parsed := whole_experts(p.unit)) is not None:
            devices.setdefault(parsed[0], set()).add(p.storage)
    split = [name for name, used in devices.items() if len(used) > 1]
    if not split:
        return []
    return [f"{len(split)} layer(s) keep their experts on more than one device ({few(split)}): accelerate places a "
            f"module whole, so plan.device_map stores each such experts module on the one of its devices farthest "
            f"from the GPUs; run the plan with placement_opt.dispatch() or load() to get the split"]


def kept_groups_note(placements: Sequence[UnitPlacement]) -> list[str]:
    """Layers whose expert groups all share one placement: they run as separate calls all the same (priced so),
    which the experts whole would not; said so that ``expert_groups`` is chosen knowing it."""
    kinds: dict[str, set[tuple[str, str, str, str | None]]] = {}
    for p in placements:
        if (parsed := whole_experts(p.unit)) is not None:
            kinds.setdefault(parsed[0], set()).add((p.storage, p.execution, p.mode, p.prefill_execution))
    kept = [name for name, used in kinds.items() if len(used) == 1]
    if not kept:
        return []
    counts = group_counts(p.unit for p in placements)
    calls = sum(counts[name] - 1 for name in kept)
    said = (f"{len(kept)} of {len(kinds)} layer(s) keep all their expert groups in one placement ({few(kept)}): "
            f"they still run as one call a group, {calls} call(s) a forward more than the experts whole, and "
            f"the estimate prices those calls")
    if len(kept) == len(kinds):
        said += "; no layer splits its experts, so a plan with expert_groups=1 can place them the same without them"
    return [said]


def uncut_note(graph: LayerGraph, expert_groups: int) -> list[str]:
    """Say that ``expert_groups`` cut nothing: the model has no experts module (a dense model), so the plan is the
    one without it (a script over several models passes it to all; trace() warns, the plan keeps it said)."""
    if expert_groups == 1 or group_counts(graph.names()):
        return []
    return [f"expert_groups={expert_groups} cut nothing: {graph.meta.model_name} has no MoE experts module, so its "
            f"plan is the one without expert groups"]


def group_note(placements: Sequence[UnitPlacement]) -> list[str]:
    """What accelerate cannot express: a layer's streamed sublayer units copied together, a layer ahead."""
    layers = {p.copy_group for p in placements if p.copy_group is not None and p.mode in ("stream", "phased")}
    if not layers:
        return []
    return [f"{len(layers)} layer(s) stream some of their sublayer units (copy_group): placement_opt's dispatcher "
            f"copies a layer's streamed units together, one layer ahead, and the estimate assumes it; "
            f"from_pretrained(device_map=...) would copy each unit when it is called"]


def contiguous_note(contiguous: bool) -> list[str]:
    """What a ``contiguous`` plan promises: the stages a pipeline on this machine can take, in unit order."""
    if not contiguous:
        return []
    return ["each device stores one contiguous range of the units that hold weights (contiguous): in unit order, "
            "the stages of a pipeline over these devices"]
