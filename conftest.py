"""The Python blocks of README.md and docs/*.md run as tests (Sybil), each file in a scratch folder.

A block that cannot run here (it needs a GPU, a checkpoint or ``torchrun``) is preceded by
``<!-- skip: next "why" -->`` and is reported as skipped with that reason; ``>>>`` blocks have
their outputs checked, the others run and their ``# comments`` show illustrative values.
Set-up a reader would have anyway (a tiny model, a parsed ``args``) sits in
``<!-- invisible-code-block: python -->`` comments beside the block.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser


def pytest_configure(config: Any) -> None:
    """Tests and docs read no profile of the machine they run on (``~/.cache/placement_opt/profile.json``): its
    measured speeds would price their plans apart from a fresh checkout's. A test of profiles sets its own."""
    folder = tempfile.mkdtemp(prefix="placement_opt_profile_")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ["PLACEMENT_OPT_PROFILE"] = os.path.join(folder, "profile.json")


def _enter_scratch(namespace: dict[str, Any]) -> None:
    namespace["_cwd"] = os.getcwd()
    namespace["_scratch"] = tempfile.mkdtemp(prefix="placement_opt_docs_")
    os.chdir(namespace["_scratch"])


def _leave_scratch(namespace: dict[str, Any]) -> None:
    os.chdir(namespace["_cwd"])
    shutil.rmtree(namespace["_scratch"], ignore_errors=True)


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md"],
    setup=_enter_scratch,
    teardown=_leave_scratch,
).pytest()
