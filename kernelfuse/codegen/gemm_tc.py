"""Matrix products on tensor cores at fp32 accuracy (3xTF32), with the epilogue inside: a Linear's output written once.

out[M][N] = x[M][K] w[N][K]ᵀ (+ bias[N]), then the anchor's epilogue (`kN_apply`) on each element before the one
store. Both operands are K-contiguous: `x` row-major and `w` a Linear's weight, which the graph reads as the view
`w.t()` (a weight stored K x N is read through a K-contiguous copy: kernelfuse.plan.gemm.k_contiguous_weights).
Each operand is split into a big and a small TF32 part (`kf_tf32_split`, kernelfuse.codegen.tensorcore), and three
products (small x big, big x small, big x big) keep fp32 accuracy. The tensor cores' own fp32 accumulation
rounds toward zero, an error that grows with K (3.4e-4 against float64 at K = 8192, cuBLAS's SGEMM 2e-5): so each
K tile's products go into a fresh tensor-core accumulator, added to the running sum in registers with
round-to-nearest (4e-6 there).

Measured against cuBLAS's SGEMM (benchmarks/gemm_probe.py, stop 41, H200, `gemm_probe_s41_h200.md`): 1.05x at
1024 x 8192 x 8192, 1.03-1.30x on BERT's and Llama's Linear shapes, 0.92x at 128 rows (the judge picks per model).
One tile configuration (the fastest across those shapes of the ten tried): 64 x 128 outputs a block of four warps
(32 x 64 each), K in tiles of 32 through three cp.async stages. Within each 16 columns of K, the columns a thread's fragments need are adjacent (the same order for
both operands: only the order of a sum's terms changes), so one 16-byte shared load serves two k8 steps.

On a compute-capability 9.0 device the launcher takes the wgmma main loop instead (kernelfuse.codegen.gemm_wgmma,
about 1.65x this one's speed) where its 128 x 128 tiles cover three quarters of the SMs; both loops call the same
epilogue struct (`kN_epi`), so the two kernels differ only in their main loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kernelfuse.capture import Graph, Node
from kernelfuse.codegen.binding import Binding, py_tuple
from kernelfuse.codegen.common import apply_function
from kernelfuse.codegen.gemm_wgmma import WG_BM, WG_BN, WG_SMEM_BYTES, WG_THREADS
from kernelfuse.plan.gemm import gemm_operands
from kernelfuse.plan.ir import FusedStep, Plan

BM, BN, BK = 64, 128, 32
WARPS_M, WARPS_N = 2, 2
STAGES = 3
THREADS = 32 * WARPS_M * WARPS_N
LD = BK + 16  # shared row stride: LD % 32 == 16, so a quarter warp's 16-byte fragment loads hit 32 distinct banks
SMEM_BYTES = STAGES * (BM + BN) * LD * 4

GEMM_PRELUDE = r"""
// ---- matrix products on tensor cores, 3xTF32 (kernelfuse.codegen.gemm_tc) ----
// C = A Bᵀ for the block's BM x BN tile (A: M x K, B: N x K, both row-major, K % 4 == 0, 16-byte aligned rows);
// the thread's elements go to epi(row, col, v0, v1, pair), two adjacent columns at a time (pair false: col is the
// last column, v1 is not an element).
// M, N and K are run-time values here (kernel arguments), as in benchmarks/gemm_probe.py's measured kernel: the
// loop is at ptxas's 255-register limit, and as compile-time constants the copies' addresses spilled.
template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, typename Epi>
__device__ __forceinline__ void kf_gemm_3xtf32(const float* __restrict__ A, const float* __restrict__ B, int M, int N,
                                               int K, Epi epi) {
  constexpr int THREADS = WARPS_M * WARPS_N * 32, LD = BK + 16, WM = BM / WARPS_M, WN = BN / WARPS_N;
  constexpr int MF = WM / 16, NF = WN / 8, KQ = BK / 4;
  const int KT = (K + BK - 1) / BK;
  static_assert(BK % 16 == 0 && LD % 32 == 16, "fragment loads of 16 bytes need K tiles of 16 and LD % 32 == 16");
  KF_DYNAMIC_SHARED(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
  const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
  // K tile kt of both operands into stage kt % STAGES
  auto issue = [&](int kt) {
    float* As = smem + (kt % STAGES) * (BM + BN) * LD;
    float* Bs = As + BM * LD;
    const int k0 = kt * BK;
#pragma unroll
    for (int i = 0; i < (BM * KQ + THREADS - 1) / THREADS; ++i) {
      const int e = tid + i * THREADS;
      if (BM * KQ % THREADS == 0 || e < BM * KQ) {  // (the copy's indices inside the test: without, ptxas spills)
        const int r = e / KQ, c = (e % KQ) * 4;
        const bool in = m0 + r < M && k0 + c < K;
        kf_gemm_cp16(As + r * LD + c, in ? A + (long long)(m0 + r) * K + k0 + c : A, in);
      }
    }
#pragma unroll
    for (int i = 0; i < (BN * KQ + THREADS - 1) / THREADS; ++i) {
      const int e = tid + i * THREADS;
      if (BN * KQ % THREADS == 0 || e < BN * KQ) {
        const int r = e / KQ, c = (e % KQ) * 4;
        const bool in = n0 + r < N && k0 + c < K;
        kf_gemm_cp16(Bs + r * LD + c, in ? B + (long long)(n0 + r) * K + k0 + c : B, in);
      }
    }
    kf_cp_async_commit();
  };
  float acc[MF][NF][4];
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < KT) issue(s);
    else kf_cp_async_commit();  // empty groups keep the count the waits rely on
  }
