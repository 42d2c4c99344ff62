"""Session 21 call 2 probe: is the decode step's o GEMM ([M, 4096] x [4096, 4096] bf16) faster when its
weight is already in L2? 32 GEMMs in one CUDA graph, each on a distinct weight (read from HBM) or all
on one weight (after the first, from L2: 33.5 MB against the H100's 50 MB). tinygemm (with PDL, as the
engine's graphs) at M <= 8, cuBLAS above. Prints µs a GEMM and the bytes' rate."""

import statistics

import torch

import flashinfer

from bench.gpu_timing import events_ms

N = K = 4096
ws = [torch.randn(N, K, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(32)]


def gemm(x, w, y):
    if x.shape[0] <= 8:
        flashinfer.gemm.tinygemm_bf16(x, w, y, None, True)
    else:
        torch.mm(x, w.t(), out=y)


for M in (1, 8, 32):
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    res = {}
    for name, pick in (("distinct", lambda i: ws[i]), ("same", lambda i: ws[0])):
        def run():
            for i in range(32):
                gemm(x, pick(i), y)
        run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        res[name] = [statistics.median(events_ms(g.replay, 20)) * 1e3 / 32 for _ in range(2)]
    print(f"o_gemm_l2 M={M:3d}: distinct " + "/".join(f"{t:.2f}" for t in res["distinct"])
          + f" us ({N * K * 2 / res['distinct'][0] / 1e6:.2f} TB/s) | same (L2) "
          + "/".join(f"{t:.2f}" for t in res["same"]) + f" us ({N * K * 2 / res['same'][0] / 1e6:.2f} TB/s)", flush=True)
