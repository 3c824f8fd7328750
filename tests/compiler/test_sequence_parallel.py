"""Sequence parallelism at compile time (LANGUAGE.md "Hugging Face models", docs/models.md): which tensor
stages run it and why the others do not, the layouts it derives, a written replicated spec, the memory and
traffic the models count. The runtime half is tested by running it: tests/runtime/test_hf_tp.py (layers on two gloo
ranks against the unsharded layer) and tests/e2e/test_hf_models.py (whole plans against transformers)."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from planc.commands.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BYTES = ROOT / "examples" / "bytes.py"


def plan_text(seq: int = 8, train: str = "", tensor1: str = "tensor = 2", transfer: str = "") -> str:
    return textwrap.dedent(f"""\
        plan sp {{
          cluster {{
            level node x 1 : bandwidth 1 GB/s, latency 50 us
            level cpu x 6 : bandwidth 10 GB/s, latency 2 us
            host = node
          }}
          model hf "LlamaForCausalLM" {{ hidden_size = 32, intermediate_size = 64, num_attention_heads = 4,
            num_key_value_heads = 2, vocab_size = 256, num_hidden_layers = 2, tie_word_embeddings = false }}
          data "{BYTES}:batches" {{ seq = {seq} }}
          stage 0 : layers 0..3 on devices 0..2 as (tensor = 2)
          stage 1 : layers 3..4 on devices 2..6 as (data = 2, {tensor1})
          {transfer}
          reduce gradients over data
          train {{ micro_batch = 2, micro_batches = 2, steps = 2 {train} }}
        }}
        """)


def compile_plan(tmp_path: Path, text: str, name: str = "p") -> dict:
    path = tmp_path / f"{name}.plan"
    path.write_text(text)
    assert main(["compile", str(path), "-o", str(tmp_path / name)]) == 0
    return json.loads((tmp_path / name / "plan.json").read_text())


def explain(tmp_path: Path, name: str, capsys) -> str:
    capsys.readouterr()
    assert main(["explain", str(tmp_path / f"{name}.plan")]) == 0
    return " ".join(capsys.readouterr().out.split())   # lines wrap at the terminal's width


def test_on_by_default_where_tensor_splits_and_the_sequence_divides(tmp_path, capsys):
    plan = compile_plan(tmp_path, plan_text())
    assert [s["sequence_parallel"] for s in plan["stages"]] == [True, True]
    t = plan["transfers"][0]
    # stage 0's two tensor ranks each send their half of the sequence; stage 1's four devices each take
    # their rows' half of it
    assert sorted(tuple(map(tuple, r)) for r in t["regions"]["src"].values()) == [((0, 2), (0, 4), (0, 32)),
                                                                                   ((0, 2), (4, 8), (0, 32))]
    assert sorted(tuple(map(tuple, r)) for r in t["regions"]["dst"].values()) == [
        ((0, 1), (0, 4), (0, 32)), ((0, 1), (4, 8), (0, 32)), ((1, 2), (0, 4), (0, 32)), ((1, 2), (4, 8), (0, 32))]
    text = explain(tmp_path, "p", capsys)
    assert "sequence parallelism: stages 0, 1 (norms, residuals and the activations" in text
    assert "no sequence parallelism" not in text


def test_turned_off_by_the_train_setting_and_said_why(tmp_path, capsys):
    plan = compile_plan(tmp_path, plan_text(train=", sequence_parallel = false"))
    assert [(s["sequence_parallel"], s["sequence_parallel_why"]) for s in plan["stages"]] == \
        [(False, "train { sequence_parallel = false }")] * 2
    regions = plan["transfers"][0]["regions"]
    assert {tuple(r[1]) for side in ("src", "dst") for r in regions[side].values()} == {(0, 8)}
    text = explain(tmp_path, "p", capsys)
    assert "stage 0: no sequence parallelism: train { sequence_parallel = false }" in text


def test_a_sequence_that_does_not_divide_runs_without_it(tmp_path, capsys):
    plan = compile_plan(tmp_path, plan_text(seq=9, tensor1="tensor = 1").replace("devices 2..6", "devices 2..4"))
    assert plan["stages"][0]["sequence_parallel"] is False
    assert plan["stages"][0]["sequence_parallel_why"] == "the sequence length 9 does not split into 2 equal parts"
    assert "sequence_parallel" not in plan["stages"][1]   # no tensor axis > 1: nothing to say
    assert "stage 0: no sequence parallelism: the sequence length 9 does not split into 2 equal parts" in \
        explain(tmp_path, "p", capsys)


def test_a_written_replicated_spec_is_honoured_and_a_contradicting_one_is_refused(tmp_path, capsys):
    plan = compile_plan(tmp_path, plan_text(transfer="transfer h from stage 0 as R R R to stage 1 as S(data) R R"))
    assert [s["sequence_parallel"] for s in plan["stages"]] == [True, True]
    regions = plan["transfers"][0]["regions"]
    assert {tuple(r[1]) for side in ("src", "dst") for r in regions[side].values()} == {(0, 8)}
    path = tmp_path / "bad.plan"   # the hidden dim split over tensor: what stage 1 computes it is not
    path.write_text(plan_text(transfer="transfer h from stage 0 to stage 1 as S(data) R S(tensor)"))
    capsys.readouterr()
    assert main(["compile", str(path), "-o", str(tmp_path / "bad")]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "stage 1 computes S0 S1 R (batch rows split over data = 2, the sequence split over tensor = 2: " \
           "sequence parallelism)" in err, err


def test_a_setting_that_is_not_a_truth_value_is_located(tmp_path, capsys):
    path = tmp_path / "p.plan"
    path.write_text(plan_text(train=", sequence_parallel = 3"))
    capsys.readouterr()
    assert main(["check", str(path)]) != 0
    err = capsys.readouterr().err
    assert "sequence_parallel must be true or false" in err and ":14:79:" in err, err


def test_a_builder_that_does_not_opt_in_is_told_how(tmp_path):
    plan = compile_plan(tmp_path, (ROOT / "plans" / "gpt-tp-2x2.plan").read_text().replace(
        '"../models/', f'"{ROOT}/models/').replace('"../examples/', f'"{ROOT}/examples/'), "gpt")
    whys = {s.get("sequence_parallel_why") for s in plan["stages"] if "sequence_parallel" in s}
    assert whys == {"the model builder does not take the keyword sequence_parallel (docs/models.md)"}, whys


def test_the_memory_model_counts_the_sequence_split(tmp_path):
    on = compile_plan(tmp_path, plan_text(), "on")["pipeline"]["stages"]
    off = compile_plan(tmp_path, plan_text(train=", sequence_parallel = false"), "off")["pipeline"]["stages"]
    for a, b in zip(on, off):
        assert a["memory"]["parameters"] == b["memory"]["parameters"]
        assert a["memory"]["activations"] < b["memory"]["activations"], (a["memory"], b["memory"])


def test_a_builder_that_opts_in_gets_the_sequence_split_layouts(tmp_path):
    (tmp_path / "spgpt.py").write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(ROOT / "examples")!r})
        from gpt import build as _build, loss, batches  # noqa: F401


        def build(tensor_parallel=None, sequence_parallel=False, **args):
            return _build(tensor_parallel=tensor_parallel, **args)
        """))
    text = (ROOT / "plans" / "gpt-tp-2x2.plan").read_text().replace(
        '"../examples/gpt.py:build"', f'"{tmp_path}/spgpt.py:build"').replace('"../examples/', f'"{ROOT}/examples/')
    plan = compile_plan(tmp_path, text, "gpt")
    assert [s["sequence_parallel"] for s in plan["stages"]] == [True, True]
    t = plan["transfers"][0]
    assert sorted({tuple(r[1]) for r in t["regions"]["src"].values()}) == [(0, 32), (32, 64)]   # seq 64 over 2
    odd = compile_plan(tmp_path, text.replace("seq = 64", "seq = 63"), "odd")
    assert {s["sequence_parallel_why"] for s in odd["stages"]} == {"the sequence length 63 does not split into 2 "
                                                                   "equal parts"}


