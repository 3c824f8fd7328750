"""The communication check's data (``train.py --comm-only``): values any rank can predict, so a piece
delivered to the wrong place, or reduced from the wrong member, shows."""
from __future__ import annotations

import torch

__all__ = ["pattern", "contribution"]


def pattern(shape, region, dtype) -> torch.Tensor:
    """A tensor's values over ``region``, a pure function of the global index (so any rank can predict them)."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    values = torch.zeros([b - a for a, b in region], dtype=torch.int64)
    for d, (a, b) in enumerate(region):
        view = [1] * len(region)
        view[d] = b - a
        values = values + (torch.arange(a, b, dtype=torch.int64) * strides[d]).view(view)
    modulus = 2 if dtype == torch.bool else 127 if dtype in (torch.int8, torch.uint8) else 251
    return (values % modulus).to(dtype)


def contribution(n: int, device: int) -> torch.Tensor:
    """Device ``device``'s input to a checked reduction: small integers (0..63, so sums stay exact in
    f32 for groups of up to 2^18 members) that depend on the element's position through a hash, not
    a period, so a piece reduced into the wrong offset (or from the wrong member) gives another sum."""
    mask, out = 0xFFFFFFFF, torch.empty(n, dtype=torch.float32)
    for a in range(0, n, 1 << 20):       # in windows: the int64 temporaries stay small for any buffer
        b = min(n, a + (1 << 20))
        h = (torch.arange(a, b, dtype=torch.int64) * 0x9E3779B1 + (device + 1) * 0x85EBCA6B) & mask
        h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & mask
        out[a:b] = (h ^ (h >> 12)) & 63
    return out
