"""The training regime's settings of the ``train`` block (LANGUAGE.md, "Training settings"):
``optimizer``, ``lr_schedule``, ``zero`` and ``clip`` (``precision`` and ``recompute`` are closed
settings, read as the others in :mod:`planc.lang.check.settings`).

Each wrong value is reported where it is written and replaced by its default so that checking goes
on. The optimizer keeps the arguments as written (``ir.Optimizer.params``); plan.json fills in the
defaults of ``planc.plan.OPTIMIZER_DEFAULTS`` (``planc.driver.assemble.train_record``), the one place.
"""

from __future__ import annotations

import math

from planc import ir
from planc.lang import ast
from planc.lang.check.values import Diagnostics, did_you_mean, int_of
from planc.plan import OPTIMIZER_DEFAULTS, LrSchedule

__all__ = ["check_optimizer", "check_lr_schedule", "check_zero", "check_clip", "OPTIMIZER_FORMS"]

OPTIMIZER_FORMS = ("sgd(lr, momentum, weight_decay), adam(lr, betas = (b1, b2), eps, weight_decay) or "
                   "adamw(lr, betas = (b1, b2), eps, weight_decay)")
SCHEDULE_FORMS = "constant or warmup_cosine(warmup = W, total = T, min_ratio = r)"
BETAS_HINT = "write betas = (b1, b2), e.g. betas = (0.9, 0.999)"


def _called(v: ast.Value) -> tuple[str | None, ast.Name | None]:
    """The name of ``name(...)`` or of a bare ``name`` (None for any other value) and its node."""
    if isinstance(v, ast.Call):
        return v.name.value, v.name
    if isinstance(v, ast.Name):
        return v.value, v
    return None, None


def _choice_hint(text: str | None, choices) -> str | None:
    """"did you mean" for a misspelt name; the lower-case spelling for one in another case."""
    if not text:
        return None
    near = [c for c in choices if c.lower() == text.lower()]
    if near:
        return f"did you mean '{near[0]}'? (spellings are lower case)"
    return did_you_mean(text, choices)


def _number(errs: Diagnostics, v: ast.Value, what: str) -> float | None:
    """A plain finite number (no unit)."""
    if not isinstance(v, ast.Num):
        errs.add(f"{what} must be a number", v.span)
        return None
    if not math.isfinite(v.value):
        errs.add(f"{what} is too large ({v.text})", v.span)
        return None
    return v.value


def _not_negative(errs: Diagnostics, v: ast.Value, what: str) -> float | None:
    x = _number(errs, v, what)
    if x is not None and x < 0:
        errs.add(f"{what} must not be negative, got {v.text}", v.span)
        return None
    return x


def _fraction(errs: Diagnostics, v: ast.Value, what: str) -> float | None:
    """A number in [0, 1) (momentum, each of Adam's betas)."""
    x = _number(errs, v, what)
    if x is not None and not 0 <= x < 1:
        errs.add(f"{what} must be in [0, 1), got {v.text}", v.span)
        return None
    return x


def _betas(errs: Diagnostics, v: ast.Value, what: str) -> tuple[float, float] | None:
    """``betas = (b1, b2)``: two numbers in [0, 1), in parentheses."""
    if not isinstance(v, ast.TupleValue):
        errs.add(f"{what} is a pair of numbers in parentheses", v.span, BETAS_HINT)
        return None
    if len(v.items) != 2:
        errs.add(f"{what} takes two numbers (b1, b2), got {len(v.items)}", v.span, BETAS_HINT)
        return None
    b1, b2 = (_fraction(errs, item, f"{what}[{i}]") for i, item in enumerate(v.items))
    return None if b1 is None or b2 is None else (b1, b2)


# each argument's reading: lr, eps and weight_decay >= 0, momentum in [0, 1), betas a pair in [0, 1)
_ARGS = {"lr": _not_negative, "momentum": _fraction, "eps": _not_negative, "weight_decay": _not_negative,
         "betas": _betas}


def check_optimizer(errs: Diagnostics, kv: ast.KeyValue | None) -> ir.Optimizer:
    """``optimizer = sgd(...) | adam(...) | adamw(...)`` (or the bare name); the arguments as written."""
    if kv is None:
        return ir.Optimizer()
    name, node = _called(kv.value)
    if name not in OPTIMIZER_DEFAULTS:
        errs.add(f"optimizer must be {OPTIMIZER_FORMS}", node.span if node is not None else kv.value.span,
                 _choice_hint(name, OPTIMIZER_DEFAULTS))
        return ir.Optimizer()
    allowed = ("lr", *OPTIMIZER_DEFAULTS[name])
    args = kv.value.args if isinstance(kv.value, ast.Call) else ()
    if "betas" in allowed:
        for arg in args:
            if arg.key.value in ("beta1", "beta2"):
                errs.add(f"{name}() takes Adam's coefficients as one pair, not '{arg.key.value}'", arg.key.span,
                         BETAS_HINT)
        args = [arg for arg in args if arg.key.value not in ("beta1", "beta2")]
    # None after an error: left out below, the error said why
    given: dict[str, object] = {k: _ARGS[k](errs, arg.value, k)
                                for k, arg in _named_args(errs, name, args, allowed).items()}
    lr = given.pop("lr", None)
    return ir.Optimizer(name, ir.Optimizer().lr if lr is None else float(lr),
                        tuple(sorted((k, v) for k, v in given.items() if v is not None)))


