"""attn_micro section of the GPU benchmark: flashinfer's paged decode attention alone."""

from __future__ import annotations

import statistics

import torch

from bench.gpu_timing import events_ms


def attn_micro(args) -> dict:
    """flashinfer paged decode alone (one layer, Llama-8B heads, bf16, page 16): KV bytes read / time,
    CUDA-core vs tensor-core kernels; pages shuffled."""
    import flashinfer

    H, KVH, D, ps = 32, 8, 128, 16
    res = []
    for B, C in ((64, 2048), (128, 1024), (128, 4096), (1, 4096)):
        P = B * C // ps
        k = torch.randn(P, ps, KVH, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        indptr = torch.arange(0, P + 1, C // ps, dtype=torch.int32)
        idx = torch.randperm(P, device="cuda").to(torch.int32)
        last = torch.full((B,), ps, dtype=torch.int32)
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device="cuda")
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
        for tc in (False, True):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            w.plan(indptr, idx, last, H, KVH, D, ps, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            ms = statistics.median(events_ms(lambda: w.run(q, (k, v)), 20))
            byts = 2 * B * C * KVH * D * 2
            res.append({"batch": B, "context": C, "tensor_cores": tc, "ms": ms, "TBps": byts / ms / 1e9})
            print(res[-1], flush=True)
        del k, v
        torch.cuda.empty_cache()
    return {"rows": res}

