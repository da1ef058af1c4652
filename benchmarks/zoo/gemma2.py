"""Gemma 2 (transformers), built from a config with random weights: transformers' eager attention (the only one it
offers Gemma 2: keys and values repeated per query head, the scores' soft cap tanh(x / 50) * 50; its sliding
window, 4096, is longer than these sequences), RMSNorm before and after each block, a GeGLU MLP; the decoder's last
hidden state."""

import torch
import torch.nn as nn
from transformers import Gemma2Config, Gemma2Model

batch_size = 4
seq_len = 512
layers = 8
hidden = 1024
heads = 8
kv_heads = 4
head_dim = 128
intermediate = 4096
vocab = 32000
SMALL = {"batch_size": 2, "seq_len": 64, "layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "head_dim": 32,
         "intermediate": 256, "vocab": 1000}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        config = Gemma2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                              num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                              vocab_size=vocab, max_position_embeddings=seq_len, attn_implementation="eager")
        self.model = Gemma2Model(config).eval()

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).last_hidden_state


def get_inputs():
    return [torch.randint(0, vocab, (batch_size, seq_len))]


def get_init_inputs():
    return []
