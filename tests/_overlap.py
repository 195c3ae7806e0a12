"""The dispatcher's prefetch played in time: the reference for the cost model's stalls (problem.py's Overlap).

Written from the runtime's behaviour (runtime/_streamer.py, runtime/dispatcher.py's ``_link_prefetch``), not
from ``placement_opt.solver.problem.stalls``: shared by the solver's brute force and the cost properties.
"""

from __future__ import annotations


def simulated_waits(durations, copies, cyclic):
    """How long each unit waits for its weights, by playing the dispatcher's two threads in time.

    One thread runs the units in order for their durations; a prefetch thread copies the weights of the
    next streamed unit (``copies[i] > 0``) from the moment the streamed unit before it starts (the first one
    from time 0). ``cyclic``: the units repeat (decode steps; the last streamed unit prefetches the first);
    the waits of a late round, once the pattern repeats, are returned.
    """
    n = len(durations)
    streamed = [i for i in range(n) if copies[i] > 0]
    if not streamed:
        return [0] * n
    clock = 0
    weights_ready = copies[streamed[0]]
    waits = [0] * n
    for _ in range(3 if cyclic else 1):
        for i in range(n):
            if copies[i] > 0:
                waits[i] = max(0, weights_ready - clock)
                clock += waits[i]
                later = [j for j in streamed if j > i] or (streamed if cyclic else [])
                if later:
                    weights_ready = clock + copies[later[0]]  # the copy starts as unit i starts
            clock += durations[i]
    return waits
