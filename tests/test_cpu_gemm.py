"""Our GEMMs (kernels/csrc/gemm_cpu.cpp: bf16 on dpbf16 (AVX512-BF16), amx (AMX tiles) and fma (AVX2),
fp32 on fma (AVX2) and on AVX-512) against fp32 and float64 matmuls, and where `auto` picks them."""
import pytest
import torch

from batchgen.runner import build, linear
from batchgen.runner.linear import Linear

needs_op = pytest.mark.skipif(not linear.dpbf16_available(), reason="no AVX512-BF16 build of the C++ ops here")
needs_fma = pytest.mark.skipif(not linear.fma_available(), reason="no AVX2/FMA build of the C++ ops here")
needs_avx512 = pytest.mark.skipif(not linear.avx512_f32_available(), reason="no AVX-512 build of the C++ ops here")
needs_amx = pytest.mark.skipif(not linear.amx_gemm_available(), reason="no AMX build of the C++ ops (or no AMX) here")
# Every test of the kernels runs on both; an AVX-512 machine runs the fma one too.
PATHS = [pytest.param("dpbf16", marks=needs_op), pytest.param("fma", marks=needs_fma)]
# Both fp32 kernels (the fma path takes the AVX-512 one where it is built): an AVX-512 machine runs both.
F32_OPS = [pytest.param("gemm_f32_fma", marks=needs_fma), pytest.param("gemm_f32_avx512", marks=needs_avx512)]


def _f32_gemm(op: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """One call of an fp32 op on pack_f32_weight's layout, whatever the rows."""
    ops = torch.ops.batchgen_cpu
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    getattr(ops, op)(out, x, ops.pack_f32_weight(w), b)
    return out


def _ref(x, w, b):
    """fp32 sums of the bf16 inputs, rounded once to bf16: what the kernel computes."""
    y = x.float() @ w.float().t()
    return (y + b.float() if b is not None else y).to(torch.bfloat16).float()


@pytest.mark.parametrize("path", PATHS)
# N: whole 64-column panels, a 3-block and a 1-block last panel, and a ragged last block (N % 16);
# K: one chunk, several (K > 2,048: fp32 partial sums between chunks) and a ragged last chunk.
@pytest.mark.parametrize("n,k", [(128, 64), (176, 96), (80, 4098), (33, 2050), (1, 6000), (1000, 130)])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 64])  # full 6-row tiles and every tail
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_fp32_sums(n, k, m, bias, path):
    _check_fp32_sums(path, n, k, m, bias)


