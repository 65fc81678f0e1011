"""Scheduler and KV bookkeeping with hand-built runner outputs: no model, no torch."""
import subprocess
import sys

import pytest

from batchgen.engine.kv_manager import KVCacheManager
from batchgen.engine.outputs import RunnerOutput, SampledToken
from batchgen.engine.request import Request, RequestStatus, SamplingParams
from batchgen.engine.scheduler import Scheduler, SchedulerConfig

EOS = 2


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_budget=64, caching=False, max_model_len=1024):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens_budget, max_model_len), kv)


def req(rid, n_prompt, max_tokens=4, first=10, **kw):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0, **kw),
                   eos_token_ids=(EOS,))


def step(s: Scheduler, token=7, tokens=None):
    """One step with a fake runner that samples `token` (or tokens[req_id]) for each sampled seq."""
    out = s.schedule()
    sampled = {rid: SampledToken((tokens or {}).get(rid, token))
               for q in out.seqs if q.sample for rid in [q.request_id] + [c for c, _ in q.forks]}
    s.update(out, RunnerOutput(sampled))
    return out


def run_all(s: Scheduler, limit=1000):
    for _ in range(limit):
        if not s.has_unfinished():
            return
        step(s)
    raise AssertionError("scheduler did not finish: deadlock or starvation")


def test_engine_core_imports_no_torch():
    code = ("import sys; import batchgen.engine.scheduler, batchgen.engine.kv_manager, batchgen.engine.block_pool;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_admission_respects_max_num_seqs_and_budget():
    s = make(max_num_seqs=2, max_tokens_budget=100)
    for i in range(3):
        s.add_request(req(f"r{i}", 10))
    out = s.schedule()
    assert [q.request_id for q in out.seqs] == ["r0", "r1"]
    assert out.num_tokens == 20 and len(s.waiting) == 1


def test_token_budget_chunks_a_long_prefill():
    s = make(max_tokens_budget=8)
    s.add_request(req("long", 20, max_tokens=2))
    chunks = []
    while s.requests["long"].num_output_tokens == 0:
        out = step(s)
        chunks.append((out.seqs[0].start_pos, len(out.seqs[0].token_ids), out.seqs[0].sample))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_decodes_go_first_and_prefill_shares_the_step():
    s = make(max_tokens_budget=6)
    s.add_request(req("a", 3, max_tokens=10))
    step(s)  # a is prefilled, now decoding
    s.add_request(req("b", 12, max_tokens=2))
    out = step(s)
    assert [(q.request_id, len(q.token_ids)) for q in out.seqs] == [("a", 1), ("b", 5)]
    assert out.num_tokens <= 6


def test_finishing_on_eos_max_tokens_and_stop_token_ids():
    s = make()
    s.add_request(req("eos", 3, max_tokens=10))
    s.add_request(req("len", 3, max_tokens=2))
    s.add_request(req("stopid", 3, max_tokens=10, stop_token_ids=(99,)))
    s.add_request(req("ignore", 3, max_tokens=3, ignore_eos=True))
    step(s, tokens={"eos": EOS, "len": 5, "stopid": 99, "ignore": EOS})
    assert s.requests["eos"].finish_reason == "stop"
    assert s.requests["stopid"].finish_reason == "stop"
    assert not s.requests["len"].is_finished and not s.requests["ignore"].is_finished
    run_all(s)
    assert s.requests["len"].finish_reason == "length" and s.requests["len"].output_token_ids == [5, 7]
    assert s.requests["ignore"].output_token_ids == [EOS, 7, 7]
    s.kv.pool.check_all_free()


def test_preemption_frees_the_newest_and_recomputes_it():
    # 6 blocks of 4 tokens: two requests of 8 prompt + 8 output tokens need 8 blocks.
    s = make(num_blocks=6, block_size=4)
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 8, max_tokens=8))
    run_all(s)
    old, new = s.requests["old"], s.requests["new"]
    assert s.stats.num_preemptions >= 1 and new.num_preemptions >= 1 and old.num_preemptions == 0
    assert old.output_token_ids == [7] * 8 and new.output_token_ids == [7] * 8
    s.kv.pool.check_all_free()


def test_recompute_after_preemption_replays_prompt_and_outputs():
    s = make(num_blocks=6, block_size=4)
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 8, max_tokens=8))
    seen = []
    for _ in range(100):
        if not s.has_unfinished():
            break
        out = step(s)
        seen += [(q.request_id, q.start_pos, len(q.token_ids)) for q in out.seqs if q.request_id == "new"]
    restarts = [x for x in seen[1:] if x[1] == 0]
    assert restarts, "the preempted request starts over from position 0"
    assert restarts[0][2] > 8, "its recompute covers the prompt and the tokens it had generated"


