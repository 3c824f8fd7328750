"""The cost side of reduction planning: every program's predicted time as ``a·S + b`` and the
deterministic ranking of programs by it (docs/reduction.md, "Ranking and plan.json")."""

from __future__ import annotations

from typing import Sequence

from planc import ir
from planc.cost import Network, held_after, step_coefficients
from planc.reduction.hierarchy import Hierarchy
from planc.reduction.lower import lower, resolve

__all__ = ["program_coefficients", "hierarchy_coefficients", "lowered", "groups_of", "rank_programs", "TIE_RELATIVE",
           "TIE_ABSOLUTE"]

Groups = tuple[tuple[int, ...], ...]
# Predictions within this relative distance of the cheapest program of their tie class are equal
# for ranking (the cost model is far coarser; sums of the same terms in another order differ by ulps).
TIE_RELATIVE = 1e-9
TIE_ABSOLUTE = 1e-15     # seconds: predictions of zero-byte, zero-latency reductions all tie

_STEP_CACHE: dict[tuple, tuple[float, float]] = {}
_STEP_CACHE_DEVICES = 1 << 22    # bound on the devices listed in the keys (memory)
_step_cache_devices = 0


def _step_coefficients(net: Network, collective: ir.Collective, groups: Groups) -> tuple[float, float]:
    """:func:`step_coefficients`, cached across matrices by the exact lowered groups.

    Different matrices often lower an instruction to the same groups; the
    cost depends only on the cluster, the collective and the groups.
    """
    global _step_cache_devices
    key = (net.cluster, collective, groups)
    hit = _STEP_CACHE.get(key)
    if hit is None:
        hit = step_coefficients(net, collective, groups)
        n = sum(len(g) for g in groups)
        if _step_cache_devices + n > _STEP_CACHE_DEVICES:
            _STEP_CACHE.clear()
            _step_cache_devices = 0
        _STEP_CACHE[key] = hit
        _step_cache_devices += n
    return hit


def hierarchy_coefficients(net: Network, hierarchy: Hierarchy, positions, programs, cache: dict,
                           start: float = 1.0) -> list[tuple[float, float]]:
    """Per program ``(a, b)`` with predicted time ``a·S + b`` for S bytes.

    Every cost term is linear in the held size, so one evaluation per
    instruction (:func:`step_coefficients`, = the times at 1 and 0 bytes)
    serves every program and every size. An instruction's groups depend only
    on its slice and form, not on its collective, so they are lowered once
    per ``(slice, form level, master?)``.
    """
    by_key: dict[tuple, tuple] = cache.setdefault("groups", {})

    def step(instr):
        s, t = resolve(instr, hierarchy)
        key = (s, t, instr.form is ir.FormKind.MASTER)
        groups = by_key.get(key)
        if groups is None:
            groups = by_key[key] = lower(instr, hierarchy, positions)
        bw, lat = _step_coefficients(net, instr.collective, groups)
        return bw, lat, len(groups[0])

    return program_coefficients(programs, step, cache, start)


def program_coefficients(programs, step, memo: dict | None = None, start: float = 1.0
                         ) -> list[tuple[float, float]]:
    """Per program ``(a, b)``, its time ``a·S + b`` for S bytes: over its instructions, each step's
    bandwidth coefficient times the fraction of S held at that step, plus its latency. Each member
    holds ``start`` of S at first (an all-gather program's members: their 1/k).
    ``step(instr)`` gives an instruction's ``(bandwidth coefficient, latency, group size)``; it is
    called once per instruction (memoised in ``memo``, shared across calls when given)."""
    memo = {} if memo is None else memo
    out = []
    for program in programs:
        a = b = 0.0
        frac = start
        for instr in program:
            hit = memo.get(instr)
            if hit is None:
                hit = memo[instr] = step(instr)
            bw, lat, k = hit
            a += frac * bw
            b += lat
            frac = held_after(instr.collective, k, frac)
        out.append((a, b))
    return out


def lowered(program, hierarchy: Hierarchy, positions, cache: dict) -> tuple:
    """:func:`lower_program` with the groups :func:`hierarchy_coefficients` lowered reused from ``cache``."""
    by_key = cache.setdefault("groups", {})
    out = []
    for instr in program:
        s, t = resolve(instr, hierarchy)
        key = (s, t, instr.form is ir.FormKind.MASTER)
        groups = by_key.get(key)
        if groups is None:
            groups = by_key[key] = lower(instr, hierarchy, positions)
        out.append((instr.collective, groups))
    return tuple(out)


def groups_of(positions) -> Groups:
    """The reduction groups of a layout's positions (members sorted, groups sorted)."""
    by_gid: dict[int, list[int]] = {}
    for d, (gid, _) in positions.items():
        by_gid.setdefault(gid, []).append(d)
    return tuple(sorted(tuple(sorted(g)) for g in by_gid.values()))


def rank_programs(programs: Sequence[Sequence[ir.Instruction]], predictions: Sequence[float]
                  ) -> list[tuple[int, float]]:
    """``(index, rounded prediction)`` of every program, best first: a total, deterministic order.

    Predictions are rounded to tie classes: the cheapest prediction not yet in a class opens one,
    and every prediction within ``TIE_RELATIVE`` of it (relative; plus ``TIE_ABSOLUTE``) joins it,
    with that cheapest prediction as its rounded value. Programs are ordered by rounded
    prediction, then length (shorter first), then program text. So the order is non-decreasing
    in the rounded prediction, predictions that differ by float noise always tie (a class spans
    ``TIE_RELATIVE`` from its cheapest member, not a fixed grid whose boundaries noise can
    straddle), and a later program's prediction is never below an earlier one's by more than
    ``TIE_RELATIVE`` of it.
    """
    texts = [ir.program_text(p) for p in programs]
    by_value = sorted(range(len(programs)), key=lambda i: (predictions[i], len(programs[i]), texts[i]))
    rounded: dict[int, float] = {}
    lead: float | None = None
    for i in by_value:
        p = predictions[i]
        if lead is None or p > lead + TIE_RELATIVE * abs(lead) + TIE_ABSOLUTE:
            lead = p
        rounded[i] = lead
    order = sorted(range(len(programs)), key=lambda i: (rounded[i], len(programs[i]), texts[i]))
    return [(i, rounded[i]) for i in order]
