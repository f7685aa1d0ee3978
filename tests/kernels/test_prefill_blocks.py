"""`summarize_keys` and `fill_pool` (a prompt's blocks after the prefill's attention) against their twins, and the
twins against the math they replace (padded blocks, `summarize_blocks` / `quantize_blocks`, a gather per slot)."""

import pytest
import torch

from oasis_hf.kernels import INTERPRET, TRITON_AVAILABLE, fill_pool, fill_pool_ref, summarize_keys, summarize_keys_ref
from oasis_hf.kernels.ref import CODES_PER_BYTE, SUMMARY_LAYOUT, quantize_blocks, summarize_blocks

needs_triton = pytest.mark.skipif(
    not (TRITON_AVAILABLE and (INTERPRET or torch.cuda.is_available())),
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (set by .ci/run)",
)
DEV = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
KINDS = list(SUMMARY_LAYOUT)

# (B, H_kv, L, D, BS, first block): a partial last block, one token in it, whole blocks only, odd head dims, a
# chunk's first touched block past 0, a single block
CASES = [(2, 3, 75, 16, 16, 0), (1, 2, 97, 80, 32, 0), (3, 1, 64, 32, 16, 0), (2, 2, 131, 64, 16, 3),
         (1, 1, 5, 16, 16, 0)]


def _keys(case, dtype, seed):
    """Keys as the transposed view a model's projections give (last dim contiguous, others strided), and left
    padding of up to two blocks per sequence."""
    b, h, length, d, bs, _ = case
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, length, h, d, generator=gen).to(dtype).transpose(1, 2)
    kv_start = torch.randint(0, min(length, 2 * bs + 3), (b,), generator=gen)
    return keys.to(DEV), kv_start.to(DEV)


