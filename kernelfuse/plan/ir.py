"""The Plan: what runs, in order — library anchors with fused epilogues, and torch calls for everything else.

An epilogue is a tiny SSA program over float values: `acc` (the anchor's result), `in0`, `in1`, ... (other
tensors, broadcast to the output) and earlier statements, each statement one row of the pointwise op table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from kernelfuse.capture import Graph, Node, Ref, TensorMeta, contiguous_strides

EArg = str | float  # a value name ("acc", "in0", a statement name) or a float constant


@dataclass(frozen=True)
class Window:
    """How a tensor read inside a concatenation's branch is indexed (kernelfuse.plan.catselect): the branch holds
    elements [offset, offset + size) along `dim` of the concatenation's `shape`, and the tensor is read at the
    element's index along `dim` less `offset`, clamped into [0, size - 1] (a valid address for every element)."""

    dim: int
    offset: int
    size: int
    shape: tuple[int, ...]  # the concatenation's: a windowed operand's strides are over it (its flat index too)

    @property
    def branch_shape(self) -> tuple[int, ...]:
        return self.shape[:self.dim] + (self.size,) + self.shape[self.dim + 1:]


@dataclass(frozen=True)
class Operand:
    """A tensor the epilogue reads besides the anchor's value, indexed through the output's logical index.

    `strides[d]` is the operand's element stride along output dimension d (0 where it is broadcast); with a
    `window`, along dimension d of the window's shape instead (a read inside a concatenation's branch).
    """

    ref: Ref
    meta: TensorMeta
    strides: tuple[int, ...]
    window: Window | None = None


@dataclass(frozen=True)
class Statement:
    name: str  # the graph node it computes
    # IR op (kernelfuse.ops.pointwise row `ir`), "reshape" (params: the new shape; same flat order), or
    # "cat_select" (a concatenation picking among its branches' values: kernelfuse.plan.catselect)
    op: str
    aten: str  # the ATen overload, to find the table row
    args: tuple[EArg, ...]
    params: tuple[object, ...]
    # the value's dtype (each statement's result is rounded to it, as eager rounds each op's output); None: the
    # program's. A kernel may mix dtypes (a bf16 value added to an fp32 one, a cast), see plan.schedule.
    dtype: torch.dtype | None = None

    def __str__(self) -> str:
        args = ", ".join(a if isinstance(a, str) else repr(a) for a in self.args)
        extra = "".join(f", {p!r}" for p in self.params)
        return f"{self.name} = {self.op}({args}{extra})"


@dataclass(frozen=True)
class Epilogue:
    statements: tuple[Statement, ...]
    operands: tuple[Operand, ...]
    out: TensorMeta

    @property
    def result(self) -> str:
        return self.statements[-1].name if self.statements else "acc"


@dataclass(frozen=True)
class Anchor:
    """A library call: cuBLAS matmul or cuDNN convolution (optionally with cuDNN's fused bias+ReLU)."""

    node: Node
    family: str  # "matmul" | "conv"
    fused_relu: bool = False  # conv: at::cudnn_convolution_relu replaces convolution -> relu
    layout: str = "nchw"  # conv: "nchw", or "nhwc" (channels-last 2-d/3-d conv; the epilogue transposes back)
    tf32: bool = False  # matmul under the tf32 policy: cuBLAS may use TF32 tensor cores for this call
    # conv: cuDNN's TF32 off for this call (eager's NCHW call computes in full fp32 here); a generated anchor:
    # 3xTF32 (fp32 accuracy) rather than TF32
    fp32: bool = False
    # "library" (cuBLAS/cuDNN, the epilogue a kernel of its own) | "generated" (kernelfuse's own kernel with the
    # epilogue inside: kernelfuse.codegen.conv_igemm, or for a matrix product kernelfuse.codegen.gemm_tc) |
    # "direct" (a depthwise convolution's direct kernel, epilogue inside: kernelfuse.codegen.conv_depthwise) |
    # "template" (reserved)
    impl: str = "library"

    @property
    def epilogue_inside(self) -> bool:
        """The epilogue runs in the anchor's own kernel (the anchor's output is written once, already fused)."""
        return self.impl != "library"


