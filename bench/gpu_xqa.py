"""``xqa_micro`` section of the GPU benchmark: decode attention of a whole step (32 layers, Llama-8B
heads, bf16, page 16, pages shuffled) as the decode graph runs it today (flashinfer's graph-mode
tensor-core decode wrapper: split-KV kernel + merge kernel per layer) against flashinfer's ``xqa``
(TensorRT-LLM's XQA decode kernel: one kernel per layer, the split-KV partials merged in-kernel by
the last CTA of each (request, kv head), no host plan), both captured in one CUDA graph of 32 calls
on 32 distinct layers' KV (no layer reads another's KV from L2; 4 layers where 32 would pass 16 GB:
B = 128 at ctx 4k), and, as a third candidate, flashinfer's paged prefill wrapper on its FA3
(Hopper, TMA + warp-specialised) kernels with one query row per request (graph mode, planned like
the decode wrapper; GQA packs the 4 query heads of a KV head into its rows). Reports µs per layer,
TB/s of KV read and the largest |difference| from the decode wrapper's output (the same attention;
bf16 rounding apart). cuDNN's paged decode is not a candidate: it wants the HND page layout
[pages, kv heads, page, D] contiguous, and the pool is NHD.

A question for the decode step, not a feature: session 11's graph profile put attention + merge at
0.40 ms of a 4.83 ms step at B=1 ctx 1k (10.1 + 2.3 µs a layer for 4 MB of KV).
"""

from __future__ import annotations

import statistics

import torch

from bench.gpu_timing import events_ms

H, KVH, D, PS, LAYERS = 32, 8, 128, 16, 32
CASES = ((1, 1024), (8, 1024), (32, 1024), (128, 1024), (1, 4096), (8, 4096), (32, 4096), (128, 4096))


def _graph_us(fn, layers: int) -> float:
    fn()  # warm-up outside the graph (JIT, lazy init)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    us = statistics.median(events_ms(g.replay, 20)) * 1e3 / layers
    del g
    return us


def xqa_micro(args) -> dict:
    """See the module docstring."""
    import flashinfer

    xqa = flashinfer.xqa if callable(flashinfer.xqa) else flashinfer.xqa.xqa  # the package re-exports it
    dev, rows = "cuda", []
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    xws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    ws3 = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    for B, C in CASES:
        npr = C // PS  # pages per row
        P = B * npr
        layers = LAYERS if 2 * P * PS * KVH * D * 2 * LAYERS <= (16 << 30) else 4
        kv = [torch.randn(2, P + 1, PS, KVH, D, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
        table = torch.randperm(P, device=dev).to(torch.int32).view(B, npr)
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device=dev)
        # flashinfer graph-mode decode wrapper, as engine.cuda_graph_runner builds and plans it
        indptr = torch.arange(0, P + 1, npr, dtype=torch.int32)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=torch.zeros(B + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=table.flatten().clone(),
            paged_kv_last_page_len_buffer=torch.ones(B, dtype=torch.int32, device=dev))
        w.plan(indptr, table.flatten().cpu(), torch.full((B,), PS, dtype=torch.int32), H, KVH, D, PS,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=D ** -0.5)
        fi_out = [torch.empty(B, H, D, dtype=torch.bfloat16, device=dev) for _ in range(layers)]

        def run_fi():
            for i in range(layers):
                w.run(q, (kv[i][0], kv[i][1]), out=fi_out[i])

        # xqa: q/out [B, 1, H, D], page table [B, pages], lengths uint32 [B, 1]; no plan
        seq = torch.full((B, 1), C, dtype=torch.uint32, device=dev)
        sem = torch.zeros(B * KVH * 4, dtype=torch.uint32, device=dev)
        x_out = [torch.empty(B, 1, H, D, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
        q4 = q.view(B, 1, H, D)

        def run_xqa():
            for i in range(layers):
                xqa(q4, kv[i][0], kv[i][1], table, seq, x_out[i], xws, sem, KVH, PS,
                                   q_scale=1.0)  # xqa scales by q_scale / sqrt(D)
        # FA3 through the paged prefill wrapper: one query row per request (qo_indptr 0, 1, ..., B)
        qo, w3 = torch.arange(B + 1, dtype=torch.int32), None
        f3_out = [torch.empty(B, H, D, dtype=torch.bfloat16, device=dev) for _ in range(layers)]

        def run_fa3():
            for i in range(layers):
                w3.run(q, (kv[i][0], kv[i][1]), out=f3_out[i])

        row = {"batch": B, "context": C, "layers": layers}
        byts = 2 * B * C * KVH * D * 2  # K and V read per layer
        try:  # built inside: a flashinfer or GPU without FA3 records fa3_error, the other two still run
            w3 = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                ws3, "NHD", use_cuda_graph=True, backend="fa3",
                qo_indptr_buf=qo.to(dev), paged_kv_indptr_buf=indptr.to(dev),
                paged_kv_indices_buf=table.flatten().clone(),
                paged_kv_last_page_len_buf=torch.full((B,), PS, dtype=torch.int32, device=dev))
            w3.plan(qo, indptr, table.flatten().cpu(), torch.full((B,), PS, dtype=torch.int32), H, KVH, D, PS,
                    causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=D ** -0.5)
            row["fa3_us"] = _graph_us(run_fa3, layers)
            row["fa3_TBps"] = byts / row["fa3_us"] / 1e6
        except Exception as e:  # the other two still run
            row["fa3_error"] = repr(e)[:400]
        try:
            row["flashinfer_us"] = _graph_us(run_fi, layers)
            row["xqa_us"] = _graph_us(run_xqa, layers)
            row["max_abs_diff"] = max((a.float() - b.view(B, H, D).float()).abs().max().item()
                                      for a, b in zip(fi_out, x_out))
            if "fa3_us" in row:
                row["fa3_max_abs_diff"] = max((a.float() - b.float()).abs().max().item()
                                              for a, b in zip(fi_out, f3_out))
            row["flashinfer_TBps"] = byts / row["flashinfer_us"] / 1e6
            row["xqa_TBps"] = byts / row["xqa_us"] / 1e6
            print(f"xqa_micro B={B:4d} ctx={C:5d}: flashinfer {row['flashinfer_us']:7.2f} us/layer "
                  f"({row['flashinfer_TBps']:.2f} TB/s) | xqa {row['xqa_us']:7.2f} ({row['xqa_TBps']:.2f})"
                  f"  max|diff| {row['max_abs_diff']:.2e} | fa3 "
                  + (f"{row['fa3_us']:7.2f} ({row['fa3_TBps']:.2f}) max|diff| {row['fa3_max_abs_diff']:.2e}"
                     if "fa3_us" in row else row.get("fa3_error", "")), flush=True)
        except Exception as e:  # report and go on to the next case
            row["error"] = repr(e)[:400]
            print(f"xqa_micro B={B} ctx={C}: error {row['error']}", flush=True)
        rows.append(row)
        del kv, w, w3
        torch.cuda.empty_cache()
    return {"rows": rows}
