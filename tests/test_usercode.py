"""Loading the user's model, loss and data functions (planc/runtime/usercode.py, runtime/main.py): a typo in
the plan's FILE:FUNCTION is a message that names it, told apart from an error inside the user's own file."""

from __future__ import annotations

import pytest

from planc.runtime.dataflow import EngineError
from planc.runtime.main import load_function
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
    assert load_function(str(tmp_path), {"file": "m3.py", "function": "loss"}, "loss")(1, 2) == 0
    with pytest.raises(EngineError, match=r"the plan's loss m3.py:losss: 'losss' is not defined in m3.py"):
        load_function(str(tmp_path), {"file": "m3.py", "function": "losss"}, "loss")
    with pytest.raises(EngineError, match=r"the plan's data gone.py:batches: .*gone.py not found"):
        load_function(str(tmp_path), {"file": "gone.py", "function": "batches"}, "data")
