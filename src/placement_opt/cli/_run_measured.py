"""What ``placement-opt run`` measured, set beside the plan's prediction and beside accelerate's run.

The table of predicted against measured figures (prefill, decode step, peak memory) with their ratios, the
notes on how they were taken, the figures ``--json`` writes, and ``--vs-accelerate``: the same prompt run in
``from_pretrained(device_map="auto")`` under the same budgets, measured side by side. :mod:`.run` holds the
command, which loads, generates and calls these.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..units import format_bytes, format_seconds
from .output import errors_as_messages, progress

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import Plan
    from ..runtime.breakdown import Breakdown
    from ..runtime.timing import Timing

__all__ = ["CPU_ROW", "time_generation", "time_units", "say_breakdown", "rows", "table", "figures", "say_heap", "say_runs", "vs_accelerate",
           "storage"]

#: The row of the CPU's memory: what the forwards add to the process's RAM at their peak.
CPU_ROW = "cpu memory growth, peak"
#: A mean decode step this many times its median (and this much above it) is said: steps that paid extra.
UNEVEN_STEPS_RATIO = 1.5
UNEVEN_STEPS_MIN_S = 0.005


def say_runs(console: Any, timing: Timing, tokenizer: Any) -> None:
    """None: prints how the medians were taken where more than one prefill was timed, and the first sequence's
    generated text where the prompt was tokenized (``tokenizer``)."""
    if len(timing.prefill_runs_s) > 1:
        runs = timing.prefill_runs_s
        console.print(f"measured prefill: the median of {len(runs)} (from {format_seconds(min(runs))} to "
                      f"{format_seconds(max(runs))}); decode: {_steps(len(timing.decode_step_s))}")
    mean, median = timing.decode_step_mean_s, timing.decode_step_median_s
    if mean > UNEVEN_STEPS_RATIO * median and mean - median >= UNEVEN_STEPS_MIN_S:
        console.print(f"note: the decode steps' mean ({format_seconds(mean)}) is well above their median "
                      f"({format_seconds(median)}): some steps paid a cost of their own, such as a Hopper GPU's "
                      f"attention set-up at each context length the process meets first, which a plan does not "
                      f"count (docs/limitations.md)")
    if tokenizer is not None:
        console.print(f"generated: {tokenizer.decode(list(timing.tokens[0]), skip_special_tokens=True)!r}")


#: Other processes' share of the cores during the timed run above which the run says it was not alone.
BUSY_SHARE = 0.25


def cpu_clock() -> tuple[float, float, float] | None:
    """(wall seconds, the whole machine's busy CPU seconds, this process's CPU seconds), to compare two readings
    (:func:`say_busy`); None where psutil cannot read them."""
    import time

    import psutil

    try:
        every, own = psutil.cpu_times(), psutil.Process().cpu_times()
    except (psutil.Error, OSError):
        return None
    busy = sum(getattr(every, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
    return time.monotonic(), busy, own.user + own.system


def say_busy(console: Any, before: tuple[float, float, float] | None,
             after: tuple[float, float, float] | None) -> None:
    """None: a note when other work took a share of the cores while the run was timed (the machine's busy CPU time
    less this process's own, between two :func:`cpu_clock` readings), which slows every measured figure while the
    prediction assumes the cores free. A hypervisor's steal counts as other work."""
    import os

    if before is None or after is None or after[0] <= before[0]:
        return
    cores = os.cpu_count() or 1
    others = (after[1] - before[1]) - (after[2] - before[2])
    share = others / ((after[0] - before[0]) * cores)
    if share > BUSY_SHARE:
        console.print(f"note: other work took {share:.0%} of this machine's {cores} cores while the run was timed: "
                      f"the measured times may run well above the predicted ones; run again when it is idle to "
                      f"compare them")


def _steps(count: int) -> str:
    return "one step" if count == 1 else f"the median of {count} steps"


def vs_accelerate(console: Any, checkpoint: str, machine: Any, plan: Plan, cost: Any, timing: Timing,
                  generation: tuple[Any, int, bool, int, Any], offload_dir: str | None) -> dict[str, Any]:
    """``--vs-accelerate``'s figures for the JSON (:func:`_accelerate_run`'s), once accelerate's run on the same
    prompt is printed beside this one's."""
    with errors_as_messages(), progress("Loading and running it with device_map='auto' ..."):
        theirs = _accelerate_run(checkpoint, machine, (plan.dtype, cost.workload), generation, offload_dir)
    console.print(_side_by_side(plan, cost, timing, theirs))
    if over := theirs.get("predicted", {}).get("over_budget"):
        console.print(f"note: device_map='auto' did not keep to the max_memory both were given ({'; '.join(over)}, "
                      f"by this cost model): it ran with more memory than placement_opt's plan had, so its speed "
                      f"is not that of a run within these budgets")
    return theirs


def time_generation(model: Any, ids: Any, new_tokens: int, before_each: Any = None, repeats: int = 1,
                    mask: Any = None) -> Timing:
    """:func:`placement_opt.runtime.timing.time_generation`, imported when a run starts (``--help`` loads no torch)."""
    from ..runtime.timing import time_generation as timed

    return timed(model, ids, new_tokens, before_each=before_each, prefill_repeats=repeats, attention_mask=mask)


def time_units(model: Any, cost: Any, ids: Any, new_tokens: int, mask: Any, before_each: Any) -> Breakdown:
    """:func:`placement_opt.runtime.breakdown.time_units`, imported when a run starts."""
    from ..runtime.breakdown import time_units as timed

    return timed(model, cost, ids, new_tokens, attention_mask=mask, before_each=before_each)


def say_breakdown(console: Any, breakdown: Breakdown, misses: int = 5) -> None:
    """None: prints the units' seconds per kind, and the units furthest from their prediction, beside the plan's."""
    from rich.table import Table

    table = Table(title="Per unit (a generation with every unit's call marked: a unit's time runs from its call to the "
                        "next unit's, its wait for weights and inputs included)", title_justify="left")
    for column in ("units", "how they run", "prefill predicted", "measured", "decode step predicted", "measured",
                   "measured / predicted"):
        table.add_column(column, justify="left" if column in ("units", "how they run") else "right")
    for rows in (breakdown.kinds(), _worst(breakdown, misses)):  # each kind, then the worst units
        for row in rows:
            table.add_row(row.name, row.kind, *_pair(row.predicted_prefill_s, row.measured_prefill_s),
                          *_pair(row.predicted_decode_step_s, row.measured_decode_step_s),
                          _ratio(row.predicted_decode_step_s, row.measured_decode_step_s))
        if rows:
            table.add_section()
    table.add_row("all units", "the whole forward", *_pair(breakdown.predicted_prefill_s, breakdown.prefill_s),
                  *_pair(breakdown.predicted_decode_step_s, breakdown.decode_step_s),
                  _ratio(breakdown.predicted_decode_step_s, breakdown.decode_step_s))
    console.print(table)
    if breakdown.predicted_transfer_s:
        console.print(f"note: the plan's activation moves between devices "
                      f"({format_seconds(breakdown.predicted_transfer_s)} over the run) are in no unit's prediction; "
                      f"measured, they count with the unit that makes them")
    if breakdown.untimed:
        console.print(f"note: not timed apart (no module of that name was called): {', '.join(breakdown.untimed)}")


def _worst(breakdown: Breakdown, count: int) -> list[Any]:
    """The units furthest from their prediction in a decode step, where more than one unit is of their kind."""
    return breakdown.misses(count) if len(breakdown.kinds()) < len(breakdown.units) else []


def _pair(predicted: float, measured: float | None) -> tuple[str, str]:
    return format_seconds(predicted), format_seconds(measured) if measured is not None else "-"


def _ratio(predicted: float, measured: float | None) -> str:
    return f"{measured / predicted:.2f}x" if measured is not None and predicted > 0 else "-"


def rows(plan: Plan, cost: Any, timing: Timing) -> list[tuple[str, float | None, float, str]]:
    """(what, predicted, measured, unit) for the table and the JSON."""
    steps = max(1, cost.workload.new_tokens)
    rows = [("prefill", cost.prefill_s, timing.prefill_s, "s"),
            ("decode step, median", cost.decode_s / steps, timing.decode_step_median_s, "s"),
            # the mean carries what some steps pay once (a GPU's set-up per new context length), the median hides it
            ("decode step, mean", cost.decode_s / steps, timing.decode_step_mean_s, "s"),
            ("decode tokens/s", cost.decode_tokens_per_s, timing.decode_tokens_per_s, "tokens/s")]
    predicted = {m.device: m.used_bytes for m in cost.memory}
    for device, measured in timing.peak_gpu_bytes.items():
        rows.append((f"{device} peak memory", predicted.get(device), float(measured), "bytes"))
        # the plan has one peak per device; the phases' measured apart say which one a miss is in
        for phase, peaks in (("prefill", timing.prefill_peak_gpu_bytes), ("decode", timing.decode_peak_gpu_bytes)):
            if device in peaks:
                rows.append((f"{device} peak memory, {phase}", None, float(peaks[device]), "bytes"))
    cpu = next((m for m in cost.memory if m.device == "cpu"), None)
    if cpu is not None and timing.peak_cpu_growth_bytes is not None and _computes_on_cpu(plan):
        # the resident weights were in RAM before the run: the forwards add the rest
        rows.append((CPU_ROW, float(cpu.used_bytes - cpu.weights_bytes), float(timing.peak_cpu_growth_bytes),
                     "bytes"))
    return rows


def say_heap(console: Any, rows: list[tuple[str, float | None, float, str]], fixed: bool) -> None:
    """Why the CPU may have grown past its prediction, where glibc's dynamic threshold was left on."""
    from ..runtime.allocator import glibc_heap

    over = any(what == CPU_ROW and predicted is not None and measured > predicted
               for what, predicted, measured, _ in rows)
    if over and not fixed and glibc_heap():
        console.print("note: the CPU grew past its prediction. With glibc's default (dynamic) mmap threshold, freed "
                      "activations stay in the heap and the peak depends on the order of frees; the plan counts the "
                      "live tensors. --fix-mmap-threshold makes the RAM follow them (docs/limitations.md: its cost)")


def _computes_on_cpu(plan: Plan) -> bool:
    """Whether the CPU computes some unit in either phase (else its growth is not what the plan prices)."""
    return any("cpu" in (p.execution, p.prefill_execution) for p in plan.placements)


def table(rows: list[tuple[str, float | None, float, str]], timing: Timing) -> Any:
    from rich.table import Table

    memory = [*(["GPU memory: torch.cuda.max_memory_allocated"] if timing.peak_gpu_bytes else []),
              *([f"{CPU_ROW}: the peak resident set over the run less the one before it, against the KV cache, "
                 f"workspace and stream buffer the plan puts on the CPU"] if any(r[0] == CPU_ROW for r in rows) else [])]
    how = f" ({'; '.join(memory)})" if memory else ""
    table = Table(title=f"Predicted by the plan, measured in this run{how}", title_justify="left")
    for column in ("", "predicted", "measured", "measured / predicted"):
        table.add_column(column, justify="left" if not column else "right")
    for what, predicted, measured, unit in rows:
        show = {"s": format_seconds, "bytes": format_bytes}.get(unit, lambda v: f"{v:.2f}")
        ratio = f"{measured / predicted:.2f}x" if predicted else "-"
        table.add_row(what, show(predicted) if predicted is not None else "-", show(measured), ratio)
    return table


def figures(plan: Plan, rows: list[tuple[str, float | None, float, str]], timing: Timing) -> dict[str, Any]:
    return {"plan": plan.to_dict(), "measured": _measured(timing),
            "rows": [{"what": w, "predicted": p, "measured": m, "unit": u} for w, p, m, u in rows]}


def _accelerate_run(checkpoint: str, machine: Any, priced: tuple[str, Any],
                    generation: tuple[Any, int, bool, int, Any], offload_dir: str | None) -> dict[str, Any]:
    """``from_pretrained(device_map="auto", max_memory=...)`` run on the same prompt (``priced``: the dtype and
    the workload; ``generation``: the ids, the new tokens, whether cold, the prefills timed, the attention mask
    or None): its map, predicted and measured figures and tokens, or the error that stopped it (an
    out-of-memory is a result, not a failure)."""
    import gc
    import os
    import tempfile

    import torch
    import transformers

    from ..cost.evaluate import evaluate
    from ..model.dtypes import as_torch_dtype
    from ..runtime._safetensors_file import drop_page_cache

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    disk = any(d.kind == "disk" for d in machine.devices)
    if offload_dir is not None:
        os.makedirs(offload_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=offload_dir, prefix="accelerate-offload-") as folder:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint, device_map="auto", max_memory=machine.max_memory, dtype=as_torch_dtype(priced[0]),
                offload_folder=folder if disk else None)
            device_map = dict(getattr(model, "hf_device_map", None) or {"": "cpu"})
            cost = evaluate(device_map, checkpoint, machine, priced[1])
            ids, new_tokens, cold, repeats, mask = generation
            ids, mask = _on_input_device(model, ids), None if mask is None else _on_input_device(model, mask)
            files = [*Path(folder).rglob("*.dat"), *Path(checkpoint).glob("*.safetensors")]
            timing = time_generation(model, ids, new_tokens, (lambda: drop_page_cache(files)) if cold else None,
                                     repeats, mask)
        except (torch.cuda.OutOfMemoryError, ValueError, RuntimeError) as exc:
            return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        finally:
            model = None
            gc.collect()
    over = [f"{m.device} needs {format_bytes(m.used_bytes)}, has {format_bytes(m.capacity_bytes)}"
            for m in cost.memory if m.free_bytes < 0]
    return {"device_map": {k: str(v) for k, v in device_map.items()},
            "predicted": {"prefill_s": cost.prefill_s, "decode_tokens_per_s": cost.decode_tokens_per_s,
                          "over_budget": over},
            "measured": _measured(timing)}


