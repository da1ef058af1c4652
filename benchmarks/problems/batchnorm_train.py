"""Batch norm in training mode (batch statistics, running statistics updated) over a large NCHW tensor."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, num_features: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)


def get_inputs():
    return [torch.rand(64, 64, 512, 512)]


def get_init_inputs():
    return [64]
