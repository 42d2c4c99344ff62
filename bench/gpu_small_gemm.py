"""``small_gemm`` section of the GPU benchmark: the decode step's bf16 GEMMs alone (Llama-3.1-8B
shapes, M = batch rows), per BLAS library torch can call (cuBLASLt, cuBLAS), as GB/s of weight read.

Each point times a CUDA graph of 16 back-to-back ``F.linear`` calls on 16 distinct weights (so no
call reads a weight from L2 that the previous one left there), replayed 20 times: device time per
GEMM without host launch cost, as in a decode graph. Session 11's graph profile put the q/k/v and o
projections at ~3.1 TB/s of weight read against ~4.2 for gate/up at M = 1.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from bench.gpu_timing import events_ms

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def small_gemm(args) -> dict:
    """See the module docstring."""
    n_w, rows = 16, []
    default = torch.backends.cuda.preferred_blas_library()
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(n_w)]
        for M in (1, 8, 32, 128):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                for w in ws[:2]:  # warm-up: handles, workspace
                    F.linear(x, w)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for w in ws:
                        F.linear(x, w)
                us = statistics.median(events_ms(g.replay, 20)) * 1e3 / n_w
                rows.append({"gemm": name, "M": M, "lib": lib, "us": us, "TBps": N * K * 2 / us / 1e6})
                print(f"small_gemm {name:8s} M={M:4d} {lib:9s} {us:8.1f} us {rows[-1]['TBps']:5.2f} TB/s", flush=True)
                del g
        del ws
        torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library(default)
    return {"default_lib": str(default), "rows": rows}
