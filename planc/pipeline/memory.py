"""The memory model: one device's bytes per stage, by part, in the plan's dtypes (docs/memory.md).

:func:`stage_memory` gives, per stage, a :class:`StageMemory`: what one device of the stage (its
largest) holds of parameters, gradients and optimizer state, and the activation bytes one micro-batch
slice leaves on it. :meth:`StageMemory.parts` adds the activations of ``k`` micro-batches in flight
(the schedule's bound, :func:`planc.pipeline.schedules.peak_in_flight`) and gives the five figures
plan.json writes as ``pipeline.stages[i].memory``; ``planc.pipeline.choose`` weighs their total against
``cluster.memory`` and ``planc.pipeline.cut`` cuts the layers so that every stage fits.

Per device of a stage holding ``P`` parameters (its tensor-parallel shard of the stage's layers),
data degree ``d``, ``p`` bytes per element of the precision (fp32 4, bf16/fp16 2):

* parameters ``P x p``; with ``zero = 3`` (and ``d`` > 1) ``(T + G) x p``: the tied parameters (whole)
  and the gathered buffers (the shard's values are the fp32 masters, under optimizer; no shard in the
  parameters' dtype is kept), ``G = min(g x min(Lmax, P - T), P - T)`` with ``Lmax`` the largest layer's parameters
  and ``g`` = 2 with ``zero_prefetch`` (the current layer's and the next one's, gathered while the
  current one computes), else 1; with ``recompute`` twice that (the layer whose backward started the
  recompute stays gathered, with its prefetched predecessor, while the recompute gathers layer by
  layer); with ``zero_keep_gathered`` ``P x p`` (the stage's whole parameters, gathered once a step and
  held through it, as ZeRO-2's); ZeRO-3's gradient staging is ``3 x Lmax`` (its buckets never straddle
  two layers, so ``ZERO2_WINDOW`` + 1 of at most a layer);
* gradients ``P x 4``: the runtime accumulates over the micro-batches and reduces in fp32; with
  ``zero = 2`` (and ``d`` > 1) ``(P' + S) x 4``: the owned shard accumulated, plus ``S`` = 4 x min(P - T,
  max(the bucket's elements, the largest layer's parameters)) of one micro-batch's gradient staged
  whole until its reduce-scatter (``zero = 3`` keeps ZeRO-2's gradients) (``runtime/grads_zero2.py``: the bucket being filled, two where a layer
  straddles a bucket boundary, and 2 in flight; a
  parameter larger than the bucket is a bucket of its own, and the largest layer bounds it);
* optimizer ``(4 s + m) x P'``: ``s`` fp32 states per parameter (sgd with momentum 1, without 0; adam and
  adamw 2), ``m`` = 4 for the fp32 master copy of bf16/fp16 plans and of ``zero`` >= 1 plans (0 in fp32
  without ZeRO: the parameters are their own masters); ``P' = ceil((P - T) / d) + T`` with ``zero`` >= 1
  (ZeRO-1, 2 and 3 shard master weights and optimizer state over the data group; ``T``: the elements tied to
  another stage's layers, which stay whole), else ``P``; a stage's own ``zero N`` overrides the train block's;
* activations of ``k`` micro-batches in flight: ``k x (I + O)``, or with the stage's ``recompute``
  ``k x I + O``, where ``I`` are the bytes of the stage's received inputs and ``O`` what its layers keep
  for backward — the distinct tensors autograd saved when the probe ran each layer on the whole
  micro-batch (``layer_saved_bytes``, parameters left out; where not measured, every tensor the layers
  return) —, for one micro-batch slice (``micro_batch / d`` rows) in the precision's dtype (float
  tensors at ``p`` bytes an element, others at their own): a recomputing stage keeps only its inputs
  per micro-batch in flight, plus the full activations of the one micro-batch it recomputes. ``O``
  includes the first layer's input where that layer saves it, so ``I + O`` may count the inputs twice;
* logits, at the last stage: one micro-batch slice of the model's last output (its vocabulary slice
  where the head is split), as the loss holds it: in the precision, its fp32 upcast (bf16/fp16), the
  loss's saved fp32 probabilities and their gradient (``p + 4 + 8`` bytes an element, ``12`` in fp32);
* step, the optimizer step's temporary: ``4 P'`` for adam/adamw and sgd with weight decay (torch's
  multi-tensor implementations allocate one fp32 tensor per master), held after the last backward when
  no activation is; the total is ``parameters + gradients + optimizer + max(activations + logits, step)``;
* build, the transient peak of building the share when the rank starts (before the first step, so not
  in the total): ``4 P + 4 W`` (+ ``p P`` when ``p`` is not 4), the share drawn in fp32 by the
  plan-independent rule (docs/models.md), ``W`` the widest layer the stage splits over ``tensor``
  drawn whole before it is sharded, and in bf16/fp16 the cast copy beside the fp32 values that become
  the masters.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from planc import ir

__all__ = ["PRECISION_BYTES", "GRADIENT_BYTES", "FLOAT_DTYPES", "PARTS", "StageMemory", "degree", "stage_memory",
           "recomputes", "optimizer_states", "activation_itemsize", "layer_bytes", "kept_bytes", "saved",
           "zero3_settings"]

PRECISION_BYTES = {ir.Precision.FP32: 4, ir.Precision.FP16: 2, ir.Precision.BF16: 2}
GRADIENT_BYTES = 4   # fp32 accumulation buffers, whatever the precision
STATE_BYTES = 4      # optimizer states and the master copy are fp32
ZERO2_WINDOW = 2     # ZeRO-2's released buckets in flight at once (runtime/grads_zero2.py WINDOW)
FLOAT_DTYPES = frozenset({"f64", "f32", "f16", "bf16"})
PARTS = ("parameters", "gradients", "optimizer", "activations", "logits", "step", "total", "build")


def degree(program: ir.Program, st, axis: str) -> int:
    """The size of mesh axis ``axis`` of a placed ``ir.StageLayout`` or of a program's ``ir.Stage``."""
    if hasattr(st, "axis_size"):          # a placed ir.StageLayout
        return st.axis_size(axis)
    return ir.axis_size(program.stage_mesh(st.index), axis)


