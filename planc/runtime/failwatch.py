"""A rank that cannot see a failure by itself is told through the rendezvous store.

A rank that waits in a collective learns of a dead or hung peer by the collective timeout
(``train { timeout }``). A rank that is *not* waiting — hung in its own compute, or alone on its
host so that no local launcher ends it when a sibling fails — would run on forever. So every rank
that fails writes one line to the job's rendezvous store (``FAILED_KEY``, the store
``torch.distributed`` started with, on host 0) before it exits, and every rank runs a
``FailureWatch`` thread that polls the store every ``interval`` seconds: once the key is there,
or the store itself is gone (host 0's rank 0 died, or its link), the rank prints who failed
and exits 2 at once — whatever its main thread is doing. The rank's own launcher then ends the
rest of its host, as it does for any rank that exits non-zero.

The store lives in rank 0's process, so a failing rank 0 that exited at once could take the key
with it before a watcher's next poll (the watcher would then end only after ``grace``, for the
wrong reason). Every rank that learns of the failure — by failing itself or by its watch — adds
one to ``SEEN_KEY``; a failing rank 0 lingers until every rank has, or ``linger`` seconds.

The watch stops before the run's last collective (``stop()``), so a rank 0 that finishes and
takes the store with it never ends a rank that is finishing too; a store that stops answering
is believed gone only after ``grace`` seconds of errors.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch.distributed as dist

__all__ = ["FailureWatch", "FAILED_KEY", "SEEN_KEY", "report_failure"]

FAILED_KEY = "planc/failed"
SEEN_KEY = "planc/failed-seen"     # how many ranks know of the failure (report_failure, FailureWatch)


def _store():
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def report_failure(rank: int, message: str, store=None, wait: float = 2.0, world: int | None = None,
                   linger: float | None = None) -> None:
    """Tell every other rank (their ``FailureWatch``) that this one failed, in one line.

    Waits at most ``wait`` seconds for the write: a store behind a dead link would block until its
    own timeout, and a failing rank must exit now (the others then see the store gone, or time out
    themselves). The rank that hosts the store (rank 0) then lingers, at most ``linger`` seconds
    (default: 3 s when it is rank 0 of a job of more than one rank, else none), until all ``world``
    ranks have counted themselves in ``SEEN_KEY``, so that its exit does not take the key with it."""
    if store is None:
        store = _store() if dist.is_initialized() else None
    if store is None:
        return
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    if linger is None:
        linger = 3.0 if rank == 0 and world > 1 else 0.0
    line = f"rank {rank}: {message.splitlines()[0] if message else 'failed'}"

    def write():
        try:
            if not store.check([FAILED_KEY]):      # the first failure is the one named
                store.set(FAILED_KEY, line)
            seen = store.add(SEEN_KEY, 1)
            deadline = time.monotonic() + linger
            while seen < world and time.monotonic() < deadline:
                time.sleep(0.05)
                seen = store.add(SEEN_KEY, 0)
        except (RuntimeError, ValueError):         # the store is gone too: the others see that
            pass

    writer = threading.Thread(target=write, name="planc-report-failure", daemon=True)
    writer.start()
    writer.join(wait + linger)


class FailureWatch:
    """Polls the rendezvous store for another rank's failure; ends this process when it sees one."""

    def __init__(self, rank: int, interval: float = 1.0, grace: float = 5.0, exit_code: int = 2,
                 store=None, exit=os._exit):
        self.rank = rank
        self.interval = interval
        self.grace = grace
        self.exit_code = exit_code
        self.store = store if store is not None else _store()
        self._exit = exit
        self._stop = threading.Event()
        self._thread = None
        if self.store is not None:
            self._thread = threading.Thread(target=self._run, name="planc-failure-watch", daemon=True)
            self._thread.start()

    def _end(self, why: str) -> None:
        if self._stop.is_set():
            return
        print(f"planc: rank {self.rank}: ending: {why}", file=sys.stderr, flush=True)
        self._stop.set()
        self._exit(self.exit_code)

    def _run(self) -> None:
        failing_since = None
        while not self._stop.wait(self.interval):
            try:
                if self.store.check([FAILED_KEY]):
                    line = self.store.get(FAILED_KEY).decode(errors='replace')
                    try:
                        self.store.add(SEEN_KEY, 1)    # a failing rank 0 may exit now (report_failure)
                    except (RuntimeError, ValueError):
                        pass
                    self._end(f"{line} (seen in the rendezvous store)")
                failing_since = None
            except (RuntimeError, ValueError) as e:   # DistStoreError is a RuntimeError
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since >= self.grace:
                    first = str(e).splitlines()[0] if str(e) else type(e).__name__
                    self._end(f"the job's rendezvous store (rank 0, host 0) has not answered for "
                              f"{now - failing_since:.0f} s: {first}")

    def stop(self) -> None:
        """No more watching: the run is at its last collective (or ending by its own error). Waits a
        moment for a poll in progress, so the thread holds no store call when the process ends."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval)