def _summaries(case, kind, dtype, seed):
    b, h, length, d, bs, _ = case
    gen = torch.Generator().manual_seed(seed + 100)
    cap = -(-length // bs) + 2
    data = torch.randn(len(SUMMARY_LAYOUT[kind]), b, h, cap, d, generator=gen).to(dtype).to(DEV)
    codes = None
    if kind == "quantized":
        codes = torch.randint(0, 256, (b, h, cap, bs, d // CODES_PER_BYTE), generator=gen, dtype=torch.uint8).to(DEV)
    return data, codes


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_summarize_keys_kernel_matches_twin(case, kind, dtype):
    """The blocks from `first_block` on: summaries to float32 rounding, key codes identical (both quantize against
    the bounds as stored); the blocks before it and past the last are untouched."""
    bs, first = case[4], case[5]
    end_block = -(-case[2] // bs)
    for seed in range(2):
        keys, kv_start = _keys(case, dtype, seed)
        data_k, codes_k = _summaries(case, kind, dtype, seed)
        data_r = data_k.clone()
        codes_r = None if codes_k is None else codes_k.clone()
        before = data_k.clone()
        summarize_keys(keys, kv_start, data_k, kind=kind, block_size=bs, first_block=first, codes=codes_k)
        summarize_keys_ref(keys, kv_start, data_r, kind=kind, block_size=bs, first_block=first, codes=codes_r)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(data_k, data_r, atol=tol, rtol=tol)
        outside = [i for i in range(data_k.shape[3]) if not first <= i < end_block]
        assert torch.equal(data_k[:, :, :, outside], before[:, :, :, outside])
        if codes_k is not None:
            assert torch.equal(codes_k, codes_r), f"seed {seed}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_summarize_keys_twin_is_the_padded_blocks_summary(case, kind):
    """The twin writes `summarize_blocks` (and `quantize_blocks`) of the keys padded to whole blocks, with padding
    and unwritten tokens masked out."""
    b, h, length, d, bs, first = case
    keys, kv_start = _keys(case, torch.float32, 7)
    keys, kv_start = keys.cpu(), kv_start.cpu()
    data, codes = _summaries(case, kind, torch.float32, 7)
    data, codes = data.cpu(), None if codes is None else codes.cpu()
    summarize_keys_ref(keys, kv_start, data, kind=kind, block_size=bs, first_block=first, codes=codes)
    nb = -(-length // bs)
    blocks = torch.nn.functional.pad(keys, (0, 0, 0, nb * bs - length)).reshape(b, h, nb, bs, d)
    pos = torch.arange(nb * bs).view(1, 1, nb, bs)
    ok = (pos < length) & (pos >= kv_start.view(-1, 1, 1, 1))
    want = summarize_blocks(kind, blocks, ok)
    assert torch.equal(data[:, :, :, first:nb], want[:, :, :, first:])
    if codes is not None:
        assert torch.equal(codes[:, :, first:nb], quantize_blocks(blocks, ok, want)[:, :, first:])


def test_summarize_keys_refuses_what_it_cannot_write():
    keys = torch.randn(1, 2, 40, 16)
    data = torch.zeros(1, 1, 2, 3, 16)  # 3 blocks of 16 hold 40 tokens
    with pytest.raises(ValueError, match="not contiguous summaries"):
        summarize_keys(keys, torch.zeros(1, dtype=torch.long), data[:, :, :, :2], kind="mean", block_size=16)
    with pytest.raises(ValueError, match="quantized.*codes"):
        summarize_keys(keys, torch.zeros(1, dtype=torch.long), torch.zeros(3, 1, 2, 3, 16), kind="quantized",
                       block_size=16)
    with pytest.raises(ValueError, match="last dim"):
        summarize_keys(torch.randn(1, 2, 16, 40).transpose(2, 3), torch.zeros(1, dtype=torch.long),
                       data, kind="mean", block_size=16)


# (B, H_kv, L, D, BS, S): a partial last block resident, odd head dim, one slot
POOL_CASES = [(2, 3, 75, 16, 16, 4), (1, 2, 97, 80, 32, 3), (3, 1, 64, 32, 16, 2), (1, 1, 20, 16, 16, 1)]


def _pool_case(case, dtype, seed):
    """Keys and values as transposed views, a residency table with empty slots and the partial last block resident
    where it fits, pools of random contents."""
    b, h, length, d, bs, s = case
    gen = torch.Generator().manual_seed(seed)
    nb = -(-length // bs)
    keys, values = (torch.randn(b, length, h, d, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    slot_block = torch.full((b, h, s + 1), -1, dtype=torch.long)
    for i in range(b):
        for j in range(h):
            chosen = torch.randperm(nb, generator=gen)[: max(1, s - 1)]
            if s > 1:
                chosen[0] = nb - 1
            slots = torch.randperm(s, generator=gen)[: len(chosen)]
            slot_block[i, j, slots] = chosen
    pools = [torch.randn(b, h, s, bs, d, generator=gen).to(dtype) for _ in range(2)]
    return [x.to(DEV) for x in (keys, values, slot_block, *pools)]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", POOL_CASES, ids=str)
def test_fill_pool_kernel_matches_twin(case, dtype):
    for seed in range(2):
        args_k = _pool_case(case, dtype, seed)
        args_r = [x.clone() for x in args_k]
        fill_pool(*args_k)
        fill_pool_ref(*args_r)
        assert torch.equal(args_k[3], args_r[3]) and torch.equal(args_k[4], args_r[4]), f"seed {seed}"


@pytest.mark.parametrize("case", POOL_CASES, ids=str)
def test_fill_pool_twin_copies_each_resident_block_and_leaves_empty_slots(case):
    """Slot s holding block j gets positions j * BS .. j * BS + BS - 1 (zero past the last token); an empty slot
    keeps what it held."""
    b, h, length, d, bs, s = case
    keys, values, slot_block, pool_k, pool_v = (x.cpu() for x in _pool_case(case, torch.float32, 3))
    before_k = pool_k.clone()
    fill_pool_ref(keys, values, slot_block, pool_k, pool_v)
    padded_k = torch.nn.functional.pad(keys, (0, 0, 0, bs))
    padded_v = torch.nn.functional.pad(values, (0, 0, 0, bs))
    for i in range(b):
        for j in range(h):
            for slot in range(s):
                blk = int(slot_block[i, j, slot])
                if blk < 0:
                    assert torch.equal(pool_k[i, j, slot], before_k[i, j, slot])
                    continue
                assert torch.equal(pool_k[i, j, slot], padded_k[i, j, blk * bs : blk * bs + bs])
                assert torch.equal(pool_v[i, j, slot], padded_v[i, j, blk * bs : blk * bs + bs])


def test_fill_pool_refuses_mismatched_shapes():
    keys = torch.randn(1, 2, 40, 16)
    pool = torch.zeros(1, 2, 3, 16, 16)
    with pytest.raises(ValueError, match="disagree"):
        fill_pool(keys, keys, torch.full((1, 2, 2), -1), pool, pool.clone())  # fewer table entries than slots
    with pytest.raises(ValueError, match="contiguous"):
        fill_pool(keys, keys, torch.full((1, 2, 4), -1), pool.transpose(3, 4), pool.transpose(3, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_summarize_keys_gpu_real_shapes(kind):
    """Prefill shapes on the GPU, bf16: Llama-8B's heads at 4,100 tokens in blocks of 32 (batch 2, a partial last
    block), Qwen2.5-1.5B's at 16,000 in blocks of 16, and a chunk whose first touched block is 250."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("needs a CUDA GPU without TRITON_INTERPRET")
    for case in [(2, 8, 4100, 128, 32, 0), (1, 2, 16000, 128, 16, 0), (2, 2, 8200, 128, 32, 250)]:
        bs, first = case[4], case[5]
        keys, kv_start = _keys(case, torch.bfloat16, 11)
        data_k, codes_k = _summaries(case, kind, torch.bfloat16, 11)
        data_r, codes_r = data_k.clone(), None if codes_k is None else codes_k.clone()
        summarize_keys(keys, kv_start, data_k, kind=kind, block_size=bs, first_block=first, codes=codes_k)
        summarize_keys_ref(keys, kv_start, data_r, kind=kind, block_size=bs, first_block=first, codes=codes_r)
        torch.testing.assert_close(data_k, data_r, atol=1e-2, rtol=1e-2)
        if codes_k is not None:  # both quantize against the bounds as stored (exact minima and maxima)
            assert torch.equal(codes_k, codes_r), case


@pytest.mark.gpu
def test_fill_pool_gpu_real_shapes():
    """Llama-8B's heads, batch 2 at 4,100 tokens, 64 slots of 32 (the default budget), bf16: bit-identical."""
    if not torch.cuda.is_available() or INTERPRET:
        pytest.skip("needs a CUDA GPU without TRITON_INTERPRET")
    args_k = _pool_case((2, 8, 4100, 128, 32, 64), torch.bfloat16, 5)
    args_r = [x.clone() for x in args_k]
    fill_pool(*args_k)
    fill_pool_ref(*args_r)
    assert torch.equal(args_k[3], args_r[3]) and torch.equal(args_k[4], args_r[4])
