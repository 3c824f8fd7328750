"""A checkpoint's manifest, ``planc.json`` (format 2, docs/runtime.md "Checkpoints"), as one typed record
for its writer and both its readers: the runtime (``train.py --save`` / ``--resume``,
``planc.runtime.checkpoint``) and ``planc checkpoint`` (``planc.checkpoint_read``). Stdlib only (part
of the contract, copied into every output).

    DIR/step<N>/.metadata, *.distcp   the torch.distributed.checkpoint folder the manifest lists
    DIR/step<N>/planc.json            written last: the run, its data position, RNG states,
                                      parameters, sharding, every file's size and sha256
    DIR/latest                        "step<N>", the newest complete checkpoint (replaced atomically)

    resolve(path) -> str             the step<N> folder ``path`` means (itself, or what its latest names)
    read(folder) -> Manifest         planc.json read and checked (keys, kinds, format)
    verify_files(folder, files)      every listed file there with its size and sha256; nothing unlisted
    write(folder, manifest), write_latest(directory, name)   atomic (written aside, fsynced, renamed)

Whatever is wrong is a :class:`ManifestError` of one line that does not name the folder: each reader
says which folder, in its own words (``--resume DIR: ...``, ``DIR: ...``).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

__all__ = ["FORMAT", "MANIFEST", "LATEST", "DCP_METADATA", "ManifestError", "FileEntry", "Manifest", "resolve",
           "read", "read_json", "verify_files", "write", "write_latest", "sha256_of", "file_entry", "fsync_dir"]

FORMAT = 2
MANIFEST = "planc.json"
LATEST = "latest"
DCP_METADATA = ".metadata"


class ManifestError(ValueError):
    """A folder that is not a complete checkpoint, or a planc.json that is not format 2: one line."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    sha256: str

    def to_json(self) -> dict:
        return {"size": self.size, "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class Manifest:
    """planc.json. ``parameters``: model order, each ``{name, shape, dtype[, tied]}``; ``regime``: the
    training regime's position (``loss_scale``, ``good_steps``, ``skipped_steps``, ``t``); ``data``:
    ``{"drawn": batches}``; ``rng``: rank -> serialized RNG state; ``extra``: keys of a later planc, kept."""
    plan: str
    digest: str
    step: int
    world_size: int
    global_batch: int
    micro_batch: int
    micro_batches: int
    precision: str
    zero: int
    optimizer: dict
    parameters: tuple
    files: dict                          # file name -> FileEntry
    lr_schedule: object = None
    model: object = None
    hf_config: dict | None = None
    regime: dict | None = None
    data: dict = field(default_factory=lambda: {"drawn": 0})
    rng: dict = field(default_factory=dict)
    sharding: object = None
    extra: tuple = ()

    KEYS = ("format", "plan", "digest", "step", "world_size", "global_batch", "micro_batch", "micro_batches",
            "precision", "zero", "optimizer", "lr_schedule", "model", "hf_config", "parameters", "regime", "data",
            "rng", "sharding", "files", "bytes")

    @property
    def format(self) -> int:
        return FORMAT

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def drawn(self) -> int:
        return int(self.data.get("drawn", 0))

    def to_json(self) -> dict:
        out = {"format": FORMAT, "plan": self.plan, "digest": self.digest, "step": self.step,
               "world_size": self.world_size, "global_batch": self.global_batch, "micro_batch": self.micro_batch,
               "micro_batches": self.micro_batches, "precision": self.precision, "zero": self.zero,
               "optimizer": self.optimizer, "lr_schedule": self.lr_schedule, "model": self.model,
               "hf_config": self.hf_config, "parameters": [dict(p) for p in self.parameters],
               "regime": self.regime, "data": self.data, "rng": self.rng, "sharding": self.sharding,
               "files": {k: v.to_json() for k, v in sorted(self.files.items())}, "bytes": self.bytes}
        out.update(dict(self.extra))
        return out

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(meta) -> "Manifest":
        """The record of a planc.json as read; ManifestError (one line, the key path) when it is not format 2."""
        if not isinstance(meta, dict):
            raise ManifestError(f"{MANIFEST}: expected an object, got {type(meta).__name__}")
        fmt = meta.get("format")
        if fmt != FORMAT:
            raise ManifestError(f"{MANIFEST} is not a planc checkpoint of format {FORMAT} (format {json.dumps(fmt)}); "
                                f"this planc reads format {FORMAT} only")
        ints = {k: _need(meta, k, int, "an integer")
                for k in ("step", "world_size", "global_batch", "micro_batch", "micro_batches", "zero")}
        strs = {k: _need(meta, k, str, "a string") for k in ("plan", "digest", "precision")}
        optimizer = _need(meta, "optimizer", dict, "an object")
        hf_config = meta.get("hf_config")
        if hf_config is not None and not isinstance(hf_config, dict):
            raise ManifestError(f"{MANIFEST}: hf_config: expected an object or null")
        for key in ("regime", "data", "rng"):
            if meta.get(key) is not None and not isinstance(meta[key], dict):
                raise ManifestError(f"{MANIFEST}: {key}: expected an object, got {json.dumps(meta[key])[:60]}")
        data = meta.get("data") or {"drawn": 0}
        if not isinstance(data.get("drawn", 0), int) or isinstance(data.get("drawn"), bool) or data.get("drawn", 0) < 0:
            raise ManifestError(f"{MANIFEST}: data.drawn: expected a non-negative integer, "
                                f"got {json.dumps(data.get('drawn'))[:60]}")
        rng = meta.get("rng") or {}
        if not all(isinstance(v, str) for v in rng.values()):
            raise ManifestError(f"{MANIFEST}: rng: expected rank -> serialized state (a string)")
        return Manifest(**strs, **ints, optimizer=optimizer, parameters=_parameters(meta), files=_files(meta),
                        lr_schedule=meta.get("lr_schedule"), model=meta.get("model"), hf_config=hf_config,
                        regime=meta.get("regime"), data=data, rng=rng, sharding=meta.get("sharding"),
                        extra=tuple((k, v) for k, v in sorted(meta.items()) if k not in Manifest.KEYS))


def _need(meta: dict, key: str, kind, what: str):
    """``meta[key]`` of the JSON type ``kind``; otherwise a one-line error with the key path."""
    if key not in meta:
        raise ManifestError(f"{MANIFEST}: key {key!r} is missing")
    v = meta[key]
    if not isinstance(v, kind) or (isinstance(v, bool) and kind is int):
        raise ManifestError(f"{MANIFEST}: {key}: expected {what}, got {json.dumps(v)[:60]}")
    return v


def _files(meta: dict) -> dict:
    files = _need(meta, "files", dict, "an object {file name: {size, sha256}}")
    out = {}
    for name, rec in files.items():
        if not name or os.path.basename(name) != name or name in (".", ".."):
            raise ManifestError(f"{MANIFEST}: files: {name!r} is not a file name inside the folder")
        if (not isinstance(rec, dict) or not isinstance(rec.get("size"), int) or isinstance(rec.get("size"), bool)
                or not isinstance(rec.get("sha256"), str)):
            raise ManifestError(f"{MANIFEST}: files[{json.dumps(name)}]: expected {{\"size\": bytes, \"sha256\": hex}}")
        out[name] = FileEntry(rec["size"], rec["sha256"])
    return out


def _parameters(meta: dict) -> tuple:
    params = _need(meta, "parameters", list, "a list")
    for i, p in enumerate(params):
        at = f"{MANIFEST}: parameters[{i}]"
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            raise ManifestError(f"{at}: expected an object with a string 'name'")
        shape = p.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise ManifestError(f"{at}.shape: expected a list of non-negative integers, got {json.dumps(shape)}")
        if not isinstance(p.get("dtype"), str):
            raise ManifestError(f"{at}.dtype: expected a string")
        tied = p.get("tied", [])
        if not isinstance(tied, list) or not all(isinstance(t, str) for t in tied):
            raise ManifestError(f"{at}.tied: expected a list of names")
    names = [p["name"] for p in params]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ManifestError(f"{MANIFEST}: parameters: {dup!r} is listed twice")
    return tuple(params)


# ---------------------------------------------------------------- the folder

def resolve(path) -> str:
    """The ``step<N>`` folder ``path`` means: itself when it holds planc.json, else the one its ``latest``
    names. A folder that is neither says what is missing."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ManifestError("no such checkpoint folder")
    if not os.path.isdir(path):
        raise ManifestError("not a folder (a checkpoint is a folder step<N>/, or the run folder whose "
                            f"'{LATEST}' names one)")
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        try:
            with open(latest) as f:
                name = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ManifestError(f"cannot read {LATEST}: {getattr(e, 'strerror', None) or e}") from None
        chosen = os.path.join(path, name)
        if not name or os.path.basename(name) != name or not os.path.isfile(os.path.join(chosen, MANIFEST)):
            raise ManifestError(f"{LATEST} names {name!r}, which is not a complete checkpoint "
                                f"(no {os.path.join(chosen, MANIFEST)})")
        return chosen
    if os.path.exists(os.path.join(path, "manifest.json")):
        raise ManifestError(f"a checkpoint of the earlier per-rank format (manifest.json, no {MANIFEST}): "
                            f"planc reads format {FORMAT} only")
    partial = sorted(e for e in os.listdir(path) if e.endswith(".partial"))
    if partial:
        raise ManifestError(f"only an incomplete checkpoint is there ({', '.join(partial)}: a save that did not "
                            f"finish, never loaded); no {LATEST} file")
    raise ManifestError(f"not a checkpoint: no {MANIFEST} (it is written last: an incomplete checkpoint is never "
                        f"loaded) and no {LATEST} file naming one")


def read(folder) -> Manifest:
    """planc.json of the checkpoint folder ``folder``, read and checked (``Manifest.from_json``)."""
    return Manifest.from_json(read_json(folder))


def read_json(folder):
    """planc.json of ``folder`` as JSON, unchecked (``Manifest.from_json`` checks it)."""
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"cannot read {MANIFEST}: {getattr(e, 'strerror', None) or e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise ManifestError(f"{MANIFEST} is not JSON ({e})") from None


def sha256_of(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_entry(path) -> FileEntry:
    return FileEntry(os.path.getsize(path), sha256_of(path))


def verify_files(folder, files: dict) -> None:
    """Every listed file has its listed size and sha256; the DCP metadata and every ``.distcp`` file in the
    folder are listed (DCP would read them). Sizes first: a cut file is named without hashing anything."""
    folder = os.fspath(folder)
    if DCP_METADATA not in files:
        raise ManifestError(f"{MANIFEST}: files does not list the DCP metadata file {DCP_METADATA}")
    for name in sorted(os.listdir(folder)):
        if (name == DCP_METADATA or name.endswith(".distcp")) and name not in files:
            raise ManifestError(f"{name} is not listed in {MANIFEST}'s files (not part of this checkpoint)")
    for name in sorted(files):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ManifestError(f"{name} is missing ({MANIFEST} lists it with {files[name].size} bytes)")
        size = os.path.getsize(path)
        if size != files[name].size:
            raise ManifestError(f"{name} has {size} bytes, {MANIFEST} lists {files[name].size} (cut or changed)")
    for name in sorted(files):
        path = os.path.join(folder, name)
        got = sha256_of(path)
        if got != files[name].sha256.lower():
            raise ManifestError(f"{name}'s sha256 is {got[:16]}..., {MANIFEST} lists {files[name].sha256[:16]}... "
                                "(the file was changed or damaged)")


# ---------------------------------------------------------------- writing

def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write(folder, manifest: Manifest) -> None:
    """planc.json into ``folder`` (the last file of a save), atomically."""
    _write_atomic(os.path.join(folder, MANIFEST), manifest.dumps().encode())


def write_latest(directory, name: str) -> None:
    """``directory/latest`` names ``name`` (replaced atomically)."""
    _write_atomic(os.path.join(directory, LATEST), (name + "\n").encode())