@dataclass(frozen=True)
class FusedStep:
    kernel: str  # kernel name in the extension, e.g. "k0"
    anchor: Anchor
    epilogue: Epilogue
    replaces: tuple[str, ...]  # graph nodes this step computes, anchor first
    out: str  # the graph node whose value it produces
    # channels-last anchor whose output stays channels-last (`epilogue.out` has its strides): the one reader, a
    # reduction kernel, reads it through those strides, so no kernel transposes it back
    keeps_layout: bool = False

    @property
    def inplace(self) -> bool:
        """The epilogue overwrites the anchor's fresh output: nothing else reads it (the planner ensured)."""
        return self.anchor.layout == "nchw" and not self.anchor.epilogue_inside

    @property
    def needs_kernel(self) -> bool:
        """A kernel of ours runs: the anchor itself (generated), or an epilogue / layout pass behind the library."""
        return self.anchor.epilogue_inside or bool(self.epilogue.statements) or \
            (self.anchor.layout == "nhwc" and not self.keeps_layout)

    def chain(self, graph: Graph) -> str:
        """The op chain it replaces, for comments and reports: `addmm -> sigmoid -> mul -> add`."""
        return " -> ".join(graph[n].op.split(".")[0] for n in self.replaces)


@dataclass(frozen=True)
class Program:
    """A pointwise SSA program over an iteration space: `acc` is the value entering it (a load of `source`, or
    the reduction's result), `in0`, `in1`, ... are operands with their element strides over `space`."""

    statements: tuple[Statement, ...]
    operands: tuple[Operand, ...]
    space: tuple[int, ...]

    @property
    def result(self) -> str:
        return self.statements[-1].name if self.statements else "acc"


