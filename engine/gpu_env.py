"""The GPU path's env switches, checked once when a model runner starts, before anything is loaded.

Each switch tunes one part of the CUDA path, and each part runs only in some engines:

====================================================  ==========================================
switch                                                takes effect in
====================================================  ==========================================
``HALFMOON_SMALL_M_GEMM``, ``_ON``                    flashinfer's fused ops (CUDA, bf16/fp16,
``HALFMOON_FUSED_ROPE_STORE``                         ``fused_ops`` on, flashinfer installed)
``HALFMOON_TUNED_GEMM``, ``_ROWS``, ``_ON``, ``_CACHE``  those fused ops inside CUDA-graph decode
``HALFMOON_DECODE_GRAPH_BLAS``, ``_DECODE_ATTN``,     CUDA-graph decode (``cuda_graph`` on and the
``HALFMOON_DECODE_PDL``                               flashinfer attention backend; ``_PDL``: some
                                                      bucket on the split-KV kernel)
``HALFMOON_FLASHINFER_EXTEND``, ``_RAGGED``,           the flashinfer attention backend
``_PREFILL``, ``_DECODE_TENSOR_CORES``
====================================================  ==========================================

:func:`check_gpu_env` first validates every value (each module's reader raises ValueError naming
its variable), then raises ValueError naming a switch that is set but would have no effect in this
engine: a CPU or float32 engine, ``cuda_graph`` or ``fused_ops`` off, another attention backend, or
a sub-switch of a part that is off (``HALFMOON_TUNED_GEMM_ROWS`` with ``HALFMOON_TUNED_GEMM`` off,
``HALFMOON_SMALL_M_GEMM_ON`` with ``HALFMOON_SMALL_M_GEMM=cublas``). A setting the engine accepts
is a setting it honours; the rest is an error at start, not a silent no-op found in a benchmark.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from engine.cuda_graph_runner import decode_attention, decode_pdl, graph_blas
from engine.small_m_gemm import small_m_gemm_mode, small_m_projections
from engine.tuned_gemm import tuned_cache, tuned_gemm_backend, tuned_projections, tuned_rows

TUNED_SUB_SWITCHES = ("HALFMOON_TUNED_GEMM_ROWS", "HALFMOON_TUNED_GEMM_ON", "HALFMOON_TUNED_GEMM_CACHE")
FLASHINFER_SWITCHES = ("HALFMOON_FLASHINFER_EXTEND", "HALFMOON_FLASHINFER_RAGGED", "HALFMOON_FLASHINFER_PREFILL",
                       "HALFMOON_FLASHINFER_DECODE_TENSOR_CORES")


@dataclass(frozen=True)
class GpuPaths:
    """Which parts of the CUDA path an engine runs: ``flashinfer_ops`` (engine.fused_ops),
    ``graphs`` (engine.cuda_graph_runner), ``flashinfer_attention`` (the flashinfer backend)."""

    flashinfer_ops: bool
    graphs: bool
    flashinfer_attention: bool

    @classmethod
    def of(cls, device: torch.device, dtype: torch.dtype, fused_ops: bool, cuda_graph: bool,
           attention_backend: str) -> "GpuPaths":
        """The parts an engine with these settings runs (``attention_backend`` as configured: "auto"
        is flashinfer exactly where :func:`engine.attention.resolve_backend_name` picks it, a CUDA
        bf16/fp16 engine with flashinfer installed); mirrors ModelRunner's own choices."""
        cuda_half = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        flashinfer = cuda_half and importlib.util.find_spec("flashinfer") is not None
        ops = fused_ops and flashinfer
        fi_attn = attention_backend == "flashinfer" or (attention_backend == "auto" and flashinfer)
        return cls(flashinfer_ops=ops, graphs=cuda_graph and fi_attn, flashinfer_attention=fi_attn)


def _set(name: str) -> bool:
    return os.environ.get(name, "") != ""  # empty is each reader's default


def check_gpu_env(paths: GpuPaths) -> None:
    """Validate the switches' values, then refuse one that is set but unused by ``paths``.

    Raises ValueError naming the variable (see the module docstring)."""
    small_m_gemm_mode()
    small_m = os.environ.get("HALFMOON_SMALL_M_GEMM", "auto")  # as asked: "auto" follows the engine
    small_m_projections()
    tuned = tuned_gemm_backend()
    tuned_projections()
    tuned_rows()
    tuned_cache()
    graph_blas(1, os.environ.get("HALFMOON_DECODE_GRAPH_BLAS", ""))
    decode_attention(1)
    decode_pdl()

    why_ops = ("needs flashinfer's fused ops (a CUDA bf16/fp16 model, fused_ops on, flashinfer installed), "
               "which this engine does not run")
    if small_m.startswith("tinygemm") and not paths.flashinfer_ops:
        raise ValueError(f"HALFMOON_SMALL_M_GEMM={small_m!r} {why_ops}")
    if _set("HALFMOON_SMALL_M_GEMM_ON") and (small_m == "cublas" or not paths.flashinfer_ops):
        raise ValueError("HALFMOON_SMALL_M_GEMM_ON has no effect: "
                         + ("HALFMOON_SMALL_M_GEMM is 'cublas'" if small_m == "cublas" else f"tinygemm {why_ops}"))
    if _set("HALFMOON_FUSED_ROPE_STORE") and not paths.flashinfer_ops:
        raise ValueError(f"HALFMOON_FUSED_ROPE_STORE {why_ops}")
    if tuned != "off" and not (paths.flashinfer_ops and paths.graphs):
        raise ValueError(f"HALFMOON_TUNED_GEMM={tuned!r} runs only in CUDA-graph decode with flashinfer's fused ops "
                         f"(a CUDA bf16 model, cuda_graph and fused_ops on, the flashinfer attention backend); "
                         f"this engine has fused ops {'on' if paths.flashinfer_ops else 'off'}, "
                         f"graphs {'on' if paths.graphs else 'off'}")
    for name in TUNED_SUB_SWITCHES:
        if _set(name) and tuned == "off":
            raise ValueError(f"{name} has no effect while HALFMOON_TUNED_GEMM is off")
    if _set("HALFMOON_DECODE_GRAPH_BLAS") and not paths.graphs:
        raise ValueError("HALFMOON_DECODE_GRAPH_BLAS picks the BLAS of CUDA-graph captures; this engine "
                         "captures none (cuda_graph off, or not the flashinfer attention backend)")
    if _set("HALFMOON_DECODE_ATTN") and not paths.graphs:
        raise ValueError("HALFMOON_DECODE_ATTN picks the decode attention of CUDA-graph captures; this engine "
                         "captures none (cuda_graph off, or not the flashinfer attention backend)")
    if _set("HALFMOON_DECODE_PDL") and not paths.graphs:
        raise ValueError("HALFMOON_DECODE_PDL launches the split-KV decode kernels of CUDA-graph captures; this "
                         "engine captures none (cuda_graph off, or not the flashinfer attention backend)")
    if _set("HALFMOON_DECODE_PDL") and os.environ.get("HALFMOON_DECODE_ATTN", "") == "flashinfer":
        raise ValueError("HALFMOON_DECODE_PDL has no effect with HALFMOON_DECODE_ATTN='flashinfer': no bucket "
                         "attends with the split-KV kernel")
    for name in FLASHINFER_SWITCHES:
        if _set(name) and not paths.flashinfer_attention:
            raise ValueError(f"{name} configures the flashinfer attention backend, which this engine does not use")
