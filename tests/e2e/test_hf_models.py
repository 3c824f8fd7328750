"""Hugging Face models as they are (``model hf "ARCH" { config keys }``), trained by planc and by
transformers alone.

Each end-to-end test writes a plan, compiles it as ``planc compile`` does, starts the output's ranks
(``e2e_util.Ranks``, CPU/gloo; the bundled plan's test through its own ``launch.sh``, the deepspeed launcher) and compares every step's loss (rtol 1e-4) and every
rank's parameters after training with a reference that knows nothing of planc: the config class of the
architecture with the plan's keys and every dropout probability 0 (LANGUAGE.md, "Hugging Face models"),
initialized by LANGUAGE.md's plan-independent rule (``hf_reference.spec_model``, written from the spec's
words, importing nothing of planc) with the attention implementation docs/models.md names, the same byte batches of examples/bytes.py (all micro-batches of a step at once:
the step's loss is their mean), HF's own loss (``labels=ids``) and torch's SGD or AdamW. Parameters are
matched by the layer layout docs/models.md documents (layer 0 ``embed_tokens``, layer 1 + i ``layer`` =
``model.layers[i]``, the last ``norm`` and ``lm_head``).

The unit tests run the layers in one process: their chain is ``model(ids).logits`` for every family the
language lists, and the meta-device compile of a Llama-3-8B-shaped plan allocates no weights.
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from e2e_util import ROOT, Ranks, _load_callable, compare_dumps, launch_env, run_direct, stage_ranks
from hf_reference import spec_model

transformers = pytest.importorskip("transformers", reason="transformers (the 'hf' extra) is not installed")

BYTES = ROOT / "examples" / "bytes.py"
STEPS = 3


def planc_name(name: str, layers: int) -> str:
    """A causal LM's parameter name as planc's dumps name it (docs/models.md's layer layout)."""
    last = layers + 1
    if m := re.fullmatch(r"model\.embed_tokens\.(.+)", name):
        return f"layers.0.embed_tokens.{m[1]}"
    if m := re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name):
        return f"layers.{int(m[1]) + 1}.layer.{m[2]}"
    if m := re.fullmatch(r"model\.norm\.(.+)", name):
        return f"layers.{last}.norm.{m[1]}"
    assert name == "lm_head.weight", name
    return f"layers.{last}.lm_head.weight"


def hf_config(arch: str, keys: dict):
    """The architecture's config with the plan's keys, every dropout probability 0 (LANGUAGE.md)."""
    config = getattr(transformers, arch).config_class(**keys)
    for k, v in config.to_dict().items():
        if ("dropout" in k or "pdrop" in k) and isinstance(v, (int, float)) and not isinstance(v, bool):
            setattr(config, k, 0.0)
    return config


def batches(micro_batch: int, seed: int, **args):
    sys.path.insert(0, str(BYTES.parent))   # bytes.py imports the bundled text beside it
    try:
        return _load_callable(BYTES.parent, {"file": BYTES.name, "function": "batches"})(micro_batch, seed, **args)
    finally:
        sys.path.remove(str(BYTES.parent))


def reference(arch: str, keys: dict, data_args: dict, train: dict, steps: int):
    """(loss per step, parameters named as planc's layers) of the model trained by transformers alone."""
    import torch
    model = spec_model(hf_config(arch, keys), train["seed"])
    opt = train["optimizer"]
    if opt["name"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=opt["lr"])
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], weight_decay=opt.get("weight_decay", 0.01))
    data = batches(train["micro_batch"], train["seed"], **data_args)
    losses = []
    for _ in range(steps):
        ids = torch.cat([next(data)[0] for _ in range(train["micro_batches"])])
        loss = model(input_ids=ids, labels=ids).loss   # HF's shifted cross-entropy, mean over predicted tokens
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    names = {planc_name(k, keys["num_hidden_layers"]): v.detach().clone() for k, v in model.named_parameters()}
    return losses, names


