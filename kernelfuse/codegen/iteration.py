"""The iteration space every generated kernel shares: merged dims, index decomposition, the prologue and epilogue
as device lambdas, and the launcher and wrapper plumbing (kernelfuse.codegen.generated, .reduce and .pool use it).

Every kernel iterates a compile-time `space`. Adjacent dims of the same class (kept or reduced) are merged first
wherever every tensor's strides chain, so index arithmetic is a few divisions by constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelfuse.capture import contiguous_strides
from kernelfuse.codegen.common import C_TYPES, INT32_LIMIT, clamped_term, offset_expr, program_lines, window_offset
from kernelfuse.plan.catselect import SELECT
from kernelfuse.plan.ir import GenStep, Operand

BLOCK = 256
# iterations of a thread's loop over a contiguous run issued together: one 4-byte load in flight per thread
# (2048 per SM, 8 KB) is too few to cover memory latency on an H100; the results are bitwise the same
UNROLL = 4
MAX_GRID = 1 << 20

# Device support shared by every generated reduction: combine functors and warp/block reductions.


@dataclass(frozen=True)
class Space:
    """The merged iteration space: sizes, a class per dim ("k" kept, "r" reduced) and every tensor's strides."""

    sizes: tuple[int, ...]
    classes: tuple[str, ...]
    strides: dict[str, tuple[int, ...]]

    def dims(self, cls: str) -> list[int]:
        return [d for d, c in enumerate(self.classes) if c == cls]

    def count(self, cls: str) -> int:
        n = 1
        for d in self.dims(cls):
            n *= self.sizes[d]
        return n


def merge_space(sizes: tuple[int, ...], classes: tuple[str, ...], strides: dict[str, tuple[int, ...]]) -> Space:
    """Drop size-1 dims, then merge neighbours of one class wherever every stride vector chains across them."""
    keep = [d for d, s in enumerate(sizes) if s != 1]
    out_sizes = [sizes[d] for d in keep]
    out_classes = [classes[d] for d in keep]
    out_strides = {k: [v[d] for d in keep] for k, v in strides.items()}
    d = len(out_sizes) - 2
    while d >= 0:
        inner = d + 1
        chains = all(v[d] == v[inner] * out_sizes[inner] for v in out_strides.values())
        if out_classes[d] == out_classes[inner] and chains:
            out_sizes[d] *= out_sizes[inner]
            for v in out_strides.values():
                v[d] = v[inner]
            del out_sizes[inner], out_classes[inner]
            for v in out_strides.values():
                del v[inner]
        d -= 1
    return Space(tuple(out_sizes), tuple(out_classes), {k: tuple(v) for k, v in out_strides.items()})


def tensor_args(step: GenStep) -> list[tuple[str, object]]:
    """(C name, graph Ref) of every tensor the kernel reads, in the wrapper's argument order."""
    args: list[tuple[str, object]] = [("src", step.source.ref)]
    args += [(f"in{i}", o.ref) for i, o in enumerate(step.prologue.operands)]
    spec = step.spec
    if spec is not None:
        if spec.weight is not None:  # type: ignore[attr-defined]
            args.append(("weight", spec.weight[0]))  # type: ignore[attr-defined]
        if spec.bias is not None:  # type: ignore[attr-defined]
            args.append(("bias", spec.bias[0]))  # type: ignore[attr-defined]
        if spec.running is not None:  # type: ignore[attr-defined]
            args += [("run_mean", spec.running[0]), ("run_var", spec.running[1])]  # type: ignore[attr-defined]
    args += [(f"ep{i}", o.ref) for i, o in enumerate(step.epilogue.operands)]
    if step.mapped is not None:
        args += [(f"m{i}", o.ref) for i, o in enumerate(step.mapped.operands)]
    return args


def index_type(step: GenStep) -> str:
    biggest = max([step.out_meta.numel, shape_numel(step.prologue.space)] +
                  [extent(o.meta.shape, o.meta.stride) for o in (step.source, *step.prologue.operands)])
    return "long long" if biggest + MAX_GRID * BLOCK > INT32_LIMIT else "int"


def shape_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    return 1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True) if d > 0)


