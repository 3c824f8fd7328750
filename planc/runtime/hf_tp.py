"""Tensor parallelism for Hugging Face decoder layers, from the config's ``base_model_tp_plan``.

Imports torch, the standard library and ``tensor_parallel``; transformers only inside the functions
that build a layer on the meta device to read its widths (``check_degree``, ``layer_traffic``).

Public API (called by the runtime's ``model hf`` support):

    layer_tp_plan(config) -> {"self_attn.q_proj": "colwise", ...}
        the config's ``base_model_tp_plan`` entries ``layers.*.X`` as ``X`` (relative to one
        decoder layer); entries outside the decoder layers (e.g. GPT-NeoX's ``embed_in:
        embedding_rowwise``) are left out: the embedding stays replicated.
    check_degree(config, degree) -> str | None
        why ``degree`` cannot shard this config's decoder layers (a style this module does not
        execute, heads or widths that do not split into ``degree`` equal parts), else None.
    parallelize_layer(module, plan, tp) -> None
        shards one decoder layer in place for the rank's ``TensorParallel``: parameters stay plain
        ``nn.Parameter``s holding the local shard, marked like ``TensorParallel.shard`` does. With
        ``tp.sequence_parallel`` the layer takes and returns its hidden states split along the sequence
        (below).
    sequence_problem(layer, plan) -> str | None / check_sequence(config, degree) -> str | None
        why the layer (the config's layers) cannot run sequence-parallel, else None.
    layer_traffic(config, rows, seq, dtype_bytes) -> {"forward": [...], "backward": [...], "errors": []}
        the bytes of each all-reduce one device of the tensor group issues per decoder layer for one
        micro-batch of ``rows`` x ``seq`` tokens (the record ``probe.measure_tensor_traffic`` gives).

Styles (transformers' names; ``f``/``g`` are Megatron's operators of ``tensor_parallel``):

    colwise                  weight and bias split on the output dim; input through f (one f per
                             input tensor of a layer forward: q, k and v of one input share it)
    colwise_gather_output    (= colwise_rep) the same, then the output gathered along its last dim
                             (an all-reduce of the zero-padded full width; backward: the own slice)
    rowwise                  weight split on the input dim (the input is the local slice); output
                             through g; the bias, replicated, added once after the sum
    rowwise_split_input      (= rowwise_rep) the same, the replicated input first cut to the own
                             slice (backward: the gradient gathered back to the full width)
    replicated_with_grad_allreduce
                             parameters replicated, each gradient summed over the group as it
                             arrives (Qwen3's per-head q_norm/k_norm see only the local heads)

Sequence parallelism (``tp.sequence_parallel``; Megatron-LM's, Korthikanti et al. 2022). The layer's
hidden states are [batch, sequence / size, hidden] on each rank: norms, residual adds and every other
module outside the split projections run on the rank's part of the sequence. A *region* is a module
whose direct children the tp plan splits (``self_attn``, ``mlp``): its input is all-gathered along the
sequence on entry (backward: reduce-scattered, which sums the column-parallel projections' input
gradients, so they skip f), and its row-parallel projections reduce-scatter their partial outputs along
the sequence instead of all-reducing them (backward: all-gathered), so the region returns the rank's part.
The gradients of the parameters that see only the rank's part of the sequence (the norms outside the
regions, a row-parallel bias) are summed over the group as they arrive. A layer runs sequence-parallel
only when this is exact (``sequence_problem``): every split projection's parent is a region other than
the layer itself, each column-parallel projection takes its region's input as it came, and a region holds
no parameter outside the tp plan.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .tensor_parallel import TensorParallel, gather_sequence, reduce_scatter_sequence

__all__ = ["layer_tp_plan", "check_degree", "parallelize_layer", "layer_traffic", "STYLES", "sequence_problem",
           "check_sequence"]

_COLWISE = {"colwise": False, "colwise_gather_output": True, "colwise_rep": True}      # -> gather?
_ROWWISE = {"rowwise": False, "rowwise_split_input": True, "rowwise_rep": True}        # -> split?
_REPLICATED = "replicated_with_grad_allreduce"
STYLES = tuple(_COLWISE) + tuple(_ROWWISE) + (_REPLICATED,)
_PREFIX = "layers.*."
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


def layer_tp_plan(config) -> dict[str, str]:
    """The decoder-layer entries of ``config.base_model_tp_plan``, relative to one layer, in order."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    return {k[len(_PREFIX):]: str(v) for k, v in plan.items() if k.startswith(_PREFIX) and len(k) > len(_PREFIX)}


