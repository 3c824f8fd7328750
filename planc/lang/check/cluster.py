"""The ``cluster`` block: levels written inline, or a YAML cluster file (read by the loader)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from planc import ir
from planc.lang import ast
from planc.lang.check.values import Diagnostics, did_you_mean, int_of, quantity
from planc.lang.units import BANDWIDTH, FLOPS, SIZE, TIME, parse_quantity
from planc.span import Span

__all__ = ["ClusterFile", "MAX_DEVICES", "check_cluster"]

MAX_DEVICES = 1 << 20


@dataclass(frozen=True, slots=True)
class ClusterFile:
    """A cluster file named by ``cluster "FILE"``, as the loader read it: its YAML document, or
    ``problem``, the message saying why it could not be read."""

    name: str                  # as written in the plan
    doc: object = None
    problem: str | None = None


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
    memory = _device_value(errs, block.memory, "memory")
    if host is None or len(levels) != len(block.levels):
        return None
    return _sized(errs, ir.Cluster(tuple(levels), host, flops, memory), block.span)


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
    if cluster.devices > MAX_DEVICES:
        errs.add(f"the cluster has {cluster.devices} devices; planc handles at most {MAX_DEVICES}", span)
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


def _from_file(errs: Diagnostics, file: ast.Str, contents: ClusterFile | None) -> ir.Cluster | None:
    if contents is None:
        errs.add(f"cluster file '{file.value}' was not read", file.span)
        return None
    if contents.problem is not None:
        errs.add(contents.problem, file.span)
        return None
    doc = contents.doc
    if isinstance(doc, dict) and isinstance(doc.get("cluster"), dict):
        doc = doc["cluster"]
    if not isinstance(doc, dict) or not isinstance(doc.get("levels"), list) or not doc["levels"]:
        errs.add(f"cluster file '{file.value}' must hold a mapping with a non-empty 'levels' list "
                 "(each: name, fanout, bandwidth, latency) and optionally 'host'", file.span)
        return None
    levels = []
    for i, entry in enumerate(doc["levels"]):
        where = f"cluster file '{file.value}', levels[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            errs.add(f"{where}: expected a mapping with 'name' and 'fanout'", file.span)
            return None
        fanout = entry.get("fanout", entry.get("x"))
        if not isinstance(fanout, int) or isinstance(fanout, bool) or fanout < 1:
            errs.add(f"{where}: 'fanout' must be a whole number >= 1, got {fanout!r}", file.span)
            return None
        try:
            bw = _yaml_quantity(entry.get("bandwidth"), "bandwidth")
            lat = _yaml_quantity(entry.get("latency"), "time") or 0.0
        except ValueError as e:
            errs.add(f"{where}: {e}", file.span)
            return None
        if fanout > 1 and bw is None:
            errs.add(f"{where}: level '{entry['name']}' has {fanout} units and needs a bandwidth", file.span)
            return None
        levels.append(ir.Level(entry["name"], fanout, bw, lat, file.span))
    names = [l.name for l in levels]
    if len(set(names)) != len(names):
        errs.add(f"cluster file '{file.value}': level names repeat: {names}", file.span)
        return None
    host = _host_level(errs, levels, doc.get("host"), file.span)
    device = {}
    for key, kind in (("flops", "FLOP rate"), ("memory", "size")):
        try:
            v = _yaml_quantity(doc.get(key), kind)
        except ValueError as e:
            errs.add(f"cluster file '{file.value}', {key}: {e}", file.span)
            return None
        if v is not None and (not math.isfinite(v) or v <= 0):
            errs.add(f"cluster file '{file.value}', {key}: must be a positive {kind}, got {doc.get(key)!r}",
                     file.span)
            return None
        device[key] = v
    if not host:
        return None
    return _sized(errs, ir.Cluster(tuple(levels), host, device["flops"], device["memory"]), file.span)


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
        raise ValueError(f"expected a {kind} (a number in base units or a quantity string), got {v!r}")
    if not math.isfinite(out):
        raise ValueError(f"expected a finite {kind}, got {v!r}")
    return out
