"""`python -m benchmarks bench accuracy`: the simulator's and cost model's predictions against measurements.

Given a cluster file written by ``planc calibrate`` and the measurements of
``python -m benchmarks.bench.iteration ... --json F`` (schedules of each plan at each
link rate) and/or of ``python -m benchmarks bench testbed`` (a JSON list of the cases
``benchmarks.bench.testbed.measure()`` returns: that bench has no ``--json`` of its
own), every measured case is predicted under the calibrated cluster at the
case's link rate:

* an iteration case (plan, ``planc SCHEDULE``, rate): the plan recompiled with
  its cluster's host level and the levels below replaced by the calibrated
  figures (the plan keeps its fanouts), the device ``flops`` the calibrated
  one; the prediction is plan.json ``pipeline.predicted.schedules[SCHEDULE]``
  (planc.pipeline.simulate); stock DeepSpeed is not simulated (its row says so);
* a testbed case (transfer strategy or reduction program): the bench's plan
  text with the calibrated cluster, compiled without probe; the prediction is
  the transfer's ``makespan`` or the reduction program's ``predicted``.

The host link at rate r: the calibrated host bandwidth measured at the nearest
calibrated rate, scaled by r over that rate (the link is the shaper), and its
latency; a calibration without host measurements uses the nominal rate and no
latency. Reported: per case predicted, measured and |p - m| / m; their median;
the fraction of pairs of alternatives (schedules of one plan at one rate,
strategies of one transfer, programs of one reduction) that the predictions
order as the measurements do; and per group whether the predicted best is the
measured best (docs/calibrate.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


SATURATED = 0.8   # a calibrated rate whose link moved less than this share of it was not shaper-limited


class AccuracyError(ValueError):
    """A bad input: a file that is missing or not what it should be."""


# ---------------------------------------------------------------- the calibrated cluster

@dataclasses.dataclass(frozen=True)
class Calibrated:
    path: str
    levels: tuple            # ir.Level of the file (host level first)
    host_index: int
    flops: float | None
    by_rate: tuple           # ((rate_mbit, bandwidth, latency, both_ways or None), ...) of the host level
    cores: int | None = None          # the file's `cores` (testbed: the machine's, per cluster)
    cores_per_host: bool = False      # True: per unit of the host level; False: one pool for the cluster
    op_overhead: float | None = None      # the runtime's own seconds per instruction and per step
    step_overhead: float | None = None

    def _entry(self, rate: float) -> tuple[tuple, float]:
        """The ``by_rate`` entry a request at ``rate`` Mbit/s scales from, and the bytes/s no scaling may
        pass. An entry measured well below its nominal rate (under ``SATURATED`` of it: the shaper was
        not what limited it, e.g. ``10000`` on a veth that moves 3.8 Gbit/s) is the machine's ceiling,
        not a rate to scale: a request at its exact rate gets it as measured; any other request scales
        from the nearest (in log) entry the shaper did limit, capped at the lowest ceiling."""
        limited = [e for e in self.by_rate if e[1] >= SATURATED * e[0] * 1e6 / 8]
        top = max((e[0] for e in limited), default=0.0)
        # a ceiling is a rate above every shaper-limited one that moved less than its nominal share (a low
        # rate measured a little under its nominal is protocol overhead, still the shaper's rate)
        ceilings = [e for e in self.by_rate if e not in limited and e[0] > top]
        shaped = [e for e in self.by_rate if e not in ceilings]
        exact = [e for e in self.by_rate if e[0] == rate]
        if exact:
            return exact[0], math.inf
        cap = min((e[1] for e in ceilings), default=math.inf)
        if not shaped:   # only the machine's ceiling: the nominal rate up to it
            e = min(ceilings, key=lambda e: e[1])
            return (rate, min(rate * 1e6 / 8, e[1]), e[2], e[3]), math.inf
        return min(shaped, key=lambda e: abs(math.log(e[0] / rate))), cap

    def host(self, rate: float | None) -> tuple[float | None, float, str]:
        """(bandwidth, latency, how) of the host link at ``rate`` Mbit/s."""
        lvl = self.levels[self.host_index]
        if rate is None:
            return lvl.bandwidth, lvl.latency, "as calibrated"
        if self.by_rate:
            (r0, bw, lat, _), cap = self._entry(rate)
            scaled = min(bw * rate / r0, cap)
            how = f"calibrated at {r0:g} Mbit/s" + ("" if r0 == rate else ", scaled")
            return scaled, lat, how + (", at the unshaped ceiling" if scaled == cap else "")
        if lvl.fanout > 1 and lvl.bandwidth:
            return lvl.bandwidth, lvl.latency, "as calibrated (unshaped)"
        return rate * 1e6 / 8, 0.0, "nominal rate (host link not calibrated)"

    def both_ways(self, rate: float | None) -> float | None:
        """The host link's bytes/s per direction while it carries data both ways, at ``rate`` (None: not
        measured), from the same calibrated rate as :meth:`host`, scaled the same way (and never above
        what :meth:`host` gives one way)."""
        lvl = self.levels[self.host_index]
        if rate is not None and self.by_rate:
            (r0, _, _, both), _ = self._entry(rate)
            return None if both is None else min(both * rate / r0, self.host(rate)[0])
        return lvl.both_ways if lvl.fanout > 1 and lvl.bandwidth else None

    def inner(self):
        below = self.levels[self.host_index + 1:]
        return next((l for l in below if l.fanout > 1 and l.bandwidth), None)


def read_calibrated(path: str | Path) -> Calibrated:
    """The cluster file through planc's own loader (its errors are PlanErrors), plus its per-rate record."""
    import yaml

    from planc.lang import load_text

    p = Path(path)
    if not p.is_file():
        raise AccuracyError(f"benchmarks bench accuracy: cluster file {path} not found")
    program = load_text(f'cluster "{p.name}"\n', str(p.resolve().parent / "_calibrated.plan"))
    c = program.cluster
    doc = yaml.safe_load(p.read_text()) or {}
    rec = (doc.get("cluster", doc) if isinstance(doc, dict) else {}).get("calibration") or {}
    by_rate = tuple((float(e["rate_mbit"]), float(e["bandwidth"]), float(e["latency"]),
                     float(e["both_ways"]) if e.get("both_ways") else None)
                    for e in rec.get("by_rate") or () if e.get("rate_mbit"))
    cores_level = getattr(c, "cores_level", None)
    if c.cores is not None and cores_level not in (None, c.host_level):
        raise AccuracyError(f"benchmarks bench accuracy: cluster file {path}: cores per level '{cores_level}' cannot "
                            f"be carried over to other plans (use 'cores_per: cluster' or the host level)")
    return Calibrated(str(path), c.levels, c.host_index, c.flops, by_rate, c.cores,
                      c.cores is not None and cores_level is not None, c.op_overhead, c.step_overhead)