@dataclass(frozen=True)
class GenStep:
    """A generated kernel: load `source` over `spec.space` (or `prologue.space` without a reduction), run the
    prologue, then at most one reduction/normalisation (`spec`, from kernelfuse.ops.reductions), then the
    epilogue over the output; write `out`. `reduce_node` is the ATen node the reduction replaces.

    `mapped` (reduce-then-broadcast of a plain reduction, `x / sqrt(mean(x * x) + eps)`): a program over the
    source's space whose `acc` is the row's value after the epilogue; the kernel writes its result for every
    element of the row instead of the row's value.

    `reads_as`: the dtype a reduction computes in where its prologue widens the source to it (autocast's cast of a
    bf16 activation to fp32 before a LayerNorm or softmax); None: the source's own."""

    kernel: str
    source: Operand
    prologue: Program
    reduce_node: Node | None
    spec: object | None  # kernelfuse.ops.reductions.ReduceSpec (kept untyped here: ops imports capture only)
    epilogue: Program
    out_meta: TensorMeta
    replaces: tuple[str, ...]
    out: str
    mapped: Program | None = None
    reads_as: torch.dtype | None = None

    def chain(self, graph: Graph) -> str:
        return " -> ".join(graph[n].op.split(".")[0] for n in self.replaces if graph[n].op != "getitem")

    @property
    def family(self) -> str:
        if self.spec is None:
            return "pointwise"
        kind = f"{self.spec.kind}"  # type: ignore[attr-defined]
        return f"{kind}-broadcast" if self.mapped is not None else kind

    @property
    def permuted_out(self) -> tuple[int, ...] | None:
        """Eager's strides for a pointwise step's output that kept a permuted layout (an elementwise op on permuted
        operands keeps theirs, and a later view or kernel was captured against it: level-3 Mamba2), or a batch
        norm's over a permuted input (its output keeps the input's layout: the channels-last graph); None where the
        output is contiguous. Only a dense permutation of the iteration space is kept; the kernel's output is
        allocated so, and the interpreter lays its value out the same way."""
        meta = self.out_meta
        kept = self.spec is None or self.spec.kind in ("affine_norm", "norm")  # type: ignore[attr-defined]
        if not kept or meta.stride == contiguous_strides(meta.shape) or not meta.is_dense_permutation:
            return None
        space = tuple(self.prologue.space)
        if tuple(meta.shape) == space:
            return tuple(meta.stride)
        if math.prod(meta.shape) != math.prod(space):
            return None
        try:  # a norm over a regrouped space (N, C, H * W): the output's strides viewed as that space
            strides = tuple(torch.empty_strided(meta.shape, meta.stride, device="meta").view(space).stride())
        except RuntimeError:
            return None
        return strides if TensorMeta(space, meta.dtype, strides).is_dense_permutation else None

    @property
    def out_strides(self) -> tuple[int, ...] | None:
        """The strides the kernel's output is allocated with, over `out_meta.shape`: a permuted flat or norm output
        (`permuted_out`), or a pool's channels-last output over a channels-last source (the channels-last graph
        keeps its pools' outputs so: kernelfuse.codegen.pool writes them in that order); None: contiguous."""
        return self.out_meta.stride if self.permuted_out is not None or self.pools_channels_last else None

    @property
    def pools_channels_last(self) -> bool:
        """A 2-d/3-d pool of an (N, C, spatial...) channels-last source whose output eager laid out channels-last
        too (dense, channel at unit stride), with no reshape in the epilogue."""
        spec, meta = self.spec, self.out_meta
        if spec is None or spec.kind not in ("max_pool", "avg_pool"):  # type: ignore[attr-defined]
            return False
        space, strides = self.prologue.space, self.source.strides
        if len(space) - len(spec.window.kernel) != 2 or len(space) not in (4, 5):  # type: ignore[attr-defined]
            return False
        if tuple(meta.shape) != tuple(self.epilogue.space):  # a reshape after the pool (a flatten to 1-d)
            return False
        source_cl = space[1] > 1 and strides[1] == 1 and any(n > 1 for n in space[2:])
        return source_cl and meta.is_dense_permutation and meta.stride[1] == 1 \
            and meta.stride != contiguous_strides(meta.shape)


@dataclass(frozen=True)
class AttnInput:
    """A tensor the attention kernel reads, as the graph value `ref` holds it; the kernel's (batch, head, row, col)
    view of it is kernelfuse.plan.attention_views.logical_view (heads split from a merged batch, Kᵀ read as K)."""

    ref: Ref
    meta: TensorMeta
    swap: bool = False  # the value holds the last two dims swapped (a hand-written q @ kᵀ hands over kᵀ)


