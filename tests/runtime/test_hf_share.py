"""A rank builds only its share of a Hugging Face model (LANGUAGE.md, "Hugging Face models"; DESIGN.md,
"Real sizes"), in one process: every range of layers built alone holds exactly the values the whole model
gets from the spec's plan-independent rule (``hf_reference.spec_model``, written from the spec), the
layers outside it stay on the meta device, a tensor-parallel share holds the shards of those values, and
a model folder is read as slices."""
from __future__ import annotations

import json

import pytest

from hf_reference import s, spec_model

transformers = pytest.importorskip("transformers", reason="transformers (the 'hf' extra) is not installed")
torch = pytest.importorskip("torch")

SMALL = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 32}


def _config(arch, **extra):
    from planc.runtime import hf
    return hf.config_from_keys(arch, {**SMALL, "num_hidden_layers": 3, **extra})


def _named(layers, held):
    return {layer.planc_param_names[k]: p for i in held for layer in [layers[i]] for k, p in layer.named_parameters()}


def test_the_seed_rule_is_the_spec_formula():
    from planc.runtime.hf_init import seed_of
    assert seed_of(7, "model.layers.3.mlp") == s(7, "model.layers.3.mlp")
    assert seed_of(7, "") == int.from_bytes(__import__("hashlib").sha256(b"7/").digest()[:8], "little") % 2 ** 63
    assert seed_of(7, "lm_head") != seed_of(8, "lm_head")


@pytest.mark.parametrize("arch,extra", [("LlamaForCausalLM", {"tie_word_embeddings": True}),
                                        ("LlamaForCausalLM", {}),
                                        ("Qwen2ForCausalLM", {}),
                                        ("Gemma2ForCausalLM", {"head_dim": 8}),
                                        ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2})])
def test_every_share_holds_the_spec_values_and_nothing_else(arch, extra):
    from planc.runtime import hf
    config = _config(arch, **extra)
    ref = dict(spec_model(config, 5, hf.attn_implementation(arch)).named_parameters())
    n = config.num_hidden_layers + 2
    for lo, hi in [(0, 1), (1, 2), (2, n - 1), (n - 1, n), (0, n)]:
        layers = hf.build_share(config, 5, range(lo, hi))
        held = _named(layers, range(lo, hi))
        assert held, (lo, hi)
        for name, p in held.items():
            assert not p.is_meta and torch.equal(p.detach(), ref[name].detach()), (arch, lo, hi, name)
        for i in set(range(n)) - set(range(lo, hi)):
            mine = {id(p) for j in range(lo, hi) for p in layers[j].parameters()}
            assert all(p.is_meta for p in layers[i].parameters() if id(p) not in mine), (arch, lo, hi, i)
    if extra.get("tie_word_embeddings"):   # the head alone takes the embedding's values (its seed's draw)
        layers = hf.build_share(config, 5, range(n - 1, n))
        assert torch.equal(layers[-1].lm_head.weight.detach(), ref["model.embed_tokens.weight"].detach())


def test_stacked_experts_are_drawn_expert_by_expert():
    """Mixtral's experts.gate_up_proj: slice e is the draw of a 1-expert tensor under s(f"{name}/{e}")."""
    from planc.runtime import hf
    config = _config("MixtralForCausalLM", num_local_experts=3, num_experts_per_tok=2)
    model = hf.build_model(config, 9)
    experts = model.model.layers[1].mlp.experts
    for e in range(3):
        torch.manual_seed(s(9, f"model.layers.1.mlp.experts/{e}"))
        want = torch.empty((1, *experts.gate_up_proj.shape[1:])).normal_(0.0, config.initializer_range)
        assert torch.equal(experts.gate_up_proj[e:e + 1].detach(), want)


def test_two_plans_of_one_model_start_from_identical_weights():
    """Layer 2 built by a rank holding layers 1..2 under tensor 2 and by one holding 2..4 unsplit: the
    shards are the slices of the same values (seeded per module, not per plan)."""
    from planc.runtime import hf
    from planc.runtime.tensor_parallel import TensorParallel, shard_info, shard_of
    config = _config("LlamaForCausalLM")
    whole = hf.build_share(config, 3, range(2, 5))
    for r in range(2):
        tp = TensorParallel(group=None, rank=r, size=2, members=(0, 1))
        split = hf.build_share(config, 3, range(1, 3), tp)
        for (k, p), (_, q) in zip(split[2].named_parameters(), whole[2].named_parameters()):
            info = shard_info(p)
            want = q if info is None else shard_of(q.detach(), info[0], info[1], info[2], info[3])
            assert torch.equal(p.detach(), want.detach()), k


