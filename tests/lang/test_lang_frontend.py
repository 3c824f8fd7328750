"""The front end's seams: spans outside ``planc.lang``, the loader as the only I/O, the checker
driven by explicit inputs, and parse mistakes collected with the checker's errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from planc import ir
from planc.lang import load_text, read_inputs
from planc.lang.check import ClusterFile, PlanInputs, check
from planc.lang.errors import PlanError
from planc.lang.parse import parse, parse_collecting
from planc.span import Span

CLUSTER = "cluster {\n  level node x 2 : bandwidth 10 GB/s\n  level gpu x 4 : bandwidth 100 GB/s\n}\n"


def test_ir_imports_nothing_from_lang():
    code = "import sys, planc.ir; sys.exit(sorted(m for m in sys.modules if m.startswith('planc.lang')) != [])"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_span_is_reexported_by_errors():
    from planc.lang import errors

    assert errors.Span is Span and ir.Span is Span


def test_mesh_axis_names():
    assert [str(a) for a in ir.MeshAxis] == ["pipe", "data", "tensor"]
    p = load_text(CLUSTER + "parallel { pipe = 2, data = 2, tensor = 2 }\n")
    assert p.pipe_axis is ir.MeshAxis.PIPE
    assert all(type(a) is str for s in p.stages for a in s.mesh_axes)   # names as written stay plain str
    assert ir.derived_mesh(p.parallel) == ((2, 2), ("data", "tensor"))
    assert p.parallel.size_of("pipe") == 2 and p.parallel.size_of("expert", 1) == 1
    with pytest.raises(KeyError):
        p.parallel.size_of("expert")


def test_stage_position_is_level_coords():
    layout = ir.StageLayout(0, None, (2, 3), ("data", "tensor"), (10, 11, 12, 13, 14, 15))
    assert [layout.position(d) for d in layout.devices] == [ir.level_coords(i, (2, 3)) for i in range(6)]


def test_check_reads_no_files():
    """A cluster file is data handed in by the loader; the checker never opens it."""
    text = 'cluster "nowhere/sys.yaml"\nparallel { data = 2, tensor = 4 }\n'
    doc = {"levels": [{"name": "node", "fanout": 2, "bandwidth": "100 Gb/s"},
                      {"name": "gpu", "fanout": 4, "bandwidth": "150 GB/s"}], "host": "node"}
    p = check(parse(text), "/x/p.plan", text, PlanInputs("/x", ClusterFile("nowhere/sys.yaml", doc=doc)))
    assert p.cluster.fanouts == (2, 4) and p.source_dir == "/x"
    with pytest.raises(PlanError) as ei:
        check(parse(text), "/x/p.plan", text, PlanInputs("/x", ClusterFile("nowhere/sys.yaml", problem="unreadable")))
    (d,) = ei.value.diagnostics[:1]
    assert d.message == "unreadable" and (d.span.line, d.span.col) == (1, 9)


def test_loader_gathers_inputs(tmp_path):
    (tmp_path / "sys.yaml").write_text(textwrap.dedent("""\
        levels:
          - {name: a, fanout: 2, bandwidth: 1 GB/s}
        """))
    text = 'cluster "sys.yaml"\n'
    inputs = read_inputs(parse(text), str(tmp_path / "p.plan"))
    assert inputs.source_dir == str(tmp_path.resolve())
    assert inputs.cluster_file.doc == {"levels": [{"name": "a", "fanout": 2, "bandwidth": "1 GB/s"}]}
    missing = read_inputs(parse('cluster "nope.yaml"\n'), str(tmp_path / "p.plan")).cluster_file
    assert missing.doc is None and missing.problem.startswith("cluster file 'nope.yaml' not found")
    assert read_inputs(parse(CLUSTER), str(tmp_path / "p.plan")).cluster_file is None


@pytest.mark.parametrize("body,message", [
    ("cluster {\n  latency 2 us\n  level a x 2 : bandwidth 1 GB/s\n}\n",
     "'latency' must follow a 'level NAME x N' declaration"),
    ("cluster {\n  level a x 2 : bandwidth 1 GB/s\n  host = a\n  host = a\n}\n", "'host' is set twice in this cluster"),
    (CLUSTER + "parallel { data = 8, place = auto, place = auto }\n", "'place' is set twice in this parallel block"),
])
def test_misplaced_block_items_are_collected(body, message):
    tree, found = parse_collecting(body + "reduce w over nothing : f32[4]\n")
    assert [d.message for d in found] == [message]
    with pytest.raises(PlanError) as ei:          # parse() alone still refuses the plan
        parse(body)
    assert [d.message for d in ei.value.diagnostics] == [message]
    with pytest.raises(PlanError) as ei:          # and load_text reports it with the checker's errors
        load_text(body + "reduce w over nothing : f32[4]\n")
    msgs = [d.message for d in ei.value.diagnostics]
    assert msgs[0] == message and msgs[-1].startswith("'nothing' is not an axis")
    pos = [(d.span.line, d.span.col) for d in ei.value.diagnostics]
    assert pos == sorted(pos)


def test_first_of_a_repeated_item_stands():
    with pytest.raises(PlanError) as ei:
        load_text("cluster {\n  level a x 2 : bandwidth 1 GB/s\n  host = a\n  host = b\n}\n")
    assert [d.message for d in ei.value.diagnostics] == ["'host' is set twice in this cluster"]
