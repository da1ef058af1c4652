"""The kernels' Python side: checks, output allocation and launches through ctypes, so no C++ binding is compiled.

The kernel file builds as a plain shared library whose launchers are `extern "C"` (KF_EXPORT); the emitted
`_Kernels` class calls them through ctypes. Each of its methods checks every tensor against the layout the kernels
were built for (a mismatch raises, never a wrong result), allocates the output with torch's allocator and launches
on torch's current stream. Compiling a torch-facing C++ binding took about 10 of a cold build's 12 seconds
(benchmarks/results/build_speed_*_h100.log); this Python costs a few microseconds per call instead.

The helpers below are copied into the emitted file (it imports nothing from kernelfuse) by `runtime_source`, so
what the tests run here is what the file runs.
"""

from __future__ import annotations

import ctypes
import inspect
from dataclasses import dataclass

import torch

from kernelfuse.plan.attention_views import causal_mask_matches


def _layout_error(t, what, shape, strides, dtype):
    """The message of a failed check: what differs from the layout the kernel was built for."""
    if tuple(t.shape) != tuple(shape):
        return f"kernelfuse: {what} has shape {list(t.shape)}, the kernel was built for {list(shape)}"
    if strides is not None:
        return f"kernelfuse: {what} has strides {list(t.stride())}, the kernel was built for {list(strides)}"
    if t.dtype != dtype:
        return f"kernelfuse: {what} has dtype {t.dtype}, expected {dtype}"
    return f"kernelfuse: {what} must be a CUDA tensor"


def _check(t, what, shape, strides, dtype):
    """Raise ValueError unless `t` is a CUDA tensor of `dtype` and `shape` laid out with `strides` (a dimension of
    size 1 may have any stride): the kernel reads it through exactly these strides."""
    if t.shape != shape or (t.stride() != strides and any(
            n != 1 and s != e for n, s, e in zip(shape, t.stride(), strides, strict=True))):
        raise ValueError(_layout_error(t, what, shape, strides, dtype))
    if t.dtype != dtype or not t.is_cuda:
        raise ValueError(_layout_error(t, what, shape, None, dtype))


def _check_dense(t, what, shape, dtype, memory_format=torch.contiguous_format):
    """Raise ValueError unless `t` is a CUDA tensor of `dtype` and `shape`, dense in `memory_format`."""
    if t.shape != shape:
        raise ValueError(_layout_error(t, what, shape, None, dtype))
    if not t.is_contiguous(memory_format=memory_format):
        raise ValueError(f"kernelfuse: {what} must be dense in {memory_format}, its strides are {list(t.stride())}")
    if t.dtype != dtype or not t.is_cuda:
        raise ValueError(_layout_error(t, what, shape, None, dtype))


