"""The feed-forward blocks: a dense gated MLP, and a sparse mixture-of-experts block (Mixtral,
Qwen2-MoE with its shared expert, Qwen3-MoE).

Routing follows transformers' arithmetic: router logits in the model dtype, softmax in fp32, the
top-k experts, renormalised to sum to 1 where the family does (Mixtral always, the Qwen MoEs with
`norm_topk_prob`); Mixtral keeps the weights in fp32, the Qwen MoEs round them to the model dtype.

On the CPU the tokens are grouped by expert (one stable sort) and each active expert runs one
gate/up GEMM and one down GEMM over its tokens; the weighted outputs are added back per token in
ascending expert order, as transformers adds them. Where the experts are on our packed GEMMs
(dpbf16; fma: the AVX2 kernels, or fp32 on the AVX-512 walk) that is one C++ op a layer
(`moe_experts`, kernels/csrc/gemm_cpu.cpp: each of its GEMMs over all experts in one parallel
region, split by cost). Experts on amx (AMX CPUs) take the same op: those with AMX_ROWS pairs or
more on the AMX tiles, the rest on the dpbf16 walk. Elsewhere (oneDNN) a Python loop over the
experts. On CUDA the experts run as two grouped GEMMs over the tokens sorted by expert
(batchgen.kernels.fused_moe, a Triton kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .linear import GATED_ACTS, ROW_TILE, Linear, row_tiles


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2I] (gate, then up) -> silu(gate) * up, as transformers computes it."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# The MLP of a prefill step runs in linear.ROW_TILE-row tiles on the CPU's packed paths. A 2,048-
# token step writes a gate/up output of 2,048 x 2I values (73 MB for a 1.5B model in bf16) that
# leaves the caches before the activation and the down GEMM read it back; in tiles of 256 rows it
# stays in L2/L3. The MLP of a 2,048-row step measured 12-14% faster so (bf16 and fp32, 1.5B and
# 3B shapes, AVX-512 Zen 5); 64-row tiles lose what the GEMMs gain from the larger M. Decode steps
# (fewer rows) are not split.


# On AMX CPUs, the pairs an expert needs before the MoE op runs its GEMMs on the AMX tiles rather than
# the dpbf16 walk. Below it an expert's GEMMs are bound by its weight stream: on a 2-core Xeon the amx
# GEMM ran a layer's linears at 162 GFLOP/s at 8 rows and 322 at 16 (8-10 GB/s of weights), where
# the dpbf16 walk streamed 19 GB/s at one row; at 32 rows the amx GEMM reached 466 GFLOP/s (README,
# The engine). The op's split on AMX has not been measured end to end yet.
AMX_ROWS = 32


@dataclass
class DenseMLP:
    gate_up: Linear
    down: Linear

    def __call__(self, x: torch.Tensor, silu_mul) -> torch.Tensor:
        """silu_mul: the activation over the gate/up output, unless gate_up applies it itself (fused_act)."""
        act = (lambda t: t) if self.gate_up.fused_act else silu_mul
        tiles = row_tiles(x.shape[0])
        if tiles is None or self.gate_up.path == "plain":
            return self.down(act(self.gate_up(x)))
        out = x.new_empty(x.shape[0], self.down.out_features)
        for i in tiles:  # each tile's rows of out written by the down GEMM itself
            self.down(act(self.gate_up(x[i : i + ROW_TILE])), out=out[i : i + ROW_TILE])
        return out

    def num_weights(self) -> int:
        return sum(lin.out_features * lin.in_features for lin in (self.gate_up, self.down))


class SparseMoE:
    """A sparse MoE block. gate_up[e] [2I, hidden] (gate rows first), down[e] [hidden, I]."""

    def __init__(self, router: torch.Tensor, gate_up: list[torch.Tensor], down: list[torch.Tensor], top_k: int,
                 renormalize: bool, fp32_weights: bool, linear_path: str, shared: DenseMLP | None = None,
                 shared_gate: torch.Tensor | None = None, gated: str | None = "silu") -> None:
        """gated: the experts' activation (Linear's `gated`) for GEMMs that apply it in their epilogue."""
        self.router = router  # [experts, hidden]
        self.num_experts = len(gate_up)
        self.top_k = top_k
        self.renormalize = renormalize
        self.fp32_weights = fp32_weights
        self.shared = shared
        self.shared_gate = shared_gate  # [1, hidden] or None
        self.on_cuda = router.device.type == "cuda"
        if self.on_cuda:
            # The Triton kernel reads the experts as one [experts, N, K] tensor each.
            self.w_gate_up = torch.stack(gate_up)
            self.w_down = torch.stack(down)
            self.experts: list[tuple[Linear, Linear]] = []
        else:
            self.experts = [(Linear(gu, None, linear_path, gated=gated), Linear(d, None, linear_path))
                            for gu, d in zip(gate_up, down)]
        # Experts on a GEMM moe_experts runs take the op: the AVX-512 walks (dpbf16, fp32 on fma with
        # AVX-512), their activation in the gate/up epilogue, or the AVX2 kernels (fma), with it
        # applied between; the op's weight lists, activation and gate/up layout.
        # On AMX (amx experts: dpbf16's packed layout) the experts with AMX_ROWS pairs or more run on
        # the AMX tiles inside the op, and the rest on the dpbf16 walk (amx_rows).
        gu0, d0 = self.experts[0] if self.experts else (None, None)
        self.packed = None
        self.amx_rows = 0
        if gu0 is not None and gated in GATED_ACTS and gu0.out_features % 32 == 0 and d0.path == gu0.path:
            walk = gu0.fused_act == gated and gu0.path in ("dpbf16", "fma", "amx")
            if walk or (gu0.fused_act is None and gu0.path == "fma"):
                self.packed = ([gu.weight for gu, _ in self.experts], [d.weight for _, d in self.experts])
                self.act, self.interleaved = GATED_ACTS[gated], walk
                self.amx_rows = AMX_ROWS if gu0.path == "amx" else 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [n, k], expert ids [n, k]) of each token."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(x.dtype)), ids

    def __call__(self, x: torch.Tensor, silu_mul) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.on_cuda:
            from batchgen.kernels.fused_moe import fused_moe

            out = fused_moe(x, self.w_gate_up, self.w_down, weights, ids)
        else:
            out = self._grouped(x, weights, ids, silu_mul)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x, silu_mul)
        return out

    def _grouped(self, x, weights, ids, silu_mul) -> torch.Tensor:
        """Each active expert's GEMMs over its tokens; the weighted outputs land in the (token,
        choice) rows of one buffer (a copy, not an atomic add), and each token's choices are
        summed in ascending expert order, the order of transformers' index_add_."""
        n, k = ids.shape
        ids, perm = torch.sort(ids, dim=-1)
        weights = torch.gather(weights, 1, perm)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        if self.packed is not None:
            out = torch.empty_like(x)
            torch.ops.batchgen_cpu.moe_experts(out, x.contiguous(), order, counts, *self.packed,
                                               weights.float().contiguous(), self.act, self.interleaved,
                                               self.amx_rows)
            return out
        tokens = order // k
        flat_weights = weights.flatten()[order]
        y = torch.empty((n * k, x.shape[1]), dtype=x.dtype)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            gate_up, down = self.experts[e]
            h = gate_up(x.index_select(0, tokens[start : start + count]))
            out = down(h if gate_up.fused_act else silu_mul(h))
            y.index_copy_(0, order[start : start + count], (out * flat_weights[start : start + count, None]).to(x.dtype))
            start += count
        y = y.view(n, k, -1)
        out = y[:, 0].clone()
        for j in range(1, k):
            out += y[:, j]
        return out

    def num_weights(self) -> int:
        per_expert = self.w_gate_up[0].numel() + self.w_down[0].numel() if self.on_cuda else sum(
            lin.out_features * lin.in_features for lin in self.experts[0])
        return (per_expert * self.num_experts + self.router.numel()
                + (self.shared.num_weights() + self.shared_gate.numel() if self.shared is not None else 0))
