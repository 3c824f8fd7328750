"""Plan-independent initialization of a Hugging Face model, one module at a time (LANGUAGE.md, "Hugging
Face models"; docs/models.md, "Initialization").

The model is built on the meta device. Every module is then visited children first (siblings in
registration order, the root last: the order of transformers' own ``initialize_weights``); the modules a
rank holds get their own tensors on the CPU (``to_empty``) and the model's ``_init_weights(module)`` runs
under ``torch.manual_seed(seed_of(seed, name))``, ``name`` the module's qualified name in the causal LM.
A module's values so depend only on (seed, its name, the config): a rank that holds layers 40..59 draws
the same numbers for them as a single process holding all 80, and no rank ever materializes a module
it does not hold. Stacked expert tensors (``grouped_gemm`` entries of ``base_model_ep_plan``) are drawn
expert by expert under ``seed_of(seed, f"{name}/{e}")``. ``tie_weights()`` comes last.

Imports torch and the standard library; the model is any ``transformers`` ``PreTrainedModel``.
"""
from __future__ import annotations

import hashlib
import re
from typing import Callable, Iterable

import torch
from torch import nn

__all__ = ["seed_of", "init_order", "stacked_tensors", "materialize", "needed_modules", "MATERIALIZE_DEVICE"]

MATERIALIZE_DEVICE = "cpu"   # drawn on the CPU generator, then moved: the same numbers on every backend


def seed_of(seed: int, name: str) -> int:
    """s(x) = the first 8 bytes of sha256(f"{seed}/{x}"), little-endian, mod 2**63."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") % 2 ** 63


def init_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once, children before their parent, siblings in registration order, the root last."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module):
        if id(module) in seen:
            return
        seen.add(id(module))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    visit("", model)
    return out


def stacked_tensors(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """{module name: its own tensors that stack experts}, from the config's ``base_model_ep_plan``
    (``grouped_gemm`` entries, relative to the base model, ``*`` a layer index)."""
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    base = prefix if getattr(model, prefix, None) is not None and getattr(model, prefix) is not model else ""
    patterns = [re.compile(re.escape(f"{base}.{k}" if base else k).replace(r"\*", r"\d+") + "$")
                for k, style in plan.items() if style == "grouped_gemm"]
    out: dict[str, list[str]] = {}
    if not patterns:
        return {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        if any(p.match(name) for p in patterns):
            module, _, tensor = name.rpartition(".")
            out.setdefault(module, []).append(tensor)
    return {k: tuple(v) for k, v in out.items()}


def needed_modules(model: nn.Module, held: Iterable[nn.Module]) -> set[str]:
    """The names of the modules whose own tensors a rank holding the modules ``held`` needs: every module
    owning a parameter or buffer reachable from ``held`` (a tied parameter is owned by its source's
    module too, whose values it takes)."""
    tensors = {id(t) for m in held for t in (*m.parameters(), *m.buffers())}
    names = set()
    for name, module in model.named_modules(remove_duplicate=False):
        own = [*module._parameters.values(), *module._buffers.values()]
        if any(t is not None and id(t) in tensors for t in own):
            names.add(name)
    return names


def _own_meta(module: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in (*module._parameters.values(), *module._buffers.values()))


def _draw(model, name: str, module: nn.Module, seed: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_of(seed, name))
        model._init_weights(module)


def _draw_experts(model, name: str, module: nn.Module, stacked: tuple[str, ...], seed: int) -> None:
    """Expert e's slice of each stacked tensor is ``_init_weights`` of the module with that tensor given a
    leading size of 1, under s(f"{name}/{e}"); the module's other tensors are drawn first, under s(name)."""
    full = {k: module._parameters[k] for k in stacked}
    experts = {int(t.shape[0]) for t in full.values()}
    if len(experts) != 1:
        raise ValueError(f"{name}: stacked expert tensors {sorted(full)} disagree on the number of experts")

    def one():
        for k, t in full.items():
            module._parameters[k] = nn.Parameter(torch.empty((1, *t.shape[1:]), dtype=t.dtype,
                                                             device=MATERIALIZE_DEVICE), requires_grad=t.requires_grad)
    one()
    _draw(model, name, module, seed)   # the module's own unstacked tensors (if any)
    for e in range(experts.pop()):
        one()
        _draw(model, f"{name}/{e}", module, seed)
        with torch.no_grad():
            for k, t in full.items():
                t[e].copy_(module._parameters[k][0])
    for k, t in full.items():
        module._parameters[k] = t


def materialize(model: nn.Module, seed: int, wanted: set[str] | None = None,
                done: Callable[[str, nn.Module], None] | None = None) -> None:
    """Initialize the modules named in ``wanted`` (None: all) by the plan-independent rule, in place; the
    others stay on the meta device. ``done(name, module)`` is called after each module whose subtree holds
    a materialized tensor, once its own draw is over (a caller shards a decoder layer there, so that at
    most one whole module beyond the rank's share is ever held). Ends with ``model.tie_weights()``."""
    stacked = stacked_tensors(model)
    real: set[str] = set()   # modules whose subtree holds a materialized tensor
    with torch.no_grad():
        for name, module in init_order(model):
            own = (wanted is None or name in wanted) and _own_meta(module)
            if own:
                module.to_empty(device=MATERIALIZE_DEVICE, recurse=False)
            below = own or any(f"{name}.{c}" in real if name else c in real for c, _ in module.named_children())
            if not below:
                continue
            real.add(name)
            if own and name in stacked:
                _draw_experts(model, name, module, stacked[name], seed)
            else:
                _draw(model, name, module, seed)
            if done is not None:
                done(name, module)
    model.tie_weights()
