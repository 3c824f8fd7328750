"""Size a model at compile time: parameters, and the shape and dtype of what crosses each stage boundary.

    python -m planc_runtime.probe '{"model_file": .., "function": .., "args": {..},
        "data_file": .., "data_function": .., "micro_batch": 8, "seed": 0,
        "stages": [[0, 3], [3, 6]],
        "transfers": [{"name": "hidden", "src_stage": 0, "src_layer": null, "dst_stage": 1}],
        "tensor_degrees": [2], "tensor_stages": [{"stage": 1, "layers": [3, 6], "degree": 2, "rows": 4}],
        "flops": true}'
        -> {"layer_params": [...], "layer_outputs": [{"shape": [8, 32, 64], "dtype": "f32"}, ..., null],
            "layer_output_bytes": [65536, ..., null], "layer_saved": [[[storage, bytes, is_float], ...], ...],
            "layer_flops": [[fwd, bwd], ..., null], "flop_errors": [],
            "transfers": [{"name": "hidden", "shape": [8, 32, 64], "dtype": "f32", "error": null}],
            "tensor_parallel": true, "sharded_layer_params": {"2": [...]}, "shard_errors": {},
            "tensor_traffic": [{"stage": 1, "degree": 2, "rows": 4, "forward": [32768, ...],
                                "backward": [32768, ...], "errors": []}],
            "graph_errors": []}                                                     (planc.probe)

    python -m planc_runtime.probe MODEL_FILE FUNCTION JSON_ARGS MICRO_BATCH \\
        [--data FILE:FUNCTION] [--seed N] [--graph JSON]

(from a checkout: ``python -m planc.runtime.probe ...``). The JSON-request form
is the compiler's: it runs the plan's stage dataflow (stage 0 gets the data's
input; every other stage gets its incoming transfers as positional arguments,
in declaration order; a layer's tuple output is the next layer's arguments),
so it measures each transfer's real shape and dtype even across skips and
multi-input stages, for one whole micro-batch of ``micro_batch`` rows. A stage
range ``null`` is every layer. ``layer_params`` counts the unsplit model's
parameters. A builder that takes a keyword ``tensor_parallel`` opts in to
tensor parallelism: the shapes come from a build with ``tensor_parallel=None``
(the full model), and for each degree ``k`` in ``tensor_degrees`` it is built
again with a stand-in context of size ``k`` (rank 0, no process group: its
all-reduces are identities) to count what one device of a tensor group holds
(``sharded_layer_params[k]``; a builder that refuses ``k`` lands in
``shard_errors[k]``). For each entry of ``tensor_stages`` (``{"stage", "layers", "degree",
"rows"}``: a stage whose ``tensor`` axis has size ``degree`` > 1, each device computing ``rows`` rows
of a micro-batch) the sharded layers of that stage run once more, forward and backward, through the
stand-in, whose Megatron f/g operators log every all-reduce: ``tensor_traffic`` lists per stage the
bytes of each all-reduce one device issues per micro-batch, ``"forward"`` (g) and ``"backward"`` (f),
with ``"errors"`` for layers that could not be measured. A layer that fails, or a stage whose inputs never
arrived, is listed in ``graph_errors`` and its transfers get ``error``.
``layer_output_bytes`` sums every tensor a layer returns; ``layer_saved`` lists per layer the storages
autograd saves for its backward in one run of the dataflow with gradients (``saved_by_layer``). With ``"flops": true``
each layer that ran is run once more on the inputs it got, with gradients, under
``torch.utils.flop_counter.FlopCounterMode``: ``layer_flops[i]`` = [forward,
backward] FLOPs for the whole micro-batch (the backward from all-ones output
gradients, into the parameters and into every floating-point input but the
data's; CPU attention kernels counted as ``sdpa``); a layer whose count fails
gets ``null`` and a line in ``flop_errors``.

The command-line form prints one JSON object on stdout::

    {"layers": [{"index": 0, "params": 1234, "output_shapes": [[8, 32, 64]],
                 "output_dtypes": ["f32"]}, ...],
     "params": 5678, "param_bytes": 22712,
     "stages": [{"index": 0, "layers": [0, 3], "params": 999, "param_bytes": 3996}],
     "transfers": [{"name": "hidden", "shape": [8, 32, 64], "dtype": "f32"}]}

``output_shapes`` lists one shape per tensor a layer returns (a tuple output
gives several). Shapes are for one whole micro-batch of ``MICRO_BATCH`` rows
from the data function (default: ``batches`` in MODEL_FILE). Without
``--graph`` the layers run in a chain (each gets the previous output);
``--graph '{"stages": [[0, 3], [3, 6]], "transfers": [{"name": ..,
"src_stage": 0, "src_layer": null, "dst_stage": 1}]}'`` runs the plan's
stage dataflow instead, and reports each transfer's shape and dtype. Exit
status 2 with a message on stderr when the model cannot be built or run.
Runs on CPU, no process group, no gradients.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

from . import lazydynamo
from .probe_measure import count_flops, first_rows, measure_tensor_traffic
from .tensor_parallel import TensorParallel
from .tied import probe_record as tied_record, split_record
from .usercode import MissingFunction, accepts_tensor_parallel, load_callable
from .usererrors import UserCodeError, describe, draw_batches, exercise, layers_of

DTYPE_NAMES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
               torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
               torch.uint8: "u8", torch.bool: "bool"}


def _load(path: str, function: str):
    return load_callable(path, function, prefix="planc_probe_")


def _tensors(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _dtype(t) -> str:
    return DTYPE_NAMES.get(t.dtype, str(t.dtype))


class StandInTensorParallel(TensorParallel):
    """Rank 0 of a tensor group of ``size`` with no process group: shards are real, sums are identities.

    Enough for what a builder uses at build time (``.rank``, ``.size``, ``.shard``); a forward through
    it gives each rank's partial results in their full shapes. Megatron's f and g are the real autograd
    functions, so every all-reduce the model would issue, forward (g) and backward (f), reaches
    :meth:`all_reduce`, which appends ``(phase, bytes)`` to ``log`` while ``phase`` is set.
    """

    def __init__(self, size: int):
        super().__init__(None, 0, size, tuple(range(size)))
        self.phase: str | None = None
        self.log: list[tuple[str, int]] = []

    def all_reduce(self, t):
        if self.phase is not None:
            self.log.append((self.phase, t.numel() * t.element_size()))
        return t


def _build(builder, args: dict, seed: int, tensor_parallel=None, opts_in: bool = False, roots=()):
    torch.manual_seed(seed)
    if opts_in:
        return layers_of(builder(**args, tensor_parallel=tensor_parallel), builder, roots)
    return layers_of(builder(**args), builder, roots)


def _layer_params(layers) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def run_graph(layers, x, stages, transfers, inputs_of: dict | None = None, on_layer=None):
    """Run the stage dataflow once (no gradients).

    ``stages``: (lo, hi) per stage in index order; ``transfers``: dicts with name, src_stage,
    src_layer (None: the stage's last), dst_stage. Returns (outputs by layer index, value sent per
    transfer name, errors): a failing layer stops its stage, and a stage whose inputs never arrived
    is skipped, each with one message in ``errors``. ``inputs_of``, when given, receives each layer's
    positional arguments by layer index.
    """
    outputs: dict[int, object] = {}
    sent: dict[str, object] = {}
    errors: list[str] = []
    with torch.no_grad() if on_layer is None else torch.enable_grad():
        for s, (lo, hi) in enumerate(stages):
            if hi > len(layers):
                errors.append(f"stage {s} has layers {lo}..{hi} but the model has {len(layers)}")
                continue
            if s == 0:
                inputs = (x,)
            else:
                names = [t["name"] for t in transfers if t["dst_stage"] == s]
                lost = [n for n in names if n not in sent]
                if not names or lost:
                    why = (f"transfer '{lost[0]}' was not measured" if lost
                           else "no transfer is declared into it")
                    errors.append(f"stage {s} could not run: {why}")
                    continue
                inputs = tuple(sent[n] for n in names)
            a = inputs
            for i in range(lo, hi):
                if inputs_of is not None:
                    inputs_of[i] = a
                if on_layer is not None:
                    on_layer(i)
                try:
                    out = layers[i](*a)
                except Exception as e:  # noqa: BLE001 - the plan feeds it the wrong inputs; say which
                    shapes = ", ".join(f"{_dtype(v)}{list(v.shape)}" if torch.is_tensor(v) else type(v).__name__
                                       for v in a)
                    errors.append(f"stage {s} layer {i} ({type(layers[i]).__name__}) failed on inputs "
                                  f"({shapes}): {type(e).__name__}: {e}")
                    break
                outputs[i] = out
                a = tuple(_tensors(out))
            for t in transfers:
                if t["src_stage"] == s:
                    layer = hi - 1 if t.get("src_layer") is None else int(t["src_layer"])
                    if layer in outputs:
                        sent[t["name"]] = outputs[layer]
    return outputs, sent, errors


def _nbytes(out, rows: tuple[int, int] | None = None) -> int:
    return sum(t.numel() * t.element_size() * _grows(t.shape, rows) for t in _tensors(out) if torch.is_tensor(t))


def _grows(shape, rows: tuple[int, int] | None) -> int:
    """``rows = (n, micro_batch)``: the probe ran ``n`` rows of the micro-batch; a tensor whose dim 0 holds
    whole multiples of them (the batch-first rows the runtime splits) has ``micro_batch // n`` times as many
    at the micro-batch; any other is the same size (1)."""
    if rows is None or rows[0] == rows[1] or not len(shape) or shape[0] % rows[0]:
        return 1
    return rows[1] // rows[0]


def _as_micro_batch(out: dict, rows: tuple[int, int]) -> dict:
    """The answer measured on ``n`` rows as the whole micro-batch's (``rows = (n, micro_batch)``, ``n`` divides
    it): dim 0 of the layers' outputs and the transfers grown by ``micro_batch // n`` (:func:`_grows`), the
    FLOPs too (every op is linear in the rows); bytes are counted grown where they are measured."""
    def shape(sh):
        return [sh[0] * _grows(sh, rows), *sh[1:]] if sh else sh
    for rec in (*out["layer_outputs"], *out["transfers"]):
        if rec and rec.get("shape"):
            rec["shape"] = shape(rec["shape"])
    if out.get("layer_flops"):
        k = rows[1] // rows[0]
        out["layer_flops"] = [[f * k for f in fb] if fb is not None else None for fb in out["layer_flops"]]
    return out


def _storage_key(t) -> int:
    """A tensor's storage, the same for every view of it: its address (meta tensors have none: the storage
    object's, alive as long as autograd keeps the tensor)."""
    st = t.untyped_storage()
    return st._cdata if t.is_meta else st.data_ptr()


