"""The command line's words -> objects: a model argument, ``--devices``, the workload, shared options.

Bad words end as ``click.BadParameter``/``click.UsageError`` (one line, exit code 2).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .._files import foreign_file, foreign_picture, loads_json, refusal
from ..errors import first_line
from ..report import EXTRA_SEARCH_S

if TYPE_CHECKING:  # pragma: no cover
    from ..cost.workload import Workload
    from ..hardware.devices import Machine

__all__ = ["OBJECTIVES", "DTYPES", "resolve_model", "check_model", "model_dtype", "resolve_devices", "workload_from", "parse_modes", "solve_options",
           "check_plot_suffix", "cluster_options",
           "require_devices", "expert_groups_option", "check_expert_groups"]


OBJECTIVES = ("latency", "throughput", "memory")
DTYPES = ("float16", "bfloat16", "float32")


def _preset_names() -> list[str]:
    try:
        from ..model import catalog as models
    except ImportError:
        return []
    return list(models.list_models())


def resolve_model(text: str) -> Any:
    """A model argument as ``trace`` accepts it: a preset's config, a config.json's config, or an id.

    Accepted: a preset name of :mod:`placement_opt.model.catalog` (``llama-2-70b``), a path to a
    ``config.json`` (or to a directory holding one), or a Hugging Face model id (``org/name``;
    only its config is read).

    Raises:
        click.BadParameter: none of these (:func:`check_model`), or a config.json that transformers cannot read.
    """
    checked = check_model(text)
    path = Path(checked)
    if path.is_file():
        return _config_from_json(path)
    if path.is_dir():
        return checked
    if checked in _preset_names():
        from ..model import catalog as models

        return models.model_config(checked)
    return checked


def check_model(text: str) -> str:
    """The model argument checked, without importing transformers: a preset's name (lower case), a config.json's
    or a model directory's absolute path, or a model id as given.

    Raises:
        click.BadParameter: none of these: a path that does not exist is named as such, an unknown
            preset gets the close names (``llama3-8b``: did you mean 'llama-3-8b'?) and the list, a file that is
            not a config.json says what it is.
    """
    path = Path(text).expanduser()
    if path.is_file():
        _read_config_json(path)
        return str(path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise click.BadParameter(f"directory {text!r} has no config.json", param_hint="MODEL")
        return str(path.resolve())  # absolute: ./llama-3-8b is this folder, never the preset of that name
    presets = _preset_names()
    if text.lower() in presets:
        return text.lower()
    if _looks_like_a_path(text):
        what = "file" if text.lower().endswith(".json") else "directory"
        raise click.BadParameter(f"no such {what}: {text} (a model is a preset name, a config.json, a local "
                                 f"model directory or a model id like 'org/name')", param_hint="MODEL")
    if "/" in text:
        return text
    known = ", ".join(presets) if presets else "none yet"
    close = _close_presets(text, presets)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise click.BadParameter(
        f"unknown model preset {text!r}: {hint}known presets are {known}; or give a config.json, "
        f"a local model directory or a model id like 'org/name'", param_hint="MODEL")


def _looks_like_a_path(text: str) -> bool:
    """Whether a model argument can only be a local path: ``./x``, ``../x``, ``/x``, ``~/x``, ``x/`` or
    ``a/b/c`` (a hub id is ``org/name``: one slash, neither first nor last), or a Windows separator."""
    if text.startswith(("./", "../", "/", "~")) or text in (".", "..") or text.endswith("/"):
        return True
    return text.count("/") >= 2 or (os.sep != "/" and os.sep in text) or text.lower().endswith(".json")


def _close_presets(text: str, presets: Sequence[str]) -> list[str]:
    """The presets a mistyped name probably meant: the same name but for its separators (``llama3-8b``,
    ``Mistral_7B``), else the few it begins or ends (``llama-3-8``, ``mixtral``, ``llama-3-8b-instruct``), else
    the closest spellings (``gemma-9b``); none when nothing is close."""
    import difflib
    import re

    def bare(name: str) -> str:
        return re.sub(r"[-_.\s]", "", name.lower())

    typed = bare(text)
    same = [p for p in presets if bare(p) == typed]
    prefix = [p for p in presets if typed and (bare(p).startswith(typed) or typed.startswith(bare(p)))]
    if same or 0 < len(prefix) <= 3:
        return same or prefix
    return difflib.get_close_matches(text.strip().lower(), list(presets), n=2, cutoff=0.85)


def model_dtype(text: str, param_hint: str = "--model") -> str:
    """The dtype a model argument's weights are published in (its config's), bfloat16 when it names none.

    Raises:
        click.BadParameter: the argument is not a model (see :func:`resolve_model`), or its config cannot be read
            (a model id neither cached nor on a hub that answers): one line, naming ``param_hint``.
    """
    resolved = resolve_model(text)
    if isinstance(resolved, str):  # a directory or a model id: its config.json
        from ..compare import one_line
        from ..errors import ModelSpecError
        from ..model._source import config_of

        try:
            resolved = config_of(resolved)
        except ModelSpecError as exc:  # transformers' own message runs over several lines
            raise click.BadParameter(one_line(exc), param_hint=param_hint) from None
    dtype = getattr(resolved, "dtype", None) or getattr(resolved, "torch_dtype", None)
    name = str(dtype).replace("torch.", "") if dtype is not None else "bfloat16"
    return name if name in DTYPES else "bfloat16"


def _config_from_json(path: Path) -> Any:
    data = _read_config_json(path)
    from transformers import AutoConfig

    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(data["model_type"], **fields)
    except ValueError as exc:
        if "Unrecognized model identifier" in str(exc):  # its list of every model type runs to 15 KB
            import transformers

            raise click.BadParameter(f"{str(path)!r}: model_type {data['model_type']!r} is not one transformers "
                                     f"{transformers.__version__} knows: a newer transformers may have it "
                                     f"(pip install -U transformers), or the config is not a transformers model's",
                                     param_hint="MODEL") from None
        raise click.BadParameter(f"{str(path)!r}: {exc}", param_hint="MODEL") from None
    except Exception as exc:  # noqa: BLE001 - transformers 5 validates with huggingface_hub's own errors
        raise click.BadParameter(f"{str(path)!r} is not a config transformers accepts: {first_line(exc)}",
                                 param_hint="MODEL") from None


def _read_config_json(path: Path) -> dict[str, Any]:
    """The JSON of a config.json file, with a ``model_type``."""
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise click.BadParameter(f"{str(path)!r} is not a text file (a checkpoint's weights?): give its config.json, "
                                 f"or the model's directory", param_hint="MODEL") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise click.BadParameter(f"cannot read {str(path)!r} as JSON: {exc}", param_hint="MODEL") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise click.BadParameter(
            f"{str(path)!r} is not a transformers config.json (no 'model_type' key)", param_hint="MODEL")
    return data


def resolve_devices(spec: str, *, dtype: str = "float16") -> Machine:
    """The ``--devices`` value as a Machine: a spec string, ``auto``, or a saved profile JSON.

    Raises:
        click.BadParameter: the spec is malformed or the file is not a profile.
    """
    from ..hardware.resolve import is_auto, resolve_machine

    try:
        if is_auto(spec):  # this machine: every visible GPU, the CPU and the disk (before a file named auto)
            return resolve_machine(None, dtype=dtype)
        path = Path(spec)
        if path.suffix.lower() == ".json" or path.is_file():
            return _machine_from_file(path, dtype)
        return resolve_machine(spec, dtype=dtype)
    except click.BadParameter:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise click.BadParameter(str(exc), param_hint="--devices") from None


def _machine_from_file(path: Path, dtype: str = "float16") -> Machine:
    from ..hardware.devices import Machine

    if not path.is_file():
        raise click.BadParameter(f"profile file {str(path)!r} does not exist", param_hint="--devices")
    try:
        data = loads_json(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise click.BadParameter(f"{str(path)!r} is not a saved machine profile: it is not JSON (cut off, or another "
                                 f"kind of file: {exc}); pass the file 'placement-opt profile --out PATH' wrote",
                                 param_hint="--devices") from None
    profiled = isinstance(data, dict) and "machine" in data
    whole = data if profiled else {}
    if profiled:
        data = data["machine"]
    if not isinstance(data, dict) or "devices" not in data:
        hint = ("write one with 'placement-opt profile --out NEW_PATH' and pass that" if foreign_file(path, "profile")
                else f"write one with 'placement-opt profile --out {path}'")
        raise click.BadParameter(f"{str(path)!r} is not a saved machine profile (no 'devices' list): {hint}",
                                 param_hint="--devices")
    machine = Machine.from_dict(data)
    if not profiled:
        return machine
    # a profile's machine is priced with the unit times calibrated into that file (profile --out PATH --model M),
    # and at the speeds it measured for the model's dtype, as --devices auto reads them from the same file: its
    # machine snapshot holds the dtype profiled last (a float32 plan was priced at bfloat16's rate, 2x fast)
    try:
        devices = _in_dtype(machine.devices, whole, dtype)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a hand-edited or cut measurement
        what = f"no {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise click.BadParameter(f"{str(path)!r} holds a malformed measurement ({what}): measure again with "
                                 f"'placement-opt profile --out {path}'", param_hint="--devices") from None
    return Machine(devices, machine.links, path.resolve())


def _in_dtype(devices: Any, profile: dict[str, Any], dtype: str) -> list[Any]:
    """``devices`` of a saved profile's machine with the compute speeds its measurements hold for ``dtype`` (else
    the fallback :func:`~..hardware.profile_store.device_from_measurement` takes, said in the source)."""
    from ..hardware.devices import replace_device
    from ..hardware.profile_store import device_from_measurement, dtype_key

    measured = profile.get("measurements")
    if not isinstance(measured, dict) or not isinstance(profile.get("created"), str):
        return list(devices)
    out = []
    for device in devices:
        entry = measured.get(device.name)
        if device.name == "disk" or not isinstance(entry, dict) or not entry.get("matmul_flops_per_s"):
            out.append(device)
            continue
        speeds = device_from_measurement(device.name, entry, dtype_key(dtype), profile["created"])
        out.append(replace_device(device, flops_per_s=speeds.flops_per_s, flops_by_tokens=speeds.flops_by_tokens,
                                  bandwidth_bytes_per_s=speeds.bandwidth_bytes_per_s, source=speeds.source))
    return out


def workload_from(batch: int, prompt: int, new_tokens: int, logits: str | None = None,
                  overlap: bool = False, padded: bool = False) -> Workload:
    from ..cost.workload import Workload

    try:
        return Workload(batch_size=batch, prompt_len=prompt, new_tokens=new_tokens, logits=logits, overlap=overlap,
                        padded=padded)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def solve_options(func: Any) -> Any:
    options = [
        click.argument("model"),
        click.option("--devices", "-d", default=None, metavar="SPEC",
                     help="the machine: devices with presets or budgets, e.g. 'cuda:0=a100-40gb,cpu=256GiB,disk'; "
                          "'auto' (this machine); or a saved profile .json (required; plan takes --cluster "
                          "instead for several machines)"),
        click.option("--objective", type=click.Choice(OBJECTIVES), default="latency", show_default=True,
                     help="what the plan minimises: latency, one request's prefill + decode; throughput, the "
                          "busiest device's work per request (what back-to-back requests wait on); memory, the fewest "
                          "bytes on the GPUs whose latency stays within 5 % of the best"),
        click.option("--batch", type=int, default=1, show_default=True, help="sequences generated together"),
        click.option("--prompt", type=int, default=512, show_default=True, help="prompt tokens (prefill)"),
        click.option("--new-tokens", type=int, default=128, show_default=True, help="tokens generated"),
        click.option("--logits", type=click.Choice(["last", "all"]), default=None,
                     help="positions whose logits the prompt computes: 'last' (generate(), the default when "
                          "generating) or 'all' (a plain forward, e.g. scoring every position)"),
        click.option("--padded", is_flag=True,
                     help="the prompts differ in length and are padded to --prompt under an attention mask: "
                          "the forwards then hold the masks transformers builds for them (Workload.padded)"),
        click.option("--dtype", type=click.Choice(DTYPES), default=None,
                     help="weight dtype (default: the model's own, from its config)"),
        click.option("--overlap", is_flag=True,
                     help="price each streamed copy as the prefetch thread runs it, beside the compute of the "
                          "units before it (CPU-computed ones included), not beside its own unit's only "
                          "(Workload.overlap; opt-in: weaker bounds in 1 s)"),
        click.option("--time-limit", type=click.FloatRange(min=0, min_open=True), default=None, metavar="S",
                     help=f"CP-SAT time limit in seconds (default: the solver's 1 s; without it, `plan` and `compare` "
                          f"search up to {EXTRA_SEARCH_S:g} s more when the plan is not proven within 1 % of the best)"),
        click.option("--no-cache", is_flag=True,
                     help="trace the model even when its graph is in the graph cache ($PLACEMENT_OPT_CACHE, else "
                          "~/.cache/placement_opt/graphs), and keep nothing there"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def cluster_options(func: Any) -> Any:
    """``plan --cluster SPEC``: pipeline stages over the ranks of several hosts (issue 16)."""
    options = [
        click.option("--cluster", default=None, metavar="SPEC|FILE.json",
                     help="plan pipeline stages over a cluster, e.g. '2x(h100-sxm*8,cpu-server)@ib-200g' or a "
                          "JSON file; --batch is then one micro-batch, --prompt its sequence length"),
        click.option("--schedule", type=click.Choice(["1f1b", "gpipe"]), default="1f1b", show_default=True,
                     help="with --cluster: the torch.distributed.pipelining schedule"),
        click.option("--microbatches", type=int, default=None, metavar="N",
                     help="with --cluster: micro-batches per step (default: one per rank)"),
        click.option("--train", is_flag=True, help="with --cluster: price training steps (forward + backward, Adam)"),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def parse_pins(values: Sequence[str]) -> dict[str, str]:
    """``--pin lm_head=cuda:0 --pin 'model.layers.*.mlp.experts=cpu'`` -> ``solve``'s pins (checked there)."""
    pins: dict[str, str] = {}
    for text in values:
        key, sep, device = text.rpartition("=")
        if not sep or not device.strip():
            raise click.UsageError(f"--pin {text!r}: give MODULE=DEVICE, e.g. --pin lm_head=cuda:0 or "
                                   f"--pin 'model.layers.*.mlp.experts=cpu' (a pattern: quote it)")
        if key.strip() in pins and pins[key.strip()] != device.strip():
            raise click.UsageError(f"--pin {key.strip()!r} is given twice, to {pins[key.strip()]} and {device.strip()}")
        pins[key.strip()] = device.strip()
    return pins


