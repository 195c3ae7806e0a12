"""Runs with more than one process: the launch context, the training-loop rules, per-rank planning.

``context`` <- ``rules``, ``ranks``. A rank's share of the machine is worked out by
``placement_opt.hardware.resolve.resolve_machine`` from the context this package detects.
``pipeline_plan`` (stand-alone): contiguous pipeline stages over the ranks of a cluster, cut by
``placement_opt.solver.stages``.
"""

__all__: list[str] = []