def saved_by_layer(layers, x, stages, transfers, rows: tuple[int, int] | None = None) -> list:
    """Per layer, the tensors autograd saves for backward when the plan's dataflow runs once with gradients
    on the whole micro-batch: ``[[storage, bytes, is_float], ...]`` (parameters left out: they are held
    anyway), storages numbered in the order first saved, so that a tensor one layer returns and the next
    saves again (tanh's output, the next Linear's input) is one storage; ``planc.pipeline.memory`` counts
    the distinct storages of a stage's layers. A layer that did not run gets an empty list. ``rows``: ``x`` is
    ``n`` rows of the micro-batch, bytes counted as at the whole (:func:`_grows`)."""
    params = {_storage_key(p) for layer in layers for p in layer.parameters()}
    ids: dict = {}
    per_layer: list[dict] = [{} for _ in layers]
    current = [None]

    def pack(t):
        key = _storage_key(t)
        if key not in params and current[0] is not None:
            sid = ids.setdefault(key, len(ids))
            per_layer[current[0]][sid] = [sid, t.untyped_storage().nbytes() * _grows(t.shape, rows),
                                          bool(t.is_floating_point())]
        return t

    def at(i):
        current[0] = i

    xs = x.detach().requires_grad_(x.is_floating_point()) if torch.is_tensor(x) else x
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_graph(layers, xs, stages, transfers, on_layer=at)
    return [sorted(d.values()) for d in per_layer]


