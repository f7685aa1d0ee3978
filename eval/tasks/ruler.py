"""RULER-style synthetic long-context tasks, generated locally with a fixed seed (no downloads).

After Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?" (2024),
https://arxiv.org/abs/2404.06654. Each sample is ``{"id", "task", "length", "input", "outputs", "metric"}``: the
prompt (about ``length`` tokens of the given tokenizer), the strings a correct answer contains, and how to score.

Tasks:

- ``niah_single``   one key with a 7-digit value hidden in varied filler; return the value.
- ``niah_multikey`` four keys, each with a value; return the value of one of them (the others distract).
- ``niah_multivalue`` one key stated four times with different values; return all four.
- ``niah_multiquery`` four keys; return the values of all four.
- ``vt``            variable tracking: chains of ``VAR A = 12345``, ``VAR B = VAR A``; name every variable that
                    holds the value.
- ``cwe``           common words: a numbered word list where ten words repeat more often; name those ten.
- ``fwe``           frequent words: coded words with Zipf frequencies; name the three most frequent.
- ``qa``            questions over synthetic documents (fact sentences among filler documents).
- ``recall_list``   short reasoning with a long answer: list eight hidden values in the order they appear.

The filler is built from templated sentences with varied subjects, verbs, objects and times, never one repeated
sentence. Scoring (``metric``): ``all`` is the share of expected strings found in the prediction (RULER's
string_match_all), scaled to 0..100 by the harness aggregation.
"""

from __future__ import annotations

import json
import random
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

_SUBJECTS = ["The harbour master", "A tired engineer", "Our neighbour", "The old librarian", "A travelling cook",
             "The night nurse", "Every gardener", "The young pilot", "A quiet student", "The museum guard",
             "The baker's daughter", "A retired sailor", "The new teacher", "Two cyclists", "The town clerk"]
_VERBS = ["repaired", "painted", "described", "forgot", "carried", "measured", "admired", "sold", "found", "cleaned",
          "borrowed", "photographed", "counted", "wrapped", "returned"]
_OBJECTS = ["a blue bicycle", "the broken clock", "three wooden chairs", "a map of the coast", "the kitchen window",
            "an umbrella", "the garden fence", "a box of letters", "the station bench", "a small lantern",
            "a jar of honey", "the ferry timetable", "a pair of boots", "the church bell", "an old radio"]
_TIMES = ["on Monday", "before dawn", "after the storm", "last winter", "during lunch", "in the evening",
          "at the market", "near the river", "after school", "on the night train"]
_KEYS = ["amber-falcon", "quiet-harbor", "silver-maple", "rapid-otter", "golden-ridge", "misty-valley",
         "crimson-lake", "hidden-orchard", "frozen-canyon", "lucky-meadow", "brave-comet", "gentle-breeze",
         "wild-cedar", "bright-lantern", "velvet-storm", "iron-willow"]
_WORDS = ["apple", "river", "candle", "mirror", "garden", "pencil", "window", "rocket", "blanket", "castle", "forest",
          "button", "ladder", "pillow", "basket", "compass", "whistle", "lantern", "teapot", "violin", "anchor",
          "saddle", "marble", "feather", "helmet", "orchard", "pebble", "quarry", "ribbon", "tunnel", "wagon",
          "zipper", "meadow", "harbor", "island", "jacket", "kettle", "lemon", "magnet", "needle"]
_CITIES = ["Norhaven", "Belmoor", "Astravel", "Kettering Cross", "Lowmarsh", "Quillby", "Ravensholt", "Tarnwick"]
_THINGS = ["museum", "observatory", "bridge", "library", "lighthouse", "opera house", "railway station", "market hall"]


def filler_sentences(rng: random.Random, count: int) -> list[str]:
    """`count` varied filler sentences."""
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TIMES)}."
            for _ in range(count)]


class _Budget:
    """Counts tokens of sentences with a tokenizer (sentence by sentence, so a 30k prompt costs 30k tokens once)."""

    def __init__(self, tokenizer, length: int) -> None:
        self.tokenizer, self.length = tokenizer, length

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def fill(self, rng: random.Random, reserved: str) -> list[str]:
        """Filler sentences that, with the `reserved` text, come to about `length` tokens."""
        room = self.length - self.count(reserved)
        out: list[str] = []
        used = 0
        while used < room:
            sentence = filler_sentences(rng, 1)[0]
            used += self.count(" " + sentence)
            out.append(sentence)
        return out


