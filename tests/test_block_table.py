"""Pool and table invariants under random operation sequences."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oasis_hf.cache.block_table import INF, BlockTable


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
            # The decode step's fixed-shape call: candidates (tail, next), installing only those not resident.
            resident = table.slot_block[..., :slots]
            pinned = resident == num_blocks - 1  # keep the current tail
            candidates = torch.tensor([num_blocks - 1, num_blocks]).expand(batch, heads, -1)
            fresh = table.block_slot.gather(-1, candidates) < 0
            table.allocate(candidates, pinned, fresh)
            assert bool((table.slot_block[..., :slots] == num_blocks).any(-1).all()), "new block not resident"
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
