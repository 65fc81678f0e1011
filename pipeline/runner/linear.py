"""Matmul paths for the CPU, chosen by measurement (`batchgen bench` prints the GEMM table).

On AVX-512 and AMX CPUs, oneDNN with a pre-packed weight beats F.linear's MKL path for fp32,
and bf16 through oneDNN runs at several times the fp32 rate where the CPU has native bf16 dot
products. `plain` keeps F.linear: it is the exact reference path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear:
    """y = x @ W.T (+ b), with the weight packed once for the chosen path."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, path: str, batch_hint: int = 256) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.path = path
        if path == "onednn" and weight.device.type == "cpu":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
        else:
            self.path = "plain"
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
