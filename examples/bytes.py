"""Any local text file as a stream of byte tokens (vocabulary 256): a real corpus, nothing downloaded.

``batches(micro_batch, seed, path=None, seq=16)`` yields ``(ids, ids)`` forever: ``ids`` an int64
tensor [micro_batch, seq] of windows of the file's bytes, the window starts drawn by a generator seeded
with ``seed`` (the same seed, the same batches). The labels are the ids themselves: a causal LM's loss
shifts them (``planc_runtime.hf.causal_lm_loss``, HF's ForCausalLMLoss). ``path`` None is the small
English text bundled beside this file (``tiny_corpus.py``, copied into a compiled output with it); any
other path is read as bytes (an absolute path, or relative to the folder the run starts in).

In a plan: ``data "../examples/bytes.py:batches" { seq = 16 }`` (the data line's keys are this
function's keyword arguments).
"""
from __future__ import annotations

import torch

from tiny_corpus import TEXT

VOCAB = 256


def corpus(path: str | None = None) -> bytes:
    """The bytes of the file at ``path`` (None: the bundled text)."""
    if path is None:
        return TEXT.encode("utf-8")
    with open(path, "rb") as f:
        return f.read()


def batches(micro_batch: int, seed: int, path: str | None = None, seq: int = 16):
    data = torch.frombuffer(bytearray(corpus(path)), dtype=torch.uint8).to(torch.int64)
    if data.numel() <= seq:
        raise ValueError(f"the corpus has {data.numel()} bytes, fewer than seq + 1 = {seq + 1}")
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq)
    while True:
        starts = torch.randint(0, data.numel() - seq, (micro_batch,), generator=g)
        ids = data[starts[:, None] + offsets]
        yield ids, ids.clone()
