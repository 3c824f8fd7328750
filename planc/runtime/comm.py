"""Receives that run ahead of compute: a communication thread per stage rank.

A stage's receives are known before the step starts: for each ``F m`` of its
plan.json list, every incoming transfer's forward route; for each ``B m``,
every outgoing transfer's backward route. ``RecvAhead`` posts them, in that
order, to a thread of its own. The thread *posts* every receive it has been
given at once (``TransferExecutor.post``: irecvs into preallocated buffers of
the plan's static shapes) and then *finishes* the oldest
(``TransferExecutor.finish``: waits, relays broadcast chunks down the chain
the moment they land, gathers allgather parts), while the compute thread runs
the previous operations; the compute thread waits only where it consumes the
data. Posting ahead matters on gloo: a sender transmits only once the
receiver's notice that it has posted has reached it, and on a busy link that
notice queues behind the other direction's traffic (the testbed's tbf queue
holds up to 50 ms); one receive posted at a time costs that trip per message.
When a receive is posted is ``planc.plan.gates.post_gates`` (the contract's, shared with the
simulator and the hang check): an operation's receives are
queued once the compute thread begins the operation ``ahead`` before it, and a
backward's output gradients already once the stage has begun that micro-batch's
forward (the gradient can only come after it, and the schedule bounds how many
micro-batches are between the two). Receive buffers therefore stay bounded by
the schedule's in-flight micro-batches plus ``ahead`` operations, not by the
micro-batch count. Why the early backward posting: under gloo's rendezvous a
gradient leaves its host only once its receive is posted, and the testbed's
traces (``train.py --trace``, docs/benchmarks.md) showed a first stage waiting
in ``B m`` with only ``ahead`` operations posted while gradients of later
micro-batches sat computed downstream for up to 0.7 s. With this rule that wait
is gone from the trace; on that plan the step time did not change measurably
(the shaped link, not the posting, set it).

The thread issues its collectives on communicators of its own (``create_groups``
makes a ``("transfer", direction, *members)`` communicator for every group a
route uses, and one p2p communicator per direction), so they never interleave
with the compute thread's tensor-parallel or gradient collectives. Receives
run in one global order per stage (the stage's list), which every member of a
receiving group shares, so group collectives match.
"""
from __future__ import annotations

import collections
import queue
import threading
from concurrent.futures import Future

from planc.plan import DEFAULT_AHEAD, Direction, post_gates   # the contract's rule (planc/plan/gates.py)

__all__ = ["RecvAhead", "receive_jobs", "post_gates", "DEFAULT_AHEAD"]

_NOTHING = object()


def receive_jobs(turns, local=frozenset()) -> list[list[tuple[str, Direction, int]]]:
    """Per compute action of the rank's list (``planc.plan.RankClass.turns``), the receives it waits for,
    in list order; ``local``: ``(transfer, direction)`` routes that move nothing (handed over on the rank,
    classrun.py), which the thread does not post."""
    return [[(a.transfer, a.direction, a.micro_batch) for a in t.recvs if (a.transfer, a.direction) not in local]
            for t in turns]


class RecvAhead:
    """Runs a stage's receives in a thread, ``ahead`` operations ahead of the compute thread."""

    def __init__(self, executors: dict, jobs: list[list[tuple[str, Direction, int]]], ahead: int | None = None,
                 tracer=None, ops=None):
        self.executors, self.tracer = executors, tracer
        self.jobs = jobs
        self.ahead = DEFAULT_AHEAD if ahead is None else int(ahead)   # the engine passes plan.json's
        # ops given: post_gates; else (tests of the thread alone) the operation ``ahead`` before
        self.gates = (post_gates(ops, self.ahead, [bool(j) for j in jobs]) if ops is not None else
                      [max(0, j - self.ahead) for j in range(len(jobs))])
        self._futures: dict[tuple[str, Direction, int], Future] = {}
        self._posted = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="planc-recv", daemon=True)
        self._thread.start()

    @classmethod
    def for_class(cls, executors: dict, rank_class, local=frozenset(), ahead: int | None = None, tracer=None):
        """The thread of a rank running ``rank_class``'s list (``planc.plan.RankClass``): its RECVs in list
        order, each compute action's gated by ``post_gates`` over the class's compute actions."""
        turns = rank_class.turns()
        return cls(executors, receive_jobs(turns, local), ahead=ahead, tracer=tracer,
                   ops=[(t.compute.kind, t.compute.stage, t.compute.micro_batch) for t in turns])

    def _run(self) -> None:
        """Post every queued receive at once, then finish the oldest; repeat.

        Posting (``TransferExecutor.post``) never blocks, so all receives within the window are
        on the wire while the oldest is completed; finishing (waits, broadcast relays, allgathers)
        runs strictly in queue order, the one order every member of a receiving group shares.
        """
        posted: collections.deque = collections.deque()
        while True:
            if posted:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = _NOTHING
            else:
                item = self._queue.get()
            if item is None:
                return
            if item is not _NOTHING:
                key, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue
                name, direction, m = key
                try:
                    posted.append((fut, self.executors[(name, direction)],
                                   self.executors[(name, direction)].post(micro_batch=m),
                                   key, self.tracer.now() if self.tracer is not None else 0.0))
                except BaseException as e:  # noqa: BLE001 - raised in the compute thread by take()
                    fut.set_exception(e)
                continue
            fut, executor, handle, key, t_post = posted.popleft()
            try:
                result = executor.finish(handle)
                if self.tracer is not None:   # from posting to arrival (and relay, for broadcast chains)
                    name, direction, m = key
                    self.tracer.complete(f"recv {name} {direction.value} m{m}", t_post, self.tracer.now(), "recv",
                                         micro_batch=m)
                fut.set_result(result)
            except BaseException as e:  # noqa: BLE001 - raised in the compute thread by take()
                fut.set_exception(e)
            del handle

    def start_step(self) -> None:
        """Post the first operations' receives (call before the step's first instruction)."""
        leftover = list(self._futures)
        if leftover:
            raise RuntimeError(f"receives of the previous step were never consumed: {sorted(map(str, leftover))}")
        self._posted = 0
        self.advance(0)

    def advance(self, op_index: int) -> None:
        """The compute thread is at operation ``op_index``: post every receive whose gate it has reached."""
        while self._posted < len(self.jobs) and self.gates[self._posted] <= op_index:
            for key in self.jobs[self._posted]:
                fut: Future = Future()
                self._futures[key] = fut
                self._queue.put((key, fut))
            self._posted += 1

    def take(self, name: str, direction: Direction, m: int, timeout: float | None = None):
        """This rank's received region of (transfer, direction, micro-batch); waits only if not there yet."""
        fut = self._futures.pop((name, direction, m))
        return fut.result(timeout=timeout)

    def posted_micro_batches(self) -> set[int]:
        """Micro-batches with a receive posted and not yet taken."""
        return {m for _, _, m in self._futures}

    def close(self) -> None:
        self._queue.put(None)
