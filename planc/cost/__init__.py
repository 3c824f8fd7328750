"""The cost model: the only place that knows bandwidths and latencies.

``network`` is the tree-of-links model, ``collectives`` the times of ring and
pipelined-chain collectives on it (see docs/cost-model.md).
"""

from planc.cost.collectives import (
    allreduce_lower_bound,
    collective_time,
    held_after,
    program_time,
    step_coefficients,
)
from planc.cost.network import Network

__all__ = ["Network", "collective_time", "program_time", "held_after", "allreduce_lower_bound",
           "step_coefficients"]
