"""A 1-d max pooling over long rows (dilated, padded): the shape class the issue measured at 0.29x torch.compile."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, kernel_size: int, stride: int, padding: int, dilation: int):
        super().__init__()
        self.pool = nn.MaxPool1d(kernel_size, stride=stride, padding=padding, dilation=dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x)


def get_inputs():
    return [torch.rand(64, 192, 65536)]


def get_init_inputs():
    return [8, 1, 4, 3]
