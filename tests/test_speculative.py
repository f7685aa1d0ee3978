"""Batched speculative decoding: greedy output equals the target's own greedy output at any batch size."""

import pytest
import torch
from transformers import DynamicCache

from oasis_hf.speculative import prompt_lookup_drafts, speculative_generate
from tests._factories import VOCAB, oasis_cache, tiny_model
from tests.test_generate import left_padded

NEW = 30


def greedy_reference(model, ids, mask):
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                          max_new_tokens=NEW, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=2, attn="oasis")


@pytest.mark.parametrize("lengths", [[120], [120, 77, 101, 90]], ids=["batch1", "batch4-leftpad"])
@pytest.mark.parametrize("draft_kind", ["random-draft", "self-draft"])
def test_greedy_equals_target_greedy(target, lengths, draft_kind):
    """A random draft is mostly rejected; the target as its own draft is always accepted: both paths are exact."""
    ids, mask = left_padded(lengths, seed=len(lengths))
    draft = tiny_model("qwen2", layers=1) if draft_kind == "random-draft" else tiny_model("llama", layers=2)
    ref = greedy_reference(tiny_model("llama", layers=2), ids, mask)
    out = speculative_generate(target, draft, ids, mask, cache=oasis_cache(target), max_new_tokens=NEW,
                               num_draft_tokens=4)
    assert torch.equal(out.sequences, ref)
    stats = out.stats
    assert stats.rounds > 0 and stats.new_tokens >= NEW
    phases = (stats.draft_seconds, stats.verify_seconds, stats.accept_seconds)
    assert all(p > 0 for p in phases) and sum(phases) <= stats.seconds
    if draft_kind == "self-draft":
        assert stats.acceptance == 1.0
        assert stats.rounds <= -(-NEW // 5) + 1  # k + 1 tokens per round
    else:
        assert stats.acceptance < 0.5


def test_adaptive_schedule_drafts_less_when_drafts_are_rejected(target):
    """A random draft is almost always rejected: the adaptive schedule falls back to one draft per round (so a round
    costs one draft step and a 2-token verify), the constant one keeps drafting four; both stay exact."""
    ids, mask = left_padded([120, 77, 101, 90], seed=4)
    draft = tiny_model("qwen2", layers=1)
    ref = greedy_reference(tiny_model("llama", layers=2), ids, mask)
    lengths = {}
    for schedule in ("adaptive", "constant"):
        out = speculative_generate(target, draft, ids, mask, cache=oasis_cache(target), max_new_tokens=NEW,
                                   num_draft_tokens=4, draft_schedule=schedule)
        assert torch.equal(out.sequences, ref)
        lengths[schedule] = out.stats.draft_lengths
        assert len(lengths[schedule]) == out.stats.rounds and sum(lengths[schedule]) == out.stats.drafted
    adaptive = lengths["adaptive"]
    assert adaptive[0] == 4 and max(adaptive[1:]) <= 2
    assert adaptive.count(0) > len(adaptive) / 2  # mostly plain rounds: backing off from drafts that never hold
    runs = [len(run) for run in "".join("p" if k == 0 else "d" for k in adaptive).split("d") if run]
    assert runs == sorted(runs) and max(runs) <= 16  # plain stretches grow (1, 2, 4, ...) between probes
    assert set(lengths["constant"][:-3]) == {4}  # fewer only when fewer than 4 tokens remain
    with pytest.raises(ValueError, match="draft_schedule"):
        speculative_generate(target, draft, ids, mask, draft_schedule="heuristic")
    default = speculative_generate(target, draft, ids, mask, cache=oasis_cache(target), max_new_tokens=NEW,
                                   num_draft_tokens=4)
    assert default.stats.draft_lengths == lengths["adaptive"]  # with a draft model the default adapts
    lookup = speculative_generate(target, None, ids, mask, cache=oasis_cache(target), max_new_tokens=NEW,
                                  num_draft_tokens=4)
    assert set(lookup.stats.draft_lengths[:-3]) == {4}  # prompt lookup: drafts are free, the default is constant


def test_draft_schedule_backs_off_to_plain_rounds_and_recovers():
    from oasis_hf.speculative import _DraftSchedule

    schedule, planned = _DraftSchedule("adaptive", 4), []
    for drafted, kept in [(4, 0), (1, 0), (0, 0), (1, 0), (0, 0), (0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (4, 1)]:
        assert drafted == schedule.planned
        schedule.update(drafted, kept)
        planned.append(schedule.planned)
    assert planned == [1, 0, 1, 0, 0, 1, 2, 3, 4, 4, 2]
    for _ in range(12):  # a probe that keeps failing: plain stretches of 1, 2, 4, ... capped at MAX_PLAIN
        schedule.update(schedule.planned, 0)
    assert schedule.backoff <= _DraftSchedule.MAX_PLAIN
    constant = _DraftSchedule("constant", 4)
    constant.update(4, 0)
    assert constant.planned == 4


def test_prefills_compute_only_the_last_logits(target):
    """The prompt forwards of target and draft ask for one position's logits: at 8 x 16k tokens and a 152k vocabulary
    the full (B, P, V) logits are 39 GiB (this ran out of memory on the GPU before)."""
    ids, mask = left_padded([120, 77], seed=5)
    draft = tiny_model("qwen2", layers=1)
    seen = {}
    for name, model in (("target", target), ("draft", draft)):
        seen[name] = []
        model.get_output_embeddings().register_forward_hook(
            lambda module, args, out, log=seen[name]: log.append(args[0].shape[1]))
    try:
        speculative_generate(target, draft, ids, mask, cache=oasis_cache(target), max_new_tokens=4,
                             num_draft_tokens=2)
    finally:
        for model in (target, draft):
            model.get_output_embeddings()._forward_hooks.clear()
    assert seen["target"][0] == 1 and seen["target"][1] == 3  # prefill: last only; verify: 1 + k positions
    assert seen["draft"][0] == 1


def test_prompt_lookup_drafts_follow_the_earliest_match_of_the_longest_ngram():
    seq = torch.tensor([[9, 5, 6, 7, 8, 5, 6],  # tail (5, 6) seen at 1: 7 8 5 follow
                        [1, 2, 9, 1, 2, 8, 1],  # (2, 1) unseen; (1,) first at 0: 2 9 1 follow
                        [0, 0, 4, 1, 2, 3, 0],  # (3, 0) and (0,) only in the left padding: no match
                        [4, 4, 7, 3, 7, 3, 7]])  # (3, 7) first at 3: 7, then the sequence ends (last token pads)
    mask = torch.ones_like(seq)
    mask[2, :2] = 0
    expected = torch.tensor([[7, 8, 5], [2, 9, 1], [0, 0, 0], [3, 7, 7]])
    assert torch.equal(prompt_lookup_drafts(seq, mask, 3), expected)
    assert torch.equal(prompt_lookup_drafts(seq[:1], mask[:1], 2, max_ngram=1), torch.tensor([[7, 8]]))  # (6,) at 2


@pytest.mark.parametrize("lengths", [[120], [120, 77, 101, 90]], ids=["batch1", "batch4-leftpad"])
def test_prompt_lookup_drafts_stay_exact_at_any_batch(target, lengths):
    """Prompt lookup (no draft model) for the whole batch: greedy output equals the target's greedy output; prompts
    that repeat a phrase give the lookup something to find."""
    ids, mask = left_padded(lengths, seed=11)
    phrase = ids[:, -12:]
    ids = torch.cat([ids[:, 24:], phrase, phrase], dim=1)
    mask = torch.cat([mask[:, 24:], torch.ones_like(phrase), torch.ones_like(phrase)], dim=1)
    ref = greedy_reference(tiny_model("llama", layers=2), ids, mask)
    out = speculative_generate(target, None, ids, mask, cache=oasis_cache(target), max_new_tokens=NEW,
                               num_draft_tokens=3)
    assert torch.equal(out.sequences, ref)
    assert out.stats.rounds > 0 and out.stats.drafted > 0
    gen = torch.Generator().manual_seed(0)
    sampled = speculative_generate(target, None, ids, mask, cache=oasis_cache(target), max_new_tokens=NEW,
                                   num_draft_tokens=3, do_sample=True, generator=gen)
    assert sampled.sequences.shape == ref.shape and torch.equal(sampled.sequences[:, : ids.shape[1]], ids)
    with pytest.raises(ValueError, match="prompt_lookup_max_ngram"):
        speculative_generate(target, None, ids, mask, prompt_lookup_max_ngram=0)


def test_small_budget_rounds_keep_the_table_within_budget(target):
    """Below-context budget: every round verifies k + 1 tokens, then crops the rejected ones; the block table stays
    consistent and within budget throughout (exactness against dense needs a budget covering the context)."""
    ids, mask = left_padded([200, 170], seed=5)
    cache = oasis_cache(target, budget_tokens=128, max_fetch_blocks=None)
    out = speculative_generate(target, tiny_model("qwen2", layers=1), ids, mask, cache=cache, max_new_tokens=NEW,
                               num_draft_tokens=4)
    assert out.sequences.shape == (2, 200 + NEW)
    assert cache.get_seq_length() >= 200 + NEW - 1
    for layer in cache.oasis_layers:
        layer.table.check()
        assert int(layer.table.resident_count().max()) <= 8


def test_eos_pads_the_rest_and_sampling_runs(target):
    ids, mask = left_padded([60, 40], seed=2)
    ref = greedy_reference(tiny_model("llama", layers=2), ids, mask)
    eos = int(ref[0, 60 + 3])  # the 4th new token of sequence 0
    out = speculative_generate(target, tiny_model("qwen2", layers=1), ids, mask, cache=oasis_cache(target),
                               max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    row = out.sequences[0, 60:]
    first = int((row == eos).nonzero()[0])
    assert first <= 3 and bool((row[first + 1 :] == 0).all())
    gen = torch.Generator().manual_seed(0)
    sampled = speculative_generate(target, tiny_model("qwen2", layers=1), ids, mask, cache=oasis_cache(target),
                                   max_new_tokens=NEW, do_sample=True, generator=gen)
    assert sampled.sequences.shape == (2, 60 + NEW)
    assert torch.equal(sampled.sequences[:, :60], ids)


def _peaked(model, factor):
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)  # low-entropy next-token distributions: few outcomes, little noise
    return model


def test_sampling_matches_target_distribution():
    """Speculative sampling is exact: the joint law of the first two new tokens (the second one comes out of a
    draft/verify round) matches the target's, while a draft with a different law is often rejected."""
    target = _peaked(tiny_model("llama", layers=1, attn="oasis"), 20.0)
    draft = _peaked(tiny_model("llama", layers=1), 20.0)  # the target, perturbed: overlapping but different law
    with torch.no_grad():
        noise = torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(7))
        draft.lm_head.weight.add_(0.3 * noise)
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        p1 = torch.softmax(target(ids).logits[0, -1].float(), -1)  # (V,)
        both = torch.cat([ids.expand(128, -1), torch.arange(128)[:, None]], dim=1)
        p2 = torch.softmax(target(both).logits[:, -1].float(), -1)  # (V, V): p(t2 | t1)
        q1 = torch.softmax(draft(ids).logits[0, -1].float(), -1)
    assert 0.5 * (q1 - p1).abs().sum() > 0.3, "emitting draft samples as they are would fail this test"
    exact = p1[:, None] * p2
    # Sampling noise of 800 draws from the exact law is 0.15-0.18 in total variation for this pair (measured
    # with three seeds), so 0.21 accepts the exact sampler and rejects one that is off by a few points.
    gen = torch.Generator().manual_seed(0)
    runs, counts, accepted = 800, torch.zeros(128, 128), 0
    for _ in range(runs):
        out = speculative_generate(target, draft, ids, None, cache=oasis_cache(target), max_new_tokens=2,
                                   num_draft_tokens=1, do_sample=True, generator=gen)
        t1, t2 = out.sequences[0, -2:].tolist()
        counts[t1, t2] += 1
        accepted += out.stats.accepted
    tv = 0.5 * (counts / runs - exact).abs().sum()
    assert 0 < accepted < runs, "the draft must be accepted sometimes and rejected sometimes for this to test much"
    assert tv < 0.21, f"total variation {tv:.3f} between sampled and exact joint distributions"


def test_bad_arguments_are_refused(target):
    ids, mask = left_padded([20])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(target, target, ids, mask, num_draft_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, target, ids, mask, do_sample=True, temperature=0.0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fixed_size_draft_equals_dynamic_cache_draft(family):
    """`GraphedDraft`'s fixed K/V, device-side position, 4-D mask and rewinds give the logits of a plain
    DynamicCache draft (run eagerly here; on CUDA the same step is a graph replay)."""
    from oasis_hf.draft import EagerDraft, GraphedDraft

    draft = tiny_model(family, layers=2)
    assert GraphedDraft.unsupported(draft) is None
    ids, mask = left_padded([50, 37, 44], seed=4)
    fixed, eager = GraphedDraft(draft, 3, 50 + 20, "cpu"), EagerDraft(draft)
    with torch.inference_mode():
        for runner in (fixed, eager):
            runner.prefill(ids, mask)
        gen = torch.Generator().manual_seed(0)
        for rewind in (0, 2, 0, 1):
            tokens = torch.randint(0, VOCAB, (3, 2), generator=gen)
            mask = torch.cat([mask, mask.new_ones(3, 2)], dim=1)
            a, b = fixed.feed(tokens, mask), eager.feed(tokens, mask)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            fixed.rewind(fixed.length - rewind)
            eager.rewind(eager.length - rewind)
            mask = mask[:, : mask.shape[1] - rewind]
            assert fixed.length == eager.length == mask.shape[1]
        fixed.feed(torch.zeros(3, 70 - fixed.length, dtype=torch.long), None)  # fill it to max_len ...
        with pytest.raises(RuntimeError, match="is full"):
            fixed.feed(torch.zeros(3, 1, dtype=torch.long), None)  # ... then one more token is refused, clearly


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["graphed", "eager"])
def test_draft_prefill_in_query_chunks_equals_one_forward(family, kind, monkeypatch):
    """A draft prefill split into query chunks (`prefill_chunks`: transformers' 4-D mask of an unchunked left-padded
    8 x 30k prefill asked for 13.4 GiB on the H200) leaves the K/V of one whole-prompt forward at every real position,
    and the next steps' logits are the same."""
    import oasis_hf.draft as draft_module
    from oasis_hf.draft import EagerDraft, GraphedDraft, prefill_chunks

    assert prefill_chunks(8, 30000, 30200)[:2] == [(0, 555), (555, 1110)]
    assert prefill_chunks(1, 5, 5) == [(0, 5)] and prefill_chunks(2, 10, 10**9) == [(i, i + 1) for i in range(10)]
    draft = tiny_model(family, layers=2)
    ids, mask = left_padded([50, 37, 44], seed=4)
    forward, runners = draft.forward, []
    for elems in (draft_module.PREFILL_MASK_ELEMS, 3 * 70 * 7):  # one chunk; then chunks of 7 (graphed) or 9 queries
        monkeypatch.setattr(draft_module, "PREFILL_MASK_ELEMS", elems)
        runner = GraphedDraft(draft, 3, 70, "cpu") if kind == "graphed" else EagerDraft(draft)
        widths = []

        def counting(*args, widths=widths, **kwargs):
            widths.append(kwargs["input_ids"].shape[1])
            return forward(*args, **kwargs)

        monkeypatch.setattr(draft, "forward", counting)
        with torch.inference_mode():
            runner.prefill(ids, mask)
        monkeypatch.setattr(draft, "forward", forward)
        runners.append((runner, widths))
    (whole, one), (chunked, many) = runners
    assert one == [50] and many == ([7] * 7 + [1] if kind == "graphed" else [9] * 5 + [5])
    assert whole.length == chunked.length == 50
    real = mask.bool()
    for a, b in zip(whole.cache.layers, chunked.cache.layers, strict=True):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            torch.testing.assert_close(x[:, :, :50].transpose(1, 2)[real], y[:, :, :50].transpose(1, 2)[real],
                                       atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(3):
            tokens = torch.randint(0, VOCAB, (3, 2), generator=gen)
            mask = torch.cat([mask, mask.new_ones(3, 2)], dim=1)
            torch.testing.assert_close(whole.feed(tokens, mask), chunked.feed(tokens, mask), atol=1e-5, rtol=1e-5)
    if kind == "eager":  # unpadded, one forward: transformers then gives SDPA no mask at all (is_causal)
        widths = []  # (PREFILL_MASK_ELEMS still makes chunks of 16 here: 1470 // (3 x 30))
        monkeypatch.setattr(draft, "forward",
                            lambda *a, **k: widths.append(k["input_ids"].shape[1]) or forward(*a, **k))
        with torch.inference_mode():
            EagerDraft(draft).prefill(ids[:, -30:], torch.ones_like(ids[:, -30:]))
        assert widths == [30] and prefill_chunks(3, 30, 30) == [(0, 16), (16, 30)]


def test_speculative_with_fixed_size_draft_equals_target_greedy(target, monkeypatch):
    """The whole loop with the fixed-size draft (as CUDA would run it) still equals the target's greedy output."""
    import oasis_hf.speculative as spec
    from oasis_hf.draft import GraphedDraft

    made = []

    def fixed_draft(model, batch, max_len, device, cuda_graphs, cache=None):
        made.append(GraphedDraft(model, batch, max_len, device))
        return made[-1]

    monkeypatch.setattr(spec, "make_draft", fixed_draft)
    ids, mask = left_padded([120, 77, 101, 90], seed=4)
    ref = greedy_reference(tiny_model("llama", layers=2), ids, mask)
    out = speculative_generate(target, tiny_model("llama", layers=2), ids, mask, cache=oasis_cache(target),
                               max_new_tokens=NEW, num_draft_tokens=4)
    assert made and torch.equal(out.sequences, ref)
    assert out.stats.acceptance == 1.0  # the target as its own draft: the fixed-size draft is exact too


def test_draft_with_sliding_layers_is_not_graphed():
    from oasis_hf.draft import EagerDraft, GraphedDraft, make_draft

    draft = tiny_model("gemma3", layers=2)
    assert "sliding" in GraphedDraft.unsupported(draft)
    assert isinstance(make_draft(draft, 1, 64, "cpu", cuda_graphs=True), EagerDraft)


@pytest.mark.gpu
def test_graphed_draft_on_cuda_replays_and_stays_exact(monkeypatch):
    """On CUDA the draft's one-token steps are graph replays (captured at the second step) with the logits of the
    eager DynamicCache draft (the graphed draft prefilled in query chunks, the eager one in one forward), and the
    loop's greedy output still equals the target's."""
    import oasis_hf.draft as draft_module
    from oasis_hf.draft import EagerDraft, GraphedDraft, make_draft

    draft = tiny_model("qwen2", layers=2, device="cuda")
    ids, mask = left_padded([50, 37, 44], seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    fixed = make_draft(draft, 3, 50 + 40, "cuda", cuda_graphs=True)
    eager = EagerDraft(draft)
    assert isinstance(fixed, GraphedDraft)
    with torch.inference_mode():
        with monkeypatch.context() as patch:  # chunks of 8 queries against the 90 keys of the fixed cache
            patch.setattr(draft_module, "PREFILL_MASK_ELEMS", 3 * 90 * 8)
            fixed.prefill(ids, mask)
        eager.prefill(ids, mask)
        gen = torch.Generator().manual_seed(0)
        for rewind in (0, 2, 0, 1, 0):
            tokens = torch.randint(0, VOCAB, (3, 2), generator=gen).cuda()
            mask = torch.cat([mask, mask.new_ones(3, 2)], dim=1)
            torch.testing.assert_close(fixed.feed(tokens, mask), eager.feed(tokens, mask), atol=1e-4, rtol=1e-4)
            fixed.rewind(fixed.length - rewind)
            eager.rewind(eager.length - rewind)
            mask = mask[:, : mask.shape[1] - rewind]
    assert fixed.graph is not None
    target = tiny_model("llama", layers=2, attn="oasis", device="cuda")
    ids, mask = left_padded([120, 77], seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    ref = greedy_reference(tiny_model("llama", layers=2, device="cuda"), ids, mask)
    out = speculative_generate(target, tiny_model("qwen2", layers=1, device="cuda"), ids, mask,
                               cache=oasis_cache(target), max_new_tokens=NEW, num_draft_tokens=4)
    assert torch.equal(out.sequences, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("whole_step", [False, True])
def test_lookahead_job_graphs_survive_rejections_at_batch_4(monkeypatch, whole_step):
    """Batch 4 on CUDA with a random draft (most drafts rejected, so `drop_rejected` narrows eager selection jobs):
    the job graph of each ``T`` is captured after a full-width warm-up and the output stays the target's greedy
    output (the budget covers the sequences, so OasisKV is exact; the jobs still score, plan and fetch). Each eager
    job waits 50 ms in the worker before it starts, so the crop after its forward finds it unstarted and narrows it
    (otherwise whether it did depends on the worker thread's timing). With ``whole_step`` (the default) the verify
    forwards replay the whole-step graph (`oasis_hf.DecodeGraph`, through `oasis_hf.enable`'s forward wrapper)
    instead, with the same output."""
    import time

    from oasis_hf.cache.selection_jobs import EagerJob

    start_job = EagerJob.__call__

    def late(job):
        time.sleep(0.05)
        return start_job(job)

    monkeypatch.setattr(EagerJob, "__call__", late)
    target = tiny_model("llama", layers=2, attn="oasis", device="cuda")
    ids, mask = left_padded([300, 177, 240, 260], seed=7)
    ids, mask = ids.cuda(), mask.cuda()
    ref = greedy_reference(tiny_model("llama", layers=2, device="cuda"), ids, mask)
    cache = oasis_cache(target, budget_tokens=512, selector="lookahead", whole_step=whole_step)
    out = speculative_generate(target, tiny_model("qwen2", layers=1, device="cuda"), ids, mask, cache=cache,
                               max_new_tokens=NEW, num_draft_tokens=4)
    assert torch.equal(out.sequences, ref)
    if whole_step:
        assert cache.graph_runner is not None and cache.graph_runner.replays > 0, "the verify forwards ran eagerly"
        return
    assert any(layer.jobs.graphs for layer in cache.layers), "no selection job was captured"
    assert cache.stats.narrowed_jobs > 0, "no job was narrowed: the test does not cover the warm-up it is about"
