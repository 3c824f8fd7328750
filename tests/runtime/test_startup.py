"""planc_runtime.startup (``train.py --profile-startup``, issue 45): the phase clock and its tables."""

import time

import pytest

from planc.runtime.startup import PHASES, StartupClock, durations, process_start, profile_table, rank_line


def test_process_start_is_before_now_and_recent():
    start = process_start()
    assert start is not None and start <= time.time() and time.time() - start < 3600


def test_durations_follow_the_phases_from_the_process_start():
    rec = {"start": 100.0, "ends": {"imports": 105.0, "process group": 106.5, "first step": 110.0}}
    assert durations(rec) == [("imports", 5.0), ("process group", 1.5), ("first step", 3.5)]
    assert "to the end of the first step 10.00 s" in rank_line(3, rec) and rank_line(3, rec).startswith("startup rank 3:")


def test_the_clock_marks_each_phase_once_and_refuses_unknown_ones():
    clock = StartupClock(start=time.time() - 1.0)
    for phase in PHASES:
        clock.mark(phase)
    first = clock.record()["ends"]["imports"]
    clock.mark("imports")                       # a second mark keeps the first
    assert clock.record()["ends"]["imports"] == first
    assert [p for p, _ in durations(clock.record())] == list(PHASES)
    with pytest.raises(ValueError, match="unknown start-up phase"):
        clock.mark("lunch")


def test_profile_table_gives_median_slowest_and_the_launch_span():
    recs = [{"start": 10.0 + r, "ends": {"imports": 15.0 + r, "first step": 20.0 + 2 * r}} for r in range(3)]
    text = profile_table(recs)
    assert "over 3 ranks" in text
    rows = {line.split()[0]: line.split()[-2:] for line in text.splitlines()[1:3]}
    assert rows == {"imports": ["5.00", "5.00"], "first": ["6.00", "7.00"]}   # median, slowest
    assert "startup to the first step's end: 14.00 s" in text    # rank 2 ends at 24, rank 0 started at 10


def test_entry_runs_main_with_the_collector_back_on(monkeypatch):
    """OUT/train.py's entry (planc_runtime.entry): main's return code ends the process, the collector enabled again,
    both while main runs and after; torch._dynamo deferred before main is imported (here recorded, not
    done: this test process keeps its own torch)."""
    import gc
    import sys
    import types

    from planc.runtime import entry

    seen = {}
    fake = types.ModuleType("planc.runtime.main")
    fake.main = lambda out_dir: seen.update(out_dir=out_dir, enabled=gc.isenabled()) or 7
    monkeypatch.setitem(sys.modules, "planc.runtime.main", fake)
    monkeypatch.setattr(sys.modules["planc.runtime"], "main", fake, raising=False)
    monkeypatch.setattr(entry, "_defer_dynamo", lambda: seen.update(deferred="main" not in seen))
    monkeypatch.setattr(entry, "_exit_now", lambda code: seen.update(exit=code))
    try:
        entry.run("/some/out")
        assert seen == {"out_dir": "/some/out", "enabled": True, "deferred": True, "exit": 7} and gc.isenabled()
    finally:
        gc.unfreeze()      # this test process's objects go back to the collector


def test_bench_startup_reads_the_table_rank_0_prints():
    """benchmarks/bench/startup.py parses rank 0's --profile-startup table: the two stay in step."""
    from benchmarks.bench.startup import _phases
    recs = [{"start": 10.0, "ends": {"imports": 15.0, "process group": 15.5, "first step": 18.0}}]
    rows, start = _phases("step 0 loss 1.0\n" + profile_table(recs) + "\n")
    assert rows == [("imports", 5.0, 5.0), ("process group", 0.5, 0.5), ("first step", 2.5, 2.5)]
    assert start == 10.0


