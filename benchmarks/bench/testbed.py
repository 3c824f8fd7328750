"""`python -m benchmarks bench testbed`: strategies and reduction programs measured on an emulated cluster.

Two network namespaces (hosts) of 4 gloo ranks each (three for the 1 -> (2,4)
fan-out, on a testbed of its own after the others), host links shaped to
400 Mbit/s (50 MB/s) by tc; inside a host ranks talk over the namespace's own
stack (≈ 3 GB/s, DESIGN.md). The plans below declare exactly these bandwidths,
so the cost model's predictions and the measured times are in the same units.
Every case is compiled by planc, launched with ``train.py --comm-only`` inside
one testbed (all cases side by side, one after the other) and timed by the
program itself; every byte moved is checked by it.

Needs root and iproute2 (``ip``, ``tc``); otherwise ``run()`` returns a note
saying why it was skipped.

A fault can be injected for real (benchmarks/testbed/faults.py; docs/testbed.md
"Faults"): ``PLANC_BENCH_LINK_DOWN=SECONDS[@HOST]`` takes HOST's link (default
the last host) down that long after rank 0's first step of the first case; the
bench then stops with the launch's account on stderr and exits 1.
``PLANC_BENCH_COLLECTIVE_TIMEOUT_S`` is the collective timeout its launches' plans get (default 120 s).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.variant import variant
from planc.plan import InHost

HOSTS, PER_HOST, LINK_MBIT = 2, 4, 400.0
WIDE_HOSTS = 3             # the 1 -> (2,4) fan-out: one device on host 0, a mesh over hosts 1 and 2
STEPS = 4                  # step 0 warms up; the median of steps 1..3 is reported
STRATEGIES = ("send_recv", "local_allgather", "global_allgather", "broadcast")
LINK_DOWN_ENV = "PLANC_BENCH_LINK_DOWN"        # SECONDS[@HOST]: a host link goes down during the first case


class BenchFailed(SystemExit):
    """The bench cannot go on (a fault broke a launch): ``python -m benchmarks bench`` exits 1 with the message
    printed to stderr; the testbed is removed by then."""

    def __init__(self, message: str):
        super().__init__(1)
        self.message = message

    def __str__(self) -> str:
        return self.message


CLUSTER = """
  cluster {
    level node x 2 : bandwidth 50 MB/s, latency 100 us
    level gpu  x 4 : bandwidth 3 GB/s,  latency 20 us
  }
"""

# 16 MB from one device on host 0 to a mesh on the other host(s), replicated on every receiver
FANOUT = """
plan NAME {{{CLUSTER}
  stage 0 on devices 0..1 as (1, 1)
  stage 1 on devices MESH
  transfer x : f32[1024, 4096] from stage 0 as R R to stage 1 as R R
  resharding {{ strategy = {STRATEGY}, chunks = 32, schedule = load_balance }}
}}
"""

TRANSFERS = {
    # to a (1,4) mesh on host 1
    "1 -> (1,4)  R R -> R R": FANOUT.replace("NAME", "tb_fanout").replace("MESH", "4..8 as (1, 4)"),
    # n-to-m between two (2,2) meshes on different hosts, sharded along different dimensions
    "(2,2) -> (2,2)  R S0 -> S0 R": """
