"""ResNet-50 (torchvision), random weights (no download), in eval mode: the classifier's logits."""

import torch
import torch.nn as nn
import torchvision

batch_size = 16
image_size = 224
SMALL = {"batch_size": 2, "image_size": 64}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torchvision.models.resnet50(weights=None).eval()

    def forward(self, x):
        return self.model(x)


def get_inputs():
    return [torch.randn(batch_size, 3, image_size, image_size)]


def get_init_inputs():
    return []
