"""The contract between the compiler and the runtime: plan.json as typed records (stdlib only).

The compiler assembles its decisions into these records and writes plan.json with them; every rank
of a launched job reads plan.json back with them (the same code: ``planc compile`` copies this
package into every output as ``OUT/planc/plan/``). The closed vocabularies are defined here once
(``vocab``); ``planc.ir`` imports them. ../shared/PLAN_FORMAT.md is the contract in words;
docs/plan-format.md lists what planc adds.
"""
from .actions import SHARED_MESH, Action, RankClass, Turn, class_stages, stages_per_class
from . import checkpoint   # planc.json of a checkpoint (its own FORMAT): planc.plan.checkpoint.Manifest
from .file import FORMAT, Plan, digest, dumps, load
from .gates import DEFAULT_AHEAD, post_gates
from .jsonpath import At, Group, PlanFileError, Range, Region
from .notes import LayerNotes, Notes, PipelineNotes, PlacementNotes, ReductionNotes, TransferNotes
from .optim import OPTIMIZER_DEFAULTS, LossScale, LrSchedule, Optimizer, Zero3
from .records import Cluster, Holder, Level, Reduction, Stage, Step, Tied, TiedSplit
from .runtime import (DEFAULT_GRAD_BUCKET_BYTES, DEFAULT_RECV_AHEAD, DEFAULT_REDUCE_BUCKET_BYTES,
                      DEFAULT_SHM_SLOT_BYTES, DEFAULT_TIMEOUT_S, Runtime)
from .training import CodeRef, HfModel, Pipeline, TagLayout, Train, VocabSplit, in_flight, padded_vocab, vocab_rows
from .transfers import Route, Task, Transfer
from .vocab import (DTYPE_NAMES, Backend, Collective, Direction, InHost, MeshAxis, Precision, Recompute,
                    ReductionMode, Schedule, StageMode, Strategy)

__all__ = [
    "FORMAT", "Plan", "digest", "dumps", "load", "At", "Group", "PlanFileError", "Range", "Region", "Cluster",
    "Level", "Reduction", "Stage", "Step", "Tied", "TiedSplit", "Holder", "DEFAULT_GRAD_BUCKET_BYTES", "DEFAULT_RECV_AHEAD",
    "DEFAULT_REDUCE_BUCKET_BYTES", "DEFAULT_SHM_SLOT_BYTES", "DEFAULT_TIMEOUT_S", "Runtime", "CodeRef", "HfModel", "VocabSplit", "padded_vocab", "vocab_rows", "Pipeline", "TagLayout", "Train", "Route", "Task",
    "Transfer", "DTYPE_NAMES", "Backend", "Collective", "Direction", "InHost", "MeshAxis", "Precision",
    "ReductionMode", "Schedule", "StageMode", "Strategy", "OPTIMIZER_DEFAULTS", "LossScale", "LrSchedule", "Zero3",
    "Optimizer", "Recompute", "DEFAULT_AHEAD", "post_gates", "checkpoint", "Notes", "PlacementNotes",
    "ReductionNotes", "TransferNotes", "PipelineNotes", "LayerNotes", "Action", "RankClass", "Turn",
    "SHARED_MESH", "class_stages", "stages_per_class", "in_flight",
]
