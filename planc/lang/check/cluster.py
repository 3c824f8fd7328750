"""The ``cluster`` block: levels written inline, or a YAML cluster file (read by the loader)."""

from __future__ import annotations

import math

from planc import budget, ir
from planc.lang import ast
from planc.lang.inputs import ClusterFile
from planc.lang.check.values import MAX_DIGITS, Diagnostics, did_you_mean, int_of, quantity
from planc.lang.units import BANDWIDTH, FLOPS, SIZE, TIME, parse_quantity
from planc.span import Span

__all__ = ["ClusterFile", "MAX_DEVICES", "check_cluster"]

MAX_DEVICES = budget.BOUNDS["devices"].default   # the default bound; --budget devices=N raises it


def check_cluster(errs: Diagnostics, block: ast.ClusterBlock | None, file: ClusterFile | None) -> ir.Cluster | None:
    """The cluster; ``file`` is the cluster file's contents when ``block`` names one."""
    if block is None:
        return None
    if block.file is not None:
        return _from_file(errs, block.file, file)
    levels: list[ir.Level] = []
    names: dict[str, Span] = {}
    for ld in block.levels:
        fanout = int_of(errs, ld.fanout, f"level '{ld.name.value}' fanout")
        if ld.name.value in names:
            errs.add(f"level '{ld.name.value}' is declared twice", ld.name.span)
        names[ld.name.value] = ld.name.span
        bw = lat = None
        for a in ld.attrs:
            if a.key.value == "bandwidth":
                if bw is not None:
                    errs.add("bandwidth is given twice for this level", a.span)
                bw = quantity(errs, a.value, BANDWIDTH, "bandwidth")
                if bw is not None and bw <= 0:
                    errs.add("bandwidth must be positive", a.value.span)
            else:
                if lat is not None:
                    errs.add("latency is given twice for this level", a.span)
                lat = quantity(errs, a.value, TIME, "time")
                if lat is not None and lat < 0:
                    errs.add("latency must not be negative", a.value.span)
                    lat = None
        if fanout is None:
            continue
        if fanout > 1 and bw is None and not any(a.key.value == "bandwidth" for a in ld.attrs):
            errs.add(f"level '{ld.name.value}' has {fanout} units and needs a bandwidth "
                     f"(e.g. 'level {ld.name.value} x {fanout} : bandwidth 100 GB/s')", ld.span)
        levels.append(ir.Level(ld.name.value, fanout, bw, lat or 0.0, ld.span))
    if not block.levels:
        errs.add("a cluster needs at least one 'level NAME x N' line", block.span)
        return None
    host = _host_level(errs, levels, block.host.value if block.host else None,
                       block.host.span if block.host else block.span)
    flops = _device_value(errs, block.flops, "flops")
    by_precision = _flops_by_precision(errs, block.flops_by)
    memory = _device_value(errs, block.memory, "memory")
    cores = _cores(errs, block.cores, block.cores_per, levels, host)
    if host is None or len(levels) != len(block.levels) or cores is False or by_precision is None:
        return None
    return _sized(errs, ir.Cluster(tuple(levels), host, flops, memory, *(cores or (None, None)),
                                   flops_by_precision=by_precision), block.span)


PRECISIONS = tuple(p.value for p in ir.Precision)


def _flops_by_precision(errs: Diagnostics, items) -> tuple[tuple[str, float], ...] | None:
    """``flops bf16 = 989 TFLOP/s`` lines as ``ir.Cluster.flops_by_precision`` (sorted by precision);
    None after an error."""
    out, ok = {}, True
    for name, value in items:
        if name.value not in PRECISIONS:
            near = [p for p in PRECISIONS if p.lower() == name.value.lower()]
            errs.add(f"'flops {name.value}': '{name.value}' is not a precision; expected one of "
                     f"{', '.join(PRECISIONS)} (or 'flops = ...' for every precision)", name.span,
                     f"did you mean '{near[0]}'? (spellings are lower case)" if near
                     else did_you_mean(name.value, PRECISIONS))
            ok = False
            continue
        v = _device_value(errs, value, "flops")
        if v is None:
            ok = False
        else:
            out[name.value] = v
    return tuple(sorted(out.items())) if ok else None


