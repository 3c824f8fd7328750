"""A stage rank's training state to and from the rectangles of a format-2 checkpoint (``ckpt_dcp``).

What a rank writes: for every fragment its ``Regime`` updates (a whole parameter, or with zero = 1 the
owned range of one), the fp32 master (``model.<name>``) and the optimizer's per-parameter state tensors
(``optim.<name>.<state>``), as rectangles at their global offsets. What it reads: the same rectangles of
its new plan's fragments, from whatever chunks the writing plan left; then the parameters are made from
the masters again (``Regime._publish``: cast, or with zero = 1 all-gathered over the data group).

Imports only torch, the standard library and the runtime's own modules.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import _get_scalar_dtype

from .ckpt_dcp import local_view, owned_rects, stage_params

__all__ = ["save_chunks", "LoadTargets", "STEP_STATE"]

# optimizers whose per-parameter state holds the step count (torch's Adam, AdamW): rebuilt from the
# schedule's t, which every parameter with state shares (a step updates all of them or, skipped, none)
STEP_STATE = ("adam", "adamw")


def _fragments(engine):
    infos = {id(i.param): i for i in stage_params(engine.module)}
    for f in engine.regime.fragments + engine.regime.tied:   # tied across stages: whole fragments of their own
        info = infos.get(id(f.param))
        if info is not None:
            yield f, info


def _tensor_states(optimizer, master) -> dict:
    """The optimizer's state tensors of ``master`` that have its shape (Adam's moments, SGD's momentum)."""
    state = optimizer.state.get(master, {})
    return {k: v for k, v in state.items()
            if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == tuple(master.shape)}


def save_chunks(engine) -> dict:
    """``{(key, global offsets): (fp32 CPU tensor, global shape)}``: this rank's owned rectangles of every
    master and optimizer state tensor (``RectSavePlanner``'s input)."""
    chunks = {}
    tied = getattr(engine, "tied", None)
    for f, info in _fragments(engine):
        shape, n = tuple(info.param.shape), info.param.numel()
        spans = tied.written(f.param) if tied is not None and f in engine.regime.tied else None
        rects = owned_rects(info, f.lo, f.hi) if spans is None else [x for a, b in spans for x in owned_rects(info, a, b)]
        sources = {f"model.{info.name}": f.master}
        sources.update({f"optim.{info.name}.{k}": v
                        for k, v in _tensor_states(engine.regime.optimizer, f.master).items()})
        for key, tensor in sources.items():
            flat = tensor.detach().reshape(-1).to("cpu", torch.float32)
            if (f.lo, f.hi) == (0, n):   # the whole tensor: its own view (each rectangle is cloned below)
                full = flat
            else:
                full = torch.zeros(n, dtype=torch.float32)
                full[f.lo:f.hi] = flat
            for local, sizes, glob in rects:
                chunks[(key, glob)] = (local_view(full, shape, local, sizes).clone(), info.shape)
    return chunks


class LoadTargets:
    """The rectangles this rank reads (``wanted``, ``RectLoadPlanner``'s input) and, once DCP has filled
    them, ``apply()``: the masters and the optimizer state set from them (``keys``: the checkpoint's tensor
    keys; ``weights_only``: the masters alone, the optimizer left fresh)."""

    def __init__(self, engine, keys, weights_only: bool):
        self.engine, self.wanted, self.places = engine, {}, []
        for f, info in _fragments(engine):
            shape, n = tuple(info.param.shape), info.param.numel()
            rects = owned_rects(info, f.lo, f.hi)
            names = [f"model.{info.name}"]
            if not weights_only:
                prefix = f"optim.{info.name}."
                names += sorted(k for k in keys if k.startswith(prefix) and "." not in k[len(prefix):])
            for key in names:
                full = torch.zeros(n, dtype=torch.float32)
                for local, sizes, glob in rects:
                    dest = torch.empty(sizes, dtype=torch.float32)
                    self.wanted.setdefault(key, []).append((glob, dest))
                    self.places.append((key, f, full, shape, local, sizes, dest))

    @torch.no_grad()
    def apply(self, t: int) -> None:
        regime = self.engine.regime
        optimizer = regime.optimizer
        for key, f, full, shape, local, sizes, dest in self.places:
            local_view(full, shape, local, sizes).copy_(dest)
        done = set()
        for key, f, full, _, _, _, _ in self.places:
            if (key, id(f)) in done:
                continue
            done.add((key, id(f)))
            value = full[f.lo:f.hi].view(f.master.shape)
            if key.startswith("model."):
                f.master.copy_(value)
            else:
                state = optimizer.state[f.master]
                state[key.rsplit(".", 1)[1]] = value.to(f.master.device, f.master.dtype).clone()
                if regime.train.optimizer.name in STEP_STATE:
                    state["step"] = torch.tensor(float(t), dtype=_get_scalar_dtype())
        regime._publish()   # the parameters from the masters (zero = 1: collective over the data group)
