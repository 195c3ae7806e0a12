"""The solver: a PlacementProblem in integers -> one option per unit. Imports no torch, no transformers.

``problem`` <- ``reductions`` <- ``cpsat``; ``greedy`` (the device_map strategies) reads the problem too.
"""

__all__: list[str] = []
