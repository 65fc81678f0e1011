"""The engine on tiny random Llama (GQA) and Qwen3 (q/k norm) models against transformers."""
import os

import pytest
import torch
from batchgen.engine.request import SamplingParams
from batchgen.llm import Engine, GenerationRequest
from helpers import engine_specs, tiny_hf_model

FAMILIES = ["llama", "qwen3"]


class IdTokenizer:
    """Detokenizes ids as space-separated numbers, so stop strings can be tested exactly."""
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)


def prompts(seed=0, lengths=(5, 17, 33, 1, 64, 40, 16, 3)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, ps, n_new):
    out = []
    for p in ps:
        ids = model.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def engine(model, **kw):
    cfg = dict(kv_cache_gib=0.02)
    cfg.update(kw)
    e = Engine(model, IdTokenizer(), *engine_specs(**cfg))
    return e


def run(e, ps, sp=None, ids=None):
    sp = sp or SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ids = ids or [str(i) for i in range(len(ps))]
    results = list(e.generate(GenerationRequest(i, p, sp) for i, p in zip(ids, ps)))
    return {(r.request_id, r.sample_index): r for r in results}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, tiny_hf_model(request.param)


@pytest.fixture(scope="module")
def reference(family_model):
    _, model = family_model
    ps = prompts()
    return ps, hf_greedy(model, ps, 16)


def _assert_match(res, ref):
    for i, want in enumerate(ref):
        assert res[(str(i), 0)].token_ids == want, f"prompt {i} diverged"


@pytest.mark.parametrize("linear_path", ["plain", "onednn"])
@pytest.mark.parametrize("decode_attention,backend", [("exact", "torch"), ("batched", "torch"), ("batched", "cpu")])
def test_greedy_matches_transformers_batched(family_model, reference, linear_path, decode_attention, backend):
    _, model = family_model
    ps, ref = reference
    e = engine(model, linear_path=linear_path, decode_attention=decode_attention, attention_backend=backend)
    assert e.backend.attention == backend
    _assert_match(run(e, ps), ref)
    e.kv_manager.check_all_free()


def test_triton_layer_ops_forward_matches_transformers(family_model, reference):
    """The CUDA forward's layer body: the Triton layer ops (kernels/layer_ops.py; here under the
    interpreter, in fp32) for the norms with their residual adds, RoPE (and Qwen3's q/k norms) and
    SiLU-mul, through the same _forward_fused the CPU's C++ ops take: greedy equals transformers."""
    _, model = family_model
    ps, ref = reference
    e = engine(model, linear_path="plain", attention_backend="torch")
    assert not e.model.fused and not e.model.triton_ops
    e.model.triton_ops = True
    _assert_match(run(e, ps), ref)


def test_cuda_takes_the_triton_layer_ops_unless_told_otherwise(monkeypatch):
    from batchgen.config import EngineSpec
    from batchgen.runner.build import choose_backend

    cuda = torch.device("cuda")
    assert choose_backend(EngineSpec(), cuda, torch.bfloat16, torch.bfloat16).layer_ops == "triton"
    assert not choose_backend(EngineSpec(decode_attention="exact"), cuda, torch.bfloat16, torch.bfloat16).triton_ops
    assert not choose_backend(EngineSpec(attention_backend="torch"), cuda, torch.bfloat16, torch.bfloat16).triton_ops
    monkeypatch.setenv("BATCHGEN_LAYER_OPS", "torch")
    assert not choose_backend(EngineSpec(), cuda, torch.bfloat16, torch.bfloat16).triton_ops


