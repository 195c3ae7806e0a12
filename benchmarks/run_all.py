"""Run every placement_opt benchmark and regenerate benchmarks/RESULTS.md (tables + figures).

Usage::

    python benchmarks/run_all.py            # everything, full sizes
    python benchmarks/run_all.py --quick    # smoke sizes, a few minutes
    python benchmarks/run_all.py --only solve_time --only strategies
    python benchmarks/run_all.py --collect  # no runs: rebuild RESULTS.md from the folders' results
    python benchmarks/run_all.py --list

Each experiment is registered in :data:`EXPERIMENTS`: either a script in its question's folder
(run in a fresh interpreter, which writes that folder's RESULTS.md) or a callable here that
returns Markdown. RESULTS.md then gathers, per experiment, the machine it ran on, the command
that reruns it, its status and wall time, and its tables; figures go to benchmarks/figures/.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

__all__ = ["Experiment", "EXPERIMENTS", "machine_description", "main"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: Where figures go: ``figures/`` beside the report (set by :func:`main` from ``--out``).
FIGURES = HERE / "figures"
RESULTS = HERE / "RESULTS.md"

sys.path.insert(0, str(HERE))  # machine_info beside this file, also where a test loads it by path
from machine_info import cpu_model  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """One benchmark: a script in ``benchmarks/<folder>/`` or a callable returning Markdown."""

    name: str
    question: str
    """The question it answers, as a heading of RESULTS.md."""
    folder: str
    script: str = ""
    """File name in ``folder``; empty: the folder's only runnable script is found."""
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ("--quick",)
    """Added with ``--quick`` when the script accepts them (it mentions ``--quick``)."""
    func: Callable[[bool], str] | None = None
    """Instead of a script: called with ``quick``, returns the Markdown body."""
    timeout_s: int = 1800
    results_file: str = "RESULTS.md"


@dataclass(kw_only=True)
class Outcome:
    experiment: Experiment
    status: str
    wall_s: float
    command: str
    body: str = ""
    log_tail: str = ""
    figures: list[str] = field(default_factory=list)


# -- the experiment of this file: strategies side by side, with pictures ------------------------

#: (model preset, device spec, batch, prompt, new tokens) compared by the ``strategies`` experiment.
STRATEGY_CASES = [
    ("llama-2-70b", "cuda:0=a100-40gb,cuda:1=a100-40gb,cpu=256GiB,disk", 1, 512, 256),
    ("llama-2-13b", "cuda:0=rtx-4090,cuda:1=rtx-3060,cpu=64GiB,disk", 1, 512, 256),
    ("llama-2-13b", "cuda:0=rtx-4090,cuda:1=rtx-3060,cpu=64GiB,disk", 8, 2048, 256),
    ("mixtral-8x7b", "cuda:0=a100-80gb,cpu=256GiB,disk", 16, 1024, 256),
    ("llama-3-8b", "cuda:0=t4,cpu=32GiB,disk", 4, 4096, 512),
]


#: A second CP-SAT time limit the full run also reports (the default is solve()'s, 1 s).
LONG_LIMIT_S = 10.0


def strategies(quick: bool) -> str:
    """Every strategy on a few model x machine x workload cases: the table ``compare`` prints."""
    sys.path.insert(0, str(ROOT / "src"))
    import placement_opt as po
    from placement_opt.cli.pictures import save_report
    from placement_opt.compare import compare_strategies
    from placement_opt.cost.workload import Workload
    from placement_opt.hardware.resolve import parse_device_spec
    from placement_opt.model import catalog as models

    cases = STRATEGY_CASES[:2] if quick else STRATEGY_CASES
    known = set(models.list_models())
    lines = ["Estimated by placement_opt's cost model for each strategy (lower is better; OOM = "
             "the strategy's map overflows a device under the memory model). `cpsat` runs with "
             f"solve()'s default 1 s time limit; the full run adds a row with a {LONG_LIMIT_S:g} s limit "
             "to show what the short limit leaves on the table. Machines are presets (datasheet "
             "figures), so these tables do not depend on the machine that computes them; the "
             "solve times do.", ""]
    for model, spec, batch, prompt, new in cases:
        if model not in known:
            lines.append(f"- {model}: not a preset in this version (skipped)")
            continue
        workload = Workload(batch_size=batch, prompt_len=prompt, new_tokens=new)
        machine = parse_device_spec(spec)
        started = time.perf_counter()
        config = models.model_config(model)
        graph = po.trace(config)
        outcomes = compare_strategies(graph, machine, workload=workload, source=config)
        wall = time.perf_counter() - started
        if not quick:  # how much the default 1 s CP-SAT limit leaves on the table
            longer = compare_strategies(graph, machine, workload=workload, strategies=["cpsat"],
                                        time_limit_s=LONG_LIMIT_S)[0]
            outcomes.append(replace(longer, strategy=f"cpsat, {LONG_LIMIT_S:g} s limit"))
        lines += [f"### {model} on `{spec}`, batch {batch} x prompt {prompt} + {new} new tokens", "",
                  f"Command: `placement-opt compare {model} --devices {spec} --batch {batch} "
                  f"--prompt {prompt} --new-tokens {new}` ({wall:.1f} s including tracing)", ""]
        lines += _strategy_table(outcomes)
        best = next((o.plan for o in outcomes if o.strategy == "cpsat" and o.plan), None)
        if best is not None:
            FIGURES.mkdir(parents=True, exist_ok=True)
            figure = FIGURES / f"strategies_{model}_b{batch}_p{prompt}.png"
            save_report(best, figure, outcomes)
            lines += ["", f"![{model}](figures/{figure.name})"]
        lines.append("")
    return "\n".join(lines)


