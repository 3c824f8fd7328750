"""Checkpoints of a training run: ``train.py --save DIR`` writes them, ``train.py --resume DIR`` continues.

Layout (docs/runtime.md "Checkpoints")::

    DIR/step<N>/manifest.json   written last: format, plan name, plan digest, step, world size, and
                                every rank file's size and sha256
    DIR/step<N>/rank<R>.pt      one per rank of the world: its stage's parameters (its tensor-parallel
                                shards), optimizer state, its fp32 master weights (those that are not
                                the parameters: bf16/fp16, or its ZeRO-1 shard), the schedule's step
                                and the loss scale, DeepSpeed step counters, RNG states, data
                                position; an idle rank's holds its RNG states only
    DIR/latest                  "step<N>", the newest complete checkpoint (replaced atomically)

A save is collective over the world (idle ranks take part). Every rank writes its file into
``DIR/.step<N>.partial/`` (a temporary name, then renamed); rank 0 gathers the files' sizes and
digests, writes the manifest, renames the folder to ``DIR/step<N>`` and then updates ``latest``.
A folder without a manifest, or whose files do not match it, is never loaded.

Why not ``DeepSpeedEngine.save_checkpoint``: it synchronizes with world-wide ``dist.barrier``
and ``all_reduce`` calls that ranks outside every stage (which build no engine) never make; its
optimizer files are named by the model-parallel rank only (``mp_rank_00_model_states.pt``), so
with ``PlanGrid`` (one grid per stage) every stage's data-rank 0 writes the same file; its layer
loader (``SDLoaderFactory``) re-merges tensor-parallel layer files with Megatron's heuristics,
not by planc's shard layout; and it keeps neither RNG states nor the data position. The state it
would restore (module, optimizer, ``global_steps``/``global_samples``/``skipped_steps``, the lr
scheduler) is what each rank file holds.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil

import torch
import torch.distributed as dist

FORMAT = 1
MANIFEST = "manifest.json"
LATEST = "latest"


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

def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- engine state

def engine_state(engine) -> dict:
    """What ``DeepSpeedEngine._load_checkpoint`` restores, for this rank's stage."""
    sched = engine.lr_scheduler
    return {"module": engine.module.state_dict(),
            "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
            "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
            "regime": engine.regime.state_dict(),
            "counters": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                         "skipped_steps": engine.skipped_steps}}


