"""Fused mixture-of-experts for CUDA: two grouped GEMMs over the tokens sorted by expert.

The (token, choice) pairs are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M, so every BLOCK_M rows of the sorted list belong to one expert (`align`). One program
computes a BLOCK_M x BLOCK_N tile: it gathers its rows of A (row r of the sorted list reads token
r // a_rows_per_id, a pair's token for the first GEMM, the pair itself for the second), multiplies
them by that expert's weight [N, K] and scatters the tile to the pairs' rows of C, optionally
scaled by each pair's routing weight. This is the scheme of vLLM's `fused_moe`, written afresh.

`align` has no host synchronisation (its padded length is the worst case), so the whole block
can be captured in a CUDA graph.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import check, dot_precision


def fused_moe_reference(x, w_gate_up, w_down, weights, ids) -> torch.Tensor:
    """Each token's experts one at a time, in fp32: sum_j weights[t, j] * down(silu(gate) * up)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w_gate_up[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, j].float() * (w_down[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [padded], expert of each BLOCK_M block [padded / block_m]) for ids [n, k].
    Padding rows hold n*k (out of range: masked); blocks past the last expert's hold -1."""
    flat = ids.flatten()
    pairs = flat.numel()
    padded_len = pairs + num_experts * (block_m - 1)
    padded_len = triton.cdiv(padded_len, block_m) * block_m
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    dest = padded_start[sorted_e] + torch.arange(pairs, device=ids.device) - start[sorted_e]
    sorted_ids = torch.full((padded_len,), pairs, dtype=torch.int32, device=ids.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, padded_len, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, num_pairs, N, K,
                         stride_am, stride_be, stride_bn, stride_cm,
                         A_ROWS_PER_ID: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m)
    if expert < 0:
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_pairs
    a_rows = rows // A_ROWS_PER_ID
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(b_ptr + expert * stride_be + cols[None, :] * stride_bn + kk[:, None],
                    mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)
        if UPCAST:  # Triton's interpreter gets bf16 dots wrong; fp32 operands there
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        w = tl.load(w_ptr + rows, mask=valid, other=0.0)
        acc = acc * w[:, None].to(tl.float32)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < N))


def _grouped_gemm(a, b, c, weights, sorted_ids, block_expert, a_rows_per_id: int, block_m: int) -> None:
    num_experts, n, k = b.shape
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](a, b, c, weights if weights is not None else c, sorted_ids, block_expert,
                               c.shape[0], n, k, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
                               A_ROWS_PER_ID=a_rows_per_id, MUL_WEIGHT=weights is not None,
                               UPCAST=os.environ.get("TRITON_INTERPRET") == "1", DOT_PRECISION=dot_precision(a.dtype),
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """x [n, hidden], w_gate_up [experts, 2I, hidden] (gate rows first), w_down [experts, hidden, I],
    weights/ids [n, k] -> [n, hidden] in x's dtype: sum_j weights[:, j] * expert_j(x)."""
    check(x.dim() == 2 and x.stride(-1) == 1, f"x must be a contiguous [tokens, hidden], got {tuple(x.shape)}")
    e, two_i, hidden = w_gate_up.shape
    check(hidden == x.shape[1] and two_i % 2 == 0, f"w_gate_up {tuple(w_gate_up.shape)} does not fit x {tuple(x.shape)}")
    check(tuple(w_down.shape) == (e, hidden, two_i // 2), f"w_down {tuple(w_down.shape)} must be {(e, hidden, two_i // 2)}")
    check(weights.shape == ids.shape and ids.dim() == 2, "weights and ids must both be [tokens, top_k]")
    check(w_gate_up.is_contiguous() and w_down.is_contiguous(), "expert weights must be contiguous")
    n, top_k = ids.shape
    sorted_ids, block_expert = align(ids, e, block_m)
    inter = torch.empty((n * top_k, two_i), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_gate_up, inter, None, sorted_ids, block_expert, top_k, block_m)
    gate, up = inter.chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).contiguous()
    out = torch.empty((n * top_k, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w_down, out, weights.flatten().contiguous(), sorted_ids, block_expert, 1, block_m)
    return out.view(n, top_k, hidden).sum(dim=1)
