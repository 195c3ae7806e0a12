"""Runs with more than one process: the launch context, the training-loop rules, a rank's share.

``context`` <- ``rules``, ``ranks``.
"""

__all__: list[str] = []
