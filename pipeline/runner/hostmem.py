"""Host memory for the packed CPU weights: anonymous mappings on 2 MiB pages.

A decode step reads every weight once. On 4 KiB pages a 1.5B bf16 model is ~700k pages, far past
any TLB's reach, so each page of the weight stream costs a page walk (two-dimensional under a
hypervisor), and the GEMM's prefetches to a new page wait on it. On 2 MiB pages the whole model
fits in the second-level TLB. The packed weights are copied into mappings advised MADV_HUGEPAGE
before their first touch, which Linux honours with THP set to `always` or `madvise` (the default
on most distributions; `never` leaves them on 4 KiB pages, as before). Measured on the 1.5B
model's GEMMs (README, "The engine"), 2 MiB against 4 KiB pages.

The pages are faulted in once, at load; `BATCHGEN_WEIGHT_HUGEPAGES=0` keeps torch's allocations.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading

import torch

HUGE = 2 << 20
# Virtual size of one arena. What is never written is never resident, so an arena's unused tail
# costs address space only; a weight larger than this gets an arena of its own.
ARENA_BYTES = 512 << 20
# Smaller tensors stay where they are: their share of the weight stream is small.
MIN_BYTES = 1 << 20
_ALIGN = 4096


def weight_hugepages_enabled() -> bool:
    return (os.environ.get("BATCHGEN_WEIGHT_HUGEPAGES", "1") != "0" and sys.platform.startswith("linux")
            and hasattr(mmap, "MADV_HUGEPAGE"))


class _Arena:
    """One private anonymous mapping advised MADV_HUGEPAGE, handed out front to back."""

    def __init__(self, nbytes: int) -> None:
        self.mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.pos = (-base) % HUGE  # start on a 2 MiB boundary
        self.end = self.pos + nbytes
        try:
            self.mm.madvise(mmap.MADV_HUGEPAGE, self.pos, nbytes)
        except OSError:  # no THP in this kernel: plain pages, still correct
            pass

    def take(self, nbytes: int) -> int | None:
        if self.pos + nbytes > self.end:
            return None
        at = self.pos
        self.pos += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return at


_lock = threading.Lock()
_current: list[_Arena] = []


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of host tensor `t` in a 2 MiB-page arena (the same values, shape and dtype,
    contiguous), or `t` itself where that does not apply: not a CPU tensor, under MIN_BYTES, or
    turned off. The arena lives as long as any tensor in it."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < MIN_BYTES or not weight_hugepages_enabled():
        return t
    with _lock:
        at = _current[0].take(nbytes) if _current else None
        if at is None:
            arena = _Arena(max(ARENA_BYTES, (nbytes + HUGE - 1) // HUGE * HUGE))
            if nbytes <= ARENA_BYTES:  # a weight's own arena does not become the current one
                _current[:] = [arena]
            at = arena.take(nbytes)
        else:
            arena = _current[0]
    out = torch.frombuffer(arena.mm, dtype=t.dtype, count=t.numel(), offset=at).view(t.shape)
    out.copy_(t)
    return out
