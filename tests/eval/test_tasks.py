"""The RULER-style suite: deterministic generation, answers that really are in the prompt, scoring, lm-eval."""

import shutil
from collections import Counter
from pathlib import Path

import pytest

from eval.tasks import TASKS, generate, process_results, relocate_suite, string_match_all, write_suite
from oasis_hf import OasisError, UnsupportedError
from tests._factories import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generation_is_deterministic_and_answers_are_in_the_prompt(task, tok):
    first = generate(task, 400, 3, tok, seed=1)
    assert first == generate(task, 400, 3, tok, seed=1)
    assert first != generate(task, 400, 3, tok, seed=2)
    for sample in first:
        assert 0.8 * 400 <= len(tok(sample["input"])["input_ids"]) <= 1.25 * 400
        assert sample["outputs"] and all(o in sample["input"] for o in sample["outputs"]), sample["outputs"]
        sentences = [s for s in sample["input"].split(".") if s.strip()]
        assert len(set(sentences)) > 0.5 * len(sentences), "filler must be varied"


def test_answers_are_right(tok):
    """Checked independently of the generators: counts, chains and needles."""
    for sample in generate("cwe", 800, 2, tok):
        listed = [w for w in sample["input"].split("\n")[1].split() if not w.endswith(".")]
        top = Counter(listed).most_common(11)
        assert sorted(sample["outputs"]) == sorted(w for w, _ in top[:10]) and top[9][1] > top[10][1]
    for sample in generate("fwe", 800, 2, tok):
        coded = Counter(sample["input"].split("\n")[1].split()).most_common(4)
        assert sample["outputs"] == [w for w, _ in coded[:3]] and coded[2][1] > coded[3][1]
    for sample in generate("vt", 600, 2, tok):
        value = sample["input"].split("assigned the value ")[1].split(",")[0]
        assignments = [line[4:].rstrip(".").split(" = ") for line in sample["input"].replace(". ", ".\n").splitlines()
                       if line.startswith("VAR ") and " = " in line]
        held, changed = {value}, True
        while changed:  # follow "VAR B = VAR A." from the first assignment
            changed = False
            for name, rhs in assignments:
                if rhs.removeprefix("VAR ") in held and name not in held:
                    held.add(name)
                    changed = True
        assert sorted(held - {value}) == sorted(sample["outputs"])


@pytest.mark.parametrize("room", [1, 37, 300, 2000])
def test_fewest_chunks_are_those_of_counting_after_every_chunk(room, tok):
    """The frequent-words builder finds its length by doubling and bisection; its words (and the generator's state
    after them) are those of counting the whole text after every chunk, as it did before."""
    import random

    from eval.tasks import ruler

    budget = ruler._Budget(tok, room)
    vocab = ["bavok", "tesum", "lirak", "mopex", "zuhan"]

    def draw(rng):
        return rng.choices(vocab, weights=[5, 4, 3, 2, 1], k=50)

    for seed in range(4):
        new, old = random.Random(seed), random.Random(seed)
        words = []
        while budget.count(" ".join(words)) < room:
            words.extend(draw(old))
        assert ruler._fewest_chunks(new, draw, budget, room) == words
        assert new.getstate() == old.getstate()


def test_scoring():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("only 123", ["123", "456"]) == 0.5
    assert process_results({"outputs": ["Apple"]}, ["apple pie"]) == {"score": 100.0}
    assert process_results({"outputs": ["x"]}, [""]) == {"score": 0.0}


def test_lm_eval_runs_the_suite_with_the_oasis_model(tok, tmp_path):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra; `pip install -e .[dev]`")
    from lm_eval.tasks import TaskManager

    from oasis_hf.integrations.lm_eval import OasisLM, register_lm_eval

    written = write_suite(tmp_path / "written", tok, lengths=[300], num_samples=2, tasks=["niah_single", "qa"])
    suite = relocate_suite(shutil.move(written, tmp_path / "suite"))  # a moved suite, pointed at its own data
    assert register_lm_eval() == "oasis"
    model = tiny_model("llama")
    lm = OasisLM(pretrained=model, tokenizer=tok, budget=128, block_size=16, selector="lookahead", device="cpu",
                 batch_size=2, max_length=1024, summary="minmax", prefill_window_tokens=16, score_decay=0.5)
    # model_args reach the cache config (validated there), the named ones and any other OasisConfig field
    assert (lm.oasis_config.summary, lm.oasis_config.prefill_window_tokens, lm.oasis_config.score_decay) == (
        "minmax", 16, 0.5)
    with pytest.raises(ValueError, match="OasisConfig.score_decay=2"):
        OasisLM(pretrained=model, tokenizer=tok, device="cpu", batch_size=1, score_decay=2)
    manager = TaskManager(include_path=str(suite))
    results = lm_eval.simple_evaluate(model=lm, tasks=["oasis_ruler"], task_manager=manager, limit=2)
    scores = results["results"]
    for name in ("oasis_ruler_niah_single_300", "oasis_ruler_qa_300"):
        assert 0.0 <= scores[name]["score,none"] <= 100.0
    assert model.config._attn_implementation == "oasis"
    # Every request batch (2 tasks x 2 samples, batches of 2) ran over the one cache of the slot, reset in between.
    cache = lm.cache_slot.current
    assert cache is not None and cache.get_seq_length() == 0
    assert cache.stats.prefill_layers == 2 * len(cache.oasis_layers)