def test_logits_in_row_chunks_give_the_same_tokens(family_model, reference, monkeypatch):
    """The fused fp32 path takes greedy tokens from bf16 logits verified in fp32, 3 rows at a time
    here (8 prompts), and samples fp32 logits a row at a time: greedy still equals transformers,
    and unseeded sampling draws the same run-wide noise stream as in one chunk."""
    from batchgen.runner import model_runner
    from batchgen.runner.model import _native_bf16

    if not _native_bf16():
        pytest.skip("no native bf16 dot products here: greedy tokens come from fp32 logits")
    _, model = family_model
    ps, ref = reference
    sp = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    whole = run(engine(model, seed=7, attention_backend="cpu"), ps, sp)
    e = engine(model, seed=7, attention_backend="cpu")
    assert e.model.fused and e.model.verified_greedy
    monkeypatch.setattr(model_runner, "LOGITS_CHUNK_BYTES", 3 * e.model.shape.vocab_size * 2)
    calls = {"greedy": [], "logits": []}
    for name in ("greedy_tokens", "logits"):
        orig = getattr(e.model, name)
        monkeypatch.setattr(e.model, name, lambda h, *a, orig=orig, name=name: calls[name.split("_")[0]].append(
            h.shape[0]) or orig(h, *a))
    _assert_match(run(e, ps), ref)
    assert calls["greedy"] and max(calls["greedy"]) == 3 and not calls["logits"], calls
    e2 = engine(model, seed=7, attention_backend="cpu")  # a fresh one: e's prefix cache would change the steps
    calls["logits"] = []
    orig_logits = e2.model.logits
    monkeypatch.setattr(e2.model, "logits", lambda h: calls["logits"].append(h.shape[0]) or orig_logits(h))
    chunked = run(e2, ps, sp)
    assert calls["logits"] and max(calls["logits"]) == 1, calls
    assert {k: r.token_ids for k, r in chunked.items()} == {k: r.token_ids for k, r in whole.items()}


def test_auto_backend_on_cpu_is_the_cpp_op_and_falls_back_to_torch_without_it(family_model, monkeypatch):
    from batchgen.kernels import cpu_attention

    _, model = family_model
    assert engine(model).backend.attention == "cpu"
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    assert engine(model).backend.attention == "torch"


@pytest.mark.parametrize("family_model", ["llama"], indirect=True)  # Triton's interpreter is slow: one family
def test_cuda_graph_decode_path_matches_transformers(family_model, reference, monkeypatch):
    """The CUDA-graph decode path short of the capture itself (Triton's interpreter cannot be
    captured): static buffers padded to bucket sizes, padding rows writing no KV, logits sliced
    back. A padding row that wrote KV would corrupt a live sequence's block 0 and diverge."""
    from batchgen.runner.cuda_graphs import DecodeGraphs, bucket_sizes

    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(256)[:5] == [1, 2, 4, 8, 16] and bucket_sizes(256)[-2:] == [240, 256]
    _, model = family_model
    ps, ref = reference
    from batchgen.runner import build
    from batchgen.shapes import cdiv

    def emulated(spec, backend, device, model, kv_layers, max_model_len, window):
        return DecodeGraphs(model, kv_layers, spec.max_num_seqs, cdiv(max_model_len, spec.block_size), window,
                            emulate=True)

    monkeypatch.setattr(build, "decode_graphs", emulated)
    e = engine(model, attention_backend="triton", max_num_seqs=6)
    _assert_match(run(e, ps[:3]), ref[:3])  # 3 rows run in the 4-row bucket: one padding row a step
    g = e.runner.graphs
    assert g.replays >= 14 and g.padded_rows > 0 and e.counters()["cuda_graph_replays"] == g.replays


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (examples/gpu_check.py runs it)")
@pytest.mark.parametrize("decode_kernel", ["blockwise", "tiled"])
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_greedy_on_cuda_matches_transformers(family_model, reference, cuda_graphs, decode_kernel, monkeypatch):
    """The whole CUDA path in fp32 (the Triton store, prefill and decode kernels, decode steps
    replayed from captured CUDA graphs or run eagerly) against transformers on the CPU."""
    from batchgen.kernels import paged_decode as decode_mod

    monkeypatch.setattr(decode_mod, "DEFAULT_DECODE_KERNEL", decode_kernel)
    _, model = family_model
    ps, ref = reference
    e = engine(model, device="cuda", dtype="float32", cuda_graphs=cuda_graphs, max_num_seqs=6)
    assert e.backend.attention == "triton"
    _assert_match(run(e, ps), ref)
    assert (e.counters()["cuda_graph_replays"] > 0) == cuda_graphs
    e.kv_manager.check_all_free()


def test_greedy_matches_one_at_a_time(family_model, reference):
    _, model = family_model
    ps, ref = reference
    e = engine(model, max_num_seqs=1)
    _assert_match(run(e, ps), ref)


def test_greedy_matches_with_small_prefill_chunks(family_model, reference):
    _, model = family_model
    ps, ref = reference
    e = engine(model, max_num_batched_tokens=5)
    _assert_match(run(e, ps), ref)
    assert e.scheduler.stats.num_steps > len(ref) * 16 // 4


