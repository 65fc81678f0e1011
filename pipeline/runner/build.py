"""The engine's set-up decisions, each a small function of the validated specs: where the model
runs and in which dtype, which attention and GEMM paths, how much KV memory, what a preemption
costs, and whether decode steps replay CUDA graphs. `batchgen plan` calls the same functions, so
its figures are the run's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..shapes import ModelShape, cdiv, kv_bytes_per_token

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}

# engine.profile latency: the batch caps that keep inter-token latency low.
LATENCY_MAX_SEQS = 16
LATENCY_MAX_TOKENS = 512


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device: 'cuda' asked for but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: float32 on a CPU (exact, and oneDNN's fp32 GEMMs are fast), bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float8_e4m3fn: "fp8", torch.int8: "int8"}.get(dtype, str(dtype).replace("torch.", ""))


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV storage: the model dtype (auto), or int8 / fp8 with per-token-head scales."""
    return dtype if kv_cache_dtype == "auto" else _KV_STORAGE[kv_cache_dtype]


def apply_profile(spec):
    """engine.profile latency caps the batch; throughput keeps the spec as it is."""
    if spec.profile != "latency":
        return spec
    return spec.model_copy(update={"max_num_seqs": min(spec.max_num_seqs, LATENCY_MAX_SEQS),
                                   "max_num_batched_tokens": min(spec.max_num_batched_tokens, LATENCY_MAX_TOKENS)})


@dataclass(frozen=True)
class Backend:
    # torch | cpu (the C++ ops) | triton
    attention: str
    # plain (F.linear) | onednn (packed weights) | dpbf16 (our AVX512-BF16 GEMM for bf16 weights) |
    # fma (our AVX2 GEMMs, fp32 and bf16 weights)
    linear_path: str
    # The C++ fused layer ops (add+RMSNorm, RoPE, SiLU-mul, greedy argmax) on the CPU fast path.
    fused_ops: bool
    # The same layer ops as Triton kernels (kernels/layer_ops.py) on CUDA: one launch each where
    # torch runs 3-8 ops. BATCHGEN_LAYER_OPS=torch keeps torch's ops (the A/B in gpu_check).
    triton_ops: bool = False

    @property
    def layer_ops(self) -> str | None:
        """Whose fused layer ops the forward takes: "cpu" (C++), "triton", or None (torch's)."""
        return "cpu" if self.fused_ops else "triton" if self.triton_ops else None


