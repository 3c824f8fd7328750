"""The checkpoint manager of a training run: when ``train.py --save DIR`` saves and ``--resume DIR``
(``--weights-only``) restores, and what rank 0 says of it (torchtitan's checkpoint manager, beside
``trainer``). ``checkpoint`` writes and reads the folders (format 2, docs/runtime.md "Checkpoints").

    CheckpointManager.before_start(plan, digest, args) -> CheckpointManager
        pure, before the process group: the checkpoint to resume from, found and checked
        (every rank finds the same problem and says it alike)
    .restore(engine, data, rank) -> int     collective: the step to continue from (0: a fresh run)
    .after_step(step, steps, engine, data)  collective when a save is due: every train.save_every
                                            steps and after the last one
"""
from __future__ import annotations

import time

import torch.distributed as dist

from . import checkpoint
from .checkpoint import CheckpointError
from .trainer import fail_together


class CheckpointManager:
    def __init__(self, plan, digest: str, save: str | None = None, resume_from: str | None = None,
                 manifest=None, weights_only: bool = False):
        self.plan, self.digest, self.directory = plan, digest, save
        self.resume_from, self.manifest, self.weights_only = resume_from, manifest, weights_only

    @classmethod
    def before_start(cls, plan, digest: str, args) -> "CheckpointManager":
        """The run's checkpoints as ``args`` ask (``--save``, ``--resume``, ``--weights-only``); the one to
        resume from resolved and checked now, before the process group starts (``checkpoint.check``)."""
        resume_from = manifest = None
        if args.resume or args.weights_only:   # before the process group starts: every rank finds the same problem
            resume_from = checkpoint.resolve(args.resume)
            manifest = checkpoint.check(resume_from, plan, weights_only=args.weights_only)
        return cls(plan, digest, args.save, resume_from, manifest, args.weights_only)

    def restore(self, engine, data, rank: int) -> int:
        """Collective (DCP reads each rank's rectangles of the checkpoint under this plan): the step to
        continue from; any rank's problem stops every rank with the same message."""
        if self.resume_from is None:
            return 0
        first, problems, read_s = 0, [], 0.0
        try:
            first, read_s = checkpoint.restore(self.resume_from, self.manifest, self.plan, engine, data,
                                               self.weights_only)
        except CheckpointError as e:
            problems = [str(e)]
        fail_together(problems, f"cannot resume from {self.resume_from}")
        if rank == 0:
            print(checkpoint.resumed_line(self.resume_from, self.manifest, self.digest, self.weights_only, read_s),
                  flush=True)
        return first

    def after_step(self, step: int, steps: int, engine, data) -> None:
        """After step ``step`` (0-based) of a run to ``steps``: a checkpoint ``step + 1`` when one is due."""
        save_every = self.plan.train.save_every
        if self.directory and (step + 1 == steps or (save_every and (step + 1) % save_every == 0)):
            t_save = time.perf_counter()
            saved = checkpoint.save(self.directory, step + 1, self.plan, self.digest, engine, data)
            if dist.get_rank() == 0:
                print(f"checkpoint step {step + 1} saved to {saved} in {time.perf_counter() - t_save:.3f} s",
                      flush=True)