def test_a_copied_suite_is_pointed_at_its_own_data(tok, tmp_path, capsys):
    """The YAMLs name their data by absolute path (lm-eval resolves a relative one against the working directory),
    so a copy reads the original's files until `relocate_suite` rewrites them; a second call writes nothing, and a
    copy that lacks a data file is refused by name. `make --relocate` does the same from the command line."""
    from eval.tasks import make

    original = write_suite(tmp_path / "a", tok, lengths=[300], num_samples=1, tasks=["niah_single", "qa"])
    copy = Path(shutil.copytree(original, tmp_path / "b"))
    yamls = sorted(copy.glob("oasis_ruler_*_300.yaml"))
    assert len(yamls) == 2 and all(str(original.resolve() / "data") in y.read_text() for y in yamls)
    assert relocate_suite(copy) == copy
    texts = [y.read_text() for y in yamls]
    data = copy.resolve() / "data"
    assert all(f"test: {data / (y.stem + '.jsonl')}\n" in t for y, t in zip(yamls, texts, strict=True))
    assert (copy / "oasis_ruler.yaml").read_text() == (original / "oasis_ruler.yaml").read_text()
    stamps = [y.stat().st_mtime_ns for y in yamls]
    relocate_suite(copy)
    assert [y.stat().st_mtime_ns for y in yamls] == stamps and [y.read_text() for y in yamls] == texts

    moved = Path(shutil.move(copy, tmp_path / "c"))
    make.main(["--relocate", str(moved)])
    assert "the task YAMLs read its data/ folder" in capsys.readouterr().out
    assert str(moved.resolve() / "data") in (moved / "oasis_ruler_qa_300.yaml").read_text()
    (moved / "data" / "oasis_ruler_qa_300.jsonl").unlink()
    with pytest.raises(OasisError, match="oasis_ruler_qa_300.yaml reads oasis_ruler_qa_300.jsonl"):
        relocate_suite(moved)
    with pytest.raises(SystemExit):
        make.main(["--lengths", "300"])  # no --out and no --relocate


def test_kvpress_baseline_is_refused_with_the_reason(tok):
    """Where kvpress is missing, or cannot hook this transformers (5.18+ passes `cache`, kvpress 0.5.5 reads
    `past_key_values`), a press row fails up front and says why, instead of running dense under its name."""
    pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra; `pip install -e .[dev]`")
    from eval.press_baselines import PressLM

    try:
        import kvpress  # noqa: F401
    except ImportError:
        expected = "needs kvpress"
    else:
        import inspect

        from transformers.models.llama.modeling_llama import LlamaAttention

        if "past_key_values" in inspect.signature(LlamaAttention.forward).parameters:
            pytest.skip("kvpress can hook this transformers: test_kvpress_presses_compress_the_prompt runs them")
        expected = "reads `past_key_values`"
    with pytest.raises(UnsupportedError, match=expected):
        PressLM(pretrained=tiny_model("llama"), tokenizer=tok, budget=128, device="cpu", press="SnapKVPress")


def test_lm_eval_draft_model_runs_batched_and_matches_dense(tok):
    """With a draft model or prompt lookup, OasisLM generates whole request batches with `speculative_generate`
    (transformers' assisted generation is batch 1 only), and with ``graphs=True`` through whole-model decode graphs
    (`decode_generate`, or `speculative_generate(target_graphs=True)` with drafts); with a budget covering the
    prompts, the texts equal dense generation."""
    pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra; `pip install -e .[dev]`")
    from lm_eval.api.instance import Instance

    from oasis_hf.integrations.lm_eval import OasisLM

    gen = {"until": [], "max_gen_toks": 10, "do_sample": False}
    prompts = [" ".join(f"word{i * 7 + j}" for j in range(n)) for i, n in enumerate((40, 55, 31))]
    requests = [Instance(request_type="generate_until", doc={}, arguments=(p, dict(gen)), idx=i)
                for i, p in enumerate(prompts)]
    texts = {}
    for name, fields in {"dense": dict(dense=True),
                         "draft": dict(draft_model=tiny_model("qwen2", layers=1), selector="lookahead"),
                         "prompt lookup": dict(prompt_lookup=3, selector="lookahead"),
                         "graphs": dict(graphs=True, selector="current-query"),
                         "draft, graphs": dict(draft_model=tiny_model("qwen2", layers=1), graphs="true")}.items():
        lm = OasisLM(pretrained=tiny_model("llama"), tokenizer=tok, budget=512, block_size=16, device="cpu",
                     batch_size=3, max_length=1024, **fields)
        texts[name] = lm.generate_until(requests, disable_tqdm=True)
    assert all(texts["dense"])
    for name, generated in texts.items():
        assert generated == texts["dense"], name


