"""Backward transfers get communicators of their own (pure part of dist_util)."""

from planc.runtime.dist_util import BACKWARD, direction_groups, lookup_group


def test_backward_view_prefers_backward_communicators():
    fwd, bwd, other = object(), object(), object()
    groups = {(0, 4): fwd, (1, 5): other, (BACKWARD, 0, 4): bwd}
    assert lookup_group(direction_groups(groups, "forward"), [4, 0]) is fwd
    assert lookup_group(direction_groups(groups, "backward"), [4, 0]) is bwd
    assert lookup_group(direction_groups(groups, "backward"), [1, 5]) is other
    assert (BACKWARD, 0, 4) not in direction_groups(groups, "backward")
