"""Can the compiled plan hang? Every rank's communication, simulated under rendezvous semantics.

``check_rendezvous(plan, ahead=4, backend="nccl")`` replays one training step
(and the ``--comm-only`` step) of every rank exactly in the order the runtime
issues it, with the strict semantics of NCCL, and returns the hangs it finds
(empty: the plan cannot hang). Pure and torch-free; docs/deadlock.md has the
model and how each rule maps to the runtime's code.

The model, per rank:

- the **compute thread** (``engine.PlanEngine``) runs its class's ``pipeline.actions`` list in
  order (``planc.plan.RankClass.turns``): a RECV waits for the receive thread's job
  (``RecvAhead.take``), a SEND issues the rank's part of the transfer (``TransferExecutor.send``,
  non-blocking), F and B compute (a tensor-parallel all_reduce when the rank has a tensor group).
  Then it waits for all its sends (``SendReaper.drain``), runs
  its gradient reduction program, and the world all_reduce of the loss.
  Ranks in no stage only do the all_reduce;
- the **receive thread** (``comm.RecvAhead``) runs, one after the other, the
  list's RECVs in list order, those of compute action ``j`` only once the compute thread has begun the turn
  ``planc.plan.gates.post_gates`` names (``j - ahead``, or for ``B m`` this stage's ``F m``
  when earlier; ``advance``), each job being ``TransferExecutor.recv``: per task of the
  route in schedule order, the receive, broadcast or all_gather it posts and
  the waits in the order the code has them;
- the **NIC thread** (``nicorder.NicOrder``; gloo, when plan.json has a host
  NIC order for the rank's host): the rank's listed sends in the host's
  order, each once the compute thread handed it over (it signals instead of
  issuing) and the host's previous listed send was sent; the compute thread
  waits for those turns with its other sends;
- ``--comm-only`` (``commcheck.comm_only``): one thread; a barrier, then per
  transfer the forward sends, the receives and a wait on the sends, then
  every reduction the rank is in, then a barrier.

Communicators: an operation completes when its partners are at the head of
their own queue on the same communicator. NCCL: a single send/recv runs on
the two-rank communicator of its peer pair (torch ``ProcessGroupNCCL``), so
p2p is FIFO per (direction, pair) and tags are not looked at: the k-th send of
a pair meets the k-th receive; a broadcast is a collective on the task's group
(``("transfer", direction, *members)``). gloo: p2p matches by (pair, tag) in
any order and a broadcast is the relay chain sender → receivers. Allgather
parts, reduction steps, tensor groups and the world are collectives (FIFO per
communicator) on both. Sends never block the thread that issues them.

The state it stops in does not depend on the order in which the simulation
runs threads: operations only ever enable others, and matching at queue heads
is deterministic. A rank that uses one communicator from both of its threads
(impossible for a compiled plan: transfers go from earlier to later stages)
gets the simulation's interleaving.

The package: ``build`` writes every rank's thread programs as the runtime issues them, ``events``
runs them under these semantics until nothing moves, and ``report`` says where they stopped.
"""
from __future__ import annotations

from planc.pipeline.deadlock.build import Builder
from planc.pipeline.deadlock.classes import check_mode as _check_by_classes
from planc.pipeline.deadlock.events import Sim
from planc.pipeline.deadlock.report import Hang, Wait, find_hangs
from planc import plan as planfile
from planc.plan.gates import DEFAULT_AHEAD

__all__ = ["check_rendezvous", "Hang", "Wait", "BACKENDS", "MODES", "METHODS"]

BACKENDS = ("nccl", "gloo")
MODES = ("train", "comm_only")
METHODS = ("classes", "full")


def check_rendezvous(plan: planfile.Plan, ahead: int = DEFAULT_AHEAD, backend: str = "nccl", mode: str = "auto",
                     tensor_parallel: bool = True, limit: int = 8, method: str = "classes",
                     shared: dict | None = None) -> list[Hang]:
    """The hangs of ``plan`` under rendezvous semantics (empty: it cannot hang).

    ``ahead``: how many operations the receive thread runs ahead (plan.json
    ``runtime.recv_ahead``, which the compiler passes; default 4). ``backend``: ``"nccl"`` (strict: p2p FIFO per
    peer pair, broadcast as a collective) or ``"gloo"`` (p2p matched by tag, broadcast
    as a relay chain). ``mode``: ``"train"`` (one training step; needs a pipeline),
    ``"comm_only"`` (one ``--comm-only`` step) or ``"auto"``: ``comm_only``, and
    ``train`` too when the plan trains. ``tensor_parallel``: model a tensor-parallel
    all_reduce in every F and B of ranks with a tensor group. At most ``limit`` hangs
    per mode are returned. ``method``: ``"classes"`` (default: one representative per class of
    pipeline replicas, then the collectives-only tail of every rank; ``planc.pipeline.deadlock.classes``,
    the same verdict) or ``"full"`` (every rank simulated at once; also where classes cannot be formed).
    ``shared``: a dict the caller passes to the checks of one plan under each backend: the tails' verdict
    (collectives only, the same under both backends) is found once and kept there, and so are the per-rank
    lookups every ``Builder`` of the plan reads.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if ahead < 0:
        raise ValueError(f"ahead must be >= 0, got {ahead}")
    if mode == "auto":
        trains = plan.pipeline is not None and plan.train is not None and plan.train.trainable
        modes = ("train", "comm_only") if trains else ("comm_only",)
    elif mode in MODES:
        if mode == "train" and plan.pipeline is None:
            raise ValueError("mode 'train' needs a plan with a pipeline")
        modes = (mode,)
    else:
        raise ValueError(f"mode must be 'auto' or one of {list(MODES)}, got {mode!r}")
    out: list[Hang] = []
    for m in modes:
        found = _check_by_classes(plan, m, backend, ahead, tensor_parallel, limit, shared) \
            if method == "classes" else None
        if found is not None:
            out += found
            continue
        b = Builder(plan, backend, ahead, tensor_parallel, shared)
        threads = []
        for rank in range(plan.cluster.devices):
            threads += b.train_threads(rank) if m == "train" else b.comm_only_threads(rank)
        if b.invalid:
            for rank, text in b.invalid[:limit]:
                out.append(Hang("invalid", (rank,), (Wait(rank, "compute" if m == "train" else "main", m, text, (),
                                                          "torch refuses it"),), backend, m))
            continue
        sim = Sim(threads)
        sim.run()
        out += find_hangs(threads, backend, m, limit, b.turns)
    return out
