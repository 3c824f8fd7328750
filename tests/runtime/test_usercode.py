"""Loading the user's model, loss and data functions (planc/runtime/usercode.py, runtime/main.py): a typo in
the plan's FILE:FUNCTION is a message that names it, told apart from an error inside the user's own file."""

from __future__ import annotations

import pytest

from planc.runtime.dataflow import EngineError
from planc.runtime.main import load_function
from planc.plan import CodeRef
from planc.runtime.usercode import MissingFunction, load_callable


def test_a_missing_function_names_what_the_file_defines(tmp_path):
    (tmp_path / "m1.py").write_text("def build():\n    return []\n\ndef loss(a, b):\n    return 0\n\nX = 3\n")
    assert load_callable(str(tmp_path / "m1.py"), "build")() == []
    with pytest.raises(MissingFunction, match=r"'biuld' is not defined in m1.py \(it defines: build, loss\)"):
        load_callable(str(tmp_path / "m1.py"), "biuld")
    with pytest.raises(MissingFunction, match="'X' is a int, not a function"):
        load_callable(str(tmp_path / "m1.py"), "X")
    with pytest.raises(FileNotFoundError):
        load_callable(str(tmp_path / "nothere.py"), "build")


def test_an_error_inside_the_users_file_is_not_called_a_typo(tmp_path):
    (tmp_path / "m2.py").write_text("import os\nos.no_such_thing\n")
    with pytest.raises(AttributeError) as e:
        load_callable(str(tmp_path / "m2.py"), "build")
    assert not isinstance(e.value, MissingFunction) and "no_such_thing" in str(e.value)
    # the half-imported module is not kept: the next call runs the file again (and fails again)
    with pytest.raises(AttributeError):
        load_callable(str(tmp_path / "m2.py"), "build")


def test_the_runtime_names_the_plans_entry(tmp_path):
    (tmp_path / "m3.py").write_text("def loss(a, b):\n    return 0\n")
    assert load_function(str(tmp_path), CodeRef("m3.py", "loss"), "loss")(1, 2) == 0
    with pytest.raises(EngineError, match=r"the plan's loss m3.py:losss: 'losss' is not defined in m3.py"):
        load_function(str(tmp_path), CodeRef("m3.py", "losss"), "loss")
    with pytest.raises(EngineError, match=r"the plan's data gone.py:batches: .*gone.py not found"):
        load_function(str(tmp_path), CodeRef("gone.py", "batches"), "data")


def test_gradient_buckets_split_where_the_dtype_changes():
    """A stage whose parameters have several dtypes (an f64 layer after f32 ones) gets one bucket per run
    of one dtype instead of refusing to start."""
    import torch

    from planc.runtime.grads import GradientBuckets

    class Stub:
        granule = 1

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)),
              torch.nn.Parameter(torch.zeros(4, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(5))]
    gb = GradientBuckets(params, Stub(), torch.device("cpu"))
    # backward order; each bucket holds its gradients, then one flag per parameter
    assert [(b.dtype, b.numel()) for b, _ in gb.buckets] == [(torch.float32, 5 + 1), (torch.float64, 6 + 2),
                                                             (torch.float32, 3 + 1)]
    gb.attach()
    assert all(p.grad.dtype == p.dtype and p.grad.shape == p.shape for p in params)


@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_parameter_no_rank_used_ends_the_step_without_a_gradient(elsewhere):
    """As in plain torch, a parameter the step's forward never used has ``.grad`` None after the
    reduction (so SGD's weight decay and momentum, and Adam, leave it alone), unless another rank of
    the group produced a gradient for it: then it holds the reduced sum like every other one."""
    import torch

    from planc.runtime.grads import GradientBuckets

    class OtherRank:
        """The reduction of a group of two: adds what the other rank's buffer holds."""
        granule = 4
        other = None

        def run(self, flat):
            if self.other is not None:
                flat += self.other
            return flat

    used, spare = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    ex = OtherRank()
    gb = GradientBuckets([used, spare], ex, torch.device("cpu"))
    (buf, placed), = gb.buckets
    at = gb.flags_at[0]
    if elsewhere:   # the other rank used both: its gradients are 1, its flags 1
        ex.other = torch.zeros_like(buf)
        ex.other[:at] = 1.0
        ex.other[at:at + len(placed)] = 1.0
    for _ in range(2):   # two steps: the flags start from zero in each
        gb.attach()
        gb.arm()
        (used * 2.0).sum().backward()
        gb.finish()
        assert used.grad.tolist() == ([3.0] * 3 if elsewhere else [2.0] * 3)
        assert (spare.grad is not None) == elsewhere
        if elsewhere:
            assert spare.grad.tolist() == [1.0, 1.0]


