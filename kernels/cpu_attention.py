"""The CPU ops (csrc/): decode and prefill attention over the paged cache, and fused elementwise
layer ops (RMSNorm with the residual add, rotary embedding, SiLU- and GELU-tanh-and-multiply,
greedy argmax).
Built on first use.

It is compiled once per source, compiler flags and CPU (it is built with -march=native, or for
$BATCHGEN_CPU_MARCH) into $BATCHGEN_CACHE/ext (default ~/.cache/batchgen/ext); later processes
only load the library.
Where no C++ compiler is at hand, `available()` is False and the engine keeps the torch path.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger("batchgen")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_attention_cpu.cpp", "prefill_attention_cpu.cpp", "fused_cpu.cpp",
                                          "gemm_cpu.cpp")]
# Part of the build key too: a changed header must rebuild.
_HEADERS = [_CSRC / "cpu_common.h"]
# -fopenmp: at::parallel_for is inline OpenMP, serial without it. The library then needs
# libgomp.so.1, which resolves to the copy torch has already loaded (same soname): one thread pool.
_OTHER_FLAGS = ["-ffast-math", "-fopenmp", "-std=c++17"]  # beside -O3 and -march (flags())
MARCH_ENV = "BATCHGEN_CPU_MARCH"
# /proc/cpuinfo flags that choose a kernel, and the macro a build defines where it may use them
ISA_MACROS = {"avx2": "__AVX2__", "fma": "__FMA__", "avx512f": "__AVX512F__", "avx512bw": "__AVX512BW__",
              "avx512vl": "__AVX512VL__", "avx512_bf16": "__AVX512BF16__", "avx512_fp16": "__AVX512FP16__",
              "amx_tile": "__AMX_TILE__", "amx_bf16": "__AMX_BF16__", "amx_int8": "__AMX_INT8__",
              "avx_ne_convert": "__AVXNECONVERT__"}
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


def march() -> str:
    """What the ops are compiled for: $BATCHGEN_CPU_MARCH as GCC's -march takes it, else native.
    A target below this CPU's (x86-64-v3: AVX2 and FMA, as AMD Zen 2/3) builds and runs the kernels
    that CPUs of that kind get, here: their tests and benchmarks on an AVX-512 machine."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def flags(arch: str | None = None) -> list[str]:
    """The compiler flags of a build for -march=`arch` (default: march())."""
    return ["-O3", f"-march={arch or march()}", *_OTHER_FLAGS]


def compiler() -> str:
    """The C++ compiler the ops build with: $CXX, else c++ (as torch.utils.cpp_extension picks it)."""
    return os.environ.get("CXX", "c++")


