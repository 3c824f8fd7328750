"""The iteration bench's report: per plan and rate each program's median against stock DeepSpeed and the
bounds (:func:`rows`, :func:`markdown`), on a terminal as rich tables, and the chart."""

from __future__ import annotations

import re
import statistics

from rich.console import Console
from rich.table import Table

from benchmarks.bench.iteration_runs import COMPUTE_MEASURED, SCHEDULES, WARMUP
from benchmarks.bench.linkbound import link_seconds, pipeline_link_bound


def _f(x, digits=3, suffix=""):
    return "—" if x is None else f"{x:.{digits}f}{suffix}"


def rows(result: dict) -> list[dict]:
    """Flat rows (one per rate and program) with the ratios."""
    compute = signal_bound(result)[0]
    if compute is None:   # a result without signal runs (older JSON): the work-alone figure
        compute = ((result.get("compute_only") or {}).get("per_rate") or [{}])[0].get("median")
    out = []
    programs = list(result["programs"])
    for i, rate in enumerate(r["rate"] for r in next(iter(result["programs"].values()))["per_rate"]):
        link = link_seconds(result["link"]["busiest_bytes"], rate)
        bound = max(compute, link) if compute is not None else None
        both = (result.get("both_ways") or {}).get(f"{rate:g}")
        link_both = result["link"]["busiest_bytes"] / both if both else None
        bound_both = max(compute, link_both) if compute is not None and link_both is not None else None
        # the link bound of a pipeline's fill and drain (pipeline_link_bound), at the faster of the
        # nominal and the calibrated one-way rate (so it stays a lower bound)
        one_way = max(rate * 1e6 / 8, float((result.get("one_way") or {}).get(f"{rate:g}") or 0))
        pipe = pipeline_link_bound(result["link"], one_way, both)
        pipe_link = pipe[0] if pipe else None
        bound_pipe = max(compute, pipe_link) if compute is not None and pipe_link is not None else None
        stock = result["programs"].get("stock DeepSpeed")
        stock_t = stock["per_rate"][i]["median"] if stock else None
        for name in programs + ([] if stock else ["stock DeepSpeed"]):
            run = result["programs"].get(name)
            t = run["per_rate"][i]["median"] if run else None
            out.append({"rate": rate, "program": name, "median": t,
                        "steps": run["per_rate"][i]["steps"] if run else [],
                        "vs_stock": t / stock_t if t and stock_t else None,
                        "vs_bound": t / bound if t and bound else None,
                        "compute_only": compute, "link": link, "bound": bound,
                        "link_both_ways": link_both, "bound_both_ways": bound_both,
                        "vs_bound_both_ways": t / bound_both if t and bound_both else None,
                        "pipeline_link": pipe_link, "bound_pipeline": bound_pipe,
                        "vs_bound_pipeline": t / bound_pipe if t and bound_pipe else None,
                        "note": None if run else f"n/a: {result['stock']['reason']}",
                        "error": run.get("error") if run else None})
    return out


def signal_bound(result: dict) -> tuple[float | None, str | None]:
    """The fastest signal-transfer run over the schedules: (median s/step, schedule)."""
    best = [(r["per_rate"][0]["median"], s) for s, r in (result.get("signal") or {}).items()
            if r["per_rate"][0]["median"] is not None]
    return min(best) if best else (None, None)


def compute_parts(run: dict) -> tuple[float, float, int] | None:
    """Medians over the measured steps of (slowest rank alone, all ranks' work ÷ cores) and the cores."""
    rx = re.compile(r"compute-only step (\d+): slowest rank alone ([0-9.]+) s, all ranks [0-9.]+ s on (\d+) cores "
                    r"([0-9.]+) s")
    found = [m for m in map(rx.search, run.get("details") or ()) if m and int(m.group(1)) >= WARMUP]
    if not found:
        return None
    return (statistics.median(float(m.group(2)) for m in found), statistics.median(float(m.group(4)) for m in found),
            int(found[0].group(3)))


