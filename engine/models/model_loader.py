"""Build a model and fill its weights: from a Hugging Face directory (``*.safetensors``) or random
(``load_format="dummy"``, a shape from ``engine/configs/<name>.json``, for benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.models.llama import LlamaForCausalLM
from engine.models.rotary import inv_freq


def resolve_model_config(model: str, load_format: str = "auto") -> tuple[ModelConfig, Path | None]:
    """(config, HF dir or None for dummy). Raises InvalidRequestError(field="model"|"load_format")."""
    if load_format == "dummy":
        p = Path(model).expanduser()
        if p.is_dir() and (p / "config.json").exists():
            return ModelConfig.from_dir(p), None
        return ModelConfig.named(model), None
    if load_format != "auto":
        raise InvalidRequestError("load_format", f"unknown load format {load_format!r}; use 'auto' or 'dummy'")
    from engine.model_store import ModelNotFoundError, resolve_model

    try:
        path = resolve_model(model)
    except ModelNotFoundError as e:
        raise InvalidRequestError("model", str(e).removeprefix("model: ")) from None
    return ModelConfig.from_dir(path), path


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """An uninitialised model of ``cfg`` on ``device`` (weights garbage until loaded)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    model.model.rotary.inv_freq = inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def checkpoint_slices(path: Path, wanted) -> Iterator[tuple[str, object]]:
    """(name, lazy safetensors slice) of every tensor in ``path/*.safetensors`` whose name is in
    ``wanted`` (others, e.g. rotary inv_freq saved by old checkpoints, are skipped); ``slice[:]``
    reads the whole tensor, ``slice[a:b]`` a part of it.

    Raises RuntimeError when ``path`` holds no ``*.safetensors``.
    """
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"no *.safetensors in {path}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name in wanted:
                    yield name, st.get_slice(name)


def load_hf_weights(model: LlamaForCausalLM, path: Path) -> None:
    """Copy every tensor of ``path/*.safetensors`` into the parameter of the same name.

    Raises RuntimeError listing parameters the checkpoint lacks (``lm_head`` may be tied).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    seen = set()
    for name, sl in checkpoint_slices(path, params):
        with torch.no_grad():
            params[name].copy_(sl[:])
        seen.add(name)
    missing = set(params) - seen
    if model.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise RuntimeError(f"checkpoint {path} lacks {sorted(missing)[:8]}")


def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights: normal(0, 0.02) for matrices and biases, ones for norms (deterministic by seed)."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def load_model(model: str, load_format: str, dtype: torch.dtype, device: torch.device,
               seed: int = 0) -> tuple[LlamaForCausalLM, Path | None]:
    """Build and fill a model; returns (model, HF dir or None for dummy weights)."""
    cfg, path = resolve_model_config(model, load_format)
    m = build_model(cfg, dtype, device)
    if path is None:
        init_dummy_weights(m, seed)
    else:
        load_hf_weights(m, path)
    return m, path
