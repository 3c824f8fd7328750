"""The iteration bench's link bounds: a plan's bytes through each host link direction per iteration
(:func:`link_bytes`) and the fill-and-drain lower bound (:func:`pipeline_link_bound`), at a calibrated or
nominal rate (:func:`calibrated_rates`, :func:`link_seconds`)."""

from __future__ import annotations

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "bool": 1}


def link_bytes(plan: dict) -> dict:
    """Bytes per iteration through each host's link, each direction (see the module docstring).

    Transfers: each task's slice, per micro-batch, forward and backward; a task with one receiver
    counts once per receiving host out of the sender's host (exact for send_recv), a task with
    several receivers once out of the sender's host and once into each other receiving host (a
    lower bound). Gradient reductions: each program step's collective over a group spanning
    hosts, as a ring over the group in rank order: every ring edge between two hosts carries
    2(n-1)/n·S (allreduce), (n-1)/n·S (reduce_scatter), (n-1)·S (all_gather of S per rank) or S
    (reduce, broadcast), S the bytes each member holds at that step.

    Besides the totals (``out``, ``in``, the busiest), ``classes`` keeps them apart for
    :func:`pipeline_link_bound`: one micro-batch's ``forward`` and ``backward`` bytes and the
    iteration's ``reduction`` bytes, each ``{"out": [per host], "in": [per host]}``, and per host
    the ``fill`` and ``drain`` candidates (see there), each a list of ``(out, in)`` byte pairs.
    """
    hosts = plan["cluster"]["hosts"]
    host_of = {int(r): h for h, rs in enumerate(hosts) for r in rs}
    classes = {k: {"out": [0.0] * len(hosts), "in": [0.0] * len(hosts)} for k in ("forward", "backward", "reduction")}
    train = plan.get("train")
    mb = int(train["micro_batches"]) if train else 1
    # per device and host link, one micro-batch's bytes crossing that link: forward into the device,
    # backward sent by it ({device: {host: [out, in]}}), for the fill and drain of pipeline_link_bound
    into: dict[int, dict[int, list[float]]] = {}
    sent_back: dict[int, dict[int, list[float]]] = {}
    for t in plan["transfers"]:
        size = DTYPE_BYTES.get(t["dtype"], 4)
        for kind, route in (("forward", t), ("backward", t.get("backward"))):
            if not route:
                continue
            c = classes[kind]
            for task in route["tasks"]:
                n = size
                for a, b in task["slice"]:
                    n *= b - a
                hs = host_of[int(task["sender"])]
                others = {host_of[int(r)] for r in task["receivers"]} - {hs}
                out_n = n * (len(others) if len(task["receivers"]) == 1 else min(1, len(others)))
                for h in others:
                    c["in"][h] += n
                c["out"][hs] += out_n
                if kind == "forward":   # each receiving device needs the task's bytes across its link
                    for r in task["receivers"]:
                        hr = host_of[int(r)]
                        if hr != hs:
                            per = into.setdefault(int(r), {})
                            per.setdefault(hs, [0.0, 0.0])[0] += n
                            per.setdefault(hr, [0.0, 0.0])[1] += n
                elif others:            # the sender's gradients, counted as the totals count the task
                    per = sent_back.setdefault(int(task["sender"]), {})
                    per.setdefault(hs, [0.0, 0.0])[0] += out_n
                    for h in others:
                        per.setdefault(h, [0.0, 0.0])[1] += n
    # the first backward byte on host h's link is sent by a device whose backward crosses it, after
    # every forward byte into that device arrived; the last forward byte on it is received by a device
    # whose backward bytes all follow: each candidate's bytes on the link, distinct, in order
    classes["fill"] = [sorted({tuple(into.get(u, {}).get(h, (0.0, 0.0))) for u, per in sent_back.items() if h in per})
                       for h in range(len(hosts))]
    classes["drain"] = [sorted({tuple(sent_back.get(v, {}).get(h, (0.0, 0.0))) for v, per in into.items() if h in per})
                        for h in range(len(hosts))]
    stage_of = {int(d): s["index"] for s in plan["stages"] for d in s["devices"]}
    red = classes["reduction"]
    for r in plan["reductions"]:
        if train and r["name"] != "gradients":
            continue   # declared for placement only; a training run reduces its gradients
        per_stage = {e["stage"]: e["bytes"] for e in r.get("per_stage_bytes") or ()}
        cur = {}
        for g in r.get("groups") or ():
            for d in g:
                cur[int(d)] = float(per_stage.get(stage_of.get(int(d)), r["bytes"]))
        for step in (r.get("program") or {}).get("steps") or ():
            kind = step["collective"]
            for g in step["groups"]:
                g = sorted(int(d) for d in g)
                k = len(g)
                s = cur.get(g[0], float(r["bytes"]))
                per_edge = {"allreduce": 2 * (k - 1) / k * s, "reduce_scatter": (k - 1) / k * s,
                            "all_gather": (k - 1) * s}.get(kind, s)
                if len({host_of[d] for d in g}) > 1:
                    for i in range(k):
                        a, b = host_of[g[i]], host_of[g[(i + 1) % k]]
                        if a != b:
                            red["out"][a] += per_edge
                            red["in"][b] += per_edge
                for d in g:
                    cur[d] = s / k if kind == "reduce_scatter" else s * k if kind == "all_gather" else s
    out = [mb * (classes["forward"]["out"][h] + classes["backward"]["out"][h]) + red["out"][h] for h in range(len(hosts))]
    inn = [mb * (classes["forward"]["in"][h] + classes["backward"]["in"][h]) + red["in"][h] for h in range(len(hosts))]
    busiest = max(range(len(hosts)), key=lambda h: max(out[h], inn[h]))
    direction = "out" if out[busiest] >= inn[busiest] else "in"
    return {"out": out, "in": inn, "busiest_host": busiest, "busiest_direction": direction,
            "busiest_bytes": max(out[busiest], inn[busiest]), "micro_batches": mb, "classes": classes}


