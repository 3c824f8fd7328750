"""``planc check``: everything ``planc compile`` runs except writing the output folder, so that check and
compile accept and reject the same plans. That is the front end, the model probe (which builds the model and
runs the user's code once as the runtime will: ``planc.model.usercheck``), every compiler pass, and the checks
the output writer makes before it writes (the code files and the modules they import beside them,
``planc.output.outputfiles``; the DeepSpeed config). ``--no-probe`` keeps the front-end-only check (no model is
built, nothing is compiled)."""
from __future__ import annotations

from pathlib import Path

from planc import ir
from planc.driver.compile import CompiledPlan, compile_file
from planc.diagnostics import PlanError

__all__ = ["check_compiles"]


def check_compiles(path: str | Path, probe: bool = True, cache: bool = True) -> CompiledPlan:
    """Compile ``path`` as ``planc compile`` would and run the output writer's checks, writing nothing.
    A user error is a located ``PlanError``; a plan that cannot train (``CompiledPlan.untrainable``) is
    returned for the caller to report, as ``planc compile`` does. ``cache``: the probe's answer may come
    from the probe cache (``--no-cache``: it runs)."""
    from planc.output.codegen import ds_config
    from planc.output.outputfiles import output_code_files

    compiled = compile_file(path, probe=probe, cache=cache)
    program: ir.Program = compiled.program
    try:
        output_code_files(program)            # what the writer would copy (raises where it could not)
        if program.train is not None:
            ds_config(compiled.plan, program)
    except PlanError as e:
        raise e.with_source(program.source_path, Path(path).read_text()) from None
    return compiled
