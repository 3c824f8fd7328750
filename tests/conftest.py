"""Suite-wide settings: every compile in the test suite (in process or through the CLI) runs with
verification between the passes (planc.verify), as ``planc compile --verify`` does."""

import os

os.environ.setdefault("PLANC_VERIFY", "1")

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
