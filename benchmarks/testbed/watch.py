"""Watching a testbed launch from outside: rank 0's step lines (and their progress bar), failed
ranks, ranks' peak memory, which rank ended first and how (``RankTracker``), the account of a failed
launch (``describe_failure``), the DeepSpeed launcher command, each host's hostname and the
/dev/shm buffers a launch's ranks leave (helpers of ``netns.Testbed.launch``)."""
from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

STEP_RE = re.compile(r"step (\d+) comm ([0-9.]+) s \(verified")                  # train.py --comm-only
TRAIN_STEP_RE = re.compile(r"step (\d+) loss (\S+) time ([0-9.]+) s [0-9.]+ samples/s")   # train.py

SHM_PREFIX = "/dev/shm/deepspeed_allreduce_buffer"   # DeepSpeed's CPU shm all-reduce (ops/csrc/cpu/comm/shm.cpp)


def shm_buffers(master_addr: str, port: str | int) -> list[str]:
    """The /dev/shm buffers of DeepSpeed's CPU ranks of one job: ``<prefix>_<uid>_<addr>_<port>_<rank>``
    (MASTER_ADDR and MASTER_PORT name the job)."""
    return sorted(glob.glob(f"{SHM_PREFIX}_{os.getuid()}_{glob.escape(master_addr)}_{port}_*"))


def remove_shm(master_addr: str, port: str | int, keep=()) -> list[str]:
    """Remove the job's buffers (those not in ``keep``: there before it started); returns what was removed."""
    removed = []
    for path in shm_buffers(master_addr, port):
        if path in keep:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


@functools.lru_cache(maxsize=1)
def _can_unshare_uts() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--uts", "true"], capture_output=True).returncode == 0


def uts_wrapper(hostname: str) -> list[str]:
    """The command prefix that runs the rest under its own ``hostname`` (a UTS namespace), so the
    runtime's per-host check sees each testbed host as its own machine; [] when unshare cannot."""
    if not _can_unshare_uts():
        return []
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]


class StepBar:
    """Rank 0's steps as a ``planc.commands.ui.progress`` bar on stderr; ``enabled`` None: when stderr is a
    terminal (piped output stays as it was). ``step(n)``: rank 0 printed step n."""

    def __init__(self, steps: int, label: str, enabled: bool | None = None):
        from planc.commands import ui

        self.it, self.done = None, 0
        if enabled is None:
            enabled = ui.is_tty(sys.stderr)
        if enabled and steps > 0:
            self.it = ui.progress(range(steps), label, stream=sys.stderr, piped="silent",
                                  describe=lambda n: f"step {n}")
            try:
                next(self.it)                     # the bar is up, step 0 running
            except Exception:                     # e.g. rich's LiveError: another live display is up
                self.it = None

    @property
    def shown(self) -> bool:
        return self.it is not None

    def step(self, n: int) -> None:
        while self.it is not None and self.done <= n:
            self.done += 1
            try:
                next(self.it)
            except StopIteration:
                self.it = None

    def close(self) -> None:
        if self.it is not None:
            self.it.close()
            self.it = None


class _StepWatch:
    """Follows rank 0's log while it is written and calls ``on_step(n, seconds)`` per step line."""

    def __init__(self, logdir: Path, pattern: str, on_step):
        self.logdir, self.pattern, self.on_step = logdir, pattern, on_step
        self.f, self.buf = None, ""

    def poll(self) -> None:
        if self.on_step is None:
            return
        if self.f is None:
            found = sorted(self.logdir.glob(self.pattern))
            if not found:
                return
            self.f = open(found[-1], errors="replace")
        self.buf += self.f.read()
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            m = STEP_RE.search(line) or TRAIN_STEP_RE.search(line)
            if m:
                self.on_step(int(m.group(1)), float(m.group(2) if m.re is STEP_RE else m.group(3)))

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


_RANK_FAILED_RE = re.compile(r"exits with return code = (-?\d+)")


def _rank_failed(logdir: Path) -> bool:
    """Whether a DeepSpeed launcher has reported a failed rank (it then kills its own ranks)."""
    for f in logdir.glob("host*.log"):
        try:
            if _RANK_FAILED_RE.search(f.read_text(errors="replace")):
                return True
        except OSError:
            pass
    return False


