"""A latent-diffusion UNet block, written as Stable Diffusion's cross-attention down block is built: a ResNet block
(group norm, SiLU, 3x3 convolutions, the timestep embedding added per channel, a residual), then a spatial
transformer (group norm, 1x1 projection in, self-attention, cross-attention to a text context, a GEGLU
feed-forward, 1x1 projection out, a residual)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

batch_size = 4
channels = 320
size = 64
heads = 8
context_len = 77
context_dim = 768
time_dim = 1280
SMALL = {"batch_size": 2, "channels": 64, "size": 16, "heads": 4, "context_len": 8, "context_dim": 96,
         "time_dim": 128}


class ResnetBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(32, c, eps=1e-5), nn.Conv2d(c, c, 3, padding=1)
        self.time = nn.Linear(time_dim, c)
        self.norm2, self.conv2 = nn.GroupNorm(32, c, eps=1e-5), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return x + h


class Attention(nn.Module):
    def __init__(self, dim: int, context: int):
        super().__init__()
        self.q = nn.Linear(dim, dim, bias=False)
        self.k, self.v = nn.Linear(context, dim, bias=False), nn.Linear(context, dim, bias=False)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, ctx):
        b, n, d = x.shape
        q, k, v = (t.view(b, -1, heads, d // heads).transpose(1, 2) for t in (self.q(x), self.k(ctx), self.v(ctx)))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class SpatialTransformer(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.norm, self.proj_in, self.proj_out = nn.GroupNorm(32, c, eps=1e-6), nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)
        self.ln1, self.attn1 = nn.LayerNorm(c), Attention(c, c)
        self.ln2, self.attn2 = nn.LayerNorm(c), Attention(c, context_dim)
        self.ln3, self.geglu, self.ff_out = nn.LayerNorm(c), nn.Linear(c, 8 * c), nn.Linear(4 * c, c)

    def forward(self, x, context):
        b, c, h, w = x.shape
        t = self.proj_in(self.norm(x)).permute(0, 2, 3, 1).reshape(b, h * w, c)
        n1 = self.ln1(t)
        t = t + self.attn1(n1, n1)
        t = t + self.attn2(self.ln2(t), context)
        a, gate = self.geglu(self.ln3(t)).chunk(2, dim=-1)
        t = t + self.ff_out(a * F.gelu(gate))
        return x + self.proj_out(t.reshape(b, h, w, c).permute(0, 3, 1, 2))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.resnet, self.transformer = ResnetBlock(channels), SpatialTransformer(channels)

    def forward(self, x, temb, context):
        return self.transformer(self.resnet(x, temb), context)


def get_inputs():
    return [torch.randn(batch_size, channels, size, size), torch.randn(batch_size, time_dim),
            torch.randn(batch_size, context_len, context_dim)]


def get_init_inputs():
    return []
