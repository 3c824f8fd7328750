"""Where the top-level grammar/ and templates/ folders are: a checkout or an installed wheel; and the modes
of the files planc exports."""

from __future__ import annotations

import os
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


# what planc exports (a compiled output folder, an exported checkpoint) is read by other users and machines
# (a shared launch folder, a model hub): readable by all whatever the umask (a private umask gives 0600)
FILE_MODE, FOLDER_MODE, SCRIPT_MODE = 0o644, 0o755, 0o755


def publish(*paths) -> None:
    """Give exported files ``FILE_MODE`` and folders ``FOLDER_MODE``."""
    for p in paths:
        os.chmod(p, FOLDER_MODE if os.path.isdir(p) else FILE_MODE)
