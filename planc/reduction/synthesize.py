"""Syntax-guided synthesis of reduction programs (P² §3.5).

Programs are enumerated over the instructions of a synthesis hierarchy (every
collective × slice × form, aliases removed: ``lower.distinct_instructions``) on one reduction group laid
out canonically on the hierarchy. A prefix is pruned when

* a step's precondition fails (``semantics.apply``), or
* it can no longer reach the goal in the steps left (information increase):
  a piece whose contributors are not the whole group needs a summing step
  (allreduce / reduce_scatter / reduce); a device holding nothing needs a
  broadcast; a device holding part of the buffer needs an all_gather, or a
  reduce (to drop it) and then a broadcast. The fewest allowed collectives
  that meet these needs bound the steps still needed.

Search is depth-first with the suffixes of each ``(state, steps left)``
memoized, so equal states reached by different prefixes are expanded once.
Every program found is re-verified by the independent ``check.py`` on its
lowered groups before it is returned. Results are cached per
``(hierarchy, max_size, collectives)``: synthesis depends only on the
hierarchy, not on the matrix that produced it.
"""

from __future__ import annotations

import itertools
from functools import lru_cache

from planc import ir
from planc.reduction import check, semantics
from planc.reduction.hierarchy import Hierarchy
from planc.reduction.lower import LoweringError, distinct_instructions, lower_program

C = ir.Collective
_SUMMING = frozenset((C.ALLREDUCE, C.REDUCE_SCATTER, C.REDUCE))

Program = tuple[ir.Instruction, ...]


def _needs(state: tuple, full: frozenset) -> tuple[bool, bool, bool]:
    need_sum = need_bcast = need_gather = False
    for pieces in state:
        if not pieces:
            need_bcast = True
            continue
        if pieces[0][0] != 0 or pieces[-1][1] != 1:
            need_gather = True
        if any(c != full for _, _, c in pieces):
            need_sum = True
    return need_sum, need_bcast, need_gather


@lru_cache(maxsize=None)
def _min_steps_table(allowed: frozenset) -> dict:
    """needs (sum, bcast, gather) → fewest allowed collectives meeting them (None: impossible)."""
    table = {}
    for needs in itertools.product((False, True), repeat=3):
        best = None
        for r in range(len(allowed) + 1):
            for combo in itertools.combinations(sorted(allowed), r):
                s = set(combo)
                ok = ((not needs[0] or s & _SUMMING)
                      and (not needs[1] or C.BROADCAST in s)
                      and (not needs[2] or C.ALL_GATHER in s or {C.REDUCE, C.BROADCAST} <= s))
                if ok:
                    best = r
                    break
            if best is not None:
                break
        table[needs] = best
    return table


def synthesize(hierarchy: Hierarchy, max_size: int = 5,
               collectives: tuple[ir.Collective, ...] = tuple(C)) -> tuple[Program, ...]:
    """Every valid program of at most ``max_size`` steps, shortest first, then in instruction order."""
    return _synthesize(hierarchy, max_size, tuple(ir.Collective(c) for c in collectives))


@lru_cache(maxsize=256)
def _synthesize(hierarchy: Hierarchy, max_size: int, collectives: tuple[ir.Collective, ...]) -> tuple[Program, ...]:
    positions = hierarchy.canonical_positions()
    devices = tuple(range(hierarchy.size))
    full = frozenset(devices)
    lowered = distinct_instructions(hierarchy, collectives)
    table = _min_steps_table(frozenset(collectives))
    start = tuple(semantics.initial_state(devices)[d] for d in devices)
    goal = tuple(((semantics.ZERO, semantics.ONE, full),) for _ in devices)
    memo: dict[tuple, tuple[tuple[int, ...], ...]] = {}

    def suffixes(state: tuple, left: int) -> tuple[tuple[int, ...], ...]:
        key = (state, left)
        if key in memo:
            return memo[key]
        found: list[tuple[int, ...]] = [()] if state == goal else []
        need = table[_needs(state, full)]
        if left > 0 and need is not None and need <= left:
            for i, (instr, groups) in enumerate(lowered):
                new = list(state)
                try:
                    for g in groups:
                        out = semantics.apply(instr.collective, [state[d] for d in g])
                        for d, s in zip(g, out):
                            new[d] = s
                except semantics.SemanticsError:
                    continue
                for rest in suffixes(tuple(new), left - 1):
                    found.append((i,) + rest)
        memo[key] = tuple(found)
        return memo[key]

    programs = sorted(suffixes(start, max_size), key=lambda p: (len(p), p))
    group = [devices]
    out = []
    for p in programs:
        if not p:
            continue
        program = tuple(lowered[i][0] for i in p)
        steps = [(str(c), g) for c, g in lower_program(program, hierarchy, positions)]
        why = check.check_program(steps, group)
        if why is not None:  # the synthesizer and the checker disagree: a bug in planc
            raise AssertionError(f"synthesized program {ir.program_text(program)} fails the checker: {why}")
        out.append(program)
    return tuple(out)


def is_valid(program: Program, hierarchy: Hierarchy) -> bool:
    """Whether a program is valid on the hierarchy (checker only)."""
    positions = hierarchy.canonical_positions()
    try:
        steps = lower_program(program, hierarchy, positions)
    except LoweringError:
        return False
    return check.check_program([(str(c), g) for c, g in steps], [tuple(range(hierarchy.size))]) is None
