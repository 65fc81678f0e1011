"""Block copies between the device KV cache and the CPU tier.

Torch indexing is the kernel here: a gather of whole blocks is one contiguous memcpy per block,
and on CUDA a pinned destination lets the device-to-host copy run asynchronously. A Triton
kernel would only re-implement the copy engine.
"""
from __future__ import annotations

import torch

from ._common import check


def copy_blocks_reference(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
    for s, d in zip(src_ids, dst_ids):
        dst[d].copy_(src[s])


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[dst_ids] = src[src_ids] for caches [num_blocks, ...] on any two devices."""
    check(src.shape[1:] == dst.shape[1:], f"block shapes differ: {tuple(src.shape[1:])} vs {tuple(dst.shape[1:])}")
    check(src.dtype == dst.dtype, f"dtypes differ: {src.dtype} vs {dst.dtype}")
    check(src_ids.numel() == dst_ids.numel(), "src_ids and dst_ids differ in length")
    if src_ids.numel() == 0:
        return
    gathered = src.index_select(0, src_ids.to(src.device))
    if gathered.device != dst.device:
        pinned = dst.device.type == "cpu" and dst.is_pinned()
        gathered = gathered.to(dst.device, non_blocking=pinned)
    dst.index_copy_(0, dst_ids.to(dst.device), gathered)
