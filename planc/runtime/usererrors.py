"""The user's code, located: where an exception of the model, loss or data code came from (the user's
file and line, from the exception's traceback, not planc's or torch's frames), and the exercise that runs
that code once as the runtime will, so that a mistake in it stops ``planc check``/``planc compile``
instead of every rank of a launch.

Used by the compile-time probe (``probe._request``: :func:`draw_batches`, :func:`exercise`) and by the
training entry point (``main``: :func:`user_step`, :class:`CheckedLoss`), which turn a failure of the
user's code into one line naming the step, micro-batch, stage, layer, file and line.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import traceback

import torch

__all__ = ["UserCodeError", "describe", "user_frame", "layers_of", "draw_batches", "exercise", "CheckedLoss",
           "user_step", "shapes", "non_finite_loss", "vocabulary_of", "ids_in_vocabulary"]

_DTYPE_NAMES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
                torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                torch.bool: "bool"}   # plan.json's names (as planc.runtime.probe.DTYPE_NAMES)
_HERE = os.path.dirname(os.path.realpath(__file__))
# planc's own files: this package (planc/runtime or OUT/planc_runtime) and the contract beside it
_OWN = (_HERE, os.path.join(os.path.dirname(_HERE), "planc"))


class UserCodeError(Exception):
    """A mistake in the user's code, in one line. ``part`` says which line of the plan it belongs to:
    ``model``, ``data``, ``loss``, ``data-use``, ``loss-use`` or ``stage:N`` (the compiler points there)."""

    def __init__(self, part: str, message: str):
        super().__init__(message)
        self.part = part


def _is_user_file(path: str, roots) -> bool:
    p = os.path.realpath(path)
    if any(p == o or p.startswith(o + os.sep) for o in _OWN):
        return False
    if any(part in ("site-packages", "dist-packages") for part in p.split(os.sep)):
        return False
    return any(p.startswith(os.path.realpath(r) + os.sep) for r in roots)


def _short(path: str, roots) -> str:
    p = os.path.realpath(path)
    for r in roots:
        r = os.path.realpath(r)
        if p.startswith(r + os.sep):
            return os.path.relpath(p, r)
    return os.path.basename(p)


def user_frame(exc: BaseException, roots):
    """The deepest frame of ``exc``'s traceback (and of the exceptions it was raised from) in a file under
    one of ``roots`` (the user's code folders), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for fr in reversed(traceback.extract_tb(exc.__traceback__)):
            if _is_user_file(fr.filename, roots):
                return fr
        exc = exc.__cause__ or exc.__context__
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def describe(exc: BaseException, roots) -> str:
    """``FILE:LINE in FUNCTION (`source`): Type: message`` for the user's deepest frame, else the message."""
    if isinstance(exc, SyntaxError) and exc.filename:
        col = f":{exc.offset}" if exc.offset else ""
        src = f" (`{exc.text.strip()}`)" if exc.text and exc.text.strip() else ""
        return f"{_short(exc.filename, roots)}:{exc.lineno}{col}{src}: {type(exc).__name__}: {exc.msg}"
    fr = user_frame(exc, roots)
    if fr is None:
        return _first_line(exc)
    src = f" (`{fr.line.strip()}`)" if fr.line else ""
    return f"{_short(fr.filename, roots)}:{fr.lineno} in {fr.name}{src}: {_first_line(exc)}"


def _defined_at(fn, roots) -> str:
    try:
        path, line = inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (TypeError, OSError):
        return getattr(fn, "__name__", repr(fn))
    return f"{_short(path, roots)}:{line}"


def shapes(values) -> str:
    """``f32[8, 16], i64[8]`` for a layer's inputs (other values by their type)."""
    vals = list(values) if isinstance(values, (tuple, list)) else [values]
    return ", ".join(f"{_DTYPE_NAMES.get(v.dtype, str(v.dtype))}[{', '.join(map(str, v.shape))}]"
                     if torch.is_tensor(v) else type(v).__name__ for v in vals)


def layers_of(built, builder, roots) -> list:
    """The builder's result as a list of ``torch.nn.Module`` layers; anything else is a UserCodeError."""
    where = _defined_at(builder, roots)
    if built is None:
        raise UserCodeError("model", f"the builder ({where}) returned None, not a list of layers "
                                     "(a missing `return`?)")
    if isinstance(built, torch.nn.Module) and not isinstance(built, (torch.nn.ModuleList, torch.nn.Sequential)):
        raise UserCodeError("model", f"the builder ({where}) returned one {type(built).__name__}, not a list of "
                                     "layers: return the layers a pipeline cuts into stages, e.g. [block1, block2, head]")
    try:
        layers = list(built)
    except TypeError:
        raise UserCodeError("model", f"the builder ({where}) returned a {type(built).__name__}, not a list of "
                                     "layers") from None
    if not layers:
        raise UserCodeError("model", f"the builder ({where}) returned no layers")
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise UserCodeError("model", f"layer {i} of the builder ({where}) is a {type(layer).__name__}, not a "
                                         "torch.nn.Module")
    return layers


def _bind_error(fn, args, kwargs) -> str | None:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    except ValueError:   # no signature to check (a builtin): the call itself tells
        return None
    return None


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def draw_batches(data_fn, micro_batch: int, seed: int, args: dict, count: int, roots) -> list:
    """``count`` batches from the plan's data function as the runtime draws them (one step's
    micro-batches), each checked: a pair (inputs, target) of tensors of ``micro_batch`` rows, all of the
    shapes of the first. Any failure is a UserCodeError naming the data function and why."""
    name = getattr(data_fn, "__name__", "data")
    where = _defined_at(data_fn, roots)
    call = f"{name}(micro_batch, seed{''.join(f', {k}=...' for k in args)})"
    why = _bind_error(data_fn, (micro_batch, seed), args)
    if why is not None:
        raise UserCodeError("data-use", f"is called as {call} (the plan's model arguments as keywords), but {why} "
                                        f"(defined at {where}; add **_ to take arguments it does not use)")
    try:
        it = data_fn(micro_batch, seed, **args)
    except Exception as e:  # noqa: BLE001 - the user's code
        raise UserCodeError("data-use", f"failed when called as {call}: {describe(e, roots)}") from e
    if not hasattr(it, "__next__"):
        raise UserCodeError("data-use", f"returned a {type(it).__name__}, not an iterator of (inputs, target) "
                                        f"batches (defined at {where}; write it as a generator: `yield x, y`)")
    out = []
    for k in range(count):
        try:
            item = next(it)
        except StopIteration:
            raise UserCodeError("data-use", f"ran dry after {k} batch(es), but one step draws {count} (one per "
                                            f"micro-batch) and every step draws again: make it endless (defined "
                                            f"at {where})") from None
        except Exception as e:  # noqa: BLE001 - the user's code
            raise UserCodeError("data-use", f"failed drawing batch {k}: {describe(e, roots)}") from e
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            what = f"a {type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
            raise UserCodeError("data-use", f"batch {k} is {what}, not a pair (inputs, target) (defined at {where})")
        for part, v in zip(("inputs", "target"), item):
            if not torch.is_tensor(v):
                raise UserCodeError("data-use", f"batch {k}'s {part} is a {type(v).__name__}, not a tensor")
            if v.dim() == 0 or v.shape[0] != micro_batch:
                rows = "a scalar" if v.dim() == 0 else f"{v.shape[0]} rows ({shapes(v)})"
                raise UserCodeError("data-use", f"batch {k}'s {part} has {rows}, but the plan's micro_batch is "
                                                f"{micro_batch}: the first dimension is the micro-batch's rows")
        if out and any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(item, out[0])):
            raise UserCodeError("data-use", f"batch {k} is ({shapes(item)}) but batch 0 was ({shapes(out[0])}): "
                                            "every micro-batch must have the same shapes (transfers are fixed-size)")
        out.append(tuple(item))
    return out


