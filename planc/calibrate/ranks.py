"""Running the microbenchmarks (``microbench.py``, torch, a script every rank runs in a subprocess: the
compiler stays torch-free) and following their phases with a progress bar; ``run_cluster`` spawns the
ranks on this machine."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from planc.calibrate.fit import DEFAULT_TIMEOUT, INNER_SIZES, MATMUL, CalibrateError, outer_sizes
from planc.commands.ui import progress
from planc.ports import free_port

MICROBENCH = Path(__file__).resolve().parent / "microbench.py"
MARK = "PLANC_MICROBENCH "


def microbench_spec(hosts: int, per_host: int, rate: float | None, repeats: int, timeout: float, backend: str,
          matmul=MATMUL) -> dict:
    return {"sizes_inner": list(INNER_SIZES), "sizes_outer": list(outer_sizes(rate)), "repeats": repeats,
            "matmul": list(matmul), "timeout": timeout, "backend": backend, "per_host": per_host}


def read_result(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise CalibrateError("planc calibrate: rank 0 printed no result", 1)


def with_progress(work, total: int, label: str):
    """Run ``work(on_phase)`` in a thread while a progress bar (planc.commands.ui.progress) follows its phases."""
    q: queue.Queue = queue.Queue()
    box: dict = {}

    def target():
        try:
            box["value"] = work(lambda name: q.put(name))
        except BaseException as e:   # handed to the caller's thread
            box["error"] = e
        finally:
            q.put(None)

    def items():
        while (name := q.get()) is not None:
            yield name

    t = threading.Thread(target=target, daemon=True)
    t.start()
    for _ in progress(items(), label, total=total):
        pass
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


PHASE_NAMES = ("matmul", "block", "p2p inner", "allreduce inner", "p2p outer", "exchange outer", "allreduce outer")


def phase_list(hosts: int, per_host: int) -> list[str]:
    return [p for p in PHASE_NAMES if not (("inner" in p and per_host < 2) or ("outer" in p and hosts < 2))]




def run_cluster(ranks: int, *, backend: str = "auto", repeats: int = 3, timeout: float = DEFAULT_TIMEOUT,
                matmul=MATMUL) -> dict:
    """``ranks`` ranks of this machine (one host), spawned here; rank 0's result."""
    names = phase_list(1, ranks)
    spec = microbench_spec(1, ranks, None, repeats, timeout, backend, matmul)
    port = str(free_port())
    threads = max(1, (os.cpu_count() or 1) // ranks)

    def work(on_phase):
        step_re = re.compile(r"^step (\d+) comm [0-9.]+ s \(verified")
        logs = [tempfile.TemporaryFile(mode="w+") for _ in range(ranks)]
        procs = []
        killer = None
        try:
            for r in range(ranks):
                env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks),
                           LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                           OMP_NUM_THREADS=str(threads), PYTHONPATH="")
                procs.append(subprocess.Popen(
                    [sys.executable, str(MICROBENCH), "--spec", json.dumps(spec)], env=env, text=True,
                    stdout=subprocess.PIPE if r == 0 else logs[r], stderr=logs[r], stdin=subprocess.DEVNULL,
                    start_new_session=True))
            expired = threading.Event()

            def kill_all():
                expired.set()
                for p in procs:
                    if p.poll() is None:
                        p.kill()

            killer = threading.Timer(timeout, kill_all)
            killer.start()
            lines = []
            for line in procs[0].stdout:
                lines.append(line)
                m = step_re.match(line)
                if m and int(m.group(1)) < len(names):
                    on_phase(names[int(m.group(1))])
            codes = [p.wait() for p in procs]
            if expired.is_set() or any(codes):
                tails = []
                for r, f in enumerate(logs):
                    f.seek(0)
                    text = f.read().strip()
                    if text:
                        tails.append(f"rank {r}: {text[-600:]}")
                why = f"timed out after {timeout:g} s" if expired.is_set() else f"exit codes {codes}"
                raise CalibrateError(f"planc calibrate --on cluster: the microbenchmarks failed ({why})"
                                     + ("\n" + "\n".join(tails) if tails else ""), 1)
            return read_result("".join(lines))
        finally:
            if killer is not None:
                killer.cancel()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()

    return with_progress(work, len(names), f"calibrate {ranks} ranks on this machine")