@functools.lru_cache(maxsize=None)
def target_isa(arch: str) -> frozenset[str] | None:
    """The ISA_MACROS flags that a build for -march=`arch` may use; None for native (all of this
    CPU's). Asks the compiler (its predefined macros); a target it refuses is an error naming
    $BATCHGEN_CPU_MARCH."""
    if arch == "native":
        return None
    import subprocess

    cxx = compiler()
    try:
        r = subprocess.run([cxx, f"-march={arch}", "-dM", "-E", "-x", "c++", os.devnull],
                           capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise RuntimeError(f"{MARCH_ENV}={arch}: cannot run the C++ compiler {cxx!r}: {e}") from e
    if r.returncode != 0:
        raise RuntimeError(f"{MARCH_ENV}={arch}: {cxx} refuses -march={arch}: {r.stderr.strip()[-500:]}")
    defined = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define ")}
    return frozenset(flag for flag, macro in ISA_MACROS.items() if macro in defined)


def _build_dir() -> Path:
    from batchgen.cache import cache_root

    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + " ".join(flags()).encode()
                         + _cpu_id().encode() + torch.__version__.encode()).hexdigest()[:16]
    d = cache_root() / "ext" / f"cpu_ops_{key}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja wheel's binary sits in the venv, which a plain
    `.venv/bin/python` run does not put there."""
    if shutil.which("ninja"):
        return
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):
        bin_dir = os.path.join(sys.prefix, "bin")
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def load() -> None:
    """Build (if needed) and load the op; raises with the compiler's message when it cannot."""
    with _lock:
        if "error" in _state:
            raise RuntimeError(_state["error"])
        if _state.get("loaded"):
            return
        try:
            from torch.utils.cpp_extension import load as cpp_load

            _ninja_on_path()

            cpp_load(name="batchgen_cpu_ops", sources=[str(p) for p in _SOURCES], extra_cflags=flags(), extra_ldflags=["-fopenmp"],
                     build_directory=str(_build_dir()), is_python_module=False, verbose=False)
        except Exception as e:  # no compiler, no ninja, a failed build: all mean "not here"
            _state["error"] = f"the CPU ops could not be built: {type(e).__name__}: {str(e)[-2000:]}"
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
        log.warning("%s; attention and the layer ops stay on the torch path", e)
        return False


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, with_lse: bool = False, out: torch.Tensor | None = None,
                 softcap: float = 0.0):
    """Each row i of q [n, heads, dim] (rows may be strided) attends to keys [lo[i], hi[i]) of its block table.
    Caches [blocks, block_size, kv_heads, dim] in float32/bfloat16, or int8 with per-(slot, head)
    scales [blocks, block_size, kv_heads]. Returns out [n, heads, dim] in q's dtype (written into
    `out` when given: contiguous, q's shape and dtype), and with with_lse also the fp32
    log-sum-exp of the scaled scores [n, heads]. softcap > 0 caps the scaled scores at
    softcap * tanh(s / softcap) first (Gemma 2)."""
    load()
    n, heads, d = q.shape
    # The op reads and writes fp32, and bf16 where its specialised kernel fits; else via fp32.
    native = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _fast(heads, k_cache.shape[2], d))
    if not native:
        qx = q.to(torch.float32).contiguous()
    else:  # a view into the fused QKV output (rows strided) is read in place
        qx = q if q.stride(-1) == 1 and q.stride(1) == d else q.contiguous()
    ox = out if native and out is not None else torch.empty(q.shape, dtype=qx.dtype)
    lse = torch.empty(q.shape[:2], dtype=torch.float32) if with_lse else None
    torch.ops.batchgen_cpu.paged_decode(ox, lse, qx, k_cache, v_cache, k_scale, v_scale, block_tables, lo, hi,
                                        float(scale), float(softcap or 0.0))
    if not native:  # ox is an fp32 temporary
        ox = out.copy_(ox) if out is not None else ox.to(q.dtype)
    return (ox, lse) if with_lse else ox


@functools.lru_cache(maxsize=None)
def _fast(heads: int, kv_heads: int, head_dim: int) -> bool:
    return bool(torch.ops.batchgen_cpu.has_fast_path(heads, kv_heads, head_dim))


