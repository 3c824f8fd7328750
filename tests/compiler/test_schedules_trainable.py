"""What a device that runs several stages (interleaved_1f1b, zbv) does not train yet is said by the
compiler, at the setting, not found by the ranks."""
from __future__ import annotations

from e2e_util import ROOT
from planc.commands.cli import main


def test_clip_and_fp16_under_a_shared_mesh_are_errors_at_the_setting(tmp_path, capsys):
    text = (ROOT / "tests" / "plans" / "gpt-interleaved-2x2.plan").read_text().replace(
        '"../../examples/', f'"{ROOT}/examples/')
    for setting, line_has in (("clip = 1.0, ", "clip"), ("precision = fp16, ", "precision")):
        plan = tmp_path / f"p{len(line_has)}.plan"
        plan.write_text(text.replace("optimizer = adam(lr = 1e-3), precision = fp32",
                                     f"optimizer = adam(lr = 1e-3), {setting}" +
                                     ("precision = fp32" if "clip" in setting else "").rstrip(", "))
                        .replace(", , ", ", "))
        assert main(["compile", "--no-probe", str(plan), "-o", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        line = next(i for i, l in enumerate(plan.read_text().splitlines(), 1) if setting.split(" =")[0] in l)
        want = ("needs one gradient norm over every stage a device runs, and under interleaved_1f1b a device "
                "runs several stages: not supported yet; drop clip, use bf16, or another schedule")
        assert f"{plan}:{line}:" in err and want in " ".join(err.split()), err