def _cores(errs: Diagnostics, v: ast.Quantity | ast.Num | None, per: ast.Name | None,
           levels: list[ir.Level], host: str | None) -> tuple[int, str | None] | None | bool:
    """``cores = N per LEVEL|cluster`` as ``(N, cores_level)`` (``cores_level`` None: the whole cluster;
    ``per`` left out: the host level); None when not written, False after an error. A level literally
    named ``cluster`` wins over the word."""
    if v is None:
        return None
    if isinstance(v, ast.Quantity):
        errs.add(f"cores is a count of CPU cores and takes no unit, got '{v.number.text} {v.unit}'; "
                 "write e.g. 'cores = 2 per cluster'", v.span)
        return False
    n = int_of(errs, v, "cores")
    names = [l.name for l in levels]
    level = host if per is None else _pool_level(per.value, names)
    if level is False:
        errs.add(f"cores per '{per.value}': '{per.value}' is not a level of this cluster "
                 f"({', '.join(names)}) nor 'cluster' (one pool for all devices)", per.span,
                 did_you_mean(per.value, names + ["cluster"]))
        return False
    return (n, level) if n is not None else False


def _pool_level(per: str, names: list[str]) -> str | None | bool:
    """The ``cores_level`` that ``per`` names (plan text and cluster file alike): a level of ``names``
    (a level named ``cluster`` wins over the word), None for ``cluster`` (one pool), False for neither."""
    if per in names:
        return per
    return None if per == "cluster" else False


# the per-device settings of a cluster: (unit table, kind in messages, example)
_DEVICE = {"flops": (FLOPS, "FLOP rate", "flops = 312 TFLOP/s"), "memory": (SIZE, "size", "memory = 80 GB")}


def _device_value(errs: Diagnostics, v: ast.Quantity | ast.Num | None, key: str) -> float | None:
    """``flops`` (FLOP/s) or ``memory`` (bytes) of one device: a positive quantity with its unit."""
    if v is None:
        return None
    table, kind, example = _DEVICE[key]
    if isinstance(v, ast.Num):
        errs.add(f"{key} needs a unit ({', '.join(u for u in table if '/' in u or key == 'memory')}); "
                 f"write e.g. '{example}'", v.span)
        return None
    if v.unit not in table:
        errs.add(f"'{v.unit}' is not a {kind} unit for {key}; expected one of "
                 f"{', '.join(u for u in table if '/' in u or key == 'memory')} (e.g. '{example}')", v.span)
        return None
    value = quantity(errs, v, table, kind)
    if value is not None and value <= 0:
        errs.add(f"{key} must be positive, got {v.number.text} {v.unit}", v.span)
        return None
    return value


def _sized(errs: Diagnostics, cluster: ir.Cluster, span: Span) -> ir.Cluster | None:
    """The cluster within the budget's ``levels`` and ``devices`` bounds (planc.budget), else None."""
    limit = int(budget.current()["levels"])
    past = cluster.levels[limit].span if len(cluster.levels) > limit else None   # the first level too many
    over = (budget.exceeded("levels", len(cluster.levels), "the cluster has",
                            past if past is not None and past.line > 0 else span)
            or budget.exceeded("devices", cluster.devices, "the cluster has", span))
    if over is not None:
        errs.items.append(over)
        return None
    return cluster


def _host_level(errs: Diagnostics, levels: list[ir.Level], host: str | None, span: Span) -> str | None:
    """The named host level, or by default the outermost level with more than one unit."""
    if host is not None:
        if host not in {l.name for l in levels}:
            errs.add(f"host level '{host}' is not a level of this cluster", span,
                     did_you_mean(host, [l.name for l in levels]))
            return None
        return host
    for l in levels:
        if l.fanout > 1:
            return l.name
    return levels[0].name if levels else None


FILE_KEYS = ("levels", "host", "flops", "memory", "cores", "cores_per", "op_overhead", "step_overhead",
             "calibration")   # calibration: a record, not read
LEVEL_KEYS = ("name", "fanout", "x", "bandwidth", "latency", "both_ways")


def _unknown_keys(errs: Diagnostics, mapping: dict, known, where: str, at) -> bool:
    """Report every key of ``mapping`` that is not one of ``known`` (a misspelt key would otherwise be
    read as absent: a default latency or host level, no memory limit); True when there was one."""
    bad = [k for k in mapping if k not in known]
    for k in bad:
        errs.add(f"{where}: unknown key {_short(k)} (known: {', '.join(known)})", at(k),
                 did_you_mean(str(k), known))
    return bool(bad)


