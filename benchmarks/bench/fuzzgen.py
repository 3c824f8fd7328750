"""The fuzz bench's inputs: grammar-aware plans drawn from pools of valid and invalid values
(:func:`generate`), byte-level mutations of the repository's plans (:func:`mutate_bytes`,
:func:`repo_seeds`) and YAML cluster files to mutate (:data:`YAML_SEEDS`)."""

from __future__ import annotations

import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEED_DIRS = ("plans", "examples", "tests/plans", "tests/golden/diagnostics", "tests/fuzz_regressions")
PLAN_NAME, YAML_NAME = "fuzz.plan", "cluster.yaml"


# ---------------------------------------------------------------- the grammar-aware generator

# value pools: (valid, invalid); a plan draws invalid ones at its own rate (many plans draw none)
LEVELS = (["rack", "node", "server", "cpu", "gpu", "socket", "board", "_l9"], ["x", "level", "data", "9"])
DTYPES = (["f32", "f16", "bf16", "i64", "i8", "bool"], ["f8", "float"])
COLLS = (["allreduce", "reduce_scatter", "all_gather", "reduce", "broadcast"], ["allgather"])
BANDWIDTHS = (["12.5 GB/s", "100 Gb/s", "150 GB/s", "800 MB/s", "3e9 B/s", "1 TB/s", "25 Mb/s"],
              ["0 GB/s", "-1 GB/s", "1e999 GB/s", "10 us", "5", "1 GB"])
LATENCIES = (["20 us", "2 us", "0 s", "1 ms", "500 ns"], ["-3 us", "1 GB/s", "1e400 s", "7"])
FLOPS = (["312 TFLOP/s", "100 TFLOPS", "1e15 FLOP/s"], ["312", "0 TFLOP/s", "80 GB"])
MEMORY = (["80 GB", "16 GiB", "512 MiB"], ["80", "0 GB", "1 s"])
YAML_BW = (["1.25e10", "100000000000", "'150 GB/s'", "12.5 GB/s", "100 Gb/s"], ["[1, 2]", "null", "yes", "-5", ".inf"])
YAML_LAT = (["2e-05", "0.000002", "0", "20 us", "'2 us'"], ["-1", "1 GB/s", "{a: 1}"])
YAML_FLOPS = (["312e12", "3.12e14", "312 TFLOP/s", "1000000000000000"], ["0", "fast", "-1e12"])
YAML_MEMORY = (["80000000000", "8.0e10", "80 GB", "16 GiB"], ["0", "80 us", "[]"])
STRATEGIES = (["auto", "send_recv", "local_allgather", "global_allgather", "broadcast"], ["fast"])
SCHEDULERS = (["naive", "load_balance", "dfs(budget = 10 ms)", "dfs(budget = 0.01 s)", "randomized_greedy",
               "randomized_greedy(trials = 4, seed = 3)"], ["dfs(budget = 0 s)", "greedy", "dfs(depth = 2)"])
PIPE_SCHEDULES = (["gpipe", "1f1b", "eager_1f1b", "auto"], ["fast"])
OPTIMIZERS = (["adam(lr = 1e-3)", "sgd(lr = 0.05, momentum = 0.9)", "sgd", "adam"], ["adam(lr = 0)", "rmsprop"])
PRECISIONS = (["fp32", "fp32", "bf16", "fp16"], ["fp8"])
TIMEOUTS = (["60 s", "500 ms", "2 s"], ["0 s", "60", "1 GB"])
NUMBERS = ["0", "1", "2", "3", "4", "8", "-1", "2.5", "1e3", "99999999999999999999", "1e999"]


class Draw:
    """The random choices of one plan: valid values, and invalid ones at the plan's own rate ``bad``
    (0 for most plans, so that many generated plans check and are compiled)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.bad = rng.choice([0.0, 0.0, 0.0, 0.01, 0.05])

    def pick(self, pool: tuple[list, list]):
        good, bad = pool
        return self.rng.choice(bad if bad and self.slip() else good)

    def num(self, lo: int, hi: int) -> str:
        """A whole number in [lo, hi]; at the plan's rate an edge case."""
        return self.rng.choice(NUMBERS) if self.slip() else str(self.rng.randint(lo, hi))

    def slip(self) -> bool:
        """Whether to write something wrong here."""
        return self.rng.random() < self.bad

    def __getattr__(self, name):   # random(), choice(), sample(), randint() of the generator
        return getattr(self.rng, name)


