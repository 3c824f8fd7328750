"""Where the top-level grammar/ and templates/ folders are: a checkout or an installed wheel."""

from __future__ import annotations

import sys
import sysconfig
from functools import cache
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def _find(folder: str) -> Path:
    candidates = [_CHECKOUT / folder]
    for prefix in dict.fromkeys([sys.prefix, sysconfig.get_paths().get("data", sys.prefix)]):   # ordered
        candidates.append(Path(prefix) / "share" / "planc" / folder)
    for c in candidates:
        if c.is_dir():
            return c
    raise FileNotFoundError(f"planc installation is incomplete: no '{folder}/' in " + ", ".join(map(str, candidates)))


@cache
def grammar_path() -> Path:
    return _find("grammar") / "planc.lark"


@cache
def templates_dir() -> Path:
    return _find("templates")


def runtime_dir() -> Path:
    return Path(__file__).resolve().parent / "runtime"


def contract_dir() -> Path:
    """planc/plan/: the contract package, copied into every output as ``OUT/planc/plan/``."""
    return Path(__file__).resolve().parent / "plan"