#pragma unroll 1
  for (int kt = 0; kt < KT; ++kt) {
    kf_cp_async_wait<STAGES - 2>();  // this thread's copies of tile kt have landed
    __syncthreads();                 // ... and every thread's; tile kt - 1's stage is free again
    if (kt + STAGES - 1 < KT) issue(kt + STAGES - 1);
    else kf_cp_async_commit();
    const float* As = smem + (kt % STAGES) * (BM + BN) * LD;
    const float* Bs = As + BM * LD;
    float part[MF][NF][4];  // this K tile's products: a fresh tensor-core accumulator
#pragma unroll
    for (int i = 0; i < MF; ++i)
#pragma unroll
      for (int j = 0; j < NF; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[i][j][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
#if defined(__CUDA_ARCH__)
      // in each 16 columns, k = t and t + 4 of step s are columns 4t + 2s and 4t + 2s + 1 (A and B alike)
      float4 bv[NF], lo[MF], hi[MF];
#pragma unroll
      for (int j = 0; j < NF; ++j) bv[j] = *reinterpret_cast<const float4*>(Bs + (wn + j * 8 + g) * LD + kk + 4 * t);
#pragma unroll
      for (int i = 0; i < MF; ++i) {
        lo[i] = *reinterpret_cast<const float4*>(As + (wm + i * 16 + g) * LD + kk + 4 * t);
        hi[i] = *reinterpret_cast<const float4*>(As + (wm + i * 16 + g + 8) * LD + kk + 4 * t);
      }
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        unsigned int bh[NF][2], bl[NF][2];
#pragma unroll
        for (int j = 0; j < NF; ++j) {
          const float b0 = s ? bv[j].z : bv[j].x, b1 = s ? bv[j].w : bv[j].y;
          kf_tf32_split(b0, bh[j][0], bl[j][0]);
          kf_tf32_split(b1, bh[j][1], bl[j][1]);
        }
#pragma unroll
        for (int i = 0; i < MF; ++i) {
          const float av[4] = {s ? lo[i].z : lo[i].x, s ? hi[i].z : hi[i].x, s ? lo[i].w : lo[i].y,
                               s ? hi[i].w : hi[i].y};
          unsigned int ah[4], al[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) kf_tf32_split(av[r], ah[r], al[r]);
#pragma unroll
          for (int j = 0; j < NF; ++j) {
            kf_mma_tf32(part[i][j], al, bh[j]);
            kf_mma_tf32(part[i][j], ah, bl[j]);
            kf_mma_tf32(part[i][j], ah, bh[j]);
          }
        }
      }
#else
      // the CPU emulation: each lane's accumulator elements from the same TF32 parts in the same three passes,
      // with scalar FMAs over the same 16 columns
      for (int i = 0; i < MF; ++i)
        for (int j = 0; j < NF; ++j)
          for (int e = 0; e < 4; ++e) {
            const float* a = As + (wm + i * 16 + g + (e >> 1) * 8) * LD + kk;
            const float* b = Bs + (wn + j * 8 + 2 * t + (e & 1)) * LD + kk;
            float v = part[i][j][e];
            for (int pass = 0; pass < 3; ++pass)
              for (int k = 0; k < 16; ++k) {
                float ha, la, hb, lb;
                kf_tf32_split_values(a[k], ha, la);
                kf_tf32_split_values(b[k], hb, lb);
                v = fmaf(pass == 0 ? la : ha, pass == 1 ? lb : hb, v);
              }
            part[i][j][e] = v;
          }
#endif
    }
#pragma unroll
    for (int i = 0; i < MF; ++i)
#pragma unroll
      for (int j = 0; j < NF; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] += part[i][j][e];  // round to nearest, outside the tensor cores
  }
