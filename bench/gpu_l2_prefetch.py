"""``l2_prefetch_micro`` section of the GPU benchmark: does asking the L2 for the o projection's weight
during the attention (engine.l2_prefetch) shorten the attention + o part of a decode step?

A step's layer, as the decode graph runs it, from the q/k/v GEMM to the o GEMM, 32 layers in one CUDA
graph (Llama-3.1-8B shapes, bf16, each layer its own weights and KV, the engine's page-major pool and
int64 ``req_to_token``): q/k/v GEMM ([B, 4096] x [4096, 6144]), split-KV attention
(engine.attention.split_kv_decode), o GEMM ([B, 4096] x [4096, 4096]; tinygemm at B <= 8 as the
engine's graphs, cuBLAS above). Variants:

* ``base``: as the engine today;
* ``inline``: the attention's programs prefetch the layer's o weight (one launch, no new kernel);
* ``side``: :func:`engine.l2_prefetch.prefetch_l2` of the o weight on a side stream forked after the
  q/k/v GEMM (its own 16-CTA kernel, running beside the attention);
* ``no_o``: q/k/v + attention only, so that ``variant - no_o`` is what the o GEMM adds.

Floor: the layer's bytes (q/k/v and o weights + KV) / copy bandwidth (``args.copy_bw``). Reports µs a
layer; a variant that is faster in both runs and keeps its ``o_us`` below ``base``'s is the evidence
for wiring it in. Cases: ``--micro-cases`` (default 1x1024, 8x1024, 32x1024, 1x4096, 8x4096, 32x4096).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.gpu_split_kv_factors import _inputs
from bench.gpu_xqa import D, H, KVH, LAYERS, PS, _graph_us
from engine.attention.split_kv_decode import SplitKVDecode
from engine.l2_prefetch import byte_view, prefetch_l2

HIDDEN = H * D
QKV = (H + 2 * KVH) * D
CASES = ((1, 1024), (8, 1024), (32, 1024), (1, 4096), (8, 4096), (32, 4096))
VARIANTS = ("base", "inline", "side", "no_o")


def _o_gemm(flashinfer, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    if x.shape[0] <= 8:
        flashinfer.gemm.tinygemm_bf16(x, w, out, None, True)
    else:
        torch.mm(x, w.t(), out=out)


def l2_prefetch_micro(args) -> dict:
    """See the module docstring."""
    import flashinfer

    dev, rows_out = "cuda", []
    cases = getattr(args, "micro_cases", None) or CASES
    w_qkv = [torch.randn(QKV, HIDDEN, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(LAYERS)]
    w_o = [torch.randn(HIDDEN, HIDDEN, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(LAYERS)]
    w_o_bytes = [byte_view(w) for w in w_o]
    side = torch.cuda.Stream()
    for B, C in cases:
        pool, r2t, rows, seq, _ = _inputs(B, C, dev)
        att = SplitKVDecode(H, KVH, D, PS, B, dev, scale=D ** -0.5)
        x = torch.randn(B, HIDDEN, dtype=torch.bfloat16, device=dev)
        qkv = torch.empty(B, QKV, dtype=torch.bfloat16, device=dev)
        attn_out = torch.empty(B, H, D, dtype=torch.bfloat16, device=dev)
        y = torch.empty(B, HIDDEN, dtype=torch.bfloat16, device=dev)
        q = qkv[:, : H * D].view(B, H, D)

        def step(variant: str) -> None:
            cur = torch.cuda.current_stream()
            for i in range(LAYERS):
                torch.mm(x, w_qkv[i].t(), out=qkv)
                if variant == "side":
                    side.wait_stream(cur)
                    with torch.cuda.stream(side):
                        prefetch_l2(w_o[i])
                att(q, pool.k_pages(i), pool.v_pages(i), r2t, rows, seq, out=attn_out,
                    prefetch=w_o_bytes[i] if variant == "inline" else None)
                if variant != "no_o":
                    _o_gemm(flashinfer, attn_out.view(B, HIDDEN), w_o[i], y)
            if variant == "side":
                cur.wait_stream(side)

        outs = {}
        for variant in ("base", "inline"):  # the prefetch must not change the attention's output
            step(variant)
            outs[variant] = attn_out.clone()
        row = {"batch": B, "context": C, "us": {v: [] for v in VARIANTS},
               "inline_equal": bool(torch.equal(outs["base"], outs["inline"]))}
        for _ in range(2):  # two interleaved runs
            for v in VARIANTS:
                row["us"][v].append(_graph_us(lambda: step(v), LAYERS))
        kv_bytes = C * KVH * D * 2 * 2 * B
        layer_bytes = (QKV + HIDDEN) * HIDDEN * 2 + kv_bytes
        row["floor_us"] = layer_bytes / args.copy_bw * 1e6 if args.copy_bw else None
        row["o_us"] = {v: [a - b for a, b in zip(row["us"][v], row["us"]["no_o"])] for v in VARIANTS if v != "no_o"}
        print(f"l2_prefetch_micro B={B:3d} ctx={C:5d}: " + " | ".join(
            f"{v} {'/'.join(f'{t:.2f}' for t in row['us'][v])}" for v in VARIANTS)
            + f" | floor {row['floor_us'] or 0:.2f} us/layer | inline output equal {row['inline_equal']}", flush=True)
        rows_out.append(row)
        del pool, r2t, att
        torch.cuda.empty_cache()
    return {"rows": rows_out}


def table_lines(res: dict) -> list[str]:
    """The section's table (µs a layer, two runs each) for bench.gpu's report."""
    lines = ["l2_prefetch_micro  B   ctx  floor_us  " + "  ".join(f"{v:>15s}" for v in VARIANTS)
             + "  o_us base | inline | side (run 1)"]
    for r in res.get("rows", []):
        cells = "  ".join(f"{'/'.join(f'{t:.1f}' for t in r['us'][v]):>15s}" for v in VARIANTS)
        o = " | ".join(f"{r['o_us'][v][0]:.1f}" for v in ("base", "inline", "side"))
        lines.append(f"l2_prefetch_micro {r['batch']:3d} {r['context']:5d} {r['floor_us'] or 0:9.1f}  {cells}  {o}")
    return lines


__all__ = ["l2_prefetch_micro", "table_lines"]