def load_engine_state(engine, state: dict) -> None:
    engine.module.load_state_dict(state["module"], strict=True)
    if state["optimizer"] is not None:
        engine.optimizer.load_state_dict(state["optimizer"])
    if state["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.regime.load_state_dict(state["regime"])
    for k, v in state["counters"].items():
        setattr(engine, k, v)


# ---------------------------------------------------------------- files

def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
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


def _gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def save(directory: str, step: int, plan, digest: str, engine, data: CountingIterator | None) -> str:
    """Collective: every rank of the world writes its state for the end of ``step`` steps.
    Returns the checkpoint folder ``DIR/step<N>``."""
    rank, world = dist.get_rank(), dist.get_world_size()
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
    problems = [p for p in _gather(problem) if p]
    if problems:
        raise CheckpointError(f"checkpoint step {step} not saved: {problems[0]}")

    stage = plan.stage_of(rank)
    state = {"format": FORMAT, "rank": rank, "stage": stage.index if stage is not None else None,
             "digest": digest, "step": step, "rng": rng_state(),
             "data": {"drawn": data.drawn if data is not None else 0},
             "engine": engine_state(engine) if engine is not None else None}
    path = os.path.join(partial, f"rank{rank}.pt")
    entry = None
    try:
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        entry = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    except Exception as e:  # noqa: BLE001 - reported by every rank together, not left to hang the others
        problem = f"rank {rank} cannot write {path}: {type(e).__name__}: {e}"
    gathered = _gather((entry, problem))
    problems = [p for _, p in gathered if p]
    if rank == 0 and not problems:
        manifest = {"format": FORMAT, "plan": plan.name, "digest": digest, "step": step, "world_size": world,
                    "files": {f"rank{r}.pt": e for r, (e, _) in enumerate(gathered)}}
        try:
            _fsync_dir(partial)
            _write_atomic(os.path.join(partial, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())
            if os.path.exists(final):   # saved before (a resumed run passing the same step): replace it
                old = os.path.join(directory, f".{name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                os.rename(partial, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(partial, final)
            _fsync_dir(directory)
            _write_atomic(os.path.join(directory, LATEST), (name + "\n").encode())
        except OSError as e:
            problem = f"rank 0 cannot complete {final}: {e}"
    problems += [p for p in _gather(problem if rank == 0 else None) if p]
    if problems:
        raise CheckpointError(f"checkpoint step {step} not saved:\n  " + "\n  ".join(dict.fromkeys(problems)))
    return final


# ---------------------------------------------------------------- resume

def resolve(path: str) -> str:
    """The complete checkpoint folder ``--resume PATH`` means: PATH itself if it holds a manifest,
    else the one PATH/latest names. Raises CheckpointError saying what is missing."""
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume {path}: no such checkpoint folder")
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.exists(latest):
        with open(latest) as f:
            name = f.read().strip()
        chosen = os.path.join(path, name)
        if not os.path.exists(os.path.join(chosen, MANIFEST)):
            raise CheckpointError(f"--resume {path}: {latest} names {name!r}, which is not a complete checkpoint "
                                  f"(no {os.path.join(chosen, MANIFEST)})")
        return chosen
    partial = sorted(e for e in os.listdir(path) if e.endswith(".partial"))
    if partial:
        raise CheckpointError(f"--resume {path}: only an incomplete checkpoint is there ({', '.join(partial)}: "
                              f"a save that did not finish, never loaded); no {LATEST} file")
    raise CheckpointError(f"--resume {path}: not a checkpoint (neither {MANIFEST} nor {LATEST} in it): "
                          f"an incomplete checkpoint is never loaded")


def check(path: str, digest: str, world: int) -> dict:
    """The manifest of the checkpoint folder ``path`` (see ``resolve``), checked against this run's plan
    digest and world size and against every rank file (present, same size and sha256). Pure: every rank
    finds the same answer, before the process group starts."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"--resume {path}: unreadable {MANIFEST} ({e}); an incomplete checkpoint "
                              f"is never loaded") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"--resume {path}: {MANIFEST} is not a planc checkpoint of format {FORMAT}")
    if manifest.get("digest") != digest:
        raise CheckpointError(f"--resume {path}: the checkpoint was written by plan {manifest.get('plan')!r} "
                              f"with digest {manifest.get('digest')}, but this plan.json has digest {digest}; "
                              f"resume only with the plan that wrote it")
    if manifest.get("world_size") != world:
        raise CheckpointError(f"--resume {path}: the checkpoint holds {manifest.get('world_size')} ranks, "
                              f"this job has {world}")
    files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    for r in range(world):
        entry, file = files.get(f"rank{r}.pt"), os.path.join(path, f"rank{r}.pt")
        if not isinstance(entry, dict) or not {"size", "sha256"} <= set(entry):
            raise CheckpointError(f"--resume {path}: {MANIFEST} lists no file (size and sha256) for rank {r}")
        if not os.path.exists(file):
            raise CheckpointError(f"--resume {path}: {file} is missing")
        size = os.path.getsize(file)
        if size != entry["size"] or _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"--resume {path}: {file} is not the file the manifest lists "
                                  f"({size} bytes, the manifest says {entry['size']}; or its sha256 differs)")
    return manifest


def load_rank(path: str, rank: int, stage_index) -> dict:
    """This rank's file of the checked checkpoint ``path``."""
    file = os.path.join(path, f"rank{rank}.pt")
    try:
        state = _torch_load(file)
    except Exception as e:  # noqa: BLE001 - a file that does not unpickle is reported with its name
        raise CheckpointError(f"rank {rank} cannot read {file}: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict) or state.get("rank") != rank or state.get("stage") != stage_index:
        raise CheckpointError(f"rank {rank}: {file} holds rank {state.get('rank') if isinstance(state, dict) else '?'} "
                              f"of stage {state.get('stage') if isinstance(state, dict) else '?'}, "
                              f"not rank {rank} of stage {stage_index}")
    return state


def _torch_load(file: str):
    # weights_only=False: DeepSpeed's fp16 optimizer state holds its loss scaler object; the file was
    # checked against the manifest's sha256 (as DeepSpeed's own loader, it trusts the checkpoint folder)
    return torch.load(file, map_location="cpu", weights_only=False)


def restore(state: dict, engine, data: CountingIterator | None) -> None:
    """Load a rank file's state: engine (module, optimizer, counters), data position, then RNG."""
    if engine is not None:
        try:
            load_engine_state(engine, state["engine"])
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"rank {state['rank']}: its checkpoint state does not fit its stage: "
                                  f"{first}") from None
    if data is not None:
        data.skip(int(state["data"]["drawn"]))
    set_rng_state(state["rng"])
