"""``planc checkpoint info | export DIR``: what a format-2 checkpoint holds, and its weights exported.

The folder is checked first by ``planc.checkpoint.read.open_checkpoint`` (planc.json, every file's size and
sha256, the DCP metadata); ``info`` renders what it found as rich tables (``planc.commands.ui``), ``export`` hands
it to ``planc.checkpoint.export``. Options are declared in ``planc.commands.cli``; docs/cli.md is the reference.
"""

from __future__ import annotations

import json
import sys

from planc.checkpoint.read import Checkpoint, CheckpointError, open_checkpoint


# ---------------------------------------------------------------- info

def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n:,} bytes ({n / size:.1f} {unit})"
    return f"{n:,} bytes"


def _record(rec) -> str:
    """An optimizer or schedule record as ``name(k=v, ...)``, its keys sorted."""
    if not isinstance(rec, dict):
        return json.dumps(rec)
    args = ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(rec.items()) if k != "name")
    return f"{rec.get('name', '?')}({args})" if args else str(rec.get("name", "?"))


def _model(meta: dict) -> str:
    m, hf = meta.get("model"), meta.get("hf_config")
    if hf:
        arch = ", ".join(hf.get("architectures") or []) or hf.get("model_type", "?")
        return f"Hugging Face {arch} (export --hf gives its folder)"
    if isinstance(m, dict) and "file" in m and "function" in m:
        args = m.get("args") or {}
        return f"{m['file']}:{m['function']}" + (f" {json.dumps(args, sort_keys=True)}" if args else "")
    return json.dumps(m, sort_keys=True)


def summary_rows(ck: Checkpoint) -> list[tuple[str, str]]:
    m = ck.meta
    stored = sorted({p.stored for p in ck.parameters})
    rows = [
        ("step", str(m["step"])),
        ("plan", m["plan"]),
        ("digest", m["digest"]),
        ("model", _model(m)),
        ("world size", str(m["world_size"])),
        ("precision", f"{m['precision']} (stored: {', '.join(stored) or 'nothing'} masters)"),
        ("zero", str(m["zero"])),
        ("global batch", f"{m['global_batch']} (micro-batch {m['micro_batch']} x {m['micro_batches']})"),
        ("optimizer", _record(m["optimizer"])),
    ]
    if "lr_schedule" in m:
        rows.append(("lr schedule", _record(m["lr_schedule"])))
    states = sorted({s for p in ck.parameters for s in p.states})
    same = len({p.states for p in ck.parameters}) <= 1
    rows += [
        ("optim state", (", ".join(states) + ("" if same else " (not for every parameter: --parameters)"))
         if states else "none stored"),
        ("parameters", f"{len(ck.parameters):,} tensors, {sum(p.elements for p in ck.parameters):,} elements"),
        ("chunks", f"{sum(p.chunks for p in ck.parameters):,} master chunks"),
        ("on disk", f"{_bytes(sum(r['size'] for r in m['files'].values()))} in {len(m['files'])} files"),
    ]
    data, regime = m.get("data"), m.get("regime")
    if isinstance(data, dict) and "drawn" in data:
        rows.append(("data", f"{data['drawn']} batches drawn"))
    if isinstance(regime, dict) and m["precision"] == "fp16":
        rows.append(("loss scale", f"{regime.get('loss_scale')} ({regime.get('skipped_steps')} steps skipped)"))
    return rows


def _runs(devices) -> str:
    """Device ids with consecutive runs as ``a-b``: ``0-3,8``."""
    out, ids = [], sorted(d for d in devices if isinstance(d, int))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out) or "-"


def sharding_rows(meta: dict) -> list[list[str]]:
    """One row per stage of planc.json "sharding": its layers (``[a, b)`` as plan.json writes them, shown
    ``a-(b-1)``), its mesh (device ids as written), tensor and data degrees and devices."""
    sharding = meta.get("sharding")
    stages = sharding.get("stages") if isinstance(sharding, dict) else None
    rows = []
    for s in stages if isinstance(stages, list) else []:
        if not isinstance(s, dict):
            continue
        lay = s.get("layers")
        ok = isinstance(lay, list) and len(lay) == 2 and all(isinstance(x, int) for x in lay) and lay[0] < lay[1]
        span = (str(lay[0]) if lay[1] - lay[0] == 1 else f"{lay[0]}-{lay[1] - 1}") if ok else json.dumps(lay)
        rows.append([str(s.get("index")), span, json.dumps(s.get("mesh"), separators=(",", ":")),
                     str(s.get("tensor")), str(s.get("data")),
                     _runs(s["devices"]) if isinstance(s.get("devices"), list) else json.dumps(s.get("devices"))])
    return rows


def info_renderables(ck: Checkpoint, parameters: bool, tty: bool) -> list:
    from planc.commands import ui

    head = ui.table(["", ui.Col("", wrap=True)], summary_rows(ck), tty=tty)
    head.show_header = False          # a list of fields: a header row would only repeat them
    out = [f"checkpoint {ck.folder}", head]
    shard = sharding_rows(ck.meta)
    if shard:
        cols = [ui.Col("stage", justify="right"), "layers", ui.Col("mesh", wrap=True),
                ui.Col("tensor", justify="right"), ui.Col("data", justify="right"), ui.Col("devices", wrap=True)]
        out += ["", ui.table(cols, shard, title="sharding (the plan that saved it)", tty=tty)]
    if parameters:
        # the optimizer state's names only where they differ between parameters (the summary gives them)
        differ = len({p.states for p in ck.parameters}) > 1
        cols = ["name", "shape", "dtype", ui.Col("chunks", justify="right")] + [ui.Col("state", wrap=True)] * differ
        rows = [[p.name + "".join(f"\n  = {t}" for t in p.tied), "x".join(map(str, p.shape)) or "scalar",
                 p.dtype, p.chunks] + [", ".join(p.states) or "-"] * differ for p in ck.parameters]
        out += ["", ui.table(cols, rows, title="parameters (global names, model order)", tty=tty)]
    return out


# ---------------------------------------------------------------- the command

def run(args) -> int:
    """``planc checkpoint info|export DIR`` (planc.commands.cli declares the options): the checkpoint checked before
    anything is shown or written; whatever is wrong is one line on stderr and exit 2."""
    from planc.commands import ui

    where = f"planc checkpoint {args.action}"
    if args.action == "export":
        wrong = ("--optimizer goes with --torch (the Hugging Face folder holds the model only)"
                 if args.hf and args.optimizer else
                 "--dtype goes with --hf (--torch writes the fp32 masters)" if args.torch and args.dtype else None)
        if wrong:
            print(f"{where}: {wrong}", file=sys.stderr)
            return 2
    try:
        with ui.status(f"{where} {args.directory}") as progress:   # hashing every file can take a while
            progress("checking planc.json, each file's sha256 and the DCP metadata")
            ck = open_checkpoint(args.directory)
            if args.action == "export":
                from planc.checkpoint.export import export_hf, export_torch
                progress("reading and writing the tensors")
                done = (export_torch(ck, args.torch, args.optimizer) if args.torch
                        else export_hf(ck, args.hf, args.dtype))
    except CheckpointError as e:
        print(f"{where}: {e}", file=sys.stderr)
        return 2
    if args.action == "info":
        ui.emit(info_renderables(ck, args.parameters, tty=ui.is_tty()))
    else:
        print(done)
    return 0