def _where_computed(plan) -> str:
    from placement_opt.cli.tables import where_computed as where

    return where(plan)


def _strategy_table(outcomes) -> list[str]:
    ref = next((o.total_s for o in outcomes if o.strategy == "cpsat" and o.fits), None)
    rows = ["| strategy | fits | prefill s | decode s | total s | vs cpsat | tokens/s | GPU/CPU/streamed units "
            "| solve s | gap |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for o in outcomes:
        if o.plan is None:
            rows.append(f"| {o.strategy} | no plan: {o.error[:80]} | | | | | | | | |")
            continue
        c = o.plan.cost
        ratio = "OOM" if not c.fits else f"{c.total_s / ref:.2f}x" if ref else "-"
        fits = "yes" if c.fits else "**OOM** " + "; ".join(
            f"{v.device} short {v.short_bytes / 2**30:.1f} GiB" for v in c.violations)
        gap = f"{o.plan.gap:.1%}" if o.strategy.startswith("cpsat") else "-"
        rows.append(f"| {o.strategy} | {fits} | {c.prefill_s:.3f} | {c.decode_s:.3f} | {c.total_s:.3f} | "
                    f"{ratio} | {c.tokens_per_s:.2f} | {_where_computed(o.plan)} | "
                    f"{o.plan.solve_time_s:.2f} | {gap} |")
    return rows


#: Every experiment, in report order. Scripts belong to the engineers of each question.
EXPERIMENTS: list[Experiment] = [
    Experiment(name="tracing", question="How long does tracing take, and how much memory?",
               folder="tracing"),
    Experiment(name="solve_time", question="How fast does CP-SAT solve, and to what gap?",
               folder="solve_time"),
    Experiment(name="plan_quality", question="How much better than the baselines are the plans?",
               folder="plan_quality"),
    Experiment(name="strategies", question="Strategies side by side (the `compare` command)",
               folder="figures", func=strategies),
    Experiment(name="cost_accuracy", question="Does the cost model predict measured times on this machine?",
               folder="cost_accuracy"),
    Experiment(name="dispatch", question="How fast does the dispatcher run a plan, vs accelerate?",
               folder="dispatch"),
    Experiment(name="decode", question="Do CPU-executed units decode as fast as the plain CPU model?",
               folder="decode"),
    Experiment(name="offload_store", question="What does the safe offload store cost a dispatch?",
               folder="offload_store"),
    Experiment(name="phases", question="Which execution mode wins where: layer, phased, sublayer, overlap "
               "(estimates)?", folder="phases"),
]


# -- running --------------------------------------------------------------------------------------


def machine_description() -> str:
    """CPU model, cores, RAM, GPUs and the OS: the line every table is tagged with."""
    cpu = cpu_model()
    ram = ""
    try:
        import psutil

        ram = f", {psutil.virtual_memory().total / 2**30:.0f} GiB RAM"
    except ImportError:
        pass
    gpus = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    except ImportError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores{ram}, {gpus}, {platform.system()} {platform.release()}"


def _find_script(experiment: Experiment) -> Path | None:
    folder = HERE / experiment.folder
    if experiment.script:
        path = folder / experiment.script
        return path if path.is_file() else None
    if not folder.is_dir():
        return None
    preferred = [folder / n for n in ("run.py", "bench.py", "benchmark.py", f"{experiment.folder}.py")]
    for path in preferred:
        if path.is_file():
            return path
    mains = sorted(p for p in folder.glob("*.py")
                   if not p.name.startswith("_") and "__main__" in p.read_text(encoding="utf-8"))
    return mains[0] if len(mains) == 1 else None


def _run_script(experiment: Experiment, quick: bool) -> Outcome:
    script = _find_script(experiment)
    if script is None:
        return Outcome(experiment=experiment, status="not yet: no script in "
                       f"benchmarks/{experiment.folder}/", wall_s=0.0, command="")
    args = list(experiment.args)
    if quick and "--quick" in script.read_text(encoding="utf-8"):
        args += list(experiment.quick_args)
    command = [sys.executable, str(script.relative_to(ROOT)), *args]
    shown = " ".join(["python", *command[1:]])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               PLACEMENT_OPT_PROGRESS="0")  # its output is captured: no bars in the log
    results = script.parent / experiment.results_file
    # A quick run must not replace the folder's full results: keep them and put them back after
    # (unless someone else wrote full results meanwhile: a file that does not say --quick stays).
    kept = results.read_bytes() if quick and results.is_file() else None
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=experiment.timeout_s)
        status = "ok" if proc.returncode == 0 else f"failed (exit code {proc.returncode})"
        log = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        status = f"timed out after {experiment.timeout_s} s"
        log = str(exc.stdout or "")[-3000:]
    wall = time.perf_counter() - started
    body = results.read_text(encoding="utf-8") if results.is_file() else ""
    if quick and "--quick" in body:  # our smoke results (each results file states its command)
        if kept is not None:
            results.write_bytes(kept)
        else:
            results.unlink()
    return Outcome(experiment=experiment, status=status, wall_s=wall, command=shown, body=body,
                   log_tail="" if status == "ok" else log)


