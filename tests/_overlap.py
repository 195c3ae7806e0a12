"""The dispatcher's prefetch played in time: the reference for the cost model's stalls (problem.py's Overlap).

Written from the runtime's behaviour (runtime/_streamer.py, runtime/_prefetch_links.py's ``link_prefetch``), not
from ``placement_opt.solver.problem.stalls``: shared by the solver's brute force and the cost properties.
"""

from __future__ import annotations


def simulated_waits(durations, copies, cyclic, runs=None):
    """How long each unit waits for its weights, by playing the dispatcher's two threads in time.

    One thread runs the units in order for their durations; a prefetch thread copies the weights of the
    next streamed unit (``copies[i] > 0``) from the moment the streamed unit before it starts (the first one
    from time 0). ``cyclic``: the units repeat (decode steps; the last streamed unit prefetches the first);
    the waits of a late round, once the pattern repeats, are returned.

    ``runs``: ``(first, end)`` ranges copied as one, as the cost model charges them: a run's head (its first
    unit) waits for every copy of its run, and starts the next copying run's copies.
    """
    if runs is not None:
        return _run_waits(durations, copies, cyclic, runs)
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


def _run_waits(durations, copies, cyclic, runs):
    n = len(durations)
    run_copy = [sum(copies[a:b]) for a, b in runs]
    copying = [r for r, c in enumerate(run_copy) if c > 0]
    waits = [0] * n
    if not copying:
        return waits
    clock, ready = 0, run_copy[copying[0]]
    for _ in range(3 if cyclic else 1):
        for r, (a, b) in enumerate(runs):
            if run_copy[r] > 0:
                waits[a] = max(0, ready - clock)
                clock += waits[a]
                later = [k for k in copying if k > r] or (copying if cyclic else [])
                if later:
                    ready = clock + run_copy[later[0]]
            clock += sum(durations[a:b])
    return waits


def dispatcher_step_time(durations, copies, cyclic, runs):
    """One forward's time (a late one when ``cyclic``) under the dispatcher's group prefetch as it runs.

    runtime/_hooks.py: a run's head, when it starts, queues its own run's copies (those not queued yet) and
    then the next copying run's on the one prefetch thread, which copies them in order, one at a time; each
    streamed unit waits only for its own copy. Written from that behaviour, not from the cost model's
    charge, which waits for the whole run at its head. The first copying run is queued at time 0, as the
    call before wrapping around does (a first call ever copies it when its head starts). The only copying
    run of a decode has each unit copy itself again once it has its weights (it would be its own next).
    """
    run_of = {u: r for r, (a, b) in enumerate(runs) for u in range(a, b)}
    copying = [r for r, (a, b) in enumerate(runs) if any(copies[a:b])]
    clock, thread_free, done, queued = 0, 0, {}, set()

    def queue(r):
        nonlocal thread_free
        for u in range(*runs[r]):
            if copies[u] > 0 and u not in queued:
                start = max(thread_free, clock)
                thread_free = done[u] = start + copies[u]
                queued.add(u)

    if not copying:
        return sum(durations)
    queue(copying[0])  # the call before (a decode step wrapping around) queued it
    step = 0
    for _ in range(3 if cyclic else 1):
        begun = clock
        for u in range(len(durations)):
            r = run_of[u]
            if u == runs[r][0] and r in copying:
                queue(r)
                later = [k for k in copying if k > r] or (copying if cyclic else [])
                if later:
                    queue(later[0])
            if copies[u] > 0:
                clock = max(clock, done[u])
                queued.discard(u)  # taken: the next round copies it again
                if cyclic and len(copying) == 1:
                    queue(r)  # the only copying run: each unit copies itself again for the next step
            clock += durations[u]
        step = clock - begun
    return step
