"""Pool and table invariants under random operation sequences."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oasis_hf.cache.block_table import INF, BlockTable
from oasis_hf.kernels import append_tokens_ref


def random_scores(gen, batch, heads, capacity, num_blocks, forced):
    scores = torch.rand(batch, heads, capacity, generator=gen)
    scores[..., num_blocks:] = -INF
    for blk in forced:
        if blk < num_blocks:
            scores[..., blk] = INF
    return scores


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    slots=st.integers(2, 9),
    cap=st.one_of(st.none(), st.integers(1, 4)),
    ops=st.lists(st.sampled_from(["plan", "grow", "allocate", "drop"]), min_size=1, max_size=25),
)
def test_random_operations_keep_invariants(seed, slots, cap, ops):
    gen = torch.Generator().manual_seed(seed)
    batch, heads = 2, 3
    table = BlockTable(batch, heads, slots, capacity_blocks=4, device="cpu")
    num_blocks = 3
    for op in ops:
        if op == "grow":
            table.grow(table.capacity_blocks + int(torch.randint(1, 6, (1,), generator=gen)))
        elif op == "drop":
            num_blocks = max(1, num_blocks - int(torch.randint(0, 3, (1,), generator=gen)))
            table.drop_from(num_blocks)
        elif op == "allocate" and num_blocks < table.capacity_blocks:
            # The decode step's bookkeeping for two tokens that end the tail block and start the next one: the next
            # block gets a slot (the tail, when resident, keeps its own).
            bs, dim = 4, 2
            tail_resident = (table.slot_block[..., :slots] == num_blocks - 1).any(-1)
            pool = torch.zeros(batch, heads, slots, bs, dim)
            summaries = torch.zeros(1, batch, heads, table.capacity_blocks, dim)
            tokens = torch.randn(batch, heads, 2, dim, generator=gen)
            start = torch.tensor(num_blocks * bs - 1)
            append_tokens_ref(tokens, tokens, start, pool, pool.clone(), table.slot_block, table.slot_score,
                              table.block_slot, summaries, torch.zeros(batch, dtype=torch.long), kind="mean",
                              sink_blocks=0, recent_blocks=1)
            after = table.slot_block[..., :slots]
            assert bool((after == num_blocks).any(-1).all()), "new block not resident"
            assert bool(((after == num_blocks - 1).any(-1) | ~tail_resident).all()), "the tail was evicted"
            num_blocks += 1
        else:
            forced = [0, num_blocks - 1]
            scores = random_scores(gen, batch, heads, table.capacity_blocks, num_blocks, forced)
            before = table.slot_block[..., :slots].clone()
            blocks, dst, valid = table.plan(scores, cap)
            after = table.slot_block[..., :slots]
            # forced blocks are resident, fetches obey the cap, only planned slots changed
            for blk in forced:
                assert bool((after == blk).any(-1).all()), f"forced block {blk} not resident"
            if cap is not None:
                nonforced = valid & ~((blocks == 0) | (blocks == num_blocks - 1))
                assert int(nonforced.sum(-1).max()) <= cap
            changed = before != after
            planned = torch.zeros_like(changed).scatter_(-1, dst, valid)
            assert not bool((changed & ~planned).any())
            # with no cap the resident set is exactly the top blocks
            if cap is None:
                want = min(slots, num_blocks)
                top = scores.topk(want, -1).indices.sort(-1).values
                have = after.sort(-1).values[..., -want:]
                assert torch.equal(top, have)
        table.check()
        assert int(table.resident_count().max()) <= slots
