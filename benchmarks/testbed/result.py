"""What a testbed launch returns (``LaunchResult``) and the testbed's error (``TestbedError``)."""
from __future__ import annotations

from dataclasses import dataclass, field


class TestbedError(RuntimeError):
    """The testbed could not be built, or a launch inside it failed."""

    __test__ = False   # not a pytest class


@dataclass
class LaunchResult:
    returncode: int                       # 0 when every rank exited 0; 124 on timeout
    stdout: str                           # rank 0's output (stdout and stderr)
    logs: dict[int, str] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)
    timed_out: bool = False
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)       # training: rank 0's `step N loss X` values
    peak_rss_kb: dict[int, int] = field(default_factory=dict)   # rank -> VmHWM sampled while it ran
    host_logs: dict[int, str] = field(default_factory=dict)     # host -> its DeepSpeed launcher's output
    launcher: str = "deepspeed"
    failure: str = ""                     # when it failed: faults, the rank that failed first and how, every rank's end
    rank_exits: dict[int, int | None] = field(default_factory=dict)   # rank -> returncode (-N: signal N; None: not seen)
    rank_ended_s: dict[int, float] = field(default_factory=dict)      # rank -> seconds after the start it ended
    killed: bool = False                  # the testbed killed what was left (timeout, or grace after a failure)
    events: list[tuple[float, str]] = field(default_factory=list)     # faults: (seconds after the start, what)
    dropped_packets: dict[int, int] = field(default_factory=dict)     # host -> packets the loss fault dropped
    collective_timeout_s: float = 0.0     # the collective timeout of the plan the ranks ran
    host_exits: dict[int, int | None] = field(default_factory=dict)   # host -> its DeepSpeed launcher's returncode
    shm_removed: list[str] = field(default_factory=list)  # DeepSpeed /dev/shm buffers its ranks left, removed
    cpu_quota: object = None              # benchmarks.testbed.quota.Quota (cpus, quota_us, period_us); None: no quota
    cpu_stats: dict[int, dict] = field(default_factory=dict)   # rank -> usage_s, nr_periods, nr_throttled, throttled_s

    def check(self) -> "LaunchResult":
        if self.returncode != 0 and self.failure:
            raise TestbedError(f"launch {'timed out' if self.timed_out else f'exited {self.returncode}'}:\n"
                               f"{self.failure}")
        if self.returncode != 0:
            bad = next((r for r, text in sorted(self.logs.items()) if "Error" in text or "error" in text), 0)
            what = "timed out" if self.timed_out else f"exited {self.returncode}"
            launchers = "".join(f"\nhost {h}'s launcher output ends:\n{t[-1500:]}"
                                for h, t in sorted(self.host_logs.items()) if not self.logs.get(bad))
            raise TestbedError(f"launch {what}; rank {bad}'s output ends:\n{self.logs.get(bad, '')[-3000:]}"
                               + launchers)
        return self
