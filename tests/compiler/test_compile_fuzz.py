"""Whole-compiler fuzzing: random, front-end-valid plans written as .plan TEXT.

For every generated plan, ``compile_program`` either returns a plan.json that
satisfies PLAN_FORMAT.md's invariants (checked by ``check_plan_json``, which
knows nothing of how the plan was found), serialises without NaN/inf and is
identical when compiled twice -- or raises a located ``PlanError``. Anything
else (another exception, a wrong plan, a run that does not end) is a bug.

Sizes are kept small (at most 64 devices, tensors of at most 4096 elements)
so the default run (PLANC_FUZZ_EXAMPLES, ~150 examples) takes well under a
minute on one core; set PLANC_FUZZ_EXAMPLES=2000 to hunt for bugs.
"""

from __future__ import annotations

import json
import math
import os
from functools import lru_cache
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from planc.driver.compile import compile_program, dump_plan
from planc.lang import load_text
from planc.lang.errors import PlanError
from tests.compiler.test_compile import check_plan_json

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PLAN_PATH = str(ROOT / "tests" / "fuzz_generated.plan")   # never written: only names the source in errors
N_EXAMPLES = int(os.environ.get("PLANC_FUZZ_EXAMPLES", "150"))
MAX_DEVICES = 64
MAX_ELEMENTS = 4096

LEVEL_NAMES = ["rack", "node", "server", "cpu", "gpu", "socket", "board", "chip"]
AXIS_NAMES = ["data", "tensor", "param", "expert", "seq"]
DTYPES = ["f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool"]
COLLECTIVES = ["allreduce", "reduce_scatter", "all_gather", "reduce", "broadcast"]
PRIMES = (2, 3)


def _factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


# ---------------------------------------------------------------- pieces of a plan

@st.composite
def clusters(draw):
    """(levels [(name, fanout)], text of the cluster block)."""
    n = draw(st.integers(1, 4))
    names = draw(st.permutations(LEVEL_NAMES))[:n]
    fanouts = []
    for _ in range(n):
        left = MAX_DEVICES // max(1, math.prod(fanouts))
        fanouts.append(draw(st.integers(1, max(1, min(4, left)))))
    lines = []
    for name, f in zip(names, fanouts):
        attrs = []
        if f > 1 or draw(st.booleans()):
            bw = draw(st.sampled_from(["12.5 GB/s", "100 Gb/s", "150 GB/s", "24 GB/s", "1 TB/s", "800 MB/s", "3e9 B/s"]))
            attrs.append(f"bandwidth {bw}")
        if draw(st.booleans()):
            attrs.append("latency " + draw(st.sampled_from(["20 us", "2 us", "0 s", "1 ms", "500 ns"])))
        lines.append(f"  level {name} x {f}" + (" : " + ", ".join(attrs) if attrs else ""))
    if draw(st.booleans()):
        lines.append(f"  host = {draw(st.sampled_from(names))}")
    return list(zip(names, fanouts)), "cluster {\n" + "\n".join(lines) + "\n}"


@st.composite
def matrices(draw, fanouts, n_axes):
    """A random parallelism matrix: each level's fanout split over the axes by its prime factors."""
    m = [[1] * len(fanouts) for _ in range(n_axes)]
    for j, f in enumerate(fanouts):
        for p in _factors(f):
            m[draw(st.integers(0, n_axes - 1))][j] *= p
    return m


@st.composite
def specs(draw, ndims, mesh_shape, mesh_names):
    """(spec text, per-tensor-dim shard count) for a stage mesh; every entry R/S0/S1/S01."""
    entries = ["R"] * ndims
    mesh_dims = list(range(min(len(mesh_shape), 2)))
    if ndims and mesh_dims:
        kind = draw(st.sampled_from(["R", "one", "two", "both"]))
        dims = draw(st.permutations(range(ndims)))
        if kind == "one":
            entries[dims[0]] = f"S{draw(st.sampled_from(mesh_dims))}"
        elif kind == "two" and len(mesh_dims) == 2 and ndims >= 2:
            entries[dims[0]], entries[dims[1]] = "S0", "S1"
            if draw(st.booleans()):
                entries[dims[0]], entries[dims[1]] = "S1", "S0"
        elif kind == "both" and len(mesh_dims) == 2:
            entries[dims[0]] = "S01"
    shards = [math.prod(mesh_shape[int(c)] for c in e[1:]) if e != "R" else 1 for e in entries]
    form = draw(st.sampled_from(["spaced", "compact", "named"]))
    if form == "named" and mesh_names:
        text = " ".join("R" if e == "R" else "S(" + ",".join(mesh_names[int(c)] for c in e[1:]) + ")"
                        for e in entries)
    elif form == "compact":
        text = "".join(entries)
    else:
        text = " ".join(entries)
    return text, shards