def _leaf(v, grad: bool):
    if not torch.is_tensor(v):
        return v
    return v.detach().requires_grad_(grad and (v.is_floating_point() or v.is_complex()))


def _slice(v, micro_batch: int, rows: int):
    if torch.is_tensor(v) and v.dim() and v.shape[0] == micro_batch and rows < micro_batch:
        return v[:rows]
    return v


def _tensors(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _rows_text(r: int, micro_batch: int) -> str:
    return (f"a whole micro-batch of {micro_batch} rows" if r >= micro_batch
            else f"one device's {r} of the micro-batch's {micro_batch} rows")


def check_loss(loss_fn, out, target, roots, what: str = "the first micro-batch"):
    """Call the loss as the runtime does and check what it returns: one finite value that requires grad."""
    name = getattr(loss_fn, "__name__", "loss")
    where = _defined_at(loss_fn, roots)
    why = _bind_error(loss_fn, (out, target), {})
    if why is not None:
        raise UserCodeError("loss-use", f"is called as {name}(output, target) with the last stage's output and "
                                        f"the data's target, but {why} (defined at {where})")
    try:
        loss = loss_fn(out, target)
    except Exception as e:  # noqa: BLE001 - the user's code
        raise UserCodeError("loss-use", f"failed on output ({shapes(out)}) and target ({shapes(target)}): "
                                        f"{describe(e, roots)}") from e
    if not torch.is_tensor(loss):
        raise UserCodeError("loss-use", f"returned a {type(loss).__name__}, not a tensor (defined at {where})")
    if loss.numel() != 1:
        raise UserCodeError("loss-use", f"returned {shapes(loss)}, not a scalar: reduce it to one value "
                                        f"(e.g. .mean()) (defined at {where})")
    if not loss.requires_grad:
        raise UserCodeError("loss-use", f"returned a value that does not depend on the output (it does not require "
                                        f"grad: .item(), .detach() or a new tensor?) (defined at {where})")
    value = float(loss.detach())
    if not math.isfinite(value):
        raise UserCodeError("loss-use", f"is {value} on {what} (output {shapes(out)}, target {shapes(target)}; "
                                        f"defined at {where})")
    return loss


def exercise(layers, loss_fn, stages, inputs_of: dict, target, micro_batch: int, rows, roots) -> None:
    """Run each stage's layers on its planned micro-batch slice (the first ``rows[s]`` rows of what it got
    in the probe's whole-micro-batch run) with gradients, in order; apply the loss to the last stage's
    output and the target's rows; one backward per stage (the last from the loss, the others from all-ones
    gradients of their last layer's output). A stage that got no inputs (a planning error the compiler
    reports) is skipped. The first failure is a UserCodeError naming the stage, layer, shapes, file and line."""
    last = len(stages) - 1
    for s, (lo, hi) in enumerate(stages):
        if lo >= hi or lo not in inputs_of:
            continue
        r = max(1, int(rows[s])) if s < len(rows) else micro_batch
        a = tuple(_leaf(_slice(v, micro_batch, r), s != 0) for v in inputs_of[lo])
        with torch.enable_grad():
            out = None
            for i in range(lo, hi):
                why = _bind_error(layers[i].forward, a, {})
                if why is not None:   # the plan hands the layer other inputs than it takes
                    fed = (f"layer {i - 1}'s output (a tuple is spread), so a layer that takes skip inputs must "
                           "start the stage its transfers arrive at" if i > lo else
                           "the data's inputs" if s == 0 else "the transfers into the stage, in declaration order")
                    raise UserCodeError(f"stage:{s}", f"stage {s} layer {i} ({type(layers[i]).__name__}) takes "
                                                      f"{_signature(layers[i].forward)} but gets {len(a)} input(s) "
                                                      f"({shapes(a)}): {why}; it gets {fed}")
                try:
                    out = layers[i](*a)
                except Exception as e:  # noqa: BLE001 - the user's layer
                    raise UserCodeError(f"stage:{s}", f"stage {s} layer {i} ({type(layers[i]).__name__}) fails on "
                                                      f"its input ({shapes(a)}; {_rows_text(r, micro_batch)}): "
                                                      f"{describe(e, roots)}") from e
                a = tuple(_tensors(out))
            if s == last:
                loss = check_loss(loss_fn, out, _slice(target, micro_batch, r), roots)
                what, ys, gs = "the loss", [loss], None
            else:
                ys = [t for t in _tensors(out) if torch.is_tensor(t) and t.requires_grad]
                what, gs = f"stage {s}'s output", [torch.ones_like(t) for t in ys]
            try:
                if ys:
                    torch.autograd.backward(ys, gs)
            except Exception as e:  # noqa: BLE001 - a layer that cannot be differentiated
                raise UserCodeError(f"stage:{s}", f"stage {s}: the backward from {what} fails: "
                                                  f"{describe(e, roots)}") from e
        for layer in layers[lo:hi]:
            for p in layer.parameters():
                p.grad = None


# ---------------------------------------------------------------- at run time (main)

class CheckedLoss:
    """The plan's loss as the runtime calls it: counts the calls (one per micro-batch, in order, on the last
    stage) and keeps each value (detached: no synchronisation) so a non-finite step loss can name its
    micro-batch; an exception in it, or a result that is not one value, is a UserCodeError."""

    def __init__(self, fn, roots, micro_batches: int):
        self.fn, self.roots, self.micro_batches = fn, roots, micro_batches
        self.values: list = []
        self.__name__ = getattr(fn, "__name__", "loss")

    def __call__(self, out, target):
        m = len(self.values)
        try:
            loss = self.fn(out, target)
        except Exception as e:  # noqa: BLE001 - the user's code
            raise UserCodeError("loss-use", f"micro-batch {m}: the loss failed on output ({shapes(out)}) and target "
                                            f"({shapes(target)}): {describe(e, self.roots)}") from e
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise UserCodeError("loss-use", f"micro-batch {m}: the loss returned "
                                            f"{shapes(loss) if torch.is_tensor(loss) else type(loss).__name__}, "
                                            "not one value")
        self.values.append(loss.detach())
        return loss

    def first_non_finite(self) -> int | None:
        for m, v in enumerate(self.values):
            if not bool(torch.isfinite(v).all()):
                return m
        return None

    def new_step(self) -> None:
        self.values = []


def _micro_batch_of(exc: BaseException):
    """The micro-batch the engine was at (its ``_exec_*`` instruction's ``buffer_id``) when ``exc`` was raised."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_name.startswith("_exec_") and "buffer_id" in tb.tb_frame.f_locals:
            found = (tb.tb_frame.f_code.co_name.removeprefix("_exec_"), tb.tb_frame.f_locals["buffer_id"])
        tb = tb.tb_next
    return found


def _layer_of(exc: BaseException, layers, first: int):
    """``(index, class)`` of the deepest of ``layers`` whose ``forward`` is on ``exc``'s traceback."""
    ids = {id(layer): first + i for i, layer in enumerate(layers)}
    tb, found = exc.__traceback__, None
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if me is not None and id(me) in ids:
            found = (ids[id(me)], type(me).__name__)
        tb = tb.tb_next
    return found


@contextlib.contextmanager
def user_step(step: int, stage, layers, first: int, roots, data_drawn=None):
    """Turn a failure of the user's code during a training step into a one-line ``UserCodeError``: the step,
    the micro-batch and instruction, the stage and layer, the user's file and line. ``StopIteration`` is the
    data running dry (``data_drawn()``: batches drawn so far). Other exceptions (planc's, communication)
    pass through unchanged."""
    try:
        yield
    except UserCodeError as e:
        mb = getattr(e, "micro_batch", None)
        where = f"step {step}, " + (f"micro-batch {mb}, " if mb is not None else "") + f"stage {stage}"
        raise UserCodeError(e.part, f"{where}: {e}") from e
    except (StopIteration, RuntimeError) as e:
        dry = isinstance(e, StopIteration) or isinstance(e.__cause__ or e.__context__, StopIteration)
        if not dry and user_frame(e, roots) is None:
            raise
        if not dry:
            raise _in_step(e, step, stage, layers, first, roots) from e
        n = data_drawn() if data_drawn is not None else None
        raise UserCodeError("data-use", f"step {step}, stage {stage}: the data generator ran dry"
                                        f"{f' after {n} batch(es)' if n is not None else ''}: make it endless "
                                        "(every step draws one batch per micro-batch)") from e
    except Exception as e:  # noqa: BLE001 - classified: the user's frame decides
        if user_frame(e, roots) is None:
            raise
        raise _in_step(e, step, stage, layers, first, roots) from e


def _in_step(e: BaseException, step: int, stage, layers, first: int, roots) -> UserCodeError:
    """One line for an exception of the user's code in a step: where in the step, and where in their code."""
    mb, layer = _micro_batch_of(e), _layer_of(e, layers, first)
    where = [f"step {step}"]
    if mb is not None:
        where.append(f"micro-batch {mb[1]} ({mb[0].replace('_', ' ')})")
    where.append(f"stage {stage}")
    if layer is not None:
        where.append(f"layer {layer[0]} ({layer[1]})")
    return UserCodeError("model", f"{', '.join(where)}: {describe(e, roots)}")


def non_finite_loss(step: int, value: float, rank: int, stage, checked) -> UserCodeError:
    """The step's loss is ``value`` (nan or inf) on every rank: gather which rank's loss calls gave the first
    non-finite micro-batch (``checked``: this rank's :class:`CheckedLoss`, None on ranks without the loss)
    and name it; collective (every rank calls it, having seen the same all-reduced loss)."""
    import torch.distributed as dist

    mine = checked.first_non_finite() if checked is not None else None
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if mine is None else (rank, stage, mine))
    hits = sorted((m, s, r) for r, s, m in (f for f in found if f is not None))
    name = getattr(checked, "__name__", "loss") if checked is not None else "loss"
    where = (f"first at micro-batch {hits[0][0]} on stage {hits[0][1]} (rank {hits[0][2]})" if hits
             else "no single micro-batch's loss was (their sum overflowed)")
    error = UserCodeError("loss-use", f"step {step}: the loss is {value}: the plan's {name}, {where}; "
                                      "the data, the learning rate or the model diverged")
    error.same_on_every_rank = True   # gathered: rank 0 says it for everyone
    return error


