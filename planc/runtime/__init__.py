"""planc's runtime, copied into every compiled output as ``planc_runtime``.

Imports only torch, deepspeed, the standard library and the contract package ``planc.plan``
(copied beside it into every output as ``OUT/planc/plan/``). Entry point:
``planc_runtime.main.main`` (called by OUT/train.py through ``planc_runtime.entry.run``); the pipeline engine is
``planc_runtime.engine.PlanEngine``; ``python -m planc_runtime.probe`` sizes
a model for the compiler.
"""
