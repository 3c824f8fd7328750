"""`planc checkpoint info | export` on checkpoints written here from the format-2 specification alone.

The writer below knows nothing of planc: it saves global tensors with torch.distributed.checkpoint as two
simulated ranks would (each writing only the rectangles it owns, tensor-parallel halves and ZeRO-1 flat
ranges cut into rectangles, replicated pieces written by both and kept once by DCP's dedup), then writes
planc.json (sizes and sha256 of every file) last, as the specification says. Exports are compared with
the tensors the test saved, and a Hugging Face export with the logits of the model it came from.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from planc.commands.cli import main

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- a checkpoint writer from the spec

def flat_range_rects(shape, start, stop):
    """The rectangles (offsets, sizes) of the flat range [start, stop) of a row-major 2-D tensor:
    a partial first row, whole rows, a partial last row (at most 3)."""
    rows, cols = shape
    out, i = [], start
    while i < stop:
        r, c = divmod(i, cols)
        if c or stop - i < cols:                       # a piece of one row
            n = min(cols - c, stop - i)
            out.append(((r, c), (1, n)))
            i += n
        else:                                          # whole rows
            k = (stop - i) // cols
            out.append(((r, 0), (k, cols)))
            i += k * cols
    return out


class _RankPlanner(DefaultSavePlanner):
    """One simulated rank: writes the rectangles ``chunks[key]`` of the global tensors it is given."""

    def __init__(self, chunks):
        super().__init__()
        self.chunks = chunks

    def create_local_plan(self):
        items = []
        for key, rects in self.chunks.items():
            t = self.state_dict[key]
            for off, size in rects:
                chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size))
                items.append(WriteItem(index=MetadataIndex(key, torch.Size(off)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(chunk=chunk, size=t.size(),
                                                                   properties=TensorProperties.create_from_tensor(t))))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, item):
        t = self.state_dict[item.index.fqn]
        for d, (o, n) in enumerate(zip(item.tensor_data.chunk.offsets, item.tensor_data.chunk.sizes)):
            t = t.narrow(d, o, n)
        return t.contiguous()


def save_ranks(folder: Path, tensors: dict, owned: list[dict]) -> None:
    """DCP's save sequence (local plans, one global plan, every rank's writes, the coordinator's finish) for
    len(owned) ranks in this process; rank r writes the rectangles ``owned[r][key]``."""
    planners = [_RankPlanner(o) for o in owned]
    writers = [FileSystemWriter(str(folder)) for _ in owned]
    plans = []
    for r, (pl, w) in enumerate(zip(planners, writers)):
        pl.set_up_planner(state_dict={k: tensors[k] for k in owned[r]}, storage_meta=w.storage_meta(),
                          is_coordinator=r == 0)
        w.set_up_storage_writer(r == 0, rank=r)
        plans.append(w.prepare_local_plan(pl.create_local_plan()))
    plans, metadata = planners[0].create_global_plan(plans)
    plans = writers[0].prepare_global_plan(plans)
    results = []
    for pl, w, plan in zip(planners, writers, plans):
        fut = w.write_data(pl.finish_plan(plan), pl)
        fut.wait()
        results.append(fut.value())
    writers[0].finish(metadata=metadata, results=results)


def two_rank_layout(tensors: dict) -> list[dict]:
    """Who owns what: 2-D tensors with an even first dimension in tensor-parallel row halves, every other
    2-D tensor as ZeRO-1 flat ranges (rank 0 the middle third, rank 1 both ends: 1-3 rectangles per
    range), the rest replicated (both ranks write the whole tensor; DCP keeps one)."""
    owned = [{}, {}]
    for k, t in tensors.items():
        if t.dim() == 2 and t.shape[0] % 2 == 0 and t.shape[0] > 2:
            h = t.shape[0] // 2
            owned[0][k] = [((0, 0), (h, t.shape[1]))]
            owned[1][k] = [((h, 0), (h, t.shape[1]))]
        elif t.dim() == 2:
            a, b, shape = t.numel() // 3, 2 * t.numel() // 3, tuple(t.shape)
            owned[0][k] = flat_range_rects(shape, a, b)
            owned[1][k] = flat_range_rects(shape, 0, a) + flat_range_rects(shape, b, t.numel())
        else:
            owned[0][k] = owned[1][k] = [((0,) * t.dim(), tuple(t.shape))]
    return owned


def write_checkpoint(run: Path, step: int, params: dict, *, optim: dict | None = None, precision="fp32",
                     hf_config=None, tied=None, extra=None) -> Path:
    """``run/step<N>/`` as format 2 says: DCP written under ``.step<N>.partial``, planc.json written last
    with every file's size and sha256, the folder renamed, ``latest`` updated. ``params``: global name ->
    fp32 tensor (model order); ``optim``: DCP key ``optim.<name>.<state>`` -> tensor."""
    partial = run / f".step{step}.partial"
    partial.mkdir(parents=True)
    tensors = {f"model.{k}": v for k, v in params.items()} | (optim or {})
    save_ranks(partial, tensors, two_rank_layout(tensors))
    files = {f.name: {"size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
             for f in sorted(partial.iterdir())}
    meta = {
        "format": 2, "plan": "gptish", "digest": "3f" * 32, "step": step, "world_size": 4,
        "global_batch": 16, "micro_batch": 4, "micro_batches": 4, "precision": precision, "zero": 1,
        "optimizer": {"name": "adamw", "lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        "lr_schedule": {"name": "constant"},
        "model": ({"file": "model.py", "function": "build", "args": {"layers": 2}} if hf_config is None
                  else {"hf": hf_config.get("architectures")}),
        "hf_config": hf_config,
        "parameters": [{"name": k, "shape": list(v.shape), "dtype": {"fp32": "f32", "bf16": "bf16"}[precision]}
                       | ({"tied": tied[k]} if tied and k in tied else {}) for k, v in params.items()],
        "regime": {"loss_scale": None, "good_steps": step, "skipped_steps": 0}, "data": {"drawn": step * 4},
        "rng": {"0": "AAAA"},
        "sharding": {"stages": [
            {"index": 0, "layers": [0, 2], "mesh": [[0, 1]], "tensor": 2, "data": 1, "devices": [0, 1]},
            {"index": 1, "layers": [2, 3], "mesh": [[2], [3]], "tensor": 1, "data": 2, "devices": [2, 3]},
            {"index": 2, "layers": [3, 4], "mesh": [[4, 5, 6, 8]], "tensor": 4, "data": 1,
             "devices": [4, 5, 6, 8]}]},
        "files": files, "bytes": sum(f["size"] for f in files.values()),
        "a_key_from_a_later_planc": {"tolerated": True},
    } | (extra or {})
    (partial / "planc.json").write_text(json.dumps(meta, sort_keys=True, indent=1))
    folder = run / f"step{step}"
    os.replace(partial, folder)
    (run / "latest").write_text(f"step{step}")
    return folder


def gptish(seed=0) -> dict:
    """A GPT-ish set of global tensors under builder names (layers.<i>.<name>), model order."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"layers.0.wte.weight": (16, 8), "layers.1.ln.weight": (8,), "layers.1.attn.qkv.weight": (24, 8),
              "layers.1.attn.qkv.bias": (24,), "layers.1.mlp.fc.weight": (5, 8), "layers.1.mlp.proj.weight": (3, 4),
              "layers.2.head.weight": (16, 8)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def adam_state(params: dict, seed=1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"optim.{k}.{s}": torch.randn(v.shape, generator=g).abs()
            for k, v in params.items() for s in ("exp_avg", "exp_avg_sq")}


