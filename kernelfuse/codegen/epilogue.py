"""CUDA for a library anchor's epilogue (plan FusedStep): cuBLAS's or cuDNN's output through the fused chain, in
one pass over it.

An NCHW (or matmul) output is rewritten in place, VEC elements per 16-byte access (`_flat_kernel`); a channels-last
convolution output is read by tiles through shared memory and written as NCHW (`_transpose_kernel`, and its 16-byte
form where channel and plane sizes are multiples of 4). Operands that are the same for a vector's elements (a
per-channel bias or scale) are loaded once a vector (`_vector_invariant`).
"""

from __future__ import annotations

import torch

from kernelfuse.capture import TensorMeta
from kernelfuse.codegen.binding import Binding, pointer_launcher, py_tuple
from kernelfuse.codegen.common import (
    C_TYPES,
    INT32_LIMIT,
    apply_function,
    channels_last_format,
    invariant_operands,
    offset_expr,
)
from kernelfuse.plan.ir import Epilogue, FusedStep, Plan

THREADS = 256
MAX_BLOCKS = 1 << 20  # kf_blocks' cap on the grid of the flat kernels


def render_fused(plan: Plan, step: FusedStep, tile: int) -> tuple[str, Binding]:
    """(the step's epilogue kernels and launcher, its Python binding): a library anchor's output through the
    epilogue, in place (NCHW or a matmul's rows: the flat kernel) or into NCHW from channels-last (the transposing
    kernels)."""
    epi = step.epilogue
    out = epi.out
    ctype = C_TYPES[out.dtype]
    # 64-bit indices when any index the kernels form can pass 2^31 - 1: the grid-stride loops step past the
    # end by up to one grid (MAX_BLOCKS * THREADS threads) before their bound check.
    index_t = "long long" if out.numel + MAX_BLOCKS * THREADS > INT32_LIMIT else "int"
    k = step.kernel
    operand_params = "".join(f", const {ctype}* __restrict__ in{i}" for i in range(len(epi.operands)))
    operand_args = "".join(f", in{i}" for i in range(len(epi.operands)))
    apply_fn = apply_function(k, epi, ctype, index_t)
    comment = f"// {k}: {step.chain(plan.graph)}\n"
    if step.anchor.layout == "nhwc":
        vector = _vector_transpose(out)
        hoisted = _vector_invariant(epi, 4) if vector else ()
        body = _transpose_kernel(k, out, ctype, index_t, operand_params, operand_args, tile)
        if vector:
            body += _transpose_kernel_vec(k, epi, index_t, operand_params, operand_args, hoisted)
    else:
        hoisted = _vector_invariant(epi, 16 // out.dtype.itemsize)
        body = _flat_kernel(k, epi, ctype, index_t, operand_params, operand_args, hoisted)
    if hoisted:
        apply_fn += apply_function(k, epi, ctype, index_t, hoisted)
    launch_params = "".join(f", const void* in{i}" for i in range(len(epi.operands)))
    launch_args = "".join(f", (const {ctype}*)in{i}" for i in range(len(epi.operands)))
    launch = _launch_function(k, step, out, ctype, launch_params, launch_args, tile)
    return comment + apply_fn + body + launch, _binding(plan, step)


def _flat_kernel(k: str, epi: Epilogue, ctype: str, index_t: str, operand_params: str, operand_args: str,
                 hoisted: tuple[int, ...]) -> str:
    """Elementwise over the contiguous output, VEC elements per 16-byte access; the `hoisted` operands (the same
    for a vector's VEC elements: `_vector_invariant`) loaded once a vector. The launcher takes VEC = 1 where a
    pointer is not 16-byte aligned: a vector is then one element and the hoisted load is that element's own."""
    out = epi.out
    vec = 16 // out.dtype.itemsize
    first_index = f"v * VEC{'' if hoisted else ' + j'}"
    if hoisted:
        preload, extra = _hoisted_loads(epi, hoisted, "i0", "    ")
        call = f"{k}_apply_h(kf_load(p.v[j]), i0 + j{operand_args}{extra})"
        start = f"\n    const {index_t} i0 = {first_index};{preload}"
    else:
        call, start = f"{k}_apply(kf_load(p.v[j]), {first_index}{operand_args})", ""
    return f"""
// Elementwise over the contiguous output; VEC elements per 16-byte access, in place when acc == out.
template <int VEC>
__global__ void __launch_bounds__({THREADS}) {k}_kernel(const {ctype}* acc, {ctype}* out{operand_params}) {{
  constexpr {index_t} kNumel = {out.numel};
  const {index_t} stride = ({index_t})gridDim.x * blockDim.x;
  const {index_t} first = ({index_t})blockIdx.x * blockDim.x + threadIdx.x;
  for ({index_t} v = first; v < kNumel / VEC; v += stride) {{
    kf_pack<{ctype}, VEC> p = reinterpret_cast<const kf_pack<{ctype}, VEC>*>(acc)[v];{start}
#pragma unroll
    for (int j = 0; j < VEC; ++j)
      p.v[j] = kf_store<{ctype}>({call});
    reinterpret_cast<kf_pack<{ctype}, VEC>*>(out)[v] = p;
  }}
  for ({index_t} i = kNumel / VEC * VEC + first; i < kNumel; i += stride)
    out[i] = kf_store<{ctype}>({k}_apply(kf_load(acc[i]), i{operand_args}));
}}
constexpr int {k}_VEC = {vec};
"""


def _transpose_kernel(k: str, out: TensorMeta, ctype: str, index_t: str, operand_params: str, operand_args: str,
                      tile: int) -> str:
    n, c = out.shape[0], out.shape[1]
    hw = out.numel // max(n * c, 1)
    rows = THREADS // tile
    return f"""
// Reads the channels-last result acc[n][hw][c] by {tile}x{tile} tiles, writes out[n][c][hw] (NCHW) through the epilogue.
__global__ void __launch_bounds__({THREADS}) {k}_kernel(const {ctype}* __restrict__ acc, {ctype}* __restrict__ out{operand_params}) {{
  constexpr int C = {c}, HW = {hw};
  __shared__ float tile[{tile}][{tile + 1}];
  const {index_t} base = ({index_t})blockIdx.z * C * HW;
  const int hw0 = blockIdx.x * {tile}, c0 = blockIdx.y * {tile};
#pragma unroll
  for (int j = 0; j < {tile // rows}; ++j) {{  // constant trip count: all loads of the tile in flight at once
    const int r = threadIdx.y + j * {rows}, hw = hw0 + r, c = c0 + threadIdx.x;
    if (hw < HW && c < C) tile[r][threadIdx.x] = kf_load(acc[base + ({index_t})hw * C + c]);
  }}
  __syncthreads();
#pragma unroll
  for (int j = 0; j < {tile // rows}; ++j) {{
    const int r = threadIdx.y + j * {rows}, c = c0 + r, hw = hw0 + threadIdx.x;
    if (hw < HW && c < C) {{
      const {index_t} i = base + ({index_t})c * HW + hw;
      out[i] = kf_store<{ctype}>({k}_apply(tile[threadIdx.x][r], i{operand_args}));
    }}
  }}
}}
"""


def _vector_transpose(out: TensorMeta) -> bool:
    """Can the channels-last epilogue move 16 bytes per access both ways: fp32, channels and plane sizes
    multiples of 4 (so that every 4 channels of a pixel and every 4 positions of a channel are 16-byte aligned)."""
    n, c = out.shape[0], out.shape[1]
    hw = out.numel // max(n * c, 1)
    return out.dtype == torch.float32 and len(out.shape) >= 3 and c % 4 == 0 and hw % 4 == 0 and out.numel > 0


def _vector_invariant(epi: Epilogue, vec: int) -> tuple[int, ...]:
    """The epilogue's operands whose offset is the same for `vec` consecutive output elements starting at a
    multiple of `vec` (a per-channel bias or scale over an NCHW plane whose size is a multiple of vec; a per-row
    operand of a GEMM output with a multiple of vec columns): a vector kernel loads each once for its vec elements
    instead of finding its offset per element."""
    return invariant_operands(epi.out.shape, epi.operands, vec)


def _hoisted_loads(epi: Epilogue, hoisted: tuple[int, ...], index: str, ind: str) -> tuple[str, str]:
    """(the lines that load the `hoisted` operands once, at output index `index`, as `in{j}_h`; the arguments that
    pass them on to `k*_apply_h`)."""
    loads = "".join(f"\n{ind}const float in{j}_h = "
                    f"kf_load(in{j}[{offset_expr(epi.operands[j].strides, epi.out.shape, index)}]);" for j in hoisted)
    return loads, "".join(f", in{j}_h" for j in hoisted)


def _transpose_kernel_vec(k: str, epi: Epilogue, index_t: str, operand_params: str, operand_args: str,
                          hoisted: tuple[int, ...]) -> str:
    """The transposed epilogue with 16-byte accesses: a block takes 32 channels x 64 positions, reads each
    pixel's 4 channels as one float4 and writes each channel's 4 positions as one float4 (level-2 54: the 32 x 32
    scalar tile moved its 2.1 GB in 0.80 ms, torch.compile's Triton kernel in 0.56, H200). A thread's 4 positions
    share a plane: the `hoisted` operands (per channel or sample) are loaded once for them."""
    out = epi.out
    n, c = out.shape[0], out.shape[1]
    hw = out.numel // max(n * c, 1)
    preload, extra = _hoisted_loads(epi, hoisted, "i", "      ")
    name = f"{k}_apply_h" if hoisted else f"{k}_apply"
    apply = lambda e, v: f"{name}({v}, i + {e}{operand_args}{extra})"  # noqa: E731
    return f"""
// The same with 16-byte accesses both ways: a block is 32 channels x 64 positions; the launcher picks it where
// both pointers are 16-byte aligned.
__global__ void __launch_bounds__({THREADS}) {k}_kernel_v(const float* __restrict__ acc, float* __restrict__ out{operand_params}) {{
  constexpr int C = {c}, HW = {hw};
  __shared__ float tile[32][65];  // [channel][position]: a warp's scalar stores and loads 2-way conflicted at most
  const {index_t} base = ({index_t})blockIdx.z * C * HW;
  const int hw0 = blockIdx.x * 64, c0 = blockIdx.y * 32;
#pragma unroll
  for (int j = 0; j < 2; ++j) {{  // a thread's pixel, 4 channels of it
    const int t = threadIdx.x + j * {THREADS}, p = t >> 3, q = (t & 7) * 4;
    if (hw0 + p < HW && c0 + q < C) {{
      const float4 v = *reinterpret_cast<const float4*>(acc + base + ({index_t})(hw0 + p) * C + c0 + q);
      tile[q][p] = v.x;
      tile[q + 1][p] = v.y;
      tile[q + 2][p] = v.z;
      tile[q + 3][p] = v.w;
    }}
  }}
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 2; ++j) {{  // a thread's channel, 4 positions of it
    const int t = threadIdx.x + j * {THREADS}, r = t >> 4, h = (t & 15) * 4;
    if (hw0 + h < HW && c0 + r < C) {{
      const {index_t} i = base + ({index_t})(c0 + r) * HW + hw0 + h;{preload}
      float4 v;
      v.x = {apply(0, "tile[r][h]")};
      v.y = {apply(1, "tile[r][h + 1]")};
      v.z = {apply(2, "tile[r][h + 2]")};
      v.w = {apply(3, "tile[r][h + 3]")};
      *reinterpret_cast<float4*>(out + i) = v;
    }}
  }}
}}
"""


def _launch_function(k: str, step: FusedStep, out: TensorMeta, ctype: str, launch_params: str, launch_args: str,
                     tile: int) -> str:
    if step.anchor.layout == "nhwc":
        n, c = out.shape[0], out.shape[1]
        hw = out.numel // max(n * c, 1)
        vec = f"""  if ((uintptr_t)acc % 16 == 0 && (uintptr_t)out % 16 == 0) {{
    {k}_kernel_v<<<dim3({(hw + 63) // 64}, {(c + 31) // 32}, {n}), {THREADS}, 0, stream>>>((const float*)acc, (float*)out{launch_args});
    return cudaGetLastError();
  }}
""" if _vector_transpose(out) else ""
        return f"""
KF_EXPORT cudaError_t {k}_launch(const void* acc, void* out{launch_params}, cudaStream_t stream) {{
{vec}  dim3 grid({(hw + tile - 1) // tile}, {(c + tile - 1) // tile}, {n}), block({tile}, {THREADS // tile});
  {k}_kernel<<<grid, block, 0, stream>>>((const {ctype}*)acc, ({ctype}*)out{launch_args});
  return cudaGetLastError();
}}
"""
    return f"""
KF_EXPORT cudaError_t {k}_launch(const void* acc, void* out{launch_params}, cudaStream_t stream) {{
  const bool aligned = ((uintptr_t)acc % 16 == 0) && ((uintptr_t)out % 16 == 0);
  if (aligned)
    {k}_kernel<{k}_VEC><<<kf_blocks({out.numel}LL / {k}_VEC, {THREADS}), {THREADS}, 0, stream>>>((const {ctype}*)acc, ({ctype}*)out{launch_args});
  else
    {k}_kernel<1><<<kf_blocks({out.numel}LL, {THREADS}), {THREADS}, 0, stream>>>((const {ctype}*)acc, ({ctype}*)out{launch_args});
  return cudaGetLastError();
}}
"""


def _binding(plan: Plan, step: FusedStep) -> Binding:
    epi, k = step.epilogue, step.kernel
    dtype = epi.out.dtype
    fmt = channels_last_format(epi.out)
    params = "".join(f", in{i}" for i in range(len(epi.operands)))
    lines = [f"# {k}: {step.chain(plan.graph)}" + ("  (in place on the library output)" if step.inplace else ""),
             f"def {k}(self, acc{params}):"]
    if step.anchor.layout == "nhwc":  # cuDNN normally returns channels-last here; if not, make it so (one copy)
        lines.append(f"    acc = acc.contiguous(memory_format={fmt})")
    layout = f", {fmt}" if step.anchor.layout == "nhwc" else ""
    lines.append(f'    _check_dense(acc, "{k} input", {py_tuple(epi.out.shape)}, {dtype}{layout})')
    for i, operand in enumerate(epi.operands):
        lines.append(f'    _check_dense(in{i}, "{k} operand in{i} ({operand.ref.name})", {py_tuple(operand.meta.shape)}, '
                     f"{dtype})")
    if step.anchor.layout == "nhwc":
        lines.append("    out = acc.new_empty(acc.shape)  # NCHW")
    else:
        lines.append("    out = acc")
    ptrs = "".join(f", in{i}.data_ptr()" for i in range(len(epi.operands)))
    lines.append(f'    self._launch(self._{k}, "{k}", acc, acc.data_ptr(), out.data_ptr(){ptrs})')
    lines.append("    return out")
    return Binding(pointer_launcher(k, 2 + len(epi.operands)), "\n".join(lines))