def test_torch_dynamo_waits_for_a_use_and_the_optimizers_compute_the_same():
    """planc_runtime.lazydynamo: the eager optimizers' steps (SGD, Adam, AdamW) and a gloo process group
    leave the real torch._dynamo unimported and compute bit for bit what they compute with it imported;
    the first other use (here ``torch._dynamo.config``) imports the real module, and a function wrapped
    before that goes through the real ``disable`` from then on."""
    import subprocess
    import sys
    code = r'''
import os, sys, tempfile
import torch
from planc.runtime import lazydynamo
assert lazydynamo.defer() and not lazydynamo.loaded()
import torch.distributed as dist

def train():
    torch.manual_seed(0)
    out = []
    for opt in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        p = torch.nn.Parameter(torch.randn(5, 3))
        o = opt([p], lr=0.1)
        for _ in range(3):
            o.zero_grad()
            (p.sin() * torch.arange(3.0)).sum().backward()
            o.step()
        out.append(p.detach().clone())
    return out

store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
lazy = train()
assert not lazydynamo.loaded(), "an eager step imported torch._dynamo"
wrapped = torch._dynamo.disable(lambda x: x + 1)
assert torch._dynamo.config is not None and lazydynamo.loaded()
import torch._dynamo
assert sys.modules["torch._dynamo"] is torch._dynamo and torch._dynamo.__file__.endswith("__init__.py")
calls = []
real_disable = torch._dynamo.disable
torch._dynamo.disable = lambda fn, *a, **k: calls.append(fn) or real_disable(fn, *a, **k)
assert wrapped(1) == 2 and len(calls) == 1
real = train()
assert all(torch.equal(a, b) for a, b in zip(lazy, real))
assert lazydynamo.load() is torch._dynamo
print("ok")
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_the_model_probe_counts_flops_without_importing_torch_dynamo(tmp_path):
    """The compiler's probe subprocess (``python -m planc.runtime.probe REQUEST``) measures a model with
    FLOPs counted and leaves the real torch._dynamo unimported (lazydynamo: about a CPU second of every
    cold compile); its answer is the one the probe gives with torch._dynamo imported first."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from planc.driver.compile import chain_transfers, load
    from planc.model.probe import probe_request
    root = Path(__file__).resolve().parents[2]
    req = json.dumps(probe_request(chain_transfers(load(root / "plans" / "gpt-2x4.plan")), flops=True))
    code = r'''
import io, json, sys, contextlib
mode = sys.argv[2]
if mode == "eager":
    import torch._dynamo
from planc.runtime import lazydynamo, probe
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    assert probe.main([sys.argv[1]]) == 0
answer = json.loads(buf.getvalue())
assert answer["layer_flops"] and sum(map(sum, answer["layer_flops"])) > 0 and not answer["flop_errors"], answer
print(json.dumps({"loaded": lazydynamo.loaded(), "answer": answer}, sort_keys=True))
'''
    runs = {}
    for mode in ("lazy", "eager"):
        proc = subprocess.run([sys.executable, "-c", code, req, mode], capture_output=True, text=True, timeout=300,
                              cwd=root)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        runs[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["lazy"]["loaded"] is False and runs["eager"]["loaded"] is True
    assert runs["lazy"]["answer"] == runs["eager"]["answer"]


def test_a_finished_rank_ends_with_its_code_after_the_exit_handlers(tmp_path):
    """``entry._exit_now``: what was printed (unflushed) and what an exit handler writes both arrive,
    and the process's code is main's: no interpreter teardown is needed for either."""
    import subprocess
    import sys
    script = tmp_path / "r.py"
    script.write_text("import atexit, sys\n"
                      "from planc.runtime.entry import _exit_now\n"
                      "atexit.register(lambda: sys.stdout.write('handler ran\\n'))\n"
                      "sys.stdout.write('printed ')\n"
                      "_exit_now(3)\n"
                      "print('never')\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and r.stdout == "printed handler ran\n", (r.returncode, r.stdout, r.stderr)
