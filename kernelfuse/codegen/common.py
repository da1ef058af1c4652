"""What every kernel family shares: C type names, index limits, the broadcast-operand offset expression and the
channels-last memory format's Python name."""

from __future__ import annotations

import torch

from kernelfuse.capture import TensorMeta, contiguous_strides
from kernelfuse.ops import POINTWISE_BY_ATEN, float_literal, render_cuda
from kernelfuse.plan.catselect import SELECT
from kernelfuse.plan.ir import Epilogue, Operand, Program, Window

C_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
INT32_LIMIT = 2**31 - 1


def channels_last_format(meta: TensorMeta) -> str:
    """How Python spells torch's channels-last memory format for a 4-d (NHWC) or 5-d (NDHWC) tensor."""
    return "torch.channels_last_3d" if len(meta.shape) == 5 else "torch.channels_last"


def offset_expr(strides: tuple[int, ...], shape: tuple[int, ...], var: str = "i") -> str:
    """C expression for an operand's element offset at logical (contiguous) output index `i`.

    Adjacent output dimensions whose operand strides chain (or are both broadcast) are merged first, so a
    per-channel bias over NCHW becomes `(i / HW) % C`, a row bias `i % N`, a same-shape operand just `i`.
    """
    out_strides = contiguous_strides(shape)
    groups: list[list[int]] = []  # [size, operand stride, output stride]
    for d, (size, stride) in enumerate(zip(shape, strides, strict=True)):
        if size == 1:
            continue
        if groups:
            last = groups[-1]
            if (stride == 0 and last[1] == 0) or (stride != 0 and last[1] == stride * size):
                last[0] *= size
                last[1] = stride
                last[2] = out_strides[d]
                continue
        groups.append([size, stride, out_strides[d]])
    terms = []
    for g, (size, stride, out_stride) in enumerate(groups):
        if stride == 0:
            continue
        term = var if out_stride == 1 else f"({var} / {out_stride})"
        if g > 0:  # the outermost group needs no modulo: i / out_stride < size already
            term = f"({term} % {size})"
        if stride != 1:
            term = f"{term} * {stride}"
        terms.append(term)
    return " + ".join(terms) if terms else "0"


def invariant_operands(shape: tuple[int, ...], operands: tuple[Operand, ...], run: int) -> tuple[int, ...]:
    """The operands (by number) whose offset is the same for `run` consecutive elements of a contiguous `shape`
    starting at a multiple of `run`: such elements differ only in the shortest run of trailing dims whose size is a
    multiple of `run`, and the operand is broadcast over those. None where the shape has no such run."""
    size, trailing = 1, []
    for d in reversed(range(len(shape))):
        trailing.append(d)
        size *= shape[d]
        if size % run == 0:
            break
    else:
        return ()
    return tuple(j for j, o in enumerate(operands) if all(o.strides[d] == 0 for d in trailing if shape[d] != 1))


def program_lines(program: Program | Epilogue, acc: str, offsets: dict[str, str], names_prefix: str,
                  ind: str, ctype: str = "float", given: dict[str, str] | None = None,
                  index: str | dict[int, str] | None = None) -> list[str]:
    """Statements of a pointwise program as float locals named `{names_prefix}...`; operand i is loaded from the
    pointer `{names_prefix}in{i}_p` at `offsets["in{i}"]` (or is the float expression `given["in{i}"]`, loaded
    already); the value ends in `{names_prefix}result`.

    In a half or bfloat16 kernel the value entering and every statement's result are rounded to that type (a
    statement's own dtype where it has one: a kernel may mix dtypes), as eager rounds each op's output: the
    fused chain then computes eager's values, not more precise ones that differ by an ulp per op (an fp16
    SwiGLU's silu * up, rounded once, missed the float64 rule after the down projection; found by the GPU
    fuzzer). `index`: the element's flat index, or its index along each concatenated dim, where a `cat_select`
    statement picks a branch by it."""
    lines = []
    names = {"acc": acc}
    if ctype != "float":
        lines.append(f"{ind}const float {names_prefix}acc_r = {_rounded(acc, ctype)};")
        names["acc"] = f"{names_prefix}acc_r"
    for i in range(len(program.operands)):
        value = (given or {}).get(f"in{i}") or f"kf_load({names_prefix}in{i}_p[{offsets[f'in{i}']}])"
        lines.append(f"{ind}const float {names_prefix}in{i} = {value};")
        names[f"in{i}"] = f"{names_prefix}in{i}"
    for st in program.statements:
        if st.op == "reshape":  # same flat index: the value is the one it reshapes
            names[st.name] = names[st.args[0]]  # type: ignore[index]
            continue
        if st.op == SELECT:  # the branch the element lies in (each branch's value is already rounded)
            if index is None:
                raise ValueError(f"{st.name}: a concatenation's select outside a flat kernel")
            var = f"{names_prefix}v_{st.name}"
            lines.append(f"{ind}const float {var} = {_select(st.params, [names[a] for a in st.args], index)};  // cat")  # type: ignore[index]
            names[st.name] = var
            continue
        row = POINTWISE_BY_ATEN[st.aten]
        args = [names[a] if isinstance(a, str) else float_literal(a) for a in st.args]
        var = f"{names_prefix}v_{st.name}"
        value = render_cuda(row, args, list(st.params))
        rounding = ctype if st.dtype is None else C_TYPES.get(st.dtype, "float")  # a bool result: 1.0f or 0.0f
        value = value if rounding == "float" else _rounded(value, rounding)
        lines.append(f"{ind}const float {var} = {value};  // {st.aten.split('.')[0]}")
        names[st.name] = var
    lines.append(f"{ind}const float {names_prefix}result = {names[program.result]};")
    return lines


