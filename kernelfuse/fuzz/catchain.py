"""The fuzzer's growing concatenation: a DenseNet block's feature list (`f = [x]; f.append(g(torch.cat(f, d)))`)
or its nested form (`z = torch.cat([z, g(z)], d)` repeated), whose concatenations extend one another
(kernelfuse.plan.catbuffer shares one buffer among them). Apart from kernelfuse.fuzz.ops, which lists it in KINDS.

Each new piece is computed from the concatenation so far (the first from the input) by a cheap op keeping the
other dims: a reduction over the concatenated dim (keepdim) then a pointwise op, a narrow then a pointwise op, or
a 1x1 convolution where the dim is the channels. A narrow reads its concatenation through a view, as does,
sometimes, a scalar added to the value (a view, a reshape, a transpose; or a matrix product reads it): the
planner must then leave that concatenation out of the shared buffer. Returning one is not drawn: an op has one
value, and the last concatenation must feed it.
"""

from __future__ import annotations

import random

from kernelfuse.fuzz.kind import Invalid, Params, Shape

PIECES = (  # {c}: the concatenation so far, {d}: the dim, {s} {n}: a narrow's start and length
    "torch.tanh({c}.mean({d}, keepdim=True))",
    "torch.sigmoid({c}.amax({d}, keepdim=True)) * 2.0",
    "F.relu({c}.sum({d}, keepdim=True) * 0.5)",
    "{c}.narrow({d}, {s}, {n}) * 0.5",
    "F.silu({c}.narrow({d}, {s}, {n}))",
    "conv",  # a 1x1 convolution then relu; a reduction where the dim is not the channels of a 3-5-d tensor
)
LEAKS = ("", "", "", "", "", "", "view", "reshape", "transpose", "matmul")
MAX_STEPS = 4


def draw_cat_chain(rng: random.Random, shapes: list[Shape]) -> Params:
    return {"k": rng.randint(2, MAX_STEPS), "d": rng.randrange(6), "neg": rng.random() < 0.5,
            "nested": rng.random() < 0.5, "pieces": [rng.randrange(len(PIECES)) for _ in range(MAX_STEPS)],
            "grow": [rng.choice((1, 2, 3)) for _ in range(MAX_STEPS)], "tail": rng.random() < 0.5,
            "leak": rng.choice(LEAKS), "at": rng.randrange(MAX_STEPS)}


def render_cat_chain(p: Params, shapes: list[Shape]) -> tuple[list[str], str]:
    """k concatenations c1..ck along one dim, ci = cat(input, piece 0, ..., piece i-1), piece i read from ci (c0:
    the input); the value is ck (plus a scalar read from c_j through a view or a matrix product, if drawn)."""
    shape = shapes[0]
    rank = len(shape)
    if rank < 2:
        raise Invalid("a chain along a dim of a rank >= 2 tensor")
    k, pos = int(p["k"]), int(p["d"]) % rank
    dim = pos - rank if p["neg"] else pos
    inits: list[str] = []
    pieces: list[str] = []
    sizes = [shape[pos]]  # along the dim: the input's, then each concatenation's
    for i in range(k):
        fn = PIECES[int(p["pieces"][i]) % len(PIECES)]  # type: ignore[index]
        grow, size = int(p["grow"][i]), sizes[-1]  # type: ignore[index]
        n = min(grow, size) if "narrow" in fn else 1
        if fn == "conv" and rank in (3, 4, 5) and pos == 1:
            inits.append(f"self.{{m}}_{i} = nn.Conv{rank - 2}d({size}, {grow}, 1)")
            fn, n = f"torch.relu(self.{{m}}_{i}({{c}}))", grow
        elif fn == "conv":
            fn = PIECES[0]
        pieces.append(fn.replace("{d}", str(dim)).replace("{s}", str(size - n if p["tail"] else 0))
                      .replace("{n}", str(n)))
        sizes.append(size + n)

    def cat(i: int, operands: str) -> str:
        return f"(c{i} := torch.cat({operands}, dim={dim}))"

    if p["nested"]:  # c(i+1) := cat([ci, piece_i(ci)]), each nested in the next
        body = "c0"
        for i, piece in enumerate(pieces):
            body = cat(i + 1, f"[{body}, {piece.replace('{c}', f'c{i}')}]")
        head, arg = "lambda c0: " + body, "{a0}"
    else:  # the feature list: f.append(piece_i(ci)), ci := cat(f), the first piece from the input itself
        steps = [f"f.append({piece.replace('{c}', cat(i, 'f') if i else 'f[0]')})" for i, piece in enumerate(pieces)]
        head, arg = "lambda f: (" + ", ".join(steps) + f", {cat(k, 'f')})[-1]", "[{a0}]"
    return inits, f"({head}{_leak(p, inits, shape, sizes, pos)})({arg})"


def _leak(p: Params, inits: list[str], shape: Shape, sizes: list[int], pos: int) -> str:
    """A scalar read from an intermediate concatenation c_j through a view or a matrix product ('' if none)."""
    j = int(p["at"]) % (len(sizes) - 2) + 1
    cj = [sizes[j] if d == pos else s for d, s in enumerate(shape)]  # c_j's shape
    if p["leak"] == "view":
        return f" + c{j}.view(-1).mean()"
    if p["leak"] == "reshape":
        return f" + c{j}.reshape({cj[0]}, -1).amax(-1).sum()"
    if p["leak"] == "transpose":
        return f" + c{j}.transpose(0, -1).cumsum(0).mean()"
    if p["leak"] == "matmul":
        inits.append(f"self.{{m}}_w = nn.Parameter(torch.randn({cj[-1]}, 1) * 0.1)")
        return f" + (c{j} @ self.{{m}}_w).mean()"
    return ""
