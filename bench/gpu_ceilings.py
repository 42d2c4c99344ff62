"""The two ceilings every floor of the GPU benchmark divides by: device-to-device copy bandwidth
(bytes read + written) and the bf16 GEMM rate (8192^3)."""

from __future__ import annotations

import statistics

import torch

from bench.gpu_timing import events_ms

# The floors divide by a nominal figure per GPU model (copy: bytes read + written, as a
# device-to-device copy_ moves them; dense bf16 GEMM 8192^3), not this run's ``ceilings``, so that
# floors compare across runs on the same model (one H200 run measured 4.14 TB/s and 765 TFLOP/s,
# the usual 4.26 and 788; H100 80GB HBM3 runs 2.96-2.99 TB/s and 770-790 TFLOP/s:
# bench/results/GPU_NOTES.md). A model not listed gets this run's ceilings.
NOMINAL = {"H200": (4.26e12, 788e12), "H100": (2.98e12, 780e12)}  # name substring -> (B/s, FLOP/s)


def nominal_ceilings(device_name: str) -> tuple[float, float] | None:
    """(copy B/s, bf16 GEMM FLOP/s) the floors use for a GPU named ``device_name`` (as
    ``torch.cuda.get_device_name`` gives it), or None for a model without nominal figures."""
    for model, figures in NOMINAL.items():
        if model in device_name:
            return figures
    return None


def floor_ceilings(copy_bw: float | None, gemm_rate: float | None,
                   measured: dict | None = None) -> tuple[float, float]:
    """The (copy B/s, GEMM FLOP/s) of the floors: ``copy_bw`` / ``gemm_rate`` where given (the
    flags), else this GPU model's nominal figures, else this run's ceilings: ``measured`` (what
    :func:`ceilings` returned earlier in the run) or measured now."""
    nominal = nominal_ceilings(torch.cuda.get_device_name())
    if nominal is None and not (copy_bw and gemm_rate):
        c = measured if measured and "copy_bw_Bps" in measured else ceilings(None)
        nominal = (c["copy_bw_Bps"], c["gemm_flops"])
    return copy_bw or nominal[0], gemm_rate or nominal[1]


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
