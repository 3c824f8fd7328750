"""Suite-wide settings: every launch keeps DeepSpeed's JIT-built op in this venv (``e2e_util.extensions_env``)."""

import os

# every launch of the suite (testbed, calibrate, failure tests too, not only e2e_util's) keeps
# DeepSpeed's JIT-built CPU op in this venv, where no other environment on the machine rebuilds it
from e2e_util import extensions_env  # noqa: E402

for _k, _v in extensions_env().items():
    os.environ.setdefault(_k, _v)

import glob  # noqa: E402
import time  # noqa: E402

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