def test_tiny_kv_budget_preempts_and_gives_identical_output(family_model, reference):
    _, model = family_model
    ps, ref = reference
    # 12 blocks of 16 tokens: far less than the 8 prompts + 16 outputs want at once.
    e = engine(model)
    e = Engine(model, IdTokenizer(), *engine_specs(kv_cache_gib=12 * 16 * e.kv_bytes_per_token / 2**30))
    assert e.num_blocks == 12
    _assert_match(run(e, ps), ref)
    assert e.scheduler.stats.num_preemptions > 0
    e.kv_manager.check_all_free()


def test_prefix_cache_hits_give_identical_output(family_model):
    _, model = family_model
    shared = prompts(seed=1, lengths=(40,))[0]
    ps = [shared + tail for tail in prompts(seed=2, lengths=(3, 7, 1, 12))]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    on = engine(model, prefix_caching=True, max_num_seqs=1)
    off = engine(model, prefix_caching=False, max_num_seqs=1)
    r_on, r_off = run(on, ps, sp), run(off, ps, sp)
    assert {k: v.token_ids for k, v in r_on.items()} == {k: v.token_ids for k, v in r_off.items()}
    assert sum(r.cached_tokens for r in r_on.values()) >= 3 * 32, "later prompts reuse the shared 40-token prefix"
    assert sum(r.cached_tokens for r in r_off.values()) == 0
    on.kv_manager.check_all_free()


def test_prompts_admitted_in_one_step_share_the_prefix_computed_in_it(family_model):
    """All prompts in the first step: the later ones take the shared 40-token prefix's two full
    blocks from the first one's KV written in that same forward (not computed again), and every
    greedy token equals the run without a prefix cache."""
    _, model = family_model
    shared = prompts(seed=1, lengths=(40,))[0]
    ps = [shared + tail for tail in prompts(seed=2, lengths=(3, 7, 1, 12))]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for backend in ("cpu", "torch"):
        on = engine(model, prefix_caching=True, attention_backend=backend)
        off = engine(model, prefix_caching=False, attention_backend=backend)
        r_on, r_off = run(on, ps, sp), run(off, ps, sp)
        assert on.scheduler.stats.num_steps == off.scheduler.stats.num_steps, "one first step admits all four"
        assert {k: v.token_ids for k, v in r_on.items()} == {k: v.token_ids for k, v in r_off.items()}, backend
        assert [r_on[(str(i), 0)].cached_tokens for i in range(4)] == [0, 32, 32, 32]
        assert on.scheduler.stats.prefill_tokens == sum(map(len, ps)) - 3 * 32
        on.kv_manager.check_all_free()


def test_seeded_sampling_is_identical_in_different_batch_mixes(family_model):
    _, model = family_model
    ps = prompts(seed=3)
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = run(engine(model, max_num_seqs=1), ps[:1], sp)
    others = [(p, SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True)) for p in ps[1:]]
    e = engine(model, max_num_batched_tokens=9)
    mixed = {(r.request_id, r.sample_index): r for r in e.generate(
        [GenerationRequest(f"x{i}", p, s) for i, (p, s) in enumerate(others[:3])] + [GenerationRequest("0", ps[0], sp)]
        + [GenerationRequest(f"y{i}", p, s) for i, (p, s) in enumerate(others[3:])])}
    assert mixed[("0", 0)].token_ids == alone[("0", 0)].token_ids
    unseeded = run(engine(model, seed=99), ps[:1], SamplingParams(max_tokens=12, temperature=5.0, ignore_eos=True))
    assert unseeded[("0", 0)].token_ids != alone[("0", 0)].token_ids


def test_n_samples_each_differ_and_stop_strings_cut_text(family_model):
    _, model = family_model
    ps = prompts(seed=4, lengths=(10,))
    res = run(engine(model), ps, SamplingParams(max_tokens=10, temperature=1.5, seed=5, n=3, ignore_eos=True))
    samples = [res[("0", k)].token_ids for k in range(3)]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1
    greedy = run(engine(model), ps, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[("0", 0)]
    # A stop string spanning tokens 3 and 4 of the greedy output.
    stop = f"{greedy.token_ids[2]} {greedy.token_ids[3]}"
    cut = run(engine(model), ps, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=(stop,)))[("0", 0)]
    assert cut.finish_reason == "stop"
    assert cut.text == "".join(f" {t}" for t in greedy.token_ids[:2]) + " "
    assert len(cut.token_ids) == 4


