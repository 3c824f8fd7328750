"""OUT/train.py's entry (standard library only until it imports ``main``).

    run(out_dir) -> int     imports ``main`` with the garbage collector paused, runs
                            ``main.main(out_dir=out_dir)``, freezes what is left before the exit

Garbage collection at start and exit: the imports of torch and DeepSpeed make about a million objects
that live as long as the rank; every full collection during the imports walks all of them again
(~15 % of the imports' CPU time), and the interpreter's last collection at exit walks them once more
(~3 s for 8 ranks on 2 cores, measured: docs/benchmarks.md "Start-up"). ``run`` pauses the collector
during the imports and then moves their objects to the permanent generation (``gc.freeze``), and
freezes again after ``main`` returns: collections skip what is frozen, and nothing a rank computes
or communicates depends on when they run.

``torch._dynamo``: right after ``import torch`` a stand-in takes its place until something uses more of it
than torch.optim's eager calls (``lazydynamo``): the import costs each rank about a CPU second.
"""
from __future__ import annotations

import gc

__all__ = ["run"]


def run(out_dir: str) -> int:
    """``main.main(out_dir=...)`` with the collections of start and exit skipped."""
    gc.disable()
    try:
        _defer_dynamo()
        from .main import main
    finally:
        gc.freeze()
        gc.enable()
    code = main(out_dir=out_dir)
    gc.freeze()      # the interpreter's last collection then skips the rank's objects
    return code


def _defer_dynamo() -> None:
    import torch  # noqa: F401   (the stand-in is put on the torch package)

    from .lazydynamo import defer
    defer()
