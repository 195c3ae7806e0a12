"""The README's CPU-route Quickstart command, run as written in a fresh virtualenv (slow: minutes).

The command is read from README.md, not copied here, so the test fails when the README's
install line stops working. One option is dropped: ``--index-url https://download.pytorch.org/whl/cpu``.
This test runs where no host but the package registry is reachable; ``torch==2.13.0`` then comes
from the local pip configuration (``PIP_FIND_LINKS``, a local CPU wheel, as ``.ci/run`` installs it),
exactly the pin the README names. Everything else (the venv, the editable install with the ``dev``
extra, the first ``placement-opt plan``) runs verbatim, in a copy of the working tree so that the
command's ``.venv`` never touches the checkout's own. ``.ci/run`` builds its own virtualenv with the same
command and says so (``PLACEMENT_OPT_README_ROUTE_BUILT_THIS_VENV``): the replay is skipped there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from _readme import CPU_INDEX, readme_cpu_command, readme_test_command, without_cpu_index

ROOT = Path(__file__).resolve().parent.parent


def test_readme_cpu_route_names_the_cpu_index_and_the_pin():
    command = readme_cpu_command()
    assert f"pip install torch==2.13.0 {CPU_INDEX}" in command
    assert 'pip install -e ".[dev]"' in command and "placement-opt plan" in command


def test_readme_test_command_is_what_ci_runs_and_its_options_are_installed():
    """.ci/run runs the Quickstart's test command as the README writes it; its ``-n`` needs pytest-xdist, which the
    dev extra the install line names must bring."""
    command = readme_test_command()
    assert command.startswith("python -m pytest -q"), command
    assert "$readme_tests" in (ROOT / ".ci" / "run").read_text()
    if " -n " in f"{command} ":
        assert '"pytest-xdist' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.slow
def test_readme_cpu_route_installs_and_plans_in_a_fresh_virtualenv(tmp_path):
    if os.environ.get("PLACEMENT_OPT_README_ROUTE_BUILT_THIS_VENV"):
        pytest.skip(".ci/run built this test run's virtualenv with the README's CPU-route command itself "
                    "(and checked its plan and its torch): no need to build a second one")
    if not os.environ.get("PIP_FIND_LINKS") and not os.environ.get("PIP_INDEX_URL"):
        pytest.skip("no local pip configuration provides torch==2.13.0 (PIP_FIND_LINKS), and the CPU "
                    "index is not reachable from the test machine")
    checkout = tmp_path / "placement_opt"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    command = without_cpu_index(readme_cpu_command())
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p)
    env["COLUMNS"] = "160"
    proc = subprocess.run(["bash", "-c", f"set -e; {command}"], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "llama-3-70b" in proc.stdout and "Memory per device" in proc.stdout
    version = subprocess.run([str(checkout / ".venv/bin/python"), "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, check=True).stdout
    assert version.startswith("2.13.0")
