"""The ``placement-opt`` command: the commands (:mod:`.main`; ``run`` in :mod:`.run`, ``profile``, ``presets`` and
``bench`` in :mod:`._machine_commands`), the words they read (:mod:`.options`),
what they print and write (:mod:`.output`), rich tables (:mod:`.tables`) and pictures (:mod:`.pictures`)."""

__all__: list[str] = []
