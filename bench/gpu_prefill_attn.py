"""prefill_attn section of the GPU benchmark: the causal attention of a whole-prompt prefill alone,
per kernel family, against the GEMM-rate floor.

The 8k prefill spends ~31 ms of its ~212 (H200) in flashinfer's ragged FA3 kernel (566 TFLOP/s of
causal attention FLOPs); this times the same work, one prompt of T tokens through 32 layers of
distinct q/k/v (Llama-8B heads: 32 query heads, 8 KV heads, head_dim 128, bf16, [T, heads, 128]
as the engine's fused q/k/v projection leaves them), through each kernel that can take it:

* ``fi_fa3``, ``fi_fa2``: ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper`` (what the engine runs),
* ``fi_cudnn``: ``flashinfer.cudnn.cudnn_batch_prefill_with_kv_cache`` (cuDNN's SDPA graph, token
  offsets, no paging),
* ``torch_cudnn``, ``torch_flash``: ``F.scaled_dot_product_attention`` pinned to cuDNN / FlashAttention-2,
  inputs as [1, heads, T, 128] views (no copy) and the output copied back to [T, heads * 128] (the
  engine's layout: that copy is in the time),

(TensorRT-LLM's FMHA v2 through flashinfer is not a candidate: its JIT module builds 176 sm90
kernels, every head size and variant, more than a device call has time for.)

FLOPs per layer = 2 * T^2 * head_dim * heads (causal: half of QK^T + PV). Each candidate's output is
compared with ``fi_fa3``'s (max |diff|, inputs N(0, 1)). A candidate that fails reports its error.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

from bench.gpu_timing import events_ms

H, KVH, D, LAYERS = 32, 8, 128, 32


def _fi_ragged(backend: str, T: int, ws: torch.Tensor):
    import flashinfer

    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
    ind = torch.tensor([0, T], dtype=torch.int32)
    w.plan(ind, ind, H, KVH, D, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return lambda q, k, v: w.run(q, k, v)


def _fi_cudnn(T: int, ws: torch.Tensor):
    from flashinfer.cudnn import cudnn_batch_prefill_with_kv_cache

    ind = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    lens = torch.tensor([T], dtype=torch.int32, device="cuda").reshape(1, 1, 1, 1)

    def run(q, k, v):
        o, _ = cudnn_batch_prefill_with_kv_cache(
            q, k, v, 1.0 / math.sqrt(D), ws, max_token_per_sequence=T, max_sequence_kv=T,
            actual_seq_lens_q=lens, actual_seq_lens_kv=lens, causal=True, return_lse=False,
            batch_offsets_q=ind, batch_offsets_k=ind, batch_offsets_units="tokens")
        return o
    return run


def _torch_sdpa(backend) -> callable:
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1).contiguous()
    return run


def prefill_attn(args) -> dict:
    """µs per layer and TFLOP/s of each candidate at each prompt length (``--prefill-tokens`` and
    its quarter), with the floor FLOPs / ``args.gemm_rate``; see the module docstring."""
    from torch.nn.attention import SDPBackend

    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    names = [n for n in getattr(args, "attn_candidates", "").split(",") if n] or [
        "fi_fa3", "fi_fa2", "fi_cudnn", "torch_cudnn", "torch_flash"]
    rows = []
    for T in (args.prefill_tokens, args.prefill_tokens // 4):
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = [(torch.randn(T, H, D, dtype=torch.bfloat16, device="cuda", generator=g),
                torch.randn(T, KVH, D, dtype=torch.bfloat16, device="cuda", generator=g),
                torch.randn(T, KVH, D, dtype=torch.bfloat16, device="cuda", generator=g)) for _ in range(LAYERS)]
        flops = 2 * T * T * D * H
        floor_us = flops / args.gemm_rate * 1e6
        ref = None
        for name in ["fi_fa3", *[n for n in names if n != "fi_fa3"]]:
            try:
                fn = {"fi_fa3": lambda: _fi_ragged("fa3", T, ws), "fi_fa2": lambda: _fi_ragged("fa2", T, ws),
                      "fi_cudnn": lambda: _fi_cudnn(T, ws),
                      "torch_cudnn": lambda: _torch_sdpa(SDPBackend.CUDNN_ATTENTION),
                      "torch_flash": lambda: _torch_sdpa(SDPBackend.FLASH_ATTENTION)}[name]()
                out = fn(*qkv[0]).reshape(T, H * D)
                diff = None if ref is None else float((out.float() - ref).abs().max())
                if ref is None:
                    ref = out.float()

                def every_layer():
                    for q, k, v in qkv:
                        fn(q, k, v)
                ms = [statistics.median(events_ms(every_layer, 5, warmup=2)) for _ in range(2)]
                us = [m * 1e3 / LAYERS for m in ms]
                r = {"name": name, "tokens": T, "us_per_layer": us, "TFLOPs": [flops / u / 1e6 for u in us],
                     "frac_of_floor": [floor_us / u for u in us], "max_abs_diff_vs_fi_fa3": diff}
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is a result too
                r = {"name": name, "tokens": T, "error": repr(e)[:300]}
            rows.append(r)
            print(f"prefill_attn {r}", flush=True)
        del qkv, ref
        torch.cuda.empty_cache()
    return {"rows": rows, "floor_gemm_flops": args.gemm_rate}
