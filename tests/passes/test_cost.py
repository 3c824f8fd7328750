"""Hand-computed cases for the tree-of-links network and the collective costs."""

import math

import pytest

from planc import ir
from planc.cost import Network, allreduce_lower_bound, collective_time, program_time
from planc.cost.network import DOWN, UP

C = ir.Collective
GB = 1e9


def two_by_four(node_bw=10 * GB, gpu_bw=100 * GB, node_lat=1e-5, gpu_lat=1e-6):
    return ir.Cluster(
        (ir.Level("node", 2, node_bw, node_lat), ir.Level("gpu", 4, gpu_bw, gpu_lat)), "node"
    )


def running_example():
    """P² Fig. 2(a): rack 1, server 2, cpu 2, gpu 4."""
    return ir.Cluster(
        (
            ir.Level("rack", 1, None),
            ir.Level("server", 2, 1 * GB, 1e-5),
            ir.Level("cpu", 2, 10 * GB, 1e-6),
            ir.Level("gpu", 4, 100 * GB, 1e-7),
        ),
        "server",
    )


def test_crossing_level_and_path():
    net = Network(two_by_four())
    assert net.crossing_level(0, 3) == 1
    assert net.crossing_level(0, 4) == 0
    assert net.crossing_level(5, 5) == 2
    assert net.path_links(0, 3) == ((1, 0, UP), (1, 3, DOWN))
    assert net.path_links(1, 6) == ((1, 1, UP), (0, 0, UP), (0, 1, DOWN), (1, 6, DOWN))
    assert net.path_links(2, 2) == ()


def test_fanout_one_levels_have_no_link():
    net = Network(running_example())
    # devices 0 and 16 differ at the server level; the rack level (fanout 1) is never crossed
    assert net.crossing_level(0, 8) == 1
    assert [l[0] for l in net.path_links(0, 8)] == [3, 2, 1, 1, 2, 3]
    assert net.latency(0, 8) == pytest.approx(1e-5 + 1e-6 + 1e-7)
    assert net.latency(0, 1) == pytest.approx(1e-7)


def test_latency_sums_crossed_levels():
    net = Network(two_by_four())
    assert net.latency(0, 1) == pytest.approx(1e-6)
    assert net.latency(0, 7) == pytest.approx(1e-5 + 1e-6)
    assert net.latency(3, 3) == 0.0


def test_flows_time_single_flow():
    net = Network(two_by_four())
    assert net.flows_time([(0, 1, 1e9)]) == pytest.approx(1e9 / 100e9 + 1e-6)
    # cross-node: the node link (10 GB/s) is the bottleneck
    assert net.flows_time([(0, 4, 1e9)]) == pytest.approx(0.1 + 1.1e-5)


def test_flows_time_contention():
    net = Network(two_by_four(node_lat=0, gpu_lat=0))
    # four GPUs of node 0 each send 1 GB to node 1: node 0's up-link carries 4 GB
    flows = [(g, 4 + g, 1e9) for g in range(4)]
    assert net.flows_time(flows) == pytest.approx(4e9 / 10e9)
    # opposite directions do not contend (full duplex)
    assert net.flows_time([(0, 4, 1e9), (4, 0, 1e9)]) == pytest.approx(0.1)
    # two flows into one GPU share its down-link
    assert net.flows_time([(1, 0, 1e9), (2, 0, 1e9)]) == pytest.approx(2e9 / 100e9)
    assert net.link_loads([(1, 0, 5.0), (2, 0, 5.0)])[(1, 0, DOWN)] == 10.0


def test_ring_allreduce_one_level():
    net = Network(two_by_four())
    S, k, B, a = 4e8, 4, 100 * GB, 1e-6
    expected = 2 * (k - 1) / k * S / B + 2 * (k - 1) * a
    assert collective_time(net, C.ALLREDUCE, [(0, 1, 2, 3)], S) == pytest.approx(expected)
    # both nodes at once: disjoint links, same time
    assert collective_time(net, C.ALLREDUCE, [(0, 1, 2, 3), (4, 5, 6, 7)], S) == pytest.approx(expected)


def test_reduce_scatter_and_all_gather():
    net = Network(two_by_four(gpu_lat=0))
    S = 4e8
    assert collective_time(net, C.REDUCE_SCATTER, [(0, 1, 2, 3)], S) == pytest.approx(3 / 4 * S / 100e9)
    # all_gather of pieces of S/4 moves the same bytes as the reduce_scatter
    assert collective_time(net, C.ALL_GATHER, [(0, 1, 2, 3)], S / 4) == pytest.approx(3 / 4 * S / 100e9)


def test_chain_broadcast_and_reduce():
    net = Network(two_by_four(gpu_lat=1e-6))
    S = 1e9
    # pipelined chain 0→1→2→3: S/B + 3 hops of latency
    assert collective_time(net, C.BROADCAST, [(0, 1, 2, 3)], S) == pytest.approx(S / 100e9 + 3e-6)
    assert collective_time(net, C.REDUCE, [(0, 1, 2, 3)], S) == pytest.approx(S / 100e9 + 3e-6)


