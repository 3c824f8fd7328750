"""The model probe pass: build the user's model once, in a subprocess (torch lives there, not in the
compiler), run the plan's stage dataflow on one micro-batch and measure what really crosses each stage
boundary and how many parameters each layer (and each tensor-parallel shard of it) holds, so transfers
and reductions are sized from the model rather than from what the plan declares."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from planc import ir
from planc.model import hfmodel
from planc.diagnostics import Diagnostic, PlanError
from planc.model.tensor_traffic import TensorTraffic, sequence_ops as _sequence_ops, stage_traffic, tensor_traffic_by_stage  # noqa: F401
from planc.model.usercheck import exercise_request, probe_failure

PRECISION_BYTES = {ir.Precision.FP32: 4, ir.Precision.FP16: 2, ir.Precision.BF16: 2}
PROBE_TIMEOUT_S = 300
TENSOR_AXIS = ir.MeshAxis.TENSOR


@dataclass(frozen=True, slots=True)
class MeasuredTransfer:
    """What a transfer's source layer really produced for one whole micro-batch (``error`` says why not)."""

    name: str
    dtype: str | None
    shape: tuple[int, ...] | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ModelProbe:
    """What the model really is, for one whole micro-batch of ``micro_batch`` rows.

    ``layer_params`` counts the unsplit model; ``sharded_layer_params`` holds, per tensor degree
    ``k`` > 1 used by the plan, what one device of a tensor group of ``k`` holds per layer (only
    when the builder opts in, ``tensor_parallel``). ``stage_tensor`` maps each stage to the size of
    its mesh axis ``tensor`` (1 without one).

    ``layer_output_bytes``: per layer, the bytes of every tensor it returns for the whole micro-batch
    (None: it did not run). ``layer_flops``: per layer, ``(forward, backward)`` FLOPs for the whole
    micro-batch of the unsplit model, counted with ``torch.utils.flop_counter.FlopCounterMode`` (empty:
    not counted; None: that layer's count failed, ``flop_errors`` says why). ``chain``: the layers were
    run as a chain (each gets the previous layer's output), as for a plan whose stages are not cut yet.
    ``tensor_traffic``: per stage whose ``tensor`` axis has size > 1, what one device of it all-reduces
    per micro-batch (only when the builder opts in; :class:`TensorTraffic`). ``layer_traffic``: in a
    chain probe, the same per layer alone (``stage`` is the layer's index), under each (degree, rows)
    some stage has; :func:`probe_for_cut` sums them per stage once the stages are cut.
    """

    layer_params: tuple[int, ...]
    layer_shapes: tuple[tuple[int, ...] | None, ...]
    layer_dtypes: tuple[str | None, ...] = ()
    transfers: tuple[MeasuredTransfer, ...] = ()
    micro_batch: int | None = None
    tensor_parallel: bool = False
    sharded_layer_params: tuple[tuple[int, tuple[int, ...]], ...] = ()
    stage_tensor: tuple[tuple[int, int], ...] = ()
    graph_errors: tuple[str, ...] = ()
    layer_output_bytes: tuple[int | None, ...] = ()
    # per layer, ((storage, bytes, is_float), ...) autograd saves for backward in one run of the dataflow on the
    # whole micro-batch (runtime probe's saved_by_layer); empty: not measured
    layer_saved: tuple = ()
    sharded_layer_saved: tuple = ()   # ((tensor degree, per layer as layer_saved), ...): a tensor-split build's
    layer_flops: tuple[tuple[int, int] | None, ...] = ()
    flop_errors: tuple[str, ...] = ()
    chain: bool = False
    tensor_traffic: tuple[TensorTraffic, ...] = ()
    layer_traffic: tuple[TensorTraffic, ...] = ()
    # a Hugging Face model: architecture, config after defaults, attention implementation, weights (hf_probe)
    hf: dict | None = None
    # parameters shared by several layers (planc.runtime.tied): ((holders ((layer, local name), ...), numel), ...)
    tied: tuple[tuple[tuple[tuple[int, str], ...], int], ...] = ()
    # per tensor degree, the ties (their first holder (layer, local name)) whose parameter the model splits
    # over a tensor group of that size: ((degree, ((layer, name), ...)), ...)
    tied_split: tuple[tuple[int, tuple[tuple[int, str], ...]], ...] = ()
    # sequence parallelism: whether the model can run it at all (a Hugging Face model; a builder that takes
    # the keyword ``sequence_parallel``), per tensor degree why it cannot, and what a device saves when it does
    sequence_opts_in: bool = False
    sequence_errors: tuple[tuple[int, str], ...] = ()
    sequence_layer_saved: tuple = ()

    def measured(self, name: str) -> MeasuredTransfer | None:
        return next((m for m in self.transfers if m.name == name), None)

    def sequence_problem(self, tensor: int) -> str | None:
        """Why a stage of this tensor degree cannot run sequence-parallel, else None."""
        if not self.sequence_opts_in:
            return ("the model builder does not take the keyword sequence_parallel (docs/models.md)"
                    if not self.hf else "the model cannot run it")
        return dict(self.sequence_errors).get(int(tensor))

    def params_per_device(self, tensor: int) -> tuple[int, ...]:
        """Per layer, the parameters one device holds when its stage's ``tensor`` axis has this size."""
        if not self.tensor_parallel or tensor <= 1:
            return self.layer_params
        for k, counts in self.sharded_layer_params:
            if k == tensor:
                return counts
        raise KeyError(f"the model was not probed at tensor degree {tensor}")

    def tensor_degree(self, stage) -> int:
        """The size of a stage's mesh axis ``tensor``: from a placed ``StageLayout`` (shape, axes), an
        explicit ``Stage`` (mesh_shape, mesh_axes), else as recorded when the plan was probed."""
        shape = getattr(stage, "shape", None)
        axes = getattr(stage, "axes", None)
        if shape is None or axes is None:
            shape, axes = getattr(stage, "mesh_shape", None), getattr(stage, "mesh_axes", ())
        if shape is not None:
            return shape[tuple(axes).index(TENSOR_AXIS)] if TENSOR_AXIS in axes else 1
        return dict(self.stage_tensor).get(stage.index, 1)

    def stage_param_bytes(self, stages, precision: ir.Precision) -> dict[int, int]:
        """Per stage, the gradient bytes ONE device of it reduces (its tensor shard of the stage's layers)."""
        out = {}
        for s in stages:
            a, b = s.layers if s.layers is not None else (0, len(self.layer_params))
            out[s.index] = sum(self.params_per_device(self.tensor_degree(s))[a:b]) * PRECISION_BYTES[precision]
        return out