def chunks_written(t: torch.Tensor) -> int:
    """How many distinct rectangles two_rank_layout gives ``t`` (replicas counted once)."""
    return len({r for o in two_rank_layout({"k": t}) for r in o.get("k", [])})


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------- info

def test_flat_range_rects_tile_the_range():
    for start, stop in ((0, 16), (2, 13), (0, 5), (5, 7), (4, 12), (13, 16)):
        hit = torch.zeros(4, 4, dtype=torch.int64)
        rects = flat_range_rects((4, 4), start, stop)
        assert len(rects) <= 3
        for (r, c), (h, w) in rects:
            hit[r:r + h, c:c + w] += 1
        want = torch.zeros(16, dtype=torch.int64)
        want[start:stop] = 1
        assert torch.equal(hit.flatten(), want), (start, stop, rects)


def test_info_shows_the_run_its_size_and_sharding(tmp_path, capsys):
    params = gptish()
    step = write_checkpoint(tmp_path / "run", 7, params, optim=adam_state(params))
    rc, out, err = run_cli(capsys, "checkpoint", "info", str(step))
    assert rc == 0, err
    # 80 columns, but for the folder's path: printed whole, on its own line, so it can be copied
    assert "\x1b[" not in out and all(len(line) <= 80 for line in out.splitlines() if str(step) not in line)
    flat = " ".join(out.split())
    elements = sum(v.numel() for v in params.values())
    on_disk = sum(f.stat().st_size for f in step.iterdir() if f.name != "planc.json")
    assert f"checkpoint {step}" in flat
    assert "step 7 " in flat
    assert f"plan gptish digest {'3f' * 32}" in flat
    assert "precision fp32 (stored: f32 masters)" in flat
    assert "zero 1 " in flat and "world size 4 " in flat
    assert "global batch 16 (micro-batch 4 x 4)" in flat
    assert 'optimizer adamw(betas=[0.9, 0.999], eps=1e-08, lr=0.001, weight_decay=0.01)' in flat
    assert "optim state exp_avg, exp_avg_sq" in flat
    assert f"parameters {len(params)} tensors, {elements:,} elements" in flat
    assert f"on disk {on_disk:,} bytes" in flat
    assert "model model.py:build" in flat and "data 28 batches drawn" in flat
    rows = [line.split() for line in out.splitlines()]
    assert ["0", "0-1", "[[0,1]]", "2", "1", "0-1"] in rows     # layers [a, b) shown a-(b-1)
    assert ["1", "2", "[[2],[3]]", "1", "2", "2-3"] in rows
    assert ["2", "3", "[[4,5,6,8]]", "4", "1", "4-6,8"] in rows
    assert "layers.1.attn.qkv.weight" not in out          # the per-parameter table only with --parameters


