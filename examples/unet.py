"""A small 1-D U-Net: a U-shaped model whose skip connections cross stages.

Layers (``build(channels, inputs, length)``):

===  ========  ========================  =========================
idx  layer     receives                  returns
===  ========  ========================  =========================
0    Enc1      x [B, inputs, L]          e1 [B, c, L]
1    Enc2      e1                        e2 [B, 2c, L/2]
2    Mid       e2                        m  [B, 2c, L/2]
3    Dec2      m, e2, e1                 (d2 [B, c, L], e1)
4    Dec1      d2, e1                    d1 [B, c, L]
5    Head      d1                        y  [B, inputs, L]
===  ========  ========================  =========================

A layer that returns a tuple hands it to the next layer as positional
arguments. With stages ``0..2``, ``2..3`` and ``3..6`` the plan declares, in
this order, ``m`` (stage 1 to 2), ``e2`` (stage 0 layer 1 to 2) and ``e1``
(stage 0 layer 0 to 2): stage 2's first layer receives its incoming
transfers as positional arguments in declaration order.
"""

import torch
from torch import nn


def _conv(n_in, n_out):
    return nn.Conv1d(n_in, n_out, kernel_size=3, padding=1)


class Enc1(nn.Module):
    def __init__(self, inputs, c):
        super().__init__()
        self.conv = _conv(inputs, c)

    def forward(self, x):
        return torch.tanh(self.conv(x))


class Enc2(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = _conv(c, 2 * c)

    def forward(self, e1):
        return torch.tanh(self.conv(nn.functional.avg_pool1d(e1, 2)))


class Mid(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = _conv(2 * c, 2 * c)

    def forward(self, e2):
        return torch.tanh(self.conv(e2))


class Dec2(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = _conv(4 * c, c)

    def forward(self, m, e2, e1):
        d = torch.tanh(self.conv(torch.cat([m, e2], dim=1)))
        return nn.functional.interpolate(d, scale_factor=2, mode="nearest"), e1


class Dec1(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = _conv(2 * c, c)

    def forward(self, d2, e1):
        return torch.tanh(self.conv(torch.cat([d2, e1], dim=1)))


class Head(nn.Module):
    def __init__(self, c, inputs):
        super().__init__()
        self.conv = nn.Conv1d(c, inputs, kernel_size=1)

    def forward(self, d1):
        return self.conv(d1)


def build(channels=4, inputs=2, length=16):
    if length % 2:
        raise ValueError("length must be even")
    c = channels
    return [Enc1(inputs, c), Enc2(c), Mid(c), Dec2(c), Dec1(c), Head(c, inputs)]


def loss(output, target):
    return nn.functional.mse_loss(output, target)


def batches(micro_batch, seed, inputs=2, length=16, **_):
    """Endless seeded denoising data: target = a smoothed copy of the input."""
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(micro_batch, inputs, length, generator=g)
        yield x, (x + x.roll(1, dims=2) + x.roll(-1, dims=2)) / 3