plan tb_n2m {{{CLUSTER}
  stage 0 on devices 0..4 as (2, 2)
  stage 1 on devices 4..8 as (2, 2)
  transfer x : f32[1024, 4096] from stage 0 as R S0 to stage 1 as S0 R
  resharding {{ strategy = {STRATEGY}, chunks = 32, schedule = load_balance }}
}}
""",
}

# issue 9's "broadcast 1 -> (2, 4)": to a (2,4) mesh spanning hosts 1 and 2, all 8 receivers
# replicated; its own testbed of 3 hosts (the other cases need 2)
WIDE = {"1 -> (2,4)  R R -> R R": FANOUT.replace("NAME", "tb_fanout_wide").replace("MESH", "4..12 as (2, 4)")}

HIERARCHICAL = ("reduce_scatter(slice=node, form=inside); allreduce(slice=node, form=parallel(root)); "
                "all_gather(slice=node, form=inside)")
PROGRAMS = {"allreduce (flat)": "allreduce", "hierarchical": HIERARCHICAL}
# the same program again with its in-host steps over gloo's loopback instead of shared memory
# (docs/runtime.md): the measured case for keeping shared memory, side by side in every run
GLOO_IN_HOST = {"hierarchical, in-host steps over gloo": ("hierarchical", {"in_host": InHost.BACKEND})}
REDUCTION = """
plan tb_reduce {{{CLUSTER}
  stage 0 on devices 0..8 as (data = 8)
  reduce grads over data using {PROGRAM} : f32[4194304]
}}
"""


def skipped_note() -> str | None:
    """A testbed bench's whole section where the testbed cannot be built here (why, and what it needs);
    None where it can."""
    from benchmarks.testbed import available
    why = available()
    return f"_Skipped: {why}. The testbed needs root and iproute2 (`ip`, `tc`); see docs/testbed.md._\n" if why else None


def _compile(text: str, out: Path) -> dict:
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file

    out.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(".plan")
    src.write_text(text)
    compiled = compile_file(src, probe=False)
    write_output(compiled.plan_json, compiled.program, out)
    return compiled.plan_json


def _transfer_cases(tmp: Path, templates: dict, cluster: str, hosts: int, tag: str) -> list[dict]:
    cases = []
    for i, (name, tmpl) in enumerate(templates.items()):
        for strategy in STRATEGIES:
            text = tmpl.format(CLUSTER=cluster, STRATEGY=strategy)
            out = tmp / f"{tag}{i}_{strategy}"
            plan = _compile(text, out)
            t = plan["transfers"][0]
            assert t["strategy"] == strategy, (t["strategy"], strategy)
            cases.append({"kind": "transfer", "case": name, "what": strategy, "out": out, "hosts": hosts,
                          "predicted": float(t["makespan"]), "bound": float(t["lower_bound"])})
    return cases


def _cases(tmp: Path) -> list[dict]:
    """Every case, the 2-host ones first (they share one testbed), then the 3-host fan-out."""
    cases = _transfer_cases(tmp, TRANSFERS, CLUSTER.rstrip(), HOSTS, "t")
    for label, program in PROGRAMS.items():
        text = REDUCTION.format(CLUSTER=CLUSTER.rstrip(), PROGRAM=program)
        out = tmp / f"r_{label.split()[0]}"
        plan = _compile(text, out)
        r = plan["reductions"][0]
        cases.append({"kind": "reduction", "case": "8 ranks, 16 MB f32", "what": label, "hosts": HOSTS,
                      "text": r["program"]["text"], "out": out, "predicted": float(r["program"]["predicted"])})
    for label, (base, runtime) in GLOO_IN_HOST.items():
        same = next(c for c in cases if c["kind"] == "reduction" and c["what"] == base)
        cases.append({**same, "what": label, "out": variant(same["out"], "gloo-in-host", **runtime)})
    wide = CLUSTER.replace(f"level node x {HOSTS}", f"level node x {WIDE_HOSTS}").rstrip()
    return cases + _transfer_cases(tmp, WIDE, wide, WIDE_HOSTS, "w")


def _fmt(x: float | None, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def parse_link_down(text: str | None) -> tuple[float, int] | None:
    """``PLANC_BENCH_LINK_DOWN``'s value ``SECONDS[@HOST]`` as (seconds, host); None when unset."""
    if not text:
        return None
    after, _, host = text.partition("@")
    try:
        seconds, h = float(after), int(host) if host else HOSTS - 1
    except ValueError:
        raise ValueError(f"{LINK_DOWN_ENV}={text!r}: expected SECONDS[@HOST], e.g. 2 or 2@1") from None
    if seconds < 0 or not 0 <= h < HOSTS:
        raise ValueError(f"{LINK_DOWN_ENV}={text!r}: SECONDS must be >= 0 and HOST one of 0..{HOSTS - 1}")
    return seconds, h


def measure(steps: int = STEPS, timeout: float = 120, *, link_down: tuple[float, int] | None = None,
            collective_timeout: float | None = None, progress: bool = True) -> list[dict]:
    """Compile every case and run it on one testbed; adds ``measured`` (median s/step) or ``error``.

    ``link_down=(seconds, host)``: host's link goes down that long after rank 0's first step of the
    first case (a real fault, ``Testbed.link_down``); when that launch fails the bench stops with
    ``BenchFailed`` (the launch's account). ``collective_timeout``: the ranks' (default 120 s); each
    case is killed after ``timeout`` + ``collective_timeout`` seconds.
    ``progress``: one bar over the cases (``planc.commands.ui.progress``, stderr)."""
    from planc.commands import ui
    from benchmarks.testbed import Testbed

    collective_timeout = collective_timeout or max(30.0, float(timeout))
    with tempfile.TemporaryDirectory(prefix="planc-bench-testbed-") as tmp:
        cases = _cases(Path(tmp))
        # one bar over every case; one testbed per host count (the 2-host cases first, in order)
        items = ui.progress(cases, "bench testbed", describe=lambda c: f"{c['case']}: {c['what']}",
                            piped="lines") if progress else iter(cases)
        try:
            for hosts in dict.fromkeys(c["hosts"] for c in cases):   # in the cases' order
                mine = [c for c in cases if c["hosts"] == hosts]
                with Testbed(hosts, LINK_MBIT) as tb:
                    _run_cases(tb, cases, (next(items) for _ in mine), steps, timeout,
                               link_down if hosts == HOSTS else None, collective_timeout)
        finally:
            if hasattr(items, "close"):
                items.close()     # the bar ends before the error is printed
    return cases


