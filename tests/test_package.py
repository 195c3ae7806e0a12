"""The package surface: lazy exports, __all__ everywhere, and a torch-free solver side."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import placement_opt


def test_every_module_declares_all() -> None:
    missing = []
    for info in pkgutil.walk_packages(placement_opt.__path__, "placement_opt."):
        module = importlib.import_module(info.name)
        if not hasattr(module, "__all__"):
            missing.append(info.name)
    assert missing == []


def test_public_names_resolve() -> None:
    for name in placement_opt.__all__:
        assert getattr(placement_opt, name) is not None, name


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
    code = ("import placement_opt, placement_opt.distributed.context, placement_opt.model.catalog\n"
            "ctx = placement_opt.distributed.context.detect_context({})\n"
            "print(ctx.kind, placement_opt.model.catalog.list_models()[0] != '', placement_opt.detect_context is "
            "placement_opt.distributed.context.detect_context)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["single", "True", "True"]
