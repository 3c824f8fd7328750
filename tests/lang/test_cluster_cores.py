"""`cores` of a cluster: `cores = N per LEVEL|cluster` in the language and `cores:` / `cores_per:` in a YAML
cluster file, checked into ``ir.Cluster(cores, cores_level)``; its canonical text, its plan.json keys
(and ``planc simulate``'s rebuild of the cluster from them), and what ``planc calibrate --on testbed``
writes. Pools are checked against device lists written out by hand."""

from __future__ import annotations

import os
import textwrap

import pytest

from planc import calibrate as cal
from planc.lang import load, load_text
from planc.lang.errors import PlanError
from planc.lang.format import summary, to_text

TWO_BY_TWO = """plan p {
  cluster {
    level host x 2 : bandwidth 1 GB/s
    level device x 2 : bandwidth 10 GB/s
    CORES
  }
}
"""

RACKS = """cluster {
  level rack x 2 : bandwidth 1 GB/s
  level host x 2 : bandwidth 5 GB/s
  level device x 2 : bandwidth 10 GB/s
  host = host
  CORES
}
"""


def cluster(text: str, cores: str):
    return load_text(text.replace("CORES", cores)).cluster


def error(text: str, path: str = "<plan>"):
    with pytest.raises(PlanError) as e:
        load_text(text, path)
    assert len(e.value.diagnostics) == 1, e.value.render()
    return e.value.diagnostics[0]


# ---------------------------------------------------------------- the language

@pytest.mark.parametrize("cores,n,level,pools", [
    ("cores = 2 per cluster", 2, None, [[0, 1, 2, 3]]),
    ("cores = 4 per host", 4, "host", [[0, 1], [2, 3]]),
    ("cores = 4", 4, "host", [[0, 1], [2, 3]]),              # default: the host level
    ("cores 3 per device", 3, "device", [[0], [1], [2], [3]]),   # `=` optional, as for flops
])
def test_cores_forms(cores, n, level, pools):
    c = cluster(TWO_BY_TWO, cores)
    assert (c.cores, c.cores_level) == (n, level)
    assert [list(p) for p in c.core_pools()] == pools


def test_cores_per_a_level_above_the_host():
    c = cluster(RACKS, "cores = 16 per rack")
    assert (c.cores, c.cores_level, c.host_level) == (16, "rack", "host")
    assert [list(p) for p in c.core_pools()] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    c = cluster(RACKS, "cores = 8")   # the default follows `host =`
    assert c.cores_level == "host" and [list(p) for p in c.core_pools()] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_no_cores_is_none():
    c = cluster(TWO_BY_TWO, "flops = 1 TFLOP/s")
    assert (c.cores, c.cores_level, c.core_pools()) == (None, None, ())


def test_a_level_named_cluster_wins_over_the_word():
    c = load_text("cluster {\n  level cluster x 2 : bandwidth 1 GB/s\n  level device x 3 : bandwidth 9 GB/s\n"
                  "  cores = 2 per cluster\n}\n").cluster
    assert c.cores_level == "cluster" and [list(p) for p in c.core_pools()] == [[0, 1, 2], [3, 4, 5]]


def test_cores_and_per_stay_usable_as_names():
    p = load_text("cluster {\n  level per x 2 : bandwidth 1 GB/s\n  level cores x 2 : bandwidth 2 GB/s\n"
                  "  host = per\n  cores = 2 per per\n}\nparallel { cores = 2, per = 2 }\n")
    assert (p.cluster.cores, p.cluster.cores_level) == (2, "per")
    assert [a.name for a in p.parallel.axes] == ["cores", "per"]
    assert load_text(to_text(p)).cluster == p.cluster


# line 5 of TWO_BY_TWO, the value starting at column 13 (after `    cores = `)
@pytest.mark.parametrize("cores,message,col", [
    ("cores = 0", "cores must be at least 1, got 0", 13),
    ("cores = -2", "cores must be at least 1, got -2", 13),
    ("cores = 2.5", "cores must be a whole number, got 2.5", 13),
    ("cores = 1e3", "cores must be a whole number, got 1e3", 13),
    ("cores = 2 GB", "cores is a count of CPU cores and takes no unit, got '2 GB'", 13),
    ("cores = 2 per rack", "cores per 'rack': 'rack' is not a level of this cluster (host, device) nor 'cluster'", 19),
    ("cores = 2 per cluster, cores = 3", "'cores' is set twice in this cluster", 28),
])
def test_bad_cores(cores, message, col):
    d = error(TWO_BY_TWO.replace("CORES", cores))
    assert message in d.message
    assert (d.span.line, d.span.col) == (5, col)


