"""The CPU decode-attention op (csrc/paged_attention_cpu.cpp), built on first use.

It is compiled once per source, compiler flags and CPU (it is built with -march=native) into
$BATCHGEN_CACHE/ext (default ~/.cache/batchgen/ext); later processes only load the library.
Where no C++ compiler is at hand, `available()` is False and the engine keeps the torch path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger("batchgen")

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# -fopenmp: at::parallel_for is inline OpenMP, serial without it. The library then needs
# libgomp.so.1, which resolves to the copy torch has already loaded (same soname): one thread pool.
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17"]
_lock = threading.Lock()
_state: dict = {}


def _cpu_id() -> str:
    """Model name and flags of this CPU: -march=native code must not run on another kind."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _build_dir() -> Path:
    from batchgen.models.loader import cache_root

    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_id().encode()
                         + torch.__version__.encode()).hexdigest()[:16]
    d = cache_root() / "ext" / f"paged_attention_cpu_{key}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def load() -> None:
    """Build (if needed) and load the op; raises with the compiler's message when it cannot."""
    with _lock:
        if "error" in _state:
            raise RuntimeError(_state["error"])
        if _state.get("loaded"):
            return
        try:
            from torch.utils.cpp_extension import load as cpp_load

            cpp_load(name="batchgen_paged_attention_cpu", sources=[str(_SOURCE)], extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                     build_directory=str(_build_dir()), is_python_module=False, verbose=False)
        except Exception as e:  # no compiler, no ninja, a failed build: all mean "not here"
            _state["error"] = f"the CPU attention op could not be built: {type(e).__name__}: {str(e)[-2000:]}"
            raise RuntimeError(_state["error"]) from e
        _state["loaded"] = True


def available() -> bool:
    """True when the op is built and loaded (building it now if needed)."""
    if os.environ.get("BATCHGEN_NO_CPP") == "1":
        return False
    try:
        load()
        return True
    except RuntimeError as e:
        log.warning("%s; decode attention stays on the torch path", e)
        return False


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, with_lse: bool = False):
    """Each row i of q [n, heads, dim] attends to keys [lo[i], hi[i]) of its block table.
    Caches [blocks, block_size, kv_heads, dim] in float32/bfloat16, or int8 with per-(slot, head)
    scales [blocks, block_size, kv_heads]. Returns out [n, heads, dim] (and the fp32 log-sum-exp of
    the scaled scores [n, heads] with with_lse)."""
    load()
    qf = q.to(torch.float32).contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    lse = torch.empty(q.shape[:2], dtype=torch.float32) if with_lse else None
    torch.ops.batchgen_cpu.paged_decode(out, lse, qf, k_cache, v_cache, k_scale, v_scale, block_tables, lo, hi,
                                        float(scale))
    out = out.to(q.dtype)
    return (out, lse) if with_lse else out


def paged_decode_reference(q, k_cache, v_cache, block_tables, lo, hi, scale, k_scale=None, v_scale=None):
    """Plain torch, fp32 math: (out, lse)."""
    nb, bs, kvh, d = k_cache.shape
    group = q.shape[1] // kvh
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    for i in range(q.shape[0]):
        pos = torch.arange(int(lo[i]), int(hi[i]))
        slots = block_tables[i, pos // bs] * bs + pos % bs
        k = k_cache.reshape(nb * bs, kvh, d)[slots].float()
        v = v_cache.reshape(nb * bs, kvh, d)[slots].float()
        if k_scale is not None:
            k = k * k_scale.reshape(nb * bs, kvh)[slots][..., None]
            v = v * v_scale.reshape(nb * bs, kvh)[slots][..., None]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        lse[i] = torch.logsumexp(s, -1)
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out, lse
