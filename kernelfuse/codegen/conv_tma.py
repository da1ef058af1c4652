"""The dense convolution on Hopper by TMA im2col loads and wgmma: `{k}_kernel_tma`, a Hopper branch of the dense
implicit-GEMM anchor (kernelfuse.codegen.conv_tc) with its epilogue code (conv_geometry's tile_stores of the
epilogue IR's `kN_apply`), either output layout, and its arithmetic: operands rounded to nearest TF32 as eager's
cuDNN and the dense kernel round them (truncated where DenseConfig.round_tf32 is off).

Why: our dense kernels (mma.sync, and its wgmma form conv_wgmma) run 2.5-4x slower than cuDNN because the gathers'
integer work dominates (stop 47's ncu); in im2col mode the TMA unit makes the gather addresses itself. The probe
(`benchmarks/tma_conv_probe.py`, stop 56) ran this schedule (`coop-256`) at cuDNN's speed. In a plan's file, on an
H200, its truncating form ran level-2 problem 54's convolution bare in 1.34 ms (the mma.sync kernel 3.11, cuDNN
channels-last 1.28) but failed the judge's accuracy rule: 1.27e-3 off float64 where eager is 4.3e-4 off, since the
tensor cores read an operand's top 19 bits (truncation) and eager rounds to nearest. Hence the rounding below.

The kernel: persistent blocks (one an SM), 384 threads. Warpgroup 0's first thread is the producer: per k block (32
channels of one tap r, s) one TMA im2col load of 256 output pixels x 32 channels of the NHWC input (coordinates
{c, w, h, n}: the window origin of the tile's first output pixel (p, q), q * stride_w + lower_w and p * stride_h +
lower_h; offsets {s * dil_w, r * dil_h}; the box's corners `lower` = -padding and `upper` = padding - (k - 1) *
dilation, W first, and its traversal strides the convolution's, so the box walks the output pixels' window origins
across rows and images as CUTLASS's im2col maps do; zero fill out of bounds: TmaConv) and one tiled TMA load of TBN
weight rows x 32 of the planner's tap-major weight copy (K, R S C), both 128-byte swizzled, into a ring of four
slots with full (expect_tx + complete_tx) and empty (one arrive a consumer warp) mbarriers. Two consumer warpgroups
take 128 pixels each on wgmma.m64nTBNk8 TF32 (TBN 128, 64 or 32), a k block's products in flight while the next is
issued (wait_group 1; half a k block's where the operands are rounded, below).
Each warpgroup's epilogue stages CH columns of its accumulators at a time in its own shared tile (smem[n * LDC +
m], the dense kernel's layout) and runs tile_stores over them with its 128 threads, while the producer already
fills the ring for the block's next tile.

The rounding (cvt.rna.tf32.f32: nearest, ties away from zero), where round_tf32 (the default):
- B, the weight, not in the kernel: the binding gives the launchers a copy of the tap-major weight rounded to
  nearest TF32 (_KernelLibrary._tf32_weight: torch's integer ops on its bits, made once per weight version and
  cached), which every form reads by descriptor as it is. Why: the weight depends on nothing else, so rounding it
  once beats rounding each slot's tile in every block at every call. (Until stop 57 warps 1 and 2 of the
  producer's warpgroup rounded each slot's tile in place behind a `ready` mbarrier the consumers waited on: on an
  H200 the pre-rounded form, A by descriptor, still ran 11-27% slower than the truncating one with that pass, level-2
  54 1.436 against 1.292 ms bare, level-1 56 2.058 against 1.617.)
- A, the im2col tile (256 x 32), in registers: each consumer thread loads its fragments of wgmma's register-A form
  (kf_cw_mma_ra_n64/n128: rows row and row + 8 of a 64-row half, k columns tq and tq + 4 of each k8 step; 16
  floats a half and k block) from the swizzled slot and rounds them there. Rounding A in place instead would add
  twice B's traffic. A warp's load of one fragment register reads eight rows at one 16-byte chunk each, stored at
  chunk c ^ (row % 8) with row % 8 = lane / 4, four lanes a chunk: 32 distinct banks, no conflicts. wgmma reads
  the fragment registers asynchronously, so each 64-row half's four products are a wgmma group of their own, from
  fragment set mi (of two), and set mi is loaded again only after the wait_group 1 that retires the group before,
  which retired the previous k block's group of the same half. One half's products stay in flight while the next
  half's fragments load. A first form kept two whole k blocks' fragment sets (64 registers) and spilled 32-164
  bytes (sm_90a ptxas); the halves' sets (32) do not.
Shared memory read a k block (TBN 128): 96 KB in every form (wgmma's B reads 64, A's 32 by its fragments' loads or
by descriptor); nothing in the kernel writes the ring but the TMA unit. The ring is addressed from the dynamic
shared array by pointer arithmetic, so these are shared (LDS), not generic, accesses.

The pre-rounded form (`{k}_kernel_tma_prerounded`, carried beside the rounding one): A and B by descriptor, the
truncating form's kernel text under its own name (a file carries one or the other for a convolution). The tensor
cores read an operand's top 19 bits, which is exact for a value already rounded to nearest TF32 (its low 13
mantissa bits zero): so where the binding makes the input's channels-last copy itself (an NCHW input, the common
case: a model's input) its copy kernel rounds as it copies (kf_nchw_to_nhwc<float, TILE, true>: kf_round_tf32,
three integer instructions a value in a pass bound by its memory traffic) and this form multiplies the same TF32
values as the rounding form, without A's fragment loads, their rounding and the halves' extra wait (on an H200 the
rounding form ran 3-52% slower than the truncating one, bare: level-2 54 1.62 against 1.26 ms). A channels-last
input is not copied, so the rounding form reads it.

Where it runs: the file carries it where DenseConfig.tma, which dense_config sets where `tma_shape` holds: a 1-d or
2-d convolution of groups 1, input and output channels multiples of 32 (TBN = 128, 64 or 32, the largest that
divides them), any padding and dilation whose corners a 4-d im2col map holds ([-128, 127]), strides up to 8 (the
map's traversal strides), transposed ones of stride 1 only, and TMA_MIN_TILES tiles at least. Why these: a 1-d
convolution is the 2-d one of H = 1 (the binding views its (N, C, L) input as (N, C, 1, L): no copy beyond the
channels-last one every input takes); a transposed convolution of stride 1 is a forward one with its taps reversed
and the padding (k - 1) * dilation - padding (TmaConv), read by reversing the tap coordinate of the weight's TMA
load, so the weight needs no flipped copy; a transposed one of stride s > 1 is s^2 phases of different tap sets (the
dense kernel's Phase), which one im2col map does not walk. On an H200 cuDNN's NCHW call ran level-1 64, 74, 76, 78
and 80 (transposed 1-d, dilated 1-d, strided dilated 1-d, transposed 2-d with 32 output channels, dilated 2-d)
2.7-5x above their memory floors: these are the shapes the generalisation is for.
Its launcher `{k}_launch_tma` takes a channels-last input and runs this kernel only: the binding calls it, with the
input made channels-last (a copy where it is not), where kf_conv_tma_ready() (the library built for sm_90a on a
compute-capability 9.0 device, the driver's tensor-map encoders found; asked once a device), else `{k}_launch`, the
dense kernel reading its own layout (NCHW by default): on other GPUs nothing changes. `{k}_launch_tma` refuses
(cudaErrorNotSupported) where it is not ready, the input is not 16-byte aligned or the maps do not encode, and never
falls back to a kernel that would read the input in another layout. Where the form rounds,
`{k}_launch_tma_prerounded` (the same checks) runs the pre-rounded form: the binding calls it only on the copy it
has just made with `to_channels_last(x, round_tf32=True)` (a contiguous NCHW fp32 input on the device), and
`{k}_launch_tma` on every other input (channels-last already, or copied by torch, which does not round). The maps
are encoded on the host at every call (caching them per pointer is a measurement for later); kf_conv_tma_launches()
counts the launches of either form, kf_conv_tma_prerounded_launches() the pre-rounded ones.

The mbarrier, setmaxnreg and named-barrier PTX, the tiled encoder and their emulation are
kernelfuse.codegen.tma_prelude's (shared with the warp-specialized attention); the im2col copy, the 2-d float tile
copy, the rounding and the convolution's encoders are here.
The CPU emulation (KF_EMULATION) runs the same kernel text: the producer's copies are synchronous (what the
hardware writes, by the box traversal and swizzle modelled here), the mbarriers are counters with the hardware's
phase and tx-count rules that block by atomic waits, the named barriers std::barriers, the products kf_wg's
emulated wgmma (the register-A form by emulated shuffles), the rounding kf_round_tf32's host form (the SASS ptxas
makes of cvt.rna), the binding's rounding copy by its own kernel. Not emulated:
the real TMA unit's corner, offset and traversal-stride semantics (padding, dilation, strides and non-square
kernels are this model's reading of the driver's documentation and of CUTLASS's use of it: the GPU tests check
them), the descriptors' bit layout, the products' asynchrony (and so the fragment sets' lifetimes), the proxy
fences, setmaxnreg.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernelfuse.codegen.conv_geometry import LDC, ConvShape

if TYPE_CHECKING:
    from kernelfuse.codegen.conv_tc import DenseConfig

TMA_THREADS = 384  # the producer's warpgroup and two consumer warpgroups
TMA_BM = 256  # output pixels a block tile (one im2col box), 128 a consumer warpgroup
TMA_STAGES = 4
# Fewer tiles than this stay on the dense kernel: twice an H100's or H200's 132 SMs, so that every persistent block
# takes two tiles or more (its ring runs on across its epilogues) and no SM idles for want of a 256-pixel tile where
# the dense kernel's 128-pixel ones would spread (chosen, not measured; smaller convolutions' files are smaller too)
TMA_MIN_TILES = 2 * 132
SMEM_LIMIT = 227 * 1024  # a block's shared memory on Hopper
STATIC_SMEM = 2 * 2 * 128 * 4  # the warpgroups' pixel tables (img_t, pix_t)


CORNER = 128  # a 4-d im2col map's corners lie in [-CORNER, CORNER - 1] (cuTensorMapEncodeIm2col)
MAX_TRAVERSAL = 8  # its traversal strides (elementStrides), at most


@dataclass(frozen=True)
class TmaConv:
    """Convolution `s` as the TMA kernel computes it: a forward 2-d convolution over the channels-last input
    (N, H, W, C), (h, w) pairs, H first. A 1-d convolution is the 2-d one of H = 1 (its input viewed (N, C, 1, L), no
    copy). A transposed convolution of stride 1 is the forward one whose taps are reversed (`flip`) with padding
    (k - 1) * dilation - padding below: out[o] = sum_q x[o + padding - q * dilation] w[ci, co, q] reads x at
    o - pad' + q' * dilation for q' = k - 1 - q. Its weight rows (the planner's tap-major copy, [co][tap][ci]) are
    then read at tap KV - 1 - rs for the kernel's tap rs (reversing every dimension's order reverses the flat index),
    so no flipped copy of the weight is made. The im2col box's corners: `lower` = -padding below (the first output
    pixel's window starts there), `upper` such that the box's last traversed position is the last output pixel's:
    padding - (k - 1) * dilation for a forward convolution (CUTLASS's, with any stride), out - in - pad' for a
    transposed one (output_padding included). Offsets: tap (r, s) at (r * dil_h, s * dil_w)."""

    h: int
    w: int
    r: int
    s: int
    p: int
    q: int
    lower: tuple[int, int]
    upper: tuple[int, int]
    dilation: tuple[int, int]
    stride: tuple[int, int]
    flip: bool


def tma_conv(s: ConvShape) -> TmaConv:
    """The TMA kernel's view of 1-d or 2-d convolution `s` (see TmaConv; tma_shape says whether it runs it)."""
    lead = 2 - len(s.kernel)  # a 1-d convolution: H = 1, one tap, no padding, stride and dilation 1 there
    in_size, out_size, kernel = (1,) * lead + s.in_size, (1,) * lead + s.out_size, (1,) * lead + s.kernel
    padding, dilation, stride = (0,) * lead + s.padding, (1,) * lead + s.dilation, (1,) * lead + s.stride
    if s.transposed:  # stride 1 (tma_shape): the forward convolution of the reversed taps
        below = tuple((k - 1) * d - p for k, d, p in zip(kernel, dilation, padding, strict=True))
        lower = tuple(-b for b in below)
        upper = tuple(o - i - b for o, i, b in zip(out_size, in_size, below, strict=True))
    else:
        lower = tuple(-p for p in padding)
        upper = tuple(p - (k - 1) * d for p, k, d in zip(padding, kernel, dilation, strict=True))
    return TmaConv(in_size[0], in_size[1], kernel[0], kernel[1], out_size[0], out_size[1], lower, upper, dilation,
                   stride, s.transposed)


def tma_shape(s: ConvShape) -> bool:
    """Whether convolution `s` suits the TMA kernel (see the module's docstring): dense_config turns it on there."""
    if len(s.kernel) not in (1, 2) or s.groups != 1 or s.cin % 32 or s.cout % 32 or min(s.out_size) < 1 \
            or s.m + TMA_BM >= 2**31 or (s.transposed and set(s.stride) != {1}):
        return False
    g = tma_conv(s)
    return (all(-CORNER <= c < CORNER for c in (*g.lower, *g.upper)) and max(g.stride) <= MAX_TRAVERSAL
            and max((g.r - 1) * g.dilation[0], (g.s - 1) * g.dilation[1]) < 2**15 and tma_tiles(s) >= TMA_MIN_TILES)


# The kernel's forms, by how A reaches the tensor cores (the module's docstring): "rounding" rounds it in its
# register fragments; "prerounded" reads it by descriptor, as it is, from an input the binding's copy rounded;
# "truncating" (round_tf32 off) reads it by descriptor too: the same kernel text as "prerounded" (a file carries one
# or the other for a convolution, never both). B is read by descriptor in every form: the binding rounds the
# weight once a version where the file rounds (_KernelLibrary._tf32_weight)
TMA_FORMS = ("rounding", "prerounded", "truncating")


def tma_forms(round_tf32: bool) -> tuple[str, ...]:
    """The forms a file carries for a TMA convolution: operands rounded to nearest TF32 (`round_tf32`), the rounding
    form for an input as it comes and the pre-rounded one for the binding's rounding copy; else the truncating
    one."""
    return ("rounding", "prerounded") if round_tf32 else ("truncating",)


def tma_suffix(form: str) -> str:
    """The suffix of a form's kernel and launcher names: `{k}_kernel_tma{suffix}`, `{k}_launch_tma{suffix}`."""
    return "_prerounded" if form == "prerounded" else ""


def tma_form(s: ConvShape, cfg: DenseConfig) -> bool:
    """Whether the dense anchor's file carries the TMA kernel for convolution `s` under configuration `cfg`."""
    return cfg.tma and tma_shape(s)


def tma_tile(s: ConvShape) -> tuple[int, int]:
    """(TBN, CH): output channels a block tile (128, 64 or 32: the largest that divides them, so that no product
    column is wasted), and columns a warpgroup's epilogue stages at once (as many as the shared memory beside the
    four ring slots holds: 16 at TBN 128, 32 at 64 and 32)."""
    bn = next(b for b in (128, 64, 32) if s.cout % b == 0)
    ch = next(c for c in (bn, 64, 32, 16) if c <= bn and tma_smem_bytes(bn, c) + STATIC_SMEM <= SMEM_LIMIT)
    return bn, ch


def tma_tiles(s: ConvShape) -> int:
    """The block tiles of convolution `s`: 256 output pixels x TBN output channels each."""
    return -(-s.m // TMA_BM) * (s.cout // tma_tile(s)[0])


def tma_smem_bytes(bn: int, ch: int) -> int:
    """Dynamic shared memory: the ring's slots (256 pixels + bn weight rows of 128 bytes each), the 1024-byte
    alignment of the swizzled tiles, the mbarriers (full, empty), and each consumer warpgroup's staged columns."""
    return TMA_STAGES * (TMA_BM + bn) * 128 + 1024 + 2 * TMA_STAGES * 8 + 2 * ch * LDC * 4


CONV_TMA_PRELUDE = r"""
// ---- the dense convolution by TMA im2col loads and wgmma, sm_90a (kernelfuse.codegen.conv_tma) ----
#if defined(__CUDACC__) || defined(KF_EMULATION)
// (kf_tma's mbarriers, 4-d tiled copies, setmaxnreg, named barriers and the tiled encoder: the file's
// kernelfuse.codegen.tma_prelude, earlier)
namespace kf_tma {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// `rows` pixels from (n, h, w) on (the box walks w, then h, then n) x 32 channels from c, each pixel shifted by the
// tap (dw, dh): coordinates innermost first, offsets in the same order (W, then H)
__device__ __forceinline__ void im2col(void* dst, const CUtensorMap* map, uint64_t* bar, int c, int w, int h, int n,
                                       int dw, int dh) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2], {%7, %8};\n" ::"r"(smem_u32(dst)), "l"((uint64_t)map),
      "r"(smem_u32(bar)), "r"(c), "r"(w), "r"(h), "r"(n), "h"((unsigned short)dw), "h"((unsigned short)dh)
      : "memory");
}
__device__ __forceinline__ void tile2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_u32(dst)), "l"((uint64_t)map), "r"(smem_u32(bar)), "r"(c0),
      "r"(c1)
      : "memory");
}
#elif defined(KF_EMULATION)
// The copies, done at once by the producer: what the TMA unit writes (rows of 32 floats in the 128-byte swizzle,
// zeros out of bounds), then their bytes completed on the barrier. The im2col box walks the positions lower,
// lower + stride, ... up to size - 1 + upper of W (the traversal stride's), then of H, then the images, from the
// coordinates' position: (size - 1 + upper - lower) / stride + 1 of them a row, as CUTLASS counts the output pixels.
inline void im2col(void* dst, const CUtensorMap* map, uint64_t* bar, int c, int w, int h, int n, int dw, int dh) {
  float* out = static_cast<float*>(dst);
  const long long C = map->dims[0], W = map->dims[1], H = map->dims[2], N = map->dims[3];
  const long long sw = map->traversal[0], sh = map->traversal[1];
  const long long wc = (W - 1 - map->lower[0] + map->upper[0]) / sw + 1;
  const long long hc = (H - 1 - map->lower[1] + map->upper[1]) / sh + 1;
  if ((w - map->lower[0]) % sw || (h - map->lower[1]) % sh) __builtin_trap();  // off the traversal's grid
  long long at = ((long long)n * hc + (h - map->lower[1]) / sh) * wc + (w - map->lower[0]) / sw;
  for (int i = 0; i < map->rows; ++i, ++at) {
    const long long pw = map->lower[0] + at % wc * sw, ph = map->lower[1] + at / wc % hc * sh, pn = at / wc / hc;
    const long long iw = pw + dw, ih = ph + dh;
    const bool in = pn < N && ih >= 0 && ih < H && iw >= 0 && iw < W;
    for (int k = 0; k < 32; ++k)
      out[kf_wg::swz128(i, k)] = in ? map->base[((pn * H + ih) * W + iw) * C + c + k] : 0.0f;
  }
  update(bar, -128LL * map->rows, 0);
}
inline void tile2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  float* out = static_cast<float*>(dst);
  for (int r = 0; r < map->rows; ++r)
    for (int k = 0; k < 32; ++k)
      out[kf_wg::swz128(r, k)] = c1 + r < map->dims[1] ? map->base[(c1 + r) * map->dims[0] + c0 + k] : 0.0f;
  update(bar, -128LL * map->rows, 0);
}
#endif

// The rounding to nearest TF32 (cvt.rna, as the dense kernel's operands; round_tf32) of A in the rounding form: a
// consumer thread's register fragments of 64 rows of a slot's im2col tile (from `rows`, 1024-byte aligned)
// for wgmma's RS form (kf_cw_mma_ra_nN), the four k8 steps ks: rows row and row + 8, k columns tq and tq + 4 of the
// step (PTX's m64k8 TF32 A fragment), read from the 128-byte swizzle, rounded. A warp's load of one register reads
// eight rows (row % 8 = lane / 4) at one 16-byte chunk, stored at chunk c ^ (row % 8), four lanes each: 32 banks.
__device__ __forceinline__ void rounded_fragments(unsigned (&a)[4][4], const float* rows, int row, int tq) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      a[ks][r] = __float_as_uint(kf_round_tf32(rows[kf_wg::swz128(row + (r & 1) * 8, ks * 8 + tq + (r >> 1) * 4)]));
}

// Host side: the tensor maps, encoded at each call
#if !defined(KF_EMULATION)
using EncodeIm2col = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                  const cuuint64_t*, const int*, const int*, cuuint32_t, cuuint32_t,
                                  const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                  CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
inline EncodeIm2col im2col_encoder() {
  static const EncodeIm2col encode = (EncodeIm2col)driver_fn("cuTensorMapEncodeIm2col");
  return encode;
}
#endif
// whether the driver's tensor-map encoders were found (the emulation encodes its own maps)
inline bool encoders() {
#if defined(KF_EMULATION)
  return true;
#else
  return im2col_encoder() != nullptr && tiled_encoder() != nullptr;
#endif
}
// x: NHWC (N, H, W, C); a box of `rows` output pixels, each 32 channels, over the output's pixels: W from lower_w
// to W - 1 + upper_w (inclusive) in steps of stride_w, H likewise (codegen.conv_tma.TmaConv), corners and strides W
// first; zeros out of bounds. False: not encoded.
inline bool encode_input(CUtensorMap* map, const float* x, int N, int H, int W, int C, int lower_h, int lower_w,
                         int upper_h, int upper_w, int stride_h, int stride_w, int rows) {
  const int lower[2] = {lower_w, lower_h}, upper[2] = {upper_w, upper_h};
#if defined(KF_EMULATION)
  *map = CUtensorMap{x, {C, W, H, N}, {lower[0], lower[1]}, {upper[0], upper[1]}, rows, {stride_w, stride_h}};
  return true;
#else
  const EncodeIm2col encode = im2col_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[4] = {(cuuint64_t)C, (cuuint64_t)W, (cuuint64_t)H, (cuuint64_t)N};
  const cuuint64_t strides[3] = {(cuuint64_t)C * 4, (cuuint64_t)W * C * 4, (cuuint64_t)H * W * C * 4};
  const cuuint32_t traversal[4] = {1, (cuuint32_t)stride_w, (cuuint32_t)stride_h, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, (void*)x, dims, strides, lower, upper, 32, rows, traversal,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
#endif
}
// w: the tap-major weight (K rows of RSC floats); boxes of `rows` rows x 32 floats
inline bool encode_weight(CUtensorMap* map, const float* w, int K, int RSC, int rows) {
#if defined(KF_EMULATION)
  *map = CUtensorMap{w, {RSC, K, 1, 1}, {0, 0}, {0, 0}, rows, {1, 1}};
  return true;
#else
  const EncodeTiled encode = tiled_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {(cuuint64_t)RSC, (cuuint64_t)K};
  const cuuint64_t strides[1] = {(cuuint64_t)RSC * 4};
  const cuuint32_t box[2] = {32, (cuuint32_t)rows}, ones[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, (void*)w, dims, strides, box, ones,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
#endif
}
// persistent blocks: one an SM; the emulation runs two, so each block's ring goes on across its tiles
inline int blocks(int tiles) {
#if defined(KF_EMULATION)
  const int sms = 2;
#else
  const int sms = kf_wg::sm90_sms();
#endif
  return tiles < sms ? tiles : sms;
}
}  // namespace kf_tma
// launches that took a TMA kernel, and those of them that took the pre-rounded form (a test's proof that it ran)
static long long kf_conv_tma_count = 0, kf_conv_tma_prerounded_count = 0;
KF_EXPORT long long kf_conv_tma_launches() { return kf_conv_tma_count; }
KF_EXPORT long long kf_conv_tma_prerounded_launches() { return kf_conv_tma_prerounded_count; }
// whether the TMA kernels run on the current device (the library built for sm_90a on a 9.0 device, the encoders
// found): the binding then converts their convolutions' inputs to channels-last and calls {k}_launch_tma
KF_EXPORT int kf_conv_tma_ready() { return kf_wg::sm90_sms() > 0 && kf_tma::encoders(); }
#endif  // __CUDACC__ || KF_EMULATION
"""


def render_dense_tma(k: str, s: ConvShape, form: str, operand_params: str, stores: str) -> str:
    """The text of `{k}_kernel_tma{tma_suffix(form)}` for convolution `s` (tma_form holds) in `form` (TMA_FORMS):
    A rounded in the consumers' register fragments where rounding, else read by descriptor (prerounded and
    truncating: the same text); B by descriptor, as the launcher is given it; `stores` is conv_geometry's
    tile_stores for tma_tile's CH columns, 128 threads whose index is `t`."""
    assert form in TMA_FORMS, form
    bn, ch = tma_tile(s)
    g = tma_conv(s)
    # the weight's k block of kernel k block kb: tap rs's (or, the taps reversed, tap KV - 1 - rs's) channel block cb
    w_kb = "((KT / CB - 1 - rs) * CB + cb)" if g.flip else "kb"
    frags = "\n      unsigned frag[2][4][4];  // A fragments of both 64-row halves" if form == "rounding" else ""
    return f"""#if defined(__CUDACC__) || defined(KF_EMULATION)
__global__ void __launch_bounds__({TMA_THREADS}, 1) {k}_kernel_tma{tma_suffix(form)}(const __grid_constant__ CUtensorMap tmap_x, const __grid_constant__ CUtensorMap tmap_w, const float* __restrict__ bias, float* __restrict__ out{operand_params}) {{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(KF_EMULATION)
  constexpr int TBN = {bn}, CH = {ch}, LDC = {LDC}, COG = {s.cout}, STAGES = {TMA_STAGES}, BM = {TMA_BM}, WG_M = BM / 2;
  constexpr int KT = {g.r * g.s * s.cin // 32}, CB = {s.cin // 32}, S = {g.s}, Q = {g.q}, PQ = {g.p * g.q}, M = {s.m};
  constexpr int LOW_H = {g.lower[0]}, LOW_W = {g.lower[1]}, STR_H = {g.stride[0]}, STR_W = {g.stride[1]};
  constexpr int DIL_H = {g.dilation[0]}, DIL_W = {g.dilation[1]}, TILES_N = {s.cout // bn}, TILES = {tma_tiles(s)};
  constexpr int A_BYTES = BM * 128, STAGE_BYTES = (BM + TBN) * 128;
  KF_DYNAMIC_SHARED(kf_tma_raw);
  // the ring on the swizzle's 1024-byte atom, by pointer arithmetic: the compiler still knows it is shared memory
  unsigned char* const ring = reinterpret_cast<unsigned char*>(kf_tma_raw) + (-(uintptr_t)kf_tma_raw & 1023);
  uint64_t* const full = reinterpret_cast<uint64_t*>(ring + STAGES * STAGE_BYTES);
  uint64_t* const empty = full + STAGES;
  float* const staged = reinterpret_cast<float*>(empty + STAGES);  // each consumer warpgroup's CH columns
  __shared__ int img_t[2][WG_M], pix_t[2][WG_M];
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {{
    for (int i = 0; i < STAGES; ++i) {{
      kf_tma::bar_init(&full[i], 1);
      kf_tma::bar_init(&empty[i], 8);  // every consumer warp arrives once its products reading the slot are done
    }}
    kf_tma::fence_init();
  }}
  __syncthreads();
  const int my_tiles = TILES > (int)blockIdx.x ? (TILES - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
  if (wg == 0) {{  // the producer: one thread issues every copy, the ring's slots in order over the block's tiles
    kf_tma::producer_registers();
    if (threadIdx.x == 0) {{
      unsigned it = 0;
      for (int i = 0; i < my_tiles; ++i) {{
        const int tile = blockIdx.x + i * gridDim.x, tm = tile / TILES_N, tn = tile % TILES_N;
        const int m0 = tm * BM, img = m0 / PQ, pq = m0 % PQ, p = pq / Q, q = pq % Q;
        for (int kb = 0; kb < KT; ++kb, ++it) {{
          const int slot = it % STAGES, rs = kb / CB, cb = kb % CB;
          kf_tma::wait(&empty[slot], ((it / STAGES) & 1) ^ 1);
          unsigned char* const a = ring + slot * STAGE_BYTES;
          kf_tma::arrive_expect_tx(&full[slot], STAGE_BYTES);
          // the window of output pixel (p, q) starts at (p * STR_H + LOW_H, q * STR_W + LOW_W); tap (r, s) is offset
          // (r * DIL_H, s * DIL_W) from it{"; the weight's taps reversed (a transposed convolution)" if g.flip else ""}
          kf_tma::im2col(a, &tmap_x, &full[slot], cb * 32, q * STR_W + LOW_W, p * STR_H + LOW_H, img, rs % S * DIL_W,
                         rs / S * DIL_H);
          kf_tma::tile2d(a + A_BYTES, &tmap_w, &full[slot], {w_kb} * 32, tn * TBN);
        }}
      }}
    }}
  }} else {{  // consumer warpgroup cw: rows cw * 128.. of each tile
    kf_tma::consumer_registers();
    const int cw = wg - 1, t = threadIdx.x % 128;
    const int row = t / 32 * 16 + lane / 4, tq = lane % 4;  // its accumulator rows (row, row + 8), columns 2 tq..
    float* const tile_c = staged + cw * CH * LDC;
    int* const img_s = img_t[cw];
    int* const pix_s = pix_t[cw];
    float acc[2][TBN / 2];
    for (int i = 0; i < my_tiles; ++i) {{
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int j = 0; j < TBN / 2; ++j) acc[mi][j] = 0.0f;
      const unsigned it0 = (unsigned)i * KT;{frags}
#pragma unroll 1
      for (int kb = 0; kb < KT; ++kb) {{
        const unsigned it = it0 + kb;
        const int slot = it % STAGES;
        kf_tma::wait(&full[slot], (it / STAGES) & 1);  // the slot's copies landed
        const float* const a = reinterpret_cast<const float*>(ring + slot * STAGE_BYTES + cw * WG_M * 128);
        const float* const b = reinterpret_cast<const float*>(ring + slot * STAGE_BYTES + A_BYTES);
{_products(bn, form)}
      }}
      kf_wg::wait<0>();
      __syncwarp();
      if (lane == 0) kf_tma::arrive(&empty[(it0 + KT - 1) % STAGES]);
      // the epilogue: CH columns at a time through this warpgroup's shared tile to tile_stores, as the dense kernel
      const int tile = blockIdx.x + i * gridDim.x, tm = tile / TILES_N, tn = tile % TILES_N;
      kf_tma::warpgroup_sync(cw);  // the previous tile's stores are done with the pixel tables and tile_c
      {{
        const int m = tm * BM + cw * WG_M + t;
        img_s[t] = m < M ? m / PQ : -1;
        pix_s[t] = m < M ? m % PQ : 0;
      }}
#pragma unroll
      for (int c = 0; c < TBN / CH; ++c) {{
        if (c > 0) kf_tma::warpgroup_sync(cw);  // the previous columns' stores are done with tile_c
        // accumulator fragment of m64nTBN: n8 block j holds (row, columns 8j + 2tq, +1) and (row + 8, the same)
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int j = 0; j < CH / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              tile_c[(8 * j + 2 * tq + (e & 1)) * LDC + mi * 64 + row + (e >> 1) * 8] = acc[mi][4 * (c * CH / 8 + j) + e];
        kf_tma::warpgroup_sync(cw);
        {{
          constexpr int BN = CH;
          const int n0 = tn * TBN + c * CH, grp = 0;
          const float* const smem = tile_c;
{stores}
        }}
      }}
    }}
  }}
#else
  __trap();  // never launched: {k}_launch_tma{tma_suffix(form)} runs it only where the loader built sm_90a for a 9.0 device
#endif
}}
#endif
"""


def _products(bn: int, form: str) -> str:
    """C lines: a consumer warpgroup's products of k block kb from its slot (a: its 128 rows of A, b: B), then the
    previous slot handed back. B by descriptor in every form. A by descriptor (truncating, prerounded): the k
    block's eight products one wgmma group. A rounded in registers:
    each 64-row half mi its group, A from fragment set mi; wgmma reads those registers asynchronously, so set mi is
    loaded again only after the wait_group 1 that retires the group before (the other half's), which has retired
    the previous k block's mi group too."""
    if form != "rounding":
        return f"""        kf_wg::fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) kf_cw_mma_n{bn}(acc[mi], kf_wg::desc(a + mi * 64 * 32, ks), kf_wg::desc(b, ks));
        kf_wg::commit();
        kf_wg::wait<1>();  // the previous k block's products are done: hand its slot back
        __syncwarp();  // (the emulation's lanes run apart; on the GPU the warp is converged here)
        if (kb > 0 && lane == 0) kf_tma::arrive(&empty[(it - 1) % STAGES]);"""
    return f"""#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {{
          kf_tma::rounded_fragments(frag[mi], a + mi * 64 * 32, row, tq);
          kf_wg::fence();
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) kf_cw_mma_ra_n{bn}(acc[mi], frag[mi][ks], kf_wg::desc(b, ks));
          kf_wg::commit();
          kf_wg::wait<1>();  // the group before is done: set 1 - mi is free again (at mi 0: the previous slot)
          if (mi == 0) {{
            __syncwarp();  // (the emulation's lanes run apart; on the GPU the warp is converged here)
            if (kb > 0 && lane == 0) kf_tma::arrive(&empty[(it - 1) % STAGES]);
          }}
        }}"""


def tma_launcher(k: str, s: ConvShape, form: str, launch_params: str, launch_args: str) -> str:
    """`{k}_launch_tma{tma_suffix(form)}`: the TMA kernel's `form` of convolution `k` on a channels-last input,
    where it can run (else cudaErrorNotSupported; the binding calls it only where kf_conv_tma_ready says it can,
    and the pre-rounded form only on its own copy rounded to nearest TF32)."""
    bn, ch = tma_tile(s)
    g = tma_conv(s)
    smem = tma_smem_bytes(bn, ch)
    name = f"{k}_kernel_tma{tma_suffix(form)}"
    what = "x rounded to nearest TF32 by the binding's copy, read as it is" if form == "prerounded" else \
        "never another kernel, which would read x as NCHW"
    what += "; w as it is (the binding's copy rounded to nearest TF32 once a version, where the form rounds)"
    counted = "++kf_conv_tma_count;" + (" ++kf_conv_tma_prerounded_count;" if form == "prerounded" else "")
    return f"""#if defined(__CUDACC__) || defined(KF_EMULATION)
// {k}'s TMA im2col kernel, {form} form (codegen.conv_tma), on a channels-last x; {what}
KF_EXPORT cudaError_t {k}_launch_tma{tma_suffix(form)}(const void* x, const void* w, const void* bias, void* out{launch_params}, cudaStream_t stream) {{
  CUtensorMap tx, tw;
  if (!kf_conv_tma_ready() || (uintptr_t)x % 16 != 0 ||
      !kf_tma::encode_input(&tx, (const float*)x, {s.batch}, {g.h}, {g.w}, {s.cin}, {g.lower[0]}, {g.lower[1]},
                            {g.upper[0]}, {g.upper[1]}, {g.stride[0]}, {g.stride[1]}, {TMA_BM}) ||
      !kf_tma::encode_weight(&tw, (const float*)w, {s.cout}, {g.r * g.s * s.cin}, {bn}))
    return cudaErrorNotSupported;
  const cudaError_t opted = kf_opt_in<{name}>({smem});
  if (opted != cudaSuccess) return opted;
  {counted}
  {name}<<<dim3(kf_tma::blocks({tma_tiles(s)})), {TMA_THREADS}, {smem}, stream>>>(tx, tw, (const float*)bias, (float*)out{launch_args});
  return cudaGetLastError();
}}
#endif
"""
