"""Typed syntax tree of a .plan file. Every node carries the span it came from.

These nodes say what was written; ``planc.lang.check`` decides what it means
and turns them into ``planc.ir`` records.
"""

from __future__ import annotations

from dataclasses import dataclass

from planc.span import Span


@dataclass(frozen=True, slots=True)
class Num:
    value: float
    text: str
    span: Span

    @property
    def is_int(self) -> bool:
        """Written as a whole number (digits only, optionally signed); exact even past float range."""
        return self.text.lstrip("-").isdigit()

    @property
    def int_value(self) -> int:
        """The exact integer written (only meaningful when ``is_int``)."""
        return int(self.text)


@dataclass(frozen=True, slots=True)
class Name:
    value: str
    span: Span


@dataclass(frozen=True, slots=True)
class Str:
    value: str
    span: Span


@dataclass(frozen=True, slots=True)
class Quantity:
    number: Num
    unit: str
    span: Span


@dataclass(frozen=True, slots=True)
class Call:
    name: Name
    args: tuple["KeyValue", ...]
    span: Span


@dataclass(frozen=True, slots=True)
class ListValue:
    items: tuple["Value", ...]
    span: Span


@dataclass(frozen=True, slots=True)
class TupleValue:
    """``(0.9, 0.999)``: a fixed-size group of values (``betas``); the checker says how many a key takes."""

    items: tuple["Value", ...]
    span: Span


Value = Num | Name | Str | Quantity | Call | ListValue | TupleValue


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: Name
    value: Value
    span: Span


@dataclass(frozen=True, slots=True)
class LevelAttr:
    key: Name
    value: Quantity
    span: Span


@dataclass(frozen=True, slots=True)
class LevelDecl:
    name: Name
    fanout: Num
    attrs: tuple[LevelAttr, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class ClusterBlock:
    levels: tuple[LevelDecl, ...]
    host: Name | None
    file: Str | None  # `cluster "file.yaml"`
    span: Span
    flops: Quantity | Num | None = None    # `flops = 312 TFLOP/s` (a plain number: reported, it needs a unit)
    memory: Quantity | Num | None = None   # `memory = 80 GB`
    cores: Quantity | Num | None = None    # `cores = 2 per cluster` (a quantity: reported, a count takes no unit)
    cores_per: Name | None = None          # the word after `per` (a level or `cluster`); None: not written
    # `flops bf16 = 989 TFLOP/s`: (the precision as written, its value), in source order
    flops_by: tuple[tuple[Name, "Quantity | Num"], ...] = ()


@dataclass(frozen=True, slots=True)
class AxisDecl:
    name: Name
    size: Num
    span: Span


@dataclass(frozen=True, slots=True)
class ParallelBlock:
    axes: tuple[AxisDecl, ...]
    place: ListValue | None  # None: auto
    place_span: Span | None
    span: Span


@dataclass(frozen=True, slots=True)
class CodeBlock:
    kind: str  # model | loss | data
    ref: Str
    args: tuple[KeyValue, ...]
    span: Span
    hf: bool = False   # `model hf "ARCH" { config keys }` / `model hf "dir"`


@dataclass(frozen=True, slots=True)
class RangeNode:
    start: Num
    end: Num
    span: Span


@dataclass(frozen=True, slots=True)
class MeshDim:
    name: Name | None
    size: Num
    span: Span


@dataclass(frozen=True, slots=True)
class StageDecl:
    index: Num
    layers: RangeNode | None
    devices: RangeNode | None
    mesh: tuple[MeshDim, ...]
    span: Span
    auto: Span | None = None   # `layers auto`: where `auto` is written
    recompute: Span | None = None   # `... recompute` at the end of the line: where it is written
    zero: Num | None = None         # `... zero N` at the end of the line: the stage's ZeRO degree


@dataclass(frozen=True, slots=True)
class StagesAuto:
    """``stages = auto(N)``: the compiler cuts the model's layers into N stages (``count`` None: ``auto``)."""

    count: Num | None
    span: Span


@dataclass(frozen=True, slots=True)
class SpecItem:
    """One written spec token: a word (`S0`, `R`, `S0RR`) or a named form `S(data, tensor)`."""

    word: Name
    names: tuple[Name, ...] | None
    span: Span


@dataclass(frozen=True, slots=True)
class Spec:
    items: tuple[SpecItem, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class TensorType:
    dtype: Name
    dims: tuple[Num, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class TransferDecl:
    """``type`` and the specs are None where omitted (allowed only in a plan with a model)."""

    name: Name
    type: TensorType | None
    src_stage: Num
    src_layer: Num | None
    src_spec: Spec | None
    dst_stage: Num
    dst_spec: Spec | None
    src_at: Span   # `stage I [layer L] [as SPEC]` after `from`
    dst_at: Span   # `stage J [as SPEC]` after `to`
    span: Span


@dataclass(frozen=True, slots=True)
class StepArg:
    key: Name
    value: Name
    level: Name | None
    span: Span


@dataclass(frozen=True, slots=True)
class StepNode:
    collective: Name
    args: tuple[StepArg, ...] | None  # None: bare name (`using allreduce`)
    span: Span


@dataclass(frozen=True, slots=True)
class ReduceDecl:
    name: Name
    axes: tuple[Name, ...]
    using: tuple[StepNode, ...] | None
    using_span: Span | None
    type: TensorType | None
    span: Span


@dataclass(frozen=True, slots=True)
class SettingsBlock:
    kind: str  # resharding | synthesis | train
    items: tuple[KeyValue, ...]
    span: Span


@dataclass(frozen=True, slots=True)
class DeepspeedDecl:
    path: Str
    span: Span


Statement = (ClusterBlock | ParallelBlock | CodeBlock | StageDecl | StagesAuto | TransferDecl
             | ReduceDecl | SettingsBlock | DeepspeedDecl)


@dataclass(frozen=True, slots=True)
class PlanFile:
    name: Name | None
    statements: tuple[Statement, ...]
    span: Span