def _run_func(experiment: Experiment, quick: bool) -> Outcome:
    started = time.perf_counter()
    command = f"python benchmarks/run_all.py --only {experiment.name}" + (" --quick" if quick else "")
    try:
        body = experiment.func(quick) if experiment.func else ""
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - one experiment's failure is reported, not fatal
        body, status = "", f"failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return Outcome(experiment=experiment, status=status, wall_s=time.perf_counter() - started,
                   command=command, body=body)


def _collect(experiment: Experiment, previous: dict[str, str]) -> Outcome:
    """No run: read what the folder's last run left (or this file's previous section)."""
    if experiment.func is not None:
        section = previous.get(experiment.name, "")
        return Outcome(experiment=experiment, status="collected" if section else "not run",
                       wall_s=0.0, command=f"python benchmarks/run_all.py --only {experiment.name}",
                       body=section)
    script = _find_script(experiment)
    results = (script.parent if script else HERE / experiment.folder) / experiment.results_file
    body = results.read_text(encoding="utf-8") if results.is_file() else ""
    shown = f"python {script.relative_to(ROOT)}" if script else ""
    return Outcome(experiment=experiment, status="collected" if body else "not yet: no results",
                   wall_s=0.0, command=shown, body=body)


_SECTION_RE = re.compile(r"<!-- section:(\w+) -->\n(.*?)<!-- /section:\1 -->", re.S)


def _previous_sections(path: Path = RESULTS) -> dict[str, str]:
    if not path.is_file():
        return {}
    return {m.group(1): m.group(2) for m in _SECTION_RE.finditer(path.read_text(encoding="utf-8"))}


def _demote(markdown: str) -> str:
    """Push the headings of a folder's RESULTS.md two levels down, below our own."""
    return re.sub(r"^(#{1,4}) ", lambda m: "#" * min(len(m.group(1)) + 2, 6) + " ", markdown, flags=re.M)


def _section_body(outcome: Outcome) -> str:
    if outcome.experiment.func is not None:
        return outcome.body
    return _demote(outcome.body.strip()) if outcome.body else "_No results file yet._"


#: The report's first line: a file at ``--out`` that starts so is an earlier report (:func:`_foreign_out`).
TITLE = "# placement_opt benchmark results"


