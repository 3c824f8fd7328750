"""The failure watch (planc/runtime/failwatch.py) on a real rendezvous store, in-process: a failure
another rank reports ends the watching rank, a store that goes away ends it after the grace, and a
stopped watch ends nothing. (On the testbed: tests/testbed/test_testbed_failures.py, a rank hung alone on
its host.)"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore

from planc.ports import free_port
from planc.runtime.failwatch import FAILED_KEY, FailureWatch, report_failure




def _stores():
    port = free_port()
    server = TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", port, 2, False, wait_for_workers=False, timeout=timedelta(seconds=2))
    return server, client


class _Exit:
    def __init__(self):
        self.codes, self.event = [], threading.Event()

    def __call__(self, code):
        self.codes.append(code)
        self.event.set()


def test_a_reported_failure_ends_the_watching_rank(capsys):
    server, client = _stores()
    ended = _Exit()
    watch = FailureWatch(1, interval=0.05, store=client, exit=ended)
    time.sleep(0.2)
    assert not ended.event.is_set()                 # nothing failed: the watch lets the rank run
    report_failure(0, "rank 0 (stage 0) failed in BackwardPass with ranks [1]: timeout\nmore", store=server)
    report_failure(2, "a later failure is not the one named", store=server)
    assert ended.event.wait(5) and ended.codes == [2]
    assert server.get(FAILED_KEY).decode() == "rank 0: rank 0 (stage 0) failed in BackwardPass with ranks [1]: timeout"
    err = capsys.readouterr().err
    assert "planc: rank 1: ending: rank 0: rank 0 (stage 0) failed in BackwardPass" in err
    assert "seen in the rendezvous store" in err
    watch.stop()


def test_a_store_that_goes_away_ends_the_rank_after_the_grace(capsys):
    server, client = _stores()
    ended = _Exit()
    t0 = time.monotonic()
    watch = FailureWatch(3, interval=0.05, grace=0.5, store=client, exit=ended)
    del server                                      # rank 0's process (the store's host) is gone
    assert ended.event.wait(30) and ended.codes == [2]
    assert time.monotonic() - t0 >= 0.5             # not before the grace
    assert "planc: rank 3: ending: the job's rendezvous store (rank 0, host 0) has not answered" in \
        capsys.readouterr().err
    watch.stop()


def test_a_stopped_watch_ends_nothing():
    server, client = _stores()
    ended = _Exit()
    watch = FailureWatch(1, interval=0.05, grace=0.1, store=client, exit=ended)
    watch.stop()                                    # the run is at its last barrier
    report_failure(0, "too late to matter", store=server)
    del server
    assert not ended.event.wait(0.6)


def test_a_failing_rank_0_keeps_its_store_until_every_rank_has_seen_the_failure():
    """The store lives in rank 0's process: rank 0 reporting its own failure waits (at most
    ``linger``) until the watching rank has read the key, so its exit cannot take the key away first."""
    server, client = _stores()
    ended = _Exit()
    watch = FailureWatch(1, interval=0.5, store=client, exit=ended)
    # a linger no run would reach: rank 0 must return because rank 1 has seen the failure, not because
    # the linger ran out (the thread is only a hang guard: a rank 0 waiting out its linger fails it)
    report = threading.Thread(target=report_failure, args=(0, "rank 0 (stage 0) failed in RecvGrad with ranks [1]"),
                              kwargs={"store": server, "world": 2, "linger": 3600}, daemon=True)
    report.start()
    report.join(120)
    assert not report.is_alive(), "rank 0 waited out its linger although every rank had seen the failure"
    assert ended.event.is_set() and ended.codes == [2]        # the watch saw it before rank 0 returned
    assert server.add("planc/failed-seen", 0) == 2
    watch.stop()


def test_a_failing_rank_0_with_no_one_watching_lingers_no_longer_than_its_bound(monkeypatch):
    """On a clock the test drives (each of report_failure's polls advances it by its sleep): rank 0 polls
    the store until the linger's end and stops at the first poll past it."""
    from planc.runtime import failwatch

    class Clock:
        now, polls = 100.0, 0

        @classmethod
        def monotonic(cls):
            return cls.now

        @classmethod
        def sleep(cls, s):
            cls.now += s
            cls.polls += 1

    monkeypatch.setattr(failwatch, "time", Clock)
    server, _client = _stores()
    report_failure(0, "alone", store=server, world=2, linger=0.5)
    # polls of 0.05 s until the clock passes the linger's end, then out at once (10 or 11 polls: the
    # sum of 0.05s may fall a rounding short of 0.5)
    assert Clock.now >= 100.5 and Clock.now - 0.05 < 100.5 and Clock.polls in (10, 11)
    assert server.add("planc/failed-seen", 0) == 1                 # nobody else ever counted itself
