"""``small_gemm`` section of the GPU benchmark: the decode step's bf16 GEMMs alone (Llama-3.1-8B
shapes, M = batch rows), per GEMM torch or flashinfer can call, as TB/s of weight read.

Libraries: cuBLAS and cuBLASLt (``F.linear`` under each of torch's BLAS choices) at every M, and at
M <= 8 flashinfer's tinygemm (``engine.small_m_gemm`` mode "tinygemm_nopdl") and tinygemm with
programmatic dependent launch ("tinygemm": each GEMM starts streaming its weights while the one
before it finishes). Each point times a CUDA graph of 16 back-to-back GEMMs on 16 distinct weights
(so no call reads a weight from L2 that the previous one left there), replayed 20 times: device time
per GEMM without host launch cost, as in a decode graph. ``max_abs_diff`` is tinygemm's output
against cuBLAS's on the same inputs (one bf16 rounding apart is expected). Session 11's graph
profile put the q/k/v and o projections at ~3.1 TB/s of weight read against ~4.2 for gate/up at
M = 1.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from bench.gpu_timing import events_ms

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 2, 4, 8, 32, 128)


def _gemms(lib: str, x: torch.Tensor, ws: list[torch.Tensor]):
    """A callable running x @ w.T for every w in ws with ``lib``, each into its own output."""
    if lib in ("cublas", "cublaslt"):
        return lambda: [F.linear(x, w) for w in ws]
    import flashinfer

    outs = [torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) for w in ws]
    pdl = lib == "tinygemm"

    def run():
        for w, o in zip(ws, outs):
            flashinfer.gemm.tinygemm_bf16(x, w, o, None, pdl)  # in place: returns None
        return outs
    return run


def small_gemm(args) -> dict:
    """See the module docstring."""
    n_w, rows = 16, []
    default = torch.backends.cuda.preferred_blas_library()
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(n_w)]
        for M in ROWS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            torch.backends.cuda.preferred_blas_library("cublas")
            ref = F.linear(x, ws[0])  # cuBLAS: what max_abs_diff compares against
            libs = ("cublas", "cublaslt") + (("tinygemm_nopdl", "tinygemm") if M <= 8 else ())
            for lib in libs:
                torch.backends.cuda.preferred_blas_library("cublaslt" if lib == "cublaslt" else "cublas")
                run = _gemms(lib, x, ws)
                outs = run()  # warm-up outside the graph: handles, workspace, JIT
                diff = (outs[0].float() - ref.float()).abs().max().item()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run()
                us = statistics.median(events_ms(g.replay, 20)) * 1e3 / n_w
                rows.append({"gemm": name, "M": M, "lib": lib, "us": us, "TBps": N * K * 2 / us / 1e6,
                             "max_abs_diff": diff})
                print(f"small_gemm {name:8s} M={M:4d} {lib:14s} {us:8.1f} us {rows[-1]['TBps']:5.2f} TB/s"
                      f"  max|diff| {diff:.2e}", flush=True)
                del g
        del ws
        torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library(default)
    return {"default_lib": str(default), "rows": rows}
