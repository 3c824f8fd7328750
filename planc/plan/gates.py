"""When a stage's receives may be posted: the one rule the runtime's receive thread
(``planc.runtime.comm.RecvAhead``), the simulator (``planc.pipeline.simulate``) and the hang check
(``planc.pipeline.deadlock``) share. It is part of the contract because the compiler proves and
predicts exactly what the runtime does with plan.json's ``runtime.recv_ahead``. Stdlib only (part of
the plan file, copied into every output).
"""
from __future__ import annotations

from .runtime import DEFAULT_RECV_AHEAD

__all__ = ["post_gates", "DEFAULT_AHEAD"]

DEFAULT_AHEAD = DEFAULT_RECV_AHEAD    # the contract's default (plan.json runtime.recv_ahead)


def post_gates(ops, ahead: int, receives=None) -> list[int]:
    """Per operation ``j`` of a rank class's compute list (``"F3"``, ``"B0"``, ``("F", 3)``, or with the
    stage, for a class of several stages, ``("F", stage, 3)``; ``W`` too), the operation whose beginning
    lets the receive thread post ``j``'s receives.

    - ``F m`` (and ``W m``): the operation ``ahead`` before it (0 for the first ``ahead`` operations);
    - ``B m``: that, or the same stage's ``F m`` when earlier: the output gradients of micro-batch ``m``
      cannot arrive before its forward ran here, and are posted from then on;
    - receives are queued (and finished) in list order, so each gate is at least the gate of
      every earlier operation that receives anything (``receives[j]``: whether op ``j`` does;
      default every op; a RECV of a ``local`` route, two stages of one mesh, receives nothing), and an operation with nothing to receive gets the gate before it: the
      result never decreases, and every gate is at most its own operation.

    The runtime (``RecvAhead``), the simulator and the deadlock check all use this one rule.
    """
    ops = [(op[0], None, int(op[1:])) if isinstance(op, str) else (op[0], None, int(op[1])) if len(op) == 2
           else (op[0], op[1], int(op[2])) for op in ops]
    receives = [True] * len(ops) if receives is None else list(receives)
    forward_at = {(s, m): j for j, (kind, s, m) in enumerate(ops) if kind == "F"}
    gates, floor = [], 0
    for j, (kind, s, m) in enumerate(ops):
        g = max(0, j - max(0, int(ahead)))
        if kind == "B" and forward_at.get((s, m), j) < g:
            g = forward_at[s, m]
        if receives[j]:
            floor = max(floor, g)
        gates.append(floor)      # an operation with nothing to receive never holds back the next ones
    return gates
