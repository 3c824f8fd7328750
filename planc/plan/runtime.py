"""plan.json ``runtime``: how the runtime executes the plan, decided by the compiler.

Every setting here changes what a rank computes or the order in which it communicates, so it is
part of the plan (and of its digest, which every rank compares at start) and never read from the
environment. The compiler writes documented defaults unless the plan's ``train`` block sets one
(docs/language.md, "Runtime settings"); the hang check (planc.pipeline.deadlock) proves the plan
with exactly ``recv_ahead``. Stdlib only (part of the plan file, copied into every output).
"""
from __future__ import annotations

from dataclasses import dataclass
from .jsonpath import At, extra, with_extra
from .vocab import Backend, InHost

__all__ = ["Runtime", "DEFAULT_RECV_AHEAD", "DEFAULT_GRAD_BUCKET_BYTES",
           "DEFAULT_REDUCE_BUCKET_BYTES", "DEFAULT_SHM_SLOT_BYTES",
           "DEFAULT_TIMEOUT_S"]

DEFAULT_RECV_AHEAD = 4                    # receives posted ahead per transfer direction
DEFAULT_GRAD_BUCKET_BYTES = 8 << 20       # a gradient bucket is reduced once its last gradient is ready
DEFAULT_REDUCE_BUCKET_BYTES = 32 << 20    # a reduction program runs on buffers of at most this size
DEFAULT_SHM_SLOT_BYTES = 8 << 20          # per member of an in-host shared-memory segment (in_host)
DEFAULT_TIMEOUT_S = 300.0                 # the collective timeout of a plan that sets none


@dataclass(frozen=True, slots=True)
class Runtime:
    backend: Backend = Backend.AUTO
    recv_ahead: int = DEFAULT_RECV_AHEAD
    grad_bucket_bytes: int = DEFAULT_GRAD_BUCKET_BYTES
    reduce_bucket_bytes: int = DEFAULT_REDUCE_BUCKET_BYTES
    in_host: InHost = InHost.SHARED_MEMORY
    # a host NIC order's turn passes only once the rank's cross-host TCP send queues are empty
    nic_drain: bool = True
    # AlpaComm's "signal send/recv" measurement: every task moves one element (same schedule, same
    # order, same dependencies), receivers get zeros; the step without the cost of moving the data
    signal_transfers: bool = False
    # each member's slot of an in-host shared-memory segment (in_host = shared_memory): a region larger
    # goes in windows of it; the runtime rounds it up to a multiple of 64 bytes (slots stay aligned)
    shm_slot_bytes: int = DEFAULT_SHM_SLOT_BYTES
    # the collective timeout (s) of a plan without a model (train { timeout = ... } with no train record
    # to hold it: a communication-only plan); a plan with a model keeps it in train.timeout
    timeout: float | None = None
    extra: tuple = ()
    # each transfer direction of each transfer on communicators of its own (its point-to-point one and its
    # broadcast and all-gather groups), not one per direction shared by every transfer: where two ranks send
    # each other activations (interleaved_1f1b, zbv: a pipe that comes back to a mesh), a receive posted
    # ahead on a shared pair communicator would stand before the send the peer waits for (written when true)
    p2p_per_transfer: bool = False

    KEYS = ("backend", "recv_ahead", "grad_bucket_bytes", "reduce_bucket_bytes", "in_host", "shm_slot_bytes",
            "nic_drain", "signal_transfers", "timeout", "p2p_per_transfer")

    @staticmethod
    def read(at: At) -> "Runtime":
        if at.value is None:
            return Runtime()
        d = Runtime()
        return Runtime(at.key("backend", str(d.backend)).enum(Backend),
                       at.key("recv_ahead", d.recv_ahead).int(1),
                       at.key("grad_bucket_bytes", d.grad_bucket_bytes).int(1),
                       at.key("reduce_bucket_bytes", d.reduce_bucket_bytes).int(1),
                       at.key("in_host", str(d.in_host)).enum(InHost),
                       at.key("nic_drain", d.nic_drain).bool(),
                       at.key("signal_transfers", d.signal_transfers).bool(),
                       at.key("shm_slot_bytes", d.shm_slot_bytes).int(1),
                       positive_seconds(at.key("timeout", None)),
                       extra(at, Runtime.KEYS), at.key("p2p_per_transfer", False).bool())

    def to_json(self) -> dict:
        return with_extra({"backend": str(self.backend), "recv_ahead": self.recv_ahead,
                           "grad_bucket_bytes": self.grad_bucket_bytes,
                           "reduce_bucket_bytes": self.reduce_bucket_bytes, "in_host": str(self.in_host),
                           "shm_slot_bytes": self.shm_slot_bytes, "nic_drain": self.nic_drain, "signal_transfers": self.signal_transfers,
                           **({"timeout": self.timeout} if self.timeout is not None else {}),
                           **({"p2p_per_transfer": True} if self.p2p_per_transfer else {})},
                          self.extra)


def positive_seconds(at: At) -> float | None:
    """A positive number of seconds, or None where the key is absent (``train.timeout``, ``runtime.timeout``)."""
    if at.value is None:
        return None
    v = at.num()
    if v <= 0:
        at.fail(f"expected a positive number of seconds, got {v}")
    return v
