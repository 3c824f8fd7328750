"""Lark front end: .plan text → typed AST (``planc.lang.ast``) with spans.

One cached LALR parser with positions. Lark's exceptions are converted here,
at the boundary, into ``PlanError`` with a span and a plain-words list of what
was expected; no ``lark`` object leaves this module. A syntax error stops the
parse (it is the single located error); a mistake the tree can be built past
(a block's item written twice or out of place) is collected instead and
reported with the checker's errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import lark
from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from planc.lang import ast
from planc.lang.typos import enum_typo, keyword_hint, unit_typo
from planc.lang.errors import Diagnostic, PlanError
from planc.span import Span
from planc.resources import grammar_path


class NewlineFilter:
    """Drops newlines inside ( ) and [ ] and right after `;`, so long matrices and programs may wrap."""

    always_accept = ("_NL",)

    def process(self, stream):
        depth = 0
        last = None
        for tok in stream:
            if tok.type in ("LPAR", "LSQB"):
                depth += 1
            elif tok.type in ("RPAR", "RSQB"):
                depth = max(0, depth - 1)
            elif tok.type == "_NL" and (depth > 0 or last == "SEMICOLON"):
                continue
            last = tok.type
            yield tok


@cache
def _parser() -> Lark:
    return Lark(
        grammar_path().read_text(),
        parser="lalr",
        lexer="contextual",
        postlex=NewlineFilter(),
        propagate_positions=True,
        maybe_placeholders=False,
    )


_TERMINAL_WORDS = {
    "NAME": "a name",
    "NUMBER": "a number",
    "STRING": 'a quoted string',
    "UNIT": "a unit (e.g. GB/s, us, MiB)",
    "_NL": "a newline",
    "SIGN": "'-'",
    "$END": "end of file",
}


def _describe(term: str) -> str:
    if term in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[term]
    for t in _parser().terminals:
        if t.name == term and isinstance(t.pattern, lark.lexer.PatternStr):
            return f"'{t.pattern.value}'"
    return term.lower()


def _expected(terms) -> str:
    words = sorted({_describe(t) for t in terms})
    if not words:
        return ""
    if len(words) > 8:
        return "expected one of " + ", ".join(words[:8]) + f" (or {len(words) - 8} more)"
    return "expected " + (words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1])


def _acceptable(e: UnexpectedInput) -> set[str]:
    """The terminals the parser really accepts here (LALR merges lookaheads, so ``e.expected`` may list more)."""
    try:
        ip = e.interactive_parser
        acc = set(ip.accepts()) if ip is not None else set()
    except Exception:  # an internal corner of lark: fall back to the state's lookaheads
        acc = set()
    return acc or set(getattr(e, "expected", None) or getattr(e, "allowed", None) or ())


_BLANK = re.compile(r"(?:\s|#[^\n]*)*")


def _unclosed(text: str) -> tuple[str, int, int] | None:
    """The innermost bracket left open at the end of the text (outside strings and comments)."""
    stack: list[tuple[str, int, int]] = []
    line, col, i, n = 1, 1, 0, len(text)
    pairs = {"}": "{", ")": "(", "]": "["}
    while i < n:
        ch = text[i]
        if ch == "#":
            while i < n and text[i] != "\n":
                i += 1
            continue
        if ch == '"':
            j = i + 1
            while j < n and text[j] not in '"\n':
                j += 1
            col += j - i
            i = j + 1 if j < n and text[j] == '"' else j
            if j < n and text[j] == '"':
                col += 1
            continue
        if ch in "{([":
            stack.append((ch, line, col))
        elif ch in pairs and stack and stack[-1][0] == pairs[ch]:
            stack.pop()
        if ch == "\n":
            line, col = line + 1, 1
        else:
            col += 1
        i += 1
    return stack[-1] if stack else None


def _eof_error(text: str, file: str, expected: str) -> PlanError:
    if _BLANK.fullmatch(text):
        return PlanError([Diagnostic("the plan is empty; it needs at least a 'cluster { ... }' block",
                                     Span(1, 1, 1, 2, file))])
    open_ = _unclosed(text)
    if open_ is not None:
        ch, line, col = open_
        close = {"{": "}", "(": ")", "[": "]"}[ch]
        return PlanError([Diagnostic(f"unexpected end of file: this '{ch}' is never closed (add '{close}')",
                                     Span(line, col, line, col + 1, file))])
    lines = text.splitlines() or [""]
    span = Span(len(lines), len(lines[-1]) + 1, len(lines), len(lines[-1]) + 2, file)
    return PlanError([Diagnostic(f"unexpected end of file; {expected}", span)])


def _tok_text(tok: Token) -> str:
    if tok.type == "_NL":
        return "end of line"
    if tok.type == "$END":
        return "end of file"
    return f"'{tok.value}'"


def _syntax_error(e: UnexpectedInput, text: str, file: str) -> PlanError:
    if getattr(e, "line", None) and (typo := unit_typo(text, e.line, e.column, file)
                                      or enum_typo(text, e.line, e.column, file)):
        return typo
    if isinstance(e, UnexpectedToken):
        tok = e.token
        expected = _expected(_acceptable(e))
        if tok.type == "$END" or tok.line is None:
            return _eof_error(text, file, expected)
        else:
            span = Span(tok.line, tok.column, tok.line, tok.column + max(1, len(tok.value.split("\n")[0])), file)
            if tok.type == "_NL":
                span = Span(tok.line, tok.column, tok.line, tok.column + 1, file)
        return PlanError([Diagnostic(f"unexpected {_tok_text(tok)}; {expected}", span,
                                     keyword_hint(tok, _acceptable(e), _parser().terminals))])
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if 0 <= e.pos_in_stream < len(text) else "?"
        span = Span(e.line, e.column, e.line, e.column + 1, file)
        exp = _expected(_acceptable(e))
        msg = f"unexpected character {ch!r}" + (f"; {exp}" if exp else "")
        if ch == '"':
            msg = "unterminated string (strings end on the same line)"
        return PlanError([Diagnostic(msg, span)])
    if isinstance(e, UnexpectedEOF):
        return _eof_error(text, file, _expected(e.expected))
    return PlanError([Diagnostic(f"syntax error: {e}", Span(getattr(e, 'line', 0) or 0, getattr(e, 'column', 0) or 0, 0, 0, file))])


@v_args(meta=True, inline=True)
class _ToAst(Transformer):
    """Lark tree → ast nodes. Every method gets ``meta`` and returns a node with a span."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file
        self.found: list[Diagnostic] = []   # mistakes the tree is built past

    def _span(self, meta) -> Span:
        if getattr(meta, "empty", True):
            return Span(0, 0, 0, 0, self.file)
        return Span(meta.line, meta.column, meta.end_line, meta.end_column, self.file)

    def _tspan(self, tok: Token) -> Span:
        return Span(tok.line, tok.column, tok.end_line, tok.end_column, self.file)

    def _name(self, tok: Token) -> ast.Name:
        return ast.Name(str(tok), self._tspan(tok))

    def _num(self, tok: Token) -> ast.Num:
        return ast.Num(float(tok), str(tok), self._tspan(tok))

    def _str(self, tok: Token) -> ast.Str:
        return ast.Str(str(tok)[1:-1], self._tspan(tok))

    # -- top level
    def start(self, meta, item):
        if isinstance(item, ast.PlanFile):
            return item
        return ast.PlanFile(None, item, self._span(meta))

    def plan_def(self, meta, name, body=()):
        return ast.PlanFile(self._name(name), tuple(body), self._span(meta))

    def body(self, meta, *statements):
        return tuple(statements)

    # -- cluster
    def cluster_inline(self, meta, *items):
        levels: list[ast.LevelDecl] = []
        host = None
        device: dict[str, object] = {}   # flops, memory, cores (its value and the `per` name)
        by_precision: dict[str, tuple[ast.Name, object]] = {}   # `flops bf16 = ...`
        for it in items:
            if isinstance(it, tuple) and it and it[0] == "flops_at":
                _, name, value, span = it
                if name.value in by_precision:   # the first one stands
                    self.found.append(Diagnostic(f"'flops {name.value}' is set twice in this cluster", span))
                else:
                    by_precision[name.value] = (name, value)
                continue
            if isinstance(it, tuple) and it and it[0] in ("flops", "memory", "cores"):
                key, value, span = it
                if key in device:   # the first one stands
                    self.found.append(Diagnostic(f"'{key}' is set twice in this cluster", span))
                else:
                    device[key] = value
                continue
            if isinstance(it, ast.LevelDecl):
                levels.append(it)
            elif isinstance(it, ast.LevelAttr):
                if not levels:   # left out: it belongs to no level
                    self.found.append(Diagnostic(f"'{it.key.value}' must follow a 'level NAME x N' declaration",
                                                 it.span))
                    continue
                last = levels[-1]
                levels[-1] = ast.LevelDecl(last.name, last.fanout, last.attrs + (it,), last.span)
            elif isinstance(it, ast.Name):
                if host is not None:   # the first one stands
                    self.found.append(Diagnostic("'host' is set twice in this cluster", it.span))
                    continue
                host = it
        cores, per = device.get("cores", (None, None))
        return ast.ClusterBlock(tuple(levels), host, None, self._span(meta), device.get("flops"),
                                device.get("memory"), cores, per, tuple(by_precision.values()))

    def cluster_file(self, meta, path):
        return ast.ClusterBlock((), None, self._str(path), self._span(meta))

    def level(self, meta, name, fanout, attr=None):
        return ast.LevelDecl(self._name(name), self._num(fanout), (attr,) if attr else (), self._span(meta))

    def bandwidth(self, meta, quantity):
        return ast.LevelAttr(ast.Name("bandwidth", self._span(meta)), quantity, self._span(meta))

    def latency(self, meta, quantity):
        return ast.LevelAttr(ast.Name("latency", self._span(meta)), quantity, self._span(meta))

    def host(self, meta, name):
        return self._name(name)

    def cluster_flops(self, meta, *rest):
        if len(rest) == 2:   # `flops bf16 = ...`: one precision's
            return ("flops_at", self._name(rest[0]), rest[1], self._span(meta))
        return ("flops", rest[0], self._span(meta))

    def cluster_memory(self, meta, value):
        return ("memory", value, self._span(meta))

    def cluster_cores(self, meta, value, per=None):
        return ("cores", (value, self._name(per) if per is not None else None), self._span(meta))

    # -- parallel
    def parallel(self, meta, *items):
        axes = tuple(i for i in items if isinstance(i, ast.AxisDecl))
        places = [i for i in items if isinstance(i, tuple) and i and i[0] == "place"]
        for extra in places[1:]:   # the first one stands
            self.found.append(Diagnostic("'place' is set twice in this parallel block", extra[2]))
        place, pspan = (places[0][1], places[0][2]) if places else (None, None)
        return ast.ParallelBlock(axes, place, pspan, self._span(meta))

    def axis(self, meta, name, size):
        return ast.AxisDecl(self._name(name), self._num(size), self._span(meta))

    def place_auto(self, meta):
        return ("place", None, self._span(meta))

    def place_matrix(self, meta, matrix):
        return ("place", matrix, self._span(meta))

    # -- code references
    def model(self, meta, path, *kvs):
        return ast.CodeBlock("model", self._str(path), tuple(kvs), self._span(meta))

    def model_hf(self, meta, path, *kvs):
        return ast.CodeBlock("model", self._str(path), tuple(kvs), self._span(meta), hf=True)

    def loss(self, meta, path):
        return ast.CodeBlock("loss", self._str(path), (), self._span(meta))

    def data(self, meta, path, *kvs):
        return ast.CodeBlock("data", self._str(path), tuple(kvs), self._span(meta))

    # -- stages
    def stage_layers(self, meta, index, layers, *rest):
        placement = next((r for r in rest if isinstance(r, tuple)), None)
        recompute = next((r for r in rest if isinstance(r, _Recompute)), None)
        devices, mesh = placement if placement else (None, ())
        auto = layers if isinstance(layers, Span) else None   # `layers auto`
        return ast.StageDecl(self._num(index), None if auto else layers, devices, mesh, self._span(meta), auto,
                             recompute.span if recompute else None, self._stage_zero(rest))

    def layers_auto(self, meta):
        return self._span(meta)

    def recompute(self, meta):
        return _Recompute(self._span(meta))

    def stage_zero(self, meta, degree):
        return _StageZero(self._num(degree), self._span(meta))

    def _stage_zero(self, rest) -> ast.Num | None:
        """A stage line's ``zero N`` (the first stands; ``zero`` or ``recompute`` again: a mistake), or None."""
        for kind, word in ((_Recompute, "recompute"), (_StageZero, "zero")):
            found = [r for r in rest if isinstance(r, kind)]
            for again in found[1:]:
                self.found.append(Diagnostic(f"'{word}' is written twice on this stage line", again.span))
        return next((r.degree for r in rest if isinstance(r, _StageZero)), None)

    def stages(self, meta, count=None):
        return ast.StagesAuto(self._num(count) if count is not None else None, self._span(meta))

    def stage_bare(self, meta, index, placement, *rest):
        devices, mesh = placement
        recompute = next((r for r in rest if isinstance(r, _Recompute)), None)
        return ast.StageDecl(self._num(index), None, devices, mesh, self._span(meta),
                             recompute=recompute.span if recompute else None, zero=self._stage_zero(rest))

    def placement(self, meta, devices, *dims):
        return (devices, tuple(dims))

    def mesh_dim_anon(self, meta, size):
        return ast.MeshDim(None, self._num(size), self._span(meta))

    def mesh_dim_named(self, meta, name, size):
        return ast.MeshDim(self._name(name), self._num(size), self._span(meta))

    def range(self, meta, a, b):
        return ast.RangeNode(self._num(a), self._num(b), self._span(meta))

    # -- transfers
    def transfer(self, meta, name, *rest):
        ttype = rest[0] if isinstance(rest[0], ast.TensorType) else None
        (src, layer, src_spec, src_at), (dst, _, dst_spec, dst_at) = rest[-2:]
        return ast.TransferDecl(self._name(name), ttype, src, layer, src_spec, dst, dst_spec, src_at, dst_at,
                                self._span(meta))

    def transfer_src(self, meta, stage, *rest):
        layer = next((r for r in rest if isinstance(r, ast.Num)), None)
        spec = next((r for r in rest if isinstance(r, ast.Spec)), None)
        return (self._num(stage), layer, spec, self._span(meta))

    def transfer_dst(self, meta, stage, spec=None):
        return (self._num(stage), None, spec, self._span(meta))

    def layer_ref(self, meta, n):
        return self._num(n)

    def tensor_type(self, meta, dtype, *dims):
        return ast.TensorType(self._name(dtype), tuple(self._num(d) for d in dims), self._span(meta))

    def spec(self, meta, *items):
        return ast.Spec(tuple(items), self._span(meta))

    def spec_word(self, meta, word):
        return ast.SpecItem(self._name(word), None, self._span(meta))

    def spec_named(self, meta, word, *names):
        return ast.SpecItem(self._name(word), tuple(self._name(n) for n in names), self._span(meta))

    # -- reductions
    def reduce(self, meta, name, *rest):
        axes, using, using_span, ttype = [], None, None, None
        for r in rest:
            if isinstance(r, Token):
                axes.append(self._name(r))
            elif isinstance(r, ast.TensorType):
                ttype = r
            else:
                using, using_span = r
        return ast.ReduceDecl(self._name(name), tuple(axes), using, using_span, ttype, self._span(meta))

    def using(self, meta, *steps):
        return (tuple(steps), Span(steps[0].span.line, steps[0].span.col, steps[-1].span.end_line,
                                   steps[-1].span.end_col, self.file))

    def step(self, meta, name, *args):
        return ast.StepNode(self._name(name), tuple(args) if args else None, self._span(meta))

    def step_arg(self, meta, key, value, level=None):
        return ast.StepArg(self._name(key), self._name(value), self._name(level) if level else None, self._span(meta))

    # -- settings
    def resharding(self, meta, *kvs):
        return ast.SettingsBlock("resharding", tuple(kvs), self._span(meta))

    def synthesis(self, meta, *kvs):
        return ast.SettingsBlock("synthesis", tuple(kvs), self._span(meta))

    def train(self, meta, *kvs):
        return ast.SettingsBlock("train", tuple(kvs), self._span(meta))

    def deepspeed(self, meta, path):
        return ast.DeepspeedDecl(self._str(path), self._span(meta))

    def kv(self, meta, key, value):
        return ast.KeyValue(self._name(key), value, self._span(meta))

    def number(self, meta, *toks):
        sign = "-" if len(toks) == 2 else ""
        tok = toks[-1]
        return ast.Num(float(sign + tok), sign + str(tok), self._span(meta))

    def quantity(self, meta, *toks):
        *num, unit = toks
        sign = "-" if len(num) == 2 else ""
        tok = num[-1]
        span = self._tspan(tok)
        if sign:
            span = Span(num[0].line, num[0].column, tok.end_line, tok.end_column, self.file)
        number = ast.Num(float(sign + tok), sign + str(tok), span)
        return ast.Quantity(number, str(unit), self._span(meta))

    def string(self, meta, tok):
        return self._str(tok)

    def name(self, meta, tok):
        return self._name(tok)

    def call(self, meta, name, *kvs):
        return ast.Call(self._name(name), tuple(kvs), self._span(meta))

    def list(self, meta, *items):
        return ast.ListValue(tuple(items), self._span(meta))

    def tuple_value(self, meta, *items):
        return ast.TupleValue(tuple(items), self._span(meta))


@dataclass(frozen=True, slots=True)
class _Recompute:
    """A stage line's trailing ``recompute`` (a Span alone would read as ``layers auto``)."""

    span: Span


@dataclass(frozen=True, slots=True)
class _StageZero:
    """A stage line's trailing ``zero N``."""
    degree: ast.Num
    span: Span


def parse_collecting(text: str, file: str = "<plan>") -> tuple[ast.PlanFile, tuple[Diagnostic, ...]]:
    """Parse .plan text into the AST and the mistakes it was built past (for the checker to report
    with its own); a syntax error raises PlanError (with the source attached)."""
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, text, file).with_source(file, text) from None
    to_ast = _ToAst(file)
    try:
        out = to_ast.transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, PlanError):
            raise e.orig_exc.with_source(file, text) from None
        raise
    return out, tuple(to_ast.found)


def parse(text: str, file: str = "<plan>") -> ast.PlanFile:
    """Parse .plan text into the AST; every error, collected or not, raises PlanError."""
    tree, found = parse_collecting(text, file)
    if found:
        raise PlanError(list(found), {file: text})
    return tree