def test_a_stage_without_parameters_gets_an_optimizer_that_changes_nothing():
    import torch

    from planc.runtime.dataflow import build_optimizer
    opt = build_optimizer(torch.nn.GELU().parameters(), {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    opt.step()
    opt.zero_grad()
    assert [p.numel() for g in opt.param_groups for p in g["params"]] == [0]


def test_the_start_up_shape_check_leaves_batchnorm_statistics_alone(tmp_path):
    """The runtime's start-up check runs each stage's layers once in training mode; BatchNorm's running
    statistics and batch count must come out as they went in (one extra update before step 0 otherwise)."""
    import torch

    from planc.driver.compile import compile_file
    from planc import plan as planfile
    from planc.runtime.dataflow import check_stage_shapes

    (tmp_path / "bn.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "def build():\n    return [nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)]\n\n"
        "def loss(o, y):\n    return nn.functional.mse_loss(o, y)\n\n"
        "def batches(micro_batch, seed, **_):\n    g = torch.Generator().manual_seed(seed)\n    while True:\n"
        "        x = torch.randn(micro_batch, 4, generator=g)\n        yield x, x[:, :2]\n")
    (tmp_path / "bn.plan").write_text("""plan bn {
  cluster { level node x 1 : bandwidth 1 GB/s
            level cpu x 2 : bandwidth 10 GB/s }
  model "bn.py:build" { }
  loss  "bn.py:loss"
  data  "bn.py:batches"
  stage 0 : layers 0..1 on devices 0..1 as (data = 1)
  stage 1 : layers 1..3 on devices 1..2 as (data = 1)
  transfer h from stage 0 to stage 1
  train { micro_batch = 4, micro_batches = 2, steps = 1, optimizer = sgd(lr = 0.1) }
}
""")
    c = compile_file(tmp_path / "bn.plan")
    plan = planfile.Plan.from_json(c.plan_json)
    from e2e_util import _load_callable
    layers = _load_callable(tmp_path, {"file": "bn.py", "function": "build"})()
    bn = layers[1]
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    x, _ = next(_load_callable(tmp_path, {"file": "bn.py", "function": "batches"})(4, 0))
    assert check_stage_shapes(plan, 1, layers[1:3], x) == []
    after = bn.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), {k: (before[k], after[k]) for k in before}
    assert int(after["num_batches_tracked"]) == 0


def test_a_builder_taking_layers_builds_only_the_share():
    """build_layers passes ``stage_layers=range(a, b)`` to a builder that takes it; the builder may return the held
    layers or all of them (None outside the range); the result is always the model's length; a builder
    without the keyword is called as before; a wrong count is refused naming both."""
    import pytest as _pytest
    from planc.runtime.usercode import build_layers
    calls = []

    def held_only(width, layers, stage_layers):   # `layers`: the builder's own count, as in examples/
        calls.append((layers, stage_layers))
        return [f"L{i}" for i in stage_layers]

    def all_of_them(width, stage_layers):
        return [f"L{i}" if i in stage_layers else None for i in range(5)]

    def plain(width):
        return [f"L{i}" for i in range(5)]

    assert build_layers(held_only, {"width": 4, "layers": 5}, None, range(1, 3), 5) == [None, "L1", "L2", None, None]
    assert calls == [(5, range(1, 3))]   # the model's own `layers` argument is left as the plan gives it
    assert build_layers(all_of_them, {"width": 4}, None, range(3, 5), 5) == [None, None, None, "L3", "L4"]
    assert build_layers(plain, {"width": 4}, None, range(1, 3), 5) == plain(4)

    def wrong(width, stage_layers):
        return ["x"] * 3
    with _pytest.raises(ValueError, match=r"called with stage_layers=1\.\.2, returned 3 layers: expected the 2 held ones or all 5"):
        build_layers(wrong, {"width": 4}, None, range(1, 3), 5)


def test_build_stage_puts_placeholders_where_the_rank_holds_nothing():
    import torch
    from planc.runtime.share import NotHeld, build_stage

    class Stage:
        layers = (1, 3)

    class Plan:
        stages = [type("S", (), {"layers": (0, 1)}), Stage, type("S", (), {"layers": (3, 4)})]

    def builder(stage_layers):
        return [torch.nn.Linear(2, 2) for _ in stage_layers]
    built = build_stage(builder, {}, None, Plan, Stage)
    assert [type(m).__name__ for m in built] == ["NotHeld", "Linear", "Linear", "NotHeld"]
    assert not list(built[0].parameters()) and isinstance(built[3], NotHeld)


def test_a_token_id_past_the_vocabulary_in_a_later_batch_names_step_micro_batch_stage_and_id():
    """The probe checks the first batch's ids; the runtime checks every batch's (usererrors.ids_in_vocabulary)
    and ends the step with one line, not the embedding's traceback."""
    import torch
    from planc.plan import HfModel
    from planc.runtime.usererrors import UserCodeError, ids_in_vocabulary, user_step, vocabulary_of

    def batches():
        for n in range(10):
            x = torch.full((2, 4), 7)
            if n == 5:
                x[1, 2] = 300
            yield x, x
    model = HfModel("LlamaForCausalLM", (("hidden_size", 32), ("vocab_size", 256)), "sdpa")
    assert vocabulary_of(model) == 256 and vocabulary_of(CodeRef("m.py", "build")) is None
    data = ids_in_vocabulary(batches(), 256, micro_batches=2)
    for _ in range(4):   # steps 0 and 1 (two micro-batches each) are fine
        next(data)
    with pytest.raises(UserCodeError) as ei:
        with user_step(2, 0, [], 0, []):
            next(data)
            next(data)
    assert str(ei.value) == ("step 2, micro-batch 1, stage 0: the data's token id 300 is outside the model's "
                             "vocabulary 0..255 (vocab_size = 256)")
    negative = ids_in_vocabulary(iter([(torch.tensor([[-1, 3]]), None)]), 256, 1)
    with pytest.raises(UserCodeError, match=r"the data's token id -1 is outside"):
        next(negative)
