"""Helpers for the end-to-end tests: the launch of a compiled output (launch_sh) and the single-process
reference (``independent_reference``: plain torch, no planc code: no test compares the product with
itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from planc.ports import free_port  # noqa: F401  (the tests' one way to pick a rendezvous port)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def spelled(plan) -> Path:
    """For a bundled plan (``plans/NAME`` or its name) whose transfers are inferred by the model probe:
    its spelled copy ``tests/plans/STEM-spelled.plan`` (line for line, the transfers' types written
    out), so tests that are about something else than the probe compile it with ``probe=False``
    (~6 s less each). A plan without a spelled copy (nothing inferred) is returned as is.
    ``test_compile.test_spelled_copies_match_the_bundled_plans`` keeps the copies in step."""
    path = Path(plan) if Path(plan).is_absolute() or "/" in str(plan) else ROOT / "plans" / plan
    copy = ROOT / "tests" / "plans" / f"{path.stem}-spelled.plan"
    return copy if path.resolve().parent == ROOT / "plans" and copy.is_file() else path


def extensions_env() -> dict:
    """``TORCH_EXTENSIONS_DIR`` for the ranks, unless set: a folder of this venv. Every CPU rank
    JIT-loads DeepSpeed's shared-memory op (``deepspeed_shm_comm``); in the shared default folder
    (~/.cache/torch_extensions) a build there by another environment (another compile command) makes
    the next rank here rebuild it: ~45 s of one core, every rank of the launch waiting on its lock."""
    venv = Path(sys.prefix)
    if os.environ.get("TORCH_EXTENSIONS_DIR") or sys.prefix == sys.base_prefix or not os.access(venv, os.W_OK):
        return {}   # set already, or no venv of ours to keep it in: the default folder
    return {"TORCH_EXTENSIONS_DIR": str(venv / "torch_extensions")}


def launch_env():
    """CPU/gloo, this venv's deepspeed and python first on PATH, the JIT-built DeepSpeed op kept in
    this venv (``extensions_env``). No ``OMP_NUM_THREADS``: each rank's threads are the runtime's own
    choice (cores ÷ ranks on this machine, ``planc_runtime.dist_util.cpu_threads``), as for a user
    who launches without setting it."""
    bin_dir = str(Path(PY).parent)
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               PYTHONPATH="", PYTHON=PY,
               PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               PLANC_MASTER_PORT=str(free_port()), **extensions_env())
    env.pop("OMP_NUM_THREADS", None)
    return env


def launch_sh(out: Path, *args, timeout=300):
    """``bash OUT/launch.sh ARGS`` (the compiled output's own launcher)."""
    return subprocess.run(["bash", str(out / "launch.sh"), *args], env=launch_env(), capture_output=True,
                          text=True, timeout=timeout, cwd=out)


def shard_of(full, dim, index, parts, blocks=1):
    """The part of a reference tensor a tensor-parallel rank holds (planc_runtime.tensor_parallel.shard_of):
    ``dim`` viewed as ``blocks`` equal blocks, part ``index`` of ``parts`` of each, concatenated."""
    import torch
    n = full.shape[dim]
    assert n % (blocks * parts) == 0, (tuple(full.shape), dim, parts, blocks)
    step, block = n // (blocks * parts), n // blocks
    return torch.cat([full.narrow(dim, b * block + index * step, step) for b in range(blocks)], dim=dim)


def compare_dumps(dump_dir: Path, ranks, ref_state: dict, rtol: float, atol: float) -> dict:
    """Every rank's dumped parameters (``--dump-params``) against the reference.

    A parameter listed in ``rank<R>.shards.json`` (``[dim, index, parts, blocks]``) is compared with
    its slice of the reference; with a fifth entry (a padded vocabulary shard) with its slice of the
    reference padded with zero rows, so its padding must be untouched zeros. Every reference parameter must be held by some rank, whole or as
    shards that tile it exactly: one layout per parameter, every index ``0..parts-1`` present, the
    shards' shapes adding up to the reference's. Returns ``{name: layout}`` of the sharded ones.

    ``ranks``: an int N (ranks ``0..N-1``, every rank in a stage), or the list of the ranks that are
    in a stage; then exactly those dumped (a rank in no stage is idle and dumps nothing).
    """
    import json
    import torch
    if isinstance(ranks, int):
        ranks = range(ranks)
    else:
        ranks = sorted(ranks)
        dumped = sorted(int(f.name[4:-3]) for f in dump_dir.glob("rank*.pt"))
        assert dumped == ranks, f"ranks that dumped parameters: {dumped}, the stages' ranks: {ranks}"
    whole, shards = set(), {}
    for rank in ranks:
        mine = torch.load(dump_dir / f"rank{rank}.pt")
        assert mine, f"rank {rank} dumped no parameters"
        info_path = dump_dir / f"rank{rank}.shards.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        assert set(info) <= set(mine), f"rank {rank}: shard records for parameters it did not dump"
        for k, v in mine.items():
            assert k in ref_state, f"rank {rank} dumped {k}, which the reference does not have"
            if k in info:
                dim, index, parts, blocks = info[k][:4]
                ref = ref_state[k]
                if len(info[k]) > 4:   # a padded vocabulary shard: the reference padded with zero rows
                    assert info[k][4] == ref.shape[dim], f"{k}: padded shard of {info[k][4]} real rows"
                    extra = list(ref.shape)
                    extra[dim] = v.shape[dim] * parts - ref.shape[dim]
                    ref = torch.cat([ref, ref.new_zeros(extra)], dim=dim)
                want = shard_of(ref, dim, index, parts, blocks)
                layout, held = shards.setdefault(k, ((dim, parts, blocks), {}))
                assert layout == (dim, parts, blocks), f"{k}: ranks disagree on its layout"
                held.setdefault(index, tuple(v.shape))
                assert held[index] == tuple(v.shape), f"{k}: shard {index} dumped with two shapes"
            else:
                want = ref_state[k]
                whole.add(k)
            torch.testing.assert_close(v, want, rtol=rtol, atol=atol, msg=f"rank {rank} {k}")
    assert not whole & set(shards), f"held both whole and sharded: {sorted(whole & set(shards))}"
    for k, ((dim, parts, blocks), held) in shards.items():
        assert set(held) == set(range(parts)), f"{k}: shards {sorted(held)} of {parts}"
        shape = list(held[0])
        shape[dim] = sum(s[dim] for s in held.values())
        real = list(ref_state[k].shape)
        pad = shape[dim] - real[dim]   # a padded shard's zero rows (less than a shard's)
        assert 0 <= pad < held[0][dim] and shape[:dim] + shape[dim + 1:] == real[:dim] + real[dim + 1:], \
            f"{k}: shards {held} do not tile {tuple(ref_state[k].shape)}"
    seen = whole | set(shards)
    assert seen == set(ref_state), f"parameters held by no rank: {sorted(set(ref_state) - seen)}"
    return {k: layout for k, (layout, _) in shards.items()}


def load_example(name: str):
    """``examples/NAME.py`` imported as a module of its own (the examples are no package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"planc_test_{name}", ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- an independent reference

def _load_callable(folder: Path, entry: dict):
    """``entry["function"]`` of the Python file ``folder / entry["file"]``, imported under a fresh name."""
    import importlib.util
    path = Path(folder) / entry["file"]
    name = f"_e2e_ref_{path.stem}_{abs(hash(str(path.resolve())))}"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return getattr(mod, entry["function"])


def schedule_factor(schedule: dict, t: int) -> float:
    """LANGUAGE.md's learning-rate factor of optimizer step t, written again from its text (not planc's):
    constant 1; warmup_cosine: (t + 1) / W while t < W, then r + (1 - r) / 2 * (1 + cos(pi * p)) with
    p = min(1, (t - W) / max(1, T - W))."""
    import math
    if schedule.get("name", "constant") == "constant":
        return 1.0
    w, total, r = schedule["warmup"], schedule["total"], schedule["min_ratio"]
    if t < w:
        return (t + 1) / w
    p = min(1.0, (t - w) / max(1, total - w))
    return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p))


def plan_source(plan: dict, model_dir: Path) -> Path:
    """The plan text plan.json was compiled from, found by its ``source`` record (file name and sha256 of
    its bytes) beside the compiled output (``model_dir``, its parent) or among the bundled plans; the
    hash must match, so the text is the one compiled. For callers that do not name it."""
    import hashlib
    name, want = Path(plan["source"]["path"]), plan["source"]["sha256"]
    model_dir = Path(model_dir)
    places = [name] if name.is_absolute() else [d / name.name for d in (
        model_dir, model_dir.parent, ROOT / "plans", ROOT / "tests" / "plans", Path.cwd())]
    for path in places:
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == want:
            return path
    raise AssertionError(f"independent_reference: the plan text {name} (sha256 {want[:12]}...) is not beside "
                         f"{model_dir}: pass source= (the .plan compiled)")


def plan_dataflow(source) -> tuple[list[tuple[int, int, int]] | None, list[tuple[str, int, int | None, int]]]:
    """The stage cut and the transfers as the plan TEXT writes them (LANGUAGE.md), never plan.json's: a
    compiler that wired a transfer from the wrong layer, or cut the stages elsewhere, must not have its
    mistake copied into the reference. ``source``: the .plan file (a Path) or its text.

    Returns (``[(stage, first layer, end layer)]`` sorted by stage, or None where the text leaves the cut to
    the compiler: ``stages = auto(N)``, ``layers auto``; ``[(name, src stage, src layer or None, dst stage)]``
    in declaration order). No ``transfer`` line: the inferred chain (each stage's output to the next stage)."""
    import re
    text = Path(source).read_text() if isinstance(source, Path) else str(source)
    text = re.sub(r"#[^\n]*", "", text)
    stages = [(int(i), int(a), int(b)) for i, a, b in
              re.findall(r"^\s*stage\s+(\d+)\s*:\s*layers\s+(\d+)\s*\.\.\s*(\d+)", text, re.M)]
    auto = re.search(r"\bstages\s*=\s*auto\b|^\s*stage\s+\d+\s*:\s*layers\s+auto\b", text, re.M)
    assert not (stages and auto), "the plan text both cuts the stages and leaves them to the compiler"
    transfers = [(name, int(src), int(layer) if layer else None, int(dst)) for name, src, layer, dst in
                 re.findall(r"^\s*transfer\s+(\w+)\b[^\n]*?\bfrom\s+stage\s+(\d+)(?:\s+layer\s+(\d+))?"
                            r"[^\n]*?\bto\s+stage\s+(\d+)", text, re.M)]
    if auto:
        assert not transfers, ("the reference needs the stage cut the plan text writes where it writes transfers "
                               "(the layer a transfer enters is its stage's first)")
        return None, []
    assert stages, "the plan text writes no `stage I : layers A..B` line"
    stages.sort()
    if not transfers:   # the chain the language infers
        transfers = [(f"chain{i}", s0, None, s1) for i, ((s0, _, _), (s1, _, _)) in enumerate(zip(stages, stages[1:]))]
    return stages, transfers


def independent_reference(plan: dict, model_dir: Path, steps: int, micro_batches: int | None = None,
                          lr_factor: float = 1.0, record: dict | None = None, skip=(), *, source=None,
                          grad_scale: float = 1.0, drop_rows: tuple[int, int] | None = None):
    """Train the whole model in this process with plain torch, knowing nothing of planc's runtime.

    ``plan`` is a compiled plan.json: its ``train`` block names the model, loss and data files (found
    in ``model_dir``, e.g. the compiled output or examples/) and the hyper-parameters. The dataflow is
    the plan TEXT's (``source``, read by ``plan_dataflow``; by default the file plan.json's ``source``
    names, found by ``plan_source`` and checked by its hash), never plan.json's stages and transfers: the
    layer ranges and the transfers in declaration order (a plan that leaves the cut to the compiler
    writes no transfer: its layers run one after the other, as any cut of a chain computes):

    - torch is seeded with ``train.seed``, then the builder builds every layer (no tensor_parallel),
      then ``batches(micro_batch, seed, **model_args)`` gives the data;
    - per micro-batch the stages run in order: stage 0's first layer gets the batch input, another
      stage's first layer its incoming transfers as positional arguments in declaration order; a layer
      returning a tuple hands it on as positional arguments; a transfer sends the output of its
      ``src.layer`` (default the stage's last layer); the last stage's output goes to the loss;
    - loss / micro_batches is back-propagated per micro-batch (the micro-batch mean); after the last
      micro-batch, with ``train.clip`` = X, ``torch.nn.utils.clip_grad_norm_`` on the whole model;
      then one optimizer step (torch.optim.SGD, Adam or AdamW with every argument plan.json writes),
      the rate lr * ``schedule_factor`` of ``train.lr_schedule`` at step t (times ``lr_factor``: a test
      that must tell a wrong rate apart), and zero_grad. Everything in fp32, whatever the precision.
      The steps listed in ``skip`` (fp16 overflows) draw their data and take no optimizer step: t counts
      the steps taken.

    Negative controls (a fault trained on purpose, that a comparison at the suite's tolerances must see):
    ``grad_scale`` multiplies every gradient before the norm, the clip and the step (a gradient-scale
    error: 2.0, 0.5); ``drop_rows = (k, n)`` leaves out part k of n of every micro-batch's rows (the rows
    of data rank k of n: a data rank whose rows never count), the loss the mean over the rows left.

    Returns (loss sum per step, ``{"layers.<i>.<param>": tensor}``); ``record``, when given, gets the
    rate (``"lr"``) and the L2 norm over all gradients before any clipping (``"grad_norm"``, what rank 0
    prints when the plan clips) of every step taken.
    """
    import torch
    train = plan["train"]
    args = dict(train["model"]["args"])
    seed = train["seed"]
    micro_batches = micro_batches or train["micro_batches"]
    torch.manual_seed(seed)
    layers = list(_load_callable(model_dir, train["model"])(**args))
    loss_fn = _load_callable(model_dir, train["loss"])
    data = _load_callable(model_dir, train["data"])(train["micro_batch"], seed, **args)

    opt_cfg = dict(train["optimizer"])
    kind, lr = opt_cfg.pop("name").lower(), opt_cfg.pop("lr")
    if "betas" in opt_cfg:
        opt_cfg["betas"] = tuple(opt_cfg["betas"])
    params = list({id(p): p for layer in layers for p in layer.parameters()}.values())   # a tied one once
    optimizers = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    assert kind in optimizers, f"independent_reference: optimizer {kind!r} (sgd, adam or adamw)"
    optimizer = optimizers[kind](params, lr=lr, **opt_cfg)
    schedule = train.get("lr_schedule") or {"name": "constant"}
    clip = train.get("clip")
    if record is not None:
        record.update(lr=[], grad_norm=[])

    cut, written = plan_dataflow(source if source is not None else plan_source(plan, model_dir))
    if cut is None:
        cut = [(0, 0, len(layers))]
    for name, src, _, dst in written:
        assert src < dst, f"transfer {name} does not flow forward"
    first = cut[0][0]
    ends = {s: b for s, _, b in cut}

    losses = []
    taken = 0
    for step in range(steps):
        total = 0.0
        for _ in range(micro_batches):
            x, y = next(data)
            if drop_rows is not None:
                k, n = drop_rows
                rows = x.shape[0]
                assert rows % n == 0, f"drop_rows: {rows} rows do not split in {n}"
                keep = torch.cat([torch.arange(0, k * rows // n), torch.arange((k + 1) * rows // n, rows)])
                x, y = x[keep], y[keep]
            sent = {}
            out = None
            for s, a, b in cut:
                inputs = (x,) if s == first else tuple(sent[name] for name, _, _, dst in written if dst == s)
                outputs = {}
                for i in range(a, b):
                    out = layers[i](*inputs)
                    outputs[i] = out
                    inputs = out if isinstance(out, tuple) else (out,)
                for name, src, layer, _ in written:
                    if src == s:
                        layer = ends[s] - 1 if layer is None else layer
                        assert layer in outputs, f"transfer {name}: layer {layer} is not in stage {s}"
                        value = outputs[layer]
                        assert isinstance(value, torch.Tensor), f"transfer {name}: layer output is not a tensor"
                        sent[name] = value
            loss = loss_fn(out, y) / micro_batches
            loss.backward()
            total += float(loss.detach())
        if step in skip:
            optimizer.zero_grad()
            losses.append(total)
            continue
        if grad_scale != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]))
        if record is not None:
            record["grad_norm"].append(float(norm))
        rate = lr * schedule_factor(schedule, taken) * lr_factor
        taken += 1
        for group in optimizer.param_groups:
            group["lr"] = rate
        if record is not None:
            record["lr"].append(rate)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    state = {f"layers.{i}.{k}": v.detach().clone() for i, layer in enumerate(layers)
             for k, v in layer.named_parameters()}
    return losses, state


def controls(data_parts: int) -> dict[str, dict]:
    """The negative controls every training e2e family runs (issue 45): the reference trained with a
    gradient-scale error (x2) and with one data rank's rows missing (rank 0 of ``data_parts``; with one
    data rank, half of every micro-batch's rows). Keyword arguments for ``independent_reference``."""
    return {"gradients x2": {"grad_scale": 2.0},
            f"data rank 0 of {data_parts}'s rows missing": {"drop_rows": (0, max(2, data_parts))}}


def assert_controls_fail(compare, plan: dict, model_dir: Path, steps: int, *, source, data_parts: int,
                         only=None, **ref) -> dict[str, str]:
    """Every control of ``controls(data_parts)`` (those named in ``only``) trained by the reference, then
    given to ``compare(losses, state, record)``: the very check, at the very tolerances, the real
    reference passed against the run's output (no launch of its own). Each must fail it; a control that
    passes means the comparison cannot see that fault. Returns {control: the first line of its failure}."""
    seen = {}
    for name, fault in controls(data_parts).items():
        if only is not None and not any(name.startswith(o) for o in only):
            continue
        record: dict = {}
        losses, state = independent_reference(plan, model_dir, steps, record=record, source=source, **ref, **fault)
        try:
            compare(losses, state, record)
        except AssertionError as e:
            seen[name] = (str(e).strip().splitlines() or [""])[0]
            continue
        raise AssertionError(f"negative control ({name}): the reference trained with that fault matches the "
                             f"run at the suite's tolerances, so the comparison cannot see it")
    assert seen, f"no control named {only}"
    return seen


# ---------------------------------------------------------------- plan.json queries

def stage_ranks(plan: dict) -> list[int]:
    """The ranks (= device numbers) that are in some stage, sorted (once each: stages may share a mesh)."""
    return sorted({d for st in plan["stages"] for d in st["devices"]})


def stage_gradient_program(plan: dict, stage: int) -> tuple[list[list[int]], dict]:
    """(that stage's gradient reduction groups, the program of the plan.json gradients entry that holds
    them). The entries may be one per stage (with a ``"stage"`` key) or one for all stages."""
    st = next(s for s in plan["stages"] if s["index"] == stage)
    devices = set(st["devices"])
    found = []
    for r in plan["reductions"]:
        if r["name"] != "gradients":
            continue
        mine = [g for g in r["groups"] if set(g) <= devices]
        if r.get("stage") is not None and r["stage"] != stage:
            assert not mine, f"gradients entry of stage {r['stage']} holds groups of stage {stage}: {mine}"
            continue
        if mine:
            found.append((mine, r["program"]))
    assert len(found) == 1, f"stage {stage}: {len(found)} gradients entries hold its groups"
    return found[0]


def data_degree(plan: dict) -> int:
    """The largest ``data`` dimension of any stage's mesh (1 without one): the controls' rows of one data rank."""
    return max([st["mesh_shape"][st["mesh_axes"].index("data")] for st in plan["stages"]
                if "data" in st.get("mesh_axes", [])] or [1])


def schedule_bound(ops) -> int:
    """Micro-batches a stage's instruction list ("F<m>" / "B<m>") can hold at once: the most
    forwards not yet matched by their backward over every prefix."""
    live = peak = 0
    for op in ops:
        if op[0] == "F":
            live += 1
        elif op[0] == "B":
            live -= 1
        else:
            raise ValueError(f"unknown pipeline instruction {op!r}")
        peak = max(peak, live)
    return peak


# ---------------------------------------------------------------- launches by hand, plan.json variants

def start_ranks(out, world: int, *args, env=None, timeout=240, fork=True, script=None):
    """``python OUT/train.py ARGS`` once per rank, env:// rendezvous on a free port, as a per-host
    launcher does (CPU/gloo; the program launch.sh starts through the `deepspeed` launcher, without the
    launcher's start-up time); returns (the worst return code, rank 0's output, every rank's output).

    ``fork``: the ranks are forks of one interpreter that imported torch, DeepSpeed and the runtime once
    (``tests/forkstart.py``: the same ``main`` on the same environment, 2-4 CPU seconds a rank fewer);
    ``fork=False`` starts one ``python`` per rank (the GPU tier). ``script``: that program instead of
    OUT/train.py (a baseline of the benches), one ``python`` per rank."""
    return Ranks(out, world, *args, env=env, fork=fork and script is None, script=script).wait(timeout)


class Ranks:
    """``start_ranks`` begun and not waited for: the launch runs while the test computes its reference.
    ``wait(timeout)`` -> (the worst return code, rank 0's output, every rank's output); on the timeout
    every rank is killed and ``subprocess.TimeoutExpired`` raised."""

    def __init__(self, out, world: int, *args, env=None, fork=True, script=None):
        import tempfile
        base = dict(launch_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        base.update(env or {})
        self.world, self.procs, self.logs = world, [], None
        if fork:
            self.logs = tempfile.TemporaryDirectory(prefix="planc-ranks-")
            self.procs.append(subprocess.Popen(
                [PY, str(ROOT / "tests" / "forkstart.py"), str(out), str(world), self.logs.name, *map(str, args)],
                env=base, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
            return
        for rank in range(world):
            renv = dict(base, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
            program = str(script or Path(out) / "train.py")
            self.procs.append(subprocess.Popen([PY, program, *map(str, args)], env=renv, cwd=out,
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               start_new_session=True))

    def wait(self, timeout):
        import json
        import time
        deadline, texts = time.monotonic() + timeout, []
        try:
            for p in self.procs:
                texts.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            self.kill()
            tails = []
            if self.logs is not None:   # what each rank said before it was killed: where it hung
                for r in range(self.world):
                    log = Path(self.logs.name) / f"rank{r}.log"
                    text = log.read_text(errors="replace") if log.is_file() else "(no output)"
                    tails.append(f"--- rank {r} ---\n{text[-1500:]}")
                self.logs.cleanup()
            raise AssertionError(f"the ranks did not end within {timeout} s; every rank killed\n"
                                 + "\n".join(tails)) from None
        finally:
            self.kill()
        if self.logs is None:
            return max(abs(p.returncode) for p in self.procs), texts[0], "\n".join(texts)
        with self.logs as logs:
            ranks = [(Path(logs) / f"rank{r}.log") for r in range(self.world)]
            ranks = [f.read_text(errors="replace") if f.is_file() else "" for f in ranks]
            codes = Path(logs) / "rc.json"
            if not codes.is_file():   # the forking interpreter itself failed (its imports): its own output
                return abs(self.procs[0].returncode) or 1, texts[0] + ranks[0], texts[0] + "\n".join(ranks)
            worst = max(abs(c) for c in json.loads(codes.read_text()).values())
        return worst, ranks[0], "\n".join(ranks)

    def kill(self):
        import signal
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()


def run_direct(out, *args, timeout=300, env=None):
    """``start_ranks`` for a test about what the ranks compute, not about the launcher, shaped as
    ``launch_sh``'s result: a ``subprocess.CompletedProcess`` whose ``stdout`` is rank 0's output and
    ``stderr`` every rank's; the world is OUT/plan.json's ``cluster.devices``. No DeepSpeed launch.py
    (launch.sh's one host: one more Python importing torch and DeepSpeed before the first rank starts,
    ~2 s of a launch on 2 cores: ``python -m benchmarks bench startup``). launch.sh
    stays tested where it is the subject (test_e2e, test_comm_only's logs, test_ui, test_user_mistakes)."""
    import json
    world = json.loads((Path(out) / "plan.json").read_text())["cluster"]["devices"]
    rc, rank0, every = start_ranks(out, world, *args, env=env, timeout=timeout)
    return subprocess.CompletedProcess([str(Path(out) / "train.py"), *map(str, args)], rc, rank0, every)


STEP_LINE = (r"^step (\d+) loss ([-0-9.e+]+) time [0-9.]+ s [0-9.]+ samples/s lr ([-0-9.e+]+)"
             r"(?: grad_norm ([-0-9.e+a-z]+))?(?: loss_scale ([0-9.e+]+))?$")


def step_lines(stdout: str) -> dict[int, dict]:
    """Rank 0's ``step N loss X time T s R samples/s lr L [grad_norm G] [loss_scale S]`` lines by step
    (docs/training.md), and ``skipped``: the steps whose ``step N skipped: overflow, loss scale S`` line
    was printed, with S."""
    import re
    out = {}
    for m in re.finditer(STEP_LINE, stdout, re.M):
        out[int(m[1])] = {"loss": float(m[2]), "lr": float(m[3]),
                          "grad_norm": float(m[4]) if m[4] else None, "loss_scale": float(m[5]) if m[5] else None}
    for m in re.finditer(r"^step (\d+) skipped: overflow, loss scale ([0-9.e+]+)$", stdout, re.M):
        out.setdefault(int(m[1]), {})["skipped"] = float(m[2])
    return out


def rank_devices(stdout: str) -> dict[int, tuple[str, str]]:
    """Rank 0's start-up line ``devices: BACKEND DEVICE (ranks 0, 1), ...`` (every rank's own backend and
    device, gathered at start-up): ``{rank: (backend, device)}``."""
    import re
    m = re.search(r"^devices: (.*)$", stdout, re.M)
    assert m, f"no devices line: {stdout[-2000:]}"
    out = {}
    for backend, device, ranks in re.findall(r"(\w+) (\S+) \(ranks? ([0-9, ]+)\)", m[1]):
        for r in ranks.split(", "):
            assert int(r) not in out, f"rank {r} twice in {m[0]!r}"
            out[int(r)] = (backend, device)
    return out


def edit_plan(out, transfer_dtype: str | None = None, **train) -> dict:
    """The compiled output's plan.json with ``train`` settings replaced, through the contract
    (``planc.plan``: load, dataclasses.replace, dumps), as the front end will write them from plan text;
    clip or fp16 get the norm group the compiler gives them (every stage device, listed in ``groups``).
    ``transfer_dtype``: every floating transfer's dtype. Returns the new plan.json as a dict."""
    import dataclasses
    import json
    from planc import plan as P
    plan = P.load(Path(out) / "plan.json")
    t = dataclasses.replace(plan.train, **train)
    groups = plan.groups
    if (t.clip is not None or str(t.precision) == "fp16") and not t.norm_group:
        members = tuple(sorted(d for st in plan.stages for d in st.devices))
        t = dataclasses.replace(t, norm_group=members)
        if len(members) > 1 and members not in groups:
            groups = groups + (members,)
    transfers = plan.transfers
    if transfer_dtype is not None:
        transfers = tuple(dataclasses.replace(x, dtype=transfer_dtype) if x.dtype in ("f32", "bf16", "f16") else x
                          for x in transfers)
    plan = dataclasses.replace(plan, train=t, groups=groups, transfers=transfers).check()
    (Path(out) / "plan.json").write_text(P.dumps(plan))
    return json.loads((Path(out) / "plan.json").read_text())


def update_error(dump, plan: dict, ref_state: dict, init_state: dict) -> float:
    """|| dumped - reference || / || reference - initial || over every parameter every stage rank dumped
    (``--dump-params``: the fp32 masters of bf16/fp16 plans; tensor-parallel shards against their slice):
    how far the run's update is from the reference's."""
    import json
    import torch
    num = den = 0.0
    for rank in stage_ranks(plan):
        mine = torch.load(Path(dump) / f"rank{rank}.pt")
        info_path = Path(dump) / f"rank{rank}.shards.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        for k, v in mine.items():
            ref, init = ref_state[k], init_state[k]
            if k in info:
                dim, index, parts, blocks = info[k]
                ref, init = shard_of(ref, dim, index, parts, blocks), shard_of(init, dim, index, parts, blocks)
            assert v.dtype == torch.float32, f"{k}: dumped {v.dtype}, not the fp32 master"
            num += float((v - ref).pow(2).sum())
            den += float((ref - init).pow(2).sum())
    return (num / den) ** 0.5