def deepspeed_command(python: str) -> list[str]:
    """The ``deepspeed`` launcher next to ``python`` (a virtual environment's), else DeepSpeed's runner module."""
    exe = Path(python).parent / "deepspeed"
    if exe.is_file() and os.access(exe, os.X_OK):
        return [str(exe)]
    return [python, "-u", "-c", "import sys; from deepspeed.launcher.runner import main; sys.exit(main())"]


def _rank_processes(launched, script: str | tuple[str, ...]):
    """(psutil process, RANK) of every running process below ``launched`` (Popen objects) whose
    command line runs ``script`` (or one of them); processes that vanish or cannot be read are skipped."""
    scripts = (script,) if isinstance(script, str) else tuple(script)
    try:
        import psutil
    except ImportError:   # pragma: no cover - psutil comes with DeepSpeed
        return
    for p in launched:
        if p.poll() is not None:
            continue
        try:
            procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        except psutil.Error:
            continue
        for q in procs:
            try:
                cmdline = q.cmdline()
                if not any(s in cmdline for s in scripts):
                    continue
                rank = q.environ().get("RANK")
            except (psutil.Error, OSError):
                continue
            if rank is not None:
                yield q, int(rank)


# -- following a launch's ranks ---------------------------------------------------------------

class RankTracker:
    """Each rank's pid (found below the launched processes by its RANK) and how and when it ended.

    ``poll`` reads ``/proc/PID/stat``: a rank that has exited is a zombie until its parent (the
    DeepSpeed launcher, which polls once a second) reaps it, and its exit status is field 52."""

    def __init__(self, script: str | tuple[str, ...], t0: float):
        self.script, self.t0 = script, t0
        self.pids: dict[int, int] = {}                            # rank -> pid
        self.ended: dict[int, tuple[float, int | None]] = {}      # rank -> (seconds since t0, returncode)
        # pid -> returncode of a rank the testbed sent SIGKILL: it cannot be caught, so when the
        # launcher reaps the rank before ``poll`` sees its zombie (a loaded machine), that is its status
        self.sigkilled: dict[int, int] = {}
        self.signalled: set[int] = set()                          # ranks the testbed sent a signal (a fault)

    def scan(self, launched) -> None:
        """Find rank processes below ``launched`` (Popen objects) not yet known."""
        for q, rank in _rank_processes(launched, self.script):
            if rank not in self.pids:
                self.pids[rank] = q.pid

    def poll(self, now: float, reaped: dict[int, int] | None = None) -> None:
        """Note the ranks that ended; ``reaped``: pid -> returncode of those this process waited for."""
        for rank, pid in list(self.pids.items()):   # kill_rank may scan from another thread
            if rank in self.ended:
                continue
            state, code = _proc_state(pid)
            if state is None or state in "ZX":
                if code is None:
                    code = (reaped or {}).get(pid, self.sigkilled.get(pid))
                self.ended[rank] = (now - self.t0, code)

    def codes_from_launchers(self, hosts: list[list[int]], host_logs: dict[int, str]) -> None:
        """After the launch: a rank whose exit status ``poll`` missed (its launcher reaped it first, on a
        loaded machine) gets its host launcher's: the DeepSpeed launcher logs ``... exits with return
        code = C`` with the code of the child that failed, which on a host with one rank is that rank's.
        On a host of several ranks the code is not attributable and stays unknown."""
        for h, ranks in enumerate(hosts):
            m = _RANK_FAILED_RE.search(host_logs.get(h, ""))
            if m is None or len(ranks) != 1:
                continue
            r = ranks[0]
            if r in self.ended and self.ended[r][1] is None:
                self.ended[r] = (self.ended[r][0], int(m.group(1)))

    def alive(self) -> list[int]:
        return sorted(r for r in self.pids if r not in self.ended)


