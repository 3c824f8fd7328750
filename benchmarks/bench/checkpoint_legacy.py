"""The checkpoint writer planc had before format 2 (one torch file per rank, refused under any other
plan), kept only for `python -m benchmarks bench checkpoint` to compare against; never imported by the
product.

``install(C)`` replaces the ``save``, ``resolve``, ``check`` and ``restore`` of a compiled output's
``planc_runtime.checkpoint`` module ``C`` with these, so that ``planc_runtime.main.main`` runs them
(``rank_main``). Layout: ``DIR/step<N>/rank<R>.pt`` (the rank's module and optimizer state dicts, the
regime's state with the fp32 masters that are not the parameters, DeepSpeed's counters, RNG states, data
position) and ``manifest.json`` written last (plan digest, world size, every file's size and sha256).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time

import torch
import torch.distributed as dist

MANIFEST = "manifest.json"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _rng() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _engine_state(engine) -> dict:
    return {"module": engine.module.state_dict(), "optimizer": engine.optimizer.state_dict(),
            "regime": {"t": engine.regime.t, "scale": engine.regime.scale, "clean": engine.regime.clean,
                       "masters": [f.master.detach().cpu() for f in engine.regime.separate]},
            "counters": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                         "skipped_steps": engine.skipped_steps}}


def install(C) -> None:
    """Make module ``C`` (a ``planc_runtime.checkpoint``) save and resume per-rank torch files."""
    Error = C.CheckpointError

    def save(directory, step, plan, digest, engine, data):
        rank, world = dist.get_rank(), dist.get_world_size()
        final, partial = os.path.join(directory, f"step{step}"), os.path.join(directory, f".step{step}.partial")
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        dist.barrier()
        state = {"rank": rank, "step": step, "rng": _rng(), "drawn": data.drawn if data is not None else 0,
                 "engine": _engine_state(engine) if engine is not None else None}
        path = os.path.join(partial, f"rank{rank}.pt")
        with open(path + ".tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        entries = _gather({"size": os.path.getsize(path), "sha256": _sha256(path)})
        if rank == 0:
            manifest = {"format": 1, "plan": plan.name, "digest": digest, "step": step, "world_size": world,
                        "files": {f"rank{r}.pt": e for r, e in enumerate(entries)}}
            with open(os.path.join(partial, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(partial, final)
            with open(os.path.join(directory, "latest"), "w") as f:
                f.write(f"step{step}\n")
        dist.barrier()
        return final

    def resolve(path):
        if os.path.exists(os.path.join(path, MANIFEST)):
            return path
        with open(os.path.join(path, "latest")) as f:
            return os.path.join(path, f.read().strip())

    def check(path, plan, weights_only=False):
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        if manifest["digest"] != C.__dict__.get("_legacy_digest"):
            raise Error(f"--resume {path}: written by another plan (the per-rank format needs the same plan)")
        for name, entry in manifest["files"].items():
            file = os.path.join(path, name)
            if os.path.getsize(file) != entry["size"] or _sha256(file) != entry["sha256"]:
                raise Error(f"--resume {path}: {file} is not the file the manifest lists")
        return manifest

    def restore(path, manifest, plan, engine, data, weights_only):
        rank, t0 = dist.get_rank(), time.perf_counter()   # nothing collective: no skew to wait for
        state = torch.load(os.path.join(path, f"rank{rank}.pt"), map_location="cpu", weights_only=False)
        if engine is not None:
            e = state["engine"]
            engine.module.load_state_dict(e["module"], strict=True)
            engine.optimizer.load_state_dict(e["optimizer"])
            with torch.no_grad():
                for m, f in zip(e["regime"]["masters"], engine.regime.separate):
                    f.master.copy_(m)
            r = engine.regime
            r.t, r.scale, r.clean = e["regime"]["t"], e["regime"]["scale"], e["regime"]["clean"]
            for k, v in e["counters"].items():
                setattr(engine, k, v)
        if data is not None:
            data.skip(state["drawn"])
        torch.set_rng_state(state["rng"]["torch"])
        version, internal, gauss = state["rng"]["python"]
        random.setstate((version, tuple(internal), gauss))
        return int(state["step"]), time.perf_counter() - t0

    C.save, C.resolve, C.check, C.restore = save, resolve, check, restore


def rank_main(out_dir: str, argv: list[str]) -> int:
    """One rank of a compiled output ``out_dir`` (``python -c``), with the legacy checkpoints installed."""
    sys.path.insert(0, out_dir)
    from planc import plan as planfile
    import planc_runtime.checkpoint as C
    from planc_runtime.main import main
    install(C)
    C._legacy_digest = planfile.digest(planfile.load(os.path.join(out_dir, "plan.json")))
    return main(argv, out_dir=out_dir)