def _yaml_cluster(d: Draw, levels, host, flops, memory) -> str:
    nested = d.random() < 0.2
    ind = "  " if nested else ""
    lines = (["cluster:"] if nested else []) + [f"{ind}levels:"]
    for name, f in levels:
        key = d.choice(["fanout", "fanout", "x"])
        fan = f if not d.slip() else d.choice(["0", "two", "2.5", "-1"])
        bw, lat = d.pick(YAML_BW), d.pick(YAML_LAT)
        if d.random() < 0.5:
            lines.append(f"{ind}  - {{name: {name}, {key}: {fan}, bandwidth: {bw}"
                         + (f", latency: {lat}}}" if d.random() < 0.7 else "}"))
        else:
            lines += [f"{ind}  - name: {name}", f"{ind}    {key}: {fan}", f"{ind}    bandwidth: {bw}"]
            if d.random() < 0.6:
                lines.append(f"{ind}    latency: {lat}")
    if host:
        lines.append(f"{ind}host: {host}")
    if flops:
        lines.append(f"{ind}flops: {d.pick(YAML_FLOPS)}")
    if memory:
        lines.append(f"{ind}memory: {d.pick(YAML_MEMORY)}")
    return "\n".join(lines) + "\n"


def _cluster(d: Draw) -> tuple[list[tuple[str, int]], str, str | None]:
    """(levels, the plan's cluster statement, a YAML cluster file or None)."""
    n = d.randint(1, 4)
    names = d.sample(LEVELS[0], n)
    if d.slip():
        names[d.randrange(n)] = d.choice(LEVELS[1] + names)
    fanouts = [d.choice([1, 2, 2, 2, 3, 4]) for _ in range(n)]
    host = (d.choice(names) if not d.slip() else "nowhere") if d.random() < 0.4 else None
    flops = d.random() < 0.3
    memory = d.random() < 0.3
    levels = list(zip(names, fanouts))
    if d.random() < 0.25:   # a YAML cluster file: plain numbers or quantity strings
        return levels, f'cluster "{YAML_NAME}"', _yaml_cluster(d, levels, host, flops, memory)
    sep = d.choice(["\n  ", ", ", "\n  ,"])
    items = []
    for name, f in levels:
        attrs = []
        if f > 1 or d.random() < 0.3:
            attrs.append("bandwidth " + d.pick(BANDWIDTHS))
        if d.random() < 0.5:
            attrs.append("latency " + d.pick(LATENCIES))
        if len(attrs) == 2 and d.random() < 0.3:
            attrs.reverse()
        items.append(f"level {name} x {d.num(f, f)}" + (" : " + ", ".join(attrs) if attrs else ""))
    if host:
        items.append(f"host = {host}")
    if flops:
        items.append("flops " + ("= " if d.random() < 0.7 else "") + d.pick(FLOPS))
    if memory:
        items.append("memory " + ("= " if d.random() < 0.7 else "") + d.pick(MEMORY))
    return levels, "cluster {" + sep + sep.join(items) + "\n}", None


