"""The user's code: loading a function from a model file, and how a model builder is called.

Stdlib only; shared by the training entry point (``main``) and the compile-time probe.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys

__all__ = ["load_callable", "accepts_tensor_parallel", "build_layers"]


def load_callable(path: str, function: str, prefix: str = "planc_user_"):
    """``function`` from the Python file at ``path``, the module loaded once per process."""
    name = prefix + os.path.splitext(os.path.basename(path))[0]
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None:
            raise FileNotFoundError(path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return getattr(mod, function)


def accepts_tensor_parallel(builder) -> bool:
    """Whether the model builder takes a keyword ``tensor_parallel`` (opts in to tensor-parallel layers)."""
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):
        return False
    p = params.get("tensor_parallel")
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def build_layers(builder, model_args: dict, tensor_parallel=None):
    """Call the model builder: with ``tensor_parallel=`` when it accepts that keyword, else as
    before (its layers are then replicas along the tensor axis)."""
    if accepts_tensor_parallel(builder):
        return builder(**model_args, tensor_parallel=tensor_parallel)
    return builder(**model_args)