def _resolve(stages, n: int) -> list[tuple[int, int]]:
    return [(0, n) if r is None else (int(r[0]), int(r[1])) for r in stages]


def probe(model_file, function, args: dict, micro_batch: int, data=None, seed=0, graph=None) -> dict:
    torch.manual_seed(seed)
    layers = _load(model_file, function)(**args)
    data_file, data_fn = (data.rsplit(":", 1) if data else (model_file, "batches"))
    x, _ = next(_load(data_file, data_fn)(micro_batch, seed, **args))
    outputs: dict[int, object] = {}
    sent: dict[str, object] = {}
    if graph is None:
        with torch.no_grad():
            a = (x,)
            for i, layer in enumerate(layers):
                out = layer(*a)
                outputs[i] = out
                a = tuple(_tensors(out))
    else:
        outputs, sent, errors = run_graph(layers, x, _resolve(graph["stages"], len(layers)),
                                          graph.get("transfers", []))
        if errors:
            raise RuntimeError(errors[0])
    result = {"layers": [], "params": 0, "param_bytes": 0}
    for i, layer in enumerate(layers):
        n = sum(p.numel() for p in layer.parameters())
        nb = sum(p.numel() * p.element_size() for p in layer.parameters())
        rec = {"index": i, "params": n, "param_bytes": nb}
        if i in outputs:
            ts = _tensors(outputs[i])
            rec["output_shapes"] = [list(t.shape) for t in ts]
            rec["output_dtypes"] = [_dtype(t) for t in ts]
        result["layers"].append(rec)
        result["params"] += n
        result["param_bytes"] += nb
    if graph is not None:
        result["stages"] = [{"index": s, "layers": [lo, hi],
                             "params": sum(result["layers"][i]["params"] for i in range(lo, hi)),
                             "param_bytes": sum(result["layers"][i]["param_bytes"] for i in range(lo, hi))}
                            for s, (lo, hi) in enumerate(_resolve(graph["stages"], len(layers)))]
        result["transfers"] = []
        for t in graph.get("transfers", []):
            v = sent.get(t["name"])
            rec = {"name": t["name"]}
            if torch.is_tensor(v):
                rec.update(shape=list(v.shape), dtype=_dtype(v))
            else:
                rec.update(shape=None, dtype=None, error=f"layer output is {type(v).__name__}, not a tensor")
            result["transfers"].append(rec)
    return result