def optimizer_states(opt: ir.Optimizer) -> int:
    """fp32 states per parameter: adam and adamw 2 (the moments), sgd 1 with momentum > 0, else 0."""
    if opt.name in ("adam", "adamw"):
        return 2
    return 1 if float(dict(opt.params).get("momentum", 0.0) or 0.0) > 0 else 0


def recomputes(program: ir.Program, index: int) -> bool:
    """Whether stage ``index`` recomputes: its own ``recompute`` if written, else the train block's
    (as ``planc.driver.assemble.train_record`` writes plan.json's ``train.recompute``)."""
    try:
        own = program.stage(index).recompute
    except KeyError:
        own = None
    return own if own is not None else program.train.recompute is ir.Recompute.FULL


def zero_of(program: ir.Program, index: int) -> int:
    """Stage ``index``'s ZeRO degree: its own ``zero N`` if written, else the train block's (as
    plan.json's ``stages[i].zero`` overrides ``train.zero``)."""
    try:
        own = program.stage(index).zero
    except KeyError:
        own = None
    return own if own is not None else program.train.zero


def zero3_settings(program: ir.Program) -> tuple[bool, bool]:
    """``(prefetch, keep_gathered)``: how zero = 3 stages gather (plan.json ``train.zero3``)."""
    t = program.train
    return (t.zero_prefetch, t.zero_keep_gathered) if t is not None else (True, False)


def whole_tied(probe, a: int, b: int) -> int:
    """Elements of the parameters layers [a, b) hold that are tied to a layer outside them: ZeRO never
    shards them (their gradients reduce by their own programs, their masters stay whole)."""
    total = 0
    for holders, numel in getattr(probe, "tied", ()) or ():
        layers = {i for i, _ in holders}
        if any(a <= i < b for i in layers) and any(not a <= i < b for i in layers):
            total += numel
    return total


def grad_bucket(program: ir.Program) -> int:
    """Elements of one fp32 gradient bucket (plan.json ``runtime.grad_bucket_bytes``)."""
    return program.train.runtime.grad_bucket_bytes // GRADIENT_BYTES


def activation_itemsize(dtype: str | None, precision: ir.Precision) -> int | None:
    """Bytes of one element of an activation of ``dtype`` in a plan of ``precision``: float tensors are
    held in the precision's dtype, others in their own (None: unknown dtype)."""
    if dtype in FLOAT_DTYPES:
        return PRECISION_BYTES[precision]
    return ir.DTYPE_BYTES.get(dtype)


