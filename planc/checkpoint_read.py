"""Reading a plan-independent checkpoint (format 2, docs/runtime.md) for ``planc checkpoint`` (docs/cli.md).

A checkpoint is a torch.distributed.checkpoint (DCP) folder ``step<N>/`` whose ``planc.json``, written
last, names the run (plan, digest, step, regime, sharding) and lists every file with its size and sha256.
:func:`open_checkpoint` is the one gate: it finds the folder (a ``step<N>`` folder or the run folder whose
``latest`` names one), checks planc.json's keys, every file against its listed size and digest, and that
the DCP metadata holds each listed parameter at its shape, before anything is shown or a tensor read.
Whatever is wrong is a :class:`CheckpointError`: one line naming the folder, exit 2 at the command line.

``planc.checkpoint_cmd`` shows it (``info``); ``planc.checkpoint_export`` reads its tensors through DCP's
own loader without a process group.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

PLANC_JSON = "planc.json"
LATEST = "latest"
FORMAT = 2
DCP_METADATA = ".metadata"

# The DCP key prefixes (global names are plan-independent): an fp32 master, and per-parameter optimizer state.
MODEL, OPTIM = "model.", "optim."


class CheckpointError(Exception):
    """A folder that is not a complete, readable checkpoint, or an export it cannot give: one line."""


@dataclass(frozen=True, slots=True)
class Parameter:
    """One entry of planc.json ``parameters`` (model order) with what the DCP metadata says of it."""
    name: str                 # the global name
    shape: tuple[int, ...]
    dtype: str                # the run's parameter dtype (the DCP value is the fp32 master)
    tied: tuple[str, ...]     # other layers' names for the same tensor
    chunks: int               # rectangular chunks the master is stored in
    stored: str               # the DCP dtype of the master
    states: tuple[str, ...]   # optimizer states stored for it (exp_avg, ...), sorted

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    folder: Path              # the step<N> folder
    meta: dict                # planc.json as read
    parameters: tuple[Parameter, ...]
    dcp: object               # torch.distributed.checkpoint.Metadata

    @property
    def hf_config(self) -> dict | None:
        return self.meta.get("hf_config")

    def optim_keys(self, p: Parameter) -> list[str]:
        return [f"{OPTIM}{p.name}.{s}" for s in p.states]


def _fail(folder, what: str):
    raise CheckpointError(f"{folder}: {what}")


def resolve(path: str | os.PathLike) -> Path:
    """The ``step<N>`` folder ``path`` means: itself when it holds planc.json, else the one its
    ``latest`` names. A folder that is neither says what is missing."""
    p = Path(path)
    if not p.exists():
        _fail(p, "no such folder")
    if not p.is_dir():
        _fail(p, "not a folder (a checkpoint is a folder step<N>/, or the run folder whose 'latest' names one)")
    if (p / PLANC_JSON).exists():
        return p
    latest = p / LATEST
    if latest.is_file():
        try:
            name = latest.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            _fail(p, f"cannot read {LATEST}: {getattr(e, 'strerror', None) or e}")
        chosen = p / name
        if not name or Path(name).name != name or not (chosen / PLANC_JSON).is_file():
            _fail(p, f"{LATEST} names {name!r}, which is not a complete checkpoint (no {chosen / PLANC_JSON})")
        return chosen
    if (p / "manifest.json").exists():
        _fail(p, "a checkpoint of the earlier per-rank format (manifest.json, no planc.json): "
                 f"planc checkpoint reads format {FORMAT} only")
    partial = sorted(e.name for e in p.iterdir() if e.name.endswith(".partial"))
    if partial:
        _fail(p, f"only an incomplete checkpoint is here ({', '.join(partial)}: a save that did not finish) "
                 f"and no {LATEST} file")
    _fail(p, f"not a complete checkpoint: no {PLANC_JSON} (it is written last; a folder without it is never "
             f"loaded) and no {LATEST} file naming one")


# ---------------------------------------------------------------- planc.json

def _need(meta: dict, key: str, kind, folder, what: str):
    """``meta[key]`` of the JSON type ``kind``; otherwise a one-line error with the key path."""
    if key not in meta:
        _fail(folder, f"{PLANC_JSON}: key {key!r} is missing")
    v = meta[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
        _fail(folder, f"{PLANC_JSON}: {key}: expected {what}, got {json.dumps(v)[:60]}")
    return v


def _read_meta(folder: Path) -> dict:
    try:
        text = (folder / PLANC_JSON).read_text()
    except (OSError, UnicodeDecodeError) as e:
        _fail(folder, f"cannot read {PLANC_JSON}: {getattr(e, 'strerror', None) or e}")
    try:
        meta = json.loads(text)
    except ValueError as e:
        _fail(folder, f"{PLANC_JSON} is not JSON ({e})")
    if not isinstance(meta, dict):
        _fail(folder, f"{PLANC_JSON}: expected an object, got {type(meta).__name__}")
    fmt = meta.get("format")
    if fmt != FORMAT:
        _fail(folder, f"{PLANC_JSON}: format {json.dumps(fmt)}; planc checkpoint reads format {FORMAT}")
    _need(meta, "step", int, folder, "an integer")
    _need(meta, "plan", str, folder, "a string")
    _need(meta, "digest", str, folder, "a string")
    for key in ("world_size", "global_batch", "micro_batch", "micro_batches", "zero"):
        _need(meta, key, int, folder, "an integer")
    _need(meta, "precision", str, folder, "a string")
    _need(meta, "optimizer", dict, folder, "an object")
    if meta.get("hf_config") is not None and not isinstance(meta["hf_config"], dict):
        _fail(folder, f"{PLANC_JSON}: hf_config: expected an object or null")
    files = _need(meta, "files", dict, folder, "an object {file name: {size, sha256}}")
    for name, rec in files.items():
        if not name or Path(name).name != name or name in (".", ".."):
            _fail(folder, f"{PLANC_JSON}: files: {name!r} is not a file name inside the folder")
        if (not isinstance(rec, dict) or not isinstance(rec.get("size"), int) or isinstance(rec.get("size"), bool)
                or not isinstance(rec.get("sha256"), str)):
            _fail(folder, f"{PLANC_JSON}: files[{json.dumps(name)}]: expected {{\"size\": bytes, \"sha256\": hex}}")
    params = _need(meta, "parameters", list, folder, "a list")
    for i, p in enumerate(params):
        at = f"{PLANC_JSON}: parameters[{i}]"
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            _fail(folder, f"{at}: expected an object with a string 'name'")
        shape = p.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            _fail(folder, f"{at}.shape: expected a list of non-negative integers, got {json.dumps(shape)}")
        if not isinstance(p.get("dtype"), str):
            _fail(folder, f"{at}.dtype: expected a string")
        tied = p.get("tied", [])
        if not isinstance(tied, list) or not all(isinstance(t, str) for t in tied):
            _fail(folder, f"{at}.tied: expected a list of names")
    names = [p["name"] for p in params]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        _fail(folder, f"{PLANC_JSON}: parameters: {dup!r} is listed twice")
    return meta


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_files(folder: Path, files: dict) -> None:
    """Every listed file has its listed size and sha256; the DCP metadata and every ``.distcp`` file in the
    folder are listed (DCP would read them). Sizes first: a cut file is named without hashing anything."""
    if DCP_METADATA not in files:
        _fail(folder, f"{PLANC_JSON}: files does not list the DCP metadata file {DCP_METADATA}")
    for name in sorted(e.name for e in folder.iterdir()):
        if (name == DCP_METADATA or name.endswith(".distcp")) and name not in files:
            _fail(folder, f"{name} is not listed in {PLANC_JSON}'s files (not part of this checkpoint)")
    for name in sorted(files):
        path = folder / name
        if not path.is_file():
            _fail(folder, f"{name} is missing ({PLANC_JSON} lists it with {files[name]['size']} bytes)")
        size = path.stat().st_size
        if size != files[name]["size"]:
            _fail(folder, f"{name} has {size} bytes, {PLANC_JSON} lists {files[name]['size']} (cut or changed)")
    for name in sorted(files):
        got = _sha256(folder / name)
        if got != files[name]["sha256"].lower():
            _fail(folder, f"{name}'s sha256 is {got[:16]}..., {PLANC_JSON} lists {files[name]['sha256'][:16]}... "
                          "(the file was changed or damaged)")


# ---------------------------------------------------------------- the DCP metadata

def _read_dcp(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(folder)).read_metadata()
    except Exception as e:   # a damaged pickle raises anything; it is the user's file, not a bug
        _fail(folder, f"cannot read the DCP metadata {DCP_METADATA}: {type(e).__name__}: {str(e)[:120]}")


def _dtype_name(dtype) -> str:
    import torch
    names = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}
    return names.get(dtype, str(dtype).removeprefix("torch."))


def _parameters(folder: Path, meta: dict, dcp) -> tuple[Parameter, ...]:
    """planc.json's parameters checked against the DCP metadata: each master present at its global shape."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = dcp.state_dict_metadata
    states: dict[str, list[str]] = {}
    listed = {p["name"] for p in meta["parameters"]}
    unlisted = sorted(k for k in entries if k.startswith(MODEL) and k[len(MODEL):] not in listed)
    if unlisted:
        _fail(folder, f"the DCP metadata holds {unlisted[0]!r}, which {PLANC_JSON}'s parameters do not list")
    for key in entries:
        if key.startswith(OPTIM):
            name, _, state = key[len(OPTIM):].rpartition(".")
            if name in listed:
                states.setdefault(name, []).append(state)
    out = []
    for p in meta["parameters"]:
        key, shape = MODEL + p["name"], tuple(p["shape"])
        md = entries.get(key)
        if not isinstance(md, TensorStorageMetadata):
            _fail(folder, f"{PLANC_JSON} lists parameter {p['name']!r} but the DCP metadata holds no tensor {key!r}")
        if tuple(md.size) != shape:
            _fail(folder, f"{key}: the DCP metadata gives shape {list(md.size)}, {PLANC_JSON} {list(shape)}")
        for s in states.get(p["name"], []):
            sm = entries[f"{OPTIM}{p['name']}.{s}"]
            if not isinstance(sm, TensorStorageMetadata) or tuple(sm.size) != shape:
                _fail(folder, f"{OPTIM}{p['name']}.{s}: expected a tensor of the parameter's shape {list(shape)}")
        out.append(Parameter(p["name"], shape, p["dtype"], tuple(p.get("tied", [])), len(md.chunks),
                             _dtype_name(md.properties.dtype), tuple(sorted(states.get(p["name"], [])))))
    return tuple(out)


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The complete checkpoint ``path`` means, checked (files, planc.json, DCP metadata) before any
    tensor is read; :class:`CheckpointError` otherwise."""
    folder = resolve(path)
    meta = _read_meta(folder)
    verify_files(folder, meta["files"])
    dcp = _read_dcp(folder)
    return Checkpoint(folder, meta, _parameters(folder, meta, dcp), dcp)
