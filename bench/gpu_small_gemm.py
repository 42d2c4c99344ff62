"""``small_gemm`` section of the GPU benchmark: the decode step's bf16 GEMMs alone (Llama-3.1-8B
shapes, M = batch rows), per GEMM torch or flashinfer can call, as TB/s of weight read.

Libraries: cuBLAS and cuBLASLt (``F.linear`` under each of torch's BLAS choices) at every M, and at
M <= 8 flashinfer's tinygemm (``engine.small_m_gemm`` mode "tinygemm_nopdl") and tinygemm with
programmatic dependent launch ("tinygemm": each GEMM starts streaming its weights while the one
before it finishes). Each point times a CUDA graph of 16 back-to-back GEMMs on 16 distinct weights
(so no call reads a weight from L2 that the previous one left there), replayed 20 times: device time
per GEMM without host launch cost, as in a decode graph. ``max_abs_diff`` is tinygemm's output
against cuBLAS's on the same inputs (one bf16 rounding apart is expected).

``fi_cublaslt``, ``fi_cudnn``, ``fi_auto``: ``flashinfer.mm_bf16`` with that backend
(``engine.tuned_gemm``), tuned at exactly M in the warm-up (``autotune(True, tuning_buckets=(M,))``)
and captured with the tuned choice (``autotune(False, ...)``), as the decode graphs capture it. M =
8192 is a prefill chunk's GEMM: there ``TFLOPs`` (against ~788 dense bf16 on an H200 at its boost
clock) is the figure, not TB/s of weight read. Session 11's graph
profile put the q/k/v and o projections at ~3.1 TB/s of weight read against ~4.2 for gate/up at
M = 1.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
import torch.nn.functional as F

from bench.gpu_timing import events_ms

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 8192)
FI_BACKENDS = {"fi_cublaslt": "cublaslt", "fi_cudnn": "cudnn", "fi_auto": "auto"}


def _gemms(lib: str, x: torch.Tensor, ws: list[torch.Tensor]):
    """A callable running x @ w.T for every w in ws with ``lib``, each into its own output."""
    if lib in ("cublas", "cublaslt"):
        return lambda: [F.linear(x, w) for w in ws]
    import flashinfer

    if lib in FI_BACKENDS:
        return lambda: [flashinfer.mm_bf16(x, w.t(), backend=FI_BACKENDS[lib]) for w in ws]

    outs = [torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) for w in ws]
    pdl = lib == "tinygemm"

    def run():
        for w, o in zip(ws, outs):
            flashinfer.gemm.tinygemm_bf16(x, w, o, None, pdl)  # in place: returns None
        return outs
    return run


def small_gemm(args) -> dict:
    """See the module docstring."""
    import flashinfer

    n_w, rows = 16, []
    default = torch.backends.cuda.preferred_blas_library()
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(n_w)]
        for M in ROWS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            torch.backends.cuda.preferred_blas_library("cublas")
            ref = F.linear(x, ws[0])  # cuBLAS: what max_abs_diff compares against
            libs = ("cublas", "cublaslt") + (("tinygemm_nopdl", "tinygemm") if M <= 8 else ()) + tuple(FI_BACKENDS)
            for lib in libs:
                torch.backends.cuda.preferred_blas_library("cublaslt" if lib == "cublaslt" else "cublas")
                run = _gemms(lib, x, ws)
                tuned = lib in FI_BACKENDS
                try:
                    with flashinfer.autotune(True, tuning_buckets=(M,)) if tuned else contextlib.nullcontext():
                        outs = run()  # warm-up outside the graph: handles, workspace, JIT, tuning
                    diff = (outs[0].float() - ref.float()).abs().max().item()
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g), (flashinfer.autotune(False, tuning_buckets=(M,)) if tuned
                                               else contextlib.nullcontext()):
                        run()
                except Exception as e:  # noqa: BLE001 - a backend this flashinfer or GPU lacks: said, next one
                    print(f"small_gemm {name:8s} M={M:4d} {lib:14s} failed: {type(e).__name__}: {e}"[:300], flush=True)
                    rows.append({"gemm": name, "M": M, "lib": lib, "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                us = statistics.median(events_ms(g.replay, 20)) * 1e3 / n_w
                rows.append({"gemm": name, "M": M, "lib": lib, "us": us, "TBps": N * K * 2 / us / 1e6,
                             "TFLOPs": 2 * M * N * K / us / 1e6, "max_abs_diff": diff})
                print(f"small_gemm {name:8s} M={M:4d} {lib:14s} {us:8.1f} us {rows[-1]['TBps']:5.2f} TB/s"
                      f" {rows[-1]['TFLOPs']:6.1f} TFLOP/s  max|diff| {diff:.2e}", flush=True)
                del g
        del ws
        torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library(default)
    return {"default_lib": str(default), "rows": rows}