def space_of(step: GenStep, epilogue: bool = False) -> Space:
    """The step's merged iteration space (a permuted output's in its memory order); `epilogue`: with the strides of
    the epilogue's operands too (as `ep{i}`), where the epilogue runs over the same space (a flat kernel's)."""
    spec = step.spec
    space = step.prologue.space
    reduced = set(spec.reduced) if spec is not None else set()  # type: ignore[attr-defined]
    classes = tuple("r" if d in reduced else "k" for d in range(len(space)))
    # a windowed read (inside a concatenation's branch) is addressed apart from the plain ones: a windowed source
    # is constant over the space as far as merging and packing can tell
    source = step.source.strides if step.source.window is None else (0,) * len(space)
    strides = {"src": source, "out": step.permuted_out or contiguous_strides(space)}
    strides.update({f"in{i}": o.strides for i, o in enumerate(step.prologue.operands) if o.window is None})
    strides.update(_window_strides(step))
    if step.mapped is not None:
        strides.update({f"m{i}": o.strides for i, o in enumerate(step.mapped.operands)})
    if epilogue and shape_numel(step.epilogue.space) == shape_numel(space):
        for i, o in enumerate(step.epilogue.operands):
            viewed = _viewed(o.strides, tuple(step.epilogue.space), tuple(space))
            if viewed is not None:
                strides[f"ep{i}"] = viewed
    if spec is not None:
        for name in ("weight", "bias"):
            if getattr(spec, name) is not None:
                strides[name] = getattr(spec, name)[1]
        if spec.running is not None and spec.kind == "affine_norm":  # type: ignore[attr-defined]
            strides["run_mean"] = strides["run_var"] = spec.weight[1] if spec.weight else _channel_strides(space)  # type: ignore[attr-defined]
    order = memory_order(step)
    if order is not None:
        space = tuple(space[d] for d in order)
        classes = tuple(classes[d] for d in order)
        strides = {name: tuple(v[d] for d in order) for name, v in strides.items()}
    return merge_space(space, classes, strides)


def windows_in_space(step: GenStep) -> bool:
    """Are the step's windowed reads and selects over its own space (the concatenation's shape is the kernel's)?
    They are then addressed through the space like any tensor, in whatever order it is iterated (a permuted
    output's memory order too): the index along a concatenated dim d is the offset of a pseudo-tensor `xc{d}`
    (stride 1 along d, 0 elsewhere), a windowed tensor's offset that of `xw_{name}` (its strides less the one
    along d) plus the clamped index times that stride. Otherwise (a reshape after the concatenation) they are
    addressed from the flat index, which is then row-major (the planner keeps such an output contiguous)."""
    space = tuple(step.prologue.space)
    windows = [o.window for o in (step.source, *step.prologue.operands) if o.window is not None]
    shapes = [tuple(st.params[2]) for st in step.prologue.statements if st.op == SELECT]  # type: ignore[arg-type]
    return bool(windows or shapes) and all(w.shape == space for w in windows) and all(s == space for s in shapes)


def windowed_reads(step: GenStep) -> dict[str, Operand]:
    """The step's windowed tensors by kernel name (`src`, `in{i}`)."""
    named = [("src", step.source), *((f"in{i}", o) for i, o in enumerate(step.prologue.operands))]
    return {name: o for name, o in named if o.window is not None}


def cat_dims(step: GenStep) -> list[int]:
    """The concatenated dims the step's windows and selects run along."""
    dims = {o.window.dim for o in windowed_reads(step).values()}  # type: ignore[union-attr]
    dims |= {int(st.params[0]) for st in step.prologue.statements if st.op == SELECT}  # type: ignore[arg-type]
    return sorted(dims)


def _window_strides(step: GenStep) -> dict[str, tuple[int, ...]]:
    """The pseudo-tensors of windows_in_space, by name (none where the windows are addressed by flat index)."""
    if not windows_in_space(step):
        return {}
    rank = len(step.prologue.space)
    out = {f"xc{d}": tuple(int(e == d) for e in range(rank)) for d in cat_dims(step)}
    for name, o in windowed_reads(step).items():
        out[f"xw_{name}"] = tuple(0 if e == o.window.dim else s for e, s in enumerate(o.strides))  # type: ignore[union-attr]
    return out


