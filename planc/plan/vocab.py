"""The closed vocabularies of plan.json (and of the language, where it says the same): defined once.

Every name is a ``StrEnum`` whose values are the spellings plan.json and the .plan language use;
``planc.ir`` imports the ones the language shares. The language's requests that may say ``auto``
(``ir.Strategy``, ``ir.PipeSchedule``) are the compiler's own: plan.json only ever holds what
``auto`` resolved to, one of the members here. Stdlib only.
"""
from __future__ import annotations

from enum import StrEnum

__all__ = ["DTYPE_NAMES", "MeshAxis", "Strategy", "Collective", "Schedule", "StageMode", "ReductionMode",
           "Direction", "Precision", "Recompute", "Backend", "InHost"]

DTYPE_NAMES = ("f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool")


class MeshAxis(StrEnum):
    """Axis names the language reserves: ``pipe`` cuts the model into stages; ``data`` and
    ``tensor`` are the mesh axes that data- and tensor-parallel runtimes look for by name."""

    PIPE = "pipe"
    DATA = "data"
    TENSOR = "tensor"


class Strategy(StrEnum):
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"
    LOCAL_ALLGATHER = "local_allgather"
    GLOBAL_ALLGATHER = "global_allgather"


class Collective(StrEnum):
    ALLREDUCE = "allreduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    REDUCE = "reduce"
    BROADCAST = "broadcast"


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    EAGER_1F1B = "eager_1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"   # pipeline.virtual stages per mesh (Megatron's virtual pipeline)
    ZB_H1 = "zb_h1"                         # 1F1B with the backward split into B and W (zero bubble, H1)
    ZBV = "zbv"                             # two stages per mesh in a V, with the B/W split


class StageMode(StrEnum):
    PIPE_AXIS = "pipe_axis"
    EXPLICIT = "explicit"


class ReductionMode(StrEnum):
    SYNTHESIZE = "synthesize"
    ALLREDUCE = "allreduce"
    PROGRAM = "program"


class Direction(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"


class Precision(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


class Recompute(StrEnum):
    NONE = "none"
    FULL = "full"       # a stage keeps only its inputs per in-flight micro-batch and reruns its forward in backward


class Backend(StrEnum):
    AUTO = "auto"        # NCCL where the launching machine has CUDA, gloo elsewhere
    GLOO = "gloo"
    NCCL = "nccl"


class InHost(StrEnum):
    SHARED_MEMORY = "shared_memory"   # gloo: a one-host group's reduction steps through /dev/shm (shmcoll)
    BACKEND = "backend"               # the backend's own collectives
