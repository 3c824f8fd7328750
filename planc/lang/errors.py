"""The front end's name for planc's diagnostics (:mod:`planc.diagnostics`, where they live).

``Diagnostic`` and ``PlanError`` are a leaf any pass may import; they sit outside ``planc.lang`` so that
``planc.budget``, which the checker imports, does not import the front end back, and so that a pass
does not load the parser: passes import :mod:`planc.diagnostics`, only the front end imports this.
"""

from __future__ import annotations

from planc.diagnostics import Diagnostic, PlanError, Span, did_you_mean, error, render_diagnostic

__all__ = ["Span", "Diagnostic", "PlanError", "error", "render_diagnostic", "did_you_mean"]
