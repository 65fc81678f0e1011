"""Decode-only steps on CUDA, replayed from CUDA graphs captured per batch-size bucket.

A decode step of a small model launches hundreds of small kernels; replaying them as one graph
removes the launch gaps. A graph fixes the addresses and shapes of its tensors, so a step's inputs
are copied into static buffers padded to the next bucket size: padding rows write no KV (slot -1),
attend to one key (context length 1) and are dropped. Block tables are padded to the longest
sequence the engine admits, so the decode kernel's split count is the same in every replay.

`emulate=True` runs the same static-buffer path eagerly without capturing (how the CPU tests
exercise everything here but the capture itself: Triton's interpreter cannot be captured).
"""
from __future__ import annotations

import torch

from .attention import AttentionMetadata


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (vLLM's spacing), and max_batch itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model, kv_layers, max_batch: int, max_blocks: int, window: int | None = None,
                 emulate: bool = False) -> None:
        dev = model.device
        self.model = model
        self.kv_layers = kv_layers
        self.window = window
        self.emulate = emulate or dev.type != "cuda"
        self.buckets = bucket_sizes(max_batch)
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.long, device=dev)
        self.tables = torch.zeros((max_batch, max_blocks), dtype=torch.int32, device=dev)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.sample = torch.arange(max_batch, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0
        self.padded_rows = 0

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def fits(self, n: int, width: int) -> bool:
        return 0 < n <= self.buckets[-1] and width <= self.tables.shape[1]

    def run(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
            lens: torch.Tensor) -> torch.Tensor:
        """One decode per row (tables [n, width] int); returns fp32 logits [n, vocab]."""
        n, width = tables.shape
        b = self.bucket(n)
        self.ids[:n].copy_(ids, non_blocking=True)
        self.pos[:n].copy_(pos, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        self.tables[:n, :width].copy_(tables, non_blocking=True)
        self.tables[:n, width:].zero_()
        self.lens[:n].copy_(lens, non_blocking=True)
        if b > n:
            self.ids[n:b].zero_()
            self.pos[n:b].zero_()
            self.slots[n:b].fill_(-1)
            self.tables[n:b].zero_()
            self.lens[n:b].fill_(1)
        self.replays += 1
        self.padded_rows += b - n
        if self.emulate:
            return self._forward(b)[:n]
        if b not in self.graphs:
            self._capture(b)
        self.graphs[b].replay()
        return self.outputs[b][:n]

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(num_decodes=b, decode_block_tables=self.tables[:b], decode_context_lens=self.lens[:b],
                                 prefills=[], slot_mapping=self.slots[:b], backend="triton", window=self.window)
        return self.model.forward(self.ids[:b], self.pos[:b], meta, self.kv_layers, self.sample[:b])

    def _capture(self, b: int) -> None:
        # Warm-up (Triton compiles and autotunes, the allocator settles) and capture both run on
        # the buffers' current contents: point every row's KV write at -1 meanwhile, so neither
        # touches the cache. The graph reads the slot buffer afresh at each replay.
        saved = self.slots[:b].clone()
        self.slots[:b].fill_(-1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(b)
        self.pool = graph.pool()
        self.slots[:b].copy_(saved)
        self.graphs[b] = graph
        self.outputs[b] = out