def render(outcomes: list[Outcome], *, quick: bool, machine: str, previous: dict[str, str]) -> str:
    """The whole RESULTS.md: a summary table, then one section per experiment."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mode = " --quick" if quick else ""
    if any(o.wall_s for o in outcomes):
        origin = [f"Regenerated by `python benchmarks/run_all.py{mode}` (or `placement-opt bench{mode}`) on {now}.",
                  f"Machine: {machine}."]
    else:  # the machine that gathered the files is not the one that measured them
        origin = [f"Rebuilt from the folders' results by `python benchmarks/run_all.py --collect` (or `placement-opt "
                  f"bench --collect`) on {now}, on {machine}: nothing ran here; each section says where it ran."]
    lines = [
        TITLE, "", *origin, "",
        "Each section below names the command that reruns it. Times on a shared VM are noisy; each "
        "folder's own RESULTS.md says how it was measured and how busy the machine was.", "",
        "| experiment | status | wall time | rerun |", "|---|---|---:|---|",
    ]
    for o in outcomes:
        wall = f"{o.wall_s:.1f} s" if o.wall_s else "-"
        lines.append(f"| [{o.experiment.name}](#{o.experiment.name}) | {o.status} | {wall} | "
                     f"`{o.command or '-'}` |")
    lines.append("")
    for o in outcomes:
        body = _section_body(o)
        if o.experiment.func is not None and o.status.startswith("not run"):
            body = previous.get(o.experiment.name, "_Not run yet._")
        lines += [f'<a id="{o.experiment.name}"></a>', f"## {o.experiment.name}: {o.experiment.question}",
                  "", f"Machine: {machine if o.wall_s else 'as stated in the results below'}. "
                  f"Rerun: `{o.command or 'not available yet'}`. Status: {o.status}.",
                  "", f"<!-- section:{o.experiment.name} -->", body.rstrip(), "",
                  f"<!-- /section:{o.experiment.name} -->", ""]
        if o.log_tail:
            lines += ["<details><summary>log tail</summary>", "", "```", o.log_tail.rstrip(), "```",
                      "", "</details>", ""]
    return "\n".join(lines)


def _run_selected(args: argparse.Namespace) -> list[Outcome]:
    """Run the selected experiments (a bar on stderr counts them), collect the others."""
    from placement_opt.progress import bar

    previous = _previous_sections(args.out)
    selected = [e for e in EXPERIMENTS if not args.collect and (not args.only or e.name in args.only)]
    outcomes = []
    with bar("Benchmarks", len(selected), progress=None if selected else False) as counted:
        for experiment in EXPERIMENTS:
            if experiment not in selected:
                outcomes.append(_collect(experiment, previous))
                continue
            counted.describe(f"Benchmarks: {experiment.name}")
            print(f"[run_all] {experiment.name} ...", flush=True)
            outcome = (_run_func if experiment.func else _run_script)(experiment, args.quick)
            print(f"[run_all] {experiment.name}: {outcome.status} ({outcome.wall_s:.1f} s)", flush=True)
            outcomes.append(outcome)
            counted.advance(1)
        counted.describe("Benchmarks")
    return outcomes


def _foreign_out(out: Path) -> str | None:
    """Why the report must not be written at ``out`` (it would replace a user's file, or draw into a ``figures``
    folder beside it that no report made), or None: ``out`` is absent and has no ``figures`` beside it, empty, or
    an earlier report (whose figures those are)."""
    try:
        if out.is_file() and out.stat().st_size > 0:
            with open(out, encoding="utf-8", errors="replace") as fh:
                return None if fh.readline().startswith(TITLE) else "is a file that is not this suite's report"
        if out.exists() and not out.is_file():
            return "is not a file"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if out.resolve() != RESULTS.resolve() and (out.resolve().parent / "figures").exists():
        return "has a figures/ folder beside it that no report of this suite made"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke sizes (minutes, not hours)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this experiment (repeatable); the others are collected")
    parser.add_argument("--collect", action="store_true",
                        help="run nothing: rebuild RESULTS.md from the results already there")
    parser.add_argument("--list", action="store_true", help="list the experiments and exit")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write (default: %(default)s)")
    args = parser.parse_args(argv)
    names = [e.name for e in EXPERIMENTS]
    unknown = [n for n in args.only if n not in names]
    if unknown:
        parser.error(f"unknown experiment(s) {', '.join(unknown)}: known are {', '.join(names)}")
    if args.list:
        for e in EXPERIMENTS:
            where = "run_all.py" if e.func else f"benchmarks/{e.folder}/"
            print(f"{e.name:15s} {where:28s} {e.question}")
        return 0
    if (why := _foreign_out(args.out)) is not None:
        parser.error(f"{args.out} {why}: the report is written only over an earlier one (with its figures/ beside "
                     f"it), never over another file; name another path, or move that away first")
    global FIGURES
    FIGURES = args.out.resolve().parent / "figures"
    previous = _previous_sections(args.out)
    machine = machine_description()
    outcomes = _run_selected(args)
    args.out.write_text(render(outcomes, quick=args.quick, machine=machine, previous=previous),
                        encoding="utf-8")
    print(f"[run_all] wrote {args.out}")
    failed = [o for o in outcomes if o.status.startswith(("failed", "timed out"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
