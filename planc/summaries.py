"""`planc check`'s summary table (re-exported by planc.explain), and explain's lines on sequence parallelism, tied parameters and the vocabulary split."""
from __future__ import annotations

import re

from planc import ui
from planc.ui import Col

__all__ = ["check_summary", "sequence_lines", "tied_lines", "vocab_line"]


def check_summary(summary: str, tty: bool = False) -> list:
    """`planc check`'s output: the first line of ``planc.lang.format.summary`` (name, ok, path), then
    its ``  key   value`` lines as a two-column table; a line of another shape stays a line below it.
    The facts are summary()'s own, so check shows exactly what it says."""
    head, *lines = summary.splitlines()
    rows, notes = [], []
    for line in lines:
        m = re.match(r"^  (\S.*?)\s{2,}(\S.*)$", line)
        if m:
            rows.append([m.group(1), m.group(2)])
        else:
            notes.append(line)
    out: list = [head]
    if rows:
        out.append(ui.table([Col("item"), Col("what", wrap=True)], rows, tty=tty))
    return out + notes


def sequence_lines(stages: list[dict]) -> list[str]:
    """Which tensor stages run sequence-parallel, and why the others do not (plan.json stages[i])."""
    on = [str(s["index"]) for s in stages if s.get("sequence_parallel")]
    out = [f"sequence parallelism: stage{'s' if len(on) > 1 else ''} {', '.join(on)} (norms, residuals and the "
           "activations between stages split along the sequence over tensor)"] if on else []
    out += [f"stage {s['index']}: no sequence parallelism: {s['sequence_why']}" for s in stages
            if s.get("sequence_parallel") is False and s.get("sequence_why")]
    return out


def tied_lines(r: dict) -> list[str]:
    """The head of a tied parameter's reduction: the parameter, its holders and devices, who contributes."""
    t = r["tied"]
    stages = sorted({h["stage"] for h in t["holders"]})
    others = [d for d in t["devices"] if d not in t["contributors"]]
    out = [f"reduce tied parameter {t['parameter']}: {ui.human_bytes(r['bytes'])}, held by stages "
           f"{', '.join(map(str, stages))} on devices {t['devices']}, {r['groups']} group(s) of {r['group_size']}",
           "  holders: " + ", ".join(f"layers.{h['layer']}.{h['name']} (stage {h['stage']})" for h in t["holders"]),
           f"  summed after the last backward, before clip and the step; "
           + ("each piece's first device counts it in the norm" if t.get("pieces") else
              f"device {t['norm_device']} counts it in the norm")]
    if others:
        out.append(f"  devices {others} enter zeros (tensor replicas of a contributor's identical gradient)")
    for p in t.get("pieces") or ():
        out.append(f"  rows {p['rows'][0]}..{p['rows'][1]} of the table summed over {p['group']} (the devices "
                   "holding them)")
    return out


def vocab_line(v: dict) -> str:
    """The vocabulary split (plan.json train.model.hf.vocab): the padding of each table, where there is any."""
    parts = [f"{what} {v[key]} rows ({v[key] - v['size']} padding)" if v[key] != v["size"] else f"{what} unpadded"
             for what, key in (("embedding", "embedding"), ("lm_head", "lm_head"))]
    return (f"vocabulary split by the tensor stages: {v['size']} tokens; " + ", ".join(parts)
            + " (padding rows zero, never trained nor written to checkpoints)")
