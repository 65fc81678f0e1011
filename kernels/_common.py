"""Launcher checks shared by the kernels: clear errors instead of silent wrong answers."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


FP8_DTYPE = torch.float8_e4m3fn
# Largest finite e4m3 magnitude: quantised values are scaled into [-448, 448].
FP8_MAX = 448.0


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> tuple[int, int, int, int]:
    check(k_cache.dim() == 4, f"k_cache must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}")
    check(k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    check(k_cache.dtype == v_cache.dtype and k_cache.dtype in FLOAT_DTYPES + (FP8_DTYPE,),
          f"cache dtype {k_cache.dtype} unsupported")
    check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous")
    check(k_cache.stride() == v_cache.stride(), "k_cache and v_cache strides differ")
    quant = k_cache.dtype == FP8_DTYPE
    check(quant == (k_scale is not None) and quant == (v_scale is not None),
          "an fp8 cache needs k_scale and v_scale (and a float cache takes none)")
    if quant:
        check(k_scale.shape == k_cache.shape[:3] and v_scale.shape == k_cache.shape[:3],
              f"scales must be [num_blocks, block_size, kv_heads] = {tuple(k_cache.shape[:3])}, "
              f"got {tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
        check(k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32, "scales must be float32")
        check(k_scale.is_contiguous() and v_scale.is_contiguous(), "scales must be contiguous")
    return tuple(k_cache.shape)


def check_same_device(*tensors: torch.Tensor) -> None:
    devs = {t.device for t in tensors}
    check(len(devs) == 1, f"tensors on different devices: {devs}")


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: exact fp32 products for fp32 operands (NVIDIA's default is TF32,
    about 3 significant digits, which would break an fp32 model's agreement with its reference);
    TF32 for 16-bit and fp8 models, whose values it holds exactly."""
    return "ieee" if dtype == torch.float32 else "tf32"
