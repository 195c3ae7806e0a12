"""The ``placement-opt`` command (:mod:`.main`), its rich tables (:mod:`.tables`) and pictures (:mod:`.pictures`)."""

__all__: list[str] = []
