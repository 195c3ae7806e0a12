"""``placement-opt run``: load a checkpoint in its plan, generate, and set what was measured beside the plan.

The check a user makes before trusting a plan on their own machine: the plan's predicted prefill, decode
step and peak GPU memory against the same run's measured ones (:func:`placement_opt.runtime.timing.time_generation`:
greedy decoding by hand, each step timed), with the ratios. A prompt is random token ids of ``--prompt``
length unless ``--text`` is given and the checkpoint has a tokenizer.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..compare import one_line
from . import _run_measured
from .options import (
    DTYPES,
    check_expert_groups,
    check_not_foreign,
    check_output_folder,
    expert_groups_option,
    model_dtype,
    parse_pins,
    require_devices,
    resolve_devices,
    workload_from,
)
from .output import STDOUT, console_for, errors_as_messages, progress, write_json

if TYPE_CHECKING:  # pragma: no cover
    from ..plan import Plan


__all__ = ["run"]

#: Seed of the random prompt's token ids: the same prompt on every run of the same checkpoint.
PROMPT_SEED = 0
#: What ``run`` says where ``load()`` asks a Python caller for an offload folder (runtime.checkpoint.OFFLOAD_DIR_HINT).
CLI_OFFLOAD_HINT = "--offload-dir DIR"
#: What ``run`` says where ``load()`` tells a Python caller how to run a plan over the budgets given beside it.
#: What ``run`` says where the library tells a Python caller to solve a plan for this model.
CLI_MISMATCH_HINT = ("plan this checkpoint (placement-opt plan CHECKPOINT --devices SPEC --json PLAN.json) and pass "
                     "that, or leave --plan out")
#: What ``run`` says where the library points a Python caller at solve() for a machine it does not have.
CLI_ELSEWHERE_HINT = "placement-opt plan plans for a machine you do not have"
CLI_BUDGET_HINT = ("leave --plan out to plan for these --devices, or give --devices at least the budgets the plan was "
                   "solved for (placement-opt explain PLAN.json shows them)")


@click.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--devices", "-d", default=None, metavar="SPEC",
              help="this machine's devices to use (required): 'cuda:0=10GiB,cpu=64GiB,disk' caps them as accelerate's "
                   "max_memory does (measured speeds where placement-opt profile saved them); 'auto': all of them")
@click.option("--batch", type=int, default=None, help="sequences generated together [default: 1, or --plan's]")
@click.option("--prompt", type=int, default=None,
              help="prompt tokens (random ids; see --text) [default: 512, or --plan's]")
@click.option("--new-tokens", type=int, default=None, help="tokens generated, greedily [default: 32, or --plan's]")
@click.option("--text", default=None, help="a prompt to tokenize with the checkpoint's tokenizer instead of random ids")
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="weights' dtype (default: the checkpoint's)")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="a saved plan (placement-opt plan --json) instead of solving")
@click.option("--offload-dir", type=click.Path(file_okay=False), default=None,
              help="where weights the checkpoint cannot hold as planned are written (cast or fused disk units)")
@click.option("--granularity", type=click.Choice(["block", "sublayer", "auto"]), default="block", show_default=True,
              help="units to place, as for plan (not with --plan, whose units are fixed; a module plan is for inspecting a model and "
                   "cannot run)")
@click.option("--pin", "pin", multiple=True, metavar="MODULE=DEVICE", help="as for plan (repeatable; not with --plan)")
@expert_groups_option
@click.option("--overlap", is_flag=True, help="plan with Workload(overlap=True), as for plan")
@click.option("--padded", is_flag=True,
              help="mask the first quarter of the first sequence's prompt as padding (attention_mask), as in a batch "
                   "of prompts of different lengths, and plan with Workload(padded=True)")
@click.option("--cold", is_flag=True,
              help="drop the disk units' files from the page cache before every timed forward, as on a machine whose "
                   "RAM cannot hold them (the plan prices disk reads cold); with --vs-accelerate, its offload and "
                   "checkpoint files too (best effort: pages accelerate keeps mapped stay)")
@click.option("--vs-accelerate", is_flag=True,
              help="then load it with from_pretrained(device_map='auto') under the same budgets (max_memory) and "
                   "run the same prompt: both measured side by side")
@click.option("--calibrate", "calibrate_first", is_flag=True,
              help="first time this model's units on this machine at this workload (placement-opt profile --model "
                   "with the same options, or the units of --plan; seconds to a minute) and save them in the "
                   "profile, so that the plan and its prediction use them")
@click.option("--fix-mmap-threshold", "fix_threshold", is_flag=True,
              help="fix glibc's mmap threshold first (placement_opt.runtime.allocator.fix_mmap_threshold): the RAM a "
                   "forward takes then follows its live tensors, which the plan's CPU memory counts, at a cost in speed "
                   "(4-18 % of a CPU forward here: docs/limitations.md)")
@click.option("--breakdown", is_flag=True,
              help="then generate once more with every unit's call marked, and set each kind of unit's seconds (and the "
                   "units furthest from their prediction) beside the plan's: where a miss comes from")
@click.option("--repeats", type=int, default=3, show_default=True,
              help="prefills timed (each on a new cache); the median is shown, and each is in --json")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="write the predicted and measured figures here ('-': to stdout, with the tables on stderr)")
def run(checkpoint: str, devices: str | None, batch: int | None, prompt: int | None, new_tokens: int | None,
        text: str | None,
        dtype: str | None, plan_path: str | None, offload_dir: str | None, granularity: str, pin: tuple[str, ...],
        expert_groups: int, overlap: bool, padded: bool, cold: bool, vs_accelerate: bool, calibrate_first: bool, fix_threshold: bool,
        breakdown: bool, repeats: int, json_path: str | None) -> None:
    """Load CHECKPOINT (a save_pretrained directory) in its plan, generate, and compare measured with predicted."""
    from ..plan import Plan
    from ..planner import SOLVER_NOTES

    console = console_for(stderr=json_path == STDOUT)
    check_output_folder(json_path, "--json")  # before the load and the run, not after them
    check_not_foreign(json_path, "run's figures", "--json")
    _check_text(text, prompt)
    with errors_as_messages():
        saved = Plan.from_json(plan_path) if plan_path else None  # read once: its workload, devices and units
    given_new_tokens = new_tokens is not None
    batch, prompt, new_tokens = _shape(saved, batch, prompt, new_tokens)
    pins = parse_pins(pin)
    _check_counts(new_tokens, repeats, given_new_tokens)
    _check_plan_options(plan_path, granularity, expert_groups, pins)
    _check_plan_dtype(saved, plan_path, dtype)
    check_expert_groups(expert_groups, granularity)
    fixed = _fix_threshold(console) if fix_threshold else False
    with errors_as_messages():
        machine = _machine(checkpoint, devices, dtype, offload_dir)
        _check_plan_devices(saved, machine)
        ids, tokenizer = _prompt(checkpoint, text, batch, prompt)
        mask = _padding_mask(ids) if padded else None
        workload = workload_from(batch, ids.shape[1], new_tokens, None, overlap, padded)
        if calibrate_first:
            cut = _plan_cut(saved, checkpoint) if saved else (granularity, expert_groups)
            _check_calibrated_cut(cut[0])
            console.print(_calibrated(checkpoint, machine, workload, dtype, *cut, offload_dir),
                          markup=False, highlight=False)
            # again: devices the profile had not measured are now, and only measured devices take calibrations
            machine = _machine(checkpoint, devices, dtype, offload_dir)
        _check_positions(checkpoint, ids.shape[1], new_tokens)
        _warn_past_plan(saved, plan_path, workload)
        with warnings.catch_warnings():  # said above in the CLI's words (load()'s names its arguments)
            warnings.filterwarnings("ignore", message="the workload given beside the plan", category=UserWarning)
            handle = _loaded(checkpoint, machine, workload, dtype, saved, offload_dir, granularity, pins,
                             expert_groups)
        before = _run_measured.cpu_clock()
        with progress(f"Generating {new_tokens} tokens for batch {batch} x prompt {ids.shape[1]} ..."):
            timing = _run_measured.time_generation(handle, ids, new_tokens, handle.drop_disk_cache if cold else None, repeats, mask)
        busy = (before, _run_measured.cpu_clock())
        plan = handle.plan
        cost = plan.cost if saved is None else _repriced(plan, checkpoint, machine, workload)
    _say_setting(console, checkpoint, machine, (batch, ids.shape[1], new_tokens, padded), plan, cold, SOLVER_NOTES)
    rows = _run_measured.rows(plan, cost, timing)
    console.print(_run_measured.table(rows, timing))
    _run_measured.say_heap(console, rows, fixed)
    _run_measured.say_runs(console, timing, tokenizer)
    _run_measured.say_busy(console, *busy)
    figures = _run_measured.figures(plan, rows, timing)
    if breakdown:
        with errors_as_messages(), progress("Generating again, every unit's call marked ..."):
            units = _run_measured.time_units(handle, cost, ids, new_tokens, mask,
                                             handle.drop_disk_cache if cold else None)
        _run_measured.say_breakdown(console, units)
        figures["breakdown"] = units.to_dict()
    if vs_accelerate:
        del handle  # its weights leave before accelerate's load
        figures["accelerate"] = _run_measured.vs_accelerate(console, checkpoint, machine, plan, cost, timing,
                                                            (ids, new_tokens, cold, repeats, mask), offload_dir)
    if json_path:
        write_json(console, json_path, json.dumps(figures, indent=1), "run's figures", "figures")


#: --batch, --prompt and --new-tokens when neither they nor a --plan say.
DEFAULT_SHAPE = (1, 512, 32)


def _shape(saved: Plan | None, batch: int | None, prompt: int | None,
           new_tokens: int | None) -> tuple[int, int, int]:
    """The run's batch, prompt and new tokens: as given, else the workload ``--plan`` was solved for (a plan run at
    another workload is priced again, and warned about), else :data:`DEFAULT_SHAPE`."""
    fallback = DEFAULT_SHAPE
    if saved is not None:
        solved = saved.workload
        fallback = (solved.batch_size, solved.prompt_len, solved.new_tokens)
    given = (batch, prompt, new_tokens)
    return tuple(g if g is not None else f for g, f in zip(given, fallback, strict=True))  # type: ignore[return-value]


def _check_text(text: str | None, prompt: int | None) -> None:
    """Refuse ``--prompt`` beside ``--text``: the text's tokens are the prompt, so its length would be dropped."""
    if text is not None and prompt is not None:
        raise click.UsageError(f"--prompt {prompt} with --text: the prompt is the text's tokens, so --prompt would be "
                               f"ignored; leave --prompt out, or leave --text out for a random prompt of --prompt "
                               f"tokens")


