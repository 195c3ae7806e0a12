"""Identical devices: relabelling them never changes a cost, so the model may fix their order.

Torch-free. Four T4s or two H100s are interchangeable: every unit prices its options on one exactly
as on the other, every edge prices a transfer between them as between any other pair they swap
into, and nothing (a pin, a capacity) tells them apart. Swapping two such devices in an assignment
gives one with the same score and the same feasibility, so for every assignment there is one as
good whose devices of each class are *first used* (stored on, or computed on in either phase) in the
class's order. A phased option names two computing devices; the swap renames both.
The CP-SAT model states that order (:meth:`~.cpsat.PlacementModel` ``_identical_devices_in_order``);
:func:`relabel` moves the hint into it. Without the order, CP-SAT explores each placement once per
permutation of the devices (24 times on four GPUs) and its bound stalls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .problem import PlacementOption, PlacementProblem

__all__ = ["identical_devices", "relabel", "first_use"]

_Key = tuple[str, str, str, str | None]


def _numbers(o: PlacementOption) -> tuple[int, ...]:
    return (o.prefill_ns, o.decode_ns, o.stored_bytes, o.resident_bytes, o.peak_bytes, o.prefill_peak_bytes,
            o.copy_prefill_ns, o.copy_decode_ns, o.host_prefill_ns, o.host_decode_ns, o.disk_prefill_ns, o.disk_decode_ns,
            o.group_copy_bytes)


def _swap(name: str | None, a: str, b: str) -> str | None:
    return b if name == a else a if name == b else name


def identical_devices(problem: PlacementProblem) -> list[list[str]]:
    """Classes (2+ devices each, in ``problem.devices`` order) whose members are interchangeable."""
    pinned = set(problem.pins.values())
    sizes = [(d.kind, d.capacity_bytes) for d in problem.devices if d.name not in pinned]
    if len(set(sizes)) == len(sizes):  # no two devices of one kind and size: none can be swapped (most machines)
        return []
    # Traced graphs repeat a few menus and a few edge prices many times: each distinct one is checked once (the
    # edges of one size share their price maps: those are told apart by identity before by content)
    menus = list({_frozen(m): m for m in (_menu(u.options) for u in problem.menu_units)}.values())
    shared = {id(c): c for e in problem.edges for c in (e.prefill_ns, e.decode_ns)}
    prices = list({tuple(sorted(c.items())): c for c in shared.values()}.values())
    classes: list[list[str]] = []
    for d in problem.devices:
        if d.name in pinned:
            continue
        home = next((c for c in classes if _interchangeable(problem, (menus, prices), c[0], d.name)), None)
        if home is None:
            classes.append([d.name])
        else:
            home.append(d.name)
    return [c for c in classes if len(c) > 1]


def _menu(options: Sequence[PlacementOption]) -> dict[_Key, list[tuple[int, ...]]]:
    menu: dict[_Key, list[tuple[int, ...]]] = {}
    for o in options:
        menu.setdefault(o.kind, []).append(_numbers(o))
    return {k: sorted(v) for k, v in menu.items()}


def _frozen(menu: dict[_Key, list[tuple[int, ...]]]) -> tuple:
    return tuple(sorted((k, tuple(v)) for k, v in menu.items()))


def _interchangeable(problem: PlacementProblem,
                     distinct: tuple[list[dict[_Key, list[tuple[int, ...]]]], list[Mapping[tuple[str, str], int]]],
                     a: str, b: str) -> bool:
    """True when swapping devices a and b maps every (distinct) option menu and edge price map onto itself."""
    menus, prices = distinct
    da, db = problem.device(a), problem.device(b)
    if (da.kind, da.capacity_bytes) != (db.kind, db.capacity_bytes):
        return False
    for menu in menus:
        for (s, e, m, pe), numbers in menu.items():
            if menu.get((_swap(s, a, b), _swap(e, a, b), m, _swap(pe, a, b))) != numbers:
                return False
    # The swap is its own inverse, so checking the image of every priced pair covers the unpriced
    # ones too (an unpriced pair whose image is priced is the image of that priced pair).
    for costs in prices:
        if any(_price(costs, p, q) != _price(costs, _swap(p, a, b), _swap(q, a, b)) for p, q in costs):
            return False
    return True


def _price(costs: Mapping[tuple[str, str], int], p: str, q: str) -> int:
    return 0 if p == q else costs.get((p, q), 0)


def first_use(problem: PlacementProblem, choice: Sequence[int]) -> dict[str, int]:
    """Device -> index of the first unit storing or computing (in either phase) on it (units in order;
    unused: absent)."""
    first: dict[str, int] = {}
    for i, o in enumerate(problem.options(choice)):
        first.setdefault(o.storage, i)
        first.setdefault(o.execution, i)
        if o.prefill_execution is not None:
            first.setdefault(o.prefill_execution, i)
    return first


def relabel(problem: PlacementProblem, choice: Sequence[int], classes: Sequence[Sequence[str]]) -> list[int]:
    """``choice`` with each class's devices renamed so that they are first used in the class's order.

    The result has the same score and feasibility (the devices are interchangeable).
    """
    first = first_use(problem, choice)
    rename: dict[str, str] = {}
    for members in classes:
        by_use = sorted(members, key=lambda d: (first.get(d, len(problem.units)), members.index(d)))
        rename.update(zip(by_use, members, strict=True))
    if all(k == v for k, v in rename.items()):
        return list(choice)
    out = []
    for u, c in zip(problem.units, choice, strict=True):
        o = u.options[c]
        want = (rename.get(o.storage, o.storage), rename.get(o.execution, o.execution), o.mode,
                None if o.prefill_execution is None else rename.get(o.prefill_execution, o.prefill_execution))
        out.append(next(k for k, p in enumerate(u.options) if p.kind == want and _numbers(p) == _numbers(o)))
    return out