@pytest.mark.parametrize("press", ["SnapKVPress", "ExpectedAttentionPress"])
def test_kvpress_presses_compress_the_prompt(tok, press):
    """Where kvpress can hook this transformers (5.17, the GPU box's): the press really compresses each layer's prompt
    KV to `budget` tokens (kvpress 0.5.5 reads a ``cache_position`` that transformers 5.x no longer passes, which
    PressLM supplies while the press is active), and the compressed cache decodes (``greedy_continue``, eager here
    and with ``graphs=True``: the same text)."""
    _kvpress_hooks_or_skip()
    from lm_eval.api.instance import Instance

    from eval.press_baselines import PressLM

    gen = {"until": [], "max_gen_toks": 6, "do_sample": False}
    prompts = [" ".join(f"word{(i * 7 + j) % 90}" for j in range(n)) for i, n in enumerate((300, 280))]
    requests = [Instance(request_type="generate_until", doc={}, arguments=(p, dict(gen)), idx=i)
                for i, p in enumerate(prompts)]
    lm = PressLM(pretrained=tiny_model("llama"), tokenizer=tok, budget=128, device="cpu", batch_size=1,
                 max_length=1024, press=press, protocol="whole-prompt")
    kept = []
    compress = lm.press.compress

    def spy(module, hidden_states, keys, values, attentions, kwargs):
        out = compress(module, hidden_states, keys, values, attentions, kwargs)
        kept.append((keys.shape[2], out[0].shape[2]))
        return out

    lm.press.compress = spy
    texts = lm.generate_until(requests, disable_tqdm=True)
    assert all(texts)
    assert kept and all(n_in > 128 and n_out == 128 for n_in, n_out in kept), kept
    kept.clear()
    lm.graphs = True
    assert lm.generate_until(requests, disable_tqdm=True) == texts
    assert kept and all(n_out == 128 for _, n_out in kept), kept


