"""GPT-2 (transformers), built from a config with random weights: the decoder's last hidden state."""

import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2Model

batch_size = 8
seq_len = 512
layers = 12
hidden = 768
heads = 12
vocab = 50257
SMALL = {"batch_size": 2, "seq_len": 64, "layers": 2, "hidden": 128, "heads": 4, "vocab": 1000}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        config = GPT2Config(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=vocab, n_positions=seq_len,
                            bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                            attn_implementation="sdpa")
        self.model = GPT2Model(config).eval()

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


def get_inputs():
    return [torch.randint(0, vocab, (batch_size, seq_len))]


def get_init_inputs():
    return []