def substitute(cluster, cal: Calibrated, rate: float | None):
    """``cluster`` (an ir.Cluster) with the calibrated figures at ``rate``: levels at and above the
    host level get the host link's, levels below it the calibrated device level's; fanouts kept."""
    from planc import ir

    bw, lat, _ = cal.host(rate)
    both = cal.both_ways(rate)
    both = min(both, bw) if both and bw else None
    inner = cal.inner()
    levels = []
    for i, l in enumerate(cluster.levels):
        if l.fanout == 1:
            levels.append(l)
        elif i <= cluster.host_index and bw:
            levels.append(dataclasses.replace(l, bandwidth=bw, latency=lat, both_ways=both))
        elif i > cluster.host_index and inner is not None:
            levels.append(dataclasses.replace(l, bandwidth=inner.bandwidth, latency=inner.latency))
        else:
            levels.append(l)
    cores, cores_level = cluster.cores, cluster.cores_level
    if cal.cores is not None:   # the calibrated machine's cores replace the plan's
        cores, cores_level = cal.cores, (cluster.host_level if cal.cores_per_host else None)
    return ir.Cluster(tuple(levels), cluster.host_level, cal.flops or cluster.flops, cluster.memory,
                      cores, cores_level,
                      cal.op_overhead if cal.op_overhead is not None else cluster.op_overhead,
                      cal.step_overhead if cal.step_overhead is not None else cluster.step_overhead)