def _run_cases(tb, cases: list[dict], items, steps: int, timeout: float, link_down,
               collective_timeout: float) -> None:
    """Launch each case in turn (``items``: the cases, through the progress bar); see ``measure``."""
    for i, c in enumerate(items):
        timers: list[threading.Timer] = []

        def on_step(n, seconds, tb=tb):
            if not timers:
                timers.append(threading.Timer(link_down[0], tb.link_down, args=(link_down[1],)))
                timers[0].daemon = True
                timers[0].start()
        fault = link_down is not None and i == 0
        try:
            # a stuck case may wait out one collective timeout after its start-up: it ends by itself
            r = tb.launch(c["out"], steps=steps, timeout=timeout + collective_timeout,
                          on_step=on_step if fault else None, collective_timeout=collective_timeout, progress=False)
        finally:
            for t in timers:
                t.cancel()
        times = r.step_times[1:] if len(r.step_times) > 1 else r.step_times
        if r.returncode != 0 or not times:
            c["measured"], c["error"] = None, f"failed ({'timeout' if r.timed_out else r.returncode})"
            if fault and any("link set down" in what for _, what in r.events):
                what = "timed out" if r.timed_out else f"failed (exit {r.returncode})"
                raise BenchFailed(
                    f"benchmarks bench testbed: case {c['case']!r} ({c['what']}) {what} after host "
                    f"{link_down[1]}'s link went down (collective timeout {collective_timeout:g} s); "
                    f"the other {len(cases) - 1} case(s) were not run and the testbed is removed:\n"
                    f"{r.failure or r.stdout[-2000:]}")
        else:
            c["measured"] = statistics.median(times)
            c["steps"] = list(times)     # the spread `python -m benchmarks bench accuracy` judges orderings against
        c["launch_s"] = r.seconds
        c.pop("out")


def table(cases: list[dict]) -> str:
    lines = ["| case | strategy / program | measured s/step | ÷ baseline (measured) | predicted s | "
             "÷ baseline (predicted) | lower bound s |",
             "|---|---|---|---|---|---|---|"]
    for c in cases:
        base_name = "send_recv" if c["kind"] == "transfer" else "allreduce (flat)"
        base = next(b for b in cases if b["case"] == c["case"] and b["what"] == base_name)
        mr = c["measured"] / base["measured"] if c.get("measured") and base.get("measured") else None
        pr = c["predicted"] / base["predicted"] if base["predicted"] else None
        measured = c.get("error") or _fmt(c["measured"])
        what = c["what"] if c["kind"] == "transfer" else f"{c['what']}: `{c['text']}`"
        lines.append(f"| {c['case']} | {what} | {measured} | {_fmt(mr, 2)} | {_fmt(c['predicted'])} | "
                     f"{_fmt(pr, 2)} | {_fmt(c.get('bound'))} |")
    return "\n".join(lines)


def run() -> str:
    if note := skipped_note():
        return note
    import torch

    try:
        link_down = parse_link_down(os.environ.get(LINK_DOWN_ENV))
        text = os.environ.get("PLANC_BENCH_COLLECTIVE_TIMEOUT_S") or "120"
        try:
            limit = float(text)
        except ValueError:
            limit = float("nan")
        if not limit > 0:
            raise ValueError(f"PLANC_BENCH_COLLECTIVE_TIMEOUT_S must be positive seconds, not {text!r}")
    except ValueError as e:
        print(f"benchmarks bench testbed: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    t0 = time.monotonic()
    try:
        cases = measure(link_down=link_down, collective_timeout=limit)
    except BenchFailed as e:
        print(e.message, file=sys.stderr)
        raise
    took = time.monotonic() - t0
    head = (f"Testbed: {HOSTS} hosts × {PER_HOST} gloo ranks ({WIDE_HOSTS} hosts for 1 -> (2,4)), host links {LINK_MBIT:g} Mbit/s (tbf, each "
            f"direction); measured = median of steps 1–{STEPS - 1} as `train.py --comm-only` prints them "
            f"(only the communication, between two barriers: patterns are made before and checked after); baseline = send_recv for transfers, "
            f"flat allreduce for reductions. Machine: {os.cpu_count()} CPU cores ({platform.machine()}), "
            f"Python {platform.python_version()}, torch {torch.__version__}; the whole bench took {took:.0f} s.")
    return head + "\n\n" + table(cases) + "\n"


if __name__ == "__main__":   # pragma: no cover
    print(run())