def _check_counts(new_tokens: int, repeats: int, given: bool = True) -> None:
    """None, or the usage error for too few new tokens to time a decode step or too few prefills to time one:
    refused before anything is read. ``given``: ``new_tokens`` is the user's --new-tokens, not --plan's workload."""
    if new_tokens < 2:
        if not given:  # a plan solved for a single forward or one token: the flag was never written
            raise click.UsageError(f"the plan was solved for new_tokens={new_tokens}, and a run times decode steps: "
                                   f"pass --new-tokens N (at least 2) to run it generating")
        raise click.UsageError(f"--new-tokens {new_tokens}: at least 2, so that a decode step is timed")
    if repeats < 1:
        raise click.UsageError(f"--repeats {repeats}: at least 1 prefill is timed")


def _machine(checkpoint: str, devices: str | None, dtype: str | None, offload_dir: str | None) -> Any:
    """The machine ``--devices`` describes, priced in the run's dtype, its bare disk where ``--offload-dir`` writes:
    resolved once before and, with ``--calibrate``, once after calibrating."""
    # NAME=SIZE is this machine's device with that budget, as for plan (and a max_memory entry)
    priced_in = dtype or model_dtype(checkpoint, "CHECKPOINT")
    return _disk_at(resolve_devices(require_devices(devices), dtype=priced_in), devices, offload_dir)


