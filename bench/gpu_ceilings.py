"""The two ceilings every floor of the GPU benchmark divides by: device-to-device copy bandwidth
(bytes read + written) and the bf16 GEMM rate (8192^3)."""

from __future__ import annotations

import statistics

import torch

from bench.gpu_timing import events_ms

# The floors use these nominal figures of the H200 machines the runs get (copy: bytes read + written,
# as a device-to-device copy_ moves them; dense bf16 GEMM), not this run's ``ceilings`` (one run
# measured 4.14 TB/s and 765 TFLOP/s: bench/results/GPU_NOTES.md), so that floors compare across runs
COPY_BW_DEFAULT = 4.26e12  # B/s
GEMM_DEFAULT = 788e12  # FLOP/s


def ceilings(args) -> dict:
    n = 1 << 30
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = statistics.median(events_ms(lambda: b.copy_(a), 20))
    copy_bw = 2 * n / (ms / 1e3)
    del a, b
    N = 8192
    x = torch.randn(N, N, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(N, N, dtype=torch.bfloat16, device="cuda")
    ms_g = statistics.median(events_ms(lambda: x @ y, 10))
    gemm = 2 * N**3 / (ms_g / 1e3)
    return {"copy_bytes": n, "copy_ms": ms, "copy_bw_Bps": copy_bw, "gemm_ms": ms_g, "gemm_flops": gemm,
            "device": torch.cuda.get_device_name()}