def test_a_folder_is_read_as_slices(tmp_path):
    """A sharded safetensors folder (with its index): a tensor-parallel share reads its slices and holds
    the folder's values; the folder's tensors are never loaded whole by the rank."""
    from planc.runtime import hf, hf_weights
    from planc.runtime.tensor_parallel import TensorParallel, shard_info, shard_of
    config = _config("LlamaForCausalLM")
    model = spec_model(config, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)   # not the init's values
    model.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    assert json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())["weight_map"]
    want = dict(model.named_parameters())
    reads = []
    real = hf_weights.FolderWeights.read_into

    def spy(self, key, param):
        reads.append((key, tuple(param.shape)))
        return real(self, key, param)
    hf_weights.FolderWeights.read_into = spy
    try:
        folder_config, _ = hf.config_from_folder(str(tmp_path / "m"))
        tp = TensorParallel(group=None, rank=1, size=2, members=(0, 1))
        layers = hf.build_share(folder_config, 0, range(1, 3), tp, folder=str(tmp_path / "m"))
    finally:
        hf_weights.FolderWeights.read_into = real
    held = _named(layers, range(1, 3))
    for name, p in held.items():
        info = shard_info(p)
        ref = want[name].detach()
        assert torch.equal(p.detach(), ref if info is None else shard_of(ref, *info)), name
    assert sorted(k for k, _ in reads) == sorted(held)            # its own tensors only
    assert any(shape != tuple(want[k].shape) for k, shape in reads)   # shards read as slices


def test_a_folder_tensor_of_another_shape_is_named(tmp_path):
    from planc.runtime import hf
    from planc.runtime.hf_weights import WeightsError
    config = _config("LlamaForCausalLM")
    spec_model(config, 1).save_pretrained(tmp_path / "m")
    bigger = _config("LlamaForCausalLM", intermediate_size=48)
    with pytest.raises(WeightsError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight: the folder holds \[32, 16\]"):
        hf.build_share(bigger, 0, range(1, 2), folder=str(tmp_path / "m"))


@pytest.mark.slow
def test_two_launched_plans_start_from_the_spec_weights_bitwise(tmp_path):
    """plans/llama-unequal.plan (stage 1 on data 2 x tensor 2) and a two-stage plan of one device each,
    launched for 0 steps: every rank's parameters are, bit for bit, the spec's initialization of the one
    model (so the two plans start from identical weights)."""
    from e2e_util import ROOT, compare_dumps, run_direct, stage_ranks
    from planc.commands.cli import main
    source = (ROOT / "plans" / "llama-unequal.plan").read_text()
    other = source.replace("stage 0 : layers 0..2 on devices 0..1 as (data = 1)",
                           "stage 0 : layers 0..3 on devices 0..1 as (data = 1)") \
                  .replace("stage 1 : layers 2..5 on devices 1..5 as (data = 2, tensor = 2)",
                           "stage 1 : layers 3..5 on devices 1..2 as (data = 1)")
    assert other != source
    (ROOT / "plans" / ".share-test.plan").write_text(other)   # beside the bundled one: its data path is relative
    try:
        for name, path in (("a", ROOT / "plans" / "llama-unequal.plan"), ("b", ROOT / "plans" / ".share-test.plan")):
            assert main(["compile", str(path), "-o", str(tmp_path / name)]) == 0
    finally:
        (ROOT / "plans" / ".share-test.plan").unlink(missing_ok=True)
    keys = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64, "tie_word_embeddings": True}
    config = transformers.LlamaConfig(**keys)
    from test_hf_models import planc_name
    ref = {planc_name(k, 3): v.detach() for k, v in spec_model(config, 7).named_parameters(remove_duplicate=False)}
    for name in ("a", "b"):   # ranks started directly: the launcher is not the subject
        r = run_direct(tmp_path / name, "--steps", "0", "--dump-params", str(tmp_path / f"dump-{name}"))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        plan = json.loads((tmp_path / name / "plan.json").read_text())
        compare_dumps(tmp_path / f"dump-{name}", stage_ranks(plan), ref, rtol=0, atol=0)


