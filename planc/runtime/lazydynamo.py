"""``torch._dynamo`` imported only when something uses it (issue 45, start-up). Standard library only.

    defer() -> bool         after ``import torch``: stands in for ``torch._dynamo`` until an attribute
                            other than the two below is asked for; False (nothing done) where torch is
                            not imported yet or ``torch._dynamo`` is imported already
    loaded() -> bool        whether the real ``torch._dynamo`` is imported
    load() -> module        the real ``torch._dynamo``, imported now: where a rank knows it will need it
                            (a recomputing stage: ``torch.utils.checkpoint`` reads ``torch._dynamo.config``
                            at every call), at its build rather than inside its first step, where the
                            import (a CPU second) would keep its peers waiting

Why: torch.optim touches ``torch._dynamo`` in eager mode too: ``Optimizer.add_param_group`` and the
functional ``adam``/``adamw``/``sgd`` are wrapped in ``torch._disable_dynamo`` (it imports
``torch._dynamo`` at the first call, to wrap the function in ``torch._dynamo.disable``), and every
``step`` imports it to call ``torch._dynamo.graph_break()`` twice. The import costs a rank about one
CPU second (torch 2.13), 8 ranks on 2 cores about 4 s of wall time, nearly all of the "engine" phase
of ``--profile-startup`` (docs/benchmarks.md "Start-up").

What stands in: a module object under ``sys.modules["torch._dynamo"]`` with

- ``graph_break()``: does nothing, as torch's own does outside a compiled region (its body is empty:
  dynamo acts on it only while tracing);
- ``disable(fn, ...)``: a function that calls ``fn`` itself while the real ``torch._dynamo`` was never
  imported, and from the moment it is, the real ``torch._dynamo.disable(fn, ...)``;
- ``trace_rules.clear_lru_cache()``: does nothing (``init_process_group`` calls it where ``torch._dynamo``
  is in ``sys.modules``; the caches of a module never imported are empty).

Both are exact: nothing can be compiling, tracing or exporting without ``torch._dynamo`` imported
(``torch.compile`` and ``torch.export`` import it first), and outside those ``disable`` only calls its
function and ``graph_break`` does nothing. Any other attribute (``torch.compile``'s ``optimize``, a
submodule, ``is_compiling``, ...) imports the real module there and then, puts it in ``sys.modules`` and
on ``torch``, and answers from it: code that uses dynamo gets dynamo, and what a rank computes is the
same either way.
"""
from __future__ import annotations

import functools
import importlib
import sys
import types

__all__ = ["defer", "load", "loaded"]

NAME = "torch._dynamo"


class _TraceRules:
    """``torch._dynamo.trace_rules`` while the stand-in holds its place: ``clear_lru_cache`` only."""

    def __getattr__(self, attr):
        return getattr(_real().trace_rules, attr)

    @staticmethod
    def clear_lru_cache() -> None:
        if loaded():
            sys.modules[NAME].trace_rules.clear_lru_cache()


class _Standin(types.ModuleType):
    """``torch._dynamo`` until something asks for more than ``graph_break`` and ``disable``."""

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__") and attr not in ("__path__", "__all__"):
            raise AttributeError(attr)
        return getattr(_real(), attr)

    trace_rules = _TraceRules()

    @staticmethod
    def graph_break(msg: str = "") -> None:
        """torch's own does nothing outside a compiled region, and none can exist before the real import."""
        if loaded():
            sys.modules[NAME].graph_break(msg)

    @staticmethod
    def disable(fn=None, recursive=True, **kwargs):
        if fn is None:
            return functools.partial(_Standin.disable, recursive=recursive, **kwargs)
        real = None

        def call(*args, **kw):
            nonlocal real
            if real is None:
                if not loaded():
                    return fn(*args, **kw)
                real = sys.modules[NAME].disable(fn, recursive, **kwargs)
            return real(*args, **kw)

        if kwargs.get("wrapping", True):
            functools.update_wrapper(call, fn)
        return call


def loaded() -> bool:
    mod = sys.modules.get(NAME)
    return mod is not None and not isinstance(mod, _Standin)


def _real():
    """The real ``torch._dynamo``, imported now if the stand-in still holds its place."""
    mod = sys.modules.get(NAME)
    if isinstance(mod, _Standin):
        del sys.modules[NAME]
        torch = sys.modules["torch"]
        if torch.__dict__.get("_dynamo") is mod:
            del torch._dynamo
        mod = importlib.import_module(NAME)     # binds torch._dynamo to the real module too
    return mod


def load():
    _real()
    return importlib.import_module(NAME)


def defer() -> bool:
    torch = sys.modules.get("torch")
    if torch is None or NAME in sys.modules:
        return False
    standin = _Standin(NAME, __doc__)
    sys.modules[NAME] = standin
    torch._dynamo = standin
    return True
