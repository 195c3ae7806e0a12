"""The plans solve() gives on a fixed grid stay exactly the recorded ones (tests/fixtures/recorded_plans.py).

The grid runs in a subprocess under a fixed string hash seed (see the fixture script's docstring);
the whole grid takes about 20 s on two cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "fixtures" / "recorded_plans.py"
FIXTURE = SCRIPT.with_suffix(".json")


@pytest.mark.slow
def test_solve_reproduces_every_recorded_plan() -> None:
    want = json.loads(FIXTURE.read_text())["plans"]
    assert len(want) >= 30
    run = subprocess.run([sys.executable, str(SCRIPT), "--emit"], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout)
    assert sorted(got) == sorted(want)
    differ = {}
    for key, plan in want.items():
        if got[key] != plan:
            moved = [(w, g) for w, g in zip(plan.get("placements", []), got[key].get("placements", []), strict=False)
                     if w != g]
            differ[key] = {"want": {k: v for k, v in plan.items() if k != "placements"},
                           "got": {k: v for k, v in got[key].items() if k != "placements"}, "units": moved[:3]}
    assert not differ, json.dumps(differ, indent=1)
