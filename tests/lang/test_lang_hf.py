"""``model hf "ARCH" { config keys }`` and ``model hf "dir"`` (LANGUAGE.md, "Hugging Face models";
docs/language.md): the forms the front end accepts, and each mistake a located error with a caret under
its culprit — the front end's own, and those only transformers can tell (an unknown architecture or key,
a config without a pipeline plan, heads that a stage's tensor degree does not split), which the compiler
learns from the meta-device probe and points back at the plan."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from planc import ir
from planc.driver.compile import compile_file, dump_plan
from planc.lang import load_text
from planc.lang.errors import PlanError
from planc.lang.format import to_text

pytest.importorskip("transformers", reason="transformers (the 'hf' extra) is not installed")

ROOT = Path(__file__).resolve().parents[2]
BYTES = ROOT / "examples" / "bytes.py"
LLAMA = ("hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4, "
         "num_key_value_heads = 2, vocab_size = 256")


def plan_text(model: str, mesh: str = "(data = 2)", data: str = f'data "{BYTES}:batches" {{ seq = 8 }}',
              extra: str = "") -> str:
    return textwrap.dedent(f"""\
        plan t {{
          cluster {{
            level node x 1 : bandwidth 1 GB/s, latency 50 us
            level cpu x 3 : bandwidth 10 GB/s, latency 2 us
            host = node
          }}
          {model}
          {data}
          {extra}
          stage 0 : layers 0..2 on devices 0..1 as (data = 1)
          stage 1 : layers 2..4 on devices 1..3 as {mesh}
          reduce gradients over data
          train {{ micro_batch = 4, micro_batches = 2, steps = 2, optimizer = sgd(lr = 0.1), seed = 3 }}
        }}
        """)


def located(e: PlanError, text: str, message: str, culprit: str) -> None:
    """``e`` has a diagnostic containing ``message`` whose span starts at ``culprit``'s first occurrence
    and is shown with a caret under it; nothing reads like a traceback."""
    rendered = e.render()
    assert "Traceback" not in rendered
    found = [d for d in e.diagnostics if message in d.message]
    assert found, rendered
    (line_no, line), = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if culprit in ln][:1]
    d = found[0]
    assert (d.span.line, d.span.col) == (line_no, line.index(culprit) + 1), rendered
    caret = re.search(r"^\s*\|?\s*(\^+)\s*$", rendered, re.M)
    assert caret is not None, rendered


def compile_error(tmp_path: Path, text: str) -> PlanError:
    (tmp_path / "p.plan").write_text(text)
    with pytest.raises(PlanError) as ei:
        compile_file(tmp_path / "p.plan")
    return ei.value


# ---------------------------------------------------------------- the forms


def test_arch_form_with_config_keys_booleans_lists_and_data_arguments():
    text = plan_text(f'model hf "LlamaForCausalLM" {{ {LLAMA}, tie_word_embeddings = true, '
                     'eos_token_id = [1, 2], rms_norm_eps = 1e-5 }')
    p = load_text(text, "t.plan")
    assert isinstance(p.model, ir.HfModel) and p.model.folder is None
    assert p.model.architecture == "LlamaForCausalLM"
    keys = dict(p.model.config)
    assert keys["tie_word_embeddings"] is True and keys["eos_token_id"] == (1, 2) and keys["rms_norm_eps"] == 1e-5
    assert keys["hidden_size"] == 32 and isinstance(keys["hidden_size"], int)
    assert p.loss is None   # the model's causal-LM loss
    assert dict(p.data.args) == {"seq": 8}
    again = load_text(to_text(p), "again.plan")   # the canonical text reads back the same
    assert again.model == p.model and again.data == p.data


def test_folder_form():
    p = load_text(plan_text('model hf "./tiny-llama"'), "t.plan")
    assert p.model.folder == "./tiny-llama" and p.model.architecture is None and p.model.config == ()


def test_a_folder_takes_no_keys():
    text = plan_text('model hf "models/tiny" { hidden_size = 32 }')
    with pytest.raises(PlanError) as ei:
        load_text(text, "t.plan")
    located(ei.value, text, "a model folder takes no config keys", "hidden_size")


def test_data_is_required_and_loss_is_not():
    text = plan_text(f'model hf "LlamaForCausalLM" {{ {LLAMA} }}', data="")
    with pytest.raises(PlanError) as ei:
        load_text(text, "t.plan")
    located(ei.value, text, "needs a 'data \"file.py:function\"' line", 'model hf "LlamaForCausalLM"')
    assert "loss" not in ei.value.render()


def test_a_config_key_given_twice():
    text = plan_text('model hf "LlamaForCausalLM" { hidden_size = 32, hidden_size = 64 }')
    with pytest.raises(PlanError) as ei:
        load_text(text, "t.plan")
    assert "config key 'hidden_size' is given twice" in ei.value.render()


# ---------------------------------------------------------------- what transformers tells, located


def test_unknown_architecture_suggests_the_class(tmp_path):
    text = plan_text(f'model hf "LlamaForCausalLm" {{ {LLAMA} }}')
    e = compile_error(tmp_path, text)
    located(e, text, "'LlamaForCausalLm' is not a causal-LM class", '"LlamaForCausalLm"')
    assert "did you mean 'LlamaForCausalLM'?" in e.render()


def test_unknown_config_key_suggests_the_key(tmp_path):
    text = plan_text(f'model hf "LlamaForCausalLM" {{ {LLAMA}, rms_norm_epsilon = 1e-5 }}')
    e = compile_error(tmp_path, text)
    located(e, text, "'rms_norm_epsilon' is not a key of LlamaConfig", "rms_norm_epsilon")
    assert "did you mean 'rms_norm_eps'?" in e.render()


def test_a_key_of_the_wrong_type_is_located_at_the_key(tmp_path):
    text = plan_text(f'model hf "LlamaForCausalLM" {{ hidden_size = 32, num_hidden_layers = true }}')
    e = compile_error(tmp_path, text)
    located(e, text, "LlamaConfig refuses these keys", "num_hidden_layers")


def test_a_model_without_a_pipeline_plan_points_to_the_builder_route(tmp_path):
    text = plan_text('model hf "GPT2LMHeadModel" { n_embd = 32, n_layer = 2, n_head = 4, vocab_size = 256 }')
    e = compile_error(tmp_path, text)
    located(e, text, "has no base_model_pp_plan", 'model hf "GPT2LMHeadModel"')
    assert 'model "file.py:build"' in e.render()


def test_heads_that_the_tensor_degree_does_not_split_name_the_stage_degree_and_numbers(tmp_path):
    text = plan_text(f'model hf "LlamaForCausalLM" {{ {LLAMA.replace("num_key_value_heads = 2", "num_key_value_heads = 1")} }}',
                     mesh="(data = 1, tensor = 2)")
    e = compile_error(tmp_path, text)
    located(e, text, "stage 1 splits its decoder layers over a 'tensor' axis of 2", "stage 1 :")
    message = next(d.message for d in e.diagnostics if "tensor" in d.message)
    assert "1 key/value heads (num_key_value_heads)" in message and "do not divide by 2" in message
    assert "attention heads" not in message   # 4 heads split; only the KV head does not


def test_a_folder_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    text = plan_text('model hf "./empty"')
    e = compile_error(tmp_path, text)
    located(e, text, "model folder './empty' has no config.json", '"./empty"')


def test_a_missing_folder(tmp_path):
    text = plan_text('model hf "./nowhere"')
    e = compile_error(tmp_path, text)
    located(e, text, "model folder './nowhere' not found", '"./nowhere"')


def test_data_outside_the_vocabulary_is_the_data_lines_error(tmp_path):
    text = plan_text(f'model hf "LlamaForCausalLM" {{ {LLAMA.replace("vocab_size = 256", "vocab_size = 64")} }}')
    e = compile_error(tmp_path, text)
    located(e, text, "outside the model's vocabulary 0..63", "data ")


# ---------------------------------------------------------------- what plan.json records


def test_plan_json_records_the_config_after_defaults_and_the_default_loss(tmp_path):
    text = plan_text(f'model hf "Qwen2ForCausalLM" {{ {LLAMA}, hidden_dropout = 0.3 }}'
                     .replace("hidden_dropout", "attention_dropout"))
    (tmp_path / "p.plan").write_text(text)
    plan = json.loads(dump_plan(compile_file(tmp_path / "p.plan").plan_json))
    train = plan["train"]
    rec = train["model"]["hf"]
    assert rec["architecture"] == "Qwen2ForCausalLM" and rec["attn_implementation"] == "sdpa"
    assert rec["keys"]["attention_dropout"] == 0.3          # as written
    assert rec["config"]["attention_dropout"] == 0.0        # what is built: no dropout
    assert rec["config"]["rms_norm_eps"] == 1e-6            # Qwen2Config's default, filled in
    assert rec["config"]["hidden_size"] == 32 and "folder" not in rec
    assert train["loss"] == {"builtin": "causal_lm_loss"}
    assert train["data"] == {"file": "bytes.py", "function": "batches", "args": {"seq": 8}}
    names = [lay["name"] for lay in train["layers"]]
    assert names == ["embed_tokens", "layers.0", "layers.1", "norm + lm_head"]
    # parameters per layer, counted here from the config: Qwen2 has q/k/v biases
    h, i, v, kv = 32, 64, 256, 2 * 8
    decoder = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    assert train["layer_params"] == [v * h, decoder, decoder, h + v * h]
    assert [lay["params"] for lay in train["layers"]] == train["layer_params"]


PHI3 = ("hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4, "
        "num_key_value_heads = 2, vocab_size = 256")


def test_a_pad_token_outside_the_vocabulary_names_the_key_and_the_fix(tmp_path):
    """Phi3's default pad_token_id (32000) with a small vocabulary: torch would assert "Padding_idx must be
    within num_embeddings" while transformers builds the embedding; the compiler names the key instead."""
    text = plan_text(f'model hf "Phi3ForCausalLM" {{ {PHI3} }}')
    e = compile_error(tmp_path, text)
    located(e, text, "pad_token_id = 32000 is outside vocab_size = 256 (token ids 0..255), and transformers builds "
                     "the embedding with it as the padding index: write pad_token_id = 0 (or another id below "
                     "256), or vocab_size = 32001 or more", "vocab_size = 256")
    assert "Padding_idx" not in e.render()
    written = plan_text(f'model hf "Phi3ForCausalLM" {{ {PHI3}, pad_token_id = 300 }}')
    located(compile_error(tmp_path, written), written, "pad_token_id = 300 is outside vocab_size = 256",
            "pad_token_id = 300")


def test_an_assertion_transformers_makes_while_building_is_the_configs_error(monkeypatch):
    """Any other config value transformers or torch asserts on while building the model (hf_probe) is
    reported as the config's, at the key its message names, not as the model code's failure."""
    from planc.runtime import hf_probe
    from planc.runtime.hf import config_from_keys
    from planc.runtime.usererrors import UserCodeError
    config = config_from_keys("LlamaForCausalLM", {"hidden_size": 32, "num_hidden_layers": 1,
                                                    "num_attention_heads": 4, "vocab_size": 256})

    def refuse(*a, **k):
        raise AssertionError("vocab_size must be even")
    monkeypatch.setattr(hf_probe, "build_model", refuse)
    with pytest.raises(UserCodeError) as ei:
        hf_probe._meta_layers(config, "LlamaForCausalLM", {"vocab_size": 256}, 0, None)
    assert ei.value.part == "hf-key:vocab_size"
    assert str(ei.value) == ("transformers cannot build LlamaForCausalLM with this config, it says AssertionError: "
                             "vocab_size must be even (check vocab_size)")