def test_blocks_recomputed_after_a_preemption_are_published_again():
    """cache_blocks publishes each block of a table once; a recompute preemption gives the table
    up, and the blocks computed again must be published again (from the first), or a later
    prompt that starts the same way would miss them."""
    s = make(num_blocks=6, block_size=4, caching=True)
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 8, max_tokens=8, first=50))
    run_all(s)
    new = s.requests["new"]
    assert new.num_preemptions >= 1
    s.add_request(Request("again", new.prompt_token_ids + new.output_token_ids[:7] + [5],
                          SamplingParams(max_tokens=1, temperature=0), eos_token_ids=(EOS,)))
    out = s.schedule()
    assert out.seqs[0].start_pos == 12, "3 full blocks of new's recomputed tokens come from the cache"


def test_request_that_can_never_fit_ends_with_an_error():
    s = make(num_blocks=4, block_size=4)
    s.add_request(req("huge", 10, max_tokens=10))  # 20 tokens need 5 blocks > 4
    s.add_request(req("ok", 4, max_tokens=2))
    out = step(s)
    huge = s.requests["huge"]
    assert huge.finish_reason == "error" and "KV blocks" in huge.error
    assert "huge" in out.rejected
    run_all(s)
    assert s.requests["ok"].finish_reason == "length"


def test_over_context_length_is_an_error_not_a_hang():
    s = make(max_model_len=16)
    s.add_request(req("long", 12, max_tokens=8))
    run_all(s)
    assert s.requests["long"].finish_reason == "error" and "max length" in s.requests["long"].error


def test_prefix_cache_reuses_full_blocks_and_refcounts_return_to_zero():
    s = make(block_size=4, caching=True)
    s.add_request(req("a", 13, max_tokens=2))
    run_all(s)
    s.add_request(req("b", 13, max_tokens=2))
    out = s.schedule()
    (b,) = out.seqs
    assert b.start_pos == 12 and len(b.token_ids) == 1, "12 tokens = 3 full blocks come from the cache"
    assert s.requests["b"].num_cached_tokens == 12
    s.update(out, RunnerOutput({"b": SampledToken(7)}))
    run_all(s)
    s.kv.pool.check_all_free()
    assert s.kv.prefix_hit_rate() > 0


def test_a_prefix_computed_in_this_step_is_a_hit_for_the_next_admission():
    """a and b share 8 tokens (2 blocks of 4) and both fit the first step: b's hit is a's two
    blocks, which a's forward writes before any attention of that step reads them."""
    s = make(block_size=4, caching=True)
    s.add_request(req("a", 13, max_tokens=2))
    s.add_request(Request("b", list(range(10, 18)) + [99, 98, 97], SamplingParams(max_tokens=2, temperature=0),
                          eos_token_ids=(EOS,)))
    s.add_request(req("c", 13, max_tokens=2, first=200))
    out = s.schedule()
    a, b, c = out.seqs
    assert (a.start_pos, len(a.token_ids)) == (0, 13)
    assert (b.start_pos, len(b.token_ids)) == (8, 3) and b.block_table[:2] == a.block_table[:2]
    assert (c.start_pos, len(c.token_ids)) == (0, 13), "another prefix: no hit"
    assert s.requests["b"].num_cached_tokens == 8
    s.update(out, RunnerOutput({r: SampledToken(7) for r in "abc"}))
    run_all(s)
    s.kv.pool.check_all_free()


def test_only_blocks_the_step_fills_are_shared_within_it():
    """a (10 tokens) fills two blocks of 4 and half a third in the first step; b starts with a's
    10 tokens: its hit in that step is the two full blocks, not the half one."""
    s = make(block_size=4, caching=True)
    s.add_request(req("a", 10, max_tokens=2))
    s.add_request(req("b", 15, max_tokens=2))
    out = s.schedule()
    assert [(q.request_id, q.start_pos, len(q.token_ids)) for q in out.seqs] == [("a", 0, 10), ("b", 8, 7)]
    s.update(out, RunnerOutput({r: SampledToken(7) for r in "ab"}))
    run_all(s)
    s.kv.pool.check_all_free()


def test_no_starvation_under_constant_pressure():
    s = make(num_blocks=10, block_size=4, max_num_seqs=4, max_tokens_budget=16)
    for i in range(12):
        s.add_request(req(f"r{i}", 6 + i % 5, max_tokens=5 + i % 3))
    run_all(s, limit=2000)
    assert all(r.status == RequestStatus.FINISHED and r.finish_reason == "length" for r in s.requests.values())
    s.kv.pool.check_all_free()


@pytest.mark.parametrize("bad", [dict(max_num_seqs=0), dict(max_num_batched_tokens=0)])
def test_config_rejects_non_positive_limits(bad):
    with pytest.raises(ValueError):
        SchedulerConfig(**bad)