# ---- the whole chain on two gloo ranks: masks, positions and rotary of the whole sequence on its parts ----

CHAIN_FAMILIES = {   # the attention variants whose mask or positions a part of the sequence could get wrong
    "MistralForCausalLM": {"sliding_window": 3},
    "Qwen2ForCausalLM": {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},
    "Gemma2ForCausalLM": {"head_dim": 8, "sliding_window": 3},
}


def chain_worker(rank, world, payload):
    import torch
    import torch.distributed as dist

    from planc.runtime import hf
    from planc.runtime.tensor_parallel import TensorParallel
    torch.set_default_dtype(torch.float64)
    out = {}
    for arch, extra in payload.items():
        keys = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 64, "num_hidden_layers": 2, "tie_word_embeddings": False, **extra}
        config = hf.config_from_keys(arch, keys)
        whole = hf.pipeline_layers(hf.build_model(config, seed=3))
        tp = TensorParallel(dist.group.WORLD, rank, world, tuple(range(world)))
        tp.sequence_parallel = True
        part = hf.build_share(config, 3, range(len(whole)), tp)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
        want, got = ids, ids
        for a, b in zip(whole, part):
            want, got = a(want), b(got)
            if isinstance(b, hf.DecoderLayer):   # the rank's part of the whole sequence's hidden states
                torch.testing.assert_close(got, want[:, rank * 4:(rank + 1) * 4], rtol=1e-6, atol=1e-9,
                                           msg=lambda m: f"{arch} {b.planc_label}: {m}")
        cols = got.shape[-1]   # the head split by vocabulary: the rank's columns of the logits
        torch.testing.assert_close(got, want[..., rank * cols:(rank + 1) * cols], rtol=1e-6, atol=1e-9)
        out[arch] = cols
    return out


def test_whole_chains_with_sliding_windows_match_on_their_parts_of_the_sequence():
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    import test_runtime_harness as H
    texts = H.run_ranks(chain_worker, 2, CHAIN_FAMILIES)
    assert all(t.strip() for t in texts.values())
