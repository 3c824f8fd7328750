"""Parallelism matrices (P² §2.1, §3.1): count, enumerate, validate.

A parallelism matrix ``M`` has one row per parallelism axis (sizes
``p_0..p_m``) and one column per level of the system hierarchy (fanouts
``h_0..h_n``, outermost first). ``M[i][j]`` is how many units of level ``j``
axis ``i`` is split across; every row multiplies to its axis size (P² eq. 2)
and every column to its level's fanout (eq. 1).

Counting and enumeration share one dynamic programme over levels: the state
after the first ``j`` columns is the tuple of what is still left to place of
each axis (``p_i`` divided by the factors chosen so far). Column ``j`` is an
ordered factorisation of ``h_j`` into ``m + 1`` factors, factor ``i``
dividing what is left of axis ``i``. The number of states is at most the
product of the axes' divisor counts, so counting is immediate even for 4,096
devices over five levels and four axes; the enumeration is a lazy
depth-first walk of the same programme that never enters a dead branch.

Order of enumeration (deterministic): column by column, outermost level
first; within a column, factor tuples in lexicographic order. Equivalently,
matrices come out in lexicographic order of their column-major flattening.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from functools import lru_cache

Matrix = tuple[tuple[int, ...], ...]


def divisors(n: int) -> tuple[int, ...]:
    """Positive divisors of ``n``, ascending."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return tuple(small + large[::-1])


@lru_cache(maxsize=4096)
def column_choices(fanout: int, left: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Ordered factorisations of ``fanout`` into ``len(left)`` factors, factor i dividing left[i]; lexicographic."""
    out: list[tuple[int, ...]] = []

    def rec(i: int, rest: int, acc: tuple[int, ...]) -> None:
        if i == len(left) - 1:
            if left[i] % rest == 0:
                out.append(acc + (rest,))
            return
        for d in divisors(math.gcd(rest, left[i])):
            rec(i + 1, rest // d, acc + (d,))

    if not left:
        return ((),) if fanout == 1 else ()
    rec(0, fanout, ())
    return tuple(out)


def _check_sizes(fanouts: Sequence[int], axis_sizes: Sequence[int]) -> None:
    for x in (*fanouts, *axis_sizes):
        if not isinstance(x, int) or x < 1:
            raise ValueError(f"fanouts and axis sizes must be positive integers, got {x!r}")


class _Space:
    """The counting programme for one (fanouts, axis sizes) pair."""

    def __init__(self, fanouts: Sequence[int], axis_sizes: Sequence[int]):
        _check_sizes(fanouts, axis_sizes)
        self.fanouts = tuple(fanouts)
        self.axis_sizes = tuple(axis_sizes)
        self._memo: dict[tuple[int, tuple[int, ...]], int] = {}

    def count(self, j: int, left: tuple[int, ...]) -> int:
        if j == len(self.fanouts):
            return 1 if all(x == 1 for x in left) else 0
        key = (j, left)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        # What is left must fit in the levels still to come.
        if math.prod(left) != math.prod(self.fanouts[j:]):
            self._memo[key] = 0
            return 0
        total = 0
        for col in column_choices(self.fanouts[j], left):
            total += self.count(j + 1, tuple(a // c for a, c in zip(left, col)))
        self._memo[key] = total
        return total

    def walk(self, j: int, left: tuple[int, ...], cols: tuple[tuple[int, ...], ...]) -> Iterator[tuple[tuple[int, ...], ...]]:
        if j == len(self.fanouts):
            yield cols
            return
        for col in column_choices(self.fanouts[j], left):
            nxt = tuple(a // c for a, c in zip(left, col))
            if self.count(j + 1, nxt):
                yield from self.walk(j + 1, nxt, cols + (col,))


def _transpose(cols: tuple[tuple[int, ...], ...], rows: int) -> Matrix:
    return tuple(tuple(c[i] for c in cols) for i in range(rows))


def count_matrices(fanouts: Sequence[int], axis_sizes: Sequence[int]) -> int:
    """The exact number of parallelism matrices, without listing them."""
    space = _Space(fanouts, axis_sizes)
    if math.prod(space.fanouts) != math.prod(space.axis_sizes):
        return 0
    return space.count(0, space.axis_sizes)


def enumerate_matrices(fanouts: Sequence[int], axis_sizes: Sequence[int]) -> Iterator[Matrix]:
    """Every parallelism matrix, lazily, in the deterministic order of the module docstring."""
    space = _Space(fanouts, axis_sizes)
    if math.prod(space.fanouts) != math.prod(space.axis_sizes):
        return
    for cols in space.walk(0, space.axis_sizes, ()):
        yield _transpose(cols, len(space.axis_sizes))


def completions(fanouts: Sequence[int], axis_sizes: Sequence[int],
                fixed: dict[int, tuple[int, ...]]) -> Iterator[Matrix]:
    """Matrices whose columns ``j in fixed`` are ``fixed[j]`` (a column: one factor per axis), in enumeration order."""
    space = _Space(fanouts, axis_sizes)
    if math.prod(space.fanouts) != math.prod(space.axis_sizes):
        return
    m = len(space.axis_sizes)

    def walk(j: int, left: tuple[int, ...], cols: tuple[tuple[int, ...], ...]):
        if j == len(space.fanouts):
            if all(x == 1 for x in left):
                yield cols
            return
        choices = column_choices(space.fanouts[j], left)
        if j in fixed:
            choices = tuple(c for c in choices if c == tuple(fixed[j]))
        for col in choices:
            nxt = tuple(a // c for a, c in zip(left, col))
            if space.count(j + 1, nxt):
                yield from walk(j + 1, nxt, cols + (col,))

    for cols in walk(0, space.axis_sizes, ()):
        yield _transpose(cols, m)


def column_major_key(matrix: Matrix) -> tuple[int, ...]:
    """Sort key that reproduces the enumeration order."""
    if not matrix:
        return ()
    return tuple(matrix[i][j] for j in range(len(matrix[0])) for i in range(len(matrix)))


def matrix_problems(matrix: Sequence[Sequence[int]], fanouts: Sequence[int], axis_sizes: Sequence[int]) -> list[str]:
    """Why ``matrix`` is not a parallelism matrix for this hierarchy and these axes (empty: it is one)."""
    problems: list[str] = []
    if len(matrix) != len(axis_sizes):
        return [f"the matrix has {len(matrix)} rows but there are {len(axis_sizes)} axes"]
    for i, row in enumerate(matrix):
        if len(row) != len(fanouts):
            return [f"row {i} has {len(row)} entries but the cluster has {len(fanouts)} levels"]
        if any(not isinstance(x, int) or x < 1 for x in row):
            return [f"row {i} has an entry that is not a positive integer"]
    for i, row in enumerate(matrix):
        if math.prod(row) != axis_sizes[i]:
            problems.append(f"row {i} multiplies to {math.prod(row)}, not the axis size {axis_sizes[i]}")
    for j, h in enumerate(fanouts):
        col = math.prod(row[j] for row in matrix)
        if col != h:
            problems.append(f"column {j} multiplies to {col}, not the level fanout {h}")
    return problems


def is_matrix(matrix: Sequence[Sequence[int]], fanouts: Sequence[int], axis_sizes: Sequence[int]) -> bool:
    return not matrix_problems(matrix, fanouts, axis_sizes)