def test_info_of_the_run_folder_follows_latest_and_lists_parameters(tmp_path, capsys):
    params = gptish()
    write_checkpoint(tmp_path / "run", 3, params)
    write_checkpoint(tmp_path / "run", 6, params, optim=adam_state(params))
    rc, out, err = run_cli(capsys, "checkpoint", "info", str(tmp_path / "run"), "--parameters")
    assert rc == 0, err
    assert "step 6" in " ".join(out.split()) and "optim state exp_avg, exp_avg_sq" in " ".join(out.split())
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("layers.")}
    assert list(rows) == list(params)                      # model order
    for name, t in params.items():
        shape = "x".join(map(str, t.shape))
        assert rows[name] == [shape, "f32", str(chunks_written(t))], name   # the same state for all: in the summary
    assert {chunks_written(t) for t in params.values()} == {1, 2, 3, 7}   # every kind of layout is covered


# ---------------------------------------------------------------- export --torch

def test_export_torch_equals_the_saved_tensors(tmp_path, capsys):
    params = gptish()
    optim = adam_state(params)
    step = write_checkpoint(tmp_path / "run", 2, params, optim=optim)
    out = tmp_path / "w.pt"
    rc, text, err = run_cli(capsys, "checkpoint", "export", str(step), "--torch", str(out))
    assert rc == 0, err and f"wrote {out}" in text
    sd = torch.load(out, weights_only=True)
    assert list(sd) == list(params)
    for k, v in params.items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v), k
    rc, _, err = run_cli(capsys, "checkpoint", "export", str(tmp_path / "run"), "--torch", str(tmp_path / "o.pt"),
                         "--optimizer")
    assert rc == 0, err
    sd = torch.load(tmp_path / "o.pt", weights_only=True)
    assert list(sd) == list(params) + [f"optim.{k}.{s}" for k in params for s in ("exp_avg", "exp_avg_sq")]
    for k, v in (params | optim).items():
        assert torch.equal(sd[k], v), k
    again = tmp_path / "again.pt"                          # deterministic bytes, whatever the file's name
    assert main(["checkpoint", "export", str(tmp_path / "run"), "--torch", str(again), "--optimizer"]) == 0
    assert again.read_bytes() == (tmp_path / "o.pt").read_bytes()
    assert not list(tmp_path.glob("*.partial"))


