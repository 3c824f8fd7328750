"""``planc checkpoint export``: a checked format-2 checkpoint as one torch state dict or a Hugging Face folder.

Tensors are read by torch.distributed.checkpoint's own loader with no process group (``dcp.load(...,
no_dist=True)``): it assembles each global tensor from whatever chunks the saving ranks wrote, so the
export does not depend on the plan that saved it. Only the keys asked for are read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from planc.checkpoint.read import MODEL, Checkpoint, CheckpointError
from planc.resources import publish

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}   # --dtype and planc.json precision
TIED_HEAD = "lm_head.weight"     # what transformers leaves out of a model with tie_word_embeddings
HF_FILES = ("config.json", "model.safetensors")


def load_tensors(ck: Checkpoint, keys: list[str]) -> dict:
    """``{DCP key: tensor}`` for ``keys``, each assembled at its global shape and stored dtype."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    entries = ck.dcp.state_dict_metadata
    state = {k: torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype) for k in keys}
    try:
        with warnings.catch_warnings():   # "no process group: loading in a single process" is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(ck.folder)), no_dist=True)
    except Exception as e:   # a file changed after it was checked, or DCP refusing the folder
        raise CheckpointError(f"{ck.folder}: DCP could not read the tensors: {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:160]}") from None
    return state


def export_torch(ck: Checkpoint, out: str | os.PathLike, optimizer: bool) -> str:
    """``torch.save`` of ``{global name: fp32 master}`` in model order, then (``optimizer``) each
    parameter's ``optim.<name>.<state>``; written to ``OUT.partial`` and renamed. Returns a summary line."""
    import torch

    out = Path(out)
    if out.is_dir():
        raise CheckpointError(f"--torch {out}: is a folder (give the .pt file to write)")
    keys = [MODEL + p.name for p in ck.parameters]
    if optimizer:
        keys += [k for p in ck.parameters for k in ck.optim_keys(p)]
    loaded = load_tensors(ck, keys)
    state = {(k[len(MODEL):] if k.startswith(MODEL) else k): loaded[k].to(torch.float32) for k in keys}
    tmp = out.with_name(out.name + ".partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:   # a file object: the archive's inner name is torch's fixed one, not OUT's
            torch.save(state, f)
        publish(tmp)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"--torch {out}: {e.strerror or e}") from None
    n_optim = len(keys) - len(ck.parameters)
    what = f"{len(ck.parameters)} parameters" + (f" and {n_optim} optimizer state tensors" if n_optim else "")
    none = "; the checkpoint holds no optimizer state" if optimizer and not n_optim else ""
    return f"wrote {out}: {what} in fp32, step {ck.meta['step']}{none}"


def _expected_keys(config: dict, folder: Path) -> dict[str, tuple[int, ...]]:
    """The parameter names and shapes ``AutoModelForCausalLM`` builds for ``config`` (on the meta device:
    no memory, no weights), one name per tied tensor."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise CheckpointError("export --hf needs transformers (pip install 'planc[hf]')") from None
    try:
        cfg = AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:   # an architecture this transformers does not know, a bad config
        raise CheckpointError(f"{folder}: transformers cannot build a causal LM from hf_config: "
                              f"{type(e).__name__}: {' '.join(str(e).split())[:160]}") from None
    # parameters, not the state dict: a checkpoint holds parameters only, and a tied tensor once, under the
    # name met first (named_parameters drops the repeats), as save_pretrained writes it
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def export_hf(ck: Checkpoint, out: str | os.PathLike, dtype: str | None) -> str:
    """``OUT/config.json`` (planc.json's hf_config, ``dtype`` set) and ``OUT/model.safetensors`` (every
    weight at ``dtype``, the run's precision by default; a tied head stored once) that
    ``AutoModelForCausalLM.from_pretrained(OUT)`` loads. The names are checked against the model
    transformers builds from the config first, so a partial or foreign checkpoint is refused by name."""
    import torch

    hf = ck.hf_config
    if hf is None:
        raise CheckpointError(f"{ck.folder}: not a Hugging Face model's checkpoint (planc.json hf_config is null: "
                              "a builder model); export it with --torch")
    dtype = dtype or ck.meta["precision"]
    if dtype not in DTYPES:
        raise CheckpointError(f"{ck.folder}: precision {dtype!r} has no Hugging Face dtype; give --dtype bf16|fp32")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--hf {out}: is a file (give the folder to write)")
    others = sorted(e.name for e in out.iterdir() if e.name not in HF_FILES) if out.is_dir() else []
    if others:   # an older export's shards or index would be loaded beside (or instead of) the new file
        raise CheckpointError(f"--hf {out}: the folder holds other files ({', '.join(others[:3])}"
                              f"{', ...' if len(others) > 3 else ''}); give a new or empty folder")
    names = {p.name: MODEL + p.name for p in ck.parameters}   # global names are HF's (planc_param_names)
    config = {**hf, "dtype": DTYPES[dtype]}
    if "torch_dtype" in hf:
        config["torch_dtype"] = DTYPES[dtype]
    expected = _expected_keys(config, ck.folder)
    missing = [n for n in expected if n not in names]
    extra = [n for n in names if n not in expected]
    if TIED_HEAD in extra and hf.get("tie_word_embeddings"):   # dropping the run's own head would lose it
        raise CheckpointError(f"{ck.folder}: hf_config ties the word embeddings (tie_word_embeddings) but the "
                              f"checkpoint holds {TIED_HEAD} as a parameter of its own")
    if missing or extra:
        what = ([f"no {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")] if missing
                else []) + ([f"{extra[0]} is not a weight of the model" + (f" (and {len(extra) - 1} more)"
                                                                           if len(extra) > 1 else "")] if extra else [])
        raise CheckpointError(f"{ck.folder}: the parameters do not match the {config.get('model_type', '?')} model "
                              f"hf_config describes: {'; '.join(what)}")
    shapes = {p.name: p.shape for p in ck.parameters}
    wrong = next((n for n in expected if expected[n] != shapes[n]), None)
    if wrong is not None:
        raise CheckpointError(f"{ck.folder}: {wrong} has shape {list(shapes[wrong])}, the model hf_config describes "
                              f"{list(expected[wrong])}")
    from safetensors.torch import save_file   # installed with transformers, which _expected_keys needed

    loaded = load_tensors(ck, [names[n] for n in expected])
    target = getattr(torch, DTYPES[dtype])
    tensors = {n: loaded[names[n]].to(target).contiguous() for n in expected}
    tmp = out / "model.safetensors.partial"
    try:
        created = not out.exists()   # a folder that was there keeps its mode
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json.partial").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        publish(*([out] if created else []), out / "config.json.partial")
        os.replace(out / "config.json.partial", out / "config.json")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        publish(tmp)
        os.replace(tmp, out / "model.safetensors")
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"--hf {out}: {e.strerror or e}") from None
    tied = ", lm_head tied to the embeddings (stored once)" if hf.get("tie_word_embeddings") else ""
    return (f"wrote {out}/config.json and {out}/model.safetensors: {len(tensors)} tensors in {dtype}{tied}, "
            f"step {ck.meta['step']}; load with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