@pytest.mark.slow
def test_build_only_reports_every_ranks_share_beside_the_prediction(tmp_path):
    """``train.py --build-only``: every stage rank builds its share, rank 0 prints each rank's bytes and build
    peak beside plan.json's memory parts, and the job ends without training."""
    import re
    from e2e_util import ROOT, run_direct
    from planc.commands.cli import main
    assert main(["compile", str(ROOT / "plans" / "llama-unequal.plan"), "-o", str(tmp_path / "out")]) == 0
    r = run_direct(tmp_path / "out", "--build-only")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "built each rank's share" in r.stdout and "step 0 loss" not in r.stdout
    reports = json.loads(re.search(r"^build report: (.*)$", r.stdout, re.M)[1])
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    memory = {s["stage"]: s["memory"] for s in plan["pipeline"]["stages"]}
    assert sorted(x["rank"] for x in reports) == [0, 1, 2, 3, 4]
    for x in reports:
        assert x["predicted"] == memory[x["stage"]]
        assert x["parameters"] == memory[x["stage"]]["parameters"]   # fp32: what the model says, to the byte
        assert x["build_peak"] is not None and x["build_peak"] >= 0


# ---------------------------------------------------------------- vocabulary parallelism (2 gloo ranks)

def vocab_worker(rank, world, payload):
    """Each case: the whole model built as a tensor-2 share (every layer held), run as a chain on the same
    ids; the loss (parallel cross-entropy) and every parameter's gradient equal the spec model's whole
    forward and backward (shards compared with their slices)."""
    import torch
    import torch.distributed as dist
    from planc.runtime import hf
    from planc.runtime.hf_vocab import VOCAB_ATTR, loss_for
    from planc.runtime.tensor_parallel import TensorParallel, shard_info, shard_of
    import transformers as tf
    torch.set_default_dtype(torch.float64)
    out = []
    for arch, extra, builtin in payload["cases"]:
        config = hf.config_from_keys(arch, {**SMALL, "num_hidden_layers": 2, **extra})
        config.torch_dtype = torch.float64
        vocab = config.vocab_size   # 64, or 63: padded to 64, rank 1's last row padding
        tp = TensorParallel(dist.group.WORLD, rank, world, tuple(range(world)))
        layers = [layer.double() for layer in hf.build_share(config, 3, range(0, 4), tp)]   # buffers too, as ref's
        emb = layers[0].embed_tokens
        assert getattr(emb, VOCAB_ATTR)[1:] == (rank * 32, rank * 32 + 32, vocab), getattr(emb, VOCAB_ATTR)
        assert emb.weight.shape[0] == 32 and layers[-1].lm_head.weight.shape[0] == 32
        if extra.get("tie_word_embeddings"):
            assert layers[-1].lm_head.weight is emb.weight
        ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(5))
        user = lambda logits, labels: tf.loss.loss_utils.ForCausalLMLoss(logits, labels, vocab_size=vocab)  # noqa: E731
        loss_fn = loss_for(layers, hf.causal_lm_loss if builtin else user, builtin)
        h = ids
        for layer in layers:
            h = layer(h)
        loss = loss_fn(h, ids)
        loss.backward()
        ref = spec_model(config, 3, hf.attn_implementation(arch)).double()
        r = ref(input_ids=ids, labels=ids)
        r.loss.backward()
        torch.testing.assert_close(loss, r.loss, rtol=1e-6, atol=1e-7)
        want = dict(ref.named_parameters())
        for layer in layers:
            for local, p in layer.named_parameters():
                name = layer.planc_param_names[local]
                w, g = want[name].detach(), want[name].grad
                info = shard_info(p)
                if info is not None:
                    if info[0] == 0 and p.shape[0] * info[2] > w.shape[0]:   # padded: zero rows, zero gradient
                        extra_rows = p.shape[0] * info[2] - w.shape[0]
                        w = torch.cat([w, w.new_zeros((extra_rows, *w.shape[1:]))])
                        g = torch.cat([g, g.new_zeros((extra_rows, *g.shape[1:]))])
                    w, g = shard_of(w, *info), shard_of(g, *info)
                torch.testing.assert_close(p.detach(), w, rtol=0, atol=0, msg=name)
                # the cross-entropy runs in fp32 in both (HF's loss upcasts with .float()): fp32's noise
                torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{arch} {name}: {m}")
        out.append(f"{arch} {float(loss.detach()):.6f}")
    return "\n".join(out)


