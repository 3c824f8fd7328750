"""DeepSpeed's JIT-built CPU op, loaded without its build lock when it is already built.

DeepSpeed builds its shared-memory op (``deepspeed_shm_comm``) through torch's JIT extension loader the
first time a rank starts; every later start loads it through the same path, which takes a lock file in
the build folder for the length of a no-op ninja run. A rank killed in that window (a launch whose other
rank failed and was killed by the launcher, a user's Ctrl-C) leaves the lock behind, and every later
launch on the machine waits on it forever. ``preload_built_op`` imports the built library directly when
it is newer than every source it was built from (what ninja would find: nothing to do), so no lock is
taken; otherwise DeepSpeed's own path runs as before (it builds, or waits for a build in progress).
"""
from __future__ import annotations

import importlib.util
import os

__all__ = ["preload_built_op", "OP"]

OP = "ShareMemCommBuilder"


def preload_built_op() -> bool:
    """Whether the op was imported from its build folder (False: DeepSpeed's path will load or build it)."""
    try:
        import torch.utils.cpp_extension as ce
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder.builder import OpBuilder
        builder = get_accelerator().create_op_builder(OP)
        if builder is None or builder.name in OpBuilder._loaded_ops:
            return False
        library = os.path.join(ce._get_build_directory(builder.name, False), f"{builder.name}.so")
        if not os.path.isfile(library):
            return False
        built = os.path.getmtime(library)
        sources = [builder.deepspeed_src_path(s) for s in builder.sources()]
        if not sources or any(not os.path.isfile(s) or os.path.getmtime(s) > built for s in sources):
            return False
        spec = importlib.util.spec_from_file_location(builder.name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        OpBuilder._loaded_ops[builder.name] = module
        return True
    except Exception:  # noqa: BLE001 - any doubt: DeepSpeed's own loader decides, as before
        return False