def test_logprobs_are_returned_for_the_chosen_token(family_model):
    _, model = family_model
    res = run(engine(model), prompts(seed=5, lengths=(6,)),
              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5))[("0", 0)]
    assert len(res.logprobs) == 4
    for tok, (lp, top) in zip(res.token_ids, res.logprobs):
        assert len(top) == 5 and tok in top and lp == pytest.approx(max(top.values()))


def test_ttft_and_itl_are_measured(family_model):
    _, model = family_model
    r = run(engine(model), prompts(seed=6, lengths=(8,)))[("0", 0)]
    assert r.ttft_s is not None and r.ttft_s > 0 and r.itl_s is not None and r.itl_s > 0


def test_triton_attention_path_matches_transformers(family_model, reference):
    """The CUDA path's kernels inside the engine, run by Triton's interpreter on this CPU:
    prefill, chunked prefill over cached context, and decode."""
    _, model = family_model
    ps, ref = reference
    e = engine(model, attention_backend="triton", max_num_batched_tokens=24)
    _assert_match(run(e, ps[:4]), ref[:4])
    assert e.backend.attention == "triton"


@pytest.mark.parametrize("preemption", ["swap", "recompute", "auto"])
def test_cpu_tier_under_a_tiny_device_budget_gives_identical_output(family_model, reference, preemption):
    _, model = family_model
    ps, ref = reference
    per_block = engine(model).kv_bytes_per_token * 16
    e = Engine(model, IdTokenizer(), *engine_specs(kv_cache_gib=12 * per_block / 2**30,
                                                  cpu_offload_gib=64 * per_block / 2**30, preemption=preemption))
    _assert_match(run(e, ps), ref)
    c = e.counters()
    assert c["preemptions"] > 0
    if preemption == "recompute":
        assert c["preemptions_swap"] == 0 and c["swapped_out_blocks"] == 0
    else:  # on a CPU, moving blocks is far cheaper than recomputing them, so auto swaps
        assert c["preemptions_swap"] > 0 and c["swapped_in_blocks"] > 0 and c["swapped_out_bytes"] > 0
    e.kv_manager.check_all_free()


def test_evicted_prefix_blocks_spill_to_cpu_and_reload_on_a_hit(family_model):
    _, model = family_model
    shared = prompts(seed=7, lengths=(48,))[0]
    others = prompts(seed=8, lengths=(60, 60))
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    per_block = engine(model).kv_bytes_per_token * 16
    cfg = dict(kv_cache_gib=6 * per_block / 2**30, max_num_seqs=1)
    e = Engine(model, IdTokenizer(), *engine_specs(cpu_offload_gib=32 * per_block / 2**30, **cfg))
    # The shared prompt is cached, pushed out of the 6-block device pool by the others, then asked again.
    order = [shared + [5], others[0], others[1], shared + [9]]
    got = run(e, order, sp)
    want = run(Engine(model, IdTokenizer(), *engine_specs(prefix_caching=False, **cfg)), order, sp)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    c = e.counters()
    assert c["prefix_blocks_spilled"] > 0 and c["prefix_blocks_reloaded"] == 3
    assert got[("3", 0)].cached_tokens == 48
    e.kv_manager.check_all_free()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantised_kv_cache_stays_close_and_carries_scales_through_the_cpu_tier(family_model, reference, kv_dtype):
    """int8/fp8 KV: greedy tokens may flip only at near-ties (vLLM's rule: each side's token in
    the other's top-5); the CPU tier must move the scales with the blocks."""
    _, model = family_model
    ps, ref = reference
    base = engine(model)
    per_block = engine(model, kv_cache_dtype=kv_dtype).kv_bytes_per_token * 16
    e = Engine(model, IdTokenizer(), *engine_specs(kv_cache_dtype=kv_dtype, kv_cache_gib=12 * per_block / 2**30,
                                                  cpu_offload_gib=64 * per_block / 2**30, preemption="swap"))
    assert e.kv_bytes_per_token < base.kv_bytes_per_token / 2 and e.num_blocks == 12
    _assert_top5_close(e, engine(model), ps)
    assert e.counters()["preemptions_swap"] > 0  # blocks (and their scales) went out and back
    e.kv_manager.check_all_free()


