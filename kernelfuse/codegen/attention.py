"""The flash-attention kernel family (plan AttnSteps): softmax(q kᵀ * scale + mask) v without the scores in memory.

A block of 128 threads takes 64 queries (32 for head dims over 128) of one (batch, head): the query tile sits in
shared memory, K and then V tiles stream through one shared buffer, and each query row keeps a running maximum and
sum (online softmax), rescaling its output accumulator (registers, D / 16 floats per row per thread) when the
maximum grows. Scores and probabilities are fp32 FMAs in exact fp32 (no TF32): the strict policy's numerics,
faster than eager's unfused form because the S x L scores make no round trip through memory. Tiles whose every
key is masked (causal, or a bool mask such as minGPT's lower-triangular buffer) are skipped before their scores
are computed. Inputs and the output are read and written through the strides the plan gives, so the transposes
and copies around attention cost nothing; grouped-query attention reads kv head `head / group`. ReLU
self-attention (relu in the softmax's place) is the same loop without the running statistics. bf16 attention runs
the same algorithm on tensor cores (mma.sync m16n8k16, fp32 accumulation, the scores' accumulator fragments reused as
the probabilities' operand fragments; head dims in steps of 8 up to 128, an odd multiple of 8 padded to the product's
k16 steps by 8 zero columns in shared memory, never read from or written to global memory): where q, k and v are
contiguous along d with 16-byte aligned rows, a FlashAttention-2-style kernel (its tiling a `FlashConfig`: blocks of
4 or 8 warps of 16 query rows, `flash_warps`, 64-key tiles, the query tile in registers; key and value tiles
double-buffered in shared memory by cp.async and read by ldmatrix, exp2 softmax, per-element masking only on mask,
tail and diagonal tiles; on Hopper, at head dims 32, 40, 64, 80, 96 and 128 (masks too), the launcher takes the wgmma
kernel of kernelfuse.codegen.attention_wgmma instead, at run time); elsewhere a simpler one (4 warps, K and V staged
through registers, V transposed). fp32 runs
on tensor cores too where the step's arithmetic allows: TF32 under the tf32 policy, 3xTF32 (torch's own fp32 SDPA
arithmetic) for SDPA nodes under the strict policy, in the same flash structure where the layout allows
(`kf_attention_fa2_f32_kernel`: m16n8k8 fragments by plain shared-memory loads, operands split as loaded); hand-written
fp32 attention under the strict policy keeps exact FMA (its `-3xtf32` twin is judged). Short rows (S and L up to
64 at head dims 32 and 64: Swin's windows) have a form of their own, kernelfuse.codegen.attention_short.
A step whose constant mask the planner found causal (AttnStep.causal_guard) gets a second launcher, causal without
the mask; its binding runs it where `_KernelLibrary._causal_mask` finds the forward's mask causal, the masked
launcher otherwise: one mechanism for every dtype and kernel, since the step's `causal` flag drives them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernelfuse.codegen.attention_short import ShortRows, short_rows
from kernelfuse.codegen.binding import Binding, pointer_launcher, py_tuple
from kernelfuse.codegen.common import C_TYPES
from kernelfuse.ops import float_literal
from kernelfuse.plan.attention_views import logical_view, mask_view, strides_of, window_view
from kernelfuse.plan.ir import AttnStep, Plan

MASK_KINDS = {"none": 0, "keep": 1, "drop": 2, "add": 3}  # the kernel's MASK template argument
SMS = 132  # an H100's SMs: the bf16 flash kernel's blocks are as large as still fill them


def tile_shape(head_dim: int) -> tuple[int, int]:
    """(queries, keys) per tile: 64 x 64 up to head dim 128; 32 x 32 above, so the output accumulator (RQ x D/16
    floats a thread) and the shared tiles (about 80 KB at D = 256) still fit."""
    return (64, 64) if head_dim <= 128 else (32, 32)


def uses_tensor_cores(step: AttnStep) -> bool:
    """Tensor cores where the head dim allows (steps of 8, up to 128): bf16 (mma.sync m16n8k16; a head dim that is
    an odd multiple of 8 is padded to the k16 steps inside the kernel), and fp32 whose step's arithmetic is TF32 or
    3xTF32 (m16n8k8); the rest (exact fp32, fp16, other head dims) runs on the FMA kernel."""
    d, dtype = step.dims[5], step.out_meta.dtype
    if d % 8 or d > 128:
        return False
    return step.math != "fma" if dtype == torch.float32 else dtype == torch.bfloat16


def vector_rows(step: AttnStep, strides: dict[str, tuple[int, ...]]) -> bool:
    """q, k and v contiguous along d with rows a multiple of 16 bytes apart (the launchers check the bases)."""
    per_16_bytes = 16 // step.out_meta.dtype.itemsize
    return not any(strides[n][3] != 1 or any(x % per_16_bytes for x in strides[n][:3]) for n in ("q", "k", "v"))


def flash_warps(step: AttnStep, strides: dict[str, tuple[int, ...]]) -> int:
    """Warps (16 query rows each) per block of the flash kernels, 0 where they do not apply: q, k or v not
    contiguous along d, or rows not a multiple of 16 bytes apart (the launcher checks the bases' alignment at run
    time and falls back to the first tensor-core kernel). fp32: 4 (its 3xTF32 operand splits take the registers
    more rows would need), fewer where fewer than 64 queries fill them (a block of 4 warps for 2 queries would
    hold 3 idle warps and their shared rows). bf16: 8 warps (128 queries) where such blocks are enough to give
    every SM one (a query tile's keys and values are read once for twice the queries); 4 (64 queries) otherwise, so
    that short sequences or few heads spread over more SMs."""
    b, h, _, s, _, _ = step.dims
    if not uses_tensor_cores(step) or not vector_rows(step, strides):
        return 0
    if step.out_meta.dtype == torch.float32:  # as many warps as the queries fill, up to 4
        return min(4, -(-s // 16))
    return 8 if s > 64 and -(-s // 128) * b * h >= SMS else 4


@dataclass(frozen=True)
class FlashConfig:
    """The bf16 flash kernel's tiling (kf_attention_fa2_kernel's last template arguments): `flash_config` gives the
    default; benchmarks/attention_probe.py --flash-configs times others against it on the GPU."""

    warps: int  # a block's warps, 16 query rows each; 0: not the flash kernel (the first tensor-core kernel)
    keys: int = 64  # a key tile's rows: 64, or 32 (half the scores' registers and the K and V tiles' shared memory)
    # the warp's query A fragments held in registers over the whole key loop, else read again from shared memory by
    # ldmatrix at each k-step of q kᵀ: (D + 15) / 16 x 4 registers fewer, so that more blocks may fit an SM
    q_in_registers: bool = True
    min_blocks: int = 0  # __launch_bounds__'s blocks an SM, 0: `launch_blocks`'s rule

    def launch_blocks(self, head_dim: int) -> int:
        """Blocks an SM the registers must allow: min_blocks, else 512 threads up to head dim 64 and 256 above (at
        most 128 registers a thread, 255 where the query fragments and the output accumulator need more)."""
        return self.min_blocks or (16 if head_dim <= 64 else 8) // self.warps

    def template_args(self, head_dim: int) -> str:
        """kf_attention_tc's WARPS, BK, QREG and BLOCKS."""
        blocks = self.launch_blocks(head_dim) if self.warps else 0
        return f"{self.warps}, {self.keys}, {str(self.q_in_registers).lower()}, {blocks}"


