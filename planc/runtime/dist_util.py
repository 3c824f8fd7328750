"""Process-group start-up, timeouts and the start-up checks of DESIGN.md "Runtime".

Public API (stable):

    collective_timeout(plan=None) -> datetime.timedelta
        the plan's ``train { timeout = ... }`` (plan.json train.timeout), else 300 s; every
        group the runtime creates uses it, so a missing peer is an error after that long, never
        a hang. No environment variable changes it: plan.json is the whole decision.
    choose_backend(plan) -> str             plan.json runtime.backend (auto: "nccl" if CUDA is available else "gloo")
    init_distributed(backend=None, timeout=None) -> str
        init the default group from the launcher's env (RANK, WORLD_SIZE,
        MASTER_ADDR, MASTER_PORT) unless already initialized; returns the backend
    check_world(plan, world_size)           raises StartupError on a size mismatch
    check_hosts(plan, infos) -> list[str]   pure: problems between cluster.hosts and
                                            per-rank (hostname, local_world_size) infos
    check_digests(digests) -> list[str]     pure: problems when ranks disagree
    startup_checks(plan, digest=None)       collective: all of the above on every rank
    StartupError(RuntimeError)
    cpu_threads(backend, env=os.environ, cores=None) -> (threads | None, why)
        pure: the intra-op threads a CPU rank should use (cores ÷ ranks on this machine),
        None where the backend is not gloo or OMP_NUM_THREADS is set
    limit_cpu_threads(backend) -> str | None
        applies cpu_threads with torch.set_num_threads; the start-up line saying so
    lookup_group(groups, members) / GroupMissing / direction_groups(groups, direction)
        (topology.create_groups makes the groups; these live here so that
        reduce/reshard need not import deepspeed)
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from planc.plan import Plan
from planc.plan import DEFAULT_TIMEOUT_S   # the contract's default, re-exported
from planc.plan import digest as plan_digest

__all__ = ["collective_timeout", "choose_backend", "init_distributed", "check_world",
           "check_hosts", "check_digests", "startup_checks", "StartupError", "DEFAULT_TIMEOUT_S",
           "lookup_group", "GroupMissing", "direction_groups", "BACKWARD", "cpu_threads", "limit_cpu_threads"]



class StartupError(RuntimeError):
    """The launched job does not match the plan it is asked to run."""

    same_on_every_rank = True   # every rank raises the same message (the checks gather first)


def collective_timeout(plan=None) -> datetime.timedelta:
    """The plan's ``train { timeout = ... }`` (plan.json ``train.timeout``; ``runtime.timeout`` for a plan
    without a model), else 300 s (also without a plan)."""
    planned = None if plan is None else plan.train.timeout if plan.train is not None else plan.runtime.timeout
    return datetime.timedelta(seconds=planned if planned is not None else DEFAULT_TIMEOUT_S)


def choose_backend(plan=None) -> str:
    """plan.json ``runtime.backend``; ``auto`` (and no plan): NCCL where this machine has CUDA, else gloo.
    A plan that asks for NCCL on a machine without CUDA is a StartupError, not a silent gloo run."""
    wanted = str(plan.runtime.backend) if plan is not None else "auto"
    if wanted == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if wanted == "nccl" and not torch.cuda.is_available():
        raise StartupError("the plan's backend is nccl (train { backend = nccl }) but this machine has no CUDA "
                           "device; compile with backend = auto or gloo to run on CPUs")
    return wanted


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | None = None) -> str:
    """Initialize the default process group once (env:// rendezvous) with our timeout."""
    if dist.is_initialized():
        return dist.get_backend()
    backend = backend or choose_backend()
    timeout = timeout or collective_timeout()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % max(1, torch.cuda.device_count()))
    dist.init_process_group(backend=backend, timeout=timeout)
    return backend