#pragma unroll
  for (int i = 0; i < MF; ++i)
#pragma unroll
    for (int j = 0; j < NF; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm + i * 16 + g + h * 8, col = n0 + wn + j * 8 + 2 * t;
        if (row >= M || col >= N) continue;
        epi(row, col, acc[i][j][2 * h], acc[i][j][2 * h + 1], col + 1 < N);
      }
}
"""


@dataclass(frozen=True)
class GemmShape:
    """out[m][n] = x[m][k] w[n][k]ᵀ: the sizes the kernel is specialised to."""

    m: int
    n: int
    k: int


def gemm_shape(graph: Graph, node: Node) -> GemmShape:
    _, x, wt = gemm_operands(node)
    (m, k), n = graph[x].meta.shape, graph[wt].meta.shape[1]
    return GemmShape(m, n, k)


def render_gemm(plan: Plan, step: FusedStep, shared: dict[str, str] | None = None) -> tuple[str, Binding]:
    """The kernel, its launcher and its binding for a matrix-product anchor with its epilogue inside.

    The kernel's text depends only on the epilogue (sizes are kernel arguments): `shared` maps each kernel text
    already emitted for this file, with its name taken out, to that name, and an anchor whose kernel would repeat
    one launches that one instead (BERT's 72 Linears are three kernels: nvcc's time grows with each)."""
    node = step.anchor.node
    s = gemm_shape(plan.graph, node)
    epi, k = step.epilogue, step.kernel
    has_bias = gemm_operands(node)[0] is not None
    ops = range(len(epi.operands))
    operand_params = "".join(f", const float* __restrict__ in{i}" for i in ops)
    params = (f"const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias, "
              f"float* __restrict__ out{operand_params}, int M, int N, int K")
    operand_args = "".join(f", in{i}" for i in ops)
    bias = " + bias[col]" if has_bias else ""
    bias1 = " + bias[col + 1]" if has_bias else ""
    member_params = "".join(f"\n  const float* __restrict__ in{i};" for i in ops)
    body = f"""{apply_function(k, epi, "float", "int")}
// the epilogue of both main loops: bias, {k}_apply, and the store (8 bytes a pair where N is even)
struct {k}_epi {{
  float* __restrict__ out;
  const float* __restrict__ bias;{member_params}
  int N;
  __device__ __forceinline__ void operator()(int row, int col, float v0, float v1, bool pair) const {{
    const int i = row * N + col;
    const float r0 = {k}_apply(v0{bias}, i{operand_args});
    if (!pair) {{
      out[i] = r0;
      return;
    }}
    const float r1 = {k}_apply(v1{bias1}, i + 1{operand_args});
    if (N % 2 == 0) {{  // i is even: an 8-byte store
      float2 r;
      r.x = r0;
      r.y = r1;
      *reinterpret_cast<float2*>(out + i) = r;
    }} else {{
      out[i] = r0;
      out[i + 1] = r1;
    }}
  }}
}};
__global__ void __launch_bounds__({THREADS}, 2) {k}_kernel({params}) {{
  kf_gemm_3xtf32<{BM}, {BN}, {BK}, {WARPS_M}, {WARPS_N}, {STAGES}>(x, w, M, N, K, {k}_epi{{out, bias{operand_args}, N}});
}}
#if defined(__CUDACC__) || defined(KF_EMULATION)
__global__ void __launch_bounds__({WG_THREADS}, 1) {k}_kernel_wg({params}) {{
  kf_gemm_3xtf32_wgmma(x, w, M, N, K, {k}_epi{{out, bias{operand_args}, N}});
}}
#endif
"""
    shared = {} if shared is None else shared
    name = shared.setdefault(_canonical(body, k), k)
    head = f"// {k}: {step.chain(plan.graph)}  (GEMM on tensor cores, 3xTF32, epilogue inside)\n"
    if name != k:
        body = f"// (the same kernels as {name}'s: {name}_kernel, {name}_kernel_wg)\n"
    operand_casts = "".join(f", (const float*)in{i}" for i in ops)
    args = f"(const float*)x, (const float*)w, (const float*)bias, (float*)out{operand_casts}, {s.m}, {s.n}, {s.k}"
    kernel = head + body + f"""
