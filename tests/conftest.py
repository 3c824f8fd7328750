"""Suite-wide settings: every compile in the test suite (in process or through the CLI) runs with
verification between the passes (planc.verify), as ``planc compile --verify`` does."""

import os

os.environ.setdefault("PLANC_VERIFY", "1")