def backend_device() -> torch.device:
    """The device of the started backend: this process's current CUDA device under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def devices_line(described) -> str:
    """Rank 0's start-up line of where every rank runs, from each rank's ``(anything, "BACKEND DEVICE")``:
    ``devices: gloo cpu (ranks 0, 1, 2)`` or ``devices: nccl cuda:0 (rank 0), nccl cuda:1 (rank 1)``;
    what a test of the GPU tier reads to know no rank fell back to gloo or the CPU."""
    ranks: dict[str, list[int]] = {}
    for r, (_, where) in enumerate(described):
        ranks.setdefault(where, []).append(r)
    return "devices: " + ", ".join(f"{where} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                                   for where, rs in ranks.items())


def cpu_threads(backend: str, env=None, cores: int | None = None) -> tuple[int | None, str]:
    """The intra-op threads one CPU rank should use, and why.

    Torch's default is a thread per core in every rank, and its OpenMP workers spin for a while
    after each parallel region. With more ranks than cores (an emulated cluster on one machine) the
    spinning workers of ranks that wait in a collective take the cores from the ranks the collective
    waits for: a tensor-parallel GPT of 8 gloo ranks on 2 cores ran 9.5 s per step, 0.85 s with one
    thread per rank (docs/runtime.md). So on gloo a rank gets ``cores ÷ ranks on this machine``
    threads, at least 1; the ranks on this machine are the launcher's ``LOCAL_WORLD_SIZE`` (torchrun)
    or ``LOCAL_SIZE`` (DeepSpeed), else the world size. ``OMP_NUM_THREADS``, where set, is the
    user's choice and is kept; NCCL ranks compute on their GPU and are left alone."""
    env = os.environ if env is None else env
    if backend != "gloo":
        return None, f"backend {backend}: left to torch"
    if env.get("OMP_NUM_THREADS", "").strip():
        return None, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS'].strip()} (set by the user)"
    if cores is None:
        cores = machine_cores()
    local, source = 1, "the world size"
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "WORLD_SIZE"):
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            local, source = int(value), name
            break
    threads = max(1, cores // local)
    return threads, f"{cores} core(s) ÷ {local} rank(s) on this machine ({source}); OMP_NUM_THREADS overrides"


def machine_cores(cgroup: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota
    (``docker --cpus=2`` on a large host: quota ÷ period, rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = open(cgroup).read().split()[:2]
        if quota != "max" and int(period) > 0:
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def limit_cpu_threads(backend: str) -> str | None:
    """Set this rank's intra-op threads by :func:`cpu_threads`; the start-up line saying so (None: unchanged)."""
    threads, why = cpu_threads(backend)
    if threads is None:
        return None
    torch.set_num_threads(threads)
    return f"cpu threads: {threads} per rank ({why})"


def check_world(plan: Plan, world_size: int) -> None:
    want = plan.cluster.devices
    if world_size != want:
        raise StartupError(
            f"world size {world_size} does not match the plan {plan.name!r}: "
            f"cluster.devices = {want} ({len(plan.cluster.hosts)} hosts of "
            f"{[len(h) for h in plan.cluster.hosts]} devices); launch {want} processes")


def check_hosts(plan: Plan, infos) -> list[str]:
    """infos[r] = (hostname, local_world_size or None) of rank r.

    When the job spans several hostnames, ranks sharing a hostname must be exactly
    one plan host and each host's device count must match. A single hostname means
    an emulated cluster (testbed, one machine): nothing to compare.
    """
    hosts = [sorted(h) for h in plan.cluster.hosts]
    by_name: dict[str, list[int]] = {}
    for r, (name, _) in enumerate(infos):
        by_name.setdefault(name, []).append(r)
    if len(by_name) <= 1:
        return []
    problems = []
    for name, ranks in sorted(by_name.items(), key=lambda kv: kv[1][0]):
        if sorted(ranks) not in hosts:
            problems.append(f"host {name!r} runs ranks {ranks}, but the plan's hosts are {hosts}")
        for r in ranks:
            lws = infos[r][1]
            if lws is not None:
                want = next((len(h) for h in hosts if r in h), None)
                if want is not None and lws != want:
                    problems.append(f"rank {r} on {name!r}: LOCAL_WORLD_SIZE={lws} but the plan "
                                    f"puts {want} devices on its host")
                    break
    return problems


def check_digests(digests) -> list[str]:
    groups: dict[str, list[int]] = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    if len(groups) <= 1:
        return []
    return ["ranks disagree on the plan: " + "; ".join(
        f"ranks {rs} have sha256 {d[:16]}…" for d, rs in sorted(groups.items(), key=lambda kv: kv[1][0]))]


def startup_checks(plan: Plan, digest: str | None = None) -> None:
    """World size, plan digest agreement and per-host device counts; collective.

    Every rank runs the same all_gather before raising, so all ranks fail
    together with the same message instead of some hanging.
    """
    world = dist.get_world_size()
    digest = digest or plan_digest(plan)
    lws = os.environ.get("LOCAL_WORLD_SIZE")
    mine = (digest, socket.gethostname(), int(lws) if lws else None)
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    problems = []
    try:
        check_world(plan, world)
    except StartupError as e:
        problems.append(str(e))
    problems += check_digests([g[0] for g in gathered])
    if not problems:
        problems += check_hosts(plan, [(g[1], g[2]) for g in gathered])
    if problems:
        raise StartupError(f"rank {dist.get_rank()}: plan {plan.name!r} cannot run here:\n  "
                           + "\n  ".join(problems))


class GroupMissing(KeyError):
    def __str__(self):
        return self.args[0] if self.args else "group missing"


BACKWARD = "backward"


def direction_groups(groups: dict, direction: str) -> dict:
    """The groups as one direction sees them: backward prefers its own communicators."""
    if direction != BACKWARD:
        return groups
    view = {k: v for k, v in groups.items() if not (k and k[0] == BACKWARD)}
    view.update({k[1:]: v for k, v in groups.items() if k and k[0] == BACKWARD})
    return view


def lookup_group(groups: dict, members):
    key = tuple(sorted(int(m) for m in members))
    if key not in groups:
        raise GroupMissing(f"process group {list(key)} is not in plan.json \"groups\"; the compiler "
                           f"must list every group a step or task uses")
    return groups[key]


# torch 2.13 deprecates the *_tensor spellings in favour of *_single; torch 2.4 has only the former.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
