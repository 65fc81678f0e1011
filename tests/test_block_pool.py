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