KF_EXPORT cudaError_t {k}_launch(const void* x, const void* w, const void* bias, void* out{"".join(f", const void* in{i}" for i in ops)}, cudaStream_t stream) {{
#if defined(__CUDACC__) || defined(KF_EMULATION)
  if (kf_wg::fits({s.m}, {s.n})) {{  // Hopper, tiles enough: the wgmma main loop
    const cudaError_t opted = kf_opt_in<{name}_kernel_wg>({WG_SMEM_BYTES});
    if (opted != cudaSuccess) return opted;
    {name}_kernel_wg<<<dim3({-(-s.n // WG_BN)}, {-(-s.m // WG_BM)}), {WG_THREADS}, {WG_SMEM_BYTES}, stream>>>({args});
    return cudaGetLastError();
  }}
#endif
  const cudaError_t opted = kf_opt_in<{name}_kernel>({SMEM_BYTES});
  if (opted != cudaSuccess) return opted;
  dim3 grid({-(-s.m // BM)}, {-(-s.n // BN)});
  {name}_kernel<<<grid, {THREADS}, {SMEM_BYTES}, stream>>>({args});
  return cudaGetLastError();
}}
"""
    return kernel, _binding(plan, step, s, has_bias)


def _canonical(body: str, k: str) -> str:
    """The kernel's text with its own names taken out: the kernel's (kN_) and the epilogue's values (v_<node>,
    numbered in order of appearance), so two anchors' kernels compare equal when they compute the same."""
    values: dict[str, str] = {}
    body = re.sub(r"\bv_\w+", lambda m: values.setdefault(m.group(0), f"v#{len(values)}"), body)
    return re.sub(rf"\b{k}_", "kN_", body)


def _binding(plan: Plan, step: FusedStep, s: GemmShape, has_bias: bool) -> Binding:
    epi, k = step.epilogue, step.kernel
    ops = range(len(epi.operands))
    params = "".join(f", in{i}" for i in ops)
    lines = [f"# {k}: {step.chain(plan.graph)}  (3xTF32 GEMM on tensor cores, epilogue inside)",
             f"def {k}(self, x, wt, b{params}):",
             f'    _check_dense(x, "{k} input", {py_tuple((s.m, s.k))}, torch.float32)',
             f'    _check_dense(wt.t(), "{k} weight (read as .t())", {py_tuple((s.n, s.k))}, torch.float32)',
             "    if x.data_ptr() % 16:  # the kernel copies 16-byte rows",
             "        x = x.clone()",
             "    if wt.data_ptr() % 16:",
             "        wt = wt.t().clone().t()"]
    if has_bias:
        lines.append(f'    _check_dense(b, "{k} bias", {py_tuple((s.n,))}, torch.float32)')
    for i, operand in enumerate(epi.operands):
        lines.append(f'    _check_dense(in{i}, "{k} operand in{i} ({operand.ref.name})", {py_tuple(operand.meta.shape)}, '
                     "torch.float32)")
    lines.append(f"    out = torch.empty({py_tuple(epi.out.shape)}, dtype=torch.float32, device=x.device)")
    bias = "b.data_ptr()" if has_bias else "None"
    ptrs = "".join(f", in{i}.data_ptr()" for i in ops)
    lines.append(f'    self._launch(self._{k}, "{k}", x, x.data_ptr(), wt.data_ptr(), {bias}, out.data_ptr(){ptrs})')
    lines.append("    return out")
    init = f'self._{k} = self._function("{k}_launch", [ctypes.c_void_p] * {4 + len(epi.operands)})'
    return Binding(init, "\n".join(lines))