def parse_modes(text: str) -> tuple[str, ...]:
    """``"resident,stream"`` -> the modes the solver may choose; a word that is none of them, or a list without
    ``resident``, is refused in the flag's words (``solve`` would say ``modes=(...)``)."""
    from ..planner import SOLVER_MODES as offered  # not at import: `--help` loads no solver

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in offered]
    if unknown or "resident" not in modes:
        what = f"{', '.join(repr(m) for m in unknown)} {'is' if len(unknown) == 1 else 'are'} not a mode" if unknown \
            else "resident is missing"
        raise click.BadParameter(f"--modes {text}: {what}; give some of {', '.join(offered)}, resident included, e.g. "
                                 f"--modes resident,stream for a plan without phased units", param_hint="--modes")
    return modes


def require_devices(devices: str | None) -> str:
    if devices is None:
        context = click.get_current_context(silent=True)
        plan = context is not None and context.info_name == "plan"
        raise click.UsageError("Missing option '--devices' / '-d'" + (" (or '--cluster')" if plan else ""))
    return devices


def check_output_folder(path: str | None, option: str) -> None:
    """Refuse an empty output path (a shell variable left unset wrote nothing, silently), and an output file in a
    folder that does not exist, before any work is done."""
    _check_not_empty(path, option)
    if path and path != "-" and not (folder := Path(path).expanduser().resolve().parent).is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist; create it first"
        raise click.BadParameter(f"{path!r}: folder {str(Path(path).parent)!r} {what}, or give a path in an "
                                 f"existing folder", param_hint=option)