def _assert_top5_close(e, base, ps):
    """Greedy tokens of e may leave base's only at near-ties (vLLM's rule: each side's token is
    in the other's top-5), and at least half the prompts match exactly."""
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    ours, full = run(e, ps, sp), run(base, ps, sp)
    exact = 0
    for i in range(len(ps)):
        a, b = ours[(str(i), 0)], full[(str(i), 0)]
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                assert ta in b.logprobs[pos][1] and tb in a.logprobs[pos][1], f"prompt {i} pos {pos}"
                break
        else:
            exact += 1
    assert exact >= len(ps) // 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_kv_cache_stays_close(family_model, reference, backend):
    """fp8 (e4m3) KV with per-token-head scales: the Triton kernels (the CUDA path, here under
    the interpreter) and the torch path quantise alike and stay within the top-5 rule."""
    _, model = family_model
    ps, _ = reference
    ps = ps if backend == "torch" else ps[:4]
    base = engine(model)
    e = engine(model, kv_cache_dtype="fp8", attention_backend=backend, max_num_batched_tokens=24)
    assert e.kv_cache.layers[0][0].dtype == torch.float8_e4m3fn and e.backend.attention == backend
    assert e.kv_bytes_per_token < base.kv_bytes_per_token / 2
    _assert_top5_close(e, base, ps)
    e.kv_manager.check_all_free()