def _check_fp32_sums(path: str, n: int, k: int, m: int, bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A bf16 Linear on `path` (packed as pack_bf16_weight packs) against fp32 sums of random
    [m, k] x [n, k] inputs; returns (the Linear, x, its output)."""
    g = torch.Generator().manual_seed(n * 31 + k + m)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    x = torch.randn(m, k, generator=g).bfloat16()
    lin = Linear(w, b, path)
    assert lin.path == path and lin.weight.shape == ((n + 15) // 16, k // 2, 16, 2)
    out = lin(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    want = _ref(x, w, b)
    # Only the fp32 summation order differs: at most one bf16 step on the larger values.
    err = (out.float() - want).abs()
    tol = 2 ** -7 * want.abs() + 1e-3 * want.abs().max()
    assert bool((err <= tol).all()), f"max error {err.max().item()} at {divmod(int(err.argmax()), n)}"
    return lin, x, out


@needs_amx
# N: a whole 32-column unit, a last unit of one block, a ragged last block; K: one 32-k step, many;
# M: 1, a ragged 16-row tile, whole tiles, an odd tile count, a ragged tile pair, 256-row calls.
@pytest.mark.parametrize("n,k", [(64, 32), (48, 1536), (33, 96), (1, 640), (1000, 224)])
@pytest.mark.parametrize("m", [1, 7, 16, 17, 32, 48, 63, 389])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_gemm_matches_fp32_sums(n, k, m, bias):
    lin, x, out = _check_fp32_sums("amx", n, k, m, bias)
    # the rows of a strided view (a [.., 2K] buffer's first K columns) give the same output
    wide = torch.cat([x, torch.full_like(x, float("nan"))], dim=1)[:, :k]
    assert torch.equal(lin(wide), out)


@needs_amx
def test_amx_takes_k_in_32s_only_and_refuses_bad_args():
    w = (torch.randn(64, 48) * 0.05).bfloat16()
    assert Linear(w, None, "amx").path == "onednn"  # K = 48: the linear stays on oneDNN
    ops = torch.ops.batchgen_cpu
    packed = ops.pack_bf16_weight(w)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        ops.gemm_bf16_amx(torch.empty(2, 64, dtype=torch.bfloat16), torch.randn(2, 48).bfloat16(), packed, None, 0)
    with pytest.raises(RuntimeError, match="act is 0"):
        ops.gemm_bf16_amx(torch.empty(2, 64, dtype=torch.bfloat16), torch.randn(2, 64).bfloat16(),
                          ops.pack_bf16_weight((torch.randn(64, 64) * 0.05).bfloat16()), None, 3)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [192, 389, 1030])  # prefill-sized row counts, with and without a tail
def test_chunked_k_with_many_rows(m, path):
    """K > 2,048 over hundreds of rows: every row tile keeps its own partial sums between chunks."""
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(72, 4100, generator=g) * 0.05).bfloat16()
    b = torch.randn(72, generator=g).bfloat16()
    x = torch.randn(m, 4100, generator=g).bfloat16()
    out, want = Linear(w, b, path)(x).float(), _ref(x, w, b)
    err = (out - want).abs()
    tol = 2 ** -7 * want.abs() + 1e-3 * want.abs().max()
    assert bool((err <= tol).all()), f"max error {err.max().item()} at {divmod(int(err.argmax()), 72)}"


@pytest.mark.parametrize("path", PATHS)
def test_gemm_reads_strided_rows_and_leading_dims(path):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(96, 64, generator=g) * 0.05).bfloat16()
    lin = Linear(w, None, path)
    wide = torch.randn(10, 200, generator=g).bfloat16()
    x = wide[:, 40:104]  # rows 200 apart
    assert x.stride() == (200, 1)
    torch.testing.assert_close(lin(x).float(), _ref(x, w, None), rtol=2 ** -7, atol=1e-3)
    x3 = torch.randn(2, 3, 64, generator=g).bfloat16()
    y3 = lin(x3)
    assert y3.shape == (2, 3, 96)
    torch.testing.assert_close(y3.reshape(6, 96), lin(x3.reshape(6, 64)), rtol=0, atol=0)
    assert lin(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 96)


@needs_fma
@pytest.mark.parametrize("m", [64, 300])  # one 64-row block; a 256-row block and a 44-row one
@pytest.mark.parametrize("bf16", [False, True])
def test_fma_prefill_rows_walk_panels_in_groups(m, bf16):
    """At prefill rows with more x than L2 holds, the fma kernels walk the weight's panels in groups,
    slice by slice (16 panels a group at 64 rows, 8 at 256, one below 64 rows): 38 panels with a
    ragged last one make each thread's run end in a partial group, and K = 1,100 gives uneven
    slices (5 x 220 fp32, 3 x 368 bf16)."""
    g = torch.Generator().manual_seed(m + bf16)
    w, b, x = torch.randn(600, 1100, generator=g) * 0.05, torch.randn(600, generator=g), torch.randn(m, 1100, generator=g)
    if bf16:
        w, b, x = w.bfloat16(), b.bfloat16(), x.bfloat16()
        out = Linear(w, b, "fma")(x).float()
        want = _ref(x, w, b)
        err = (out - want).abs()
        tol = 2 ** -7 * want.abs() + 1e-3 * want.abs().max()
    else:
        out = _f32_gemm("gemm_f32_fma", x, w, b)
        want = _ref64(x, w, b)
        err = (out.double() - want).abs()
        tol = 1e-6 * (1100 ** 0.5) * (x.double().abs() @ w.double().abs().t()).clamp_min(1e-3) + 1e-6
    assert bool((err <= tol).all()), f"max error {err.max().item()} at {divmod(int(err.argmax()), 600)}"


def _ref64(x, w, b):
    y = x.double() @ w.double().t()
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("op", F32_OPS)
# N: one panel, a ragged last panel (N % 16), many panels, a single column; K: below and above one
# 256-k slice (fma) and one 1,024-k chunk (AVX-512), uneven slices (300 -> 2 x 150, 4,864 -> 19 x 256
# or 5 x 973) and odd K; M: every 6-row tail and near-equal tile heights, and calls past 256 rows
# (fma's row blocks, one of a single row; the AVX-512 op takes any rows in one call).
@pytest.mark.parametrize("n,k", [(16, 64), (33, 300), (1000, 7), (1, 513), (72, 4864)])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 13, 32, 64, 257, 520])
@pytest.mark.parametrize("bias", [False, True])
def test_f32_gemm_matches_float64(n, k, m, bias, op):
    g = torch.Generator().manual_seed(n * 131 + k * 7 + m)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    out = _f32_gemm(op, x, w, b)
    want = _ref64(x, w, b)
    # fp32 sums in another order than float64's: errors of a few ulps of the sum's terms.
    err = (out.double() - want).abs()
    tol = 1e-6 * (k ** 0.5) * (x.double().abs() @ w.double().abs().t()).clamp_min(1e-3) + 1e-6
    assert bool((err <= tol).all()), f"max error {err.max().item()} at {divmod(int(err.argmax()), n)}"


@needs_fma
def test_fma_path_packs_fp32_weights_for_the_best_kernel_built():
    """Linear(fp32 weight, "fma"): the weight packed once as [N / 16, K, 16]; the AVX-512 op where the
    build has AVX-512 (in 256-row calls, as the dpbf16 path), else the AVX2 one. Same values as one call of it."""
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(40, 96, generator=g) * 0.05, torch.randn(40, generator=g), torch.randn(600, 96, generator=g)
    lin = Linear(w, b, "fma")
    assert lin.path == "fma" and lin.weight.shape == (3, 96, 16) and lin.weight.dtype == torch.float32
    avx512 = linear.avx512_f32_available()
    assert lin._tiled == avx512
    op = "gemm_f32_avx512" if avx512 else "gemm_f32_fma"
    assert torch.equal(lin(x), _f32_gemm(op, x, w, b))


@pytest.mark.parametrize("op", F32_OPS)
def test_f32_gemm_reads_strided_rows_and_leading_dims(op):
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(40, 64, generator=g), torch.randn(40, generator=g)
    wide = torch.randn(300, 200, generator=g)
    x = wide[:, 40:104]  # rows 200 apart, more than one 256-row block
    assert x.stride() == (200, 1)
    torch.testing.assert_close(_f32_gemm(op, x, w, b), _ref64(x, w, b).float(), rtol=1e-5, atol=1e-4)
    ops, packed = torch.ops.batchgen_cpu, torch.ops.batchgen_cpu.pack_f32_weight(w)
    with pytest.raises(RuntimeError, match="x has 63 features, the weight 64"):
        getattr(ops, op)(torch.empty(2, 40), torch.randn(2, 63), packed, None)
    with pytest.raises(RuntimeError, match="bias fp32"):
        getattr(ops, op)(torch.empty(2, 40), torch.randn(2, 64), packed, torch.randn(39))


@needs_fma
def test_fma_linear_takes_leading_dims_empty_and_other_dtypes():
    g = torch.Generator().manual_seed(4)
    lin = Linear(torch.randn(40, 64, generator=g), torch.randn(40, generator=g), "fma")
    x3 = torch.randn(2, 3, 64, generator=g)
    assert lin(x3).shape == (2, 3, 40)
    torch.testing.assert_close(lin(x3).reshape(6, 40), lin(x3.reshape(6, 64)), rtol=0, atol=0)
    assert lin(torch.empty(0, 64)).shape == (0, 40)
    x = torch.randn(5, 64, generator=g)
    assert torch.equal(lin(x.bfloat16()), lin(x.bfloat16().float()))  # other dtypes are widened first


@needs_avx512
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
# I: one 64-column tile pair, a last panel of one gate/up pair (I % 32 == 16); K over one chunk; M:
# 1, a 6-row tail, many tiles; with and without bias.
@pytest.mark.parametrize("inter,k,m,bias", [(32, 64, 1, False), (48, 2100, 13, True), (2240, 1536, 37, True),
                                           (96, 128, 300, False)])
def test_f32_gated_gemm_equals_gemm_then_activation(act, inter, k, m, bias):
    """The AVX-512 fp32 GEMM's gated epilogue gives what the plain GEMM followed by silu_mul /
    gelu_tanh_mul gives: the same sums, the same activation, up to the last bits where -ffast-math
    orders the activation's arithmetic differently in the two ops."""
    from batchgen.kernels import cpu_attention as ops

    g = torch.Generator().manual_seed(inter + k + m)
    w = torch.randn(2 * inter, k, generator=g) * 0.05
    b = torch.randn(2 * inter, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    plain, fused = Linear(w, b, "fma"), Linear(w, b, "fma", gated=act)
    assert plain.fused_act is None and fused.fused_act == act
    want = (ops.silu_mul if act == "silu" else ops.gelu_tanh_mul)(plain(x))
    got = fused(x)
    assert got.shape == (m, inter) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # and both near the float64 activation of the float64 sums
    gate, up = _ref64(x, w, b).chunk(2, dim=-1)
    f = torch.nn.functional
    truth = (f.silu(gate) if act == "silu" else f.gelu(gate, approximate="tanh")) * up
    torch.testing.assert_close(got.double(), truth, rtol=1e-4, atol=1e-5 * float(truth.abs().max()))


BF16_OPS = [pytest.param("gemm_bf16", marks=needs_op), pytest.param("gemm_bf16_fma", marks=needs_fma)]


@pytest.mark.parametrize("op", BF16_OPS + F32_OPS)
def test_gemms_with_no_input_features_give_the_bias(op):
    """K = 0 (nothing to walk): the output is the bias, or zeros. The chunk or slice count would
    divide by zero: gemm_bf16 died of SIGFPE here before its walk was shared with gemm_f32_avx512."""
    ops, bf16 = torch.ops.batchgen_cpu, op.startswith("gemm_bf16")
    dt = torch.bfloat16 if bf16 else torch.float32
    pack, gemm = (ops.pack_bf16_weight if bf16 else ops.pack_f32_weight), getattr(ops, op)
    w, b, x = pack(torch.empty(64, 0, dtype=dt)), torch.randn(64), torch.empty(3, 0, dtype=dt)
    out = torch.full((3, 64), 7.0, dtype=dt)
    gemm(out, x, w, b)
    torch.testing.assert_close(out.float(), b.to(dt).float().expand(3, 64))
    gemm(out, x, w, None)
    assert not out.any()
    if op in ("gemm_bf16", "gemm_f32_avx512"):  # the gated ones: no gate or up values to take
        with pytest.raises(RuntimeError, match="a gated GEMM needs K > 0"):
            gemm(torch.empty(3, 32, dtype=dt), x, w, None, 1)


@pytest.mark.parametrize("path", PATHS)
def test_weights_it_cannot_take_stay_on_onednn(path):
    # fp32 model: fma has an fp32 GEMM, dpbf16 does not
    assert Linear(torch.randn(32, 64), None, path).path == ("fma" if path == "fma" else "onednn")
    w = (torch.randn(32, 63) * 0.05).bfloat16()
    odd = Linear(w, None, path)  # odd K: no k pairs; F.linear where oneDNN has no bf16
    assert odd.path == ("onednn" if linear.onednn_bf16_available() else "plain")
    x = torch.randn(3, 63).bfloat16()
    torch.testing.assert_close(odd(x).float(), _ref(x, w, None), rtol=2 ** -7, atol=1e-3)


def test_onednn_without_bf16_kernels_takes_fma(monkeypatch):
    """A bf16 weight asked onto oneDNN where oneDNN refuses bf16 (AVX2-only CPUs) lands on fma
    (or F.linear without the C++ ops); the engine refuses an explicit onednn for a bf16 model."""
    from batchgen.config import EngineSpec
    from batchgen.errors import ConfigError

    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: False)
    w = (torch.randn(48, 64) * 0.05).bfloat16()
    lin = Linear(w, None, "onednn")
    assert lin.path == ("fma" if linear.fma_available() else "plain")
    x = torch.randn(5, 64).bfloat16()
    torch.testing.assert_close(lin(x).float(), _ref(x, w, None), rtol=2 ** -7, atol=1e-3)
    assert Linear(torch.randn(48, 64), None, "onednn").path == "onednn"  # fp32 stays
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="engine.linear_path: onednn has no bf16"):
        build.choose_backend(EngineSpec(linear_path="onednn"), cpu, torch.bfloat16, torch.bfloat16)
    build.choose_backend(EngineSpec(linear_path="onednn"), cpu, torch.float32, torch.float32)


