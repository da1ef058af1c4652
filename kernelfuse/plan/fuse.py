"""Build Plans from a Graph: each library anchor takes the pointwise ops behind it as a fused epilogue.

Fusion is greedy and conservative: a pointwise node joins an anchor's epilogue when its output has the anchor's
shape and dtype, and every tensor it reads is either already in the epilogue or computed before it (a bias, an
input, a parameter). An epilogue member whose value is needed outside the epilogue (another user, a graph
output) ends the epilogue before it. Every refusal keeps the node as a torch call with its reason.
The choice of anchors and of what joins their epilogues is kernelfuse.plan.anchors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernelfuse.capture import Graph, Node
from kernelfuse.ops import ANCHOR_OPS, POINTWISE_BY_ATEN, VIEW_OPS
from kernelfuse.ops.anchors import family_of
from kernelfuse.ops.kept import KEPT_AS_TORCH
from kernelfuse.plan.anchors import anchor_supported, channels_last_conv_relu, channels_last_ok, fuse_behind
from kernelfuse.plan.attention import attention_steps
from kernelfuse.plan.catbuffer import looked_through, shared_cat_buffers
from kernelfuse.plan.conv import igemm_refusal, tap_major_weights
from kernelfuse.plan.convinput import channels_last_into_convs
from kernelfuse.plan.gemm import k_contiguous_weights
from kernelfuse.plan.ir import (
    FusedStep,
    GenStep,
    Plan,
    Step,
    TorchStep,
)
from kernelfuse.plan.layout import channels_last_graph
from kernelfuse.plan.merge import merge_into_reductions
from kernelfuse.plan.schedule import schedule

KEPT_REASON = "kept as a torch call: a kernel over it failed to plan or generate (see the fallbacks)"
CAT_REASON = "concatenation into a buffer it shares with the later ones that extend it: copies its new operands"
CL_REASON = "kept as a torch call in the channels-last graph: its kernel writes only the contiguous layout"


@dataclass(frozen=True)
class PlanOptions:
    """Planner knobs. `max_fusions` caps how many kernels the plan fuses, anchor epilogues first, then generated
    kernels in graph order (`--max-fusions N`: bisect a numerical failure to the one fusion that causes it)."""

    conv_layout: str = "nhwc"  # "nhwc" | "nchw": the layout of every 2-d/3-d convolution not in conv_layouts
    conv_layouts: tuple[tuple[str, str], ...] = ()  # (convolution node, layout) pairs chosen by measurement
    fp32_convs: tuple[str, ...] = ()  # channels-last convolutions to run with cuDNN's TF32 off (eager's does)
    cudnn_fused_relu: bool = True
    matmul_tf32: bool = False  # the tf32 policy: matrix products on TF32 tensor cores
    max_fusions: int | None = None
    generated: bool = True  # generated kernels (pointwise chains, reductions, norms) besides anchor epilogues
    # nodes that stay torch calls: a kernel over them failed to plan or generate (the pipeline's fallback), so the
    # re-made plan fuses everything else as before
    keep: tuple[str, ...] = ()
    # attention (SDPA and its hand-written form, kernelfuse.plan.attention): "kernel" (our flash-attention kernel),
    # "library" (one torch SDPA call on the same strided views: cuDNN/flash/efficient kernels), "split" (our kernel,
    # hand-written fp32 attention too in 3xTF32 on tensor cores, as torch's fp32 SDPA computes), or "off"
    attention: str = "kernel"
    # "generated": eligible convolutions run kernelfuse's own kernels, epilogue inside (the implicit GEMM; a
    # depthwise one the direct kernel); "direct": the depthwise ones only, the rest stay library calls
    conv_impl: str = "library"
    # plan the channels-last graph (kernelfuse.plan.layout): activations stay channels-last between convolutions,
    # which run as plain torch calls; kernels read and write the graph's strides
    channels_last_graph: bool = False
    # "generated": fp32 matrix products (a Linear's addmm/mm) run kernelfuse's 3xTF32 GEMM on tensor cores with the
    # epilogue inside (kernelfuse.codegen.gemm_tc); "library": cuBLAS, the epilogue a kernel of its own
    gemm_impl: str = "library"
    # concatenations that extend one another write into one buffer (kernelfuse.plan.catbuffer)
    share_cat_buffers: bool = True


def plan_variants(graph: Graph, precision: str = "strict", max_fusions: int | None = None,
                  conv_layouts: dict[str, str] | None = None, fp32_convs: frozenset[str] = frozenset(),
                  keep: frozenset[str] = frozenset()) -> list[Plan]:
    """The fused plans worth judging, best first. With `conv_layouts` (each convolution's layout, measured on the
    GPU by kernelfuse.bench.layout): the plan they give, then the all-NCHW plan as its fallback. Otherwise one
    plan per layout when the graph has a 2-d or 3-d convolution (channels-last first: cuDNN's faster layout for
    most fp32 convolutions on Hopper). Either way the channels-last graph's plan comes last, where the graph has
    one (`_channels_last_plans`).

    Under the tf32 policy matrix products may run on TF32 tensor cores (cuDNN convolutions already do by default).
    The nodes in `keep` stay torch calls in every plan.
    """
    tf32 = precision == "tf32"
    kept = tuple(sorted(keep))
    channels_last = _channels_last_plans(graph, PlanOptions(conv_layout="nchw", matmul_tf32=tf32,
                                                            fp32_convs=tuple(sorted(fp32_convs)),
                                                            max_fusions=max_fusions, keep=kept))
    if conv_layouts is not None:
        options = PlanOptions(conv_layouts=tuple(sorted(conv_layouts.items())), fp32_convs=tuple(sorted(fp32_convs)),
                              matmul_tf32=tf32, max_fusions=max_fusions, keep=kept)
        measured = make_plan(graph, options)
        fallback = make_plan(graph, PlanOptions(conv_layout="nchw", matmul_tf32=tf32, max_fusions=max_fusions,
                                                keep=kept))
        return _with_library_attention(graph, [measured] if fallback.summary() == measured.summary()
                                       else [measured, fallback]) + channels_last
    has_conv = any(channels_last_ok(graph, n) for n in graph.nodes)
    layouts = ("nhwc", "nchw") if has_conv else ("nchw",)
    return _with_library_attention(graph, [make_plan(graph, PlanOptions(conv_layout=layout, matmul_tf32=tf32,
                                                                        max_fusions=max_fusions, keep=kept))
                                           for layout in layouts]) + channels_last


def _channels_last_plans(graph: Graph, options: PlanOptions) -> list[Plan]:
    """The plan of the channels-last graph (and its library-attention twin), after the others: the judge decides
    whether keeping activations channels-last beats converting around each convolution. None where there is no
    such graph (kernelfuse.plan.layout.channels_last_graph)."""
    if channels_last_graph(graph) is None:
        return []
    cl = replace(options, channels_last_graph=True)
    return [make_plan(graph, cl), *_library_twin(graph, cl)]


def _library_twin(graph: Graph, options: PlanOptions) -> list[Plan]:
    """The plan with each attention one torch SDPA call, where one is: a step torch's SDPA cannot take (an fp32
    mask beside bf16 scores, a window mask) keeps the kernel, and a twin without any call would repeat its plan."""
    twin = make_plan(graph, replace(options, attention="library"))
    return [twin] if any(a.impl == "library" for a in twin.attention) else []


def _with_library_attention(graph: Graph, plans: list[Plan]) -> list[Plan]:
    """After the plans, their twins with hand-written fp32 attention on 3xTF32 tensor cores (the arithmetic of
    torch's own fp32 SDPA kernel, not eager's exact FMA: the judge's accuracy rule decides), then their twins with
    each attention one torch SDPA call (its tensor-core backends) instead of our kernel; the faster ships."""
    ours = [p for p in plans if isinstance(p.options, PlanOptions)]
    split = [make_plan(graph, replace(p.options, attention="split")) for p in ours
             if any(a.origin == "hand-written" and a.math == "fma" and a.out_meta.dtype == torch.float32
                    and a.dims[5] % 8 == 0 and a.dims[5] <= 128 for a in p.attention)]  # tensor cores can take it
    library = [twin for p in ours for twin in _library_twin(graph, p.options)]
    return plans + split + library


def optimizer_variants(graph: Graph, precision: str = "strict", max_fusions: int | None = None,
                       conv_layouts: dict[str, str] | None = None, fp32_convs: frozenset[str] = frozenset(),
                       keep: frozenset[str] = frozenset()) -> list[Plan]:
    """Every variant the optimizer judges: the library-anchor plans of `plan_variants`, then the implicit-GEMM one.
    `conv_layouts`: each convolution's layout as timed on this GPU (None: not measured), `fp32_convs`: those eager
    computes in full fp32; an unmeasured convolution's implicit GEMM keeps fp32 accuracy."""
    library = plan_variants(graph, precision, max_fusions, conv_layouts, fp32_convs, keep)
    owned = owned_anchor_variants(graph, precision, max_fusions, fp32_convs, keep, frozenset(conv_layouts or {}))
    return library + owned + direct_variants(library[0], owned) + gemm_variants(library, precision)


def gemm_variants(library: list[Plan], precision: str) -> list[Plan]:
    """The first library plan, the first with torch's SDPA for its attention (its `-sdpa` twin), the first with
    hand-written attention on 3xTF32 tensor cores (`-3xtf32`) and the channels-last graph's plan (`fused-cl`), each
    with its fp32 matrix products run by kernelfuse's 3xTF32 GEMM, epilogue inside. Strict policy only: under tf32
    cuBLAS's TF32 kernels are faster than any 3xTF32 one. None where no product qualifies (gemm_refusal). The judge
    decides whether they beat cuBLAS's SGEMM on these shapes (level-3 44 at stop 54: our GEMM made 1.42x compile,
    our 3xTF32 attention 1.07x more, and until then no variant held both)."""
    if precision != "strict":
        return []
    ours = [p for p in library if isinstance(p.options, PlanOptions)]
    bases = [p for p in ours if not p.options.channels_last_graph]
    twins = [[p for p in bases[1:] if p.options.attention == kind][:1] for kind in ("library", "split")]
    channels_last = [p for p in ours if p.options.channels_last_graph][:1]  # ConvNeXt's Linears on NHWC maps
    found = []
    for base in bases[:1] + twins[0] + twins[1] + channels_last:
        plan = make_plan(base.source or base.graph, replace(base.options, gemm_impl="generated"))
        if any(s.anchor.family == "matmul" and s.anchor.epilogue_inside for s in plan.fused):
            found.append(plan)
    return found


def direct_variants(best_library: Plan, owned: list[Plan]) -> list[Plan]:
    """The first library plan with its depthwise convolutions run by the direct kernel, the rest as it planned them
    (cuDNN at their measured layouts): for models whose regular convolutions cuDNN wins but whose depthwise ones it
    runs far from the memory floor. None where the owned-anchor plan already is exactly that (every convolution
    depthwise) or there is no depthwise one."""
    if not isinstance(best_library.options, PlanOptions) or \
            not any(s.anchor.impl == "generated" for p in owned for s in p.fused):
        return []
    plan = make_plan(best_library.source or best_library.graph, replace(best_library.options, conv_impl="direct"))
    return [plan] if any(s.anchor.impl == "direct" for s in plan.fused) else []


def owned_anchor_variants(graph: Graph, precision: str = "strict", max_fusions: int | None = None,
                          fp32_convs: frozenset[str] = frozenset(), keep: frozenset[str] = frozenset(),
                          measured: frozenset[str] = frozenset()) -> list[Plan]:
    """The plan whose eligible convolutions run kernelfuse's implicit GEMM with the epilogue inside (a variant the
    judge measures against the library plans of `plan_variants`), or none where no convolution is eligible.
    `measured`: convolutions whose cuDNN arithmetic was measured on this GPU; `fp32_convs`: those of them eager
    computes in full fp32. TF32 only where eager was measured to use it: an unmeasured convolution (no GPU timing;
    kernelfuse.bench.layout times 1-d ones too, NCHW only) gets fp32 accuracy (3xTF32), as cuDNN often computes
    small ones exactly."""
    convs = [node for node in graph.nodes if node.op in ANCHOR_OPS and ANCHOR_OPS[node.op] == "conv"]
    if not any(not igemm_refusal(graph, node) and node.name not in keep for node in convs):
        return []
    exact = set(fp32_convs) | {node.name for node in convs if node.name not in measured}
    options = PlanOptions(conv_layout="nchw", fp32_convs=tuple(sorted(exact)), cudnn_fused_relu=False,
                          matmul_tf32=precision == "tf32", max_fusions=max_fusions, conv_impl="generated",
                          keep=tuple(sorted(keep)))
    plan = make_plan(graph, options)
    return [plan] if any(s.anchor.epilogue_inside for s in plan.fused) else []


def torch_calls_plan(graph: Graph) -> Plan:
    """The captured graph with every node a torch call: no fusion, no generated kernel (a reference to check and
    count against, and what ships unfused when the captured graph differs from the module: autocast's casts)."""
    return make_plan(graph, PlanOptions(max_fusions=0, generated=False))


def make_plan(graph: Graph, options: PlanOptions = PlanOptions()) -> Plan:
    """Anchors take their pointwise epilogues; the scheduler turns the rest into generated kernels; an anchor's
    epilogue whose only reader is a reduction kernel moves into that kernel's prologue (one pass, not two)."""
    captured = graph
    if options.channels_last_graph:
        changed = channels_last_graph(graph)
        assert changed is not None, "plan_variants asks for the channels-last plan only where the graph has one"
        graph = changed
    if options.gemm_impl == "generated":
        graph = k_contiguous_weights(graph)
    if options.conv_impl == "generated" and options.generated:
        graph = tap_major_weights(graph, frozenset(options.fp32_convs) | frozenset(options.keep))
    graph, into = shared_cat_buffers(graph) if options.share_cat_buffers else (graph, {})
    fused: dict[str, FusedStep] = {}  # output node name -> step
    kept = set(options.keep)
    attention, reasons = attention_steps(graph, 0, library=options.attention == "library", tf32=options.matmul_tf32,
                                         split=options.attention == "split") \
        if options.generated and options.attention != "off" else ([], {})
    attention = [a for a in attention if not kept.intersection(a.replaces)]  # a kept node stays a torch call
    attention = attention[:options.max_fusions]  # attention first: its bmms are no anchors of their own
    absorbed: set[str] = set(kept) | {name for step in attention for name in step.replaces}  # one kernel at most
    for node in graph.nodes:
        if node.name in absorbed or node.op not in ANCHOR_OPS or node.meta is None:
            continue
        if options.max_fusions is not None and len(fused) + len(attention) >= options.max_fusions:
            break
        ok, _ = anchor_supported(graph, node)
        if ok:
            step = fuse_behind(graph, node, options, f"k{len(fused)}", absorbed)
        else:
            step = channels_last_conv_relu(graph, node, options, f"k{len(fused)}", absorbed)
        if step is None:
            continue
        fused[step.out] = step
        absorbed.update(step.replaces)
    cap = None if options.max_fusions is None else max(options.max_fusions - len(fused) - len(attention), 0)
    # a concatenation laid out in a shared buffer stays the torch call that copies into it, and one whose operands
    # such a call copies stays a torch call too: never a kernel's select (kernelfuse.plan.catselect)
    buffered = set(into) | looked_through(graph, into)
    gens, gen_reasons = schedule(graph, absorbed | buffered, len(fused), cap) if options.generated else ([], {})
    held: set[str] = set()
    while options.channels_last_graph and (wrong := [g for g in gens if _other_layout(g)]):
        # the kernel would write another layout than the graph's (a pooling): its op stays a torch call, and the
        # pointwise ops it had taken in are scheduled again without it (into the norm before it, say)
        for gen in wrong:
            held.update([gen.reduce_node.name] if gen.reduce_node is not None else gen.replaces)
        gens, gen_reasons = schedule(graph, absorbed | held | buffered, len(fused), cap)
    reasons.update(gen_reasons)
    reasons.update(dict.fromkeys(held, CL_REASON))
    reasons.update(dict.fromkeys(kept, KEPT_REASON))
    by_out: dict[str, Step] = dict(fused)
    by_out.update((step.out, step) for step in attention)
    for gen in gens:
        by_out[gen.out] = gen
    merge_into_reductions(graph, by_out)
    for name, step in list(by_out.items()):
        if isinstance(step, FusedStep) and step.anchor.layout == "nhwc" and not step.epilogue.statements \
                and not step.keeps_layout and not step.anchor.fused_relu:
            del by_out[name]  # a lone channels-last convolution no reduction reads: the plain torch call is as good
    if not options.channels_last_graph:
        graph = channels_last_into_convs(graph, by_out)
    done = {name for step in by_out.values() for name in step.replaces}
    steps: list[Step] = []
    for node in graph.nodes:
        if node.name in by_out:
            steps.append(by_out[node.name])
        elif node.name not in done and node.op not in ("input", "param", "buffer"):
            fp32 = options.channels_last_graph and node.op == "convolution.default" \
                and node.name in options.fp32_convs
            reason = CAT_REASON if node.name in into else reasons.get(node.name) or _unfused_reason(graph, node, done)
            steps.append(TorchStep(node, reason, fp32, into.get(node.name)))
    if len({s.node.name for s in steps if isinstance(s, TorchStep) and s.into is not None}) != len(into):
        return make_plan(captured, replace(options, share_cat_buffers=False))  # a kernel took one in: no sharing
    layouts = sorted({s.anchor.layout for s in steps if isinstance(s, FusedStep) and s.anchor.family == "conv"
                      and not s.anchor.epilogue_inside                      and channels_last_ok(graph, s.anchor.node)})
    variant = f"fused-{'+'.join(layouts)}" if layouts else "fused"
    if options.channels_last_graph:
        variant = "fused-cl"
    conv_impls = {s.anchor.impl for s in steps if isinstance(s, FusedStep) and s.anchor.family == "conv"}
    if "generated" in conv_impls:
        variant = "fused-igemm"
    elif "direct" in conv_impls:
        variant += "-direct"
    if any(isinstance(s, FusedStep) and s.anchor.family == "matmul" and s.anchor.epilogue_inside for s in steps):
        variant += "-tcgemm"
    if options.matmul_tf32 and any(isinstance(s, FusedStep) and s.anchor.tf32 for s in steps):
        variant += "-tf32"
    if options.attention == "library" and attention:
        variant += "-sdpa"
    if options.attention == "split" and attention:
        variant += "-3xtf32"
    return Plan(graph, tuple(steps), variant, options, source=captured)


def _other_layout(gen: GenStep) -> bool:
    """Does the kernel write its output in another layout than the graph holds (its kernels write contiguous
    outputs, permuted pointwise and norm ones, and channels-last pools of channels-last sources only)?"""
    return not gen.out_meta.is_dense_contiguous and gen.out_strides is None


def _unfused_reason(graph: Graph, node: Node, fused: set[str]) -> str:
    """Why `node` stays a torch call (`fused`: the nodes the plan's kernels took)."""
    if node.op in VIEW_OPS:
        return "view"
    if node.op == "constant":
        return "a tensor forward makes from literals, written into the file"
    family = family_of(node.op)
    if node.op in ANCHOR_OPS:
        ok, why = anchor_supported(graph, node)
        if ok and any(r in fused and graph[r].op in POINTWISE_BY_ATEN for r in _readers_behind_views(graph, node.name)):
            return "library call; the generated kernel reading it through a view runs its epilogue"
        return "library call, nothing to fuse behind it" if ok else f"library call: {why}"
    if node.op in POINTWISE_BY_ATEN:
        return "pointwise op not fused: no library call before it, or its input is needed elsewhere"
    return KEPT_AS_TORCH.get(node.op) or f"{family}: no kernel yet"


def _readers_behind_views(graph: Graph, name: str) -> list[str]:
    """The nodes, views excepted, reading `name`'s value through one or more views."""
    views = [u.name for u in graph.users(name) if u.op in VIEW_OPS]
    return [u.name for v in views for u in graph.users(v) if u.op not in VIEW_OPS] + \
        [r for v in views for r in _readers_behind_views(graph, v)]
