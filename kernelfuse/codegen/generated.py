"""CUDA for generated kernels (plan GenSteps): pointwise, row reductions, and reduce-then-broadcast (softmax, norms).

Every kernel iterates a compile-time `space`. Adjacent dims of the same class (kept or reduced) are merged first
wherever every tensor's strides chain, so index arithmetic is a few divisions by constants. Two row strategies:

- `inner` (the innermost dim is reduced): a warp (short rows) or a whole block (long rows) per row; threads stride
  along the row, so loads are coalesced; partial results combine through warp shuffles and shared memory;
- `strided` (the innermost dim is kept, or rows are very short): one thread per row; neighbouring threads own
  neighbouring rows, so loads are coalesced across the warp.

Kinds (kernelfuse.ops.reductions): one pass for sum/mean/prod/amax/amin; logsumexp and softmax take the row max
first (ATen's order: max, then sum of exp(x - max)); norms take the mean, then the biased variance around it
(two passes, more accurate than one-pass sums). Passes re-read the row and recompute the prologue instead of
storing it. Numerics follow ATen: float accumulation, NaN-propagating max/min, logsumexp's infinite max replaced by
0, softmax as exp(x - max) / sum, batch norm's running statistics with the unbiased variance.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernelfuse.capture import contiguous_strides
from kernelfuse.codegen.common import AT_TYPES, C_TYPES, INT32_LIMIT, ints, offset_expr, program_lines
from kernelfuse.ops import float_literal
from kernelfuse.plan.ir import GenStep, Plan

BLOCK = 256
MAX_GRID = 1 << 20

# Device support shared by every generated reduction: combine functors and warp/block reductions.
REDUCE_PRELUDE = r"""
struct kf_sum_op { __device__ __forceinline__ float operator()(float a, float b) const { return a + b; } };
struct kf_prod_op { __device__ __forceinline__ float operator()(float a, float b) const { return a * b; } };
struct kf_max_op { __device__ __forceinline__ float operator()(float a, float b) const { return (a != a || b != b) ? NAN : fmaxf(a, b); } };
struct kf_min_op { __device__ __forceinline__ float operator()(float a, float b) const { return (a != a || b != b) ? NAN : fminf(a, b); } };

