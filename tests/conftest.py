"""Suite-wide settings: every launch keeps DeepSpeed's JIT-built op in this venv (``e2e_util.extensions_env``);
every folder of tests is importable from any other (README.md, "Folders")."""

import os
import sys
from pathlib import Path

# tests/ (the shared helpers: e2e_util, forkstart, hf_reference, plan_contract) is on the path as this file's
# folder; the folders of tests are too, so a test's helpers in another folder import by name
# (``import test_runtime_harness as H``, ``from test_deadlock import ...``) whichever file runs alone, and
# the processes a test spawns inherit the same path
_TESTS = Path(__file__).resolve().parent
for _folder in sorted({p.parent for p in _TESTS.glob("*/test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# every launch of the suite (testbed, calibrate, failure tests too, not only e2e_util's) keeps
# DeepSpeed's JIT-built CPU op in this venv, where no other environment on the machine rebuilds it
from e2e_util import extensions_env  # noqa: E402

for _k, _v in extensions_env().items():
    os.environ.setdefault(_k, _v)

import glob  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

# One intra-op thread for what a test computes in its own process (the references, the in-process
# runtime tests): the suite runs two workers on two cores beside the ranks they launch, and torch's
# default (a thread per core) makes each worker's OpenMP threads spin against the other's and the
# ranks': the nic-order reference took 15-33 s so, 5-7 s on one thread. The ranks are unaffected:
# their threads are the runtime's choice (``launch_env`` passes no OMP_NUM_THREADS).
torch.set_num_threads(1)

_STARTED = time.time()


def pytest_sessionfinish(session, exitstatus):
    """DeepSpeed's CPU accelerator leaves a ~69 MB shared-memory buffer per rank in /dev/shm when a
    rank dies (the failure tests kill ranks on purpose): remove the ones this session's runs made."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return   # the controller cleans up once every worker is done
    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        try:
            if os.stat(path).st_mtime >= _STARTED:
                os.unlink(path)
        except OSError:
            pass


# The suite runs on two workers (Makefile: pytest -n 2 --dist loadgroup), which take the tests in
# collection order. The launches dominate it (each several seconds of start-up on 2 cores), so the
# files that hold the most launches go first, longest first: the last test a worker takes is then a
# short one, and neither waits alone at the end for a long file the other could have shared. The order
# is by launches held (and the known slow fixtures); `make test` prints --durations=30 to correct it.
LONG_FIRST = (
    "test_hf_models.py", "test_checkpoint_reshard.py", "test_e2e_regime.py", "test_failures.py",
    "test_checkpoint.py", "test_e2e_zero3_ckpt.py", "test_e2e_zero2.py", "test_e2e_zero3.py", "test_bench_zero3.py",
    "test_hf_gpt2.py", "test_hf_tp.py", "test_e2e_unequal.py", "test_e2e.py",
    "test_checkpoint_cli.py", "test_testbed_faults.py", "test_testbed_failures.py", "test_testbed.py",
    "test_testbed_watch.py", "test_quota.py", "test_calibrate.py", "test_user_mistakes.py", "test_comm_only.py",
    "test_bench_iteration.py", "test_e2e_nic_order.py", "test_chain_default.py", "test_packaging.py",
    "test_runtime_reduce.py", "test_runtime_reduce_zero.py", "test_runtime_reshard.py", "test_runtime_harness.py",
)
# files whose module- or session-scoped fixtures launch ranks: one worker takes all of a file's tests,
# so the fixture's launches run once, not once per worker (``pytest_xdist_make_scheduler``; the
# xdist_group marks say the same for a reader and for an xdist whose loadgroup reads them)
ONE_WORKER = ("test_checkpoint_reshard.py", "test_checkpoint.py", "test_testbed_faults.py",
              "test_testbed_failures.py", "test_bench_iteration.py")


def pytest_collection_modifyitems(config, items):
    import pytest
    rank = {name: i for i, name in enumerate(LONG_FIRST)}

    def key(item):
        name = item.path.name
        if name in rank:
            return rank[name]
        return len(LONG_FIRST) + (0 if item.get_closest_marker("slow") else 1)

    for item in items:
        if item.path.name in ONE_WORKER:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    items.sort(key=key)    # stable: a file's tests keep their order


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with a ONE_WORKER file's tests as one unit, in collection order (long first).

    xdist's own loadgroup finds a test's group in a suffix its worker adds to the test's id, and with
    pytest 9 (ids kept in ``Node._id``) that suffix never reaches the id: every test was its own unit,
    and a ONE_WORKER file's tests went to both workers, each running the file's fixtures (a chain of
    launches, a testbed run) once. Here the unit is read from the id's file name instead. The units
    keep the collection's order (not xdist's default, the biggest unit first): the order of
    ``pytest_collection_modifyitems`` above."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FileGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.rsplit("/", 1)[-1] in ONE_WORKER:
                return path
            return super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return FileGroups(config, log)