@functools.lru_cache(maxsize=None)
def has_prefill_path(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether paged_prefill runs here for this shape (it needs AVX-512 or AVX2 and head_dim % 16 == 0)."""
    return bool(torch.ops.batchgen_cpu.has_prefill_path(heads, kv_heads, head_dim))


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens: torch.Tensor, start_pos: torch.Tensor, scale: float, window: int = 0,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of prefill chunks whose K/V are already in the cache. Sequence p's queries
    are rows [cu_seqlens[p], cu_seqlens[p + 1]) of q [n, heads, dim] (float32 or bfloat16; rows
    may be strided), at positions start_pos[p], start_pos[p] + 1, ...; each sees the keys at or
    before its own position (and within `window` when > 0) through block_tables[p]. Caches as for
    paged_decode, and so is softcap. Returns out [n, heads, dim] in q's dtype (written into `out`
    when given)."""
    load()
    if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    torch.ops.batchgen_cpu.paged_prefill(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens,
                                         start_pos, int(window or 0), float(scale), float(softcap or 0.0))
    return out


def _reference_kv(k_cache, v_cache, table, pos, group, k_scale, v_scale):
    """K and V (fp32, dequantised, repeated for each query head of a group) at positions `pos` of
    one block table: [len(pos), kv_heads * group, dim] each."""
    nb, bs, kvh, d = k_cache.shape
    slots = table[pos // bs] * bs + pos % bs
    k = k_cache.reshape(nb * bs, kvh, d)[slots].float()
    v = v_cache.reshape(nb * bs, kvh, d)[slots].float()
    if k_scale is not None:
        k = k * k_scale.reshape(nb * bs, kvh)[slots][..., None]
        v = v * v_scale.reshape(nb * bs, kvh)[slots][..., None]
    return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def paged_prefill_reference(q, k_cache, v_cache, block_tables, cu_seqlens, start_pos, scale, window=0,
                            k_scale=None, v_scale=None, softcap=0.0):
    """Plain torch, fp32 math."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for p in range(block_tables.shape[0]):
        a, b, s = int(cu_seqlens[p]), int(cu_seqlens[p + 1]), int(start_pos[p])
        pos = torch.arange(s + b - a)
        k, v = _reference_kv(k_cache, v_cache, block_tables[p], pos, group, k_scale, v_scale)
        qpos = torch.arange(s, s + b - a)[:, None]
        mask = pos[None, :] <= qpos
        if window:
            mask &= pos[None, :] > qpos - window
        sc = torch.einsum("nhd,khd->hnk", q[a:b].float(), k) * scale
        if softcap:
            sc = torch.tanh(sc / softcap) * softcap
        sc = sc.masked_fill(~mask[None], float("-inf"))
        out[a:b] = torch.einsum("hnk,khd->nhd", sc.softmax(-1), v).to(q.dtype)
    return out


def paged_decode_reference(q, k_cache, v_cache, block_tables, lo, hi, scale, k_scale=None, v_scale=None, softcap=0.0):
    """Plain torch, fp32 math: (out, lse)."""
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    for i in range(q.shape[0]):
        pos = torch.arange(int(lo[i]), int(hi[i]))
        k, v = _reference_kv(k_cache, v_cache, block_tables[i], pos, group, k_scale, v_scale)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        lse[i] = torch.logsumexp(s, -1)
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v).to(q.dtype)
    return out, lse


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, when given), then RMSNorm(h) * weight: [n, hidden] -> [n, hidden]."""
    out = torch.empty(h.shape, dtype=h.dtype)
    torch.ops.batchgen_cpu.add_rms_norm(out, h, delta, weight, float(eps))
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place: x [n, heads, dim] (rows may be strided), cos/sin [n, dim]."""
    torch.ops.batchgen_cpu.rope_(x, cos, sin)
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2 * inter] -> silu(gate) * up, [n, inter]."""
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
    torch.ops.batchgen_cpu.silu_mul(out, gate_up)
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[n, 2 * inter] -> gelu_tanh(gate) * up, [n, inter] (Gemma's gated MLP)."""
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
    torch.ops.batchgen_cpu.gelu_tanh_mul(out, gate_up)
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [n, kv_heads, dim] (rows may be strided) into cache slots; a slot outside the cache is
    refused. (index_copy_ dispatches per row.)"""
    torch.ops.batchgen_cpu.store_kv(k, v, k_cache, v_cache, slot_mapping)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) for [n, vocab] float32/bf16 logits (first index among ties), reading
    bf16 rows directly: converting the logits to fp32 first would be a pass over all of them
    (examples/bench_logits.py times the lm_head and argmax of a step)."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    torch.ops.batchgen_cpu.argmax_rows(out, x)
    return out


# Error bound of bf16 logits (see argmax_verified): the two input roundings (2 x 2^-8 relative)
# plus fp32 accumulation, with margin, times |h| |w_t|; and the bf16 output rounding, times |logit|.
_C_REL = 1.02 * 2.0 ** -7
_C_OUT = 1.01 * 2.0 ** -8


def argmax_verified(approx: torch.Tensor, h: torch.Tensor, w: torch.Tensor, wnorm: torch.Tensor) -> torch.Tensor:
    """argmax over vocab of the fp32 logits h @ w.T [n, vocab], given approx, the bf16 logits of
    h.bfloat16() @ w.bfloat16().T (fp32 accumulation): only tokens that the error bound leaves in
    reach of the largest get an fp32 dot product. wnorm [vocab] holds the rows' L2 norms, rounded up."""
    out = torch.empty(h.shape[0], dtype=torch.long)
    torch.ops.batchgen_cpu.argmax_verified(out, approx, h, w, wnorm, _C_REL, _C_OUT)
    return out
