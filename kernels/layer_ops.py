"""The decoder layer's elementwise ops as Triton kernels, for the CUDA forward: RMSNorm fused with
the residual add before it, rotary embedding in place on the QKV output, and the gated MLP
activations (SiLU- and GELU-tanh-and-multiply).

In torch each is 3-8 separate ops, each a kernel launch with its own dispatch: an eager CUDA step
of a 30-layer model launched ~1,000 kernels, and its host time, not the GPU, set the pace. These
are one launch each, with the same semantics as the C++ CPU ops of cpu_attention (math in fp32,
one rounding at the end; the residual is stored rounded, as the next layer reads it), so
`CausalLM._forward_fused` runs one layer body over either set.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT_DTYPES, check, check_same_device, pow2


@triton.jit
def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, out_ptr, stride_h, stride_d, stride_o, D, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    m = i < D
    h = tl.load(h_ptr + r * stride_h + i, mask=m, other=0.0).to(tl.float32)
    if HAS_DELTA:
        h = h + tl.load(d_ptr + r * stride_d + i, mask=m, other=0.0).to(tl.float32)
        hr = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + r * stride_h + i, hr, mask=m)
        h = hr.to(tl.float32)  # the stored (rounded) residual, as the next layer sees it
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + i, (w * (h * inv)).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_c, HEADS, HALF,
                 HEADS_P: tl.constexpr, HALF_P: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_P)[:, None]
    i = tl.arange(0, HALF_P)[None, :]
    m = (h < HEADS) & (i < HALF)
    lo = x_ptr + t * stride_xt + h * stride_xh + i
    a = tl.load(lo, mask=m, other=0.0).to(tl.float32)
    b = tl.load(lo + HALF, mask=m, other=0.0).to(tl.float32)
    ci = i < HALF
    c1 = tl.load(cos_ptr + t * stride_c + i, mask=ci, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + HALF + i, mask=ci, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_c + i, mask=ci, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_c + HALF + i, mask=ci, other=0.0).to(tl.float32)
    ty = x_ptr.dtype.element_ty
    tl.store(lo, (a * c1 - b * s1).to(ty), mask=m)
    tl.store(lo + HALF, (b * c2 + a * s2).to(ty), mask=m)


@triton.jit
def _gated_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, INTER, GELU: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < INTER
    g = tl.load(gu_ptr + r * stride_gu + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * stride_gu + INTER + i, mask=m, other=0.0).to(tl.float32)
    if GELU:
        # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        # (exponents capped at 88: past it the quotient is 0 either way, without an inf)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(tl.minimum(-2.0 * z, 88.0)))
    else:
        a = g / (1.0 + tl.exp(tl.minimum(-g, 88.0)))
    tl.store(out_ptr + r * stride_o + i, (a * u).to(out_ptr.dtype.element_ty), mask=m)


def _check_rows(x: torch.Tensor, name: str) -> None:
    check(x.dim() == 2 and x.stride(1) == 1, f"{name} must be [n, width] with contiguous rows, got {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"{name}: dtype {x.dtype} unsupported")


def _row_warps(width: int) -> int:
    """Warps for one program per row: ~8 values a thread up to 16 warps (a 70B model's 8,192-wide
    rows take 16 warps at 16 values each)."""
    return max(1, min(16, pow2(width) // 256))


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, when given), then RMSNorm(h) * weight: [n, hidden] -> [n, hidden]."""
    _check_rows(h, "add_rms_norm: h")
    n, d = h.shape
    check(weight.shape == (d,) and weight.is_contiguous(), f"add_rms_norm: weight must be [{d}], got {tuple(weight.shape)}")
    if delta is not None:
        _check_rows(delta, "add_rms_norm: delta")
        check(delta.shape == h.shape and delta.dtype == h.dtype,
              f"add_rms_norm: delta {tuple(delta.shape)} {delta.dtype} must match h {tuple(h.shape)} {h.dtype}")
        check_same_device(h, delta, weight)
    else:
        check_same_device(h, weight)
    out = torch.empty((n, d), dtype=h.dtype, device=h.device)
    if n:
        _add_rms_norm_kernel[(n,)](h, delta if delta is not None else h, weight, out, h.stride(0),
                                   delta.stride(0) if delta is not None else 0, out.stride(0), d, float(eps),
                                   HAS_DELTA=delta is not None, BLOCK=pow2(d), num_warps=_row_warps(d))
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place: x [n, heads, dim] (rows may be strided; heads contiguous),
    cos/sin [n, dim]: x' = x * cos + rotate_half(x) * sin."""
    check(x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2],
          f"rope_: x must be [n, heads, dim] with contiguous heads, got {tuple(x.shape)} strides {x.stride()}")
    n, heads, dim = x.shape
    check(dim % 2 == 0, f"rope_: head_dim {dim} must be even")
    check(cos.shape == (n, dim) and sin.shape == (n, dim) and cos.is_contiguous() and sin.is_contiguous(),
          f"rope_: cos/sin must be contiguous [{n}, {dim}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    check_same_device(x, cos, sin)
    if n:
        _rope_kernel[(n,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads, dim // 2,
                           HEADS_P=pow2(heads), HALF_P=pow2(dim // 2))
    return x


def _gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    name = "gelu_tanh_mul" if gelu else "silu_mul"
    _check_rows(gate_up, f"{name}: gate_up")
    n, width = gate_up.shape
    check(width % 2 == 0, f"{name}: gate_up's width must be even, got {width}")
    inter = width // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, pow2(inter))
    if n:
        _gated_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                         GELU=gelu, BLOCK=block)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2 * inter] (gate, then up) -> silu(gate) * up, [n, inter]."""
    return _gated(gate_up, gelu=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2 * inter] -> gelu_tanh(gate) * up, [n, inter] (Gemma's gated MLP)."""
    return _gated(gate_up, gelu=True)
