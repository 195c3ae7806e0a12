"""Generate docs/api.md from the docstrings of placement_opt's public names.

Usage::

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is out of date

Walks every module listed in :data:`MODULES` (in data-flow order), every name in its
``__all__``, and writes its signature and docstring; dataclass fields get the docstring written
under them in the source. A module that cannot be imported yet is listed as "not yet available",
so the reference never claims something that is not there.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "api.md"

#: (module, one-line role) in the order of the data flow.
MODULES = [
    ("placement_opt", "the package: lazy re-exports of the entry points"),
    ("placement_opt.model.catalog", "built-in model presets (published configurations)"),
    ("placement_opt.model.tracer", "stage 1: model -> LayerGraph"),
    ("placement_opt.model.graph", "the layer graph every later stage reads"),
    ("placement_opt.hardware.devices", "devices, machines, presets"),
    ("placement_opt.hardware.detect", "this machine's capacities"),
    ("placement_opt.hardware.resolve", "what a user calls a machine -> Machine; device specs"),
    ("placement_opt.hardware.profiler", "measuring this machine"),
    ("placement_opt.hardware.profile_store", "the saved profile"),
    ("placement_opt.cost.workload", "what the model will be asked to do"),
    ("placement_opt.cost.pricing", "stage 3: prices of every placement option"),
    ("placement_opt.cost.memory", "memory per device and violations"),
    ("placement_opt.cost.build", "stage 3: LayerGraph + Machine + Workload -> PlacementProblem"),
    ("placement_opt.cost.device_map", "accelerate device maps"),
    ("placement_opt.cost.evaluate", "the price of any placement: evaluate, Cost"),
    ("placement_opt.solver.problem", "the integer problem the solvers read"),
    ("placement_opt.solver.cpsat", "the CP-SAT model"),
    ("placement_opt.solver.greedy", "device_map='auto' family of greedy strategies"),
    ("placement_opt.planner", "stage 4: solve() -> Plan"),
    ("placement_opt.plan", "stage 5: the frozen Plan"),
    ("placement_opt.compare", "every strategy side by side"),
    ("placement_opt.runtime.dispatcher", "stage 6: run a plan"),
    ("placement_opt.runtime.loader", "stage 6: load a checkpoint into a plan"),
    ("placement_opt.runtime.offload", "safetensors files of disk-stored weights"),
    ("placement_opt.distributed.context", "distributed launch context"),
    ("placement_opt.distributed.rules", "placement rules of training loops"),
    ("placement_opt.distributed.ranks", "a rank's share of the machine"),
    ("placement_opt.errors", "the exception hierarchy"),
    ("placement_opt.cli.pictures", "pictures of plans and comparisons"),
    ("placement_opt.cli.main", "the placement-opt command"),
]


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (``x: int`` then ``\"\"\"doc\"\"\"``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _doc(obj: object) -> str:
    return _rst_to_md(inspect.cleandoc(obj.__doc__)) if getattr(obj, "__doc__", None) else "_(no docstring)_"


_ROLE_RE = re.compile(r":(?:func|class|data|meth|mod|attr|obj|exc):`~?([^`]+)`")


def _rst_to_md(doc: str) -> str:
    """The little reStructuredText our docstrings use, as Markdown: literal blocks, tables, roles."""
    doc = _ROLE_RE.sub(r"`\1`", doc).replace("``", "`")
    out: list[str] = []
    lines = doc.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("===") and set(line.replace(" ", "")) == {"="}:
            end = max(j for j in range(i, len(lines)) if lines[j].startswith("==="))
            out += ["```text", *lines[i:end + 1], "```"]
            i = end + 1
            continue
        if line.rstrip().endswith("::"):
            text = line.rstrip()[:-2].rstrip()
            if text:
                out.append(text + ":")
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            block = []
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            out += ["", "```python", *textwrap.dedent("\n".join(block)).split("\n"), "```", ""]
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _class_section(name: str, cls: type) -> list[str]:
    lines = [f"### class `{name}{_signature(cls) if not dataclasses.is_dataclass(cls) else ''}`", "",
             _doc(cls), ""]
    if dataclasses.is_dataclass(cls):
        docs = _field_docs(cls)
        lines += ["| field | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = "" if f.default is dataclasses.MISSING else f"`{f.default!r}`"
            if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = "factory"
            kind = str(f.type).replace("|", "\\|")
            lines.append(f"| `{f.name}` | `{kind}` | {default} | {docs.get(f.name, '')} |")
        lines.append("")
    members = []
    for attr, value in vars(cls).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, property):
            members.append(f"- `{attr}` (property): {_first_line(value)}")
        elif isinstance(value, (classmethod, staticmethod)):
            func = value.__func__
            members.append(f"- `{attr}{_signature(func)}`: {_first_line(func)}")
        elif inspect.isfunction(value):
            members.append(f"- `{attr}{_signature(value)}`: {_first_line(value)}")
    if members:
        lines += ["Members:", "", *members, ""]
    return lines


def _first_line(obj: object) -> str:
    doc = getattr(obj, "__doc__", None)
    return _rst_to_md(inspect.cleandoc(doc).split("\n")[0]) if doc else ""


def _module_section(module_name: str, role: str) -> list[str]:
    anchor = module_name.replace(".", "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return [f'<a id="{anchor}"></a>', f"## `{module_name}`: {role}", "",
                f"**Not yet available** in this version ({type(exc).__name__}: {exc}).", ""]
    lines = [f'<a id="{anchor}"></a>', f"## `{module_name}`: {role}", "", _doc(module), ""]
    if module_name == "placement_opt":
        return lines + [f"Exports: {', '.join(f'`{n}`' for n in module.__all__)}.", ""]
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name, None)
        if obj is None:
            lines += [f"### `{name}`", "", "_(declared in `__all__` but missing)_", ""]
        elif inspect.isclass(obj):
            lines += _class_section(name, obj)
        elif callable(obj):
            lines += [f"### `{name}{_signature(obj)}`", "", _doc(obj), ""]
        else:
            text = repr(obj)
            text = text if len(text) < 300 else text[:300] + " ..."
            lines += [f"### `{name}`", "", f"`{text}`", ""]
    return lines


def generate() -> str:
    """The whole api.md text."""
    lines = ["# API reference", "",
             "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.", "",
             "Modules, in the order data flows through them:", ""]
    lines += [f"- [`{m}`](#{m.replace('.', '')}): {role}" for m, role in MODULES]
    lines.append("")
    for module_name, role in MODULES:
        lines += _module_section(module_name, role)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate docs/api.md from docstrings.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is out of date")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent / "src"))
    text = generate()
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
