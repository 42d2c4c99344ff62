"""Which GEMM runs a projection of a small batch (<= 8 rows, decode at small batch) on the fused GPU path.

flashinfer's ``tinygemm_bf16`` (TensorRT-LLM's tinygemm2, sm90+, bf16) streams one 16-row weight tile
per 384-thread block through 16 TMA pipeline stages and reads each weight once for up to 8 rows. It
has no split-K, so no reduce kernel after it, and with programmatic dependent launch its weight loads
start while the kernel before it finishes (only its activation loads wait for that kernel).

Measured on an H200, Llama-3.1-8B shapes (bench/results/GPU_NOTES.md, session 13):

* alone at M = 1-8 (``python -m bench.gpu small_gemm``), µs per GEMM, cuBLAS against tinygemm with
  PDL: o 12.5-12.7 against 11.0-11.2; down 31.3-32.0 against 29.1-29.6; q/k/v 15.3-15.8 against
  15.7 at M=8; gate/up 56.7 against 69.4 at M=1 (20 % slower: 1792 one-block-per-SM programs);
* graph decode (``python -m bench.gpu decode``) with o and down on tinygemm: -0.08 to -0.13 ms a
  step at B = 1-8 against cuBLAS, in every cell of four runs (B=1 ctx 1k 4.85 -> 4.72-4.73 ms); all
  four projections on tinygemm: +0.17 ms (gate/up).

So o and down take tinygemm by default; env ``HALFMOON_SMALL_M_GEMM`` (:func:`small_m_gemm_mode`) and
``HALFMOON_SMALL_M_GEMM_ON`` (:func:`small_m_projections`) override.
"""

from __future__ import annotations

import os

import torch

SMALL_M_ROWS = 8  # tinygemm's batch tile: up to 8 rows read each weight once
SMALL_M_MODES = ("auto", "cublas", "tinygemm", "tinygemm_nopdl")
PROJECTIONS = ("qkv", "o", "gate_up", "down")
DEFAULT_SMALL_M_PROJECTIONS = ("o", "down")  # where tinygemm beat cuBLAS (GPU_NOTES session 13)


def small_m_gemm_mode(tinygemm_available: bool = True, dtype: torch.dtype | None = None) -> str:
    """The GEMM for batches of <= :data:`SMALL_M_ROWS` rows, from env ``HALFMOON_SMALL_M_GEMM``:
    "cublas" (``F.linear``), "tinygemm" (flashinfer's tinygemm with programmatic dependent
    launch), "tinygemm_nopdl", or "auto" (the default: tinygemm when ``tinygemm_available`` and the
    model ``dtype`` is bfloat16 or not given, else cublas). Raises ValueError on any other value, or
    when tinygemm is asked for but is not available or the model is not bfloat16."""
    mode = os.environ.get("HALFMOON_SMALL_M_GEMM", "auto")
    if mode not in SMALL_M_MODES:
        raise ValueError(f"HALFMOON_SMALL_M_GEMM={mode!r}: expected one of {SMALL_M_MODES}")
    bf16 = dtype is None or dtype == torch.bfloat16
    if mode == "auto":
        return "tinygemm" if tinygemm_available and bf16 else "cublas"
    if mode.startswith("tinygemm") and not tinygemm_available:
        raise ValueError(f"HALFMOON_SMALL_M_GEMM={mode!r}: tinygemm needs an sm90+ GPU and a flashinfer with it")
    if mode.startswith("tinygemm") and not bf16:
        raise ValueError(f"HALFMOON_SMALL_M_GEMM={mode!r}: tinygemm needs a bfloat16 model, not {dtype}")
    return mode


# compute capabilities flashinfer builds tinygemm2 for (its mm_bf16 "tinygemm" requirement)
TINYGEMM_CAPABILITIES = ((9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1))


def tinygemm_available(device: torch.device, flashinfer) -> bool:
    """flashinfer has ``gemm.tinygemm_bf16`` and ``device`` is a GPU it is built for (sm90 and up)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device) in TINYGEMM_CAPABILITIES
            and hasattr(getattr(flashinfer, "gemm", None), "tinygemm_bf16"))


def small_m_projections() -> frozenset[str]:
    """Which projections the small-batch GEMM takes, from env ``HALFMOON_SMALL_M_GEMM_ON`` (a comma
    list of :data:`PROJECTIONS`, empty for none; default :data:`DEFAULT_SMALL_M_PROJECTIONS`). Raises
    ValueError naming an unknown one."""
    env = os.environ.get("HALFMOON_SMALL_M_GEMM_ON", ",".join(DEFAULT_SMALL_M_PROJECTIONS))
    names = [n.strip() for n in env.split(",") if n.strip()]
    bad = [n for n in names if n not in PROJECTIONS]
    if bad:
        raise ValueError(f"HALFMOON_SMALL_M_GEMM_ON: unknown projection(s) {bad}; expected some of {PROJECTIONS}")
    return frozenset(names)


def takes_small_m_gemm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x [T, K] @ weight[N, K].T`` fits tinygemm: T <= SMALL_M_ROWS, bf16, both
    contiguous, N % 16 == 0 (its weight tile), K % 64 == 0 (its TMA box)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= SMALL_M_ROWS and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and x.is_contiguous() and weight.is_contiguous()
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 64 == 0 and x.shape[1] == weight.shape[1])
