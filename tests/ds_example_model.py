"""The model and data of tests/ds_example_script.py, importable without DeepSpeed (the test
builds its single-process reference from them)."""

import torch
from torch import nn

FEATURES, STEPS, SAVE_AT, MICRO, LR, CLIP = 12, 6, 3, 4, 0.001, 1.0
BETAS, EPS, WEIGHT_DECAY = (0.8, 0.999), 1e-8, 3e-7


class Net(nn.Module):
    """A small MLP (two blocks, so stage 3 has units to gather)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(FEATURES, 24), nn.Tanh(),
                                                   nn.Linear(24, FEATURES)) for _ in range(2)])
        self.head = nn.Linear(FEATURES, 3)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def dataset():
    """Deterministic 3-class data (a CIFAR-10 stand-in without the download)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(96, FEATURES, generator=gen)
    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long() + (x[:, 0] > 1).long())