def flash_config(step: AttnStep, strides: dict[str, tuple[int, ...]]) -> FlashConfig:
    """The bf16 flash kernel's tiling: `flash_warps` warps (0: the flash kernel does not apply), 64-key tiles. The
    query fragments stay in registers up to head dim 64. Above it, up to 96, they are re-read from shared memory at
    128 registers a thread, so that two 8-warp blocks fit an SM instead of one at 196 registers (stop 44, H200,
    minGPT's d96: 0.382 ms against 0.465). Above 96 the 64-key tile spills at 128 registers: the registers stay."""
    warps = flash_warps(step, strides)
    if warps and 64 < step.dims[5] <= 96:
        return FlashConfig(warps, q_in_registers=False, min_blocks=16 // warps)
    return FlashConfig(warps)


def flash_f32_keys(head_dim: int, keys: int) -> int:
    """Keys per tile of the fp32 flash kernel: 64 up to head dim 64, 32 above (its shared tiles, 4 x keys x (D + 4)
    floats beside the query tile's 64 rows, stay near 100 KB at D = 128: two blocks an SM); fewer, in steps of 16,
    where the sequence has fewer keys, so that short sequences (a few tokens per batch row) keep small blocks."""
    return min(64 if head_dim <= 64 else 32, -(-keys // 16) * 16)


def short_rows_tiling(step: AttnStep) -> ShortRows | None:
    """The short-rows form's tiling where it takes the step (kernelfuse.codegen.attention_short)."""
    return short_rows(step, vector_rows(step, input_strides(step)))


def input_strides(step: AttnStep) -> dict[str, tuple[int, ...]]:
    """Element strides over (batch, head, row, col) of q, k, v and the mask, as the kernel reads them."""
    batch = step.dims[0]
    out = {name: strides_of(inp.meta, lambda t, inp=inp: logical_view(t, inp, batch))
           for name, inp in (("q", step.q), ("k", step.k), ("v", step.v))}
    out["mask"] = strides_of(step.mask.meta, lambda t: mask_view(t, step.dims)) if step.mask else (0, 0, 0, 0)
    out["windows"] = strides_of(step.windows.meta, lambda t: window_view(t, step.dims, step.window_count)) \
        if step.windows else (0, 0, 0, 0)
    return out


def render_attention(plan: Plan, step: AttnStep) -> tuple[str, Binding]:
    """(the step's launcher, its Python binding); the kernels are kernelfuse.codegen.attention_prelude's templates.
    A step with a causal guard has two launchers: `{kernel}_launch` with its mask, and `{kernel}_causal_launch`,
    causal without it, which the binding calls once it has checked that the mask is causal."""
    source = _launcher(plan, step, step.kernel)
    if step.causal_guard is not None:
        source += _launcher(plan, step.as_causal(), f"{step.kernel}_causal")
    return source, _binding(plan, step)


def _launcher(plan: Plan, step: AttnStep, name: str) -> str:
    """The C launcher `{name}_launch` of the step's kernel."""
    b, h, hk, s, length, d = step.dims
    ctype = C_TYPES[step.out_meta.dtype]
    tensor_cores = uses_tensor_cores(step)
    # the mask as the kernels read it: bools as bytes, an additive mask in its own dtype (fp32 beside bf16 data under
    # autocast), bf16 as raw bits in the tensor-core kernels
    mask_ctype = "unsigned char" if step.mask is None or step.mask.meta.dtype == torch.bool else \
        C_TYPES[step.mask.meta.dtype]
    mask_type = "unsigned short" if tensor_cores and mask_ctype == "__nv_bfloat16" else mask_ctype
    bq, bk = tile_shape(d)
    strides = input_strides(step)
    arrays = ", ".join("{" + ", ".join(str(x) for x in strides[n]) + "}" for n in ("q", "k", "v", "mask")) + \
        ", {" + ", ".join(str(x) for x in step.out_strides) + "}"
    args = "const void* q, const void* k, const void* v, " + ("const void* mask, " if step.mask else "") + \
        ("const void* windows, " if step.windows else "")
    mask = "mask" if step.mask else "nullptr"
    windows = "windows, {" + ", ".join(str(x) for x in strides["windows"]) + f"}}, {step.window_count}" \
        if step.windows else "nullptr, {0, 0, 0, 0}, 0"
    softcap = ", ".join(float_literal(x) for x in step.softcap) if step.softcap else "0.0f, 0.0f"
    flags = f"{str(step.causal).lower()}, {str(step.empty_nan).lower()}, {str(step.activation == 'relu').lower()}"
    kind = MASK_KINDS[step.mask_kind]
    if tensor_cores and step.out_meta.dtype == torch.float32:
        launch = f"kf_attention_f32tc<{mask_type}, {d}, {kind}, {flags}, {str(step.math == '3xtf32').lower()}, " \
            f"{flash_warps(step, strides)}, {flash_f32_keys(d, length)}>"
    elif tensor_cores:
        launch = f"kf_attention_tc<{mask_type}, {d}, {kind}, {flags}, {flash_config(step, strides).template_args(d)}>"
    else:
        launch = f"kf_attention<{ctype}, {mask_type}, {d}, {bq}, {bk}, {kind}, {flags}>"
    what = ", causal: its mask checked causal" if step.causal and name != step.kernel else ""
    return f"""// {step.kernel}: {step.chain(plan.graph)}  (B={b} H={h} KV heads={hk} S={s} L={length} D={d}{what})
KF_EXPORT cudaError_t {name}_launch({args}void* out, cudaStream_t stream) {{
  const kf_attn_params p = {{q, k, v, {mask}, out, {h}, {h // hk}, {s}, {length}, {arrays},
                            {float_literal(step.scale)}, {windows}, {softcap}}};
{_short_rows_launch(step, mask_type, kind)}  return {launch}(p, {b}, stream);
}}
"""


def _short_rows_launch(step: AttnStep, mask_type: str, kind: int) -> str:
    """The short-rows form's launch before the step's own kernel, where it takes the step (it returns false where
    the bases are not 16-byte aligned or the device's shared memory is short: the step's kernel runs)."""
    short = short_rows_tiling(step)
    if short is None:
        return ""
    b, _, _, s, length, d = step.dims
    args = f"{mask_type}, {d}, {kind}, {str(step.causal).lower()}, {str(step.empty_nan).lower()}, " \
        f"{short.math(step)}, {-(-length // 8)}, {-(-s // 16)}, {short.template_args()}"
    return f"""  cudaError_t error = cudaSuccess;  // the short-rows form (kernelfuse.codegen.attention_short)
  if (kf_attention_short<{args}>(p, {b}, stream, error)) return error;
"""


def _binding(plan: Plan, step: AttnStep) -> Binding:
    """The method `{kernel}(q, k, v[, mask][, windows])`. With a causal guard it also takes `sources`, the
    parameters and buffers the forward computed the mask from, and runs the causal launcher where
    `_KernelLibrary._causal_mask` finds the mask causal (None: a mask of unknown origin, checked at every call)."""
    k = step.kernel
    names = ["q", "k", "v"] + (["mask"] if step.mask else []) + (["windows"] if step.windows else [])
    guarded = step.causal_guard is not None
    params = ", ".join(names) + (", sources=None" if guarded else "")
    lines = [f"# {k}: {step.chain(plan.graph)}  (flash attention)", f"def {k}(self, {params}):"]
    for name, inp in zip(names, step.inputs, strict=True):
        meta = inp.meta
        lines.append(f'    _check({name}, "{k} {name} (%{inp.ref.name})", {py_tuple(meta.shape)}, '
                     f"{py_tuple(meta.stride)}, {meta.dtype})")
    lines.append(f"    out = q.new_empty_strided({py_tuple(step.out_meta.shape)}, {py_tuple(step.out_meta.stride)}, "
                 f"dtype={step.out_meta.dtype})")
    ptrs = ", ".join(f"{n}.data_ptr()" for n in [*names, "out"])
    init = pointer_launcher(k, len(names) + 1)
    if guarded:
        rows, cols = step.dims[3:5]
        lines.append(f'    if self._causal_mask("{k}", mask, sources, "{step.mask_kind}", {rows}, {cols}):')
        lines.append("        # the mask checked causal: the causal kernel (reads no mask, skips the key tiles past "
                     "the diagonal)")
        causal = ", ".join(f"{n}.data_ptr()" for n in ["q", "k", "v", "out"])
        lines.append(f'        self._launch(self._{k}_causal, "{k}", q, {causal})')
        lines.append("        return out")
        init += "\n" + pointer_launcher(f"{k}_causal", 4)
    lines.append(f'    self._launch(self._{k}, "{k}", q, {ptrs})')
    lines.append("    return out")
    return Binding(init, "\n".join(lines))