@dataclass(frozen=True)
class AttnStep:
    """One flash-attention kernel: softmax(q kᵀ * scale + mask) v with the softmax computed online, tile by tile,
    so the S x L scores never reach memory (kernelfuse.codegen.attention). Built from an SDPA node or from its
    hand-written form (bmm -> scale -> mask -> softmax -> bmm); `replaces` are all the nodes it computes, the
    copies that fed the bmms included (their layouts are read through strides instead)."""

    kernel: str
    q: AttnInput  # (batch, heads, S, D)
    k: AttnInput  # (batch, kv_heads, L, D)
    v: AttnInput  # (batch, kv_heads, L, D)
    mask: AttnInput | None  # broadcast to (batch, heads, S, L)
    mask_kind: str  # "none" | "keep" (bool, True attends: SDPA) | "drop" (bool, True masked: masked_fill) | "add"
    causal: bool  # keys after the query's position are masked (SDPA is_causal, top-left aligned)
    scale: float
    empty_nan: bool  # a row with every key masked is NaN (softmax of all -inf) rather than zeros (SDPA's)
    dims: tuple[int, int, int, int, int, int]  # batch, heads, kv_heads, S, L, D
    out_meta: TensorMeta
    out_strides: tuple[int, int, int, int]  # element strides of the output over (batch, heads, S, D)
    replaces: tuple[str, ...]
    out: str
    origin: str  # "sdpa" | "hand-written"
    activation: str = "softmax"  # or "relu": relu(scores) @ v without normalisation (ReLU self-attention)
    impl: str = "kernel"  # or "library": one torch SDPA call on the same views (a measured variant; softmax only)
    # fp32 arithmetic: "fma" (exact fp32), "tf32" (the tf32 policy), "3xtf32" (split TF32 on tensor cores: what
    # torch's own fp32 SDPA kernel computes on sm_80+, so only for SDPA nodes under the strict policy)
    math: str = "fma"
    # a second additive mask, periodic over the batch: batch b adds window b % window_count of it, broadcast to
    # (window_count, heads, S, L) (Swin's shifted windows: images x windows merged into the batch); with an
    # additive `mask` of its dtype only
    windows: AttnInput | None = None
    window_count: int = 0
    # Gemma 2's soft cap of the scaled scores, cap * tanh(x / cap), as eager computes it: x times the float 1 / cap,
    # tanh, times cap; (the multiplier inside, the one outside), or None
    softcap: tuple[float, float] | None = None
    # the mask is causal (kernelfuse.plan.attention_views.causal_mask_matches) for the values the planner saw, and
    # is computed from these buffers (and literals) alone: the kernel step runs as causal, reading no mask and
    # skipping the key tiles past the diagonal, once its binding has checked the mask the forward computes (once
    # per version of these buffers); where the check fails, with the mask as planned (`causal` stays False here:
    # the step's own fields are the masked attention). None: no such guard
    causal_guard: tuple[str, ...] | None = None

    @property
    def family(self) -> str:
        return "attention"

    def as_causal(self) -> AttnStep:
        """The step its guard runs where the mask checks causal: causal, no mask."""
        return replace(self, mask=None, mask_kind="none", causal=True, causal_guard=None)

    def chain(self, graph: Graph) -> str:
        ops = [graph[n].op.split(".")[0] for n in self.replaces]
        kept = [o for o in ops if o in ("scaled_dot_product_attention", "bmm", "mul", "tanh", "masked_fill", "add",
                                        "_softmax", "relu")]
        return " -> ".join(kept)

    @property
    def inputs(self) -> tuple[AttnInput, ...]:
        """The tensors the kernel reads, in its launcher's order."""
        return (self.q, self.k, self.v) + ((self.mask,) if self.mask is not None else ()) + \
            ((self.windows,) if self.windows is not None else ())


@dataclass(frozen=True)
class CatInto:
    """A concatenation written into the buffer of the last one of its chain (kernelfuse.plan.catbuffer): the step
    copies only the operands the previous concatenation of the chain did not hold, and its value is the buffer's
    first part along `dim` (the whole buffer for the last one)."""

    buffer: str  # the chain's last concatenation: its value is the buffer
    dim: int
    copies: tuple[tuple[Ref, int], ...]  # the operands copied here, each with its offset along dim
    first: bool  # the chain's first concatenation allocates the buffer


@dataclass(frozen=True)
class TorchStep:
    node: Node
    reason: str  # why it stays a torch call ("view", "reduction: no kernel yet", ...)
    fp32: bool = False  # a convolution of the channels-last graph run with cuDNN's TF32 off (eager's computes in fp32)
    into: CatInto | None = None  # a concatenation laid out in a shared buffer


Step = FusedStep | GenStep | AttnStep | TorchStep