def _proc_state(pid: int) -> tuple[str | None, int | None]:
    """(state letter, returncode as subprocess gives it) of ``pid``; (None, None) if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None, None
    fields = text.rsplit(")", 1)[1].split()
    state = fields[0]
    if state not in "ZX" or len(fields) < 50:
        return state, None
    status = int(fields[49])
    return state, (-(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF)


def sample_hwm(tracker: RankTracker, hwm: dict[int, int]) -> None:
    """Peak resident memory (VmHWM, kB) of every running rank the tracker knows."""
    for rank, pid in tracker.pids.items():
        if rank in tracker.ended:
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                kb = next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
        except (OSError, ValueError):
            continue
        if kb is not None:
            hwm[rank] = max(hwm.get(rank, 0), kb)


# -- the account of a failed launch -----------------------------------------------------------

_SAID_RE = re.compile(r"^planc: rank \d+: .*$", re.M)


def _how(code: int | None) -> str:
    if code is None:
        return "ended (exit status not seen)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited {code}"


# what a process killed by a signal leaves on stderr: C++'s std::terminate (a gloo::IoException thrown
# on a communication thread), CPython's fault handler, glibc's own abort messages
_DYING_RE = re.compile(r"terminate called|what\(\):|Fatal Python error|Segmentation fault|"
                       r"double free|corrupted|Aborted|core dumped")


# signals a process raises on itself (abort, a fault): its own stderr says why; SIGKILL and SIGTERM
# come from outside (the testbed, a launcher) and the rank's last line says nothing about them
_SELF_INFLICTED = {int(s) for s in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL,
                                     signal.SIGTRAP)}


def _self_inflicted(code: int | None) -> bool:
    return code is not None and code < 0 and -code in _SELF_INFLICTED


def last_words(log: str, *, signalled: bool = False) -> str:
    """What a rank said when it failed: its last ``planc: rank R: ...`` line, else its last error line.

    A rank that died of a signal it raised itself (``signalled``: SIGABRT, SIGSEGV, ...) seldom says
    either: its last lines that name how a process dies (``terminate called ...``, ``what(): ...``,
    ``Fatal Python error``) are quoted instead, else its last line, so the account keeps the one message
    that explains the signal."""
    said = _SAID_RE.findall(log)
    if said:
        return said[-1].strip()
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    if signalled:
        dying = [line for line in lines if _DYING_RE.search(line)]
        if dying:
            return " | ".join(dying[-2:])[:400]
    errors = [line for line in lines if re.search(r"\w*(Error|Exception)\b", line)]
    if errors:
        return errors[-1]
    return lines[-1][:400] if signalled and lines else ""


def describe_failure(*, world: int, host_of: dict[int, int], tracker: RankTracker | None,
                     logs: dict[int, str], events: list[tuple[float, str]], timed_out: bool,
                     killed_at: float | None, timeout: float, collective_timeout: float) -> str:
    """A few lines: the faults applied, the rank that failed first and how, then every rank's end."""
    lines = []
    if events:
        lines.append("faults: " + "; ".join(f"{t:.1f} s: {what}" for t, what in events))
    ended = tracker.ended if tracker is not None else {}
    # ranks the tracker saw end in the same poll share a time: a rank a fault hit (the testbed sent it
    # a signal) is then the cause and goes first (its launcher stops its siblings within the same poll)
    hit = tracker.signalled if tracker is not None else set()
    failed = sorted(((t, r) for r, (t, code) in ended.items() if code != 0
                     and (killed_at is None or t < killed_at)), key=lambda x: (x[0], x[1] not in hit, x[1]))
    if failed:
        t, r = failed[0]
        said = last_words(logs.get(r, ""), signalled=_self_inflicted(ended[r][1]) and r not in hit)
        lines.append(f"first to fail: rank {r} (host {host_of.get(r, '?')}) {_how(ended[r][1])} at {t:.1f} s"
                     + (f": {said}" if said else ""))
    if timed_out:
        lines.append(f"the launch timeout ({timeout:g} s) ran out: the testbed killed every process left")
    elif killed_at is not None:
        lines.append(f"at {killed_at:.1f} s the testbed killed the processes left (a rank had failed; "
                     f"collective timeout {collective_timeout:g} s)")
    for r in range(world):
        host = host_of.get(r, "?")
        if r in ended:
            t, code = ended[r]
            how = f"{_how(code)} at {t:.1f} s" if killed_at is None or t < killed_at else "killed by the testbed"
        elif tracker is not None and r in tracker.pids:
            how = "killed by the testbed"
        else:
            how = "not seen running"
        code = ended.get(r, (None, None))[1]
        said = last_words(logs.get(r, ""), signalled=_self_inflicted(code) and r not in hit
                          and (killed_at is None or ended[r][0] < killed_at))
        lines.append(f"  rank {r} (host {host}): {how}" + (f": {said}" if said else ""))
    return "\n".join(lines)
