"""A Whisper-base encoder (transformers), built from a config with random weights: two 1-d convolutions over
the log-mel frames, then pre-norm transformer layers; the encoder's last hidden state."""

import torch
import torch.nn as nn
from transformers import WhisperConfig, WhisperModel

batch_size = 4
positions = 1500
mel_bins = 80
layers = 6
hidden = 512
heads = 8
ffn = 2048
SMALL = {"batch_size": 2, "positions": 64, "mel_bins": 16, "layers": 1, "hidden": 128, "heads": 4, "ffn": 512}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        config = WhisperConfig(d_model=hidden, encoder_layers=layers, decoder_layers=1, encoder_attention_heads=heads,
                               decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
                               num_mel_bins=mel_bins, max_source_positions=positions, attn_implementation="sdpa")
        self.encoder = WhisperModel(config).encoder.eval()

    def forward(self, input_features):
        return self.encoder(input_features=input_features).last_hidden_state


def get_inputs():
    # the first convolution keeps the frames, the second (stride 2) halves them to the positions
    return [torch.randn(batch_size, mel_bins, 2 * positions)]


def get_init_inputs():
    return []
