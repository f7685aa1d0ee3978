"""`oasis_hf.models`: the dequantized weights of a packaged GGUF are kept and reused (no GGUF in CI: the GGUF
reader is replaced by a tiny random model; saving and reading the converted folder are transformers' own)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import transformers

from oasis_hf import models
from tests._factories import tiny_model


@pytest.fixture
def gguf_reader(monkeypatch):
    """``from_pretrained(..., gguf_file=...)`` returns a tiny Llama and counts the calls; others run for real."""
    real = transformers.AutoModelForCausalLM.from_pretrained
    calls = []

    def from_pretrained(name, *args, **kwargs):
        if "gguf_file" in kwargs:
            calls.append(kwargs["gguf_file"])
            return tiny_model("llama").to(kwargs.get("dtype", torch.float32))
        return real(name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    return calls


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_dequantized_weights_are_kept_per_dtype_and_reused(tmp_path, gguf_reader):
    path = tmp_path / "m" / "m.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF")
    first = models.converted_model(path, torch.bfloat16, "abc")
    assert gguf_reader == ["m.gguf"] and (path.parent / "converted-bfloat16" / "converted-from.txt").is_file()
    again = models.converted_model(path, torch.bfloat16, "abc")
    assert gguf_reader == ["m.gguf"], "the second load must read the kept folder, not the GGUF"
    assert again.dtype == torch.bfloat16 and _same_weights(first, again)
    models.converted_model(path, torch.float32, "abc")  # another dtype: its own folder
    assert len(gguf_reader) == 2 and (path.parent / "converted-float32").is_dir()
    models.converted_model(path, torch.bfloat16, "new-sha")  # the GGUF changed: converted again, the mark updated
    assert len(gguf_reader) == 3
    assert (path.parent / "converted-bfloat16" / "converted-from.txt").read_text().split() == ["m.gguf", "new-sha"]
    assert not list(path.parent.glob("*.partial"))


def test_a_killed_save_is_not_used_and_a_failed_save_still_loads(tmp_path, gguf_reader, monkeypatch, caplog):
    path = tmp_path / "m" / "m.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF")
    (path.parent / "converted-float32").mkdir()  # a folder without its mark: a save that did not finish
    models.converted_model(path, torch.float32, "abc", cache=False)
    assert gguf_reader == ["m.gguf"] and not (path.parent / "converted-float32" / "converted-from.txt").exists()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(models, "_save_dense", full_disk)
    with caplog.at_level(logging.WARNING, logger="oasis_hf.models"):
        model = models.converted_model(path, torch.float32, "abc")
    assert isinstance(model, transformers.PreTrainedModel)
    assert "No space left" in caplog.text and not list(path.parent.glob("*.partial"))


def test_packed_gguf_modules_are_not_kept(tmp_path, monkeypatch, caplog):
    """Where transformers kept GGUF blocks (a matmul kernel was installed) there are no dense weights to save."""

    class GgufLinear(torch.nn.Linear):
        pass

    def from_pretrained(name, *args, **kwargs):
        model = tiny_model("llama")
        model.packed = GgufLinear(2, 2)
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    path = tmp_path / "m" / "m.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF")
    with caplog.at_level(logging.INFO, logger="oasis_hf.models"):
        models.converted_model(path, torch.float32, "abc")
    assert "GgufLinear" in caplog.text and not (path.parent / "converted-float32").exists()


def test_cache_lock_serialises_and_runs_unlocked_where_it_cannot_lock(tmp_path):
    """Two holders of one lock file run one after the other (flock, one open file each); a lock file that cannot
    be created (its folder is a file: a read-only cache, say) does not stop the work."""
    import threading
    import time

    order = []

    def hold(name):
        with models.cache_lock(tmp_path / "x.lock"):
            order.append(f"{name} in")
            time.sleep(0.2)
            order.append(f"{name} out")

    first = threading.Thread(target=hold, args=("a",))
    first.start()
    time.sleep(0.05)
    hold("b")
    first.join()
    assert order == ["a in", "a out", "b in", "b out"]
    (tmp_path / "file").write_text("")
    with models.cache_lock(tmp_path / "file" / "x.lock"):
        order.append("unlocked")
    assert order[-1] == "unlocked"


def test_an_unknown_name_fails_at_once_when_the_hub_cannot_answer(monkeypatch, tmp_path):
    """Neither packaged nor a local folder, with the Hub offline or unreachable: an OasisError naming the packaged
    models (and the close one) before transformers is asked; with the Hub reachable, or for a local folder, the
    name goes to ``from_pretrained``."""
    asked = []

    def from_pretrained(name, **kwargs):
        asked.append(str(name))
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(models.OasisError, match=r"unknown model 'smollm2'.*Did you mean 'smollm2-135m-instruct'\?"
                                                r".*gemma-3-270m, qwen2.5-coder-0.5b-instruct"):
        models.load("smollm2", device="cpu")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=2.0: False)
    with pytest.raises(models.OasisError, match="cannot be reached"):
        models.load("someone/some-model", device="cpu")
    assert asked == []
    with pytest.raises(OSError, match="stop here"):
        models.load(str(tmp_path), device="cpu")  # a local folder: transformers reads it
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=2.0: True)
    with pytest.raises(OSError, match="stop here"):
        models.load("someone/some-model", device="cpu")
    assert asked == [str(tmp_path), "someone/some-model"]


def test_hub_reachable_is_false_offline_and_without_a_route(monkeypatch):
    """The probe: offline variables answer without a connection; an endpoint nothing listens on answers False
    within its timeout."""
    import time

    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    assert models.hub_reachable() is False
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1")  # port 443 on localhost: refused at once
    t0 = time.perf_counter()
    assert models.hub_reachable(timeout=1.0) is False
    assert time.perf_counter() - t0 < 3.0


def _unigram_tokenizer():
    """A Unigram (SentencePiece-style) tokenizer built in memory, as transformers builds one from a GGUF's scores."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import Unigram

    pieces = ["<unk>", "<bos>", "<eos>", "▁The", "▁quick", "▁brown", "▁fox", "▁", "qu", "ick", "The", "fox"]
    pieces += sorted({c for c in models.TOKENIZER_PROBE + "▁" if c not in pieces})
    backend = Tokenizer(Unigram([(p, -float(len(pieces) - i) / 10 if len(p) == 1 else -1.0)
                                 for i, p in enumerate(pieces)], unk_id=0))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<bos>",
                                                eos_token="<eos>")


