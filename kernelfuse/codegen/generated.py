"""CUDA for generated kernels (plan GenSteps): the dispatch by family, pointwise kernels and their Python bindings.

Pointwise kernels move 16 bytes per access where the source is contiguous over the space; reductions, softmax and
norms are in kernelfuse.codegen.reduce (their split form over a few long rows in kernelfuse.codegen.split),
pooling in kernelfuse.codegen.pool, scans in kernelfuse.codegen.scan; the shared iteration machinery in kernelfuse.codegen.iteration.
"""

from __future__ import annotations

from kernelfuse.codegen.binding import Binding, pointer_launcher, py_tuple
from kernelfuse.codegen.common import C_TYPES
from kernelfuse.codegen.iteration import (
    AFFINE_TENSORS,
    BLOCK,
    Space,
    decompose,
    epilogue_lines,
    index_type,
    launch_params,
    operand_ctype,
    pack_kinds,
    pointer_params,
    shape_numel,
    space_of,
    tensor_args,
    tensor_dtype,
    value_dtype,
    value_lambda,
    windows_in_space,
)
from kernelfuse.codegen.pool import pool_kernel
from kernelfuse.codegen.reduce import row_kernel, row_strategy, row_workspace
from kernelfuse.codegen.reduce_prelude import REDUCE_PRELUDE
from kernelfuse.codegen.scan import scan_kernel
from kernelfuse.codegen.split import split_chunks, split_kernel, split_workspace
from kernelfuse.codegen.tiled import tiled_launch, tiled_layout_change, tiled_loop
from kernelfuse.ops import float_literal
from kernelfuse.ops.scans import SCAN_KINDS
from kernelfuse.plan.ir import GenStep, Plan

__all__ = ["REDUCE_PRELUDE", "render_generated", "tensor_args"]  # tensor_args: the emitted call passes them


def render_generated(plan: Plan, step: GenStep) -> tuple[str, Binding]:
    """(CUDA kernel + launcher, its Python binding) for one GenStep."""
    ctype = C_TYPES[value_dtype(step)]
    family = _family(step)
    windows = any(o.window is not None for o in (step.source, *step.prologue.operands))
    if windows and (step.spec is not None or (step.permuted_out is not None and not windows_in_space(step))):
        raise ValueError(f"{step.kernel}: a concatenation's branches outside a pointwise kernel over their space")
    if family == "flat":
        body = _flat_kernel(step, ctype)
    elif family == "pool":
        body = pool_kernel(step, ctype)
    elif family == "scan":
        body = scan_kernel(step, ctype)
    elif family == "split":
        body = split_kernel(step, ctype, split_chunks(step))
    else:
        body = row_kernel(step, ctype)
    return f"// {step.kernel}: {step.chain(plan.graph)}\n{body}", _binding(plan, step)


def _family(step: GenStep) -> str:
    """The kernel family a step renders to: flat (pointwise, eval-mode batch norm), pool, scan, split or row."""
    spec = step.spec
    if spec is None or spec.kind == "affine_norm":  # type: ignore[attr-defined]
        return "flat"
    if spec.window is not None:  # type: ignore[attr-defined]
        return "pool"
    if spec.kind in SCAN_KINDS:  # type: ignore[attr-defined]
        return "scan"
    return "split" if split_chunks(step) > 1 else "row"


def keeps_rows_on_chip(step: GenStep) -> bool:
    """Does the step's kernel keep its rows on chip across several blocks (kernelfuse.codegen.onchip)?"""
    return _family(step) == "row" and row_strategy(step)[3] > 0


def workspace_floats(step: GenStep) -> int:
    """Floats of device workspace the step's launcher takes after `out` (0: none)."""
    family = _family(step)
    return split_workspace(step) if family == "split" else row_workspace(step) if family == "row" else 0