def _stage_tensor(program: ir.Program) -> tuple[tuple[int, int], ...]:
    return tuple((s.index, ir.axis_size(program.stage_mesh(s.index), TENSOR_AXIS)) for s in program.stages)


def _tensor_stages(program: ir.Program, stage_tensor) -> list[dict]:
    """The stages whose tensor traffic the probe measures: tensor degree > 1, with each device's rows."""
    out = []
    for s, k in stage_tensor:
        if k > 1:
            data = ir.axis_size(program.stage_mesh(s), ir.MeshAxis.DATA)
            layers = program.stage(s).layers
            out.append({"stage": s, "layers": list(layers) if layers is not None else None, "degree": k,
                        "rows": max(1, program.train.micro_batch // data)})
    return out


def code_file(program: ir.Program, what: str, ref: ir.CodeRef | None) -> Path | None:
    """The Python file of the plan's ``model``, ``loss`` or ``data`` line (``what``), beside the plan; a
    missing one is an error at that line. None for a line the plan does not have."""
    if ref is None:
        return None
    path = Path(program.source_dir) / ref.path
    if not path.is_file():
        raise PlanError(Diagnostic(f"{what} file '{ref.path}' not found (looked for {path})", ref.span))
    return path


def wants_flops(program: ir.Program) -> bool:
    """Whether compiling ``program`` needs the layers' FLOPs: stages to cut, or a compute model."""
    return program.auto_stages or program.cluster.flops is not None


# the probe runs at most this many rows of the micro-batch (more only where one device of a stage takes as many):
# what it measures is linear in the rows and scaled to the micro-batch (planc.runtime.probe), so its time and
# memory do not grow with a micro-batch that grows with the data axis, and so with the cluster
PROBE_ROWS = 64


def probe_rows(program: ir.Program) -> int:
    """The rows of each micro-batch the probe runs the model on: the micro-batch, or the smallest divisor of
    it of at least ``PROBE_ROWS`` and more than any device's share (``exercise_request``'s rows, the tensor
    traffic's rows: they are cut from these)."""
    mb = program.train.micro_batch
    share = max((mb // ir.axis_size(program.stage_mesh(s.index), ir.MeshAxis.DATA) for s in program.stages), default=mb)
    return next((d for d in range(max(PROBE_ROWS, share + 1), mb) if mb % d == 0), mb)


# per-layer tensor traffic in a chain probe: layers 0..LAYER_TRAFFIC-1 are asked for (the layer count is
# not known before the model is built); a model with more layers is probed again once cut
LAYER_TRAFFIC = 512


def probe_request(program: ir.Program, flops: bool | None = None) -> dict:
    """The runtime probe's JSON request for ``program`` (``planc.runtime.probe._request``)."""
    model = program.model
    hf = hfmodel.is_hf(program)   # a Hugging Face model: no model file (planc.model.hfmodel, runtime.hf_probe)
    path = None if hf else code_file(program, "model", model)
    for what, ref in (("data", program.data), ("loss", program.loss)):
        code_file(program, what, ref)
    stage_tensor = _stage_tensor(program)
    stages = sorted(program.stages, key=lambda s: s.index)
    chain = program.auto_stages
    if chain:   # every layer alone, under each (degree, rows) a stage may have: summed per stage once cut
        kinds = sorted({(t["degree"], t["rows"]) for t in _tensor_stages(program, stage_tensor)})
        tensor_stages = [{"stage": i, "layers": [i, i + 1], "degree": k, "rows": rows}
                         for k, rows in kinds for i in range(LAYER_TRAFFIC)]
    else:
        tensor_stages = _tensor_stages(program, stage_tensor)
    req = {
        "model_file": str(path) if path else None, "function": model.function, "args": dict(model.args),
        "data_file": str(Path(program.source_dir) / program.data.path) if program.data else None,
        "data_function": program.data.function if program.data else None,
        "loss_file": str(Path(program.source_dir) / program.loss.path) if program.loss else None,
        "loss_function": program.loss.function if program.loss else None,
        "micro_batch": program.train.micro_batch, "seed": program.train.seed,
        "stages": ([None] if chain else
                   [list(s.layers) if s.layers is not None else None for s in stages] or [None]),
        "transfers": [] if chain else [
            {"name": t.name, "src_stage": t.src_stage, "src_layer": t.src_layer, "dst_stage": t.dst_stage}
            for t in program.transfers],
        "tensor_degrees": sorted({k for _, k in stage_tensor if k > 1}),
        "tensor_stages": tensor_stages,
        "flops": wants_flops(program) if flops is None else bool(flops),
        "exercise": exercise_request(program, chain),   # the user's code run as the runtime will
    }
    if program.data is not None and program.data.args:   # the data line's own arguments
        req["data_args"] = dict(program.data.args)
    if hf:   # on the meta device: no memory to save
        req["hf"] = hfmodel.request_fields(program)
    elif probe_rows(program) < program.train.micro_batch:
        req["rows"] = probe_rows(program)
    return req


def probe_model(program: ir.Program, flops: bool | None = None, cache=None) -> ModelProbe:
    """Build the model in a subprocess (torch lives there, not in the compiler), run the plan's stage
    dataflow on one micro-batch and measure it. ``flops`` (default :func:`wants_flops`) also counts
    each layer's forward and backward FLOPs. A plan whose stages are not cut yet
    (``program.auto_stages``) runs its layers as a chain instead and measures no transfer, but each
    layer's tensor traffic alone: :func:`probe_for_cut` gives the cut program's probe from it (or
    None: probe the cut program). ``cache``: a :class:`planc.model.probe_cache.ProbeCache` that answers a
    request it has seen (same files, function, arguments, micro-batch, torch) without the subprocess."""
    return start_probe(program, flops, cache).result()


def start_probe(program: ir.Program, flops: bool | None = None, cache=None) -> "PendingProbe":
    """:func:`probe_model` begun: the subprocess started (unless the cache answers), its answer read by
    a thread; the caller works meanwhile and takes the answer with ``result()`` (``done()``: it is in)."""
    return PendingProbe(program, probe_request(program, flops), cache)


class PendingProbe:
    """A model probe under way: :func:`_run_probe` (the subprocess, its answer read and checked) on a
    thread, unless the cache answered; ``result()`` waits for it and raises what it raised."""

    def __init__(self, program: ir.Program, req: dict, cache):
        self.program, self.req, self.cache = program, req, cache
        self.doc = cache.get(req) if cache is not None else None
        self.error = None
        self.thread = None
        if self.doc is None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            self.doc = _run_probe(self.program, self.req)
        except BaseException as e:   # handed to result(), on the caller's thread
            self.error = e

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def result(self) -> ModelProbe:
        program, model = self.program, self.program.model
        stage_tensor = _stage_tensor(program)
        if self.thread is not None:
            self.thread.join()
            self.thread = None
            if self.error is not None:
                raise self.error
            if self.cache is not None:
                self.cache.put(self.req, self.doc)
        doc = self.doc
        if FAILED in doc:
            raise PlanError(_failure(program, doc[FAILED]))
        if doc.get("hf"):   # heads that do not split: at the stage, before the tensor-parallel module's own reasons
            hfmodel.check_tensor_degrees(program, doc["hf"]["config"])
        if doc.get("shard_errors"):
            errs = []
            for k, why in sorted(doc["shard_errors"].items(), key=lambda kv: int(kv[0])):
                users = ", ".join(str(i) for i, d in stage_tensor if d == int(k))
                errs.append(Diagnostic(f"the model cannot be split over a tensor group of {k} (the 'tensor' axis "
                                       f"of stage {users}): {model.path}:{model.function} says {why}", model.span))
            raise PlanError(errs)
        return probe_from_json(doc, program.train.micro_batch, stage_tensor, chain=program.auto_stages)


# An answer that is the probe's own report of a part of the user's model, data or loss failing (its exit 2
# with a ``probe[PART]:`` line): as much a function of the request as an answer (the cache's key holds the
# files' bytes), so it is kept and replayed like one (``planc check`` then ``planc compile`` probe once).
# A probe that timed out, crashed or failed otherwise is never kept.
FAILED = "probe_failed"


def _failure(program: ir.Program, stderr: str):
    """The located errors of a failed probe's stderr."""
    return (hfmodel.is_hf(program) and hfmodel.failure(program, stderr)) or probe_failure(program, stderr)


def _run_probe(program: ir.Program, req: dict) -> dict:
    """The runtime probe's JSON answer to ``req``, in a subprocess, or ``{FAILED: stderr}`` where it reports
    the user's code failing; its other failures as located errors."""
    model = program.model
    env = dict(os.environ, PYTHONHASHSEED="0", CUDA_VISIBLE_DEVICES="")
    try:
        # run from the folder this planc is installed in: `-m` puts the working directory first on the
        # path, and a compiled output folder (or any folder with a planc/ of its own) would shadow it
        proc = subprocess.run([sys.executable, "-m", "planc.runtime.probe", json.dumps(req)], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, env=env, cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        raise PlanError(Diagnostic(f"building the model took longer than {PROBE_TIMEOUT_S} s "
                                   "(use --no-probe to skip sizing it)", model.span)) from None
    if proc.returncode != 0:   # located at the plan line of the part that failed (planc.model.usercheck, planc.model.hfmodel)
        if proc.returncode == 2 and any(line.startswith("probe[") for line in proc.stderr.splitlines()):
            return {FAILED: proc.stderr}   # the user's code failed, as the probe reports it: kept like an answer
        raise PlanError(_failure(program, proc.stderr))
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise PlanError(Diagnostic("the model probe printed no result", model.span)) from None


def probe_for_cut(chain: ModelProbe, program: ir.Program) -> ModelProbe | None:
    """The probe of the cut ``program`` from the chain probe of the uncut one, without running the model
    again: what the runtime probe would measure on the cut's dataflow when that dataflow is the chain
    (every transfer from a stage's last layer to the next stage, one into each stage but the first,
    each such layer returning one tensor): the transfers are those layers' outputs, a stage's tensor
    traffic its layers' in order (``measure_tensor_traffic`` runs layer by layer). None when it is not
    a chain or a layer's traffic is missing: probe the cut program."""
    if not chain.chain or chain.graph_errors or program.auto_stages:
        return None
    stages = sorted(program.stages, key=lambda s: s.index)
    if [s.index for s in stages] != list(range(len(stages))) or any(s.layers is None for s in stages):
        return None
    pairs = sorted((t.src_stage, t.dst_stage) for t in program.transfers)
    if pairs != [(i, i + 1) for i in range(len(stages) - 1)]:
        return None
    measured = []
    for t in program.transfers:
        last = stages[t.src_stage].layers[1] - 1
        if t.src_layer not in (None, last) or last >= len(chain.layer_shapes):
            return None
        shape, dtype = chain.layer_shapes[last], chain.layer_dtypes[last]
        nbytes = chain.layer_output_bytes[last] if last < len(chain.layer_output_bytes) else None
        if shape is None or dtype not in ir.DTYPE_BYTES or nbytes != math.prod(shape) * ir.DTYPE_BYTES[dtype]:
            return None   # not one tensor of a dtype planc sends: the real probe says why
        measured.append(MeasuredTransfer(t.name, dtype, shape))
    per_layer = {(tr.stage, tr.degree, tr.rows): tr for tr in chain.layer_traffic}
    stage_tensor = _stage_tensor(program)
    traffic = []
    for st in _tensor_stages(program, stage_tensor):
        a, b = st["layers"] if st["layers"] is not None else (0, len(chain.layer_params))
        parts = [per_layer.get((i, st["degree"], st["rows"])) for i in range(a, b)]
        if None in parts:
            return None
        errors = "; ".join(p.error for p in parts if p.error) or None
        sequence = None if any(p.sequence is None for p in parts) else (
            sum((p.sequence[0] for p in parts), ()), sum((p.sequence[1] for p in parts), ()))
        traffic.append(TensorTraffic(st["stage"], st["degree"], st["rows"], sum((p.forward for p in parts), ()),
                                     sum((p.backward for p in parts), ()), errors, sequence))
    flops = wants_flops(program)
    return dataclasses.replace(chain, transfers=tuple(measured), stage_tensor=stage_tensor, chain=False,
                               tensor_traffic=tuple(sorted(traffic, key=lambda t: t.stage)), layer_traffic=(),
                               layer_flops=chain.layer_flops if flops else (),
                               flop_errors=chain.flop_errors if flops else ())


def _saved(doc) -> tuple:
    return tuple(tuple((int(sid), int(n), bool(f)) for sid, n, f in lay) for lay in doc or ())


def _shape(v) -> tuple[int, ...] | None:
    return tuple(int(d) for d in v) if v is not None else None


def probe_from_json(doc: dict, micro_batch: int, stage_tensor=(), chain: bool = False) -> ModelProbe:
    """The ModelProbe of the runtime probe's JSON answer (``planc.runtime.probe._request``)."""
    outs = doc.get("layer_outputs") or [None] * len(doc["layer_params"])
    flops = doc.get("layer_flops")
    traffic = tuple(TensorTraffic(int(t["stage"]), int(t["degree"]), int(t["rows"]),
                                  tuple(int(b) for b in t.get("forward", ())), tuple(int(b) for b in t.get("backward", ())),
                                  "; ".join(t.get("errors") or ()) or None, _sequence_ops(t.get("sequence")))
                    for t in doc.get("tensor_traffic") or ())
    return ModelProbe(
        layer_params=tuple(int(x) for x in doc["layer_params"]),
        layer_shapes=tuple(_shape(o["shape"]) if o else None for o in outs),
        layer_dtypes=tuple(o["dtype"] if o else None for o in outs),
        transfers=tuple(MeasuredTransfer(m["name"], m.get("dtype"), _shape(m.get("shape")), m.get("error"))
                        for m in doc.get("transfers", ())),
        micro_batch=micro_batch,
        tensor_parallel=bool(doc.get("tensor_parallel")),
        sharded_layer_params=tuple(sorted((int(k), tuple(int(x) for x in v))
                                          for k, v in (doc.get("sharded_layer_params") or {}).items())),
        stage_tensor=tuple(stage_tensor),
        graph_errors=tuple(doc.get("graph_errors") or ()),
        layer_output_bytes=tuple(int(b) if b is not None else None for b in doc.get("layer_output_bytes") or ()),
        layer_saved=_saved(doc.get("layer_saved")),
        sharded_layer_saved=tuple(sorted((int(k), _saved(v)) for k, v in (doc.get("sharded_layer_saved") or {}).items())),
        layer_flops=tuple((int(f[0]), int(f[1])) if f is not None else None for f in flops) if flops else (),
        flop_errors=tuple(doc.get("flop_errors") or ()),
        chain=chain,
        tensor_traffic=() if chain else traffic,
        layer_traffic=tuple(t for t in traffic if t.stage < len(doc["layer_params"])) if chain else (),
        hf=doc.get("hf"),
        tied=tuple((tuple((int(i), str(n)) for i, n in t["holders"]), int(t["numel"])) for t in doc.get("tied") or ()),
        tied_split=tuple(sorted((int(k), tuple((int(i), str(n)) for i, n in v))
                                for k, v in (doc.get("tied_split") or {}).items())),
        sequence_opts_in=bool(doc.get("hf")) or bool(doc.get("sequence_opts_in")),
        sequence_errors=tuple(sorted((int(k), str(v)) for k, v in (doc.get("sequence_errors") or {}).items())),
        sequence_layer_saved=tuple(sorted((int(k), _saved(v))
                                          for k, v in (doc.get("sequence_layer_saved") or {}).items())),
    )


def _type_text(dtype: str | None, shape) -> str:
    return f"{dtype}[{', '.join(map(str, shape))}]"


FLOATING_DTYPES = ("f64", "f32", "f16", "bf16")
PRECISION_DTYPES = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}


def activation_dtype(dtype: str | None, precision) -> str | None:
    """What a stage of a ``precision`` plan sends for a tensor the model as built (the probe runs it so,
    in fp32) gives as ``dtype``: in a bf16 or fp16 plan a floating tensor is in the plan's precision
    (LANGUAGE.md, "Training settings"); fp32 plans send what the model computes."""
    if str(precision) == "fp32" or dtype not in FLOATING_DTYPES:
        return dtype
    return PRECISION_DTYPES[str(precision)]


def check_against_model(program: ir.Program, probe: ModelProbe) -> None:
    """Stage ranges cover the model's layers; every transfer's declared type is what its layer produces."""
    if program.auto_stages:   # the driver cuts them first: planc.pipeline.cut.apply_auto_stages
        first = next(s for s in program.stages if s.auto_layers and s.layers is None)
        raise PlanError(Diagnostic("internal: the stages' layers are 'auto' and were not cut before inference "
                                   "(planc.pipeline.cut.apply_auto_stages)", first.span))
    errs: list[Diagnostic] = []
    n = len(probe.layer_params)
    staged = [s for s in program.stages if s.layers is not None]
    if staged:
        end = max(s.layers[1] for s in staged)
        if end != n:
            last = max(staged, key=lambda s: s.layers[1])
            errs.append(Diagnostic(f"the stages cover layers 0..{end} but the model has {n} layers (0..{n})", last.span))
    for t in program.transfers:
        if t.shape is None:
            continue
        src = program.stage(t.src_stage)
        last = src.layers[1] - 1 if src.layers is not None else n - 1
        layer = t.src_layer if t.src_layer is not None else last
        got = probe.measured(t.name)
        if got is None or got.shape is None or layer >= n:
            continue
        precision = program.train.precision
        dtype = activation_dtype(got.dtype, precision)
        if tuple(got.shape) != tuple(t.shape) or (dtype is not None and dtype != activation_dtype(t.dtype, precision)):
            span = t.type_span if t.type_span.line else t.span
            errs.append(Diagnostic(f"transfer '{t.name}' declares {_type_text(t.dtype, t.shape)} but stage "
                                   f"{t.src_stage} layer {layer} produces {_type_text(dtype, got.shape)} for a "
                                   f"micro-batch of {program.train.micro_batch}", span))
    if errs:
        raise PlanError(errs)


def check_model_reductions(program: ir.Program, probe: ModelProbe) -> None:
    """Gradients of a tensor-parallel model are shards: summing them over ``tensor`` mixes unrelated
    parameters. Reject ``reduce gradients over ..., tensor`` when the model opts in and a stage splits."""
    if not probe.tensor_parallel:
        return
    split = [s.index for s in program.stages if probe.tensor_degree(s) > 1]
    if not split:
        return
    errs = []
    for r in program.reductions:
        if r.name != "gradients" or TENSOR_AXIS not in r.axes:
            continue
        rest = [a for a in r.axes if a != TENSOR_AXIS]
        fix = f"reduce gradients over {', '.join(rest)} only" if rest else "drop 'tensor' from this reduction"
        where = "stage " + ", ".join(map(str, split))
        errs.append(Diagnostic(
            f"gradients of tensor-parallel shards must not be reduced over '{TENSOR_AXIS}': the model "
            f"({program.model.path}:{program.model.function}) splits its layers over the '{TENSOR_AXIS}' axis of "
            f"{where}, so each device along it holds a different shard; {fix}", r.span))
    if errs:
        raise PlanError(errs)
