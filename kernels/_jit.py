"""Triton device functions shared by the attention kernels (apart from _common, which the
torch-only block copy imports without Triton)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def soft_cap(s, cap):
    # Gemma 2's cap * tanh(s / cap) on attention scores, tanh(x) = 1 - 2 / (exp(2x) + 1).
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))