class _KernelLibrary:
    """The compiled kernel library: its `extern "C"` launchers by name, each launched on torch's current stream."""

    # torch's current stream as an integer: the private accessor Inductor's generated code uses, where it exists
    _raw_stream = staticmethod(getattr(torch._C, "_cuda_getCurrentRawStream", None)
                               or (lambda index: torch.cuda.current_stream(index).cuda_stream))
    # the current device without torch.cuda's lazy-init test (a CUDA tensor exists: CUDA is initialised)
    _current_device = staticmethod(getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device)

    def __init__(self, path):
        # PyDLL: a launcher keeps the GIL, as torch's own ops do. CDLL would release and retake it around every
        # launch, and the retake waits whenever another Python thread (a data loader, a compiler's worker) runs.
        self._lib = ctypes.PyDLL(path)
        self._lib.kf_error_string.argtypes = [ctypes.c_int]
        self._lib.kf_error_string.restype = ctypes.c_char_p
        self._tma_ready = {}  # device index -> whether the convolutions' TMA kernels run there
        self._tf32_weights = {}  # convolution -> (key, weight, its copy rounded to nearest TF32): _tf32_weight
        self._causal_masks = {}  # (attention, its mask's sources) -> (key, sources, verdict): _causal_mask

    def _allow_wgmma(self, built_for_sm90a):
        """Tell the GEMM, convolution and attention launchers whether this library holds the sm_90a (wgmma) kernels:
        only the loader knows what it built for, and without it they take the mma.sync ones (a library without such
        launchers has no switch)."""
        if hasattr(self._lib, "kf_wgmma_enable"):
            self._lib.kf_wgmma_enable(ctypes.c_int(int(built_for_sm90a)))
        self._tma_ready = {}

    def _conv_tma_ready(self, tensor):
        """Whether the convolutions' TMA im2col kernels (kernelfuse.codegen.conv_tma) run on `tensor`'s device:
        kf_conv_tma_ready (the library built for sm_90a, a compute-capability 9.0 device), asked once a device."""
        index = tensor.get_device()
        ready = self._tma_ready.get(index)
        if ready is None:
            if index >= 0 and index != self._current_device():  # the library asks about its current device
                with torch.cuda.device(index):
                    return self._conv_tma_ready(tensor)
            ready = self._tma_ready[index] = bool(self._lib.kf_conv_tma_ready())
        return ready

    def _conv_tma_input(self, x, other, dense, tma, prerounded=None):
        """(x, its memory format, the launcher to call) for a convolution whose file holds a TMA im2col kernel
        (launchers: `dense`, the dense kernel's; `tma`, the TMA kernel's as it takes any input, rounding its
        operands or truncating; `prerounded`, where the file has it, the rounding TMA kernel's form that reads x
        as it is): where the TMA kernel runs on x's device, x channels-last and 16-byte aligned (a copy only where
        it is not), the pre-rounded form where that copy is the file's own rounded to nearest TF32, else `tma`;
        elsewhere x in `other`, the dense kernel's layout, and `dense`."""
        if x.dim() != 4:  # (another rank fails the binding's shape check)
            return x, other, dense
        if not self._conv_tma_ready(x):
            return x.contiguous(memory_format=other), other, dense
        if prerounded is not None and self._copy_kernel_takes(x, round_tf32=True):
            x, launcher = self.to_channels_last(x, round_tf32=True), prerounded
        else:  # as it is, or torch's copy: not rounded
            x, launcher = self._channels_last_copy(x), tma
        if x.data_ptr() % 16:  # a view off the 16-byte grain the TMA unit reads
            x = x.clone(memory_format=torch.channels_last)
        return x, torch.channels_last, launcher

    def _tf32_weight(self, w, kernel):
        """`w` rounded to nearest TF32 for convolution `kernel`'s TMA kernels, which read the weight by descriptor as
        it is (the tensor cores truncate it): made once per weight version (one a convolution, the last it was given),
        keyed by w's data pointer, shape, strides, version counter and device. The entry holds w itself, so no other
        tensor can take its address while the key stands; an in-place update (an optimizer step, copy_) bumps the
        version and makes a new copy. A write through `.data` bypasses the counter (as for the file's other weight
        copies); an inference tensor has none: rounded at every call. Inside a CUDA graph capture the copy is the
        graph's own (rounded at every replay, no cache): a graph must not read a cached copy that a later call with
        another weight would free."""
        if w.is_inference() or self._capturing(w):
            return self._round_tf32(w)
        key = (w.data_ptr(), w.shape, w.stride(), w._version, w.device)
        cached = self._tf32_weights.get(kernel)
        if cached is None or cached[0] != key:
            cached = self._tf32_weights[kernel] = (key, w, self._round_tf32(w))
        return cached[2]

    def _causal_mask(self, kernel, mask, sources, kind, rows, cols):
        """Whether attention `kernel`'s mask is causal over its (rows, cols) scores (causal_mask_matches), so that
        its causal launcher, which reads no mask and skips the key tiles past the diagonal, computes what the mask
        does. The planner found it so for the buffers it saw, but a user may change them (load_state_dict, an
        in-place edit): it is checked here on the mask the forward computed, once per version of `sources` (the
        parameters and buffers the mask is computed from, with literals only: keyed by identity, data pointer,
        version counter, device, dtype, shape and strides, and the mask's shape and strides, since a slice of
        another size is another mask; the entry holds them, so no other tensor takes their address while it
        stands; a write through `.data` bypasses the counter: then `_causal_masks.clear()`).
        Never inside a CUDA graph capture (the check waits for the device): there the verdict found before it
        stands, where there is one (the warm-up call before a capture finds it), else the masked launcher runs.
        `sources` None (a mask of unknown origin) or one without a version counter (an inference tensor): checked
        at every call outside a capture."""
        if sources is None or any(s.is_inference() for s in sources):
            return not self._capturing(mask) and causal_mask_matches(mask, kind, rows, cols)
        key = [(id(s), s.data_ptr(), s._version, s.device, s.dtype, s.shape, s.stride()) for s in sources]
        key.append((mask.shape, mask.stride()))  # a slice of the buffers of another size: checked again
        slot = (kernel, tuple(mask.shape), *(id(s) for s in sources))  # a size a slot: dynamic shapes
        cached = self._causal_masks.get(slot)
        if cached is None or cached[0] != key:
            if self._capturing(mask):
                return False
            if len(self._causal_masks) >= 16:  # modules of their own (one library serves them all): the oldest goes
                self._causal_masks.pop(next(iter(self._causal_masks)))
            cached = self._causal_masks[slot] = (key, tuple(sources), causal_mask_matches(mask, kind, rows, cols))
        return cached[2]

    @staticmethod
    def _capturing(t):
        """Whether `t`'s kernels are being captured into a CUDA graph (torch's current stream is capturing)."""
        return t.is_cuda and torch.cuda.is_current_stream_capturing()

    @staticmethod
    def _round_tf32(w):
        """fp32 `w` rounded to nearest TF32 as ptxas compiles cvt.rna.tf32.f32 (kf_round_tf32): half an ulp (0x1000)
        added to the bits of finite values, then the low 13 bits cleared from every value, on w's device and in its
        strides. int32 arithmetic on the bits: a finite value's bits plus 0x1000 stay below the infinities' (no
        carry out of the exponent, sign-magnitude negatives alike), so no wrap-around. Torch's element-wise ops (a
        few passes over a weight, once per version) rather than a kernel of the file's: nothing to build or
        emulate."""
        with torch.no_grad():
            bits = w.detach().view(torch.int32)
            rounded = torch.empty_like(w)  # w's strides (the tap-major layout the kernels read)
            out = rounded.view(torch.int32)
            torch.where(w.isfinite(), bits + 0x1000, bits, out=out)
            out &= -0x2000  # 0xffffe000
        return rounded

    def _channels_last_copy(self, x):
        """4-d x channels-last: through the file's copy kernel where it takes x (3.4 TB/s against torch's 1.8 on
        an H200, level-2 54's input), else torch's copy; no copy where x is channels-last already."""
        if self._copy_kernel_takes(x):
            return self.to_channels_last(x)
        return x.contiguous(memory_format=torch.channels_last)

    def _copy_kernel_takes(self, x, round_tf32=False):
        """Whether the file's NCHW -> channels-last copy (`to_channels_last`) takes 4-d x, rounding its values to
        nearest TF32 where `round_tf32` (fp32, where the file carries the TMA convolution's pre-rounded form): a
        contiguous tensor on the device, of a dtype it was built for, batch at most 65535 (the grid's z)."""
        launchers = getattr(self, "_to_nhwc_tf32" if round_tf32 else "_to_nhwc", None) or {}
        return self._on_device(x) and x.is_contiguous() and x.dtype in launchers and x.size(0) <= 65535

    @staticmethod
    def _on_device(t):
        """Whether the library's kernels can read `t` (a CUDA tensor; the CPU emulation's tensors too)."""
        return t.is_cuda

    def _function(self, symbol, argtypes):
        """The launcher `symbol`: `argtypes`, then the stream; it returns a cudaError_t."""
        function = getattr(self._lib, symbol)
        function.argtypes = [*argtypes, ctypes.c_void_p]
        function.restype = ctypes.c_int
        return function

    def _launch(self, function, kernel, tensor, *args):
        """`function(*args, stream)` on `tensor`'s device and torch's current stream there; a CUDA error raises."""
        index = tensor.get_device()
        if index != self._current_device():  # the runtime launches on its current device: make it tensor's
            with torch.cuda.device(index):
                return self._launch(function, kernel, tensor, *args)
        error = function(*args, self._raw_stream(index))
        if error:
            raise RuntimeError(f"kernelfuse: launching {kernel} failed: {self._lib.kf_error_string(error).decode()}")
        return None