// Combine `v` across the TPR threads of a row (TPR 1: the thread owns the row; 32: a warp; else the block).
template <int TPR, typename Op>
__device__ __forceinline__ float kf_row_reduce(float v, Op op) {
  if (TPR == 1) return v;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (TPR <= 32) return v;
  __shared__ float kf_smem[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // the previous call's readers are done with kf_smem
  if (lane == 0) kf_smem[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {  // one thread combines the warps' results, in a fixed order
    float w = kf_smem[0];
#pragma unroll
    for (int j = 1; j < TPR / 32; ++j) w = op(w, kf_smem[j]);
    kf_smem[0] = w;
  }
  __syncthreads();
  return kf_smem[0];
}
"""

REDUCE_OPS = {"sum": ("kf_sum_op", "0.0f"), "mean": ("kf_sum_op", "0.0f"), "prod": ("kf_prod_op", "1.0f"),
              "amax": ("kf_max_op", "(-INFINITY)"), "amin": ("kf_min_op", "INFINITY")}


@dataclass(frozen=True)
class _Space:
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


def merge_space(sizes: tuple[int, ...], classes: tuple[str, ...], strides: dict[str, tuple[int, ...]]) -> _Space:
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
    return _Space(tuple(out_sizes), tuple(out_classes), {k: tuple(v) for k, v in out_strides.items()})


def render_generated(plan: Plan, step: GenStep) -> tuple[str, str]:
    """(CUDA kernel + launcher, C++ wrapper) for one GenStep."""
    spec = step.spec
    dtype = step.out_meta.dtype
    ctype = C_TYPES[dtype]
    if spec is None or spec.kind == "affine_norm":  # type: ignore[attr-defined]
        body = _flat_kernel(step, ctype)
    elif spec.window is not None:  # type: ignore[attr-defined]
        body = _pool_kernel(step, ctype)
    else:
        body = _row_kernel(step, ctype)
    return f"// {step.kernel}: {step.chain(plan.graph)}\n{body}", _wrapper(plan, step)


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
    return args


def _index_t(step: GenStep) -> str:
    biggest = max([step.out_meta.numel, _numel(step.prologue.space)] +
                  [_extent(o.meta.shape, o.meta.stride) for o in (step.source, *step.prologue.operands)])
    return "long long" if biggest + MAX_GRID * BLOCK > INT32_LIMIT else "int"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    return 1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True) if d > 0)


def _space_of(step: GenStep) -> _Space:
    spec = step.spec
    space = step.prologue.space
    reduced = set(spec.reduced) if spec is not None else set()  # type: ignore[attr-defined]
    classes = tuple("r" if d in reduced else "k" for d in range(len(space)))
    strides = {"src": step.source.strides, "out": contiguous_strides(space)}
    strides.update({f"in{i}": o.strides for i, o in enumerate(step.prologue.operands)})
    if spec is not None:
        for name in ("weight", "bias"):
            if getattr(spec, name) is not None:
                strides[name] = getattr(spec, name)[1]
        if spec.running is not None and spec.kind == "affine_norm":  # type: ignore[attr-defined]
            strides["run_mean"] = strides["run_var"] = spec.weight[1] if spec.weight else _channel_strides(space)  # type: ignore[attr-defined]
    return merge_space(space, classes, strides)


def _channel_strides(space: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if d == 1 else 0 for d in range(len(space)))  # batch norm's [N, C, HW]: per channel


def _decompose(space: _Space, cls: str, var: str, prefix: str, names: list[str], ind: str) -> list[str]:
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


def _epilogue_lines(step: GenStep, index: str, ind: str) -> list[str]:
    """The epilogue at output flat index `index` (operands indexed through the output's shape)."""
    shape = step.epilogue.space  # the reduction's value; a reshape after it keeps the flat index
    offsets = {f"in{i}": offset_expr(o.strides, shape, f"({index})") for i, o in enumerate(step.epilogue.operands)}
    return program_lines(step.epilogue, "y", offsets, "e_", ind)


def _pointer_params(step: GenStep, ctype: str) -> str:
    params = [f"const {ctype}* __restrict__ src"]
    params += [f"const {ctype}* __restrict__ p_in{i}_p" for i in range(len(step.prologue.operands))]
    spec = step.spec
    if spec is not None:
        if spec.weight is not None:  # type: ignore[attr-defined]
            params.append(f"const {ctype}* __restrict__ weight")
        if spec.bias is not None:  # type: ignore[attr-defined]
            params.append(f"const {ctype}* __restrict__ bias")
        if spec.running is not None:  # type: ignore[attr-defined]
            params += [f"{ctype}* __restrict__ run_mean", f"{ctype}* __restrict__ run_var"]
    params += [f"const {ctype}* __restrict__ e_in{i}_p" for i in range(len(step.epilogue.operands))]
    params.append(f"{ctype}* __restrict__ out")
    return ", ".join(params)


def _value_lambda(step: GenStep, space: _Space, cls: str, row_prefix: str | None) -> list[str]:
    """`value_at(r, acc)`: the prologue at element r (of the row, or flat) given the source value `acc`;
    `source(r)`: the source element loaded through its strides; `value(r)`: the two together."""
    operands = [f"in{i}" for i in range(len(step.prologue.operands))]
    base = (lambda n: f"{row_prefix}{n} + o_{n}") if row_prefix else (lambda n: f"o_{n}")
    lines = ["    auto value_at = [&](INDEX r, float acc) -> float {"]
    lines += _decompose(space, cls, "r", "o_", operands, "      ") if operands else []
    lines += program_lines(step.prologue, "acc", {n: base(n) for n in operands}, "p_", "      ")
    lines += ["      return p_result;", "    };", "    auto source = [&](INDEX r) -> float {"]
    lines += _decompose(space, cls, "r", "o_", ["src"], "      ")
    lines += [f"      return kf_load(src[{base('src')}]);", "    };",
              "    auto value = [&](INDEX r) -> float { return value_at(r, source(r)); };"]
    return lines


def _flat_kernel(step: GenStep, ctype: str) -> str:
    """Pointwise over the whole space (and eval-mode batch norm, an affine map per channel). Where the source is
    contiguous over the space, VEC elements move per 16-byte access (the launcher checks alignment)."""
    k = step.kernel
    space = _space_of(step)
    index_t = _index_t(step)
    numel = _numel(step.prologue.space)
    spec = step.spec
    vectorised = space.strides["src"] == space.strides["out"]
    element = ["      float y = value_at(i, acc);"]
    if spec is not None:  # affine_norm: (x - running_mean) / sqrt(running_var + eps) * weight + bias
        extra = [n for n in ("weight", "bias", "run_mean", "run_var") if n in space.strides]
        element += _decompose(space, "k", "i", "a_", extra, "      ")
        eps = float_literal(spec.eps)  # type: ignore[attr-defined]
        element.append(f"      y = (y - kf_load(run_mean[a_run_mean])) * (1.0f / sqrtf(kf_load(run_var[a_run_var]) + {eps}));")
        if "weight" in extra:
            element.append("      y = y * kf_load(weight[a_weight]);")
        if "bias" in extra:
            element.append("      y = y + kf_load(bias[a_bias]);")
    element += _epilogue_lines(step, "i", "      ")
    element.append("      return e_result;")
    lines = ["template <int VEC>",
             f"__global__ void __launch_bounds__({BLOCK}) {k}_kernel({_pointer_params(step, ctype)}) {{",
             f"  typedef {index_t} INDEX;",
             f"  constexpr INDEX NUMEL = {numel};",
             "  {"]
    lines += _value_lambda(step, space, "k", None)
    lines += ["    auto element = [&](INDEX i, float acc) -> float {", *element, "    };",
              "    const INDEX first = (INDEX)blockIdx.x * blockDim.x + threadIdx.x;",
              "    const INDEX stride = (INDEX)gridDim.x * blockDim.x;"]
    if vectorised:
        lines += ["    for (INDEX v = first; v < NUMEL / VEC; v += stride) {",
                  f"      const kf_pack<{ctype}, VEC> p = reinterpret_cast<const kf_pack<{ctype}, VEC>*>(src)[v];",
                  f"      kf_pack<{ctype}, VEC> q;",
                  "#pragma unroll",
                  f"      for (int j = 0; j < VEC; ++j) q.v[j] = kf_store<{ctype}>(element(v * VEC + j, kf_load(p.v[j])));",
                  f"      reinterpret_cast<kf_pack<{ctype}, VEC>*>(out)[v] = q;",
                  "    }",
                  "    for (INDEX i = NUMEL / VEC * VEC + first; i < NUMEL; i += stride)",
                  f"      out[i] = kf_store<{ctype}>(element(i, kf_load(src[i])));"]
    else:
        lines += ["    for (INDEX i = first; i < NUMEL; i += stride)",
                  f"      out[i] = kf_store<{ctype}>(element(i, source(i)));"]
    lines += ["  }", "}", ""]
    vec = 16 // {"float": 4}.get(ctype, 2) if vectorised else 1
    return "\n".join(lines) + _flat_launcher(step, ctype, numel, vec)


def _flat_launcher(step: GenStep, ctype: str, numel: int, vec: int) -> str:
    k = step.kernel
    params, args = _launch_params(step, ctype)
    aligned = "((uintptr_t)src % 16 == 0) && ((uintptr_t)out % 16 == 0)"
    launch = (f"{k}_kernel<{{VEC}}><<<kf_blocks({numel}LL / {{VEC}}, {BLOCK}), {BLOCK}, 0, stream>>>({args}, "
              f"({ctype}*)out);")
    body = f"  if ({aligned})\n    {launch.format(VEC=vec)}\n  else\n    {launch.format(VEC=1)}" if vec > 1 \
        else f"  {launch.format(VEC=1)}"
    return f"""
cudaError_t {k}_launch({params}, void* out, cudaStream_t stream) {{
{body}
  return cudaGetLastError();
}}
"""


def _pool_kernel(step: GenStep, ctype: str) -> str:
    """One thread per output element: walk its window over the input (prologue recomputed per element read),
    skipping positions in the padding; max propagates NaN, avg divides as ATen does (padding counted or not)."""
    spec = step.spec
    win = spec.window  # type: ignore[attr-defined]
    k = step.kernel
    in_shape = step.prologue.space
    out_shape = step.epilogue.space  # the pooled value (a reshape in the epilogue keeps its flat index)
    nd = len(win.kernel)
    lead_in, lead_out = in_shape[:-nd], out_shape[:-nd]
    assert lead_in == lead_out, (lead_in, lead_out)
    space = _space_of(step)  # every input dim kept: value(r) takes a flat input index
    index_t = _index_t(step)
    numel = _numel(out_shape)
    isz, osz = _numel(in_shape[-nd:]), _numel(out_shape[-nd:])
    max_pool = spec.kind == "max_pool"  # type: ignore[attr-defined]
    lines = [f"// pooling: kernel {list(win.kernel)}, stride {list(win.stride)}, padding {list(win.padding)}, "
             f"dilation {list(win.dilation)}",
             f"__global__ void __launch_bounds__({BLOCK}) {k}_kernel({_pointer_params(step, ctype)}) {{",
             f"  typedef {index_t} INDEX;",
             f"  for (INDEX i = (INDEX)blockIdx.x * {BLOCK} + threadIdx.x; i < (INDEX){numel}; "
             f"i += (INDEX)gridDim.x * {BLOCK}) {{"]
    lines += _value_lambda(step, space, "k", None)
    lines.append(f"    const INDEX lead = i / {osz};")
    lines.append(f"    INDEX rest = i % {osz};")
    for d in reversed(range(nd)):
        lines.append(f"    const int q{d} = (int)(rest % {out_shape[-nd + d]}); rest /= {out_shape[-nd + d]};")
    for d in range(nd):
        lines.append(f"    const int s{d} = q{d} * {win.stride[d]} - {win.padding[d]};")
    lines.append("    float acc = -INFINITY;" if max_pool else "    float acc = 0.0f;")
    ind = "    "
    for d in range(nd):
        size = in_shape[-nd + d]
        lines.append(f"{ind}for (int w{d} = 0; w{d} < {win.kernel[d]}; ++w{d}) {{")
        ind += "  "
        lines.append(f"{ind}const int p{d} = s{d} + w{d} * {win.dilation[d]};")
        lines.append(f"{ind}if (p{d} < 0 || p{d} >= {size}) continue;")
    flat = "p0"
    for d in range(1, nd):
        flat = f"({flat}) * {in_shape[-nd + d]} + p{d}"
    load = f"value(lead * {isz} + {flat})"
    lines.append(f"{ind}acc = kf_max_op()(acc, {load});" if max_pool else f"{ind}acc += {load};")
    for _ in range(nd):
        ind = ind[:-2]
        lines.append(f"{ind}}}")
    if not max_pool:
        lines += _avg_divisor(win, in_shape[-nd:])
    lines.append("    const float y = acc;")
    lines += _epilogue_lines(step, "i", "    ")
    lines.append(f"    out[i] = kf_store<{ctype}>(e_result);")
    lines += ["  }", "}", ""]
    return "\n".join(lines) + _launcher(step, ctype, f"kf_blocks({numel}LL, {BLOCK})")


def _avg_divisor(win, sizes: tuple[int, ...]) -> list[str]:
    """ATen's avg_pool divisor: the override, else the window clipped to input + padding (count_include_pad),
    else the number of positions inside the input."""
    if win.divisor is not None:
        return [f"    acc = acc / {float_literal(float(win.divisor))};"]
    pad_terms, in_terms = [], []
    for d, size in enumerate(sizes):
        end = f"min(s{d} + {win.kernel[d]}, {size + win.padding[d]})"
        pad_terms.append(f"({end} - s{d})")
        in_terms.append(f"(min({end}, {size}) - max(s{d}, 0))")
    count = " * ".join(pad_terms if win.count_include_pad else in_terms)
    return [f"    acc = acc / (float)({count});"]


SPLIT_MAX_ROWS = 264  # two rows per SM of an H100: fewer rows than this leave multiprocessors idle
SPLIT_MIN_ROW = 65536
SPLIT_TARGET_BLOCKS = 1024
SPLIT_MIN_CHUNK = 4096


def split_chunks(step: GenStep) -> int:
    """Chunks per row for a split reduction (1: none). A few long rows (a loss over the whole tensor, a sum over a
    large outer dim) are cut into chunks reduced by separate blocks, then combined in a fixed order."""
    spec = step.spec
    if spec is None or spec.kind not in REDUCE_OPS or spec.window is not None:  # type: ignore[attr-defined]
        return 1
    space = _space_of(step)
    rows, red = space.count("k"), space.count("r")
    if rows > SPLIT_MAX_ROWS or red < SPLIT_MIN_ROW:
        return 1
    return max(1, min(-(-SPLIT_TARGET_BLOCKS // rows), red // SPLIT_MIN_CHUNK))


def _split_kernel(step: GenStep, ctype: str, chunks: int) -> str:
    """Split reduction: block (chunk, row) reduces its chunk into `work`; one warp per row combines the chunks in
    order, then the epilogue. Deterministic: the same partials combine the same way on every call."""
    spec = step.spec
    k = step.kernel
    space = _space_of(step)
    rows, red = space.count("k"), space.count("r")
    chunk = -(-red // chunks)
    op, identity = REDUCE_OPS[spec.kind]  # type: ignore[attr-defined]
    tensors = ["src", *(f"in{i}" for i in range(len(step.prologue.operands)))]
    lines = [f"// strategy: split, {rows} rows of {red} in {chunks} chunks of {chunk}, then a combine kernel",
             f"__global__ void __launch_bounds__({BLOCK}) {k}_partial({_pointer_params(step, ctype)}, "
             "float* __restrict__ work) {",
             f"  typedef {_index_t(step)} INDEX;",
             f"  constexpr int TPR = {BLOCK};",
             "  const int lane = threadIdx.x;",
             "  const INDEX row = blockIdx.y;"]
    lines += _decompose(space, "k", "row", "row_", tensors, "  ")
    lines += _value_lambda(step, space, "r", "row_")
    lines += [f"  const INDEX begin = (INDEX)blockIdx.x * {chunk};",
              f"  const INDEX end = begin + {chunk} < (INDEX){red} ? begin + {chunk} : (INDEX){red};",
              f"  float s = {identity};",
              f"  for (INDEX r = begin + lane; r < end; r += TPR) s = {op}()(s, value(r));",
              f"  s = kf_row_reduce<TPR>(s, {op}());",
              f"  if (lane == 0) work[row * {chunks} + blockIdx.x] = s;",
              "}", "",
              f"__global__ void __launch_bounds__({BLOCK}) {k}_combine({_pointer_params(step, ctype)}, "
              "const float* __restrict__ work) {",
              f"  typedef {_index_t(step)} INDEX;",
              "  constexpr int TPR = 32;",
              "  const int lane = threadIdx.x % TPR;",
              f"  const INDEX row = (INDEX)blockIdx.x * {BLOCK // 32} + threadIdx.x / TPR;",
              f"  if (row >= {rows}) return;",
              f"  float s = {identity};",
              f"  for (int c = lane; c < {chunks}; c += TPR) s = {op}()(s, work[row * {chunks} + c]);",
              f"  s = kf_row_reduce<TPR>(s, {op}());"]
    if spec.kind == "mean":  # type: ignore[attr-defined]
        lines.append(f"  s = s * {float_literal(1.0 / red)};  // ATen's mean: sum times 1/N")
    lines += [ln[2:] for ln in _reduced_store(step, "s", ctype)]
    lines += ["}", ""]
    params, args = _launch_params(step, ctype)
    lines.append(f"""
cudaError_t {k}_launch({params}, void* out, void* work, cudaStream_t stream) {{
  {k}_partial<<<dim3({chunks}, {rows}), {BLOCK}, 0, stream>>>({args}, ({ctype}*)out, (float*)work);
  {k}_combine<<<kf_blocks({rows}LL * 32, {BLOCK}), {BLOCK}, 0, stream>>>({args}, ({ctype}*)out, (const float*)work);
  return cudaGetLastError();
}}
""")
    return "\n".join(lines)


def _row_kernel(step: GenStep, ctype: str) -> str:
    spec = step.spec
    k = step.kernel
    chunks = split_chunks(step)
    if chunks > 1:
        return _split_kernel(step, ctype, chunks)
    space = _space_of(step)
    index_t = _index_t(step)
    rows, red = space.count("k"), space.count("r")
    inner = bool(space.dims("r")) and space.classes[-1] == "r"
    tpr = 1 if not inner or red < 32 else 32 if red <= 1024 else BLOCK
    rows_per_block = BLOCK // tpr
    kind = spec.kind  # type: ignore[attr-defined]
    tensors = ["src", *(f"in{i}" for i in range(len(step.prologue.operands)))]
    if spec.broadcast:  # type: ignore[attr-defined]
        tensors += ["out"] + [n for n in ("weight", "bias") if n in space.strides]
    lines = [f"// strategy: {'inner' if inner else 'strided'}, {tpr} thread(s) per row, {rows} rows of {red}",
             f"__global__ void __launch_bounds__({BLOCK}) {k}_kernel({_pointer_params(step, ctype)}) {{",
             f"  typedef {index_t} INDEX;",
             f"  constexpr int TPR = {tpr};",
             "  const int lane = threadIdx.x % TPR;",
             f"  for (INDEX row = (INDEX)blockIdx.x * {rows_per_block} + threadIdx.x / TPR; row < (INDEX){rows}; "
             f"row += (INDEX)gridDim.x * {rows_per_block}) {{"]
    lines += _decompose(space, "k", "row", "row_", tensors, "    ")
    lines += _value_lambda(step, space, "r", "row_")
    lines += _kind_lines(step, kind, red, ctype, space)
    lines += ["  }", "}", ""]
    grid = f"kf_blocks({rows}LL * {tpr}, {BLOCK})"
    return "\n".join(lines) + _launcher(step, ctype, grid)


def _loop(body: list[str], ind: str = "    ") -> list[str]:
    return [f"{ind}for (INDEX r = lane; r < (INDEX)RED; r += TPR) {{", *[f"{ind}  {b}" for b in body], f"{ind}}}"]


def _kind_lines(step: GenStep, kind: str, red: int, ctype: str, space: _Space) -> list[str]:
    spec = step.spec
    lines = [f"    constexpr INDEX RED = {red};"]
    if kind in REDUCE_OPS:
        op, identity = REDUCE_OPS[kind]
        lines.append(f"    float s = {identity};")
        lines += _loop([f"s = {op}()(s, value(r));"])
        lines.append(f"    s = kf_row_reduce<TPR>(s, {op}());")
        if kind == "mean":
            lines.append(f"    s = s * {float_literal(1.0 / red)};  // ATen's mean: sum times 1/N")
        return lines + _reduced_store(step, "s", ctype)
    if kind in ("logsumexp", "softmax", "log_softmax"):
        lines.append("    float m = -INFINITY;")
        lines += _loop(["m = kf_max_op()(m, value(r));"])
        lines.append("    m = kf_row_reduce<TPR>(m, kf_max_op());")
        if kind == "logsumexp":
            lines.append("    m = fabsf(m) == INFINITY ? 0.0f : m;  // ATen: an infinite max is replaced by 0")
        lines.append("    float s = 0.0f;")
        lines += _loop(["s += expf(value(r) - m);"])
        lines.append("    s = kf_row_reduce<TPR>(s, kf_sum_op());")
        if kind == "logsumexp":
            lines.append("    const float lse = logf(s) + m;")
            return lines + _reduced_store(step, "lse", ctype)
        lines.append("    const float logs = logf(s);" if kind == "log_softmax" else "")
        expr = "value(r) - m - logs" if kind == "log_softmax" else "expf(value(r) - m) / s"
        return lines + _broadcast_store(step, expr, ctype, [], space)
    # norm: mean, then the biased variance around it; affine; batch norm updates its running statistics
    lines.append("    float s = 0.0f;")
    lines += _loop(["s += value(r);"])
    lines.append(f"    const float mean = kf_row_reduce<TPR>(s, kf_sum_op()) * {float_literal(1.0 / red)};")
    lines.append("    float q = 0.0f;")
    lines += _loop(["const float d = value(r) - mean;", "q += d * d;"])
    lines.append(f"    const float var = kf_row_reduce<TPR>(q, kf_sum_op()) * {float_literal(1.0 / red)};")
    lines.append(f"    const float rstd = 1.0f / sqrtf(var + {float_literal(spec.eps)});")  # type: ignore[attr-defined]
    if spec.running is not None:  # type: ignore[attr-defined]
        m = float_literal(spec.momentum)  # type: ignore[attr-defined]
        keep = float_literal(1.0 - spec.momentum)  # type: ignore[attr-defined]
        unbias = float_literal(red / max(red - 1, 1))
        lines += ["    if (lane == 0) {  // running statistics, as ATen updates them (unbiased variance)",
                  f"      run_mean[row] = kf_store<{ctype}>({m} * mean + {keep} * kf_load(run_mean[row]));",
                  f"      run_var[row] = kf_store<{ctype}>({m} * (var * {unbias}) + {keep} * kf_load(run_var[row]));",
                  "    }"]
    expr = "(value(r) - mean) * rstd"
    if spec.weight is not None:  # type: ignore[attr-defined]
        expr = f"({expr}) * kf_load(weight[row_weight + o_weight])"
    if spec.bias is not None:  # type: ignore[attr-defined]
        expr = f"{expr} + kf_load(bias[row_bias + o_bias])"
    affine = [n for n in ("weight", "bias") if n in space.strides]
    return lines + _broadcast_store(step, expr, ctype, affine, space)


def _reduced_store(step: GenStep, value: str, ctype: str) -> list[str]:
    lines = ["    if (lane == 0) {", f"      const float y = {value};"]
    lines += _epilogue_lines(step, "row", "      ")
    lines += [f"      out[row] = kf_store<{ctype}>(e_result);", "    }"]
    return lines


def _broadcast_store(step: GenStep, expr: str, ctype: str, extra: list[str], space: _Space) -> list[str]:
    """Write every element of the row: `expr` (the row's statistics applied), then the epilogue."""
    body = [ln.strip() for ln in _decompose(space, "r", "r", "o_", ["out", *extra], "")]
    body.append(f"const float y = {expr};")
    body += [ln.strip() for ln in _epilogue_lines(step, "row_out + o_out", "")]
    body.append(f"out[row_out + o_out] = kf_store<{ctype}>(e_result);")
    return _loop(body)


def _launch_params(step: GenStep, ctype: str) -> tuple[str, str]:
    """The launcher's pointer parameters and the casts that pass them to the kernel."""
    const = {name: "" if name in ("run_mean", "run_var") else "const " for name, _ in tensor_args(step)}
    params = ", ".join(f"{const[name]}void* {name}" for name in const)
    args = ", ".join(f"({const[name]}{ctype}*){name}" for name in const)
    return params, args


def _launcher(step: GenStep, ctype: str, grid: str) -> str:
    k = step.kernel
    params, args = _launch_params(step, ctype)
    return f"""
cudaError_t {k}_launch({params}, void* out, cudaStream_t stream) {{
  {k}_kernel<<<{grid}, {BLOCK}, 0, stream>>>({args}, ({ctype}*)out);
  return cudaGetLastError();
}}
"""


def _wrapper(plan: Plan, step: GenStep) -> str:
    k = step.kernel
    at_type = AT_TYPES[step.out_meta.dtype]
    args = tensor_args(step)
    metas = {name: plan.graph[ref].meta for name, ref in args}  # type: ignore[index]
    decl_params = "".join(f", {'const ' if name not in ('run_mean', 'run_var') else ''}void*" for name, _ in args)
    chunks = split_chunks(step)
    work = ", void*" if chunks > 1 else ""
    lines = [f"cudaError_t {k}_launch({decl_params[2:]}, void*{work}, cudaStream_t);", "",
             f"// {k}: {step.chain(plan.graph)}",
             f"torch::Tensor {k}({', '.join(f'const torch::Tensor& {name}' for name, _ in args)}) {{",
             "  const c10::cuda::CUDAGuard guard(src.device());"]
    for name, ref in args:
        meta = metas[name]
        lines.append(f'  kf_check_strided({name}, "{k} {name} (%{ref.name})", {{{ints(meta.shape)}}}, '  # type: ignore[attr-defined]
                     f"{{{ints(meta.stride)}}}, {at_type});")
    lines.append(f"  torch::Tensor out = at::empty({{{ints(step.out_meta.shape)}}}, src.options());")
    ptrs = ", ".join(f"{name}.data_ptr()" for name, _ in args) + ", out.data_ptr()"
    if chunks > 1:  # the split reduction's partial results, one float per (row, chunk)
        rows = _space_of(step).count("k")
        lines.append(f"  torch::Tensor work = at::empty({{{rows * chunks}}}, src.options().dtype(at::kFloat));")
        ptrs += ", work.data_ptr()"
    lines.append(f'  kf_check_launch({k}_launch({ptrs}, c10::cuda::getCurrentCUDAStream()), "{k}");')
    lines += ["  return out;", "}", ""]
    return "\n".join(lines)
