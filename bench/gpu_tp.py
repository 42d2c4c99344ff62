"""Tensor-parallel decode on one host's GPUs: TP=1 vs TP=2 decode step time (CUDA graphs, fused
ops), Llama-3.1-8B shape with bf16 dummy weights, a batch x context grid, each beside its floor.

    python -m bench.gpu_tp [--out bench/results/gpu_tp.json] [--batches 1,8,32,128] [--contexts 1024,4096]

Floor of one step on each GPU (the ranks run in parallel, so the step is one rank's time):
``(weights / tp + KV read / tp) / copy bandwidth`` plus, for tp > 1, the collectives a step makes:
two all-reduces per layer (o_proj, down_proj) and one for the embedding, of ``B x hidden`` bf16
each, and the lm_head's gather of ``B x vocab / tp`` bf16 to rank 0, each costing
``--collective-latency-us`` + bytes / ``--link-bw`` (a 2-rank ring moves the message once per rank).
Both collective constants are assumptions (flags), not measurements.

Rows: ``graph_ms`` (CUDA events around ``runner.forward``: under TP the batch broadcast + the
replay on rank 0, whose graph waits on the follower's inside each all-reduce), ``step_ms`` (wall,
with the device argmax and ``.tolist()`` as a scheduler step), ``eager_ms`` at ``--eager-batches``
(the same forward without graphs). Needs >= 2 CUDA devices: refuses with one line otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from bench.gpu_ceilings import floor_ceilings

BF16 = 2


def floor_ms(cfg, tp: int, batch: int, context: int, copy_bw: float, latency_us: float, link_bw: float) -> dict:
    """The floor of one decode step on each of ``tp`` GPUs (module docstring): milliseconds of its
    memory part, its collective part and their sum, and the bytes behind them."""
    h, inter, L, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    weights = (L * (h * (q + 2 * kv) + q * h + 3 * h * inter) + cfg.vocab_size * h) * BF16  # all but the embedding
    kv_read = batch * context * 2 * L * kv * BF16
    mem_ms = (weights + kv_read) / tp / copy_bw * 1e3
    coll_ms = 0.0
    if tp > 1:
        messages = [batch * h * BF16] * (2 * L + 1) + [batch * cfg.vocab_size // tp * BF16]
        coll_ms = sum(latency_us * 1e-3 + n / link_bw * 1e3 for n in messages)
    return {"floor_ms": mem_ms + coll_ms, "mem_floor_ms": mem_ms, "collective_floor_ms": coll_ms,
            "weight_bytes_per_gpu": weights // tp, "kv_bytes_per_gpu": kv_read // tp}


def _time_runner(runner, args, tp: int, batches: list[int], contexts: list[int]) -> list[dict]:
    from bench.gpu_runner import decode_batch, decode_rows
    from bench.gpu_timing import events_ms

    mc = runner.model_config
    # random K/V (never time on zeros): rank 0's pool; a follower's stays zeros (bench runs no code
    # on it), so rank 0's attention is the one timed on real values
    for buf in runner.kv_pool.buffers():
        buf.normal_()
    rows, slots = decode_rows(runner, max(batches), max(contexts))
    g = torch.Generator().manual_seed(0)
    out = []
    for C in contexts:
        for B in batches:
            batch = decode_batch(rows, slots, C, torch.randint(0, mc.vocab_size, (B,), generator=g).tolist())
            graph_ms = statistics.median(events_ms(lambda: runner.forward(batch), args.iters))
            for _ in range(3):
                runner.forward(batch).argmax(-1).tolist()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                runner.forward(batch).argmax(-1).tolist()
            step_ms = (time.perf_counter() - t0) / args.iters * 1e3
            row = {"tp": tp, "batch": B, "context": C, "graph_ms": graph_ms, "step_ms": step_ms,
                   **floor_ms(mc, tp, B, C, args.copy_bw, args.collective_latency_us, args.link_bw)}
            row["frac_of_floor_graph"] = row["floor_ms"] / graph_ms
            if B in args.eager_batches and C == contexts[0]:
                every = torch.arange(B, device=batch.input_ids.device)  # a logit_index: the eager path
                row["eager_ms"] = statistics.median(events_ms(lambda: runner.forward(batch, every),
                                                              max(5, args.iters // 2)))
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def run(args) -> dict:
    """Both TP sizes' rows (TP=1 first, freed before TP=2 starts) and the measured / floor speedups."""
    from bench.gpu_runner import PAGE_SIZE, build_runner

    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    num_pages = max(batches) * -(-(max(contexts) + 1) // PAGE_SIZE) + 8
    res = {"model": args.model, "copy_bw_Bps": args.copy_bw, "collective_latency_us": args.collective_latency_us,
           "link_bw_Bps": args.link_bw, "torch": torch.__version__, "rows": [], "load_s": {}}
    for tp in args.tps:
        runner, res["load_s"][tp] = build_runner(args, max(batches), max(contexts) + PAGE_SIZE, num_pages, tp=tp)
        try:
            res.setdefault("buckets", runner.graph_runner.buckets if runner.graph_runner else None)
            res["rows"] += _time_runner(runner, args, tp, batches, contexts)
        finally:
            runner.close()
            del runner
            torch.cuda.empty_cache()
    by = {(r["tp"], r["batch"], r["context"]): r for r in res["rows"]}
    res["speedup"] = [{"batch": B, "context": C, "measured": by[1, B, C]["graph_ms"] / by[2, B, C]["graph_ms"],
                       "floor": by[1, B, C]["floor_ms"] / by[2, B, C]["floor_ms"]}
                      for (tp, B, C) in by if tp == 1 and (2, B, C) in by]
    return res


def table(res: dict) -> str:
    """TP=1 and TP=2 side by side per (batch, context): measured, floor, and their speedups."""
    by = {(r["tp"], r["batch"], r["context"]): r for r in res["rows"]}
    lines = ["  B   ctx | tp1 graph_ms floor_ms | tp2 graph_ms floor_ms (mem + coll) eager_ms | "
             "speedup measured floor"]
    for s in res["speedup"]:
        one, two = by[1, s["batch"], s["context"]], by[2, s["batch"], s["context"]]
        lines.append(f"{s['batch']:4d} {s['context']:5d} | {one['graph_ms']:12.3f} {one['floor_ms']:8.3f} | "
                     f"{two['graph_ms']:12.3f} {two['floor_ms']:8.3f} ({two['mem_floor_ms']:.3f} + "
                     f"{two['collective_floor_ms']:.3f}) {two.get('eager_ms', float('nan')):8.3f} | "
                     f"{s['measured']:16.2f}x {s['floor']:5.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/gpu_tp.json")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tps", default=[1, 2], type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--eager-batches", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--copy-bw", type=float, default=None,
                   help="B/s per GPU (default: the GPU model's nominal, bench.gpu_ceilings.NOMINAL; H200 4.26e12)")
    p.add_argument("--collective-latency-us", type=float, default=8.0,
                   help="assumed time of one small NCCL collective inside a graph, microseconds")
    p.add_argument("--link-bw", type=float, default=450e9, help="assumed NVLink B/s per direction between the two GPUs")
    args = p.parse_args(argv)
    n = torch.cuda.device_count()
    if n < max(args.tps):
        print(f"error: bench.gpu_tp needs {max(args.tps)} CUDA devices (TP={max(args.tps)}); this host has {n}",
              file=sys.stderr)
        return 2
    args.copy_bw, _ = floor_ceilings(args.copy_bw, None)
    res = run(args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