def choose_backend(spec, device: torch.device, kv_dtype: torch.dtype, dtype: torch.dtype | None = None) -> Backend:
    """Attention and GEMM paths for the device, model dtype and KV storage, refusing impossible asks."""
    from batchgen.kernels import cpu_attention

    from .linear import (
        amx_gemm_available,
        dpbf16_available,
        fma_available,
        fma_f32_preferred,
        onednn_available,
        onednn_bf16_available,
        own_bf16_path,
    )

    linear_path = spec.linear_path
    cpu = device.type == "cpu"
    if linear_path == "auto":
        # fp32: our fma GEMM on AVX2 CPUs without AVX-512, else oneDNN. bf16: amx on AMX CPUs, dpbf16 on
        # other AVX512-BF16 ones, else oneDNN where it has bf16 kernels (or ours are not built), else
        # (AVX2-only CPUs) our fma GEMM.
        linear_path = "plain" if not cpu else (
            ("fma" if fma_f32_preferred() else "onednn" if onednn_available() else "plain")
            if dtype == torch.float32 else
            own_bf16_path() or
            "onednn" if onednn_available() and (onednn_bf16_available() or not fma_available()) else
            "fma" if fma_available() else "plain")
    elif linear_path == "dpbf16" and cpu and not dpbf16_available():
        raise ConfigError("engine.linear_path: dpbf16 needs a CPU with AVX512-BF16 and the C++ ops "
                          "(use auto, fma or onednn)")
    elif linear_path == "amx" and cpu and not amx_gemm_available():
        raise ConfigError("engine.linear_path: amx needs a CPU with AMX-BF16 (and an OS that grants it) and the C++ "
                          "ops (use auto, dpbf16 or onednn)")
    elif linear_path == "fma" and cpu and not fma_available():
        raise ConfigError("engine.linear_path: fma needs a CPU with AVX2 and FMA and the C++ ops (use auto or onednn)")
    elif linear_path == "onednn" and cpu and dtype == torch.bfloat16 and not onednn_bf16_available():
        raise ConfigError("engine.linear_path: onednn has no bf16 kernels on this CPU (it needs AVX512-BW/VL/DQ, "
                          "AVX-NE-CONVERT or AMX); use auto or fma, or model.dtype: float32")
    fp8 = kv_dtype == torch.float8_e4m3fn
    attention = spec.attention_backend
    if attention == "auto":
        if device.type == "cuda":
            attention = "triton"
        else:  # the C++ op reads float, bf16 and int8 caches; fp8 on a CPU stays on torch
            attention = "cpu" if not fp8 and cpu_attention.available() else "torch"
    elif attention == "cpu":
        if device.type != "cpu":
            raise ConfigError("engine.attention_backend: cpu runs on the CPU device only")
        if fp8:
            raise ConfigError("engine.kv_cache_dtype: fp8 is for CUDA (Triton kernels); on a CPU use int8, or "
                              "engine.attention_backend: torch")
        try:
            cpu_attention.load()
        except RuntimeError as e:
            raise ConfigError(f"engine.attention_backend: cpu: {e}") from e
    if attention == "triton" and kv_dtype == torch.int8:
        raise ConfigError("engine.kv_cache_dtype: int8 runs on the CPU paths; on CUDA use fp8, or set "
                          "engine.attention_backend: torch")
    # The exact reference paths (linear_path plain, decode_attention exact) keep torch's own ops.
    fused = attention == "cpu" and linear_path != "plain" and spec.decode_attention == "batched"
    triton_ops = (attention == "triton" and spec.decode_attention == "batched"
                  and os.environ.get("BATCHGEN_LAYER_OPS", "triton") != "torch")
    return Backend(attention, linear_path, fused, triton_ops)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


@dataclass(frozen=True)
class KVLayout:
    bytes_per_token: int
    block_bytes: int
    num_blocks: int
    num_cpu_blocks: int
    # Where the device budget came from, for the planner's report.
    budget_bytes: int
    budget_source: str
    # (device, CPU) blocks per KV group (ModelShape.kv_groups): num_blocks / num_cpu_blocks is
    # group 0's. One entry without hybrid KV.
    group_blocks: tuple[tuple[int, int], ...] = ()


def kv_budget(spec, shape: ModelShape, kv_dtype: torch.dtype, device: torch.device, max_model_len: int,
              max_seq_tokens: int | None = None, free_bytes: int | None = None) -> tuple[int, str]:
    """The device KV budget in bytes and where it came from: engine.kv_cache_gib, else
    kv_cache_fraction of free memory, capped at what max_num_seqs sequences of the longest
    request (max_seq_tokens, else the context) can use."""
    if spec.kv_cache_gib is not None:
        return int(spec.kv_cache_gib * 2**30), "engine.kv_cache_gib"
    per_block = spec.block_size * kv_bytes_per_token(shape, dtype_name(kv_dtype))
    free = available_memory_bytes(device) if free_bytes is None else free_bytes
    budget = int(spec.kv_cache_fraction * free)
    source = f"engine.kv_cache_fraction {spec.kv_cache_fraction} of {free / 2**30:.1f} GiB free on {device.type}"
    longest = min(max_seq_tokens or max_model_len, max_model_len)
    useful = spec.max_num_seqs * (cdiv(longest, spec.block_size) + 1) * per_block
    if useful < budget:
        return useful, source + f", capped at what {spec.max_num_seqs} sequences of {longest} tokens can use"
    return budget, source