def write_plan(tmp_path: Path, arch: str, keys: dict, stages: str, devices: int, train: str,
               seq: int = 8) -> Path:
    config = ", ".join(f"{k} = {json.dumps(v) if isinstance(v, bool) else v}" for k, v in keys.items())
    plan = tmp_path / "p.plan"
    plan.write_text(textwrap.dedent(f"""\
        plan hf_e2e {{
          cluster {{
            level node x 1 : bandwidth 1 GB/s, latency 50 us
            level cpu x {devices} : bandwidth 10 GB/s, latency 2 us
            host = node
          }}
          model hf "{arch}" {{ {config} }}
          data "{BYTES}:batches" {{ seq = {seq} }}
        """) + textwrap.indent(textwrap.dedent(stages), "  ") + textwrap.dedent(f"""\
          reduce gradients over data
          train {{ {train} }}
        }}
        """))
    return plan


def train_and_compare(tmp_path: Path, plan_path: Path, arch: str, keys: dict, seq: int = 8, atol: float = 1e-6,
                      aliases: dict | None = None, save: Path | None = None, resume: tuple | None = None,
                      steps: int = STEPS, launcher: bool = False):
    """``launcher``: through the output's launch.sh (the deepspeed launcher); else each rank started
    directly (``e2e_util.Ranks``: what the ranks compute is the subject). ``aliases``: {planc name: reference name} of parameters a stage holds as a copy of another's
    (tied across stages: the reference names them once). ``save``: also checkpoint the run into it.
    ``resume``: (checkpoint folder, its step): the run resumes there and trains up to ``steps``, whose
    losses from that step on and final parameters are the uninterrupted reference's."""
    from planc.commands.cli import main
    out = tmp_path / "out"
    assert main(["compile", str(plan_path), "-o", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    train = plan["train"]
    assert train["trainable"] and train["loss"] == {"builtin": "causal_lm_loss"}
    assert train["model"]["hf"]["attn_implementation"] == "sdpa"
    extra = ["--save", str(save)] if save is not None else []
    extra += ["--resume", str(resume[0])] if resume is not None else []
    first = resume[1] if resume is not None else 0
    args = ["--steps", str(steps), "--dump-params", str(tmp_path / "dump"), *extra]
    if launcher:
        proc = subprocess.Popen(["bash", str(out / "launch.sh"), *args], env=launch_env(), cwd=out, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    else:
        ranks = Ranks(out, plan["cluster"]["devices"], *args)
    try:   # the launch runs while this process trains the reference
        ref_losses, ref_state = reference(arch, keys, {"seq": seq}, train, steps)
        for copy, original in (aliases or {}).items():
            ref_state[copy] = ref_state[original]
        if launcher:
            stdout, stderr = proc.communicate(timeout=400)
            rc = proc.returncode
        else:
            rc, stdout, stderr = ranks.wait(400)
    finally:
        if launcher and proc.poll() is None:
            proc.kill()
            proc.communicate()
        elif not launcher:
            ranks.kill()
    assert rc == 0, stdout[-4000:] + stderr[-4000:]
    if resume is not None:
        assert "resumed from" in stdout and f"at step {first}" in stdout, stdout[-2000:]
    losses = {int(a): float(b) for a, b in re.findall(r"step (\d+) loss ([-0-9.e+]+)", stdout)}
    assert sorted(losses) == list(range(first, steps)), stdout[-2000:]
    assert [losses[i] for i in sorted(losses)] == pytest.approx(ref_losses[first:], rel=1e-4, abs=1e-6), stdout[-2000:]
    assert ref_losses[-1] < ref_losses[0]   # it learns: not a comparison of two idle models
    return plan, compare_dumps(tmp_path / "dump", stage_ranks(plan), ref_state, rtol=1e-4, atol=atol)


SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256}


@pytest.mark.slow
def test_qwen2_with_biased_qkv_on_three_stages_sgd(tmp_path):
    keys = {**SMALL, "num_hidden_layers": 3, "tie_word_embeddings": False}
    plan_path = write_plan(tmp_path, "Qwen2ForCausalLM", keys, """\
        stage 0 : layers 0..2 on devices 0..1 as (data = 1)
        stage 1 : layers 2..4 on devices 1..2 as (data = 1)
        stage 2 : layers 4..5 on devices 2..3 as (data = 1)
        """, 3, "micro_batch = 4, micro_batches = 2, steps = 3, schedule = 1f1b, optimizer = sgd(lr = 0.5), seed = 11")
    plan, sharded = train_and_compare(tmp_path, plan_path, "Qwen2ForCausalLM", keys)
    assert sharded == {} and [len(s["devices"]) for s in plan["stages"]] == [1, 1, 1]
    assert "layers.1.layer.self_attn.q_proj.bias" in plan_names(tmp_path)


@pytest.mark.slow
def test_mistral_sliding_window_two_stages_data_parallel_unequal_mesh_adamw(tmp_path):
    keys = {**SMALL, "num_hidden_layers": 2, "sliding_window": 4}   # a window shorter than the sequence
    plan_path = write_plan(tmp_path, "MistralForCausalLM", keys, """\
        stage 0 : layers 0..2 on devices 0..1 as (data = 1)
        stage 1 : layers 2..4 on devices 1..3 as (data = 2)
        """, 3, "micro_batch = 4, micro_batches = 2, steps = 3, schedule = gpipe, optimizer = adamw(lr = 1e-2), seed = 5")
    # Adam divides by the gradient's own scale: where a gradient is float noise (summed over the data
    # axis in another order) its update is too, up to a few 1e-5 at lr 1e-2; a wrong update is ~lr
    plan, sharded = train_and_compare(tmp_path, plan_path, "MistralForCausalLM", keys, atol=1e-4)
    assert sharded == {} and [len(s["devices"]) for s in plan["stages"]] == [1, 2]


@pytest.mark.slow
def test_llama_untied_two_tensor_stages_vocabulary_parallel_sgd(tmp_path):
    """Two tensor stages, the second also data 2: the embedding table and lm_head split by vocabulary
    (the loss a parallel cross-entropy over the split logits), the decoder layers by the tp plan. The
    vocabulary of 257 does not divide by 2: padded to 258, the padding row (tensor rank 1's last) stays
    zero (compare_dumps pads the reference with zeros), and the checkpoint exports 257 rows."""
    import torch
    from planc.commands.cli import main
    keys = {**SMALL, "num_hidden_layers": 2, "tie_word_embeddings": False, "vocab_size": 257}
    plan_path = write_plan(tmp_path, "LlamaForCausalLM", keys, """\
        stage 0 : layers 0..3 on devices 0..2 as (tensor = 2)
        stage 1 : layers 3..4 on devices 2..6 as (data = 2, tensor = 2)
        """, 6, "micro_batch = 2, micro_batches = 3, steps = 3, schedule = 1f1b, optimizer = sgd(lr = 0.5), seed = 2",
                           seq=12)
    ckpt = tmp_path / "ckpt"
    plan, sharded = train_and_compare(tmp_path, plan_path, "LlamaForCausalLM", keys, seq=12, save=ckpt)
    assert plan["transfers"][0]["shape"] == [2, 12, 32]
    assert sharded["layers.0.embed_tokens.weight"] == sharded["layers.3.lm_head.weight"] == (0, 2, 1)
    assert plan["train"]["model"]["hf"]["vocab"] == {"size": 257, "embedding": 258, "lm_head": 258}
    assert main(["checkpoint", "export", str(ckpt), "--hf", str(tmp_path / "hf")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert exported.model.embed_tokens.weight.shape == exported.lm_head.weight.shape == torch.Size([257, 32])
    joined = _dumped_as_reference(tmp_path, "layers.3.lm_head.weight", sharded)
    torch.testing.assert_close(exported.lm_head.weight.detach(), joined, rtol=0, atol=0)
    # sequence parallelism on both (the default): the boundary moves each tensor rank's part of the sequence
    assert [s["sequence_parallel"] for s in plan["stages"]] == [True, True]
    regions = plan["transfers"][0]["regions"]
    assert sorted(tuple(r[1]) for r in regions["src"].values()) == [(0, 6), (6, 12)]
    assert sorted(tuple(r[1]) for r in regions["dst"].values()) == [(0, 6), (0, 6), (6, 12), (6, 12)]


@pytest.mark.slow
def test_llama_vocabulary_that_does_not_divide_adamw_resumes_under_another_padding(tmp_path):
    """A vocabulary of 257 on one tensor-2 stage (padded to 258), AdamW: the run matches the reference and
    its checkpoint holds 257 rows; resumed under tensor 4 (padded to 260, other padding rows) it trains on as
    the uninterrupted reference, its padding rows zero."""
    keys = {**SMALL, "num_hidden_layers": 1, "num_key_value_heads": 4, "vocab_size": 257}
    train = "micro_batch = 2, micro_batches = 2, steps = 3, schedule = 1f1b, optimizer = adamw(lr = 1e-2), seed = 3"
    plan_path = write_plan(tmp_path, "LlamaForCausalLM", keys, """\
        stage 0 : layers 0..3 on devices 0..2 as (data = 1, tensor = 2)
        """, 2, train.replace("schedule = 1f1b, ", ""))
    ckpt = tmp_path / "ckpt"
    plan, sharded = train_and_compare(tmp_path, plan_path, "LlamaForCausalLM", keys, atol=1e-4, save=ckpt)
    assert plan["train"]["model"]["hf"]["vocab"] == {"size": 257, "embedding": 258, "lm_head": 258}
    assert sharded["layers.0.embed_tokens.weight"] == (0, 2, 1)
    (tmp_path / "b").mkdir()
    plan_b = write_plan(tmp_path / "b", "LlamaForCausalLM", keys, """\
        stage 0 : layers 0..3 on devices 0..4 as (data = 1, tensor = 4)
        """, 4, train.replace("schedule = 1f1b, ", "").replace("steps = 3", "steps = 4"))
    plan2, sharded2 = train_and_compare(tmp_path / "b", plan_b, "LlamaForCausalLM", keys, atol=1e-4,
                                        resume=(ckpt, STEPS), steps=STEPS + 1)
    assert plan2["train"]["model"]["hf"]["vocab"] == {"size": 257, "embedding": 260, "lm_head": 260}
    assert sharded2["layers.2.lm_head.weight"] == (0, 4, 1)


@pytest.mark.slow
def test_llama_sequence_parallel_stages_with_a_boundary_written_replicated_adamw(tmp_path):
    """Vocabulary-parallel + sequence-parallel on two tensor stages (the second also data 2), AdamW + clip,
    with the boundary written replicated: stage 0 gathers its sequence before sending, stage 1 receives the
    whole sequence and keeps its part (LANGUAGE.md: a written replicated spec is honoured)."""
    keys = {**SMALL, "num_hidden_layers": 2, "tie_word_embeddings": False}
    plan_path = write_plan(tmp_path, "LlamaForCausalLM", keys, """\
        stage 0 : layers 0..3 on devices 0..2 as (tensor = 2)
        stage 1 : layers 3..4 on devices 2..6 as (data = 2, tensor = 2)
        transfer h from stage 0 as R R R to stage 1 as S(data) R R
        """, 6, "micro_batch = 2, micro_batches = 2, steps = 3, schedule = 1f1b, optimizer = adamw(lr = 1e-2), "
                "clip = 1e6, seed = 3", seq=8)
    plan, sharded = train_and_compare(tmp_path, plan_path, "LlamaForCausalLM", keys, seq=8, atol=1e-5)
    assert [s["sequence_parallel"] for s in plan["stages"]] == [True, True]
    regions = plan["transfers"][0]["regions"]
    assert {tuple(r[1]) for side in ("src", "dst") for r in regions[side].values()} == {(0, 8)}
    assert sharded["layers.0.embed_tokens.weight"] == (0, 2, 1)


@pytest.mark.slow
def test_llama_tied_across_stages_of_tensor_2_and_4_sgd(tmp_path):
    """The embedding tied across a tensor-2 and a tensor-4 stage, split by vocabulary on both: the table of
    258 rows padded to 260 (the holders' lcm 4), stage 0's ranks keep 130 rows, stage 1's 65 (its last
    rank 63 real and 2 padding, which stay zero); the tied gradient summed piece by piece (rows in the grid
    of 4) over the holders that hold each piece, by the planned, checked piecewise program."""
    keys = {**SMALL, "num_hidden_layers": 2, "num_key_value_heads": 4, "tie_word_embeddings": True,
            "vocab_size": 258}
    plan_path = write_plan(tmp_path, "LlamaForCausalLM", keys, """\
        stage 0 : layers 0..2 on devices 0..2 as (data = 1, tensor = 2)
        stage 1 : layers 2..4 on devices 2..6 as (data = 1, tensor = 4)
        """, 6, "micro_batch = 2, micro_batches = 2, steps = 3, schedule = 1f1b, optimizer = sgd(lr = 0.5), seed = 4")
    plan, sharded = train_and_compare(tmp_path, plan_path, "LlamaForCausalLM", keys, atol=1e-5,
                                      aliases={"layers.3.lm_head.weight": "layers.0.embed_tokens.weight"})
    assert sharded["layers.0.embed_tokens.weight"] == (0, 2, 1) and sharded["layers.3.lm_head.weight"] == (0, 4, 1)
    assert "layers.1.layer.self_attn.q_proj.weight" in sharded and "layers.2.layer.mlp.up_proj.weight" in sharded
    assert plan["train"]["model"]["hf"]["vocab"] == {"size": 258, "embedding": 260, "lm_head": 260}
    pieces = sorted((tuple(rows), tuple(g)) for r in plan["reductions"] if r.get("tied")
                    for rows, g in zip(r["tied"]["split"]["rows"], r["groups"]))
    # stage 0: devices 0, 1 (rows 0..130, 130..260); stage 1: devices 2..5 (65 rows each)
    assert pieces == [((0, 65), (0, 2)), ((65, 130), (0, 3)), ((130, 195), (1, 4)), ((195, 258), (1, 5))]


@pytest.mark.slow
def test_llama_tied_embeddings_within_one_data_parallel_stage(tmp_path):
    """``tie_word_embeddings = true`` with the embedding and lm_head in one stage: HF's one Parameter,
    its gradient from both uses, summed over the data axis once (the reference names it once too)."""
    keys = {**SMALL, "num_hidden_layers": 2, "tie_word_embeddings": True}
    plan_path = write_plan(tmp_path, "LlamaForCausalLM", keys, """\
        stage 0 : layers 0..4 on devices 0..2 as (data = 2)
        """, 2, "micro_batch = 4, micro_batches = 2, steps = 3, optimizer = sgd(lr = 0.5), seed = 5")
    # the tied weight's gradient adds two uses and two devices' halves: float noise of a few 1e-6.
    # --dump-params lists a tied parameter under each layer's name for it: both are the one weight.
    plan, sharded = train_and_compare(tmp_path, plan_path, "LlamaForCausalLM", keys, atol=1e-5,
                                      aliases={"layers.3.lm_head.weight": "layers.0.embed_tokens.weight"})
    import torch
    for f in (tmp_path / "dump").glob("rank*.pt"):   # both names hold the one weight, bitwise
        mine = torch.load(f)
        assert torch.equal(mine["layers.0.embed_tokens.weight"], mine["layers.3.lm_head.weight"]), f.name


@pytest.mark.slow
def test_the_bundled_llama_plan_tied_across_stages_with_a_tensor_parallel_stage(tmp_path):
    """plans/llama-unequal.plan: stage 1 splits over tensor = 2 (planc_runtime.hf_tp); the embeddings are
    tied across stage 0 (one device) and stage 1 (2 x 2): both copies end equal to the reference's one
    weight. The run's checkpoint exports to an HF folder that ``from_pretrained`` loads, giving the
    reference's logits."""
    import torch
    from planc.commands.cli import main
    keys = {**SMALL, "num_hidden_layers": 3, "max_position_embeddings": 64, "tie_word_embeddings": True}
    ckpt = tmp_path / "ckpt"
    plan, sharded = train_and_compare(tmp_path, ROOT / "plans" / "llama-unequal.plan", "LlamaForCausalLM", keys,
                                      seq=16, atol=1e-4,   # AdamW at lr 1e-2 (see the Mistral test)
                                      aliases={"layers.4.lm_head.weight": "layers.0.embed_tokens.weight"},
                                      save=ckpt, launcher=True)
    assert plan["tensor_groups"] and sharded   # the projections of layers 1..2 are held as shards
    assert plan["stages"][1]["sequence_parallel"] is True   # and their norms and residuals by the sequence
    tied = [r["tied"] for r in plan["reductions"] if r.get("tied")]
    assert all(sorted({h["stage"] for h in t["holders"]}) == [0, 1] for t in tied)
    # stage 0 (one device) holds the whole table, stage 1 splits it over tensor 2: one piece each half,
    # summed over device 0 and stage 1's two data replicas at that tensor coordinate
    assert sorted(t["split"]["rows"][0] for t in tied) == [[0, 128], [128, 256]]
    assert main(["checkpoint", "export", str(ckpt), "--hf", str(tmp_path / "hf")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight   # tied again by transformers
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(hf_config("LlamaForCausalLM", keys))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(_dumped_as_reference(tmp_path, planc_name(name, keys["num_hidden_layers"]), sharded))
    ids = torch.arange(32).reshape(2, 16)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = exported(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the checkpoint resumes under another plan: other cut, no tensor axis, the tie now between a data-2
    # stage and a one-device stage; its 4th step is the reference's 4th, and both copies of the tied
    # weight end as the reference's one weight after 4 steps
    (tmp_path / "b").mkdir()
    plan_b = write_plan(tmp_path / "b", "LlamaForCausalLM", keys, """\
        stage 0 : layers 0..3 on devices 0..2 as (data = 2)
        stage 1 : layers 3..5 on devices 2..3 as (data = 1)
        """, 3, "micro_batch = 4, micro_batches = 2, steps = 4, schedule = 1f1b, optimizer = adamw(lr = 1e-2), "
               "seed = 7", seq=16)
    plan2, _ = train_and_compare(tmp_path / "b", plan_b, "LlamaForCausalLM", keys, seq=16, atol=1e-4,
                                 aliases={"layers.4.lm_head.weight": "layers.0.embed_tokens.weight"},
                                 resume=(ckpt, STEPS), steps=STEPS + 1)
    tied2 = [r["tied"] for r in plan2["reductions"] if r.get("tied")]
    assert len(tied2) == 1 and [len(st["devices"]) for st in plan2["stages"]] == [2, 1]


def _dumped_as_reference(tmp_path: Path, name: str, sharded: dict):
    """The trained parameter ``name`` from the ranks' dumps (whole, or its tensor shards joined)."""
    import torch
    parts = {}
    for f in sorted((tmp_path / "dump").glob("rank*.pt")):
        mine = torch.load(f)
        if name not in mine:
            continue
        if name not in sharded:
            return mine[name]
        info = json.loads(f.with_suffix("").with_suffix(".shards.json").read_text())
        dim, index, parts_n, blocks = info[name][:4]
        assert blocks == 1
        parts[index] = (dim, mine[name])
    assert parts, name
    dim = next(iter(parts.values()))[0]
    whole = torch.cat([parts[i][1] for i in sorted(parts)], dim=dim)
    real = info[name][4] if len(info[name]) > 4 else whole.shape[dim]   # a padded shard: its real rows
    return whole.narrow(dim, 0, real)


def plan_names(tmp_path: Path) -> set[str]:
    import torch
    return {k for f in (tmp_path / "dump").glob("rank*.pt") for k in torch.load(f)}


# ---------------------------------------------------------------- one process


FAMILIES = {
    "LlamaForCausalLM": {},
    "Qwen2ForCausalLM": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "Qwen3ForCausalLM": {"head_dim": 8},
    "MistralForCausalLM": {"sliding_window": 4},
    "GemmaForCausalLM": {"head_dim": 8},
    "Phi3ForCausalLM": {"pad_token_id": 0},
    "Olmo2ForCausalLM": {},
}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_the_layers_in_a_chain_are_the_hf_model(arch):
    """The pipeline layers of planc_runtime.hf, run one after the other, give the model's logits and HF's
    loss and gradients, and hold exactly its parameters under the names planc_param_names gives."""
    import torch
    from planc.runtime import hf
    keys = {**SMALL, "num_hidden_layers": 2, **FAMILIES[arch]}
    torch.manual_seed(0)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 10))
    layers = hf.pipeline_layers(hf.build_model(hf.config_from_keys(arch, keys), seed=4))
    assert len(layers) == keys["num_hidden_layers"] + 2
    h = ids
    for layer in layers:
        h = layer(h)
    hf.causal_lm_loss(h, ids).backward()

    ref = spec_model(hf_config(arch, keys), 4)
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(h, out.logits, rtol=1e-5, atol=1e-6)
    held = {name: p for layer in layers for local, p in layer.named_parameters()
            for name in [layer.planc_param_names[local]]}
    every = dict(ref.named_parameters())   # a tied weight once, under its first name (planc's one name for it)
    assert set(held) == set(every)
    for k, p in every.items():
        assert torch.equal(held[k].detach(), p.detach()), k
        torch.testing.assert_close(held[k].grad, p.grad, rtol=1e-5, atol=1e-7, msg=k)


def test_tied_embeddings_stay_one_parameter():
    from planc.runtime import hf
    keys = {**SMALL, "num_hidden_layers": 1, "tie_word_embeddings": True}
    layers = hf.pipeline_layers(hf.build_model(hf.config_from_keys("LlamaForCausalLM", keys), seed=1))
    assert layers[0].embed_tokens.weight is layers[-1].lm_head.weight
    # one name for the one weight, HF's first (its state dict stores a tied weight once)
    assert layers[-1].planc_param_names["lm_head.weight"] == "model.embed_tokens.weight"
    assert layers[0].planc_param_names["embed_tokens.weight"] == "model.embed_tokens.weight"


def test_the_meta_compile_of_an_8b_llama_allocates_no_weights(tmp_path):
    """plans/llama3-8b-64.plan compiles with the probe (a subprocess of the compiler) while no process of
    the compile ever holds more than 2 GB: the 8.03 G fp32 parameters alone would be 32 GB. The parameter
    counts per layer are the config's, worked out here."""
    script = textwrap.dedent(f"""\
        import resource, sys
        from planc.commands.cli import main
        code = main(["compile", {str(ROOT / 'plans' / 'llama3-8b-64.plan')!r}, "-o", {str(tmp_path / 'out')!r},
                     "--no-cache"])
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        print("peak_kib", peak)
        sys.exit(code)
        """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**launch_env(), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    peak = int(re.search(r"peak_kib (\d+)", r.stdout)[1]) * 1024
    h, i, v, layers, kv = 4096, 14336, 128256, 32, 8 * 128
    decoder = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h
    params = [v * h] + [decoder] * layers + [h + v * h]
    assert sum(params) * 4 > 30e9
    assert peak < 2e9, f"the compile peaked at {peak / 1e9:.2f} GB"
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["train"]["layer_params"] == params
    assert len(plan["stages"]) == 4 and plan["stages"][-1]["layers"][1] == layers + 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 2e9   # nor did this test process


@pytest.mark.slow
def test_a_model_folder_fine_tunes_its_own_weights(tmp_path):
    """``model hf "./dir"``: a folder written by save_pretrained (weights of another seed than the plan's)
    is copied into the output, its weights loaded by every rank; the reference is
    ``from_pretrained(dir)`` with dropout 0, trained by transformers alone."""
    import torch
    keys = {**SMALL, "num_hidden_layers": 2, "tie_word_embeddings": False}
    torch.manual_seed(123)
    transformers.AutoModelForCausalLM.from_config(hf_config("Qwen2ForCausalLM", keys)).save_pretrained(tmp_path / "tiny")
    plan_path = write_plan(tmp_path, "Qwen2ForCausalLM", keys, """\
        stage 0 : layers 0..2 on devices 0..1 as (data = 1)
        stage 1 : layers 2..4 on devices 1..3 as (data = 2)
        """, 3, "micro_batch = 4, micro_batches = 2, steps = 3, optimizer = sgd(lr = 0.5), seed = 9")
    plan_path.write_text(re.sub(r'model hf "Qwen2ForCausalLM" \{[^}]*\}', 'model hf "./tiny"', plan_path.read_text()))
    from planc.commands.cli import main
    out = tmp_path / "out"
    assert main(["compile", str(plan_path), "-o", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    rec = plan["train"]["model"]["hf"]
    assert rec["folder"] == "tiny" and rec["weights"] and (out / "tiny" / "config.json").is_file()
    proc = run_direct(out, "--steps", str(STEPS), "--dump-params", str(tmp_path / "dump"), timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    config = transformers.AutoConfig.from_pretrained(tmp_path / "tiny", local_files_only=True)
    for k, v in config.to_dict().items():
        if ("dropout" in k or "pdrop" in k) and isinstance(v, (int, float)) and not isinstance(v, bool):
            setattr(config, k, 0.0)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", config=config, local_files_only=True,
                                                              attn_implementation="sdpa")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = batches(4, 9, seq=8)
    ref_losses = []
    for _ in range(STEPS):
        ids = torch.cat([next(data)[0] for _ in range(2)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    losses = [float(x) for x in re.findall(r"step \d+ loss ([-0-9.e+]+)", proc.stdout)]
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-6), proc.stdout[-2000:]
    ref_state = {planc_name(k, 2): v.detach() for k, v in model.named_parameters()}
    assert compare_dumps(tmp_path / "dump", stage_ranks(plan), ref_state, rtol=1e-4, atol=1e-6) == {}


def test_stages_auto_cuts_an_hf_model(tmp_path):
    """``stages = auto(2)`` on a Hugging Face model: the probe's per-layer FLOPs cut it, every layer in one
    stage, and planc explain lists the layers with their stage, parameters and FLOPs."""
    from planc.driver.compile import compile_file
    from planc.commands.explain import explain
    keys = {**SMALL, "num_hidden_layers": 4}
    plan_path = write_plan(tmp_path, "LlamaForCausalLM", keys, "stages = auto(2)\n", 4,
                           "micro_batch = 4, micro_batches = 4, steps = 1, optimizer = sgd(lr = 0.1), seed = 1")
    text = plan_path.read_text().replace("    host = node\n", "    host = node\n    flops = 1 TFLOP/s\n")
    plan_path.write_text(text.replace("  stages = auto(2)", "  parallel { pipe = 2, data = 2 }\n  stages = auto(2)"))
    plan = compile_file(plan_path).plan_json
    ranges = [s["layers"] for s in sorted(plan["stages"], key=lambda s: s["index"])]
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == keys["num_hidden_layers"] + 2
    layers = plan["train"]["layers"]
    assert [lay["name"] for lay in layers] == ["embed_tokens"] + [f"layers.{i}" for i in range(4)] + ["norm + lm_head"]
    decoder_flops = {tuple(lay["flops"]) for lay in layers[1:-1]}
    assert len(decoder_flops) == 1 and min(next(iter(decoder_flops))) > 0   # alike, forward and backward counted
    shown = explain(plan)
    for i, lay in enumerate(layers):
        assert re.search(rf"^\s+{i}\s+{re.escape(lay['name'])}\s+\d", shown, re.M), shown
