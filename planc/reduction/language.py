"""Text form of reduction programs: ``COLLECTIVE(slice=LEVEL, form=FORM); ...``.

``FORM`` is ``inside``, ``parallel(LEVEL)`` or ``master(LEVEL)``. Whitespace is
free, a trailing ``;`` is allowed, the empty text is the empty program. The
front end parses ``using PROGRAM`` with its own grammar; this parser serves
tests, the CLI and plan.json readers. Printing is ``ir.program_text`` (the
canonical spelling, also used by ``planc explain``).
"""

from __future__ import annotations

import re

from planc import ir

_STEP = re.compile(
    r"\s*(?P<coll>[A-Za-z_]\w*)\s*\(\s*slice\s*=\s*(?P<slice>[A-Za-z_]\w*)\s*,\s*form\s*=\s*"
    r"(?P<form>[A-Za-z_]\w*)\s*(?:\(\s*(?P<level>[A-Za-z_]\w*)\s*\)\s*)?\)\s*"
)


class ProgramSyntaxError(ValueError):
    """A malformed program text; ``column`` is 1-based."""

    def __init__(self, message: str, column: int):
        super().__init__(f"column {column}: {message}")
        self.column = column


def parse_program(text: str) -> tuple[ir.Instruction, ...]:
    out = []
    pos = 0
    n = len(text)
    while pos < n and text[pos:].strip():
        m = _STEP.match(text, pos)
        if not m:
            col = pos + len(text[pos:]) - len(text[pos:].lstrip()) + 1
            raise ProgramSyntaxError(
                "expected COLLECTIVE(slice=LEVEL, form=inside|parallel(LEVEL)|master(LEVEL))", col)
        try:
            coll = ir.Collective(m["coll"])
        except ValueError:
            raise ProgramSyntaxError(
                f"unknown collective {m['coll']!r} (expected one of {', '.join(ir.Collective)})",
                m.start("coll") + 1) from None
        try:
            form = ir.FormKind(m["form"])
        except ValueError:
            raise ProgramSyntaxError(f"unknown form {m['form']!r} (expected inside, parallel or master)",
                                     m.start("form") + 1) from None
        if (form is ir.FormKind.INSIDE) != (m["level"] is None):
            msg = "inside takes no level" if form is ir.FormKind.INSIDE else f"{form} needs a level: {form}(LEVEL)"
            raise ProgramSyntaxError(msg, m.start("form") + 1)
        out.append(ir.Instruction(coll, m["slice"], form, m["level"]))
        pos = m.end()
        if pos < n:
            if text[pos] != ";":
                raise ProgramSyntaxError("expected ';' between steps", pos + 1)
            pos += 1
    return tuple(out)


def format_program(program: tuple[ir.Instruction, ...]) -> str:
    return ir.program_text(program)
