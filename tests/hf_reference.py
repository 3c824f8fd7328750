"""The initialization LANGUAGE.md ("Hugging Face models") prescribes, written again from its words for the
tests' single-process references; it imports nothing of planc.

    build on the meta device (``from_config``); visit every module depth-first, children before their
    parent, siblings in registration order, the root last; materialize the module's own tensors on the
    CPU; run the model's ``_init_weights(module)`` under ``torch.manual_seed(s(name))``,
    s(x) = int.from_bytes(sha256(f"{seed}/{x}").digest()[:8], "little") % 2**63; stacked expert tensors
    (``grouped_gemm`` entries of ``base_model_ep_plan``) expert by expert; then ``tie_weights()``.
"""
from __future__ import annotations

import hashlib
import re

import torch


def s(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") % 2 ** 63


def _postorder(module, name=""):
    for child_name, child in module._modules.items():
        if child is not None:
            yield from _postorder(child, f"{name}.{child_name}" if name else child_name)
    yield name, module


def _materialize_own(module) -> None:
    for key, t in list(module._parameters.items()):
        if t is not None and t.device.type == "meta":
            module._parameters[key] = torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype),
                                                         requires_grad=t.requires_grad)
    for key, t in list(module._buffers.items()):
        if t is not None and t.device.type == "meta":
            module._buffers[key] = torch.empty(t.shape, dtype=t.dtype)


def _seeded(seed: int, fn) -> None:
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        fn()
    finally:
        torch.set_rng_state(state)


def spec_model(config, seed: int, attn_implementation: str = "sdpa"):
    """The causal LM of ``config`` as LANGUAGE.md initializes it, every module materialized, training mode."""
    import transformers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    ep = {k for k, v in (getattr(model.config, "base_model_ep_plan", None) or {}).items() if v == "grouped_gemm"}
    base = model.base_model_prefix
    stacked_names = [re.compile(re.escape(f"{base}.{k}").replace(r"\*", r"\d+") + "$") for k in ep]
    seen = set()
    with torch.no_grad():
        for name, module in _postorder(model):
            if id(module) in seen:
                continue
            seen.add(id(module))
            _materialize_own(module)
            stacked = [k for k in module._parameters if any(r.match(f"{name}.{k}") for r in stacked_names)]
            if not stacked:
                _seeded(s(seed, name), lambda: model._init_weights(module))
                continue
            whole = {k: module._parameters[k] for k in stacked}
            for k, t in whole.items():
                module._parameters[k] = torch.nn.Parameter(torch.empty((1, *t.shape[1:])))
            _seeded(s(seed, name), lambda: model._init_weights(module))
            for e in range(next(iter(whole.values())).shape[0]):
                for k, t in whole.items():
                    module._parameters[k] = torch.nn.Parameter(torch.empty((1, *t.shape[1:])))
                _seeded(s(seed, f"{name}/{e}"), lambda: model._init_weights(module))
                for k, t in whole.items():
                    t[e] = module._parameters[k][0]
            for k, t in whole.items():
                module._parameters[k] = t
    model.tie_weights()
    model.train()
    return model
