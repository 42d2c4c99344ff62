"""Compile the flashinfer modules the GPU path uses, in parallel processes (JIT, first use only).

    python -m bench.gpu_warm   # norm, rope, activation, decode, paged prefill, ragged prefill, merge
                               # (bf16, head_dim 128)

Each module builds into ~/.cache/flashinfer once (decode ~25 s, prefill ~50 s, norm/rope ~60-75 s
in parallel on 16 cores); scripts/gpu_session.sh saves the .so files and restores them as flashinfer
AOT modules (<package>/data/aot/), which load in seconds with FLASHINFER_DISABLE_JIT=1 (checked on an
H200). Restored into ~/.cache/flashinfer instead, flashinfer 0.6.18 rebuilds them (ninja wants its .o).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

JOBS = {"ragged": 7, "prefill": 4, "decode": 2, "norm": 1, "rope": 1, "act": 1, "merge": 1}


def build(kind: str) -> None:
    import torch

    import flashinfer

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(8, 512, dtype=dt, device=dev)
    if kind == "norm":
        flashinfer.norm.rmsnorm(x, torch.ones(512, dtype=dt, device=dev), 1e-5)
        flashinfer.norm.fused_add_rmsnorm(x, x.clone(), torch.ones(512, dtype=dt, device=dev), 1e-5)
    elif kind == "merge":
        o = torch.randn(8, 32, 128, dtype=dt, device=dev)
        lse = torch.randn(8, 32, dtype=torch.float32, device=dev)
        flashinfer.merge_state_in_place(o, lse, o.clone(), lse.clone())
    elif kind == "ragged":  # the extend path's new-token part (FA3 kernels on Hopper with "auto")
        ws = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=os.environ.get(
            "HALFMOON_FLASHINFER_RAGGED", "auto"))
        ind = torch.tensor([0, 40], dtype=torch.int32)
        w.plan(ind, ind, 32, 8, 128, causal=True, q_data_type=dt, kv_data_type=dt)
        w.run(torch.randn(40, 32, 128, dtype=dt, device=dev), torch.randn(40, 8, 128, dtype=dt, device=dev),
              torch.randn(40, 8, 128, dtype=dt, device=dev), return_lse=True)
    elif kind == "act":
        flashinfer.activation.silu_and_mul(x)
    elif kind == "rope":
        q = torch.randn(8, 4 * 128, dtype=dt, device=dev)
        k = torch.randn(8, 2 * 128, dtype=dt, device=dev)
        cache = torch.randn(64, 128, dtype=torch.float32, device=dev)
        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(torch.arange(8, device=dev), q, k, 128, cache)
    else:
        from bench.gpu import backend_vs_torch

        if kind == "decode":  # only the decode wrapper: plan/run one decode batch
            from engine.attention.flashinfer_backend import FlashInferAttentionBackend

            ws = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            kv = torch.randn(4, 16, 8, 128, dtype=dt, device=dev)
            w.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32, device=dev),
                   torch.tensor([5], dtype=torch.int32), 32, 8, 128, 16, q_data_type=dt, kv_data_type=dt)
            w.run(torch.randn(1, 32, 128, dtype=dt, device=dev), (kv, kv))
            del FlashInferAttentionBackend
        else:
            backend_vs_torch(extend_mode="paged")
    torch.cuda.synchronize()


def main() -> int:
    if len(sys.argv) > 1:
        t = time.perf_counter()
        build(sys.argv[1])
        print(f"built {sys.argv[1]} in {time.perf_counter() - t:.1f}s", flush=True)
        return 0
    procs = {}
    for kind, jobs in JOBS.items():
        env = dict(os.environ, MAX_JOBS=str(jobs))
        procs[kind] = subprocess.Popen([sys.executable, "-m", "bench.gpu_warm", kind], env=env)
    rc = 0
    for kind, p in procs.items():
        rc |= p.wait()
        print(f"{kind}: rc={p.returncode}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
