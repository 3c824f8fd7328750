"""Semantic checks: AST → ``ir.Program``.

All errors found are gathered (sorted by position) and raised together as one
``PlanError``; a check that cannot run because an earlier part is broken is
skipped rather than reported twice.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path

import yaml
from decimal import Decimal

from planc import ir
from planc.lang import ast
from planc.lang.errors import Diagnostic, PlanError, Span, did_you_mean
from planc.lang.units import BANDWIDTH, SIZE, TIME, parse_quantity

SINGLE_BLOCKS = {
    ast.ClusterBlock: "cluster", ast.ParallelBlock: "parallel", ast.DeepspeedDecl: "deepspeed",
}
_SPEC_TOKEN = re.compile(r"R|S01|S0|S1")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_DEVICES = 1 << 20
MAX_DIGITS = 18  # whole numbers in a plan fit in 64 bits
# Settings whose work grows linearly with their value at compile time: capped so that no accepted
# plan makes `planc compile` run (or allocate) without end.
MAX_TRIALS = 4096               # randomized_greedy: each trial is a full pass over the jobs
MAX_DFS_BUDGET_S = 600.0        # dfs: a node count of budget x DFS_NODES_PER_SECOND
MAX_MICRO_BATCHES = 100_000     # the pipeline lists and simulates 2 x micro_batches ops per stage


class _Checker:
    def __init__(self, tree: ast.PlanFile, path: str, text: str):
        self.tree = tree
        self.path = path
        self.text = text
        self.dir = str(Path(path).resolve().parent) if path and not path.startswith("<") else os.getcwd()
        self.diags: list[Diagnostic] = []

    # ------------------------------------------------------------ helpers
    def err(self, message: str, span: Span, hint: str | None = None) -> None:
        self.diags.append(Diagnostic(message, span, hint))

    def int_of(self, num: ast.Num, what: str, minimum: int = 1) -> int | None:
        if not num.is_int:
            self.err(f"{what} must be a whole number, got {num.text}", num.span)
            return None
        if len(num.text.lstrip("-")) > MAX_DIGITS:
            self.err(f"{what} is too large ({len(num.text)} digits)", num.span)
            return None
        v = num.int_value
        if v < minimum:
            self.err(f"{what} must be at least {minimum}, got {v}", num.span)
            return None
        return v

    def quantity(self, q: ast.Quantity, table: dict, kind: str) -> float | None:
        if q.unit not in table:
            self.err(f"'{q.unit}' is not a {kind} unit; expected one of " + ", ".join(table), q.span)
            return None
        value = float(Decimal(q.number.text) * Decimal(repr(table[q.unit])))
        if not math.isfinite(value):
            self.err(f"{q.number.text} {q.unit} is too large", q.span)
            return None
        return value

    # ------------------------------------------------------------ driver
    def run(self) -> ir.Program:
        seen: dict[str, Span] = {}
        by_kind: dict[str, list] = {}
        for st in self.tree.statements:
            kind = SINGLE_BLOCKS.get(type(st)) or getattr(st, "kind", None)
            if isinstance(st, (ast.StageDecl, ast.TransferDecl, ast.ReduceDecl)):
                kind = type(st).__name__
            elif kind is not None:
                if kind in seen:
                    self.err(f"'{kind}' may appear only once (first at line {seen[kind].line})", st.span)
                    continue
                seen[kind] = st.span
            by_kind.setdefault(kind, []).append(st)

        name = self.tree.name.value if self.tree.name else _name_from_path(self.path)
        cluster = self.cluster(by_kind.get("cluster", [None])[0])
        parallel = self.parallel(by_kind.get("parallel", [None])[0], cluster)
        model = self.code(by_kind.get("model", [None])[0])
        loss = self.code(by_kind.get("loss", [None])[0])
        data = self.code(by_kind.get("data", [None])[0])
        if model is not None:
            for what, ref in (("loss", loss), ("data", data)):
                if ref is None:
                    self.err(f"a plan with a model needs a '{what} \"file.py:function\"' line",
                             by_kind["model"][0].span)
        stage_mode, stages = self.stages(by_kind.get("StageDecl", []), cluster, parallel, model is not None)
        transfers = self.transfers(by_kind.get("TransferDecl", []), stages, model is not None or "model" in by_kind)
        reductions = self.reductions(by_kind.get("ReduceDecl", []), cluster, parallel, stages, stage_mode)
        resharding = self.resharding(by_kind.get("resharding", [None])[0])
        synthesis = self.synthesis(by_kind.get("synthesis", [None])[0])
        train = self.train(by_kind.get("train", [None])[0], parallel, stages)
        ds = by_kind.get("deepspeed", [None])[0]

        if self.diags or cluster is None:
            if cluster is None and "cluster" not in by_kind:
                self.err("a plan needs a 'cluster { ... }' block", self.tree.span if self.tree.span.line else Span(1, 1, 1, 2, self.path))
            raise PlanError(self.diags, {self.path: self.text})
        return ir.Program(
            name=name,
            source_path=self.path,
            source_sha256=hashlib.sha256(self.text.encode()).hexdigest(),
            source_dir=self.dir,
            cluster=cluster,
            parallel=parallel,
            stage_mode=stage_mode,
            stages=stages,
            transfers=transfers,
            reductions=reductions,
            model=model, loss=loss, data=data,
            resharding=resharding,
            synthesis=synthesis,
            train=train,
            deepspeed_overrides=ds.path.value if ds else None,
        )

    # ------------------------------------------------------------ cluster
    def cluster(self, block: ast.ClusterBlock | None) -> ir.Cluster | None:
        if block is None:
            return None
        if block.file is not None:
            return self.cluster_yaml(block.file)
        levels: list[ir.Level] = []
        names: dict[str, Span] = {}
        for ld in block.levels:
            fanout = self.int_of(ld.fanout, f"level '{ld.name.value}' fanout")
            if ld.name.value in names:
                self.err(f"level '{ld.name.value}' is declared twice", ld.name.span)
            names[ld.name.value] = ld.name.span
            bw = lat = None
            for a in ld.attrs:
                if a.key.value == "bandwidth":
                    if bw is not None:
                        self.err("bandwidth is given twice for this level", a.span)
                    bw = self.quantity(a.value, BANDWIDTH, "bandwidth")
                    if bw is not None and bw <= 0:
                        self.err("bandwidth must be positive", a.value.span)
                else:
                    if lat is not None:
                        self.err("latency is given twice for this level", a.span)
                    lat = self.quantity(a.value, TIME, "time")
            if fanout is None:
                continue
            if fanout > 1 and bw is None and not any(a.key.value == "bandwidth" for a in ld.attrs):
                self.err(f"level '{ld.name.value}' has {fanout} units and needs a bandwidth "
                         f"(e.g. 'level {ld.name.value} x {fanout} : bandwidth 100 GB/s')", ld.span)
            levels.append(ir.Level(ld.name.value, fanout, bw, lat or 0.0, ld.span))
        if not block.levels:
            self.err("a cluster needs at least one 'level NAME x N' line", block.span)
            return None
        host = self.host_level(levels, block.host.value if block.host else None, block.host.span if block.host else block.span)
        if host is None or len(levels) != len(block.levels):
            return None
        return self.sized_cluster(ir.Cluster(tuple(levels), host), block.span)

    def sized_cluster(self, cluster: ir.Cluster, span: Span) -> ir.Cluster | None:
        if cluster.devices > MAX_DEVICES:
            self.err(f"the cluster has {cluster.devices} devices; planc handles at most {MAX_DEVICES}", span)
            return None
        return cluster

    def host_level(self, levels: list[ir.Level], host: str | None, span: Span) -> str | None:
        if host is not None:
            if host not in {l.name for l in levels}:
                self.err(f"host level '{host}' is not a level of this cluster", span,
                         did_you_mean(host, [l.name for l in levels]))
                return None
            return host
        for l in levels:
            if l.fanout > 1:
                return l.name
        return levels[0].name if levels else None

    def cluster_yaml(self, file: ast.Str) -> ir.Cluster | None:
        path = Path(self.dir) / file.value
        try:
            doc = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            self.err(f"cluster file '{file.value}' not found (looked in {path.parent})", file.span)
            return None
        except (OSError, yaml.YAMLError) as e:
            self.err(f"cannot read cluster file '{file.value}': {str(e).splitlines()[0]}", file.span)
            return None
        if isinstance(doc, dict) and isinstance(doc.get("cluster"), dict):
            doc = doc["cluster"]
        if not isinstance(doc, dict) or not isinstance(doc.get("levels"), list) or not doc["levels"]:
            self.err(f"cluster file '{file.value}' must hold a mapping with a non-empty 'levels' list "
                     "(each: name, fanout, bandwidth, latency) and optionally 'host'", file.span)
            return None
        levels = []
        for i, entry in enumerate(doc["levels"]):
            where = f"cluster file '{file.value}', levels[{i}]"
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                self.err(f"{where}: expected a mapping with 'name' and 'fanout'", file.span)
                return None
            fanout = entry.get("fanout", entry.get("x"))
            if not isinstance(fanout, int) or isinstance(fanout, bool) or fanout < 1:
                self.err(f"{where}: 'fanout' must be a whole number >= 1, got {fanout!r}", file.span)
                return None
            try:
                bw = _yaml_quantity(entry.get("bandwidth"), "bandwidth")
                lat = _yaml_quantity(entry.get("latency"), "time") or 0.0
            except ValueError as e:
                self.err(f"{where}: {e}", file.span)
                return None
            if fanout > 1 and bw is None:
                self.err(f"{where}: level '{entry['name']}' has {fanout} units and needs a bandwidth", file.span)
                return None
            levels.append(ir.Level(entry["name"], fanout, bw, lat, file.span))
        names = [l.name for l in levels]
        if len(set(names)) != len(names):
            self.err(f"cluster file '{file.value}': level names repeat: {names}", file.span)
            return None
        host = self.host_level(levels, doc.get("host"), file.span)
        return self.sized_cluster(ir.Cluster(tuple(levels), host), file.span) if host else None

    # ------------------------------------------------------------ parallel
    def parallel(self, block: ast.ParallelBlock | None, cluster: ir.Cluster | None) -> ir.Parallel | None:
        if block is None:
            return None
        axes, seen = [], set()
        for a in block.axes:
            size = self.int_of(a.size, f"axis '{a.name.value}' size")
            if a.name.value in seen:
                self.err(f"axis '{a.name.value}' is declared twice", a.name.span)
            seen.add(a.name.value)
            if size is not None:
                axes.append(ir.Axis(a.name.value, size, a.span))
        if not block.axes:
            self.err("a parallel block needs at least one axis (e.g. 'data = 8')", block.span)
            return None
        if len(axes) != len(block.axes):
            return None
        if cluster is not None and math.prod(a.size for a in axes) != cluster.devices:
            sizes = " x ".join(f"{a.name} {a.size}" for a in axes)
            self.err(f"axis sizes multiply to {math.prod(a.size for a in axes)} ({sizes}) but the cluster has "
                     f"{cluster.devices} devices", block.span)
            return None
        matrix = None
        if block.place is not None:
            matrix = self.matrix(block.place, axes, cluster)
            if matrix is None:
                return None
        return ir.Parallel(tuple(axes), matrix, block.span)

    def matrix(self, lv: ast.ListValue, axes: list[ir.Axis], cluster: ir.Cluster | None):
        rows = []
        for row in lv.items:
            if not isinstance(row, ast.ListValue):
                self.err("a placement matrix is a list of rows, e.g. [[2,1],[1,4]]", row.span)
                return None
            vals = []
            for x in row.items:
                if not isinstance(x, ast.Num):
                    self.err("matrix entries must be whole numbers", x.span)
                    return None
                v = self.int_of(x, "a matrix entry")
                if v is None:
                    return None
                vals.append(v)
            rows.append(tuple(vals))
        if len(rows) != len(axes):
            self.err(f"the matrix has {len(rows)} rows but there are {len(axes)} axes "
                     f"({', '.join(a.name for a in axes)}); one row per axis", lv.span)
            return None
        if cluster is None:
            return tuple(rows)
        n = len(cluster.levels)
        ok = True
        for row, a, node in zip(rows, axes, lv.items):
            if len(row) != n:
                self.err(f"row for axis '{a.name}' has {len(row)} entries but the cluster has {n} levels "
                         f"({', '.join(l.name for l in cluster.levels)}); one column per level", node.span)
                ok = False
            elif math.prod(row) != a.size:
                self.err(f"row for axis '{a.name}' multiplies to {math.prod(row)}, but the axis size is {a.size}", node.span)
                ok = False
        if not ok:
            return None
        for j, level in enumerate(cluster.levels):
            col = math.prod(r[j] for r in rows)
            if col != level.fanout:
                self.err(f"column for level '{level.name}' multiplies to {col}, but the level has {level.fanout} units", lv.span)
                ok = False
        return tuple(rows) if ok else None

    # ------------------------------------------------------------ code references
    def code(self, block: ast.CodeBlock | None) -> ir.CodeRef | None:
        if block is None:
            return None
        ref = block.ref.value
        path, sep, fn = ref.rpartition(":")
        if not sep or not path.endswith(".py") or not _IDENT.fullmatch(fn):
            self.err(f"{block.kind} must be written \"file.py:function\", got \"{ref}\"", block.ref.span)
            return None
        args, seen = [], set()
        for kv in block.args:
            if kv.key.value in seen:
                self.err(f"argument '{kv.key.value}' is given twice", kv.key.span)
            seen.add(kv.key.value)
            args.append((kv.key.value, self.plain_value(kv.value)))
        return ir.CodeRef(path, fn, tuple(args), block.span)

    def plain_value(self, v):
        if isinstance(v, ast.Num):
            return v.int_value if v.is_int and len(v.text) <= MAX_DIGITS else v.value
        if isinstance(v, ast.Str):
            return v.value
        if isinstance(v, ast.Name):
            return {"true": True, "false": False, "none": None}.get(v.value, v.value)
        if isinstance(v, ast.ListValue):
            return tuple(self.plain_value(x) for x in v.items)
        if isinstance(v, ast.Quantity):
            for table in (SIZE, TIME, BANDWIDTH):
                if v.unit in table:
                    return v.number.value * table[v.unit]
        self.err("expected a number, string, name or list here", v.span)
        return None

    # ------------------------------------------------------------ stages
    def stages(self, decls, cluster, parallel, has_model) -> tuple[ir.StageMode, tuple[ir.Stage, ...]]:
        explicit = [d for d in decls if d.devices is not None]
        if explicit and len(explicit) != len(decls):
            derived = next(d for d in decls if d.devices is None)
            self.err("either every stage names its devices ('on devices C..D as (M1, M2)') or none does", derived.span)
            return ir.StageMode.EXPLICIT, ()
        mode = ir.StageMode.EXPLICIT if explicit else ir.StageMode.PIPE_AXIS
        if mode is ir.StageMode.PIPE_AXIS and parallel is None and decls:
            self.err("stages without 'on devices' take their devices from the 'pipe' axis; add a 'parallel' block "
                     "or give each stage its devices", decls[0].span)
            return mode, ()
        if mode is ir.StageMode.PIPE_AXIS and parallel is None and not decls:
            if cluster is not None and not self.diags:
                if has_model:
                    self.err("a plan with a model needs a 'parallel' block or explicit stages", self.tree.span)
            return mode, ()
        out: list[ir.Stage] = []
        seen: dict[int, Span] = {}
        for d in decls:
            idx = self.int_of(d.index, "stage index", minimum=0)
            if idx is None:
                continue
            if idx in seen:
                self.err(f"stage {idx} is declared twice (first at line {seen[idx].line})", d.index.span)
                continue
            seen[idx] = d.span
            layers = None
            if d.layers is not None:
                a = self.int_of(d.layers.start, "first layer", minimum=0)
                b = self.int_of(d.layers.end, "end layer", minimum=0)
                if a is not None and b is not None:
                    if b <= a:
                        self.err(f"layer range {a}..{b} is empty (ranges are half-open: A..B holds A up to B-1)", d.layers.span)
                    else:
                        layers = (a, b)
            elif has_model:
                self.err(f"stage {idx} needs its layers ('stage {idx} : layers A..B') because the plan has a model", d.span)
            first = shape = None
            axes: tuple[str, ...] = ()
            if mode is ir.StageMode.EXPLICIT:
                first, shape, axes = self.explicit_mesh(d, cluster)
            elif parallel is not None:
                axes = tuple(a.name for a in parallel.axes if a.name != "pipe")
            out.append(ir.Stage(idx, layers, first, shape, axes, d.span))
        out.sort(key=lambda s: s.index)
        if not out and decls:
            return mode, ()
        # indices 0..S-1
        for want, s in enumerate(out):
            if s.index != want:
                self.err(f"stages are numbered 0..{len(out) - 1} in order; stage {want} is missing", s.span)
                break
        if mode is ir.StageMode.PIPE_AXIS and parallel is not None:
            pipe = parallel.size_of("pipe") if "pipe" in parallel.axis_names() else 1
            if out and len(out) != pipe:
                self.err(f"the 'pipe' axis has size {pipe} but {len(out)} stages are declared; "
                         "declare one stage per pipe coordinate", out[-1].span if len(out) > pipe else decls[0].span)
            if not out and pipe > 1 and has_model:
                self.err(f"the 'pipe' axis has size {pipe}; declare each stage's layers ('stage 0 : layers 0..4')", parallel.span)
            if not out:
                axes = tuple(a.name for a in parallel.axes if a.name != "pipe")
                out = [ir.Stage(i, None, None, None, axes, parallel.span) for i in range(pipe)]
        self.check_layers(out)
        if mode is ir.StageMode.EXPLICIT:
            self.check_disjoint(out)
        return mode, tuple(out)

    def explicit_mesh(self, d: ast.StageDecl, cluster):
        c = self.int_of(d.devices.start, "first device", minimum=0)
        e = self.int_of(d.devices.end, "end device", minimum=0)
        dims, names = [], []
        for md in d.mesh:
            size = self.int_of(md.size, "mesh dimension size")
            if size is None:
                return None, None, ()
            dims.append(size)
            names.append(md.name.value if md.name else None)
        if any(n is not None for n in names) and any(n is None for n in names):
            self.err("name every mesh dimension or none (e.g. 'as (data = 2, tensor = 4)')", d.span)
            return None, None, ()
        axes = tuple(n if n is not None else f"m{i}" for i, n in enumerate(names))
        if len(set(axes)) != len(axes):
            self.err(f"mesh dimension names repeat: {', '.join(axes)}", d.span)
        if len(dims) > 2:
            self.err(f"a stage mesh has 1 or 2 dimensions, got {len(dims)}", d.span)
        if c is None or e is None:
            return None, None, axes
        if e <= c:
            self.err(f"device range {c}..{e} is empty (ranges are half-open)", d.devices.span)
            return None, None, axes
        if cluster is not None and e > cluster.devices:
            self.err(f"device range {c}..{e} goes past the cluster's {cluster.devices} devices (0..{cluster.devices})", d.devices.span)
            return None, None, axes
        if math.prod(dims) != e - c:
            self.err(f"mesh shape ({', '.join(map(str, dims))}) holds {math.prod(dims)} devices but the range "
                     f"{c}..{e} has {e - c}", d.span)
            return None, None, axes
        return c, tuple(dims), axes

    def check_layers(self, stages: list[ir.Stage]) -> None:
        with_layers = [s for s in stages if s.layers is not None]
        if not with_layers:
            return
        if len(with_layers) != len(stages):
            return
        expect = 0
        for s in stages:
            a, b = s.layers
            if a < expect:
                self.err(f"stage {s.index} layers {a}..{b} overlap the previous stage's (which end at {expect})", s.span)
            elif a > expect:
                self.err(f"stage {s.index} layers start at {a} but the previous stage ends at {expect}; "
                         f"layer ranges must be contiguous", s.span)
            expect = b

    def check_disjoint(self, stages: list[ir.Stage]) -> None:
        owner: dict[int, int] = {}
        for s in stages:
            devs = s.explicit_devices
            if devs is None:
                continue
            clash = sorted({owner[d] for d in devs if d in owner})
            if clash:
                self.err(f"stage {s.index} devices {devs[0]}..{devs[-1] + 1} overlap stage {clash[0]}'s; "
                         "stage meshes must be disjoint", s.span)
            for d in devs:
                owner.setdefault(d, s.index)

    def stage_shape(self, stage: ir.Stage, parallel: ir.Parallel | None) -> tuple[int, ...] | None:
        mesh = ir.stage_mesh(stage, parallel)
        return mesh[0] if mesh is not None else None

    # ------------------------------------------------------------ transfers
    def transfers(self, decls, stages, has_model: bool) -> tuple[ir.Transfer, ...]:
        """Without a model every transfer is complete; with one, an omitted type or spec stays None
        for ``planc.infer`` (which also checks a written spec's entry count and divisibility
        once the shape is measured)."""
        out, names = [], {}
        by_index = {s.index: s for s in stages}
        parallel = self._parallel_cache
        for t in decls:
            if t.name.value in names:
                self.err(f"transfer '{t.name.value}' is declared twice", t.name.span)
                continue
            names[t.name.value] = t.span
            name = t.name.value
            missing = False
            if t.type is None and not has_model:
                self.err(f"transfer '{name}' needs its type, e.g. 'transfer {name} : f32[8, 1024] from ...'; "
                         "only a plan with a model may leave it out (planc measures it on the model)", t.name.span)
                missing = True
            example = " ".join(["S0"] + ["R"] * (len(t.type.dims) - 1 if t.type is not None else 1))
            for side, spec, at in (("source", t.src_spec, t.src_at), ("destination", t.dst_spec, t.dst_at)):
                if spec is None and not has_model:
                    self.err(f"transfer '{name}' needs its {side} layout, e.g. '{_source_text(at, self.text)} as "
                             f"{example}'; "
                             "only a plan with a model may leave it out (planc derives it from the stage's mesh)", at)
                    missing = True
            dtype, shape = self.tensor_type(t.type) if t.type is not None else (None, None)
            src = self.stage_ref(t.src_stage, by_index)
            dst = self.stage_ref(t.dst_stage, by_index)
            if src is not None and dst is not None and src.index == dst.index:
                self.err(f"transfer '{t.name.value}' goes from stage {src.index} to itself", t.dst_stage.span)
                continue
            layer = None
            if t.src_layer is not None:
                layer = self.int_of(t.src_layer, "layer", minimum=0)
                if layer is not None and src is not None and src.layers is not None:
                    a, b = src.layers
                    if not a <= layer < b:
                        self.err(f"layer {layer} is not in stage {src.index} (layers {a}..{b})", t.src_layer.span)
            if src is None or dst is None or (t.type is not None and shape is None):
                continue
            sspec = self.spec(t.src_spec, shape, src, parallel) if t.src_spec is not None else None
            dspec = self.spec(t.dst_spec, shape, dst, parallel) if t.dst_spec is not None else None
            if missing or (t.src_spec is not None and sspec is None) or (t.dst_spec is not None and dspec is None):
                continue
            out.append(ir.Transfer(name, dtype, shape, src.index, layer, sspec, dst.index, dspec, t.span,
                                   type_span=t.type.span if t.type is not None else t.name.span,
                                   src_spec_span=t.src_spec.span if t.src_spec is not None else t.src_at,
                                   dst_spec_span=t.dst_spec.span if t.dst_spec is not None else t.dst_at))
        return tuple(out)

    def stage_ref(self, num: ast.Num, by_index) -> ir.Stage | None:
        idx = self.int_of(num, "stage index", minimum=0)
        if idx is None:
            return None
        if idx not in by_index:
            have = ", ".join(str(i) for i in sorted(by_index)) or "none"
            self.err(f"there is no stage {idx} (stages: {have})", num.span)
            return None
        return by_index[idx]

    def tensor_type(self, tt: ast.TensorType):
        dtype = tt.dtype.value
        ok = True
        if dtype not in ir.DTYPE_BYTES:
            self.err(f"unknown dtype '{dtype}'; expected one of {', '.join(ir.DTYPE_BYTES)}", tt.dtype.span,
                     did_you_mean(dtype, ir.DTYPE_BYTES))
            ok = False
        dims = []
        for d in tt.dims:
            v = self.int_of(d, "a tensor dimension")
            if v is None:
                ok = False
            dims.append(v)
        return (dtype, tuple(dims)) if ok else (None, None)

    def spec(self, sp: ast.Spec, shape, stage: ir.Stage, parallel) -> ir.ShardingSpec | None:
        """The written spec; with ``shape`` None (to be measured) only its form and mesh axes are checked."""
        mesh_shape = self.stage_shape(stage, parallel)
        entries: list[tuple[tuple[int, ...], Span]] = []
        for item in sp.items:
            if item.names is not None:
                if item.word.value != "S":
                    self.err(f"a named sharding entry is written S(axis, ...), not {item.word.value}(...)", item.word.span)
                    return None
                dims = []
                for n in item.names:
                    if n.value not in stage.mesh_axes:
                        self.err(f"'{n.value}' is not a mesh axis of stage {stage.index} (axes: "
                                 f"{', '.join(stage.mesh_axes) or 'none'})", n.span, did_you_mean(n.value, stage.mesh_axes))
                        return None
                    dims.append(stage.mesh_axes.index(n.value))
                if dims not in ([0], [1], [0, 1]):
                    self.err("only S0, S1 and S01 (dimension 0 major) exist; "
                             f"S({', '.join(n.value for n in item.names)}) is not one of them", item.span)
                    return None
                entries.append((tuple(dims), item.span))
                continue
            word = item.word.value
            toks = _SPEC_TOKEN.findall(word)
            if "".join(toks) != word:
                self.err(f"'{word}' is not a sharding spec; each tensor dimension is R, S0, S1 or S01 "
                         "(spaces optional: 'S0 R R' or 'S0RR')", item.word.span)
                return None
            for tok in toks:
                entries.append(((), item.span) if tok == "R" else (tuple(int(c) for c in tok[1:]), item.span))
        if shape is not None and len(entries) != len(shape):
            self.err(spec_length_error(len(entries), shape), sp.span)
            return None
        used: dict[int, int] = {}
        for tdim, (axes, span) in enumerate(entries):
            for a in axes:
                if a in used:
                    self.err(f"mesh dimension {a} shards both tensor dimension {used[a]} and {tdim}; "
                             "a mesh dimension may shard at most one tensor dimension", span)
                    return None
                used[a] = tdim
                if mesh_shape is not None and a >= len(mesh_shape):
                    self.err(f"S{a} needs a mesh dimension {a}, but stage {stage.index}'s mesh is "
                             f"{len(mesh_shape)}-dimensional {tuple(mesh_shape)}", span)
                    return None
            if mesh_shape is not None and axes and shape is not None:
                why = spec_divide_error(tdim, shape[tdim], axes, mesh_shape, stage.index)
                if why:
                    self.err(why, span)
                    return None
        return ir.ShardingSpec(tuple(a for a, _ in entries))

    # ------------------------------------------------------------ reductions
    def reductions(self, decls, cluster, parallel, stages, mode) -> tuple[ir.Reduction, ...]:
        out, names = [], set()
        if mode is ir.StageMode.EXPLICIT:
            # explicit stages reduce over their own mesh dimensions (LANGUAGE.md); a `parallel`
            # axis that no mesh has would reduce over nothing
            known = list(dict.fromkeys(a for s in stages for a in s.mesh_axes))
        else:
            known = list(parallel.axis_names()) if parallel else []
        for r in decls:
            if r.name.value in names:
                self.err(f"reduction '{r.name.value}' is declared twice", r.name.span)
                continue
            names.add(r.name.value)
            ok = True
            axes = []
            for a in r.axes:
                if a.value not in known:
                    self.err(f"'{a.value}' is not an axis (axes: {', '.join(known) or 'none'})", a.span,
                             did_you_mean(a.value, known))
                    ok = False
                elif a.value == "pipe" and mode is ir.StageMode.PIPE_AXIS:
                    self.err("'pipe' is the pipeline axis: stages hold different layers, so there is nothing to "
                             "reduce over it", a.span)
                    ok = False
                elif a.value in axes:
                    self.err(f"axis '{a.value}' is listed twice", a.span)
                    ok = False
                axes.append(a.value)
            dtype = shape = None
            if r.name.value == "gradients":
                if r.type is not None:
                    self.err("'gradients' are sized by the model's parameters; a shape is only for standalone "
                             "reductions (use another name)", r.type.span)
                    ok = False
            elif r.type is None:
                self.err(f"standalone reduction '{r.name.value}' needs a tensor type, e.g. "
                         f"'reduce {r.name.value} over {', '.join(axes) or 'data'} : f32[1048576]'", r.span)
                ok = False
            else:
                dtype, shape = self.tensor_type(r.type)
                ok = ok and dtype is not None
            mode_, program, pspan = ir.ReductionMode.SYNTHESIZE, None, ir.Span(0, 0, 0, 0)
            if r.using is not None:
                pspan = r.using_span
                if len(r.using) == 1 and r.using[0].args is None and r.using[0].collective.value == "allreduce":
                    mode_ = ir.ReductionMode.ALLREDUCE
                else:
                    program = self.program(r.using, cluster)
                    if program is None:
                        ok = False
                    mode_ = ir.ReductionMode.PROGRAM
            if ok:
                out.append(ir.Reduction(r.name.value, tuple(axes), mode_, program, dtype, shape, r.span, pspan))
        return tuple(out)

    def program(self, steps, cluster) -> tuple[ir.Instruction, ...] | None:
        levels = [ir.ROOT_LEVEL] + ([l.name for l in cluster.levels] if cluster else [])
        colls = [c.value for c in ir.Collective]
        out = []
        for st in steps:
            name = st.collective.value
            if name not in colls:
                self.err(f"unknown collective '{name}'; expected one of {', '.join(colls)}", st.collective.span,
                         did_you_mean(name, colls))
                return None
            if st.args is None:
                self.err(f"'{name}' needs its slice and form, e.g. {name}(slice=root, form=inside)", st.span)
                return None
            args = {}
            for a in st.args:
                if a.key.value not in ("slice", "form"):
                    self.err(f"unknown step argument '{a.key.value}'; expected slice or form", a.key.span,
                             did_you_mean(a.key.value, ["slice", "form"]))
                    return None
                if a.key.value in args:
                    self.err(f"'{a.key.value}' is given twice", a.key.span)
                    return None
                args[a.key.value] = a
            if set(args) != {"slice", "form"}:
                missing = ({"slice", "form"} - set(args)).pop()
                self.err(f"step '{name}' is missing '{missing}='", st.span)
                return None
            sl = args["slice"]
            if sl.level is not None or sl.value.value not in levels:
                self.err(f"slice must name a level ({', '.join(levels)}), got '{sl.value.value}'", sl.value.span,
                         did_you_mean(sl.value.value, levels))
                return None
            fm = args["form"]
            kinds = [k.value for k in ir.FormKind]
            if fm.value.value not in kinds:
                self.err(f"form must be inside, parallel(LEVEL) or master(LEVEL), got '{fm.value.value}'",
                         fm.value.span, did_you_mean(fm.value.value, kinds))
                return None
            kind = ir.FormKind(fm.value.value)
            if kind is ir.FormKind.INSIDE and fm.level is not None:
                self.err("form 'inside' takes no level", fm.level.span)
                return None
            if kind is not ir.FormKind.INSIDE:
                if fm.level is None:
                    self.err(f"form '{kind}' needs a level: {kind}(LEVEL)", fm.span)
                    return None
                if fm.level.value not in levels:
                    self.err(f"'{fm.level.value}' is not a level ({', '.join(levels)})", fm.level.span,
                             did_you_mean(fm.level.value, levels))
                    return None
            out.append(ir.Instruction(ir.Collective(name), sl.value.value, kind, fm.level.value if fm.level else None))
        return tuple(out)

    # ------------------------------------------------------------ settings blocks
    def settings(self, block: ast.SettingsBlock | None, allowed: list[str]) -> dict[str, ast.KeyValue]:
        out: dict[str, ast.KeyValue] = {}
        if block is None:
            return out
        for kv in block.items:
            k = kv.key.value
            if k not in allowed:
                self.err(f"unknown {block.kind} setting '{k}'; expected one of {', '.join(allowed)}", kv.key.span,
                         did_you_mean(k, allowed))
                continue
            if k in out:
                self.err(f"'{k}' is set twice", kv.key.span)
                continue
            out[k] = kv
        return out

    def enum_value(self, kv: ast.KeyValue | None, enum, default):
        if kv is None:
            return default
        v = kv.value
        text = v.value if isinstance(v, ast.Name) else (v.text if isinstance(v, ast.Num) else None)
        choices = [e.value for e in enum]
        if text not in choices:
            self.err(f"{kv.key.value} must be one of {', '.join(choices)}", v.span,
                     did_you_mean(str(text), choices) if text else None)
            return default
        return enum(text)

    def int_setting(self, kv: ast.KeyValue | None, default: int, minimum: int = 1) -> int:
        if kv is None:
            return default
        if not isinstance(kv.value, ast.Num):
            self.err(f"{kv.key.value} must be a whole number", kv.value.span)
            return default
        v = self.int_of(kv.value, kv.key.value, minimum)
        return default if v is None else v

    def call_args(self, call: ast.Call, allowed: dict[str, str]) -> dict[str, object]:
        out = {}
        for kv in call.args:
            k = kv.key.value
            if k not in allowed:
                self.err(f"{call.name.value}() has no argument '{k}'; expected {', '.join(allowed) or 'none'}",
                         kv.key.span, did_you_mean(k, allowed))
                continue
            kind = allowed[k]
            v = kv.value
            if kind == "time":
                if isinstance(v, ast.Quantity):
                    q = self.quantity(v, TIME, "time")
                elif isinstance(v, ast.Num):
                    q = v.value
                else:
                    q = None
                    self.err(f"{k} must be a time, e.g. 1 s", v.span)
                if q is not None and q <= 0:
                    self.err(f"{k} must be positive", v.span)
                    q = None
                if q is not None:
                    out[k] = q
            elif kind == "int":
                if isinstance(v, ast.Num):
                    iv = self.int_of(v, k, 0)
                    if iv is not None:
                        out[k] = iv
                else:
                    self.err(f"{k} must be a whole number", v.span)
            else:  # float
                if isinstance(v, ast.Num) and v.value > 0:
                    out[k] = v.value
                else:
                    self.err(f"{k} must be a positive number", v.span)
        return out

    def resharding(self, block) -> ir.Resharding:
        s = self.settings(block, ["strategy", "chunks", "schedule"])
        strategy = self.enum_value(s.get("strategy"), ir.Strategy, ir.Strategy.AUTO)
        chunks = self.int_setting(s.get("chunks"), 64)
        res = dict(scheduler=ir.SchedulerKind.RANDOMIZED_GREEDY, dfs_budget_s=1.0, trials=64, seed=0)
        kv = s.get("schedule")
        if kv is not None:
            v = kv.value
            name = v.name.value if isinstance(v, ast.Call) else (v.value if isinstance(v, ast.Name) else None)
            choices = [e.value for e in ir.SchedulerKind]
            if name not in choices:
                self.err("schedule must be naive, load_balance, dfs(budget = 1 s) or randomized_greedy(trials = 64, seed = 0)",
                         v.span, did_you_mean(str(name), choices) if name else None)
            else:
                res["scheduler"] = ir.SchedulerKind(name)
                if isinstance(v, ast.Call):
                    allowed = {"dfs": {"budget": "time"}, "randomized_greedy": {"trials": "int", "seed": "int"}}.get(name, {})
                    args = self.call_args(v, allowed)
                    res["dfs_budget_s"] = args.get("budget", 1.0)
                    res["trials"] = args.get("trials", 64)
                    res["seed"] = args.get("seed", 0)
                    if res["trials"] < 1:
                        self.err("trials must be at least 1", v.span)
                    elif res["trials"] > MAX_TRIALS:
                        self.err(f"trials = {res['trials']} is too many (at most {MAX_TRIALS}; each trial "
                                 "is a pass over every unit task)", v.span)
                        res["trials"] = MAX_TRIALS
                    if res["dfs_budget_s"] > MAX_DFS_BUDGET_S:
                        self.err(f"a dfs budget of {res['dfs_budget_s']:g} s is too large (at most "
                                 f"{MAX_DFS_BUDGET_S:g} s)", v.span)
                        res["dfs_budget_s"] = MAX_DFS_BUDGET_S
        return ir.Resharding(strategy, chunks, res["scheduler"], float(res["dfs_budget_s"]), int(res["trials"]), int(res["seed"]))

    def synthesis(self, block) -> ir.Synthesis:
        s = self.settings(block, ["max_size", "collectives"])
        max_size = self.int_setting(s.get("max_size"), 5)
        if max_size > 8:
            self.err(f"max_size {max_size} is too large (at most 8; P² finds useful programs by size 5)", s["max_size"].value.span)
            max_size = 8
        colls = tuple(ir.Collective)
        kv = s.get("collectives")
        if kv is not None:
            if not isinstance(kv.value, ast.ListValue) or not kv.value.items:
                self.err("collectives is a non-empty list, e.g. [allreduce, reduce_scatter, all_gather]", kv.value.span)
            else:
                names = [c.value for c in ir.Collective]
                picked = []
                for it in kv.value.items:
                    if not isinstance(it, ast.Name) or it.value not in names:
                        text = it.value if isinstance(it, ast.Name) else "this"
                        self.err(f"'{text}' is not a collective; expected {', '.join(names)}", it.span,
                                 did_you_mean(str(text), names))
                    elif ir.Collective(it.value) not in picked:
                        picked.append(ir.Collective(it.value))
                if picked:
                    colls = tuple(picked)
        return ir.Synthesis(max_size, colls)

    def train(self, block, parallel, stages) -> ir.Train:
        s = self.settings(block, ["micro_batch", "micro_batches", "steps", "schedule", "optimizer", "precision", "seed"])
        opt = ir.Optimizer()
        kv = s.get("optimizer")
        if kv is not None:
            v = kv.value
            if not isinstance(v, (ast.Call, ast.Name)) or (v.name.value if isinstance(v, ast.Call) else v.value) not in ("adam", "sgd"):
                self.err("optimizer must be adam(lr = ...) or sgd(lr = ...)", v.span)
            else:
                name = v.name.value if isinstance(v, ast.Call) else v.value
                allowed = {"lr": "float", "momentum": "float", "weight_decay": "float", "beta1": "float", "beta2": "float", "eps": "float"}
                args = self.call_args(v, allowed) if isinstance(v, ast.Call) else {}
                lr = float(args.pop("lr", 1e-3))
                opt = ir.Optimizer(name, lr, tuple(sorted((k, float(x)) for k, x in args.items())))
        seed = self.int_setting(s.get("seed"), 1234, minimum=0)
        train = ir.Train(
            micro_batch=self.int_setting(s.get("micro_batch"), 8),
            micro_batches=self.int_setting(s.get("micro_batches"), 4),
            steps=self.int_setting(s.get("steps"), 10),
            schedule=self.enum_value(s.get("schedule"), ir.PipeSchedule, ir.PipeSchedule.ONE_F_ONE_B),
            optimizer=opt,
            precision=self.enum_value(s.get("precision"), ir.Precision, ir.Precision.FP32),
            seed=seed,
        )
        if train.micro_batches > MAX_MICRO_BATCHES:
            self.err(f"micro_batches {train.micro_batches} is too many (at most {MAX_MICRO_BATCHES})",
                     s["micro_batches"].value.span)
        if "micro_batch" in s:
            for st in stages:
                n = ir.axis_size(ir.stage_mesh(st, parallel), "data")
                if n > 1:
                    if train.micro_batch % n:
                        self.err(f"micro_batch {train.micro_batch} does not divide evenly over the data axis of size {n} "
                                 f"(stage {st.index})", s["micro_batch"].value.span)
                        break
        return train

    _parallel_cache = None


def spec_length_error(entries: int, shape) -> str | None:
    """The message for a spec whose entry count is not the tensor's rank (None: it is)."""
    if entries == len(shape):
        return None
    return (f"the spec has {entries} entries but the tensor has {len(shape)} dimensions "
            f"{list(shape)}; write one entry per dimension")


