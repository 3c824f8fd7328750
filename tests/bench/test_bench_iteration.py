"""`planc bench iteration`: what stock DeepSpeed can express, the link bound's byte count, the report,
and (root + iproute2 only) the stock DeepSpeed script and the compute-only worker launched per host
inside the testbed. No test asserts on a timing."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from benchmarks.bench import iteration
from benchmarks.testbed import available

ROOT = Path(__file__).resolve().parents[2]


def _compile(path: Path) -> dict:
    from planc.driver.compile import compile_file

    from e2e_util import spelled
    return compile_file(spelled(path), probe=False).plan_json   # a bundled plan's types: its spelled copy


@pytest.fixture(scope="module")
def gpt_plan() -> dict:
    return _compile(ROOT / "plans/gpt-bench-2x2.plan")


@pytest.fixture(scope="module")
def unet_plan() -> dict:
    return _compile(ROOT / "plans/unet-skip.plan")


def test_stock_deepspeed_expresses_the_gpt_chain_with_a_uniform_cut(gpt_plan):
    assert [s["devices"] for s in gpt_plan["stages"]] == [[0, 1], [2, 3]]   # DeepSpeed's rank order
    assert iteration.stock_reason(gpt_plan) is None
    assert iteration.stock_partition(gpt_plan) == "uniform"


def test_stock_deepspeed_cannot_express_skips_tensor_axes_or_other_cuts(unet_plan, gpt_plan):
    assert iteration.stock_reason(unet_plan).startswith("skips to non-adjacent stages (transfer `e2`")
    tensor = _compile(ROOT / "plans/gpt-2x4.plan")
    assert "`tensor` axis of 2" in iteration.stock_reason(tensor)
    moved = copy.deepcopy(gpt_plan)   # a cut neither uniform nor balanced by parameters
    moved["stages"][0]["layers"], moved["stages"][1]["layers"] = [0, 1], [1, 6]
    moved["train"]["layer_params"] = [1, 1, 1, 1, 1, 1]
    moved["transfers"][0]["src"]["layer"] = 0
    assert iteration.stock_partition(moved) is None
    assert "neither partition_method" in iteration.stock_reason(moved)
    swapped = copy.deepcopy(gpt_plan)
    swapped["stages"][0]["devices"], swapped["stages"][1]["devices"] = [0, 2], [1, 3]
    assert "PipeDataParallelTopology puts it on [0, 1]" in iteration.stock_reason(swapped)


def test_link_bytes_counts_activations_and_gradients_per_micro_batch(gpt_plan):
    lk = iteration.link_bytes(gpt_plan)
    per_mb = 8 * 64 * 256 * 4                    # f32[8, 64, 256], half from each stage-0 device
    assert lk["out"] == [8 * per_mb, 8 * per_mb]  # activations out of host 0, gradients out of host 1
    assert lk["in"] == [8 * per_mb, 8 * per_mb]
    assert lk["busiest_bytes"] == 8 * per_mb       # the data-parallel reduction stays inside each host
    assert math.isclose(iteration.link_seconds(lk["busiest_bytes"], 10), 8 * per_mb / 1.25e6)


def test_link_bytes_ring_estimate_for_a_reduction_across_hosts(gpt_plan):
    plan = copy.deepcopy(gpt_plan)
    plan["transfers"] = []
    plan["reductions"] = [{"name": "gradients", "bytes": 1000, "groups": [[0, 2]],
                           "per_stage_bytes": [{"stage": 0, "bytes": 1000}],
                           "program": {"steps": [{"collective": "reduce_scatter", "groups": [[0, 2]]},
                                                 {"collective": "all_gather", "groups": [[0, 2]]}]}},
                          {"name": "tensor_traffic", "bytes": 10 ** 9, "groups": [[0, 2]],
                           "program": {"steps": [{"collective": "allreduce", "groups": [[0, 2]]}]}}]
    lk = iteration.link_bytes(plan)
    # reduce_scatter: (n-1)/n * 1000 = 500 per ring edge; all_gather of the 500-byte shards: 500;
    # the placement-only reduction is not run by a training step
    assert lk["out"] == [1000, 1000] and lk["in"] == [1000, 1000]


def test_the_fill_and_drain_bound_of_a_two_stage_pipeline_is_its_closed_form(gpt_plan):
    """Host 0 sends one micro-batch's activations (half from each data rank) and receives its
    gradients. The data ranks are independent pipelines: one rank's first half of the activations
    and one rank's last half of the gradients cross alone at the one-way rate, the rest both ways."""
    lk = iteration.link_bytes(gpt_plan)
    n = 8 * 64 * 256 * 4
    assert lk["classes"]["forward"]["out"] == [n, 0] and lk["classes"]["backward"]["in"] == [n, 0]
    assert lk["micro_batches"] == 8
    assert lk["classes"]["fill"][0] == [(n / 2, 0.0)] and lk["classes"]["drain"][0] == [(0.0, n / 2)]
    assert lk["classes"]["fill"][1] == [(0.0, n / 2)]        # host 1: the same inputs, coming in
    r1, r2 = 3.18e6, 2.73e6
    t, host = iteration.pipeline_link_bound(lk, r1, r2)
    assert math.isclose(t, n / r1 + 15 * n / (2 * r2))
    # directions independent (no both-ways figure): (B + 1/2) N / R, N a micro-batch's activations
    t, _ = iteration.pipeline_link_bound(lk, r1)
    assert math.isclose(t, 8.5 * n / r1)
    # a both-ways figure above the one-way rate is capped there; older JSON (no fill): no bound
    assert math.isclose(iteration.pipeline_link_bound(lk, r1, 2 * r1)[0], 8.5 * n / r1)
    old = dict(lk, classes={k: v for k, v in lk["classes"].items() if k not in ("fill", "drain")})
    assert iteration.pipeline_link_bound(old, r1) is None


