"""``skinny_gemm`` section of the GPU benchmark: the decode projections through the split-N Triton
kernel (``engine.models.skinny_gemm``) against cuBLAS (``F.linear``), Llama-3.1-8B shapes, bf16.

Each point times a CUDA graph of 16 back-to-back calls on 16 distinct weights (no call finds its
weight in L2), replayed 20 times, as ``small_gemm`` does. ``down+glu`` is SiLU·mul then down_proj:
flashinfer's ``silu_and_mul`` + ``F.linear`` against the kernel's GLU prologue. First a sweep of
tiles at M = 1 (peer and ceiling: cuBLAS, and the weight bytes at the 4.26 TB/s floor), then
the best tile per projection at M = 1, 4, 8, 16. Outputs are checked against ``F.linear``.
"""

from __future__ import annotations

import itertools
import statistics

import torch
import torch.nn.functional as F

from bench.gpu_timing import events_ms
from engine.models.skinny_gemm import SkinnyConfig, skinny_gemm, supports

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, False), "down+glu": (4096, 14336, True),
          "down": (4096, 14336, False), "gate_up": (28672, 4096, False)}
FLOOR_TBPS = 4.26
N_W = 16


def _graph_us(fn) -> float:
    fn(), fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return statistics.median(events_ms(g.replay, 20)) * 1e3 / N_W


def _reference(x, w, glu):
    if glu:
        import flashinfer
        return F.linear(flashinfer.activation.silu_and_mul(x), w)
    return F.linear(x, w)


def _point(ws, x, glu, cfg):
    if cfg is None:
        return _graph_us(lambda: [_reference(x, w, glu) for w in ws])
    return _graph_us(lambda: [skinny_gemm(x, w, glu, cfg) for w in ws])


def skinny(args) -> dict:
    """See the module docstring."""
    rows, best = [], {}
    tiles = [SkinnyConfig(bn, bk, nw, ns) for bn, bk, nw, ns in
             itertools.product((8, 16, 32), (256, 512, 1024), (4, 8), (1, 3))]
    for name, (N, K, glu) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(N_W)]
        floor_us = N * K * 2 / FLOOR_TBPS / 1e6
        for M in (1,):
            x = torch.randn(M, 2 * K if glu else K, device="cuda", dtype=torch.bfloat16)
            ref_us = _point(ws, x, glu, None)
            scores = []
            for cfg in tiles:
                if not supports(x, ws[0], glu, cfg):
                    continue
                try:
                    us = _point(ws, x, glu, cfg)
                except Exception as e:  # a tile Triton cannot fit (shared memory): skip it
                    print(f"skinny {name} M={M} {cfg} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
                    continue
                scores.append((us, cfg))
            scores.sort(key=lambda s: s[0])
            for us, cfg in scores[:5]:
                print(f"skinny sweep {name:9s} M={M:2d} bn={cfg.bn:3d} bk={cfg.bk:4d} w={cfg.num_warps} "
                      f"s={cfg.num_stages} {us:7.2f} us ({N * K * 2 / us / 1e6:4.2f} TB/s) cublas {ref_us:7.2f}",
                      flush=True)
            rows.append({"gemm": name, "M": M, "cublas_us": ref_us, "floor_us": floor_us,
                         "sweep": [{"us": us, **cfg.__dict__} for us, cfg in scores]})
            if M == 1 and scores:
                best[name] = scores[0][1]
        cfg = best.get(name)
        if cfg is None:
            continue
        for M in (1, 2, 4):
            x = torch.randn(M, 2 * K if glu else K, device="cuda", dtype=torch.bfloat16)
            ref_us, us = _point(ws, x, glu, None), _point(ws, x, glu, cfg)
            err = (skinny_gemm(x, ws[0], glu, cfg).float() - _reference(x, ws[0], glu).float()).abs().max().item()
            rows.append({"gemm": name, "M": M, "cfg": cfg.__dict__, "skinny_us": us, "cublas_us": ref_us,
                         "floor_us": floor_us, "max_abs_diff": err})
            print(f"skinny best  {name:9s} M={M:2d} skinny {us:7.2f} us cublas {ref_us:7.2f} floor {floor_us:6.2f} "
                  f"| skinny/cublas {us / ref_us:5.3f} floor/skinny {floor_us / us:5.3f} | max|diff| {err:.2e}",
                  flush=True)
        del ws
        torch.cuda.empty_cache()
    return {"rows": rows, "best": {k: v.__dict__ for k, v in best.items()}}
