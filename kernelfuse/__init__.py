"""kernelfuse: a PyTorch model in, a verified faster ModelNew built from fused CUDA kernels out.

Pipeline (one subpackage per stage, data flows one way): load -> capture -> rewrite -> plan -> codegen -> emit
-> build -> verify -> bench, with `judge` wrapping verify and bench in an isolated child process.
"""

__version__ = "0.1.0"
