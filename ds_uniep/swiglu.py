"""``silu(a) * b`` for SwiGLU experts whose ``w1`` and ``w3`` run as one GEMM.

The joint GEMM writes ``h = [a | b]`` (``[R, 2F]``). Elementwise torch ops on its two
halves run on strided operands (row stride 2F), which on a GPU take the slow, unvectorised
path: at ep 4 on H200s, silu, the product and their backward cost about 0.8 ms per layer at
dsv2lite-like shapes. On CUDA tensors this module runs them as two Triton kernels instead
(one read of ``h``, one write), and anywhere else as the torch ops.

Rounding: the kernels compute ``silu(a) * b`` in fp32 and round once; the backward computes
``da = g * b * s * (1 + a * (1 - s))`` and ``db = g * silu(a)`` (``s = sigmoid(a)``) in fp32
and rounds each once. The torch ops round ``silu(a)`` first, so the two differ in the last
bit; each is deterministic, and a given device always takes the same one.
"""
import functools

import torch
from torch import Tensor
from torch.nn import functional as F


@functools.lru_cache(maxsize=None)
def _kernels():
    """The Triton kernels, or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def swiglu_fwd(h_ptr, out_ptr, F_, h_stride, out_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F_
        a = tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(h_ptr + row * h_stride + F_ + cols, mask=mask, other=0.0).to(tl.float32)
        y = a / (1.0 + tl.exp(-a)) * b
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_bwd(g_ptr, h_ptr, dh_ptr, F_, g_stride, h_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F_
        g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(h_ptr + row * h_stride + F_ + cols, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-a))
        da = g * b * s * (1.0 + a * (1.0 - s))
        db = g * (a * s)
        tl.store(dh_ptr + row * h_stride + cols, da.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + row * h_stride + F_ + cols, db.to(dh_ptr.dtype.element_ty), mask=mask)

    return triton, swiglu_fwd, swiglu_bwd  # named so in profiles


_BLOCK = 1024


def uses_kernels(h: Tensor) -> bool:
    """Whether :func:`swiglu` runs the Triton kernels on ``h`` (a CUDA tensor, Triton present)."""
    return h.is_cuda and _kernels() is not None


class _SwiGLU(torch.autograd.Function):

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        triton, fwd, _ = _kernels()
        h = h.contiguous()
        R, F2 = h.shape
        out = torch.empty((R, F2 // 2), dtype=h.dtype, device=h.device)
        if R:
            fwd[(R, triton.cdiv(F2 // 2, _BLOCK))](h, out, F2 // 2, h.stride(0), out.stride(0), BLOCK=_BLOCK)
        ctx.save_for_backward(h)
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        triton, _, bwd = _kernels()
        h, = ctx.saved_tensors
        g = g.contiguous()
        dh = torch.empty_like(h)
        R, F2 = h.shape
        if R:
            bwd[(R, triton.cdiv(F2 // 2, _BLOCK))](g, h, dh, F2 // 2, g.stride(0), h.stride(0), BLOCK=_BLOCK)
        return dh


def swiglu(h: Tensor) -> Tensor:
    """``silu(a) * b`` for ``h = [a | b]`` (``[R, 2F]``), with autograd; see the module docstring."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu takes [R, 2F], got {tuple(h.shape)}")
    if uses_kernels(h):
        return _SwiGLU.apply(h)
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b