def char_tokenizer():
    """One token per character of the suite's prompts (letters, digits, punctuation, space, newline): exact
    round trips within the tiny models' vocabulary."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "<pad>", "<eos>"] + list(string.ascii_letters + string.digits + " \n.,:?!'-=")
    backend = Tokenizer(tok_models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<eos>")
    tokenizer.padding_side = "left"
    return tokenizer


SUITE_PROMPT = ("Some special magic numbers are hidden in the text below. " * 6 + "\nThe harbour master repaired "
                "a blue bicycle on Monday. " * 8 + "\nWhat is the special magic number for amber-falcon mentioned "
                "in the text above? Answer with the number only.\nAnswer:")


def test_question_split_finds_the_question_line_and_the_answer_cue():
    """The press protocols cut a suite prompt where its question line and its final ``Answer:`` cue begin; a
    prompt without that layout is refused with the protocol that works without it."""
    from eval.press_baselines import question_split

    tok = char_tokenizer()
    ids = tok(SUITE_PROMPT)["input_ids"]
    question, cue = question_split(tok, ids)
    assert tok.decode(ids[question:]) == ("What is the special magic number for amber-falcon mentioned in the text "
                                          "above? Answer with the number only.\nAnswer:")
    assert tok.decode(ids[cue:]) == "Answer:"
    long = "Some context.\n" + "Which of these " * 60 + "is it?\nAnswer:"  # a question line past the decoded tail
    ids = tok(long)["input_ids"]
    question, cue = question_split(tok, ids)
    assert tok.decode(ids[question:]) == long.split("\n", 1)[1] and tok.decode(ids[cue:]) == "Answer:"
    with pytest.raises(UnsupportedError, match="protocol='whole-prompt'"):
        question_split(tok, tok("no question here")["input_ids"])


@pytest.mark.parametrize("press", ["SnapKVPress", "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))",
                                   "CompactorPress"])
@pytest.mark.parametrize("protocol", ["query-agnostic", "query-aware"])
def test_press_protocols_count_the_uncompressed_tail_inside_the_budget(press, protocol):
    """kvpress's protocols: the press sees the context (query-agnostic) or the context and question (query-aware);
    the rest of the prompt follows uncompressed, and the press keeps ``budget - tail`` so that decoding starts from
    `budget` tokens per layer and KV head (on average over a layer's heads for AdaKV, which masks the keys it
    prunes). Decoding continues greedily from there."""
    _kvpress_hooks_or_skip()
    import torch
    from lm_eval.api.instance import Instance

    from eval.press_baselines import PressLM, kept_tokens, question_split

    torch.manual_seed(0)
    # head_dim 128 as in the real models: kvpress's head-wise masking needs a key direction that every query of the
    # uncompressed tail scores negatively, which 16 dimensions do not offer for a hundred queries
    model = _tiny_llama(init=0.02)
    tok = char_tokenizer()
    budget = 160
    lm = PressLM(pretrained=model.eval(), tokenizer=tok, budget=budget, device="cpu", batch_size=1,
                 max_length=2048, press=press, protocol=protocol)
    seen = []
    inner = lm.press.press if hasattr(lm.press, "press") else lm.press
    score = inner.score

    def spy(module, hidden_states, keys, values, attentions, kwargs):
        seen.append((keys.shape[2], lm.press.compression_ratio))
        return score(module, hidden_states, keys, values, attentions, kwargs)

    inner.score = spy
    ids = tok(SUITE_PROMPT)["input_ids"]
    question, cue = question_split(tok, ids)
    head = question if protocol == "query-agnostic" else cue
    gen = {"until": [], "max_gen_toks": 5, "do_sample": False}
    text = lm.generate_until([Instance(request_type="generate_until", doc={}, arguments=(SUITE_PROMPT, gen),
                                       idx=0)], disable_tqdm=True)
    assert len(text) == 1 and seen
    assert all(n == head for n, _ in seen), (seen, head)  # the press saw the head only
    kept = int(head * (1 - seen[0][1]))
    assert kept == budget - (len(ids) - head)  # kvpress's rounding lands on the budget less the tail
    from eval.press_baselines import press_prefill

    cache, _ = press_prefill(lm.model, torch.tensor([ids]), lm.press, budget, len(ids) - head)
    assert kept_tokens(lm.model, cache) == {budget}


def test_press_prefill_names_the_protocol_when_kvpress_cannot_mask_the_tail(monkeypatch):
    """A head-wise press (AdaKV) hides each head's pruned keys from later queries behind a fake key that all of them
    score negatively; where kvpress's search for that key gives up on the uncompressed tail's queries, the prefill
    stops with an error that names the protocol that leaves only the answer cue uncompressed, not kvpress's bare
    ValueError."""
    _kvpress_hooks_or_skip()
    import kvpress.attention_patch
    import torch

    from eval.press_baselines import PressLM, press_prefill, question_split
    from oasis_hf.errors import UnsupportedError

    def gives_up(queries, max_iter=1000):
        raise ValueError("Could not find fake keys such that for every query q, exp(<q, k>) = 0")

    monkeypatch.setattr(kvpress.attention_patch, "search_hyperplane", gives_up)
    torch.manual_seed(0)
    tok = char_tokenizer()
    lm = PressLM(pretrained=_tiny_llama(heads=4, kv_heads=2), tokenizer=tok, budget=288, device="cpu", batch_size=1,
                 max_length=2048, press="AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))", protocol="query-agnostic")
    ids = tok(SUITE_PROMPT, return_tensors="pt")["input_ids"]
    question, _ = question_split(tok, ids[0].tolist())
    with pytest.raises(UnsupportedError, match="protocol='query-aware'") as caught:
        press_prefill(lm.model, ids, lm.press, 288, ids.shape[1] - question)
    assert isinstance(caught.value.__cause__, ValueError)


@pytest.mark.parametrize("press", ["SnapKVPress", "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))"])
def test_press_rows_decode_a_batch_as_they_decode_one_request_at_a_time(press):
    """A request batch (left padded, as lm-eval gives it): each prompt is compressed on its own; the compressed caches
    that kept the same number of tokens decode together (a shorter prompt that kept all of its tokens in a batch of
    its own), a head-wise press's compacted rows together. Every row gets the tokens it gets alone."""
    _kvpress_hooks_or_skip()
    import torch

    from eval.press_baselines import PressLM

    torch.manual_seed(0)
    model = _tiny_llama()
    tok = char_tokenizer()
    start = SUITE_PROMPT.index("\nThe harbour")
    prompts = [SUITE_PROMPT, SUITE_PROMPT[:start] + SUITE_PROMPT[start + 70:],  # two longer than the budget
               SUITE_PROMPT[:60] + SUITE_PROMPT[SUITE_PROMPT.index("\nWhat"):]]  # one shorter: keeps every token
    lm = PressLM(pretrained=model.eval(), tokenizer=tok, budget=288, device="cpu", batch_size=3, max_length=2048,
                 press=press, protocol="query-aware")
    batch = tok(prompts, padding=True, return_tensors="pt")
    assert len(tok(prompts[2])["input_ids"]) < 288 < len(tok(prompts[1])["input_ids"])
    width = batch["input_ids"].shape[1]
    together = lm._model_generate(batch["input_ids"], width + 7, [], attention_mask=batch["attention_mask"],
                                  do_sample=False)
    for row, prompt in enumerate(prompts):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        alone = lm._model_generate(ids, ids.shape[1] + 7, [], do_sample=False)[0, ids.shape[1]:]
        assert torch.equal(together[row, width : width + len(alone)], alone), row
        assert bool((together[row, width + len(alone):] == tok.pad_token_id).all())


