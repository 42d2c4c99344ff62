"""Decode section of the GPU benchmark: 8B dummy weights, batch x context grid. Median step time
(graph replay incl. plan and input copies; the whole step with device argmax + .tolist(); the host
launch time; steps queued back to back) vs the floor (weight bytes + KV bytes read) / copy bandwidth;
eager (no graph) at a few points."""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.gpu_runner import PAGE_SIZE, build_runner, decode_batch, decode_rows
from bench.gpu_timing import events_ms


def weight_bytes(model) -> tuple[int, int]:
    """(bytes a decode step reads: every parameter but the embedding table, embedding bytes)."""
    emb = model.model.embed_tokens.weight
    # fused projections: the q/k/v / gate/up params are views into one tensor each; count each view once
    tot = 0
    seen_st = set()
    for name, p in model.named_parameters():
        if p is emb:
            continue
        st = p.untyped_storage().data_ptr()
        key = (st, p.storage_offset())
        if key in seen_st:
            continue
        seen_st.add(key)
        tot += p.numel() * p.element_size()
    return tot, emb.numel() * emb.element_size()


def decode(args) -> dict:
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    maxB, maxC = max(batches), max(contexts)
    ps = PAGE_SIZE
    pages_per_req = -(-(maxC + 1) // ps)
    num_pages = maxB * pages_per_req + 8
    runner, load_s = build_runner(args, maxB, maxC + ps, num_pages)
    mc = runner.model_config
    kv_tok = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2  # bytes per token (bf16 K+V)
    for buf in runner.kv_pool.buffers():  # random K/V (never time on zeros)
        buf.normal_()
    wbytes, ebytes = weight_bytes(runner.model)
    bw = args.copy_bw
    rows, slots = decode_rows(runner, maxB, maxC)
    results = []
    g = torch.Generator().manual_seed(0)
    for C in contexts:
        for B in batches:
            ids = torch.randint(0, mc.vocab_size, (B,), generator=g).tolist()
            batch = decode_batch(rows, slots, C, ids)
            fwd = lambda: runner.forward(batch)  # noqa: E731
            ms_graph = statistics.median(events_ms(fwd, args.iters))
            gr = runner.graph_runner
            replay = gr.graphs[gr.bucket_for(B)].replay
            ms_replay = statistics.median(events_ms(replay, args.iters))

            def step():
                runner.forward(batch).argmax(-1).tolist()

            for _ in range(3):
                step()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            ms_step = (time.perf_counter() - t0) / args.iters * 1e3
            # host time of one step's launch (input copies + plan + replay launch), GPU idle meanwhile
            host = []
            for _ in range(args.iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                runner.forward(batch)
                host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            ms_host = statistics.median(host)
            # steps queued back to back with no per-step sync: the step time of a scheduler that
            # prepares step n+1 while the GPU runs step n (sglang's overlap scheduler); ours syncs
            t0 = time.perf_counter()
            for _ in range(args.iters):
                runner.forward(batch)
            torch.cuda.synchronize()
            ms_pipelined = (time.perf_counter() - t0) / args.iters * 1e3
            kv_read = B * C * kv_tok
            floor_bytes = wbytes + kv_read + B * ebytes // mc.vocab_size
            floor_ms = floor_bytes / bw * 1e3
            row = {"batch": B, "context": C, "graph_ms": ms_graph, "replay_ms": ms_replay, "step_ms": ms_step,
                   "floor_ms": floor_ms, "frac_of_floor_replay": floor_ms / ms_replay,
                   "weight_bytes": wbytes, "kv_bytes": kv_read, "frac_of_floor_graph": floor_ms / ms_graph,
                   "frac_of_floor_step": floor_ms / ms_step, "host_ms": ms_host, "pipelined_ms": ms_pipelined,
                   "frac_of_floor_pipelined": floor_ms / ms_pipelined,
                   "achieved_TBps_graph": floor_bytes / (ms_graph / 1e3) / 1e12}
            if B in args.eager_batches and C == contexts[0]:
                eager = lambda: runner.model(batch, runner.backend)  # noqa: E731
                with torch.inference_mode():
                    row["eager_ms"] = statistics.median(events_ms(eager, max(5, args.iters // 2)))
            results.append(row)
            print(json.dumps(row), flush=True)
    out = {"model": args.model, "load_s": load_s, "copy_bw_Bps": bw, "kv_bytes_per_token": kv_tok,
           "weight_bytes": wbytes, "buckets": runner.graph_runner.buckets, "rows": results}
    del runner
    torch.cuda.empty_cache()
    return out