def _windowed_offset(name: str, operand: Operand, prefix: str) -> str:
    """A windowed read's offset through the space (windows_in_space), from decompose's `{prefix}` offsets."""
    window = operand.window
    along = operand.strides[window.dim]  # type: ignore[union-attr]
    if along == 0:
        return f"{prefix}xw_{name}"
    return f"{prefix}xw_{name} + {clamped_term(window, along, f'{prefix}xc{window.dim}')}"  # type: ignore[arg-type, union-attr]


def _viewed(strides: tuple[int, ...], shape: tuple[int, ...], space: tuple[int, ...]) -> tuple[int, ...] | None:
    """The strides of a tensor over `shape` viewed as `space` (same numel), or None where no such view exists."""
    if shape == space:
        return strides
    try:
        return tuple(torch.empty_strided(shape, strides, device="meta").view(space).stride())
    except RuntimeError:
        return None


def memory_order(step: GenStep) -> tuple[int, ...] | None:
    """A flat kernel's permuted output (channels-last) is iterated in its memory order, so that the space's index
    is the output's offset: its dims, outermost first (None: the output is contiguous, iterated as it is)."""
    strides = step.permuted_out
    if strides is None:
        return None
    return tuple(sorted(range(len(strides)), key=lambda d: -strides[d]))


def _channel_strides(space: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if d == 1 else 0 for d in range(len(space)))  # batch norm's [N, C, HW]: per channel


def pack_kinds(space: Space, vec: int, dim: int = -1) -> dict[str, str]:
    """How each tensor of the space is read by an access to `vec` consecutive elements along `dim` (a pack),
    by name: "run" where the pack's elements are consecutive in memory (stride 1 along `dim`, every other stride a
    multiple of `vec`: aligned as the pack), "same" where the tensor is constant along `dim` (loaded once a pack).
    The dim's size must be a multiple of `vec`, so that a pack starting at a multiple of `vec` never straddles two
    of its runs (none where `vec` is 1). The flat kernels' VEC-wide accesses and the on-chip row kernels' groups of
    four (kernelfuse.codegen.onchip) share this rule."""
    if vec == 1 or not space.sizes or space.sizes[dim] % vec:
        return {}
    d = dim % len(space.sizes)
    kinds = {}
    for name, strides in space.strides.items():
        if strides[d] == 0:
            kinds[name] = "same"
        elif strides[d] == 1 and all(s % vec == 0 for e, s in enumerate(strides) if e != d):
            kinds[name] = "run"
    return kinds


def decompose(space: Space, cls: str, var: str, prefix: str, names: list[str], ind: str) -> list[str]:
    """Lines that split `var` into the indices of the `cls` dims and sum each tensor's offset `{prefix}{name}`."""
    dims = space.dims(cls)
    lines = []
    if len(dims) > 1:
        lines.append(f"{ind}INDEX t_{prefix} = {var};")
    idx = {}
    for pos, d in enumerate(reversed(dims)):
        outermost = pos == len(dims) - 1
        if len(dims) == 1:
            idx[d] = var
        elif outermost:
            idx[d] = f"t_{prefix}"
        else:
            lines.append(f"{ind}const INDEX {prefix}{d} = t_{prefix} % {space.sizes[d]}; t_{prefix} /= {space.sizes[d]};")
            idx[d] = f"{prefix}{d}"
    for name in names:
        terms = [f"{idx[d]} * {space.strides[name][d]}" if space.strides[name][d] != 1 else idx[d]
                 for d in dims if space.strides[name][d] != 0]
        lines.append(f"{ind}const INDEX {prefix}{name} = {' + '.join(terms) if terms else '0'};")
    return lines


