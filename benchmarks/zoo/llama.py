"""Llama (transformers), built from a config with random weights: RMSNorm, rotary embeddings, grouped-query
attention (4 key/value heads for 16 query heads) and a SiLU-gated MLP; the decoder's last hidden state."""

import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaModel

batch_size = 4
seq_len = 512
layers = 8
hidden = 1024
heads = 16
kv_heads = 4
intermediate = 2816
vocab = 32000
SMALL = {"batch_size": 2, "seq_len": 64, "layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2,
         "intermediate": 352, "vocab": 1000}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                             max_position_embeddings=seq_len, attn_implementation="sdpa")
        self.model = LlamaModel(config).eval()

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).last_hidden_state


def get_inputs():
    return [torch.randint(0, vocab, (batch_size, seq_len))]


def get_init_inputs():
    return []