@st.composite
def shapes_for(draw, shard_lists):
    """A tensor shape whose every dim divides evenly over the shard counts given, at most MAX_ELEMENTS."""
    ndims = len(shard_lists[0])
    need = [math.lcm(*(s[i] for s in shard_lists)) for i in range(ndims)]
    if math.prod(need) > MAX_ELEMENTS:
        return None
    shape = list(need)
    for i in draw(st.permutations(range(ndims))):
        room = MAX_ELEMENTS // math.prod(shape)
        shape[i] *= draw(st.integers(1, max(1, min(8, room))))
    return shape


@lru_cache(maxsize=None)
def _synthesized(levels: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    from planc import ir
    from planc.reduction import Hierarchy, synthesize
    return tuple(ir.program_text(p) for p in synthesize(Hierarchy(levels), 4, tuple(ir.Collective)))


@st.composite
def programs(draw, level_names):
    """A pinned reduction program text (valid or not) over the cluster's level names and root."""
    levels = ["root"] + list(level_names)
    shape = draw(st.sampled_from(["random", "flat", "hier", "synth", "synth"]))
    if shape == "synth" and level_names:
        # a program valid on some hierarchy of these levels (maybe not on the plan's)
        k = draw(st.integers(1, min(3, len(level_names))))
        picked = sorted(draw(st.permutations(range(len(level_names))))[:k])
        hier = tuple((level_names[j], draw(st.sampled_from([2, 3, 4]))) for j in picked)
        found = _synthesized(hier)
        if found:
            return draw(st.sampled_from(found))
    if shape == "flat":
        return "allreduce(slice=root, form=inside)"
    if shape == "hier" and level_names:
        lv = draw(st.sampled_from(level_names))
        return (f"reduce_scatter(slice={lv}, form=inside); allreduce(slice={lv}, form=parallel(root)); "
                f"all_gather(slice={lv}, form=inside)")
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        coll = draw(st.sampled_from(COLLECTIVES))
        sl = draw(st.sampled_from(levels))
        fk = draw(st.sampled_from(["inside", "parallel", "master"]))
        form = "inside" if fk == "inside" else f"{fk}({draw(st.sampled_from(levels))})"
        steps.append(f"{coll}(slice={sl}, form={form})")
    return "; ".join(steps) + draw(st.sampled_from(["", ";"]))


@st.composite
def settings_blocks(draw):
    out = []
    if draw(st.booleans()):
        items = []
        if draw(st.booleans()):
            items.append("strategy = " + draw(st.sampled_from(
                ["send_recv", "local_allgather", "global_allgather", "broadcast", "auto"])))
        if draw(st.booleans()):
            items.append(f"chunks = {draw(st.integers(1, 64))}")
        if draw(st.booleans()):
            items.append("schedule = " + draw(st.sampled_from([
                "naive", "load_balance", "dfs(budget = 0.01 s)", "dfs(budget = 10 ms)",
                f"randomized_greedy(trials = {draw(st.integers(1, 8))}, seed = {draw(st.integers(0, 99))})",
                "randomized_greedy"])))
        out.append("resharding { " + ", ".join(items) + " }")
    if draw(st.booleans()):
        items = [f"max_size = {draw(st.integers(1, 5))}"]
        if draw(st.booleans()):
            picked = draw(st.lists(st.sampled_from(COLLECTIVES), min_size=1, max_size=5, unique=True))
            items.append("collectives = [" + ", ".join(picked) + "]")
        out.append("synthesis { " + ", ".join(items) + " }")
    return out


# ---------------------------------------------------------------- whole plans

@st.composite
def comm_plans(draw):
    """A communication-only plan: a parallel block (pipe axis or not, auto or pinned) or explicit stages."""
    levels, cluster_text = draw(clusters())
    level_names = [n for n, _ in levels]
    fanouts = [f for _, f in levels]
    devices = math.prod(fanouts)
    lines = [cluster_text]
    stages = []          # (index, mesh shape, mesh dim names or None)
    reduce_axes: list[str] = []
    explicit = draw(st.booleans())

    if not explicit:
        n_axes = draw(st.integers(1, 3))
        use_pipe = draw(st.booleans())
        names = list(draw(st.permutations(AXIS_NAMES))[:n_axes])
        if use_pipe:
            names.insert(draw(st.integers(0, len(names))), "pipe")
        matrix = draw(matrices(fanouts, len(names)))
        sizes = [math.prod(r) for r in matrix]
        place = "place = auto" if draw(st.booleans()) else \
            "place = [" + ", ".join("[" + ", ".join(map(str, r)) + "]" for r in matrix) + "]"
        items = [f"{n} = {s}" for n, s in zip(names, sizes)]
        if draw(st.booleans()) or "[" in place:
            items.append(place)
        sep = draw(st.sampled_from([", ", "\n  "]))
        lines.append("parallel {\n  " + sep.join(items) + "\n}")
        mesh_names = [n for n in names if n != "pipe"]
        mesh_shape = [s for n, s in zip(names, sizes) if n != "pipe"]
        n_stages = sizes[names.index("pipe")] if use_pipe else 1
        declare = draw(st.booleans())
        widths = draw(st.lists(st.integers(1, 3), min_size=n_stages, max_size=n_stages))
        a = 0
        for i in range(n_stages):
            stages.append((i, mesh_shape, mesh_names))
            if declare:
                lines.append(f"stage {i} : layers {a}..{a + widths[i]}")
                a += widths[i]
        if not declare:
            stages = [(i, mesh_shape, mesh_names) for i in range(n_stages)]
            if not use_pipe:
                stages = [(0, mesh_shape, mesh_names)]
        reduce_axes = mesh_names
    else:
        n_stages = draw(st.integers(1, min(4, devices)))
        # disjoint device ranges, in a random order of stage indices, with random gaps
        cuts = sorted(draw(st.lists(st.integers(0, devices), min_size=2 * n_stages, max_size=2 * n_stages)))
        ranges = [(cuts[2 * i], cuts[2 * i + 1]) for i in range(n_stages)]
        ranges = [(c, d) if d > c else None for c, d in ranges]
        if any(r is None for r in ranges):
            # fall back to one device per stage
            ranges = [(i, i + 1) for i in range(n_stages)]
        order = draw(st.permutations(range(n_stages)))
        named = draw(st.booleans())
        pool = draw(st.permutations(["data", "tensor", "m0", "m1", "seq"]))
        decls = []
        for idx, (c, d) in zip(order, ranges):
            size = d - c
            if draw(st.booleans()) and size > 1:
                divs = [k for k in range(1, size + 1) if size % k == 0]
                m0 = draw(st.sampled_from(divs))
                shape = [m0, size // m0]
            else:
                shape = [size]
            if named:
                mnames = list(pool[:len(shape)]) if draw(st.integers(0, 3)) else list(reversed(pool[:len(shape)]))
                mesh = "(" + ", ".join(f"{n} = {s}" for n, s in zip(mnames, shape)) + ")"
            else:
                mnames = [f"m{i}" for i in range(len(shape))]
                mesh = "(" + ", ".join(map(str, shape)) + ")"
            stages.append((idx, shape, mnames))
            decls.append((idx, f"stage {idx} on devices {c}..{d} as {mesh}"))
        for _, text in decls:
            lines.append(text)
        stages.sort()
        reduce_axes = list(dict.fromkeys(n for _, _, ns in stages for n in ns))
        if draw(st.integers(0, 3)) == 0:
            # a parallel block beside explicit stages: its axes are names too, but do not place the stages
            pnames = ["data", "expert"] if draw(st.booleans()) else ["expert", "param"]
            matrix = draw(matrices(fanouts, 2))
            lines.append("parallel { " + ", ".join(f"{n} = {math.prod(r)}" for n, r in zip(pnames, matrix))
                         + draw(st.sampled_from(["", ", place = auto"])) + " }")
            reduce_axes += [n for n in pnames if n not in reduce_axes]

    by_index = {i: (shape, names) for i, shape, names in stages}
    # transfers
    if len(by_index) >= 2:
        for k in range(draw(st.integers(0, 3))):
            a, b = draw(st.permutations(sorted(by_index)))[:2]
            ndims = draw(st.integers(1, 3))
            stext, sshards = draw(specs(ndims, *by_index[a]))
            dtext, dshards = draw(specs(ndims, *by_index[b]))
            shape = draw(shapes_for([sshards, dshards]))
            if shape is None:
                continue
            dtype = draw(st.sampled_from(DTYPES))
            lines.append(f"transfer t{k} : {dtype}[{', '.join(map(str, shape))}] from stage {a} as {stext} "
                         f"to stage {b} as {dtext}")
    # standalone reductions
    if reduce_axes:
        for k in range(draw(st.integers(0, 3))):
            axes = draw(st.lists(st.sampled_from(reduce_axes), min_size=1, max_size=len(reduce_axes), unique=True))
            using = draw(st.sampled_from(["", "allreduce", "program"]))
            text = f"reduce r{k} over {', '.join(axes)}"
            if using == "allreduce":
                text += " using allreduce"
            elif using == "program":
                text += " using " + draw(programs(level_names))
            n = draw(st.integers(1, MAX_ELEMENTS))
            text += f" : {draw(st.sampled_from(DTYPES))}[{n}]"
            lines.append(text)
    if reduce_axes and draw(st.integers(0, 4)) == 0:
        axes = draw(st.lists(st.sampled_from(reduce_axes), min_size=1, max_size=len(reduce_axes), unique=True))
        lines.append(f"reduce gradients over {', '.join(axes)}" + draw(st.sampled_from(
            ["", " using allreduce", " using " + draw(programs(level_names))])))
    lines += draw(settings_blocks())
    if draw(st.booleans()):
        lines = draw(st.permutations(lines))
    body = "\n".join(lines)
    if draw(st.booleans()):
        return f"plan fuzz {{\n{body}\n}}\n"
    return body + "\n"


@st.composite
def model_plans(draw):
    """A plan with a model (examples/mlp.py or gpt.py), compiled without probing it."""
    which = draw(st.sampled_from(["mlp", "gpt"]))
    n_layers = draw(st.integers(2, 4)) if which == "mlp" else draw(st.integers(1, 3))
    total = n_layers if which == "mlp" else n_layers + 2
    levels = [("node", draw(st.integers(1, 4))), ("gpu", draw(st.integers(1, 4)))]
    devices = levels[0][1] * levels[1][1]
    lines = ["cluster {"] + [f"  level {n} x {f} : bandwidth {bw}, latency 2 us"
                             for (n, f), bw in zip(levels, ["12.5 GB/s", "150 GB/s"])] + ["}"]
    divs = [k for k in range(1, devices + 1) if devices % k == 0 and k <= total]
    pipe = draw(st.sampled_from(divs))
    rest = devices // pipe
    data = draw(st.sampled_from([k for k in range(1, rest + 1) if rest % k == 0]))
    tensor = rest // data
    explicit = draw(st.booleans())
    if explicit:
        # explicit stages: equal meshes (trainable) or not, named (data[, tensor]) or anonymous dims
        named = draw(st.booleans())
        per = data * tensor
        start = 0
        stage_lines = []
        for i in range(pipe):
            size = per if draw(st.integers(0, 3)) else draw(st.integers(1, per))
            dims = [("data", size)] if tensor == 1 or size != per else [("data", data), ("tensor", tensor)]
            mesh = ", ".join(f"{n} = {k}" if named else str(k) for n, k in dims)
            stage_lines.append((i, f"on devices {start}..{start + size} as ({mesh})"))
            start += size
        if not named:
            data = 1    # no mesh dimension is named data: transfers are replicated
    else:
        axes = [("pipe", pipe), ("data", data)] + ([("tensor", tensor)] if tensor > 1 or draw(st.booleans()) else [])
        if math.prod(s for _, s in axes) != devices:
            axes.append(("tensor", tensor))
        lines.append("parallel { " + ", ".join(f"{n} = {s}" for n, s in axes) + ", place = auto }")
    ex = EXAMPLES / f"{which}.py"
    args = ("{ layers = %d, hidden = 16, inputs = 8, outputs = 4 }" % n_layers if which == "mlp"
            else "{ layers = %d, hidden = 16, heads = 2, seq = 8, vocab = 32 }" % n_layers)
    lines += [f'model "{ex}:build" {args}', f'loss "{ex}:loss"', f'data "{ex}:batches"']
    cuts = sorted(draw(st.lists(st.integers(1, total - 1), min_size=pipe - 1, max_size=pipe - 1, unique=True))) \
        if pipe > 1 else []
    bounds = [0] + cuts + [total]
    for i in range(pipe):
        lines.append(f"stage {i} : layers {bounds[i]}..{bounds[i + 1]}" + (" " + stage_lines[i][1] if explicit else ""))
    micro_batch = math.lcm(data, 4) * draw(st.integers(1, 2)) if explicit else data * draw(st.integers(1, 4))
    width = 16
    for i in range(pipe - 1):
        j = i + 1 if draw(st.integers(0, 4)) else draw(st.integers(0, pipe - 1))
        if j == i:
            continue
        spec = "S0 R" if data > 1 else "R R"
        if draw(st.integers(0, 5)) == 0:
            spec = "R R"
        layer = ""
        if draw(st.integers(0, 3)) == 0:
            layer = f" layer {draw(st.integers(bounds[i], bounds[i + 1] - 1))}"
        shape = [micro_batch, width] if which == "mlp" else [micro_batch, 8 * width // 8]
        lines.append(f"transfer h{i} : f32[{', '.join(map(str, shape))}] from stage {i}{layer} as {spec} "
                     f"to stage {j} as {spec}")
    if draw(st.booleans()) and (not explicit or data > 1):
        lines.append("reduce gradients over data" + draw(st.sampled_from(["", " using allreduce"])))
    if tensor > 1 and (not explicit or named) and draw(st.booleans()):
        lines.append("reduce tp over tensor : f32[1024]")
    lines += draw(settings_blocks())
    lines.append("train { micro_batch = %d, micro_batches = %d, schedule = %s, precision = %s, optimizer = %s }" % (
        micro_batch, draw(st.integers(1, 6)), draw(st.sampled_from(["gpipe", "1f1b", "eager_1f1b"])),
        draw(st.sampled_from(["fp32", "fp32", "bf16", "fp16"])),
        draw(st.sampled_from(["adam(lr = 1e-3)", "sgd(lr = 0.05)"]))))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the property

def _check_plan_text(text: str) -> None:
    try:
        program = load_text(text, PLAN_PATH)
    except PlanError as e:
        # The generators aim at front-end-valid plans; a rejection must still be a located error.
        _check_error(e)
        return
    try:   # no timing here: the compile's work is bounded by counts (planc.budget), and a hang by pytest-timeout
        first = compile_program(program)
    except PlanError as e:
        _check_error(e)
        return
    plan = first.plan_json
    check_plan_json(plan)
    dumped = dump_plan(plan)                    # allow_nan=False: NaN/inf raise here
    assert json.loads(dumped) == json.loads(json.dumps(plan, allow_nan=False))
    again = compile_program(load_text(text, PLAN_PATH))
    assert dump_plan(again.plan_json) == dumped, "compiling twice gave different plan.json"


def _check_error(e: PlanError) -> None:
    out = e.render()
    assert e.diagnostics and "error:" in out
    assert "Traceback" not in out
    assert any(d.span.file == PLAN_PATH and d.span.line >= 1 for d in e.diagnostics), out
    assert f"{PLAN_PATH}:" in out, out


SETTINGS = dict(deadline=None, derandomize=N_EXAMPLES <= 150, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


@settings(max_examples=max(1, N_EXAMPLES * 5 // 6), **SETTINGS)
@given(comm_plans())
def test_random_comm_only_plans_compile_or_fail_cleanly(text):
    _check_plan_text(text)


@settings(max_examples=max(1, N_EXAMPLES // 6), **SETTINGS)
@given(model_plans())
def test_random_model_plans_compile_or_fail_cleanly(text):
    _check_plan_text(text)