def test_a_cached_tokenizer_reloads_tokenizing_as_the_fresh_one(tmp_path, monkeypatch):
    """Where the tokenizer's own class rebuilds its vocabulary on load (Gemma 3's: one token per character), the
    cache names transformers' generic class instead, and `load_tokenizer` refuses a cached copy (an older cache)
    whose tokens differ from the probe recorded at save time, rebuilding it from the GGUF."""
    fresh = _unigram_tokenizer()
    ids = fresh(models.TOKENIZER_PROBE)["input_ids"]

    real = transformers.AutoTokenizer.from_pretrained.__func__
    built = []

    def from_pretrained(cls, name, *args, gguf_file=None, **kwargs):
        if gguf_file is not None:  # the GGUF rebuild: count it, hand back the in-memory tokenizer
            built.append(gguf_file)
            return fresh
        tokenizer = real(cls, name, *args, **kwargs)
        config = json.loads((Path(name) / "tokenizer_config.json").read_text())
        if config.get("tokenizer_class") != "PreTrainedTokenizerFast":  # its own class rebuilds it: per character
            tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=_per_character(tokenizer))
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(from_pretrained))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    first = models.load_tokenizer(gguf)
    assert first(models.TOKENIZER_PROBE)["input_ids"] == ids and built == ["model.gguf"]
    saved = json.loads((tmp_path / "tokenizer" / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "PreTrainedTokenizerFast"
    again = models.load_tokenizer(gguf)  # from the cache: no rebuild
    assert again(models.TOKENIZER_PROBE)["input_ids"] == ids and built == ["model.gguf"]
    probe = tmp_path / "tokenizer" / "oasis_probe.json"
    probe.write_text(json.dumps({"input_ids": [0]}))  # a cache that no longer matches what it recorded
    assert models.load_tokenizer(gguf)(models.TOKENIZER_PROBE)["input_ids"] == ids and len(built) == 2


def _per_character(tokenizer):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split

    vocab = {tok: i for i, tok in enumerate(sorted(tokenizer.get_vocab()))}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Split("", behavior="isolated")
    return backend


@pytest.mark.parametrize("name", sorted(models.REGISTRY))
def test_each_packaged_models_cached_tokenizer_tokenizes_like_the_gguf(name, tmp_path):
    """The real thing, where the model is assembled (CI does not download them: `oasis-hf models assemble NAME`):
    the tokenizer rebuilt from the GGUF, cached and reloaded, gives the same ids on a varied text."""
    path = models.assembled_path(name)
    if not path.is_file():
        pytest.skip(f"{name} is not assembled here (oasis-hf models assemble {name})")
    pytest.importorskip("gguf", reason="reading a GGUF needs the gguf package (pip install -e '.[models]')")
    fresh = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert models.cache_tokenizer(fresh, tmp_path / "tokenizer")
    cached = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    text = models.TOKENIZER_PROBE + " " + " ".join(f"word{i} {i * 37}" for i in range(200))
    assert cached(text)["input_ids"] == fresh(text)["input_ids"]
