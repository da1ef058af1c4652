"""BERT-base (transformers), built from a config with random weights: the encoder's last hidden state."""

import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

batch_size = 8
seq_len = 512
layers = 12
hidden = 768
heads = 12
intermediate = 3072
vocab = 30522
SMALL = {"batch_size": 2, "seq_len": 64, "layers": 2, "hidden": 128, "heads": 4, "intermediate": 512,
         "vocab": 1000}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=seq_len,
                            attn_implementation="sdpa")
        self.model = BertModel(config, add_pooling_layer=False).eval()

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


def get_inputs():
    return [torch.randint(0, vocab, (batch_size, seq_len))]


def get_init_inputs():
    return []