def _on_input_device(model: Any, tensor: Any) -> Any:
    """``tensor`` where ``model``'s input embedding is. A model that accelerate puts whole on one GPU gets no hooks
    to move its inputs (``dispatch_model`` only calls ``model.to``), so the prompt's CPU ids would fail there; a model
    whose embedding is offloaded (on ``meta``) has hooks that move them, and takes them where they are."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embedding, "weight", None)
    if weight is None or weight.device.type == "meta" or weight.device == tensor.device:
        return tensor
    return tensor.to(weight.device)


def _measured(timing: Timing) -> dict[str, Any]:
    return {"prefill_s": timing.prefill_s, "prefill_runs_s": list(timing.prefill_runs_s),
            "decode_step_s": list(timing.decode_step_s),
            "decode_tokens_per_s": timing.decode_tokens_per_s, "peak_gpu_bytes": timing.peak_gpu_bytes,
            "peak_cpu_growth_bytes": timing.peak_cpu_growth_bytes,
            "tokens": [list(t) for t in timing.tokens]}


def storage(plan_or_map: Any) -> str:
    """Units (or map entries) per storage device: ``cuda:0 20, cpu 14``."""
    where = ([p.storage for p in plan_or_map.placements] if hasattr(plan_or_map, "placements")
             else [str(v) if not str(v).isdigit() else f"cuda:{v}" for v in plan_or_map.values()])
    return ", ".join(f"{device} {where.count(device)}" for device in dict.fromkeys(where))


def _side_by_side(ours_plan: Plan, cost: Any, ours: Timing, theirs: dict[str, Any]) -> Any:
    """Both runs measured: placement_opt's plan against from_pretrained(device_map="auto") under the same budgets."""
    from rich.table import Table

    table = Table(title="Measured side by side: placement_opt's plan and from_pretrained(device_map='auto') with the "
                        "same max_memory, the same prompt", title_justify="left")
    for column in ("", "placement_opt", "device_map='auto'", "auto / placement_opt"):
        table.add_column(column, justify="left" if not column else "right")
    if "error" in theirs:
        table.add_row("device_map='auto'", "", theirs["error"], "")
        return table
    measured = theirs["measured"]
    rows = [("prefill", ours.prefill_s, measured["prefill_s"], format_seconds),
            ("decode step, median", ours.decode_step_median_s,
             statistics.median(measured["decode_step_s"]) if measured["decode_step_s"] else 0.0, format_seconds),
            ("decode step, mean", ours.decode_step_mean_s,
             statistics.fmean(measured["decode_step_s"]) if measured["decode_step_s"] else 0.0, format_seconds),
            ("decode tokens/s", ours.decode_tokens_per_s, measured["decode_tokens_per_s"], lambda v: f"{v:.2f}")]
    rows += [(f"{d} peak memory", float(ours.peak_gpu_bytes.get(d, 0)), float(b), format_bytes)
             for d, b in measured["peak_gpu_bytes"].items()]
    for what, mine, other, show in rows:
        table.add_row(what, show(mine), show(other), f"{other / mine:.2f}x" if mine else "-")
    growth = (ours.peak_cpu_growth_bytes, measured["peak_cpu_growth_bytes"])
    if None not in growth:
        table.add_row("cpu memory growth, peak", format_bytes(growth[0]), format_bytes(growth[1]),
                      f"{growth[1] / growth[0]:.2f}x" if growth[0] else "-")
    table.add_row("weights stored on", storage(ours_plan), storage(theirs["device_map"]), "")
    over = theirs["predicted"].get("over_budget") or []
    # this run's price (a saved plan is priced again for --batch and --devices), as accelerate's map is
    table.add_row("within max_memory (predicted)", "yes" if cost.fits else "no",
                  "no: " + "; ".join(over) if over else "yes", "")
    same = sum(a == b for x, y in zip(ours.tokens, measured["tokens"], strict=True) for a, b in zip(x, y, strict=True))
    total = sum(len(x) for x in ours.tokens)
    table.add_row("greedy tokens equal", "", f"{same}/{total}", "")
    return table
