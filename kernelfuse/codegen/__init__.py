"""Stage 5 — codegen: CUDA kernels for a Plan's fused steps and the Python binding that calls them."""

from kernelfuse.codegen.common import offset_expr
from kernelfuse.codegen.cuda import CodegenOptions, CudaSources, generate

__all__ = ["CodegenOptions", "CudaSources", "generate", "offset_expr"]