def epilogue_lines(step: GenStep, index: str, ind: str, given: dict[str, str] | None = None) -> list[str]:
    """The epilogue at output flat index `index` (operands indexed through the output's shape, or the float
    expressions `given` by name `in{i}`)."""
    shape = tuple(step.epilogue.space)  # the reduction's value; a reshape after it keeps the flat index
    strides = [o.strides for o in step.epilogue.operands]
    order = memory_order(step)  # or a permuted output's memory order, as space_of iterates it
    if order is not None:
        if len(order) != len(shape):  # a norm over (N, C, H * W) of an (N, C, H, W) output: the kernel's space
            space = tuple(step.prologue.space)
            strides = [_viewed(s, shape, space) for s in strides]  # type: ignore[misc]
            if len(order) != len(space) or any(s is None for s in strides):
                raise ValueError(f"{step.kernel}: a permuted output over a regrouped epilogue space")
            shape = space
        shape = tuple(shape[d] for d in order)
        strides = [tuple(s[d] for d in order) for s in strides]
    offsets = {f"in{i}": offset_expr(s, shape, f"({index})") for i, s in enumerate(strides)}
    return program_lines(step.epilogue, "y", offsets, "e_", ind, C_TYPES.get(value_dtype(step), "float"), given)


AFFINE_TENSORS = ("weight", "bias", "run_mean", "run_var")


def tensor_dtype(step: GenStep, name: str) -> torch.dtype:
    """The dtype the kernel reads tensor `name` of tensor_args as: an operand's own (a bool mask read as 1.0f or
    0.0f; another float dtype in a pointwise kernel that mixes them), the source's own, an affine parameter's
    own where the spec says (param_dtype), else the kernel's (value_dtype). The binding checks
    each tensor against it."""
    programs = {"in": step.prologue, "ep": step.epilogue, "m": step.mapped}
    for prefix, program in programs.items():
        if program is not None and name.startswith(prefix) and name[len(prefix):].isdigit():
            return program.operands[int(name[len(prefix):])].meta.dtype
    if name == "src":
        return step.source.meta.dtype
    if name in AFFINE_TENSORS and getattr(step.spec, "param_dtype", None) is not None:
        return step.spec.param_dtype  # type: ignore[union-attr]
    return value_dtype(step)


def operand_ctype(step: GenStep, name: str) -> str:
    """The C type of tensor `name` of tensor_args (tensor_dtype's)."""
    dtype = tensor_dtype(step, name)
    return "bool" if dtype == torch.bool else C_TYPES[dtype]


def value_dtype(step: GenStep) -> torch.dtype:
    """The dtype a kernel computes in: a reduction's source's, or the one its prologue widens that to (reads_as);
    it may write another (argmax/argmin an int64 index, a norm whose epilogue ends in autocast's cast to bf16).
    A pointwise kernel's output's."""
    if step.reads_as is not None:
        return step.reads_as
    if step.spec is not None or step.out_meta.dtype == torch.int64:
        return step.source.meta.dtype
    return step.out_meta.dtype


def out_ctype(step: GenStep) -> str:
    """The C type of the kernel's output: a 64-bit integer for an index result, else its dtype's (the type it
    computes in, value_dtype's, unless its epilogue ends in a cast)."""
    return "long long" if step.out_meta.dtype == torch.int64 else C_TYPES[step.out_meta.dtype]


def pointer_params(step: GenStep, ctype: str) -> str:
    params = [f"const {operand_ctype(step, 'src')}* __restrict__ src"]
    params += [f"const {operand_ctype(step, f'in{i}')}* __restrict__ p_in{i}_p"
               for i in range(len(step.prologue.operands))]
    spec = step.spec
    if spec is not None:
        if spec.weight is not None:  # type: ignore[attr-defined]
            params.append(f"const {operand_ctype(step, 'weight')}* __restrict__ weight")
        if spec.bias is not None:  # type: ignore[attr-defined]
            params.append(f"const {operand_ctype(step, 'bias')}* __restrict__ bias")
        if spec.running is not None:  # type: ignore[attr-defined]
            params += [f"{operand_ctype(step, n)}* __restrict__ {n}" for n in ("run_mean", "run_var")]
    params += [f"const {operand_ctype(step, f'ep{i}')}* __restrict__ e_in{i}_p"
               for i in range(len(step.epilogue.operands))]
    if step.mapped is not None:
        params += [f"const {operand_ctype(step, f'm{i}')}* __restrict__ m_in{i}_p"
                   for i in range(len(step.mapped.operands))]
    params.append(f"{out_ctype(step)}* __restrict__ out")
    return ", ".join(params)