def test_growing_sequences_keep_consecutive_blocks():
    """Decodes of sequences admitted together each grow into their own reserved run, so every
    block table is one stretch of consecutive block ids (CPU attention reads them faster)."""
    s = make(num_blocks=64, block_size=4, max_num_seqs=4, max_tokens_budget=64)
    for i in range(3):
        s.add_request(req(f"r{i}", 5, max_tokens=20))
    for _ in range(19):
        step(s)
    tables = [s.kv.block_ids(f"r{i}") for i in range(3)]
    assert all(len(t) == 6 for t in tables), tables  # 5 + 18 = 23 tokens in the cache
    for t in tables:
        assert t == list(range(t[0], t[0] + len(t))), tables
    run_all(s)
    s.kv.pool.check_all_free()


def test_runs_never_cost_capacity():
    """Reservations are soft: with every block spoken for, a newcomer still gets reserved blocks
    instead of waiting or preempting."""
    s = make(num_blocks=8, block_size=4, max_num_seqs=4, max_tokens_budget=64)
    s.add_request(req("long", 4, max_tokens=28))  # reserves a run of all 8 blocks
    step(s)
    s.add_request(req("short", 4, max_tokens=4))
    out = step(s)
    assert {q.request_id for q in out.seqs} == {"long", "short"}
    assert s.kv.pool.num_used_blocks == 3 and s.requests["long"].num_preemptions == 0
    assert s.kv.block_ids("long") == [0, 1] and s.kv.block_ids("short") == [2], "short took a reserved block"
    run_all(s)
    assert all(r.finish_reason == "length" for r in s.requests.values())
    s.kv.pool.check_all_free()


def _family(n_prompt, n, max_tokens=3):
    parent = req("p\x000", n_prompt, max_tokens=max_tokens)
    parent.forks = [req(f"p\x00{i}", n_prompt, max_tokens=max_tokens) for i in range(1, n)]
    return parent


def test_forks_share_the_prompt_blocks_and_copy_the_partial_one():
    s = make(num_blocks=64, block_size=4, caching=True)
    s.add_request(_family(10, 3))
    out = step(s)
    assert out.seqs[0].forks and [q.request_id for q in out.seqs] == ["p\x000"], "one prefill"
    ids = {i: s.kv.block_ids(f"p\x00{i}") for i in range(3)}
    assert ids[1][:2] == ids[2][:2] == ids[0][:2], "full blocks shared"
    assert len({ids[0][2], ids[1][2], ids[2][2]}) == 3, "each sample has its own last block"
    nxt = s.schedule()
    assert sorted(nxt.copy_within) == sorted((ids[0][2], ids[k][2]) for k in (1, 2))
    assert [q.request_id for q in nxt.seqs] == ["p\x000", "p\x001", "p\x002"] and nxt.num_tokens == 3
    assert s.kv.prefix_hit_rate() >= 2 / 3
    s.update(nxt, RunnerOutput({q.request_id: SampledToken(7) for q in nxt.seqs}))
    run_all(s)
    assert all(s.requests[f"p\x00{i}"].num_output_tokens == 3 for i in range(3))
    s.kv.check_all_free()


def test_a_fork_without_a_free_block_waits_and_runs_as_its_own_request():
    s = make(num_blocks=3, block_size=4)  # the prompt takes all 3 blocks: no room for a copy
    s.add_request(_family(10, 2, max_tokens=2))
    step(s)
    assert [r.request_id for r in s.waiting] == ["p\x001"] and s.requests["p\x001"].num_output_tokens == 0
    run_all(s)
    assert s.requests["p\x001"].num_output_tokens == 2 and s.requests["p\x000"].num_output_tokens == 2
    s.kv.check_all_free()


def test_a_rejected_request_rejects_its_forks():
    s = make(num_blocks=2, block_size=4)
    s.add_request(_family(10, 3))
    out = step(s)
    assert sorted(out.rejected) == ["p\x000", "p\x001", "p\x002"]
    assert all(s.requests[f"p\x00{i}"].error for i in range(3))


def hybrid(full_blocks=32, sliding_blocks=32, window=8, block_size=4, cpu_blocks=0):
    from batchgen.engine.kv_manager import HybridKVManager

    return HybridKVManager([KVCacheManager(full_blocks, block_size, True, num_cpu_blocks=cpu_blocks),
                            KVCacheManager(sliding_blocks, block_size, True, num_cpu_blocks=cpu_blocks,
                                           window=window)])


