"""Launcher checks shared by the kernels: clear errors instead of silent wrong answers."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    check(k_cache.dim() == 4, f"k_cache must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(k_cache.shape)}")
    check(k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    check(k_cache.dtype == v_cache.dtype and k_cache.dtype in FLOAT_DTYPES, f"cache dtype {k_cache.dtype} unsupported")
    check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous")
    check(k_cache.stride() == v_cache.stride(), "k_cache and v_cache strides differ")
    return tuple(k_cache.shape)


def check_same_device(*tensors: torch.Tensor) -> None:
    devs = {t.device for t in tensors}
    check(len(devs) == 1, f"tensors on different devices: {devs}")


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