def test_exported_files_are_readable_by_all_whatever_the_umask(tmp_path, capsys, monkeypatch):
    """--torch and --hf write 0644 files (and a new folder 0755) under a private umask: they are shared."""
    import os
    import stat
    step = write_checkpoint(tmp_path / "run", 1, gptish())
    old = os.umask(0o077)
    try:
        assert main(["checkpoint", "export", str(step), "--torch", str(tmp_path / "w.pt")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "w.pt").stat().st_mode) == 0o644
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params, tied = _hf_params(_llama(True))
    step = write_checkpoint(tmp_path / "hfrun", 1, params, tied=tied, hf_config=_llama(True).config.to_dict())
    old = os.umask(0o077)
    try:
        assert main(["checkpoint", "export", str(step), "--hf", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in [tmp_path / "hf", *(tmp_path / "hf").iterdir()]}
    assert modes == {"hf": 0o755, "config.json": 0o644, "model.safetensors": 0o644}


def test_export_torch_of_a_bf16_run_gives_the_fp32_masters(tmp_path, capsys):
    params = {k: v + 1e-3 for k, v in gptish(5).items()}   # values bf16 cannot hold: the masters are the truth
    step = write_checkpoint(tmp_path / "run", 1, params, precision="bf16")
    rc, out, err = run_cli(capsys, "checkpoint", "info", str(step), "--parameters")
    assert rc == 0 and "precision bf16 (stored: f32 masters)" in " ".join(out.split())
    assert main(["checkpoint", "export", str(step), "--torch", str(tmp_path / "w.pt")]) == 0
    sd = torch.load(tmp_path / "w.pt", weights_only=True)
    assert all(torch.equal(sd[k], v) for k, v in params.items())


# ---------------------------------------------------------------- export --hf

def _llama(tie: bool, arch: str = "llama"):
    transformers = pytest.importorskip("transformers")
    if arch == "gpt2":                                     # the project's HF example (examples/hf_gpt2.py)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=32, vocab_size=64,
                                      bos_token_id=63, eos_token_id=63, tie_word_embeddings=tie)
    else:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                       tie_word_embeddings=tie)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():                                  # away from the initialisation (zeros/ones norms)
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _hf_params(model) -> tuple[dict, dict]:
    """The model's parameters under the spec's global names (HF's), a tied tensor once under its first
    name; and the other names of each tied tensor."""
    first, params, tied = {}, {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.setdefault(first[id(p)], []).append(name)
        else:
            first[id(p)] = name
            params[name] = p.detach().clone()
    return params, tied


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("gpt2", False)])
def test_export_hf_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, capsys, monkeypatch, arch, tie):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _llama(tie, arch)
    params, tied = _hf_params(model)
    assert ("lm_head.weight" in params) != tie
    step = write_checkpoint(tmp_path / "run", 4, params, hf_config=model.config.to_dict(), tied=tied)
    out = tmp_path / "hf"
    rc, text, err = run_cli(capsys, "checkpoint", "export", str(step), "--hf", str(out))
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    stored = load_file(out / "model.safetensors")
    assert ("lm_head.weight" in stored) != tie             # a tied head stored once, as transformers does
    assert set(stored) == set(params) and all(t.dtype == torch.float32 for t in stored.values())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(loaded) is type(model)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in params.items())
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-6)
    rc, _, err = run_cli(capsys, "checkpoint", "export", str(step), "--hf", str(tmp_path / "b"), "--dtype", "bf16")
    assert rc == 0, err
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"
    stored = load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(stored[k], v.to(torch.bfloat16)) for k, v in params.items())