def test_bad_level_gets_a_hint_and_the_span_of_the_name():
    d = error(TWO_BY_TWO.replace("CORES", "cores = 2 per hots"))
    assert d.hint == "did you mean 'host'?"
    assert (d.span.line, d.span.col, d.span.end_col) == (5, 19, 23)


def test_per_without_a_name_is_a_syntax_error():
    d = error(TWO_BY_TWO.replace("CORES", "cores = 2 per"))
    assert "expected a name" in d.message and d.span.line == 5


@pytest.mark.parametrize("cores", ["cores = 2 per cluster", "cores = 4 per host", "cores = 4", "cores = 1 per device"])
def test_canonical_text_round_trips(cores):
    p = load_text(TWO_BY_TWO.replace("CORES", cores))
    text = to_text(p)
    level = p.cluster.cores_level or "cluster"
    assert f"    cores = {p.cluster.cores} per {level}\n" in text
    again = load_text(text)
    assert again.cluster == p.cluster and to_text(again) == text


def test_canonical_text_of_a_level_named_cluster():
    p = load_text("cluster {\n  level cluster x 2 : bandwidth 1 GB/s\n  level device x 3 : bandwidth 9 GB/s\n"
                  "  cores = 2 per cluster\n}\n")
    assert "    cores = 2 per cluster\n" in to_text(p) and load_text(to_text(p)).cluster == p.cluster


def test_canonical_text_without_cores_has_none():
    assert "cores" not in to_text(load_text(TWO_BY_TWO.replace("CORES", "")))


def test_summary_names_the_pools():
    s = summary(load_text(TWO_BY_TWO.replace("CORES", "cores = 2 per cluster")))
    assert "cores      2 shared by the 4 device(s) of each pool (one for the whole cluster)" in s
    s = summary(load_text(TWO_BY_TWO.replace("CORES", "cores = 1")))
    assert "cores      1 shared by the 2 device(s) of each pool (one per host, 2 in all)" in s


# ---------------------------------------------------------------- YAML cluster files

YAML = """\
levels:
  - {name: host, fanout: 2, bandwidth: 1 GB/s}
  - {name: device, fanout: 2, bandwidth: 10 GB/s}
EXTRA
"""


def yaml_cluster(tmp_path, extra: str):
    (tmp_path / "c.yaml").write_text(YAML.replace("EXTRA", extra))
    (tmp_path / "p.plan").write_text('cluster "c.yaml"\n')
    return load(tmp_path / "p.plan").cluster


@pytest.mark.parametrize("extra,n,level", [
    ("cores: 2\ncores_per: cluster", 2, None),
    ("cores: 4", 4, "host"),
    ("cores: 4\ncores_per: device", 4, "device"),
    ("flops: 1e9", None, None),
])
def test_yaml_cores(tmp_path, extra, n, level):
    c = yaml_cluster(tmp_path, extra)
    assert (c.cores, c.cores_level) == (n, level)


def test_yaml_cores_nested_under_cluster(tmp_path):
    (tmp_path / "c.yaml").write_text("cluster:\n" + textwrap.indent(YAML.replace("EXTRA", "cores: 2\ncores_per: cluster"), "  "))
    (tmp_path / "p.plan").write_text('cluster "c.yaml"\n')
    c = load(tmp_path / "p.plan").cluster
    assert (c.cores, c.cores_level) == (2, None) and [list(p) for p in c.core_pools()] == [[0, 1, 2, 3]]


# the bad key is on line 4 (its value at column 8 for `cores:`, 12 for `cores_per:`)
@pytest.mark.parametrize("extra,message,col", [
    ("cores: two", "cores: expected a whole number of CPU cores >= 1, got 'two'", 8),
    ("cores: 0", "cores: expected a whole number of CPU cores >= 1, got 0", 8),
    ("cores: 1.5", "cores: expected a whole number of CPU cores >= 1, got 1.5", 8),
    ("cores: true", "cores: expected a whole number of CPU cores >= 1, got True", 8),
    ("cores: 2.0", "cores: expected a whole number of CPU cores >= 1, got 2.0", 8),
    ("cores: -3", "cores: expected a whole number of CPU cores >= 1, got -3", 8),
    ("cores: 1000000000000000000000", "cores: 1000000000000000000000 is too large (at most 18 digits)", 8),
    ("cores_per: host", "cores_per: given without 'cores'", 12),
])
def test_bad_yaml_cores(tmp_path, extra, message, col):
    (tmp_path / "c.yaml").write_text(YAML.replace("EXTRA", extra))
    (tmp_path / "p.plan").write_text('cluster "c.yaml"\n')
    d = error((tmp_path / "p.plan").read_text(), str(tmp_path / "p.plan"))
    assert d.message.startswith("cluster file 'c.yaml', ") and message in d.message
    assert d.span.file.endswith("c.yaml") and (d.span.line, d.span.col) == (4, col)