def test_the_fill_and_drain_bound_is_below_a_schedule_that_achieves_it():
    """Random two-direction links: the bound is at least the plain bound and at most the time of a
    schedule the fill and drain allow: the smallest fill alone, every other byte at the link's limits,
    the smallest drain alone."""
    import random

    rng = random.Random(7)
    carry = iteration._carry_time
    for _ in range(500):
        mb = rng.randint(1, 16)
        fo, bi = rng.uniform(1, 100), rng.uniform(1, 100)
        fi, bo = rng.choice([0.0, rng.uniform(0, 50)]), rng.choice([0.0, rng.uniform(0, 50)])
        ro, ri = rng.choice([0.0, rng.uniform(0, 500)]), rng.choice([0.0, rng.uniform(0, 500)])
        r1 = rng.uniform(1, 10)
        r2 = rng.uniform(r1 / 2, r1)
        fills = [(fo * rng.uniform(0.1, 1), fi * rng.uniform(0.1, 1)) for _ in range(rng.randint(1, 3))]
        drains = [(bo * rng.uniform(0.1, 1), bi * rng.uniform(0.1, 1)) for _ in range(rng.randint(1, 3))]
        x, y = mb * (fo + bo) + ro, mb * (fi + bi) + ri
        lk = {"out": [x], "in": [y], "micro_batches": mb,
              "classes": {"forward": {"out": [fo], "in": [fi]}, "backward": {"out": [bo], "in": [bi]},
                          "reduction": {"out": [ro], "in": [ri]}, "fill": [fills], "drain": [drains]}}
        t, _ = iteration.pipeline_link_bound(lk, r1, r2)
        assert t >= carry(x, y, r1, r2) - 1e-9
        f = min(fills, key=lambda v: carry(*v, r1, r2))
        d = min(drains, key=lambda v: carry(*v, r1, r2))
        feasible = carry(*f, r1, r2) + carry(x - f[0] - d[0], y - f[1] - d[1], r1, r2) + carry(*d, r1, r2)
        assert t <= feasible + 1e-9


