"""A rank that runs several stages (interleaved_1f1b, zbv: the stages of one rank class share its mesh).

One ``PlanEngine`` per stage, each with its own layers, optimizer, gradient buckets and reductions, as a
rank of one stage has; what the class shares is made here:

- **one receive thread** (``comm.RecvAhead``) over every stage's transfers, posting the class's RECVs in
  list order, gated by ``planc.plan.post_gates`` over the class's compute actions (with their stages);
- **the list**: plan.json ``pipeline.actions`` for the class, run in order, each instruction on the engine
  of its action's stage (``PlanSchedule`` tags each one with its stage); the REDUCEs, one per stage in
  list order, each that stage's gradient reduction and optimizer step;
- **handovers**: a transfer between two stages of the class whose route is ``local`` (plan.json: every
  device's destination region lies in what it holds) moves nothing: the SEND puts the tensor in
  :class:`LocalBox`, the RECV takes the rank's destination region of it (a copy: the two stages' autograd
  graphs stay apart, as across ranks).
"""
from __future__ import annotations

from planc.plan import Direction, Plan

from .comm import RecvAhead
from .dataflow import EngineError
from .regions import to_local

__all__ = ["local_routes", "LocalBox", "ClassRun"]


def local_routes(plan: Plan) -> frozenset:
    """``(transfer, direction)`` of every route plan.json marks ``local`` (moves nothing between devices)."""
    out = set()
    for t in plan.transfers:
        for d, route in ((Direction.FORWARD, t.forward), (Direction.BACKWARD, t.backward)):
            if route is not None and route.local:
                out.add((t.name, d))
    return frozenset(out)


class LocalBox:
    """Tensors one stage of a rank hands to another of its stages, by (transfer, direction, micro-batch)."""

    def __init__(self, plan: Plan, rank: int):
        self.rank = rank
        self.routes = {t.name: t for t in plan.transfers}
        self.held: dict = {}

    def put(self, transfer: str, direction: Direction, m: int, tensor) -> None:
        self.held[(transfer, direction, m)] = tensor.detach()

    def take(self, transfer: str, direction: Direction, m: int):
        key = (transfer, direction, m)
        if key not in self.held:
            raise EngineError(f"rank {self.rank}: transfer {transfer!r} ({direction}) of micro-batch {m} is taken "
                              "before its stage handed it over (the list's SEND must come before its RECV)")
        t = self.held.pop(key)
        route = self.routes[transfer].route(direction)
        src, dst = route.region("src", self.rank), route.region("dst", self.rank)
        return t[to_local(dst, src)].clone()


class ClassRun:
    """The engines of one rank's stages (``engines``: stage index -> PlanEngine, built in stage order) run as
    one rank class's list."""

    def __init__(self, engines: dict, plan: Plan, rank: int, tracer=None):
        self.engines, self.plan, self.rank = engines, plan, rank
        first = engines[min(engines)]
        self.rank_class = first.rank_class
        if set(engines) != set(self.rank_class.stages):
            raise EngineError(f"rank {rank}: engines for stages {sorted(engines)}, but its class runs "
                              f"{list(self.rank_class.stages)}")
        executors = {}
        for e in engines.values():
            executors.update(e.executors)
        self.recvs = RecvAhead.for_class(executors, self.rank_class, local_routes(plan),
                                         ahead=plan.runtime.recv_ahead, tracer=tracer)
        box = LocalBox(plan, rank)
        for e in engines.values():
            e.recvs, e.local_box = self.recvs, box

    def attach_nic(self, nic) -> None:
        for e in self.engines.values():
            e.attach_nic(nic)

    def train_batch(self) -> float:
        """One iteration of the class's list; this rank's share of the step's mean loss."""
        from .dsplan import PlanSchedule
        for e in self.engines.values():
            e.begin_step()
        self.recvs.start_step()
        nic = next((e.nic for e in self.engines.values() if e.nic is not None), None)
        if nic is not None:
            nic.begin_step()
        first = self.engines[min(self.engines)]
        loads = {s for s, e in self.engines.items() if e.is_first_stage() or e.is_last_stage()}
        schedule = PlanSchedule(self.rank_class, first.micro_batches, first.num_stages, first.stage_id, loads)
        for step in schedule.steps():
            for cmd in step:
                engine = self.engines.get(getattr(cmd, "planc_stage", None), first)
                engine._INSTRUCTION_MAP[type(cmd)](engine, **cmd.kwargs)
        return sum(e.loss_share() for e in self.engines.values())


def several_stages_unsupported(plan: Plan, rank: int, args=None) -> list[str]:
    """What a rank of several stages cannot run yet, one line each (every rank stops together): the global
    gradient norm (``clip``, fp16's overflow vote: one sum over every stage's gradients, which each stage's
    engine computes alone), checkpoints, a tied parameter held by two of the rank's stages, and a transfer
    between two of its stages that is not ``local`` (part of a region exchanged with the mesh's other
    devices)."""
    t = plan.train
    mine = {s.index for s in plan.stages_of(rank)}
    out = []
    why = f"rank {rank} runs stages {sorted(mine)} (one mesh)"
    if t.clip is not None or str(t.precision) == "fp16":
        out.append(f"{why}: clip and fp16's loss scaling need one gradient norm over every stage it runs; "
                   "not supported yet with interleaved_1f1b or zbv (drop clip, or use bf16)")
    if args is not None and (getattr(args, "save", None) or getattr(args, "resume", None)):
        out.append(f"{why}: checkpoints (--save, --resume) are not supported yet with interleaved_1f1b or zbv")
    for r in plan.reductions:
        if r.tied is not None and len({h.stage for h in r.tied.holders} & mine) > 1:
            out.append(f"{why}: a tied parameter is held by two of its stages; not supported yet")
            break
    local = local_routes(plan)
    for tr in plan.transfers:
        if tr.src_stage in mine and tr.dst_stage in mine:
            for d in Direction:
                if (tr.name, d) not in local:
                    out.append(f"{why}: transfer {tr.name!r} ({d}) between two of its stages exchanges part of "
                               "its region with other devices; only transfers that move nothing (local) run yet")
    return out
