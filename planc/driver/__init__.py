"""The compiler's driver: the passes in order (``compile``), the trainability policy, the
independent re-check of every pass's output (``verify``) and the assembly of the
passes' records into a ``planc.plan.Plan``."""
