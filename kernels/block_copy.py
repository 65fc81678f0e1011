"""Block copies between the device KV cache and the CPU tier.

Torch indexing is the kernel here: a gather of whole blocks is one contiguous memcpy per block,
and the copy engine moves the gathered blocks between host and device. A Triton kernel would
only re-implement the copy engine.

Across host and device the host side always goes through pinned memory, so the transfer is
asynchronous, and the host never reads a buffer before its transfer is done:
- device -> host: gather on the device, copy into a pinned staging buffer, wait for the stream,
  then scatter on the host (reading the staging buffer earlier would read garbage);
- host -> device: gather on the host into pinned memory, then copy and scatter on the device,
  in stream order.
"""
from __future__ import annotations

import torch

from ._common import check


def copy_blocks_reference(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> None:
    for s, d in zip(src_ids, dst_ids):
        dst[d].copy_(src[s])


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[dst_ids] = src[src_ids] for caches [num_blocks, ...] on any two devices. On return the
    host side of the copy is complete (dst may be read or src reused)."""
    check(src.shape[1:] == dst.shape[1:], f"block shapes differ: {tuple(src.shape[1:])} vs {tuple(dst.shape[1:])}")
    check(src.dtype == dst.dtype, f"dtypes differ: {src.dtype} vs {dst.dtype}")
    check(src_ids.numel() == dst_ids.numel(), "src_ids and dst_ids differ in length")
    if src_ids.numel() == 0:
        return
    gathered = src.index_select(0, src_ids.to(src.device))
    if src.device == dst.device:
        dst.index_copy_(0, dst_ids.to(dst.device), gathered)
    elif dst.device.type == "cpu":  # device -> host
        staging = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        staging.copy_(gathered, non_blocking=True)
        torch.cuda.current_stream(src.device).synchronize()
        dst.index_copy_(0, dst_ids.cpu(), staging)
    else:  # host -> device
        host = gathered.pin_memory() if torch.cuda.is_available() else gathered
        dst.index_copy_(0, dst_ids.to(dst.device), host.to(dst.device, non_blocking=True))
