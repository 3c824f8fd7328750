"""The user's code: loading a function from a model file, and how a model builder is called.

Stdlib only; shared by the training entry point (``main``) and the compile-time probe.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys

__all__ = ["load_callable", "accepts_tensor_parallel", "accepts_sequence_parallel", "build_layers", "accepts_stage_layers", "is_hf", "data_arguments", "hf_builder",
           "builtin_function"]


class MissingFunction(AttributeError):
    """The user's file has no callable of that name (a typo in the plan's ``FILE:FUNCTION``), as opposed to
    an AttributeError raised by the file's own code while it is imported."""


def load_callable(path: str, function: str, prefix: str = "planc_user_"):
    """``function`` from the Python file at ``path``, the module loaded once per process. A file that does
    not exist is a FileNotFoundError, a name it does not define (or that is not callable) a MissingFunction."""
    name = prefix + os.path.splitext(os.path.basename(path))[0]
    mod = sys.modules.get(name)
    if mod is None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found")
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None:
            raise FileNotFoundError(f"{path} is not a Python file")
        mod = importlib.util.module_from_spec(spec)
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in sys.path:   # as for a script: the modules beside it import (planc.outputfiles copies them)
            sys.path.insert(0, folder)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]   # a half-imported module must not be found by the next call
            raise
    fn = getattr(mod, function, None)
    if fn is None or not callable(fn):
        defined = sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == mod.__name__)
        why = "is not defined" if fn is None else f"is a {type(fn).__name__}, not a function"
        raise MissingFunction(f"'{function}' {why} in {os.path.basename(path)}"
                              + (f" (it defines: {', '.join(defined[:12])})" if defined else ""))
    return fn


def _accepts(builder, keyword: str) -> bool:
    try:
        params = inspect.signature(builder).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(keyword)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def accepts_tensor_parallel(builder) -> bool:
    """Whether the model builder takes a keyword ``tensor_parallel`` (opts in to tensor-parallel layers)."""
    return _accepts(builder, "tensor_parallel")


SHARE_KEYWORD = "stage_layers"   # not ``layers``: the bundled builders' (and users') own layer-count argument


def accepts_stage_layers(builder) -> bool:
    """Whether the model builder takes the keyword ``stage_layers`` (builds only the layers a rank holds)."""
    return _accepts(builder, SHARE_KEYWORD)


def accepts_sequence_parallel(builder) -> bool:
    """Whether the model builder takes the keyword ``sequence_parallel`` (opts in to sequence parallelism)."""
    return _accepts(builder, "sequence_parallel")


def build_layers(builder, model_args: dict, tensor_parallel=None, layers: range | None = None, total: int | None = None):
    """Call the model builder: with ``tensor_parallel=`` when it accepts that keyword, else as before (its
    layers are then replicas along the tensor axis); with ``stage_layers=`` (the range of global layer
    indices the rank holds) when it accepts that keyword. Such a builder returns either the held layers (``len(layers)``
    of them) or all ``total`` layers (those outside the range may be None); the result is always ``total``
    long, a layer the rank does not hold being ``None`` (docs/models.md, "Building only a share"). The keyword
    is ``stage_layers``, not LANGUAGE.md's ``layers``: every bundled builder takes ``layers`` as its own
    layer count (``model "gpt.py:build" { layers = 2 }``), which the range would silently replace."""
    kwargs = dict(model_args)
    if accepts_tensor_parallel(builder):
        kwargs["tensor_parallel"] = tensor_parallel
    if accepts_sequence_parallel(builder):   # plan.json stages[i].sequence_parallel, through the tensor context
        kwargs["sequence_parallel"] = bool(getattr(tensor_parallel, "sequence_parallel", False))
    share = layers is not None and accepts_stage_layers(builder)
    if share:
        kwargs[SHARE_KEYWORD] = layers
    built = builder(**kwargs)
    if not share:
        return built
    built = list(built)
    if total is not None and len(built) == len(layers) and len(built) != total:
        out = [None] * total
        out[layers.start:layers.stop] = built
        return out
    if total is not None and len(built) != total:
        raise ValueError(f"the model builder, called with stage_layers={layers.start}..{layers.stop - 1}, returned "
                         f"{len(built)} layers: expected the {len(layers)} held ones or all {total}")
    return built


def is_hf(model_ref) -> bool:
    """Whether plan.json's ``train.model`` is a Hugging Face model record (``{"hf": {...}}``)."""
    return hasattr(model_ref, "architecture") and hasattr(model_ref, "attn_implementation")


def data_arguments(train) -> dict:
    """The data function's keyword arguments: its line's own (``data "f.py:g" { ... }``), else the model's
    (a builder's; a Hugging Face model's config keys are not the data's)."""
    if train.data.args or is_hf(train.model):
        return dict(train.data.args)
    return dict(train.model.args)


def hf_builder(out_dir: str, train, error=ValueError):
    """The builder of plan.json's Hugging Face model record (``planc_runtime.hf.builder``; torch and
    transformers imported here, not with this module); a failure to import them is ``error``."""
    try:
        from . import hf
        return hf.builder(train.model.to_json()["hf"], out_dir, train.seed)
    except ImportError as e:
        raise error(f"the plan's Hugging Face model {train.model.architecture} needs transformers: {e}") from None


def builtin_function(name: str):
    """One of the runtime's functions a plan may name (plan.json ``{"builtin": NAME}``)."""
    from . import hf
    return {"causal_lm_loss": hf.causal_lm_loss}[name]