def test_export_hf_defaults_to_the_runs_precision(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params, tied = _hf_params(_llama(True))
    step = write_checkpoint(tmp_path / "run", 1, params, precision="bf16", tied=tied,
                            hf_config=_llama(True).config.to_dict())
    assert main(["checkpoint", "export", str(step), "--hf", str(tmp_path / "hf")]) == 0
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert main(["checkpoint", "export", str(step), "--hf", str(tmp_path / "hf")]) == 0   # again, over itself
    assert main(["checkpoint", "export", str(step), "--hf", str(tmp_path / "again")]) == 0
    for name in ("config.json", "model.safetensors"):                                   # the same bytes
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


# ---------------------------------------------------------------- bad inputs: one line, exit 2

def _one_line_error(capsys, argv, *needles):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2, (rc, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("planc checkpoint "), err
    for n in needles:
        assert n in err, (n, err)
    return err


def test_bad_folders_are_one_line_errors(tmp_path, capsys):
    params = gptish()
    good = write_checkpoint(tmp_path / "run", 5, params)
    _one_line_error(capsys, ["checkpoint", "info", str(tmp_path / "nowhere")], str(tmp_path / "nowhere"),
                    "no such checkpoint folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(capsys, ["checkpoint", "info", str(empty)], str(empty), "no planc.json")

    def broken(name):
        folder = tmp_path / name
        subprocess.run(["cp", "-r", str(good), str(folder)], check=True)
        return folder

    f = broken("no_planc_json")
    (f / "planc.json").unlink()
    _one_line_error(capsys, ["checkpoint", "info", str(f)], str(f), "no planc.json")
    f = broken("flipped")
    dcp_file = sorted(f.glob("*.distcp"))[-1]
    data = bytearray(dcp_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    dcp_file.write_bytes(bytes(data))
    _one_line_error(capsys, ["checkpoint", "export", str(f), "--torch", str(tmp_path / "x.pt")], str(f),
                    dcp_file.name, "sha256")
    assert not (tmp_path / "x.pt").exists()
    f = broken("cut")
    dcp_file = sorted(f.glob("*.distcp"))[0]
    dcp_file.write_bytes(dcp_file.read_bytes()[:-10])
    _one_line_error(capsys, ["checkpoint", "info", str(f)], f"{dcp_file.name} has", "cut or changed")
    f = broken("missing_file")
    (f / "__1_0.distcp").unlink()
    _one_line_error(capsys, ["checkpoint", "info", str(f)], "__1_0.distcp is missing")
    f = broken("not_json")
    (f / "planc.json").write_text("{\"format\": 2,")
    _one_line_error(capsys, ["checkpoint", "info", str(f)], "planc.json is not JSON")
    f = broken("no_files_key")
    meta = json.loads((f / "planc.json").read_text())
    del meta["files"]
    (f / "planc.json").write_text(json.dumps(meta))
    _one_line_error(capsys, ["checkpoint", "info", str(f)], "key 'files' is missing")
    f = broken("old_format")
    (f / "planc.json").write_text(json.dumps({**json.loads((good / "planc.json").read_text()), "format": 1}))
    _one_line_error(capsys, ["checkpoint", "info", str(f)], "format 1", "reads format 2")
    f = broken("bad_shape")
    meta = json.loads((f / "planc.json").read_text())
    meta["parameters"][2]["shape"] = [24, 9]
    (f / "planc.json").write_text(json.dumps(meta))
    _one_line_error(capsys, ["checkpoint", "info", str(f)], "model.layers.1.attn.qkv.weight", "[24, 8]", "[24, 9]")


def test_any_planc_json_value_of_the_wrong_kind_is_a_one_line_error_or_shown(tmp_path, capsys):
    """Every key path of planc.json (files' records too) given a value of another kind, or removed: info and
    export end with exit 0 or one line and exit 2, never a traceback (exit 3)."""
    params = gptish()
    step = write_checkpoint(tmp_path / "run", 7, params, optim=adam_state(params))
    original = json.loads((step / "planc.json").read_text())

    def paths(o, at=()):
        if at:
            yield at
        items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ()
        for k, v in items:
            yield from paths(v, at + (k,))

    kinds = [None, -1, "x", [[0, 1]], {"stages": [1, None]}, "DELETE"]   # each JSON kind, and none
    values = kinds + [0, 1.5, True, [], [1], {}, {"a": 1}]
    rng = random.Random(0)
    cases = [(at, v) for at in sorted(paths(original), key=str)      # every kind at the top, one deeper down
             for v in (kinds if len(at) == 1 else [rng.choice(values)])]
    for at, value in cases:
        meta = copy.deepcopy(original)
        inner = meta
        for k in at[:-1]:
            inner = inner[k]
        if value == "DELETE" and isinstance(inner, dict):
            del inner[at[-1]]
        else:
            inner[at[-1]] = value
        (step / "planc.json").write_text(json.dumps(meta))
        rc, _, err = run_cli(capsys, "checkpoint", "info", str(step), "--parameters")
        assert rc == 0 or rc == 2 and len(err.strip().splitlines()) == 1, (at, value, rc, err)
        if rc == 0 and rng.random() < 0.25:
            rc, _, err = run_cli(capsys, "checkpoint", "export", str(step), "--torch", str(tmp_path / "o.pt"))
            assert rc == 0 or rc == 2 and len(err.strip().splitlines()) == 1, (at, value, rc, err)


def test_unreadable_dcp_metadata_and_dangling_latest(tmp_path, capsys):
    good = write_checkpoint(tmp_path / "run", 5, gptish())
    f = tmp_path / "garbled"
    subprocess.run(["cp", "-r", str(good), str(f)], check=True)
    (f / ".metadata").write_bytes(b"not a pickle")
    meta = json.loads((f / "planc.json").read_text())      # listed as it is: only DCP can find it wrong
    meta["files"][".metadata"] = {"size": 12, "sha256": hashlib.sha256(b"not a pickle").hexdigest()}
    (f / "planc.json").write_text(json.dumps(meta))
    _one_line_error(capsys, ["checkpoint", "info", str(f)], str(f), "cannot read the DCP metadata")
    (tmp_path / "run" / "latest").write_text("step9")
    _one_line_error(capsys, ["checkpoint", "info", str(tmp_path / "run")], "latest names 'step9'",
                    "not a complete checkpoint")
    partial = tmp_path / "only_partial"
    (partial / ".step3.partial").mkdir(parents=True)
    _one_line_error(capsys, ["checkpoint", "info", str(partial)], ".step3.partial", "did not finish")


def test_wrong_export_use_is_a_one_line_error(tmp_path, capsys):
    builder = write_checkpoint(tmp_path / "run", 1, gptish())
    _one_line_error(capsys, ["checkpoint", "export", str(builder), "--hf", str(tmp_path / "hf")],
                    "not a Hugging Face model's checkpoint", "--torch")
    assert not (tmp_path / "hf").exists()
    _one_line_error(capsys, ["checkpoint", "export", str(builder), "--hf", str(tmp_path / "hf"), "--optimizer"],
                    "--optimizer goes with --torch")
    _one_line_error(capsys, ["checkpoint", "export", str(builder), "--torch", str(tmp_path / "w.pt"), "--dtype",
                             "bf16"], "--dtype goes with --hf")
    _one_line_error(capsys, ["checkpoint", "export", str(builder), "--torch", str(tmp_path)], "is a folder")


def test_hf_export_of_parameters_the_config_does_not_describe_is_refused(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _llama(False)
    params, _ = _hf_params(model)
    del params["model.layers.1.mlp.down_proj.weight"]
    step = write_checkpoint(tmp_path / "run", 1, params, hf_config=model.config.to_dict())
    _one_line_error(capsys, ["checkpoint", "export", str(step), "--hf", str(tmp_path / "hf")],
                    "no model.layers.1.mlp.down_proj.weight")
    assert not (tmp_path / "hf").exists()


def test_hf_export_refuses_a_separate_head_in_a_tied_model_and_a_folder_with_other_files(tmp_path, capsys,
                                                                                        monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _llama(True)
    params, _ = _hf_params(model)
    step = write_checkpoint(tmp_path / "run", 1, params | {"lm_head.weight": torch.randn(64, 16)},
                            hf_config=model.config.to_dict())
    _one_line_error(capsys, ["checkpoint", "export", str(step), "--hf", str(tmp_path / "hf")],
                    "ties the word embeddings", "lm_head.weight as a parameter of its own")
    good = write_checkpoint(tmp_path / "run2", 1, params, hf_config=model.config.to_dict())
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model.safetensors.index.json").write_text("{}")
    _one_line_error(capsys, ["checkpoint", "export", str(good), "--hf", str(tmp_path / "old")],
                    "model.safetensors.index.json", "new or empty folder")


def test_planc_json_and_the_dcp_metadata_must_agree_on_the_parameters(tmp_path, capsys):
    params = gptish()
    some = {"layers.1.ln.weight": params["layers.1.ln.weight"]}         # optimizer state for one parameter only
    step = write_checkpoint(tmp_path / "run", 1, params, optim=adam_state(some))
    rc, out, _ = run_cli(capsys, "checkpoint", "info", str(step), "--parameters")
    assert rc == 0 and "(not for every parameter: --parameters)" in " ".join(out.split())
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("layers.")}
    assert rows["layers.1.ln.weight"][-2:] == ["exp_avg,", "exp_avg_sq"] and rows["layers.0.wte.weight"][-1] == "-"
    meta = json.loads((step / "planc.json").read_text())
    meta["parameters"] = meta["parameters"][1:]
    (step / "planc.json").write_text(json.dumps(meta))
    _one_line_error(capsys, ["checkpoint", "info", str(step)], "'model.layers.0.wte.weight'", "do not list")


def test_the_command_line_pipes_plain_text_and_exits_2_without_a_traceback(tmp_path):
    step = write_checkpoint(tmp_path / "run", 1, gptish())
    (step / "__0_0.distcp").write_bytes(b"")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "planc", "checkpoint", "info", str(step)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"planc checkpoint info: {step}: __0_0.distcp has 0 bytes, planc.json lists "
                                f"{json.loads((step / 'planc.json').read_text())['files']['__0_0.distcp']['size']} "
                                "(cut or changed)")