def test_a_stored_run_is_reported_again_with_the_fill_and_drain_bound(tmp_path, gpt_plan, monkeypatch):
    res = _fake_result(stock=True)
    lk = iteration.link_bytes(gpt_plan)
    res["link"] = {k: lk[k] for k in ("out", "in", "busiest_host", "busiest_direction", "busiest_bytes")}
    doc = {"machine": "m", "rates_mbit": [10.0, 100.0], "rounds": 1, "seconds": 1.0, "plans": [res]}
    f = tmp_path / "run.json"
    f.write_text(json.dumps(doc))
    monkeypatch.setattr(iteration, "compile_variants",
                        lambda *a, **k: {"1f1b": {"plan": gpt_plan, "out": None}})
    text = iteration.report(str(f))
    assert "Fill and drain" in text and "`python -m benchmarks bench iteration --from-json run.json`" in text
    n = 8 * 64 * 256 * 4
    t10 = 8.5 * n / 1.25e6                     # no calibration: directions independent, nominal rate
    assert f"10 Mbit/s {t10:.3f} s" in text
    # a plan that compiles now to other bytes than the run measured is refused, not reported
    res["link"]["out"] = [1.0, 2.0]
    f.write_text(json.dumps(doc))
    with pytest.raises(iteration.ReportError, match="compiles now to other link bytes than the run measured"):
        iteration.report(str(f))
    assert iteration.main(["--from-json", str(f)]) == 2


def _fake_result(stock: bool) -> dict:
    def prog(ts):
        return {"per_rate": [{"rate": r, "steps": [t], "median": t} for r, t in zip((10.0, 100.0), ts)],
                "peak_rss_kb": {0: 2048, 1: 4096}, "losses": [1.5, 1.25], "launch_s": 3.0}
    programs = {f"planc {s}": prog([4.0, 2.0]) for s in iteration.SCHEDULES}
    if stock:
        programs["stock DeepSpeed"] = prog([5.0, 2.0])
    return {"plan": "plans/x.plan", "name": "x", "hosts": [2, 2], "stages": [2, 2], "micro_batch": 8,
            "micro_batches": 8, "link": {"busiest_bytes": 2.5e6, "busiest_host": 0, "busiest_direction": "out",
                                         "out": [2.5e6, 0], "in": [0, 2.5e6]},
            "stock": {"expressible": stock, "reason": None if stock else "skips to non-adjacent stages",
                      "partition_method": "uniform" if stock else None},
            "programs": programs, "compute_only": {"per_rate": [{"rate": 100.0, "median": 1.0}]},
            "compute_only_runs": [{"when": "before", "per_rate": [{"rate": 100.0, "median": 0.5}]}],
            "signal": {"gpipe": {"per_rate": [{"rate": 100.0, "median": 1.5}]},
                       "1f1b": {"per_rate": [{"rate": 100.0, "median": 1.0}]},
                       "eager_1f1b": {"per_rate": [{"rate": 100.0, "median": None}]}}}


def test_report_ratios_and_not_applicable_rows():
    rs = iteration.rows(_fake_result(stock=True))
    at10 = {r["program"]: r for r in rs if r["rate"] == 10.0}
    assert at10["planc gpipe"]["vs_stock"] == pytest.approx(0.8)
    assert at10["planc gpipe"]["bound"] == pytest.approx(2.0)     # link 2.5 MB / 1.25 MB/s > signal 1 s
    at100 = {r["program"]: r for r in rs if r["rate"] == 100.0}
    assert at100["planc gpipe"]["bound"] == pytest.approx(1.0)    # the fastest signal run (1f1b), not work alone
    assert at10["planc gpipe"]["vs_bound"] == pytest.approx(2.0)
    text = iteration.markdown(_fake_result(stock=True), "10,100")
    assert "| 10 | planc gpipe | 4.000 | 0.80 | 2.00 | 2.000 (1.000, 2.000) |" in text
    assert "`python -m benchmarks bench iteration plans/x.plan --rates 10,100`" in text
    text = iteration.markdown(_fake_result(stock=False), "10,100")
    assert "| 10 | stock DeepSpeed | n/a: skips to non-adjacent stages |" in text
    assert "planc 1f1b 2/4 MB (losses 1.5000, 1.2500; 3.0 s)" in text
    assert "the fastest counts): gpipe 1.500 s, 1f1b 1.000 s, eager_1f1b — s." in text
    assert "compute-only (before) — MB (— s)" in text and "planc 1f1b, signal transfers — MB (— s)" in text


