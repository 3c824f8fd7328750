"""The training regime's records: optimizer, learning-rate schedule, fp16 loss scaling.

What LANGUAGE.md's "Training settings" fixes, written once for the compiler (which fills in every
default) and the runtime (which executes what is written): stdlib only, part of ``planc.plan``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .jsonpath import At

__all__ = ["OPTIMIZER_DEFAULTS", "Optimizer", "LrSchedule", "LossScale"]

# torch's SGD, Adam and AdamW with the language's defaults (LANGUAGE.md, "Training settings"); plan.json
# writes every argument, defaults filled in, under torch's names (``betas`` a pair).
OPTIMIZER_DEFAULTS: dict[str, dict[str, object]] = {
    "sgd": {"momentum": 0.0, "weight_decay": 0.0},
    "adam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
}


@dataclass(frozen=True, slots=True)
class Optimizer:
    """``{"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}``."""

    name: str
    lr: float
    args: tuple[tuple[str, object], ...]      # every argument of the optimizer, defaults filled in

    @staticmethod
    def make(name: str, lr: float, **given) -> "Optimizer":
        """The optimizer ``name`` with ``given`` arguments over the defaults (unknown ones: ValueError)."""
        if name not in OPTIMIZER_DEFAULTS:
            raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZER_DEFAULTS)}")
        unknown = sorted(set(given) - set(OPTIMIZER_DEFAULTS[name]))
        if unknown:
            raise ValueError(f"{name}() has no argument {unknown[0]!r}")
        args = {**OPTIMIZER_DEFAULTS[name], **given}
        if "betas" in args:
            args["betas"] = tuple(float(b) for b in args["betas"])
        return Optimizer(name, float(lr), tuple((k, args[k]) for k in sorted(args)))

    @staticmethod
    def read(at: At) -> "Optimizer":
        name = at.key("name").str()
        if name not in OPTIMIZER_DEFAULTS:
            at.key("name").fail(f"{name!r} is not one of {', '.join(OPTIMIZER_DEFAULTS)}")
        lr = at.key("lr").num()
        if lr < 0:
            at.key("lr").fail(f"the learning rate must not be negative, got {lr}")
        given = {}
        for k, v in at.mapping():
            if k in ("name", "lr"):
                continue
            if k not in OPTIMIZER_DEFAULTS[name]:
                v.fail(f"{name} has no argument {k!r} (it takes {', '.join(OPTIMIZER_DEFAULTS[name])})")
            if k == "betas":
                pair = v.items()
                if len(pair) != 2:
                    v.fail(f"expected two numbers, got {v.value}")
                given[k] = tuple(float(b.num()) for b in pair)
            else:
                given[k] = v.num()
        return Optimizer.make(name, lr, **given)

    def kwargs(self) -> dict:
        """torch's keyword arguments (``lr`` included)."""
        return {"lr": self.lr, **dict(self.args)}

    def to_json(self) -> dict:
        return {"name": self.name, "lr": self.lr,
                **{k: list(v) if isinstance(v, tuple) else v for k, v in self.args}}


@dataclass(frozen=True, slots=True)
class LrSchedule:
    """``constant`` or ``warmup_cosine(warmup, total, min_ratio)``; ``factor(t)`` multiplies the
    optimizer's rate at optimizer step t = 0, 1, ... (LANGUAGE.md's formula)."""

    name: str = "constant"
    warmup: int = 0
    total: int = 0
    min_ratio: float = 0.0

    NAMES = ("constant", "warmup_cosine")

    def factor(self, t: int) -> float:
        if self.name == "constant":
            return 1.0
        if t < self.warmup:
            return (t + 1) / self.warmup
        progress = min(1.0, (t - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    @staticmethod
    def read(at: At) -> "LrSchedule":
        name = at.key("name").str()
        if name not in LrSchedule.NAMES:
            at.key("name").fail(f"{name!r} is not one of {', '.join(LrSchedule.NAMES)}")
        if name == "constant":
            return LrSchedule()
        r = at.key("min_ratio").num()
        if not 0 <= r <= 1:
            at.key("min_ratio").fail(f"expected a ratio in [0, 1], got {r}")
        return LrSchedule(name, at.key("warmup").int(0), at.key("total").int(0), float(r))

    def to_json(self) -> dict:
        if self.name == "constant":
            return {"name": "constant"}
        return {"name": self.name, "warmup": self.warmup, "total": self.total, "min_ratio": self.min_ratio}


@dataclass(frozen=True, slots=True)
class LossScale:
    """fp16's dynamic loss scaling: start at ``initial``, multiply by ``backoff`` on a step whose
    gradients overflow (the step is skipped), by ``growth`` after ``window`` clean steps in a row;
    never below ``minimum``. DeepSpeed's defaults (2^16, 0.5, 2, 1000, 1)."""

    initial: float = 65536.0
    backoff: float = 0.5
    growth: float = 2.0
    window: int = 1000
    minimum: float = 1.0

    @staticmethod
    def read(at: At) -> "LossScale":
        return LossScale(at.key("initial").num(), at.key("backoff").num(), at.key("growth").num(),
                         at.key("window").int(1), at.key("minimum").num())

    def to_json(self) -> dict:
        return {"initial": self.initial, "backoff": self.backoff, "growth": self.growth, "window": self.window,
                "minimum": self.minimum}


@dataclass(frozen=True, slots=True)
class Zero3:
    """How zero = 3 stages gather their parameters (plan.json ``train.zero3``, present where a stage has
    zero = 3). ``prefetch``: the next layer's all-gather starts while the current layer computes
    (forward: layer i + 1 at layer i's start; backward: layer i - 1 at layer i's). ``keep_gathered``:
    a layer's parameters, once gathered in a step, stay gathered across the step's micro-batches and
    are freed after its last backward (torch's ``set_reshard_after_backward(False)``: one gather per
    layer and step instead of two per micro-batch, the stage's whole parameters held during the step);
    otherwise they are freed after each forward and each backward."""

    prefetch: bool = True
    keep_gathered: bool = False

    @staticmethod
    def read(at: At) -> "Zero3":
        return Zero3(at.key("prefetch", True).bool(), at.key("keep_gathered", False).bool())

    def to_json(self) -> dict:
        return {"prefetch": self.prefetch, "keep_gathered": self.keep_gathered}
