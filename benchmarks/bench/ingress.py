"""``python -m benchmarks.bench.ingress PLAN --cluster CAL.yaml [--rates 25,100]``: link orders, simulated.

The experiment behind docs/benchmarks.md, "An order on the receiving host's link, simulated": for
each rate the plan is compiled under the calibrated cluster at that rate (as ``python -m benchmarks bench
accuracy`` does), and its 1f1b and eager_1f1b lists are simulated four ways: links shared as the
sends come (the plain simulation), each sending host's cross-host sends one at a time in the order
they became ready (the host NIC order's construction, :func:`planc.pipeline.simulate.nic_order_from`),
each receiving host's incoming sends so (:func:`~planc.pipeline.simulate.ingress_order_from`), and
both. A column whose chains would hang the lists says so. Nothing is launched.
"""
from __future__ import annotations

import argparse
import sys

SCHEDULES = ("1f1b", "eager_1f1b")
COLUMNS = ("shared", "sending hosts", "receiving hosts", "both")


def rows(plan_path: str, cal_path: str, rates) -> list[dict]:
    from benchmarks.bench.accuracy import compiled_at_rates, read_calibrated
    from planc.lang import load
    from planc.pipeline.gantt import plan_input
    from planc.pipeline.schedules import build
    from planc.pipeline.simulate import _simulate, _turns, ingress_order_from, nic_order_from

    out = []
    for rate, pj in compiled_at_rates(load(plan_path), read_calibrated(cal_path), rates):
        sim = plan_input(pj)
        for name in SCHEDULES:
            lists = _turns(build(name, len(pj["stages"]), pj["pipeline"]["micro_batches"], sim.transfers).actions,
                           len(pj["stages"]))
            shared = _simulate(sim, lists, free=False, keep=False)
            egress, ingress = nic_order_from(shared.ready, sim), ingress_order_from(shared.ready, sim)
            row = {"rate_mbit": rate, "schedule": name, "shared": shared.iteration}
            for col, chains in (("sending hosts", egress), ("receiving hosts", ingress), ("both", egress + ingress)):
                try:
                    row[col] = _simulate(sim, lists, free=False, keep=False, nic_order=chains).iteration
                except ValueError:      # the chains would hang the lists
                    row[col] = None
            out.append(row)
    return out


def markdown(rs: list[dict]) -> str:
    lines = ["| Mbit/s | schedule | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for r in rs:
        cells = ["hangs" if r[c] is None else f"{r[c]:.3f}" for c in COLUMNS]
        lines.append(f"| {r['rate_mbit']:g} | {r['schedule']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from benchmarks.bench.accuracy import AccuracyError
    from planc.lang.errors import PlanError

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.ingress", description=__doc__.splitlines()[0])
    p.add_argument("plan")
    p.add_argument("--cluster", required=True, metavar="YAML", help="a `planc calibrate` file")
    p.add_argument("--rates", default="25,100", help="link rates in Mbit/s, comma-separated")
    a = p.parse_args(argv)
    try:
        rates = [float(x) for x in a.rates.split(",") if x.strip()]
    except ValueError:
        print(f"python -m benchmarks.bench.ingress: --rates {a.rates!r}: not numbers", file=sys.stderr)
        return 2
    try:
        print(markdown(rows(a.plan, a.cluster, rates or [25.0])))
    except (AccuracyError, PlanError, OSError) as e:
        print(f"python -m benchmarks.bench.ingress: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
