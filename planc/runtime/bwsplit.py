"""A stage's backward split in two, as zero-bubble schedules run it (``zb_h1``, Qi et al. 2024): B, then W.

B of micro-batch m computes the gradients of the stage's received activations (what the previous stage
waits for); W computes the weight gradients later, filling a pipeline bubble. docs/runtime-engine.md,
"The backward split", says how the engine calls them and what each holds.

B reads the autograd graph once: the *input path* is every node with a path down to an input; a trainable
parameter's *cuts* are the input-path nodes met first on the way up from it (where its weight-gradient
path branches off: a linear's ``AddmmBackward0``), plus any output reached without crossing the input
path. Parameters sharing a cut form a group. B runs autograd from the outputs (or the loss) to the inputs
with a pre-hook on every cut keeping the gradients flowing into it. W runs, per group, autograd from those
kept gradients to the group's parameters: each cut node runs again computing only its weight side
(autograd computes only the outputs a call needs) and nothing of the input path runs twice, unlike a
second pass from the outputs (as dear as the whole fused backward). Groups of vectors only (norms'
scales and shifts) are computed in B, where they cost a reduction, and their gradients kept until W:
that holds less than a norm's input and output gradient would.

What B keeps for W: the cut gradients, the vector gradients, and the saved tensors of the cut and
weight-side nodes (a linear's input). Under ``saving(m)`` the forward's saved tensors are boxed and B
empties those of an input-path node W will not run (attention, GELU, norms) as soon as that node has run,
as a fused backward frees them; without it they live until the graph is dropped. W's calls release what
they read (``retain_graph=False``), so after W nothing of m is left.

W accumulates as ``AccumulateGrad`` does (in place into an existing ``.grad``, a view into planc's
buckets; else a fresh tensor laid out like the parameter), then runs the parameter's post-accumulate hooks:
once per parameter and W, all inside one autograd graph task, so a hook may queue an end-of-backward
callback (``grads_zero2``): it runs once, when W ends. A parameter's tensor hooks (``register_hook``) run
where its gradient is computed: W for matrices, B for vectors.

A stage whose inputs need no gradient (the first: token ids) has nothing for B to compute: B keeps the
outputs and their gradients, W runs the whole fused backward (its W passes fill stage 0's bubbles).

Recompute (non-reentrant ``torch.utils.checkpoint``): B recomputes the forward once, as a fused backward
does; checkpoint hands each recomputed tensor out once per backward, so W recomputes it again (once for
all of W's calls: one ``GraphExecGroup``).

Imports only torch and the standard library (and ``dataflow``'s error type).
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .dataflow import EngineError

__all__ = ["BackwardSplit", "distinct_outputs"]

# which node a saved tensor belongs to (private torch functions; without them B frees nothing): the node
# whose backward unpacks it, and the sequence number the forward was at when it was packed (its node's + 1)
_current_node = getattr(torch._C, "_current_autograd_node", None)
_next_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)
_exec_group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)   # torch >= 2.9: one recompute for W


class _Box:
    """A tensor autograd saved, boxed so that B can drop it. Its owner is the node that unpacks it in B if
    that node's sequence number is the one current when it was packed: a tensor unpacked on another's
    behalf (checkpoint's saved inputs, read when a node's unpack starts the recompute) has none. During B
    ``owners`` (node -> its boxes) collects the boxes as their nodes unpack them."""

    __slots__ = ("tensor", "node", "seq", "m", "owners", "__weakref__")

    def __init__(self, tensor, m):
        self.tensor, self.node, self.m, self.owners = tensor, None, m, None
        self.seq = _next_sequence_nr() - 1 if _next_sequence_nr is not None else None

    def unpack(self):
        if self.tensor is None:
            raise EngineError(f"micro-batch {self.m}: a tensor its forward saved was freed after B (the input "
                              "gradients) but a later backward reads it")
        if self.node is None and _current_node is not None:
            n = self.node = _current_node()
            if self.owners is not None and n is not None and n._sequence_nr() == self.seq:
                self.owners.setdefault(n, []).append(self)
        return self.tensor


def _release(owners, node):
    """A post-hook of an input-path node W will not run: once it has run in B, its saved tensors go."""
    def hook(_grad_inputs, _grad_outputs):
        for box in owners.pop(node, ()):
            box.tensor = None
    return hook


@dataclass(slots=True)
class _Call:
    """One autograd call of W: the gradients known at its roots after B, the parameters behind them."""
    edges: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    clamps: list = field(default_factory=list)   # (input-path cut, its gradients): B's total there
    params: list = field(default_factory=list)
    cuts: set = field(default_factory=set)       # every root node (input-path cuts and outputs)
    runs: set = field(default_factory=set)       # the input-path nodes it runs: its cuts (and, merged, between)
    ready: list | None = None                    # vector parameters: their gradients, computed in B
    order: int = 0                               # the latest-created root first, as autograd runs

    def take(self, kept) -> None:
        """After B: the gradients B's pre-hooks kept at this call's input-path cuts become its roots."""
        self.clamps = [(c, kept[c]) for c, _ in self.clamps if c in kept]
        for c, gs in self.clamps:
            for i, g in enumerate(gs):
                if g is not None:
                    self.edges.append(GradientEdge(c, i))
                    self.grads.append(g)


@dataclass(slots=True)
class _Pending:
    """Micro-batch m between B and W."""
    calls: list
    whole: tuple | None      # first stage: (outputs, gradients) for the fused backward
    boxes: list              # weak references (held_bytes): a box lives as long as the node saving it


class BackwardSplit:
    """B and W of one stage's micro-batches over ``params`` (the stage's parameters; those that do not
    require grad are left out). ``m`` is any hashable micro-batch key, used in errors and records."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        self._pending: dict = {}
        self._boxes: dict = {}

    # ---- F
    def saving(self, m):
        """The forward of micro-batch ``m`` runs inside this context: its saved tensors are boxed so that
        B can free those only the input gradients read. Optional (B and W are exact without it)."""
        boxes = self._boxes.setdefault(m, [])

        def pack(t):
            box = _Box(t.detach() if t.requires_grad else t, m)   # no cycle through an output's grad_fn
            boxes.append(box)
            return box

        return torch.autograd.graph.saved_tensors_hooks(pack, _Box.unpack)

    # ---- B
    def backward_input(self, m, outputs, grads=None, inputs=()) -> None:
        """B of micro-batch ``m``: the gradients of ``inputs`` (those that require grad), accumulated into
        their ``.grad`` as a fused backward would, and what W needs kept. ``outputs``: the stage's outputs,
        ``grads`` their gradients in order (one output may appear several times, e.g. a skip and the main
        path: its gradients are summed; outputs that do not require grad are skipped); on the last stage
        ``outputs=[loss]`` (scaled as the fused backward would scale it) and ``grads=None``."""
        if m in self._pending:
            raise EngineError(f"micro-batch {m}: B (the input gradients) ran twice without its W between")
        held = self._boxes.pop(m, [])
        boxes = held[:]
        held.clear()   # the list every saved variable's pack hook holds: no box is kept alive by it
        outs, sums = distinct_outputs(outputs, grads)
        leaves = [x for x in inputs if torch.is_tensor(x) and x.requires_grad]
        roots = [get_gradient_edge(t) for t in outs]
        ins = {get_gradient_edge(x).node: x for x in leaves}
        parents = _parents([e.node for e in roots], stop=ins)
        leaves = [x for n, x in ins.items() if n in parents]
        if not leaves:   # nothing to differentiate, or the first stage: W runs the whole backward
            self._pending[m] = _Pending([], (outs, sums) if outs else None, _weak(boxes))
            return
        path = _up([n for n in ins if n in parents], parents)
        root_grads: dict = {}
        for e, g in zip(roots, sums):
            root_grads.setdefault(e.node, []).append((e.output_nr, g))
        calls = self._calls(parents, path, root_grads)
        early = [c for c in calls if all(p.dim() < 2 for p in c.params)]
        calls = self._merge_stacked([c for c in calls if not any(c is e for e in early)], parents, path)
        runs = set().union(*(c.runs for c in calls))
        kept: dict = {}
        owners: dict = {}   # saved tensors only the input path reads, dropped as soon as their node has run
        for box in boxes:
            box.owners = owners
        handles = [c.register_prehook(_keep(kept, c)) for call in calls for c, _ in call.clamps]
        handles += [n.register_hook(_release(owners, n)) for n in (path - runs if boxes else ())]
        try:
            got = torch.autograd.grad(outs, leaves + [p for c in early for p in c.params], sums,
                                      retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
            for box in boxes:
                box.owners = None
        for x, g in zip(leaves, got):   # as AccumulateGrad: g itself unless it is an output's gradient
            if g is not None:
                if x.grad is None:
                    x.grad = g.clone() if any(g is s for s in sums) else g
                else:
                    x.grad.add_(g)
        got = iter(got[len(leaves):])
        for c in early:
            c.ready = [(p, g) for p in c.params if (g := next(got)) is not None]
        for call in calls:
            call.take(kept)
        self._pending[m] = _Pending(sorted(calls + early, key=lambda c: -c.order), None, _weak(boxes))

    def _calls(self, parents, path, root_grads) -> list[_Call]:
        """The groups of parameters W computes together: those reaching a shared cut."""
        group: dict = {}   # cut node -> its _Call
        index = {id(p): i for i, p in enumerate(self.params)}
        for p in self.params:
            a = get_gradient_edge(p).node
            if a not in parents:
                continue   # not used by this micro-batch's forward
            call = _Call(params=[p], cuts=set(_cuts(a, parents, path, root_grads)))
            for c in list(call.cuts):
                other = group.get(c)
                if other is not None and other is not call:
                    call.params += other.params
                    call.cuts |= other.cuts
                    for c2 in other.cuts:
                        group[c2] = call
            for c in call.cuts:
                group[c] = call
        calls = list({id(c): c for c in group.values()}.values())
        for call in calls:
            call.params.sort(key=lambda p: index[id(p)])
            call.order = max(c._sequence_nr() for c in call.cuts)
            call.runs = call.cuts & path
            for c in sorted(call.cuts, key=lambda c: -c._sequence_nr()):
                if c in path:
                    call.clamps.append((c, None))
                else:   # an output off the input path: its own gradient enters there
                    for nr, g in root_grads[c]:
                        call.edges.append(GradientEdge(c, nr))
                        call.grads.append(g)
        return calls

    def _merge_stacked(self, calls, parents, path) -> list[_Call]:
        """A group whose cuts lie on one another's input path (a parameter used at two depths of the stage)
        makes its call run the input path between them again; it is merged with every group whose cut lies
        there, so that no node runs in two of W's calls (each reads its saved tensors once)."""
        merged = [c for c in calls if len(c.runs) > 1 and _between(c, parents, path) - c.runs]
        if not merged:
            return calls
        index = {id(p): i for i, p in enumerate(self.params)}
        while True:
            one = _Call(order=max(c.order for c in merged))
            for c in merged:
                one.edges += c.edges
                one.grads += c.grads
                one.clamps += c.clamps
                one.params += c.params
                one.cuts |= c.cuts
            one.params.sort(key=lambda p: index[id(p)])
            one.runs = _between(one, parents, path) | (one.cuts & path)
            more = [c for c in calls if not any(c is d for d in merged) and c.cuts & one.runs]
            if not more:
                return [one] + [c for c in calls if not any(c is d for d in merged)]
            merged += more

    # ---- W
    def backward_weight(self, m) -> None:
        """W of micro-batch ``m``: every parameter's gradient accumulated into ``.grad`` and its
        post-accumulate hooks run, in one autograd graph task; then nothing of ``m`` is kept."""
        pending = self._pending.pop(m, None)
        if pending is None:
            raise EngineError(f"micro-batch {m}: W (the weight gradients) ran before its B (the input gradients)")
        group = _exec_group() if _exec_group is not None else contextlib.nullcontext()
        with group:
            if pending.whole is not None:
                outs, sums = pending.whole
                torch.autograd.backward(outs, sums)
            elif pending.calls:
                anchor = torch.zeros((), requires_grad=True)
                torch.autograd.backward(_InOneGraphTask.apply(anchor, lambda: _run(pending.calls)))
        pending.calls.clear()
        pending.boxes.clear()

    # ---- records
    @property
    def pending(self) -> list:
        """The micro-batches between their B and their W."""
        return sorted(self._pending)

    def held_bytes(self, m) -> int:
        """What micro-batch ``m`` holds between B and W: the gradients at the cuts and, where its forward
        ran under ``saving``, the saved tensors kept for W (the parameters' storages left out)."""
        pending = self._pending[m]
        params = {p.untyped_storage()._cdata for p in self.params}
        tensors = [g for call in pending.calls for g in call.grads + [g for _, g in call.ready or ()]]
        tensors += [b.tensor for ref in pending.boxes if (b := ref()) is not None and b.tensor is not None]
        if pending.whole is not None:
            tensors += pending.whole[1]
        seen: dict = {}
        for t in tensors:
            st = t.untyped_storage()
            if st._cdata not in params:
                seen[st.data_ptr(), t.device] = st.nbytes()
        return sum(seen.values())


class _InOneGraphTask(torch.autograd.Function):
    """Runs ``work`` as the backward of a one-node graph: W's calls, hooks and callbacks in one graph task."""

    @staticmethod
    def forward(ctx, anchor, work):
        ctx.work = work
        return anchor.clone()

    @staticmethod
    def backward(ctx, _grad):
        work, ctx.work = ctx.work, None
        work()
        return None, None


def _run(calls) -> None:
    for call in calls:
        if call.ready is not None:
            for p, g in call.ready:
                _accumulate(p, g)
            call.ready = None
            continue
        handles = [c.register_prehook(lambda _g, saved=saved: saved) for c, saved in call.clamps] \
            if len(call.edges) > 1 else []
        try:
            dws = torch.autograd.grad(call.edges, call.params, call.grads, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        call.grads, call.clamps = [], []
        for p, g in zip(call.params, dws):
            if g is not None:
                _accumulate(p, g)


def _accumulate(p, g) -> None:
    """``AccumulateGrad``: in place into an existing ``.grad``, else a fresh tensor with the parameter's
    layout (never ``g`` itself: it may be another parameter's or a gradient the caller holds); then the
    parameter's post-accumulate hooks."""
    if p.grad is None:
        p.grad = torch.empty_like(p, dtype=g.dtype).copy_(g)
    else:
        p.grad.add_(g)
    for hook in list((p._post_accumulate_grad_hooks or {}).values()):
        hook(p)


def _weak(boxes) -> list:
    return [weakref.ref(b) for b in boxes if b.tensor is not None]


def _keep(kept, node):
    def hook(grads):
        kept[node] = tuple(grads)
    return hook


def distinct_outputs(outputs, grads):
    """The distinct outputs that require grad, each with its gradients summed (one output may feed several
    transfers: a skip and the main path); ``grads`` None: a scalar loss, gradient 1. What a fused backward
    over a stage's outputs differentiates too (engine.py's loop, which this can replace)."""
    outs, sums = [], []
    for i, t in enumerate(outputs):
        if not (torch.is_tensor(t) and t.requires_grad):
            continue
        g = torch.ones_like(t) if grads is None else grads[i]
        for j, u in enumerate(outs):
            if u is t:
                sums[j] = sums[j] + g
                break
        else:
            outs.append(t)
            sums.append(g)
    return outs, sums


def _parents(roots, stop) -> dict:
    """Every node reachable from ``roots`` (not below ``stop``) -> the nodes that feed it a gradient."""
    parents: dict = {r: [] for r in roots}
    todo = list(parents)
    while todo:
        n = todo.pop()
        if n in stop:
            continue
        for child, _ in n.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(n)
    return parents


def _up(start, parents) -> set:
    seen = set(start)
    todo = list(seen)
    while todo:
        for q in parents[todo.pop()]:
            if q not in seen:
                seen.add(q)
                todo.append(q)
    return seen


def _between(call, parents, path) -> set:
    """The input-path nodes a call runs: below one of its roots and above one of its parameters."""
    above = _up([get_gradient_edge(p).node for p in call.params], parents)
    below, todo = set(call.cuts), list(call.cuts)
    while todo:
        for child, _ in todo.pop().next_functions:
            if child is not None and child in parents and child not in below:
                below.add(child)
                todo.append(child)
    return below & above & path


def _cuts(a, parents, path, root_grads) -> list:
    """Walking up from parameter node ``a``: the input-path nodes met first, and the outputs passed."""
    cuts, seen, todo = [], {a}, [a]
    while todo:
        n = todo.pop()
        if n in root_grads:
            cuts.append(n)
        for q in parents[n]:
            if q in seen:
                continue
            seen.add(q)
            if q in path:
                cuts.append(q)
            else:
                todo.append(q)
    return cuts