def round_ratios(result: dict) -> list[dict]:
    """Per rate and round (a result of ``rounds`` > 1): eager_1f1b ÷ 1f1b and planc's best ÷ stock DeepSpeed
    from that round's medians (None where a program has no median in that round or does not run)."""
    progs = result["programs"]
    if result.get("rounds", 1) < 2 or "planc 1f1b" not in progs:
        return []
    out = []
    for i, p in enumerate(progs["planc 1f1b"]["per_rate"]):
        def med(name, k):
            run = progs.get(name)
            return run["per_rate"][i]["round_medians"][k] if run else None
        for k in range(result["rounds"]):
            eager, one = med("planc eager_1f1b", k), med("planc 1f1b", k)
            plancs = [med(f"planc {s}", k) for s in SCHEDULES]
            stock = med("stock DeepSpeed", k)
            best = min(plancs) if all(x is not None for x in plancs) else None
            out.append({"rate": p["rate"], "round": k + 1,
                        "eager_vs_1f1b": eager / one if eager and one else None,
                        "best_vs_stock": best / stock if best and stock else None})
    return out


def _bound_line(table: list[dict], seconds: str, ratio: str, head: str) -> list[str]:
    """A paragraph (``["", text]``, or [] when no row has it) giving, per rate, the link time ``seconds``
    of :func:`rows` and planc's fastest program against max(signal, that) (``ratio``)."""
    best = {}
    for r in table:
        if r[seconds] is not None and r[ratio] is not None and r["program"].startswith("planc ") \
                and r["median"] is not None:
            if r["rate"] not in best or r["median"] < best[r["rate"]]["median"]:
                best[r["rate"]] = r
    if not best:
        return []
    return ["", head + ", ".join(f"{rate:g} Mbit/s {r[seconds]:.3f} s" for rate, r in best.items())
            + "; planc's best ÷ max(signal, that): "
            + ", ".join(f"{rate:g} Mbit/s {r[ratio]:.2f} ({r['program'][6:]})" for rate, r in best.items()) + "."]


def _program_text(name: str, run: dict) -> str:
    """``NAME RSS/RSS/... MB (losses L, L, L; S s)``: one program's resident peaks, first losses and launch time."""
    mem = "/".join(f"{kb / 1024:.0f}" for _, kb in sorted(run.get("peak_rss_kb", {}).items())) or "—"
    losses = ", ".join(f"{x:.4f}" for x in run.get("losses", [])[:3]) \
        if "compute" not in name and "signal" not in name else ""
    return f"{name} {mem} MB ({f'losses {losses}; ' if losses else ''}{run.get('launch_s', '—')} s)"


