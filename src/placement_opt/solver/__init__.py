"""The solver: a PlacementProblem in integers -> one option per unit. Imports no torch, no transformers.

``problem`` (the problem, its one cost and objective definitions) <- ``greedy`` (the device_map
strategies and a constructive start), ``reductions`` (coarsening, a restriction for a start plan),
``edges`` (covered edges, exact) and ``symmetry`` (interchangeable devices, exact) <- ``cpsat`` (the
CP-SAT model), ``aggregate`` and ``relax`` (counting relaxations: bounds and start plans), ``polish``
(local search on the exact price, under overlap) <- ``search`` (``solve_problem``: start, reductions,
the memory objective's two solves, bound and gap).
"""

__all__: list[str] = []
