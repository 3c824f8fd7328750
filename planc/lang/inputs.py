"""What the checker needs from outside the plan text, as the loader reads it.

:func:`read_inputs` gathers a plan's folder and the YAML files it names (the cluster file, the
DeepSpeed overrides) into :class:`PlanInputs`; the checker (``planc.lang.check``) only ever sees
them as data. Both the loader (``planc.lang.load``) and the checker (its default inputs) use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from planc.lang import ast
from planc.lang.yamlfile import YamlProblem, read_yaml
from planc.span import Span

__all__ = ["ClusterFile", "PlanInputs", "read_inputs"]


@dataclass(frozen=True, slots=True)
class ClusterFile:
    """A cluster file named by ``cluster "FILE"``, as the loader read it: its YAML document, or
    ``problem``, the message saying why it could not be read."""

    name: str                  # as written in the plan
    doc: object = None
    problem: str | None = None
    path: str | None = None    # the file as diagnostics name it (None: errors point at the plan's line)
    text: str | None = None    # its text, to show the line of an error
    marks: dict = field(default_factory=dict)   # span of each YAML node by path: ("levels", 0, "fanout")
    problem_span: Span | None = None            # where in the file ``problem`` is, when YAML said

    def at(self, *path, fallback: Span) -> Span:
        """The span of the YAML node at ``path`` (or of its nearest enclosing node), else ``fallback``."""
        for k in range(len(path), -1, -1):
            span = self.marks.get(tuple(path[:k]))
            if span is not None:
                return span
        return fallback


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """What the checker needs from outside the plan text, gathered by the loader.

    ``source_dir``: the folder that the plan's paths are relative to. ``cluster_file``: the
    cluster file that ``cluster "FILE"`` names, as read (None when the plan names none).
    """

    source_dir: str
    cluster_file: ClusterFile | None = None
    deepspeed_file: ClusterFile | None = None   # the `deepspeed "FILE"` overrides, read the same way


def read_inputs(tree: ast.PlanFile, path: str):
    """What the checker needs from outside the text (:class:`PlanInputs`): the plan's
    folder (the working directory for text without a file), and the YAML files it names, if any: the
    cluster file and the DeepSpeed overrides."""
    source_dir = str(Path(path).resolve().parent) if path and not path.startswith("<") else os.getcwd()
    block = next((s for s in tree.statements if isinstance(s, ast.ClusterBlock)), None)
    ds = next((s for s in tree.statements if isinstance(s, ast.DeepspeedDecl)), None)
    return PlanInputs(source_dir,
                      _read_yaml_input(source_dir, path, block.file.value, "cluster file")
                      if block is not None and block.file is not None else None,
                      _read_yaml_input(source_dir, path, ds.path.value, "DeepSpeed overrides file")
                      if ds is not None else None)


def _read_yaml_input(source_dir: str, path: str, name: str, what: str):
    """A YAML file the plan names (relative to its folder), read with each node's span, or the problem."""
    file = Path(source_dir) / name
    # the file as diagnostics name it: beside the plan, as the plan's own path is written
    shown = str(Path(path).parent / name) if path and not path.startswith("<") else name
    text = None
    try:
        text = file.read_text()
        doc, marks = read_yaml(text, shown)
        return ClusterFile(name, doc=doc, path=shown, text=text, marks=marks)
    except FileNotFoundError:
        return ClusterFile(name, problem=f"{what} '{name}' not found (looked in {file.parent})")
    except UnicodeDecodeError as e:
        return ClusterFile(name, problem=f"{what} '{name}' is not UTF-8 text (byte {e.start})")
    except YamlProblem as e:
        return ClusterFile(name, problem=f"cannot read {what} '{name}': {e}", path=shown, text=text,
                           problem_span=e.span)
    except OSError as e:
        return ClusterFile(name, problem=f"cannot read {what} '{name}': {e.strerror or e}")
    except ValueError as e:   # a name the file system cannot take (a NUL byte)
        return ClusterFile(name, problem=f"cannot read {what} {name!r}: {e}")