def _meta_layers(config) -> nn.ModuleList:
    """The decoder layers of the config's base model, built on the meta device (no memory, no weights;
    0.2 s for a 80-layer 70B config), from a copy of the config (building sets attributes such as
    ``_attn_implementation`` on it)."""
    import transformers   # lazily: the runtime imports this module for every model

    cfg = copy.deepcopy(config)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(cfg)
    return model.get_submodule("layers")


def _is_attention(module: nn.Module) -> bool:
    return isinstance(getattr(module, "head_dim", getattr(module, "head_size", None)), int)


def _parent(layer: nn.Module, name: str) -> nn.Module:
    head = name.rpartition(".")[0]
    return layer.get_submodule(head) if head else layer


def _problem(layer: nn.Module, plan: dict, degree: int, config) -> str | None:
    """The first reason ``degree`` cannot shard ``layer`` by ``plan``, else None."""
    unknown = [f"layers.*.{k}: {s}" for k, s in plan.items() if s not in STYLES]
    if unknown:
        return (f"tensor-parallel style not supported for a decoder layer: {', '.join(unknown)} "
                f"(supported: {', '.join(STYLES)})")
    for name, style in plan.items():
        try:
            sub = layer.get_submodule(name)
        except AttributeError:
            return f"layers.*.{name} (tp plan, {style}) is not a submodule of {type(layer).__name__}"
        if style == _REPLICATED:
            continue
        if type(sub) is not nn.Linear:
            return f"layers.*.{name} ({style}) is a {type(sub).__name__}; only torch.nn.Linear is split"
        col = style in _COLWISE
        width, what = (sub.out_features, "output") if col else (sub.in_features, "input")
        if width % degree:
            return f"layers.*.{name} ({style}): its {what} width {width} does not split into {degree} equal parts"
        if style == "colwise" and _is_attention(_parent(layer, name)):
            heads = getattr(config, "num_attention_heads", None)
            kv = getattr(config, "num_key_value_heads", None) or heads
            for key, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
                if isinstance(n, int) and n % degree:
                    return (f"{key} = {n} does not split into {degree} equal parts "
                            f"(layers.*.{name.rpartition('.')[0]} is split by heads)")
    return None


def check_degree(config, degree) -> str | None:
    """Why a tensor degree cannot shard this config's decoder layers, else None."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        return f"tensor degree {degree!r} is not a positive integer"
    plan = layer_tp_plan(config)
    if degree == 1:
        return None
    if not plan:
        return (f"{type(config).__name__} ({getattr(config, 'model_type', '?')}) has no base_model_tp_plan "
                f"entries 'layers.*.…': its decoder layers cannot be split")
    try:
        layers = _meta_layers(config)
    except Exception as e:  # noqa: BLE001 - reported as the reason
        return f"could not build the decoder layers of {type(config).__name__} to check them: {type(e).__name__}: {e}"
    for i, layer in enumerate(layers):   # every layer: some models vary widths or heads by layer
        why = _problem(layer, plan, degree, config)
        if why:
            return why if i == 0 else f"decoder layer {i}: {why}"
    return None


def _regions(plan: dict) -> list[str]:
    """The modules whose direct children the tp plan splits (in plan order, each once)."""
    out = []
    for name, style in plan.items():
        parent = name.rpartition(".")[0]
        if style != _REPLICATED and parent not in out:
            out.append(parent)
    return out


def sequence_problem(layer: nn.Module, plan: dict) -> str | None:
    """Why ``layer`` cannot run sequence-parallel by ``plan``, else None (the module docstring's conditions
    that can be read from the modules; a column-parallel projection fed something else than its region's
    input is found when the layer first runs)."""
    if not plan:
        return "its config has no tp plan for the decoder layers"
    regions = _regions(plan)
    if "" in regions:
        names = [n for n, s in plan.items() if "." not in n and s != _REPLICATED]
        return f"the tp plan splits {', '.join(names)} directly in the decoder layer (no module to gather around)"
    for r in regions:
        if any(o != r and (r.startswith(o + ".") or o.startswith(r + ".")) for o in regions):
            return f"the tp plan splits projections at two depths under layers.*.{r}"
    for r in regions:
        if not any(s in _ROWWISE for n, s in plan.items() if n.rpartition(".")[0] == r):
            return f"layers.*.{r} has no row-parallel projection to scatter its output along the sequence"
    return None


def check_sequence(config, degree) -> str | None:
    """Why the config's decoder layers cannot run sequence-parallel over ``degree`` devices, else None (a
    degree they cannot be split over at all is ``check_degree``'s)."""
    plan = layer_tp_plan(config)
    if degree == 1 or check_degree(config, degree):
        return None
    layers = _meta_layers(config)
    for i, layer in enumerate(layers):
        why = sequence_problem(layer, plan)
        if why:
            return why if i == 0 else f"decoder layer {i}: {why}"
    return None


