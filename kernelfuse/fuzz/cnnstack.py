"""The fuzzer's small CNN body: 2-4 stages of a 2-d (or 3-d) convolution, each optionally followed by a batch norm,
a ReLU and a pool, so that each convolution reads a value computed from the one before (the planner's
channels-last graph, kernelfuse.plan.layout, variant `fused-cl`), then a classifier's tail or the map itself.
Apart from kernelfuse.fuzz.ops, which lists it in KINDS.

What it reaches in the channels-last graph: a ReLU that is its convolution's only reader (cuDNN's conv+bias+ReLU on
the channels-last operands), or one whose convolution is also read elsewhere (the mean of its output added to the
final map: the fused call must be refused); pools of channels-last sources (max or average, padding, ceil mode,
adaptive to 1 or 2), written channels-last; batch norms as modules (the model's mode) or eval-mode functional ones
over random running statistics (eps 1e-5 or 1e-3, as the norm kind draws); a flatten or `x.view(x.size(0), -1)` of
the channels-last map (a view that needs NCHW strides: a contiguous copy before it) then a linear layer, or a
global average pool then the same. A stage whose batch norm is followed by the second ReLU form adds a downsample
branch (1x1 convolution and batch norm of the stage's input) before its ReLU, as a ResNet block does.
Sizes are whatever the input has: a convolution whose window does not fit the map is 1x1, a pool's window is cut
to the map (rectangular over a 1-high map) or dropped, a stride that would leave one position of two or more is 1,
so a shrunk model re-renders; channels shrink to keep each value small.
"""

from __future__ import annotations

import math
import random

from kernelfuse.fuzz.kind import Invalid, Params, Shape

MAX_STAGES = 4
MAX_NUMEL = 6144  # per intermediate value, as the generator bounds each op's value
# after each convolution, in order: b batch norm (module, the model's mode), e eval-mode functional batch norm,
# r ReLU, p pool; "r" right after the convolution is its only reader unless the stage leaks
AFTER = ("", "r", "r", "rp", "rp", "br", "brp", "ep", "er", "b", "p", "rp")
POOLS = ("max", "max", "avg", "avg", "adaptive")
RELUS = ("torch.relu({x})", "F.relu({x})", "self.{m}_relu{i}({x})", "F.relu({x}, inplace=True)")
TAILS = ("flatten", "view", "gap", "gap_linear", "map", "flatten", "view")


def draw_cnn_stack(rng: random.Random, shapes: list[Shape]) -> Params:
    n = MAX_STAGES
    return {"stages": rng.randint(2, MAX_STAGES), "out": [rng.randint(1, 12) for _ in range(n)],
            "k": [rng.choice((1, 3, 3)) for _ in range(n)], "pad": [rng.choice((0, 1, 1)) for _ in range(n)],
            "stride": [rng.choice((1, 1, 2)) for _ in range(n)],
            "groups": [rng.choice((1, 1, 1, 1, 2, 3, 0)) for _ in range(n)],
            "bias": [rng.random() < 0.7 for _ in range(n)], "after": [rng.choice(AFTER) for _ in range(n)],
            "relu": [rng.randrange(len(RELUS)) for _ in range(n)],
            "pool": [rng.choice(POOLS) for _ in range(n)], "pk": [rng.choice((2, 3)) for _ in range(n)],
            "ps": [rng.choice((0, 0, 1, 2)) for _ in range(n)], "pp": [rng.choice((0, 0, 1)) for _ in range(n)],
            "ceil": [rng.random() < 0.3 for _ in range(n)], "cip": [rng.random() < 0.5 for _ in range(n)],
            "aout": [rng.choice((1, 2, 2)) for _ in range(n)], "eps": [rng.choice((1e-5, 1e-3)) for _ in range(n)],
            "leak": rng.random() < 0.25, "at": rng.randrange(MAX_STAGES),
            "tail": rng.choice(TAILS), "classes": rng.choice((1, 3, 8, 10))}