@pytest.mark.parametrize("protocol", ["query-aware", "query-agnostic"])
def test_headwise_press_rows_decode_compacted_as_kvpress_decodes_each_masked_cache(protocol):
    """AdaKV's rows: each prompt's masked cache compacted (per KV head its attended slots, the padding masked) and a
    batch of them decoded together gives the tokens of kvpress's own masking over each full cache alone (the path
    the rows took before compaction); the masks are gone from the model afterwards."""
    _kvpress_hooks_or_skip()
    import torch

    from eval.press_baselines import PressLM, attention_modules, on_sdpa, press_prefill, question_split
    from eval.static_decode import greedy_continue

    torch.manual_seed(0)
    # head_dim 128: under query-agnostic the question's 115 tokens attend over the masked keys, and kvpress's search
    # for a key that all 230 queries of a KV head score negatively gives up after 1,000 steps in 64 dimensions
    model = _tiny_llama(layers=3, heads=4, kv_heads=2)
    tok = char_tokenizer()
    start = SUITE_PROMPT.index("\nThe harbour")
    prompts = [SUITE_PROMPT, SUITE_PROMPT[:start] + SUITE_PROMPT[start + 70:], SUITE_PROMPT[: start - 40]
               + SUITE_PROMPT[start:]]
    lm = PressLM(pretrained=model, tokenizer=tok, budget=288, device="cpu", batch_size=3, max_length=2048,
                 press="AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))", protocol=protocol)
    eos = lm.model.generation_config.eos_token_id
    eos = eos if eos is not None else tok.eos_token_id
    expected, widths = [], []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        question, cue = question_split(tok, ids[0].tolist())
        tail = ids.shape[1] - (question if protocol == "query-agnostic" else cue)
        cache, logits = press_prefill(lm.model, ids, lm.press, 288, tail)
        masked = [module.masked_key_indices for module in attention_modules(lm.model)]
        assert all(m is not None for m in masked)
        heads = torch.stack([torch.bincount(m[1], minlength=2) for m in masked])
        widths.append(ids.shape[1] - int(heads.min()))
        with on_sdpa(lm.model):  # kvpress's masking over the whole prompt's keys
            expected.append(greedy_continue(lm.model, cache, logits.argmax(-1, keepdim=True), position=ids.shape[1],
                                            max_new_tokens=6, eos_token_id=eos, graphs=False)[0])
    assert len(set(widths)) > 1  # the heads of a layer kept different counts: the compaction pads them
    batch = tok(prompts, padding=True, return_tensors="pt")
    width = batch["input_ids"].shape[1]
    together = lm._model_generate(batch["input_ids"], width + 7, [], attention_mask=batch["attention_mask"],
                                  do_sample=False)
    for row, tokens in enumerate(expected):
        assert torch.equal(together[row, width : width + len(tokens)], tokens), row
        assert bool((together[row, width + len(tokens):] == tok.pad_token_id).all())
    assert all(getattr(m, "masked_key_indices", None) is None for m in attention_modules(lm.model))


@pytest.mark.parametrize("press", ["SnapKVPress", "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))"])
def test_query_agnostic_press_rows_answer_as_kvpress_pipeline(press):
    """The query-agnostic protocol is kvpress's own pipeline (`_agnostic_answers`): it compresses the context,
    prefills question + newline + prefix after it at the full positions and decodes greedily, answering what a press
    row answers at the same compression ratio."""
    _kvpress_hooks_or_skip()
    import torch

    torch.manual_seed(1)
    # head_dim 128 and 2 query heads per KV head: AdaKV's patch must find one key direction that every query of the
    # ~70-token question prefill points away from (it raises otherwise, in kvpress's pipeline as in PressLM).
    tok = char_tokenizer()
    tok.bos_token = "<unk>"  # the pipeline reads the tokenizer's BOS
    ours, theirs = _agnostic_answers(_tiny_llama(), tok, press, SUITE_PROMPT, budget=288, new=8)
    assert theirs == ours
    assert len(theirs) > 2  # a few characters before any EOS: the comparison has something to compare


