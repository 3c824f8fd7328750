"""A multi-layer perceptron as pipeline layers, for quick plans and tests.

``build(layers, hidden, inputs, outputs)``: layer 0 maps ``inputs`` to
``hidden``, the middle layers ``hidden`` to ``hidden``, the last ``hidden`` to
``outputs``; ``layers`` modules in all (at least 2).
"""

import torch
from torch import nn


class Dense(nn.Module):
    def __init__(self, n_in, n_out, act=True):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out)
        self.act = act

    def forward(self, x):
        y = self.linear(x)
        return torch.tanh(y) if self.act else y


def build(layers=4, hidden=16, inputs=8, outputs=4):
    if layers < 2:
        raise ValueError("mlp needs at least 2 layers")
    sizes = [inputs] + [hidden] * (layers - 1) + [outputs]
    return [Dense(sizes[i], sizes[i + 1], act=i < layers - 1) for i in range(layers)]


def loss(output, target):
    return nn.functional.mse_loss(output, target)


def batches(micro_batch, seed, inputs=8, outputs=4, **_):
    """Endless seeded regression data: targets are a fixed smooth function of the inputs."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(inputs, outputs, generator=g)
    while True:
        x = torch.randn(micro_batch, inputs, generator=g)
        yield x, torch.sin(x @ w)