def test_cross_group_contention():
    """Four groups {g, 4+g} all cross the same node links: 4x the bytes on each NIC."""
    net = Network(two_by_four(node_lat=0, gpu_lat=0))
    S = 1e9
    one = collective_time(net, C.ALLREDUCE, [(0, 4)], S)
    assert one == pytest.approx(2 * 1 / 2 * S / 10e9)
    four = collective_time(net, C.ALLREDUCE, [(g, 4 + g) for g in range(4)], S)
    assert four == pytest.approx(4 * one)


def test_ring_across_nodes_crosses_each_nic_once():
    net = Network(two_by_four(node_lat=0, gpu_lat=0))
    S = 8e8
    # ring 0..7 in rank order crosses node links once in each direction per round
    t = collective_time(net, C.ALLREDUCE, [tuple(range(8))], S)
    assert t == pytest.approx(2 * 7 / 8 * S / 10e9)
    assert allreduce_lower_bound(net, range(8), S) == pytest.approx(t)


def test_program_time_tracks_held_size():
    net = Network(two_by_four(node_lat=0, gpu_lat=0))
    S = 8e8
    steps = [
        (C.REDUCE_SCATTER, [(0, 1, 2, 3), (4, 5, 6, 7)]),
        (C.ALLREDUCE, [(g, 4 + g) for g in range(4)]),
        (C.ALL_GATHER, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ]
    rs = 3 / 4 * S / 100e9
    ar = 4 * (2 * 1 / 2 * (S / 4) / 10e9)  # four groups of S/4 share each NIC
    assert program_time(net, steps, S) == pytest.approx(rs + ar + rs)
    flat = collective_time(net, C.ALLREDUCE, [tuple(range(8))], S)
    assert program_time(net, steps, S) < flat


def test_lower_bound_edge_cases():
    net = Network(two_by_four())
    assert allreduce_lower_bound(net, [3], 1e9) == 0.0
    assert allreduce_lower_bound(net, [0, 1], 1e9) == pytest.approx(1e9 / 100e9)
    assert net.bottleneck_bandwidth([0]) == math.inf


def test_large_cluster_is_fast_enough():
    cl = ir.Cluster(
        (ir.Level("node", 512, 25 * GB, 1e-5), ir.Level("gpu", 8, 300 * GB, 1e-6)), "node"
    )
    net = Network(cl)
    groups = [tuple(range(8 * n, 8 * n + 8)) for n in range(512)]
    t = collective_time(net, C.ALLREDUCE, groups, 1e9)
    assert t == pytest.approx(2 * 7 / 8 * 1e9 / 300e9 + 14e-6)


def test_missing_bandwidth_on_linked_level_rejected():
    with pytest.raises(ValueError):
        Network(ir.Cluster((ir.Level("node", 2, None),), "node"))


def _walked_time(net, collective, groups, nbytes):
    """Reference: every edge's path walked link by link (the pre-counting algorithm)."""
    from planc.cost.collectives import _edge_bytes_and_rounds, _edges, _RING
    flows, latency = [], 0.0
    for g in groups:
        members = sorted(g)
        if len(members) < 2:
            continue
        per_edge, rounds = _edge_bytes_and_rounds(collective, len(members), nbytes)
        edges = _edges(collective, members)
        flows.extend((a, b, per_edge) for a, b in edges)
        lats = [net._lat_from[net.crossing_level(a, b)] for a, b in edges]
        latency = max(latency, rounds * max(lats) if collective in _RING else sum(lats))
    loads = {}
    for a, b, w in flows:
        if a != b and w > 0:
            for link in net.path_links(a, b):
                loads[link] = loads.get(link, 0.0) + w
    return max((x / net.link_capacity(l) for l, x in loads.items()), default=0.0) + latency


@pytest.mark.parametrize("seed", range(6))
def test_counted_step_time_equals_walked_paths(seed):
    """Counting link loads per unit gives exactly the per-edge path walk, for arbitrary groups."""
    import random
    from planc.cost.collectives import step_coefficients
    rng = random.Random(seed)
    for cluster in (running_example(), two_by_four(),
                    ir.Cluster((ir.Level("pod", 3, 1 * GB, 3e-5), ir.Level("rack", 1, None),
                                ir.Level("node", 2, 7 * GB, 1e-5), ir.Level("gpu", 3, 90 * GB, 1e-6)), "node")):
        net = Network(cluster)
        for _ in range(40):
            devices = list(range(cluster.devices))
            rng.shuffle(devices)
            groups, i = [], 0
            while i < len(devices):
                k = rng.randint(1, 5)
                groups.append(tuple(devices[i:i + k]))
                i += k
            groups = groups[:rng.randint(1, len(groups))]
            for c in C:
                for nbytes in (0.0, 1.0, 3e6):
                    assert collective_time(net, c, groups, nbytes) == _walked_time(net, c, groups, nbytes)
                a, b = step_coefficients(net, c, groups)
                assert b == collective_time(net, c, groups, 0.0)
                assert a == collective_time(net, c, groups, 1.0) - b