def test_vocabulary_parallel_embedding_head_and_loss_match_the_whole_model():
    import test_runtime_harness as H
    cases = [("LlamaForCausalLM", {}, True), ("LlamaForCausalLM", {"tie_word_embeddings": True}, True),
             ("Gemma2ForCausalLM", {"head_dim": 8}, True), ("LlamaForCausalLM", {}, False),
             # a vocabulary that does not divide: padded to 64, the padded logits no probability (both losses;
             # Gemma-2's soft-capping maps a padded logit to a finite one: masked after it)
             ("LlamaForCausalLM", {"vocab_size": 63}, True), ("LlamaForCausalLM", {"vocab_size": 63}, False),
             ("Gemma2ForCausalLM", {"head_dim": 8, "vocab_size": 63}, True)]
    texts = H.run_ranks(vocab_worker, 2, {"cases": cases})
    import ast
    lines = [ast.literal_eval(texts[r].strip()).splitlines() for r in range(2)]
    assert lines[0] == lines[1] and len(lines[0]) == len(cases)   # both tensor ranks computed the one loss


def test_a_tie_across_stages_and_a_vocabulary_that_does_not_divide_split_and_pad():
    """The head alone of a tied table keeps its rows of the embedding's draw (the whole table goes); a
    vocabulary of 63 on tensor 2 pads to 64: rank 1 keeps rows 32..62 and one zero row; plan.json's
    vocabulary record pads a tied table to the holders' least common multiple (here 4 on a tensor-2 rank)."""
    from planc.runtime import hf
    from planc.runtime.hf_vocab import VOCAB_ATTR
    from planc.runtime.tensor_parallel import TensorParallel, shard_info, shard_size
    tied = _config("LlamaForCausalLM", tie_word_embeddings=True)
    ref = spec_model(tied, 0).model.embed_tokens.weight.detach()
    for r in range(2):
        tp = TensorParallel(group=None, rank=r, size=2, members=(0, 1))
        layers = hf.build_share(tied, 0, range(3, 5), tp)   # the head alone: its table is tied to stage 0's
        w = layers[-1].lm_head.weight
        assert w.shape[0] == 32 and getattr(layers[-1], VOCAB_ATTR)[1:] == (32 * r, 32 * r + 32, 64)
        assert torch.equal(w.detach(), ref[32 * r:32 * r + 32]) and shard_info(w) == (0, r, 2, 1)
        assert layers[0].embed_tokens.weight is w   # the unheld embedding keeps the tie, not the whole table
    odd = _config("LlamaForCausalLM", vocab_size=63)
    ref = spec_model(odd, 0).model.embed_tokens.weight.detach()
    tp = TensorParallel(group=None, rank=1, size=2, members=(0, 1))
    emb = hf.build_share(odd, 0, range(0, 1), tp)[0].embed_tokens
    assert getattr(emb, VOCAB_ATTR)[1:] == (32, 64, 63) and shard_size(emb.weight) == 63
    assert torch.equal(emb.weight.detach()[:31], ref[32:]) and not emb.weight.detach()[31].any()
    record = {"size": 63, "embedding": 68, "lm_head": 68}   # tied across tensor 2 and tensor 4: lcm 4
    layers = hf.build_share(_config("LlamaForCausalLM", vocab_size=63, tie_word_embeddings=True), 0,
                            range(0, 2), tp, vocab=record)
    assert getattr(layers[0].embed_tokens, VOCAB_ATTR)[1:] == (34, 68, 63)
    with pytest.raises(ValueError, match="do not split over a tensor group of 2"):
        hf.build_share(odd, 0, range(0, 1), tp, vocab={"size": 63, "embedding": 63, "lm_head": 63})


