"""GPU benchmark and checks against the H200's limits (not a test; results JSON + a table).

    python -m bench.gpu ceilings correctness decode prefill [--out bench/results/gpu_h200.json]
    python -m bench.gpu transfer pd --out ...          (two GPUs: KV transfer GPU0 -> GPU1, P/D)

Sections (each adds one key to the JSON; each is a module, see its docstring):
  ceilings      bench/gpu_ceilings.py: device-to-device copy bandwidth and the bf16 GEMM rate, the
                two ceilings every floor below divides by
  correctness   bench/gpu_correctness.py: our model vs transformers with the same random weights;
                flashinfer vs torch attention
  decode        bench/gpu_decode.py: 8B dummy weights, batch x context grid of step times vs the
                floor (weight bytes + KV bytes read) / copy bandwidth
  prefill       bench/gpu_prefill.py: one long prompt, whole and chunked, vs the floor FLOPs / GEMM rate
  prefill_attn  bench/gpu_prefill_attn.py: a whole prompt's causal attention alone, per kernel family
                (flashinfer FA3 / FA2 / cuDNN, torch SDPA cuDNN / FlashAttention-2)
  gate_up_micro bench/gpu_gate_up.py: the MLP's gate/up GEMM + SiLU·mul at prefill sizes, cuBLAS +
                flashinfer against the fused Triton kernel (engine/gate_up_silu.py) per tile
  prefill_parts bench/gpu_prefill_parts.py: the 8k pass's idle gaps, the fused RoPE + K/V store and
                strided ragged attention alone, the pass with the fused store on and off
  profile       bench/gpu_profile.py: GPU time of an eager decode step by kernel
  graph_profile bench/gpu_profile.py: kernels and idle time of CUDA-graph decode replays
  host_profile  bench/gpu_profile.py: host time of a graph decode step by function
  attn_micro    bench/gpu_attention.py: flashinfer paged decode attention alone
  small_gemm    bench/gpu_small_gemm.py: the decode step's GEMMs alone at M = 1..128, cuBLAS vs cuBLASLt
                vs tinygemm (M <= 8, with and without programmatic dependent launch)
  xqa_micro     bench/gpu_xqa.py: a step's decode attention, flashinfer's graph-mode wrapper vs xqa
  split_kv_micro bench/gpu_split_kv.py: the same against engine/attention/split_kv_decode.py per
                launch shape
  split_kv_factors bench/gpu_split_kv_factors.py: that kernel on the engine's inputs, one factor
                changed at a time (which input difference slows it in the graph against the micro)
  transfer, pd  bench/gpu_transfer.py: KV transfer GPU0 -> GPU1 and P/D on two GPUs

Floors are written before the run into bench/results/GPU_NOTES.md; this prints measured / floor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.gpu_attention import attn_micro
from bench.gpu_ceilings import ceilings, floor_ceilings
from bench.gpu_correctness import backend_vs_torch, correctness, model_vs_transformers
from bench.gpu_decode import decode
from bench.gpu_gate_up import gate_up_micro
from bench.gpu_prefill import prefill
from bench.gpu_prefill_attn import prefill_attn
from bench.gpu_prefill_parts import prefill_parts
from bench.gpu_profile import graph_profile, host_profile, parse_cases, profile
from bench.gpu_small_gemm import small_gemm
from bench.gpu_split_kv import split_kv_micro
from bench.gpu_split_kv_factors import split_kv_factors
from bench.gpu_xqa import xqa_micro

__all__ = ["backend_vs_torch", "main", "model_vs_transformers", "table"]

SECTIONS = {"ceilings": ceilings, "correctness": correctness, "decode": decode, "prefill": prefill,
            "prefill_parts": prefill_parts, "prefill_attn": prefill_attn, "profile": profile,
            "graph_profile": graph_profile, "host_profile": host_profile, "attn_micro": attn_micro, "small_gemm": small_gemm,
            "xqa_micro": xqa_micro, "gate_up_micro": gate_up_micro, "split_kv_micro": split_kv_micro,
            "split_kv_factors": split_kv_factors}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sections", nargs="+",
                   choices=[*SECTIONS, "transfer", "pd"])
    p.add_argument("--out", default="bench/results/gpu_h200.json")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="1024,4096")
    p.add_argument("--eager-batches", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--iters-prefill", type=int, default=5)
    p.add_argument("--prefill-tokens", type=int, default=8192)
    p.add_argument("--prefill-backends", default="fa2,fa3",
                   help="kernels of the paged prefill wrapper to time besides the default (comma list)")
    p.add_argument("--attn-candidates", default="",
                   help="prefill_attn's kernels (comma list; default all, see bench/gpu_prefill_attn.py)")
    p.add_argument("--ref-layers", type=int, default=4, help="layers of the shapes compared with transformers")
    p.add_argument("--transfer-reps", type=int, default=5)
    p.add_argument("--transfer-busy-poll", action="store_true",
                   help="the sending engine polls without sleeping while a batch is in flight")
    p.add_argument("--pd-tokens", type=int, default=24, help="tokens generated per P/D request")
    p.add_argument("--transports", default=None, help="UCX_TLS for the transfer engines (default: UCX's choice)")
    p.add_argument("--copy-bw", type=float, default=None, help="B/s for the floors (default: the GPU model's nominal, bench.gpu_ceilings.NOMINAL)")
    p.add_argument("--kv-layout", default=None, choices=("page_major", "layer_major"),
                   help="KV layout: the engine pool's (decode, profiles; default the engine's, page_major) "
                        "and split_kv_micro's (default layer_major)")
    p.add_argument("--profile-cases", default="1x1024,32x1024", type=parse_cases,
                   help="graph_profile's BxCONTEXT cases (comma list)")
    p.add_argument("--micro-cases", default=None, type=parse_cases,
                   help="BxCONTEXT cases (comma list) of split_kv_micro (default its 16) and "
                        "split_kv_factors (default 64x1024,64x4096)")
    p.add_argument("--micro-grid", default="small", choices=("small", "wide"),
                   help="split_kv_micro's launch shapes: its 12-shape grid or the 44-shape WIDE_GRID")
    p.add_argument("--gemm-rate", type=float, default=None, help="FLOP/s for the floors (default: the GPU model's nominal, bench.gpu_ceilings.NOMINAL)")
    args = p.parse_args(argv)
    res = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            res = json.load(f)
    res.setdefault("meta", {})["torch"] = torch.__version__
    for sec in args.sections:
        t = time.perf_counter()
        if sec in ("transfer", "pd"):
            from bench import gpu_transfer

            res[sec] = getattr(gpu_transfer, sec)(args)
        else:
            if sec in ("decode", "prefill", "prefill_parts", "prefill_attn", "gate_up_micro", "split_kv_micro"):
                c = res.get("ceilings", {})
                args.copy_bw, args.gemm_rate = floor_ceilings(args.copy_bw, args.gemm_rate, c)
                res.setdefault("meta", {})["floors_use"] = {"copy_bw_Bps": args.copy_bw, "gemm_flops": args.gemm_rate,
                                                            "measured_this_run": c}
            try:
                res[sec] = SECTIONS[sec](args)
            except Exception as e:  # keep the other sections' results
                import traceback

                traceback.print_exc()
                res[sec] = {"error": repr(e)}
        res[sec + "_wall_s"] = time.perf_counter() - t
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))
    return 0


def table(res: dict) -> str:
    lines = []
    c = res.get("ceilings")
    if c and "copy_bw_Bps" in c:
        lines.append(f"ceilings: copy {c['copy_bw_Bps'] / 1e12:.2f} TB/s, bf16 GEMM {c['gemm_flops'] / 1e12:.0f} TFLOP/s")
    d = res.get("decode")
    if d and "rows" in d:
        lines.append("decode  B   ctx   graph_ms replay_ms step_ms host_ms pipe_ms floor_ms  floor/replay"
                     "  floor/step  floor/pipe  eager_ms")
        for r in d["rows"]:
            lines.append(f"      {r['batch']:4d} {r['context']:5d} {r['graph_ms']:9.3f} {r['replay_ms']:9.3f} "
                         f"{r['step_ms']:7.3f} {r.get('host_ms', float('nan')):7.3f} "
                         f"{r.get('pipelined_ms', float('nan')):7.3f} {r['floor_ms']:8.3f} "
                         f"{r['frac_of_floor_replay']:12.1%} {r['frac_of_floor_step']:11.1%} "
                         f"{r.get('frac_of_floor_pipelined', float('nan')):11.1%}  {r.get('eager_ms', float('nan')):8.3f}")
    pf = res.get("prefill")
    if pf and "ms" in pf:
        lines.append(f"prefill {pf['tokens']} tok: {pf['ms']:.1f} ms, floor {pf['floor_ms']:.1f} ms "
                     f"({pf['frac_of_floor']:.1%}, {pf['achieved_TFLOPs']:.0f} TFLOP/s); 4 chunks "
                     f"{pf['chunked_4x_ms']:.1f} ms ({pf['chunked_frac_of_floor']:.1%})")
        for pb, modes in pf.get("by_prefill_backend", {}).items():
            for mode, r in modes.items():
                if "ms" in r:
                    lines.append(f"  paged kernels {pb:4s} extend {mode:6s}: whole {r['ms']:.1f} ms "
                                 f"({pf['floor_ms'] / r['ms']:.1%}), 4 chunks {r['chunked_4x_ms']:.1f} ms "
                                 f"({pf['floor_ms'] / r['chunked_4x_ms']:.1%})")
                else:
                    lines.append(f"  paged kernels {pb:4s} extend {mode:6s}: {r.get('error')}")
    pa = res.get("prefill_attn")
    if pa and "rows" in pa:
        lines.append("prefill_attn  kernel       tokens  us/layer (2 runs)   TFLOP/s  of floor  max|diff| vs fi_fa3")
        for r in pa["rows"]:
            if "error" in r:
                lines.append(f"              {r['name']:12s} {r['tokens']:6d}  {r['error'][:90]}")
            else:
                lines.append(f"              {r['name']:12s} {r['tokens']:6d}  {r['us_per_layer'][0]:8.1f} {r['us_per_layer'][1]:8.1f}"
                             f"  {r['TFLOPs'][0]:8.0f}  {r['frac_of_floor'][0]:7.1%}  {r['max_abs_diff_vs_fi_fa3']}")
    sk = res.get("split_kv_micro")
    if sk and "rows" in sk:
        lines.append("split_kv_micro  B   ctx  floor_us  flashinfer_us  split_kv default_us  best_us  (block_n, stages, ctas/SM, splits)")
        for r in sk["rows"]:
            d, b = r.get("default", {}), r.get("best", {})
            lines.append(f"              {r['batch']:4d} {r['context']:5d} {r['floor_us']:8.2f} {r.get('flashinfer_us', float('nan')):13.2f}"
                         f" {d.get('us', float('nan')):19.2f} {b.get('us', float('nan')):8.2f}  ({b.get('block_n')}, "
                         f"{b.get('stages')}, {b.get('ctas_per_sm')}, {b.get('splits')})")
    gu = res.get("gate_up_micro")
    if gu and "rows" in gu:
        lines.append("gate_up_micro  kernel               tile                     tokens  ms (2 runs)      of floor  rel diff")
        for r in gu["rows"]:
            tile = ",".join(map(str, r.get("tile", []))) or "-"
            if "error" in r:
                lines.append(f"               {r['name']:20s} {tile:24s} {r['tokens']:6d}  {r['error'][:80]}")
            else:
                lines.append(f"               {r['name']:20s} {tile:24s} {r['tokens']:6d}  {r['ms'][0]:7.3f} {r['ms'][1]:7.3f}"
                             f"  {r['frac_of_floor']:7.1%}  {r['rel_max_diff']}")
    cr = res.get("correctness")
    if cr and "backend_vs_torch" in cr:
        lines.append(f"flashinfer vs torch: {cr['backend_vs_torch']}")
        for r in cr.get("model_vs_transformers", []):
            errs = {k: round(v, 6) for k, v in r.items() if k.startswith(("rel_err", "hf_"))}
            lines.append(f"  {r['shape']} x{r['layers']} {r['dtype']} {r['backend']} graph={r['cuda_graph']}: {errs}")
    for key in ("transfer", "pd"):
        if key in res:
            lines.append(f"{key}: {json.dumps(res[key])[:1500]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