def _say_setting(console: Any, checkpoint: str, machine: Any, shape: tuple[int, int, int, bool], plan: Plan,
                 cold: bool, search_notes: tuple[str, ...]) -> None:
    """None: prints what ran (the checkpoint on the devices, ``shape``: batch, prompt tokens, new tokens, padded,
    and the plan), the plan's notes but the search's (``search_notes``), and, without --cold, that disk units may
    be read from the page cache: what the figures that follow rest on."""
    batch, prompt, new_tokens, padded = shape
    console.print(f"[bold]{checkpoint}[/] on {', '.join(machine.names)}: batch {batch} x prompt {prompt} + "
                  f"{new_tokens} new tokens{', padded' if padded else ''}, greedy; plan {plan.strategy} "
                  f"({plan.status}, gap {plan.gap:.1%}), units stored on {_run_measured.storage(plan)}")
    for note in plan.notes:  # what the prediction rests on (calibrated or assumed speeds, ...); not the search's
        if not note.startswith(search_notes):
            console.print(f"note: {note}")
    disk = sum(p.storage == "disk" for p in plan.placements)
    if disk and not cold:
        console.print(f"note: {disk} unit(s) are read from disk through the page cache, which may hold them here "
                      f"(reads faster than the cold ones the plan prices); --cold drops them before every forward")


