"""`eval.rank_summaries`: block scoring rules against the exact attention, offline."""

import json
import sys

import pytest
import torch

from eval import rank_summaries
from tests._factories import tiny_model, tiny_tokenizer


def scores_for(block_size: int, bits=(2,), sink=0, recent=0, length=64, seed=0, sub_blocks=(), rerank=(),
               selected=0):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 3, 8, generator=gen)  # 2 KV heads, groups of 3 rows
    keys = torch.randn(2, length, 8, generator=gen)
    return query, keys, rank_summaries.block_scores(query, keys, 0.5, block_size, sink, recent, list(bits),
                                                    list(sub_blocks), list(rerank), selected)


def test_rules_with_exact_keys_rank_as_the_oracle():
    # Blocks of one token: a block's mean key and its bounds are the key (Quest's bound is then the logit), its
    # codes dequantize to it exactly, its one sub-block is itself and its variance is zero, so every rule's share is
    # the exact mass.
    _, _, (mass, scores) = scores_for(block_size=1, bits=(3,), sub_blocks=(1,))
    for name, score in scores.items():
        assert rank_summaries.quality(mass, score, 8) == pytest.approx((1.0, 1.0)), name
    assert rank_summaries.quality(mass, -mass, 8)[0] == 0.0  # the reverse order picks none of the oracle's 8 of 64


@pytest.mark.parametrize("recent", [0, 2])
def test_summary_rules_are_the_softmax_shares_the_library_scores(recent):
    query, keys, (mass, scores) = scores_for(block_size=4, sink=1, recent=recent, length=66)  # 16 complete blocks
    blocks = keys[:, :64].reshape(2, 16, 4, 8)
    mean_logits = torch.einsum("hgd,hcd->hgc", query, blocks.mean(2)) * 0.5
    lo, hi = blocks.amin(2), blocks.amax(2)
    bound_logits = (torch.einsum("hgd,hcd->hgc", query.clamp(min=0), hi)
                    + torch.einsum("hgd,hcd->hgc", query.clamp(max=0), lo)) * 0.5
    mean_share, bound_share = mean_logits.softmax(-1).sum(1), bound_logits.softmax(-1).sum(1)
    names = rank_summaries.rule_names([2], 4)
    choosable = slice(1, 16 - recent)
    var = blocks.var(2, unbiased=False)
    gauss = mean_logits + 0.5 * 0.25 * torch.einsum("hgd,hcd->hgc", query**2, var)
    torch.testing.assert_close(scores[names[-1]], gauss.softmax(-1).sum(1)[:, choosable])
    torch.testing.assert_close(scores[names[0]], mean_share[:, choosable])
    torch.testing.assert_close(scores[names[1]], bound_share[:, choosable])
    torch.testing.assert_close(scores[names[2]], (0.5 * (mean_share + bound_share))[:, choosable])
    exact = (torch.einsum("hgd,hnd->hgn", query, keys) * 0.5).softmax(-1)[..., :64].reshape(2, 3, 16, 4).sum((1, 3))
    torch.testing.assert_close(mass, exact[:, choosable])
    assert set(scores) == set(names) and mass.shape == (2, 15 - recent)


def test_one_token_sub_blocks_are_the_exact_mass_and_counts_must_divide_the_block():
    # A block's parts of one token each: the log-sum-exp of their logits is the log of the block's exact mass (up to
    # the softmax normaliser shared by every block), so the rule picks the oracle's blocks.
    _, _, (mass, scores) = scores_for(block_size=8, length=512, seed=5, sub_blocks=(8, 2))
    names = rank_summaries.rule_names([2], 8, [8, 2])
    assert rank_summaries.quality(mass, scores[names[-3]], 8) == pytest.approx((1.0, 1.0))
    assert rank_summaries.quality(mass, scores[names[-2]], 8)[1] <= 1.0 + 1e-6
    with pytest.raises(ValueError, match="divide the block size 8"):
        scores_for(block_size=8, sub_blocks=(3,))


def test_two_stage_rules_rank_the_first_stage_picks_by_their_codes():
    # 32 blocks, all choosable, S = 4: k = 1 keeps exactly mean+minmax's picks, k = 8 lets every block in, where the
    # codes' shares over the candidates are those over all tokens (the 2-bit keys' rule); k = 2 ranks 8 candidates.
    _, _, (mass, scores) = scores_for(block_size=4, length=128, seed=7, rerank=(1, 2, 8), selected=4)
    names = rank_summaries.rule_names([2], 4, [], [1, 2, 8])
    stage1, codes = scores[names[2]], scores[names[3]]
    assert mass.shape == (2, 32) and len(names) == 5 + 3 * len(rank_summaries.RERANK_NORMALISERS)
    rules = iter(names[5:])
    for _ in rank_summaries.RERANK_NORMALISERS:  # k = 1
        one = scores[next(rules)]
        assert (one.isfinite().sum(-1) == 4).all()
        assert rank_summaries.quality(mass, one, 4) == pytest.approx(rank_summaries.quality(mass, stage1, 4))
    for _ in rank_summaries.RERANK_NORMALISERS:  # k = 2
        two = scores[next(rules)]
        assert (two.isfinite().sum(-1) == 8).all()
        assert torch.isin(two.topk(4, dim=-1).indices, stage1.topk(8, dim=-1).indices).all()
    for _ in rank_summaries.RERANK_NORMALISERS:  # k = 8: no other block, both are the one-stage rule
        torch.testing.assert_close(scores[next(rules)], codes)


def test_the_mean_key_normaliser_counts_the_other_blocks():
    # Blocks of one token: a non-candidate's mean key is its key, so the estimate is exact and the two-stage rule's
    # shares are the one-stage shares of the candidates; the candidates-only softmax over-weights them.
    _, _, (mass, scores) = scores_for(block_size=1, length=64, seed=2, rerank=(2,), selected=4)
    names = rank_summaries.rule_names([2], 1, [], [2])
    alone, estimated = scores[names[-2]], scores[names[-1]]
    exact = scores[names[3]].masked_fill(~estimated.isfinite(), -float("inf"))
    torch.testing.assert_close(estimated, exact)
    assert (alone[alone.isfinite()] > estimated[estimated.isfinite()]).all()


def test_more_bits_rank_closer_to_the_oracle():
    _, _, (mass, scores) = scores_for(block_size=8, bits=(1, 8), length=512, seed=3)
    names = rank_summaries.rule_names([1, 8], 8)
    one_bit, eight_bit = (rank_summaries.quality(mass, scores[n], 8) for n in names[3:5])
    assert eight_bit[0] > one_bit[0] and eight_bit[1] >= 0.99


def test_the_script_measures_a_tiny_model_end_to_end(tmp_path, monkeypatch):
    path = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    out = tmp_path / "rank"
    monkeypatch.setattr(sys, "argv", ["rank_summaries", "--model", str(path), "--tasks", "niah_single", "--context",
                                      "400", "--samples", "1", "--new-tokens", "4", "--block-size", "4",
                                      "--selected", "3", "--recent-blocks", "2", "--bits", "2", "--device", "cpu",
                                      "--out", str(out)])
    rank_summaries.main()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["rule"] for r in rows] == rank_summaries.rule_names([2], 4, [2, 4], [2, 4])
    for row in rows:  # 3 generated positions x 2 layers
        assert row["positions x layers"] == 6
        assert 0.0 <= row["top-3 recall"] <= 1.0 and 0.0 < row["mass of its picks / the oracle's"] <= 1.0 + 1e-6
    assert "niah_single" in out.with_suffix(".md").read_text()