def _flat_kernel(step: GenStep, ctype: str) -> str:
    """Pointwise over the whole space (and eval-mode batch norm, an affine map per channel). Where the source is
    contiguous over the space, VEC elements move per access, 16 bytes of the wider of the source's and the
    output's types (the launcher checks alignment); so do the operands that run along the innermost dim with it
    (a channels-last per-channel parameter, a residual), and one that is constant along it (a per-channel
    parameter over NCHW planes) is loaded once per VEC elements (`_packed`)."""
    k = step.kernel
    src_t = operand_ctype(step, "src")  # the output's type, or another where the kernel mixes dtypes
    space = space_of(step, epilogue=True)
    index_t = index_type(step)
    numel = shape_numel(step.prologue.space)
    spec = step.spec
    # a permuted output (channels-last, say) is iterated in its memory order (kernelfuse.codegen.iteration.space_of):
    # its writes, and the reads of a source laid out alike, are contiguous and move VEC elements per access
    # (or a source that runs along the innermost dim with it, as a chunk of a wider tensor does, read at offsets
    # of its own)
    same_layout = space.strides["src"] == space.strides["out"]
    vec = 16 // max(value_dtype(step).itemsize, tensor_dtype(step, "src").itemsize)
    packed = _packed(space, vec)
    vectorised = same_layout or packed.pop("src", None) == "run"
    if not vectorised:
        vec, packed = 1, {}
    tiled = not vectorised and tiled_layout_change(space)  # a layout change: through shared-memory tiles
    packed.pop("src", None)
    given = {name: f"x_{name}" for name in packed}
    element = ["      float y = value_at(i, acc" + "".join(f", x_{n}" for n in packed if n.startswith("in")) + ");"]
    if spec is not None:  # affine_norm: (x - running_mean) / sqrt(running_var + eps) * weight + bias
        extra = [n for n in AFFINE_TENSORS if n in space.strides]
        loaded = [n for n in extra if n not in given]
        element += decompose(space, "k", "i", "a_", loaded, "      ") if loaded else []
        param = {n: given.get(n) or f"kf_load({n}[a_{n}])" for n in extra}
        eps = float_literal(spec.eps)  # type: ignore[attr-defined]
        element.append(f"      y = (y - {param['run_mean']}) * (1.0f / sqrtf({param['run_var']} + {eps}));")
        if "weight" in extra:
            element.append(f"      y = y * {param['weight']};")
        if "bias" in extra:
            element.append(f"      y = y + {param['bias']};")
    element += epilogue_lines(step, "i", "      ", {f"in{n[2:]}": v for n, v in given.items() if n.startswith("ep")})
    element.append("      return e_result;")
    lines = ["template <int VEC>",
             f"__global__ void __launch_bounds__({BLOCK}) {k}_kernel({pointer_params(step, ctype)}) {{",
             f"  typedef {index_t} INDEX;",
             f"  constexpr INDEX NUMEL = {numel};",
             "  {"]
    lines += value_lambda(step, space, "k", None, tuple(n for n in packed if n.startswith("in")))
    lines += [f"    auto element = [&](INDEX i, float acc{''.join(f', float {v}' for v in given.values())}) -> float {{",
              *element, "    };",
              "    const INDEX first = (INDEX)blockIdx.x * blockDim.x + threadIdx.x;",
              "    const INDEX stride = (INDEX)gridDim.x * blockDim.x;"]
    if vectorised:
        lines += ["    for (INDEX v = first; v < NUMEL / VEC; v += stride) {",
                  *(decompose(space, "k", "v * VEC", "b_", [*packed, *([] if same_layout else ["src"])], "      ")
                    if packed or not same_layout else []),
                  *(_pack_line(step, name, kind) for name, kind in packed.items()),
                  f"      const kf_pack<{src_t}, VEC> p = " + (
                      f"reinterpret_cast<const kf_pack<{src_t}, VEC>*>(src)[v];" if same_layout else
                      f"kf_pack_load<{src_t}, VEC>(src + b_src);"),
                  f"      kf_pack<{ctype}, VEC> q;",
                  "#pragma unroll",
                  f"      for (int j = 0; j < VEC; ++j) q.v[j] = kf_store<{ctype}>(element(v * VEC + j, kf_load(p.v[j])"
                  + "".join(f", kf_load(k_{n}.v[j])" if kind == "run" else f", k_{n}" for n, kind in packed.items())
                  + "));",
                  f"      reinterpret_cast<kf_pack<{ctype}, VEC>*>(out)[v] = q;",
                  "    }"]
        if not packed and same_layout:  # (a packed space's numel is a multiple of VEC: no tail)
            lines += ["    for (INDEX i = NUMEL / VEC * VEC + first; i < NUMEL; i += stride)",
                      f"      out[i] = kf_store<{ctype}>(element(i, kf_load(src[i])));"]
    elif tiled:
        lines += tiled_loop(space, ctype)
    else:
        lines += ["    for (INDEX i = first; i < NUMEL; i += stride)",
                  f"      out[i] = kf_store<{ctype}>(element(i, source(i)));"]
    lines += ["  }", "}", ""]
    runs = [_pointer(name) for name, kind in packed.items() if kind == "run"]
    return "\n".join(lines) + _flat_launcher(step, ctype, numel, vec, runs, tiled_launch(space) if tiled else None)


