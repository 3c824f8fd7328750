"""The accepted spellings of the language's closed settings, by key (for messages that name them)."""

from __future__ import annotations

from planc import ir
from planc.plan import Backend, InHost, Precision, Recompute

__all__ = ["ENUM_SETTINGS", "ENUM_FORMS"]

ENUM_SETTINGS: dict[str, tuple[str, ...]] = {
    "schedule": tuple(s.value for s in ir.PipeSchedule),
    "precision": tuple(p.value for p in Precision),
    "recompute": tuple(r.value for r in Recompute),
    "strategy": tuple(s.value for s in ir.Strategy),
    "backend": tuple(b.value for b in Backend),
    "in_host": tuple(h.value for h in InHost),
}

# how a message lists a setting's accepted values where they are not plain names
ENUM_FORMS: dict[str, str] = {
    "schedule": "gpipe, 1f1b, eager_1f1b, interleaved_1f1b(virtual = V), zb_h1, zbv or auto",
}
