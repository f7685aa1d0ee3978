"""Every Triton kernel against its PyTorch twin (under TRITON_INTERPRET=1 on CPU, natively on the GPU), plus a
second, naive oracle for the sparse attention (dense SDPA over the gathered blocks)."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from oasis_hf import OasisConfig
from oasis_hf.kernels import (
    INTERPRET,
    TRITON_AVAILABLE,
    append_tokens,
    append_tokens_ref,
    block_mass,
    block_mass_ref,
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
    write_tokens,
    write_tokens_ref,
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
    from oasis_hf import kernels

    twins = [name for name in kernels.__all__ if f"{name}_ref" in kernels.__all__]
    assert len(twins) == 10, twins
    for name in twins:
        kernel, twin = getattr(kernels, name), getattr(kernels, f"{name}_ref")
        assert inspect.signature(kernel) == inspect.signature(twin), name


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


# (B, H_q, H_kv, T, N, D, BS, capacity): GQA 1/3/4, one and several query tokens, partial last block and tile,
# odd head dims, a row past the keys' end, spare capacity
MASS_CASES = [
    (2, 4, 2, 3, 70, 8, 16, 6),
    (1, 6, 2, 5, 200, 64, 32, 8),
    (3, 8, 8, 1, 130, 80, 16, 12),
    (2, 12, 3, 7, 33, 16, 32, 3),
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", MASS_CASES, ids=str)
def test_block_mass_kernel_matches_twin(case, dtype):
    """Each row's causal softmax over its visible keys, summed per block: left padding (kv_start), queries earlier
    than the last key, and a row that sees no key at all (its position is before its sequence's first real key)."""
    b, hq, hkv, t, n, d, bs, capacity = case
    gen = torch.Generator().manual_seed(n)
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    query = torch.randn(b, hq, t, d, generator=gen).to(device, dtype)
    keys = torch.randn(b, hkv, n, d, generator=gen).to(device, dtype)
    q_pos = torch.arange(n - t, n).to(device)
    q_pos[0] = 3  # an early query: sees few keys, none where the sequence starts later
    kv_start = torch.tensor([0, 9, 2][:b]).to(device)
    got = block_mass(query, keys, d**-0.5, q_pos, kv_start, bs, capacity)
    want = block_mass_ref(query, keys, d**-0.5, q_pos, kv_start, bs, capacity)
    assert got.shape == want.shape == (b, hkv, capacity) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    rows_seeing_keys = hq // hkv * (t - 1) + hq // hkv * (kv_start <= 3).to(torch.float32)  # per (sequence, head)
    torch.testing.assert_close(got.sum(-1), rows_seeing_keys[:, None].expand(b, hkv).to(got), atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sparse_attention_never_reads_what_no_query_may_see(backend):
    """Positions past the sequence and empty slots may hold anything (a preallocated buffer is uninitialised): NaN
    there changes nothing, in the twin as in the kernel's masked loads."""
    if backend == "triton" and not (TRITON_AVAILABLE and (torch.cuda.is_available() or INTERPRET)):
        pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1 (set by .ci/run)")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() and not INTERPRET else "cpu"
    query, pool_k, pool_v, slot_block, seq_len, kv_start, scale = make_inputs((2, 4, 2, 1, 16, 3, 8, 37), torch.float32)
    slot_block[1, 0, 0] = -1  # an empty slot
    bs = pool_k.shape[3]
    poisoned_k, poisoned_v = pool_k.clone(), pool_v.clone()
    for pool in (poisoned_k, poisoned_v):
        pool[1, 0, 0] = float("nan")
        tail = (slot_block[..., : pool.shape[2]] == (seq_len - 1) // bs).nonzero()  # the tail block's slot
        for b, h, s in tail.tolist():
            pool[b, h, s, seq_len % bs or bs :] = float("nan")  # positions past the sequence
    attend = sparse_attention if backend == "triton" else sparse_attention_ref
    moved = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (query, slot_block, kv_start)]
    clean = attend(moved[0], pool_k.to(device), pool_v.to(device), moved[1], seq_len, moved[2], scale)
    dirty = attend(moved[0], poisoned_k.to(device), poisoned_v.to(device), moved[1], seq_len, moved[2], scale)
    assert not dirty.isnan().any()
    torch.testing.assert_close(dirty, clean, atol=0, rtol=0)


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
def test_sparse_attention_inside_torch_compile_matches_twin():
    """A compiled function that calls the kernel (the dense-graphed baseline's compiled model does) gets the eager
    result: Inductor types a Python-float kernel argument as fp64, so the softmax scale is a constant instead."""
    args = make_inputs((2, 28, 4, 1, 128, 16, 32, 1500), torch.bfloat16, "cuda")
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: sparse_attention(*a) * 1.0, dynamic=False)
    torch.testing.assert_close(compiled(*args), sparse_attention(*args), atol=0, rtol=0)


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


# (B, H_q, H_kv, T, D, NB, BS): GQA 1/4/7, 1 and several query tokens, NB not a multiple of the kernel's 64-block tile
SCORE_CASES = [(1, 4, 4, 1, 16, 10, 16), (2, 8, 2, 1, 64, 130, 16), (1, 7, 1, 4, 32, 65, 32), (3, 4, 1, 3, 80, 7, 16)]
KINDS = ("mean", "minmax", "mean+minmax")
SCORED_KINDS = (*KINDS, "quantized")  # quantized: token-level scoring from codes (`make_quantized_inputs`)


def make_score_inputs(case, kind, dtype, device="cpu"):
    """Queries, summaries of `kind` built from random keys (some tokens missing, block 0 empty), left padding,
    a view ending inside the last-but-two block, a selection memory."""
    from oasis_hf.kernels.ref import summarize_blocks

    b, hq, hkv, t, d, nb, bs = case
    gen = torch.Generator().manual_seed(sum(case) + len(kind))
    query = torch.randn(b, hq, t, d, generator=gen).to(device, dtype)
    keys = torch.randn(b, hkv, nb, 4, d, generator=gen)
    token_ok = torch.rand(b, 1, nb, 4, generator=gen) > 0.3
    token_ok[:, :, 0] = False
    summaries = summarize_blocks(kind, keys, token_ok).to(device, dtype)
    kv_start = torch.randint(0, 3 * bs, (b,), generator=gen).to(device)
    start = torch.tensor(max(nb - 3, 1) * bs - t - 1 + bs // 2, device=device)
    memory = torch.rand(b, hkv, nb, generator=gen).to(device) * 0.02
    return query, summaries, kv_start, start, memory, d**-0.5


def _rules(case, **over):
    return dict(dict(num_tokens=case[3], block_size=case[6], sink_blocks=1, recent_blocks=2, decay=0.0), **over)


def _slow_scores(query, summaries, kind, kv_start, start, scale, memory, num_tokens, block_size, sink_blocks,
                 recent_blocks, decay, start_offset=0, memory_write=True):
    """The rules the slow way: a softmax per query row over the choosable blocks (mean logit and/or Quest's bound
    per channel), then per block forced / excluded / remembered (and the memory updated unless not `memory_write`)."""
    from oasis_hf.kernels.ref import SUMMARY_LAYOUT

    b, hq, t, d = query.shape
    layout = SUMMARY_LAYOUT[kind]
    hkv, nb = summaries.shape[2], summaries.shape[3]
    view = int(start) + start_offset
    num_blocks = -(-(view + num_tokens) // block_size)
    out = torch.zeros(b, hkv, nb)
    memory = memory.clone()
    for i in range(b):
        first = int(kv_start[i]) // block_size
        allowed = [n for n in range(nb) if first <= n < num_blocks]
        for h in range(hkv):
            shares = torch.zeros(nb)
            for qh in range(h * (hq // hkv), (h + 1) * (hq // hkv)):
                for tok in range(t):
                    q = query[i, qh, tok].float()
                    parts = []
                    if "mean" in layout:
                        parts.append(summaries[layout.index("mean"), i, h, allowed].float() @ q * scale)
                    if "lo" in layout:
                        lo, hi = (summaries[layout.index(n), i, h, allowed].float() for n in ("lo", "hi"))
                        parts.append(torch.maximum(q * lo, q * hi).sum(-1) * scale)
                    if allowed:
                        probs = [torch.softmax(x, 0) for x in parts]
                        shares[allowed] += sum(probs) / len(probs)
            recent_from = min(num_blocks - recent_blocks, view // block_size)
            for n in range(nb):
                ok = n in allowed
                score = float(shares[n])
                if decay > 0:
                    score = max(score / ((hq // hkv) * t) if ok else 0.0, float(memory[i, h, n]) * decay)
                    if memory_write:
                        memory[i, h, n] = score
                forced = ok and (n < first + sink_blocks or n >= recent_from)
                out[i, h, n] = float("inf") if forced else (score if ok else -float("inf"))
    return out, memory


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", SCORE_CASES, ids=str)
def test_score_blocks_ref_matches_slow_rules(case, kind):
    query, summaries, kv_start, start, memory, scale = make_score_inputs(case, kind, torch.float32)
    for decay, offset, write in ((0.0, 0, True), (0.5, case[3] - 1, True), (0.5, 0, False)):
        rules = _rules(case, decay=decay, num_tokens=1 if offset else case[3], memory_write=write)
        mem_ref = memory.clone()
        out = score_blocks_ref(query, summaries, None, mem_ref, kv_start, start, scale, kind=kind,
                               source="summaries", start_offset=offset, **rules)
        expected, expected_mem = _slow_scores(query, summaries, kind, kv_start, start, scale, memory,
                                              start_offset=offset, **rules)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mem_ref, expected_mem, atol=1e-6, rtol=1e-5)
        assert torch.equal(mem_ref, memory) == (not decay or not write)  # read-only memory: left as it was


def _check_scores(case, kind, source, decay, dtype, device, offset=0, memory_write=True, candidates=0):
    codes = None
    if kind == "quantized":
        query, summaries, codes, kv_start, start, memory, *_, scale = make_quantized_inputs(case, dtype, device)
    else:
        query, summaries, kv_start, start, memory, scale = make_score_inputs(case, kind, dtype, device)
    raw = torch.rand(memory.shape, device=device) if source == "raw" else None
    rules = _rules(case, decay=decay, num_tokens=1 if offset else case[3], memory_write=memory_write)
    mem_k, mem_r = memory.clone(), memory.clone()
    out = score_blocks(query, summaries, raw, mem_k, kv_start, start, scale, kind=kind, source=source,
                       start_offset=offset, codes=codes, candidates=candidates, **rules)
    ref = score_blocks_ref(query, summaries, raw, mem_r, kv_start, start, scale, kind=kind, source=source,
                           start_offset=offset, codes=codes, candidates=candidates, **rules)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.equal(torch.isinf(out), torch.isinf(ref)) and torch.equal(out == float("inf"), ref == float("inf"))
    finite = torch.isfinite(ref)
    assert bool(finite.any()), "the case must leave some blocks to score"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[finite], ref[finite], atol=tol, rtol=1e-3)
    torch.testing.assert_close(mem_k, mem_r, atol=tol, rtol=1e-3)
    if not memory_write:
        assert torch.equal(mem_k, memory) and torch.equal(mem_r, memory)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", SCORED_KINDS)
@pytest.mark.parametrize("case", SCORE_CASES, ids=str)
def test_score_blocks_kernel_matches_twin(case, kind, dtype):
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    _check_scores(case, kind, "summaries", 0.0, dtype, dev)
    _check_scores(case, kind, "summaries", 0.9, dtype, dev, offset=case[3] - 1)  # a selection job's view
    _check_scores(case, kind, "summaries", 0.9, dtype, dev, memory_write=False)  # the memory read, not updated


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SCORE_CASES, ids=str)
def test_score_blocks_kernel_matches_twin_two_stage(case, dtype):
    """``quantized`` in two stages: a few candidates (the forced blocks and two or three more), and more candidates
    than blocks (every block's codes, as one stage)."""
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    _check_scores(case, "quantized", "summaries", 0.0, dtype, dev, candidates=6)
    _check_scores(case, "quantized", "summaries", 0.9, dtype, dev, offset=case[3] - 1, candidates=6)
    _check_scores(case, "quantized", "summaries", 0.9, dtype, dev, candidates=case[5] + 3)


def make_quantized_inputs(case, dtype, device="cpu", grid=False):
    """`make_score_inputs` for a ``quantized`` summary: keys of BS tokens per block, real from the padding start to
    the view's end as in a cache, their bounds and codes; with `grid`, every real key on its block's 4-level grid
    (quantization is lossless)."""
    from oasis_hf.kernels.ref import quantize_blocks, summarize_blocks

    b, hq, hkv, t, d, nb, bs = case
    gen = torch.Generator().manual_seed(sum(case) + 7)
    query = torch.randn(b, hq, t, d, generator=gen)
    keys = torch.randn(b, hkv, nb, bs, d, generator=gen)
    kv_start = torch.randint(0, 3 * bs, (b,), generator=gen)
    start = torch.tensor(max(nb - 3, 1) * bs - t - 1 + bs // 2)
    pos = torch.arange(nb * bs).view(1, 1, nb, bs)
    token_ok = (pos >= kv_start.view(-1, 1, 1, 1)) & (pos < start + t)
    bounds = summarize_blocks("quantized", keys, token_ok)
    if grid:
        lo, hi = bounds[0][..., None, :], bounds[1][..., None, :]
        keys = lo + torch.randint(0, 4, keys.shape, generator=gen) * (hi - lo) / 3
        bounds[2] = summarize_blocks("mean", keys, token_ok)[0]  # the mean of the keys on the grid
    codes = quantize_blocks(keys, token_ok, bounds)
    memory = torch.rand(b, hkv, nb, generator=gen) * 0.02
    out = [query.to(dtype), bounds.to(dtype), codes, kv_start, start, memory]
    return [x.to(device) for x in out] + [keys, token_ok, d**-0.5]


@pytest.mark.parametrize("case", SCORE_CASES, ids=str)
def test_score_blocks_ref_quantized_is_exact_attention_on_lossless_keys(case):
    """With every key on its block's grid, a ``quantized`` score is the exact attention mass of each block: every
    row's softmax over the real tokens of the view in choosable blocks, summed per block and over the rows; the
    rules (forced, excluded) as for the other summaries."""
    query, bounds, codes, kv_start, start, memory, keys, token_ok, scale = make_quantized_inputs(case, torch.float32,
                                                                                                 grid=True)
    b, hq, hkv, t, d, nb, bs = case
    rules = _rules(case)
    out = score_blocks_ref(query, bounds, None, None, kv_start, start, scale, kind="quantized", source="summaries",
                           codes=codes, **rules)
    forced = score_blocks_ref(query, bounds, None, None, kv_start, start, scale, kind="minmax", source="summaries",
                              **rules)
    assert torch.equal(torch.isinf(out), torch.isinf(forced)) and torch.equal(out > 0, forced > 0)
    end = int(start) + t
    num_blocks = -(-end // bs)
    for i in range(b):
        pos = torch.arange(nb * bs)
        real = (pos >= int(kv_start[i])) & (pos < end) & (pos < num_blocks * bs)
        for h in range(hkv):
            k = keys[i, h].reshape(nb * bs, d)[real]
            rows = query[i, h * (hq // hkv) : (h + 1) * (hq // hkv)].reshape(-1, d)
            probs = torch.softmax(rows @ k.T * scale, dim=-1).sum(0)
            mass = torch.zeros(nb * bs).index_put_((pos[real],), probs).view(nb, bs).sum(-1)
            finite = torch.isfinite(out[i, h])
            torch.testing.assert_close(out[i, h][finite], mass[finite], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", SCORE_CASES, ids=str)
def test_score_blocks_ref_two_stage_follows_its_rule(case):
    """Two-stage ``quantized`` scoring, the slow way: per (sequence, KV head) the `candidates` blocks ``mean+minmax``
    rates best (forced ones first) are the candidates; each query row's softmax runs over the real tokens of the
    candidates (logits against their dequantized keys) and one entry per other choosable block at its mean key's
    logit + log(BS); a block's score is its entries' shares summed over the rows. More candidates than blocks gives
    the one-stage scores."""
    from oasis_hf.kernels.ref import SUMMARY_LAYOUT, dequantize_blocks

    query, summaries, codes, kv_start, start, _, keys, token_ok, scale = make_quantized_inputs(case, torch.float32)
    b, hq, hkv, t, d, nb, bs = case
    rules = _rules(case)
    one_stage = score_blocks_ref(query, summaries, None, None, kv_start, start, scale, kind="quantized",
                                 source="summaries", codes=codes, **rules)
    every = score_blocks_ref(query, summaries, None, None, kv_start, start, scale, kind="quantized",
                             source="summaries", codes=codes, candidates=nb + 1, **rules)
    torch.testing.assert_close(every, one_stage, atol=1e-6, rtol=1e-5)
    first_stage = score_blocks_ref(query, summaries, None, None, kv_start, start, scale, kind="mean+minmax",
                                   source="summaries", **rules)
    dequantized = dequantize_blocks(codes, summaries)  # (B, H_kv, NB, BS, D)
    mean = summaries[SUMMARY_LAYOUT["quantized"].index("mean")]
    end = int(start) + t
    num_blocks = -(-end // bs)
    for count in (3, 6):
        out = score_blocks_ref(query, summaries, None, None, kv_start, start, scale, kind="quantized",
                               source="summaries", codes=codes, candidates=count, **rules)
        assert torch.equal(torch.isinf(out), torch.isinf(one_stage)) and torch.equal(out > 0, one_stage > 0)
        others = 0
        for i in range(b):
            first = int(kv_start[i]) // bs
            choosable = list(range(first, min(num_blocks, nb)))
            for h in range(hkv):
                chosen = set(first_stage[i, h].topk(count).indices.tolist()) & set(choosable)
                expected = torch.zeros(nb)
                for row in query[i, h * (hq // hkv) : (h + 1) * (hq // hkv)].reshape(-1, d):
                    entries, owners = [], []
                    for n in choosable:
                        if n in chosen:
                            real = [j for j in range(bs) if int(kv_start[i]) <= n * bs + j < end]
                            entries += [float(dequantized[i, h, n, j] @ row) * scale for j in real]
                            owners += [n] * len(real)
                        else:
                            entries.append(float(mean[i, h, n] @ row) * scale + math.log(bs))
                            owners.append(n)
                    shares = torch.softmax(torch.tensor(entries), 0)
                    expected.index_add_(0, torch.tensor(owners), shares)
                finite = torch.isfinite(out[i, h])
                torch.testing.assert_close(out[i, h][finite], expected[finite], atol=1e-5, rtol=1e-4)
                others += len(choosable) - len(chosen)
        if others:  # some block went without its codes: its score is an estimate
            assert not torch.allclose(out[torch.isfinite(out)], one_stage[torch.isfinite(out)])


@needs_triton
@pytest.mark.parametrize("source", ["recency", "raw"])
def test_score_blocks_kernel_sources_without_summaries(source):
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    _check_scores(SCORE_CASES[1], "mean", source, 0.0, torch.float32, dev)
    _check_scores(SCORE_CASES[3], "minmax", source, 0.9 if source == "raw" else 0.0, torch.float32, dev)


def test_score_blocks_refuses_bad_input():
    query, summaries, kv_start, start, memory, scale = make_score_inputs(SCORE_CASES[0], "mean", torch.float32)
    rules = _rules(SCORE_CASES[0])
    with pytest.raises(ValueError, match="unknown source 'quest'"):
        score_blocks(query, summaries, None, memory, kv_start, start, scale, kind="mean", source="quest", **rules)
    with pytest.raises(ValueError, match="does not match 'minmax' summaries"):
        score_blocks(query, summaries, None, memory, kv_start, start, scale, kind="minmax", source="summaries",
                     **rules)
    with pytest.raises(ValueError, match="needs `raw`"):
        score_blocks(query, summaries, None, memory, kv_start, start, scale, kind="mean", source="raw", **rules)
    bounds = make_score_inputs(SCORE_CASES[0], "mean+minmax", torch.float32)[1]  # the layout of quantized
    for score in (score_blocks, score_blocks_ref):
        with pytest.raises(ValueError, match="quantized.*codes"):
            score(query, bounds, None, memory, kv_start, start, scale, kind="quantized", source="summaries", **rules)
        with pytest.raises(ValueError, match="candidates=4 with a 'mean' summary"):
            score(query, summaries, None, memory, kv_start, start, scale, kind="mean", source="summaries",
                  candidates=4, **rules)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", SCORED_KINDS)
def test_score_blocks_gpu_large(kind):
    """Decode shapes on the GPU: Llama-8B at batch 8 / 32k (1,030 blocks of 32) and batch 1 / 128k (4,097 blocks:
    many splits per (sequence, head)), Qwen2.5-1.5B's 5 verify queries at 30k in blocks of 16; bf16."""
    for case in [(8, 32, 8, 1, 128, 1030, 32), (1, 32, 8, 1, 128, 4097, 32), (8, 12, 2, 5, 128, 1875, 16)]:
        _check_scores(case, kind, "summaries", 0.9, torch.bfloat16, "cuda")
        _check_scores(case, kind, "summaries", 0.9, torch.bfloat16, "cuda", memory_write=False)  # sync_fetch_memory
        if kind == "quantized":  # two stages: 4 x 59 candidates and the forced blocks, as at a 2048-token budget
            _check_scores(case, kind, "summaries", 0.9, torch.bfloat16, "cuda", candidates=4 * 59 + 8)


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
@pytest.mark.parametrize("keep_margin", [0.3, 0.5])
@pytest.mark.parametrize(("case", "max_fetch"), [((2, 3, 5, 9), 2), ((2, 1, 7, 40), None), ((1, 2, 4, 4), 0)])
def test_plan_blocks_keep_margin_matches_twin(case, max_fetch, keep_margin):
    """With a residents' bonus (hysteresis) the kernel still returns the twin's plan and table through a chain of
    plans from an empty table: the same rounding of ``score * (1 + margin)`` (0.3: not exact in float32), ties
    among boosted residents and non-residents, forced and unchoosable blocks, caps."""
    batch, heads, num_slots, num_blocks = case
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    gen = torch.Generator().manual_seed(sum(case) + 11)
    tables = [torch.full((batch, heads, num_slots + 1), -1, dtype=torch.long, device=dev),
              torch.full((batch, heads, num_slots + 1), -float("inf"), device=dev),
              torch.full((batch, heads, num_blocks + 1), -1, dtype=torch.long, device=dev)]
    moved = {0.0: 0, keep_margin: 0}
    for step in range(5):
        live = min(num_blocks, max(2, num_blocks - 3 + step))
        scores = _plan_scores(gen, batch, heads, num_blocks, live, step).to(dev)
        copies = [t.clone() for t in tables]
        plain = [t.clone() for t in tables]
        out_k = plan_blocks(scores, *copies, max_fetch, keep_margin=keep_margin)
        out_r = plan_blocks_ref(scores, *tables, max_fetch, keep_margin=keep_margin)
        for name, k, r in zip(("blocks", "slots", "valid"), out_k, out_r, strict=True):
            assert torch.equal(k, r), f"step {step}: {name} differs\n{k}\n{r}"
        for name, k, r in zip(("slot_block", "slot_score", "block_slot"), copies, tables, strict=True):
            assert torch.equal(k[..., :-1], r[..., :-1]), f"step {step}: {name} differs"
        moved[keep_margin] += int(out_r[2].sum())
        moved[0.0] += int(plan_blocks_ref(scores, *plain, max_fetch)[2].sum())
    assert moved[keep_margin] <= moved[0.0]  # from the same tables each step, a bonus never fetches more


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_keep_margin_keeps_near_ties_resident(backend):
    """A block that is not resident replaces a resident one only when it scores more than ``1 + keep_margin``
    times it; the slots keep the blocks' own scores, not the boosted ones."""
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() and not INTERPRET else "cpu"
    plan = plan_blocks if backend == "triton" else plan_blocks_ref
    inf = float("inf")

    def run(margin):
        tables = [torch.full((1, 1, 4), -1, dtype=torch.long, device=dev),
                  torch.full((1, 1, 4), -inf, device=dev),
                  torch.full((1, 1, 7), -1, dtype=torch.long, device=dev)]
        fetched = []
        for row in ([inf, 0.5, 0.4, 0.1, 0.1, 0.1],  # blocks 0, 1, 2 resident
                    [inf, 0.5, 0.4, 0.45, 0.1, 0.1],  # 3 beats 2, but not by 1.25x
                    [inf, 0.5, 0.4, 0.55, 0.1, 0.1]):  # 3 beats 2 by more than 1.25x
            _, _, valid = plan(torch.tensor([[row]], device=dev), *tables, None, keep_margin=margin)
            fetched.append(int(valid.sum()))
        return fetched, sorted(tables[0][0, 0, :3].tolist()), tables[1][0, 0, :3].tolist()

    assert run(0.0)[:2] == ([3, 1, 0], [0, 1, 3])
    fetched, resident, slot_scores = run(0.25)
    assert (fetched, resident) == ([3, 0, 1], [0, 1, 3])
    assert sorted(slot_scores) == pytest.approx([0.5, 0.55, inf])  # the scores themselves, not 1.25x


@pytest.mark.parametrize("margin", [-0.1, float("inf"), float("nan")])
def test_keep_margin_rejects_what_is_not_a_bonus(margin):
    tables = [torch.full((1, 1, 3), -1, dtype=torch.long), torch.zeros(1, 1, 3), torch.full((1, 1, 5), -1)]
    with pytest.raises(ValueError, match="keep_margin"):
        plan_blocks_ref(torch.zeros(1, 1, 4), *tables, None, keep_margin=margin)
    if TRITON_AVAILABLE:
        with pytest.raises(ValueError, match="keep_margin"):
            plan_blocks(torch.zeros(1, 1, 4), *tables, None, keep_margin=margin)
    with pytest.raises(ValueError, match="keep_margin"):
        OasisConfig(keep_margin=margin)


@needs_triton
@pytest.mark.parametrize("spread", ["last-byte", "negative", "all-equal", "extremes"])
def test_plan_blocks_threshold_select_on_close_scores(spread):
    """The kernel's select of the S-th best score works on the integer form of the scores: scores that differ only
    in their lowest bits (adjacent floats), negative ones, a row of equal scores (every block ties) and scores at
    the ends of the float range (+-max, +-denormals, +-0, -inf) give the twin's plan and table, and every chosen
    block scores at least the S-th best."""
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    gen = torch.Generator().manual_seed(len(spread))
    batch, heads, num_slots, num_blocks = 1, 3, 6, 70
    ulp = torch.randint(0, 40, (batch, heads, num_blocks), generator=gen, dtype=torch.int32)
    if spread == "last-byte":
        scores = (torch.ones(batch, heads, num_blocks).view(torch.int32) + ulp).view(torch.float32)
    elif spread == "negative":
        scores = -(torch.full((batch, heads, num_blocks), 3.0).view(torch.int32) + ulp * 3).view(torch.float32)
    elif spread == "extremes":
        big, tiny = torch.finfo(torch.float32).max, 1e-45  # the largest float and the smallest denormal
        values = torch.tensor([big, big, -big, tiny, -tiny, 0.0, -0.0, -float("inf")])
        scores = values[torch.randint(0, len(values), (batch, heads, num_blocks), generator=gen)]
        # one head without +max: its S-th best lies among the smallest values
        scores[:, 1] = torch.where(scores[:, 1] == big, -big, scores[:, 1])
    else:
        scores = torch.full((batch, heads, num_blocks), 0.25)
    scores[..., 0] = float("inf")
    tables = [torch.full((batch, heads, num_slots + 1), -1, dtype=torch.long, device=dev),
              torch.full((batch, heads, num_slots + 1), -float("inf"), device=dev),
              torch.full((batch, heads, num_blocks + 1), -1, dtype=torch.long, device=dev)]
    copies = [t.clone() for t in tables]
    out_k = plan_blocks(scores.to(dev), *copies, 3)
    out_r = plan_blocks_ref(scores.to(dev), *tables, 3)
    for name, k, r in zip(("blocks", "slots", "valid"), out_k, out_r, strict=True):
        assert torch.equal(k, r), f"{name} differs\n{k}\n{r}"
    for k, r in zip(copies, tables, strict=True):
        assert torch.equal(k[..., :-1], r[..., :-1])
    wanted = scores.topk(num_slots, dim=-1).values[..., -1]  # the S-th best score of each head
    chosen = scores.to(dev).gather(-1, copies[0][..., :num_slots].clamp(min=0)).cpu()
    assert bool((chosen >= wanted[..., None]).all())


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
@pytest.mark.parametrize(("max_programs", "rows"), [(None, 6), (1, 6), (3, 6), (3, 1), (5, 2)],
                         ids=["all-6-rows", "1-program", "3-programs", "3-programs-1-row", "5-programs-2-rows"])
def test_gather_blocks_kernel_matches_twin(max_programs, rows):
    """A plan (blocks, slots, valid) of a segment that starts at block 3: entries invalid or outside the segment
    leave the pool untouched; K and V land in the planned slots. With fewer (sequence, head) rows than programs,
    several programs share a row."""
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    batch, heads = (2, 3) if rows == 6 else (1, rows)
    src_k, src_v, (k1, v1, k2, v2), blocks, slots, valid = _gather_case(dev, (max_programs or 0) + rows, batch=batch,
                                                                       heads=heads, slots=9 if rows < 6 else 5)
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
    rank N, X first and miss M; ``mean+minmax`` averages the two softmax shares and keeps N and M. (Two empty
    blocks, then the recent block the view ends in, which the rules force.)"""
    from oasis_hf.cache.summaries import BlockSummaries

    dev = "cuda" if backend == "triton" and torch.cuda.is_available() and not INTERPRET else "cpu"
    ch0 = torch.tensor([[10.0, -3, -3, -3], [2, 2, 2, 2], [6, -6, 6, -6], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0],
                        [0, 0, 0, 0]])
    keys = torch.zeros(1, 1, 7, 4, 16)
    keys[..., 0] = ch0
    keys[..., 1] = 0.5 * torch.tensor([1.0, -1, 1, -1])  # the same in every block: no score difference
    query = torch.zeros(1, 2, 1, 16, device=dev)
    query[..., 0] = 1.0
    fn = score_blocks if backend == "triton" else score_blocks_ref
    top2 = {}
    for kind in KINDS:
        summaries = BlockSummaries(kind, 1, 1, 7, 16, torch.float32, dev, 4)
        summaries.write(keys.view(1, 1, 28, 16).to(dev), torch.zeros(1, dtype=torch.long, device=dev), 0, backend)
        scores = fn(query, summaries.data, None, None, torch.zeros(1, dtype=torch.long, device=dev),
                    torch.tensor(27, device=dev), 1.0, kind=kind, source="summaries", num_tokens=1, block_size=4,
                    sink_blocks=0, recent_blocks=1)[0, 0]
        assert scores[6] == float("inf") and bool(torch.isfinite(scores[:6]).all())
        assert 1.0 < float(scores[:6].sum()) < 2.0  # 2 query heads' shares, less the forced block's
        top2[kind] = {"NMXY"[i] if i < 4 else "F" for i in scores[:6].topk(2).indices.tolist()}
    assert top2 == {"mean": {"M", "Y"}, "minmax": {"N", "X"}, "mean+minmax": {"N", "M"}}


def test_block_summaries_store_what_each_kind_names():
    """``mean+minmax`` stores lo, hi and the mean key (3 tensors) of the real, written tokens of each block (left
    padding and the partial last block's tail excluded); a block of padding only has zero summaries."""
    from oasis_hf.cache.summaries import BlockSummaries

    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 3, 33, 8, generator=gen)  # 9 blocks of 4, the last one holding one token
    kv_start = torch.tensor([5, 0])
    both = BlockSummaries("mean+minmax", 2, 3, 9, 8, torch.float32, "cpu", 4)
    both.write(keys, kv_start)
    assert both.data.shape[0] == 3 and both.nbytes == 3 * 2 * 3 * 9 * 8 * 4
    low, high, mean = both.data
    pos = torch.arange(36).view(1, 1, 9, 4)
    ok = ((pos < 33) & (pos >= kv_start.view(-1, 1, 1, 1)))[..., None]
    blocks = torch.nn.functional.pad(keys, (0, 0, 0, 3)).view(2, 3, 9, 4, 8)
    torch.testing.assert_close(mean, torch.where(ok, blocks, 0.0).sum(3) / ok.sum(3).clamp(min=1))
    torch.testing.assert_close(low, torch.where(ok.any(3), torch.where(ok, blocks, float("inf")).amin(3), 0.0))
    torch.testing.assert_close(high, torch.where(ok.any(3), torch.where(ok, blocks, float("-inf")).amax(3), 0.0))
    assert not bool(mean[0, :, 0].any()) and not bool(low[0, :, 0].any()) and bool(mean[1, :, 0].all())


def test_quantized_block_summaries_keep_codes_and_count_their_bytes():
    """``quantized``: the bounds and mean key in `data`, codes beside them written with them, grown and zeroed with
    them, counted in `nbytes` as `summary_key_vectors` says; a head dim that does not pack into bytes is refused."""
    from oasis_hf.cache.summaries import BlockSummaries
    from oasis_hf.kernels.ref import quantize_blocks, summarize_blocks, summary_key_vectors

    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 3, 5, 16, 8, generator=gen).to(torch.bfloat16)
    token_ok = torch.ones(2, 1, 5, 16, dtype=torch.bool)
    summaries = BlockSummaries("quantized", 2, 3, 5, 8, torch.bfloat16, "cpu", 16)
    summaries.write(keys.view(2, 3, 80, 8), torch.zeros(2, dtype=torch.long))
    bounds = summarize_blocks("quantized", keys, token_ok)
    assert torch.equal(summaries.data, bounds) and torch.equal(summaries.codes, quantize_blocks(keys, token_ok, bounds))
    per_block = summary_key_vectors("quantized", 16) * 8 * 2  # key vectors x D x bf16 bytes
    assert summaries.nbytes == 2 * 3 * 5 * per_block == 2 * 3 * 5 * (3 * 8 * 2 + 16 * 2)
    assert summary_key_vectors("mean+minmax", 16) == 3 and summary_key_vectors("quantized", 32) == 7  # 7/32 of keys
    summaries.grow(7)
    assert summaries.codes.shape == (2, 3, 7, 16, 2) and not bool(summaries.codes[:, :, 5:].any())
    assert torch.equal(summaries.codes[:, :, :5], quantize_blocks(keys, token_ok, bounds))
    summaries.zero_()
    assert not bool(summaries.codes.any()) and not bool(summaries.data.any())
    assert BlockSummaries("mean", 1, 1, 4, 8, torch.float32, "cpu", 16).codes is None
    with pytest.raises(ValueError, match="head_dim 6 is not a multiple of 4"):
        BlockSummaries("quantized", 1, 1, 4, 6, torch.float32, "cpu", 16)


def test_block_summaries_refuse_an_unknown_kind():
    from oasis_hf.cache.summaries import BlockSummaries
    from oasis_hf.config import SUMMARY_KINDS
    from oasis_hf.kernels import SUMMARY_LAYOUT

    assert set(SUMMARY_KINDS) == set(SUMMARY_LAYOUT)  # what OasisConfig accepts is what BlockSummaries stores
    with pytest.raises(ValueError, match="unknown block summary 'median'.*mean\\+minmax"):
        BlockSummaries("median", 1, 1, 4, 8, torch.float32, "cpu", 4)


# (B, H_kv, S, BS, D, T, offset into the block of the first new token): one token mid-block and at a block start, a
# verification forward crossing into a new block, one spanning three blocks, odd head dims
APPEND_CASES = [(2, 3, 6, 16, 16, 1, 7), (1, 2, 5, 16, 80, 1, 0), (3, 1, 7, 32, 64, 5, 30), (2, 2, 9, 16, 32, 17, 15)]


def _append_case(case, kind, dtype, device, seed):
    """A partly filled table (some slots empty, one resident block scored +inf, one -inf), the blocks before the
    new tokens' first resident, new K/V as the transposed view a model's projections give."""
    from oasis_hf.kernels.ref import SUMMARY_LAYOUT

    b, h, s, bs, d, t, offset = case
    gen = torch.Generator().manual_seed(seed)
    start = 6 * bs + offset
    cap = -(-(start + t) // bs) + 3
    slot_block = torch.full((b, h, s + 1), -1, dtype=torch.long)
    slot_score = torch.full((b, h, s + 1), -float("inf"))
    block_slot = torch.full((b, h, cap + 1), -1, dtype=torch.long)
    for i in range(b):
        for j in range(h):
            held = torch.randperm(6, generator=gen)[: s - 2].tolist()
            if offset and 6 not in held:
                held[-1] = 6  # the block the new tokens continue is resident
            slots = torch.randperm(s, generator=gen)[: len(held)]
            for blk, slot in zip(held, slots.tolist(), strict=True):
                slot_block[i, j, slot], block_slot[i, j, blk] = blk, slot
                slot_score[i, j, slot] = float(torch.rand((), generator=gen))
            slot_score[i, j, slots[0]] = float("inf")
            slot_score[i, j, slots[1]] = -float("inf")
    pools = [torch.randn(b, h, s, bs, d, generator=gen).to(dtype) for _ in range(2)]
    kv = [torch.randn(b, t, h, d, generator=gen).to(dtype).transpose(1, 2) for _ in range(2)]
    summaries = torch.randn(len(SUMMARY_LAYOUT[kind]), b, h, cap, d, generator=gen).to(dtype)
    kv_start = torch.randint(0, 2 * bs, (b,), generator=gen)
    tensors = [kv[0], kv[1], torch.tensor(start), *pools, slot_block, slot_score, block_slot, summaries, kv_start]
    return [x.to(device) for x in tensors]


@needs_triton
@pytest.mark.parametrize("evict_oldest", [False, True], ids=["by-score", "oldest"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", APPEND_CASES, ids=str)
def test_append_tokens_kernel_matches_twin(case, kind, dtype, evict_oldest):
    """Slot allocation, table entries and pool rows identical to the twin; summaries to rounding; with and without
    pinned sinks and a long recent window; evicting by score or by age."""
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    for seed, (sinks, recent) in enumerate([(1, 2), (0, 1), (2, 5)]):
        args_k = _append_case(case, kind, dtype, dev, seed)
        args_r = [x.clone() for x in args_k]
        append_tokens(*args_k, kind=kind, sink_blocks=sinks, recent_blocks=recent, evict_oldest=evict_oldest)
        append_tokens_ref(*args_r, kind=kind, sink_blocks=sinks, recent_blocks=recent, evict_oldest=evict_oldest)
        for name, k, r in zip(("pool_k", "pool_v", "slot_block", "slot_score", "block_slot"), args_k[3:8],
                              args_r[3:8], strict=True):
            trash = name in ("slot_block", "slot_score", "block_slot")  # masked twin writes land in the last column
            assert torch.equal(k[..., :-1] if trash else k, r[..., :-1] if trash else r), f"{name} (seed {seed})"
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(args_k[8], args_r[8], atol=tol, rtol=tol)
        start, t, bs = int(args_k[2]), case[5], case[3]
        new_blocks = range(start // bs, (start + t - 1) // bs + 1)
        for blk in new_blocks:  # every touched block is resident and holds the new tokens
            assert bool((args_r[5][..., : case[2]] == blk).any(-1).all())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", APPEND_CASES, ids=str)
def test_append_tokens_kernel_matches_twin_quantized(case, dtype):
    """A ``quantized`` summary: the bounds to rounding as for ``minmax``, and every key code of the touched blocks
    identical to the twin's (the codes come from the bounds as stored, so both sides quantize alike)."""
    from oasis_hf.kernels.ref import CODES_PER_BYTE

    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    b, h, _, bs, d, t, _ = case
    for seed, (sinks, recent) in enumerate([(1, 2), (0, 1)]):
        args_k = _append_case(case, "quantized", dtype, dev, seed)
        args_r = [x.clone() for x in args_k]
        cap = args_k[8].shape[3]
        gen = torch.Generator().manual_seed(seed)
        codes_k = torch.randint(0, 256, (b, h, cap, bs, d // CODES_PER_BYTE), generator=gen, dtype=torch.uint8).to(dev)
        codes_r, before = codes_k.clone(), codes_k.clone()
        append_tokens(*args_k, kind="quantized", sink_blocks=sinks, recent_blocks=recent, codes=codes_k)
        append_tokens_ref(*args_r, kind="quantized", sink_blocks=sinks, recent_blocks=recent, codes=codes_r)
        assert torch.equal(args_k[3], args_r[3]) and torch.equal(args_k[7][..., :-1], args_r[7][..., :-1])
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(args_k[8], args_r[8], atol=tol, rtol=tol)
        start = int(args_k[2])
        touched = list(range(start // bs, (start + t - 1) // bs + 1))
        assert torch.equal(codes_k, codes_r), f"seed {seed}"
        untouched = [i for i in range(cap) if i not in touched]
        assert torch.equal(codes_k[:, :, untouched], before[:, :, untouched])  # only the touched blocks re-quantize
        assert not torch.equal(codes_k[:, :, touched], before[:, :, touched])
    with pytest.raises(ValueError, match="quantized.*codes"):
        append_tokens(*args_k, kind="quantized", sink_blocks=1, recent_blocks=2)


def _attention_append_case(case, kind, dtype, device, seed, group=3):
    """`_append_case`'s state plus the step's queries (B, H_kv * group, T, D) and its `AppendState`."""
    from oasis_hf.kernels.ref import AppendState

    key, value, start, pool_k, pool_v, slot_block, slot_score, block_slot, summaries, kv_start = _append_case(
        case, kind, dtype, device, seed)
    b, h, t, d = key.shape
    gen = torch.Generator().manual_seed(100 + seed)
    query = torch.randn(b, h * group, t, d, generator=gen).mul_(0.5).to(dtype).to(device)
    state = AppendState(slot_score, block_slot, summaries, kind, sink_blocks=1, recent_blocks=2,
                        evict_oldest=seed % 2 == 1)
    return query, key, value, start, pool_k, pool_v, slot_block, kv_start, state


def _clone_state(state):
    from dataclasses import replace

    return replace(state, slot_score=state.slot_score.clone(), block_slot=state.block_slot.clone(),
                   summaries=state.summaries.clone(), codes=None if state.codes is None else state.codes.clone())


def _poison_new_rows(pool, slot_block, start, num_tokens):
    """NaN in the pool rows the new tokens will occupy in blocks already resident: a read of them shows."""
    bs = pool.shape[3]
    num_slots = slot_block.shape[-1] - 1
    for pos in range(int(start), int(start) + num_tokens):
        held = slot_block[..., :num_slots] == pos // bs  # (B, H_kv, S)
        pool[..., pos % bs, :][held] = float("nan")


@pytest.mark.parametrize("case", APPEND_CASES, ids=str)
def test_sparse_attention_twin_reads_the_new_tokens_from_its_arguments(case):
    """Given `new_key` / `new_value`, the pool is read below the new tokens only (its rows at their positions hold
    NaN here): with empty slots for the new blocks (no eviction), that equals appending first and attending the
    pool. With `append=`, the twin leaves the same pool, table and summaries as `append_tokens_ref` alone."""
    query, key, value, start, pool_k, pool_v, slot_block, kv_start, state = _attention_append_case(
        case, "mean", torch.float32, "cpu", seed=0)
    seq_len, scale = start + key.shape[2], query.shape[-1] ** -0.5
    num_slots = slot_block.shape[-1] - 1
    state.slot_score[state.slot_score == -float("inf")] = 0.5  # no resident block as cheap as an empty slot
    appended = [x.clone() for x in (pool_k, pool_v, slot_block)]
    after = _clone_state(state)
    append_tokens_ref(key, value, start, *appended, after.slot_score, after.block_slot, after.summaries, kv_start,
                      kind="mean", sink_blocks=1, recent_blocks=2)
    held = slot_block[..., :num_slots]
    assert ((held < 0) | (held == appended[2][..., :num_slots])).all()  # nothing was evicted
    expected = sparse_attention_ref(query, *appended, seq_len, kv_start, scale)
    for pool in (pool_k, pool_v):
        _poison_new_rows(pool, slot_block, start, key.shape[2])
    got = sparse_attention_ref(query, pool_k, pool_v, slot_block, seq_len, kv_start, scale, new_key=key,
                               new_value=value)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    mine = _clone_state(state)
    fused = [x.clone() for x in (pool_k, pool_v, slot_block)]
    again = sparse_attention_ref(query, *fused, seq_len, kv_start, scale, new_key=key, new_value=value, append=mine)
    torch.testing.assert_close(again, expected, atol=1e-5, rtol=1e-5)
    for name, x, y in zip(("pool_k", "pool_v", "slot_block", "slot_score", "block_slot", "summaries"),
                          fused + [mine.slot_score, mine.block_slot, mine.summaries],
                          appended + [after.slot_score, after.block_slot, after.summaries], strict=True):
        assert torch.equal(x, y), name


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["mean+minmax", "quantized"])
@pytest.mark.parametrize("case", APPEND_CASES, ids=str)
def test_sparse_attention_kernel_with_new_tokens_and_append_matches_twin(case, kind, dtype):
    """The new tokens read from the arguments (the pool's rows for them are NaN) and, with `append=`, the append in
    the merge launch: output to the attention tolerance, pool / table identical, summaries to rounding, evicting by
    score (seed 0) and by age (seed 1). Without `append=` nothing is written."""
    from oasis_hf.kernels.ref import CODES_PER_BYTE

    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    for seed in (0, 1):
        query, key, value, start, pool_k, pool_v, slot_block, kv_start, state = _attention_append_case(
            case, kind, dtype, dev, seed)
        if kind == "quantized":
            b, h, _, bs, d = pool_k.shape
            codes = torch.randint(0, 256, (b, h, state.summaries.shape[3], bs, d // CODES_PER_BYTE),
                                  dtype=torch.uint8).to(dev)
            state = replace_codes(state, codes)
        for pool in (pool_k, pool_v):
            _poison_new_rows(pool, slot_block, start, key.shape[2])
        seq_len, scale = start + key.shape[2], query.shape[-1] ** -0.5
        before = [x.clone() for x in (pool_k, pool_v, slot_block)]
        plain = sparse_attention(query, pool_k, pool_v, slot_block, seq_len, kv_start, scale, new_key=key,
                                 new_value=value)
        for x, y in zip((pool_k, pool_v, slot_block), before, strict=True):
            assert torch.equal(x.nan_to_num(), y.nan_to_num())
        mine, theirs = state, _clone_state(state)
        twin_tensors = [x.clone() for x in (pool_k, pool_v, slot_block)]
        out = sparse_attention(query, pool_k, pool_v, slot_block, seq_len, kv_start, scale, new_key=key,
                               new_value=value, append=mine)
        ref = sparse_attention_ref(query, *twin_tensors, seq_len, kv_start, scale, new_key=key, new_value=value,
                                   append=theirs)
        exact = sparse_attention_ref(query.float(), *[x.float() for x in before[:2]], before[2], seq_len, kv_start,
                                     scale, new_key=key.float(), new_value=value.float())
        err = (out.float() - exact).abs().max().item()
        ref_err = (ref.float() - exact).abs().max().item()
        assert out.isfinite().all() and err <= 2 * ref_err + TOL[dtype], (err, ref_err, seed)
        assert (plain.float() - out.float()).abs().max().item() == 0.0  # the append does not change the output
        for name, x, y in zip(("pool_k", "pool_v", "slot_block", "slot_score", "block_slot"),
                              (pool_k, pool_v, slot_block, mine.slot_score, mine.block_slot),
                              (*twin_tensors, theirs.slot_score, theirs.block_slot), strict=True):
            trash = name in ("slot_block", "slot_score", "block_slot")  # masked twin writes land in the last column
            x, y = (x[..., :-1], y[..., :-1]) if trash else (x.nan_to_num(), y.nan_to_num())
            assert torch.equal(x, y), f"{name} (seed {seed})"
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(mine.summaries, theirs.summaries, atol=tol, rtol=tol)
        if kind == "quantized":
            assert torch.equal(mine.codes, theirs.codes)


def replace_codes(state, codes):
    from dataclasses import replace

    return replace(state, codes=codes)


def test_sparse_attention_refuses_half_the_new_tokens_or_an_append_without_them():
    query, key, value, start, pool_k, pool_v, slot_block, kv_start, state = _attention_append_case(
        APPEND_CASES[0], "mean", torch.float32, "cpu", seed=0)
    args = (query, pool_k, pool_v, slot_block, start + 1, kv_start, 0.25)
    for attend in (sparse_attention, sparse_attention_ref):
        with pytest.raises(ValueError, match="new_key and new_value together"):
            attend(*args, new_key=key)
        with pytest.raises(ValueError, match="append= needs the new tokens"):
            attend(*args, append=state)
        with pytest.raises(ValueError, match=r"not \(B, H_kv, T, D\)"):
            attend(*args, new_key=key[:, :1], new_value=value[:, :1])


def test_quantized_codes_round_trip_and_pack_four_channels_per_byte():
    """`quantize_blocks` / `dequantize_blocks`: a key on its block's 4-level grid comes back exactly; any key within
    (hi - lo) / 6 of itself; channel d sits in byte d // 4 at bit 2 * (d % 4); unreal tokens and flat channels
    code 0."""
    from oasis_hf.kernels.ref import dequantize_blocks, quantize_blocks, summarize_blocks

    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3, 5, 16, 8, generator=gen)
    keys[..., 7] = 0.25  # a flat channel
    token_ok = torch.rand(2, 1, 5, 16, generator=gen) > 0.2
    token_ok[..., 0] = True
    bounds = summarize_blocks("quantized", keys, token_ok)
    codes = quantize_blocks(keys, token_ok, bounds)
    assert codes.shape == (2, 3, 5, 16, 2) and codes.dtype == torch.uint8
    back = dequantize_blocks(codes, bounds)
    width = (bounds[1] - bounds[0])[..., None, :]
    real = token_ok[..., None].expand_as(keys)
    assert bool(((back - keys).abs() <= width / 6 + 1e-6)[real].all())
    grid = bounds[0][..., None, :] + torch.randint(0, 4, keys.shape, generator=gen) * width / 3
    grid = torch.where(real, grid, bounds[0][..., None, :])
    again = quantize_blocks(grid, token_ok, bounds)
    torch.testing.assert_close(dequantize_blocks(again, bounds), grid, atol=1e-6, rtol=0)
    one = torch.zeros(1, 1, 1, 1, 8)
    one[..., 5] = 1.0  # channel 5 at the top of [0, 1]: code 3 in byte 1, bits 2-3
    lohi = torch.stack([torch.zeros(1, 1, 1, 8), torch.ones(1, 1, 1, 8)])
    assert quantize_blocks(one, torch.ones(1, 1, 1, 1, dtype=torch.bool), lohi).flatten().tolist() == [0, 3 << 2]
    assert not bool(quantize_blocks(keys, torch.zeros_like(token_ok), bounds).any())


def test_append_tokens_twin_writes_what_a_dense_cache_holds():
    """The twin against the plain meaning: after the call, every new token's K/V sits in its block's slot, the
    touched blocks' mean summaries equal the mean of their real tokens, and the evicted blocks were neither sinks,
    recent nor touched."""
    case = (2, 2, 6, 16, 8, 5, 14)
    args = _append_case(case, "mean", torch.float32, "cpu", 4)
    key, value, start, pool_k, pool_v, slot_block, slot_score, block_slot, summaries, kv_start = args
    before = slot_block.clone()
    append_tokens_ref(*args, kind="mean", sink_blocks=1, recent_blocks=2)
    bs, start = case[3], int(start)
    for b in range(case[0]):
        first_real = int(kv_start[b]) // bs
        for h in range(case[1]):
            for t in range(case[5]):
                pos = start + t
                slot = int(block_slot[b, h, pos // bs])
                assert torch.equal(pool_k[b, h, slot, pos % bs], key[b, h, t])
                assert torch.equal(pool_v[b, h, slot, pos % bs], value[b, h, t])
            gone = set(before[b, h, :-1].tolist()) - set(slot_block[b, h, :-1].tolist()) - {-1}
            assert not gone & {first_real, start // bs - 1, start // bs}, gone
            blk = (start + case[5] - 1) // bs
            slot = int(block_slot[b, h, blk])
            rows = torch.arange(bs) + blk * bs
            real = (rows < start + case[5]) & (rows >= int(kv_start[b]))
            torch.testing.assert_close(summaries[0, b, h, blk], pool_k[b, h, slot][real].mean(0))


@pytest.mark.parametrize("num_tokens", [1, 17])
def test_append_tokens_evict_oldest_keeps_the_sinks_and_the_latest_blocks(num_tokens):
    """``evict_oldest`` (the ``static`` selector): whatever the scores say, the new blocks take the slots of the
    oldest unpinned blocks, so a full pool of sinks plus the latest blocks stays exactly that; by score, the
    lowest-scored blocks go instead."""
    bs, d, slots = 16, 8, 5
    held = [0, 2, 3, 4, 5]  # sink 0, then the latest blocks before the new tokens' block 6
    start = 6 * bs
    gen = torch.Generator().manual_seed(3)
    for evict_oldest in (False, True):
        slot_block = torch.full((1, 2, slots + 1), -1, dtype=torch.long)
        block_slot = torch.full((1, 2, 10), -1, dtype=torch.long)
        order = torch.randperm(slots, generator=gen)
        for blk, slot in zip(held, order.tolist(), strict=True):
            slot_block[..., slot], block_slot[..., blk] = blk, slot
        slot_score = torch.full((1, 2, slots + 1), -float("inf"))
        slot_score[..., :slots] = torch.tensor([5.0, 9.0, 1.0, 2.0, 3.0])[order.argsort()]  # block 2 scores highest
        pool = torch.zeros(1, 2, slots, bs, d)
        tokens = torch.randn(1, 2, num_tokens, d, generator=gen)
        append_tokens_ref(tokens, tokens, torch.tensor(start), pool, pool.clone(), slot_block, slot_score,
                          block_slot, torch.zeros(1, 1, 2, 9, d), torch.zeros(1, dtype=torch.long), kind="mean",
                          sink_blocks=1, recent_blocks=1, evict_oldest=evict_oldest)
        new = list(range(6, (start + num_tokens - 1) // bs + 1))
        gone = ([2, 3] if evict_oldest else [3, 4])[: len(new)]  # oldest first; else lowest score (1.0, 2.0) first
        expected = [blk for blk in held if blk not in gone] + new
        for h in range(2):
            assert sorted(slot_block[0, h, :slots].tolist()) == sorted(expected), (evict_oldest, h)


@needs_triton
@pytest.mark.parametrize("case", [(2, 3, 5, 16, 16, 0, 20), (1, 2, 3, 32, 80, 2, 64), (2, 1, 17, 16, 32, 1, 3)],
                         ids=str)
def test_write_tokens_kernel_matches_twin(case):
    """(B, H, T, BS, D, segment's first block, start): rows inside the segment land at their positions, rows
    before or past it are skipped (a write that straddles two segments)."""
    b, h, t, bs, d, first_block, start = case
    dev = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    gen = torch.Generator().manual_seed(sum(case))
    key = torch.randn(b, t, h, d, generator=gen).transpose(1, 2).to(dev)
    value = torch.randn(b, h, t, d, generator=gen).to(dev)
    segment = [torch.full((b, h, 3, bs, d), float("nan")).to(dev) for _ in range(4)]
    start_t = torch.tensor(start, device=dev)
    write_tokens(key, value, start_t, segment[0], segment[1], first_block)
    write_tokens_ref(key, value, start_t, segment[2], segment[3], first_block)
    torch.testing.assert_close(segment[0], segment[2], equal_nan=True)
    torch.testing.assert_close(segment[1], segment[3], equal_nan=True)
    local = start - first_block * bs
    written = [t_ for t_ in range(t) if 0 <= local + t_ < 3 * bs]
    assert written, "the case must write some rows"
    flat = segment[0].view(b, h, 3 * bs, d)
    assert torch.equal(flat[:, :, local + written[0]], key[:, :, written[0]])
    assert int(torch.isnan(flat[..., 0]).sum()) == b * h * (3 * bs - len(written))


@pytest.mark.gpu
def test_append_and_write_tokens_gpu_large():
    """Llama-8B's decode shape (batch 8, 8 KV heads, budget 2048 in blocks of 32, head dim 128, bf16) for one token
    and a 5-token verification forward, every summary kind (a ``quantized`` one's codes exactly); the write-back into
    a pinned host segment."""
    for kind in (*KINDS, "quantized"):
        for case in [(8, 8, 64, 32, 128, 1, 31), (8, 8, 64, 32, 128, 5, 30)]:
            args_k = _append_case(case, kind, torch.bfloat16, "cuda", 0)
            args_r = [x.clone() for x in args_k]
            codes = {}
            if kind == "quantized":
                codes = {"codes": torch.zeros(8, 8, args_k[8].shape[3], 32, 32, dtype=torch.uint8, device="cuda")}
            codes_r = {name: c.clone() for name, c in codes.items()}
            append_tokens(*args_k, kind=kind, sink_blocks=1, recent_blocks=5, **codes)
            append_tokens_ref(*args_r, kind=kind, sink_blocks=1, recent_blocks=5, **codes_r)
            assert all(torch.equal(codes[name], codes_r[name]) for name in codes)
            assert torch.equal(args_k[3], args_r[3]) and torch.equal(args_k[4], args_r[4])
            for k, r in zip(args_k[5:8], args_r[5:8], strict=True):
                assert torch.equal(k[..., :-1], r[..., :-1])  # tables without the trash column
            torch.testing.assert_close(args_k[8], args_r[8], atol=1e-2, rtol=1e-2)
    key = torch.randn(8, 1, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    host = [torch.zeros(8, 8, 40, 32, 128, dtype=torch.bfloat16).pin_memory() for _ in range(2)]
    write_tokens(key, key, torch.tensor(100, device="cuda"), host[0], host[1], 1)
    torch.cuda.synchronize()
    assert torch.equal(host[0].view(8, 8, -1, 128)[:, :, 100 - 32], key[:, :, 0].cpu())
    with pytest.raises(ValueError, match="pageable"):
        write_tokens(key, key, torch.tensor(0, device="cuda"), host[0].clone(), host[1].clone(), 0)


@pytest.mark.gpu
def test_plan_blocks_kernel_scales_to_long_tables():
    """128k and 512k tokens in blocks of 32 (4,097 and 16,385 blocks): the kernel's threshold select gives the
    twin's plan and table."""
    for num_blocks in (4097, 16385):
        gen = torch.Generator().manual_seed(num_blocks)
        scores = _plan_scores(gen, 1, 8, num_blocks, num_blocks - 2, 1).cuda()
        tables = [torch.full((1, 8, 65), -1, dtype=torch.long, device="cuda"),
                  torch.full((1, 8, 65), -float("inf"), device="cuda"),
                  torch.full((1, 8, num_blocks + 1), -1, dtype=torch.long, device="cuda")]
        copies = [t.clone() for t in tables]
        if num_blocks > 16384:
            with pytest.raises(ValueError, match="exceed"):
                plan_blocks(scores, *copies, 16)
            continue
        out_k = plan_blocks(scores, *copies, 16)
        out_r = plan_blocks_ref(scores, *tables, 16)
        for k, r in zip(out_k, out_r, strict=True):
            assert torch.equal(k, r)
        for k, r in zip(copies, tables, strict=True):
            assert torch.equal(k[..., :-1], r[..., :-1])  # the twin's masked writes land in the trash column


def test_backend_choice_traces_into_one_graph(monkeypatch):
    """`use_triton` logs its choice once per (backend, device), but not while torch.compile traces: a log call
    there broke the graph, and a model compiled before any eager call (the dense baseline's compiled row when it
    ran first) compiled its attention once per layer and again in later calls."""
    from oasis_hf.kernels import backend

    monkeypatch.setattr(backend, "_logged", set())  # nothing logged yet in this process
    fn = torch.compile(lambda x: x * 2 if backend.use_triton(x, "auto") else x + 1, fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(torch.full((3,), 3.0)), torch.full((3,), 4.0))  # CPU: the twin; a break raises
    assert backend._logged == set()  # the traced call logged nothing; the next eager call logs
    backend.use_triton(torch.ones(3), "auto")
    assert backend._logged == {"auto:cpu:False"}