def layer_bytes(probe, i: int, precision: ir.Precision) -> int:
    """Bytes of what layer ``i`` returns for the whole micro-batch, in the plan's dtypes (the probe
    runs the model in fp32; every tensor a layer returns is taken in its first tensor's dtype)."""
    dtype = probe.layer_dtypes[i] if i < len(probe.layer_dtypes) else None
    size = activation_itemsize(dtype, precision)
    measured = probe.layer_output_bytes[i] if i < len(probe.layer_output_bytes) else None
    if measured is not None:
        own = ir.DTYPE_BYTES.get(dtype)
        return measured * size // own if size and own else measured
    shape = probe.layer_shapes[i] if i < len(probe.layer_shapes) else None
    if shape is None or size is None:
        return 0
    return math.prod(shape) * size


def kept_bytes(probe, a: int, b: int, precision: ir.Precision, tensor: int = 1, sequence: bool = False) -> int:
    """Bytes layers ``a..b`` keep for their backward per whole micro-batch: the distinct storages autograd
    saved when the probe ran the dataflow with gradients (``layer_saved``, or ``sharded_layer_saved`` of
    the stage's tensor degree where the probe ran a tensor-split build: a device keeps its heads' and its
    MLP columns' activations only; ``sequence_layer_saved`` where the stage is also sequence-parallel: its
    norms and residuals for its part of the sequence only; float tensors at the precision's size, others at
    their own; parameters left out), or, where that was not measured, every tensor the layers return
    (:func:`layer_bytes`)."""
    saved = ((sequence and dict(getattr(probe, "sequence_layer_saved", ())).get(tensor))
             or dict(getattr(probe, "sharded_layer_saved", ())).get(tensor) or getattr(probe, "layer_saved", ()))
    if len(saved) < b:
        return sum(layer_bytes(probe, i, precision) for i in range(a, min(b, len(probe.layer_params))))
    seen = {sid: (n, f) for i in range(a, b) for sid, n, f in saved[i]}
    return sum(n * PRECISION_BYTES[precision] // 4 if f else n for n, f in seen.values())


def _splits_sequence(t: ir.Transfer) -> bool:
    """Whether the transfer's destination layout splits dim 1 (a sequence-parallel stage's input)."""
    return t.dst_spec is not None and len(t.dst_spec.dims) > 1 and bool(t.dst_spec.dims[1])


def _transfer_bytes(t: ir.Transfer, probe, precision: ir.Precision) -> int:
    shape, dtype = t.shape, t.dtype
    if shape is None or dtype is None:
        m = probe.measured(t.name)
        if m is None or m.shape is None:
            return 0
        shape, dtype = m.shape, m.dtype
    size = activation_itemsize(dtype, precision)
    return math.prod(shape) * size if size else 0


@dataclass(frozen=True, slots=True)
class StageMemory:
    """What one device of a stage holds: ``params`` parameters (its tensor shard of the stage's layers),
    and for one whole micro-batch of ``micro_batch`` rows the bytes of the layers' outputs and of the
    stage's received inputs, in the plan's dtypes; ``data`` the stage's data degree (its rows split
    over it). The settings that size the parts are kept so a what-if (:meth:`with_`) is one replace."""

    stage: int
    params: int
    data: int
    micro_batch: int
    outputs: int            # the whole micro-batch's layer outputs, bytes
    inputs: int             # the whole micro-batch's received inputs, bytes
    precision: ir.Precision
    states: int
    zero: int = 0
    recompute: bool = False
    widest: int = 0         # parameters of the widest layer drawn whole before it is sharded over tensor
    last_out: int = 0       # elements of the model's last output (the logits) for one whole micro-batch, on a
                            # device of the last stage (its vocabulary slice); 0 on the other stages
    step_states: bool = False   # the optimizer's step allocates a temporary as large as its fp32 tensors
    tied: int = 0           # of ``params``, elements tied to another stage's layers: never sharded by ZeRO
    bucket: int = 0         # elements of one gradient bucket (plan.json runtime.grad_bucket_bytes / 4)
    largest: int = 0        # the stage's largest layer's parameters on a device: a bound on its largest
                            # parameter, which gets a bucket of its own when it is larger than ``bucket``
    prefetch: bool = True   # zero = 3: the next layer gathered while this one computes (two layers held)
    keep_gathered: bool = False   # zero = 3: gathered once a step, the whole stage held through it

    def with_(self, **changes) -> "StageMemory":
        """The same stage under other settings (``zero``, ``recompute``, ``micro_batch``: the activation
        bytes scale with the rows, as the probe's shapes do)."""
        m = changes.get("micro_batch", self.micro_batch)
        if m != self.micro_batch:
            changes.update(outputs=self.outputs * m // self.micro_batch, inputs=self.inputs * m // self.micro_batch,
                           last_out=self.last_out * m // self.micro_batch)
        return dataclasses.replace(self, **changes)

    def _slice(self, whole: int) -> int:
        """One device's share of a whole micro-batch's bytes: its rows, ``ceil(micro_batch / data)``."""
        rows = -(-self.micro_batch // max(self.data, 1))
        return -(-whole * rows // max(self.micro_batch, 1))

    @property
    def slice_outputs(self) -> int:
        return self._slice(self.outputs)

    @property
    def slice_inputs(self) -> int:
        return self._slice(self.inputs)

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-3 with data-parallel peers: the parameters are sharded and gathered per layer."""
        return self.zero >= 3 and self.data > 1

    @property
    def gathered(self) -> int:
        """ZeRO-3's gathered parameters (elements; the shard's values are the fp32 masters, counted in
        ``optimizer``: no shard in the parameters' dtype is kept): with ``keep_gathered`` the stage's whole
        shardable parameters; else the largest layer's, twice with ``prefetch`` (the current and the
        next layer), twice that again with ``recompute`` (runtime/zero3.py), never more than the stage's shardable parameters ``P - T``; 0 without ZeRO-3."""
        if not self.shards_parameters:
            return 0
        whole = self.params - self.tied
        if self.keep_gathered:
            return whole
        held = (4 if self.prefetch else 2) if self.recompute else (2 if self.prefetch else 1)
        return min(held * min(self.largest or whole, whole), whole)

    @property
    def parameters(self) -> int:
        held = self.tied + self.gathered if self.shards_parameters else self.params
        return held * PRECISION_BYTES[self.precision]

    @property
    def sharded(self) -> int:
        """The elements of a device's ZeRO shard: ``ceil((P - T) / d) + T`` (tied ones ``T`` whole)."""
        return -(-(self.params - self.tied) // self.data) + self.tied

    @property
    def staging(self) -> int:
        """ZeRO-2's whole gradient buckets of one micro-batch, held until their reduce-scatter (elements):
        two being filled (a layer straddling a bucket boundary) and ``ZERO2_WINDOW`` waiting
        (runtime/grads_zero2.py); a bucket is at most the stage's gradient, whose copies of two micro-batches
        can be alive at once (one still reducing while the next fills)."""
        whole = self.params - self.tied
        if self.shards_parameters:   # ZeRO-3's buckets never straddle two layers: at most a layer's parameters
            return (ZERO2_WINDOW + 1) * min(self.largest or whole, whole)   # (one larger than the limit included)
        bucket = min(max(self.bucket, self.largest), whole) if self.bucket else whole
        return (ZERO2_WINDOW + 2) * bucket

    @property
    def gradients(self) -> int:
        if self.zero >= 2 and self.data > 1:   # ZeRO-2: the owned shard accumulated, a few buckets staged
            return (self.sharded + self.staging) * GRADIENT_BYTES
        return self.params * GRADIENT_BYTES

    @property
    def optimizer(self) -> int:
        # a separate fp32 master: bf16/fp16, and ZeRO-1 in fp32 too (the parameters are all-gathered
        # replicas; the shard the optimizer updates is its own copy)
        master = STATE_BYTES if self.precision is not ir.Precision.FP32 or self.zero else 0
        held = self.sharded if self.zero else self.params
        return (self.states * STATE_BYTES + master) * held

    @property
    def static(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def logits(self) -> int:
        """One micro-batch slice's logits at the last stage as the loss holds them: the output in the
        precision, its fp32 upcast (bf16/fp16), the loss's saved fp32 probabilities and their gradient."""
        p = PRECISION_BYTES[self.precision]
        return self._slice(self.last_out) * (p + (STATE_BYTES if p != STATE_BYTES else 0) + 2 * STATE_BYTES)

    @property
    def step(self) -> int:
        """The optimizer step's temporary (torch's multi-tensor Adam: the denominators, one fp32 tensor per
        master), held after the last backward, when the activations are gone."""
        return STATE_BYTES * (self.sharded if self.zero else self.params) if self.step_states else 0

    @property
    def build(self) -> int:
        p = PRECISION_BYTES[self.precision]
        return STATE_BYTES * (self.params + self.widest) + (p * self.params if p != STATE_BYTES else 0)

    def activations(self, in_flight: int) -> int:
        """Activation bytes with ``in_flight`` micro-batches whose forward ran and backward has not."""
        if self.recompute:
            return in_flight * self.slice_inputs + self.slice_outputs
        return in_flight * (self.slice_inputs + self.slice_outputs)

    def total(self, in_flight: int) -> int:
        return self.static + max(self.activations(in_flight) + self.logits, self.step)

    def parts(self, in_flight: int) -> dict:
        """plan.json's ``pipeline.stages[i].memory``: bytes per device by part, and their total."""
        act = self.activations(in_flight)
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": act, "logits": self.logits, "step": self.step, "total": self.total(in_flight),
                "build": self.build}


def saved(m: StageMemory, in_flight: int) -> dict:
    """What the stage's ``zero`` and ``recompute`` save against the same stage without them (bytes per
    device; only those it uses): ``zero`` the optimizer state (and masters), ``zero_gradients`` what
    ZeRO-2 saves of gradients against ZeRO-1, ``zero_parameters`` what ZeRO-3 saves of parameters against
    ZeRO-2 (the shard and the gathered buffers against the whole)."""
    out = {}
    if m.zero:
        out["zero"] = m.with_(zero=0).optimizer - m.optimizer
    if m.zero >= 2 and m.data > 1:
        out["zero_gradients"] = m.with_(zero=1).gradients - m.gradients
    if m.shards_parameters:
        out["zero_parameters"] = m.with_(zero=2).parameters - m.parameters
    if m.recompute:
        out["recompute"] = m.with_(recompute=False).activations(in_flight) - m.activations(in_flight)
    return out


def stage_memory(program: ir.Program, stages, probe) -> tuple[StageMemory, ...]:
    """Per stage (index order) the memory model of its largest device (module docstring): ``stages``
    are the placed ``ir.StageLayout``s or the program's ``ir.Stage``s with their layer ranges cut."""
    train = program.train
    precision = train.precision
    n = len(probe.layer_params)
    out = []
    for st in sorted(stages, key=lambda s: s.index):
        a, b = st.layers if st.layers is not None else (0, n)
        tensor = degree(program, st, ir.MeshAxis.TENSOR)
        try:
            per_device = probe.params_per_device(tensor)[a:b]
        except KeyError:   # not probed at this degree: the unsplit count, an upper bound
            per_device = probe.layer_params[a:b]
        params = sum(per_device)
        widest = max((w for w, d in zip(probe.layer_params[a:b], per_device) if d < w), default=0)
        sequence = any(s.index == st.index and s.sequence_parallel for s in program.stages)
        outputs = kept_bytes(probe, a, min(b, n), precision, tensor, sequence)
        # a received input is the device's part (the data division is StageMemory's; the sequence's here)
        inputs = sum(_transfer_bytes(t, probe, precision) // (tensor if _splits_sequence(t) else 1)
                     for t in program.transfers if t.dst_stage == st.index)
        last = 0
        if b >= n and probe.layer_shapes and probe.layer_shapes[-1]:   # the logits, split like the head's params
            last = math.prod(probe.layer_shapes[-1])
            if per_device and probe.layer_params[-1] and per_device[-1] < probe.layer_params[-1]:
                last = last * per_device[-1] // probe.layer_params[-1]
        adam = train.optimizer.name in ("adam", "adamw") or bool(dict(train.optimizer.params).get("weight_decay", 0))
        out.append(StageMemory(st.index, params, degree(program, st, ir.MeshAxis.DATA), train.micro_batch,
                               outputs, inputs, precision, optimizer_states(train.optimizer),
                               zero_of(program, st.index), recomputes(program, st.index), widest, last, adam,
                               whole_tied(probe, a, b), grad_bucket(program), max(per_device, default=0),
                               *zero3_settings(program)))
    return tuple(out)
