"""gate_up_micro section of the GPU benchmark: the MLP's gate/up GEMM + SiLU·mul at prefill sizes,
the engine's two kernels (cuBLAS ``F.linear`` + flashinfer ``silu_and_mul``) against the fused
Triton kernel of ``engine/gate_up_silu.py`` per tile and variant, and the GEMM-rate floor.

Llama-8B shape (K = 4096, I = 14336, bf16), T = ``--prefill-tokens`` and its quarter. Floor:
2 * T * 2I * K FLOPs / ``args.gemm_rate``. Each fused result is compared with the two-kernel one
(max |diff| relative to the output's max |value|).
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from bench.gpu_timing import events_ms

K, I_SIZE = 4096, 14336
TILES = [  # (bm, bn, bk, group_m, warps, stages)
    (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 64, 64, 8, 4, 4), (128, 64, 64, 8, 8, 4),
    (64, 128, 64, 8, 4, 4), (256, 64, 64, 8, 8, 3), (128, 128, 32, 8, 8, 5), (128, 256, 64, 8, 8, 3)]


def gate_up_micro(args) -> dict:
    """ms per layer of each way to compute silu(x W_g^T) * (x W_u^T); see the module docstring."""
    import flashinfer

    from engine.gate_up_silu import Tile, gate_up_silu

    rows = []
    w = torch.randn(2 * I_SIZE, K, dtype=torch.bfloat16, device="cuda") * 0.02
    for T in (args.prefill_tokens, args.prefill_tokens // 4):
        x = torch.randn(T, K, dtype=torch.bfloat16, device="cuda")
        floor_ms = 2 * T * 2 * I_SIZE * K / args.gemm_rate * 1e3
        ref = flashinfer.activation.silu_and_mul(F.linear(x, w))
        scale = ref.float().abs().max().item()

        def timed(name, fn, check=True, **extra):
            try:
                out = fn()
                diff = (out.float() - ref.float()).abs().max().item() / scale if check else None
                ms = [statistics.median(events_ms(fn, 10, warmup=2)) for _ in range(2)]
                r = {"name": name, "tokens": T, "ms": ms, "floor_ms": floor_ms, "frac_of_floor": floor_ms / min(ms),
                     "rel_max_diff": diff, **extra}
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit is a result too
                r = {"name": name, "tokens": T, "error": repr(e)[:240], **extra}
            rows.append(r)
            print(f"gate_up_micro {r}", flush=True)

        timed("cublas+silu_and_mul", lambda: flashinfer.activation.silu_and_mul(F.linear(x, w)))
        timed("cublas_gemm_only", lambda: F.linear(x, w), check=False)
        for variant in ("ptr", "tma"):
            for t in TILES:
                tile = Tile(*t)
                timed(f"fused_{variant}", lambda: gate_up_silu(x, w, tile, variant), tile=list(t))
        del x, ref
        torch.cuda.empty_cache()
    return {"rows": rows, "floor_gemm_flops": args.gemm_rate}
