"""The solver: a PlacementProblem in integers -> one option per unit. Imports no torch, no transformers.

``problem`` (the problem, its one cost and objective definitions) <- ``greedy`` (the device_map
strategies and a constructive start) and ``reductions`` <- ``cpsat`` (the CP-SAT model) <- ``search``
(``solve_problem``: start, coarsening, the memory objective's two solves, bound and gap).
"""

__all__: list[str] = []