def _from_file(errs: Diagnostics, file: ast.Str, contents: ClusterFile | None) -> ir.Cluster | None:
    """The cluster of a YAML cluster file; each error points at the YAML node that holds the bad value
    (``contents.marks``), or at the plan's ``cluster "FILE"`` when the file has no such node."""
    if contents is None:
        errs.add(f"cluster file '{file.value}' was not read", file.span)
        return None
    if contents.problem is not None:
        errs.add(contents.problem, contents.problem_span or file.span)
        return None
    doc, root = contents.doc, ()
    if isinstance(doc, dict) and isinstance(doc.get("cluster"), dict):
        doc, root = doc["cluster"], ("cluster",)

    def at(*path) -> Span:
        return contents.at(*root, *path, fallback=file.span)

    if not isinstance(doc, dict) or not isinstance(doc.get("levels"), list) or not doc["levels"]:
        errs.add(f"cluster file '{file.value}' must hold a mapping with a non-empty 'levels' list "
                 "(each: name, fanout, bandwidth, latency) and optionally 'host'",
                 at("levels") if isinstance(doc, dict) else at())
        return None
    unknown = _unknown_keys(errs, doc, FILE_KEYS, f"cluster file '{file.value}'", at)   # and read on: more errors
    limit = int(budget.limit("levels"))
    if len(doc["levels"]) > limit:   # before reading each one: the budget's 'levels' bound
        errs.items.append(budget.exceeded("levels", len(doc["levels"]), f"cluster file '{file.value}' has",
                                          at("levels", limit)))
        return None
    levels = []
    for i, entry in enumerate(doc["levels"]):
        where = f"cluster file '{file.value}', levels[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            errs.add(f"{where}: expected a mapping with 'name' and 'fanout'", at("levels", i))
            return None
        if _unknown_keys(errs, entry, LEVEL_KEYS, where, lambda *k, i=i: at("levels", i, *k)):
            return None
        key = "fanout" if "fanout" in entry else "x"
        fanout = entry.get(key)
        if not isinstance(fanout, int) or isinstance(fanout, bool) or fanout < 1:
            errs.add(f"{where}: 'fanout' must be a whole number >= 1, got {_short(fanout)}",
                     at("levels", i, key))
            return None
        values = {}
        for k, kind in (("bandwidth", "bandwidth"), ("latency", "time"), ("both_ways", "bandwidth")):
            try:
                values[k] = _yaml_quantity(entry.get(k), kind)
            except ValueError as e:
                errs.add(f"{where}: {k}: {e}", at("levels", i, k))
                return None
        bw, lat = values["bandwidth"], values["latency"] or 0.0
        if bw is not None and bw <= 0:
            errs.add(f"{where}: bandwidth must be positive, got {_short(entry.get('bandwidth'))}",
                     at("levels", i, "bandwidth"))
            return None
        if lat < 0:
            errs.add(f"{where}: latency must not be negative, got {_short(entry.get('latency'))}",
                     at("levels", i, "latency"))
            return None
        if fanout > 1 and bw is None:
            errs.add(f"{where}: level '{entry['name']}' has {fanout} units and needs a bandwidth", at("levels", i))
            return None
        both = values["both_ways"]
        if both is not None and (bw is None or not 0 < both <= bw):
            errs.add(f"{where}: both_ways (a direction's bandwidth while the link carries data both ways) must be "
                     f"positive and at most the level's bandwidth {_short(entry.get('bandwidth'))}, got "
                     f"{_short(entry.get('both_ways'))}", at("levels", i, "both_ways"))
            return None
        levels.append(ir.Level(entry["name"], fanout, bw, lat, at("levels", i), both))
    names = [l.name for l in levels]
    if len(set(names)) != len(names):
        twice = next(i for i, n in enumerate(names) if n in names[:i])
        errs.add(f"cluster file '{file.value}': level names repeat: level '{names[twice]}' is declared twice",
                 at("levels", twice, "name"))
        return None
    host = doc.get("host")
    if host is not None and not isinstance(host, str):
        errs.add(f"cluster file '{file.value}', host: expected a level name, got {_short(host)}", at("host"))
        return None
    host = _host_level(errs, levels, host, at("host"))
    device = {}
    by_precision = _yaml_flops_by_precision(errs, doc.get("flops"), file.value, at)
    if by_precision is None:
        return None
    for key, kind in (("flops", "FLOP rate"), ("memory", "size")):
        if key == "flops" and isinstance(doc.get(key), dict):   # one per precision, read above
            device[key] = None
            continue
        try:
            v = _yaml_quantity(doc.get(key), kind)
        except ValueError as e:
            errs.add(f"cluster file '{file.value}', {key}: {e}", at(key))
            return None
        if v is not None and (not math.isfinite(v) or v <= 0):
            errs.add(f"cluster file '{file.value}', {key}: must be a positive {kind}, got {_short(doc.get(key))}",
                     at(key))
            return None
        device[key] = v
    for key in ("op_overhead", "step_overhead"):   # the runtime's own time (planc calibrate): seconds >= 0
        try:
            v = _yaml_quantity(doc.get(key), "time")
        except ValueError as e:
            errs.add(f"cluster file '{file.value}', {key}: {e}", at(key))
            return None
        if v is not None and v < 0:
            errs.add(f"cluster file '{file.value}', {key}: must be a time of at least 0 (seconds of a device "
                     f"per {'instruction' if key == 'op_overhead' else 'step'}), got {_short(doc.get(key))}", at(key))
            return None
        device[key] = v
    if not host or unknown:
        return None
    cores = _yaml_cores(errs, doc, file.value, [l.name for l in levels], host, at)
    if cores is False:
        return None
    return _sized(errs, ir.Cluster(tuple(levels), host, device["flops"], device["memory"], *(cores or (None, None)),
                                   device["op_overhead"], device["step_overhead"], by_precision), at("levels"))


