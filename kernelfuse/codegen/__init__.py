"""Stage 5 — codegen: CUDA kernels and C++ bindings for a Plan's fused steps."""

from kernelfuse.codegen.common import offset_expr
from kernelfuse.codegen.cuda import CodegenOptions, CudaSources, generate

__all__ = ["CodegenOptions", "CudaSources", "generate", "offset_expr"]
