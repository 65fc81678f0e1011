"""Matmul paths for the CPU, chosen by measurement (`batchgen bench` prints the GEMM table).

On AVX-512 and AMX CPUs, oneDNN with a pre-packed weight beats F.linear's MKL path for fp32,
and bf16 through oneDNN runs at several times the fp32 rate where the CPU has native bf16 dot
products. `plain` keeps F.linear: it is the exact reference path.

`dpbf16` is our own bf16 GEMM (kernels/csrc/gemm_cpu.cpp) for CPUs with AVX512-BF16 and no AMX
(AMD Zen 4/5, Intel Cooper Lake): at a decode step's tens of rows oneDNN stalls on the weight
stream, and this kernel prefetches the next weight panel while it computes the current one.
Weights that are not bf16 (an fp32 model) stay on oneDNN under it. On AMX CPUs tiles are several
times faster, so `auto` never picks it there.

`amx` is our bf16 GEMM on AMX tiles (Intel Sapphire Rapids and later; kernels/csrc/gemm_cpu.cpp,
gemm_bf16_amx), on dpbf16's packed weight, for K a multiple of 32 (other linears stay on oneDNN).
oneDNN's AMX kernels ran a decode step's 1-32 rows at 8-12 GB/s of weight stream on Qwen2.5-1.5B's
shapes (2 cores), as slowly as 64 rows; this one ran them 1.7-1.9x faster, 1.16-1.24x at 48-64 rows
and 0.97-0.99x at 128-256 (`examples/bench_gemm_rows.py --paths onednn,amx`), and applies the MLP's
gate/up activation in its epilogue. `auto` takes it for bf16 weights on AMX CPUs.

`fma` is our GEMM for AVX2 CPUs without AVX-512 (AMD Zen 2/3, Intel client parts), for both weight
dtypes. bf16: oneDNN has no bf16 kernels there (its weight reorder refuses bf16) and F.linear's
bf16 fallback runs at a fraction of the fp32 rate, so the bf16 weight is widened to fp32 in
registers and multiplied with FMA. fp32: 6 x 16 register tiles over 16-column weight panels, which
ran 11-54% above oneDNN's AVX2 fp32 GEMM at Qwen2.5-0.5B's shapes on a Zen 2 (most at decode row
counts; `examples/bench_gemm_rows.py --dtype float32 --paths onednn,fma`). Both share one blocking.
Where the ops are built with AVX-512, fp32 weights on `fma` go to our AVX-512 fp32 GEMM instead
(gemm_f32_avx512: the dpbf16 kernel's walk with fp32 FMAs, the gate/up activation in its epilogue).
`auto` picks `fma` for bf16 weights wherever oneDNN cannot take them, and for fp32 weights on CPUs
with AVX2 and no AVX-512, and on AMD Zen 4, whose AVX-512 runs on 256-bit units: there oneDNN's
fp32 GEMM ran at 64-85% of the FMA peak at a decode step's 8-32 rows and ours 1.10-1.46x faster at
8-16 rows since its prefetch cursor (0.95-0.98x from 64 rows up; README, The engine). Other
AVX-512 CPUs keep oneDNN's fp32 kernels: on a Zen 5 the same walk measured 0.87-1.16x oneDNN's,
mostly level (before the cursor; not re-measured there).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..workload import cpu_flags, half_width_avx512
from .hostmem import on_huge_pages


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.lru_cache(maxsize=None)
def dpbf16_available() -> bool:
    """Whether the dpbf16 GEMM runs here: the C++ ops built with AVX512-BF16 (for -march=native,
    or $BATCHGEN_CPU_MARCH)."""
    from batchgen.kernels import cpu_attention

    return cpu_attention.available() and bool(torch.ops.batchgen_cpu.has_dpbf16_gemm())


@functools.lru_cache(maxsize=None)
def fma_available() -> bool:
    """Whether the fma GEMM runs here: the C++ ops built with AVX2 and FMA (for -march=native,
    or $BATCHGEN_CPU_MARCH)."""
    from batchgen.kernels import cpu_attention

    return cpu_attention.available() and bool(torch.ops.batchgen_cpu.has_fma_bf16_gemm())


@functools.lru_cache(maxsize=None)
def avx512_f32_available() -> bool:
    """Whether the AVX-512 fp32 GEMM runs here: the C++ ops built with AVX-512F (for -march=native,
    or $BATCHGEN_CPU_MARCH)."""
    from batchgen.kernels import cpu_attention

    return cpu_attention.available() and bool(torch.ops.batchgen_cpu.has_avx512_f32_gemm())


@functools.lru_cache(maxsize=None)
def amx_gemm_available() -> bool:
    """Whether the amx GEMM runs here: the C++ ops built with AMX-BF16 (the -march target) and the OS
    granting this process AMX tile data."""
    from batchgen.kernels import cpu_attention

    return cpu_attention.available() and bool(torch.ops.batchgen_cpu.has_amx_gemm())


@functools.lru_cache(maxsize=None)
def onednn_bf16_available() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (AVX512-BW/VL/DQ, AVX-NE-CONVERT or AMX); under a
    $BATCHGEN_CPU_MARCH below this CPU's, whether it would on a CPU of that target."""
    if not (onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    from batchgen.kernels import cpu_attention

    if cpu_attention.march() == "native":
        return True
    return bool(cpu_flags() & {"avx512bw", "amx_bf16", "avx_ne_convert"})


def fma_f32_preferred() -> bool:
    """Whether `auto` puts fp32 weights on our fp32 GEMM (the fma path): AVX2 and FMA without AVX-512,
    or AVX-512 on 256-bit units (AMD Zen 4), where our AVX-512 kernel beat oneDNN's at decode row
    counts. Other AVX-512 CPUs keep oneDNN's kernels."""
    if "avx512f" not in cpu_flags():
        return fma_available()
    return half_width_avx512() and avx512_f32_available()


def dpbf16_preferred() -> bool:
    """Whether `auto` takes dpbf16: it runs here and the CPU has no AMX (where the amx GEMM, else
    oneDNN's AMX kernels, run bf16)."""
    return "amx_bf16" not in cpu_flags() and dpbf16_available()


def own_bf16_path() -> str | None:
    """Our GEMM that `auto` puts bf16 weights on where it runs: amx on AMX CPUs, dpbf16 on other
    AVX512-BF16 CPUs; None elsewhere (oneDNN, or fma on AVX2 CPUs)."""
    if "amx_bf16" in cpu_flags() and amx_gemm_available():
        return "amx"
    return "dpbf16" if dpbf16_preferred() else None


# gate/up activations the dpbf16 GEMM can apply in its epilogue (the op's `act`)
GATED_ACTS = {"silu": 1, "gelu_tanh": 2}


def interleave_gate_up(t: torch.Tensor, block: int = 16) -> torch.Tensor:
    """[2I, ...] (gate rows, then up rows) -> the same rows as alternating blocks of `block` gate and
    `block` up rows: the layout of gemm_bf16's gated epilogue (I a multiple of `block`)."""
    gate, up = t.chunk(2, dim=0)
    rest = t.shape[1:]
    return torch.stack([gate.reshape(-1, block, *rest), up.reshape(-1, block, *rest)], 1).reshape(t.shape)


# Rows per tile of a prefill-sized call (the dpbf16 Linear's GEMM calls, the CPU MLP's tiles).
# The dpbf16 panel walk reads all of x once per 64-column panel; over a 2,048-row prefill step
# that is 8 MiB from L3 each time, and the QKV projection ran at 82% of the MLP tiles' rate in the
# same run (3B, Zen 4), 92% in 256-row calls. The MLP: see moe.DenseMLP.
ROW_TILE = 256


def row_tiles(n: int) -> range | None:
    """Starts of the ROW_TILE-row tiles of n rows (the last one ragged), or None when n is at
    most 1.5 tiles and runs as one call."""
    return range(0, n, ROW_TILE) if n > ROW_TILE * 3 // 2 else None


class Linear:
    """y = x @ W.T (+ b), with the weight packed once for the chosen path.

    gated ("silu" or "gelu_tanh"): W is a fused gate/up weight [2I, K] (gate rows first). Where the
    dpbf16 GEMM takes it (I a multiple of 16), the call returns act(gate) * up [.., I] from the
    GEMM's epilogue and `fused_act` is set; elsewhere it returns the [.., 2I] gate/up output as
    usual and the caller applies the activation."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, path: str, batch_hint: int = 256,
                 gated: str | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.path = path
        self.fused_act = None
        cpu = weight.device.type == "cpu"
        packable = cpu and weight.dtype == torch.bfloat16 and self.in_features % 2 == 0
        f32 = cpu and weight.dtype == torch.float32
        if path == "dpbf16" and not (packable and dpbf16_available()):
            path = "onednn"
        if path == "amx" and not (packable and self.in_features % 32 == 0 and amx_gemm_available()):
            path = "onednn"
        if path == "fma" and not ((packable or f32) and fma_available()):
            path = "onednn"
        if path == "onednn" and cpu and weight.dtype == torch.bfloat16 and not onednn_bf16_available():
            path = "fma" if packable and fma_available() else "plain"  # oneDNN refuses bf16 here
        self.path = path
        self._tiled = path in ("dpbf16", "amx")  # ROW_TILE-row calls: the panel walks read all of x per panel
        if path in ("dpbf16", "fma", "amx"):
            ops = torch.ops.batchgen_cpu
            if f32 and avx512_f32_available():  # fma's fp32 GEMM on AVX-512, the gate/up activation in its epilogue
                if gated in GATED_ACTS and self.out_features % 32 == 0:
                    act = GATED_ACTS[gated]
                    self.fused_act = gated
                    weight, bias = interleave_gate_up(weight), interleave_gate_up(bias) if bias is not None else None
                else:
                    act = 0
                self._op = lambda out, x, w, b: ops.gemm_f32_avx512(out, x, w, b, act)
                self._tiled = True
                self.weight = ops.pack_f32_weight(weight.contiguous())
            elif f32:  # fma's fp32 GEMM on AVX2
                self._op, self.weight = ops.gemm_f32_fma, ops.pack_f32_weight(weight.contiguous())
            elif path in ("dpbf16", "amx") and gated in GATED_ACTS and self.out_features % 32 == 0:
                act = GATED_ACTS[gated]
                self.fused_act = gated
                gemm = ops.gemm_bf16 if path == "dpbf16" else ops.gemm_bf16_amx
                self._op = lambda out, x, w, b: gemm(out, x, w, b, act)
                self.weight = ops.pack_bf16_weight(interleave_gate_up(weight).contiguous())
                bias = interleave_gate_up(bias) if bias is not None else None
            else:
                self._op = {"dpbf16": ops.gemm_bf16, "amx": ops.gemm_bf16_amx}.get(path, ops.gemm_bf16_fma)
                self.weight = ops.pack_bf16_weight(weight.contiguous())
            self.weight = on_huge_pages(self.weight)
            self._bias32 = bias.float().contiguous() if bias is not None else None
        elif path == "onednn" and cpu:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
        else:
            self.path = "plain"
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out: where to write y (e.g. rows of a larger output). The packed paths write into it when
        it is contiguous and of the weight's dtype; otherwise y is copied into it."""
        if self.path in ("dpbf16", "fma", "amx"):
            x2 = x.reshape(-1, x.shape[-1])
            dt = self.weight.dtype  # fp32 (gemm_f32_fma) or bf16 (packed as bf16)
            if x2.stride(-1) != 1 or x2.dtype != dt:
                x2 = x2.to(dt).contiguous()
            cols = self.out_features // 2 if self.fused_act else self.out_features
            direct = out is not None and out.shape == (x2.shape[0], cols) and out.dtype == dt and out.is_contiguous()
            y = out if direct else x2.new_empty(x2.shape[0], cols)
            tiles = row_tiles(x2.shape[0]) if self._tiled else None
            if tiles:
                for i in tiles:
                    self._op(y[i : i + ROW_TILE], x2[i : i + ROW_TILE], self.weight, self._bias32)
            else:
                self._op(y, x2, self.weight, self._bias32)
            y = y.view(*x.shape[:-1], cols)
            if direct:
                return y
        elif self.path == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        if out is None:
            return y
        return out.copy_(y.reshape(out.shape))