class _GatherLast(torch.autograd.Function):
    """The shards along the last dim, in rank order, on every rank (an all-reduce of the zero-padded
    full width); backward: the gradient is replicated, each rank keeps its slice."""

    @staticmethod
    def forward(ctx, x, tp):
        n = x.shape[-1]
        ctx.span = (tp.rank * n, n)
        full = x.new_zeros(*x.shape[:-1], n * tp.size)
        full.narrow(-1, tp.rank * n, n).copy_(x)
        return tp.all_reduce(full)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, *ctx.span).contiguous(), None


class _SplitLast(torch.autograd.Function):
    """A replicated tensor's own slice along the last dim; backward: the slices' gradients gathered
    to the full width (the replicated producer needs its whole gradient on every rank)."""

    @staticmethod
    def forward(ctx, x, tp):
        n = x.shape[-1] // tp.size
        ctx.tp, ctx.span, ctx.width = tp, (tp.rank * n, n), x.shape[-1]
        return x.narrow(-1, tp.rank * n, n).contiguous()

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(*grad.shape[:-1], ctx.width)
        full.narrow(-1, *ctx.span).copy_(grad)
        return ctx.tp.all_reduce(full), None


class _LayerState:
    """One parallelized decoder layer's context: the rank's ``TensorParallel`` and, during one forward
    of the layer, the inputs already passed through f (so sibling column-parallel projections of the
    same tensor share one f, i.e. one all-reduce of its gradient). A deep copy keeps the group and
    starts with no inputs."""

    def __init__(self, tp: TensorParallel, sequence: bool = False):
        self.tp, self.seen, self.sequence = tp, [], sequence
        self.gathered: list = []   # sequence parallel: the regions' gathered inputs in this forward

    def __deepcopy__(self, memo):
        return _LayerState(self.tp, self.sequence)

    def clear(self, *_args):
        self.seen, self.gathered = [], []

    def f(self, x: torch.Tensor) -> torch.Tensor:
        for src, fx in self.seen:
            if src is x:
                return fx
        if self.sequence:
            if any(g is x for g in self.gathered):   # the gather's backward already sums the input gradient
                return x
            raise RuntimeError("sequence parallelism: a column-parallel projection's input is not its module's "
                               "input as the layer passed it, so its gradient would not be summed exactly once")
        fx = self.tp.copy_to_region(x)
        self.seen.append((x, fx))
        return fx

    def gather_input(self, module, args, kwargs):
        """A region's forward pre-hook: its hidden states (first positional argument or ``hidden_states``)
        gathered along the sequence."""
        if args:
            g = gather_sequence(args[0], self.tp)
            self.gathered.append(g)
            return (g,) + tuple(args[1:]), kwargs
        if "hidden_states" in kwargs:
            g = gather_sequence(kwargs["hidden_states"], self.tp)
            self.gathered.append(g)
            return args, {**kwargs, "hidden_states": g}
        raise RuntimeError(f"sequence parallelism: {type(module).__name__} was called without hidden states")

    def reduce_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(grad.clone(memory_format=torch.contiguous_format))


