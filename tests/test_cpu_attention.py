"""The C++ CPU ops (decode and prefill attention, fused layer ops) against plain torch references."""
import pytest
import torch

from batchgen.kernels import cpu_attention as ca
from batchgen.shapes import cdiv

# not available: no compiler or BATCHGEN_NO_CPP=1 (a build error fails test_cpu_ops_build instead)
pytestmark = pytest.mark.skipif(not ca.available(), reason="the C++ ops are not available: the engine keeps the torch path")


def _case(heads, kvh, d, bs, lens, dtype, seed=0, lo=None):
    g = torch.Generator().manual_seed(seed)
    n = len(lens)
    blocks = [cdiv(x, bs) for x in lens]
    nb = sum(blocks) + 3
    kc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    width = max(blocks)
    tables = torch.zeros(n, width, dtype=torch.long)
    c = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = perm[c : c + b]
        c += b
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    hi = torch.tensor(lens, dtype=torch.long)
    lo = torch.tensor(lo if lo is not None else [0] * n, dtype=torch.long)
    return q, kc, vc, tables, lo, hi


LENS = [1, 15, 16, 17, 33, 200, 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# GQA 1, 3 (AVX-512: registers kernel), 6, 7 and 8 (tiled kernel: 3-head score tiles and a 1-head
# tail on AVX-512, 2-head tiles and a 1-head tail on AVX2), 12 (generic)
@pytest.mark.parametrize("heads,kvh", [(4, 4), (9, 3), (12, 2), (14, 2), (16, 2), (12, 1)])
@pytest.mark.parametrize("d", [64, 128, 256, 96, 32])  # 96: Phi-3-mini; 32: the generic (non-specialised) kernel
@pytest.mark.parametrize("bs", [16, 32])
def test_op_matches_reference(dtype, heads, kvh, d, bs):
    q, kc, vc, tables, lo, hi = _case(heads, kvh, d, bs, LENS, dtype)
    out, lse = ca.paged_decode(q, kc, vc, tables, lo, hi, d ** -0.5, with_lse=True)
    ref, ref_lse = ca.paged_decode_reference(q.float(), kc, vc, tables, lo, hi, d ** -0.5)
    assert out.dtype == dtype
    # fp32 math inside; bf16 only rounds the output, so the bound is bf16's half-ulp at |x| <= ~4.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)


def test_lo_hi_select_a_window_and_an_empty_range_gives_zeros():
    q, kc, vc, tables, lo, hi = _case(9, 3, 64, 16, [40, 40, 5, 100], torch.float32, lo=[0, 25, 5, 99])
    out, lse = ca.paged_decode(q, kc, vc, tables, lo, hi, 0.125, with_lse=True)
    ref, ref_lse = ca.paged_decode_reference(q[:2], kc, vc, tables[:2], lo[:2], hi[:2], 0.125)
    torch.testing.assert_close(out[:2], ref)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and (lse[2] < -1e29).all()
    ref1, _ = ca.paged_decode_reference(q[3:], kc, vc, tables[3:], lo[3:], hi[3:], 0.125)
    torch.testing.assert_close(out[3:], ref1)  # one key: softmax is exactly 1, out is that V row


@pytest.mark.parametrize("heads,kvh", [(9, 3), (15, 3)])  # the AVX-512 registers and tiled kernels (3 and 5 heads a group)
@pytest.mark.parametrize("d", [64, 96])  # 96: V summed in slices of 3 vectors, not 4
def test_int8_cache_with_scales(heads, kvh, d):
    from batchgen.runner.attention import QuantCache

    q, kc, vc, tables, lo, hi = _case(heads, kvh, d, 16, LENS, torch.float32)
    kq = QuantCache(kc.shape[0], 16, kvh, d, "cpu")
    vq = QuantCache(kc.shape[0], 16, kvh, d, "cpu")
    slots = torch.arange(kc.shape[0] * 16)
    kq.store(kc.view(-1, kvh, d), slots)
    vq.store(vc.view(-1, kvh, d), slots)
    out = ca.paged_decode(q, kq.data, vq.data, tables, lo, hi, 0.125, kq.scale, vq.scale)
    ref, _ = ca.paged_decode_reference(q, kq.data, vq.data, tables, lo, hi, 0.125, kq.scale, vq.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _prefill_case(heads, kvh, d, bs, chunks, dtype, seed=0):
    """chunks: (new tokens, start position) per sequence; blocks in random order."""
    g = torch.Generator().manual_seed(seed)
    blocks = [cdiv(n + s, bs) for n, s in chunks]
    nb = sum(blocks) + 3
    kc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, kvh, d, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(chunks), max(blocks), dtype=torch.long)
    c = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = perm[c : c + b]
        c += b
    cu = torch.tensor([0] + [sum(n for n, _ in chunks[: i + 1]) for i in range(len(chunks))], dtype=torch.long)
    start = torch.tensor([s for _, s in chunks], dtype=torch.long)
    q = torch.randn(int(cu[-1]), heads, d, generator=g).to(dtype)
    return q, kc, vc, tables, cu, start


# Whole prompts and later chunks; lengths on and across the 16-query tiles and 128-key chunks.
CHUNKS = [(1, 0), (17, 0), (5, 20), (130, 0), (40, 260), (1, 7), (16, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh", [(4, 4), (9, 3), (14, 2), (16, 2), (12, 1)])  # AVX2 row tiles: 6, then 4 or 2
@pytest.mark.parametrize("d", [32, 64, 80, 128])
@pytest.mark.parametrize("bs", [16, 32])
def test_prefill_op_matches_reference(dtype, heads, kvh, d, bs):
    if not ca.has_prefill_path(heads, kvh, d):
        pytest.skip("no AVX-512 or AVX2 here: prefill stays on SDPA")
    q, kc, vc, tables, cu, start = _prefill_case(heads, kvh, d, bs, CHUNKS, dtype)
    out = ca.paged_prefill(q, kc, vc, tables, cu, start, d ** -0.5)
    ref = ca.paged_prefill_reference(q.float(), kc, vc, tables, cu, start, d ** -0.5)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # fp32 math; bf16 rounds the output only
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kvh,d", [(8, 4, 64), (4, 1, 256), (8, 2, 32), (12, 1, 64)])
def test_decode_and_prefill_ops_soft_cap_their_scores(dtype, heads, kvh, d):
    """Gemma 2's softcap * tanh(score / softcap) in both ops (the AVX-512 or AVX2 kernels at head_dim 64
    and 256, the generic one at 32 and GQA 12), its log-sum-exp included; a cap inside the
    scores' range, so skipping it fails."""
    cap = 1.5
    q, kc, vc, tables, lo, hi = _case(heads, kvh, d, 16, LENS, dtype, seed=3)
    q = q * 4
    out, lse = ca.paged_decode(q, kc, vc, tables, lo, hi, d ** -0.5, with_lse=True, softcap=cap)
    ref, ref_lse = ca.paged_decode_reference(q.float(), kc, vc, tables, lo, hi, d ** -0.5, softcap=cap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    uncapped, _ = ca.paged_decode_reference(q.float(), kc, vc, tables, lo, hi, d ** -0.5)
    assert (uncapped.float() - ref.float()).abs().max() > 0.1
    if not ca.has_prefill_path(heads, kvh, d):
        return
    q, kc, vc, tables, cu, start = _prefill_case(heads, kvh, d, 16, CHUNKS, dtype, seed=3)
    q = q * 4
    out = ca.paged_prefill(q, kc, vc, tables, cu, start, d ** -0.5, window=50, softcap=cap)
    ref = ca.paged_prefill_reference(q.float(), kc, vc, tables, cu, start, d ** -0.5, window=50, softcap=cap)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 3, 50, 200])
def test_prefill_op_sliding_window(window):
    if not ca.has_prefill_path(9, 3, 64):
        pytest.skip("no AVX-512 or AVX2 here")
    q, kc, vc, tables, cu, start = _prefill_case(9, 3, 64, 16, CHUNKS, torch.float32, seed=1)
    out = ca.paged_prefill(q, kc, vc, tables, cu, start, 0.125, window=window)
    ref = ca.paged_prefill_reference(q, kc, vc, tables, cu, start, 0.125, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if window == 1:  # each query sees only its own key: the output is that V row
        nb, bs, kvh, d = vc.shape
        p, i = 4, 7  # sequence 4's 8th new token, at position 267
        pos = int(start[p]) + i
        slot = int(tables[p, pos // bs]) * bs + pos % bs
        row = vc.view(-1, kvh, d)[slot].repeat_interleave(3, 0)
        torch.testing.assert_close(out[int(cu[p]) + i], row)


def test_prefill_op_int8_cache_and_strided_q_rows():
    from batchgen.runner.attention import QuantCache

    if not ca.has_prefill_path(9, 3, 64):
        pytest.skip("no AVX-512 or AVX2 here")
    q, kc, vc, tables, cu, start = _prefill_case(9, 3, 64, 16, CHUNKS, torch.float32, seed=2)
    kq = QuantCache(kc.shape[0], 16, 3, 64, "cpu")
    vq = QuantCache(kc.shape[0], 16, 3, 64, "cpu")
    slots = torch.arange(kc.shape[0] * 16)
    kq.store(kc.view(-1, 3, 64), slots)
    vq.store(vc.view(-1, 3, 64), slots)
    # q as the model has it: a view into a fused QKV row, rows strided.
    qkv = torch.randn(q.shape[0], (9 + 6) * 64)
    qkv[:, : 9 * 64] = q.reshape(q.shape[0], -1)
    qv = qkv[:, : 9 * 64].view(-1, 9, 64)
    out = ca.paged_prefill(qv, kq.data, vq.data, tables, cu, start, 0.125, k_scale=kq.scale, v_scale=vq.scale)
    ref = ca.paged_prefill_reference(q, kq.data, vq.data, tables, cu, start, 0.125, k_scale=kq.scale,
                                     v_scale=vq.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_prefill_op_refuses_a_chunk_beyond_its_table():
    if not ca.has_prefill_path(9, 3, 64):
        pytest.skip("no AVX-512 or AVX2 here")
    q, kc, vc, tables, cu, start = _prefill_case(9, 3, 64, 16, [(5, 0), (20, 10)], torch.float32)
    start[1] = 20  # 20 + 20 tokens > 2 blocks of 16
    with pytest.raises(RuntimeError, match="sequence 1 .* does not fit its block table"):
        ca.paged_prefill(q, kc, vc, tables, cu, start, 0.125)
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0"):
        ca.paged_prefill(q[:10], kc, vc, tables, cu, start, 0.125)


def test_bad_arguments_are_refused_with_a_message():
    q, kc, vc, tables, lo, hi = _case(9, 3, 64, 16, [5, 9], torch.float32)
    with pytest.raises(RuntimeError, match="block_tables must be contiguous int64"):
        ca.paged_decode(q, kc, vc, tables.int(), lo, hi, 0.125)
    with pytest.raises(RuntimeError, match="heads must be a multiple of kv_heads"):
        ca.paged_decode(q[:, :8], kc, vc, tables, lo, hi, 0.125)
    with pytest.raises(RuntimeError, match="int8 cache needs"):
        ca.paged_decode(q, kc.to(torch.int8), vc.to(torch.int8), tables, lo, hi, 0.125)


# The fused layer ops against the torch ops they replace (math in fp32, one rounding at the end:
# bf16 may differ from torch's op-by-op rounding by one bf16 step).
def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_in_place_then_normalises(dtype):
    from batchgen.runner.model import rms_norm

    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 576, generator=g).to(dtype)
    delta = torch.randn(37, 576, generator=g).to(dtype)
    w = torch.rand(576, generator=g).to(dtype) + 0.5
    want_h = h + delta
    want = rms_norm(want_h, w, 1e-5)
    got = ca.add_rms_norm(h, delta, w, 1e-5)
    torch.testing.assert_close(h, want_h, **_tol(dtype))  # h was updated in place
    torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(ca.add_rms_norm(h, None, w, 1e-5), rms_norm(h, w, 1e-5), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_a_strided_qk_view(dtype):
    from batchgen.runner.model import rotate_half

    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(11, (9 + 3 + 3) * 64, generator=g).to(dtype)
    cos, sin = torch.randn(11, 64, generator=g).to(dtype), torch.randn(11, 64, generator=g).to(dtype)
    qk = qkv[:, : 12 * 64].view(11, 12, 64)  # rows strided by the V columns after them
    want = qk.float() * cos.float()[:, None] + rotate_half(qk.float()) * sin.float()[:, None]
    v_before = qkv[:, 12 * 64 :].clone()
    ca.rope_(qk, cos, sin)
    torch.testing.assert_close(qk.float(), want, **_tol(dtype))
    assert torch.equal(qkv[:, 12 * 64 :], v_before)  # V untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gu = torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(5)).to(dtype)
    want = torch.nn.functional.silu(gu[:, :1536].float()) * gu[:, 1536:].float()
    torch.testing.assert_close(ca.silu_mul(gu).float(), want, **_tol(dtype))


@pytest.mark.parametrize("rows", [385, 1000, 2048])  # over the untiled limit: a ragged and whole last tile
def test_dense_mlp_in_row_tiles_equals_the_whole_mlp(rows):
    from batchgen.runner.linear import ROW_TILE, Linear, onednn_available
    from batchgen.runner.moe import DenseMLP

    if not onednn_available():
        pytest.skip("no oneDNN: the MLP is not tiled")
    g = torch.Generator().manual_seed(6)
    gate_up, down = torch.randn(2 * 96, 64, generator=g) * 0.1, torch.randn(64, 96, generator=g) * 0.1
    mlp = DenseMLP(Linear(gate_up, None, "onednn"), Linear(down, None, "onednn"))
    x = torch.randn(rows, 64, generator=g)
    calls = []
    act = lambda t: calls.append(t.shape[0]) or ca.silu_mul(t)  # noqa: E731
    got = mlp(x, act)
    assert max(calls) <= ROW_TILE and sum(calls) == rows  # it did run in tiles
    want = torch.nn.functional.linear(ca.silu_mul(torch.nn.functional.linear(x, gate_up)), down)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_silu_mul_accuracy_over_the_whole_range():
    """The op's own exp and reciprocal (not libm's): within a few fp32 ulps of float64 from the
    tails (|g| up to 100, where exp(-|g|) underflows) through 0, odd widths included."""
    g = torch.cat([torch.linspace(-100, 100, 20001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.5, -87.5])])
    g = g[: g.numel() // 19 * 19].view(-1, 19)  # width 19: one 16-lane vector and a scalar tail per row
    gu = torch.cat([g, torch.full_like(g, 1.5)], dim=1)
    want = torch.nn.functional.silu(g.double()) * 1.5
    torch.testing.assert_close(ca.silu_mul(gu).double(), want, rtol=1e-6, atol=1e-30)
    wide = torch.linspace(-30, 30, 2 * 4096).view(2, 4096)
    gu = torch.cat([wide, torch.ones_like(wide)], dim=1)
    torch.testing.assert_close(ca.silu_mul(gu).double(), torch.nn.functional.silu(wide.double()), rtol=1e-6,
                               atol=1e-30)


def test_gelu_tanh_mul_accuracy_over_the_whole_range():
    """Gemma's gelu_tanh(gate) * up as g * sigmoid(2 z): within a few fp32 ulps of float64's
    0.5 g (1 + tanh(z)) from the tails through 0 (absolute near 0, where gelu is ~g / 2), odd
    widths included; and bf16 rows as torch's bf16 op rounds them."""
    g = torch.cat([torch.linspace(-100, 100, 20001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 9.5, -9.5])])
    g = g[: g.numel() // 19 * 19].view(-1, 19)
    gu = torch.cat([g, torch.full_like(g, 1.5)], dim=1)
    want = torch.nn.functional.gelu(g.double(), approximate="tanh") * 1.5
    torch.testing.assert_close(ca.gelu_tanh_mul(gu).double(), want, rtol=1e-5, atol=1e-7)
    x = torch.randn(7, 2 * 300).to(torch.bfloat16)
    ref = (torch.nn.functional.gelu(x[:, :300].float(), approximate="tanh") * x[:, 300:].float()).to(torch.bfloat16)
    torch.testing.assert_close(ca.gelu_tanh_mul(x).float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_strided_rows_into_their_slots(dtype):
    from batchgen.runner.attention import store_kv

    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(40, 15 * 64, generator=g).to(dtype)
    k, v = qkv[:, 9 * 64 : 12 * 64].view(40, 3, 64), qkv[:, 12 * 64 :].view(40, 3, 64)
    slots = torch.randperm(20 * 16, generator=g)[:40]
    kc, vc = torch.zeros(20, 16, 3, 64, dtype=dtype), torch.zeros(20, 16, 3, 64, dtype=dtype)
    ca.store_kv(k, v, kc, vc, slots)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kv(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr) and kc.abs().sum() > 0
    with pytest.raises(RuntimeError, match="slot 320 of token 3 is outside the cache"):
        ca.store_kv(k, v, kc, vc, torch.where(torch.arange(40) == 3, 320, slots))


def test_fused_ops_refuse_mismatched_shapes():
    with pytest.raises(RuntimeError, match="weight must be"):
        ca.add_rms_norm(torch.randn(2, 8), None, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="width must be even"):
        ca.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch_including_ties(dtype):
    x = torch.randn(7, 10000, generator=torch.Generator().manual_seed(6)).to(dtype)
    x[2, 5000] = x[2, 9000] = 50.0  # a tie across chunks: the first index wins
    x[3, 17] = x[3, 18] = 60.0  # a tie inside one chunk
    x[4, :] = -3.0  # all equal
    assert torch.equal(ca.argmax_rows(x), x.float().argmax(-1))
    assert ca.argmax_rows(x)[2] == 5000 and ca.argmax_rows(x)[3] == 17 and ca.argmax_rows(x)[4] == 0


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_argmax_verified_is_the_fp32_argmax_where_bf16_logits_pick_wrong(vocab):
    """Greedy tokens from bf16 logits plus fp32 checks equal the fp64 argmax of the true logits,
    also on rows built so that the bf16 logits' own argmax is a different token."""
    from batchgen.runner.linear import Linear, onednn_available

    g = torch.Generator().manual_seed(vocab)
    d = 64
    w = torch.randn(vocab, d, generator=g)
    h = torch.randn(24, d, generator=g) * 4
    # Rows 0-11: tokens a < b lead all others with logits ~200 (others ~N(0, 32^2)), 1e-3 to 1.2e-2
    # apart, where bf16 resolves steps of 1: on the odd rows the later one, b, is the true argmax.
    for r in range(12):
        a, b = (r * 7) % vocab, (r * 7 + 3) % vocab
        u = h[r] / h[r].norm() ** 2
        w[a] = 200 * u
        w[b] = w[a] + (1e-3 * (r + 1)) * u * (1 if r % 2 else -1)
    true = (h.double() @ w.double().T).argmax(1)
    wb = w.to(torch.bfloat16)
    approx = (Linear(wb, None, "onednn")(h.to(torch.bfloat16)) if onednn_available()
              else (h.to(torch.bfloat16).float() @ wb.float().T).to(torch.bfloat16))
    wnorm = (w.double().norm(dim=1) * (1 + 1e-6)).float()
    got = ca.argmax_verified(approx, h, w, wnorm)
    assert got.tolist() == true.tolist()
    assert (approx.float().argmax(1) != true).any(), "the test needs rows where bf16 alone picks wrong"