# ---------------------------------------------------------------- predicting the cases

def _plan_path(p: str) -> Path:
    path = Path(p)
    return path if path.exists() else ROOT / p


def compiled_at_rates(program, cal: Calibrated, rates):
    """``(rate, plan.json)`` of ``program`` compiled under ``cal`` at each link rate, the model probed
    once (under the first rate's cluster: the probe does not depend on the links)."""
    from planc.driver.compile import compile_program
    from planc.model.probe import probe_model

    probe = probe_model(dataclasses.replace(program, cluster=substitute(program.cluster, cal, rates[0])))
    for rate in rates:
        yield rate, compile_program(dataclasses.replace(program, cluster=substitute(program.cluster, cal, rate)),
                                    probe).plan_json


def iteration_cases(doc: dict, cal: Calibrated, source: str) -> list[dict]:
    """One row per (plan, program, rate) of a ``bench iteration`` JSON, each with its prediction."""
    from planc.lang import load

    rows = []
    for res in doc.get("plans") or ():
        path = _plan_path(res["plan"])
        if not path.exists():
            raise AccuracyError(f"benchmarks bench accuracy: {source}: plan {res['plan']} not found")
        program = load(path)
        rates = sorted({float(r["rate"]) for run in res["programs"].values() for r in run["per_rate"]})
        predicted = {}
        for rate, plan_json in compiled_at_rates(program, cal, rates):
            pred = (plan_json.get("pipeline") or {}).get("predicted") or {}
            predicted[rate] = {s: v.get("iteration") for s, v in (pred.get("schedules") or {}).items()}
        for name, run in res["programs"].items():
            for r in run["per_rate"]:
                rate = float(r["rate"])
                sched = name[len("planc "):] if name.startswith("planc ") else None
                p = predicted[rate].get(sched) if sched else None
                note = None if p is not None else ("not predicted: stock DeepSpeed's engine is not simulated"
                                                   if sched is None else "not predicted (plan.json has no prediction)")
                rows.append({"source": source, "group": f"{res.get('name', path.stem)} at {rate:g} Mbit/s",
                             "alternatives": "schedules", "alternative": name, "rate_mbit": rate,
                             "predicted": p, "measured": r.get("median"), "note": note,
                             "host_link": cal.host(rate)[2], "samples": _samples(r)})
    return rows


def _testbed_cluster_text(cal: Calibrated, rate: float, hosts: int, per_host: int) -> str:
    bw, lat, _ = cal.host(rate)
    both = cal.both_ways(rate)
    both = min(both, bw) if both and bw else None
    inner = cal.inner()
    ib, il = (inner.bandwidth, inner.latency) if inner else (3e9, 20e-6)
    return (f"\n  cluster {{\n    level node x {hosts} : bandwidth {bw / 1e6:.6f} MB/s, latency {lat * 1e6:.4f} us\n"
            f"    level gpu  x {per_host} : bandwidth {ib / 1e6:.6f} MB/s, latency {il * 1e6:.4f} us\n  }}")