def test_run_bench_passes_options_and_skips_without_a_testbed(monkeypatch, tmp_path):
    from benchmarks import bench

    monkeypatch.setattr("benchmarks.testbed.available", lambda: "no testbed in this test")
    doc = tmp_path / "b.md"
    text = bench.run_bench("iteration", write=str(doc), plans=["plans/gpt-bench-2x2.plan"], rates=[10.0])
    assert text.startswith("_Skipped: no testbed in this test")
    assert "<!-- bench:iteration -->" in doc.read_text()


TINY = """
plan bench_tiny {{
  cluster {{
    level node x 2 : bandwidth 100 MB/s, latency 50 us
    level gpu  x 2 : bandwidth 10 GB/s,  latency 2 us
  }}
  parallel {{ pipe = 2, data = 2, place = [[2, 1], [1, 2]] }}
  model "{mlp}:build" {{ layers = 4, hidden = 16, inputs = 8, outputs = 4 }}
  loss  "{mlp}:loss"
  data  "{mlp}:batches"
  stage 0 : layers 0..2
  stage 1 : layers 2..4
  transfer h : f32[4, 16] from stage 0 as S0 R to stage 1 as S0 R
  reduce gradients over data
  train {{ micro_batch = 4, micro_batches = 2, steps = 2, schedule = 1f1b, optimizer = sgd(lr = 0.1), seed = 3 }}
}}
"""


@pytest.mark.slow
@pytest.mark.testbed
@pytest.mark.skipif(available() is not None, reason=f"testbed unavailable: {available()}")
def test_stock_deepspeed_and_compute_only_run_per_host_in_the_testbed(tmp_path):
    """Stock DeepSpeed on the plan's model and data trains like the single-process reference (the
    same losses; planc's own launches are held to that reference by the e2e tests); the compute-only
    worker prints a step line per step, and the testbed reads every rank's peak memory."""
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file
    from benchmarks.testbed import Testbed

    from e2e_util import extensions_env, independent_reference
    src = tmp_path / "tiny.plan"
    src.write_text(TINY.format(mlp=ROOT / "examples/mlp.py"))
    c = compile_file(src, probe=True)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    assert iteration.stock_reason(c.plan_json) is None
    ref_losses, _ = independent_reference(c.plan_json, out, 2)
    with Testbed(2, 1000) as tb:
        env = extensions_env()
        # each host's ranks started directly (the bench starts them with DeepSpeed's launcher; the
        # testbed's launcher path is test_testbed*.py's subject, stock DeepSpeed's engine this one's)
        stock = tb.launch(out, steps=2, timeout=240, comm_only=False, env=env, launcher="direct",
                          script=ROOT / "benchmarks/bench/stock_deepspeed.py",
                          extra_args=["--out", str(out), "--partition", iteration.stock_partition(c.plan_json)]).check()
        compute = tb.launch(out, steps=2, timeout=240, comm_only=False, env=env, script=Path(iteration.__file__),
                            launcher="direct", extra_args=["--compute-only", "--out", str(out)]).check()
    assert "parts=[0, 2, 4], topology pipe 2 x data 2" in stock.stdout
    assert len(ref_losses) == len(stock.losses) == 2
    assert stock.losses == pytest.approx(ref_losses, rel=1e-4)
    assert len(compute.step_times) == 2
    assert sorted(stock.peak_rss_kb) == [0, 1, 2, 3]
    json.dumps(stock.peak_rss_kb)


def test_compute_parts_reads_the_workers_lines_after_the_warm_up():
    lines = [f"compute-only step {i}: slowest rank alone {a} s, all ranks {2 * b} s on 2 cores {b} s, "
             f"per rank [0.1, 0.2]" for i, (a, b) in enumerate([(9.0, 9.0), (0.4, 0.7), (0.5, 0.8), (0.3, 0.9)])]
    assert iteration.compute_parts({"details": lines}) == (0.4, 0.8, 2)
    assert iteration.compute_parts({}) is None


class _Bar:
    """A stand-in for planc.commands.ui.Bar that records what the bench tells it."""

    def __init__(self):
        self.done, self.items = 0, []

    def advance(self, n=1, item=None):
        self.done += n
        self.items.append(item)

    def update(self, item):
        self.items.append(item)