@pytest.mark.slow
def test_query_agnostic_press_rows_answer_as_kvpress_pipeline_on_a_real_model():
    """The same check on SmolLM2-135M-Instruct (where it is assembled: `oasis-hf models assemble
    smollm2-135m-instruct`) with a 2,000-token niah_single prompt of the suite: SnapKV and AdaKV expected attention at
    two budgets give kvpress's pipeline's answers (its chat template off: the suite's prompts are plain text)."""
    _kvpress_hooks_or_skip()
    from eval.tasks.ruler import generate
    from oasis_hf import models

    if not models.assembled_path("smollm2-135m-instruct").is_file():
        pytest.skip("smollm2-135m-instruct is not assembled here (oasis-hf models assemble smollm2-135m-instruct)")
    pytest.importorskip("gguf", reason="reading a GGUF needs the gguf package (pip install -e '.[models]')")
    model, tok = models.load("smollm2-135m-instruct", device="cpu")
    tok.chat_template = None
    prompt = generate("niah_single", 2000, 1, tok)[0]["input"]
    for spec in ("SnapKVPress", "AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))"):
        for budget in (512, 1024):
            ours, theirs = _agnostic_answers(model, tok, spec, prompt, budget, new=12)
            assert theirs == ours, (spec, budget)


def _tiny_llama(layers: int = 2, heads: int = 2, kv_heads: int = 1, head_dim: int = 128, init: float = 0.3):
    """A random Llama over the char tokenizer's vocabulary. ``init`` 0.3 gives varied tokens (0.02 repeats one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                        vocab_size=128, initializer_range=init)).eval()


def _agnostic_answers(model, tok, spec: str, prompt: str, budget: int, new: int) -> tuple[str, str]:
    """A query-agnostic press row's answer to `prompt` and that of kvpress's `KVPressTextGenerationPipeline` at the
    same compression ratio: the context before the question line compressed, the question line as ``question``, the
    cue as ``answer_prefix`` (the pipeline runs under `cache_positions`, the hook PressLM adds for kvpress 0.5.5 on
    transformers 5.17; it puts the tokenizer's BOS before a context without a chat template)."""
    from kvpress import KVPressTextGenerationPipeline

    from eval.press_baselines import PressLM, cache_positions, make_press, on_sdpa, press_ratio

    question_at, cue_at = prompt.rindex("\nWhat") + 1, prompt.rindex("\nAnswer:")
    context, question = prompt[:question_at], prompt[question_at:cue_at]
    bos = tok.bos_token or ""
    ids = tok(bos + prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    lm = PressLM(pretrained=model, tokenizer=tok, budget=budget, device="cpu", batch_size=1, max_length=4096,
                 press=spec, protocol="query-agnostic")
    ours = lm._model_generate(ids, ids.shape[1] + new, [], do_sample=False)[0, ids.shape[1]:]
    press = make_press(spec, model)
    head = len(tok(bos + context, add_special_tokens=False)["input_ids"])
    press.compression_ratio = press_ratio(budget - (ids.shape[1] - head), head)
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device="cpu")
    with on_sdpa(model), cache_positions(model):
        theirs = pipe(context, question=question, answer_prefix="Answer:", press=press, max_new_tokens=new)
    return tok.decode(ours, skip_special_tokens=True), theirs["answer"]


def _kvpress_hooks_or_skip():
    """kvpress 0.5.5 and a transformers it can hook (5.17), or skip saying which is missing."""
    pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra; `pip install -e .[dev]`")
    pytest.importorskip("kvpress", reason="kvpress is not installed (the press rows of eval.accuracy need it)")
    import inspect

    from transformers.models.llama.modeling_llama import LlamaAttention

    if "past_key_values" not in inspect.signature(LlamaAttention.forward).parameters:
        pytest.skip("kvpress 0.5.5 cannot hook this transformers (5.18+): the refusal test covers it")


@pytest.mark.parametrize("press_name", ["SnapKVPress", "ExpectedAttentionPress"])
def test_press_question_prefill_keeps_the_budget_both_ways(press_name):
    """`eval.press_question.prefill`: compressing the whole prompt, the press sees all of it and keeps `budget`
    tokens (the retention of the prompt's tail is measured per layer); keeping the question, the press sees all but
    the tail and keeps ``budget - tail``, and the tail follows uncompressed: its KV and last logits are those of a
    plain forward of the tail over the compressed prefix at the full prompt's positions (kvpress's pipeline)."""
    _kvpress_hooks_or_skip()
    import torch
    from transformers import DynamicCache

    from eval.press_baselines import make_press
    from eval.press_question import prefill

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    press = make_press(press_name, model)
    seen = []
    compress = press.compress

    def spy(module, hidden_states, keys, values, attentions, kwargs):
        out = compress(module, hidden_states, keys, values, attentions, kwargs)
        seen.append((keys.shape[2], out[0].shape[2]))
        return out

    press.compress = spy
    with torch.no_grad():
        cache, logits, shares = prefill(model, ids, press, budget=128, tail=0, probe=32)
        assert seen == [(300, 128)] * 2 and logits.shape == (1, model.config.vocab_size)
        assert len(shares) == 2 and all(0.0 <= s <= 1.0 for s in shares), shares
        assert "score" not in press.__dict__  # the retention spy is gone after the prefill
        seen.clear()
        cache, logits, shares = prefill(model, ids, press, budget=128, tail=32, probe=32)
        assert seen == [(268, 96)] * 2 and shares == []
        assert {layer.keys.shape[-2] for layer in cache.layers} == {128}
        # the tail's forward ran without the press, over the compressed prefix, at the full prompt's positions
        prefix = DynamicCache()
        for layer_idx, layer in enumerate(cache.layers):
            prefix.update(layer.keys[:, :, :96].clone(), layer.values[:, :, :96].clone(), layer_idx)
        again = model(input_ids=ids[:, 268:], past_key_values=prefix, position_ids=torch.arange(268, 300)[None])
        torch.testing.assert_close(again.logits[:, -1], logits)
        torch.testing.assert_close(prefix.layers[1].keys, cache.layers[1].keys)


def test_press_question_runs_end_to_end(tmp_path, monkeypatch):
    """`python -m eval.press_question`: every row runs on a tiny model and the table and JSON are written (plumbing:
    the scores of a random model are not asserted)."""
    _kvpress_hooks_or_skip()
    import json
    import sys

    from eval import press_question

    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    out = tmp_path / "probe"
    monkeypatch.setattr(sys, "argv", ["eval.press_question", "--model", str(folder), "--task", "niah_single",
                                      "--length", "400", "--samples", "2", "--budget", "128", "--question-tokens",
                                      "32", "--device", "cpu", "--out", str(out)])
    press_question.main()
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["method"] for r in rows] == [label for label, _, _ in press_question.ROWS]
    for row in rows:
        assert row["niah_single score"].endswith("/2")
        assert ("question tail kept (mean)" in row) == row["method"].endswith("whole prompt")
    assert "question tail 32 tokens" in out.with_suffix(".md").read_text()
    monkeypatch.setattr(sys, "argv", ["eval.press_question", "--model", str(folder), "--budget", "64",
                                      "--question-tokens", "64"])
    with pytest.raises(SystemExit):
        press_question.main()


