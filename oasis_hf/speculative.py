"""Batched speculative decoding (draft, verify, accept per sequence) for batch sizes transformers refuses.

transformers' assisted generation runs batch 1 only. `speculative_generate` drafts ``k`` tokens for every sequence
with a small draft model, or with prompt lookup (``draft_model=None``: the tokens that followed the earliest earlier
occurrence of the sequence's last n-gram, as transformers' ``prompt_lookup_num_tokens`` does, for the whole batch at
once), verifies them with one target forward of ``k + 1`` tokens (with an `OasisCache` these
are the queries the lookahead prefetcher scores blocks with), and accepts per sequence:

- greedy: a draft token is accepted while it equals the target's argmax;
- sampling: speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept ``d`` with probability
  ``min(1, p(d) / q(d))``, otherwise sample from ``norm(max(0, p - q))``; an accepted token is an exact sample
  of ``p``.

The caches hold one length for the whole batch (left padding keeps positions aligned), so each round every
sequence keeps ``n = min_b(accepted_b)`` drafts plus one more token: its own accepted draft ``n + 1`` where it
accepted more (an exact target sample / the target's argmax), otherwise the target's correction. The output is
therefore the target's own greedy output with greedy decoding, and a sample of the target's distribution with
sampling; sequences that accepted more lose only speed.

Because the batch keeps its minimum, large batches accept fewer drafts per round than one sequence does (on the
Qwen2.5-Coder 1.5B/0.5B pair at 16k tokens, 77% of 4 drafts kept at batch 1 but 32% at batch 8, and 6% with the
target on a 2048-token OasisCache budget). Drafting ``k`` tokens then costs ``k`` draft steps and a ``k + 1``-token
verify for about one token, so with a draft model the default schedule is ``"adaptive"``: each round drafts one
more token than the batch accepted in the round before (at most ``num_draft_tokens``), as transformers' "heuristic"
schedule adapts ``num_assistant_tokens``; where even one draft fails, it backs off to plain rounds (no draft, a
one-token verify) for 1, 2, 4, ... 16 rounds between one-draft probes, so drafts that never hold cost about what
plain decoding costs. ``"constant"`` (the default for prompt lookup,
whose drafts cost no draft step) always drafts ``num_draft_tokens``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from oasis_hf import compat
from oasis_hf.decode_graph import graph_runner
from oasis_hf.draft import forward_logits, make_draft, positions
from oasis_hf.errors import UnsupportedError

logger = logging.getLogger(__name__)


@dataclass
class SpeculativeStats:
    """What one `speculative_generate` call did."""

    rounds: int = 0
    drafted: int = 0  # draft tokens proposed, per sequence, summed over rounds
    accepted: int = 0  # draft tokens kept (the batch minimum), summed over rounds
    accepted_per_sequence: list[int] = field(default_factory=list)  # before taking the batch minimum
    draft_lengths: list[int] = field(default_factory=list)  # drafts proposed in each round
    new_tokens: int = 0
    seconds: float = 0.0
    # Where the rounds' time went (wall time on the device's timeline: CUDA events on a GPU, so host gaps count):
    draft_seconds: float = 0.0  # drafting (draft model steps or prompt lookup)
    verify_seconds: float = 0.0  # the target's verify forwards
    accept_seconds: float = 0.0  # acceptance, the host read, cache crops and bookkeeping

    @property
    def acceptance(self) -> float:
        """Fraction of proposed draft tokens kept."""
        return self.accepted / max(1, self.drafted)


@dataclass
class SpeculativeOutput:
    sequences: torch.Tensor  # (B, prompt + new) token ids, left padding kept, `pad_token_id` after EOS
    stats: SpeculativeStats


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits / temperature, dim=-1)


def prompt_lookup_drafts(seq: torch.Tensor, mask: torch.Tensor, k: int, max_ngram: int = 2) -> torch.Tensor:
    """Prompt-lookup drafts for a batch: (B, k) token ids.

    For each sequence of `seq` (B, L), the longest n-gram (``max_ngram`` down to 1) ending the sequence is looked up
    among its earlier real tokens (`mask` (B, L), 0 on left padding); the draft is the ``k`` tokens that followed the
    earliest occurrence (transformers' `PromptLookupCandidateGenerator` rule), padded with the last token where fewer
    follow. A sequence with no match drafts its last token repeated (rejected at no extra cost: the verify forward
    has a fixed ``k + 1`` tokens). Device work only, no host synchronisation.
    """
    batch, length = seq.shape
    drafts = seq[:, -1:].expand(batch, k).clone()
    found = torch.zeros(batch, dtype=torch.bool, device=seq.device)
    real = mask.bool()
    offsets = torch.arange(k, device=seq.device)
    for n in range(min(max_ngram, length - 1), 0, -1):
        starts = torch.arange(length - n + 1, device=seq.device)
        match = (seq.unfold(1, n, 1) == seq[:, None, -n:]).all(-1)  # (B, L - n + 1): window i equals the tail
        match &= real[:, : length - n + 1] & (starts + n < length)  # real tokens, and something follows
        first = match.float().argmax(-1)  # the earliest match (argmax returns the first maximum)
        index = first[:, None] + n + offsets
        cand = torch.where(index < length, seq.gather(1, index.clamp(max=length - 1)), seq[:, -1:])
        hit = match.any(-1) & ~found
        drafts = torch.where(hit[:, None], cand, drafts)
        found |= hit
    return drafts


@torch.inference_mode()
def speculative_generate(
    model,
    draft_model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    cache=None,
    draft_cache=None,
    max_new_tokens: int = 128,
    num_draft_tokens: int = 4,
    do_sample: bool = False,
    temperature: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    draft_cuda_graphs: bool = True,
    prompt_lookup_max_ngram: int = 2,
    target_graphs: bool = False,
    draft_schedule: str | None = None,
) -> SpeculativeOutput:
    """Generate with a draft model for any batch size; greedy output equals the target's own greedy output.

    Parameters
    ----------
    model, draft_model : causal LMs sharing one tokenizer (same vocabulary ids), on one device. ``draft_model=None``
        drafts by prompt lookup instead (`prompt_lookup_drafts`, n-grams up to `prompt_lookup_max_ngram`).
    input_ids : (B, P) prompt ids, left padded. attention_mask : (B, P), 1 for real tokens (None: all real).
    cache : the target's cache, empty (e.g. a fresh `OasisCache`; None: `DynamicCache`).
    draft_cache : the draft's cache, empty (None: `DynamicCache`).
    max_new_tokens : tokens to add per sequence. num_draft_tokens : ``k``, drafts per round (>= 1; the most per round
        with ``draft_schedule="adaptive"``).
    do_sample, temperature : greedy, or speculative sampling at this temperature.
    eos_token_id, pad_token_id : a sequence stops at EOS; later positions hold `pad_token_id`.
    generator : random generator for sampling (on the model's device).
    draft_cuda_graphs : on CUDA, run each draft token as one CUDA graph replay over fixed-size draft K/V
        (`oasis_hf.draft.GraphedDraft`; needs a full-attention SDPA draft and no `draft_cache`): a small draft's
        eager forward costs about as much as the target's, which would cancel the gain of drafting.
    target_graphs : always run the target's verify forwards as whole-model CUDA graphs (`oasis_hf.DecodeGraph`),
        refusing a cache it cannot capture (sliding layers, several devices, the stale policy, `measure_recall`).
        Without it the verify forwards are ``model(...)`` calls, which a model given to `oasis_hf.enable` routes to
        the same graph whenever `OasisConfig.whole_step` is set and the cache allows it (eager otherwise, with the
        reason logged once). Measured on an H200 (Qwen2.5-Coder 1.5B/0.5B, 16k, batch 1): 38.9 tokens/s through
        the graph against 27.9 eager.
    draft_schedule : ``"adaptive"``: each round drafts one more token than the batch kept in the last round, at
        most `num_draft_tokens`, backing off to plain rounds after a failed one-draft round (`_DraftSchedule`);
        ``"constant"``: always `num_draft_tokens`. None (default): adaptive with a draft model, constant with
        prompt lookup (its drafts cost no draft steps, only a wider verify).

    Returns
    -------
    `SpeculativeOutput` with ``sequences`` (B, P + max_new_tokens at most) and `SpeculativeStats`.
    """
    if num_draft_tokens < 1 or max_new_tokens < 1:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} and max_new_tokens={max_new_tokens} must both be >= 1"
        )
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 with do_sample=True (use do_sample=False for greedy)")
    if draft_schedule is None:
        draft_schedule = "constant" if draft_model is None else "adaptive"
    if draft_schedule not in ("adaptive", "constant"):
        raise ValueError(f"draft_schedule={draft_schedule!r} is not one of 'adaptive', 'constant'")
    if prompt_lookup_max_ngram < 1:
        raise ValueError(f"prompt_lookup_max_ngram={prompt_lookup_max_ngram} must be >= 1")
    vocab = model.get_output_embeddings().weight.shape[0]
    if draft_model is not None:
        vocab = min(vocab, draft_model.get_output_embeddings().weight.shape[0])
    if cache is not None and cache.get_seq_length() != 0:
        raise UnsupportedError("speculative_generate needs an empty target cache; pass a fresh OasisCache, or call "
                               "reset() on it")
    device = input_ids.device
    batch = input_ids.shape[0]
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device)
    cache = cache if cache is not None else DynamicCache(config=model.config)
    max_len = input_ids.shape[1] + max_new_tokens + num_draft_tokens + 1
    runner = None
    if target_graphs:
        runner = graph_runner(model, cache)
    drafter = None if draft_model is None else make_draft(draft_model, batch, max_len, device, draft_cuda_graphs,
                                                          draft_cache)
    eos = torch.tensor([] if eos_token_id is None else eos_token_id, device=device).long().flatten()
    pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if len(eos) else 0)
    stats = SpeculativeStats(accepted_per_sequence=[0] * batch)
    t0 = time.perf_counter()

    def choose(probs_or_logits: torch.Tensor) -> torch.Tensor:  # (B, V) -> (B,)
        if do_sample:
            return torch.multinomial(probs_or_logits, 1, generator=generator).squeeze(-1)
        return probs_or_logits.argmax(-1)

    # Prefill both models on the prompt; the target's last logits give the first new token.
    logits = forward_logits(model, input_ids, mask, cache, last_only=True)[:, -1, :vocab]
    if drafter is not None and input_ids.shape[1] > 1:
        drafter.prefill(input_ids[:, :-1], mask[:, :-1])
    last = choose(_probs(logits, temperature) if do_sample else logits)  # (B,) first new token, not in any cache
    seq = torch.cat([input_ids, last[:, None]], dim=1)
    mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
    finished = torch.isin(last, eos)
    produced = 1
    schedule = _DraftSchedule(draft_schedule, num_draft_tokens)

    clock = _PhaseClock(device)
    while produced < max_new_tokens and not bool(finished.all()):
        clock.mark()
        k = min(schedule.planned, max_new_tokens - produced)
        if k == 0:  # a plain round (the adaptive schedule backs off from drafts that never hold): verify `last` only
            draft_ids, draft_probs = seq.new_empty(batch, 0), []
        elif drafter is None:  # prompt lookup: a deterministic proposal, q is one-hot on it
            draft_ids = prompt_lookup_drafts(seq, mask, k, prompt_lookup_max_ngram)
            draft_probs = list(torch.nn.functional.one_hot(draft_ids, vocab).float().unbind(1)) if do_sample else []
        else:
            draft_ids, draft_probs = _draft(drafter, seq, mask, k, vocab, do_sample, temperature, choose)
        clock.mark()
        # Verify: one target forward over [last, d_1 .. d_k].
        verify_ids = torch.cat([last[:, None], draft_ids], dim=1)
        verify_mask = torch.cat([mask, mask.new_ones(batch, k)], dim=1)
        if runner is not None:
            t_logits = runner(verify_ids, positions(verify_mask, k + 1)).float()[:, :, :vocab]
        else:
            t_logits = forward_logits(model, verify_ids, verify_mask, cache)[:, :, :vocab]  # (B, k+1, V)
        if do_sample:
            p = _probs(t_logits, temperature)
            q, ok = None, draft_ids.bool()  # a plain round: nothing to accept, the token is sampled from p
            if k:
                q = torch.stack(draft_probs, dim=1)  # (B, k, V)
                p_d = p[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)
                q_d = q.gather(-1, draft_ids[..., None]).squeeze(-1)
                u = torch.rand(p_d.shape, device=device, generator=generator)
                ok = u <= (p_d / q_d.clamp_min(1e-20)).clamp(max=1.0)
        else:
            ok = draft_ids == t_logits[:, :k].argmax(-1)
        clock.mark()
        accepted = ok.long().cumprod(dim=1).sum(dim=1)  # (B,) leading accepted drafts
        accepted = torch.where(finished, k, accepted)  # finished sequences never hold the batch back
        per_sequence = accepted.tolist()  # the round's one read of the acceptance (a host synchronisation)
        n = min(per_sequence)
        for b, a in enumerate(per_sequence):
            stats.accepted_per_sequence[b] += a
        schedule.update(k, n)
        # Token n + 1: the sequence's own accepted draft where it accepted more, else the target's correction.
        if do_sample:
            residual = p[:, n] - (q[:, n] if n < k else 0.0)
            residual = residual.clamp(min=0)
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, n])
            fix = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator).squeeze(-1)
        else:
            fix = t_logits[:, n].argmax(-1)
        nxt = draft_ids[:, n] if n < k else fix
        nxt = torch.where(accepted > n, nxt, fix)
        new = torch.cat([draft_ids[:, :n], nxt[:, None]], dim=1)  # (B, n + 1)
        # EOS: everything after a sequence's first EOS becomes padding.
        is_eos = torch.isin(new, eos) & ~finished[:, None]
        after = (is_eos.long().cumsum(1) - is_eos.long()) > 0
        new = torch.where(finished[:, None] | after, pad, new)
        finished = finished | is_eos.any(1)
        # Keep [last, d_1 .. d_n] in the target cache; the draft cache keeps at most as much.
        keep = seq.shape[1] + n
        compat.crop_to(cache, keep)
        if drafter is not None:
            drafter.rewind(keep)
        seq = torch.cat([seq, new], dim=1)
        mask = torch.cat([mask, mask.new_ones(batch, n + 1)], dim=1)
        last = new[:, -1]
        produced += n + 1
        stats.rounds += 1
        stats.drafted += k
        stats.accepted += n
        stats.draft_lengths.append(k)
        clock.mark()
    stats.draft_seconds, stats.verify_seconds, stats.accept_seconds = clock.totals(3)
    stats.new_tokens = produced
    stats.seconds = time.perf_counter() - t0
    total = input_ids.shape[1] + max_new_tokens
    return SpeculativeOutput(sequences=seq[:, :total], stats=stats)


class _DraftSchedule:
    """Drafts per round. ``constant``: always `most`. ``adaptive``: one more than the batch kept in the last round
    (1 to `most`); after a one-draft round that kept nothing, plain rounds (no draft, a one-token verify: plain
    decoding) follow, 1, then 2, 4, ... up to `MAX_PLAIN` in a row between one-draft probes, so a batch whose drafts
    do not hold decodes at the speed of plain decoding instead of paying draft steps and a wider verify."""

    MAX_PLAIN = 16

    def __init__(self, kind: str, most: int) -> None:
        self.kind, self.most = kind, most
        self.planned = most  # drafts of the next round
        self.backoff = 0  # plain rounds after the last failed probe
        self.plain_left = 0

    def update(self, drafted: int, kept: int) -> None:
        """The round drafted `drafted` tokens and the batch kept `kept` of them."""
        if self.kind == "constant":
            return
        if drafted == 0:  # a plain round
            self.plain_left -= 1
            self.planned = 1 if self.plain_left <= 0 else 0
        elif drafted == 1 and kept == 0:  # a one-draft round that failed: back off
            self.backoff = min(2 * self.backoff, self.MAX_PLAIN) if self.backoff else 1
            self.plain_left = self.backoff
            self.planned = 0
        else:
            if kept:
                self.backoff = 0
            self.planned = min(self.most, kept + 1)


class _PhaseClock:
    """Time between successive `mark` calls, phases cycling with period ``n``: CUDA events on a GPU (no
    synchronisation until `totals`), the host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def totals(self, n: int) -> list[float]:
        """Seconds per phase: phase i sums the intervals that start at marks i, i + n + 1, ... (each round records
        ``n + 1`` marks: its start and the end of each phase)."""
        out = [0.0] * n
        if self.cuda and self.marks:
            self.marks[-1].synchronize()
        for start in range(0, len(self.marks) - n, n + 1):
            for phase in range(n):
                a, b = self.marks[start + phase], self.marks[start + phase + 1]
                out[phase] += a.elapsed_time(b) / 1e3 if self.cuda else b - a
        return out


def _draft(drafter, seq, mask, k: int, vocab: int, do_sample: bool, temperature: float, choose):
    """``k`` draft tokens per sequence from the draft model, (B, k), and their distributions (sampling) or logits:
    first feed what the draft cache lacks (the tokens after its length), then one token at a time."""
    batch = seq.shape[0]
    drafts, draft_probs = [], []
    step_ids, step_mask = seq[:, drafter.length :], mask[:, : seq.shape[1]]
    for _ in range(k):
        d_logits = drafter.feed(step_ids, step_mask)[:, :vocab]
        q = _probs(d_logits, temperature) if do_sample else d_logits
        token = choose(q)
        drafts.append(token)
        draft_probs.append(q)
        step_ids = token[:, None]
        step_mask = torch.cat([step_mask, step_mask.new_ones(batch, 1)], dim=1)
    return torch.stack(drafts, dim=1), draft_probs