class TPLinear(nn.Linear):
    """An ``nn.Linear`` split by one tp-plan style (set by ``parallelize_layer``; its parameters keep
    their names ``weight`` and ``bias``)."""

    planc_tp_style: str
    _planc_tp: _LayerState

    def extra_repr(self):
        return f"{super().extra_repr()}, tp={self.planc_tp_style} {self._planc_tp.tp.rank}/{self._planc_tp.tp.size}"

    def forward(self, x):
        st, style = self._planc_tp, self.planc_tp_style
        if style in _COLWISE:
            y = F.linear(st.f(x), self.weight, self.bias)
            return _GatherLast.apply(y, st.tp) if _COLWISE[style] else y
        if _ROWWISE[style]:
            x = _SplitLast.apply(x, st.tp)
        if st.sequence:
            y = reduce_scatter_sequence(F.linear(x, self.weight), st.tp)
        else:
            y = st.tp.reduce_from_region(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def _split_linear(lin: nn.Linear, style: str, state: _LayerState) -> None:
    tp = state.tp
    dim = 0 if style in _COLWISE else 1
    lin.weight = tp.shard(lin.weight, dim)
    if lin.bias is not None and dim == 0:
        lin.bias = tp.shard(lin.bias, 0)
    if dim == 0:
        lin.out_features //= tp.size
    else:
        lin.in_features //= tp.size
    lin.__class__ = TPLinear
    lin.planc_tp_style = style
    lin._planc_tp = state


def parallelize_layer(module: nn.Module, plan: dict, tp: TensorParallel | None) -> None:
    """Shard one decoder layer in place by ``plan`` (``layer_tp_plan``) for ``tp``; ``tp`` None or of
    size 1 leaves it whole. Raises ``ValueError`` with the reason (``check_degree``'s) when it cannot."""
    if tp is None or tp.size == 1:
        return
    if not plan:
        raise ValueError(f"no tp plan entries for {type(module).__name__}: it cannot be split over {tp.size} devices")
    if any(isinstance(m, TPLinear) for m in module.modules()):
        raise ValueError(f"{type(module).__name__} is already split for tensor parallelism")
    attn = next((m for m in module.modules() if _is_attention(m)), None)
    config = getattr(attn, "config", None) or getattr(module, "config", None)
    why = _problem(module, plan, tp.size, config)
    sequence = bool(getattr(tp, "sequence_parallel", False))
    if not why and sequence:
        why = sequence_problem(module, plan)
        why = why and f"it cannot run sequence-parallel: {why}"
    if why:
        raise ValueError(why)
    state = _LayerState(tp, sequence)
    head_split = set()
    summed = set()   # parameters whose gradient is summed over the group as it arrives, or split
    seq_biases = set()
    with torch.no_grad():
        for name, style in plan.items():
            sub = module.get_submodule(name)
            if style == _REPLICATED:
                for p in sub.parameters():
                    if p.requires_grad:
                        p.register_hook(state.reduce_grad)
                    summed.add(id(p))
                continue
            _split_linear(sub, style, state)
            summed.update(id(p) for p in sub.parameters())   # shards: nothing to sum, except ...
            if sequence and style in _ROWWISE and sub.bias is not None:
                summed.discard(id(sub.bias))   # ... a row-parallel bias, added to the rank's part of the sequence
                seq_biases.add(id(sub.bias))
            if style == "colwise" and _is_attention(_parent(module, name)):
                head_split.add(name.rpartition(".")[0])
    if sequence:   # what sees only the rank's part of the sequence: its gradient summed over the group
        regions = _regions(plan)
        inside = {id(p) for r in regions for p in module.get_submodule(r).parameters()} - seq_biases
        for p in module.parameters():
            if id(p) not in summed and id(p) not in inside and p.requires_grad:
                p.register_hook(state.reduce_grad)
        for r in regions:
            module.get_submodule(r).register_forward_pre_hook(state.gather_input, with_kwargs=True)
    for name in sorted(head_split):   # the attention module sees its local heads
        sub = module.get_submodule(name) if name else module
        for a in _HEAD_ATTRS:
            v = getattr(sub, a, None)
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(sub, a, v // tp.size)
    module.register_forward_pre_hook(state.clear)
    module.register_forward_hook(state.clear)


def layer_traffic(config, rows: int, seq: int, dtype_bytes: int, sequence: bool = False) -> dict:
    """The collectives one device of a tensor group issues per decoder layer for one micro-batch of
    ``rows`` x ``seq`` tokens with activations (and gradients) of ``dtype_bytes`` bytes: ``forward`` and
    ``backward`` their bytes (of the whole tensor: an all-gather's output, a reduce-scatter's input),
    ``forward_kinds`` and ``backward_kinds`` each one's collective (``all_reduce``, ``all_gather``,
    ``reduce_scatter``), in the order issued.

    Without sequence parallelism, all all-reduces: forward, g of every row-parallel projection and the
    padded gather of every ``*_gather_output``; backward, one f per distinct input of column-parallel
    projections (siblings under one module share their input), the gradient gather of every
    ``rowwise_split_input`` and one per parameter of a ``replicated_with_grad_allreduce`` module (in
    reverse module order). With ``sequence``: each region's input all-gathered (backward: reduce-scattered)
    in place of f, every row-parallel output reduce-scattered (backward: all-gathered) in place of g, and
    last in backward (their place among the others depends on where the model applies them), the sum of
    every parameter gradient that sees only the rank's part of the sequence.
    The tensor degree does not change the bytes: every collective carries the full width. Widths are
    decoder layer 0's (the supported models' layers are alike)."""
    plan = layer_tp_plan(config)
    out: dict = {"forward": [], "backward": [], "errors": [], "forward_kinds": [], "backward_kinds": []}
    if not plan:
        out["errors"].append(f"{type(config).__name__} has no base_model_tp_plan entries 'layers.*.…'")
        return out
    layer = _meta_layers(config)[0]
    if sequence and (why := sequence_problem(layer, plan)):
        out["errors"].append(f"not sequence-parallel: {why}")
        return out
    tokens = int(rows) * int(seq) * int(dtype_bytes)
    fwd, bwd, f_inputs, entered = [], [], set(), set()
    for name, style in plan.items():
        sub = layer.get_submodule(name)
        parent = name.rpartition(".")[0]
        if style == _REPLICATED:
            bwd += [("all_reduce", p.numel() * dtype_bytes) for p in sub.parameters() if p.requires_grad]
        elif style in _COLWISE:
            if parent not in f_inputs:
                f_inputs.add(parent)
                if sequence:   # the region's entry: gathered forward, reduce-scattered backward
                    fwd.append(("all_gather", tokens * sub.in_features))
                    bwd.append(("reduce_scatter", tokens * sub.in_features))
                else:
                    bwd.append(("all_reduce", tokens * sub.in_features))
            if _COLWISE[style]:
                fwd.append(("all_reduce", tokens * sub.out_features))
        elif style in _ROWWISE:
            if sequence and parent not in f_inputs:   # a region entered by its row-parallel projection
                f_inputs.add(parent)
                fwd.append(("all_gather", tokens * sub.in_features))
                bwd.append(("reduce_scatter", tokens * sub.in_features))
            if _ROWWISE[style]:
                bwd.append(("all_reduce", tokens * sub.in_features))
            fwd.append(("reduce_scatter" if sequence else "all_reduce", tokens * sub.out_features))
            if sequence:
                bwd.append(("all_gather", tokens * sub.out_features))
        else:
            out["errors"].append(f"layers.*.{name}: style {style} is not supported")
    bwd = bwd[::-1]
    if sequence:
        biases = {id(m.bias) for n, s in plan.items() if s in _ROWWISE
                  and (m := layer.get_submodule(n)).bias is not None}
        kept = {id(p) for r in _regions(plan) for p in layer.get_submodule(r).parameters()}
        kept |= {id(p) for n in plan for p in layer.get_submodule(n).parameters()}
        bwd += [("all_reduce", p.numel() * dtype_bytes) for p in layer.parameters()
                if (id(p) not in kept or id(p) in biases) and p.requires_grad]
    out["forward"], out["forward_kinds"] = [b for _, b in fwd], [k for k, _ in fwd]
    out["backward"], out["backward_kinds"] = [b for _, b in bwd], [k for k, _ in bwd]
    return out
