"""The front end under attack: 1,000 hostile inputs, each a checked plan or a located PlanError.

The inputs come from the engine of ``planc bench fuzz`` (benchmarks/bench/fuzz.py), driven here by
hypothesis (derandomized: the same inputs on every run): plans built from the grammar's
constructs, byte-level mutations of every .plan in the repository, mutated YAML cluster files,
token-level mutations and random token soup. ``run_input`` loads each one from a scratch folder
(and compiles it without probing when it checks and is small), each bounded by a per-input
alarm; any other exception, a diagnostic without a position in the input, or a run past the
bound is a failure. Inputs that once failed live in tests/fuzz_regressions/ (``# expect: TEXT``
on the first line: a diagnostic that must be reported; ``# expect: accepted``: it must check).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from benchmarks.bench import fuzz

ROOT = Path(__file__).resolve().parents[2]
REGRESSIONS = ROOT / "tests" / "fuzz_regressions"
SEEDS = [b for _, b in fuzz.repo_seeds()]
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _ok(out: fuzz.Outcome) -> None:
    assert out.status in ("accepted", "diagnostic"), out.detail


def test_there_are_seeds():
    names = [n for n, _ in fuzz.repo_seeds()]
    assert any(n.startswith("plans/") for n in names) and any(n.startswith("tests/golden/") for n in names)
    assert any(n.startswith("tests/plans/") for n in names)


# 350 + 250 + 150 + 150 + 100 = 1,000 inputs

@settings(max_examples=350, **SETTINGS)
@given(st.randoms(use_true_random=False))
def test_grammar_built_plans(folder, rng):
    text, yml = fuzz.generate(rng)
    _ok(fuzz.run_input(text.encode(), None if yml is None else yml.encode(), folder))


@settings(max_examples=250, **SETTINGS)
@given(st.randoms(use_true_random=False), st.sampled_from(range(len(SEEDS))))
def test_byte_mutations_of_every_repository_plan(folder, rng, which):
    _ok(fuzz.run_input(fuzz.mutate_bytes(rng, SEEDS[which], SEEDS), None, folder))


@settings(max_examples=150, **SETTINGS)
@given(st.randoms(use_true_random=False), st.sampled_from(fuzz.YAML_SEEDS))
def test_mutated_yaml_cluster_files(folder, rng, seed):
    mutated = fuzz.mutate_bytes(rng, seed.encode(), [s.encode() for s in fuzz.YAML_SEEDS])
    out = fuzz.run_input(fuzz.YAML_PLAN.encode(), mutated, folder)
    _ok(out)


@settings(max_examples=150, **SETTINGS)
@given(st.randoms(use_true_random=False))
def test_byte_mutations_of_generated_plans(folder, rng):
    text, yml = fuzz.generate(rng)
    _ok(fuzz.run_input(fuzz.mutate_bytes(rng, text.encode(), SEEDS), None if yml is None else yml.encode(), folder))


@settings(max_examples=100, **SETTINGS)
@given(st.lists(st.sampled_from(list('{}()[],;:=."#\n x') + ["..", "stage", "1", "S0", "level", "cluster",
                                                           "auto(", "stages", "=", "layers", "as"]), max_size=40))
def test_random_token_soup(folder, parts):
    _ok(fuzz.run_input("".join(parts).encode(), None, folder))


def test_known_nasty_inputs(folder):
    for text in ["", "\n", "plan", "plan x {", "}", '"', "\x00", "\ufeffcluster { level a x 2 : bandwidth 1 GB/s }",
                 "cluster { level a x 1e999 }", "cluster { level a x " + "9" * 5000 + " }",
                 "cluster { level a x 1048577 : bandwidth 1 GB/s }",
                 "cluster { level a x 2 : bandwidth 1e999 GB/s }", "cluster { level a x 2 : bandwidth -1 GB/s }",
                 "cluster {\n" + "level l x 1\n" * 2000 + "}", "(" * 5000, "cluster { level a x 2 : bandwidth "
                 + "1" * 5000 + " GB/s }"]:
        _ok(fuzz.run_input(text.encode(), None, folder))
    for yml in ["levels: " + "[" * 5000 + "]" * 5000, "a: &a [*a, *a]\nlevels: *a\n", "!!python/object:os.system {}",
                "levels:\n  - {name: a, fanout: 99999999999999999999999, bandwidth: 1}\n", "\t\x00", "levels: [\n"]:
        out = fuzz.run_input(fuzz.YAML_PLAN.encode(), yml.encode(), folder)
        _ok(out)
        assert out.status == "diagnostic"


def test_yaml_errors_point_at_the_yaml_line(folder):
    yml = "levels:\n  - name: node\n    fanout: 2\n    bandwidth: 12 parsecs\n"
    out = fuzz.run_input(fuzz.YAML_PLAN.encode(), yml.encode(), folder)
    assert out.status == "diagnostic" and "bandwidth" in out.detail
    from planc.lang import load
    from planc.lang.errors import PlanError
    with pytest.raises(PlanError) as ei:
        load(folder / fuzz.PLAN_NAME)
    (d,) = ei.value.diagnostics
    assert d.span.file.endswith(fuzz.YAML_NAME) and (d.span.line, d.span.col) == (4, 16)
    assert "    bandwidth: 12 parsecs" in ei.value.render()


def test_yaml_plain_numbers_are_base_units(folder):
    yml = ("levels:\n  - {name: node, fanout: 2, bandwidth: 12500000000, latency: 2.0e-05}\n"
           "  - {name: gpu, fanout: 4, bandwidth: 150 GB/s}\nflops: 312e12\nmemory: 80000000000\n")
    (folder / fuzz.YAML_NAME).write_text(yml)
    (folder / fuzz.PLAN_NAME).write_text(fuzz.YAML_PLAN)
    from planc.lang import load
    c = load(folder / fuzz.PLAN_NAME).cluster
    assert [l.bandwidth for l in c.levels] == [12.5e9, 150e9] and c.levels[0].latency == 2e-5
    assert c.flops == 312e12 and c.memory == 80e9


def test_the_bench_stream_is_deterministic():
    a = [x for x in fuzz.inputs(30, seed=5)]
    assert a == [x for x in fuzz.inputs(30, seed=5)] and a != [x for x in fuzz.inputs(30, seed=6)]
    assert {k for k, _, _ in a} == {"grammar", "bytes", "yaml"}


def test_a_hang_is_a_failure(folder, monkeypatch):
    """The per-input bound itself: an input that runs past it is reported, not waited for."""
    import planc.lang
    import time

    monkeypatch.setattr(planc.lang, "load", lambda path, budget=None: time.sleep(5))
    out = fuzz.run_input(b"cluster { level a x 1 }\n", None, folder, limit_s=0.2)
    assert out.status == "failure" and "ran past 0.2 s" in out.detail


REGRESSION_FILES = sorted(REGRESSIONS.glob("*.plan"))


def test_there_are_regressions():
    assert len(REGRESSION_FILES) >= 3


@pytest.mark.parametrize("path", REGRESSION_FILES, ids=[p.stem for p in REGRESSION_FILES])
def test_fuzz_regression(folder, path):
    plan = path.read_bytes()
    side = path.with_suffix(".yaml")
    out = fuzz.run_input(plan, side.read_bytes() if side.exists() else None, folder)
    _ok(out)
    first = plan.split(b"\n", 1)[0].decode("utf-8", "replace")
    if first.startswith("# expect:"):
        want = first.split(":", 1)[1].strip()
        if want == "accepted":
            assert out.status == "accepted", out.detail
        else:
            assert out.status == "diagnostic" and want in out.detail, out.detail


def test_run_writes_the_table(tmp_path):
    text = fuzz.run(20, seed=1, save=str(tmp_path / "failures"))
    assert "| kind | inputs | accepted | diagnostics | failures | slowest input |" in text
    rows = [l for l in text.splitlines() if l.startswith("| ") and l.split("|")[1].strip() in ("grammar", "bytes", "yaml")]
    assert sum(int(r.split("|")[2]) for r in rows) == 20


def test_regressions_exit_2_from_the_command_line(tmp_path):
    """The same inputs through `planc check`: exit 2 with located diagnostics, never a traceback."""
    import subprocess
    import sys

    names = []
    for path in REGRESSION_FILES:
        (tmp_path / path.stem).mkdir()
        (tmp_path / path.stem / path.name).write_bytes(path.read_bytes())
        if path.with_suffix(".yaml").exists():
            (tmp_path / path.stem / fuzz.YAML_NAME).write_bytes(path.with_suffix(".yaml").read_bytes())
        names.append(str(tmp_path / path.stem / path.name))
    r = subprocess.run([sys.executable, "-m", "planc", "check", *names], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    for name in names:
        assert f"{name}:" in r.stderr or f"{Path(name).parent / fuzz.YAML_NAME}:" in r.stderr, r.stderr


def test_planc_bench_fuzz_exits_1_when_an_input_fails(monkeypatch, capsys, tmp_path):
    """A failing input (here: every input, by a stand-in checker) makes the command fail, naming the count."""
    from benchmarks import cli

    monkeypatch.setenv("PLANC_FUZZ_INPUTS", "3")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fuzz, "run_input", lambda *a, **k: fuzz.Outcome("failure", 0.0, "stand-in failure"))
    assert cli.main(["bench", "fuzz"]) == 1
    err = capsys.readouterr().err
    assert "benchmarks bench fuzz: 3 input(s) failed" in err
    monkeypatch.setattr(fuzz, "run_input", lambda *a, **k: fuzz.Outcome("accepted", 0.0))
    assert cli.main(["bench", "fuzz"]) == 0


def test_yaml_misspelt_keys_are_errors_with_a_hint(folder):
    """A key the file format does not know is an error at it, not a value silently left at its default
    (a misspelt `latency` read as 0, `host` as the default level, `memory` as no limit)."""
    yml = ("levels:\n  - {name: node, fanout: 2, bandwidth: 12.5 GB/s, latncy: 20 us}\n"
           "  - {name: gpu, fanout: 4, bandwidth: 150 GB/s}\nhots: gpu\nmemmory: 1 GB\n"
           "calibration: {anything: 1}\n")
    (folder / fuzz.YAML_NAME).write_text(yml)
    (folder / fuzz.PLAN_NAME).write_text(fuzz.YAML_PLAN)
    from planc.lang import load
    from planc.lang.errors import PlanError
    with pytest.raises(PlanError) as ei:
        load(folder / fuzz.PLAN_NAME)
    got = {(d.span.line, d.message.split("unknown key ")[1].split(" ")[0]) for d in ei.value.diagnostics}
    assert got == {(2, "'latncy'"), (4, "'hots'"), (5, "'memmory'")}   # calibration: planc's own record, allowed
    text = ei.value.render()
    assert "did you mean 'latency'?" in text and "did you mean 'host'?" in text and "did you mean 'memory'?" in text