def spec_divide_error(tdim: int, size: int, axes: tuple[int, ...], mesh_shape, stage: int) -> str | None:
    """The message for tensor dimension ``tdim`` of ``size`` not dividing over mesh ``axes`` (None: it does)."""
    n = math.prod(mesh_shape[a] for a in axes)
    if size % n == 0:
        return None
    return (f"tensor dimension {tdim} of size {size} does not divide evenly over mesh size {n} "
            f"(stage {stage}, {'S' + ''.join(map(str, axes))})")


def _source_text(span: Span, text: str) -> str:
    """The source text under a one-line span (for messages that quote what was written)."""
    lines = text.splitlines()
    if span.line < 1 or span.line > len(lines) or span.end_line != span.line:
        return "stage I"
    return " ".join(lines[span.line - 1][span.col - 1:span.end_col - 1].split())


def _name_from_path(path: str) -> str:
    """A plan without `plan NAME { }` is named after its file: 'gpt-2x4.plan' -> 'gpt_2x4'."""
    if not path or path.startswith("<"):
        return "plan"
    name = re.sub(r"\W", "_", Path(path).stem, flags=re.ASCII) or "plan"
    return "_" + name if name[0].isdigit() else name


def _yaml_quantity(v, kind: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        return parse_quantity(v, kind)
    raise ValueError(f"expected a {kind}, got {v!r}")


def check(tree: ast.PlanFile, path: str, text: str) -> ir.Program:
    c = _Checker(tree, path, text)
    # transfers need the parallel block to know derived mesh shapes
    pblocks = [s for s in tree.statements if isinstance(s, ast.ParallelBlock)]
    cblocks = [s for s in tree.statements if isinstance(s, ast.ClusterBlock)]
    if pblocks:
        probe = _Checker(tree, path, text)
        cl = probe.cluster(cblocks[0]) if cblocks else None
        c._parallel_cache = probe.parallel(pblocks[0], cl)
    return c.run()
