"""Every Triton kernel against its PyTorch twin (under TRITON_INTERPRET=1 on CPU, natively on the GPU), plus a
second, naive oracle for the sparse attention (dense SDPA over the gathered blocks)."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from oasis_hf.kernels import (
    INTERPRET,
    TRITON_AVAILABLE,
    copy_rows,
    copy_rows_ref,
    gather_blocks,
    gather_blocks_ref,
    plan_blocks,
    plan_blocks_ref,
    score_blocks,
    score_blocks_ref,
    sparse_attention,
    sparse_attention_ref,
)

needs_triton = pytest.mark.skipif(
    not (TRITON_AVAILABLE and (INTERPRET or torch.cuda.is_available())),
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (set by .ci/run)",
)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (B, H_q, H_kv, T, D, S, BS, L): 1 and many query tokens, partial last block, GQA 1/4/7, odd head dims
CASES = [
    (1, 4, 4, 1, 16, 3, 16, 40),
    (2, 8, 2, 1, 64, 5, 16, 75),
    (1, 7, 1, 4, 32, 4, 32, 100),
    (3, 4, 1, 9, 16, 6, 16, 81),
    (2, 14, 2, 1, 80, 4, 16, 50),
]


def make_inputs(case, dtype, device="cpu"):
    b, hq, hkv, t, d, s, bs, length = case
    nb = -(-length // bs)
    query = torch.randn(b, hq, t, d, device=device).mul_(0.5).to(dtype)
    pool_k = torch.randn(b, hkv, s, bs, d, device=device).to(dtype)
    pool_v = torch.randn(b, hkv, s, bs, d, device=device).to(dtype)
    slot_block = torch.full((b, hkv, s + 1), -1, dtype=torch.long)
    for i in range(b):
        for h in range(hkv):
            chosen = torch.randperm(nb - 1)[: s - 1]
            slot_block[i, h, : len(chosen)] = chosen
            slot_block[i, h, s - 1] = nb - 1  # the tail block (new tokens) is always resident
    kv_start = torch.randint(0, bs + 3, (b,))
    return query, pool_k, pool_v, slot_block.to(device), length, kv_start.to(device), d**-0.5


def naive_oracle(query, pool_k, pool_v, slot_block, length, kv_start, scale):
    """Gather every resident token into dense K/V and run fp32 SDPA with an explicit mask."""
    b, hq, t, d = query.shape
    _, hkv, s, bs, _ = pool_k.shape
    out = torch.zeros(b, t, hq, d)
    for i in range(b):
        for h in range(hq):
            kvh = h // (hq // hkv)
            keys, values, pos = [], [], []
            for slot in range(s):
                blk = int(slot_block[i, kvh, slot])
                if blk < 0:
                    continue
                keys.append(pool_k[i, kvh, slot].float())
                values.append(pool_v[i, kvh, slot].float())
                pos.append(torch.arange(blk * bs, blk * bs + bs))
            k, v, p = torch.cat(keys), torch.cat(values), torch.cat(pos)
            qpos = length - t + torch.arange(t)
            mask = (p[None] <= qpos[:, None]) & (p[None] < length) & (p[None] >= int(kv_start[i]))
            o = F.scaled_dot_product_attention(query[i, h].float()[None], k[None], v[None], attn_mask=mask[None],
                                               scale=scale)[0]
            out[i, :, h] = torch.where(mask.any(-1, keepdim=True), o, 0.0)
    return out


def test_twins_have_identical_signatures():
    assert inspect.signature(sparse_attention) == inspect.signature(sparse_attention_ref)
    assert inspect.signature(copy_rows) == inspect.signature(copy_rows_ref)
    assert inspect.signature(score_blocks) == inspect.signature(score_blocks_ref)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_ref_matches_naive_oracle(case):
    args = make_inputs(case, torch.float32)
    ref = sparse_attention_ref(*args)
    torch.testing.assert_close(ref, naive_oracle(*args), atol=1e-5, rtol=1e-5)


def _check_kernel(case, dtype, device):
    args = make_inputs(case, dtype, device)
    out = sparse_attention(*args)
    ref = sparse_attention_ref(*args)
    exact = sparse_attention_ref(args[0].float(), args[1].float(), args[2].float(), *args[3:])
    err = (out.float() - exact.float()).abs().max().item()
    ref_err = (ref.float() - exact.float()).abs().max().item()
    assert out.shape == ref.shape == (case[0], case[3], case[1], case[4]) and out.dtype == dtype
    assert err <= 2 * ref_err + TOL[dtype], f"kernel err {err:.3g} vs twin err {ref_err:.3g} ({dtype}, {case})"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_sparse_attention_kernel_matches_twin(case, dtype):
    _check_kernel(case, dtype, "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")


@needs_triton
@pytest.mark.parametrize("max_programs", [None, 1, 2])
def test_copy_rows_kernel_matches_twin(max_programs):
    src = torch.randn(7, 3, 48)
    rows = torch.tensor([0, 5, -1, 19, 20])
    src_off = torch.where(rows >= 0, rows * 48, -1)
    dst_off = torch.tensor([4, 0, 1, 3, 2]) * 48
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    dst_k = torch.full((5, 48), float("nan"), device=dev)
    dst_r = dst_k.clone()
    copy_rows(src.to(dev), src_off.to(dev), dst_k, dst_off.to(dev), 48, max_programs)
    copy_rows_ref(src.to(dev), src_off.to(dev), dst_r, dst_off.to(dev), 48, max_programs)
    torch.testing.assert_close(dst_k, dst_r, equal_nan=True)
    assert torch.isnan(dst_k[1]).all() and torch.equal(dst_k[4].cpu(), src.view(-1, 48)[0])


@needs_triton
@pytest.mark.parametrize("row_elems", [4096, 8192 + 64])
def test_copy_rows_persistent_programs_cover_every_row(row_elems):
    """A capped grid loops: 2 programs move 37 rows (several tiles each, rows wider than one tile)."""
    gen = torch.Generator().manual_seed(row_elems)
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    src = torch.randn(50, row_elems, generator=gen).to(dev)
    rows = torch.randperm(50, generator=gen)[:37]
    src_off = (rows * row_elems).to(dev)
    dst_off = (torch.arange(37) * row_elems).to(dev)
    dst = torch.zeros(37, row_elems, device=dev)
    copy_rows(src, src_off, dst, dst_off, row_elems, 2)
    torch.testing.assert_close(dst, src[rows.to(dev)])
    with pytest.raises(ValueError, match="max_programs"):
        copy_rows(src, src_off, dst, dst_off, row_elems, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sparse_attention_gpu_large(dtype):
    """Real decode shapes on the GPU: Llama-8B heads, budget 2048, batch 8."""
    _check_kernel((8, 32, 8, 1, 128, 64, 32, 30000), dtype, "cuda")
    _check_kernel((2, 28, 4, 5, 128, 64, 32, 9000), dtype, "cuda")


@pytest.mark.gpu
def test_copy_rows_reads_and_writes_pinned_host_memory():
    host = torch.randn(64, 4096).pin_memory()
    dev = torch.zeros(16, 4096, device="cuda")
    rows = torch.randperm(64)[:16]
    copy_rows(host, (rows * 4096).cuda(), dev, (torch.arange(16) * 4096).cuda(), 4096)
    torch.testing.assert_close(dev.cpu(), host[rows])
    back = torch.zeros(16, 4096).pin_memory()
    copy_rows(dev, (torch.arange(16) * 4096).cuda(), back, (torch.arange(16).flip(0) * 4096).cuda(), 4096)
    torch.cuda.synchronize()
    torch.testing.assert_close(back.flip(0), host[rows])
    with pytest.raises(ValueError, match="pageable"):
        copy_rows(torch.randn(4, 8), torch.zeros(1, dtype=torch.long, device="cuda"), dev,
                  torch.zeros(1, dtype=torch.long, device="cuda"), 8)


# (B, H_q, H_kv, T, D, NB): GQA 1/4/7, 1 and several query tokens, NB not a multiple of the kernel's 64-block tile
SCORE_CASES = [(1, 4, 4, 1, 16, 10), (2, 8, 2, 1, 64, 130), (1, 7, 1, 4, 32, 65), (3, 4, 1, 3, 80, 7)]


def make_score_inputs(case, dtype, device="cpu"):
    b, hq, hkv, t, d, nb = case
    gen = torch.Generator().manual_seed(sum(case))
    query = torch.randn(b, hq, t, d, generator=gen).to(device, dtype)
    summary = torch.randn(b, hkv, nb, d, generator=gen).to(device, dtype)
    ids = torch.arange(nb)
    first = torch.randint(0, 3, (b, 1), generator=gen)
    block_ok = (ids >= first) & (ids < nb - 1)
    if b > 2:
        block_ok[2] = False  # a sequence with nothing to choose scores zero everywhere
    return query, summary, block_ok.to(device), d**-0.5


@pytest.mark.parametrize("case", SCORE_CASES, ids=str)
def test_score_blocks_ref_matches_loop_oracle(case):
    query, summary, block_ok, scale = make_score_inputs(case, torch.float32)
    b, hq, hkv, t, d, nb = case
    expected = torch.zeros(b, hkv, nb)
    for i in range(b):
        for h in range(hq):
            for tok in range(t):
                allowed = block_ok[i].nonzero().flatten()
                if len(allowed) == 0:
                    continue
                logits = summary[i, h // (hq // hkv), allowed] @ query[i, h, tok] * scale
                expected[i, h // (hq // hkv), allowed] += torch.softmax(logits, 0)
    torch.testing.assert_close(score_blocks_ref(query, summary, block_ok, scale), expected, atol=1e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SCORE_CASES, ids=str)
def test_score_blocks_kernel_matches_twin(case, dtype):
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    args = make_score_inputs(case, dtype, dev)
    out, ref = score_blocks(*args), score_blocks_ref(*args)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-4 if dtype == torch.float32 else 2e-2, rtol=1e-3)
    assert bool((out[~args[2][:, None, :].expand_as(out)] == 0).all())


def _quest_bound_scores(query, low, high, block_ok, scale):
    """Quest's bound the slow way: per channel the larger of q*lo and q*hi, summed; softmax over the allowed blocks
    per query row; the rows of a GQA group and its tokens summed."""
    b, hq, t, d = query.shape
    hkv = low.shape[1]
    q = query.float().reshape(b, hkv, (hq // hkv) * t, 1, d)
    logits = torch.maximum(q * low.float()[:, :, None], q * high.float()[:, :, None]).sum(-1) * scale
    logits = logits.masked_fill(~block_ok[:, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SCORE_CASES, ids=str)
def test_minmax_summaries_score_quests_bound(case, dtype, backend):
    """`BlockSummaries("minmax").score` runs Quest's bound as one dot product over 2D channels (relu(q).hi +
    min(q,0).lo) through `score_blocks` or its twin; it must equal the elementwise bound, empty blocks included."""
    from oasis_hf.cache.summaries import BlockSummaries

    dev = "cuda" if backend == "triton" and torch.cuda.is_available() and not INTERPRET else "cpu"
    b, hq, hkv, t, d, nb = case
    query, _, block_ok, scale = make_score_inputs(case, dtype, dev)
    gen = torch.Generator().manual_seed(nb)
    bs = 4
    keys = torch.randn(b, hkv, nb, bs, d, generator=gen).to(dev, dtype)
    token_ok = torch.rand(b, 1, nb, bs, generator=gen).to(dev) > 0.3
    token_ok[:, :, 0] = False  # a block with no valid token has zero bounds
    summaries = BlockSummaries("minmax", b, hkv, nb, d, dtype, dev)
    summaries.write(torch.arange(nb, device=dev), keys, token_ok)
    low, high = summaries.data[0], summaries.data[1]
    assert bool((high >= low).all()) and not bool(low[:, :, 0].any())
    out = summaries.score(query, scale, block_ok[:, None, :], backend)
    expected = _quest_bound_scores(query, low, high, block_ok, scale)
    assert out.shape == (b, hkv, nb) and out.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 and backend == "torch" else (1e-3 if dtype == torch.float32 else 2e-2)
    torch.testing.assert_close(out, expected, atol=tol, rtol=1e-3)


@pytest.mark.gpu
def test_minmax_summaries_score_gpu_large():
    """Qwen2.5-1.5B's lookahead shape at 30k tokens in blocks of 16: batch 8, 12 query heads over 2 KV heads, 5
    verify queries, head dim 128 (256 channels in the bound's dot product), bf16."""
    from oasis_hf.cache.summaries import BlockSummaries

    query, _, block_ok, scale = make_score_inputs((8, 12, 2, 5, 128, 1875), torch.bfloat16, "cuda")
    summaries = BlockSummaries("minmax", 8, 2, 1875, 128, torch.bfloat16, "cuda")
    keys = torch.randn(8, 2, 1875, 16, 128, device="cuda", dtype=torch.bfloat16)
    token_ok = torch.ones(8, 1, 1875, 16, dtype=torch.bool, device="cuda")
    summaries.write(torch.arange(1875, device="cuda"), keys, token_ok)
    expected = _quest_bound_scores(query, summaries.data[0], summaries.data[1], block_ok, scale)
    torch.testing.assert_close(summaries.score(query, scale, block_ok[:, None, :], "triton"), expected, atol=2e-2,
                               rtol=1e-3)


@pytest.mark.gpu
def test_score_blocks_gpu_large():
    """Llama-8B decode shape: batch 8, 32 query heads over 8 KV heads, 32k tokens in blocks of 32."""
    args = make_score_inputs((8, 32, 8, 1, 128, 1030), torch.bfloat16, "cuda")
    torch.testing.assert_close(score_blocks(*args), score_blocks_ref(*args), atol=2e-2, rtol=1e-3)


def test_package_works_without_triton():
    """A CPU-only install (``pip install oasis_hf`` with CPU torch, which does not pull Triton) imports and decodes
    on the PyTorch twins. Triton is hidden from a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
        "import oasis_hf\n"
        "from oasis_hf.kernels import TRITON_AVAILABLE; assert not TRITON_AVAILABLE\n"
        "from tests._factories import oasis_cache, tiny_model\n"
        "from tests.test_generate import generate, left_padded\n"
        "m = tiny_model('llama', attn='oasis'); ids, mask = left_padded([120])\n"
        "with oasis_cache(m, selector='lookahead', budget_tokens=128, max_fetch_blocks=2) as cache:\n"
        "    generate(m, ids, mask, cache)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


# (B, H_kv, S, NB): S not a power of two, NB == S, NB far above S (the 32k / budget-2048 shape: 513 blocks, 32 slots)
PLAN_CASES = [
    *(pytest.param(case, cap, id=f"{case}-{cap}") for case in [(2, 3, 5, 9), (1, 2, 4, 4), (2, 1, 7, 40)]
      for cap in (None, 0, 2)),
    pytest.param((1, 2, 32, 513), 2, id="32k-budget-2048"),  # ~10 s in the interpreter: one cap only
]


def _plan_scores(gen, batch, heads, num_blocks, live, step):
    """Scores with what the planner must get right: ties (a coarse grid, +0.0 and -0.0), forced (+inf) sinks and
    recent blocks, unchoosable (-inf) blocks past the live ones and a padded sequence."""
    scores = torch.randint(0, 6, (batch, heads, num_blocks), generator=gen).float() / 5
    scores[..., ::7] = -0.0
    scores[..., live:] = -float("inf")
    scores[..., 0] = float("inf")
    scores[..., live - 1] = float("inf")
    if batch > 1:
        scores[1, :, : step % 3] = -float("inf")  # left padding of the second sequence
    return scores


@needs_triton
@pytest.mark.parametrize(("case", "max_fetch"), PLAN_CASES)
def test_plan_blocks_kernel_matches_twin(case, max_fetch):
    """From an empty table through a chain of plans (the twin's table carried on), the kernel returns the same
    plan and leaves the same table at every step, ties and caps included."""
    batch, heads, num_slots, num_blocks = case
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    gen = torch.Generator().manual_seed(sum(case) + (max_fetch or 7))
    slot_block = torch.full((batch, heads, num_slots + 1), -1, dtype=torch.long, device=dev)
    slot_score = torch.full((batch, heads, num_slots + 1), -float("inf"), device=dev)
    block_slot = torch.full((batch, heads, num_blocks + 1), -1, dtype=torch.long, device=dev)
    for step in range(4):
        live = max(2, num_blocks - 3 + step) if step < 3 else num_blocks
        live = min(live, num_blocks)
        scores = _plan_scores(gen, batch, heads, num_blocks, live, step).to(dev)
        tables_k = [t.clone() for t in (slot_block, slot_score, block_slot)]
        count_k, count_r = torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev)
        out_k = plan_blocks(scores, *tables_k, max_fetch, count_k)
        out_r = plan_blocks_ref(scores, slot_block, slot_score, block_slot, max_fetch, count_r)
        for name, k, r in zip(("blocks", "slots", "valid"), out_k, out_r, strict=True):
            assert torch.equal(k, r), f"step {step}: {name} differs\n{k}\n{r}"
        assert torch.equal(tables_k[0][..., :num_slots], slot_block[..., :num_slots]), f"step {step}: slot_block"
        assert torch.equal(tables_k[1][..., :num_slots], slot_score[..., :num_slots]), f"step {step}: slot_score"
        assert torch.equal(tables_k[2][..., :-1], block_slot[..., :-1]), f"step {step}: block_slot"
        assert int(count_k) == int(count_r) == int(out_r[2].sum())
        if max_fetch is not None:
            forced = out_r[2] & (scores.gather(-1, out_r[0]) == float("inf"))
            assert int((out_r[2] & ~forced).sum(-1).max()) <= max_fetch


@needs_triton
def test_plan_blocks_rejects_what_it_cannot_plan():
    table = [torch.full((1, 1, 5), -1, dtype=torch.long), torch.zeros(1, 1, 5), torch.full((1, 1, 9), -1)]
    with pytest.raises(ValueError, match="slots"):
        plan_blocks(torch.zeros(1, 1, 3), *table, None)  # fewer blocks scored than slots
    with pytest.raises(ValueError, match="float32"):
        plan_blocks(torch.zeros(1, 1, 6, dtype=torch.float16), *table, None)


def _gather_case(dev, seed, batch=2, heads=3, src_blocks=7, slots=5, bs=4, dim=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    src_k = torch.randn(batch, heads, src_blocks, bs, dim, generator=gen).to(dtype)
    src_v = torch.randn(batch, heads, src_blocks, bs, dim, generator=gen).to(dtype)
    blocks = torch.randint(0, src_blocks + 6, (batch, heads, slots), generator=gen) + 3  # some outside the segment
    slots_ = torch.stack([torch.randperm(slots, generator=gen) for _ in range(batch * heads)]).view(batch, heads, -1)
    valid = torch.rand(batch, heads, slots, generator=gen) < 0.7
    pools = [torch.full((batch, heads, slots, bs, dim), float("nan"), device=dev).to(dtype) for _ in range(4)]
    return src_k, src_v, pools, blocks.to(dev), slots_.to(dev), valid.to(dev)


@needs_triton
@pytest.mark.parametrize("max_programs", [None, 1, 3])
def test_gather_blocks_kernel_matches_twin(max_programs):
    """A plan (blocks, slots, valid) of a segment that starts at block 3: entries invalid or outside the segment
    leave the pool untouched; K and V land in the planned slots."""
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    src_k, src_v, (k1, v1, k2, v2), blocks, slots, valid = _gather_case(dev, max_programs or 0)
    src_k, src_v = src_k.to(dev), src_v.to(dev)
    gather_blocks(src_k, src_v, k1, v1, blocks, slots, valid, 3, max_programs)
    gather_blocks_ref(src_k, src_v, k2, v2, blocks, slots, valid, 3, max_programs)
    torch.testing.assert_close(k1, k2, equal_nan=True)
    torch.testing.assert_close(v1, v2, equal_nan=True)
    b, h, j = next(zip(*((valid & (blocks >= 3) & (blocks < 10)).nonzero(as_tuple=True)), strict=True))
    assert torch.equal(k1[b, h, slots[b, h, j]], src_k[b, h, blocks[b, h, j] - 3])
    assert torch.isnan(k1).any(), "the case must leave some slots untouched"


def test_gather_blocks_rejects_mismatched_shapes():
    src = torch.zeros(2, 3, 4, 4, 8)
    pool = torch.zeros(2, 3, 5, 4, 8)
    plan = torch.zeros(2, 3, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="disagree"):
        gather_blocks(src, src, torch.zeros(2, 3, 5, 4, 16), torch.zeros(2, 3, 5, 4, 16), plan, plan, plan.bool())
    with pytest.raises(ValueError, match=r"\(B, H_kv, N\)"):
        gather_blocks(src, src, pool, pool, plan[:, :2], plan, plan.bool())


@pytest.mark.gpu
def test_gather_blocks_reads_pinned_host_memory():
    """The real case: a pinned host segment, bf16 blocks of 32 x 128, the pool on the GPU, a capped grid."""
    src_k, src_v, (k1, v1, k2, v2), blocks, slots, valid = _gather_case(
        "cuda", 5, batch=4, heads=8, src_blocks=40, slots=16, bs=32, dim=128, dtype=torch.bfloat16)
    src_k, src_v = src_k.pin_memory(), src_v.pin_memory()
    gather_blocks(src_k, src_v, k1, v1, blocks, slots, valid, 3, 4)
    gather_blocks_ref(src_k, src_v, k2, v2, blocks, slots, valid, 3)
    torch.cuda.synchronize()
    torch.testing.assert_close(k1, k2, equal_nan=True)
    torch.testing.assert_close(v1, v2, equal_nan=True)
    with pytest.raises(ValueError, match="pageable"):
        gather_blocks(src_k.clone(), src_v.clone(), k1, v1, blocks, slots, valid)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_mean_plus_minmax_lets_each_summary_propose(backend):
    """Four blocks of 4 keys against the query e0: N holds one key that matches strongly among keys that do not
    (a fact to retrieve), M only keys that match moderately (words to count), X one strong and one strongly negative
    key (a bound as high as a fact's, mean 0), Y weak matches. Mean keys rank M, Y first and miss N; Quest's bounds
    rank N, X first and miss M; ``mean+minmax`` averages the two softmax shares and keeps N and M."""
    from oasis_hf.cache.summaries import BlockSummaries

    dev = "cuda" if backend == "triton" and torch.cuda.is_available() and not INTERPRET else "cpu"
    ch0 = torch.tensor([[10.0, -3, -3, -3], [2, 2, 2, 2], [6, -6, 6, -6], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]])
    keys = torch.zeros(1, 1, 6, 4, 16)
    keys[..., 0] = ch0
    keys[..., 1] = 0.5 * torch.tensor([1.0, -1, 1, -1])  # the same in every block: no score difference
    query = torch.zeros(1, 2, 1, 16)
    query[..., 0] = 1.0
    block_ok = torch.ones(1, 1, 6, dtype=torch.bool, device=dev)
    top2 = {}
    for kind in ("mean", "minmax", "mean+minmax"):
        summaries = BlockSummaries(kind, 1, 1, 6, 16, torch.float32, dev)
        summaries.write(torch.arange(6, device=dev), keys.to(dev), torch.ones(1, 1, 6, 4, dtype=torch.bool, device=dev))
        scores = summaries.score(query.to(dev), 1.0, block_ok, backend)[0, 0]
        torch.testing.assert_close(scores.sum(), torch.tensor(2.0, device=dev))  # 2 query heads, shares sum to 1
        top2[kind] = {"NMXY"[i] if i < 4 else "F" for i in scores.topk(2).indices.tolist()}
    assert top2 == {"mean": {"M", "Y"}, "minmax": {"N", "X"}, "mean+minmax": {"N", "M"}}


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("case", SCORE_CASES[:6], ids=str)
def test_mean_plus_minmax_score_is_the_average_of_both(case, backend):
    """``mean+minmax`` stores lo, hi and the mean key (3 tensors) and scores the average of the mean-key scores and
    Quest's bound, each computed the slow way here; empty blocks have zero summaries."""
    from oasis_hf.cache.summaries import BlockSummaries

    dev = "cuda" if backend == "triton" and torch.cuda.is_available() and not INTERPRET else "cpu"
    b, hq, hkv, t, d, nb = case
    query, _, block_ok, scale = make_score_inputs(case, torch.float32, dev)
    gen = torch.Generator().manual_seed(nb + 1)
    keys = torch.randn(b, hkv, nb, 4, d, generator=gen).to(dev)
    token_ok = torch.rand(b, 1, nb, 4, generator=gen).to(dev) > 0.3
    token_ok[:, :, 0] = False
    both = BlockSummaries("mean+minmax", b, hkv, nb, d, torch.float32, dev)
    both.write(torch.arange(nb, device=dev), keys, token_ok)
    assert both.data.shape[0] == 3 and both.nbytes == 3 * b * hkv * nb * d * 4
    low, high, mean = both.data
    ok = token_ok[..., None]
    want_mean = torch.where(ok, keys, 0.0).sum(3) / ok.sum(3).clamp(min=1)
    torch.testing.assert_close(mean, want_mean)
    torch.testing.assert_close(low, torch.where(ok.any(3), torch.where(ok, keys, float("inf")).amin(3), 0.0))
    torch.testing.assert_close(high, torch.where(ok.any(3), torch.where(ok, keys, float("-inf")).amax(3), 0.0))
    expected = 0.5 * (score_blocks_ref(query, want_mean, block_ok, scale)
                      + _quest_bound_scores(query, low, high, block_ok, scale))
    tol = 1e-4 if backend == "torch" else 1e-3
    torch.testing.assert_close(both.score(query, scale, block_ok[:, None, :], backend), expected, atol=tol, rtol=1e-3)


@pytest.mark.gpu
def test_mean_plus_minmax_score_gpu_large():
    """The minmax GPU test's shape (30k tokens in blocks of 16, Qwen2.5-1.5B's heads, 5 verify queries, bf16) with
    mean keys and bounds kept: two Triton launches, averaged."""
    from oasis_hf.cache.summaries import BlockSummaries

    query, _, block_ok, scale = make_score_inputs((8, 12, 2, 5, 128, 1875), torch.bfloat16, "cuda")
    summaries = BlockSummaries("mean+minmax", 8, 2, 1875, 128, torch.bfloat16, "cuda")
    keys = torch.randn(8, 2, 1875, 16, 128, device="cuda", dtype=torch.bfloat16)
    token_ok = torch.ones(8, 1, 1875, 16, dtype=torch.bool, device="cuda")
    summaries.write(torch.arange(1875, device="cuda"), keys, token_ok)
    low, high, mean = summaries.data
    expected = 0.5 * (score_blocks_ref(query, mean, block_ok, scale)
                      + _quest_bound_scores(query, low, high, block_ok, scale))
    torch.testing.assert_close(summaries.score(query, scale, block_ok[:, None, :], "triton"), expected, atol=2e-2,
                               rtol=1e-3)


def test_block_summaries_refuse_an_unknown_kind():
    from oasis_hf.cache.summaries import _TENSORS, BlockSummaries
    from oasis_hf.config import SUMMARY_KINDS

    assert set(SUMMARY_KINDS) == set(_TENSORS)  # what OasisConfig accepts is what BlockSummaries stores
    with pytest.raises(ValueError, match="unknown block summary 'median'.*mean\\+minmax"):
        BlockSummaries("median", 1, 1, 4, 8, torch.float32, "cpu")
