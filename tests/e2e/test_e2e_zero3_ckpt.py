"""End-to-end: checkpoints across ZeRO degrees (docs/training.md "ZeRO-2", "ZeRO-3", "Checkpoints"): one
reference run in six launches, each resuming the previous launch's checkpoint under another degree
(0 -> 2 -> 3 -> 1 -> 3 -> 0: ZeRO-2 from 0 and into 3, every pair of 3 with 0 and 1 both ways), AdamW +
clip on data 2 -> data 4; losses, norms and the last launch's parameters against
``independent_reference`` at rtol 1e-4, with the negative controls. Slow: 6 launches of 9 ranks.
"""
from __future__ import annotations

import pytest

from e2e_util import (assert_controls_fail, compare_dumps, data_degree, independent_reference, stage_ranks,
                      start_ranks, step_lines)
from test_e2e_zero2 import ADAMW_CLIP, train_settings, variant


def _chain(tmp_path, degrees):
    """One run in one launch per entry of zero ``degrees``: each resumes the previous one's checkpoint; the
    losses, norms and the last launch's parameters are one uninterrupted reference run's."""
    launches = []
    for i, zero in enumerate(degrees):
        src, out, plan = variant(tmp_path, "mlp-data2-to-data4.plan", train_settings(zero, ADAMW_CLIP), f"z{i}{zero}")
        args = ["--steps", i + 1, "--save", tmp_path / f"ck{i}"]
        if i:
            args += ["--resume", tmp_path / f"ck{i - 1}"]
        if i == len(degrees) - 1:
            args += ["--dump-params", tmp_path / "dump"]
        assert plan["train"]["zero"] == zero
        rc, text, every = start_ranks(out, plan["cluster"]["devices"], *args)
        assert rc == 0 and "Traceback" not in every, every[-4000:]
        assert sorted(step_lines(text)) == [i], text[-2000:]
        if i:
            assert f"resumed from {tmp_path / f'ck{i - 1}' / f'step{i}'} at step {i}" in text, text[-2000:]
        launches.append(step_lines(text))

    def compare(ref_losses, ref_state, record):
        for i, lines in enumerate(launches):
            assert lines[i]["loss"] == pytest.approx(ref_losses[i], rel=1e-4, abs=1e-6), i
            assert lines[i]["grad_norm"] == pytest.approx(record["grad_norm"][i], rel=1e-4), i
        compare_dumps(tmp_path / "dump", stage_ranks(plan), ref_state, rtol=1e-4, atol=1e-6)

    record: dict = {}
    compare(*independent_reference(plan, out, len(degrees), record=record, source=src), record)
    assert_controls_fail(compare, plan, out, len(degrees), source=src, data_parts=data_degree(plan))


@pytest.mark.slow
def test_checkpoints_cross_zero_degrees_0_2_3_1_3_0(tmp_path):
    _chain(tmp_path, (0, 2, 3, 1, 3, 0))
