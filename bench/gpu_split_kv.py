"""``split_kv_micro`` section of the GPU benchmark: a decode step's attention (32 layers of distinct KV,
Llama-8B heads, bf16, page 16, pages shuffled) captured in one CUDA graph, flashinfer's graph-mode
tensor-core decode wrapper (split-KV kernel + merge kernel a layer, the engine's default) against
engine.attention.split_kv_decode (one Triton kernel a layer, partials merged in-kernel) for each
launch shape of a small grid (32/64 tokens a tile x 2/3 pipeline stages x 1/2/4 programs per SM;
4 warps) or, with ``--micro-grid wide``, :data:`WIDE_GRID` (44 shapes). Reports
µs a layer, TB/s of KV read, the largest |difference| from the wrapper's output, and per case the
fastest shape beside the engine's shape for that batch size (``default_config``). The cases: the
xqa micro's (B = 1, 8, 32, 128 at ctx 1k and 4k) and B = 2, 4, 16, 64 (the graph buckets between),
or ``--micro-cases``.

K/V layout (``--kv-layout``): "layer_major" gives each layer its own K and V tensors; "page_major"
is the engine's default pool (engine/kvcache/kv_pool.py): one region [pages, 32 layers, 2, page, kv
heads, head_dim], so one layer's pages are 32 KB pieces 2 MB apart (a case needing over 40 GB of it
is skipped).

The wrapper side is the same setup as ``xqa_micro`` (bench/gpu_xqa.py); floor: KV bytes / copy
bandwidth (the graph-replay time of one layer can not go below it).
"""

from __future__ import annotations

import itertools

import torch

from bench.gpu_xqa import CASES as XQA_CASES
from bench.gpu_xqa import D, H, KVH, LAYERS, PS, _graph_us
from engine.attention.split_kv_decode import SplitConfig, SplitKVDecode, default_config, num_splits

CASES = tuple(sorted(set(XQA_CASES) | {(b, c) for b in (2, 4, 16, 64) for c in (1024, 4096)},
                     key=lambda bc: (bc[1], bc[0])))
GRID = [SplitConfig(block_n=n, stages=s, ctas_per_sm=c) for n, s, c in itertools.product((32, 64), (2, 3), (1, 2, 4))]
# ``--micro-grid wide``: 128-token tiles, four stages, three programs an SM and eight warps too (a
# shape whose K/V ring does not fit shared memory fails to launch and is reported as an error)
WIDE_GRID = ([SplitConfig(block_n=n, stages=s, ctas_per_sm=c)
              for n, s, c in itertools.product((32, 64, 128), (2, 3, 4), (1, 2, 3, 4))]
             + [SplitConfig(block_n=n, warps=8, stages=s, ctas_per_sm=c)
                for n, s, c in itertools.product((64, 128), (2, 3), (1, 2))])


def split_kv_micro(args) -> dict:
    """See the module docstring."""
    import flashinfer

    dev, rows = "cuda", []
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = getattr(args, "micro_cases", None) or CASES
    grid = WIDE_GRID if getattr(args, "micro_grid", "small") == "wide" else GRID
    page_major = getattr(args, "kv_layout", None) == "page_major"
    for B, C in cases:
        default = default_config(B)
        npr = C // PS
        P = B * npr
        region_bytes = 2 * (P + 1) * PS * KVH * D * 2 * LAYERS
        if page_major:
            if region_bytes > (40 << 30):
                print(f"split_kv_micro B={B:4d} ctx={C:5d}: skipped (page_major region {region_bytes / 2**30:.0f} GiB)")
                continue
            layers = LAYERS
            region = torch.empty(P + 1, LAYERS, 2, PS, KVH, D, dtype=torch.bfloat16, device=dev).normal_()
            kv = [region[:, i].transpose(0, 1) for i in range(layers)]  # [2, pages, PS, KVH, D] views
            del region  # the views keep it: freed with kv
        else:
            layers = LAYERS if region_bytes <= (16 << 30) else 4
            kv = [torch.randn(2, P + 1, PS, KVH, D, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
        table = torch.randperm(P, device=dev).to(torch.int32).view(B, npr)
        q = torch.randn(B, H, D, dtype=torch.bfloat16, device=dev)
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

        # the engine's inputs: token slots per row (req_to_token), rows, lengths
        t = torch.arange(C, device=dev)
        r2t = (table[:, t // PS].long() * PS + t % PS).to(torch.int32)  # [B, C]
        req_rows = torch.arange(B, device=dev)
        seq = torch.full((B,), C, dtype=torch.int64, device=dev)
        byts = 2 * B * C * KVH * D * 2
        row = {"batch": B, "context": C, "layers": layers, "kv_layout": "page_major" if page_major else "layer_major",
               "floor_us": byts / args.copy_bw * 1e6, "shapes": []}
        try:
            row["flashinfer_us"] = _graph_us(run_fi, layers)
            row["flashinfer_TBps"] = byts / row["flashinfer_us"] / 1e6
        except Exception as e:
            row["flashinfer_error"] = repr(e)[:300]
        for cfg in grid + ([default] if default not in grid else []):
            att = SplitKVDecode(H, KVH, D, PS, B, dev, scale=D ** -0.5, sms=sms, config=cfg)
            outs = [torch.empty(B, H, D, dtype=torch.bfloat16, device=dev) for _ in range(layers)]

            def run_sk():
                for i in range(layers):
                    att(q, kv[i][0], kv[i][1], r2t, req_rows, seq, out=outs[i])

            shape = {"block_n": cfg.block_n, "warps": cfg.warps, "stages": cfg.stages, "ctas_per_sm": cfg.ctas_per_sm,
                     "splits": num_splits(B, KVH, sms, cfg.ctas_per_sm)}
            try:
                shape["us"] = _graph_us(run_sk, layers)
                shape["TBps"] = byts / shape["us"] / 1e6
                if "flashinfer_us" in row:
                    shape["max_abs_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(fi_out, outs))
                shape["counters_zero"] = int(att.counter.abs().sum()) == 0
            except Exception as e:
                shape["error"] = repr(e)[:300]
            row["shapes"].append(shape)
            if cfg == default:
                row["default"] = shape
            del att, outs
        ok = [s for s in row["shapes"] if "us" in s]
        if ok:
            row["best"] = min(ok, key=lambda s: s["us"])
        fi = row.get("flashinfer_us", float("nan"))
        best, dflt = row.get("best", {}), row.get("default", {})
        print(f"split_kv_micro B={B:4d} ctx={C:5d}: flashinfer {fi:7.2f} us/layer | default "
              f"{dflt.get('us', float('nan')):7.2f} | best {best.get('us', float('nan')):7.2f} "
              f"(n{best.get('block_n')} w{best.get('warps')} s{best.get('stages')} c{best.get('ctas_per_sm')} S{best.get('splits')}) "
              f"max|diff| {best.get('max_abs_diff', float('nan')):.2e} floor {row['floor_us']:.2f}", flush=True)
        rows.append(row)
        del kv, w
        torch.cuda.empty_cache()
    return {"rows": rows}
