"""Reading plan.json with a path: every value knows where it is, so an error names its key.

Stdlib only; part of the contract package (``planc.plan``), copied into every output.
"""
from __future__ import annotations

from typing import Any

Range = tuple[int, int]
Region = tuple[Range, ...]
Group = tuple[int, ...]


class PlanFileError(ValueError):
    """plan.json is malformed or contradicts itself; the message names the key."""



class At:
    """A JSON value and where it is (``transfers[0].tasks[2]``), for error messages."""

    __slots__ = ("value", "path")

    def __init__(self, value, path: str):
        self.value, self.path = value, path

    def fail(self, why: str):
        raise PlanFileError(f"plan.json: {self.path or '(top)'}: {why}")

    def key(self, name: str, default=...):
        if not isinstance(self.value, dict):
            self.fail(f"expected an object, got {kind(self.value)}")
        sub = f"{self.path}.{name}" if self.path else name
        if name not in self.value:
            if default is ...:
                raise PlanFileError(f"plan.json: {sub}: missing")
            return At(default, sub)
        return At(self.value[name], sub)

    def items(self):
        if not isinstance(self.value, list):
            self.fail(f"expected a list, got {kind(self.value)}")
        return [At(v, f"{self.path}[{i}]") for i, v in enumerate(self.value)]

    def mapping(self):
        if not isinstance(self.value, dict):
            self.fail(f"expected an object, got {kind(self.value)}")
        return [(k, At(v, f"{self.path}.{k}")) for k, v in self.value.items()]

    def int(self, minimum: int | None = None) -> int:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(f"expected an integer, got {kind(v)}")
        if minimum is not None and v < minimum:
            self.fail(f"{v} is below {minimum}")
        return v

    def opt_int(self, minimum: int | None = None) -> int | None:
        return None if self.value is None else self.int(minimum)

    def num(self) -> float:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(f"expected a number, got {kind(v)}")
        return v

    def opt_num(self):
        return None if self.value is None else self.num()

    def str(self) -> str:
        if not isinstance(self.value, str):
            self.fail(f"expected a string, got {kind(self.value)}")
        return self.value

    def bool(self) -> bool:
        if not isinstance(self.value, bool):
            self.fail(f"expected true or false, got {kind(self.value)}")
        return self.value

    def enum(self, cls):
        s = self.str()
        try:
            return cls(s)
        except ValueError:
            self.fail(f"{s!r} is not one of {[str(m) for m in cls]}")

    def ints(self, minimum: int | None = 0) -> tuple[int, ...]:
        v = self.value
        if type(v) is list and all(type(x) is int for x in v) and (minimum is None or not v or min(v) >= minimum):
            return tuple(v)   # the common case at once; anything else element by element, to name it
        return tuple(x.int(minimum) for x in self.items())

    def groups(self) -> tuple[Group, ...]:
        out = []
        for g in self.items():
            members = g.ints()
            if list(members) != sorted(set(members)):
                g.fail(f"group members must be sorted and distinct, got {list(members)}")
            out.append(members)
        return tuple(out)

    def region(self, ndim: int | None = None) -> Region:
        v = self.value
        if (type(v) is list and (ndim is None or len(v) == ndim)
                and all(type(r) is list and len(r) == 2 and type(r[0]) is int and type(r[1]) is int
                        and 0 <= r[0] <= r[1] for r in v)):
            return tuple((r[0], r[1]) for r in v)   # well-formed: at once; else range by range, to name it
        out = []
        for r in self.items():
            pair = r.ints()
            if len(pair) != 2 or pair[0] > pair[1]:
                r.fail(f"expected a half-open range [a, b] with a <= b, got {r.value}")
            out.append((pair[0], pair[1]))
        if ndim is not None and len(out) != ndim:
            self.fail(f"{len(out)} ranges for a tensor of {ndim} dimensions")
        return tuple(out)


def kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), repr(v))


def extra(at: At, known) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in at.value.items() if k not in known)


def with_extra(out: dict, extra) -> dict:
    for k, v in extra:
        out[k] = v
    return out


def lists(groups) -> list[list[int]]:
    return [list(g) for g in groups]


def region_json(region: Region) -> list[list[int]]:
    return [[a, b] for a, b in region]


def device_key(at: At, k: str) -> int:
    if not k.isdigit():
        at.fail(f"device keys are decimal device ids, got {k!r}")
    return int(k)


def inside(inner: Region, outer: Region) -> bool:
    return all(o0 <= i0 <= i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))