def size_kv_cache(spec, shape: ModelShape, kv_dtype: torch.dtype, device: torch.device, max_model_len: int,
                  max_seq_tokens: int | None = None) -> KVLayout:
    """Blocks for the device budget (kv_budget) and for the CPU tier (engine.cpu_offload_gib)."""
    per_token = kv_bytes_per_token(shape, dtype_name(kv_dtype))
    per_block = spec.block_size * per_token
    budget, source = kv_budget(spec, shape, kv_dtype, device, max_model_len, max_seq_tokens)
    cpu_blocks = int(spec.cpu_offload_gib * 2**30) // per_block
    if len(shape.kv_groups) == 1:
        groups = ((budget // per_block, cpu_blocks),)
    else:
        groups = tuple(zip(hybrid_blocks(spec, shape, budget // (per_block // shape.num_layers)),
                           [cpu_blocks] * len(shape.kv_groups)))
    if min(n for n, _ in groups) < 1:
        raise ConfigError(f"engine.kv_cache_gib: {budget} bytes hold no {per_block}-byte block; raise it")
    return KVLayout(per_token, per_block, groups[0][0], cpu_blocks, budget, source, groups)


def window_blocks_cap(spec, window: int) -> int:
    """Most blocks a sliding-window group can hold at once: each running sequence its window
    (plus the block being filled and one partly out of the window), and the step's new tokens."""
    return spec.max_num_seqs * (cdiv(window, spec.block_size) + 2) + cdiv(spec.max_num_batched_tokens,
                                                                           spec.block_size)


def hybrid_blocks(spec, shape: ModelShape, layer_blocks: int) -> list[int]:
    """Blocks per KV group from a budget of `layer_blocks` single-layer blocks: the same number
    for every group, except that a sliding-window group gets no more than it can ever hold
    (window_blocks_cap) and the rest goes to the others (the full-attention layers), which is
    where long sequences need it."""
    groups = shape.kv_groups
    layers = [shape.group_layers(g) for g in range(len(groups))]
    capped: dict[int, int] = {}
    while True:
        free = [g for g in range(len(groups)) if g not in capped]
        left = layer_blocks - sum(layers[g] * n for g, n in capped.items())
        share = left // max(1, sum(layers[g] for g in free)) if free else 0
        newly = {g: window_blocks_cap(spec, groups[g]) for g in free
                 if groups[g] and window_blocks_cap(spec, groups[g]) < share}
        if not newly:
            return [capped.get(g, share) for g in range(len(groups))]
        capped.update(newly)


def preemption_costs(shape: ModelShape, block_bytes: int, device: torch.device) -> tuple[float, float]:
    """(seconds to recompute one token, seconds to move one block out and back) for the
    swap-or-recompute choice. Rough rates: host copies ~10 GB/s on a CPU and ~20 GB/s over PCIe;
    recompute is 2 FLOP per parameter per token at ~150 GFLOP/s (a 2-core CPU) or ~300 TFLOP/s
    (an H200 in bf16, derated). Only their ratio matters, and on a CPU it favours swapping by far."""
    flops = 1.5e11 if device.type == "cpu" else 3e14
    copy_bw = 1e10 if device.type == "cpu" else 2e10
    return 2 * shape.non_embedding_params() / flops, 2 * block_bytes / copy_bw


def decode_graphs(spec, backend: Backend, device: torch.device, model, kv_layers, max_model_len: int,
                  window: int | None):
    """CUDA graphs for decode-only steps (CUDA with the Triton kernels), or None."""
    if not (spec.cuda_graphs and backend.attention == "triton" and device.type == "cuda"):
        return None
    if len(model.shape.kv_groups) > 1:
        return None  # the graphs replay one block table per sequence; hybrid KV has one per group
    if model.shape.num_experts:
        # The fused-MoE launcher has no host synchronisation, but its capture has not been run on
        # a GPU yet: MoE decode stays eager until it has.
        return None
    from .cuda_graphs import DecodeGraphs

    return DecodeGraphs(model, kv_layers, spec.max_num_seqs, cdiv(max_model_len, spec.block_size), window)