def _insert(rng: random.Random, filler: list[str], needles: list[str]) -> str:
    """Place the needles at random depths (10%..90%) of the filler, in order."""
    slots = sorted(rng.randint(len(filler) // 10, max(len(filler) // 10, 9 * len(filler) // 10)) for _ in needles)
    pieces = list(filler)
    for offset, (slot, needle) in enumerate(zip(slots, needles, strict=True)):
        pieces.insert(slot + offset, needle)
    return " ".join(pieces)


def _value(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _niah(rng, budget, kind: str):
    keys = rng.sample(_KEYS, 4)
    if kind == "single":
        pairs = [(keys[0], _value(rng))]
        asked = [pairs[0]]
    elif kind == "multikey":
        pairs = [(k, _value(rng)) for k in keys]
        asked = [pairs[rng.randrange(4)]]
    elif kind == "multivalue":
        pairs = [(keys[0], _value(rng)) for _ in range(4)]
        asked = pairs
    else:  # multiquery
        pairs = [(k, _value(rng)) for k in keys]
        asked = pairs
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in pairs]
    rng.shuffle(needles)
    names = sorted({k for k, _ in asked})
    question = (f"What are all the special magic numbers for {', '.join(names)} mentioned in the text above? "
                "Answer with the numbers only.\nAnswer:")
    head = "Some special magic numbers are hidden in the following text. Memorize them.\n"
    text = _insert(rng, budget.fill(rng, head + " ".join(needles) + "\n" + question), needles)
    return head + text + "\n" + question, [v for _, v in asked]


def _vt(rng, budget):
    value = str(rng.randint(10000, 99999))
    names = [f"{rng.choice('ABCDEFGHJKLMNPQRSTUVWXYZ')}{rng.randint(100, 999)}" for _ in range(5)]
    names = list(dict.fromkeys(names))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)]
    question = (f"Find every variable that is assigned the value {value}, directly or through other variables. "
                "Answer with the variable names only.\nAnswer:")
    head = "Memorize and track the chain of variable assignments hidden in the following text.\n"
    text = _insert(rng, budget.fill(rng, head + " ".join(chain) + "\n" + question), chain)
    return head + text + "\n" + question, names


