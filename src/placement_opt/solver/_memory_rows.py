"""The memory rows of :class:`~.cpsat.PlacementModel`: capacity, transient peaks, copy runs, GPU bytes.

Torch-free. A mixin: it reads the model's data and variables (``p``, ``x``, ``model``, ``hint``,
``chosen``, ``devices``, ``peak``, ``_own_vars``) and its helpers (``_opts``, ``_hinted``, ``_terms``,
``_hint_of``), all set up by :class:`~.cpsat.PlacementModel`; the variables it adds (``z``, ``peak``,
``copies``, ``any``, ``first``, ``own``) are defined in :mod:`.cpsat`'s docstring.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from .problem import (
    PlacementOption,
    Transient,
    device_transients,
    next_copies,
    phase_copies,
    phase_peaks,
)
from .rows import add_capacity_row, peak_levels

__all__: list[str] = []


class _MemoryRows:
    """Stored + resident + peak bytes within every device's capacity, and the GPU bytes of the memory objective."""

    def _transients(self, options: Any) -> dict[str, list[tuple[int, Any]]]:
        """Device -> (transient bytes, x or 1) of each of ``options`` ((x, option) pairs) putting one there
        (peaks(): the execution device's, and a phased option's prefill device's), in order; one pass."""
        out: dict[str, list[tuple[int, Any]]] = {d: [] for d in self.devices}
        for var, opt in options:
            for d, nbytes in opt.peaks_apart():
                out[d].append((nbytes, var))
        return out

    def _peak(self, dev: str, flagged: list[tuple[int, Any]], hinted: int) -> Any:
        # peak[d] from level flags (see peak_levels); x[u, o] switches on the level of each transient its
        # option puts on d; ``hinted``: the hint's peak there.
        peak, levels, z = peak_levels(self.model, dev, flagged)
        for level, zj in zip(levels, z, strict=True):
            self._hinted(zj, int(hinted >= level))
        return peak

    def _run_peak(self, dev: str, hinted: Transient | None) -> Any:
        # device_transients as rows, per phase: copies[ph, r, d] = run r's group copies to d in ph; the next
        # copying run's (_next_chain; a prefill's last wraps to the decode's first); peak[d] >= own[r] (the
        # largest own peak in ph of a unit of r, phase_peaks) + copies + the larger of the next and the copies,
        # as two rows.
        top = max((n for u in range(len(self.p.units)) for _, opt in self._opts(u) for d, n in opt.peaks_apart()
                   if d == dev), default=0)
        most = max((opt.group_copy_bytes for u in range(len(self.p.units)) for _, opt in self._opts(u)
                    if opt.group_copy_bytes and opt.group_device == dev), default=0)
        most *= max(b - a for a, b in self.p.runs)
        peak = self._hinted(self.model.new_int_var(0, top + 2 * most, f"peak[{dev}]"),
                            hinted.total_bytes if hinted else 0)
        wrap: Any = 0
        own = {phase: [self._run_own(dev, phase, a, b) for a, b in self.p.runs] for phase in ("decode_ns", "prefill_ns")}
        for phase in ("decode_ns", "prefill_ns"):
            rows, chain = [], []
            for r, (a, b) in enumerate(self.p.runs):
                copying = [(u, o, opt) for u in range(a, b) for o, opt in self._opts(u)
                           if phase_copies(opt, phase) and opt.group_device == dev]
                run = None
                if copying:
                    run, bound = self._copies(f"copies[{phase},{a},{dev}]", copying, a, b)
                    chain.append((r, run, bound, copying))
                if own[phase][r] is not None or run is not None:
                    rows.append((r, own[phase][r], run))
            if not chain:
                for _, mine, _ in rows:
                    self.model.add(peak >= mine)
                continue
            head, first = self._next_chain(dev, phase, chain, wrap if phase == "prefill_ns" else None)
            wrap = first
            for r, mine, run in rows:
                base = (mine if mine is not None else 0) + (run if run is not None else 0)
                self.model.add(peak >= base + head(r))
                if run is not None:  # the next copies count at least as the run's own
                    self.model.add(peak >= base + run)
        return peak

    def _run_own(self, dev: str, phase: str, a: int, b: int) -> Any:
        # The largest own peak on dev (phase_peaks) of the run's units a..b-1 in phase: an expression, or None
        # when no option of theirs computes there. The phases share one variable where their peaks agree.
        terms = [(n, self.x[u, o]) for u in range(a, b) for o, opt in self._opts(u)
                 for d, n in phase_peaks(opt, phase) if d == dev and n > 0]
        if not terms:
            return None
        if len(terms) == 1:
            return terms[0][0] * terms[0][1]
        key = tuple(sorted((n, x.index) for n, x in terms))
        if key not in self._own_vars:
            hint = max((n for n, x in terms if self._hint_of(x)), default=0)
            var = self._hinted(self.model.new_int_var(0, max(n for n, _ in terms), f"own[{a},{dev}]"), hint)
            for n, x in terms:
                self.model.add(var >= n * x)
            self._own_vars[key] = var
        return self._own_vars[key]

    def _copies(self, name: str, copying: list[tuple[int, int, PlacementOption]], a: int, b: int) -> tuple[Any, int]:
        # A run's group copies to a device in a phase, as a variable (sum of its copying options' bytes x), and
        # its bound.
        most = sum(max((opt.group_copy_bytes for v, _, opt in copying if v == u), default=0) for u in range(a, b))
        hint = sum(opt.group_copy_bytes for u, o, opt in copying if self.hint[u] == o)
        var = self._hinted(self.model.new_int_var(0, most, name), hint)
        self.model.add(var == sum(opt.group_copy_bytes * self.x[u, o] for u, o, opt in copying))
        return var, most

    def _next_chain(self, dev: str, phase: str, chain: list[tuple[int, Any, int, list[tuple[int, int, PlacementOption]]]],
                    wrap: Any) -> tuple[Callable[[int], Any], Any]:
        # first[j] >= copies[j] and, where run j copies nothing (any[j] = 0, which copies[j] > 0 rules out),
        # >= first[j + 1], round the cycle (wrap None) or, past the last, >= ``wrap``: at the least, the copies of
        # the first copying run from j on. Returns (run r -> the next copies after r, first[0]).
        values = [self._hint_of(copies) for _, copies, _, _ in chain]
        after = next_copies(values, None if wrap is None else self._hint_of(wrap))
        most = max(m for _, _, m, _ in chain)
        first = [self._hinted(self.model.new_int_var(0, most, f"first[{phase},{r},{dev}]"), values[j] or after[j])
                 for j, (r, *_) in enumerate(chain)]
        for j, (r, copies, bound, copying) in enumerate(chain):
            any_ = self._hinted(self.model.new_bool_var(f"any[{phase},{r},{dev}]"), int(values[j] > 0))
            least = min(opt.group_copy_bytes for _, _, opt in copying)
            self.model.add(copies <= bound * any_)  # copying sets it ...
            self.model.add(copies >= least * any_)  # ... and only copying
            self.model.add(first[j] >= copies)
            following = first[(j + 1) % len(chain)] if wrap is None or j + 1 < len(chain) else wrap
            if not isinstance(following, int):  # a wrap of 0: no decode copies to start
                self.model.add(first[j] >= following).only_enforce_if(any_.Not())
        positions = [r for r, *_ in chain]

        def head(r: int) -> Any:
            j = bisect.bisect_right(positions, r)
            return first[j % len(chain)] if wrap is None or j < len(chain) else wrap
        return head, first[0]

    def _capacity_rows(self) -> None:
        # Stored + resident + peak bytes on every device stay within its capacity.
        terms = self._terms()
        flagged = self._transients((self.x[u, o], opt) for u in range(len(self.p.units)) for o, opt in self._opts(u))
        hinted = self._transients((1, opt) for opt in self.chosen)
        copied = {o.group_device for u in self.p.menu_units for o in u.options if o.group_copy_bytes}
        transients = device_transients(self.chosen, self.p.runs) if copied else {}
        for dev in self.p.devices:
            if dev.name in copied:  # copy groups: peak rows per copy run
                self.peak[dev.name] = self._run_peak(dev.name, transients.get(dev.name))
            else:
                top = max((nbytes for nbytes, _ in hinted[dev.name]), default=0)
                self.peak[dev.name] = self._peak(dev.name, flagged[dev.name], top)
            add_capacity_row(self.model, dev, self.peak[dev.name], terms)

    def _gpu_bytes(self) -> Any:
        # Stored + resident + peak bytes summed over the GPUs (the memory objective).
        gpus = set(self.p.gpu_names())
        terms: list[Any] = [self.peak[g] for g in sorted(gpus)]
        for opt, var in self._terms():
            size = (opt.stored_bytes if opt.storage in gpus else 0) + \
                   (opt.resident_bytes if opt.execution in gpus else 0)
            if size:
                terms.append(size * var)
        return sum(terms)
