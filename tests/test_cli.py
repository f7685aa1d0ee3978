"""The `oasis-hf` command line."""

import subprocess
import sys

import pytest

from oasis_hf.cli import main, passkey_prompt
from tests._factories import tiny_model, tiny_tokenizer, words


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def test_generate_on_a_tiny_model(tiny_dir, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(words(200, seed=9))
    rc = main(["generate", "--model", str(tiny_dir), "--prompt-file", str(prompt), "--device", "cpu",
               "--budget", "128", "--block-size", "16", "--max-new-tokens", "8", "--selector", "lookahead"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert len(out.split()) == 8  # eight word tokens
    assert "tokens/s" in err and "KV on the model's device" in err and "GPU KV" not in err and "prefetch late" in err


def test_generate_with_chunked_prefill_prints_the_same_text(tiny_dir, tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(words(200, seed=9))
    args = ["generate", "--model", str(tiny_dir), "--prompt-file", str(prompt), "--device", "cpu", "--budget", "128",
            "--block-size", "16", "--max-new-tokens", "8", "--selector", "lookahead", "--prompt-lookup", "0"]
    texts = []
    for extra in ([], ["--prefill-chunk", "100"]):  # chunks of 100 and 101 tokens: both take the exact path
        assert main(args + extra) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1]


def test_help_explains_each_command():
    out = subprocess.run([sys.executable, "-m", "oasis_hf.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("generate", "demo", "models"):
        assert command in out.stdout
    gen = subprocess.run([sys.executable, "-m", "oasis_hf.cli", "generate", "--help"], capture_output=True,
                         text=True, check=True)
    assert "--budget" in gen.stdout and "--prompt-lookup" in gen.stdout


def test_help_imports_neither_torch_nor_transformers():
    """`oasis-hf --help` and each command's help answer from argparse alone: the heavy imports wait for a command
    to run (they take seconds). Defaults shown are the ones used (the demo's 12 new tokens)."""
    code = ("import sys, contextlib, io\n"
            "from oasis_hf.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['demo', '--help'], ['models', '--help']):\n"
            "    out = io.StringIO()\n"
            "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "    print(out.getvalue())\n"
            "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    demo = out.split("usage: oasis-hf demo")[1].split("usage:")[0]
    assert "tokens to generate (default 12)" in " ".join(demo.split())


def test_bad_arguments_fail_with_a_clear_message(tiny_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--selector", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    rc = main(["generate", "--model", str(tiny_dir), "--prompt", "w1 w2", "--device", "cpu", "--budget", "100"])
    assert rc == 1
    assert "budget_tokens=100 is invalid" in capsys.readouterr().err
    rc = main(["models", "assemble", "no-such-model"])
    assert rc == 1
    assert "unknown packaged model" in capsys.readouterr().err


def test_models_list(capsys):
    assert main(["models", "list"]) == 0
    assert "smollm2-135m-instruct (default)" in capsys.readouterr().out


def test_passkey_prompt_is_varied_and_holds_the_key():
    tok = tiny_tokenizer()
    prompt, key = passkey_prompt(300, tok, seed=1)
    assert f"pass key is {key}" in prompt
    sentences = prompt.split(".")
    assert len(set(sentences)) > 0.8 * len(sentences)  # not one repeated sentence


def test_the_package_does_not_run_the_lab(capsys):
    """Benchmarks and evaluations live in eval/ of a checkout (``python -m eval.bench_floor``); the installed
    command has no subcommand that imports them."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
