"""Terminal output (planc.commands.ui): plain 80-column text without escapes when piped, colour on a TTY,
the progress helper, golden files of the tables in plain mode, and per-rank logs of launch.sh.

Golden files: tests/golden/tables/*.txt hold the plain (piped) output of `planc check` (bundled
plans), `explain` and `compile`'s table (a hand-written plan.json, so cost-model changes do not
touch them) and `explain --as` (a pinned placement). After an intended change, regenerate them with

    PLANC_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/commands/test_ui.py -k golden

and review the diff (the paths of this checkout are written as <ROOT>)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from planc.commands import ui
from planc.driver.compile import compile_file
from planc.commands.explain import check_summary, compile_summary, explain
from planc.commands.explain_as import explain_as_data, explain_as_renderables
from planc.lang import load
from planc.lang.format import summary

from e2e_util import spelled

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "tables"
ANSI = re.compile(r"\x1b\[")


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_plain_when_piped_colour_on_a_tty():
    t = ui.table([ui.Col("name"), ui.Col("value", "right")], [["alpha", 1], ["beta", 22]])
    piped = io.StringIO()
    ui.emit(["a title line", t], piped)
    out = piped.getvalue()
    assert not ANSI.search(out)
    assert out.splitlines()[:3] == ["a title line", "name    value", "-------------"]
    assert out.splitlines()[3:] == ["alpha       1", "beta       22"]
    tty = FakeTTY()
    ui.emit(["a title line", ui.table([ui.Col("name")], [["alpha"]], tty=True)], tty)
    assert ANSI.search(tty.getvalue()) and "alpha" in tty.getvalue()
    assert ui.console(io.StringIO()).width == 80


def test_long_lines_wrap_with_a_hanging_indent_and_tables_fit():
    words = " ".join(f"word{i}" for i in range(40))
    t = ui.table([ui.Col("k"), ui.Col("v", wrap=True)], [["key", words]])
    line, table = ui.render("  " + words), ui.render(t)
    assert all(len(l) <= 80 for l in (line + table).splitlines())
    lines = line.splitlines()
    assert len(lines) > 1 and lines[0].startswith("  word0") and all(l.startswith("      word") for l in lines[1:])
    assert " ".join(line.split()) == words and " ".join(table.split()[2:]).endswith(words)   # every word, in order


def test_progress_lines_when_piped_silent_or_bar_on_tty():
    err = io.StringIO()
    assert list(ui.progress(["a", "b", "c"], "bench", stream=err)) == ["a", "b", "c"]
    lines = err.getvalue().splitlines()
    assert lines[:3] == ["bench [1/3] a", "bench [2/3] b", "bench [3/3] c"]
    assert re.fullmatch(r"bench: 3 done in \d+\.\d s", lines[3])
    quiet = io.StringIO()
    assert list(ui.progress(iter(range(4)), "x", stream=quiet, piped="silent")) == [0, 1, 2, 3]
    assert quiet.getvalue() == ""
    tty = FakeTTY()
    assert list(ui.progress(range(3), "calibrate", stream=tty, describe=lambda i: f"item {i}")) == [0, 1, 2]
    assert "calibrate" in tty.getvalue() and "3/3" in tty.getvalue()
    with pytest.raises(ValueError, match="piped must be"):
        list(ui.progress([1], "x", piped="loud"))


def _hand_written_plan() -> dict:
    """test_explain's hand-written plan.json with a placement and a pipeline: its golden text depends
    on the layout only, not on the cost model or the schedulers."""
    from test_explain import _small_plan

    plan = _small_plan()
    plan["placement"] = {"axes": [{"name": "pipe", "size": 2}, {"name": "data", "size": 2}],
                         "matrix": [[2, 1], [1, 2]], "candidates": 2, "search": "exhaustive", "evaluated": 2,
                         "ranked": [{"matrix": [[2, 1], [1, 2]], "predicted": 0.0042,
                                     "breakdown": {"reduce gradients": 0.0002, "transfers": 0.004}},
                                    {"matrix": [[1, 2], [2, 1]], "predicted": 0.0123,
                                     "breakdown": {"reduce gradients": 0.0083, "transfers": 0.004}}],
                         "coords": [[0, 0], [0, 1], [1, 0], [1, 1]]}
    from schedule_util import set_compute_lists
    plan["pipeline"] = {"schedule": "1f1b", "micro_batches": 2, "predicted_iteration": 0.031}
    set_compute_lists(plan, [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]])
    plan["choices"] = {"schedule": "1f1b, the first of eager_1f1b, 1f1b that fits the memory"}
    return plan


def _goldens() -> dict[str, str]:
    from test_explain_as import PLAN

    small = _hand_written_plan()
    out = {"explain-hand-written.txt": explain(small) + "\n",
           "compile-hand-written.txt": ui.render(*compile_summary(small))}
    for name in ("gpt-2x4", "alpacomm-2x4"):
        out[f"check-{name}.txt"] = ui.render(*check_summary(summary(load(ROOT / "plans" / f"{name}.plan"))))
    # a pinned placement: its coordinates follow the rank-mapping rule, whatever the cost model says
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "pinned.plan"
        src.write_text(PLAN.format(tag="pinned", axes="pipe = 2, data = 2, tensor = 2", matrix="[[1, 2], [1, 2], [2, 1]]"))
        pinned = compile_file(src, probe=False).plan_json
    for target in ("megatron", "deepspeed", "torch"):
        out[f"as-{target}-pinned.txt"] = ui.render(*explain_as_renderables(explain_as_data(pinned, target)))
    return {k: v.replace(str(ROOT), "<ROOT>") for k, v in out.items()}


def test_golden_tables_in_plain_mode():
    got = _goldens()
    if os.environ.get("PLANC_UPDATE_GOLDEN"):
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, text in got.items():
            (GOLDEN / name).write_text(text)
    missing = sorted(set(got) - {p.name for p in GOLDEN.glob("*.txt")})
    assert not missing, f"no golden file for {missing}: run with PLANC_UPDATE_GOLDEN=1"
    for name, text in got.items():
        assert not ANSI.search(text) and all(len(l) <= 80 for l in text.splitlines()), name
        assert text == (GOLDEN / name).read_text(), f"{name} differs from tests/golden/tables/{name}"


def test_cli_check_and_compile_print_tables(tmp_path):
    r = subprocess.run([sys.executable, "-m", "planc", "check", str(ROOT / "plans" / "unet-skip.plan")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not ANSI.search(r.stdout)
    assert re.search(r"^stage 2\s+layers 3\.\.6, 2 device\(s\), mesh axes \(data\)$", r.stdout, re.M)
    r = subprocess.run([sys.executable, "-m", "planc", "compile", str(spelled("unet-skip.plan")),
                        "--no-probe", "-o", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {tmp_path / 'o'}/ (6 devices; 3 stage(s)")
    assert re.search(r"^transfer e1\s+\w+", r.stdout, re.M) and re.search(r"^pipeline\s+eager_1f1b", r.stdout, re.M)
    assert f"launch: bash {tmp_path / 'o'}/launch.sh" in r.stdout and not ANSI.search(r.stdout)


TINY = """
plan tiny_logs {
  cluster {
    level node x 2 : bandwidth 1 GB/s, latency 20 us
    level gpu  x 1 : bandwidth 20 GB/s, latency 2 us
  }
  stage 0 on devices 0..1 as (1)
  stage 1 on devices 1..2 as (1)
  transfer a : f32[4, 4] from stage 0 as R R to stage 1 as R R
}
"""


# The real launcher's per-rank logs are checked in tests/e2e/test_comm_only.py (its launches write them).


FAKE_DEEPSPEED = """#!/usr/bin/env bash
# stands in for DeepSpeed's launcher: writes each rank's output where --enable_each_rank_log says
dir=""
while [ $# -gt 0 ]; do
  case "$1" in --enable_each_rank_log) dir="$2"; shift 2 ;; *) shift ;; esac
