"""Stand-in for ``planc.reduction.best_time`` while the reduction package has not landed.

It costs the flat single AllReduce over every reduction group at once with
the cost model (``planc.cost.collectives``), i.e. no synthesis. It is used
only when ``from planc.reduction import best_time`` fails; delete this file
once that import works.
"""

from __future__ import annotations

import math
from collections import defaultdict

from planc import ir
from planc.cost.collectives import collective_time
from planc.cost.network import Network
from planc.placement.mapping import coords_for


def best_time(cluster: ir.Cluster, matrix, axis_names, reduction_axes, nbytes, synthesis) -> float:
    sizes = [math.prod(row) for row in matrix]
    coords = coords_for(matrix, cluster.fanouts, sizes)
    red = {axis_names.index(a) for a in reduction_axes}
    groups: dict[tuple, list[int]] = defaultdict(list)
    for d, c in enumerate(coords):
        groups[tuple(x for i, x in enumerate(c) if i not in red)].append(d)
    return collective_time(Network(cluster), ir.Collective.ALLREDUCE, list(groups.values()), nbytes)
