"""The testbed's account of how each rank ended (benchmarks.testbed.watch), without a testbed: a rank
whose exit status was missed gets its host launcher's only where that is exactly its own."""

from __future__ import annotations

from benchmarks.testbed.watch import RankTracker, describe_failure, last_words

LAUNCHER_FAILED = "[ERROR] [launch.py:259:sigkill_handler] ['python', 'train.py'] exits with return code = 2\n"


def _tracker(ended: dict) -> RankTracker:
    t = RankTracker("train.py", 0.0)
    t.pids = {r: 1000 + r for r in ended}
    t.ended = dict(ended)
    return t


def test_a_missed_status_on_a_one_rank_host_is_the_launchers():
    t = _tracker({0: (39.2, None), 1: (40.6, 2), 2: (40.7, 2)})
    t.codes_from_launchers([[0], [1, 2]], {0: LAUNCHER_FAILED, 1: LAUNCHER_FAILED})
    assert t.ended[0] == (39.2, 2)
    text = describe_failure(world=3, host_of={0: 0, 1: 1, 2: 1}, tracker=t, logs={}, events=[], timed_out=False,
                            killed_at=None, timeout=240, collective_timeout=60)
    assert text.splitlines()[0] == "first to fail: rank 0 (host 0) exited 2 at 39.2 s"


def test_a_missed_status_stays_unknown_where_the_launcher_code_is_not_its_own():
    # two ranks on the host: the launcher's code is one of theirs, which one is not known
    t = _tracker({0: (5.0, None), 1: (5.1, None)})
    t.codes_from_launchers([[0, 1]], {0: LAUNCHER_FAILED})
    assert t.ended == {0: (5.0, None), 1: (5.1, None)}
    # one rank, but its launcher reported no failure (it ended cleanly or was killed): nothing is made up
    t = _tracker({0: (5.0, None)})
    t.codes_from_launchers([[0]], {0: "[INFO] Process 1000 exits successfully.\n"})
    assert t.ended == {0: (5.0, None)}
    # a status that was seen is never replaced
    t = _tracker({0: (5.0, -9)})
    t.codes_from_launchers([[0]], {0: LAUNCHER_FAILED})
    assert t.ended == {0: (5.0, -9)}
    text = describe_failure(world=1, host_of={0: 0}, tracker=_tracker({0: (5.0, None)}), logs={}, events=[],
                            timed_out=False, killed_at=None, timeout=240, collective_timeout=60)
    assert "ended (exit status not seen) at 5.0 s" in text


def test_a_rank_the_testbed_killed_fails_first_among_ranks_seen_ending_in_the_same_poll():
    # rank 3 was killed by the testbed; its launcher stopped rank 2 before the next poll saw either
    t = _tracker({0: (13.7, None), 1: (13.4, 2), 2: (13.4, -15), 3: (13.4, -9)})
    t.signalled.add(3)                  # as Testbed.kill_rank records it
    events = [(13.4, "rank 3 (host 1) sent SIGKILL by the testbed")]
    text = describe_failure(world=4, host_of={0: 0, 1: 0, 2: 1, 3: 1}, tracker=t, logs={}, events=events,
                            timed_out=False, killed_at=None, timeout=240, collective_timeout=15)
    assert text.splitlines()[1] == "first to fail: rank 3 (host 1) killed by SIGKILL at 13.4 s"
    # without a fault on a rank, equal times go by rank; an earlier time always goes first
    t.signalled.clear()
    text = describe_failure(world=4, host_of={0: 0, 1: 0, 2: 1, 3: 1}, tracker=t, logs={}, events=[],
                            timed_out=False, killed_at=None, timeout=240, collective_timeout=15)
    assert text.splitlines()[0] == "first to fail: rank 1 (host 0) exited 2 at 13.4 s"
    t.signalled.add(3)
    t.ended[0] = (13.0, 2)
    text = describe_failure(world=4, host_of={0: 0, 1: 0, 2: 1, 3: 1}, tracker=t, logs={}, events=events,
                            timed_out=False, killed_at=None, timeout=240, collective_timeout=15)
    assert text.splitlines()[1] == "first to fail: rank 0 (host 0) exited 2 at 13.0 s"


def test_a_rank_killed_by_a_signal_is_quoted_by_what_it_wrote_dying():
    """SIGABRT from std::terminate on a gloo thread says nothing in planc's words: the account quotes the
    terminate lines (else the rank's last line); a rank that exited says only its error lines."""
    aborted = ("step 0 loss 0.0\nterminate called after throwing an instance of 'gloo::IoException'\n"
               "  what():  [gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.2]:41234\n")
    t = _tracker({0: (9.6, None), 1: (9.2, -6), 2: (9.2, -6), 3: (9.7, 0)})
    text = describe_failure(world=4, host_of={0: 0, 1: 0, 2: 1, 3: 1}, tracker=t,
                            logs={1: aborted, 2: "compute-only step 0\nsomething odd\n", 3: "fine\n"}, events=[],
                            timed_out=False, killed_at=None, timeout=240, collective_timeout=15)
    first = text.splitlines()[0]
    assert first.startswith("first to fail: rank 1 (host 0) killed by SIGABRT at 9.2 s: terminate called")
    assert "Connection closed by peer" in first
    assert "rank 2 (host 1): killed by SIGABRT at 9.2 s: something odd" in text
    assert "rank 3 (host 1): exited 0 at 9.7 s\n" in text + "\n"     # an exit with no error line says nothing
    # planc's own words still come first, and an exit status quotes only error lines
    assert last_words("planc: rank 1: bad shape\nterminate called\n", signalled=True) == "planc: rank 1: bad shape"
    assert last_words("just a line\n") == ""
    assert last_words("ValueError: x\nlast\n", signalled=False) == "ValueError: x"


def test_a_rank_killed_from_outside_is_not_quoted_by_its_last_line():
    """SIGKILL by the testbed, SIGTERM by a launcher: the rank's last line ("... built successfully")
    says nothing about it; only planc's words or an error line are quoted."""
    t = _tracker({2: (11.6, -15), 3: (11.5, -9)})
    t.signalled.add(3)
    logs = {3: "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n",
            2: "step 0\nplanc: rank 2: rank 2 (stage 1) failed in ReduceGrads\n"}
    text = describe_failure(world=4, host_of={0: 0, 1: 0, 2: 1, 3: 1}, tracker=t, logs=logs, events=[],
                            timed_out=False, killed_at=None, timeout=240, collective_timeout=15)
    assert "first to fail: rank 3 (host 1) killed by SIGKILL at 11.5 s\n" in text
    assert "rank 2 (host 1): killed by SIGTERM at 11.6 s: planc: rank 2: rank 2 (stage 1) failed" in text


def test_an_abort_the_testbed_sent_is_not_the_ranks_own():
    t = _tracker({1: (5.0, -6)})
    t.signalled.add(1)
    text = describe_failure(world=2, host_of={0: 0, 1: 0}, tracker=t, logs={1: "step 3 loss 1.0\n"}, events=[],
                            timed_out=False, killed_at=None, timeout=240, collective_timeout=15)
    assert "first to fail: rank 1 (host 0) killed by SIGABRT at 5.0 s\n" in text
