"""Progress bars of long work (``load()``, ``profile``, ``bench``): one switch for the whole package.

A bar is shown on stderr, never stdout (``--json -`` keeps standard output pure JSON), when
:func:`progress_enabled` says so:

* the ``progress=`` keyword of :func:`placement_opt.load` / :func:`placement_opt.profile`: ``True``
  or ``False`` decides; ``None`` (the default) asks the environment;
* the environment variable ``PLACEMENT_OPT_PROGRESS``: ``1`` (always, also into a pipe or a
  captured stream: the final bar is written once when the work ends), ``0`` (never) or ``auto``
  (the default): shown when stderr is a terminal or in a Jupyter notebook (rich detects both),
  silent in pipes, files and under pytest.

Updates are cheap: :meth:`Bar.advance` adds to a counter and passes it to rich only once about
1 % of the total has gathered (or when the step's description changes), so a bar per tensor costs
nothing measurable on the paths it counts.

Example::

    with bar("Loading weights", total=nbytes, unit="bytes", progress=None) as b:
        for tensor in tensors:
            ...
            b.advance(tensor.nbytes)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ENV", "switch", "progress_enabled", "Bar", "bar"]

#: The environment variable of the switch: ``auto`` (default), ``1`` or ``0``.
ENV = "PLACEMENT_OPT_PROGRESS"
_ON = ("1", "true", "yes", "on", "always")
_OFF = ("0", "false", "no", "off", "never")


def switch() -> str:
    """``"on"``, ``"off"`` or ``"auto"``: what ``$PLACEMENT_OPT_PROGRESS`` says (anything unrecognised is auto)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    return "on" if value in _ON else "off" if value in _OFF else "auto"


def progress_enabled(progress: bool | None = None) -> bool:
    """Whether a bar is shown: ``progress`` if given, else ``$PLACEMENT_OPT_PROGRESS``, else auto.

    Auto: on when stderr is a terminal or the code runs in Jupyter, off under pytest and in pipes.
    An unrecognised value of the variable counts as ``auto``.
    """
    if progress is not None:
        return bool(progress)
    said = switch()
    if said != "auto":
        return said == "on"
    if "PYTEST_CURRENT_TEST" in os.environ:
        return False
    from rich.console import Console

    console = Console(stderr=True)
    return console.is_terminal or console.is_jupyter


class Bar:
    """One task of a progress bar; a silent one (``shown`` False) does nothing but count."""

    def __init__(self, total: float, progress: Any = None, task: Any = None) -> None:
        self.total = total
        self.done = 0.0
        self.shown = progress is not None
        self._progress, self._task = progress, task
        self._pending = 0.0
        self._step = max(total / 100, 1e-12) if total else 0.0

    def advance(self, amount: float = 1, description: str | None = None) -> None:
        """Count ``amount`` more done; rich hears of it per ~1 % of the total or a new description."""
        self.done += amount
        if not self.shown:
            return
        self._pending += amount
        if description is not None or self._pending >= self._step:
            self._flush(description)

    def describe(self, description: str) -> None:
        """Name the step in progress (shown at once)."""
        if self.shown:
            self._flush(description)

    def _flush(self, description: str | None = None) -> None:
        fields: dict[str, Any] = {"completed": self.done}
        if description is not None:
            fields["description"] = description
        self._progress.update(self._task, **fields)
        self._pending = 0.0


def _columns(unit: str) -> list[Any]:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    counts = [DownloadColumn(binary_units=True), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn()]
    return [TextColumn("{task.description}"), BarColumn(), *counts, TimeElapsedColumn(), TimeRemainingColumn()]


@contextmanager
def bar(description: str, total: float, *, unit: str = "steps", progress: bool | None = None) -> Iterator[Bar]:
    """A rich progress bar on stderr for ``total`` bytes (``unit="bytes"``) or steps, if enabled.

    Leaves the finished bar on screen (its final text: description, ``done/total``, elapsed time).
    When :func:`progress_enabled` says no, the bar is silent and rich is not imported.
    """
    if not progress_enabled(progress):
        yield Bar(total)
        return
    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    with Progress(*_columns(unit), console=console, redirect_stdout=False, redirect_stderr=False) as shown:
        task = shown.add_task(description, total=total)
        handle = Bar(total, shown, task)
        try:
            yield handle
        finally:
            handle._flush()
