"""The package surface: lazy exports, __all__ everywhere, and a torch-free solver side."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import placement_opt


def test_every_module_declares_all() -> None:
    missing = []
    for info in pkgutil.walk_packages(placement_opt.__path__, "placement_opt."):
        module = importlib.import_module(info.name)
        if not hasattr(module, "__all__"):
            missing.append(info.name)
    assert missing == []


PUBLIC = ["trace", "solve", "evaluate", "dispatch", "load", "profile", "calibrate", "Workload", "Device", "Machine", "Plan",
          "DispatchedModel", "PlacementError", "InfeasiblePlacementError", "pipeline", "Cluster"]


def test_the_public_surface_is_the_documented_dozen() -> None:
    assert sorted(placement_opt.__all__) == sorted([*PUBLIC, "__version__"])
    for name in PUBLIC:
        assert name in placement_opt.__doc__, f"{name} is missing from the package docstring's table"


def test_public_names_resolve_and_are_documented() -> None:
    for name in PUBLIC:
        value = getattr(placement_opt, name)
        doc = inspect.getdoc(value) or ""
        assert len(doc) > 40, f"placement_opt.{name} has no real docstring"


def test_entry_points_show_an_example() -> None:
    for name in ("trace", "solve", "evaluate", "dispatch", "load", "profile", "Plan"):
        doc = inspect.getdoc(getattr(placement_opt, name)) or ""
        assert ">>>" in doc or "Example" in doc, f"placement_opt.{name}'s docstring has no example"


@pytest.mark.parametrize("name, home", [
    ("LayerGraph", "placement_opt.model.graph"), ("list_models", "placement_opt.model.catalog"),
    ("Cost", "placement_opt.cost.evaluate"), ("UnitPlacement", "placement_opt.plan"),
    ("detect_context", "placement_opt.distributed.context"),
    ("should_place_on_device", "placement_opt.distributed.rules"), ("TraceError", "placement_opt.errors"),
])
def test_names_that_left_the_top_level_still_resolve_with_a_warning(name: str, home: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"placement_opt.{name} moved to {home}.{name}"):
        value = getattr(placement_opt, name)
    assert value is getattr(importlib.import_module(home), name)
    assert name not in placement_opt.__all__ and name not in dir(placement_opt)


def test_every_error_is_a_placement_error_and_a_value_error() -> None:
    from placement_opt import errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.PlacementError) and issubclass(cls, ValueError), name
        assert (cls.__doc__ or "").strip(), name


def test_no_test_module_imports_another() -> None:
    # Shared builders live in tests/_models.py and tests/_plans.py (issue 11).
    tests_dir = Path(__file__).resolve().parent
    while tests_dir.name != "tests":
        tests_dir = tests_dir.parent
    offenders = []
    for path in sorted(tests_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(tests_dir)} imports {n}" for n in names
                          if n.split(".")[-1].startswith("test_")]
    assert offenders == []


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        placement_opt.no_such_thing  # noqa: B018
    except AttributeError as err:
        assert "no_such_thing" in str(err)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_solver_side_never_imports_torch() -> None:
    # The graph -> problem -> solver -> plan side must run without torch (STYLE.md rule 2).
    code = (
        "import sys\n"
        "import placement_opt.model.graph, placement_opt.hardware.devices, placement_opt.cost.workload\n"
        "import placement_opt.solver.problem, placement_opt.plan\n"
        "import placement_opt.solver.cpsat, placement_opt.solver.greedy, placement_opt.solver.reductions\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_stage_functions_stay_functions_after_their_modules_are_imported() -> None:
    # No module is named like the function it exports, so importing the module never shadows it.
    code = (
        "import importlib, placement_opt\n"
        "for name, module_name in (('trace', 'model.tracer'), ('solve', 'planner'),\n"
        "                          ('dispatch', 'runtime.dispatcher'), ('load', 'runtime.loader'),\n"
        "                          ('profile', 'hardware.profiler')):\n"
        "    module = importlib.import_module('placement_opt.' + module_name)\n"
        "    assert callable(getattr(placement_opt, name)), name\n"
        "    assert getattr(placement_opt, name) is getattr(module, name), name\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_stage_modules_are_attributes_without_an_import() -> None:
    code = ("import placement_opt, types\n"
            "stages = ('model', 'hardware', 'cost', 'solver', 'plan', 'planner', 'compare', 'runtime',\n"
            "          'distributed', 'cli', 'errors', 'units')\n"
            "print(all(isinstance(getattr(placement_opt, s), types.ModuleType) for s in stages))\n"
            "print(placement_opt.errors.TraceError.__module__, placement_opt.cost.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "placement_opt.errors", "placement_opt.cost"]