def layer_failure(e: BaseException, layers, first: int, roots=None) -> str:
    """``layer L (Class): FILE:LINE in F (`source`): Type: message`` for an exception raised while ``layers``
    (indices from ``first``) ran; ``roots`` default: the folder of the running program (OUT/ for train.py)."""
    roots = roots if roots is not None else [os.path.dirname(os.path.abspath(sys.argv[0] or "."))]
    layer = _layer_of(e, layers, first)
    return (f"layer {layer[0]} ({layer[1]}): " if layer is not None else "") + describe(e, roots)


def vocabulary_of(model_ref) -> int | None:
    """The vocabulary size of plan.json's model when the runtime knows it (a Hugging Face model's
    ``vocab_size``), else None."""
    config = dict(getattr(model_ref, "config", ()) or ()) if hasattr(model_ref, "attn_implementation") else {}
    vocab = config.get("vocab_size")
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None


def ids_in_vocabulary(batches, vocab: int, micro_batches: int):
    """The data generator's ``(x, y)`` batches, each input's token ids checked against the vocabulary on the
    way (a min and a max per batch): the compile-time probe sees only the first batch, and an id past the
    vocabulary would fail deep in the embedding with a long traceback. A bad id is one ``UserCodeError``
    naming the micro-batch (the step and stage are added by :func:`user_step`) and the id."""
    for n, (x, y) in enumerate(batches):
        if torch.is_tensor(x) and x.numel() and not x.is_floating_point() and x.dtype != torch.bool:
            lo, hi = int(x.min()), int(x.max())
            if lo < 0 or hi >= vocab:
                error = UserCodeError("data-use", f"the data's token id {hi if hi >= vocab else lo} is outside the "
                                                  f"model's vocabulary 0..{vocab - 1} (vocab_size = {vocab})")
                error.micro_batch = n % micro_batches
                raise error
        yield x, y
