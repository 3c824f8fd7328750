"""Source spans: where in a plan file a thing was written.

Its own module, below both the front end and the IR, so that ``planc.ir`` can
carry spans without importing ``planc.lang``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Span"]


@dataclass(frozen=True, slots=True, order=True)
class Span:
    """A region of a source file; lines and columns are 1-based, end exclusive."""

    line: int
    col: int
    end_line: int
    end_col: int
    file: str = field(default="<plan>", compare=False)

    @staticmethod
    def unknown(file: str = "<plan>") -> "Span":
        return Span(0, 0, 0, 0, file)
