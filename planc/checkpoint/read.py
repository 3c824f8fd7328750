"""Reading a plan-independent checkpoint (format 2, docs/runtime.md) for ``planc checkpoint`` (docs/cli.md).

A checkpoint is a torch.distributed.checkpoint (DCP) folder ``step<N>/`` whose ``planc.json``, written
last, names the run (plan, digest, step, regime, sharding) and lists every file with its size and sha256:
the contract's record ``planc.plan.checkpoint.Manifest``, read and checked by the functions there, the
same ones the runtime's ``--resume`` uses. :func:`open_checkpoint` is the one gate: it finds the folder
(a ``step<N>`` folder or the run folder whose ``latest`` names one), checks planc.json's keys, every
file against its listed size and digest, and that the DCP metadata holds each listed parameter at its
shape, before anything is shown or a tensor read.
Whatever is wrong is a :class:`CheckpointError`: one line naming the folder, exit 2 at the command line.

``planc.checkpoint.command`` shows it (``info``); ``planc.checkpoint.export`` reads its tensors through DCP's
own loader without a process group.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from planc.plan import checkpoint as manifests
from planc.plan.checkpoint import DCP_METADATA, FORMAT, LATEST, Manifest, ManifestError  # noqa: F401 (re-exported)
from planc.plan.checkpoint import MANIFEST as PLANC_JSON

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
    meta: dict                # planc.json as read (its keys and kinds checked: ``manifest``)
    manifest: Manifest        # the same, as the contract's record
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
    ``latest`` names (``planc.plan.checkpoint.resolve``). A folder that is neither says what is missing."""
    try:
        return Path(manifests.resolve(path))
    except ManifestError as e:
        _fail(Path(path), str(e))


def _read_meta(folder: Path) -> tuple[dict, Manifest]:
    """planc.json as read, and its record (``planc.plan.checkpoint.read``: keys, kinds, format)."""
    try:
        meta = manifests.read_json(folder)
        return meta, Manifest.from_json(meta)
    except ManifestError as e:
        _fail(folder, str(e))


def verify_files(folder: Path, manifest: Manifest) -> None:
    """Every listed file has its listed size and sha256, nothing unlisted (``planc.plan.checkpoint``)."""
    try:
        manifests.verify_files(folder, manifest.files)
    except ManifestError as e:
        _fail(folder, str(e))


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
    meta, manifest = _read_meta(folder)
    verify_files(folder, manifest)
    dcp = _read_dcp(folder)
    return Checkpoint(folder, meta, manifest, _parameters(folder, meta, dcp), dcp)
