"""Pure-PyTorch twins of the Triton kernels: the CPU path and the test oracle.

Written from the math, not from the kernels: gather what the kernel would read into dense tensors, then compute in
float32. Each function has exactly the signature of its Triton counterpart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_INF = float("inf")
_FLT_MAX = torch.finfo(torch.float32).max

#: Block summaries per kind, stacked along the first dim of a summaries tensor (n, B, H_kv, NB_cap, D): Quest's
#: per-channel bounds lo and hi first, then the mean key. `oasis_hf.cache.summaries.BlockSummaries` stores this
#: layout; `append_tokens` and `score_blocks` read it. ``quantized`` keeps the bounds and the mean key here (the
#: first stage of its two-stage scoring) and every key's codes beside them (`quantize_blocks`).
SUMMARY_LAYOUT = {"mean": ("mean",), "minmax": ("lo", "hi"), "mean+minmax": ("lo", "hi", "mean"),
                  "quantized": ("lo", "hi", "mean")}
#: Bits per channel of a ``quantized`` summary's key codes; ``8 // CODE_BITS`` channels share a byte.
CODE_BITS = 2
CODES_PER_BYTE = 8 // CODE_BITS


def summary_key_vectors(kind: str, block_size: int, element_size: int = 2) -> float:
    """GPU bytes of one block's summary of `kind`, in key vectors (one token's key, `element_size` bytes per
    channel): the stacked vectors of `SUMMARY_LAYOUT`, plus a ``quantized`` summary's codes."""
    codes = block_size * CODE_BITS / (8 * element_size) if kind == "quantized" else 0.0
    return len(SUMMARY_LAYOUT[kind]) + codes


@dataclass(frozen=True)
class AppendState:
    """What `append_tokens` updates besides the pool and the slot table, and how: handed to `sparse_attention` to
    append a step's new tokens after its attention, in the launch that merges the attention's splits.

    slot_score : (B, H_kv, S + 1) float32; block_slot : (B, H_kv, NB_cap + 1) int64; summaries : (n, B, H_kv, NB_cap,
    D) in the layout of `kind`; kv_start : (B,) int64; codes : a ``quantized`` summary's key codes. The other fields
    as `append_tokens`'s keyword arguments.
    """

    slot_score: torch.Tensor
    block_slot: torch.Tensor
    summaries: torch.Tensor
    kind: str
    sink_blocks: int
    recent_blocks: int
    codes: torch.Tensor | None = None
    evict_oldest: bool = False


def sparse_attention_ref(
    query: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slot_block: torch.Tensor,
    seq_len: int | torch.Tensor,
    kv_start: torch.Tensor,
    scale: float,
    *,
    new_key: torch.Tensor | None = None,
    new_value: torch.Tensor | None = None,
    append: AppendState | None = None,
) -> torch.Tensor:
    """Exact attention of the new queries over the resident blocks (twin of `sparse_attention`).

    Parameters
    ----------
    query : (B, H_q, T, D)
        Queries of the ``T`` newest tokens, at positions ``seq_len - T .. seq_len - 1``.
    pool_k, pool_v : (B, H_kv, S, BS, D)
        Resident blocks; slot ``s`` of (b, h) holds logical block ``slot_block[b, h, s]``, i.e. the tokens at
        positions ``block * BS .. block * BS + BS - 1``.
    slot_block : (B, H_kv, S) integer
        Logical block id per slot; negative means empty.
    seq_len : int or 0-d integer tensor
        Tokens in the sequence (shared by the batch: left padding keeps positions aligned).
    kv_start : (B,) integer
        First real position of each sequence; earlier positions are left padding and never attended.
    scale : float
        Softmax scale (usually ``D ** -0.5``).
    new_key, new_value : (B, H_kv, T, D), optional
        The ``T`` new tokens' K/V. Given, they are read from here and the pool only below position
        ``seq_len - T``: the tokens need not be in the pool yet.
    append : AppendState, optional (needs `new_key` / `new_value`)
        After the attention, append the new tokens as `append_tokens` does (pool rows, slot table `slot_block`
        with its S + 1 columns, summaries): a block this evicts was still attended in this call.

    Returns
    -------
    (B, T, H_q, D) tensor in the dtype of `query` (the layout Hugging Face attention functions return).
    Rows whose query sees no key (all padding) are zero.
    """
    batch, num_q_heads, num_tokens, head_dim = query.shape
    _, num_kv_heads, num_slots, block_size, _ = pool_k.shape
    group = num_q_heads // num_kv_heads
    check_new_tokens("sparse_attention", query, pool_k, new_key, new_value, append)
    table = slot_block
    slot_block = slot_block[..., :num_slots].long()

    keys = pool_k.float().reshape(batch, num_kv_heads, num_slots * block_size, head_dim)
    values = pool_v.float().reshape(batch, num_kv_heads, num_slots * block_size, head_dim)
    # Absolute position of every gathered key: (B, H_kv, S * BS)
    key_pos = (slot_block[..., None] * block_size + torch.arange(block_size, device=query.device)).reshape(
        batch, num_kv_heads, num_slots * block_size
    )
    key_ok = (slot_block[..., None] >= 0).expand(-1, -1, -1, block_size).reshape_as(key_pos)
    pool_end = seq_len - num_tokens if new_key is not None else seq_len
    key_ok = key_ok & (key_pos < pool_end) & (key_pos >= kv_start.view(batch, 1, 1).to(key_pos.device))
    if new_key is not None:  # the new tokens after the pool's keys, as the pool would hold them (its dtype)
        new_pos = (seq_len - num_tokens + torch.arange(num_tokens, device=query.device)).expand(
            batch, num_kv_heads, -1)
        keys = torch.cat([keys, new_key.to(pool_k.dtype).float()], dim=2)
        values = torch.cat([values, new_value.to(pool_v.dtype).float()], dim=2)
        key_ok = torch.cat([key_ok, new_pos >= kv_start.view(batch, 1, 1).to(key_pos.device)], dim=2)
        key_pos = torch.cat([key_pos, new_pos], dim=2)
    query_pos = seq_len - num_tokens + torch.arange(num_tokens, device=query.device)  # (T,)
    # (B, H_kv, T, S * BS)
    allowed = key_ok[:, :, None, :] & (key_pos[:, :, None, :] <= query_pos[None, None, :, None])

    q = query.float().reshape(batch, num_kv_heads, group * num_tokens, head_dim)  # rows ordered (g, t)
    scores = torch.einsum("bhmd,bhnd->bhmn", q, keys) * scale  # (B, H_kv, G*T, S*BS)
    allowed = allowed[:, :, None].expand(-1, -1, group, -1, -1).reshape_as(scores)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> zeros
    # Keys nobody may see are never read, as in the kernel's masked loads: an empty slot or a position past the
    # sequence may hold anything (a preallocated buffer's uninitialised memory), and 0 * NaN would be NaN.
    values = values.masked_fill(~key_ok[..., None], 0.0)
    out = torch.einsum("bhmn,bhnd->bhmd", probs, values)
    out = out.reshape(batch, num_q_heads, num_tokens, head_dim).transpose(1, 2).to(query.dtype)
    if append is not None:
        start = torch.as_tensor(seq_len, device=query.device) - num_tokens
        append_tokens_ref(new_key, new_value, start, pool_k, pool_v, table, append.slot_score, append.block_slot,
                          append.summaries, kv_start, kind=append.kind,
                          sink_blocks=append.sink_blocks, recent_blocks=append.recent_blocks, codes=append.codes,
                          evict_oldest=append.evict_oldest)
    return out