def _named_args(errs: Diagnostics, call: str, args, allowed) -> dict[str, ast.KeyValue]:
    """``call(k = v, ...)``'s arguments by name, in the order written; an unknown or repeated name is
    reported at the name and left out."""
    got: dict[str, ast.KeyValue] = {}
    for arg in args:
        k = arg.key.value
        if k not in allowed:
            errs.add(f"{call}() has no argument '{k}'; it takes {', '.join(allowed)}", arg.key.span,
                     did_you_mean(k, allowed))
        elif k in got:
            errs.add(f"'{k}' is given twice", arg.key.span)
        else:
            got[k] = arg
    return got


def check_lr_schedule(errs: Diagnostics, kv: ast.KeyValue | None, steps: int) -> LrSchedule:
    """``lr_schedule = constant | warmup_cosine(warmup = W, total = T, min_ratio = r)``; W 0, T the
    train block's ``steps``, r 0 unless written (``total`` is always filled in)."""
    if kv is None:
        return LrSchedule()
    name, node = _called(kv.value)
    if name not in LrSchedule.NAMES:
        errs.add(f"lr_schedule must be {SCHEDULE_FORMS}", node.span if node is not None else kv.value.span,
                 _choice_hint(name, LrSchedule.NAMES))
        return LrSchedule()
    args = kv.value.args if isinstance(kv.value, ast.Call) else ()
    if name == "constant":
        if args:
            errs.add("constant takes no arguments", args[0].span)
        return LrSchedule()
    got = _named_args(errs, "warmup_cosine", args, ("warmup", "total", "min_ratio"))
    values: dict[str, object] = {}
    for k, arg in got.items():
        v = arg.value
        if k == "min_ratio":
            r = _number(errs, v, k)
            if r is not None and not 0 <= r <= 1:
                errs.add(f"min_ratio must be in [0, 1], got {v.text}", v.span)
                r = None
            values[k] = r
        elif not isinstance(v, ast.Num):
            errs.add(f"{k} must be a whole number of optimizer steps", v.span)
        else:
            values[k] = int_of(errs, v, k, minimum=1 if k == "total" else 0)
    warmup = values.get("warmup")
    total = values.get("total")
    ok = all(values.get(k) is not None for k in ("warmup", "total") if k in got)
    warmup = 0 if warmup is None else warmup
    total = steps if total is None else total
    if ok and warmup > total:
        whose = "" if "total" in got else " (the train block's steps)"
        errs.add(f"warmup {warmup} is more than total {total}{whose}: the warmup must end by the last step",
                 got["warmup"].value.span)
    r = values.get("min_ratio")
    return LrSchedule("warmup_cosine", warmup, total, 0.0 if r is None else float(r))


def check_zero(errs: Diagnostics, kv: ast.KeyValue | None) -> int:
    """``zero = 0 | 1 | 2 | 3``."""
    if kv is None:
        return 0
    return zero_degree(errs, kv.value, "zero")


def zero_degree(errs: Diagnostics, v, where: str) -> int:
    """A ZeRO degree as written (the train block's ``zero = N`` or a stage line's ``zero N``): 0, 1, 2 or 3;
    anything else is a located error (0 stands in for it)."""
    if isinstance(v, ast.Num) and v.text in ("0", "1", "2", "3"):
        return int(v.text)
    text = v.text if isinstance(v, ast.Num) else v.value if isinstance(v, ast.Name) else None
    errs.add(f"{where} must be 0, 1, 2 or 3 (1: fp32 master weights and optimizer state sharded over each stage's "
             "data group, ZeRO stage 1; 2: the gradients too, ZeRO stage 2; 3: the parameters too, ZeRO stage 3)"
             + (f", got {text}" if text is not None else ""), v.span)
    return 0


def check_clip(errs: Diagnostics, kv: ast.KeyValue | None) -> float | None:
    """``clip = X``: the bound on the model's global gradient norm, a positive number (None: no clipping)."""
    if kv is None:
        return None
    v = kv.value
    x = _number(errs, v, "clip (the bound on the global gradient norm)")
    if x is not None and x <= 0:
        errs.add(f"clip must be a positive number, got {v.text} (leave clip out for no clipping)", v.span)
        return None
    return x
