"""``model``, ``loss`` and ``data``: references to Python functions, with the model's arguments, or a
Hugging Face model (``model hf "ARCH" { config keys }`` / ``model hf "dir"``)."""

from __future__ import annotations

from planc import ir
from planc.lang import ast
from planc.lang.check.values import IDENT, Diagnostics, plain_value

__all__ = ["check_code"]


def _args(errs: Diagnostics, block: ast.CodeBlock, what: str = "argument") -> tuple:
    args, seen = [], set()
    for kv in block.args:
        if kv.key.value in seen:
            errs.add(f"{what} '{kv.key.value}' is given twice", kv.key.span)
        seen.add(kv.key.value)
        args.append((kv.key.value, plain_value(errs, kv.value)))
    return tuple(args)


def _check_hf(errs: Diagnostics, block: ast.CodeBlock) -> ir.HfModel | None:
    """``"LlamaForCausalLM"`` (a name: a transformers class, checked against transformers by the probe)
    with config keys, or a folder (anything else) without keys."""
    ref = block.ref.value
    spans = tuple((kv.key.value, kv.key.span) for kv in block.args)
    if not ref.strip():
        errs.add('model hf needs a transformers class ("LlamaForCausalLM") or a model folder', block.ref.span)
        return None
    if IDENT.fullmatch(ref):   # a class name; a folder is a path ("./name", "models/x")
        return ir.HfModel(ref, None, _args(errs, block, "config key"), block.span, block.ref.span, spans)
    if block.args:
        errs.add(f"a model folder takes no config keys (they are its config.json's); \"{ref}\" is read as a folder "
                 "because it is not a class name", block.args[0].key.span)
        return None
    return ir.HfModel(None, ref, (), block.span, block.ref.span, spans)


def check_code(errs: Diagnostics, block: ast.CodeBlock | None) -> ir.CodeRef | ir.HfModel | None:
    """``"file.py:function"`` and its arguments as plain data (paths stay relative to the plan)."""
    if block is None:
        return None
    if block.hf:
        return _check_hf(errs, block)
    ref = block.ref.value
    path, sep, fn = ref.rpartition(":")
    if not sep or not path.endswith(".py") or not IDENT.fullmatch(fn):
        errs.add(f"{block.kind} must be written \"file.py:function\", got \"{ref}\"", block.ref.span)
        return None
    return ir.CodeRef(path, fn, _args(errs, block), block.span)