done
ts=$(date +%Y%m%d%H%M%S)
for i in 1 2 3; do echo "step $i from rank 0" >> "$dir/${ts}_rank0.log"; sleep 0.1; done
echo "planc: rank 1: rank 1 (stage 0) failed in Send with ranks [2]" > "$dir/${ts}_rank1.log"
echo "all fine here" > "$dir/${ts}_rank2.log"
exit "${FAKE_RC:-0}"
"""


@pytest.mark.parametrize("rc", [0, 3])
def test_launch_sh_follows_rank0_and_reports_failed_ranks(tmp_path, rc):
    """launch.sh's own plumbing with a stand-in launcher (the real one: tests/e2e/test_comm_only.py):
    rank 0's log on stdout, the exit status passed on, on failure the other ranks' errors on stderr."""
    from planc.output.codegen import write_output

    (tmp_path / "tiny.plan").write_text(TINY)
    c = compile_file(tmp_path / "tiny.plan")
    out = write_output(c.plan_json, c.program, tmp_path / "out")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "deepspeed").write_text(FAKE_DEEPSPEED)
    (bin_dir / "deepspeed").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON="false",   # no CUDA probe
               FAKE_RC=str(rc))
    r = subprocess.run(["bash", str(out / "launch.sh"), "--steps", "1"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == rc, r.stderr
    assert r.stdout.splitlines() == ["step 1 from rank 0", "step 2 from rank 0", "step 3 from rank 0"]
    if rc:
        assert "planc: rank 1: rank 1 (stage 0) failed in Send with ranks [2]" in r.stderr
        assert "_rank1.log (last 40 lines) ---" in r.stderr and "all fine here" not in r.stderr
        assert f"planc: launch failed ({rc}); every rank's log is in {out}/logs/" in r.stderr
    else:
        assert r.stderr == ""
    assert sorted(p.name.split("_")[1] for p in (out / "logs").glob("*_rank*.log")) == \
        ["rank0.log", "rank1.log", "rank2.log"]
    assert not list((out / "logs").glob(".launch.*"))


def test_launch_sh_on_one_host_starts_launch_py_as_the_deepspeed_runner_would(tmp_path, monkeypatch):
    """On one host launch.sh skips the `deepspeed` runner: it starts DeepSpeed's per-node launcher
    (``-u -m deepspeed.launcher.launch``) in the runner's Python (the first line of its script) with the
    arguments the runner gives it for ``--num_nodes 1 --num_gpus N`` (the runner run here in this process,
    its Popen recorded). With PLANC_MULTI_HOST=1 the runner itself runs, over the hostfile."""
    from deepspeed.launcher import runner

    from planc.output.codegen import write_output

    (tmp_path / "tiny.plan").write_text(TINY)
    c = compile_file(tmp_path / "tiny.plan")
    out = write_output(c.plan_json, c.program, tmp_path / "out")
    bin_dir, logs, seen = tmp_path / "bin", tmp_path / "logs", tmp_path / "argv"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
    (bin_dir / "deepspeed").write_text(f"#!{bin_dir / 'python3'}\nfrom deepspeed.launcher.runner import main\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON="false",   # no CUDA probe
               PLANC_MASTER_PORT="1234", PLANC_LOG_DIR=str(logs), ARGV_OUT=str(seen))

    def launched(**more):
        r = subprocess.run(["bash", str(out / "launch.sh"), "--steps", "1"], env=dict(env, **more),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return seen.read_text().splitlines()

    cmds, popen = [], subprocess.Popen

    def recorded(cmd, **kw):     # the runner's start of launch.py; anything else it runs, really
        if "deepspeed.launcher.launch" not in cmd:
            return popen(cmd, **kw)
        cmds.append(cmd)
        return types.SimpleNamespace(returncode=0, wait=lambda: 0)

    monkeypatch.setattr(runner.subprocess, "Popen", recorded)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    runner.main(["--master_port", "1234", "--num_nodes", "1", "--num_gpus", "2", "--enable_each_rank_log", str(logs),
                 str(out / "train.py"), "--steps", "1"])
    assert cmds[0][1:4] == ["-u", "-m", "deepspeed.launcher.launch"]
    assert launched() == cmds[0][1:]
    multi = launched(PLANC_MULTI_HOST="1")
    assert multi[0] == str(bin_dir / "deepspeed") and multi[1:] == [
        "--master_port", "1234", "--hostfile", str(out / "hostfile"), "--enable_each_rank_log", str(logs),
        str(out / "train.py"), "--steps", "1"]


def test_bar_and_status_only_on_a_terminal():
    quiet = io.StringIO()
    with ui.bar("steps", 4, stream=quiet) as b:
        b.advance(2, "a")
        b.update("b")
        b.advance(2)
    with ui.status("planc compile", stream=quiet) as say:
        say("probing the model")
    assert quiet.getvalue() == ""                      # piped: not a byte
    tty = FakeTTY()
    with ui.bar("steps", 4, stream=tty) as b:
        b.advance(3, "planc 1f1b @ 10 Mbit/s")
        b.advance(1)
    assert "steps" in tty.getvalue() and "4/4" in tty.getvalue()
    tty = FakeTTY()
    with ui.status("planc compile", stream=tty) as say:
        say("ranking placements")
    assert "planc compile" in tty.getvalue()


def test_a_bar_inside_another_stays_silent(monkeypatch):
    """One live display per terminal: a testbed launch's step bar inside a bench's bar (which has
    sys.stderr redirected to rich's proxy meanwhile) yields its items and draws nothing."""
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    with ui.bar("outer steps", 2) as b:
        assert sys.stderr is not tty                   # rich's proxy while the bar is up
        assert list(ui.progress(range(3), "inner bar", stream=sys.stderr, piped="silent")) == [0, 1, 2]
        with ui.status("inner spinner") as say:
            say("x")
        b.advance(2)
    assert "outer steps" in tty.getvalue() and "2/2" in tty.getvalue()
    assert "inner" not in tty.getvalue()
    assert list(ui.progress(range(2), "after", stream=tty)) == [0, 1] and "after" in tty.getvalue()


ESC = re.compile(r"\x1b|\r")


def test_compile_progress_names_each_pass_and_changes_nothing(tmp_path):
    """compile_file(progress=...) is told each pass before it runs; the plan is the same without it,
    and `planc compile` / `explain` piped print no spinner (stderr empty, stdout unchanged)."""
    src = tmp_path / "tiny.plan"
    src.write_text(TINY)                               # communication only: nothing to probe
    said = []
    with_progress = compile_file(src, progress=said.append).plan_json
    from planc.driver.compile import PASS_TEXT
    assert said[0] == PASS_TEXT["infer"] and said[-1] == PASS_TEXT["assemble"] and PASS_TEXT["probe"] not in said
    assert [s for s in said if s in (PASS_TEXT["infer"], PASS_TEXT["place"], PASS_TEXT["transfers"])] == [
        PASS_TEXT["infer"], PASS_TEXT["place"], PASS_TEXT["transfers"]]
    assert compile_file(src).plan_json == with_progress
    for cmd in (["compile", str(src), "--no-probe", "-o", str(tmp_path / "o")], ["explain", str(src), "--no-probe"]):
        r = subprocess.run([sys.executable, "-m", "planc", *cmd], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stderr == "" and not ESC.search(r.stdout), (cmd, r.stderr)
    from planc.commands.explain import explain_data, explain_renderables
    assert r.stdout == ui.render(*explain_renderables(explain_data(compile_file(src, probe=False).plan_json)))


def test_fuzz_and_resharding_bars_on_a_terminal_only(monkeypatch, capsys, tmp_path):
    from benchmarks.bench import fuzz, resharding
    piped = fuzz.run(n=6, seed=1, save=str(tmp_path))
    assert capsys.readouterr().err == ""
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    on_tty = fuzz.run(n=6, seed=1, save=str(tmp_path))
    assert "benchmarks bench fuzz" in tty.getvalue() and "6/6" in tty.getvalue()
    counts = lambda text: [l.split("|")[1:6] for l in text.splitlines() if l.startswith("| ") and "inputs" not in l]
    assert counts(on_tty) == counts(piped) and counts(piped)           # the same table, bar or not
    one = resharding.cases(False)[:1]                  # a 1-to-2 broadcast: quick to plan
    monkeypatch.setattr(resharding, "cases", lambda large: one)
    table = resharding.run(large=False)
    assert "benchmarks bench resharding" in tty.getvalue() and table.count("\n") == 3   # header, rule, one case
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert resharding.run(large=False).splitlines()[2].split("|")[1:5] == table.splitlines()[2].split("|")[1:5]
    assert sys.stderr.getvalue() == ""
