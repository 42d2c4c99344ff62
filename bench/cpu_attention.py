"""CPU decode attention alone: the ``cpu_paged`` kernel vs ``torch_paged``, against the KV-read floor.

    .venv/bin/python -m bench.cpu_attention [--threads 1,2] [--batches 1,8] [--contexts 200,640,2000]
                                            [--json out.json]

One decode step's attention over every layer of a SmolLM2-135M-shaped pool (30 layers, 9 q heads,
3 kv heads, head_dim 64, page 16, float32, page_major by default; ``--layout``, ``--dtype``): for
each thread count, batch B and context C, B rows of C + 1 tokens on pages scattered at random over
a pool with no other pages, then ``backend.init_forward`` + ``forward`` of all layers (the new
token's K/V store included), as the model runs it. Both backends run in each repetition, the order
alternating, so load from other processes hits both alike; figures are medians over repetitions.

Floor: the K/V bytes one step must read (``2 * layers * B * (C + 1) * kv_heads * head_dim *
itemsize``) over the copy bandwidth measured in this run on that many threads (``copy_bandwidth``
of bench/cpu_decode.py: read + write counted, STREAM's convention). ``x_floor`` = time / floor
(1.0 = at the floor). ``max_abs_diff``: largest |cpu_paged - torch_paged| over the outputs.
JSON on stdout (or ``--json``), a table on stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.cpu_decode import copy_bandwidth
from bench.results_file import print_result

LAYERS, H, KVH, D, PS = 30, 9, 3, 64, 16
NAMES = ("torch_paged", "cpu_paged")


def setup(batch: int, ctx: int, layout: str, dtype: torch.dtype, seed: int):
    """(backend kwargs, decode batch, q, k, v) for B rows of ``ctx`` cached tokens."""
    from engine.forward_batch import ForwardBatch
    from engine.kvcache.kv_pool import KVPool
    from engine.kvcache.req_to_token_pool import ReqToTokenPool

    g = torch.Generator().manual_seed(seed)
    per_row = -(-(ctx + 1) // PS)
    pages = batch * per_row
    pool = KVPool(pages, PS, LAYERS, KVH, D, dtype, "cpu", layout=layout)
    for buf in pool.buffers():
        buf.copy_(torch.randn(buf.shape, generator=g))
    r2t = ReqToTokenPool(batch, ctx + PS)
    order = torch.randperm(pages, generator=g)
    rows = []
    for b in range(batch):
        row = r2t.alloc()
        own = order[b * per_row:(b + 1) * per_row]
        r2t.write(row, 0, (own[:, None] * PS + torch.arange(PS)[None, :]).reshape(-1)[:ctx + 1])
        rows.append(row)
    batch_ = ForwardBatch.decode(rows, [ctx] * batch, [0] * batch, r2t.req_to_token)
    kw = dict(kv_pool=pool, req_to_token_pool=r2t, num_heads=H, num_kv_heads=KVH, head_dim=D)
    q = torch.randn(batch, H, D, generator=g).to(dtype)
    k, v = (torch.randn(batch, KVH, D, generator=g).to(dtype) for _ in range(2))
    return kw, batch_, q, k, v


def measure(batch: int, ctx: int, layout: str, dtype: torch.dtype, repeats: int) -> dict:
    from engine.attention import create_backend

    kw, fb, q, k, v = setup(batch, ctx, layout, dtype, seed=batch * 7919 + ctx)
    backends = {n: create_backend(n, **kw) for n in NAMES}
    times = {n: [] for n in NAMES}
    outs = {}
    for rep in range(repeats + 1):  # the first round warms up and is not counted
        for n in (NAMES if rep % 2 == 0 else NAMES[::-1]):
            be = backends[n]
            t = time.perf_counter()
            be.init_forward(fb)
            o = [be.forward(q, k, v, layer, fb) for layer in range(LAYERS)]
            if rep:
                times[n].append(time.perf_counter() - t)
            outs[n] = o
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs[NAMES[0]], outs[NAMES[1]]))
    return dict(ms={n: statistics.median(v) * 1e3 for n, v in times.items()}, max_abs_diff=diff)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="200,640,2000")
    ap.add_argument("--layout", default="page_major", choices=["page_major", "layer_major"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    from engine.cpu_kernels import PAGED_DECODE as cpu_kernel

    mod, why = cpu_kernel.load()
    if mod is None:
        print(f"error: cpu_paged kernel unavailable: {why}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    threads = [int(x) for x in args.threads.split(",")]
    bw = {t: copy_bandwidth(t) for t in threads}
    load_before = os.getloadavg()
    results = []
    for t in threads:
        torch.set_num_threads(t)
        for b in [int(x) for x in args.batches.split(",")]:
            for c in [int(x) for x in args.contexts.split(",")]:
                m = measure(b, c, args.layout, dtype, args.repeats)
                kv = 2 * LAYERS * b * (c + 1) * KVH * D * torch.empty(0, dtype=dtype).element_size()
                floor_ms = kv / bw[t] * 1e3
                tp, cp = m["ms"]["torch_paged"], m["ms"]["cpu_paged"]
                r = dict(threads=t, batch=b, ctx=c, kv_mb=round(kv / 1e6, 1), floor_ms=round(floor_ms, 2),
                         torch_paged_ms=round(tp, 2), cpu_paged_ms=round(cp, 2), speedup=round(tp / cp, 2),
                         cpu_paged_x_floor=round(cp / floor_ms, 2), torch_paged_x_floor=round(tp / floor_ms, 2),
                         max_abs_diff=m["max_abs_diff"], load_avg_1m=os.getloadavg()[0])
                results.append(r)
                print(f"threads={t} B={b} ctx={c}: torch_paged {tp:.2f} ms, cpu_paged {cp:.2f} ms (x{tp / cp:.2f}), "
                      f"floor {floor_ms:.2f} ms", file=sys.stderr, flush=True)
    out = dict(bench="cpu_attention", layout=args.layout, dtype=args.dtype, torch=torch.__version__,
               cpus=os.cpu_count(), repeats=args.repeats, shape=dict(layers=LAYERS, q_heads=H, kv_heads=KVH,
                                                                   head_dim=D, page_size=PS),
               copy_bandwidth_gb_s={str(t): round(v / 1e9, 2) for t, v in bw.items()},
               load_avg_before=load_before, load_avg_after=os.getloadavg(), results=results,
               note="times: all layers' attention of one decode step (init_forward + forward incl. the KV store); "
                    "floor = K/V bytes / copy bandwidth on that many threads; speedup = torch_paged / cpu_paged")
    print_result(out, args.json)
    print("| threads | B | ctx | KV MB | floor ms | torch_paged ms | cpu_paged ms | speedup | cpu_paged x floor | "
          "torch_paged x floor | load 1m |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in results:
        print(f"| {r['threads']} | {r['batch']} | {r['ctx']} | {r['kv_mb']} | {r['floor_ms']} | {r['torch_paged_ms']} | "
              f"{r['cpu_paged_ms']} | {r['speedup']} | {r['cpu_paged_x_floor']} | {r['torch_paged_x_floor']} | "
              f"{r['load_avg_1m']:.2f} |", file=sys.stderr)
    print(f"copy bandwidth GB/s {out['copy_bandwidth_gb_s']}; load average before {load_before}, "
          f"after {out['load_avg_after']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
