"""The iteration simulator's figures (``planc.pipeline.simulate``): per stage its busy and bubble
fractions, the time its compute waited on communication, its peak activation bytes and micro-batches in
flight (docs/simulator.md).

A rank class of several stages (interleaved_1f1b, zbv) computes them on one stream: its devices' busy time,
waits and activation bytes are the class's, given for each of its stages; the micro-batches in flight are
each stage's own (from its ``F`` until its ``B``, or its ``W`` where it splits the backward).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageFigures", "Prediction", "figures"]


@dataclass(frozen=True, slots=True)
class StageFigures:
    stage: int
    busy: float                  # fraction of the iteration its devices compute
    bubble: float                # 1 - busy
    exposed_communication: float  # seconds its compute waits on communication (not on compute upstream)
    peak_activation_bytes: float  # one device: in-flight activations + received, not yet consumed inputs
    peak_in_flight: int

    def to_json(self) -> dict:
        return {"stage": self.stage, "busy": self.busy, "bubble": self.bubble,
                "exposed_communication": self.exposed_communication,
                "peak_activation_bytes": self.peak_activation_bytes, "peak_in_flight": self.peak_in_flight}


@dataclass(frozen=True, slots=True)
class Prediction:
    iteration: float
    free_iteration: float         # the same lists with free communication
    stages: tuple[StageFigures, ...]
    compute: tuple = ()           # (stage, device, kind, micro-batch, start, end) of every compute interval
    traffic: tuple = ()           # (link id, start, end, what) of every flow, what = (kind, name, micro-batch)
    transfers: tuple = ()         # (name, direction, micro-batch, start, end) of every transfer instance
    # the host NIC order the iteration ran under: ((host, ((sender, transfer, direction, micro-batch), ...)), ...)
    # (empty: sends share the links as they come); see :func:`predict`
    nic_order: tuple = ()
    unordered_iteration: float | None = None   # the same lists without the NIC order (None: not simulated)
    ready: tuple = ()             # (start, send key) of every cross-host send, in the order its host became ready

    @property
    def exposed_communication(self) -> float:
        return max(0.0, self.iteration - self.free_iteration)


def figures(sim, lists, ops_of, devs_of, g, trace, iteration, begin, comp_end, comp_nodes, begin_jobs,
            recv_sources, ends, marks, keep) -> Prediction:
    """The figures of one simulated iteration (``planc.pipeline.simulate._simulate``'s graph and trace)."""
    st, fin = trace.start, trace.finish
    busy: dict[int, float] = {}
    for node, s, d, kind, m in comp_nodes:
        busy[d] = busy.get(d, 0.0) + fin[node] - st[node]
    out: dict[int, StageFigures] = {}
    for (stages, _, _), ops, devs in zip(lists, ops_of, devs_of):
        split = {s for k, s, _ in ops if k == "W"}
        worst_busy, worst_wait, worst_mem = 1.0, 0.0, 0.0
        worst_k = dict.fromkeys(stages, 0)
        for d in devs:
            wait = 0.0
            events_ = []      # (time, order, bytes, stage, in-flight delta): order 0 frees before 1 holds
            for i, (kind, s, m) in enumerate(ops):
                c = sim.compute[s]
                b = begin[d, i]
                prev = fin[comp_end[d, i - 1]] if i else 0.0
                ready = max([prev] + [fin[r] for j in begin_jobs.get((d, i), ()) for r in recv_sources.get(j, ())])
                wait += max(0.0, st[b] - ready)
                if kind == "F":
                    events_.append((st[b], 1, c.activation_bytes, s, 1))
                    for j in begin_jobs.get((d, i), ()):     # received ahead, held until consumed
                        got = _job_bytes(g, j, d)
                        events_.append((fin[j], 1, got, s, 0))
                        events_.append((st[b], 0, -got, s, 0))
                    continue
                if kind == "B" and c.recompute_bytes:   # a recomputing stage holds them again while it runs B
                    events_.append((st[b], 1, c.recompute_bytes, s, 0))
                if kind == ("W" if s in split else "B"):   # what B keeps for W is held until W
                    events_.append((fin[comp_end[d, i]], 0, -c.activation_bytes - c.recompute_bytes, s, -1))
            if ops:
                wait += fin[ends[d]] - fin[comp_end[d, len(ops) - 1]]
            held = peak = 0.0
            k = dict.fromkeys(stages, 0)
            for _, _, x, s, dk in sorted(events_, key=lambda e: (e[0], e[1])):
                held += x
                k[s] += dk
                peak = max(peak, held)
                worst_k[s] = max(worst_k[s], k[s])
            frac = busy.get(d, 0.0) / iteration if iteration > 0 else 1.0
            worst_busy = min(worst_busy, frac)
            worst_wait, worst_mem = max(worst_wait, wait), max(worst_mem, peak)
        for s in stages:
            out[s] = StageFigures(s, worst_busy, 1.0 - worst_busy, worst_wait, worst_mem, worst_k[s])
    compute = traffic = transfers = ()
    if keep:
        compute = tuple((s, d, kind, m, st[n], fin[n]) for n, s, d, kind, m in comp_nodes)
        traffic = tuple((link, a, b, g.nodes[n].tag) for n, a, b, links, _ in trace.flows for link in links)
        transfers = tuple((sim.transfers[ti].name, direction, m, min((st[e] for e in nodes), default=0.0),
                           max((fin[e] for e in nodes), default=0.0)) for ti, direction, m, nodes in marks)
    return Prediction(iteration, iteration, tuple(out[s] for s in sorted(out)), compute, traffic, transfers)


def _job_bytes(g, job: int, device: int) -> float:
    """Bytes a receive job delivers to ``device`` (what its tasks' flows bring it)."""
    total = 0.0
    for dep in g.nodes[job].deps:
        for a, b, x in g.nodes[dep].flows:
            if b == device:
                total += x
    return total
