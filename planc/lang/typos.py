"""Syntax errors worth more than "unexpected X": a misspelt unit, a closed setting's value the lexer
cannot read, a misspelt keyword. Each returns a located error (or hint), or None when it does not apply;
``parse._syntax_error`` asks them before its generic message."""

from __future__ import annotations

import difflib
import re

import lark
from lark import Token

from planc.lang import units
from planc.lang.errors import Diagnostic, PlanError, did_you_mean
from planc.lang.vocabulary import ENUM_FORMS, ENUM_SETTINGS
from planc.span import Span

__all__ = ["unit_typo", "enum_typo", "keyword_hint"]


_QUANTITY = re.compile(r"(?:\b(bandwidth|latency|flops|memory)(?:\s+(?:fp32|bf16|fp16))?\s*=?\s*)?\d[\d.]*(?:[eE][+-]?\d+)?\s*([A-Za-z/][^\s,}#]*)")
_KIND_OF_KEY = {"bandwidth": "bandwidth", "latency": "time", "flops": "FLOP rate", "memory": "size"}


def unit_typo(text: str, line: int, column: int, file: str) -> PlanError | None:
    """A syntax error inside the unit of a quantity ('1 GB/z', '5 usec'): say which unit is unknown and
    which units that key takes, instead of the character the lexer stopped at."""
    lines = text.splitlines()
    if not 0 < line <= len(lines):
        return None
    for m in _QUANTITY.finditer(lines[line - 1]):
        start, end = m.start(2) + 1, m.end(2) + 1
        if not start <= column <= end:
            continue
        unit, key = m.group(2), m.group(1)
        known = [u for table in units.KINDS.values() for u in table]
        if unit in known:
            return None
        kind = _KIND_OF_KEY.get(key)
        choices = list(units.KINDS[kind]) if kind else known
        close = [c for c in choices if c.lower() == unit.lower()] or \
            difflib.get_close_matches(unit, choices, n=1, cutoff=0.5 if kind else 0.7)
        if not close and kind is None:
            return None   # a word after a number that looks like no unit ('cores = 2 per'): not a unit typo
        msg = f"unknown unit '{unit}'"
        if close:
            msg += f"; did you mean {' or '.join(repr(c) for c in close)}?"
        if kind:
            msg += (" " if close else "; ") + f"a {kind} takes {', '.join(choices)}"
        return PlanError([Diagnostic(msg, Span(line, start, line, end, file))])
    return None


_SETTING = re.compile(r"\b([a-z_]+)\s*=\s*([^\s,}#]+)")


def enum_typo(text: str, line: int, column: int, file: str) -> PlanError | None:
    """A closed setting's value the lexer cannot even read as a name ('schedule = 1F1B'): name the
    setting's accepted spellings at the value instead of the token the parser stopped at."""
    lines = text.splitlines()
    if not 0 < line <= len(lines):
        return None
    for m in _SETTING.finditer(lines[line - 1]):
        key, value = m.group(1), m.group(2)
        choices = ENUM_SETTINGS.get(key)
        if choices is None or not m.start(2) + 1 <= column <= m.end(2) + 1:
            continue
        near = [c for c in choices if c.lower() == value.lower()]
        hint = f"did you mean '{near[0]}'? (spellings are lower case)" if near else did_you_mean(value, choices)
        return PlanError([Diagnostic(f"'{value}' is not a {key}: {key} must be one of "
                                     f"{ENUM_FORMS.get(key, ', '.join(choices))}",
                                     Span(line, m.start(2) + 1, line, m.end(2) + 1, file), hint)])
    return None


def keyword_hint(tok: Token, acceptable, terminals) -> str | None:
    """A misspelt keyword ('tranfer', 'reduse'): "did you mean 'transfer'?" among the keywords the parser
    accepts at that point."""
    if tok.type != "NAME":
        return None
    words = [t.pattern.value for t in terminals
             if t.name in acceptable and isinstance(t.pattern, lark.lexer.PatternStr) and t.pattern.value.isidentifier()]
    return did_you_mean(str(tok.value), words)
