"""ViT-B/16 (transformers), built from a config with random weights: the encoder's last hidden state."""

import torch
import torch.nn as nn
from transformers import ViTConfig, ViTModel

batch_size = 8
image_size = 224
patch = 16
layers = 12
hidden = 768
heads = 12
intermediate = 3072
SMALL = {"batch_size": 2, "image_size": 64, "layers": 2, "hidden": 128, "heads": 4, "intermediate": 512}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        config = ViTConfig(image_size=image_size, patch_size=patch, hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, intermediate_size=intermediate, attn_implementation="sdpa")
        self.model = ViTModel(config, add_pooling_layer=False).eval()

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).last_hidden_state


def get_inputs():
    return [torch.randn(batch_size, 3, image_size, image_size)]


def get_init_inputs():
    return []