@dataclass(frozen=True)
class Plan:
    graph: Graph
    steps: tuple[Step, ...]
    variant: str
    options: object = None  # the kernelfuse.plan.fuse.PlanOptions that made it: the same plan for another capture
    graphed: bool = False  # the forward is replayed from a CUDA graph (kernelfuse.emit.graphed)
    # the graph the planner was given; `graph` may hold this plan's own layout choices (a kernel writing a
    # channels-last convolution's input, kernelfuse.plan.convinput), so another variant is planned from this one
    source: Graph | None = field(default=None, compare=False, repr=False)

    def as_graphed(self) -> Plan:
        """The same kernels, replayed from a CUDA graph: a variant of its own, judged like the others."""
        return replace(self, graphed=True, variant=f"{self.variant}+graph")

    @property
    def fused(self) -> list[FusedStep]:
        return [s for s in self.steps if isinstance(s, FusedStep)]

    @property
    def generated(self) -> list[GenStep]:
        return [s for s in self.steps if isinstance(s, GenStep)]

    @property
    def attention(self) -> list[AttnStep]:
        return [s for s in self.steps if isinstance(s, AttnStep)]

    @property
    def launches_kernels(self) -> bool:
        """Does the plan run any kernel of its own (an anchor's epilogue, a generated or an attention kernel)?"""
        return bool(self.fused or self.generated or self.attention)

    @property
    def unfused(self) -> list[TorchStep]:
        return [s for s in self.steps if isinstance(s, TorchStep) and s.reason != "view"]

    def summary(self) -> str:
        lines = [f"plan variant: {self.variant}"]
        for s in self.fused:
            lib = {"matmul": "cuBLAS", "conv": "cuDNN"}[s.anchor.family] + (" TF32" if s.anchor.tf32 else "")
            extra = (" conv+bias+relu" if s.anchor.fused_relu else "") + (" fp32" if s.anchor.fp32 else "")
            layout = "" if s.anchor.family != "conv" else " [channels-last graph]" \
                if self.options.channels_last_graph else f" [{s.anchor.layout}]"
            kernel = " + epilogue kernel" if s.needs_kernel else " (read channels-last)" if s.keeps_layout else ""
            if s.anchor.epilogue_inside:
                lib = "direct depthwise fp32" if s.anchor.impl == "direct" else \
                    "generated GEMM 3xTF32" if s.anchor.family == "matmul" else \
                    "generated implicit GEMM" + (" 3xTF32" if s.anchor.fp32 else " TF32")
                kernel = ", epilogue inside"
                extra = ""
            lines.append(f"  fused {s.kernel}: {s.chain(self.graph)}  ({lib}{extra}{layout}{kernel})")
        for g in self.generated:
            lines.append(f"  generated {g.kernel}: {g.chain(self.graph)}  ({g.family} kernel)")
        for a in self.attention:  # no batch size: the CPU check compares this with a small-batch twin's summary
            mask = f", causal ({a.mask_kind} mask verified causal at run time)" if a.causal_guard is not None else \
                f", {a.mask_kind} mask" if a.mask is not None else ""
            extra = (", causal" if a.causal else "") + mask + \
                (f", {a.window_count}-window mask" if a.windows is not None else "") + \
                (", grouped-query" if a.dims[2] != a.dims[1] else "") + (", relu" if a.activation == "relu" else "") + \
                (f", soft cap {a.softcap[1]:g}" if a.softcap else "") + \
                (f", {a.math}" if a.math != "fma" and a.impl == "kernel" else "")
            how = "flash-attention kernel" if a.impl == "kernel" else "torch SDPA call"
            lines.append(f"  attention {a.kernel}: {a.chain(self.graph)}  ({how}, {a.origin}, head dim {a.dims[5]}"
                         f"{extra})")
        for s in self.unfused:
            lines.append(f"  unfused: {s.node.op} ({s.reason})")
        if not self.unfused:
            lines.append("  unfused: none")
        if self.graphed:
            lines.append("  the whole forward replayed from one CUDA graph (one launch per call)")
        return "\n".join(lines)

    def __str__(self) -> str:
        out = [self.summary()]
        for s in self.fused:
            out.append(f"  {s.kernel} epilogue -> {s.epilogue.out}")
            out += [f"    {st}" for st in s.epilogue.statements]
            out += [f"    in{i} = {o.ref} strides={list(o.strides)}" for i, o in enumerate(s.epilogue.operands)]
        return "\n".join(out)
