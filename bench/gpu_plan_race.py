"""flashinfer paged prefill planned back to back, without our backend: does an earlier forward run
with a later plan's schedule? (GPU_NOTES run 4: FA3 paged prefill hit an illegal memory access in
the 4-chunk prefill bench.)

    python -m bench.gpu_plan_race [--backend fa3] [--order up|down] [--how nosync|sync|fence]

One request, 4 chunks of 2048 tokens over its cached prefix (the prefill bench's chunked case:
Llama-3.1-8B heads 32/8, head_dim 128, bf16, page 16, pages shuffled), page table from our
``page_table``. Each chunk is planned and run on one ``BatchPrefillWithPagedKVCacheWrapper``
(causal, kv = the whole row so far), and compared with torch attention over the same K/V.
``--how``: ``sync`` synchronizes after each chunk; ``nosync`` stalls the stream first
(``torch.cuda._sleep``) and then plans and runs all chunks without a sync, as the bench did;
``fence`` does that through :class:`engine.attention.flashinfer_backend.PlanFence`.
Every chunk is first run once with syncs (kernel loading can synchronize and hide the race).
``--order down`` runs the chunks longest first (an earlier chunk then sees a shorter schedule: wrong
numbers instead of a fault). Prints one JSON line: rel. error per chunk, or the error.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="fa3")
    p.add_argument("--order", default="up", choices=["up", "down"])
    p.add_argument("--how", default="nosync", choices=["nosync", "sync", "fence"])
    p.add_argument("--chunk", type=int, default=2048)
    a = p.parse_args(argv)
    import flashinfer

    from engine.attention.flashinfer_backend import PlanFence, page_table

    H, KVH, D, ps, dev, dt = 32, 8, 128, 16, "cuda", torch.bfloat16
    C, n = a.chunk, 4
    T = C * n
    g = torch.Generator(device=dev).manual_seed(0)
    P = T // ps + 64
    k_cache = torch.randn(P, ps, KVH, D, dtype=dt, device=dev, generator=g)
    v_cache = torch.randn(P, ps, KVH, D, dtype=dt, device=dev, generator=g)
    pages = torch.randperm(P, device=dev, generator=g)[: T // ps]
    r2t = (pages.repeat_interleave(ps) * ps + torch.arange(ps, device=dev).repeat(T // ps)).view(1, T)
    q_all = torch.randn(T, H, D, dtype=dt, device=dev, generator=g)
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=a.backend)
    fence = PlanFence()
    order = range(n) if a.order == "up" else reversed(range(n))
    qo_indptr = torch.tensor([0, C], dtype=torch.int32)
    rows = torch.zeros(1, dtype=torch.int64, device=dev)
    tables = {c: page_table(r2t, rows, torch.tensor([(c + 1) * C]), ps) for c in range(n)}
    kw = dict(causal=True, q_data_type=dt, kv_data_type=dt)

    def chunk(c: int, how: str) -> torch.Tensor:
        indptr, idx, last = tables[c]
        args = (qo_indptr, indptr, idx, last, H, KVH, D, ps)
        if how == "fence":
            fence.plan(w, *args, **kw)
        else:
            w.plan(*args, **kw)
        o = w.run(q_all[c * C:(c + 1) * C], (k_cache, v_cache))
        if how == "sync":
            torch.cuda.synchronize()
        return o

    for c in range(n):  # load the kernels first: a kernel's first launch may wait for the device
        chunk(c, "sync")
    outs = {}
    if a.how != "sync":
        torch.cuda._sleep(1 << 28)  # ~0.14 s at ~1.9 GHz: the host plans every chunk before the device wakes
    for c in order:
        outs[c] = chunk(c, a.how)
    res = {"backend": a.backend, "order": a.order, "how": a.how}
    try:
        torch.cuda.synchronize()
        errs = {}
        for c in range(n):
            kv = (c + 1) * C
            slots = r2t[0, :kv]
            k = k_cache.view(-1, KVH, D)[slots].repeat_interleave(H // KVH, 1).transpose(0, 1)
            v = v_cache.view(-1, KVH, D)[slots].repeat_interleave(H // KVH, 1).transpose(0, 1)
            q = q_all[c * C:(c + 1) * C].transpose(0, 1)
            qpos = torch.arange(c * C, kv, device=dev)
            mask = torch.arange(kv, device=dev)[None, :] <= qpos[:, None]
            ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
            got = outs[c].transpose(0, 1).float()
            errs[c] = float((got - ref).norm() / ref.norm())
        res["rel_err"] = errs
    except Exception as e:  # noqa: BLE001 - the fault is the result
        res["error"] = repr(e)[:200]
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
