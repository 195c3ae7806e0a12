"""solver/ runs where torch cannot be imported at all (ARCHITECTURE.md: the solver is torch-free).

The import-linter contract in pyproject.toml checks the static imports; this test checks the running
code: a fresh interpreter whose import system refuses torch, transformers and accelerate imports
``placement_opt.solver`` and solves a hand-built problem.
"""

from __future__ import annotations

import subprocess
import sys

_CODE = '''
import importlib.abc
import sys

BLOCKED = ("torch", "transformers", "accelerate")


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None


sys.meta_path.insert(0, Blocker())
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker let torch through")

import placement_opt.solver
from placement_opt.solver.search import solve_problem
from placement_opt.solver.greedy import choice_from_storage
from placement_opt.solver.problem import DeviceSpec, EdgeSpec, PlacementOption, PlacementProblem, UnitSpec


def option(storage, execution, mode, prefill_ns, decode_ns):
    return PlacementOption(storage=storage, execution=execution, mode=mode, prefill_ns=prefill_ns,
                           decode_ns=decode_ns, stored_bytes=100, resident_bytes=0, peak_bytes=0)


# Two units of 100 bytes; the GPU holds one (150 bytes), so one unit runs from the CPU.
# a: GPU 10 + 10 ns, CPU 50 + 50 ns; b: GPU 10 + 10 ns, CPU 30 + 30 ns; a GPU<->CPU hop costs 5 ns.
menu = {"a": (20, 100), "b": (20, 60)}
units = tuple(UnitSpec(name=n, options=(option("cuda:0", "cuda:0", "resident", g // 2, g // 2),
                                        option("cpu", "cpu", "resident", c // 2, c // 2)))
              for n, (g, c) in menu.items())
hop = {("cuda:0", "cpu"): 5, ("cpu", "cuda:0"): 5}
problem = PlacementProblem(units=units, edges=(EdgeSpec(src="a", dst="b", prefill_ns=hop, decode_ns={}),),
                           devices=(DeviceSpec(name="cuda:0", kind="gpu", capacity_bytes=150),
                                    DeviceSpec(name="cpu", kind="cpu", capacity_bytes=1000)))
solution = solve_problem(problem, "latency", time_limit_s=5.0, workers=1)
hint = choice_from_storage(problem, {"a": "cuda:0", "b": "cpu"})
print(solution.status, list(solution.choice), solution.objective_value, hint,
      any(m.split(".")[0] in BLOCKED for m in sys.modules))
'''


def test_solver_imports_and_solves_with_torch_unimportable() -> None:
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    # a on the GPU (20 ns), b on the CPU (60 ns), one hop (5 ns): 85 ns; the other way is 125 ns.
    assert out.stdout.split() == ["OPTIMAL", "[0,", "1]", "85", "[0,", "1]", "False"]