def value_lambda(step: GenStep, space: Space, cls: str, row_prefix: str | None,
                 given: tuple[str, ...] = ()) -> list[str]:
    """`value_at(r, acc)`: the prologue at element r (of the row, or flat) given the source value `acc`;
    `source(r)`: the source element loaded through its strides; `value(r)`: the two together. Operands named in
    `given` (`in{i}`) are value_at's parameters `x_in{i}` after acc, loaded by the caller (and there is no
    `value`)."""
    base = (lambda n: f"{row_prefix}{n} + o_{n}") if row_prefix else (lambda n: f"o_{n}")
    lines = value_at_lambda(step, space, cls, row_prefix, given)
    lines += ["    auto source = [&](INDEX r) -> float {"]
    if step.source.window is not None and windows_in_space(step):  # the source read inside a branch
        lines += decompose(space, cls, "r", "o_", ["xw_src", f"xc{step.source.window.dim}"], "      ")
        lines += [f"      return kf_load(src[{_windowed_offset('src', step.source, 'o_')}]);", "    };"]
    elif step.source.window is not None:
        lines += [f"      return kf_load(src[{window_offset(step.source, 'r')}]);", "    };"]
    else:
        lines += decompose(space, cls, "r", "o_", ["src"], "      ")
        lines += [f"      return kf_load(src[{base('src')}]);", "    };"]
    if not given:
        lines.append("    auto value = [&](INDEX r) -> float { return value_at(r, source(r)); };")
    return lines


def value_at_lambda(step: GenStep, space: Space, cls: str, row_prefix: str | None, given: tuple[str, ...] = (),
                    name: str = "value_at") -> list[str]:
    """The prologue as the lambda `name(r, acc, x_in{i}...)`: value_lambda's `value_at`, or another with other
    operands `given` (an on-chip pass's group loads those once for its four elements: kernelfuse.codegen.onchip)."""
    windowed = {f"in{i}": o for i, o in enumerate(step.prologue.operands) if o.window is not None}
    operands = [f"in{i}" for i in range(len(step.prologue.operands)) if f"in{i}" not in given and f"in{i}" not in windowed]
    base = (lambda n: f"{row_prefix}{n} + o_{n}") if row_prefix else (lambda n: f"o_{n}")
    params = "".join(f", float x_{n}" for n in given)
    lines = [f"    auto {name} = [&](INDEX r, float acc{params}) -> float {{"]
    in_space = windows_in_space(step)
    pseudo = [*(f"xc{d}" for d in cat_dims(step)), *(f"xw_{n}" for n in windowed)] if in_space else []
    lines += decompose(space, cls, "r", "o_", operands + pseudo, "      ") if operands or pseudo else []
    offsets = {n: base(n) for n in operands}
    offsets |= {n: _windowed_offset(n, o, "o_") if in_space else window_offset(o, "r") for n, o in windowed.items()}
    index: str | dict[int, str] | None = {d: f"o_xc{d}" for d in cat_dims(step)} if in_space else "r"
    lines += program_lines(step.prologue, "acc", offsets, "p_", "      ", C_TYPES.get(step.source.meta.dtype, "float"),
                           {n: f"x_{n}" for n in given}, index=index if row_prefix is None else None)
    return lines + ["      return p_result;", "    };"]


def launch_params(step: GenStep, ctype: str) -> tuple[str, str]:
    """The launcher's pointer parameters and the casts that pass them to the kernel."""
    const = {name: "" if name in ("run_mean", "run_var") else "const " for name, _ in tensor_args(step)}
    params = ", ".join(f"{const[name]}void* {name}" for name in const)
    args = ", ".join(f"({const[name]}{operand_ctype(step, name)}*){name}" for name in const)
    return params, args


def launcher(step: GenStep, ctype: str, grid: str) -> str:
    k = step.kernel
    params, args = launch_params(step, ctype)
    return f"""
KF_EXPORT cudaError_t {k}_launch({params}, void* out, cudaStream_t stream) {{
  {k}_kernel<<<{grid}, {BLOCK}, 0, stream>>>({args}, ({out_ctype(step)}*)out);
  return cudaGetLastError();
}}
"""
