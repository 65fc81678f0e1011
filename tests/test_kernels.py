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
    width = max(-(-n // bs) for n in lengths)
    perm = torch.randperm(num_blocks, generator=g)
    rows, used = [], 0
    for n in lengths:
        need = -(-n // bs)
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


@pytest.mark.parametrize("window", [0, 20], ids=["full", "window20"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_paged_decode(shape, dtype, window):
    kvh, ratio, d, bs = shape
    lengths = ragged_lengths(bs)
    nblocks = sum(-(-n // bs) for n in lengths) + 4
    kc, vc = make_cache(nblocks, bs, kvh, d, dtype)
    tables = block_tables_for(lengths, bs, nblocks)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = rand(len(lengths), kvh * ratio, d, dtype=dtype, seed=SEED)
    scale = d ** -0.5
    out = paged_decode(q, kc, vc, tables, lens, scale, blocks_per_split=2, window=window)
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
    nblocks = sum(-(-t // bs) for t in totals) + 4
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


def test_block_copy_round_trip():
    src, _ = make_cache(10, 16, 2, 64, torch.float32)
    dst = torch.zeros(6, 16, 2, 64)
    copy_blocks(src, dst, torch.tensor([7, 2, 9]), torch.tensor([0, 5, 3]))
    want = torch.zeros_like(dst)
    copy_blocks_reference(src.cpu(), want, [7, 2, 9], [0, 5, 3])
    assert torch.equal(dst, want)


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