def test_hybrid_prefix_hit_needs_only_the_windows_blocks_in_the_sliding_group():
    """A 33-token prompt done and freed; then the sliding group's early blocks are evicted (the
    full group keeps all). The same prompt again hits all 8 full blocks: the sliding group holds
    the two its 8-token window still sees (blocks 6, 7), and the rest of its table is empty."""
    kv = hybrid(full_blocks=32, sliding_blocks=12)
    a = req("a", 33)
    assert kv.allocate_slots(a, 33) is not None
    a.num_computed_tokens = 33
    kv.cache_blocks(a)
    kv.free_out_of_window(a)
    full, sliding = kv.groups
    hashes = sliding._block_hashes(a, 8)
    kv.forget(a)
    sliding.pool.allocate(9)  # takes every uncached block, then evicts the oldest cached ones
    assert [sliding.pool.lookup(h) is not None for h in hashes] == [False] * 6 + [True] * 2
    b = req("b", 33)
    hit, cached = kv.get_computed_blocks(b)
    assert cached == 32
    assert [x is None for x in hit.hits[1].device] == [True] * 6 + [False] * 2
    assert all(x is not None for x in hit.hits[0].device)
    assert kv.allocate_slots(b, 1, hit) is not None
    assert kv.group_block_ids("b")[0][:6] == [0] * 6  # freed slots read block 0, masked by the window


def test_hybrid_hit_is_cut_to_what_every_group_holds():
    """The sliding group lost even the window's blocks: no group may claim a hit the other
    cannot serve, so the hit shrinks to where the sliding group's window is whole."""
    kv = hybrid(full_blocks=32, sliding_blocks=12)
    a = req("a", 33)
    kv.allocate_slots(a, 33)
    a.num_computed_tokens = 33
    kv.cache_blocks(a)
    full, sliding = kv.groups
    hashes = sliding._block_hashes(a, 8)
    kv.forget(a)
    sliding.pool.allocate(3 + 2)  # the 3 never-used blocks, then evicts blocks 8, 7 (freed last-first)
    present = [sliding.pool.lookup(h) is not None for h in hashes]
    k = max(i for i in range(1, 9) if all(present[max(0, (i * 4 - 8 + 1) // 4): i]))
    hit, cached = kv.get_computed_blocks(req("b", 33))
    assert cached == k * 4 < 32 and all(h.num_blocks == k for h in hit.hits)


def test_hybrid_allocation_is_all_or_nothing():
    """The sliding group has no room: allocate_slots refuses and the full group is untouched."""
    kv = hybrid(full_blocks=32, sliding_blocks=3)
    assert kv.allocate_slots(req("a", 16), 16) is None
    assert kv.num_used_blocks == 0
    assert kv.allocate_slots(req("b", 12), 12) is not None
    assert [g.num_used_blocks for g in kv.groups] == [3, 3]


def test_swap_moves_only_the_live_blocks_of_a_windowed_table():
    """A sliding table whose first blocks left the window swaps out its live blocks only and
    comes back with the same leading holes."""
    kv = KVCacheManager(16, 4, False, num_cpu_blocks=16, window=8)
    a = req("a", 30, max_tokens=2)
    kv.allocate_slots(a, 30)
    a.num_computed_tokens = 30
    kv.free_out_of_window(a)
    before = kv.block_ids("a")
    dead = sum(1 for b in kv._blocks["a"] if b is None)
    assert dead == 5 and kv.can_swap_out(a)
    kv.swap_out(a)
    out, _, _ = kv.take_transfers()
    assert len(out) == len(before) - dead and kv.num_used_blocks == 0
    assert kv.allocate_slots(a, 1) is not None
    _, into, _ = kv.take_transfers()
    assert len(into) == len(before) - dead
    assert [b is None for b in kv._blocks["a"]][:dead] == [True] * dead and len(kv._blocks["a"]) == 8
    kv.end_step()
    kv.forget(a)
    kv.check_all_free()


def test_window_hit_reloads_the_windows_blocks_from_the_cpu_tier():
    """Every block of a finished 33-token prompt is evicted from the device and spilled to the
    CPU tier: the same prompt again hits 8 blocks, reloading only the two its window sees."""
    kv = KVCacheManager(12, 4, True, num_cpu_blocks=16, window=8)
    a = req("a", 33)
    kv.allocate_slots(a, 33)
    a.num_computed_tokens = 33
    kv.cache_blocks(a)
    kv.forget(a)
    taken = kv.pool.allocate(12)  # evicts (and spills) all 8 cached full blocks
    spilled, _, _ = kv.take_transfers()
    assert len(spilled) == 8
    kv.pool.free(taken)
    b = req("b", 33)
    hit, cached = kv.get_computed_blocks(b)
    assert cached == 32 and hit.device == [None] * 6 and len(hit.cpu) == 2
    assert kv.allocate_slots(b, 1, hit) is not None
    _, reloaded, _ = kv.take_transfers()
    assert [src for src, _ in reloaded] == [c.block_id for c in hit.cpu] and kv.tier.reloaded_blocks == 2