def render_cnn_stack(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    """Stage i: c_i = conv_i(x_i); x_(i+1) = its batch norm / ReLU / pool as drawn. A leak adds the mean of a
    ReLU'd convolution's output to the last map; the tail flattens (or views) it for a linear layer."""
    shape = shapes[0]
    if len(shape) not in (4, 5):
        raise Invalid("a CNN body needs an (N, C, H, W) or (N, C, D, H, W) input")
    d = len(shape) - 2
    if any(s < 1 for s in shape):
        raise Invalid("an empty dim")
    batch, cin, space = shape[0], shape[1], list(shape[2:])
    if batch * cin * math.prod(space) > MAX_NUMEL:
        raise Invalid("too large")
    inits: list[str] = []
    steps: list[str] = []
    leak_at = int(p["at"]) % int(p["stages"]) if p["leak"] else -1
    leak: tuple[str, int] | None = None  # the leaking convolution's value and channels
    x = "x0"
    for i in range(int(p["stages"])):
        x_in, cin_in, space_in = x, cin, space
        cin, space, x = _conv(p, i, d, batch, cin, space, x, inits, steps)
        after = str(_at(p, "after", i))
        leaks = after.startswith("r") and i == leak_at  # its output read elsewhere too: no fused conv+ReLU
        if leaks:
            leak = (x, cin)
        for j, op in enumerate(after):
            y = f"x{i}_{j}"
            if op == "r":
                relu = RELUS[int(_at(p, "relu", i)) % len(RELUS)]
                if leaks and "inplace" in relu:  # would change the value the leak reads
                    relu = RELUS[0]
                if relu.startswith("self."):
                    inits.append(f"self.{{m}}_relu{i} = nn.ReLU()")
                expr = relu.replace("{x}", x).replace("{i}", str(i))
            elif op == "b" and batch * math.prod(space) > 1:  # a training one needs two values per channel
                inits.append(f"self.{{m}}_bn{i} = nn.BatchNorm{d}d({cin}, eps={_at(p, 'eps', i)})")
                expr = f"self.{{m}}_bn{i}({x})"
                if j == 0 and after.startswith("br") and int(_at(p, "relu", i)) == 1:
                    expr = _shortcut(p, i, d, x_in, cin_in, space_in, cin, space, inits, expr)
            elif op in "be":
                inits += [f"self.register_buffer('{{m}}_mean{i}', torch.randn({cin}) * 0.5)",
                          f"self.register_buffer('{{m}}_var{i}', torch.rand({cin}) + 0.5)",
                          f"self.{{m}}_w{i} = nn.Parameter(torch.rand({cin}) + 0.5)",
                          f"self.{{m}}_b{i} = nn.Parameter(torch.randn({cin}) * 0.5)"]
                expr = (f"F.batch_norm({x}, self.{{m}}_mean{i}, self.{{m}}_var{i}, self.{{m}}_w{i}, self.{{m}}_b{i}, "
                        f"training=False, eps={_at(p, 'eps', i)})")
            else:
                pooled = _pool(p, i, d, space)
                if pooled is None:
                    continue
                expr, space = pooled[0].replace("{x}", x), pooled[1]
            steps.append(f"({y} := {expr})")
            x = y
    if leak is not None:  # a per-channel mean where the channels match the map's, else the mean of all
        conv, channels = leak
        mean = f"{conv}.mean({tuple(range(2, d + 2))}, keepdim=True)" if channels == cin else f"{conv}.mean()"
        steps.append(f"(xl := {x} + {mean})")
        x = "xl"
    steps.append(_tail(p, d, cin, space, x, inits))
    return inits, "(lambda x0: (" + ", ".join(steps) + ")[-1])({a0})"


def _shortcut(p: Params, i: int, d: int, x_in: str, cin_in: int, space_in: list[int], cout: int, space: list[int],
              inits: list[str], expr: str) -> str:
    """Stage i's batch norm plus a ResNet block's downsample branch (a 1x1 convolution of the stage's input, its own
    batch norm), where a 1x1 window at the stage's stride (or 1) gives the convolution's output sizes; else the
    norm alone. Two norms meeting in an add: kernelfuse.rewrite.norms splits both in training mode."""
    for stride in dict.fromkeys((int(_at(p, "stride", i)), 1)):
        if [(s - 1) // stride + 1 for s in space_in] == space:
            inits += [f"self.{{m}}_sc{i} = nn.Conv{d}d({cin_in}, {cout}, 1, stride={stride}, bias=False)",
                      f"self.{{m}}_sbn{i} = nn.BatchNorm{d}d({cout}, eps={_at(p, 'eps', i)})"]
            return f"({expr} + self.{{m}}_sbn{i}(self.{{m}}_sc{i}({x_in})))"
    return expr


def _at(p: Params, key: str, i: int) -> object:
    return p[key][i % MAX_STAGES]  # type: ignore[index]


def _conv(p: Params, i: int, d: int, batch: int, cin: int, space: list[int], x: str, inits: list[str],
          steps: list[str]) -> tuple[int, list[int], str]:
    """Stage i's convolution on `x` (cin channels over `space`): its channels, spatial sizes and value name."""
    k, pad, stride = int(_at(p, "k", i)), int(_at(p, "pad", i)), int(_at(p, "stride", i))
    if any(s + 2 * pad < k for s in space):  # the window does not fit: a 1x1 convolution
        k, pad = 1, 0
    if any((s + 2 * pad - k) // stride + 1 < 2 <= s for s in space):  # keep two positions where there were
        stride, pad = 1, k // 2
    kernel, pads = [k] * d, [pad] * d
    if d == 3 and space[0] == 1:  # one depth position: the window spans one (ATen's CPU bf16 Conv3d with a
        kernel[0], pads[0] = 1, 0  # channels-last weight of one channel a group reads uninitialised memory for a
        # taller one, torch 2.14.1; the channels-last graph's copy of the weight reaches it: fuzz seed 90001, 22)
    out_space = [(s + 2 * q - w) // stride + 1 for s, w, q in zip(space, kernel, pads, strict=True)]
    cout = int(_at(p, "out", i))
    cout = max(1, min(cout, MAX_NUMEL // (batch * math.prod(out_space))))
    g = int(_at(p, "groups", i)) or cin  # 0: depthwise
    if cin % g or cout < g:
        g = 1
    cout = max(cout // g, 1) * g
    inits.append(f"self.{{m}}_c{i} = nn.Conv{d}d({cin}, {cout}, {_size(kernel)}, stride={stride}, "
                 f"padding={_size(pads)}, groups={g}, bias={bool(_at(p, 'bias', i))})")
    name = f"c{i}"
    steps.append(f"({name} := self.{{m}}_c{i}({x}))")
    return cout, out_space, name


def _pool(p: Params, i: int, d: int, space: list[int]) -> tuple[str, list[int]] | None:
    """Stage i's pool over `space` as an expression of `{x}` and its output sizes; None where no window of more
    than one position fits. A window larger than a dim is cut to it (a rectangular window: (1, 3) over a 1-high
    map), as ATen's 3-d pools want the window inside the input without its padding."""
    fn = str(_at(p, "pool", i))
    if fn == "adaptive":
        a = int(_at(p, "aout", i))
        return f"F.adaptive_avg_pool{d}d({{x}}, {a})", [a] * d
    k = int(_at(p, "pk", i))
    window = [min(k, s) for s in space]
    stride = int(_at(p, "ps", i)) or k
    pads = [min(int(_at(p, "pp", i)), w // 2) for w in window]
    ceil = bool(_at(p, "ceil", i))
    if any(_pooled(s, w, stride, q, ceil) < 2 <= s for s, w, q in zip(space, window, pads, strict=True)):
        stride = 1  # keep two positions where there were: a stride of 1, a window one shorter than the dim
        window = [min(w, max(s - 1, 1)) for s, w in zip(space, window, strict=True)]
        pads = [min(q, w // 2) for q, w in zip(pads, window, strict=True)]
    if all(w == 1 for w in window):
        return None
    out = [_pooled(s, w, stride, q, ceil) for s, w, q in zip(space, window, pads, strict=True)]
    args = f"{_size(window)}, stride={stride}, padding={_size(pads)}, ceil_mode={ceil}"
    if fn == "max":
        return f"F.max_pool{d}d({{x}}, {args})", out
    return f"F.avg_pool{d}d({{x}}, {args}, count_include_pad={bool(_at(p, 'cip', i))})", out


def _size(sizes: list[int]) -> str:
    """One number where every dim has it, else the tuple."""
    return str(sizes[0]) if len(set(sizes)) == 1 else str(tuple(sizes))


def _pooled(size: int, k: int, stride: int, pad: int, ceil: bool) -> int:
    """A pool's output size as torch computes it (ceil mode: the last window must start inside the input or its
    left padding)."""
    span = size + 2 * pad - k
    out = (-(-span // stride) if ceil else span // stride) + 1
    if ceil and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _tail(p: Params, d: int, channels: int, space: list[int], x: str, inits: list[str]) -> str:
    """The last step: a classifier's flatten (or view) then a linear layer, a global average pool (then a linear
    layer), or the map itself."""
    tail, classes = str(p["tail"]), int(p["classes"])
    if tail == "map":
        return x
    features = channels * math.prod(space)
    if tail.startswith("gap"):
        x, features = f"F.adaptive_avg_pool{d}d({x}, 1)", channels
        flat = f"torch.flatten({x}, 1)"
        if tail == "gap":
            return flat
    elif tail == "view":
        flat = f"{x}.view({x}.size(0), -1)"
    else:
        flat = f"torch.flatten({x}, 1)"
    inits.append(f"self.{{m}}_fc = nn.Linear({features}, {classes})")
    return f"self.{{m}}_fc({flat})"
