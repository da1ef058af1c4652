"""The fuzzer's layer kinds: norms, linear layers and matrix products, attention, convolution and pooling. Apart
from kernelfuse.fuzz.ops (the pointwise, reduction, view and cat kinds, and the table KINDS of all of them) so
each module stays one family of ops.
"""

from __future__ import annotations

import math
import random

from kernelfuse.fuzz.kind import Invalid, Params, Shape


def draw_norm(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"fn": rng.choice(("layer", "layer", "group", "batch", "batch", "instance", "rms", "functional_bn")),
            "k": rng.randint(1, 3), "g": rng.randrange(8), "affine": rng.random() < 0.7,
            "eps": rng.choice((1e-5, 1e-3))}


def render_norm(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    shape = shapes[0]
    rank = len(shape)
    affine, eps = bool(p["affine"]), p["eps"]
    if p["fn"] in ("layer", "rms"):
        k = min(int(p["k"]), rank)
        if k == 0:
            raise Invalid("0-d")
        cls = "nn.LayerNorm" if p["fn"] == "layer" else "nn.RMSNorm"
        return [f"self.{{m}} = {cls}({list(shape[-k:])}, eps={eps}, elementwise_affine={affine})"], "self.{m}({a0})"
    if rank < 2:
        raise Invalid("needs N, C")
    c = shape[1]
    if p["fn"] == "group":
        divisors = [d for d in range(1, c + 1) if c % d == 0]
        g = divisors[int(p["g"]) % len(divisors)]
        init = [f"self.{{m}} = nn.GroupNorm({g}, {c}, eps={eps}, affine={affine})"]
        if int(p["k"]) == 3:  # read by a reduction over the channels (level-2 92's form), broadcast back
            return init, "({a0} + torch.logsumexp(torch.tanh(self.{m}({a0})), dim=1, keepdim=True))"
        return init, "self.{m}({a0})"
    if p["fn"] == "functional_bn":
        if rank > 5:
            raise Invalid("rank")
        return ([f"self.register_buffer('{{m}}_mean', torch.randn({c}))",
                 f"self.register_buffer('{{m}}_var', torch.rand({c}) + 0.5)",
                 f"self.{{m}}_w = nn.Parameter(torch.randn({c}))"],
                f"F.batch_norm({{a0}}, self.{{m}}_mean, self.{{m}}_var, self.{{m}}_w, None, training=False, eps={eps})")
    if p["fn"] == "batch":
        if rank > 5:
            raise Invalid("rank")
        d = {2: 1, 3: 1, 4: 2, 5: 3}[rank]
        init = [f"self.{{m}} = nn.BatchNorm{d}d({c}, eps={eps}, affine={affine})"]
        if int(p["k"]) == 3:  # two norms meeting in a residual add (a ResNet block's downsample branch)
            return [*init, f"self.{{m}}_skip = nn.BatchNorm{d}d({c}, eps={eps}, affine={affine})"], \
                "torch.relu(self.{m}({a0}) + self.{m}_skip({a0} * 0.5 + 1.0))"
        return init, "self.{m}({a0})"
    if rank < 3:
        raise Invalid("instance norm needs a spatial dim")
    return [f"self.{{m}} = nn.InstanceNorm{rank - 2}d({c}, eps={eps}, affine={affine})"], "self.{m}({a0})"


def draw_linear(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"fn": rng.choice(("linear", "linear", "matmul", "bmm", "gated")), "n": rng.choice((1, 3, 8, 16, 17, 32)),
            "bias": rng.random() < 0.7}


def render_linear(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    shape = shapes[0]
    if not shape:
        raise Invalid("0-d")
    k, n, bias = shape[-1], int(p["n"]), bool(p["bias"])
    if p["fn"] == "linear":
        return [f"self.{{m}} = nn.Linear({k}, {n}, bias={bias})"], "self.{m}({a0})"
    if p["fn"] == "gated":  # the gated MLP: one value read by two anchors, their outputs multiplied
        return ([f"self.{{m}}_gate = nn.Linear({k}, {n}, bias={bias})",
                 f"self.{{m}}_up = nn.Linear({k}, {n}, bias=False)",
                 f"self.{{m}}_down = nn.Linear({n}, {k}, bias={bias})"],
                "self.{m}_down(F.silu(self.{m}_gate({a0})) * self.{m}_up({a0}))")
    if p["fn"] == "matmul":
        return [f"self.{{m}} = nn.Parameter(torch.randn({k}, {n}) * 0.2)"], "torch.matmul({a0}, self.{m})"
    if len(shape) != 3:
        raise Invalid("bmm needs rank 3")
    return [f"self.{{m}} = nn.Parameter(torch.randn({shape[0]}, {k}, {n}) * 0.2)"], "torch.bmm({a0}, self.{m})"


def render_matmul_pair(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    a, b = shapes
    if len(a) < 2 or a != b:
        raise Invalid("a value times another's transpose needs equal shapes")
    if a[-2] * a[-2] * math.prod(a[:-2]) > 8192:
        raise Invalid("too large")
    return [], "torch.matmul({a0}, {a1}.transpose(-2, -1))" if p["fn"] else "{a0} @ {a1}.transpose(-1, -2)"


ATTENTION_FORMS = ("sdpa", "sdpa_causal", "hand", "hand_bias", "autocast_bias", "windows")


def draw_attention(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"form": rng.choice(ATTENTION_FORMS), "heads": rng.choice((1, 2, 4)), "windows": rng.choice((1, 2, 3))}


def render_attention(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    """Self-attention over the last two dims (rows, channels split into heads; q, k and v the same heads): SDPA
    (plain or causal) or its hand-written form (minGPT's; with a per-head additive bias; autocast's fp32 softmax
    and cast back; Swin's shifted windows: the batch as images x windows, a window mask added in a 5-d view).
    Causal SDPA with `windows` 2 over a batch and an even number of heads takes keys and values from the first
    half of the heads, each repeated for two query heads as transformers' repeat_kv copies them; with `windows` 2
    the hand-written forms soft-cap the scores as Gemma 2 does (`tanh(x / 2) * 2`), and over a batch with an even
    number of heads read keys and values repeated the same way, as transformers' eager attention does (no new
    draw: earlier seeds' other models stay as they were)."""
    shape = shapes[0]
    if len(shape) not in (2, 3):
        raise Invalid("attention over rank 2 or 3")
    s, c, h, form = shape[-2], shape[-1], int(p["heads"]), str(p["form"])
    if c % h or s > 64 or c // h > 128:
        raise Invalid("heads do not divide the channels, or too long")
    # bounded and finite: torch's CPU SDPA zeroes some rows that read a NaN (CUDA's backends and the kernels give
    # NaN), so a NaN would test the CPU backend's quirk rather than the kernels
    heads = f"torch.tanh(torch.nan_to_num({{a0}})).unflatten(-1, ({h}, {c // h})).transpose(-3, -2)"
    back = ".transpose(-3, -2).flatten(-2))(" + heads + ")"
    scores = f"(t @ t.transpose(-2, -1)) * {1.0 / math.sqrt(c // h)!r}"
    lines: list[str] = []
    if form in ("hand_bias", "autocast_bias", "windows"):
        lines.append(f"self.{{m}}_bias = nn.Parameter(torch.randn({h}, {s}, {s}) * 0.5)")
    if form == "sdpa_causal" and int(p["windows"]) == 2 and len(shape) == 3 and h % 2 == 0:
        kv = f"t[:, :{h // 2}, None].expand(-1, {h // 2}, 2, -1, -1).reshape(t.shape)"
        body = f"F.scaled_dot_product_attention(t, {kv}, {kv}, is_causal=True)"
    elif form.startswith("sdpa"):
        body = f"F.scaled_dot_product_attention(t, t, t, is_causal={form == 'sdpa_causal'})"
    elif form in ("hand", "hand_bias") and int(p["windows"]) == 2:
        kv = f"t[:, :{h // 2}, None].expand(-1, {h // 2}, 2, -1, -1).reshape(t.shape)" \
            if len(shape) == 3 and h % 2 == 0 else "t"
        capped = f"torch.tanh(((t @ {kv}.transpose(-2, -1)) * {1.0 / math.sqrt(c // h)!r}) / 2.0) * 2.0"
        bias = " + self.{m}_bias" if form == "hand_bias" else ""
        body = f"torch.softmax({capped}{bias}, -1) @ {kv}"
    elif form == "hand":
        body = f"torch.softmax({scores}, -1) @ t"
    elif form == "hand_bias":
        body = f"torch.softmax({scores} + self.{{m}}_bias, -1) @ t"
    elif form == "autocast_bias":
        body = f"torch.softmax(({scores}).float() + self.{{m}}_bias.float(), -1).to(t.dtype) @ t"
    else:
        w = int(p["windows"])
        if len(shape) != 3 or shape[0] % w:
            raise Invalid("windows need a batch of images x windows")
        lines.append(f"self.{{m}}_win = nn.Parameter(torch.where(torch.rand({w}, {s}, {s}) > 0.3, 0.0, -100.0))")
        body = (f"torch.softmax((({scores} + self.{{m}}_bias).view(-1, {w}, {h}, {s}, {s}) + "
                f"self.{{m}}_win.unsqueeze(1).unsqueeze(0)).view(-1, {h}, {s}, {s}), -1) @ t")
    return lines, "(lambda t: (" + body + ")" + back


def draw_conv(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"out": rng.choice((1, 2, 3, 4, 6, 8)), "k": rng.choice((1, 2, 3, 3)), "stride": rng.choice((1, 1, 2, 3)),
            "pad": rng.choice((0, 0, 1, 2)), "dil": rng.choice((1, 1, 1, 2)), "groups": rng.choice((1, 1, 2, 3, 0)),
            "bias": rng.random() < 0.7, "transposed": rng.random() < 0.25, "opad": rng.randrange(2)}


def render_conv(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    shape = shapes[0]
    if len(shape) not in (3, 4, 5):
        raise Invalid("conv needs rank 3-5")
    d, cin = len(shape) - 2, shape[1]
    k, stride, dil, pad = int(p["k"]), int(p["stride"]), int(p["dil"]), int(p["pad"])
    cout = int(p["out"])
    g = int(p["groups"]) or cin  # 0: depthwise
    if cin % g:
        g = 1
    cout = max(cout // g, 1) * g
    if any(s + 2 * pad < dil * (k - 1) + 1 for s in shape[2:]):
        raise Invalid("input smaller than the kernel")
    if p["transposed"]:
        opad = int(p["opad"]) if int(p["opad"]) < max(stride, dil) else 0
        return ([f"self.{{m}} = nn.ConvTranspose{d}d({cin}, {cout}, {k}, stride={stride}, padding={pad}, "
                 f"output_padding={opad}, groups={g}, bias={bool(p['bias'])}, dilation={dil})"], "self.{m}({a0})")
    return ([f"self.{{m}} = nn.Conv{d}d({cin}, {cout}, {k}, stride={stride}, padding={pad}, dilation={dil}, "
             f"groups={g}, bias={bool(p['bias'])})"], "self.{m}({a0})")


def draw_pool(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"fn": rng.choice(("max", "avg", "avg", "max", "adaptive")), "k": rng.choice((1, 2, 3)),
            "stride": rng.choice((0, 1, 2)), "pad": rng.choice((0, 0, 1)), "ceil": rng.random() < 0.3,
            "cip": rng.random() < 0.5, "dil": rng.choice((1, 1, 2))}


def render_pool(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    shape = shapes[0]
    if len(shape) not in (3, 4, 5):
        raise Invalid("pooling needs rank 3-5")
    d = len(shape) - 2
    if p["fn"] == "adaptive":
        return [], f"F.adaptive_avg_pool{d}d({{a0}}, 1)"
    k, pad = int(p["k"]), min(int(p["pad"]), int(p["k"]) // 2)
    stride = int(p["stride"]) or k
    if p["fn"] == "max":
        dil = int(p["dil"])
        if any(s + 2 * pad < dil * (k - 1) + 1 for s in shape[2:]):
            raise Invalid("input smaller than the window")
        return [], (f"F.max_pool{d}d({{a0}}, {k}, stride={stride}, padding={pad}, dilation={dil}, "
                    f"ceil_mode={bool(p['ceil'])})")
    if any(s + 2 * pad < k for s in shape[2:]):
        raise Invalid("input smaller than the window")
    cip = f", count_include_pad={bool(p['cip'])}"
    return [], f"F.avg_pool{d}d({{a0}}, {k}, stride={stride}, padding={pad}, ceil_mode={bool(p['ceil'])}{cip})"
