"""Send completion off the compute thread."""
from __future__ import annotations

import queue
import threading

from .dataflow import EngineError

__all__ = ["SendReaper"]


class SendReaper:
    """Waits on send handles in a thread of its own and drops each buffer the moment its send completes.

    gloo's send handles report completion only through ``wait()`` (``is_completed()``
    stays False until then), and waiting in the compute thread would stall it on
    a peer that is not ready yet; so a daemon thread waits, in issue order, and
    the engine only asks which micro-batches still have sends in flight. A send
    that fails (a dead peer, the collective timeout) is raised in the compute
    thread at its next question.
    """

    def __init__(self, tracer=None):
        self.tracer = tracer
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}      # micro-batch -> sends in flight
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="planc-send-reaper", daemon=True)
        self._thread.start()

    def add(self, micro_batch: int, works, what: str = "send") -> None:
        works = [w for w in works if w is not None]
        if not works:
            return
        with self._lock:
            self._pending[micro_batch] = self._pending.get(micro_batch, 0) + 1
        self._queue.put((micro_batch, works, what, self.tracer.now() if self.tracer is not None else 0.0))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            m, works, what, issued = item
            try:
                for w in works:
                    w.wait()
                if self.tracer is not None:   # from issue to completion (waits run in issue order)
                    self.tracer.complete(what, issued, self.tracer.now(), "send", micro_batch=m)
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread
                self._error = e
            finally:
                del works, item
                with self._lock:
                    self._pending[m] -= 1
                    if not self._pending[m]:
                        del self._pending[m]
                self._queue.task_done()

    def in_flight(self) -> int:
        """Micro-batches with a send not yet complete."""
        self._raise()
        with self._lock:
            return len(self._pending)

    def drain(self) -> None:
        """Block until every send so far has completed."""
        self._queue.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise EngineError(f"a send failed: {e}") from e