def _packed(space: Space, vec: int) -> dict[str, str]:
    """The tensors a VEC-wide access along the innermost dim reads once per pack ("same") or as one run ("run"),
    by name (`pack_kinds`); the output is written by the kernel's own store."""
    return {name: kind for name, kind in pack_kinds(space, vec).items()
            if name != "out" and not name.startswith(("xc", "xw_"))}  # not the windows' pseudo-tensors


def _pointer(name: str) -> str:
    """The kernel's pointer parameter for tensor `name` of tensor_args."""
    if name.startswith("in"):
        return f"p_{name}_p"
    return f"e_in{name[2:]}_p" if name.startswith("ep") else name


def _pack_line(step: GenStep, name: str, kind: str) -> str:
    ptr, ctype = _pointer(name), operand_ctype(step, name)
    if kind == "same":
        return f"      const float k_{name} = kf_load({ptr}[b_{name}]);"
    return f"      const kf_pack<{ctype}, VEC> k_{name} = kf_pack_load<{ctype}, VEC>({ptr} + b_{name});"


def _flat_launcher(step: GenStep, ctype: str, numel: int, vec: int, runs: list[str],
                   config: tuple[str, str] | None = None) -> str:
    """VEC-wide where the source, the output and the packed runs (`runs`: their kernel pointer names, which are
    the launcher's own but for the program operands') are 16-byte aligned, else one element at a time. `config`:
    the grid's declaration and the launch configuration where they are not a grid-stride loop's
    (kernelfuse.codegen.tiled)."""
    k = step.kernel
    params, args = launch_params(step, ctype)
    names = {_pointer(n): n for n, _ in tensor_args(step)}
    aligned = " && ".join(f"((uintptr_t){p} % 16 == 0)" for p in ["src", "out", *(names[r] for r in runs)])
    declare, chevrons = config or ("", f"<<<kf_blocks({numel}LL / {{VEC}}, {BLOCK}), {BLOCK}, 0, stream>>>")
    launch = f"{declare}{k}_kernel<{{VEC}}>{chevrons}({args}, ({ctype}*)out);"
    body = f"  if ({aligned})\n    {launch.format(VEC=vec)}\n  else\n    {launch.format(VEC=1)}" if vec > 1 \
        else f"  {launch.format(VEC=1)}"
    return f"""
KF_EXPORT cudaError_t {k}_launch({params}, void* out, cudaStream_t stream) {{
{body}
  return cudaGetLastError();
}}
"""


def _binding(plan: Plan, step: GenStep) -> Binding:
    """The `_Kernels` method: check each tensor's layout, allocate out (and the workspace), launch."""
    k = step.kernel
    args = tensor_args(step)
    metas = {name: plan.graph[ref].meta for name, ref in args}  # type: ignore[index]
    metas["src"] = step.source.meta  # the layout the kernel reads (a channels-last convolution's, say)
    lines = [f"# {k}: {step.chain(plan.graph)}",
             f"def {k}(self, {', '.join(name for name, _ in args)}):"]
    for name, ref in args:
        meta = metas[name]
        lines.append(f'    _check({name}, "{k} {name} (%{ref.name})", {py_tuple(meta.shape)}, {py_tuple(meta.stride)}, '  # type: ignore[attr-defined]
                     f"{tensor_dtype(step, name)})")  # the type its pointer has in the kernel
    strides = step.out_strides
    # out is allocated from src: its dtype is named wherever src's differs (an argmax's int64; a pointwise kernel
    # adding an fp32 residual to a bf16 source writes fp32)
    of_dtype = "" if step.out_meta.dtype == tensor_dtype(step, "src") else f", dtype={step.out_meta.dtype}"
    if strides:  # eager's permuted layout, which later views and kernels were captured against
        lines.append(f"    out = src.new_empty_strided({py_tuple(step.out_meta.shape)}, {py_tuple(strides)}{of_dtype})")
    else:
        lines.append(f"    out = src.new_empty({py_tuple(step.out_meta.shape)}{of_dtype})")
    ptrs = "".join(f"{name}.data_ptr(), " for name, _ in args) + "out.data_ptr()"
    workspace = workspace_floats(step)
    if workspace:  # a split kernel's partial results, a split norm's statistics, an on-chip row kernel's partials
        lines.append(f"    work = src.new_empty({workspace}, dtype=torch.float32)")
        ptrs += ", work.data_ptr()"
    lines.append(f'    self._launch(self._{k}, "{k}", src, {ptrs})')
    lines.append("    return out")
    return Binding(pointer_launcher(k, len(args) + 1 + bool(workspace)), "\n".join(lines))

