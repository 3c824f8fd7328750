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
        ``nn.Parameter``s holding the local shard, marked like ``TensorParallel.shard`` does.
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
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .tensor_parallel import TensorParallel

__all__ = ["layer_tp_plan", "check_degree", "parallelize_layer", "layer_traffic", "STYLES"]

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

    def __init__(self, tp: TensorParallel):
        self.tp, self.seen = tp, []

    def __deepcopy__(self, memo):
        return _LayerState(self.tp)

    def clear(self, *_args):
        self.seen = []

    def f(self, x: torch.Tensor) -> torch.Tensor:
        for src, fx in self.seen:
            if src is x:
                return fx
        fx = self.tp.copy_to_region(x)
        self.seen.append((x, fx))
        return fx

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
    if why:
        raise ValueError(why)
    state = _LayerState(tp)
    head_split = set()
    with torch.no_grad():
        for name, style in plan.items():
            sub = module.get_submodule(name)
            if style == _REPLICATED:
                for p in sub.parameters():
                    if p.requires_grad:
                        p.register_hook(state.reduce_grad)
                continue
            _split_linear(sub, style, state)
            if style == "colwise" and _is_attention(_parent(module, name)):
                head_split.add(name.rpartition(".")[0])
    for name in sorted(head_split):   # the attention module sees its local heads
        sub = module.get_submodule(name) if name else module
        for a in _HEAD_ATTRS:
            v = getattr(sub, a, None)
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(sub, a, v // tp.size)
    module.register_forward_pre_hook(state.clear)
    module.register_forward_hook(state.clear)


def layer_traffic(config, rows: int, seq: int, dtype_bytes: int) -> dict:
    """The all-reduces one device of a tensor group issues per decoder layer for one micro-batch of
    ``rows`` x ``seq`` tokens with activations (and gradients) of ``dtype_bytes`` bytes, in the order
    issued: forward, g of every row-parallel projection and the padded gather of every
    ``*_gather_output``; backward, one f per distinct input of column-parallel projections (siblings
    under one module share their input), the gradient gather of every ``rowwise_split_input`` and one
    per parameter of a ``replicated_with_grad_allreduce`` module (in reverse module order).
    The tensor degree does not change the bytes: every all-reduce carries the full width. Widths are
    decoder layer 0's (the supported models' layers are alike)."""
    plan = layer_tp_plan(config)
    out: dict = {"forward": [], "backward": [], "errors": []}
    if not plan:
        out["errors"].append(f"{type(config).__name__} has no base_model_tp_plan entries 'layers.*.…'")
        return out
    layer = _meta_layers(config)[0]
    tokens = int(rows) * int(seq) * int(dtype_bytes)
    backward, f_inputs = [], set()
    for name, style in plan.items():
        sub = layer.get_submodule(name)
        if style == _REPLICATED:
            backward += [p.numel() * dtype_bytes for p in sub.parameters() if p.requires_grad]
        elif style in _COLWISE:
            parent = name.rpartition(".")[0]
            if parent not in f_inputs:
                f_inputs.add(parent)
                backward.append(tokens * sub.in_features)
            if _COLWISE[style]:
                out["forward"].append(tokens * sub.out_features)
        elif style in _ROWWISE:
            out["forward"].append(tokens * sub.out_features)
            if _ROWWISE[style]:
                backward.append(tokens * sub.in_features)
        else:
            out["errors"].append(f"layers.*.{name}: style {style} is not supported")
    out["backward"] = backward[::-1]
    return out