class PartFailed(Exception):
    """The plan's ``model``, ``data`` or ``loss`` failed: the compiler points at that line of the plan."""

    def __init__(self, part: str, cause: BaseException, roots=()):
        plain = isinstance(cause, (MissingFunction, FileNotFoundError))   # their message says it all
        super().__init__(str(cause) if plain else describe(cause, roots))   # the user's file and line
        self.part = part


@contextlib.contextmanager
def _part(name: str, roots=()):
    try:
        yield
    except (PartFailed, UserCodeError):
        raise
    except Exception as e:  # noqa: BLE001 - reported as the plan line's error
        raise PartFailed(name, e, roots) from e


def _request(req: dict) -> dict:
    """planc.probe's form: one JSON request, the stage dataflow measured (see the module docstring)."""
    if req.get("hf"):   # a Hugging Face model, on the meta device: no weights (planc.runtime.hf_probe)
        from .hf_probe import probe_hf
        return probe_hf(req, run_graph, saved_by_layer, _load, _part)
    seed = int(req.get("seed", 0))
    args = dict(req.get("args", {}))
    roots = sorted({os.path.dirname(os.path.abspath(req[k])) for k in ("model_file", "data_file", "loss_file")
                    if req.get(k)})   # the user's code folders: their frames locate an error
    with _part("model", roots):
        builder = _load(req["model_file"], req["function"])
    with _part("data"):
        data_fn = _load(req.get("data_file") or req["model_file"], req.get("data_function") or "batches")
    loss_fn = None
    if req.get("loss_function"):   # loaded, not called: a typo in its name is found at compile time
        with _part("loss", roots):
            loss_fn = _load(req.get("loss_file") or req["model_file"], req["loss_function"])
    opts_in = accepts_tensor_parallel(builder)
    with _part("model", roots):
        layers = _build(builder, args, seed, None, opts_in, roots)
    ex = req.get("exercise")   # the user's code run as the runtime will (usererrors.exercise)
    micro_batch = int(req["micro_batch"])
    with _part("data", roots):
        batches = draw_batches(data_fn, micro_batch, seed, req.get("data_args", args),
                               int(ex["micro_batches"]) if ex else 1, roots)
    # the model runs the first `rows` rows of each batch (planc.probe.probe_rows): its time and memory do not
    # grow with a micro-batch that grows with the data axis; the answer is scaled to the micro-batch
    n = int(req.get("rows") or micro_batch)
    rows = (n, micro_batch)
    if n < micro_batch:   # copies, not views: a view's storage is the whole batch's (saved_by_layer counts storages)
        batches = [tuple(v.clone() if torch.is_tensor(v) else v for v in (first_rows(x, micro_batch, n),
                                                                          first_rows(y, micro_batch, n)))
                   for x, y in batches]
    x, y = batches[0]
    transfers = [dict(t) for t in req.get("transfers", [])]
    stages = _resolve(req.get("stages") or [None], len(layers))
    inputs_of: dict[int, tuple] = {}
    outputs, sent, errors = run_graph(layers, x, stages, transfers, inputs_of)
    if ex and loss_fn is not None:
        exercise(layers, loss_fn, stages, inputs_of, y, n, ex["rows"], roots)
    flops, flop_errors = (count_flops(layers, inputs_of, stages[0][0] if stages else None)
                          if req.get("flops") else (None, []))

    layer_outputs = []
    for i in range(len(layers)):
        first = _tensors(outputs[i])[0] if i in outputs else None
        layer_outputs.append({"shape": list(first.shape), "dtype": _dtype(first)} if torch.is_tensor(first) else None)
    measured = []
    for t in transfers:
        v = sent.get(t["name"])
        if torch.is_tensor(v):
            measured.append({"name": t["name"], "shape": list(v.shape), "dtype": _dtype(v), "error": None})
        else:
            why = (f"its layer returns a {type(v).__name__}, not one tensor" if t["name"] in sent
                   else (errors[0] if errors else "its layer did not run"))
            measured.append({"name": t["name"], "shape": None, "dtype": None, "error": why})

    sharded, shard_errors, traffic, tied_split = {}, {}, [], {}
    if opts_in:
        for k in sorted({int(k) for k in req.get("tensor_degrees", ()) if int(k) > 1}):
            tp = StandInTensorParallel(k)
            try:
                shards = _build(builder, args, seed, tp, True)
            except (ValueError, RuntimeError) as e:   # the builder refuses this split (e.g. heads % k)
                shard_errors[str(k)] = f"{type(e).__name__}: {e}"
                continue
            sharded[str(k)] = _layer_params(shards)
            split = split_record(shards)
            if split:   # a tie split over the tensor axis: the compiler refuses it at the stage (reduction/tied.py)
                tied_split[str(k)] = split
            for st in req.get("tensor_stages", ()):
                if int(st["degree"]) != k:
                    continue
                lo, hi = (0, len(shards)) if st.get("layers") is None else (int(st["layers"][0]), int(st["layers"][1]))
                rec = measure_tensor_traffic(shards, tp, lo, min(hi, len(shards)), inputs_of, n,
                                             int(st["rows"]), stages[0][0] if stages else None)
                traffic.append({"stage": int(st["stage"]), "degree": k, "rows": int(st["rows"]), **rec})
    return _as_micro_batch({
            "layer_params": _layer_params(layers), "layer_outputs": layer_outputs,
            "layer_output_bytes": [_nbytes(outputs[i], rows) if i in outputs else None for i in range(len(layers))],
            "layer_saved": saved_by_layer(layers, x, stages, transfers, rows) if not errors else [],
            "layer_flops": flops, "flop_errors": flop_errors, "transfers": measured,
            "tensor_parallel": opts_in, "sharded_layer_params": sharded, "shard_errors": shard_errors,
            "tensor_traffic": sorted(traffic, key=lambda t: t["stage"]), "graph_errors": errors,
            "tied": tied_record(layers),   # parameters shared by several layers (tied.py)
            "tied_split": tied_split,      # per tensor degree, the ties whose parameter that split shards
            **_sequence_fields(builder, x, req)}, rows)


