"""Which matrix products kernelfuse's own GEMM takes (kernelfuse.codegen.gemm_tc), and the graph change that lets it
take a weight stored K x N: the planner's side of the generated GEMM, as `igemm_refusal` is the convolution's."""

from __future__ import annotations

from dataclasses import replace

import torch

from kernelfuse.capture import Graph, Node, Ref, TensorMeta
from kernelfuse.plan.layout import fresh_name


def gemm_operands(node: Node) -> tuple[object, object, object]:
    """(bias or None, x, wᵀ) of an addmm or mm node."""
    if node.op == "addmm.default":
        return node.positional[0], node.positional[1], node.positional[2]
    return None, node.positional[0], node.positional[1]


def gemm_refusal(graph: Graph, node: Node, weight: TensorMeta | None = None) -> str:
    """Why this matrix product cannot run as the generated 3xTF32 GEMM ('' when it can); `weight`: the second
    operand's layout to judge instead of the graph's (as k_contiguous_weights would make it)."""
    if node.op not in ("addmm.default", "mm.default") or node.meta is None:
        return "not a 2-d matrix product (addmm or mm)"
    if node.keywords and any(node.keywords.get(k, 1) != 1 for k in ("beta", "alpha")):
        return "addmm with beta or alpha other than 1"
    bias, x, wt = gemm_operands(node)
    metas = [graph[x].meta, weight or graph[wt].meta]
    if any(m is None or m.dtype != torch.float32 for m in [*metas, node.meta]):
        return "not fp32 (the generated GEMM keeps fp32 accuracy with 3xTF32; other dtypes stay cuBLAS's)"
    (m, k), (k2, n) = metas[0].shape, metas[1].shape
    if metas[0].stride != (k, 1) or metas[1].stride != (1, k2):
        return "operands not K-contiguous (x row-major and the weight read through .t(), as a Linear's)"
    if k % 4 or m * n == 0:
        return "K not a multiple of 4 (16-byte rows) or an empty output"
    if bias is not None:
        b = graph[bias].meta
        if b is None or b.shape != (n,) or b.dtype != torch.float32 or b.stride != (1,):
            return "a bias other than one fp32 vector of the output's columns"
    if m * n > 2**31 - 1 or m * k > 2**31 - 1 or n * k > 2**31 - 1:
        return "an operand or the output over 2^31 elements"
    return ""


def k_contiguous_weights(graph: Graph) -> Graph:
    """`graph` with each fp32 matrix product whose weight is a parameter or buffer stored K x N row-major (GPT-2's
    Conv1D, `x @ W`) reading it as `W.t().contiguous().t()`: the same values, K-contiguous as the generated GEMM
    reads its weight. The copy depends on the weight alone, so the emitted file makes it once per weight version
    (kernelfuse.emit.hoist), not in every forward. Unchanged where there is no such product."""
    names = {n.name for n in graph.nodes}
    nodes: list[Node] = []
    views: dict[str, Ref] = {}  # weight -> its K-contiguous view (one copy per weight, however many products read it)
    for node in graph.nodes:
        weight = _row_major_weight(graph, node)
        if weight is None:
            nodes.append(node)
            continue
        if weight.name not in views:
            meta = graph[weight].meta
            k, n = meta.shape
            swapped, copy, view = (fresh_name(f"{weight.name}_{tag}", names) for tag in ("nk", "nk_copy", "kn"))
            nodes += [Node(swapped, "t.default", (weight,), replace(meta, shape=(n, k), stride=(1, n))),
                      Node(copy, "clone.default", (Ref(swapped), ("kw", "memory_format", torch.contiguous_format)),
                           replace(meta, shape=(n, k), stride=(k, 1))),
                      Node(view, "t.default", (Ref(copy),), replace(meta, shape=(k, n), stride=(1, k)))]
            views[weight.name] = Ref(view)
        args = list(node.args)
        args[len(args) - len(node.keywords) - 1] = views[weight.name]  # mat2: the last positional argument
        nodes.append(replace(node, args=tuple(args)))
    if not views:
        return graph
    return graph.rebuilt(nodes)


def _row_major_weight(graph: Graph, node: Node) -> Ref | None:
    """The weight of an fp32 addmm/mm that reads a parameter or buffer stored K x N row-major, where the generated
    GEMM could take the product once that weight is K-contiguous; else None."""
    if node.op not in ("addmm.default", "mm.default"):
        return None
    w = gemm_operands(node)[2]
    if not isinstance(w, Ref) or graph[w].op not in ("param", "buffer") or graph[w].meta is None:
        return None
    meta = graph[w].meta
    if len(meta.shape) != 2 or not meta.is_contiguous:
        return None
    k, n = meta.shape
    return w if not gemm_refusal(graph, node, replace(meta, stride=(1, k))) else None