def _cwe(rng, budget):
    common = rng.sample(_WORDS, 10)
    rare = [w for w in _WORDS if w not in common]
    head = "Below is a numbered list of words. Some words repeat more often than the others.\n"
    question = "What are the 10 most common words in the list above? Answer with the words only.\nAnswer:"
    room = budget.length - budget.count(head + question)

    def build(entries: int) -> str:
        each_rare = max(1, entries // (len(rare) + 30))  # common words appear three times as often as rare ones
        each_common = (entries - each_rare * len(rare)) // len(common)
        words = common * each_common + rare * each_rare
        random.Random(entries).shuffle(words)
        return " ".join(f"{i}. {w}" for i, w in enumerate(words, 1))

    entries = max(90, room // budget.count(" 1234. " + rare[0]))
    entries = max(90, int(entries * room / budget.count(build(entries))))  # one correction for the number widths
    return head + build(entries) + "\n" + question, common


def _fewest_chunks(rng, draw, budget, room: int) -> list[str]:
    """The words of the fewest chunks ``draw(rng)`` (a list of words each) whose joined text reaches `room` tokens,
    with `rng` left where drawing them chunk by chunk leaves it.

    Counting the whole text after every chunk is quadratic in the length (about 10 minutes for 50 samples of
    ``fwe`` at 64k), so a copy of the generator draws ahead and the count is found by doubling, then bisection (the
    token count grows with every chunk); then `rng` draws exactly those chunks.
    """
    probe = random.Random()
    probe.setstate(rng.getstate())
    chunks: list[list[str]] = []

    def fills(n: int) -> bool:
        while len(chunks) < n:
            chunks.append(draw(probe))
        return budget.count(" ".join(w for chunk in chunks[:n] for w in chunk)) >= room

    low, high = 0, 1  # fills(low) is False (no text), fills(high) is searched for
    while not fills(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fills(mid) else (mid, high)
    return [w for _ in range(high) for w in draw(rng)]


def _fwe(rng, budget):
    vocab = [f"{rng.choice('bcdfghjklmnpqrstvwxz')}{rng.choice('aeiou')}{rng.choice('bcdfghjklmnpqrstvwxz')}"
             f"{rng.choice('aeiou')}{rng.choice('bcdfghjklmnpqrstvwxz')}" for _ in range(40)]
    vocab = list(dict.fromkeys(vocab))
    head = "Read the following coded text and keep track of how often each coded word appears.\n"
    question = "What are the 3 most frequently appearing coded words in the text above? Answer with the words only.\n" \
               "Answer:"
    weights = [1.0 / (rank + 1) ** 1.2 for rank in range(len(vocab))]
    room = budget.length - budget.count(head + question)
    words = _fewest_chunks(rng, lambda r: r.choices(vocab, weights=weights, k=50), budget, room)
    counts = Counter(words).most_common()
    # answer: the top 3, made unambiguous (the 4th is strictly less frequent)
    while counts[2][1] == counts[3][1]:
        words.append(counts[2][0])
        counts = Counter(words).most_common()
    rng.shuffle(words)
    return head + " ".join(words) + "\n" + question, [w for w, _ in counts[:3]]


def _qa(rng, budget):
    facts = []
    for _ in range(6):
        city, thing = rng.choice(_CITIES), rng.choice(_THINGS)
        facts.append((city, thing, str(rng.randint(1700, 1999))))
    facts = list({(c, t): (c, t, y) for c, t, y in facts}.values())
    city, thing, year = rng.choice(facts)
    docs = [f"Document: the {t} of {c} was opened in the year {y}." for c, t, y in facts]
    question = f"In which year was the {thing} of {city} opened? Answer with the year only.\nAnswer:"
    head = "Answer the question using the documents below.\n"
    text = _insert(rng, budget.fill(rng, head + " ".join(docs) + "\n" + question), docs)
    return head + text + "\n" + question, [year]


def _recall_list(rng, budget):
    keys = rng.sample(_KEYS, 8)
    values = [_value(rng) for _ in keys]
    needles = [f"Entry for {k}: {v}." for k, v in zip(keys, values, strict=True)]
    question = ("List the eight entry numbers from the text above in the order they appear, one per line, as "
                "'key: number'.\nAnswer:\n")
    head = "Eight entries are hidden in the following text.\n"
    text = _insert(rng, budget.fill(rng, head + " ".join(needles) + "\n" + question), needles)
    return head + text + "\n" + question, values


TASKS: dict[str, tuple[Callable, int]] = {  # name -> (builder, answer tokens to generate)
    "niah_single": (lambda r, b: _niah(r, b, "single"), 32),
    "niah_multikey": (lambda r, b: _niah(r, b, "multikey"), 32),
    "niah_multivalue": (lambda r, b: _niah(r, b, "multivalue"), 64),
    "niah_multiquery": (lambda r, b: _niah(r, b, "multiquery"), 64),
    "vt": (_vt, 48),
    "cwe": (_cwe, 96),
    "fwe": (_fwe, 32),
    "qa": (_qa, 16),
    "recall_list": (_recall_list, 160),
}


def generate(task: str, length: int, num_samples: int, tokenizer, seed: int = 0) -> list[dict]:
    """`num_samples` samples of `task` at about `length` tokens of `tokenizer`; deterministic in all arguments."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    builder, _ = TASKS[task]
    budget = _Budget(tokenizer, length)
    samples = []
    for index in range(num_samples):
        rng = random.Random(zlib.crc32(f"{task}/{length}/{seed}/{index}".encode()))
        text, outputs = builder(rng, budget)
        samples.append({"id": index, "task": task, "length": length, "input": text, "outputs": outputs,
                        "metric": "all"})
    return samples


def string_match_all(prediction: str, outputs: list[str]) -> float:
    """Share of expected strings that occur in the prediction (case-insensitive), 0..1."""
    low = prediction.lower()
    return sum(o.lower() in low for o in outputs) / len(outputs)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval hook: score one generation; reported as ``score`` (0..100)."""
    return {"score": 100.0 * string_match_all(results[0], doc["outputs"])}


_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{input}}}}"
doc_to_target: "{{{{outputs | join(', ')}}}}"
process_results: !function utils.process_results
generation_kwargs:
  max_gen_toks: {max_new}
  do_sample: false
  until: []
metric_list:
  - metric: score
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

_GROUP = """group: {group}
task:
{tasks}
aggregate_metric_list:
  - metric: score
    aggregation: mean
    weight_by_size: false
metadata:
  version: 1.0
"""


def write_suite(out_dir: str | Path, tokenizer, lengths: list[int], num_samples: int, tasks: list[str] | None = None,
                seed: int = 0, group: str = "oasis_ruler") -> Path:
    """Write JSONL data and lm-eval YAMLs (``<group>_<task>_<length>`` tasks and a ``<group>`` group) to `out_dir`.

    Use it with ``lm_eval --include_path out_dir --tasks <group>``.
    """
    out = Path(out_dir)
    (out / "data").mkdir(parents=True, exist_ok=True)
    names = []
    for task in tasks or list(TASKS):
        for length in lengths:
            name = f"{group}_{task}_{length}"
            data = out / "data" / f"{name}.jsonl"
            with data.open("w") as fh:
                for sample in generate(task, length, num_samples, tokenizer, seed):
                    fh.write(json.dumps(sample) + "\n")
            (out / f"{name}.yaml").write_text(_YAML.format(name=name, data=data.resolve(), max_new=TASKS[task][1]))
            names.append(name)
    (out / "utils.py").write_text("from eval.tasks.ruler import process_results  # noqa: F401\n")
    (out / f"{group}.yaml").write_text(_GROUP.format(group=group, tasks="\n".join(f"  - {n}" for n in names)))
    return out