class _Testbed:
    """Runs ``steps_run`` of a launch's steps (fewer: a launch that died), calling ``on_step`` as the
    real testbed does, and records the link rate set before each step."""

    def __init__(self, steps_run=None):
        self.steps_run, self.rates, self.rate = steps_run, [], None

    def set_link_mbit(self, rate):
        self.rate = rate

    def launch(self, out, steps, on_step, **_):
        from benchmarks.testbed.result import LaunchResult
        n = steps if self.steps_run is None else self.steps_run
        times = []
        for i in range(n):
            self.rates.append(self.rate)
            times.append(0.1 * (i + 1))
            on_step(i, times[-1])
        return LaunchResult(returncode=0 if n == steps else 1, stdout="", step_times=times)


def test_progress_bar_counts_every_step_of_every_launch(tmp_path):
    """The bar advances once per step (the rate shown is the segment's), and a launch that stops
    early still completes its share, so a bench's bar ends at its total."""
    tb, bar = _Testbed(), _Bar()
    rates = [10.0, 100.0]
    res = iteration._over_rates(tb, tmp_path, rates, measured=2, timeout=1, bar=bar, what="planc 1f1b")
    total = iteration.launch_steps(rates, 2)
    assert total == (iteration.WARMUP + 2) * 2 and bar.done == total
    assert tb.rates == [10.0] * (total // 2) + [100.0] * (total // 2)       # the rates the steps ran at
    shown = [i for i in bar.items if i and "@" in i]
    assert shown[0] == "planc 1f1b @ 10 Mbit/s" and "planc 1f1b @ 100 Mbit/s" in shown
    assert [r["median"] is not None for r in res["per_rate"]] == [True, True]
    dead, bar2 = _Testbed(steps_run=1), _Bar()
    res = iteration._over_rates(dead, tmp_path, rates, measured=2, timeout=1, bar=bar2, what="stock DeepSpeed")
    assert bar2.done == total and "error" in res
    # without a bar (piped): the same measurement
    assert iteration._over_rates(_Testbed(), tmp_path, rates, measured=2, timeout=1)["per_rate"] == \
        iteration._over_rates(_Testbed(), tmp_path, rates, measured=2, timeout=1, bar=_Bar())["per_rate"]


def test_runs_launched_per_rate_merge_into_one_program_row():
    """Under a calibrated cluster each rate's program is compiled and launched on its own; the
    report reads them as one run: rates in order, every step, each rank's highest peak, the first error."""
    def run(rate, times, rss, rc=0, error=None):
        r = {"returncode": rc, "launch_s": 10.0, "step_times": times, "details": [], "losses": [5.0, 4.9],
             "peak_rss_kb": rss, "per_rate": [{"rate": rate, "steps": times[1:], "median": times[-1]}]}
        if error:
            r["error"] = error
        return r
    merged = iteration._merge_runs([run(25.0, [2.0, 1.8], {0: 100, 1: 90}),
                                    run(100.0, [1.0], {0: 120, 1: 80}, rc=1, error="exit 1: boom")])
    assert [p["rate"] for p in merged["per_rate"]] == [25.0, 100.0]
    assert merged["step_times"] == [2.0, 1.8, 1.0] and merged["launch_s"] == 20.0 and merged["launches"] == 2
    assert merged["peak_rss_kb"] == {0: 120, 1: 90}
    assert merged["returncode"] == 1 and merged["error"] == "exit 1: boom" and merged["losses"] == [5.0, 4.9]
    assert "error" not in iteration._merge_runs([run(25.0, [2.0, 1.8], {0: 1})])


def test_rounds_launch_the_programs_round_robin_and_pool_their_steps(monkeypatch, tmp_path, gpt_plan):
    """``--rounds 2``: gpipe, 1f1b, eager_1f1b, stock, gpipe, ... (a load drift falls on every program
    alike); each program's median is over the steps of both rounds, each round's median kept, and the
    report gives each round's eager ÷ 1f1b and best ÷ stock."""
    order = []

    class Recording(_Testbed):
        def __init__(self, *_a, **_k):
            super().__init__()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def launch(self, out, steps, on_step, script=None, env=None, **kw):
            signal = out.name.endswith("-signal")   # a copy whose plan.json says runtime.signal_transfers
            assert signal == json.loads((out / "plan.json").read_text())["runtime"]["signal_transfers"]
            what = ("compute" if script and "compute_only" in str(script) else
                    "stock" if script else "signal " + out.name[:-len("-signal")] if signal else out.name)
            order.append(what)
            # round k: eager_1f1b's steps take (k + 1) s, the others' stay: the rounds' ratios differ
            k = sum(1 for w in order if w == what) - 1
            base = {"gpipe": 3.0, "1f1b": 2.0, "eager_1f1b": 1.0 + k, "stock": 4.0}.get(what, 0.5)
            for i in range(steps):
                on_step(i, base)
            from benchmarks.testbed.result import LaunchResult
            return LaunchResult(returncode=0, stdout="", step_times=[base] * steps)

    def variants(plan_path, tmp, cluster, rate):
        for s in iteration.SCHEDULES:
            (tmp_path / s).mkdir(exist_ok=True)
            (tmp_path / s / "plan.json").write_text(json.dumps(gpt_plan))
        return {s: {"out": tmp_path / s, "plan": gpt_plan} for s in iteration.SCHEDULES}

    monkeypatch.setattr("benchmarks.testbed.Testbed", Recording)
    monkeypatch.setattr(iteration, "compile_variants", variants)
    res = iteration.measure_plan("plans/gpt-bench-2x2.plan", [100.0], measured=2, rounds=2)
    programs = [w for w in order if w in ("gpipe", "1f1b", "eager_1f1b", "stock")]
    assert programs == ["gpipe", "1f1b", "eager_1f1b", "stock"] * 2
    assert order[0] == "compute" and order[-3:] == ["signal gpipe", "signal 1f1b", "signal eager_1f1b"]
    eager = res["programs"]["planc eager_1f1b"]["per_rate"][0]
    assert eager["round_medians"] == [1.0, 2.0] and eager["steps"] == [1.0, 1.0, 2.0, 2.0]
    assert eager["median"] == 1.5 and res["rounds"] == 2
    ratios = iteration.round_ratios(res)
    # each round from its own medians (round 2: eager 2.0 ties 1f1b), not from the pooled 1.5
    assert [(r["round"], r["eager_vs_1f1b"], r["best_vs_stock"]) for r in ratios] == [(1, 0.5, 0.25), (2, 1.0, 0.5)]
    text = iteration.markdown(res, "100 --rounds 2")
    assert "- 100 Mbit/s: eager_1f1b ÷ 1f1b 0.50, 1.00; planc's best ÷ stock DeepSpeed 0.25, 0.50" in text
    # one round: no per-round lines, and the steps are the launch's own
    order.clear()
    one = iteration.measure_plan("plans/gpt-bench-2x2.plan", [100.0], measured=2)
    assert "round_medians" not in one["programs"]["planc 1f1b"]["per_rate"][0]
    assert "Per round" not in iteration.markdown(one, "100")


def test_rounds_of_repeated_rates_pool_by_position():
    def run(medians):
        return {"returncode": 0, "launch_s": 1.0, "step_times": [], "details": [], "losses": [],
                "peak_rss_kb": {}, "per_rate": [{"rate": 100.0, "steps": [m, m], "median": m} for m in medians]}
    pooled = iteration._pool_rounds([run([1.0, 2.0]), run([3.0, 4.0])])
    assert [p["round_medians"] for p in pooled["per_rate"]] == [[1.0, 3.0], [2.0, 4.0]]
    failed = iteration._pool_rounds([run([1.0, 2.0]), run([None, 4.0])])
    assert [p["median"] for p in failed["per_rate"]] == [None, 3.0]   # a failed round: no pooled median


def test_rounds_and_measured_reach_the_bench(monkeypatch, capsys):
    from benchmarks import bench
    from benchmarks.cli import main

    seen = {}
    monkeypatch.setattr(bench, "run_bench", lambda name, write=None, **options: seen.update(options) or "ok\n")
    assert main(["bench", "iteration", "--rounds", "3", "--measured", "4"]) == 0
    assert seen["rounds"] == 3 and seen["measured"] == 4
    with pytest.raises(ValueError, match="at least 1"):
        iteration.run(["plans/gpt-bench-2x2.plan"], [100.0], measured=0)


def test_rounds_must_be_positive(capsys):
    from benchmarks.cli import main

    assert main(["bench", "iteration", "--rounds", "0"]) == 2
    assert "--rounds 0: must be at least 1" in capsys.readouterr().err
    assert main(["bench", "synthesis", "--rounds", "3"]) == 2
    assert "takes no --rounds" in capsys.readouterr().err
    assert main(["bench", "iteration", "--measured", "0"]) == 2
    assert "--measured 0: must be at least 1" in capsys.readouterr().err


def test_the_both_ways_link_time_is_reported_where_the_cluster_file_measured_it():
    """A calibrated cluster's ``both_ways`` (bytes/s a direction keeps while the other is busy) gives a
    second link time and ratio; without it (no --cluster, or a file without the figure) there is none."""
    res = _fake_result(stock=True)
    assert all(r["link_both_ways"] is None and r["vs_bound_both_ways"] is None for r in iteration.rows(res))
    assert "Both ways" not in iteration.markdown(res, "10,100")
    res["both_ways"] = {"10": 1.0e6, "100": None}
    at = {(r["rate"], r["program"]): r for r in iteration.rows(res)}
    assert at[(10.0, "planc 1f1b")]["link_both_ways"] == pytest.approx(2.5)        # 2.5 MB / 1 MB/s
    assert at[(10.0, "planc 1f1b")]["vs_bound_both_ways"] == pytest.approx(4.0 / 2.5)
    assert at[(100.0, "planc 1f1b")]["link_both_ways"] is None
    text = iteration.markdown(res, "10,100")
    assert "the same bytes take 10 Mbit/s 2.500 s; planc's best ÷ max(signal, that): 10 Mbit/s 1.60 (gpipe)." in text


def test_from_json_bad_inputs_are_named_without_a_traceback(tmp_path, capsys):
    from benchmarks.cli import main

    missing = tmp_path / "nope.json"
    assert main(["bench", "iteration", "--from-json", str(missing)]) == 2
    assert f"--from-json {missing}: no such file" in capsys.readouterr().err
    f = tmp_path / "run.json"
    f.write_text("{}")
    assert main(["bench", "iteration", "--from-json", str(f), "--rates", "10"]) == 2
    assert "it takes only --cluster and --write" in capsys.readouterr().err
    assert main(["bench", "synthesis", "--from-json", str(f)]) == 2
    assert "takes no --from-json (only iteration does)" in capsys.readouterr().err
    assert main(["bench", "iteration", "--from-json", str(f)]) == 2
    assert "not a stored run of `python -m benchmarks bench iteration --json` (KeyError" in capsys.readouterr().err


def test_cpus_per_rank_reaches_every_launch_and_the_header(monkeypatch, tmp_path, gpt_plan):
    """``--cpus-per-rank``: the testbed runs every rank under that quota, the result and the header say
    which; quotas over the machine's cores are refused before any launch; without it nothing changes."""
    made = []

    class Quotad(_Testbed):
        def __init__(self, *_a, **k):
            super().__init__()
            made.append(k.get("cpus_per_rank"))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def variants(plan_path, tmp, cluster, rate):
        return {s: {"out": tmp_path, "plan": gpt_plan} for s in iteration.SCHEDULES}

    monkeypatch.setattr("benchmarks.testbed.Testbed", Quotad)
    monkeypatch.setattr(iteration, "compile_variants", variants)
    monkeypatch.setattr(iteration, "variant", lambda out, *a, **k: out)
    monkeypatch.setattr(iteration, "cores_available", lambda: 2)
    res = iteration.measure_plan("plans/gpt-bench-2x2.plan", [100.0], measured=1, cpus_per_rank="auto")
    assert made == [0.5] and res["cpus_per_rank"] == 0.5
    note = iteration.quota_note([res])
    assert note.startswith(" Ranks of `gpt_bench_2x2` under CPU quotas: 0.5 CPU per rank (")
    with pytest.raises(iteration.quota.QuotaError, match="= 4 cores of quota, more than the 2 cores"):
        iteration.measure_plan("plans/gpt-bench-2x2.plan", [100.0], measured=1, cpus_per_rank=1.0)
    assert made == [0.5]                                   # refused before a testbed was made
    plain = iteration.measure_plan("plans/gpt-bench-2x2.plan", [100.0], measured=1)
    assert made == [0.5, None] and "cpus_per_rank" not in plain and iteration.quota_note([plain]) == ""