def test_recall_bench_on_suite_task_prompts(tmp_path, monkeypatch):
    """`eval.recall --task`: a suite task's prompts instead of the pass key, its score summed per row; the minmax
    variants run (plumbing on a tiny random model: the recall values are measured, not asserted)."""
    import json
    import sys

    from eval import recall
    from tests._factories import tiny_model, tiny_tokenizer

    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    out = tmp_path / "recall"
    base = ["eval.recall", "--model", str(folder), "--context", "600", "--budgets", "256", "--task", "vt",
            "--new-tokens", "4", "--loops", "prompt-lookup", "--methods", "lookahead", "--device", "cpu",
            "--out", str(out)]
    fields = ["block_size=16", "sink_tokens=16", "recent_tokens=64", "score_decay=0.9", "max_fetch_blocks=none",
              'layer_budget_tokens={"1": 1024}']
    monkeypatch.setattr(sys, "argv", [*base, "--config", *fields, "--variant", "slow", "score_decay=0.5"])
    built, real_cache = [], recall.oasis_hf.OasisCache
    monkeypatch.setattr(recall.oasis_hf, "OasisCache",
                        lambda cfg, config: built.append(config) or real_cache(cfg, config))
    recall.main()
    payload = json.loads(out.with_suffix(".json").read_text())
    rows = payload["rows"]
    names = ["lookahead", "lookahead, minmax summaries", "lookahead, mean+minmax summaries",
             "lookahead, quantized keys"]
    assert [r["method"] for r in rows] == [m for n in names for m in (n, f"{n} [slow]")]
    # A variant's fields go on top of --config (and of the row's own); the plain row keeps --config's.
    assert [c.score_decay for c in built] == [0.9, 0.5] * 4
    del built[1::2]
    assert all(0.0 <= r["attention mass on resident"] <= 1.0 and r["vt score"].endswith("/1") for r in rows)
    # The blocks moved per (KV head, layer-step); no row corrects inside the step (no sync_fetch_blocks here).
    assert all(r[recall.FETCHED] > 0 and r[recall.CORRECTED] == 0 for r in rows)
    # --config reaches every row's OasisConfig (the row's own summary kept) and the recorded arguments.
    assert [c.summary for c in built] == ["mean", "minmax", "mean+minmax", "quantized"]
    assert all(c.measure_recall for c in built)
    assert all((c.block_size, c.sink_tokens, c.recent_tokens, c.score_decay, c.max_fetch_blocks,
                c.layer_budget_tokens) == (16, 16, 64, 0.9, None, ((1, 1024),)) for c in built)
    assert payload["args"]["config"]["block_size"] == 16
    # The recall per layer: layer 1's budget covers the prompt, so it holds all of the attention there.
    assert all(set(r["layer top-S recall"]) == {"0", "1"} for r in rows)
    assert all(r["layer mass"]["1"] == pytest.approx(1.0) and r["layer mass"]["0"] < 0.999 for r in rows)
    table = out.with_suffix(".md").read_text()
    assert "block_size=16" in table and "Oracle top-S recall per layer" in table and "\n| 1 | 1.000 |" in table
    # A field that is not OasisConfig's, or a value it refuses, stops before any model is loaded.
    monkeypatch.setattr(recall.models, "load", lambda *a, **k: pytest.fail("loaded a model despite a bad --config"))
    for bad in ("blocks=16", "block_size=24", "selector=static"):
        monkeypatch.setattr(sys, "argv", [*base, "--config", bad])
        with pytest.raises(SystemExit):
            recall.main()
        monkeypatch.setattr(sys, "argv", [*base, "--variant", "v", bad])
        with pytest.raises(SystemExit):
            recall.main()
    monkeypatch.setattr(sys, "argv", [*base, "--variant", "v"])  # a name without fields
    with pytest.raises(SystemExit):
        recall.main()
    # A field valid for some selectors only is checked against the rows that run: the in-step correction of an
    # asynchronous selection passes for the lookahead rows and stops a run of current-query rows.
    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(recall.models, "load", load)
    monkeypatch.setattr(sys, "argv", [*base, "--variant", "sync", "sync_fetch_blocks=2"])
    with pytest.raises(Loaded):
        recall.main()
    methods = base.index("--methods") + 1
    monkeypatch.setattr(sys, "argv", [*base[:methods], "current-query", *base[methods + 1:], "--variant", "sync",
                                      "sync_fetch_blocks=2"])
    with pytest.raises(SystemExit):
        recall.main()


