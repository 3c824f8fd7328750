"""Checkpoints of a training run: ``train.py --save DIR`` writes them, ``train.py --resume DIR`` continues,
under the plan that wrote them or any other plan of the same model and global batch.

Layout (format 2, docs/runtime.md "Checkpoints")::

    DIR/step<N>/.metadata, *.distcp   a torch.distributed.checkpoint folder: ``model.<name>`` (fp32 masters)
                                      and ``optim.<name>.<state>`` at global names and shapes, each rank
                                      writing the rectangles it owns (``ckpt_dcp``, ``ckpt_state``)
    DIR/step<N>/planc.json            written last: plan, digest, step, batch sizes, regime, data position,
                                      every rank's RNG states, parameters, sharding, every file's size and
                                      sha256
    DIR/latest                        "step<N>", the newest complete checkpoint (replaced atomically)

A save is collective over the world (idle ranks take part, with nothing to write). The folder is written
as ``DIR/.step<N>.partial/`` and renamed when complete; a folder without ``planc.json``, or whose files do
not match it, is never loaded (checked before any process group starts). planc.json is the contract's
record ``planc.plan.checkpoint.Manifest``, written and read (and its files checked) by the functions there,
the same ones ``planc checkpoint`` reads it with.
"""
from __future__ import annotations

import base64
import io
import os
import random
import shutil
import time

import torch
import torch.distributed as dist

from planc.plan import checkpoint as manifests

