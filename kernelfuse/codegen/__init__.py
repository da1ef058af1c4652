"""Stage 5 — codegen: CUDA kernels for a Plan's fused steps and the Python binding that calls them."""

from kernelfuse.codegen.common import offset_expr
from kernelfuse.codegen.cuda import CodegenOptions, CudaSources, generate
from kernelfuse.codegen.dryrun import BindingMismatch, check_bindings, generate_checked

__all__ = ["BindingMismatch", "CodegenOptions", "CudaSources", "check_bindings", "generate", "generate_checked",
           "offset_expr"]
