"""OUT/train.py's entry (standard library only until it imports ``main``).

    run(out_dir)            imports ``main`` with the garbage collector paused, runs
                            ``main.main(out_dir=out_dir)``, and ends the process with its code
                            (``_exit_now``: the exit handlers, not the interpreter's teardown)

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
    _exit_now(code)
    return code      # not reached


def _exit_now(code) -> None:
    """End a rank whose ``main`` returned: the exit handlers run (logging's flush, DeepSpeed's), the
    streams are flushed, and the process ends without the interpreter's teardown. The teardown
    destroys C++ objects in whatever order it meets them; a joinable thread among them (a
    communicator's or DeepSpeed's) aborts the finished rank with "terminate called without an active
    exception" (SIGABRT) now and then. Every collective has ended by then (``main``'s last barrier,
    the process group destroyed), so nothing is lost."""
    import atexit
    import os
    import sys
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def _defer_dynamo() -> None:
    import torch  # noqa: F401   (the stand-in is put on the torch package)

    from .lazydynamo import defer
    defer()
