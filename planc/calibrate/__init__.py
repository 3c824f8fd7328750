"""`planc calibrate --on cluster OUT.yaml`: measure the links and the device, write a cluster YAML.

The microbenchmarks (``planc/calibrate/microbench.py``, torch, run by every rank
in a subprocess: the compiler stays torch-free) time a ping-pong between two
ranks of one host and between two hosts, ``all_reduce`` over one host's ranks
and over one rank per host, at several message sizes, an ``n x n`` matmul and
the forward and backward of a transformer layer on every rank (on CPUs one rank
at a time: the simulator models the sharing of cores itself). :func:`fit` turns the medians into each level's
bandwidth and latency under the cost model's own formulas (docs/cost-model.md)
by weighted least squares, and the device ``flops``; :func:`write_yaml` writes
the cluster file that plans load with ``cluster "OUT.yaml"`` (docs/calibrate.md).

``--on cluster``: ``--ranks`` ranks spawned on this machine (NCCL when it has a
GPU per rank, else gloo). The emulated testbed's calibration is the lab's
(``python -m benchmarks calibrate --on testbed``, outside the product), built on
these same pieces.

Modules: ``fit`` (the fitting), ``clusterfile`` (the YAML document, its checks
and summary), ``ranks`` (running the microbenchmarks, ``run_cluster``),
``microbench.py`` (the torch side, run as a script, never imported).
"""

from __future__ import annotations

from planc.calibrate.clusterfile import (check_output, cluster_doc, cores_available, samples_record, summary,
                                         write_yaml)
from planc.calibrate.fit import (DEFAULT_TIMEOUT, INNER_SIZES, LEVEL_NAMES, MATMUL, CalibrateError, both_ways,
                                 fit, fit_line, outer_sizes)
from planc.calibrate.ranks import MARK, MICROBENCH, PHASE_NAMES, run_cluster

__all__ = ["CalibrateError", "DEFAULT_TIMEOUT", "INNER_SIZES", "LEVEL_NAMES", "MARK", "MATMUL", "MICROBENCH",
           "PHASE_NAMES", "both_ways", "calibrate", "check_output", "cluster_doc", "cores_available", "fit",
           "fit_line", "outer_sizes", "run_cluster", "samples_record", "summary", "write_yaml"]


def calibrate(out: str, *, ranks: int = 2, backend: str = "auto", repeats: int = 3,
              timeout: float = DEFAULT_TIMEOUT, command: str = "planc calibrate --on cluster",
              matmul=MATMUL) -> dict:
    """Measure ``ranks`` ranks of this machine, fit and write OUT.yaml; returns the document written
    (CalibrateError on a bad input or a failed run)."""
    path = check_output(out)
    if repeats < 1 or timeout <= 0:
        raise CalibrateError("planc calibrate: --repeats must be >= 1 and --timeout positive")
    if ranks < 1:
        raise CalibrateError(f"planc calibrate: --ranks {ranks}: need at least 1")
    if backend not in ("auto", "gloo", "nccl"):
        raise CalibrateError(f"planc calibrate: --backend {backend!r}: expected auto, gloo or nccl")
    rates = [None]
    raws = [run_cluster(ranks, backend=backend, repeats=repeats, timeout=timeout, matmul=matmul)]
    doc = cluster_doc([fit(r) for r in raws], "cluster", rates, repeats)
    doc["calibration"]["samples"] = samples_record(rates, raws)
    write_yaml(doc, path, command)
    return doc