def test_auto_takes_dpbf16_only_without_amx(monkeypatch):
    from batchgen.config import EngineSpec
    from batchgen.errors import ConfigError

    cpu = torch.device("cpu")
    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: True)
    monkeypatch.setattr(linear, "dpbf16_available", lambda: True)
    monkeypatch.setattr(linear, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(linear, "half_width_avx512", lambda: False)  # Zen 5, Cooper Lake (Zen 4: fp32 on fma)
    assert build.choose_backend(EngineSpec(), cpu, torch.bfloat16).linear_path == "dpbf16"
    assert build.choose_backend(EngineSpec(), cpu, torch.float32, torch.float32).linear_path in ("onednn", "plain")
    monkeypatch.setattr(linear, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    monkeypatch.setattr(linear, "amx_gemm_available", lambda: True)
    assert build.choose_backend(EngineSpec(), cpu, torch.bfloat16).linear_path == "amx"
    assert build.choose_backend(EngineSpec(), cpu, torch.float32, torch.float32).linear_path in ("onednn", "plain")
    monkeypatch.setattr(linear, "amx_gemm_available", lambda: False)  # no AMX build of our ops (or the OS refused)
    assert build.choose_backend(EngineSpec(), cpu, torch.bfloat16).linear_path == "onednn"
    with pytest.raises(ConfigError, match="engine.linear_path: amx"):
        build.choose_backend(EngineSpec(linear_path="amx"), cpu, torch.bfloat16)
    monkeypatch.setattr(linear, "dpbf16_available", lambda: False)
    monkeypatch.setattr(linear, "cpu_flags", lambda: {"avx512f"})
    assert build.choose_backend(EngineSpec(), cpu, torch.bfloat16).linear_path in ("onednn", "plain")
    with pytest.raises(ConfigError, match="engine.linear_path: dpbf16"):
        build.choose_backend(EngineSpec(linear_path="dpbf16"), cpu, torch.bfloat16)


def test_auto_takes_fma_where_onednn_has_no_bf16(monkeypatch):
    from batchgen.config import EngineSpec
    from batchgen.errors import ConfigError

    cpu = torch.device("cpu")
    monkeypatch.setattr(linear, "dpbf16_available", lambda: False)
    monkeypatch.setattr(linear, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: False)
    monkeypatch.setattr(linear, "fma_available", lambda: True)
    assert build.choose_backend(EngineSpec(), cpu, torch.bfloat16, torch.bfloat16).linear_path == "fma"
    # AVX2 without AVX-512: an fp32 model's weights go to the fp32 fma GEMM too
    assert build.choose_backend(EngineSpec(), cpu, torch.float32, torch.float32).linear_path == "fma"
    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: True)  # AVX-512 without bf16 dot products
    monkeypatch.setattr(linear, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})
    monkeypatch.setattr(linear, "half_width_avx512", lambda: False)
    monkeypatch.setattr(linear, "avx512_f32_available", lambda: True)
    assert build.choose_backend(EngineSpec(), cpu, torch.bfloat16, torch.bfloat16).linear_path == "onednn"
    # fp32 stays on oneDNN's AVX-512 kernels, except where AVX-512 runs on 256-bit units (Zen 4)
    assert build.choose_backend(EngineSpec(), cpu, torch.float32, torch.float32).linear_path in ("onednn", "plain")
    monkeypatch.setattr(linear, "half_width_avx512", lambda: True)
    assert build.choose_backend(EngineSpec(), cpu, torch.float32, torch.float32).linear_path == "fma"
    assert build.choose_backend(EngineSpec(), cpu, torch.bfloat16, torch.bfloat16).linear_path == "onednn"
    monkeypatch.setattr(linear, "avx512_f32_available", lambda: False)  # no AVX-512 build of our ops
    assert build.choose_backend(EngineSpec(), cpu, torch.float32, torch.float32).linear_path in ("onednn", "plain")
    monkeypatch.setattr(linear, "fma_available", lambda: False)
    with pytest.raises(ConfigError, match="engine.linear_path: fma"):
        build.choose_backend(EngineSpec(linear_path="fma"), cpu, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
# I: one 64-column tile pair, a last tile of one gate/up pair (I % 32 == 16); K over one L2 chunk
# (dpbf16; amx takes K in 32s); M: 1, a 6-row tail, many tiles; with and without bias.
@pytest.mark.parametrize("path,inter,k,m,bias", [
    pytest.param("dpbf16", 32, 64, 1, False, marks=needs_op), pytest.param("dpbf16", 48, 4100, 13, True, marks=needs_op),
    pytest.param("dpbf16", 2240, 1536, 37, True, marks=needs_op), pytest.param("dpbf16", 96, 128, 300, False, marks=needs_op),
    pytest.param("amx", 32, 64, 1, False, marks=needs_amx), pytest.param("amx", 48, 4096, 13, True, marks=needs_amx),
    pytest.param("amx", 2240, 1536, 37, True, marks=needs_amx), pytest.param("amx", 96, 128, 300, False, marks=needs_amx)])
def test_gated_gemm_equals_gemm_then_activation(path, act, inter, k, m, bias):
    """gemm_bf16's gated epilogue gives what the plain GEMM followed by silu_mul / gelu_tanh_mul gives
    (the same fp32 sums rounded to bf16, the same activation), up to one bf16 step where -ffast-math
    orders the activation's products differently."""
    from batchgen.kernels import cpu_attention as ops

    g = torch.Generator().manual_seed(inter + k + m)
    w = (torch.randn(2 * inter, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(2 * inter, generator=g).bfloat16() if bias else None
    x = torch.randn(m, k, generator=g).bfloat16()
    plain, fused = Linear(w, b, path), Linear(w, b, path, gated=act)
    assert plain.fused_act is None and fused.fused_act == act
    want = (ops.silu_mul if act == "silu" else ops.gelu_tanh_mul)(plain(x))
    got = fused(x)
    assert got.shape == (m, inter) and got.dtype == torch.bfloat16
    differ = got != want
    assert int(differ.sum()) <= max(2, got.numel() // 1000), f"{int(differ.sum())} of {got.numel()} values differ"
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


def test_gated_weights_the_epilogue_cannot_take_keep_the_plain_output():
    # fp32 weights off the AVX-512 op, or I not a multiple of 16: the caller applies the activation to [.., 2I]
    fp32 = Linear(torch.randn(64, 32), None, "fma" if linear.fma_available() else "plain", gated="silu")
    assert fp32.fused_act == ("silu" if fp32.path == "fma" and linear.avx512_f32_available() else None)
    odd = Linear(torch.randn(48, 32), None, "fma" if linear.fma_available() else "plain", gated="silu")
    assert odd.fused_act is None and odd(torch.randn(3, 32)).shape == (3, 48)
    w = (torch.randn(2 * 24, 32) * 0.05).bfloat16()
    lin = Linear(w, None, "dpbf16", gated="silu")
    assert lin.fused_act is None and lin(torch.randn(3, 32).bfloat16()).shape == (3, 48)


def test_interleave_gate_up_alternates_16_row_blocks():
    t = torch.arange(64).view(64, 1)
    got = linear.interleave_gate_up(t).view(-1).tolist()
    assert got == list(range(0, 16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))


@pytest.mark.parametrize("path,dtype", [pytest.param("dpbf16", torch.bfloat16, marks=needs_op),
                                        pytest.param("amx", torch.bfloat16, marks=needs_amx),
                                        pytest.param("fma", torch.bfloat16, marks=needs_fma),
                                        pytest.param("fma", torch.float32, marks=needs_fma)])
def test_out_rows_are_written_in_place(path, dtype):
    """Linear(x, out=rows of a larger tensor): the packed GEMM writes those rows themselves (no
    copy), with the same values as the call without out; an out it cannot write into (another
    dtype, strided) still gets the values, by a copy."""
    g = torch.Generator().manual_seed(11)
    lin = Linear((torch.randn(80, 96, generator=g) * 0.1).to(dtype), None, path)
    x = torch.randn(13, 96, generator=g).to(dtype)
    want = lin(x)
    big = torch.full((20, 80), float("nan"), dtype=dtype)
    got = lin(x, out=big[4:17])
    assert got.data_ptr() == big[4:17].data_ptr()
    assert torch.equal(big[4:17], want)
    assert big[:4].isnan().all() and big[17:].isnan().all()  # nothing outside its rows
    other = torch.zeros(13, 80, dtype=torch.float64)
    assert lin(x, out=other) is other and torch.equal(other, want.double())
    strided = torch.zeros(80, 13, dtype=dtype).t()
    lin(x, out=strided)
    assert torch.equal(strided, want)


@pytest.mark.parametrize("path,dtype", [pytest.param("dpbf16", torch.bfloat16, marks=needs_op),
                                        pytest.param("amx", torch.bfloat16, marks=needs_amx),
                                        pytest.param("fma", torch.bfloat16, marks=needs_fma),
                                        pytest.param("fma", torch.float32, marks=needs_fma)])
@pytest.mark.parametrize("rows", [385, 600])  # over the untiled limit: a ragged last tile
def test_dense_mlp_tiles_write_the_output_rows(path, dtype, rows):
    """The packed MLP in 256-row tiles (each tile's down GEMM writing its rows of the output)
    gives exactly the untiled call's values: each row's sums do not depend on the other rows."""
    from batchgen.kernels import cpu_attention as ca
    from batchgen.runner.moe import DenseMLP

    g = torch.Generator().manual_seed(12)
    gate_up = (torch.randn(2 * 96, 64, generator=g) * 0.1).to(dtype)
    down = (torch.randn(64, 96, generator=g) * 0.1).to(dtype)
    mlp = DenseMLP(Linear(gate_up, None, path, gated="silu"), Linear(down, None, path))
    x = torch.randn(rows, 64, generator=g).to(dtype)
    act = ca.silu_mul
    inner = mlp.gate_up(x)
    whole = mlp.down(inner if mlp.gate_up.fused_act else act(inner))
    op, written = mlp.down._op, []
    mlp.down._op = lambda out, *a: written.append((out.data_ptr(), out.shape[0])) or op(out, *a)
    got = mlp(x, act)
    assert torch.equal(got, whole)
    row_bytes = got.stride(0) * got.element_size()
    assert written == [(got.data_ptr() + i * row_bytes, min(256, rows - i)) for i in range(0, rows, 256)]


@pytest.mark.parametrize("path,dtype,op", [pytest.param("dpbf16", torch.bfloat16, "gemm_bf16", marks=needs_op),
                                           pytest.param("amx", torch.bfloat16, "gemm_bf16_amx", marks=needs_amx),
                                           pytest.param("fma", torch.float32, "gemm_f32_avx512", marks=needs_avx512)])
@pytest.mark.parametrize("rows,calls", [(384, [384]), (385, [256, 129]), (1000, [256, 256, 256, 232])])
@pytest.mark.parametrize("bias", [False, True])
def test_avx512_gemms_run_a_prefill_sized_call_in_256_row_blocks(path, dtype, op, rows, calls, bias):
    """Over 384 rows (a prefill step's QKV or output projection) the dpbf16 and amx Linears, and the fp32
    one on the AVX-512 op, call the GEMM on 256-row blocks of x and of its output, with exactly the
    values of one call over all rows (each row's sums do not depend on the other rows)."""
    g = torch.Generator().manual_seed(13)
    w = (torch.randn(200, 96, generator=g) * 0.1).to(dtype)
    b = torch.randn(200, generator=g).to(dtype) if bias else None
    lin = Linear(w, b, path)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    whole = torch.empty(rows, 200, dtype=dtype)
    getattr(torch.ops.batchgen_cpu, op)(whole, x, lin.weight, lin._bias32, 0)
    op, seen = lin._op, []
    lin._op = lambda out, xs, *a: seen.append((out.shape[0], xs.shape[0])) or op(out, xs, *a)
    got = lin(x)
    assert seen == [(c, c) for c in calls]
    assert torch.equal(got, whole)


@pytest.mark.parametrize("vendor,family,flags,want", [
    ("AuthenticAMD", "25", {"avx2", "avx512f"}, True),     # Zen 4
    ("AuthenticAMD", "25", {"avx2"}, False),               # Zen 3: the same family, no AVX-512
    ("AuthenticAMD", "26", {"avx2", "avx512f"}, False),    # Zen 5: full-width units
    ("GenuineIntel", "6", {"avx2", "avx512f"}, False),
    ("", "", set(), False),                                # no /proc/cpuinfo
])
def test_half_width_avx512_is_zen4(monkeypatch, vendor, family, flags, want):
    from batchgen import workload

    monkeypatch.setattr(workload, "cpu_vendor_family", lambda: (vendor, family))
    monkeypatch.setattr(workload, "cpu_flags", lambda: frozenset(flags))
    assert workload.half_width_avx512() is want


def test_cpu_vendor_family_reads_this_machine():
    from batchgen import workload

    vendor, family = workload.cpu_vendor_family()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert (vendor, family) == ("", "")
        return
    assert f"vendor_id\t: {vendor}" in text or not vendor
    assert family == "" or f"cpu family\t: {family}" in text


# (dtype, path): the AVX-512 walks (gate/up interleaved, SiLU in the epilogue), and the AVX2 kernels
# (fma for bf16 weights; for fp32 where the build has no AVX-512)
MOE_CASES = [pytest.param(torch.bfloat16, "dpbf16", marks=needs_op),
             pytest.param(torch.float32, "fma", marks=needs_avx512),
             pytest.param(torch.bfloat16, "fma", marks=needs_fma),
             pytest.param(torch.float32, "fma", marks=[needs_fma, pytest.mark.skipif(
                 linear.avx512_f32_available(), reason="fp32 on fma takes the AVX-512 walk here")])]


def _sparse_moe(dtype, experts, top_k, hidden, inter, seed=0, fp32_weights=False, path=None):
    from batchgen.runner.moe import SparseMoE

    g = torch.Generator().manual_seed(seed)
    router = (torch.randn(experts, hidden, generator=g) * 0.5).to(dtype)
    gate_up = [(torch.randn(2 * inter, hidden, generator=g) * 0.05).to(dtype) for _ in range(experts)]
    down = [(torch.randn(hidden, inter, generator=g) * 0.05).to(dtype) for _ in range(experts)]
    moe = SparseMoE(router, gate_up, down, top_k, True, fp32_weights,
                    path or ("dpbf16" if dtype == torch.bfloat16 else "fma"))
    return moe, gate_up, down


def _moe_tokens(tokens, hidden, seed, dtype=torch.bfloat16):
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _moe_float64(x, weights, ids, gate_up, down):
    """The MoE block in float64: each token's routing-weighted SiLU-gated expert MLPs, summed."""
    inter = down[0].shape[1]
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].double(), ids[t].tolist()):
            gu = x[t].double() @ gate_up[e].double().t()
            ref[t] += w * (torch.nn.functional.silu(gu[:inter]) * gu[inter:]) @ down[e].double().t()
    return ref


@pytest.mark.parametrize("dtype,path", MOE_CASES)
# experts, top-k, hidden, expert intermediate, tokens: a decode step over many experts (most with
# one or no token), a ragged hidden (72: a last block of 8 columns), hidden over one L2 chunk (the
# gate/up GEMM's partial sums), one token on one expert (a single work item), Mixtral's fp32 weights.
@pytest.mark.parametrize("experts,top_k,hidden,inter,tokens,fp32_weights", [
    (128, 8, 256, 96, 3, False), (16, 4, 72, 48, 37, False), (4, 3, 2064, 32, 300, False),
    (2, 1, 16, 16, 1, False), (8, 2, 64, 32, 19, True)])
def test_moe_experts_op_equals_the_expert_loop(dtype, path, experts, top_k, hidden, inter, tokens, fp32_weights):
    """moe_experts (one op a layer) gives the Python loop's values exactly (each expert's two GEMMs,
    weighted and summed in ascending expert order with the same roundings), and both agree with a
    float64 evaluation of the MoE block."""
    from batchgen.kernels import cpu_attention as ops

    moe, gate_up, down = _sparse_moe(dtype, experts, top_k, hidden, inter, seed=experts + tokens,
                                     fp32_weights=fp32_weights, path=path)
    walk = path == "dpbf16" or linear.avx512_f32_available() and dtype == torch.float32
    assert moe.packed is not None and moe.act == 1 and moe.interleaved == walk
    x = _moe_tokens(tokens, hidden, tokens, dtype)
    got = moe(x, ops.silu_mul)
    packed, moe.packed = moe.packed, None
    want = moe(x, ops.silu_mul)
    moe.packed = packed
    assert got.dtype == dtype and torch.equal(got, want)
    ref = _moe_float64(x, *moe.route(x), gate_up, down)
    tol = 0.05 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype,path", MOE_CASES)
def test_moe_experts_op_refuses_bad_arguments(dtype, path):
    moe, _, _ = _sparse_moe(dtype, 4, 2, 64, 32, path=path)
    gu, d = moe.packed
    x = torch.randn(3, 64).to(dtype)
    order, weights, out = torch.arange(6), torch.full((3, 2), 0.5), torch.empty_like(x)
    op = torch.ops.batchgen_cpu.moe_experts
    with pytest.raises(RuntimeError, match="add up to 5, not the 6 pairs"):
        op(out, x, order, [2, 2, 1, 0], gu, d, weights, 1, moe.interleaved)
    with pytest.raises(RuntimeError, match="one gate_up and one down weight per expert"):
        op(out, x, order, [2, 2, 2], gu, d, weights, 1, moe.interleaved)
    with pytest.raises(RuntimeError, match="expert 2's weights"):
        op(out, x, order, [2, 2, 1, 1], gu[:2] + [d[2]] + gu[3:], d, weights, 1, moe.interleaved)
    with pytest.raises(RuntimeError, match="not a permutation of the 6 pairs"):
        op(out, x, torch.tensor([0, 1, 2, 3, 4, 4]), [2, 2, 1, 1], gu, d, weights, 1, moe.interleaved)
    with pytest.raises(RuntimeError, match="not a permutation"):
        op(out, x, torch.tensor([0, 1, 2, 3, 4, 60]), [2, 2, 1, 1], gu, d, weights, 1, moe.interleaved)
    with pytest.raises(RuntimeError, match="act is 1"):
        op(out, x, order, [2, 2, 1, 1], gu, d, weights, 0, moe.interleaved)
    assert moe(x[:0], lambda t: t).shape == (0, 64)  # a step with no tokens for this layer


@needs_op
def test_amx_experts_take_the_op_with_the_walks_layout(monkeypatch):
    """Experts on amx (AMX CPUs) take moe_experts with amx_rows: their packed weights are the walk's
    (with amx_rows 0 the op gives what the dpbf16 experts give), and a build without AMX refuses
    amx_rows rather than running the walk for it."""
    from batchgen.runner import moe as moe_mod

    monkeypatch.setattr(linear, "amx_gemm_available", lambda: True)  # packs as amx would; no amx call runs
    amx, _, _ = _sparse_moe(torch.bfloat16, 8, 2, 256, 96, path="amx")
    monkeypatch.undo()
    dp, _, _ = _sparse_moe(torch.bfloat16, 8, 2, 256, 96, path="dpbf16")
    assert amx.experts[0][0].path == "amx" and amx.packed is not None and amx.interleaved
    assert amx.amx_rows == moe_mod.AMX_ROWS > 0 and dp.amx_rows == 0
    x = _moe_tokens(40, 256, 1)
    from batchgen.kernels import cpu_attention as ops

    if not linear.amx_gemm_available():
        with pytest.raises(RuntimeError, match="this build has no AMX"):
            amx(x, ops.silu_mul)
    amx.amx_rows = 0
    assert torch.equal(amx(x, ops.silu_mul), dp(x, ops.silu_mul))


@needs_op
def test_moe_experts_op_refuses_bad_amx_rows():
    moe, _, _ = _sparse_moe(torch.bfloat16, 4, 2, 64, 32, path="dpbf16")
    x = torch.randn(3, 64).bfloat16()
    args = (torch.empty_like(x), x, torch.arange(6), [2, 2, 1, 1], *moe.packed, torch.full((3, 2), 0.5), 1)
    op = torch.ops.batchgen_cpu.moe_experts
    with pytest.raises(RuntimeError, match="amx_rows is 0"):
        op(*args, True, -1)
    with pytest.raises(RuntimeError, match="amx_rows takes bf16 weights in the interleaved"):
        op(*args, False, 16)


@needs_amx
# a decode step (every expert on the walk), a step split between both (routed on a Zen 4: 32, 41
# and 35 pairs on the tiles, amx_rows itself and ragged 16-row tiles; 21-30 on the walk), every
# expert on the tiles (91-106 pairs)
@pytest.mark.parametrize("tokens,split", [(3, "walk"), (120, "mixed"), (400, "amx")])
def test_moe_experts_on_amx_tiles_equal_the_expert_loop(tokens, split):
    """On AMX the op runs the experts of at least amx_rows pairs on the AMX tiles and the rest on the
    walk: it equals the Python loop over the same split (each expert's GEMMs on gemm_bf16_amx or
    gemm_bf16) bit for bit, and a float64 evaluation of the block."""
    from batchgen.kernels import cpu_attention as ops

    amx, gate_up, down = _sparse_moe(torch.bfloat16, 8, 2, 256, 96, seed=5, path="amx")
    dp, _, _ = _sparse_moe(torch.bfloat16, 8, 2, 256, 96, seed=5, path="dpbf16")
    assert amx.experts[0][0].path == "amx" and amx.amx_rows == 32
    x = _moe_tokens(tokens, 256, tokens)
    weights, ids = amx.route(x)
    counts = torch.bincount(ids.flatten(), minlength=8).tolist()
    on_amx = [c >= amx.amx_rows for c in counts]
    assert split == ("amx" if all(on_amx) else "walk" if not any(on_amx) else "mixed")
    got = amx(x, ops.silu_mul)
    dp.experts, dp.packed = [amx.experts[e] if a else dp.experts[e] for e, a in enumerate(on_amx)], None
    assert torch.equal(got, dp(x, ops.silu_mul))
    if split == "amx":  # the loop on amx alone
        amx.packed = None
        assert torch.equal(got, amx(x, ops.silu_mul))
    ref = _moe_float64(x, weights, ids, gate_up, down)
    torch.testing.assert_close(got.double(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
