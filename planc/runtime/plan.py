"""Reading plan.json and answering small questions about it.

Public API (stable; used by engine.py and the other runtime modules):

    load_plan(path) -> dict                 parsed plan.json; the raw bytes are kept
                                            under the private key "_bytes" for digests
    plan_digest(plan_or_bytes) -> str       sha256 hex of the plan.json bytes
    stage_of(plan, rank) -> int | None      index of the stage whose mesh holds rank
    stage_layout(plan, index) -> dict       the stage record (index, devices, mesh, mesh_axes)
    mesh_shape(mesh) -> tuple[int, ...]     shape of a nested-list mesh
    mesh_position(mesh, rank) -> tuple | None   rank's index in the mesh
    host_of(plan, rank) -> int              index into cluster.hosts
    host_devices(plan, rank) -> tuple       devices of rank's host

Only the standard library is used here; runtime modules import each other
relatively because the package is copied into outputs as `planc_runtime`.
"""
from __future__ import annotations

import hashlib
import json
import os

__all__ = [
    "load_plan", "plan_digest", "stage_of", "stage_layout", "mesh_shape",
    "mesh_position", "mesh_devices", "host_of", "host_devices", "PlanError",
]


class PlanError(ValueError):
    """plan.json is missing something the runtime needs or contradicts itself."""


def load_plan(path: str | os.PathLike) -> dict:
    """Parse plan.json; keep its exact bytes so every rank digests the same thing."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        plan = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PlanError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(plan, dict) or plan.get("format") != "planc/1":
        raise PlanError(f"{path}: expected a plan with \"format\": \"planc/1\", "
                        f"got {plan.get('format') if isinstance(plan, dict) else type(plan).__name__!r}")
    plan["_bytes"] = raw
    plan["_path"] = str(path)
    return plan


def plan_digest(plan_or_bytes) -> str:
    """sha256 of the plan.json bytes (the file as written, not a re-serialization).

    A dict from `load_plan` digests its original bytes; any other dict is
    serialized canonically (sorted keys, compact) so equal plans agree.
    """
    if isinstance(plan_or_bytes, (bytes, bytearray, memoryview)):
        raw = bytes(plan_or_bytes)
    elif isinstance(plan_or_bytes, dict):
        raw = plan_or_bytes.get("_bytes")
        if raw is None:
            clean = {k: v for k, v in plan_or_bytes.items() if not k.startswith("_")}
            raw = json.dumps(clean, sort_keys=True, separators=(",", ":")).encode()
    elif isinstance(plan_or_bytes, str):
        raw = plan_or_bytes.encode()
    else:
        raise TypeError(f"plan_digest: expected bytes or dict, got {type(plan_or_bytes).__name__}")
    return hashlib.sha256(raw).hexdigest()


def mesh_shape(mesh) -> tuple[int, ...]:
    """Shape of a nested-list mesh ([[0, 1], [2, 3]] -> (2, 2); [4, 5] -> (2,))."""
    shape = []
    m = mesh
    while isinstance(m, (list, tuple)):
        shape.append(len(m))
        if not m:
            break
        m = m[0]
    return tuple(shape)


def mesh_devices(mesh) -> list[int]:
    """Devices of a mesh in row-major order."""
    if isinstance(mesh, (list, tuple)):
        out = []
        for m in mesh:
            out.extend(mesh_devices(m))
        return out
    return [int(mesh)]


def mesh_position(mesh, rank: int):
    """Index tuple of `rank` in the mesh, or None when it is not a member."""
    shape = mesh_shape(mesh)
    for flat, d in enumerate(mesh_devices(mesh)):
        if d == rank:
            pos = []
            for s in reversed(shape):
                pos.append(flat % s)
                flat //= s
            return tuple(reversed(pos))
    return None


def stage_layout(plan: dict, index: int) -> dict:
    for st in plan.get("stages", ()):
        if st["index"] == index:
            return st
    raise PlanError(f"plan has no stage {index} (stages: {[s['index'] for s in plan.get('stages', ())]})")


def stage_of(plan: dict, rank: int):
    """Index of the stage whose mesh contains `rank`; None for idle devices."""
    for st in plan.get("stages", ()):
        if rank in mesh_devices(st["mesh"]):
            return st["index"]
    return None


def host_of(plan: dict, rank: int) -> int:
    for h, devs in enumerate(plan["cluster"]["hosts"]):
        if rank in devs:
            return h
    raise PlanError(f"rank {rank} is on no host of cluster.hosts (devices: {plan['cluster'].get('devices')})")


def host_devices(plan: dict, rank: int) -> tuple[int, ...]:
    return tuple(plan["cluster"]["hosts"][host_of(plan, rank)])