def _mesh(d: Draw, size: int) -> tuple[list[str], list[int], str]:
    shape = [2, size // 2] if size > 1 and size % 2 == 0 and d.random() < 0.4 else [size]
    if d.slip():
        shape[0] += 1
    names = d.sample(["data", "tensor", "m0", "seq"], len(shape))
    if d.random() < 0.5:
        return names, shape, "(" + ", ".join(f"{n} = {s}" for n, s in zip(names, shape)) + ")"
    return [f"m{i}" for i in range(len(shape))], shape, "(" + ", ".join(map(str, shape)) + ")"


def _spec(d: Draw, shape: list[int], mesh: tuple[list[str], list[int]]) -> str:
    """A sharding spec for ``shape`` on ``mesh``; each dim sharded only where the mesh divides it."""
    names, sizes = mesh
    out, used = [], set()
    for n in shape + ([1] if d.slip() else []):
        r = d.random()
        free = [k for k in range(len(sizes)) if k not in used and n % sizes[k] == 0]
        if r < 0.5 or not free:
            out.append("R" if not d.slip() else d.choice(["S2", "S(nope)", "Q"]))
            continue
        k = d.choice(free)
        used.add(k)
        out.append(f"S{k}" if r < 0.8 or not names else f"S({names[k]})")
    sep = " " if d.random() < 0.7 or any("(" in x for x in out) else ""
    return sep.join(out)


def _program(d: Draw, names: list[str]) -> str:
    steps = []
    levels = ["root"] + names
    for _ in range(d.randint(1, 3)):
        form = d.choice(["inside", f"parallel({d.choice(levels)})", f"master({d.choice(levels)})"])
        steps.append(f"{d.pick(COLLS)}(slice={d.choice(levels)}, form={form})")
    if d.random() < 0.5 and names:   # the usual hierarchical program
        lv = d.choice(names)
        return (f"reduce_scatter(slice={lv}, form=inside); allreduce(slice={lv}, form=parallel(root)); "
                f"all_gather(slice={lv}, form=inside)")
    return "; ".join(steps) + d.choice(["", ";"])


def _shape(d: Draw, ndims: int) -> list[int]:
    return [d.choice([1, 2, 4, 6, 8, 12, 16]) for _ in range(ndims)]


def generate(rng: random.Random) -> tuple[str, str | None]:
    """One plan (text) built from the grammar's constructs, and its YAML cluster file or None."""
    d = Draw(rng)
    levels, cluster, yaml_text = _cluster(d)
    devices = 1
    for _, f in levels:
        devices *= f
    level_names = [n for n, _ in levels]
    lines = [cluster]
    model = d.random() < 0.45
    axes: list[str] = []
    mesh_of: dict[int, tuple[list[str], list[int]]] = {}
    layers = d.randint(2, 6)
    if model:
        ex = ROOT / "examples" / "mlp.py"
        lines += [f'model "{ex}:build" {{ layers = {layers}, hidden = 16, inputs = 8, outputs = 4 }}',
                  f'loss "{ex}:loss"', f'data "{ex}:batches"' if not d.slip() else 'data "nofunction"']
    mode = d.choice(["parallel", "parallel", "explicit", "auto"])
    if mode in ("parallel", "auto"):
        pipe = d.choice([k for k in (1, 2, 2, 4) if devices % k == 0 and k <= layers])
        rest = devices // pipe
        items = [f"pipe = {pipe}"] if pipe > 1 or d.random() < 0.2 else []
        data = d.choice([k for k in range(1, rest + 1) if rest % k == 0])
        items.append(f"data = {data}")
        if rest // data > 1 or d.random() < 0.2:
            items.append(f"tensor = {d.num(rest // data, rest // data)}")
        if d.random() < 0.4:
            items.append("place = auto")
        if d.random() < 0.5:
            d.shuffle(items)
        lines.append("parallel { " + d.choice([", ", "\n  "]).join(items) + " }")
        axes = ["data", "tensor"]
        n_stages = pipe
        if mode == "auto" and model:
            lines.append(d.choice([f"stages = auto({n_stages})", "stages = auto"])
                         if not d.slip() else f"stages = auto({d.num(0, 5)})")
        elif model or (pipe > 1 and d.random() < 0.5):
            a = 0
            each_auto = model and d.random() < 0.15
            for i in range(n_stages):
                b = min(layers - (n_stages - 1 - i), a + d.randint(1, 2)) if i < n_stages - 1 else layers
                lines.append(f"stage {i} : layers auto" if each_auto else f"stage {i} : layers {a}..{b}")
                a = b
        for i in range(n_stages):
            mesh_of[i] = (["data", "tensor"], [data, rest // data])
    else:
        n_stages = d.randint(1, min(3, devices, layers))
        per = devices // n_stages
        auto_layers = model and d.random() < 0.3
        a = start = 0
        for i in range(n_stages):
            names, shape, mesh = _mesh(d, per)
            mesh_of[i] = (names, shape)
            axes += names
            layer = ""
            if model:
                b = a + 1 if i < n_stages - 1 else layers
                layer = " : layers auto" if auto_layers else f" : layers {a}..{b}"
                a = b
            lines.append(f"stage {i}{layer} on devices {start}..{start + per} as {mesh}")
            start += per
    n_tr = (d.randint(0, 3) if not model else len(mesh_of) - 1) if len(mesh_of) > 1 else 0
    for k in range(n_tr):
        a = k if model else d.randint(0, len(mesh_of) - 1)
        b = a + 1 if model else d.choice([i for i in mesh_of if i != a])
        if d.slip():
            b = len(mesh_of)
        shape = [8, 16] if model else _shape(d, d.randint(1, 3))
        text = f"transfer t{k}"
        if not model or d.random() < 0.6:
            text += f" : {d.pick(DTYPES)}[{', '.join(d.num(x, x) for x in shape)}]"
        text += f" from stage {a}"
        if model and d.random() < 0.2:
            text += f" layer {d.num(0, layers - 1)}"
        if not model or d.random() < 0.6:
            text += " as " + _spec(d, shape, mesh_of[a])
        text += f" to stage {b}"
        if not model or d.random() < 0.6:
            text += " as " + _spec(d, shape, mesh_of.get(b, mesh_of[a]))
        lines.append(text)
    for k in range(d.randint(0, 2)):
        choices = sorted(set(axes)) + (["pipe", "nothing"] if d.slip() else [])
        over = ", ".join(d.sample(choices, min(len(choices), d.randint(1, 2)))) if choices else "data"
        name = "gradients" if model and k == 0 and d.random() < 0.6 else f"r{k}"
        text = f"reduce {name} over {over}"
        if d.random() < 0.4:
            text += " using " + (_program(d, level_names) if d.random() < 0.7 else "allreduce")
        if name != "gradients" or d.slip():
            text += f" : {d.pick(DTYPES)}[{d.num(1, 4096)}]"
        lines.append(text)
    if d.random() < 0.3:
        items = [f"strategy = {d.pick(STRATEGIES)}", f"chunks = {d.num(1, 16)}", f"schedule = {d.pick(SCHEDULERS)}"]
        lines.append("resharding { " + ", ".join(d.sample(items, d.randint(1, 3))) + " }")
    if d.random() < 0.3:
        items = [f"max_size = {d.num(1, 4)}",
                 "collectives = [" + ", ".join(dict.fromkeys(d.pick(COLLS) for _ in range(d.randint(1, 4)))) + "]"]
        lines.append("synthesis { " + ", ".join(d.sample(items, d.randint(1, 2))) + " }")
    if model or d.slip():
        items = [f"micro_batch = {d.num(8, 8)}", f"micro_batches = {d.num(1, 8)}", f"steps = {d.num(1, 5)}",
                 f"schedule = {d.pick(PIPE_SCHEDULES)}", f"optimizer = {d.pick(OPTIMIZERS)}",
                 f"precision = {d.pick(PRECISIONS)}", f"timeout = {d.pick(TIMEOUTS)}",
                 f"save_every = {d.num(1, 5)}", f"seed = {d.num(0, 99)}"]
        lines.append("train { " + d.choice([", ", "\n  "]).join(d.sample(items, d.randint(1, len(items)))) + " }")
    if d.random() < 0.05:
        lines.append('deepspeed "ds.yaml"')
    if d.random() < 0.5:
        d.shuffle(lines)
    body = "\n".join(lines)
    if d.random() < 0.4:
        body = f"plan {d.choice(['fuzz', 'p_1', 'plan_9']) if not d.slip() else '9x'} {{\n{body}\n}}"
    return body + "\n", yaml_text


# ---------------------------------------------------------------- mutations

TOKEN = re.compile(rb'"[^"\n]*"|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|[A-Za-z_]\w*|\.\.|\n|[ \t]+|#[^\n]*|.', re.S)
JUNK = [b"{", b"}", b"(", b")", b"[", b"]", b",", b";", b":", b"=", b"..", b"\n", b'"', b"@", b"\x00", b"\xff",
        "é".encode(), b"\t", b"#", b"\r", b"\xef\xbb\xbf", b"stage", b"layers", b"auto", b"auto(", b"on devices",
        b"as", b"S0", b"S(", b"R", b"GB/s", b"us", b"plan", b"cluster", b"level", b"x", b"stages = auto(2)",
        b"flops", b"memory", b"cores", b"per", b"TFLOP/s", b"GiB", b"-", b"timeout", b"save_every", b"using", b"over", b"transfer",
        b"1e999", b"99999999999999999999", b"0", b"-1", b"1f1b", b"&a", b"*a", b"!!python/object", b"- ", b": "]


def mutate_bytes(rng: random.Random, data: bytes, donors: list[bytes]) -> bytes:
    """1-4 byte- or token-level edits: flips, inserts, deletes, duplications, splices, swaps."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(9)
        n = len(buf)
        i = rng.randint(0, n)
        if kind == 0 and n:                      # flip a bit
            j = min(i, n - 1)
            buf[j] ^= 1 << rng.randrange(8)
        elif kind == 1:                          # a random byte
            buf[i:i] = bytes([rng.randrange(256)])
        elif kind == 2 and n:                    # delete a run
            del buf[i:i + rng.randint(1, 16)]
        elif kind == 3 and n:                    # duplicate a run
            j = min(i, n - 1)
            buf[j:j] = buf[j:j + rng.randint(1, 64)]
        elif kind == 4 and donors:               # splice a run of another input
            d = rng.choice(donors)
            a = rng.randint(0, len(d))
            buf[i:i] = d[a:a + rng.randint(1, 80)]
        elif kind == 5:                          # insert a token
            buf[i:i] = rng.choice(JUNK)
        elif kind == 6 and n:                    # truncate
            del buf[i:]
        else:                                    # token-level: replace a number, or swap two tokens
            toks = TOKEN.findall(bytes(buf))
            if len(toks) < 2:
                continue
            if kind == 7:
                nums = [k for k, t in enumerate(toks) if t[:1].isdigit()]
                if nums:
                    toks[rng.choice(nums)] = rng.choice(NUMBERS).encode()
            else:
                a, b = rng.randrange(len(toks)), rng.randrange(len(toks))
                toks[a], toks[b] = toks[b], toks[a]
            buf = bytearray(b"".join(toks))
    return bytes(buf)


def repo_seeds() -> list[tuple[str, bytes]]:
    """Every .plan in the repository's plan folders and tests, with its name, in a fixed order."""
    out = []
    for d in SEED_DIRS:
        for p in sorted((ROOT / d).rglob("*.plan")):
            out.append((str(p.relative_to(ROOT)), p.read_bytes()))
    return out


YAML_PLAN = f'plan y {{\n  cluster "{YAML_NAME}"\n  parallel {{ data = 2, tensor = 4 }}\n  reduce g over data : f32[64]\n}}\n'
YAML_SEEDS = [
    "levels:\n  - {name: node, fanout: 2, bandwidth: 12.5 GB/s, latency: 20 us}\n"
    "  - {name: gpu, fanout: 4, bandwidth: \"150 GB/s\", latency: 2us}\nhost: node\n",
    "cluster:\n  levels:\n    - name: node\n      fanout: 2\n      bandwidth: 12500000000\n      latency: 2.0e-05\n"
    "    - name: gpu\n      x: 4\n      bandwidth: 1.5e11\n  flops: 312e12\n  memory: 80 GB\n",
    "levels:\n  - name: node\n    fanout: 8\n    bandwidth: 100 Gb/s\nhost: node\nflops: 312 TFLOP/s\nmemory: 85899345920\n",
]
