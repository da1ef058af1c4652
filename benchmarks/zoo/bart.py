"""BART-base (transformers), built from a config with random weights: encoder and decoder (self- and
cross-attention); the decoder's last hidden state."""

import torch
import torch.nn as nn
from transformers import BartConfig, BartModel

batch_size = 8
seq_len = 256
layers = 6
hidden = 768
heads = 12
ffn = 3072
vocab = 50265
SMALL = {"batch_size": 2, "seq_len": 32, "layers": 1, "hidden": 128, "heads": 4, "ffn": 512, "vocab": 1000}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        config = BartConfig(d_model=hidden, encoder_layers=layers, decoder_layers=layers,
                            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                            decoder_ffn_dim=ffn, vocab_size=vocab, max_position_embeddings=seq_len,
                            attn_implementation="sdpa")
        self.model = BartModel(config).eval()

    def forward(self, input_ids, decoder_input_ids):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids,
                          use_cache=False).last_hidden_state


def get_inputs():
    return [torch.randint(0, vocab, (batch_size, seq_len)), torch.randint(0, vocab, (batch_size, seq_len))]


def get_init_inputs():
    return []
