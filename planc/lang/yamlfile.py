"""YAML cluster files read with their positions: every value's ``file:line:col``.

``read_yaml(text, file)`` returns the document (as ``yaml.safe_load`` builds it)
and the span of every node by its path from the root (``("levels", 0, "fanout")``),
so that the cluster checker can point an error at the YAML line that holds the
bad value. A file YAML cannot read raises :class:`YamlProblem` with the position
the parser reports.
"""

from __future__ import annotations

import yaml

from planc.span import Span

__all__ = ["read_yaml", "YamlProblem", "MAX_NODES", "MAX_DEPTH"]

MAX_NODES = 100_000   # a cluster file is a few dozen values; more is not a cluster file
MAX_DEPTH = 64        # PyYAML composes recursively: deeper nesting would exhaust the stack


class YamlProblem(ValueError):
    def __init__(self, message: str, span: Span | None):
        super().__init__(message)
        self.span = span


def _span(node, file: str) -> Span:
    a, b = node.start_mark, node.end_mark
    if b.line == a.line:
        return Span(a.line + 1, a.column + 1, a.line + 1, max(b.column + 1, a.column + 2), file)
    return Span(a.line + 1, a.column + 1, b.line + 1, b.column + 1, file)


def _at(text: str, position: int, file: str) -> Span:
    """The span of the character at ``position`` (an index into ``text``)."""
    before = text[:position]
    line = before.count("\n") + 1
    col = position - (before.rfind("\n") + 1) + 1
    return Span(line, col, line, col + 1, file)


def _char(c) -> str:
    return f"U+{c:04X}" if isinstance(c, int) else repr(c)


def _where(text: str, position: int) -> str:
    s = _at(text, position, "")
    return f"line {s.line}, column {s.col}"


def _nesting(text: str) -> int:
    """An upper bound of the flow nesting depth (``[[[...`` / ``{{{...``), found without parsing."""
    depth = most = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            most = max(most, depth)
        elif ch in "]}" and depth:
            depth -= 1
    return most


def read_yaml(text: str, file: str) -> tuple[object, dict[tuple, Span]]:
    """The document and each node's span by path; YamlProblem when YAML cannot read it."""
    if _nesting(text) > MAX_DEPTH or text.count("\n") > MAX_NODES:
        raise YamlProblem(f"is too large or nested too deeply for a cluster file (at most {MAX_DEPTH} levels "
                          f"of nesting and {MAX_NODES} lines)", None)
    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as e:   # a character YAML does not allow, found before parsing
        raise YamlProblem(f"character {_char(e.character)} at {_where(text, e.position)} is not allowed in YAML",
                          _at(text, e.position, file)) from None
    try:
        node = loader.get_single_node()
        spans: dict[tuple, Span] = {}
        if node is not None:
            _walk(node, (), file, spans, set(), 0)
        doc = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = Span(mark.line + 1, mark.column + 1, mark.line + 1, mark.column + 2, file) if mark else None
        raise YamlProblem(" ".join(filter(None, [e.context, e.problem])) or str(e).splitlines()[0], where) from None
    except yaml.reader.ReaderError as e:
        raise YamlProblem(f"character {_char(e.character)} at {_where(text, e.position)} is not allowed in YAML",
                          _at(text, e.position, file)) from None
    except yaml.YAMLError as e:
        raise YamlProblem(str(e).splitlines()[0] if str(e) else type(e).__name__, None) from None
    except RecursionError:
        raise YamlProblem(f"is nested too deeply for a cluster file (at most {MAX_DEPTH} levels)", None) from None
    finally:
        loader.dispose()
    return doc, spans


def _walk(node, path: tuple, file: str, out: dict, seen: set, depth: int) -> None:
    """Record every node's span; aliases (a node reached twice) are recorded once, at the first path."""
    if id(node) in seen or depth > MAX_DEPTH:
        return
    seen.add(id(node))
    if len(seen) > MAX_NODES:
        raise YamlProblem(f"has more than {MAX_NODES} values (aliases included); not a cluster file",
                          _span(node, file))
    out[path] = _span(node, file)
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key is not None:
                _walk(v, path + (key,), file, out, seen, depth + 1)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _walk(v, path + (i,), file, out, seen, depth + 1)
