"""The tensor-parallel traffic the probe measures per stage (``TensorTraffic``), and what placement and the
simulator price: a sequence-parallel stage's gathers and reduce-scatters as all-reduce equivalents.

Re-exported by ``planc.model.probe``; imports nothing of planc (``ModelProbe`` and ``ir.Program`` are only read).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["TensorTraffic", "stage_traffic", "tensor_traffic_by_stage", "sequence_ops"]


def _allreduce_equivalents(ops) -> tuple[int, ...]:
    out, gathers, scatters = [], [], []
    for kind, nbytes in ops:
        if kind == "all_reduce":
            out.append(int(nbytes))
        else:
            (gathers if kind == "all_gather" else scatters).append(int(nbytes))
    out += [(a + b) // 2 for a, b in zip(gathers, scatters)]
    k = min(len(gathers), len(scatters))
    out += [b // 2 for b in gathers[k:] + scatters[k:]]
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TensorTraffic:
    """What one device of a tensor-parallel stage all-reduces over its tensor group per micro-batch.

    Measured by the probe (``planc.runtime.probe.measure_tensor_traffic``): the stage's layers, built
    with a stand-in tensor group of size ``degree``, run forward and backward on ``rows`` rows (the
    device's slice of a micro-batch along the stage's ``data`` axis); every all-reduce of Megatron's
    g (forward) and f (backward) is logged with its bytes, in issue order. ``error``: some layer of
    the stage could not be measured (its traffic is then missing from the counts).
    """

    stage: int
    degree: int
    rows: int
    forward: tuple[int, ...] = ()
    backward: tuple[int, ...] = ()
    error: str | None = None
    # the same stage sequence-parallel: ((collective, bytes), ...) forward and backward, in issue order
    # (collective all_reduce, all_gather or reduce_scatter; bytes of the whole tensor); None: not measured
    sequence: tuple | None = None

    def with_sequence(self) -> "TensorTraffic":
        """This stage's traffic when it runs sequence-parallel, as all-reduce equivalents (the form placement
        and the simulator price): in the ring model an all-gather and a reduce-scatter of N bytes each cost
        half an all-reduce of N bytes, bandwidth and latency alike, so each all-gather is paired with a
        reduce-scatter (in order) into one all-reduce of their mean size; one left unpaired counts as an
        all-reduce of half its size (its latency counted whole)."""
        if self.sequence is None:
            return self
        return dataclasses.replace(self, forward=_allreduce_equivalents(self.sequence[0]),
                                   backward=_allreduce_equivalents(self.sequence[1]))

    @property
    def ops(self) -> tuple[int, ...]:
        """Every all-reduce of one micro-batch, forward then backward (bytes each)."""
        return self.forward + self.backward

    @property
    def bytes(self) -> int:
        """Bytes one device all-reduces per micro-batch, forward and backward together."""
        return sum(self.forward) + sum(self.backward)


def sequence_ops(rec) -> tuple | None:
    if not rec or rec.get("errors"):
        return None
    return tuple(tuple(zip((str(k) for k in rec[f"{side}_kinds"]), (int(b) for b in rec[side])))
                 for side in ("forward", "backward"))


def stage_traffic(probe: ModelProbe | None, program: ir.Program | None = None) -> tuple[TensorTraffic, ...]:
    """The probe's tensor traffic per stage, a sequence-parallel stage's (``ir.Stage.sequence_parallel``) as
    its all-reduce equivalents (``TensorTraffic.with_sequence``)."""
    if probe is None:
        return ()
    sp = {s.index for s in program.stages if s.sequence_parallel} if program is not None else set()
    return tuple(t.with_sequence() if t.stage in sp else t for t in getattr(probe, "tensor_traffic", ()))


def tensor_traffic_by_stage(probe: ModelProbe | None, program: ir.Program | None = None
                            ) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per tensor-parallel stage, ``(forward, backward)``: the bytes of each all-reduce one device
    issues over its tensor group per micro-batch (placement's input; empty without a measurement);
    sequence-parallel stages as :func:`stage_traffic` gives them."""
    return {t.stage: (t.forward, t.backward) for t in stage_traffic(probe, program) if t.ops}