@dataclass(frozen=True)
class Binding:
    """One launcher's Python side: the line of `_Kernels.__init__` that declares its C signature, and the method
    that calls it with tensors."""

    init: str  # (lines, where it declares more than one launcher)
    method: str


def pointer_launcher(kernel: str, pointers: int) -> str:
    """The `__init__` line of a launcher `{kernel}_launch` that takes `pointers` device pointers, then the stream."""
    return f'self._{kernel} = self._function("{kernel}_launch", [ctypes.c_void_p] * {pointers})'


def py_tuple(values: tuple[int, ...]) -> str:
    """A Python tuple literal (one element keeps its comma)."""
    return repr(tuple(values))


def kernels_class(bindings: list[Binding]) -> str:
    """The emitted `_Kernels` class: one method per kernel entry point, all on one ctypes library."""
    init = "\n".join(_indent(b.init, "        ") for b in bindings)
    methods = "\n\n".join(_indent(b.method.strip("\n"), "    ") for b in bindings)
    return f'''
class _Kernels(_KernelLibrary):
    """The kernels of CUDA_SRC, called with tensors: each checks its tensors against the layouts the kernels were
    built for, allocates its output and launches on torch's current stream."""

    def __init__(self, path):
        super().__init__(path)
{init}

{methods}
'''


def runtime_source() -> str:
    """The helpers above as the emitted file's text."""
    return "\n\n".join(inspect.getsource(obj).strip("\n") + "\n"
                       for obj in (_layout_error, _check, _check_dense, causal_mask_matches, _KernelLibrary))


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())