@pytest.mark.parametrize("per,message", [
    ("rack", "cores_per: 'rack' is not a level of this cluster (host, device) nor 'cluster'"),
    ("3", "cores_per: expected a level name or 'cluster', got 3"),
])
def test_bad_yaml_cores_per(tmp_path, per, message):
    (tmp_path / "c.yaml").write_text(YAML.replace("EXTRA", f"cores: 2\ncores_per: {per}"))
    (tmp_path / "p.plan").write_text('cluster "c.yaml"\n')
    d = error((tmp_path / "p.plan").read_text(), str(tmp_path / "p.plan"))
    assert message in d.message and d.span.file.endswith("c.yaml")
    assert (d.span.line, d.span.col) == (5, 12)


# ---------------------------------------------------------------- plan.json

PLAN = """plan p {
  cluster {
    level host x 2 : bandwidth 1 GB/s
    level device x 2 : bandwidth 10 GB/s
    CORES
  }
  parallel { data = 4 }
  reduce grads over data : f32[1024]
}
"""


@pytest.mark.parametrize("cores,keys", [
    ("cores = 2 per cluster", {"cores": 2, "cores_level": None}),
    ("cores = 3", {"cores": 3, "cores_level": "host"}),
    ("", {}),
])
def test_plan_json_cluster_keys(tmp_path, cores, keys):
    from planc.driver.compile import compile_file
    from planc.pipeline.gantt import cluster_of

    (tmp_path / "p.plan").write_text(PLAN.replace("CORES", cores))
    plan = compile_file(tmp_path / "p.plan", probe=False).plan_json
    got = {k: plan["cluster"][k] for k in ("cores", "cores_level") if k in plan["cluster"]}
    assert got == keys
    rebuilt = cluster_of(plan)   # `planc simulate OUT/`'s cluster
    assert (rebuilt.cores, rebuilt.cores_level) == (keys.get("cores"), keys.get("cores_level"))
    assert rebuilt.core_pools() == load(tmp_path / "p.plan").cluster.core_pools()


# ---------------------------------------------------------------- planc calibrate

def _fit(hosts=2, per_host=2):
    """What ``calibrate.fit`` returns, made by hand (only the keys ``cluster_doc`` reads)."""
    level = {"bandwidth": 12e6, "latency": 1e-4, "rms_relative": 0.01, "points": 4}
    return {"hosts": hosts, "per_host": per_host, "backend": "gloo", "device": "cpu", "flops": 30e9,
            "flops_per_rank": [30e9] * (hosts * per_host),
            "levels": {"host": dict(level), "device": dict(level, bandwidth=3e9)} if hosts > 1
            else {"device": dict(level, bandwidth=3e9)}}


def test_testbed_file_has_this_machines_cores(tmp_path):
    doc = cal.cluster_doc([_fit()], "testbed", [100.0], 3)
    assert doc["cores"] == len(os.sched_getaffinity(0)) and doc["cores_per"] == "cluster"
    assert f"  cores: {doc['cores']} per cluster" in cal.summary(doc)
    cal.write_yaml(doc, tmp_path / "cal.yaml", "planc calibrate --on testbed cal.yaml")
    (tmp_path / "p.plan").write_text('cluster "cal.yaml"\nparallel { data = 4 }\n')
    c = load(tmp_path / "p.plan").cluster
    assert (c.cores, c.cores_level) == (len(os.sched_getaffinity(0)), None)
    assert [list(p) for p in c.core_pools()] == [[0, 1, 2, 3]]


def test_cluster_file_has_no_cores(tmp_path):
    doc = cal.cluster_doc([_fit(hosts=1, per_host=2)], "cluster", [None], 3)
    assert "cores" not in doc and "cores_per" not in doc and "cores" not in cal.summary(doc)
    cal.write_yaml(doc, tmp_path / "cal.yaml", "x")
    (tmp_path / "p.plan").write_text('cluster "cal.yaml"\n')
    assert load(tmp_path / "p.plan").cluster.cores is None