def _sequence_fields(builder, x, req) -> dict:
    """A builder's sequence parallelism: whether it opts in (the keyword ``sequence_parallel``) and, per
    tensor degree, why not when the input's dim 1 (the sequence) does not split over it."""
    from .usercode import accepts_sequence_parallel
    if not accepts_sequence_parallel(builder):
        return {}
    seq = int(x.shape[1]) if torch.is_tensor(x) and x.dim() >= 2 else None
    errors = {str(k): (f"the sequence length {seq} does not split into {k} equal parts" if seq is not None
                       else "the model's input has no sequence dimension (dim 1)")
              for k in (int(k) for k in req.get("tensor_degrees", ()) if int(k) > 1) if seq is None or seq % k}
    return {"sequence_opts_in": True, "sequence_errors": errors}


def main(argv=None) -> int:
    # torch._dynamo only if something uses it (lazydynamo: exact; the FLOP counter's and torch.optim's
    # eager calls need only its stand-in): about a CPU second of every cold compile's probe
    lazydynamo.defer()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].lstrip().startswith("{"):
        try:
            out = _request(json.loads(argv[0]))
        except (PartFailed, UserCodeError) as e:   # the compiler reads the part from the tag
            print(f"probe[{e.part}]: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # noqa: BLE001
            print(f"probe: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        print(json.dumps(out, sort_keys=True))
        return 0
    p = argparse.ArgumentParser(prog="probe", description=__doc__.split("\n\n")[0])
    p.add_argument("model_file")
    p.add_argument("function")
    p.add_argument("json_args", help='keyword arguments of FUNCTION as JSON, e.g. \'{"layers": 4}\'')
    p.add_argument("micro_batch", type=int)
    p.add_argument("--data", default=None, help="FILE:FUNCTION of the batch generator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--graph", default=None, help="stage ranges and transfers as JSON")
    a = p.parse_args(argv)
    try:
        out = probe(a.model_file, a.function, json.loads(a.json_args), a.micro_batch, a.data, a.seed,
                    json.loads(a.graph) if a.graph else None)
    except Exception as e:  # noqa: BLE001 - the compiler shows this message to the user
        print(f"probe: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    json.dump(out, sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