def _padding_mask(ids: Any) -> Any:
    """An attention mask with the first quarter of the first sequence's prompt as padding (one token at least,
    one kept at least)."""
    import torch

    if ids.shape[1] < 2:
        raise click.UsageError(f"--padded masks part of the prompt as padding: a prompt of {ids.shape[1]} token "
                               f"leaves none to keep; give --prompt 2 or more")
    mask = torch.ones_like(ids)
    mask[0, :max(1, ids.shape[1] // 4)] = 0
    return mask


def _prompt(checkpoint: str, text: str | None, batch: int, prompt: int) -> tuple[Any, Any]:
    """(batch x prompt token ids, the tokenizer or None): ``text`` tokenized, else seeded random ids."""
    import torch
    import transformers

    if small := [f"--{flag} {value}" for flag, value in (("batch", batch), ("prompt", prompt)) if value < 1]:
        raise click.UsageError(f"{' and '.join(small)}: at least 1")
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    if getattr(config, "is_encoder_decoder", False):
        raise click.UsageError(f"{checkpoint} is an encoder-decoder model ({config.model_type}): run times decoder-only "
                               f"causal LMs; load() it from Python and call generate() with its own inputs")
    _check_generates(checkpoint, config)
    if text is not None:
        missing = "no tokenizer file (tokenizer.json, tokenizer.model, vocab.json, ...)"
        try:
            if not _has_tokenizer_files(Path(checkpoint)):
                # transformers 5 builds an empty tokenizer for some configs, which turns any text into no tokens
                raise OSError(missing)
            tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        except (OSError, ValueError) as exc:
            raise click.UsageError(f"--text needs the checkpoint's tokenizer, and {checkpoint} has none that "
                                   f"transformers can read ({str(exc).splitlines()[0][:120]}): leave --text out "
                                   f"for a random prompt of --prompt tokens, or save the tokenizer beside the "
                                   f"weights (tokenizer.save_pretrained)") from None
        ids = tokenizer([text] * batch, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            raise click.UsageError(f"--text {text!r} tokenizes to no tokens with {checkpoint}'s tokenizer "
                                   f"({type(tokenizer).__name__}, {len(tokenizer)} entries): give some text")
        return ids, tokenizer
    vocab = config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(PROMPT_SEED)
    return torch.randint(0, vocab, (batch, prompt), generator=generator), None


#: Files a saved tokenizer leaves in its folder (any one of them): fast tokenizers, SentencePiece and BPE vocabularies.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tekken.json")


def _has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _disk_at(machine: Any, devices: str | None, offload_dir: str | None) -> Any:
    """A bare ``disk`` in ``--devices`` is the free space where ``--offload-dir`` writes (its nearest existing
    folder), not the current directory's: the weights converted for the plan go there."""
    import shutil

    from ..hardware.devices import replace_device

    bare = devices is not None and any(part.strip().lower() == "disk" for part in devices.split(","))
    if not bare or offload_dir is None or "disk" not in machine:
        return machine
    folder = Path(offload_dir).expanduser().resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    return machine.with_devices([replace_device(d, memory_bytes=free) if d.name == "disk" else d
                                 for d in machine.devices], machine.links)


def _check_positions(checkpoint: str, prompt: int, new_tokens: int) -> None:
    """Refuse, before any loading, a run past the model's learned position table
    (:func:`~placement_opt.runtime.checkpoint.learned_positions`): its lookup would fail mid-generation."""
    from ..runtime.checkpoint import learned_positions, meta_model

    positions = prompt + new_tokens - 1  # the last token generated is never fed back
    if (table := learned_positions(meta_model(Path(checkpoint), None))) is not None and positions > table[1]:
        name, most = table
        raise click.UsageError(
            f"{checkpoint}'s model has {most} learned positions ({name}), and --prompt {prompt} + --new-tokens "
            f"{new_tokens} feeds it {positions}: give --prompt and --new-tokens adding up to at most {most + 1}")


def _check_generates(checkpoint: str, config: Any) -> None:
    """Refuse, before any loading, a checkpoint whose model has no causal LM head: run generates text.

    The class is the one ``load()`` builds (the config's ``architectures[0]``, else ``AutoModelForCausalLM``).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from ..runtime.checkpoint import model_class

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = model_class(config)
    if cls is not None:
        can = getattr(cls, "can_generate", None)
        generates = bool(can()) if callable(can) else hasattr(cls, "generate")
        what = f"a {arch} ({config.model_type})"
    else:
        generates = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
        what = f"a {arch or config.model_type} model ({config.model_type})"
    if not generates:
        raise click.UsageError(f"{checkpoint} holds {what}, which cannot generate text (no causal LM head): run "
                               f"needs a decoder-only causal LM checkpoint (a *ForCausalLM, saved from "
                               f"AutoModelForCausalLM); 'placement-opt plan {checkpoint}' still plans this one")


def _plan_cut(plan: Plan, checkpoint: str) -> tuple[str, int]:
    """The units a plan places, as ``trace()`` and ``calibrate()`` cut them: its granularity and expert groups.

    A plan does not record its cut. Sublayer plans name a home device; a plan of other units than the
    checkpoint's blocks was solved on ``trace(granularity="module")`` (Python only: the command line solves blocks
    and sublayers).
    """
    from ..model.expert_groups import group_counts
    from ..model.tracer import trace

    if plan.home:
        return "sublayer", max(group_counts(p.unit for p in plan.placements).values(), default=1)
    blocks = {unit.name for unit in trace(checkpoint, dtype=plan.dtype).units()}
    return ("block" if {p.unit for p in plan.placements} <= blocks else "module"), 1


def _calibrated(checkpoint: str, machine: Any, workload: Any, dtype: str | None, granularity: str,
                expert_groups: int, offload_dir: str | None) -> str:
    """``calibrate()`` of the checkpoint on this machine's devices at the run's workload; its summary."""
    from ..runtime.calibrate import calibrate

    with progress(f"Calibrating {checkpoint} on {', '.join(machine.names)} ..."):
        result = calibrate(checkpoint, machine.names, workload=workload,
                           dtype=dtype or model_dtype(checkpoint, "CHECKPOINT"), granularity=granularity,
                           expert_groups=expert_groups, offload_dir=offload_dir)
    return result.summary()


def _check_calibrated_cut(granularity: str) -> None:
    """calibrate() times block and sublayer units: a plan of single modules would be priced with none of its units
    timed."""
    if granularity == "module":
        raise click.UsageError("--calibrate with a plan of single modules (solved on trace(granularity='module')): "
                               "calibrate() times block and sublayer units only, so none of this plan's units would "
                               "be timed; leave --calibrate out, or use a plan solved at block or sublayer granularity")


def _check_plan_options(plan_path: str | None, granularity: str, expert_groups: int, pins: dict[str, str]) -> None:
    """Refuse options that shape a solve beside --plan, which fixes the units and where each goes: load() ignores
    them, and a user who gave them expects them to count."""
    given = [flag for flag, on in (("--granularity", granularity != "block"), ("--expert-groups", expert_groups != 1),
                                   ("--pin", bool(pins))) if on]
    if plan_path and given:
        raise click.UsageError(f"{', '.join(given)} with --plan: the plan fixes its units and where each goes, so "
                               f"{' and '.join(given)} would be ignored; leave {'them' if len(given) > 1 else 'it'} "
                               f"out, or leave --plan out to solve a plan with {'them' if len(given) > 1 else 'it'}")


def _loaded(checkpoint: str, machine: Any, workload: Any, dtype: str | None, plan: Plan | None,
            offload_dir: str | None, granularity: str, pins: dict[str, str], expert_groups: int = 1) -> Any:
    """``load()`` in a given plan, else in one solved for ``workload`` (with the search ``plan`` makes)."""
    from ..errors import DeviceSpecError, DispatchError
    from ..plan_check import MISMATCH_HINT
    from ..runtime.checkpoint import OFFLOAD_DIR_HINT
    from ..runtime.loader import BUDGET_HINT, ELSEWHERE_HINT, load

    try:
        with progress(f"Loading {checkpoint} ..."):
            return load(checkpoint, machine, workload=workload, dtype=dtype, offload_dir=offload_dir, plan=plan,
                        granularity=None if granularity == "block" else granularity, pins=pins or None,
                        progress=False, expert_groups=expert_groups)
    except (DispatchError, DeviceSpecError) as exc:
        # load() asks a Python caller for its arguments; here the user types flags: a usage error (exit code 2)
        if OFFLOAD_DIR_HINT in str(exc):
            raise click.UsageError(one_line(exc).replace(OFFLOAD_DIR_HINT, CLI_OFFLOAD_HINT)) from None
        for hint, ours in ((BUDGET_HINT, CLI_BUDGET_HINT), (MISMATCH_HINT, CLI_MISMATCH_HINT),
                           (ELSEWHERE_HINT, CLI_ELSEWHERE_HINT)):
            if hint in str(exc):
                raise click.UsageError(one_line(exc).replace(hint, ours)) from None
        raise


def _warn_past_plan(plan: Plan | None, plan_path: str | None, workload: Any) -> None:
    """One line, before loading, where this run's workload holds more KV cache or computes more tokens at once than
    ``--plan`` counted memory for (load() and the dispatched model said it twice, in the library's words)."""
    from ..runtime._phases import workload_past_plan

    if plan is None:
        return
    past = workload_past_plan(workload, plan.workload)
    if past:
        warnings.warn(f"this run {' and '.join(past)}: its KV cache and activations take more memory than the plan "
                      f"in {plan_path} counted, and may not fit; leave --plan out to solve a plan for this run, or "
                      f"leave --batch, --prompt and --new-tokens out to run the plan's own workload", UserWarning,
                      stacklevel=2)


def _check_plan_dtype(plan: Plan | None, plan_path: str | None, dtype: str | None) -> None:
    """Before anything loads: ``--dtype`` other than the one ``--plan`` was priced in (load() said it as
    ``dtype='bfloat16'``, in its own argument's words)."""
    if plan is not None and dtype is not None and dtype != plan.dtype:
        raise click.UsageError(f"--dtype {dtype}, but the plan in {plan_path} was priced for {plan.dtype} (its memory "
                               f"and times): leave --dtype out to run in {plan.dtype}, or solve a plan for {dtype} "
                               f"with 'placement-opt plan CHECKPOINT --dtype {dtype} --json PATH'")


def _check_plan_devices(plan: Plan | None, machine: Any) -> None:
    """Before anything loads: a ``--plan`` using a device ``--devices`` does not name cannot be priced for this run."""
    if plan is None:
        return
    used = {d for p in plan.placements for d in (p.storage, p.execution, p.prefill_execution) if d}
    if missing := sorted(used - set(machine.names)):
        raise click.UsageError(f"the plan uses {', '.join(missing)}, which --devices does not name: add "
                               f"{', '.join(missing)} to --devices (its speeds price the run), or leave --plan out to "
                               f"plan for these devices")


def _repriced(plan: Plan, checkpoint: str, machine: Any, workload: Any) -> Any:
    """A saved plan's cost for this run: its placement priced for this run's workload on this machine's devices
    (the plan may have been solved for another workload or budget)."""
    from ..cost.evaluate import evaluate
    from ..model.tracer import trace


    granularity, groups = _plan_cut(plan, checkpoint)
    graph = trace(checkpoint, dtype=plan.dtype, granularity=granularity, expert_groups=groups)
    return evaluate(plan, graph, machine, workload)


def _fix_threshold(console: Any) -> bool:
    from ..runtime.allocator import fix_mmap_threshold

    if fix_mmap_threshold():
        return True
    console.print("note: --fix-mmap-threshold: this process does not allocate from glibc's heap (or glibc refused "
                  "the value): its allocator is as it was")
    return False
