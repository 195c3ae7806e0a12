"""The ``placement-opt`` commands that plan nothing: profile, presets, bench.

``profile`` measures this machine (and, with ``--model``, calibrates a model's units on it), ``presets``
lists the model presets and the device presets with their datasheet figures, and ``bench`` runs the
benchmark suite. :mod:`.main` adds them to its command group; as there, heavy modules are imported inside
the commands.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from .options import (
    DTYPES,
    check_expert_groups,
    check_not_foreign,
    check_output_folder,
    expert_groups_option,
    model_dtype,
    resolve_model,
    workload_from,
)
from .output import Failure, console_for, devices_table, errors_as_messages, say_written
from .tables import presets_tables

__all__ = ["profile", "presets", "bench"]


@click.command()
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="where to save the profile (default: $PLACEMENT_OPT_PROFILE or "
                   "~/.cache/placement_opt/profile.json)")
@click.option("--quick", is_flag=True, help="shorter, less precise measurements (see the durations above)")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="the dtype the model will run in, measured (default: --model's, else bfloat16)")
@click.option("--model", default=None, metavar="MODEL",
              help="also calibrate this model (a preset name, config.json or model directory): one unit of "
                   "each shape timed here at --batch/--prompt/--new-tokens; plans for this machine use it")
@click.option("--batch", type=int, default=1, show_default=True, help="with --model: sequences generated together")
@click.option("--prompt", type=int, default=512, show_default=True, help="with --model: prompt tokens (prefill)")
@click.option("--new-tokens", type=int, default=128, show_default=True, help="with --model: tokens generated")
@click.option("--granularity", type=click.Choice(["block", "sublayer", "auto"]), default="block", show_default=True,
              help="with --model: the units timed, as plan --granularity cuts them (auto: block and sublayer both)")
@expert_groups_option
def profile(out: str | None, quick: bool, dtype: str | None, model: str | None, batch: int, prompt: int,
            new_tokens: int, granularity: str, expert_groups: int) -> None:
    """Measure this machine (compute, memory and disk bandwidth, links) and save the profile.

    Only the dtype the model runs in is timed (a CPU computes float16, bfloat16 and float32 at
    very different speeds); earlier figures of other dtypes stay in the file. It takes, on a
    2-core CPU with no GPU: about 12 s in bfloat16 (6 s with --quick), 2.5 s in float32 with
    --quick; each GPU adds a few seconds.

    With --model, the model is calibrated too: a copy cut to one layer of each shape is built
    with random weights and each unit is timed through placement_opt's dispatch at the workload's
    prefill and decode shapes (on a 2-core CPU, 4-9 s for a 7B shape; under a minute with the disk,
    whose reads are timed too); plans for this machine then
    price those units with the times measured, whatever form --devices takes. Plans made with
    --granularity sublayer (or auto, and --expert-groups) need their parts timed too: pass the same
    options here.

    Use the saved file with --devices PATH, or --devices auto when it is at the default place.
    """
    console = console_for()
    check_expert_groups(expert_groups, granularity)
    from ..hardware.profile_store import profile_path

    check_not_foreign(out or str(profile_path()), "profile", "--out")
    if model is None and (granularity != "block" or expert_groups > 1):
        raise click.UsageError("--granularity and --expert-groups say how --model is timed: add --model MODEL")
    given = click.get_current_context().get_parameter_source
    shaping = [f"--{name.replace('_', '-')}" for name in ("batch", "prompt", "new_tokens")
               if given(name) == click.core.ParameterSource.COMMANDLINE]
    if model is None and shaping:  # the devices are measured at fixed sizes: alone, these were ignored
        raise click.UsageError(f"{', '.join(shaping)} {'says' if len(shaping) == 1 else 'say'} the workload --model is "
                               f"timed at: add --model MODEL, or leave {'it' if len(shaping) == 1 else 'them'} out")
    with errors_as_messages():
        from ..hardware.profile_store import profile_path
        from ..hardware.profiler import profile as measure

        resolved = resolve_model(model) if model else None
        workload = workload_from(batch, prompt, new_tokens)
        dtype = dtype or (model_dtype(model) if model else "bfloat16")
        started = time.perf_counter()
        machine = measure(path=out, quick=quick, dtype=dtype)  # its bar: one step per measurement, on stderr
        took = time.perf_counter() - started
        calibrated = None
        if resolved is not None:
            from ..runtime.calibrate import calibrate

            calibrated = calibrate(resolved, machine.names, workload=workload, dtype=dtype, path=out,
                                   granularity=granularity, expert_groups=expert_groups, repeats=1 if quick else 2)
    console.print(devices_table(machine))
    if calibrated is not None:
        console.print(calibrated.summary(), markup=False, highlight=False)
    say_written(console, f"measured in {took:.1f} s; saved to {profile_path(out)}")


@click.command()
def presets() -> None:
    """List the model presets and the GPU, CPU and disk presets with their datasheet figures."""
    console = console_for()
    for table in presets_tables():
        console.print(table)


@click.command()
@click.option("--quick", is_flag=True, help="small sizes and few repeats (a smoke run)")
@click.option("--only", multiple=True, metavar="NAME", help="run only these experiments (repeatable)")
@click.option("--collect", is_flag=True, help="run nothing: rebuild the report from the results there")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="where to write the report (default benchmarks/RESULTS.md)")
@click.option("--list", "list_", is_flag=True, help="list the experiments and what each asks, run nothing")
def bench(quick: bool, only: tuple[str, ...], collect: bool, out: str | None, list_: bool) -> None:
    """Run the benchmark suite (benchmarks/run_all.py) and regenerate benchmarks/RESULTS.md.

    A bar on stderr counts the experiments (on a terminal, or as PLACEMENT_OPT_PROGRESS says).
    """
    import os
    import subprocess

    from ..progress import ENV, progress_enabled

    check_output_folder(out, "--out")
    running = [flag for flag, on in (("--quick", quick), ("--only", bool(only))) if on]
    if collect and running:  # run_all.py would drop them: nothing runs, and --quick labelled the report a smoke run
        raise click.UsageError(f"{' and '.join(running)} with --collect: --collect runs nothing and rebuilds the report "
                               f"from every folder's last results; leave {'them' if len(running) > 1 else 'it'} out, "
                               f"or leave --collect out to run")
    script = _benchmarks_dir() / "run_all.py"
    if not script.is_file():
        raise Failure(f"{script} not found: 'bench' needs a source checkout of placement_opt")
    if list_:  # what --only takes; nothing runs, nothing is written
        listed = subprocess.run([sys.executable, str(script), "--list"], stdout=subprocess.PIPE, text=True)
        click.echo(listed.stdout, nl=False)
        return
    command = [sys.executable, str(script)] + (["--quick"] if quick else []) + (["--collect"] if collect else [])
    for name in only:
        command += ["--only", name]
    if out:
        command += ["--out", str(Path(out).resolve())]
    shown = progress_enabled()  # the suite's bar needs our stderr itself (a pipe would hide it until the end)
    proc = subprocess.run(command, cwd=script.parent.parent, stdout=subprocess.PIPE,
                          stderr=None if shown else subprocess.PIPE, text=True,
                          env=dict(os.environ, **{ENV: "1" if shown else "0"}))
    click.echo(proc.stdout, nl=False)
    errors = (proc.stderr or "").strip()
    if proc.returncode == 2:
        raise click.UsageError(errors.splitlines()[-1] if errors else "benchmarks/run_all.py refused the arguments "
                               "(its message is above)")
    if proc.returncode:
        click.echo(proc.stderr or "", nl=False, err=True)
        raise Failure(f"benchmark suite failed (exit code {proc.returncode}); see the report for which")


def _benchmarks_dir() -> Path:
    return Path(__file__).resolve().parents[3] / "benchmarks"
