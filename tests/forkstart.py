"""Start a launch's ranks as forks of one interpreter that imported the rank program once (tests only).

    python tests/forkstart.py OUT WORLD LOGS [TRAIN_ARGS...]

Each rank runs exactly ``python OUT/train.py TRAIN_ARGS`` would (``planc_runtime.main.main`` on
``OUT``, ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE`` in its environment, its stdout and
stderr together in ``LOGS/rank<R>.log``), but the imports every rank repeats (torch, DeepSpeed, the
runtime; transformers for a ``model hf`` plan: about 2-4 CPU seconds a rank) happen once, in this
process, before it forks the ranks. The ranks then share those pages copy-on-write. What a rank
computes and communicates is the same: nothing runs before the fork but imports (no tensor op, no
thread pool, no process group), and each fork builds its own everything after it.

Why a test harness and not the product's launcher: ``launch.sh`` starts ranks through the
``deepspeed`` launcher as users run them, and stays tested where it is the subject (test_e2e,
test_comm_only, test_hf_models, test_failures, the testbed). The suite's other launches are about what
ranks compute; this cuts what they repeat (issue 45: the suite under 15 minutes).

Exit: the worst return code of the ranks (a rank killed by signal S counts as 128 + S), after every
rank has ended; ``LOGS/rc.json`` lists each rank's. As a per-host launcher does (DeepSpeed's kills the
rest at once), a rank that fails ends the launch: the ranks still running ``SIBLING_GRACE_S`` after it
are killed (the grace lets them print their own failure report), so a rank that dies at the rendezvous
never leaves the others waiting on it until the test's timeout.
"""
from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import sys
import time
import traceback

SIBLING_GRACE_S = 15.0


def _preload(out: str) -> None:
    """What ``planc_runtime.entry.run`` imports before ``main``, with the collector paused as it does;
    and transformers (offline, as the runtime sets it) where the plan's model is ``hf``."""
    sys.path.insert(0, out)
    gc.disable()
    try:
        from planc_runtime import entry
        entry._defer_dynamo()
        import planc_runtime.main  # noqa: F401
        with open(os.path.join(out, "plan.json")) as f:
            model = json.load(f)["train"].get("model") or {}
        if "hf" in model:
            from planc_runtime import hf
            hf.transformers()
            import transformers.modeling_utils  # noqa: F401
    finally:
        gc.freeze()
        gc.enable()


def _rank(out: str, rank: int, world: int, log: str, args: list[str]) -> int:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    sys.argv = [os.path.join(out, "train.py"), *args]
    from planc_runtime.main import main
    try:
        code = main(out_dir=out)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    gc.freeze()
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return int(code or 0)


def main(argv: list[str]) -> int:
    out, world, logs, args = os.path.abspath(argv[0]), int(argv[1]), argv[2], argv[3:]
    _preload(out)
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _rank(out, rank, world, os.path.join(logs, f"rank{rank}.log"), args)
            finally:
                os._exit(code)
        pids[pid] = rank
    codes, killed_at = {}, None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG) if killed_at is not None else os.wait()
        if pid == 0:                      # a rank failed; the others are still running
            if time.monotonic() >= killed_at:
                for other in pids:
                    os.kill(other, signal.SIGKILL)
                killed_at = float("inf")
            time.sleep(0.05)
            continue
        if pid in pids:
            codes[pids.pop(pid)] = code = os.waitstatus_to_exitcode(status)
            if code != 0 and killed_at is None and pids:
                killed_at = time.monotonic() + SIBLING_GRACE_S
    with open(os.path.join(logs, "rc.json"), "w") as f:
        json.dump({str(r): codes[r] for r in sorted(codes)}, f)
    return max((128 - c if c < 0 else c) for c in codes.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