# the contract's (planc/plan/checkpoint.py), named here as the runtime always had them
FORMAT, MANIFEST, LATEST = manifests.FORMAT, manifests.MANIFEST, manifests.LATEST
Manifest, ManifestError = manifests.Manifest, manifests.ManifestError


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or resumed from; the message names the folder and why."""

    same_on_every_rank = True   # every rank reads the same manifest and finds the same problem


# ---------------------------------------------------------------- data position

class CountingIterator:
    """An iterator that counts the items drawn; ``skip(n)`` replays (draws and drops) ``n`` of them."""

    def __init__(self, it):
        self.it, self.drawn = iter(it), 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.it)
        self.drawn += 1
        return item

    def skip(self, n: int) -> None:
        for i in range(n):
            try:
                next(self)
            except StopIteration:
                raise CheckpointError(f"the data stream ended after {i} batch(es), but the checkpoint "
                                      f"was taken after {n}") from None


# ---------------------------------------------------------------- RNG

def rng_state() -> str:
    """This rank's torch (CPU and CUDA) and Python RNG states, serialized (base64 of ``torch.save``)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    buf = io.BytesIO()
    torch.save(state, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def set_rng_state(text: str) -> None:
    state = torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- files

def _gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _own_files(folder: str, rank: int) -> dict:
    """Size and sha256 of the files of ``folder`` this rank wrote (DCP names them ``__<rank>_<n>.distcp``;
    rank 0 also wrote ``.metadata``)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith(f"__{rank}_") or (rank == 0 and name == ".metadata"):
            path = os.path.join(folder, name)
            out[name] = manifests.file_entry(path)
    return out


# ---------------------------------------------------------------- what planc.json says of the run

def model_parameters(described: list) -> list[dict]:
    """planc.json's ``parameters`` from every rank's ``(layer, entry)`` list: each name once, in model order
    (by layer, then the order of the layer's ``named_parameters``)."""
    seen, out = set(), []
    for layer, pos, entry in sorted((layer, pos, e) for d in described if d for pos, (layer, e) in enumerate(d)):
        if entry["name"] not in seen:
            seen.add(entry["name"])
            out.append(entry)
    return out


def describe_rank(engine):
    """What a rank tells rank 0 for planc.json (collected by every rank: the same list on all of them)."""
    from .ckpt_dcp import stage_params
    if engine is None:
        return None
    return [(i.layer, i.entry()) for i in stage_params(engine.module)]


def _hf_config(engine):
    if engine is None:
        return None
    for layer in engine.module.forward_funcs:
        config = getattr(layer, "config", None)
        if hasattr(config, "to_dict"):
            return config.to_dict()
    return None


def _sharding(plan) -> dict:
    stages = []
    for st in plan.stages:
        axes = dict(zip(st.mesh_axes, st.mesh_shape))
        stages.append({"index": st.index, "layers": list(st.layers), "mesh": list(st.mesh_shape),
                       "tensor": axes.get("tensor", 1), "data": axes.get("data", 1), "devices": list(st.devices)})
    return {"stages": stages}


# ---------------------------------------------------------------- save

def save(directory: str, step: int, plan, digest: str, engine, data: CountingIterator | None) -> str:
    """Collective over the world: the state at the end of ``step`` steps into ``DIR/step<N>`` (format 2).
    Every rank learns of any rank's failure and raises the same CheckpointError. Returns the folder."""
    from torch.distributed import checkpoint as dcp
    from .ckpt_dcp import RectSavePlanner
    from .ckpt_state import save_chunks
    rank = dist.get_rank()
    name = f"step{step}"
    final = os.path.join(directory, name)
    partial = os.path.join(directory, f".{name}.partial")
    problem = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)   # a save of this step that was interrupted
            os.makedirs(partial)
        except OSError as e:
            problem = f"cannot create {partial}: {e}"
    chunks = {}
    if problem is None:
        try:
            chunks = save_chunks(engine) if engine is not None else {}
        except Exception as e:  # noqa: BLE001 - reported by every rank together, not left to hang the others
            problem = f"rank {rank} cannot collect its state: {type(e).__name__}: {e}"
    regime = engine.regime if engine is not None else None
    mine = {"rng": rng_state(), "drawn": data.drawn if data is not None else 0,
            "params": describe_rank(engine), "hf_config": _hf_config(engine),
            "regime": None if regime is None else {"loss_scale": regime.scale, "good_steps": regime.clean,
                                                   "skipped_steps": int(engine.skipped_steps), "t": regime.t}}
    gathered = _gather((mine, problem))
    problems = [p for _, p in gathered if p]
    if problems:
        raise CheckpointError(f"checkpoint step {step} not saved:\n  " + "\n  ".join(dict.fromkeys(problems)))
    try:
        dcp.save({}, storage_writer=dcp.FileSystemWriter(partial, thread_count=1), planner=RectSavePlanner(chunks))
        files = _own_files(partial, rank)
    except Exception as e:  # noqa: BLE001 - DCP raises on every rank when any rank's write failed
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        files, problem = None, f"rank {rank} cannot write into {partial}: {type(e).__name__}: {first}"
    written = _gather((files, problem))
    problems = [p for _, p in written if p]
    if rank == 0 and not problems:
        states = [m for m, _ in gathered]
        train = plan.train
        manifest = Manifest(
            plan=plan.name, digest=digest, step=step, world_size=len(states),
            global_batch=train.micro_batch * train.micro_batches, micro_batch=train.micro_batch,
            micro_batches=train.micro_batches, precision=str(train.precision), zero=train.zero,
            optimizer=train.optimizer.to_json(), lr_schedule=train.lr_schedule.to_json(),
            model=train.model.to_json(True),
            hf_config=next((m["hf_config"] for m in states if m["hf_config"] is not None), None),
            parameters=tuple(model_parameters([m["params"] for m in states])),
            regime=next((m["regime"] for m in states if m["regime"] is not None), None),
            data={"drawn": max(m["drawn"] for m in states)},
            rng={str(r): m["rng"] for r, m in enumerate(states)},
            sharding=_sharding(plan),
            files={k: v for f, _ in written for k, v in f.items()})
        try:
            manifests.fsync_dir(partial)
            manifests.write(partial, manifest)
            if os.path.exists(final):   # saved before (a resumed run passing the same step): replace it
                old = os.path.join(directory, f".{name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                os.rename(partial, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(partial, final)
            manifests.fsync_dir(directory)
            manifests.write_latest(directory, name)
        except OSError as e:
            problem = f"rank 0 cannot complete {final}: {e}"
    problems += [p for p in _gather(problem if rank == 0 else None) if p]
    if problems:
        raise CheckpointError(f"checkpoint step {step} not saved:\n  " + "\n  ".join(dict.fromkeys(problems)))
    return final


# ---------------------------------------------------------------- resume: checks before any process group

def resolve(path: str) -> str:
    """The complete checkpoint folder ``--resume PATH`` means: PATH itself if it holds planc.json, else the
    one PATH/latest names (``planc.plan.checkpoint.resolve``). Raises CheckpointError saying what is missing."""
    if path is None:
        raise CheckpointError("--weights-only goes with --resume DIR")
    try:
        return manifests.resolve(path)
    except ManifestError as e:
        raise CheckpointError(f"--resume {path}: {e}") from None


def check(path: str, plan, weights_only: bool = False) -> Manifest:
    """planc.json of the checkpoint folder ``path`` (see ``resolve``), read and checked against every file it
    lists (present, same size and sha256; no other ``.distcp`` file; ``planc.plan.checkpoint``) and against
    this run's global batch and optimizer (unless ``weights_only``). Pure: every rank finds the same answer,
    before the process group starts."""
    try:
        manifest = manifests.read(path)
        manifests.verify_files(path, manifest.files)
    except ManifestError as e:
        raise CheckpointError(f"--resume {path}: {e}") from None
    train = plan.train
    batch = train.micro_batch * train.micro_batches
    if not weights_only and manifest.global_batch != batch:
        raise CheckpointError(f"--resume {path}: the checkpoint was trained with a global batch of "
                              f"{manifest.global_batch} samples ({manifest.micro_batch} x "
                              f"{manifest.micro_batches}), this plan's is {batch} ({train.micro_batch} x "
                              f"{train.micro_batches}): its data position does not carry over (--weights-only "
                              f"takes the weights alone)")
    if not weights_only and manifest.optimizer.get("name") != train.optimizer.name:
        raise CheckpointError(f"--resume {path}: the checkpoint's optimizer is "
                              f"{manifest.optimizer.get('name')!r}, this plan's is "
                              f"{train.optimizer.name!r}: its state does not carry over (--weights-only takes "
                              f"the weights alone)")
    return manifest


# ---------------------------------------------------------------- resume: collective, once the engines exist

def compare_models(mine: list[dict], theirs: list[dict]) -> str | None:
    """None when both parameter lists have the same names and shapes in the same order; else the first
    (up to three) parameters that differ, in words."""
    diffs = []
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else None
        b = theirs[i] if i < len(theirs) else None
        if a is not None and b is not None and (a["name"], list(a["shape"])) == (b["name"], list(b["shape"])):
            continue
        here = f"{a['name']} {list(a['shape'])}" if a else "nothing"
        there = f"{b['name']} {list(b['shape'])}" if b else "nothing"
        diffs.append(f"parameter {i} is {here} here, {there} in the checkpoint")
        if len(diffs) == 3:
            break
    if not diffs:
        return None
    return (f"this model has {len(mine)} parameters, the checkpoint's {len(theirs)}; " if len(mine) != len(theirs)
            else "") + "; ".join(diffs)


def restore(path: str, manifest: Manifest, plan, engine, data: CountingIterator | None, weights_only: bool) -> int:
    """Collective over the world: the checked checkpoint ``path`` into this run, under this run's plan.
    Each stage rank reads the rectangles of its masters and optimizer state its plan gives it (DCP
    resharding); the schedule's t, loss scale and step counters, the data position (global: the samples
    drawn) and the RNG states (the state of the rank with this rank's number if the writing run had one,
    else rank 0's) follow. ``weights_only``: the masters alone (fresh optimizer, step 0, fresh data and
    RNG). Returns the step to continue from and the seconds the restore took (from when every rank is in it)."""
    from torch.distributed import checkpoint as dcp
    from .ckpt_dcp import RectLoadPlanner
    from .ckpt_state import LoadTargets
    rank = dist.get_rank()
    mine = model_parameters(_gather(describe_rank(engine)))
    t0 = time.perf_counter()   # every rank is here: the time the restore takes, not the ranks' skew before it
    diff = compare_models(mine, list(manifest.parameters))
    if diff:
        raise CheckpointError(f"--resume {path}: the checkpoint holds another model: {diff}")
    step = 0 if weights_only else manifest.step
    regime = manifest.regime or {}
    t = 0 if weights_only else int(regime.get("t", step - int(regime.get("skipped_steps", 0))))
    try:
        reader = dcp.FileSystemReader(path)
        targets = LoadTargets(engine, set(reader.read_metadata().state_dict_metadata), weights_only) \
            if engine is not None else None
        dcp.load({}, storage_reader=reader, planner=RectLoadPlanner(targets.wanted if targets else {}))
    except Exception as e:  # noqa: BLE001 - DCP raises on every rank when any rank's read failed
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"--resume {path}: cannot read its tensors: {first}") from None
    if targets is not None:
        targets.apply(t)
    if engine is not None and not weights_only:
        r = engine.regime
        r.t = t
        if r.fp16 and manifest.precision == "fp16":   # another precision's scale (1) means nothing here
            r.scale, r.clean = float(regime["loss_scale"]), int(regime["good_steps"])
        engine.global_steps = step
        engine.global_samples = step * manifest.global_batch
        engine.skipped_steps = int(regime.get("skipped_steps", 0))
    if weights_only:
        return 0, time.perf_counter() - t0
    if data is not None and engine is not None and engine.data_iterator is not None:
        samples = manifest.drawn * manifest.micro_batch
        data.skip(samples // plan.train.micro_batch)
    states = manifest.rng
    if states:
        set_rng_state(states.get(str(rank), states.get("0")))
    return step, time.perf_counter() - t0


def resumed_line(path: str, manifest: Manifest, digest: str, weights_only: bool, seconds: float) -> str:
    same = "the same plan" if manifest.digest == digest else f"plan {manifest.plan!r}"
    return (f"resumed from {path} {'(weights only) of' if weights_only else 'at'} step {manifest.step} "
            f"(written by {same} on {manifest.world_size} ranks) in {seconds:.3f} s")
