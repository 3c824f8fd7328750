"""End-to-end: Hugging Face GPT-2 (examples/hf_gpt2.py) trained by planc on unequal meshes.

plans/hf-gpt2.plan (stage 0 on one device, stage 1 on two devices data-parallel) is compiled as
``planc compile plans/hf-gpt2.plan -o OUT`` does and launched with ``bash OUT/launch.sh`` (the
`deepspeed` launcher, CPU/gloo, 3 ranks), 3 SGD steps. The reference knows nothing of planc or of
the example's layers: it builds ``GPT2LMHeadModel`` from its own ``GPT2Config`` (the plan's model
arguments, dropout 0, tied embeddings, as docs/models.md says the example does), seeded with the
plan's seed, and per step calls the HF model's own forward with ``labels`` (its causal-LM loss) on the
step's rows — the same rows the data function gives the pipeline, all micro-batches of the step at
once, so its loss is the global mean — then one SGD step. Losses and every parameter must agree to
float tolerance: the tied weight too, on both stages that hold it (``wte`` on stage 0, ``lm_head`` on
stage 1, whose gradient planc sums across the stages; HF's model has the one parameter).
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from e2e_util import ROOT, _load_callable, compare_dumps, launch_env, stage_ranks

transformers = pytest.importorskip("transformers", reason="transformers (the 'hf' extra) is not installed")

PLAN = ROOT / "plans" / "hf-gpt2.plan"
STEPS = 3


def planc_name(name: str, blocks: int) -> str:
    """A GPT2LMHeadModel parameter's name in planc's dumps: the layer layout of examples/hf_gpt2.py
    (docs/models.md): layer 0 wte/wpe, layer 1+i transformer.h[i] as ``block``, the last ln_f and lm_head."""
    last = blocks + 1
    if m := re.fullmatch(r"transformer\.(wte|wpe)\.(.+)", name):
        return f"layers.0.{m[1]}.{m[2]}"
    if m := re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", name):
        return f"layers.{int(m[1]) + 1}.block.{m[2]}"
    if m := re.fullmatch(r"transformer\.ln_f\.(.+)", name):
        return f"layers.{last}.ln_f.{m[1]}"
    assert name == "lm_head.weight", name
    return f"layers.{last}.lm_head.weight"


def hf_config(args: dict):
    """GPT2Config of the plan's model arguments: no dropout (deterministic), tied embeddings."""
    from transformers import GPT2Config
    return GPT2Config(n_layer=args["layers"], n_embd=args["hidden"], n_head=args["heads"], n_positions=args["seq"],
                      vocab_size=args["vocab"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      tie_word_embeddings=True, bos_token_id=args["vocab"] - 1, eos_token_id=args["vocab"] - 1)


def hf_reference(plan: dict, steps: int):
    """(loss per step, parameters named as planc's layers) of GPT2LMHeadModel trained in this process."""
    import torch
    from transformers import GPT2LMHeadModel

    train = plan["train"]
    args = dict(train["model"]["args"])
    torch.manual_seed(train["seed"])
    model = GPT2LMHeadModel(hf_config(args))
    assert model.lm_head.weight is model.transformer.wte.weight   # tied: one parameter
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=train["optimizer"]["lr"])
    data = _load_callable(ROOT / "examples", train["data"])(train["micro_batch"], train["seed"], **args)
    losses = []
    for _ in range(steps):
        rows = [next(data) for _ in range(train["micro_batches"])]
        ids = torch.cat([x for x, _ in rows])
        labels = torch.cat([y for _, y in rows])
        loss = model(input_ids=ids, labels=labels).loss   # HF's own shifted cross-entropy, mean over tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))

    # named_parameters names the tied weight once (transformer.wte.weight); planc's head holds it as lm_head
    named = dict(model.named_parameters(remove_duplicate=False))
    return losses, {planc_name(k, args["layers"]): v.detach().clone() for k, v in named.items()}


@pytest.mark.slow
def test_hf_gpt2_trains_on_unequal_meshes_like_the_hf_model(tmp_path):
    from planc.commands.cli import main
    out = tmp_path / "out"
    assert main(["compile", str(PLAN), "-o", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    stages = sorted(plan["stages"], key=lambda st: st["index"])
    assert [len(st["devices"]) for st in stages] == [1, 2] and stages[1]["mesh_axes"] == ["data"]
    (tied,) = [r for r in plan["reductions"] if "tied" in r]   # the embedding tied to the head, across stages
    assert tied["groups"] == [[0, 1, 2]] and tied["tied"]["parameter"] == "layers.0.wte.weight"
    assert [(h["stage"], h["layer"], h["name"]) for h in tied["tied"]["holders"]] == [
        (0, 0, "wte.weight"), (1, 3, "lm_head.weight")]
    assert plan["train"]["trainable"] and plan["train"]["optimizer"]["name"] == "sgd"
    (t,) = plan["transfers"]
    args = plan["train"]["model"]["args"]
    assert t["shape"] == [plan["train"]["micro_batch"], args["seq"], args["hidden"]] and t["dtype"] == "f32"

    # the launch runs while this process trains the reference (2 cores: start-up dominates both)
    proc = subprocess.Popen(["bash", str(out / "launch.sh"), "--steps", str(STEPS), "--dump-params",
                             str(tmp_path / "dump")], env=launch_env(), cwd=out, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ref_losses, ref_state = hf_reference(plan, STEPS)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout[-4000:] + stderr[-4000:]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([-0-9.e+]+)", stdout)]
    assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-6), stdout[-2000:]
    assert ref_losses[-1] < ref_losses[0]   # it learns: the comparison is not between two idle models
    sharded = compare_dumps(tmp_path / "dump", stage_ranks(plan), ref_state, rtol=1e-5, atol=1e-6)
    assert sharded == {}


def test_layers_in_a_chain_are_the_hf_model():
    """The example's layers, run one after the other, give GPT2LMHeadModel's logits, loss and gradients
    (same seed, same config), and hold exactly its parameters."""
    import torch
    hf = _load_callable(ROOT / "examples", {"file": "hf_gpt2.py", "function": "build"})
    loss_fn = _load_callable(ROOT / "examples", {"file": "hf_gpt2.py", "function": "loss"})
    batches = _load_callable(ROOT / "examples", {"file": "hf_gpt2.py", "function": "batches"})
    args = {"layers": 2, "hidden": 16, "heads": 2, "seq": 8, "vocab": 32}
    torch.manual_seed(11)
    layers = hf(**args)
    assert len(layers) == args["layers"] + 2
    ids, labels = next(batches(3, 0, **args))
    assert torch.equal(ids, labels) and ids.shape == (3, args["seq"])
    h = ids
    for layer in layers:
        h = layer(h)
    loss = loss_fn(h, labels)
    loss.backward()

    from transformers import GPT2LMHeadModel
    torch.manual_seed(11)
    ref = GPT2LMHeadModel(hf_config(args))
    out = ref(input_ids=ids, labels=labels)
    out.loss.backward()
    torch.testing.assert_close(h, out.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=1e-7)
    mine = {f"layers.{i}.{k}": p for i, layer in enumerate(layers) for k, p in layer.named_parameters()}
    assert len({id(p) for p in mine.values()}) == len(list(ref.parameters()))
    assert mine["layers.0.wte.weight"] is mine[f"layers.{args['layers'] + 1}.lm_head.weight"]   # tied
    for k, p in ref.named_parameters(remove_duplicate=False):
        q = mine[planc_name(k, args["layers"])]
        assert torch.equal(q.detach(), p.detach()), k
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=k)