def check_new_tokens(name: str, query: torch.Tensor, pool_k: torch.Tensor, new_key: torch.Tensor | None,
                     new_value: torch.Tensor | None, append: AppendState | None) -> None:
    """`sparse_attention`'s checks of its optional new tokens: both or neither, shaped (B, H_kv, T, D) after the
    query and the pool, and present when an append is asked for."""
    if (new_key is None) != (new_value is None):
        raise ValueError(f"{name}: pass new_key and new_value together")
    if append is not None and new_key is None:
        raise ValueError(f"{name}: append= needs the new tokens (new_key=, new_value=)")
    if new_key is None:
        return
    want = (query.shape[0], pool_k.shape[1], query.shape[2], query.shape[3])
    if new_key.shape != want or new_value.shape != want:
        raise ValueError(f"{name}: new_key {tuple(new_key.shape)} / new_value {tuple(new_value.shape)} are not "
                         f"(B, H_kv, T, D) = {want}")


def block_mass_ref(
    query: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    q_pos: torch.Tensor,
    kv_start: torch.Tensor,
    block_size: int,
    capacity_blocks: int,
) -> torch.Tensor:
    """Exact causal softmax attention mass per block, summed over a GQA group's query rows (twin of `block_mass`).

    Parameters
    ----------
    query : (B, H_q, T, D)
        Queries at positions `q_pos` (T,) integer.
    keys : (B, H_kv, N, D)
        Every key, at positions ``0 .. N - 1``.
    scale : float
        Softmax scale.
    q_pos : (T,) integer; kv_start : (B,) integer
        The queries' positions; each sequence's first real key (left padding before it is never attended).
    block_size, capacity_blocks : int
        Tokens per block; width of the result (``>= ceil(N / block_size)``).

    Returns
    -------
    (B, H_kv, capacity_blocks) float32: per block, the softmax probabilities of its keys summed over the ``G * T``
    rows of the group (a row sees the keys ``kv_start[b] <= n <= q_pos[t]``; a row that sees none adds nothing);
    zero past the last block.
    """
    batch, _, num_tokens, head_dim = query.shape
    num_kv_heads, length = keys.shape[1], keys.shape[2]
    q = query.float().reshape(batch, num_kv_heads, -1, head_dim)  # rows ordered (g, t)
    logits = torch.einsum("bhmd,bhnd->bhmn", q, keys.float()) * scale
    key_pos = torch.arange(length, device=keys.device)
    rows_pos = q_pos.repeat(q.shape[2] // num_tokens)
    allowed = (key_pos[None, :] <= rows_pos[:, None])[None, None] & (key_pos >= kv_start.view(-1, 1, 1, 1))
    probs = torch.softmax(logits.masked_fill(~allowed, -_INF), dim=-1).nan_to_num(0.0).sum(2)
    return token_mass_per_block(probs, block_size, capacity_blocks)


def token_mass_per_block(mass: torch.Tensor, block_size: int, capacity_blocks: int) -> torch.Tensor:
    """(B, H_kv, N) per-token mass -> (B, H_kv, capacity_blocks) per-block sums, zero past the last block."""
    batch, heads, length = mass.shape
    num_blocks = -(-length // block_size)
    mass = torch.nn.functional.pad(mass, (0, num_blocks * block_size - length))
    mass = mass.view(batch, heads, num_blocks, block_size).sum(-1)
    return torch.nn.functional.pad(mass, (0, capacity_blocks - num_blocks))


def copy_rows_ref(
    src: torch.Tensor,
    src_offsets: torch.Tensor,
    dst: torch.Tensor,
    dst_offsets: torch.Tensor,
    row_elems: int,
    max_programs: int | None = None,
) -> None:
    """Copy ``N`` rows of `row_elems` contiguous elements from `src` to `dst` (twin of `copy_rows`).

    Parameters
    ----------
    src, dst : tensors of one dtype, any shape and device; each row must be contiguous in memory.
    src_offsets, dst_offsets : (N,) int64
        Element offsets of each row relative to ``src.data_ptr()`` / ``dst.data_ptr()``. A row whose source
        offset is negative is skipped (fixed-shape plans mark unused entries that way).
    row_elems : int
        Elements per row.
    max_programs : int | None
        Scheduling hint of the kernel (how many GPU programs share the rows); no effect on the result, unused here.
    """
    if src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: src dtype {src.dtype} != dst dtype {dst.dtype}")
    keep = src_offsets >= 0
    if not bool(keep.any()):
        return
    src_offsets, dst_offsets = src_offsets[keep], dst_offsets[keep].to(src_offsets.device)
    span = torch.arange(row_elems, device=src_offsets.device)
    src_flat = _flat_view(src)
    dst_flat = _flat_view(dst)
    rows = src_flat[(src_offsets[:, None] + span).to(src.device)]
    dst_flat[(dst_offsets[:, None] + span).to(dst.device)] = rows.to(dst.device)


def _flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """1-D view of the storage of `tensor`, starting at its first element."""
    total = tensor.untyped_storage().nbytes() // tensor.element_size() - tensor.storage_offset()
    return tensor.as_strided((total,), (1,), tensor.storage_offset())


# ----------------------------------------------------------------------------------------------- block planning
# The selection plan of `BlockTable` as functions of its tensors: ``slot_block`` / ``slot_score`` (B, H_kv, S + 1)
# and ``block_slot`` (B, H_kv, NB_cap + 1), each with a trailing "trash" column that masked scatters write to.
# Ties are broken by index (lower block first in the wanted order, lower slot first in the eviction order), so the
# Triton kernel `plan_blocks` can reproduce the result exactly.


def check_keep_margin(keep_margin: float) -> None:
    """Refuse a residents' bonus (`plan_blocks` and its twin) that is negative or not finite."""
    if not 0.0 <= keep_margin < math.inf:
        raise ValueError(f"plan_blocks: keep_margin={keep_margin!r}; use a finite float >= 0 (0: no hysteresis)")


def keep_residents(scores: torch.Tensor, block_slot: torch.Tensor, keep_margin: float) -> torch.Tensor:
    """`scores` (B, H_kv, NB) as the plan ranks them: a resident block's (``block_slot >= 0``) times ``1 +
    keep_margin`` in float32 (`OasisConfig.keep_margin`), the others as they are; `scores` itself at 0."""
    check_keep_margin(keep_margin)
    if not keep_margin:
        return scores
    resident = block_slot[..., : scores.shape[-1]] >= 0
    return torch.where(resident, scores * (1.0 + keep_margin), scores)


def propose_blocks(scores: torch.Tensor, slot_block: torch.Tensor, block_slot: torch.Tensor, max_fetch: int | None,
                   keep_margin: float = 0.0):
    """The delta that makes the top-``S`` blocks by `scores` resident, without touching the tables.

    Parameters
    ----------
    scores : (B, H_kv, NB) float — ``+inf`` must be resident, ``-inf`` must not be chosen.
    slot_block : (B, H_kv, S + 1) long. block_slot : (B, H_kv, NB_cap + 1) long, ``NB_cap >= NB``.
    max_fetch : cap on the misses fetched that are not ``+inf`` (best first), or None.
    keep_margin : the residents' bonus in the ranking (`keep_residents`); the returned scores are the ranked ones.

    Returns
    -------
    blocks, slots, valid, block_scores : each (B, H_kv, S): install ``blocks[j]`` into ``slots[j]`` where
    ``valid[j]``; the valid entries come first (misses in score order), ``slots`` is a permutation of the slots,
    emptiest and least important first.
    """
    num_slots = slot_block.shape[-1] - 1
    scores = keep_residents(scores, block_slot, keep_margin)
    top, wanted = scores.sort(dim=-1, descending=True, stable=True)
    top, wanted = top[..., :num_slots], wanted[..., :num_slots]
    wanted_ok = top > -_INF
    hit_slot = block_slot.gather(-1, wanted)
    hit = wanted_ok & (hit_slot >= 0)
    miss = wanted_ok & ~hit
    kept = torch.zeros_like(slot_block).scatter_add_(-1, torch.where(hit, hit_slot, num_slots), hit.long())
    resident = slot_block[..., :num_slots]
    current = scores.gather(-1, resident.clamp(min=0))
    evict_key = torch.where(kept[..., :num_slots] > 0, _INF, torch.where(resident < 0, -_INF, current))
    free_slots = evict_key.argsort(dim=-1, stable=True)  # empty slots first, then the least important residents
    order = (~miss).to(torch.int8).argsort(dim=-1, stable=True)  # misses first, in score order
    blocks = wanted.gather(-1, order)
    valid = miss.gather(-1, order)
    block_scores = top.gather(-1, order)
    if max_fetch is not None:
        forced = block_scores == _INF
        num_forced = (valid & forced).sum(-1, keepdim=True)
        rank = torch.arange(num_slots, device=scores.device)
        valid = valid & (forced | (rank < num_forced + max_fetch))
    return blocks, free_slots, valid, block_scores


def assign_blocks(slot_block, slot_score, block_slot, blocks, slots, valid, scores) -> None:
    """Install ``blocks[..., j]`` into ``slots[..., j]`` where `valid` (all (B, H_kv, N)), evicting what those slots
    held; the valid slots of one (sequence, head) must be distinct and the blocks not resident elsewhere."""
    trash_slot, trash_block = slot_block.shape[-1] - 1, block_slot.shape[-1] - 1
    old = slot_block.gather(-1, torch.where(valid, slots, trash_slot))
    block_slot.scatter_(-1, torch.where(valid & (old >= 0), old, trash_block), -1)
    target = torch.where(valid, slots, trash_slot)
    slot_block.scatter_(-1, target, blocks)
    slot_score.scatter_(-1, target, scores.float())
    block_slot.scatter_(-1, torch.where(valid, blocks, trash_block), slots)


def refresh_slot_scores(slot_block: torch.Tensor, slot_score: torch.Tensor, scores: torch.Tensor) -> None:
    """Set every resident block's importance from `scores` (B, H_kv, NB) (the next plan's eviction order); blocks
    past ``NB`` (the table grew since the scores were made) keep theirs, empty slots get ``-inf``."""
    num_slots, width = slot_block.shape[-1] - 1, scores.shape[-1]
    now = slot_block[..., :num_slots]
    fresh = scores.gather(-1, now.clamp(0, width - 1))
    slot_score[..., :num_slots] = torch.where(
        now >= width, slot_score[..., :num_slots], torch.where(now >= 0, fresh, -_INF)
    )


def plan_blocks_ref(
    scores: torch.Tensor,
    slot_block: torch.Tensor,
    slot_score: torch.Tensor,
    block_slot: torch.Tensor,
    max_fetch: int | None,
    fetched: torch.Tensor | None = None,
    keep_margin: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Twin of `plan_blocks` (same arguments and result, see there): `propose_blocks`, then `assign_blocks` and
    `refresh_slot_scores` on the tables in place; returns (blocks, slots, valid), each (B, H_kv, S). The slots keep
    the scores themselves, not the ranked ones (a fetched block is not resident when ranked, so its score is its
    own)."""
    blocks, slots, valid, block_scores = propose_blocks(scores, slot_block, block_slot, max_fetch, keep_margin)
    assign_blocks(slot_block, slot_score, block_slot, blocks, slots, valid, block_scores)
    refresh_slot_scores(slot_block, slot_score, scores)
    if fetched is not None:
        fetched.add_(valid.sum())
    return blocks, slots, valid


def gather_blocks_ref(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    blocks: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    first_block: int = 0,
    max_programs: int | None = None,
) -> None:
    """Twin of `gather_blocks` (same arguments, see there): ``dst[b, h, slots[b,h,j]] = src[b, h, blocks[b,h,j] -
    first_block]`` for K and V where valid and inside the segment, with index ops on any device."""
    local = blocks - first_block
    take = valid & (local >= 0) & (local < src_k.shape[2])
    if not bool(take.any()):
        return
    b, h, j = take.nonzero(as_tuple=True)
    rows, dst_slots = local[b, h, j], slots[b, h, j]
    b_src, h_src, rows_src = (t.to(src_k.device) for t in (b, h, rows))
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        dst[b, h, dst_slots] = src[b_src, h_src, rows_src].to(dst.device)


# ------------------------------------------------------------------------------------------- summaries and scores
def summarize_blocks(kind: str, blocks_k: torch.Tensor, token_ok: torch.Tensor) -> torch.Tensor:
    """The summaries of `kind` of ``n`` blocks: (len(SUMMARY_LAYOUT[kind]), B, H_kv, n, D) in the keys' dtype.

    blocks_k : (B, H_kv, n, BS, D) keys; token_ok : (B, 1 or H_kv, n, BS) bool, False for padding and unwritten
    tokens. The mean of the real keys (zero for an empty block) and their per-channel min and max (zero when
    empty), computed in float32.
    """
    ok = token_ok[..., None]
    k = blocks_k.float()
    parts = {}
    if "mean" in SUMMARY_LAYOUT[kind]:
        parts["mean"] = torch.where(ok, k, 0.0).sum(3) / ok.sum(3).clamp(min=1)
    if "lo" in SUMMARY_LAYOUT[kind]:
        any_ok = ok.any(3)
        parts["lo"] = torch.where(any_ok, torch.where(ok, k, _INF).amin(3), 0.0)
        parts["hi"] = torch.where(any_ok, torch.where(ok, k, -_INF).amax(3), 0.0)
    return torch.stack([parts[name] for name in SUMMARY_LAYOUT[kind]]).to(blocks_k.dtype)


def summarize_keys_ref(
    keys: torch.Tensor,
    kv_start: torch.Tensor,
    summaries: torch.Tensor,
    *,
    kind: str,
    block_size: int,
    first_block: int = 0,
    codes: torch.Tensor | None = None,
) -> None:
    """Twin of `summarize_keys` (same arguments, see there): `summarize_blocks` (and `quantize_blocks`) of blocks
    ``first_block .. ceil(L / BS) - 1`` of `keys` (B, H_kv, L, D), written into `summaries` (and `codes`)."""
    if kind == "quantized" and codes is None:  # before anything is written
        raise ValueError("summarize_keys: a 'quantized' summary needs its key codes (codes=...)")
    batch, heads, length, head_dim = keys.shape
    end_block = -(-length // block_size)
    if end_block <= first_block:
        return
    part = keys[:, :, first_block * block_size :]
    part = torch.nn.functional.pad(part, (0, 0, 0, (end_block - first_block) * block_size - part.shape[2]))
    blocks_k = part.reshape(batch, heads, end_block - first_block, block_size, head_dim)
    pos = torch.arange(first_block * block_size, end_block * block_size, device=keys.device)
    token_ok = ((pos < length) & (pos >= kv_start.view(-1, 1))).view(batch, 1, -1, block_size)
    summary = summarize_blocks(kind, blocks_k, token_ok).to(summaries.dtype)
    summaries[:, :, :, first_block:end_block] = summary
    if kind == "quantized":
        codes[:, :, first_block:end_block] = quantize_blocks(blocks_k, token_ok, summary)


def fill_pool_ref(
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_block: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
) -> None:
    """Twin of `fill_pool` (same arguments, see there): ``pool[b, h, s] = rows of block slot_block[b, h, s]`` (zero
    past the last token) for every slot that holds a block."""
    batch, heads, length, head_dim = keys.shape
    num_slots, block_size = pool_k.shape[2], pool_k.shape[3]
    resident = slot_block[..., :num_slots]
    pos = resident.clamp(min=0)[..., None] * block_size + torch.arange(block_size, device=keys.device)
    index = pos.clamp(max=length - 1).flatten(2)[..., None].expand(-1, -1, -1, head_dim)
    inside = ((pos < length) & (resident >= 0)[..., None])[..., None]
    keep = (resident >= 0)[..., None, None]
    for src, pool in ((keys, pool_k), (values, pool_v)):
        rows = torch.where(inside, src.gather(2, index).view(batch, heads, num_slots, block_size, head_dim), 0)
        pool.copy_(torch.where(keep, rows.to(pool.dtype), pool))


def _code_shifts(device) -> torch.Tensor:
    """Bit offset of each of a byte's `CODES_PER_BYTE` channels."""
    return CODE_BITS * torch.arange(CODES_PER_BYTE, device=device, dtype=torch.int32)


def quantize_blocks(blocks_k: torch.Tensor, token_ok: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Every key of ``n`` blocks at `CODE_BITS` bits per channel inside its block's bounds, packed.

    blocks_k : (B, H_kv, n, BS, D) keys; token_ok : (B, 1 or H_kv, n, BS) bool; bounds : (2, B, H_kv, n, D) the
    blocks' lo and hi as stored (`summarize_blocks` of ``"minmax"``). A channel's code is
    ``floor((k - lo) / (hi - lo) * L + 0.5)`` clamped to ``0 .. L`` (``L = 2**CODE_BITS - 1``; 0 where hi == lo or
    the token is not real). Returns (B, H_kv, n, BS, D // CODES_PER_BYTE) uint8: channel d in byte
    ``d // CODES_PER_BYTE`` at bit ``CODE_BITS * (d % CODES_PER_BYTE)``.
    """
    levels = 2**CODE_BITS - 1
    lo, hi = bounds[0].float()[..., None, :], bounds[1].float()[..., None, :]
    width = hi - lo
    scaled = torch.where(width > 0, (blocks_k.float() - lo) / torch.where(width > 0, width, 1.0) * levels, 0.0)
    codes = torch.where(token_ok[..., None], torch.floor(scaled + 0.5).clamp(0, levels), 0).to(torch.int32)
    packed = (codes.unflatten(-1, (-1, CODES_PER_BYTE)) << _code_shifts(codes.device)).sum(-1)
    return packed.to(torch.uint8)


def dequantize_blocks(codes: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Keys back from `quantize_blocks`' codes (..., n, BS, D // CODES_PER_BYTE) and bounds (2, ..., n, D):
    ``lo + code * (hi - lo) / L`` in float32, (..., n, BS, D)."""
    code = ((codes.to(torch.int32)[..., None] >> _code_shifts(codes.device)) & (2**CODE_BITS - 1)).flatten(-2).float()
    lo, hi = bounds[0].float()[..., None, :], bounds[1].float()[..., None, :]
    return lo + code * ((hi - lo) / (2**CODE_BITS - 1))


def check_candidates(kind: str, candidates: int) -> None:
    """Refuse a two-stage candidate count (`score_blocks` and its twin) that is negative or set for a summary without
    key codes."""
    if candidates < 0 or (candidates and kind != "quantized"):
        raise ValueError(f"score_blocks: candidates={candidates} with a {kind!r} summary; two-stage scoring needs a "
                         f"'quantized' summary and a positive count (0: one stage)")


def _token_shares(query: torch.Tensor, summaries: torch.Tensor, codes: torch.Tensor, ok: torch.Tensor,
                  token_ok: torch.Tensor, scale: float, candidates: int = 0,
                  forced: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H_kv, NB) float32 of a ``quantized`` summary: each query row's softmax over the real tokens of the `ok`
    blocks of its logits against the dequantized keys, summed per block and over the G * T rows.

    With ``candidates > 0`` only the codes of the `candidates` blocks ``mean+minmax`` rates best (the `forced` ones
    first) are read: each other `ok` block enters the softmax as its ``BS`` tokens at its mean key's logit (one
    entry ``mean logit + log(BS)``), and its share is that entry's."""
    batch, _, _, head_dim = query.shape
    num_kv_heads, capacity = summaries.shape[2], summaries.shape[3]
    block_size = codes.shape[3]
    q = query.float().reshape(batch, num_kv_heads, -1, head_dim)
    keys = dequantize_blocks(codes, summaries).flatten(2, 3)  # (B, H_kv, NB * BS, D)
    allowed = ok[..., None] & token_ok  # (B, 1, NB, BS)
    logits = torch.einsum("bhmd,bhnd->bhmn", q, keys) * scale
    if candidates > 0:
        first_stage = _summary_shares(query, summaries, "mean+minmax", ok, scale)
        first_stage = torch.where(forced, _INF, torch.where(ok, first_stage, -_INF))
        picked = first_stage.topk(min(candidates, capacity), dim=-1).indices
        chosen = torch.zeros_like(first_stage, dtype=torch.bool).scatter_(-1, picked, True) & ok  # (B, H_kv, NB)
        mean = summaries[SUMMARY_LAYOUT["quantized"].index("mean")].float()
        estimate = torch.einsum("bhmd,bhnd->bhmn", q, mean) * scale + math.log(block_size)  # (B, H_kv, M, NB)
        entry = torch.arange(block_size, device=query.device) == 0
        estimate = torch.where(entry, estimate[..., None], -_INF)  # (B, H_kv, M, NB, BS): one entry per block
        logits = torch.where(chosen[:, :, None, :, None], logits.unflatten(-1, (capacity, block_size)), estimate)
        allowed = torch.where(chosen[..., None], allowed, ok[..., None] & entry)  # (B, H_kv, NB, BS)
        logits = logits.flatten(-2)
    allowed = allowed.flatten(-2)
    shares = torch.softmax(logits.masked_fill(~allowed[:, :, None], -_INF), dim=-1).nan_to_num(0.0).sum(2)
    return shares.unflatten(-1, (capacity, -1)).sum(-1)


def _summary_shares(query: torch.Tensor, summaries: torch.Tensor, kind: str, ok: torch.Tensor, scale: float):
    """(B, H_kv, NB) float32: each query row's softmax over the `ok` blocks of its block logits (mean key: the mean
    logit; bounds: Quest's upper bound ``relu(q) . hi + min(q, 0) . lo``), summed over the G * T rows of a group;
    ``mean+minmax`` averages the two. Zero outside `ok` (B, 1 or H_kv, NB)."""
    batch, _, _, head_dim = query.shape
    num_kv_heads = summaries.shape[2]
    q = query.float().reshape(batch, num_kv_heads, -1, head_dim)  # (B, H_kv, G*T, D), rows ordered (g, t)
    layout = SUMMARY_LAYOUT[kind]
    logits = []
    if "mean" in layout:
        logits.append(torch.einsum("bhmd,bhnd->bhmn", q, summaries[layout.index("mean")].float()))
    if "lo" in layout:
        lo, hi = summaries[layout.index("lo")].float(), summaries[layout.index("hi")].float()
        logits.append(torch.einsum("bhmd,bhnd->bhmn", q.clamp(min=0), hi)
                      + torch.einsum("bhmd,bhnd->bhmn", q.clamp(max=0), lo))
    shares = [torch.softmax((x * scale).masked_fill(~ok[:, :, None], -_INF), dim=-1).nan_to_num(0.0).sum(2)
              for x in logits]
    return shares[0] if len(shares) == 1 else 0.5 * (shares[0] + shares[1])


def score_blocks_ref(
    query: torch.Tensor,
    summaries: torch.Tensor,
    raw: torch.Tensor | None,
    memory: torch.Tensor | None,
    kv_start: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    *,
    kind: str,
    source: str,
    num_tokens: int,
    block_size: int,
    sink_blocks: int,
    recent_blocks: int,
    decay: float = 0.0,
    start_offset: int = 0,
    memory_write: bool = True,
    codes: torch.Tensor | None = None,
    candidates: int = 0,
) -> torch.Tensor:
    """Every block's selection score with the rules every selector shares (twin of `score_blocks`).

    The view holds positions up to ``p0 + num_tokens - 1``, ``p0 = start + start_offset`` (`start`: 0-d long
    tensor), so ``nb = ceil((p0 + num_tokens) / BS)`` blocks exist; a block is choosable when it holds real tokens
    (``kv_start // BS <= block < nb``).

    Parameters
    ----------
    query : (B, H_q, T, D) the rows that score (``source="summaries"``); for the other sources only its shape.
    summaries : (n, B, H_kv, NB_cap, D) block summaries in the layout of `kind` (`SUMMARY_LAYOUT`).
    raw : (B, H_kv, NB_cap) scores computed elsewhere (``source="raw"``: the exact mass of an oracle or of the
        prefill window), else None.
    memory : (B, H_kv, NB_cap) float32 selection memory, read when ``decay > 0`` (else unused) and then updated in
        place unless ``memory_write=False`` (a score that consults the memory without becoming part of it).
    kv_start : (B,) first real position. scale : softmax scale.
    kind : summary layout. source : ``"summaries"`` (softmax share of each row's block logits, summed over the G * T
        rows), ``"recency"`` (the block index: StreamingLLM) or ``"raw"``.
    block_size, sink_blocks, recent_blocks : the config's geometry.
    decay : selection memory: a choosable block's score becomes ``max(score / (G * T), decay * memory)``.
    codes : (B, H_kv, NB_cap, BS, D // CODES_PER_BYTE) uint8, the key codes of a ``quantized`` summary
        (`quantize_blocks`; required for it, else unused): a row's softmax then runs over the real tokens of the
        view (``kv_start <= position < p0 + num_tokens``) of the choosable blocks, each token's logit against its
        dequantized key, and a block's share is its tokens' shares.
    candidates : ``quantized`` only: score in two stages. ``mean+minmax`` on the bounds and mean key rates every
        block (the forced ones first), and only the codes of the best `candidates` blocks are read: in each row's
        softmax every other choosable block counts as its ``BS`` tokens at its mean key's logit, and its score is
        that share. ``0`` (default): the codes of every block.

    Returns
    -------
    (B, H_kv, NB_cap) float32: ``+inf`` for the sinks (the first `sink_blocks` real blocks) and the recent blocks
    (from ``min(nb - recent_blocks, p0 // BS)`` on), ``-inf`` for blocks that are not choosable, else the score.
    """
    batch, num_kv_heads, capacity = summaries.shape[1], summaries.shape[2], summaries.shape[3]
    view_start = start + start_offset
    num_blocks = (view_start + num_tokens + block_size - 1) // block_size
    ids = torch.arange(capacity, device=summaries.device).view(1, 1, -1)
    first = (kv_start // block_size).view(-1, 1, 1)
    ok = (ids >= first) & (ids < num_blocks)  # (B, 1, NB_cap)
    recent_from = torch.minimum(num_blocks - recent_blocks, view_start // block_size)
    forced = ok & ((ids < first + sink_blocks) | (ids >= recent_from))
    check_candidates(kind, candidates)
    if source == "summaries" and kind == "quantized":
        if codes is None:
            raise ValueError("score_blocks: a 'quantized' summary needs its key codes (codes=...)")
        pos = ids[..., None] * block_size + torch.arange(block_size, device=ids.device)  # (1, 1, NB_cap, BS)
        token_ok = (pos >= kv_start.view(-1, 1, 1, 1)) & (pos < view_start + num_tokens)
        score = _token_shares(query, summaries, codes, ok, token_ok, scale, candidates, forced)
    elif source == "summaries":
        score = _summary_shares(query, summaries, kind, ok, scale)
    elif source == "recency":
        score = ids.float().expand(batch, num_kv_heads, -1)
    elif source == "raw":
        score = raw.float()
    else:
        raise ValueError(f"score_blocks: unknown source {source!r}; choose 'summaries', 'recency' or 'raw'")
    if decay > 0:
        rows = query.shape[1] // num_kv_heads * query.shape[2]
        score = torch.maximum(torch.where(ok, score / rows, 0.0), memory * decay)
        if memory_write:
            memory.copy_(score)
    return torch.where(forced, _INF, torch.where(ok, score, -_INF))


# ------------------------------------------------------------------------------------------------- new tokens
def append_tokens_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    start: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    slot_block: torch.Tensor,
    slot_score: torch.Tensor,
    block_slot: torch.Tensor,
    summaries: torch.Tensor,
    kv_start: torch.Tensor,
    *,
    kind: str,
    sink_blocks: int,
    recent_blocks: int,
    codes: torch.Tensor | None = None,
    evict_oldest: bool = False,
) -> None:
    """The bookkeeping of a decode / verification forward's ``T`` new tokens (twin of `append_tokens`).

    1. The blocks the tokens touch that are not resident get slots: the r-th such block takes the r-th cheapest
       slot (empty first, then the lowest score, lower slot first on ties; with `evict_oldest` the lowest block
       index instead of the score), never one holding a sink, a recent block (the last `recent_blocks` of the
       sequence) or a block the new tokens touch; the evicted block leaves the table, the new one enters with
       score ``+inf``.
    2. The tokens' K/V are written into their slots.
    3. The summaries of the touched blocks are recomputed from the pool (`summarize_blocks`), and for a
       ``quantized`` summary every key code of those blocks against their new bounds (`quantize_blocks`).

    Parameters
    ----------
    key, value : (B, H_kv, T, D) the new tokens, at positions ``start .. start + T - 1`` (`start`: 0-d long tensor).
    pool_k, pool_v : (B, H_kv, S, BS, D). slot_block, slot_score : (B, H_kv, S + 1); block_slot : (B, H_kv, NB_cap
        + 1): the residency table (`oasis_hf.cache.block_table.BlockTable`), updated in place.
    summaries : (n, B, H_kv, NB_cap, D) in the layout of `kind`, updated in place. kv_start : (B,) first real position.
    sink_blocks, recent_blocks : the config's geometry.
    codes : (B, H_kv, NB_cap, BS, D // CODES_PER_BYTE) uint8 key codes of a ``quantized`` summary (required for
        it), updated in place.
    evict_oldest : evict by age (the ``static`` selector), not by score.
    """
    if kind == "quantized" and codes is None:
        raise ValueError("append_tokens: a 'quantized' summary needs its key codes (codes=...)")
    batch, heads, num_tokens, _ = key.shape
    num_slots, block_size = slot_block.shape[-1] - 1, pool_k.shape[3]
    dev = key.device
    end = start + num_tokens
    num_blocks = (end + block_size - 1) // block_size
    first, last = start // block_size, (end - 1) // block_size
    candidates = first + torch.arange(-(-(num_tokens - 1) // block_size) + 1, device=dev)
    touched = torch.minimum(candidates, last).expand(batch, heads, -1)  # padded to a fixed count with `last`
    fresh = (candidates <= last) & (block_slot.gather(-1, touched) < 0)
    resident = slot_block[..., :num_slots]
    first_real = (kv_start // block_size).view(-1, 1, 1)
    sink = (resident >= first_real) & (resident < first_real + sink_blocks)
    pinned = (resident >= 0) & (sink | (resident >= torch.minimum(num_blocks - recent_blocks, first)))
    score = resident.float() if evict_oldest else slot_score[..., :num_slots].clamp(max=_FLT_MAX)
    evict_key = torch.where(pinned, _INF, torch.where(resident < 0, -_INF, score))
    cheapest = evict_key.sort(dim=-1, stable=True).indices[..., : touched.shape[-1]]
    rank = (fresh.long().cumsum(-1) - 1).clamp(min=0)  # the r-th fresh block takes the r-th cheapest slot
    assign_blocks(slot_block, slot_score, block_slot, touched, cheapest.gather(-1, rank), fresh,
                  torch.full(touched.shape, _INF, device=dev))
    b_idx = torch.arange(batch, device=dev).view(-1, 1, 1)
    h_idx = torch.arange(heads, device=dev).view(1, -1, 1)
    pos = start + torch.arange(num_tokens, device=dev)
    slot = block_slot.gather(-1, (pos // block_size).expand(batch, heads, -1))  # (B, H_kv, T)
    pool_k[b_idx, h_idx, slot, pos % block_size] = key.to(pool_k.dtype)
    pool_v[b_idx, h_idx, slot, pos % block_size] = value.to(pool_v.dtype)
    blocks = touched[0, 0]
    token_pos = (blocks[:, None] * block_size + torch.arange(block_size, device=dev)).view(1, 1, -1, block_size)
    token_ok = (token_pos < end) & (token_pos >= kv_start.view(-1, 1, 1, 1))
    touched_k = pool_k[b_idx, h_idx, block_slot.gather(-1, touched)]  # (B, H_kv, n, BS, D)
    fresh_summaries = summarize_blocks(kind, touched_k, token_ok).to(summaries.dtype)
    summaries.index_copy_(3, blocks, fresh_summaries)
    if kind == "quantized":
        codes.index_copy_(2, blocks, quantize_blocks(touched_k, token_ok, fresh_summaries))


def write_tokens_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    start: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    first_block: int,
) -> None:
    """Write-back of new tokens into one host store segment (twin of `write_tokens`).

    key, value : (B, H_kv, T, D) at positions ``start .. start + T - 1`` (`start`: 0-d long tensor).
    dst_k, dst_v : (B, H_kv, NB_seg, BS, D) a segment holding logical blocks ``first_block ..``; rows outside it are
    skipped.
    """
    batch, heads, seg_blocks, block_size, head_dim = dst_k.shape
    local = (start + torch.arange(key.shape[2], device=key.device) - first_block * block_size).to(dst_k.device)
    inside = (local >= 0) & (local < seg_blocks * block_size)
    for src, dst in ((key, dst_k), (value, dst_v)):
        flat = dst.view(batch, heads, seg_blocks * block_size, head_dim)
        flat[:, :, local[inside]] = src[:, :, inside.to(src.device)].to(device=dst.device, dtype=dst.dtype)