def _yaml_flops_by_precision(errs: Diagnostics, flops, file: str, at) -> tuple[tuple[str, float], ...] | None:
    """A cluster file's ``flops: {fp32: ..., bf16: ...}`` (each as a plain ``flops``) sorted by precision;
    ``()`` for a plain ``flops`` or none; None after an error."""
    if not isinstance(flops, dict):
        return ()
    if not flops:
        errs.add(f"cluster file '{file}', flops: an empty mapping; give a FLOP rate, or one per precision "
                 f"({', '.join(PRECISIONS)})", at("flops"))
        return None
    out = {}
    for key, value in flops.items():
        if key not in PRECISIONS:
            errs.add(f"cluster file '{file}', flops: {_short(key)} is not a precision; expected "
                     f"{', '.join(PRECISIONS)}", at("flops", key), did_you_mean(str(key), PRECISIONS))
            return None
        try:
            v = _yaml_quantity(value, "FLOP rate")
        except ValueError as e:
            errs.add(f"cluster file '{file}', flops.{key}: {e}", at("flops", key))
            return None
        if v is None or v <= 0:
            errs.add(f"cluster file '{file}', flops.{key}: must be a positive FLOP rate, got {_short(value)}",
                     at("flops", key))
            return None
        out[key] = v
    return tuple(sorted(out.items()))


def _yaml_cores(errs: Diagnostics, doc: dict, file: str, names: list[str], host: str, at):
    """``cores: N`` and ``cores_per: LEVEL|cluster`` of a cluster file, as :func:`_cores` reads them."""
    cores, per = doc.get("cores"), doc.get("cores_per")
    if cores is None:
        if per is not None:
            errs.add(f"cluster file '{file}', cores_per: given without 'cores' (e.g. 'cores: 2')", at("cores_per"))
            return False
        return None
    if not isinstance(cores, int) or isinstance(cores, bool) or cores < 1:
        errs.add(f"cluster file '{file}', cores: expected a whole number of CPU cores >= 1, got {_short(cores)}",
                 at("cores"))
        return False
    if cores >= 10 ** MAX_DIGITS:   # as the language's whole numbers
        errs.add(f"cluster file '{file}', cores: {_short(cores)} is too large (at most {MAX_DIGITS} digits)",
                 at("cores"))
        return False
    if per is None:
        return cores, host
    if not isinstance(per, str):
        errs.add(f"cluster file '{file}', cores_per: expected a level name or 'cluster', got {_short(per)}",
                 at("cores_per"))
        return False
    level = _pool_level(per, names)
    if level is not False:
        return cores, level
    errs.add(f"cluster file '{file}', cores_per: '{per}' is not a level of this cluster ({', '.join(names)}) "
             "nor 'cluster'", at("cores_per"), did_you_mean(per, names + ["cluster"]))
    return False


def _short(v) -> str:
    """``repr`` of a YAML value, cut short (a fuzzed file can hold anything)."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _yaml_quantity(v, kind: str) -> float | None:
    """A YAML value in base units (a number, or a number YAML kept as a string: `312e12`, since YAML 1.1
    floats need a dot) or a quantity string with its unit; finite, else ValueError."""
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        out = float(v) if isinstance(v, float) or abs(v) < 2 ** 1000 else math.inf
    elif isinstance(v, str):
        try:
            out = float(v)
        except ValueError:
            out = parse_quantity(v, kind)
    else:
        raise ValueError(f"expected a {kind} (a number in base units or a quantity string), got {_short(v)}")
    if not math.isfinite(out):
        raise ValueError(f"expected a finite {kind}, got {_short(v)}")
    return out