def _both(one_way: float, both_ways: float) -> float:
    """The most bytes/s a host link carries over both directions together: twice what a direction
    keeps while the other is busy, and never less than one direction alone."""
    return max(one_way, 2 * both_ways)


def _carry_time(o: float, i: float, one_way: float, both_ways: float) -> float:
    """The least time a host link carries ``o`` bytes out and ``i`` in: each direction at most
    ``one_way`` bytes/s, the two together at most :func:`_both`."""
    return max(o / one_way, i / one_way, (o + i) / _both(one_way, both_ways))


def _window_carry(w: float, avail_o: float, avail_i: float, one_way: float, both_ways: float) -> float:
    """The most bytes (both directions together) a host link carries in ``w`` seconds when only
    ``avail_o`` out and ``avail_i`` in may cross it then."""
    return min(_both(one_way, both_ways) * w, min(one_way * w, avail_o) + min(one_way * w, avail_i))


def pipeline_link_bound(link: dict, one_way: float, both_ways: float | None = None) -> tuple[float, int] | None:
    """A lower bound on the iteration from the host links alone, knowing what a pipeline must do
    first and last: ``(seconds, host)`` for the host whose link gives the largest, None for a
    ``link`` without ``classes`` (an older bench JSON) or a plan without micro-batches.

    Per host link, with ``X`` bytes out and ``Y`` in per iteration:

    * **fill**: the first backward byte to cross the link is sent by a device ``u`` whose backward
      crosses it, once ``u`` has run the micro-batch's forward, so after every forward byte into
      ``u`` that crosses the link has (``link_bytes``'s ``fill`` candidates, one per such ``u``: its
      bytes out and in); the first ``a = min over u of carry(u's bytes)`` seconds carry forward (and
      reduction) bytes only;
    * **drain**: symmetrically, the last forward byte to cross is received by a device ``v`` whose
      backward bytes on the link (the ``drain`` candidates) all follow it: the last ``c = min over v
      of carry(v's bytes)`` seconds carry backward (and reduction) bytes only;
    * in between, the link carries at most ``max(one_way, 2 * both_ways)`` bytes/s over both
      directions, each direction at most ``one_way``.

    Given the calibration's rates (a ``both_ways`` measured low makes the bound high), ``T >= a + c +
    (X + Y - W_a - W_c) / max(one_way, 2 * both_ways)``, ``W`` the most the fill and drain
    windows can carry of the bytes allowed in them (:func:`_window_carry`) — unless every forward
    byte crossed before the first backward byte (then the two windows may meet), where ``T >=
    carry(all forward) + carry(all backward)``: the bound is the smaller of the two, and at least
    ``carry(X, Y)``. On a two-stage pipeline with data degree ``d`` whose link carries activations
    one way and gradients the other, ``u`` and ``v`` are one data rank's devices: ``(f + g) / (d *
    one_way) + (X + Y - (f + g) / d) / (2 * both_ways)`` for one micro-batch's activations ``f``
    and gradients ``g`` — one data rank's first activations and last gradients cross alone.
    ``both_ways`` None (not calibrated): the directions are independent (``both_ways =
    one_way``). Reduction bytes are allowed anywhere (weaker, so still a bound); a multi-receiver
    task counts as :func:`link_bytes` counts it (a lower bound)."""
    classes = link.get("classes")
    mb = int(link.get("micro_batches") or 0)
    if not classes or "fill" not in classes or mb < 1:
        return None
    r1 = float(one_way)
    r2 = min(float(both_ways), r1) if both_ways else r1
    best = None
    for h in range(len(link["out"])):
        fo, fi = classes["forward"]["out"][h], classes["forward"]["in"][h]
        bo, bi = classes["backward"]["out"][h], classes["backward"]["in"][h]
        ro, ri = classes["reduction"]["out"][h], classes["reduction"]["in"][h]
        x, y = link["out"][h], link["in"][h]
        if x + y <= 0:
            continue
        a = min((_carry_time(o, i, r1, r2) for o, i in classes["fill"][h]), default=0.0)
        c = min((_carry_time(o, i, r1, r2) for o, i in classes["drain"][h]), default=0.0)
        wa = _window_carry(a, mb * fo + ro, mb * fi + ri, r1, r2)
        wc = _window_carry(c, mb * bo + ro, mb * bi + ri, r1, r2)
        overlapped = a + c + max(0.0, x + y - wa - wc) / _both(r1, r2)
        # or every forward byte crossed before the first backward byte (the windows may then meet)
        apart = _carry_time(mb * fo, mb * fi, r1, r2) + _carry_time(mb * bo, mb * bi, r1, r2)
        t = max(min(overlapped, apart), _carry_time(x, y, r1, r2))
        if best is None or t > best[0]:
            best = (t, h)
    return best


def calibrated_rates(cal, rates) -> dict:
    """A result's ``both_ways`` and ``one_way``: the calibrated host link's bytes/s per rate (Mbit/s),
    keyed as the rates print (``f"{rate:g}"``)."""
    return {"both_ways": {f"{r:g}": cal.both_ways(r) for r in rates},
            "one_way": {f"{r:g}": cal.host(r)[0] for r in rates}}


def link_seconds(nbytes: float, mbit: float) -> float:
    return nbytes / (mbit * 1e6 / 8)