def test_a_folder_of_pytorch_bin_files_is_memory_mapped(tmp_path):
    """A folder with only ``pytorch_model.bin``: read through torch.load(mmap=True), the same values."""
    from planc.runtime import hf
    config = _config("LlamaForCausalLM")
    model = spec_model(config, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    (tmp_path / "m").mkdir()
    config.save_pretrained(tmp_path / "m")
    torch.save(model.state_dict(), tmp_path / "m" / "pytorch_model.bin")
    folder_config, _ = hf.config_from_folder(str(tmp_path / "m"))
    layers = hf.build_share(folder_config, 0, range(2, 4), folder=str(tmp_path / "m"))
    want = dict(model.named_parameters())
    for name, p in _named(layers, range(2, 4)).items():
        assert torch.equal(p.detach(), want[name].detach()), name


# ---------------------------------------------------------------- tied tables split by vocabulary: the checker

def _layouts():
    """Stage 0: tensor 2 on devices 0, 1; stage 1: data 2 x tensor 4 on devices 2..9 (DESIGN.md's meshes)."""
    from planc import ir
    return [ir.StageLayout(0, (0, 1), (2,), ("tensor",), (0, 1)),
            ir.StageLayout(1, (1, 2), (2, 4), ("data", "tensor"), tuple(range(2, 10)))]


def test_the_piecewise_program_sums_each_piece_over_exactly_its_holders():
    """258 rows padded to 260 (lcm 4) over tensor 2 and data 2 x tensor 4: four pieces of 65 rows (the
    last cut to 63 real ones), each summed over the one stage-0 device and the two stage-1 data replicas
    that keep it; the checker, knowing only the plan's words, accepts it and rejects every wrong variant."""
    from planc import plan as P
    from planc.reduction.check import check_tied, check_tied_pieces
    from planc.reduction.tied import _piece_records, contribution_keys
    stages = _layouts()
    records = _piece_records(stages, 258, 260)
    got = sorted((ab, g) for rec in records for g, ab in rec)
    assert got == [((0, 65), (0, 2, 6)), ((65, 130), (0, 3, 7)), ((130, 195), (1, 4, 8)), ((195, 258), (1, 5, 9))]
    assert sorted(len(rec) for rec in records) == [1, 1, 2]   # pieces 0 and 2 share a buffer layout

    def split(rec):
        return P.TiedSplit(258, 260, tuple(ab for _, ab in rec), tuple(min(g) for g, _ in rec)), [g for g, _ in rec]
    good = [split(rec) for rec in records]
    assert check_tied_pieces(good, stages, 258, 260) is None
    keys = contribution_keys(stages)
    for rec in records:
        groups = [g for g, _ in rec]
        s, _ = split(rec)
        assert check_tied([("allreduce", groups)], groups, sorted(d for g in groups for d in g), keys,
                          pieces=s.rows) is None
    # a piece summed over the wrong holders: rows 65..130 with stage 1's tensor coordinate 2 (devices 4, 8)
    wrong = [(s, [(0, 4, 8) if tuple(s.rows[i]) == (65, 130) else g for i, g in enumerate(gs)]) for s, gs in good]
    assert "rows [65, 130) are summed over [0, 4, 8], but the devices holding them are [0, 3, 7]" in \
        check_tied_pieces(wrong, stages, 258, 260)
    # (read as a program alone that group is fine: one of each (stage, data replica); only the rows tell);
    # a group that leaves out stage 1's second data replica misses a contribution
    assert check_tied([("allreduce", [(0, 4, 8)])], [(0, 4, 8)], [0, 4, 8], keys, pieces=[(65, 130)]) is None
    assert "contributions" in check_tied([("allreduce", [(0, 3)])], [(0, 3)], [0, 3], keys, pieces=[(65, 130)])
    gap = [(P.TiedSplit(258, 260, (ab,), (min(g),)), [g]) for rec in records for g, ab in rec if ab != (195, 258)]
    assert check_tied_pieces(gap, stages, 258, 260) == "rows [195, 258) are summed by no group"
    straddle = [(P.TiedSplit(258, 260, ((0, 130),), (0,)), [(0, 2, 3, 6, 7)]),
                (P.TiedSplit(258, 260, ((130, 258),), (1,)), [(1, 4, 5, 8, 9)])]
    assert "hold only part of the piece" in check_tied_pieces(straddle, stages, 258, 260)
    assert "do not split over its tensor axis of 4" in check_tied_pieces(good, stages, 258, 258)


def _plan_doc(tmp_path):
    """The output of Llama tied across tensor 2 and tensor 4 (vocabulary 258), compiled."""
    import sys
    from planc.commands.cli import main
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_hf_models import SMALL as KEYS, write_plan
    keys = {**KEYS, "num_hidden_layers": 1, "num_key_value_heads": 4, "tie_word_embeddings": True, "vocab_size": 258}
    plan = write_plan(tmp_path, "LlamaForCausalLM", keys, """\
        stage 0 : layers 0..2 on devices 0..2 as (data = 1, tensor = 2)
        stage 1 : layers 2..3 on devices 2..6 as (data = 1, tensor = 4)
        """, 6, "micro_batch = 2, micro_batches = 2, steps = 1, optimizer = sgd(lr = 0.5), seed = 4")
    assert main(["compile", str(plan), "-o", str(tmp_path / "out")]) == 0
    return tmp_path / "out"


def test_a_compiled_piecewise_plan_passes_every_checker_and_a_wrong_one_fails_each(tmp_path):
    """The compiled plan passes verify's reading and the contract's outside checker; a piece moved to the
    wrong holders in plan.json is rejected by both, and malformed vocabulary records are located errors."""
    import copy
    import plan_contract
    from planc import plan as P
    from planc.driver.verify import _assembled
    out = _plan_doc(tmp_path)
    doc = json.loads((out / "plan.json").read_text())
    assert plan_contract.check(out)[0] == []
    assert _assembled(P.Plan.from_json(doc), None) == []
    from planc.commands.explain import explain
    text = " ".join(explain(doc).split())
    assert "vocabulary split by the tensor stages: 258 tokens; embedding 260 rows (2 padding), lm_head 260 rows" in text
    assert "rows 65..130 of the table summed over [0, 3]" in text
    tied = [i for i, r in enumerate(doc["reductions"]) if r.get("tied")]
    i = next(i for i in tied if doc["reductions"][i]["tied"]["split"]["rows"] == [[65, 130]])
    assert doc["reductions"][i]["groups"] == [[0, 3]]

    bad = copy.deepcopy(doc)   # rows 65..130 summed over stage 1's tensor coordinate 2 instead of 1
    r = bad["reductions"][i]
    r["groups"] = [[0, 4]]
    r["tied"]["contributors"] = [0, 4]
    for s in r["program"]["steps"]:
        s["groups"] = [[0, 4]]
    bad["groups"].append([0, 4]) if [0, 4] not in bad["groups"] else None
    (out / "plan.json").write_text(json.dumps(bad))
    assert any("rows [65, 130)" in v for v in plan_contract.check(out)[0])
    problems = _assembled(P.Plan.from_json(bad), None)
    assert any("rows [65, 130) are summed over [0, 4], but the devices holding them are [0, 3]" in p
               for p in problems), problems

    def refused(edit, match):
        d = copy.deepcopy(doc)
        edit(d)
        with pytest.raises(P.PlanFileError, match=match):
            P.Plan.from_json(d).check()
    refused(lambda d: d["train"]["model"]["hf"]["vocab"].update(lm_head=258),
            r"train\.model\.hf\.vocab\.lm_head: 258 rows do not split over stage 1's tensor axis of 4")
    refused(lambda d: d["train"]["model"]["hf"]["vocab"].update(embedding=262),
            r"train\.model\.hf\.vocab\.embedding: 262 rows, but the tied table of reductions\[\d\]\.tied\.split "
            r"is padded to 260")
    refused(lambda d: d["train"]["model"]["hf"]["vocab"].update(lm_head=200),
            r"train\.model\.hf\.vocab\.lm_head: 200 rows: fewer than the vocabulary's 258")
    refused(lambda d: d["reductions"][i]["tied"]["split"].update(rows=[[65, 300]]),
            rf"reductions\[{i}\]\.tied\.split\.rows\[0\]: expected a non-empty range")
    refused(lambda d: d["reductions"][i]["tied"]["split"].update(norm_devices=[1]),
            rf"reductions\[{i}\]\.tied\.split\.norm_devices\[0\]: device 1 is not a contributor in group \[0, 3\]")