def markdown(result: dict, rates_arg: str) -> str:
    lk = result["link"]
    parts = compute_parts(result.get("compute_only") or {})
    parts_text = (f" = max(slowest rank alone {parts[0]:.3f} s, all ranks' work ÷ {parts[2]} cores {parts[1]:.3f} s)"
                  if parts else "")
    if parts and result.get("cpus_per_rank"):   # quota'd ranks share no core: the slowest rank is the figure
        parts_text = f" = slowest rank alone under its {result['cpus_per_rank']:g}-core quota {parts[0]:.3f} s"

    hosts = " + ".join(str(h) for h in result["hosts"])
    lines = [f"### `{result['plan']}` ({result['name']}: {len(result['hosts'])} hosts of {hosts} ranks, "
             f"stages of {result['stages']} devices, {result['micro_batches']} micro-batches of "
             f"{result['micro_batch']} rows)", "",
             f"Reproduce: `python -m benchmarks bench iteration {result['plan']} --rates {rates_arg}`", "",
             f"Link bound: {lk['busiest_bytes'] / 1e6:.2f} MB per iteration through host "
             f"{lk['busiest_host']}'s link ({lk['busiest_direction']}), ÷ the rate. Compute-only bound "
             f"(signal send/recv: each planc program with every transfer cut to one element, "
             f"`runtime.signal_transfers`, median of {COMPUTE_MEASURED} steps unshaped; the fastest counts): "
             + ", ".join(f"{s} {_f(r['per_rate'][0]['median'])} s" for s, r in (result.get("signal") or {}).items())
             + f". For scale, each rank's work timed alone: "
             f"{_f((result.get('compute_only') or {}).get('per_rate', [{}])[0].get('median'))} s{parts_text} "
             f"(no bubble, no contention: below any real program). Stock DeepSpeed: "
             + (f"`PipelineModule(partition_method='{result['stock']['partition_method']}')`, default topology."
                if result["stock"]["expressible"] else f"n/a: {result['stock']['reason']}."), "",
             "| link Mbit/s | program | median s/step | ÷ stock DeepSpeed | ÷ bound | bound s (signal, link) |",
             "|---|---|---|---|---|---|"]
    table = rows(result)
    for r in table:
        t = r["note"] or (f"failed ({r['error'][:60]})" if r["error"] and r["median"] is None else _f(r["median"]))
        lines.append(f"| {r['rate']:g} | {r['program']} | {t} | {_f(r['vs_stock'], 2)} | {_f(r['vs_bound'], 2)} | "
                     f"{_f(r['bound'])} ({_f(r['compute_only'])}, {_f(r['link'])}) |")
    lines += _bound_line(table, "link_both_ways", "vs_bound_both_ways",
                         "Both ways (the cluster file's `both_ways`: the rate a direction of the host link keeps "
                         "while the other direction carries data too, as a 1F1B step's activations and gradients "
                         "do): the same bytes take ")
    lines += _bound_line(table, "pipeline_link", "vs_bound_pipeline",
                         "Fill and drain (`pipeline_link_bound`: a device's first inputs and another's last "
                         "gradients cross a host link with nothing coming the other way, the rest at most "
                         "both ways): the link needs at least ")
    lines += ["", "Per program, each rank's peak RSS in MB (VmHWM), the first losses and the launch's seconds: "
              + "; ".join(_program_text(name, run) for name, run in list(result["programs"].items()) + [
                  (f"planc {s}, signal transfers", r) for s, r in (result.get("signal") or {}).items()] + [
                  (f"compute-only ({r.get('when', '?')})", r) for r in result.get("compute_only_runs") or ()]) + "."]
    per_round = round_ratios(result)
    if per_round:
        lines += ["", f"Per round ({result['rounds']} interleaved rounds; each ratio from that round's medians):"]
        for rate in dict.fromkeys(r["rate"] for r in per_round):
            rs = [r for r in per_round if r["rate"] == rate]
            text = f"- {rate:g} Mbit/s: eager_1f1b ÷ 1f1b " + ", ".join(_f(r["eager_vs_1f1b"], 2) for r in rs)
            if any(r["best_vs_stock"] is not None for r in rs):
                text += "; planc's best ÷ stock DeepSpeed " + ", ".join(_f(r["best_vs_stock"], 2) for r in rs)
            lines.append(text)
    return "\n".join(lines) + "\n"


def _rich_print(results: list[dict]) -> bool:
    console = Console(stderr=True)
    for res in results:
        table = Table(title=f"{res['plan']} ({res['name']})")
        for col in ("Mbit/s", "program", "median s/step", "÷ stock", "÷ bound", "bound s"):
            table.add_column(col)
        for r in rows(res):
            table.add_row(f"{r['rate']:g}", r["program"], r["note"] or _f(r["median"]), _f(r["vs_stock"], 2),
                          _f(r["vs_bound"], 2), _f(r["bound"]))
        console.print(table)
    return True


def _chart(results: list[dict], path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart: not drawn, matplotlib is not installed"
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results):
        rs = rows(res)
        rates = sorted({r["rate"] for r in rs})
        for name in dict.fromkeys(r["program"] for r in rs):
            ys = [next((r["median"] for r in rs if r["rate"] == x and r["program"] == name), None) for x in rates]
            if any(y is not None for y in ys):
                ax.plot(rates, ys, marker="o", label=name)
        ax.plot(rates, [next(r["bound"] for r in rs if r["rate"] == x) for x in rates], "k--", label="bound")
        ax.set_xscale("log")
        ax.set_xlabel("host link, Mbit/s")
        ax.set_ylabel("s per step (median)")
        ax.set_title(res["name"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return f"chart: {path}"
