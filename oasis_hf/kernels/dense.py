"""Dense attention through PyTorch SDPA: the prefill path and the fallback for calls that are not OasisCache's.

Queries are lower-right aligned with the keys (query ``t`` of ``T`` sits at key position ``L - T + t``), like Hugging
Face's own attention with a cache. Handles causality, a sliding window, GQA and a 2-D padding mask ``(B, L)``;
masks are built in query chunks so a long padded prefill never materialises a ``(B, T, L)`` mask at once, and a
left-padded causal prefill runs unpadded per sequence (fused causal kernels, no mask at all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

_MASK_ELEMS = 1 << 27  # at most 128 Mi mask entries per chunk


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding_mask: torch.Tensor | None,
    scale: float,
    sliding_window: int | None = None,
    is_causal: bool = True,
    dropout: float = 0.0,
    pad_lengths: list[int] | None = None,
) -> torch.Tensor:
    """Attention of `query` (B, H_q, T, D) over `key`/`value` (B, H_kv, L, D); returns (B, T, H_q, D).

    padding_mask : (B, L) bool or None — False marks padding keys. Query rows that see no key attend to their own
    position so their (unused) outputs stay finite.
    pad_lengths : the padding tokens per sequence when the caller knows them on the host and the padding is all on
        the left (a causal prefill then skips reading them back from the mask).
    """
    batch, num_q_heads, num_tokens, _ = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    if padding_mask is not None and padding_mask.dim() != 2:
        raise ValueError(
            f"oasis attention expects a 2-D padding mask (B, L) or None, got shape {tuple(padding_mask.shape)}; "
            "register the mask function with oasis_hf.register() instead of building 4-D masks"
        )
    gqa = num_q_heads != num_kv_heads
    if padding_mask is None and sliding_window is None and (num_tokens in (1, kv_len) or not is_causal):
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, scale=scale, enable_gqa=gqa,
            is_causal=is_causal and num_tokens == kv_len and num_tokens > 1,
        )  # fmt: skip
        return out.transpose(1, 2)
    if padding_mask is None and sliding_window is None and is_causal and 1 < num_tokens < kv_len:
        # The last T of L positions (a prefill chunk, a verification forward): lower-right causal, a fused kernel
        # without a mask in memory (the explicit-mask path below takes the memory-efficient kernel over GQA-expanded
        # K/V, several times slower on a long chunk).
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(num_tokens, kv_len), dropout_p=dropout, scale=scale,
            enable_gqa=gqa,
        )  # fmt: skip
        return out.transpose(1, 2)
    if (padding_mask is not None and sliding_window is None and is_causal and num_tokens == kv_len > 1
            and not (query.is_cuda and torch.cuda.is_current_stream_capturing())):
        out = _left_padded_prefill(query, key, value, padding_mask, scale, gqa, dropout, pad_lengths)
        if out is not None:
            return out
    if gqa:  # explicit masks take the memory-efficient kernel, which wants equal head counts
        group = num_q_heads // num_kv_heads
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    key_pos = torch.arange(kv_len, device=query.device)
    rows = max(1, _MASK_ELEMS // max(1, batch * kv_len))
    outs = []
    for t0 in range(0, num_tokens, rows):
        t1 = min(num_tokens, t0 + rows)
        query_pos = kv_len - num_tokens + torch.arange(t0, t1, device=query.device)
        allowed = torch.ones(t1 - t0, kv_len, dtype=torch.bool, device=query.device)
        if is_causal:
            allowed &= key_pos[None, :] <= query_pos[:, None]
        if sliding_window is not None:
            allowed &= query_pos[:, None] - key_pos[None, :] < sliding_window
        allowed = allowed[None, None]
        if padding_mask is not None:
            allowed = allowed & padding_mask[:, None, None, :].to(torch.bool)
        allowed = allowed | (key_pos[None, :] == query_pos[:, None])[None, None]
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, t0:t1], key, value, attn_mask=allowed, dropout_p=dropout, scale=scale
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2)


def _left_padded_prefill(query, key, value, padding_mask, scale: float, gqa: bool, dropout: float,
                         pad_lengths: list[int] | None = None):
    """A causal prefill (``T == L``) whose padding is all on the left, as one unpadded causal SDPA call per sequence:
    the fused causal kernels (flash attention on CUDA) instead of an explicit mask, which takes the memory-efficient
    kernel over the whole ``T x L`` square and, with GQA, K/V copied per query head. Padded query rows attend to
    their own position, as in the masked path. Returns (B, T, H_q, D_v), or None where a real token follows a padded
    one (the masked path handles that). Reads the padding lengths on the host unless `pad_lengths` gives them (left
    padding known): not for graph capture."""
    if pad_lengths is None:
        mask = padding_mask.to(torch.bool)
        left = (mask[:, 1:] >= mask[:, :-1]).all(dim=1)  # (B,) no real token before a padded one
        pad_lengths, ok = torch.stack([(~mask).sum(dim=1), left.long()]).tolist()  # one host read for both
        if not all(ok):
            return None
    if not any(pad_lengths):  # no padding at all: one batched call
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scale, is_causal=True,
                                              enable_gqa=gqa).transpose(1, 2)
    batch, num_q_heads, num_tokens, _ = query.shape
    group = num_q_heads // key.shape[1]
    out = query.new_empty(batch, num_tokens, num_q_heads, value.shape[-1])
    for b, pad in enumerate(pad_lengths):
        if pad:
            out[b, :pad] = value[b, :, :pad].repeat_interleave(group, dim=0).transpose(0, 1)
        if pad < num_tokens:
            real = F.scaled_dot_product_attention(
                query[b : b + 1, :, pad:], key[b : b + 1, :, pad:], value[b : b + 1, :, pad:],
                dropout_p=dropout, scale=scale, is_causal=True, enable_gqa=gqa,
            )  # fmt: skip
            out[b, pad:] = real[0].transpose(0, 1)
    return out