def _check_not_empty(path: str | None, option: str) -> None:
    if path is not None and not path.strip():
        raise click.BadParameter("an empty path writes nothing: give a file name, or leave the option out",
                                 param_hint=option)


def check_plot_suffix(path: str | None) -> None:
    """Refuse a ``--plot`` path of another format, or holding a file placement_opt did not draw (never drawn over)."""
    _check_not_empty(path, "--plot")
    if path and Path(path).suffix.lower() not in (".png", ".svg", ".html", ".htm"):
        raise click.BadParameter(f"{path!r}: use a .png, .svg or .html file name", param_hint="--plot")
    if path and (why := foreign_picture(Path(path).expanduser())) is not None:
        raise click.BadParameter(refusal(path, "picture", why), param_hint="--plot")


def check_outputs(json_path: str | None, plot: str | None, kind: str = "plan") -> None:
    """Refuse ``--json`` / ``--plot`` paths that cannot be written, before any solving: a ``--json`` file there
    that is not a ``kind`` placement_opt wrote (a key of :data:`placement_opt._files.OWN_JSON`) is the user's."""
    check_plot_suffix(plot)
    check_output_folder(json_path, "--json")
    check_output_folder(plot, "--plot")
    check_not_foreign(json_path, kind, "--json")
    if json_path and plot and json_path != "-" and _same_file(json_path, plot):
        # the JSON, written first, would be drawn over (or refused as no picture, after the whole solve)
        raise click.BadParameter(f"{plot!r} is the --json file too: give the pictures a path of their own",
                                 param_hint="--plot")


def _same_file(a: str, b: str) -> bool:
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def check_not_foreign(path: str | None, kind: str, option: str) -> None:
    """Refuse an output path holding a file placement_opt did not write as a ``kind`` (never written over)."""
    if path and path != "-" and (why := foreign_file(Path(path).expanduser(), kind)) is not None:
        raise click.BadParameter(refusal(path, kind, why), param_hint=option)


def expert_groups_option(func: Any) -> Any:
    """``--expert-groups N``: each MoE layer's experts cut into N units (with ``--granularity sublayer``/``auto``)."""
    return click.option(
        "--expert-groups", "expert_groups", type=click.IntRange(min=1), default=1, show_default=True, metavar="N",
        help="with --granularity sublayer or auto: cut each MoE layer's experts into N groups placed on their own, "
             "so the GPU can hold part of a layer's experts (1: a layer's experts are one unit)")(func)


def check_expert_groups(expert_groups: int, granularity: str) -> None:
    if expert_groups > 1 and granularity not in ("sublayer", "auto"):
        raise click.UsageError(f"--expert-groups {expert_groups} cuts sublayer units: add --granularity sublayer "
                               f"(or auto)")
