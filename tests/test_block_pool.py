from batchgen.engine.block_pool import BlockPool, hash_block


def test_allocate_and_free_return_every_reference():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1
    assert all(b.ref_cnt == 1 for b in blocks)
    pool.free(blocks)
    pool.check_all_free()


def test_cached_block_survives_free_until_its_space_is_needed():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    h = hash_block(None, [1, 2, 3])
    pool.cache(a, h)
    pool.free([b, a])  # tail first: b is evicted before a
    assert pool.lookup(h) is a and pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([a])
    (first,) = pool.allocate(1)
    assert first is b and pool.lookup(h) is a, "LRU: the uncached tail block goes first"
    (second,) = pool.allocate(1)
    assert second is a and pool.lookup(h) is None and pool.num_evictions == 1


def test_hash_chains_depend_on_parent_and_salt():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(None, [1, 2], b"model-a") != hash_block(None, [1, 2], b"model-b")
    assert hash_block(None, [1, 2]) == h1


def test_run_takes_consecutive_blocks_and_reserves_the_rest_softly():
    pool = BlockPool(10, enable_caching=False)
    (x,) = pool.allocate(1)  # block 0 is used: the lowest run of 4 free blocks starts at 1
    run = pool.allocate_run(2, 4)
    assert [b.block_id for b in run] == [1, 2]
    assert pool.num_free_blocks == 7, "reserved blocks 3 and 4 still count as free"
    # Another sequence's growth may not take block 3 (reserved for the run) ...
    assert pool.take_next(2, reserved_below=0) is None
    # ... the run's own growth may, up to its end, and past it only unreserved blocks.
    assert pool.take_next(2, reserved_below=5).block_id == 3
    assert pool.take_next(3, reserved_below=5).block_id == 4
    assert pool.take_next(4, reserved_below=5).block_id == 5
    # Plain allocation takes unreserved blocks first, reserved ones only when nothing else is left.
    rest = pool.allocate_run(1, 3)
    assert [b.block_id for b in rest] == [6]
    assert [b.block_id for b in pool.allocate(2)] == [9, 7], "LRU order of the unreserved, then reserved"
    assert pool.allocate_run(1, 2) is None, "no run of 2 unreserved free blocks is left"
    assert [b.block_id for b in pool.allocate(1)] == [8]
    pool.release(7, 9)
    pool.free([x] + run + rest)
    pool.free([pool.blocks[i] for i in (3, 4, 5, 7, 8, 9)])
    pool.check_all_free()


def test_runs_avoid_cached_blocks_while_there_is_another_run():
    pool = BlockPool(8, enable_caching=True)
    blocks = pool.allocate(8)
    h = hash_block(None, [1, 2])
    pool.cache(blocks[1], h)
    pool.free(blocks)
    run = pool.allocate_run(3, 3)
    assert [b.block_id for b in run] == [2, 3, 4] and pool.lookup(h) is blocks[1]
    assert [b.block_id for b in pool.allocate_run(3, 3)] == [5, 6, 7] and pool.lookup(h) is blocks[1]
    # Only blocks 0 and 1 are left, 1 holding the cached block: a run may now evict it, unless
    # told to leave cached blocks to the LRU order.
    assert pool.allocate_run(2, 2, evict_cached=False) is None and pool.lookup(h) is blocks[1]
    assert [b.block_id for b in pool.allocate_run(2, 2)] == [0, 1]
    assert pool.lookup(h) is None and pool.num_evictions == 1
