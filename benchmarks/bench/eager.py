"""``python -m benchmarks.bench.eager PLAN --cluster CAL.yaml [--rates 25,100,400,10000] [--model K=V,...]
[--own-cores]``: how much eager_1f1b can gain over 1f1b on a plan's model family, simulated.

The experiment behind docs/benchmarks.md, "How much eager_1f1b can gain, simulated": for every model
size given (``--model channels=64,length=1024``, repeatable; default the plan's own arguments) and
every rate, the plan is compiled under the calibrated cluster at that rate (as ``python -m benchmarks bench
accuracy`` does) and its three schedules are simulated; the table gives each one's predicted
iteration, the iteration with free communication (the compute), and 1f1b ÷ eager_1f1b.
``--own-cores`` drops the calibration's shared ``cores`` (every device computes on its own, as GPUs
do) to ask what the schedule could gain on hardware that is not the testbed's shared CPUs. Nothing
is launched; these are predictions, to be read beside the measurements of ``python -m benchmarks bench iteration``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b")


def _model_args(text: str) -> dict:
    """``channels=64,length=1024`` -> {"channels": 64, "length": 1024} (numbers where they parse)."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--model {text!r}: {item!r} is not KEY=VALUE")
        value = value.strip()
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                continue
        out[key.strip()] = value
    return out


def rows(plan_path: str, cal_path: str, rates, models=(None,), own_cores: bool = False) -> list[dict]:
    from benchmarks.bench.accuracy import read_calibrated, substitute
    from planc.driver.compile import compile_program
    from planc.lang import load
    from planc.model.probe import probe_model

    base = load(plan_path)
    if base.model is None or base.train is None:
        raise ValueError(f"{plan_path}: not a training plan (no model/train block)")
    cal = read_calibrated(cal_path)
    out = []
    for args in models:
        program = base
        if args:
            known = dict(base.model.args)
            unknown = sorted(set(args) - set(known))
            if unknown:
                raise ValueError(f"--model: the plan's model takes no {', '.join(unknown)} "
                                 f"(it has {', '.join(sorted(known)) or 'no arguments'})")
            known.update(args)
            program = dataclasses.replace(base, model=dataclasses.replace(base.model, args=tuple(known.items())))
        probe = None
        for rate in rates:
            cluster = substitute(program.cluster, cal, rate)
            if own_cores:
                cluster = dataclasses.replace(cluster, cores=None, cores_level=None)
            p = dataclasses.replace(program, cluster=cluster)
            if probe is None:
                probe = probe_model(p)
            pred = (compile_program(p, probe).plan_json.get("pipeline") or {}).get("predicted") or {}
            its = {s: (pred.get("schedules") or {}).get(s, {}).get("iteration") for s in SCHEDULES}
            out.append({"model": ", ".join(f"{k}={v}" for k, v in dict(program.model.args).items()),
                        "rate_mbit": rate, **its, "compute": pred.get("iteration_free_communication"),
                        "gain": its["1f1b"] / its["eager_1f1b"] if its["1f1b"] and its["eager_1f1b"] else None})
    return out


def markdown(rs: list[dict]) -> str:
    lines = ["| model | Mbit/s | gpipe s | 1f1b s | eager_1f1b s | compute s (free communication) | 1f1b ÷ eager |",
             "|---|---|---|---|---|---|---|"]
    for r in rs:
        cells = ["—" if r[k] is None else f"{r[k]:.3f}" for k in (*SCHEDULES, "compute", "gain")]
        lines.append(f"| {r['model']} | {r['rate_mbit']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from benchmarks.bench.accuracy import AccuracyError
    from planc.lang.errors import PlanError

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.eager", description=__doc__.splitlines()[0])
    p.add_argument("plan")
    p.add_argument("--cluster", required=True, metavar="YAML", help="a `planc calibrate` file")
    p.add_argument("--rates", default="25,100,400,10000", help="link rates in Mbit/s, comma-separated")
    p.add_argument("--model", action="append", default=None, metavar="K=V,...",
                   help="model arguments replacing the plan's (repeat for several sizes)")
    p.add_argument("--own-cores", action="store_true", help="every device computes on its own cores")
    a = p.parse_args(argv)
    try:
        rates = [float(x) for x in a.rates.split(",") if x.strip()]
        models = [_model_args(m) for m in a.model] if a.model else [None]
    except ValueError as e:
        print(f"python -m benchmarks.bench.eager: {e}", file=sys.stderr)
        return 2
    if not rates or any(not r > 0 for r in rates):
        print(f"python -m benchmarks.bench.eager: --rates {a.rates!r}: not positive Mbit/s", file=sys.stderr)
        return 2
    try:
        print(markdown(rows(a.plan, a.cluster, rates, models, a.own_cores)))
    except (AccuracyError, PlanError, OSError, ValueError) as e:
        print(f"python -m benchmarks.bench.eager: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
