"""Resource bounds of the compiler: what a plan may ask for before a pass would run away.

Every pass whose work grows with a plan construct (devices, levels, unit tasks,
micro-batches, program sizes) checks that construct against a bound *before* doing
the work, and stops with a located :class:`~planc.diagnostics.PlanError` that names
the bound and how to raise it::

    plan.plan:1:1: error: the cluster has 1048576 devices, over the budget of 65536 (bound 'devices')
      hint: raise it with --budget devices=1048576 (planc compile/check/explain); see docs/limits.md

A :class:`Budget` is a set of bounds; ``--budget devices=2000000,tasks=200000`` on
``planc compile/check/explain`` replaces the named ones (:func:`parse`). The budget in
force is a context variable (:func:`current`, :func:`using`), so the passes need no
extra argument: ``compile_file(path, budget=...)`` and the CLI set it around their
work. docs/limits.md states each bound, its default and what it costs when raised.

Imports the standard library and the diagnostic type only, so that any pass may use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass, field

from planc.diagnostics import Diagnostic, PlanError
from planc.span import Span

__all__ = ["Bound", "BOUNDS", "Budget", "BudgetSyntaxError", "DEFAULT", "parse", "current", "using",
           "check", "exceeded", "hint", "limit", "accepts"]


@dataclass(frozen=True, slots=True)
class Bound:
    name: str          # as written after --budget
    default: float
    what: str          # the thing counted, in messages: "devices", "unit tasks"
    doc: str           # what grows with it (docs/limits.md says more)
    integer: bool = True


BOUNDS: dict[str, Bound] = {b.name: b for b in (
    Bound("devices", 65_536, "devices",
          "every pass lists devices (linear in them: placement, routes, the launch check over classes of ranks)"),
    Bound("levels", 64, "levels", "placement matrices and synthesis hierarchies grow with the cluster's depth"),
    Bound("tasks", 10_000, "unit tasks",
          "the unit tasks of the transfers leaving one stage are costed, scheduled together and written out"),
    Bound("task_devices", 100_000, "task endpoints (holders + receivers of each unit task)",
          "each unit task is costed for each of its holders and receivers"),
    Bound("micro_batches", 10_000, "micro-batches", "schedules list 2 ops per micro-batch per stage"),
    Bound("pipeline_ops", 200_000, "pipeline ops",
          "2 x stages x micro-batches ops are listed and every rank's order simulated for deadlocks"),
    Bound("synthesis_size", 8, "steps",
          "reduction synthesis enumerates programs of up to synthesis { max_size } steps"),
    Bound("trials", 4096, "trials", "randomized_greedy makes one pass over every unit task per trial"),
    Bound("dfs_seconds", 600.0, "seconds", "dfs(budget) explores budget x 10,000 nodes", integer=False),
)}


class BudgetSyntaxError(ValueError):
    """A --budget value that cannot be read; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Budget:
    """Bounds by name; a name not given keeps its default."""

    limits: tuple[tuple[str, float], ...] = ()
    _by_name: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values = {n: b.default for n, b in BOUNDS.items()}
        for name, value in self.limits:
            if name not in BOUNDS:
                raise BudgetSyntaxError(f"unknown budget bound '{name}'; expected one of {', '.join(BOUNDS)}")
            values[name] = value
        object.__setattr__(self, "_by_name", values)

    def __getitem__(self, name: str) -> float:
        return self._by_name[name]

    def replace(self, **limits: float) -> "Budget":
        return Budget(tuple({**dict(self.limits), **limits}.items()))

    def describe(self) -> str:
        return ",".join(f"{n}={_fmt(self[n])}" for n in BOUNDS)


DEFAULT = Budget()


def parse(text: str, base: Budget = DEFAULT) -> Budget:
    """``"devices=2000000,tasks=200000"`` → a Budget (others as in ``base``); BudgetSyntaxError if unreadable."""
    limits = dict(base.limits)
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, eq, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if not eq or not raw:
            raise BudgetSyntaxError(f"budget item '{item}' is not NAME=NUMBER (e.g. devices=20000)")
        bound = BOUNDS.get(name)
        if bound is None:
            raise BudgetSyntaxError(f"unknown budget bound '{name}'; expected one of {', '.join(BOUNDS)}")
        try:
            value = float(raw.replace("_", ""))
            if bound.integer:   # 2000000, 2_000_000 or 2e6
                if not value.is_integer():
                    raise ValueError(raw)
                value = int(value)
        except (ValueError, OverflowError):
            kind = "a whole number" if bound.integer else "a number"
            raise BudgetSyntaxError(f"budget bound {name} must be {kind}, got '{raw}'") from None
        if not value > 0 or value != value or value == float("inf"):
            raise BudgetSyntaxError(f"budget bound {name} must be positive and finite, got '{raw}'")
        limits[name] = value
    return Budget(tuple(limits.items()))


_CURRENT: contextvars.ContextVar[Budget] = contextvars.ContextVar("planc_budget", default=DEFAULT)


def current() -> Budget:
    """The budget in force (:data:`DEFAULT` unless :func:`using` set another)."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(budget: Budget | str | None):
    """Make ``budget`` (a Budget, its --budget text, or None for the one in force) current inside."""
    if budget is None:
        yield current()
        return
    if isinstance(budget, str):
        budget = parse(budget)
    token = _CURRENT.set(budget)
    try:
        yield budget
    finally:
        _CURRENT.reset(token)


def accepts(fn):
    """Give ``fn`` a keyword argument ``budget`` (a Budget, --budget text or None: the one in force)
    that is current while ``fn`` runs: ``compile_file(path, budget="devices=20000")``."""
    @functools.wraps(fn)
    def wrapper(*args, budget: "Budget | str | None" = None, **kwargs):
        with using(budget):
            return fn(*args, **kwargs)
    sig = inspect.signature(fn)
    param = inspect.Parameter("budget", inspect.Parameter.KEYWORD_ONLY, default=None)
    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), param])
    return wrapper


def exceeded(name: str, value: float, subject: str, span: Span) -> Diagnostic | None:
    """The diagnostic for ``value`` over bound ``name`` of the current budget, or None when within.

    ``subject`` says what has the value, e.g. ``"the cluster has"``: the message reads
    "the cluster has 1048576 devices, over the budget of 65536 (bound 'devices')".
    """
    bound, limit = BOUNDS[name], current()[name]
    if value <= limit:
        return None
    return Diagnostic(f"{subject} {_fmt(value)} {bound.what}, over the budget of {_fmt(limit)} (bound '{name}')",
                      span, hint(name, value))


def hint(name: str, value: float) -> str:
    """How to raise bound ``name`` far enough for ``value``."""
    return (f"raise it with --budget {name}={_fmt(_raised(value, BOUNDS[name]))} "
            "(planc compile/check/explain); see docs/limits.md")


def limit(name: str) -> float:
    """Bound ``name`` of the current budget."""
    return current()[name]


def check(name: str, value: float, subject: str, span: Span) -> None:
    """Raise the located PlanError of :func:`exceeded` when ``value`` is over bound ``name``."""
    d = exceeded(name, value, subject, span)
    if d is not None:
        raise PlanError(d)


def _raised(value: float, bound: Bound) -> float:
    if bound.integer:
        return int(value) if value == int(value) else int(value) + 1
    return value


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"
