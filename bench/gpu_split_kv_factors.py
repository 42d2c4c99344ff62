"""``split_kv_factors`` section of the GPU benchmark: does any difference between the engine's inputs
and ``split_kv_micro``'s make engine.attention.split_kv_decode slower inside the engine's graph?

It found one: at B=64 the graph's split-KV kernel took ~1.9x its micro time (H100: 655 against 345
µs a layer at ctx 4k) until the kernel narrowed the slots of the int64 ``req_to_token`` to int32
(the "r2t_int32" variant had the micro's speed; bench/results/GPU_NOTES.md, session 20). The micro and the engine
differ in the inputs: the engine's pool is page-major with each request's pages in ascending order
(engine.kvcache.page_allocator hands out low ids first), ``req_to_token`` is int64 with rows of
``max_context``, ``seq_lens`` is context + 1 (the new token), and ``q`` is a strided view of the
fused qkv output; in the graph the kernel also runs between the layer's GEMMs. Each variant here
starts from the engine's inputs and changes one thing; "micro" changes all four input factors;
"between_gemms" times 32 x (GEMM + attention) minus 32 x GEMM (an [B, 4096] x [4096, 14336] bf16
GEMM, the size of the MLP's up projection), i.e. the attention's cost next to other kernels.

Reports µs a layer per (case, variant) and the variant's ratio to "engine". Cases: ``--micro-cases``
(default 64x1024,64x4096).
"""

from __future__ import annotations

import torch

from bench.gpu_xqa import D, H, KVH, LAYERS, PS, _graph_us
from engine.attention.split_kv_decode import SplitKVDecode
from engine.kvcache.kv_pool import KVPool
from engine.kvcache.page_allocator import PageAllocator
from engine.kvcache.req_to_token_pool import ReqToTokenPool


def _inputs(B: int, C: int, dev: str):
    """The engine's decode inputs for B rows of C cached tokens + 1 new: (pool, r2t, rows, seq, q)."""
    npr = -(-(C + 1) // PS)
    pool = KVPool(B * npr + 1, PS, LAYERS, KVH, D, torch.bfloat16, dev)
    for buf in pool.buffers():
        buf.normal_()
    alloc = PageAllocator(B * npr + 1, PS, dev)
    r2t_pool = ReqToTokenPool(B, C + PS, dev)
    rows = []
    for _ in range(B):
        row = r2t_pool.alloc()
        r2t_pool.write(row, 0, alloc.alloc_slots(0, C + 1, None))
        rows.append(row)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
    seq = torch.full((B,), C + 1, dtype=torch.int64, device=dev)
    qkv = torch.randn(B, (H + 2 * KVH) * D, dtype=torch.bfloat16, device=dev)
    q = qkv[:, : H * D].view(B, H, D)
    return pool, r2t_pool.req_to_token, rows_t, seq, q


def _shuffled(r2t: torch.Tensor, rows: torch.Tensor, C: int) -> torch.Tensor:
    """The same rows with their pages permuted across the batch (token offsets kept)."""
    out = r2t.clone()
    used = r2t[rows, : C + 1]
    pages = torch.unique(used // PS)
    perm = pages[torch.randperm(pages.numel(), device=r2t.device)]
    remap = torch.empty(int(pages.max()) + 1, dtype=r2t.dtype, device=r2t.device)
    remap[pages] = perm
    out[rows, : C + 1] = remap[used // PS] * PS + used % PS
    return out


def split_kv_factors(args) -> dict:
    """See the module docstring."""
    dev, rows_out = "cuda", []
    cases = getattr(args, "micro_cases", None) or [(64, 1024), (64, 4096)]
    for B, C in cases:
        pool, r2t, rows, seq, q = _inputs(B, C, dev)
        att = SplitKVDecode(H, KVH, D, PS, B, dev, scale=D ** -0.5)
        outs = [torch.empty(B, H, D, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
        x = torch.randn(B, 4096, dtype=torch.bfloat16, device=dev)
        wt = torch.randn(14336, 4096, dtype=torch.bfloat16, device=dev)
        y = torch.empty(B, 14336, dtype=torch.bfloat16, device=dev)
        shuffled = _shuffled(r2t, rows, C)
        inputs = {
            "engine": (q, r2t, seq),
            "q_contiguous": (q.contiguous(), r2t, seq),
            "seq_context": (q, r2t, seq - 1),
            "r2t_int32": (q, r2t.to(torch.int32), seq),
            "pages_shuffled": (q, shuffled, seq),
            "micro": (q.contiguous(), shuffled.to(torch.int32), seq - 1),
        }
        row = {"batch": B, "context": C, "us": {}}

        def attend(qq, rr, ss, i):
            att(qq, pool.k_pages(i), pool.v_pages(i), rr, rows, ss, out=outs[i])

        for name, (qq, rr, ss) in inputs.items():
            row["us"][name] = _graph_us(lambda: [attend(qq, rr, ss, i) for i in range(LAYERS)], LAYERS)

        def gemms():
            for _ in range(LAYERS):
                torch.mm(x, wt.t(), out=y)

        def both():
            for i in range(LAYERS):
                torch.mm(x, wt.t(), out=y)
                attend(q, r2t, seq, i)

        row["gemm_us"] = _graph_us(gemms, LAYERS)
        row["us"]["between_gemms"] = _graph_us(both, LAYERS) - row["gemm_us"]
        base = row["us"]["engine"]
        row["ratio"] = {k: v / base for k, v in row["us"].items()}
        print(f"split_kv_factors B={B:4d} ctx={C:5d}: " + " | ".join(f"{k} {v:7.2f}" for k, v in row["us"].items())
              + f" | gemm {row['gemm_us']:.2f} us/layer", flush=True)
        rows_out.append(row)
        del pool, r2t, outs, att
        torch.cuda.empty_cache()
    return {"rows": rows_out}