def testbed_cases(cases: list, cal: Calibrated, source: str, rate: float | None = None) -> list[dict]:
    """One row per case of ``benchmarks.bench.testbed.measure()``'s list, predicted under the calibrated cluster."""
    from benchmarks.bench import testbed as tb
    from planc.driver.compile import compile_file

    rate = float(rate or tb.LINK_MBIT)
    text = _testbed_cluster_text(cal, rate, tb.HOSTS, tb.PER_HOST)
    wide = _testbed_cluster_text(cal, rate, tb.WIDE_HOSTS, tb.PER_HOST)      # the 3-host fan-out's
    templates = {**{k: (v, text) for k, v in tb.TRANSFERS.items()}, **{k: (v, wide) for k, v in tb.WIDE.items()}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="planc-accuracy-") as tmp:
        for i, c in enumerate(cases):
            if not isinstance(c, dict) or c.get("kind") not in ("transfer", "reduction"):
                raise AccuracyError(f"benchmarks bench accuracy: {source}: case {i} is not a bench testbed case "
                                    f"(a mapping with kind 'transfer' or 'reduction')")
            if c["kind"] == "transfer":
                if c.get("case") not in templates or c.get("what") not in tb.STRATEGIES:
                    raise AccuracyError(f"benchmarks bench accuracy: {source}: case {i}: unknown transfer case "
                                        f"{c.get('case')!r} / strategy {c.get('what')!r}")
                template, cluster = templates[c["case"]]
                plan = template.format(CLUSTER=cluster, STRATEGY=c["what"])
            else:
                if c.get("what") in tb.GLOO_IN_HOST:
                    continue     # an implementation's A/B, not an alternative the compiler chooses between
                if c.get("what") not in tb.PROGRAMS:
                    raise AccuracyError(f"benchmarks bench accuracy: {source}: case {i}: unknown reduction program "
                                        f"{c.get('what')!r}")
                plan = tb.REDUCTION.format(CLUSTER=text, PROGRAM=tb.PROGRAMS[c["what"]])
            src = Path(tmp) / f"case{i}.plan"
            src.write_text(plan)
            pj = compile_file(src, probe=False).plan_json
            p = (float(pj["transfers"][0]["makespan"]) if c["kind"] == "transfer"
                 else float(pj["reductions"][0]["program"]["predicted"]))
            rows.append({"source": source, "group": f"{c['case']} ({c['kind']})",
                         "alternatives": "strategies" if c["kind"] == "transfer" else "programs",
                         "alternative": c["what"], "rate_mbit": rate, "predicted": p,
                         "measured": c.get("measured"), "note": c.get("error"), "host_link": cal.host(rate)[2],
                         "samples": _samples(c)})
    return rows