def coordinate(shape: tuple[int, ...], dim: int, index: str) -> str:
    """C expression for the index along `dim` of the element at flat (row-major) index `index` of `shape`."""
    inner = 1
    for size in shape[dim + 1:]:
        inner *= size
    value = index if inner == 1 else f"({index}) / {inner}"
    outer = all(size == 1 for size in shape[:dim])
    return f"({value})" if outer else f"(({value}) % {shape[dim]})"


def window_offset(operand: Operand, index: str) -> str:
    """C expression for a windowed operand's element offset at flat index `index` of its window's shape: the
    other dims as offset_expr has them, the window's dim clamped into the branch (kernelfuse.plan.catselect)."""
    window: Window = operand.window  # type: ignore[assignment]
    strides = list(operand.strides)
    along, strides[window.dim] = strides[window.dim], 0
    rest = offset_expr(tuple(strides), window.shape, index)
    if along == 0:
        return rest
    term = clamped_term(window, along, coordinate(window.shape, window.dim, index))
    return term if rest == "0" else f"{rest} + {term}"


def clamped_term(window: Window, stride: int, c: str) -> str:
    """C expression for a windowed read's offset along its dim (`stride` apart) at coordinate `c` of the
    concatenation: `c` less the branch's offset, clamped into the branch."""
    last = window.offset + window.size >= window.shape[window.dim]  # never past the branch's end
    shifted = f"{c} - {window.offset}" if window.offset else c
    low = f"({c} < {window.offset} ? 0 : {shifted})" if window.offset else c
    clamped = low if last else f"({shifted} >= {window.size - 1} ? {window.size - 1} : {low})"
    return clamped if stride == 1 else f"{clamped} * {stride}"


def _select(params: tuple[object, ...], values: list[str], index: str | dict[int, str]) -> str:
    """C expression choosing among a concatenation's branch values by the element's index along its dim (from the
    flat index, or given per dim)."""
    dim, sizes, shape = params
    c = index[dim] if isinstance(index, dict) else coordinate(shape, dim, index)  # type: ignore[arg-type, index]
    bounds, total = [], 0
    for size in sizes[:-1]:  # type: ignore[index]
        total += size
        bounds.append(total)
    expr = values[-1]
    for bound, value in zip(reversed(bounds), reversed(values[:-1]), strict=True):
        expr = f"({c} < {bound} ? {value} : {expr})"
    return expr


def _rounded(expr: str, ctype: str) -> str:
    """`expr` (a float) rounded to `ctype` and back."""
    return f"kf_load(kf_store<{ctype}>({expr}))"


def apply_function(k: str, epi: Epilogue, ctype: str, index_t: str, hoisted: tuple[int, ...] = ()) -> str:
    """`float k0_apply(float acc, index_t i, operands...)`: the epilogue at logical output index i. With
    `hoisted` operand numbers, `k0_apply_h(..., float in{j}_h...)` instead: those operands come in as values the
    caller loaded once for several elements that share their offset."""
    params = "".join(f", const {ctype}* __restrict__ in{i}_p" for i in range(len(epi.operands)))
    params += "".join(f", float in{j}_h" for j in hoisted)
    offsets = {f"in{i}": offset_expr(o.strides, epi.out.shape) for i, o in enumerate(epi.operands)}
    name = f"{k}_apply_h" if hoisted else f"{k}_apply"
    lines = [f"__device__ __forceinline__ float {name}(float acc, {index_t} i{params}) {{"]
    lines += program_lines(epi, "acc", offsets, "", "  ", ctype, {f"in{j}": f"in{j}_h" for j in hoisted})
    lines += ["  return result;", "}"]
    return "\n".join(lines) + "\n"
