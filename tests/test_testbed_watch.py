"""The testbed's account of how each rank ended (planc.testbed.watch), without a testbed: a rank
whose exit status was missed gets its host launcher's only where that is exactly its own."""

from __future__ import annotations

from planc.testbed.watch import RankTracker, describe_failure

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