def read_measured(path: str | Path) -> tuple[str, object]:
    """``("iteration", doc)`` or ``("testbed", cases)`` (AccuracyError for anything else)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise AccuracyError(f"benchmarks bench accuracy: measured file {path} not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AccuracyError(f"benchmarks bench accuracy: {path} is not JSON: {e}") from None
    if isinstance(doc, dict) and isinstance(doc.get("plans"), list):
        return "iteration", doc
    if isinstance(doc, dict) and isinstance(doc.get("cases"), list):
        return "testbed", doc
    if isinstance(doc, list):
        return "testbed", {"cases": doc}
    raise AccuracyError(f"benchmarks bench accuracy: {path}: neither `bench iteration --json` output (a 'plans' list) "
                        f"nor a list of bench testbed cases")


# ---------------------------------------------------------------- the figures

MIN_ROUNDS = 3   # per-round medians stand for a program's spread from this many rounds on


def _samples(r: dict) -> list[float] | None:
    """What a measurement's spread is judged on: each round's median when the program ran in at least
    MIN_ROUNDS interleaved rounds (steps of one launch are not independent of each other: a drift of the
    machine moves them together), else the measured steps themselves; None when neither was kept."""
    rounds = [x for x in (r.get("round_medians") or ()) if x is not None]
    if len(rounds) >= MIN_ROUNDS:
        return [float(x) for x in rounds]
    steps = [float(x) for x in (r.get("steps") or ()) if x is not None]
    return steps or None


def resolved(a: dict, b: dict) -> bool:
    """Whether the measurements order ``a`` and ``b`` beyond their own spread: each has at least two
    samples and every sample of one is below every sample of the other. With three samples each, that
    happens by chance with probability 2/20 when the two are the same program (an exact rank test)."""
    sa, sb = a.get("samples"), b.get("samples")
    if not sa or not sb or len(sa) < 2 or len(sb) < 2:
        return False
    return max(sa) < min(sb) or max(sb) < min(sa)

def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _tie_rank(row: dict) -> int:
    """Where ``schedule = auto`` puts this alternative among equal predictions (0 first; not a schedule: 0)."""
    from planc.pipeline.choose import CANDIDATES

    order = [f"planc {c.value}" for c in CANDIDATES]
    return order.index(row["alternative"]) if row.get("alternatives") == "schedules" and \
        row["alternative"] in order else 0


def summarize(rows: list[dict]) -> dict:
    """Per-case errors, their median, pair ordering and best-vs-best over the groups of alternatives.

    A pair (i, j) of one group agrees when ``sign(p_i - p_j) == sign(m_i - m_j)``; only cases with
    both a prediction and a measurement count."""
    done = [r for r in rows if r.get("predicted") is not None and r.get("measured")]
    for r in rows:
        r["error"] = (abs(r["predicted"] - r["measured"]) / r["measured"]
                      if r.get("predicted") is not None and r.get("measured") else None)
    groups = {}
    for r in done:
        groups.setdefault((r["source"], r["group"]), []).append(r)
    agree = total = r_agree = r_total = 0
    best = []
    for (source, name), rs in groups.items():
        pairs = list(itertools.combinations(rs, 2))
        same = [_sign(a["predicted"] - b["predicted"]) == _sign(a["measured"] - b["measured"]) for a, b in pairs]
        ok = sum(same)
        agree, total = agree + ok, total + len(pairs)
        sure = [s for s, (a, b) in zip(same, pairs) if resolved(a, b)]
        r_agree, r_total = r_agree + sum(sure), r_total + len(sure)
        if len(rs) > 1:
            # the compiler's pick: the shortest prediction, equal ones in its tie order (schedule = auto:
            # eager_1f1b, 1f1b, gpipe; planc.pipeline.choose.CANDIDATES), else in the rows' order
            bp = min(enumerate(rs), key=lambda ir: (ir[1]["predicted"], _tie_rank(ir[1]), ir[0]))[1]["alternative"]
            top = min(rs, key=lambda r: r["measured"])
            bm = top["alternative"]
            best.append({"source": source, "group": name, "alternatives": rs[0]["alternatives"],
                         "predicted_best": bp, "measured_best": bm, "same": bp == bm,
                         # the measured best beyond the spread: faster than every other in every sample
                         "best_resolved": all(resolved(top, r) for r in rs if r is not top),
                         "pairs": len(pairs), "pairs_agree": ok,
                         "pairs_resolved": len(sure), "pairs_resolved_agree": sum(sure)})
    errors = [r["error"] for r in done]
    sure_best = [g for g in best if g["best_resolved"]]
    return {"cases": rows, "median_error": statistics.median(errors) if errors else None,
            "pairs_agree": agree, "pairs": total, "pair_fraction": agree / total if total else None,
            "pairs_resolved_agree": r_agree, "pairs_resolved": r_total,
            "resolved_pair_fraction": r_agree / r_total if r_total else None,
            "groups": best, "best_all_same": all(g["same"] for g in best) if best else None,
            "best_resolved_same": sum(g["same"] for g in sure_best), "best_resolved": len(sure_best)}


def evaluate(cluster: str | list[str], measured: list[str]) -> dict:
    """Every measured file's cases predicted under ``cluster`` (one file for all, or one per measured
    file, in order: e.g. the 2 x 2 calibration for the iteration cases, the 2 x 4 one for the testbed's)."""
    single = isinstance(cluster, (str, Path))
    clusters = [cluster] * len(measured) if single else list(cluster)
    if len(clusters) != len(measured):
        raise ValueError(f"{len(clusters)} cluster files for {len(measured)} measured files")
    cals = {}
    rows = []
    for path, cfile in zip(measured, clusters):
        cal = cals.get(str(cfile))
        if cal is None:
            cal = cals[str(cfile)] = read_calibrated(cfile)
        kind, doc = read_measured(path)
        if kind == "iteration":
            rows += iteration_cases(doc, cal, str(path))
        else:
            rows += testbed_cases(doc["cases"], cal, str(path), doc.get("link_mbit"))
    out = summarize(rows)
    out["cluster"] = str(cluster) if single else ", ".join(f"{c} ({m})" for c, m in zip(clusters, measured))
    return out