def test_every_accuracy_method_is_a_valid_configuration_at_every_preset_budget():
    """eval.accuracy's rows name their settings; each must build (a typo in a field would fail here, not on the GPU),
    and the OasisKV rows of the GPU preset share one selection setting, so that they differ in the queries only."""
    pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra; `pip install -e .[dev]`")
    from eval._accuracy_methods import DEFAULT_ROW, METHODS, PRESETS, SELECTION
    from eval.press_baselines import PROTOCOLS
    from oasis_hf import OasisConfig
    from oasis_hf.integrations.lm_eval import oasis_config

    lm_only = ("dense", "press", "protocol", "draft", "prompt_lookup", "batch_size")
    for method, fields in METHODS.items():
        if "press" in fields:
            assert fields["protocol"] in PROTOCOLS and f"({fields['protocol'].replace('-prompt', ' prompt')})" in \
                method, method  # the row's name says what the press saw
            continue
        for budget in sorted({b for p in PRESETS.values() for b in p["budgets"]}):
            config = oasis_config(budget, **{k: v for k, v in fields.items() if k not in lm_only})
            assert config.budget_tokens == budget, method
            if method == DEFAULT_ROW:  # the library's defaults, field for field
                assert config == OasisConfig(budget_tokens=budget)
    assert DEFAULT_ROW in PRESETS["gpu-qwen-1.5b"]["methods"]
    for method in PRESETS["gpu-qwen-1.5b"]["methods"]:
        if "press" in METHODS[method] or method == DEFAULT_ROW:
            continue
        config = oasis_config(512, **{k: v for k, v in METHODS[method].items() if k not in lm_only})
        if config.selector != "static" and "dense" not in METHODS[method] and "press" not in METHODS[method]:
            assert (config.block_size, config.prefill_window_tokens, config.score_decay, config.summary) == tuple(
                SELECTION.values())
            assert (config.sink_tokens, config.recent_tokens) == (16, 64)


def test_press_specs_build_the_presses_kvpress_registers():
    """Every press row of eval.accuracy names a press constructor kvpress builds (AdaKV wrapping its scorer, the
    expected-attention epsilon passed through); anything else is refused naming the presses there are."""
    _kvpress_hooks_or_skip()
    import kvpress

    from eval._accuracy_methods import METHODS
    from eval.press_baselines import make_press

    model = tiny_model("llama")
    for method, fields in METHODS.items():
        if "press" in fields:
            assert make_press(fields["press"], model) is not None, method
    ada = make_press("AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))", model)
    assert isinstance(ada, kvpress.AdaKVPress) and ada.press.epsilon == 1e-2
    for bad in ("os.system('x')", "AdaKVPress(SnapKVPress(", "NoSuchPress"):
        with pytest.raises(UnsupportedError, match="press"):
            make_press(bad, model)
