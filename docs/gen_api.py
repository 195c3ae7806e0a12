"""Generate docs/api.md from the docstrings of placement_opt's public names.

Usage::

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is out of date

Walks the package's stages in data-flow order (:data:`STAGES`) and every public module in them,
every name in its ``__all__``, and writes its signature and docstring; dataclass fields get the
docstring written under them in the source. A module that does not import stops the script.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import inspect
import os
import pkgutil
import re
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "api.md"

#: The package's parts in the order data flows through them; modules inside a folder are found
#: by walking it (every public module, ``_private`` ones skipped), so a new module is never missed.
STAGES = ["model", "hardware", "cost", "solver", "planner", "baselines", "plan_notes", "plan", "plan_check",
          "report", "compare", "runtime", "distributed", "cli", "schema", "errors", "units", "progress"]


def modules() -> list[tuple[str, str]]:
    """(module, one-line role) for the package and every public module, in data-flow order."""
    package = importlib.import_module("placement_opt")
    found = [("placement_opt", "the public surface")]
    for stage in STAGES:
        module = importlib.import_module(f"placement_opt.{stage}")
        found.append((module.__name__, _role(module)))
        if hasattr(module, "__path__"):
            for info in sorted(pkgutil.iter_modules(module.__path__), key=lambda i: i.name):
                if not info.name.startswith("_"):
                    name = f"{module.__name__}.{info.name}"
                    found.append((name, _role(importlib.import_module(name))))
    missing = {f"placement_opt.{i.name}" for i in pkgutil.iter_modules(package.__path__)
               if not i.name.startswith("_")} - {m for m, _ in found}
    if missing:
        raise SystemExit(f"gen_api.py: add {sorted(missing)} to STAGES in data-flow order")
    return found


def _role(module: object) -> str:
    doc = inspect.getdoc(module) or ""
    return _rst_to_md(doc.split("\n")[0].rstrip(".")) if doc else ""


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


#: Around every example taken from a docstring that is not a doctest: the docs test (Sybil,
#: ../conftest.py) skips it with this reason. Such examples are excerpts over names the reader
#: defines; runnable ones are in the guides. Doctests (``>>>``) run and their outputs are checked.
_ILLUSTRATIVE = '<!-- skip: start "illustrative: an excerpt of the docstring above, over names the reader defines" -->'


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
            code = textwrap.dedent("\n".join(block)).split("\n")
            if code[0].startswith(">>>"):  # a doctest: run, its outputs checked
                out += ["", "```python", *code, "```", ""]
            else:
                out += ["", _ILLUSTRATIVE, "```python", *code, "```", "<!-- skip: end -->", ""]
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _signature(obj: object) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return re.sub(r" at 0x[0-9a-f]+>", ">", text)  # default values' addresses change every run


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
        if isinstance(value, (property, functools.cached_property)):  # computed once or each time, read alike
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
    module = importlib.import_module(module_name)  # a module that does not import is a bug: fail
    lines = [f'<a id="{anchor}"></a>', f"## `{module_name}`: {role}", "", _doc(module), ""]
    if module_name == "placement_opt":
        homes = [(n, getattr(module, n).__module__) for n in module.__all__ if not n.startswith("__")]
        return lines + ["Public names, each documented in its home module:", "",
                        *[f"- [`{n}`](#{home.replace('.', '')}): `{home}.{n}`" for n, home in homes], ""]
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name, None)
        if obj is None:
            lines += [f"### `{name}`", "", "_(declared in `__all__` but missing)_", ""]
        elif inspect.isclass(obj):
            lines += _class_section(name, obj)
        elif callable(obj):
            lines += [f"### `{name}{_signature(obj)}`", "", _doc(obj), ""]
        else:
            # Sets print in hash order, which changes between runs: sorted, the page is reproducible.
            text = f"{type(obj).__name__}({sorted(obj)!r})" if isinstance(obj, (set, frozenset)) else repr(obj)
            # a path under the home of whoever generated the page is written as ~: the page is the same for anyone
            text = text.replace(str(Path.home()), "~") if isinstance(obj, os.PathLike) else text
            text = text if len(text) < 300 else text[:300] + " ..."
            lines += [f"### `{name}`", "", f"`{text}`", ""]
    return lines


def generate() -> str:
    """The whole api.md text."""
    lines = ["# API reference", "",
             "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.", "",
             "Modules, in the order data flows through them:", ""]
    found = modules()
    lines += [f"- [`{m}`](#{m.replace('.', '')}): {role}" for m, role in found]
    lines.append("")
    for module_name, role in found:
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