# ---------------------------------------------------------------- reporting

def _f(x, fmt="{:.4g}") -> str:
    return "—" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    """One row per group of alternatives (the per-case figures are in ``--json`` and on the terminal)."""
    by_group: dict[str, list[dict]] = {}
    for r in res["cases"]:
        by_group.setdefault(r["group"], []).append(r)
    lines = [f"Predicted under `{res['cluster']}` against measured: per group, each alternative's predicted / "
             "measured seconds, the largest |p−m|/m, the predicted and the measured best, the pairs ordered as "
             "measured (of those the measurement itself orders).", "",
             "| group | predicted / measured s | max \\|p−m\\|/m | best: predicted, measured | pairs |",
             "|---|---|---|---|---|"]
    for g in res["groups"]:
        rows = by_group.get(g["group"], [])
        figures = ", ".join(f"{r['alternative']} {_f(r['predicted'])} / {_f(r['measured'])}" for r in rows
                            if r["predicted"] is not None)
        errors = [r["error"] for r in rows if r["error"] is not None]
        best = (f"{g['predicted_best']}, {g['measured_best']}" if not g["same"] else f"{g['predicted_best']} (same)")
        best += "" if g["best_resolved"] else " (within the spread)"
        lines.append(f"| {g['group']} | {figures} | {_f(max(errors) if errors else None, '{:.1%}')} | {best} | "
                     f"{g['pairs_agree']}/{g['pairs']} ({g['pairs_resolved_agree']}/{g['pairs_resolved']}) |")
    unpredicted = sorted({r["note"] for r in res["cases"] if r["predicted"] is None and r.get("note")})
    lines += ["", f"Median |p−m|/m: {_f(res['median_error'], '{:.1%}')}; pairs of alternatives ordered as "
              f"measured: {res['pairs_agree']}/{res['pairs']} ({_f(res['pair_fraction'], '{:.0%}')}); predicted "
              f"best = measured best in {sum(g['same'] for g in res['groups'])}/{len(res['groups'])} groups.",
              f"Of these, the pairs the measurement itself orders (every sample of one below every sample of "
              f"the other; samples: per-round medians from {MIN_ROUNDS} rounds, else steps): "
              f"{res['pairs_resolved_agree']}/{res['pairs_resolved']} ordered as measured "
              f"({_f(res['resolved_pair_fraction'], '{:.0%}')}); groups whose measured best is beyond the spread: "
              f"{res['best_resolved_same']}/{res['best_resolved']} predicted."]
    lines += [f"{u[0].upper()}{u[1:]}." for u in unpredicted]
    return "\n".join(lines) + "\n"


def _rich(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"predicted against measured ({res['cluster']})")
    for col in ("group", "alternative", "Mbit/s", "predicted s", "measured s", "|p-m|/m", "note"):
        t.add_column(col)
    for r in res["cases"]:
        t.add_row(r["group"], r["alternative"], f"{r['rate_mbit']:g}", _f(r["predicted"]), _f(r["measured"]),
                  _f(r["error"], "{:.1%}"), r.get("note") or "")
    Console(stderr=True).print(t)


def run(measured=None, cluster: str | list[str] | None = None, json_path: str | None = None,
        verbose: bool = True) -> str:
    """Markdown of :func:`evaluate` (``measured``: JSON files; ``cluster``: the calibrated YAML, or one per
    measured file)."""
    if not cluster or not measured:
        return ("_Skipped: `python -m benchmarks bench accuracy` needs `--cluster CALIBRATED.yaml` and the measured JSON "
                "files (see docs/calibrate.md)._\n")
    res = evaluate(cluster, list(measured))
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1) + "\n")
    if verbose:
        _rich(res)
    return markdown(res)
