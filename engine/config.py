"""Model and engine configuration.

``ModelConfig`` is read from a Hugging Face ``config.json`` (transformers 4.x ``rope_theta`` /
``rope_scaling`` or 5.x ``rope_parameters``); ``EngineConfig`` holds the runtime knobs (page size,
KV memory budget, dtype, device, threads, batch limits, chunked prefill, radix cache switch).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from engine.scheduler.retraction import MAX_RETRACTIONS

CONFIGS_DIR = Path(__file__).parent / "configs"

# architectures (HF "architectures"[0] or model_type) served by engine/models/llama.py
SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclasses.dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (one class covers Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2)."""

    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3"|"linear"|"default", ...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype  # the checkpoint's dtype
    sliding_window: int | None = None  # recorded; the torch backend attends to the full context

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = None
        for a in archs:
            if a in SUPPORTED_ARCHS:
                arch = SUPPORTED_ARCHS[a]
        if arch is None:
            mt = d.get("model_type")
            if mt in SUPPORTED_ARCHS.values():
                arch = mt
            else:
                raise ValueError(f"model: unsupported architecture {archs or mt!r}; supported: {sorted(SUPPORTED_ARCHS)}")
        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] not in ("default", "linear", "llama3"):
                raise ValueError(f"model: rope_type {scaling['rope_type']!r} is not supported")
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        heads = d["num_attention_heads"]
        dt = d.get("dtype") or d.get("torch_dtype") or "float32"
        use_sw = d.get("use_sliding_window", True)
        return cls(
            arch=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", arch == "qwen2"),
            qk_norm=arch == "qwen3",
            eos_token_ids=eos,
            bos_token_id=d.get("bos_token_id"),
            dtype=getattr(torch, dt) if isinstance(dt, str) else dt,
            sliding_window=d.get("sliding_window") if use_sw else None,
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    @classmethod
    def named(cls, name: str) -> "ModelConfig":
        """A shipped shape from ``engine/configs/<name>.json`` (for ``load_format="dummy"``).

        Raises: InvalidRequestError(field="model") for an unknown name.
        """
        from engine.errors import InvalidRequestError

        p = CONFIGS_DIR / f"{name}.json"
        if not p.exists():
            known = sorted(x.stem for x in CONFIGS_DIR.glob("*.json"))
            raise InvalidRequestError("model", f"unknown model shape {name!r}; known: {known}")
        return cls.from_dict(json.loads(p.read_text()))


class ContextCapError(ValueError):
    """A ``--max-context`` the model cannot serve (<= 0, or above its window)."""


def served_context(requested: int | None, window: int) -> int:
    """The context a server serves: ``requested`` (vLLM's ``--max-model-len``, SGLang's
    ``--context-length``) or, when None, the model's own ``window`` (``max_position_embeddings``),
    in tokens (prompt + completion).

    Raises:
        ContextCapError: ``requested`` is <= 0 or above ``window`` (RoPE past the trained window,
            and a row longer than the model could attend).
    """
    if requested is None:
        return window
    if requested <= 0:
        raise ContextCapError(f"--max-context must be > 0, got {requested}")
    if requested > window:
        raise ContextCapError(f"--max-context {requested} is above the model's context window of {window} tokens")
    return requested


def _parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype: unknown dtype {dtype!r}; one of {sorted(table)}")
    return table[dtype]


@dataclasses.dataclass
class EngineConfig:
    """Runtime knobs.

    kv_memory: KV pool budget: an int/str of bytes (``"2GiB"`` ok) or a float fraction in (0, 1] of
        the device's free memory (CPU: ``MemAvailable``). ``num_pages`` overrides it when set.
    page_size: tokens per KV page (tests use 1, 4, 16).
    torch_threads: intra-op threads; None -> 1 when ``workers_on_host > 1``, else torch's default.
    max_running_requests: request rows in ``req_to_token`` (also the running-batch cap).
    max_context: tokens per request row (default: the model's ``max_position_embeddings``).
    chunked_prefill_size: max prompt tokens per extend batch (a longer prompt is split).
    max_retractions: a request preempted this often is pinned: not chosen again while another
        running request can be (``engine.scheduler.retraction.pick_victim``); >= 0.
    kv_layout: ``"page_major"`` (all layers' K/V of a page contiguous: a page run moves in one
        transfer put) or ``"layer_major"`` (one buffer per layer per K/V); see engine/kvcache/kv_pool.py.
        Prefill and decode workers must use the same one.
    tp_size: tensor-parallel ranks (``engine.distributed``): this process is rank 0 and starts the
        others; 1 = no tensor parallelism.
    tp_timeout_s: bound on every tensor-parallel collective and on forming the group (seconds).
    fused_ops: one GEMM for q/k/v and one for gate/up (``engine/fused_ops.py`` on CUDA bf16/fp16 with
        flashinfer, ``engine/torch_fused_ops.py`` on every other device and dtype).
    cpu_linear: ``"packed"``, ``"onednn"`` or ``"torch"`` (``engine/models/cpu_linear.py``): how a float32 CPU
        model with ``fused_ops`` on runs its GEMMs (other devices and dtypes have no packed path and
        always run ``F.linear``); any other value is a ValueError naming ``cpu_linear``.
    """

    model: str = "smollm2-135m-instruct"
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights, named shape)
    dtype: str | torch.dtype = "float32"
    device: str = "cpu"
    page_size: int = 16
    kv_memory: int | float | str = 0.1
    num_pages: int | None = None
    max_running_requests: int = 64
    max_context: int | None = None
    chunked_prefill_size: int = 2048
    max_retractions: int = MAX_RETRACTIONS
    disable_radix_cache: bool = False
    torch_threads: int | None = None
    workers_on_host: int = 1
    attention_backend: str = "auto"  # "auto" (flashinfer on CUDA bf16/fp16, cpu_paged on CPU when built, else torch_paged) | "torch" | "torch_paged" | "cpu_paged" | "flashinfer"
    seed: int = 0  # dummy weights
    cuda_graph: bool = True  # capture decode batches in CUDA graphs (CUDA + flashinfer only)
    cuda_graph_max_bs: int | None = None  # largest captured decode batch (default max_running_requests)
    fused_ops: bool = True  # fused qkv/gate_up GEMMs: flashinfer norm/rope/silu on CUDA bf16/fp16, torch ops elsewhere
    cpu_linear: str = "packed"  # float32 CPU GEMMs: "packed" (small-M kernel + oneDNN) | "onednn" | "torch" (F.linear)
    kv_layout: str = "page_major"  # KV pool memory layout: "page_major" | "layer_major" (engine/kvcache/kv_pool.py)
    tp_size: int = 1  # tensor-parallel ranks (engine/distributed/)
    tp_timeout_s: float = 30.0

    def to_json(self) -> str:
        """This config as JSON (the dtype by name), for ``from_json`` in another process."""
        d = dataclasses.asdict(self)
        d["dtype"] = str(self.torch_dtype).removeprefix("torch.")
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> "EngineConfig":
        return cls(**json.loads(text))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _parse_dtype(self.dtype)

    def resolved_threads(self) -> int | None:
        if self.torch_threads is not None:
            return self.torch_threads
        return 1 if self.workers_on_host > 1 else None

    def apply_threads(self) -> None:
        """Set torch's intra-op thread count for this process (see ``resolved_threads``)."""
        n = self.resolved_threads()
        if n is not None and n > 0:
            torch.set_num_threads(n)


def parse_bytes(v: int | float | str) -> int | float:
    """``"2GiB"``/``"512MB"``/``"1073741824"`` -> bytes (int); a float in (0, 1] stays a fraction."""
    if isinstance(v, (int, float)):
        return v
    s = v.strip()
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    low = s.lower()
    for u, m in units.items():
        if low.endswith(u):
            return int(float(low[: -len(u)]) * m)
    x = float(s)
    return x if (0 < x <= 1 and "." in s) else int(x)
