"""Stage 5 — codegen: CUDA kernels and C++ bindings for a Plan's fused steps."""

from kernelfuse.codegen.cuda import CodegenOptions, CudaSources, generate, offset_expr

__all__ = ["CodegenOptions", "CudaSources", "generate", "offset_expr"]
