"""Triton kernels against their torch references (TRITON_INTERPRET=1 on a CPU).

Tolerance, FlashAttention's rule: the kernel's error against an fp32 reference is at most 2x the
error of the same attention computed by torch in the low precision (plus an fp32 floor).
"""
import pytest
import torch

from batchgen.kernels.block_copy import copy_blocks, copy_blocks_reference
from batchgen.kernels.paged_decode import paged_decode, paged_decode_reference
from batchgen.kernels.paged_prefill import paged_prefill, paged_prefill_reference
from batchgen.kernels.store_kv import store_kv, store_kv_reference
from batchgen.shapes import cdiv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEED = int(__import__("os").environ.get("BATCHGEN_KERNEL_SEED", "5"))
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (kv_heads, GQA ratio, head_dim, block_size)
SHAPES = [(2, 1, 64, 16), (1, 3, 64, 32), (2, 8, 128, 16), (1, 8, 64, 32), (3, 3, 128, 32)]


def shape_id(s):
    return f"kvh{s[0]}-gqa{s[1]}-d{s[2]}-bs{s[3]}"


def make_cache(num_blocks, bs, kvh, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, bs, kvh, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(num_blocks, bs, kvh, d, generator=g).to(DEVICE, dtype)
    return k, v


def ragged_lengths(bs):
    return [1, bs, bs + 1, 2 * bs - 1, 3 * bs + 5]


def block_tables_for(lengths, bs, num_blocks, seed=1):
    g = torch.Generator().manual_seed(seed)
    width = max(cdiv(n, bs) for n in lengths)
    perm = torch.randperm(num_blocks, generator=g)
    rows, used = [], 0
    for n in lengths:
        need = cdiv(n, bs)
        row = perm[used : used + need].tolist() + [0] * (width - need)
        used += need
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def rand(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def assert_flash_tolerance(out, ref32, ref_lowp):
    """FlashAttention's rule, plus one rounding step of the output: the kernel must store its
    result in the low precision, and on small shapes torch's own error can be below that."""
    err = (out.float() - ref32.float()).abs().max().item()
    base = (ref_lowp.float() - ref32.float()).abs().max().item()
    rounding = torch.finfo(out.dtype).eps * ref32.abs().max().item() if out.dtype != torch.float32 else 0.0
    assert err <= 2 * base + rounding + 1e-5, f"kernel error {err:.2e} > 2 x torch low-precision error {base:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_store_kv_matches_reference_and_skips_padding(shape, dtype):
    kvh, _, d, bs = shape
    kc, vc = make_cache(8, bs, kvh, d, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    n = 2 * bs + 3
    k = rand(n, kvh, d, dtype=dtype, seed=2)
    v = rand(n, kvh, d, dtype=dtype, seed=3)
    slots = torch.randperm(8 * bs, generator=torch.Generator().manual_seed(4))[:n].to(DEVICE)
    slots[[0, 5]] = -1
    store_kv(k, v, kc, vc, slots)
    store_kv_reference(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


# (kernel, tile tokens, blocks per split): the blockwise kernel; the tiled one with tiles smaller
# than, equal to and larger than a block, several tiles to a split, and (3 blocks) splits that
# are not a whole number of tiles.
DECODE_VARIANTS = [("blockwise", 64, 2), ("tiled", 16, 4), ("tiled", 64, 3)]


def variant_id(v):
    return v[0] if v[0] == "blockwise" else f"tiled{v[1]}"


# The tiled kernel's 16-token tiles run in bf16 only; fp16 tiles run on CUDA only (the interpreter
# takes its dots in fp32, so there fp16 would repeat bf16).
@pytest.mark.parametrize("variant,dtype", [(v, t) for v in DECODE_VARIANTS for t in DTYPES
                                           if v[0] == "blockwise" or t == torch.bfloat16
                                           or (t == torch.float32 and v[1] != 16)
                                           or (t == torch.float16 and DEVICE == "cuda")],
                         ids=lambda x: variant_id(x) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("window", [0, 20], ids=["full", "window20"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_paged_decode(shape, dtype, window, variant):
    kernel, tile, per_split = variant
    kvh, ratio, d, bs = shape
    lengths = ragged_lengths(bs) + [9 * bs + 3]  # the last spans several splits
    nblocks = sum(cdiv(n, bs) for n in lengths) + 4
    kc, vc = make_cache(nblocks, bs, kvh, d, dtype)
    tables = block_tables_for(lengths, bs, nblocks)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = rand(len(lengths), kvh * ratio, d, dtype=dtype, seed=SEED)
    scale = d ** -0.5
    out = paged_decode(q, kc, vc, tables, lens, scale, blocks_per_split=per_split, window=window, kernel=kernel,
                       tile=tile)
    ref32 = paged_decode_reference(q.float(), kc.float(), vc.float(), tables, lens, scale, window=window)
    ref_lowp = paged_decode_reference(q, kc, vc, tables, lens, scale, math_dtype=dtype, window=window)
    assert_flash_tolerance(out, ref32, ref_lowp)


@pytest.mark.parametrize("window", [0, 20], ids=["full", "window20"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_paged_prefill_with_cached_context(shape, dtype, window):
    kvh, ratio, d, bs = shape
    # (cached tokens, new tokens): fresh prefills, a chunk after a prefix hit, a 1-token chunk.
    pairs = [(0, 1), (0, bs), (bs, bs + 3), (2 * bs - 1, 17), (5, 1)]
    totals = [c + n for c, n in pairs]
    nblocks = sum(cdiv(t, bs) for t in totals) + 4
    kc, vc = make_cache(nblocks, bs, kvh, d, dtype)
    tables = block_tables_for(totals, bs, nblocks)
    cu = torch.tensor([0] + list(torch.tensor([n for _, n in pairs]).cumsum(0)), dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(totals, dtype=torch.int32, device=DEVICE)
    q = rand(int(cu[-1]), kvh * ratio, d, dtype=dtype, seed=SEED)
    scale = d ** -0.5
    out = paged_prefill(q, kc, vc, tables, cu, lens, scale, window=window)
    ref32 = paged_prefill_reference(q.float(), kc.float(), vc.float(), tables, cu, lens, scale, window=window)
    ref_lowp = paged_prefill_reference(q, kc, vc, tables, cu, lens, scale, math_dtype=dtype, window=window)
    assert_flash_tolerance(out, ref32, ref_lowp)


def test_decode_launcher_rejects_an_unknown_kernel_and_bad_tiles():
    kc, vc = make_cache(4, 16, 2, 64, torch.float32)
    q = rand(2, 4, 64, dtype=torch.float32, seed=0)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="'fast' is not one of blockwise, tiled"):
        paged_decode(q, kc, vc, tables, lens, 0.1, kernel="fast")
    with pytest.raises(ValueError, match=r"tile \(24\) must be a power of two"):
        paged_decode(q, kc, vc, tables, lens, 0.1, kernel="tiled", tile=24)


def test_block_copy_round_trip():
    src, _ = make_cache(10, 16, 2, 64, torch.float32)
    dst = torch.zeros(6, 16, 2, 64)
    copy_blocks(src, dst, torch.tensor([7, 2, 9]), torch.tensor([0, 5, 3]))
    want = torch.zeros_like(dst)
    copy_blocks_reference(src.cpu(), want, [7, 2, 9], [0, 5, 3])
    assert torch.equal(dst, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (examples/gpu_check.py runs it)")
def test_block_copy_between_a_device_cache_and_a_pinned_host_tier():
    """Device -> pinned host -> device round trips of many blocks, with the host side read right
    after each call: a host read racing the asynchronous copy would see stale blocks."""
    g = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.randn(512, 16, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    host = torch.zeros(600, 16, 8, 128, dtype=torch.bfloat16, pin_memory=True)
    ids = torch.randperm(512)[:300]
    slots = torch.randperm(600)[:300]
    for _ in range(3):
        dev.mul_(1.5)  # new contents each round, so a stale read cannot pass by luck
        copy_blocks(dev, host, ids, slots)
        assert torch.equal(host[slots], dev[ids.cuda()].cpu())
        back = torch.zeros_like(dev)
        copy_blocks(host, back, slots, ids)
        assert torch.equal(back[ids.cuda()], dev[ids.cuda()])


def test_launchers_reject_bad_shapes_and_dtypes():
    kc, vc = make_cache(4, 16, 2, 64, torch.float32)
    q = torch.randn(2, 5, 64)  # 5 heads over 2 KV heads
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode(q, kc, vc, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode(torch.randn(2, 4, 64, dtype=torch.float16), kc, vc, torch.zeros(2, 1, dtype=torch.int32),
                     torch.ones(2, dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(torch.randn(3, 2, 64), torch.randn(3, 2, 64), kc, vc, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="differ"):
        store_kv(torch.randn(3, 2, 64), torch.randn(3, 2, 64), kc, vc[:, :, :1], torch.zeros(3, dtype=torch.long))


FP8 = torch.float8_e4m3fn
FP8_SHAPES = [(2, 1, 64, 16), (1, 3, 64, 32), (2, 8, 128, 16)]


def fp8_cache(num_blocks, bs, kvh, d, seed=0):
    """An fp8 cache filled by the reference quantiser from random fp32 K/V, with its scales."""
    from batchgen.kernels.store_kv import store_kv_reference

    k32, v32 = make_cache(num_blocks, bs, kvh, d, torch.float32, seed)
    kc = torch.zeros(num_blocks, bs, kvh, d, dtype=FP8, device=DEVICE)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(num_blocks, bs, kvh, device=DEVICE)
    vs = torch.zeros_like(ks)
    slots = torch.arange(num_blocks * bs, device=DEVICE)
    store_kv_reference(k32.view(-1, kvh, d), v32.view(-1, kvh, d), kc, vc, slots, ks, vs)
    return kc, vc, ks, vs


@pytest.mark.parametrize("shape", FP8_SHAPES, ids=shape_id)
def test_store_kv_fp8_quantises_per_token_head_and_skips_padding(shape):
    from batchgen.kernels.store_kv import dequantize

    kvh, _, d, bs = shape
    n = 2 * bs + 3
    k = rand(n, kvh, d, dtype=torch.float32, seed=2) * 3
    v = rand(n, kvh, d, dtype=torch.float32, seed=3)
    slots = torch.randperm(8 * bs, generator=torch.Generator().manual_seed(4))[:n].to(DEVICE)
    slots[[0, 5]] = -1
    caches = [torch.zeros(8, bs, kvh, d, dtype=FP8, device=DEVICE) for _ in range(4)]
    scales = [torch.zeros(8, bs, kvh, device=DEVICE) for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots, scales[0], scales[1])
    store_kv_reference(k, v, caches[2], caches[3], slots, scales[2], scales[3])
    for a, b in ((0, 2), (1, 3)):
        torch.testing.assert_close(scales[a], scales[b], rtol=1e-6, atol=0)
        got, want = dequantize(caches[a], scales[a]), dequantize(caches[b], scales[b])
        # At most one e4m3 step apart (3 mantissa bits: 2^-3 relative), should the kernel's
        # division round the last fp32 bit the other way at a rounding boundary.
        assert ((got - want).abs() <= want.abs() / 8 + 1e-6).all()
    keep = slots >= 0
    for x, c, s in ((k, caches[0], scales[0]), (v, caches[1], scales[1])):
        back = dequantize(c, s).view(-1, kvh, d)[slots[keep]]
        # e4m3 rounds to within half a step (2^-4 relative), subnormals within 2^-10 x scale.
        bound = x[keep].abs() / 16 + s.view(-1, kvh)[slots[keep]][..., None] * 2**-9
        assert ((back - x[keep]).abs() <= bound).all()
    # Exactly the kept tokens got scales: the two padding slots wrote nothing.
    assert int((scales[0] != 0).sum()) == int(keep.sum()) * kvh


@pytest.mark.parametrize("kernel", ["blockwise", "tiled"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=shape_id)
def test_paged_decode_and_prefill_over_an_fp8_cache(shape, qdtype, kernel):
    """Against the fp32 reference over the dequantised cache: the kernels see the same values
    (fp8 -> fp32 is exact, the scale product is one fp32 multiply), so fp32 tolerance holds."""
    from batchgen.kernels.store_kv import dequantize

    kvh, ratio, d, bs = shape
    lengths = ragged_lengths(bs)
    nblocks = sum(cdiv(n, bs) for n in lengths) + 4
    kc, vc, ks, vs = fp8_cache(nblocks, bs, kvh, d)
    k32, v32 = dequantize(kc, ks), dequantize(vc, vs)
    tables = block_tables_for(lengths, bs, nblocks)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scale = d ** -0.5
    q = rand(len(lengths), kvh * ratio, d, dtype=qdtype, seed=SEED)
    out = paged_decode(q, kc, vc, tables, lens, scale, blocks_per_split=2, k_scale=ks, v_scale=vs, kernel=kernel,
                       tile=16)
    ref = paged_decode_reference(q.float(), k32, v32, tables, lens, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-5 if qdtype == torch.float32 else 2e-2, rtol=1e-2)
    if kernel != "blockwise":
        return  # the prefill kernel has one variant
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)
    qp = rand(int(cu[-1]), kvh * ratio, d, dtype=qdtype, seed=SEED + 1)
    out = paged_prefill(qp, kc, vc, tables, cu, lens, scale, k_scale=ks, v_scale=vs)
    ref = paged_prefill_reference(qp.float(), k32, v32, tables, cu, lens, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-5 if qdtype == torch.float32 else 2e-2, rtol=1e-2)


def test_fp8_launchers_want_scales_of_the_cache_shape():
    kc, vc, ks, vs = fp8_cache(4, 16, 2, 64)
    q = torch.randn(2, 4, 64)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="fp8 cache needs k_scale"):
        paged_decode(q, kc, vc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="scales must be"):
        paged_decode(q, kc, vc, tables, lens, 0.1, k_scale=ks[:, :8], v_scale=vs[:, :8])


@pytest.mark.parametrize("kernel", ["blockwise", "tiled"])
@pytest.mark.parametrize("window", [0, 20], ids=["full", "window20"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2]], ids=shape_id)
def test_decode_and_prefill_soft_cap_their_scores(shape, dtype, window, kernel):
    """Gemma 2's softcap * tanh(score / softcap) inside both kernels: a cap well inside the
    scores' range, so a kernel that skipped it would be far outside the tolerance."""
    kvh, ratio, d, bs = shape
    cap, scale = 1.5, d ** -0.5
    lengths = ragged_lengths(bs)
    nblocks = sum(cdiv(n, bs) for n in lengths) + 4
    kc, vc = make_cache(nblocks, bs, kvh, d, dtype)
    tables = block_tables_for(lengths, bs, nblocks)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = rand(len(lengths), kvh * ratio, d, dtype=dtype, seed=SEED) * 3
    out = paged_decode(q, kc, vc, tables, lens, scale, blocks_per_split=2, window=window, softcap=cap, kernel=kernel,
                       tile=16)
    ref32 = paged_decode_reference(q.float(), kc.float(), vc.float(), tables, lens, scale, window=window, softcap=cap)
    assert_flash_tolerance(out, ref32, paged_decode_reference(q, kc, vc, tables, lens, scale, math_dtype=dtype,
                                                              window=window, softcap=cap))
    uncapped = paged_decode_reference(q.float(), kc.float(), vc.float(), tables, lens, scale, window=window)
    assert (uncapped - ref32).abs().max() > 0.05  # the cap matters at these scores
    if kernel != "blockwise":
        return  # the prefill kernel has one variant

    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=DEVICE)
    qp = rand(int(cu[-1]), kvh * ratio, d, dtype=dtype, seed=SEED + 1) * 3
    out = paged_prefill(qp, kc, vc, tables, cu, lens, scale, window=window, softcap=cap)
    ref32 = paged_prefill_reference(qp.float(), kc.float(), vc.float(), tables, cu, lens, scale, window=window,
                                    softcap=cap)
    assert_flash_tolerance(out, ref32, paged_prefill_reference(qp, kc, vc, tables, cu, lens, scale, math_dtype=dtype,
                                                               window=window, softcap=cap))


# The layer ops (kernels/layer_ops.py) against fp32 torch: math in fp32, one rounding at the end,
# as the C++ CPU ops they stand in for on CUDA.
def _layer_tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_add_rms_norm_adds_in_place_then_normalises(dtype):
    from batchgen.kernels import layer_ops

    base = rand(7, 200, dtype=dtype, seed=1)  # width 200: a masked tail in the 256-wide block
    h = base[:, :96]  # rows strided: a view into a wider tensor
    delta = rand(7, 96, dtype=dtype, seed=2)
    w = (rand(96, dtype=torch.float32, seed=3).abs() + 0.5).to(dtype)
    h32 = (h.float() + delta.float()).to(dtype).float()  # the residual as stored
    want = w.float() * h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
    tail = base[:, 96:].clone()
    got = layer_ops.add_rms_norm(h, delta, w, 1e-6)
    # h updated in place (within one rounding step: the interpreter's casts truncate), nothing else
    torch.testing.assert_close(h.float(), h32, rtol=0 if dtype == torch.float32 else torch.finfo(dtype).eps, atol=0)
    assert torch.equal(base[:, 96:], tail)
    h32 = h.float()
    torch.testing.assert_close(got.float(), want, **_layer_tol(dtype))
    plain = layer_ops.add_rms_norm(h, None, w, 1e-6)
    assert torch.equal(plain, got) and torch.equal(h.float(), h32)  # no delta: h untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,dim", [(12, 64), (5, 80)], ids=["12x64", "5x80"])  # 80: a masked half
def test_layer_rope_in_place_on_a_strided_qk_view(dtype, heads, dim):
    from batchgen.kernels import layer_ops
    from batchgen.runner.model import rotate_half

    qkv = rand(9, (heads + 3) * dim, dtype=dtype, seed=4)
    cos, sin = rand(9, dim, dtype=dtype, seed=5), rand(9, dim, dtype=dtype, seed=6)
    qk = qkv[:, : heads * dim].view(9, heads, dim)  # rows strided by the V columns after them
    want = qk.float() * cos.float()[:, None] + rotate_half(qk.float()) * sin.float()[:, None]
    v_before = qkv[:, heads * dim :].clone()
    layer_ops.rope_(qk, cos, sin)
    torch.testing.assert_close(qk.float(), want, **_layer_tol(dtype))
    assert torch.equal(qkv[:, heads * dim :], v_before)  # V untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_layer_gated_mul(dtype, act):
    from batchgen.kernels import layer_ops

    inter = 1100  # two 1024-wide column blocks, the second ragged
    gu = rand(5, 2 * inter, dtype=dtype, seed=7) * 4
    g, u = gu[:, :inter].float(), gu[:, inter:].float()
    fn = layer_ops.silu_mul if act == "silu" else layer_ops.gelu_tanh_mul
    want = (torch.nn.functional.silu(g) if act == "silu" else torch.nn.functional.gelu(g, approximate="tanh")) * u
    torch.testing.assert_close(fn(gu).float(), want, **_layer_tol(dtype))
    tails = torch.tensor([[-100.0, -30.0, 0.0, 30.0, 100.0] * 2], device=DEVICE)  # exp overflow stays finite
    out = fn(tails)
    assert torch.isfinite(out).all() and abs(out[0, 0].item()) < 1e-30 and out[0, 3].item() == pytest.approx(900.0)


def test_layer_ops_refuse_mismatched_shapes():
    from batchgen.kernels import layer_ops

    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        layer_ops.add_rms_norm(torch.randn(2, 8, device=DEVICE), None, torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="delta"):
        layer_ops.add_rms_norm(torch.randn(2, 8, device=DEVICE), torch.randn(3, 8, device=DEVICE),
                               torch.ones(8, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="width must be even"):
        layer_ops.silu_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous heads"):
        layer_ops.rope_(torch.randn(4, 8, 3, device=DEVICE).transpose(1, 2), torch.randn(4, 8, device=DEVICE),
                        torch.randn(4, 8, device=DEVICE))