def test_fp8_kv_is_refused_on_the_cpp_op_with_a_clear_error(family_model):
    from batchgen.errors import ConfigError

    _, model = family_model
    assert engine(model, kv_cache_dtype="fp8").backend.attention == "torch"
    with pytest.raises(ConfigError, match="fp8 is for CUDA"):
        engine(model, kv_cache_dtype="fp8", attention_backend="cpu")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_cascade_decode_over_a_shared_prefix_matches_transformers(family_model, backend, monkeypatch):
    """Decodes sharing a cached 80-token prefix attend to it once (cascade) and still give
    transformers' greedy tokens."""
    _, model = family_model
    shared = prompts(seed=21, lengths=(80,))[0]
    ps = [shared + tail for tail in prompts(seed=22, lengths=(3, 9, 1, 14, 6))]
    ref = hf_greedy(model, ps, 12)
    e = engine(model, max_num_seqs=8, attention_backend=backend)
    calls = []
    import batchgen.runner.attention as attn

    orig = attn._cascade_prefix
    monkeypatch.setattr(attn, "_cascade_prefix", lambda *a: calls.append(1) or orig(*a))
    run(e, [ps[0]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), ids=["warm"])
    res = run(e, ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert calls, "the cascade path ran"
    for i, want in enumerate(ref):
        assert res[(str(i), 0)].token_ids == want, f"prompt {i} diverged"


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4


def _mapping(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding addr (its permissions under "perms")."""
    out: dict[str, str] = {}
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
                if inside:
                    out["perms"] = line.split()[1]
            elif inside and ":" in head:
                out[head.rstrip(":")] = line.split(":", 1)[1].strip()
                if head == "VmFlags:":
                    return out
    return out


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding addr, from /proc/self/smaps."""
    return _mapping(addr).get("VmFlags", "").split()


def _thp_fallbacks() -> int:
    with open("/proc/vmstat") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("thp_fault_fallback "))


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
@pytest.mark.parametrize("huge", ["0", "1"])
def test_host_kv_memory_is_lazy_zeroed_private_and_huge_pages_on_request(monkeypatch, huge):
    """The KV cache costs no time or resident memory until its blocks are written, reads as
    zeros, is a private mapping, and is advised for 2 MiB pages when BATCHGEN_HUGEPAGES=1."""
    from batchgen.runner.model_runner import host_zeros

    monkeypatch.setenv("BATCHGEN_HUGEPAGES", huge)
    before = _rss_kib()
    t = host_zeros((4096, 16, 4, 256), torch.float32)  # 256 MiB
    assert t.shape == (4096, 16, 4, 256) and t.is_contiguous() and t.data_ptr() % (2 << 20) == 0
    assert _rss_kib() - before < 32 << 10, "nothing is resident before it is written"
    assert not t[::97].any() and not t[-1].any()
    # Private: a shared anonymous mapping is shmem, where the THP hint is not met.
    assert _mapping(t.data_ptr())["perms"].endswith("p")
    fallbacks = _thp_fallbacks()
    t.fill_(1.0)
    assert _rss_kib() - before > 200 << 10 and t.sum().item() == t.numel()
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.path.exists(thp):
        assert ("hg" in _vm_flags(t.data_ptr())) == (huge == "1")
        if huge == "1" and "[never]" not in open(thp).read():
            # The hint is met: huge pages back the tensor, unless the kernel tried and had none
            # free (its fallback counter moved).
            huge_kib = int(_mapping(t.data_ptr())["AnonHugePages"].split()[0])
            assert huge_kib >= 128 << 10 or _thp_fallbacks() > fallbacks, huge_kib


def test_keep_freed_memory_keeps_large_buffers_on_the_heap():
    """In a fresh glibc process a 20 MiB malloc is an mmap (freed straight back to the OS, and
    page-faulted in again next time); after keep_freed_memory() it comes from the heap, which
    keeps it. BATCHGEN_NO_MALLOPT=1 leaves glibc as it is."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    code = ("import ctypes; from batchgen.runner.model_runner import keep_freed_memory; "
            "libc = ctypes.CDLL(None); libc.sbrk.restype = ctypes.c_void_p; libc.malloc.restype = ctypes.c_void_p; "
            "applied = keep_freed_memory(); p = libc.malloc(20 << 20); print(applied, p < libc.sbrk(0))")
    out = {}
    for flag in ("0", "1"):
        env = dict(os.environ, BATCHGEN_NO_MALLOPT=flag)
        out[flag] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout.split()
    assert out["0"] == ["True", "True"], "applied: the buffer came from the heap"
    assert out["1"] == ["False", "False"], "not applied: glibc mmapped it"




def test_n_samples_fork_after_one_prefill_and_match_independent_requests(family_model):
    """n = 4: the prompt is prefilled once and the other samples fork from it (75% of prompt
    tokens are prefix hits); each sample equals an independent request with seed + i."""
    _, model = family_model
    ps = prompts(seed=3, lengths=(37, 20, 50, 16))
    sp = SamplingParams(max_tokens=10, temperature=0.8, seed=11, n=4, ignore_eos=True)
    e = engine(model, linear_path="plain", decode_attention="exact")
    forked = run(e, ps, sp)
    assert e.kv_manager.prefix_hit_rate() >= 0.75 and e.scheduler.stats.prefill_tokens == sum(map(len, ps))
    e.kv_manager.check_all_free()
    for i in range(4):
        alone = run(engine(model, linear_path="plain", decode_attention="exact"), ps,
                    SamplingParams(max_tokens=10, temperature=0.8, seed=11 + i, ignore_eos=True))
        for k in range(len(ps)):
            assert forked[(str(k), i)].token_ids == alone[(str(k), 0)].token_ids, (k, i)


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (0.7, 0), (1.3, 20)])
def test_logprobs_are_the_log_softmax_of_the_distribution_sampled_from(family_model, monkeypatch, temperature, top_k):
    """Each generated token's logprob and top-K equal torch.log_softmax of the engine's own logits
    after temperature and top-k (as sampled), to fp32 rounding."""
    from batchgen.runner.sampler import Sampler

    _, model = family_model
    seen = {}
    real = Sampler.__call__

    def spy(self, logits, seqs, mask=None):
        for row, s in zip(logits.float(), seqs):
            seen[(s.request_id, s.output_index)] = row.clone()
        return real(self, logits, seqs, mask)

    monkeypatch.setattr(Sampler, "__call__", spy)
    sp = SamplingParams(max_tokens=6, temperature=temperature, top_k=top_k, seed=4, logprobs=4, ignore_eos=True)
    res = run(engine(model), prompts()[:4], sp)
    checked = 0
    for (rid, _), r in res.items():
        for k, (tok, (lp, top)) in enumerate(zip(r.token_ids, r.logprobs)):
            row = seen[(f"{rid}\x000", k)] / (temperature or 1.0)
            if top_k:
                row = row.masked_fill(row < row.topk(top_k).values[-1], float("-inf"))
            want = torch.log_softmax(row, -1)
            assert abs(lp - want[tok].item()) < 1e-5 and len(top) == 4
            vals, idx = want.topk(4)
            assert list(top) == idx.tolist() and torch.allclose(torch.tensor(list(top.values())), vals, atol=1e-5)
            checked += 1
    assert checked == 24


def test_bf16_whole_prompts_through_sdpa_and_later_chunks_through_the_op(family_model, monkeypatch):
    """On AMX CPUs bf16 whole prompts go to SDPA and later chunks of the same step to the C++ op;
    forced on here (and off for the reference), the greedy tokens agree by vLLM's closeness rule
    (each side's token in the other's top-5)."""
    from batchgen.kernels import cpu_attention
    from batchgen.runner import attention

    _, model = family_model
    c = model.config
    cpu_attention.load()
    if not cpu_attention.has_prefill_path(c.num_attention_heads, c.num_key_value_heads,
                            getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads):
        pytest.skip("no AVX-512 or AVX2 here: every prefill stays on SDPA")
    ps = prompts(seed=2, lengths=(40, 9, 70, 12, 33))
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
    res = {}
    for forced in (False, True):
        calls = []
        with monkeypatch.context() as m:
            m.setattr(attention, "amx_available", lambda forced=forced: forced)
            m.setattr(attention, "_sdpa_one", lambda *a, real=attention._sdpa_one, **k: calls.append(1) or real(*a, **k))
            res[forced] = run(engine(model, dtype="bfloat16", max_num_batched_tokens=48), ps, sp)
        assert bool(calls) == forced
    for key, a in res[True].items():
        b = res[False][key]
        for (ta, (_, top_a)), (tb, (_, top_b)) in zip(zip(a.token_ids, a.logprobs), zip(b.token_ids, b.logprobs)):
            if ta != tb:
                assert ta in top_b and tb in top_a
                break


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_packed_weights_live_in_2mib_page_arenas(monkeypatch):
    """Packed CPU weights are copied into arenas advised MADV_HUGEPAGE (hostmem.py): the same
    values and outputs, 4 KiB-aligned neighbours in one mapping, a weight larger than an arena in
    its own, small tensors and BATCHGEN_WEIGHT_HUGEPAGES=0 left where torch put them."""
    import gc

    from batchgen.runner import hostmem, linear
    from batchgen.runner.linear import Linear

    monkeypatch.setattr(hostmem, "ARENA_BYTES", 8 << 20)
    monkeypatch.setattr(hostmem, "_current", [])
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(1 << 18, generator=g) for _ in range(2))  # 1 MiB each
    ha, hb = hostmem.on_huge_pages(a), hostmem.on_huge_pages(b)
    assert torch.equal(ha, a) and torch.equal(hb, b) and ha.data_ptr() != a.data_ptr()
    assert ha.data_ptr() % (2 << 20) == 0 and hb.data_ptr() == ha.data_ptr() + (1 << 20), "one arena, in order"
    assert "hg" in _vm_flags(ha.data_ptr()) and _mapping(ha.data_ptr())["perms"].endswith("p")
    big = torch.randn(3 << 20, generator=g)  # 12 MiB: an arena of its own; the current one stays
    hbig = hostmem.on_huge_pages(big)
    assert torch.equal(hbig, big) and "hg" in _vm_flags(hbig.data_ptr())
    hc = hostmem.on_huge_pages(a)
    assert hc.data_ptr() == hb.data_ptr() + (1 << 20)
    small = torch.randn(1000)
    assert hostmem.on_huge_pages(small) is small
    # The arena outlives the tensors that made it, while any tensor in it lives.
    want = hc.clone()
    del ha, hb, hbig
    gc.collect()
    assert torch.equal(hc, want)

    path = "dpbf16" if linear.dpbf16_available() else "fma" if linear.fma_available() else None
    if path is None:
        return
    w, x = (torch.randn(1024, 1024, generator=g) * 0.05).bfloat16(), torch.randn(7, 1024, generator=g).bfloat16()
    on = Linear(w, None, path)
    assert "hg" in _vm_flags(on.weight.data_ptr())
    monkeypatch.setenv("BATCHGEN_WEIGHT_HUGEPAGES", "0")
    off = Linear(w, None, path)
    assert "hg" not in _vm_flags(off.weight.data_ptr())
    assert torch.equal(on(x), off(x))
