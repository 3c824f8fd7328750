"""The one diagnostic type of planc, with source spans and rendering (a leaf: span and the stdlib).

Every user error (syntax, semantics, a pinned program that is invalid, a file
that cannot be read) is a :class:`PlanError` holding one or more
:class:`Diagnostic`. The CLI renders them as ``file:line:col: message``, the
source line, and a caret run under the span, and exits 2.

It lives at the top of the package, beside ``span``, so that any pass and ``planc.budget`` (which the
front end imports) can raise it without importing the front end (which loads the parser, lark);
``planc.lang.errors`` names the same objects for the front end.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from planc.span import Span  # re-exported: `from planc.lang.errors import Span` keeps working

__all__ = ["Span", "Diagnostic", "PlanError", "error", "render_diagnostic", "did_you_mean"]


@dataclass(frozen=True, slots=True)
class Diagnostic:
    message: str
    span: Span
    hint: str | None = None

    def sort_key(self) -> tuple[str, int, int]:
        # by position only: errors at the same place keep the order they were found in
        return (self.span.file, self.span.line, self.span.col)


class PlanError(Exception):
    """One or more user-facing errors about a plan; never a bug in planc."""

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic, sources: dict[str, str] | None = None):
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics: tuple[Diagnostic, ...] = tuple(sorted(diagnostics, key=Diagnostic.sort_key))
        self.sources: dict[str, str] = dict(sources or {})
        super().__init__(self.diagnostics[0].message if self.diagnostics else "plan error")

    def with_source(self, file: str, text: str) -> "PlanError":
        self.sources.setdefault(file, text)
        return self

    def render(self) -> str:
        return "\n".join(render_diagnostic(d, self.sources.get(d.span.file)) for d in self.diagnostics)

    def __str__(self) -> str:
        return self.render()


def error(message: str, span: Span, hint: str | None = None) -> PlanError:
    return PlanError([Diagnostic(message, span, hint)])


def render_diagnostic(diag: Diagnostic, source: str | None) -> str:
    """``file:line:col: error: message``, then the line and a caret run under the span."""
    s = diag.span
    if s.line <= 0:
        head = f"{s.file}: error: {diag.message}"
        return head + (f"\n  hint: {diag.hint}" if diag.hint else "")
    out = [f"{s.file}:{s.line}:{s.col}: error: {diag.message}"]
    if source is not None:
        lines = source.splitlines()
        if 1 <= s.line <= len(lines):
            text = lines[s.line - 1].expandtabs(1)
            gutter = f"{s.line:>4} | "
            out.append(gutter + text)
            start = max(s.col - 1, 0)
            if s.end_line == s.line and s.end_col > s.col:
                width = s.end_col - s.col
            else:
                width = max(len(text) - start, 1)
            width = max(1, min(width, max(len(text) - start, 1)))
            out.append(" " * len(gutter) + " " * start + "^" * width)
    if diag.hint:
        out.append(f"  hint: {diag.hint}")
    return "\n".join(out)


def did_you_mean(name: str, choices) -> str | None:
    """A "did you mean" hint for an unknown name, or None."""
    best = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"did you mean '{best[0]}'?" if best else None
